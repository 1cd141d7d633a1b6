"""Run the forward and backward kernels on a few awkward shapes, for compute-sanitizer:

    compute-sanitizer --tool memcheck python scripts/sanitize.py
    compute-sanitizer --tool racecheck python scripts/sanitize.py
"""

import os

import numpy as np
import cupy

import flashnumba

rng = np.random.default_rng(0)
cases = [  # (batch, seqlen_q, seqlen_k, nheads, head_dim, causal, forward kwargs, backward kwargs)
    (1, 77, 77, 2, 64, False, {}, {}),
    (1, 77, 77, 2, 64, True, {}, {}),
    (2, 33, 97, 1, 59, True, {}, dict(block_m=16, block_n=32)),
    (1, 100, 17, 2, 40, True, dict(block_m=32, block_n=16, num_threads=64), {}),
    (1, 65, 129, 1, 128, False, {}, {}),
    (1, 70, 70, 1, 256, True, {}, {}),
    (1, 77, 91, 2, 64, True, dict(kernel="v1"), dict(block_m=32, block_n=16)),
    (1, 50, 30, 1, 96, False, dict(kernel="v1"), {}),
    (1, 77, 91, 2, 64, True, dict(kernel="v2"), {}),
    (2, 33, 97, 1, 59, False, dict(kernel="v2", block_m=32, block_n=16, num_threads=64), {}),
]
if os.environ.get("SANITIZE_CASES") == "defaults":  # the default kernels only, three awkward shapes
    cases = [(2, 33, 97, 1, 59, True, {}, {}), (1, 77, 70, 2, 128, False, {}, {}), (1, 70, 81, 1, 256, True, {}, {})]
for b, sq, sk, h, d, causal, fkw, bkw in cases:
    q, k, v = (cupy.asarray(rng.standard_normal((b, s, h, d), dtype=np.float32)) for s in (sq, sk, sk))
    dout = cupy.asarray(rng.standard_normal((b, sq, h, d), dtype=np.float32))
    out, lse = flashnumba.flash_attn_forward(q, k, v, causal=causal, **fkw)
    dq, dk, dv = flashnumba.flash_attn_backward(dout, q, k, v, out, lse, causal=causal, **bkw)
    cupy.cuda.Device().synchronize()
    hq, hk, hv, hdo = (x.get() for x in (q, k, v, dout))
    ref, _ = flashnumba.reference.attention_forward(hq, hk, hv, causal=causal)
    grads = flashnumba.reference.attention_backward(hdo, hq, hk, hv, causal=causal)
    errs = [float(np.abs(x.get() - r).max()) for x, r in zip((out, dq, dk, dv), (ref, *grads))]
    print(b, sq, sk, h, d, causal, fkw, bkw, "max err out/dq/dk/dv", " ".join(f"{e:.1e}" for e in errs))
