"""One call each of Hopper forward configurations (and of the mma.sync forward) between profiler start and stop,
for Nsight Compute (--profile-from-start off): d 128, seqlen 4096, batch 4, 16 heads, float16.
Arguments: block_m:block_n:num_threads of the wgmma configurations (default: the planner's), e.g. 128:64:288;
or ``backward`` (then the Hopper backward's kernels at the planner's tiles, and the mma.sync backward's, on the
same shape; ``backward 64`` for head_dim 64 with 32 heads), e.g.

    ncu --profile-from-start off --set full -o wgb python scripts/wgmma_ncu.py backward
"""
import sys

import cupy
import numpy as np

import flashnumba

rng = np.random.default_rng(0)
backward = sys.argv[1:2] == ["backward"]
D = int(sys.argv[2]) if backward and len(sys.argv) > 2 else 128
q, k, v, dout = (cupy.asarray(rng.standard_normal((4, 4096, 2048 // D, D), np.float32).astype(np.float16))
                 for _ in range(4))
if backward:
    out, lse = flashnumba.flash_attn_forward(q, k, v)
    configs = [dict(kernel="wgmma"), dict(kernel="tc")]

    def run(c):
        flashnumba.flash_attn_backward(dout, q, k, v, out, lse, **c)
else:
    configs = [dict(kernel="wgmma", **dict(zip(("block_m", "block_n", "num_threads"), map(int, a.split(":")))))
               for a in sys.argv[1:]] or [dict(kernel="wgmma")]
    configs.append(dict(kernel="tc"))

    def run(c):
        flashnumba.flash_attn_forward(q, k, v, **c)
for c in configs:
    run(c)
cupy.cuda.Device().synchronize()
cupy.cuda.profiler.start()
for c in configs:
    run(c)
cupy.cuda.Device().synchronize()
cupy.cuda.profiler.stop()
