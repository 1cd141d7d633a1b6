"""The Hopper backward (kernel="wgmma") on a few awkward shapes, for compute-sanitizer (memcheck, racecheck,
synccheck):

    compute-sanitizer --tool racecheck python scripts/sanitize_wgmma_backward.py

sequences not a multiple of the tiles, causal and a window, float16 and bfloat16, one and two warpgroups, GQA,
the dK/dV kernel's query tiles of 32 (ALiBi and dropout at head_dim 128), key tiles that no query sees, the
defaults at head_dim 128 and 64 (causal), the tensor-map copies of two warpgroups and a producer at head_dim 32,
64, 96, 128 and 256, head dims split between the dK/dV kernel's warpgroups (160, 256), varlen with an empty
sequence; each gradient's largest error against the float64 reference is printed.
"""

import ml_dtypes
import numpy as np

import flashnumba
from flashnumba import reference

rng = np.random.default_rng(0)
cases = [  # (batch, seqlen_q, seqlen_k, nheads, nheads_k, head_dim, dtype, tiles, options)
    (1, 77, 91, 2, 2, 64, np.float16, None, dict(causal=True)),
    (1, 200, 133, 4, 2, 128, ml_dtypes.bfloat16, (64, 64), dict(window_size=(40, 7))),
    (1, 90, 150, 2, 1, 128, np.float16, None, dict(causal=True, alibi_slopes=np.array([0.2, 0.5], np.float32))),
    # key tiles that no query sees (the dK/dV kernel's early return with zeros), a right bound and softcap
    (1, 40, 300, 2, 2, 128, np.float16, None, dict(window_size=(5, 3), softcap=8.0)),
    # the defaults at head_dim 128 (the dK/dV kernel's query tiles of 32 with the producer) and 64 causal (the dQ
    # kernel's key tiles of 128 with the producer)
    (1, 130, 200, 2, 2, 128, np.float16, None, {}),
    (2, 300, 300, 2, 1, 64, np.float16, None, dict(causal=True)),
    # the tensor-map copies at head_dim 96 (the 64-byte swizzle), GQA, a window
    (2, 150, 211, 4, 2, 96, ml_dtypes.bfloat16, None, dict(window_size=(60, 10))),
    # head_dim 32 (one 64-byte swizzled box a row), causal, GQA
    (1, 140, 300, 2, 1, 32, np.float16, None, dict(causal=True)),
    # above head_dim 128: the dK/dV kernel's two warpgroups on 64 keys, each half of the head dims (tensor maps at
    # 256, per-thread copies at 160), the dQ kernel's key tiles of 32 at 256
    (1, 130, 170, 2, 1, 256, ml_dtypes.bfloat16, None, dict(causal=True)),
    (1, 100, 140, 2, 2, 160, np.float16, None, dict(window_size=(30, 0))),
]
for b, sq, sk, h, hk, d, dtype, tiles, opts in cases:
    q = rng.standard_normal((b, sq, h, d)).astype(dtype)
    k, v = (rng.standard_normal((b, sk, hk, d)).astype(dtype) for _ in range(2))
    dout = rng.standard_normal((b, sq, h, d)).astype(dtype)
    out, lse = flashnumba.flash_attn_forward(q, k, v, **opts)
    blocks = {} if tiles is None else dict(block_m=tiles[0], block_n=tiles[1])
    grads = flashnumba.flash_attn_backward(dout, q, k, v, out, lse, kernel="wgmma", **blocks, **opts)[:3]
    truth = reference.attention_backward(*(x.astype(np.float64) for x in (dout, q, k, v)), **opts)
    errors = ", ".join(f"{n} {float(np.abs(g.astype(np.float64) - t).max()):.2e}"
                       for n, g, t in zip(("dq", "dk", "dv"), grads, truth))
    print(f"wgmma backward b={b} sq={sq} sk={sk} h={h}/{hk} d={d} {np.dtype(dtype).name} tiles={tiles} {opts}: "
          f"max error {errors}")
lens_q, lens_k = [5, 0, 70], [9, 3, 166]
cu_q, cu_k = (np.concatenate([[0], np.cumsum(n)]).astype(np.int32) for n in (lens_q, lens_k))
q = rng.standard_normal((cu_q[-1], 2, 64)).astype(np.float16)
k, v = (rng.standard_normal((cu_k[-1], 2, 64)).astype(np.float16) for _ in range(2))
dout = rng.standard_normal(q.shape).astype(np.float16)
out, lse = flashnumba.flash_attn_varlen_forward(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=True)
grads = flashnumba.flash_attn_varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, max(lens_q), max(lens_k),
                                              causal=True, kernel="wgmma")[:3]
print(f"wgmma backward varlen {lens_q} x {lens_k}: finite "
      f"{all(bool(np.isfinite(g.astype(np.float32)).all()) for g in grads)}")
