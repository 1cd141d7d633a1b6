"""One call of the Hopper forward and one of the mma.sync forward (d 128, seqlen 4096, batch 4, 16 heads, float16)
between profiler start and stop, for Nsight Compute (--profile-from-start off)."""
import cupy
import numpy as np

import flashnumba

rng = np.random.default_rng(0)
q, k, v = (cupy.asarray(rng.standard_normal((4, 4096, 16, 128), np.float32).astype(np.float16)) for _ in range(3))
for kernel in ("wgmma", "tc"):
    flashnumba.flash_attn_forward(q, k, v, kernel=kernel)
cupy.cuda.Device().synchronize()
cupy.cuda.profiler.start()
for kernel in ("wgmma", "tc"):
    flashnumba.flash_attn_forward(q, k, v, kernel=kernel)
cupy.cuda.Device().synchronize()
cupy.cuda.profiler.stop()
