"""The Hopper forward (kernel="wgmma") on a few awkward shapes, for compute-sanitizer (memcheck, racecheck,
synccheck):

    compute-sanitizer --tool racecheck python scripts/sanitize_wgmma.py [half] [3xtf32]

sequences not a multiple of the tiles, causal on and off, float16 and bfloat16, one and two warpgroups, B_c 32, 48,
64 and 128, GQA with a window, varlen with an empty sequence; the cases of two warpgroups and the producer warpgroup
(the default threads) copy with tensor maps (head_dim 32, 64, 96, 128, 160 and 256, GQA with a window too), the
ones of one warpgroup (head_dim 128 and 224) and varlen per thread; then the float32 3xTF32 forward on wgmma
(``config.hopper_3xtf32``), one and two warpgroups, and its backward. Each result's largest error against the
float64 reference is printed. Naming a part (``half``: float16 and bfloat16; ``3xtf32``) runs that part alone.
"""

import sys

import ml_dtypes
import numpy as np

import flashnumba

rng = np.random.default_rng(0)
parts = sys.argv[1:] or ["half", "3xtf32"]
cases = [  # (batch, seqlen_q, seqlen_k, nheads, nheads_k, head_dim, causal, dtype, block_m, block_n, window)
    (1, 77, 91, 2, 2, 64, True, np.float16, None, None, None),
    (2, 65, 40, 1, 1, 128, False, np.float16, None, None, None),
    (1, 200, 333, 4, 2, 128, True, ml_dtypes.bfloat16, 64, 64, None),
    (1, 130, 270, 2, 1, 96, False, np.float16, 128, 64, (40, 7)),
    (1, 300, 129, 1, 1, 128, True, np.float16, 128, 128, None),
    (2, 150, 260, 4, 1, 64, False, ml_dtypes.bfloat16, None, None, (60, 20)),  # tensor maps with GQA and a window
    (1, 140, 300, 2, 1, 32, True, np.float16, None, None, None),  # head_dim 32: one 64-byte swizzled box a row
    (1, 150, 230, 2, 1, 160, True, np.float16, None, None, None),  # head_dim 160: five 64-byte boxes, B_c 64
    (1, 170, 140, 2, 2, 256, False, ml_dtypes.bfloat16, None, None, (50, 10)),  # head_dim 256: B_c 32
    (1, 190, 250, 2, 1, 256, True, np.float16, 128, 48, None),  # head_dim 256, key tiles of 48: six-atom boxes
    (1, 100, 120, 1, 1, 224, True, np.float16, 64, 32, None),  # one warpgroup, per-thread copies at 224
]
for b, sq, sk, h, hk, d, causal, dtype, bm, bn, window in cases if "half" in parts else ():
    q = rng.standard_normal((b, sq, h, d)).astype(dtype)
    k, v = (rng.standard_normal((b, sk, hk, d)).astype(dtype) for _ in range(2))
    opts = dict(causal=causal) | (dict(window_size=window) if window else {})
    out, lse = flashnumba.flash_attn_forward(q, k, v, kernel="wgmma", block_m=bm, block_n=bn, **opts)
    ref, _ = flashnumba.reference.attention_forward(*(x.astype(np.float32) for x in (q, k, v)), **opts)  # (GQA too)
    print(f"wgmma b={b} sq={sq} sk={sk} h={h}/{hk} d={d} causal={causal} {np.dtype(dtype).name} tiles=({bm}, {bn}) "
          f"window={window}: max error {float(np.abs(out.astype(np.float64) - ref).max()):.2e}")
lens_q, lens_k = [5, 0, 70], [9, 3, 166]
if "half" in parts:  # varlen with an empty sequence
    cu_q, cu_k = (np.concatenate([[0], np.cumsum(n)]).astype(np.int32) for n in (lens_q, lens_k))
    q = rng.standard_normal((cu_q[-1], 2, 64)).astype(np.float16)
    k, v = (rng.standard_normal((cu_k[-1], 2, 64)).astype(np.float16) for _ in range(2))
    out, lse = flashnumba.flash_attn_varlen_forward(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=True,
                                                    kernel="wgmma")
    print(f"wgmma varlen {lens_q} x {lens_k}: finite {bool(np.isfinite(out.astype(np.float32)).all())}")

# The 3xTF32 forward on wgmma (float32; config.hopper_3xtf32): its cp.async copies of the next tile beside the split
# of this one, one warpgroup and two
tf32_cases = ((77, 91, 64, True, 64, 16), (150, 70, 128, False, 128, 16), (130, 200, 64, True, 128, 32),
              (65, 40, 128, True, 64, 32))
for sq, sk, d, causal, bm, bn in tf32_cases if "3xtf32" in parts else ():
    q, k, v = (rng.standard_normal((1, s, 2, d)).astype(np.float32) for s in (sq, sk, sk))
    with flashnumba.config.temporarily("hopper_3xtf32", "per_step"):
        out, lse = flashnumba.flash_attn_forward(q, k, v, causal=causal, precision="3xtf32", block_m=bm, block_n=bn)
    ref, _ = flashnumba.reference.attention_forward(q, k, v, causal=causal)
    print(f"3xtf32 wgmma sq={sq} sk={sk} d={d} causal={causal} tiles=({bm}, {bn}): max error "
          f"{float(np.abs(out - ref).max()):.2e}")

# its backward (both kernels: the dQ kernel's and the dK/dV kernel's next loop tile copied beside the split of this one)
backward_cases = ((77, 91, 64, True, 16), (150, 70, 64, False, 32), (65, 140, 128, True, 16))
for sq, sk, d, causal, loop in backward_cases if "3xtf32" in parts else ():
    q, k, v, dout = (rng.standard_normal((1, s, 2, d)).astype(np.float32) for s in (sq, sk, sk, sq))
    out, lse = flashnumba.flash_attn_forward(q, k, v, causal=causal)
    with flashnumba.config.temporarily("hopper_3xtf32", "per_step"):
        grads = flashnumba.flash_attn_backward(dout, q, k, v, out, lse, causal=causal, precision="3xtf32",
                                               block_m=loop, block_n=loop)
    truth = flashnumba.reference.attention_backward(dout, q, k, v, causal=causal)
    print(f"3xtf32 wgmma backward sq={sq} sk={sk} d={d} causal={causal} loop tiles {loop}: max error "
          + ", ".join(f"{float(np.abs(np.asarray(g) - t).max()):.2e}" for g, t in zip(grads, truth)))
