"""One call each of Hopper forward configurations (and of the mma.sync forward) between profiler start and stop,
for Nsight Compute (--profile-from-start off): d 128, seqlen 4096, batch 4, 16 heads, float16.
Arguments: block_m:block_n:num_threads of the wgmma configurations (default: the planner's), e.g. 128:64:288."""
import sys

import cupy
import numpy as np

import flashnumba

rng = np.random.default_rng(0)
q, k, v = (cupy.asarray(rng.standard_normal((4, 4096, 16, 128), np.float32).astype(np.float16)) for _ in range(3))
configs = [dict(kernel="wgmma", **dict(zip(("block_m", "block_n", "num_threads"), map(int, a.split(":")))))
           for a in sys.argv[1:]] or [dict(kernel="wgmma")]
configs.append(dict(kernel="tc"))
for c in configs:
    flashnumba.flash_attn_forward(q, k, v, **c)
cupy.cuda.Device().synchronize()
cupy.cuda.profiler.start()
for c in configs:
    flashnumba.flash_attn_forward(q, k, v, **c)
cupy.cuda.Device().synchronize()
cupy.cuda.profiler.stop()
