"""The tensor-core forward (kernel="tc") on a few awkward shapes, for compute-sanitizer (scripts/sanitize.py runs
it too):

    compute-sanitizer --tool racecheck python scripts/sanitize_tc.py

seqlen not a multiple of the tiles, causal on and off, float16 and bfloat16, the default blocks and others.
"""

import cupy
import ml_dtypes
import numpy as np

import flashnumba

rng = np.random.default_rng(0)
cases = [  # (batch, seqlen_q, seqlen_k, nheads, head_dim, causal, dtype, block_m, block_n)
    (1, 77, 91, 2, 64, True, np.float16, None, None),
    (2, 65, 40, 1, 128, False, np.float16, None, None),
    (1, 50, 129, 1, 64, False, np.float16, None, None),
    (1, 200, 333, 1, 128, True, ml_dtypes.bfloat16, None, None),
    (1, 130, 70, 2, 64, True, np.float16, 128, 32),
    (1, 33, 100, 1, 128, False, ml_dtypes.bfloat16, 16, 16),
]
for b, sq, sk, h, d, causal, dtype, bm, bn in cases:
    hq, hk, hv = (rng.standard_normal((b, s, h, d)).astype(dtype) for s in (sq, sk, sk))
    out, lse = flashnumba.flash_attn_forward(hq, hk, hv, causal=causal, kernel="tc", block_m=bm, block_n=bn)
    cupy.cuda.Device().synchronize()
    ref, _ = flashnumba.reference.attention_forward(*(x.astype(np.float32) for x in (hq, hk, hv)), causal=causal)
    err = float(np.abs(out.astype(np.float64) - ref).max())
    print("tc", b, sq, sk, h, d, causal, np.dtype(dtype).name, bm, bn, f"max err out {err:.1e}")
