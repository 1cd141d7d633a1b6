"""Run the forward kernels on a few awkward shapes, for compute-sanitizer (memcheck, racecheck, synccheck).

    compute-sanitizer --tool memcheck python scripts/sanitize_forward.py
"""

import numpy as np
import cupy

import flashnumba

rng = np.random.default_rng(0)
cases = [  # (batch, seqlen_q, seqlen_k, nheads, head_dim, causal, kernel kwargs)
    (1, 77, 77, 2, 64, False, {}),
    (1, 77, 77, 2, 64, True, {}),
    (2, 33, 97, 1, 59, True, {}),
    (1, 100, 17, 2, 40, True, dict(block_m=32, block_n=16, num_threads=64)),
    (1, 65, 129, 1, 128, False, {}),
    (1, 70, 70, 1, 256, True, {}),
    (1, 77, 91, 2, 64, True, dict(kernel="v1")),
    (1, 50, 30, 1, 96, False, dict(kernel="v1")),
]
for b, sq, sk, h, d, causal, kw in cases:
    q = cupy.asarray(rng.standard_normal((b, sq, h, d), dtype=np.float32))
    k = cupy.asarray(rng.standard_normal((b, sk, h, d), dtype=np.float32))
    v = cupy.asarray(rng.standard_normal((b, sk, h, d), dtype=np.float32))
    out, lse = flashnumba.flash_attn_forward(q, k, v, causal=causal, **kw)
    cupy.cuda.Device().synchronize()
    ref, _ = flashnumba.reference.attention_forward(q.get(), k.get(), v.get(), causal=causal)
    print(b, sq, sk, h, d, causal, kw, "max err", float(np.abs(out.get() - ref).max()))
