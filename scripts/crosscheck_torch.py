"""Cross-check flashnumba against torch's scaled_dot_product_attention on the GPU (GQA, causal with a
bottom-right mask, sliding window; no dropout), forward and backward.

    python scripts/crosscheck_torch.py

Both are compared with the float64 NumPy reference; flashnumba passes where its error is at most 3x torch's
plus a few ulps (the tolerance the test suite uses). torch's ``is_causal`` is top-left aligned, so the
bottom-right mask is passed explicitly as a boolean ``attn_mask``. Exits non-zero on a failure.
"""

import sys

import cupy
import numpy as np
import torch

import flashnumba
from flashnumba import reference

CASES = [  # (batch, seqlen_q, seqlen_k, nheads, nheads_k, head_dim, causal, window_size, dtype)
    (2, 257, 257, 8, 2, 64, True, (-1, -1), np.float16),
    (2, 200, 333, 8, 1, 128, True, (-1, -1), np.float16),
    (1, 300, 180, 6, 3, 64, True, (-1, -1), np.float32),
    (2, 256, 256, 4, 4, 64, False, (64, 0), np.float32),
    (1, 129, 257, 8, 2, 96, False, (32, 16), np.float16),
]


def sdpa(q, k, v, dout, mask, group):
    tq, tk, tv, tdo = (torch.from_numpy(x).cuda().transpose(1, 2).requires_grad_() for x in (q, k, v, dout))
    out = torch.nn.functional.scaled_dot_product_attention(
        tq, tk, tv, attn_mask=torch.from_numpy(mask).cuda(), enable_gqa=group > 1)
    out.backward(tdo.detach())
    return [x.detach().transpose(1, 2).float().cpu().numpy() for x in (out, tq.grad, tk.grad, tv.grad)]


def main():
    rng = np.random.default_rng(0)
    failures = 0
    for b, sq, sk, h, hk, d, causal, window, dtype in CASES:
        q, dout = (rng.standard_normal((b, sq, h, d)).astype(dtype) for _ in range(2))
        k, v = (rng.standard_normal((b, sk, hk, d)).astype(dtype) for _ in range(2))
        opts = dict(causal=causal, window_size=window)
        truth = (reference.attention_forward(q, k, v, **opts)[0], *reference.attention_backward(dout, q, k, v, **opts))
        mask = reference.visibility_mask(sq, sk, **opts)
        theirs = sdpa(q, k, v, dout, mask, h // hk)
        dev = [cupy.asarray(x) for x in (q, k, v, dout)]
        out, dq, dk, dv = flashnumba.attention_with_grad(dev[0], dev[1], dev[2], dev[3], **opts)
        ours = [x.get().astype(np.float32) for x in (out, dq, dk, dv)]
        for name, o, t, r in zip(("out", "dq", "dk", "dv"), ours, theirs, truth):
            # rows with no visible key: torch gives NaN (softmax of all -inf), flashnumba and the reference 0
            rows_ok = np.isfinite(t).all(axis=(-1, -2)) if name in ("out", "dq") else np.ones(t.shape[:2], bool)
            e_ours = float(np.abs(o - r)[rows_ok].max())
            e_torch = float(np.abs(t - r)[rows_ok].max())
            tol = 3 * e_torch + 4 * float(np.finfo(dtype).eps) * max(1.0, float(np.abs(r).max()))
            ok = e_ours <= tol
            failures += not ok
            print(f"{'ok  ' if ok else 'FAIL'} b={b} sq={sq} sk={sk} h={h} hk={hk} d={d} causal={causal} "
                  f"window={window} {np.dtype(dtype).name} {name}: flashnumba {e_ours:.2e}, torch {e_torch:.2e}")
    print(f"{failures} failures")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
