"""One forward and one backward call of the default kernels, between profiler start and stop, for Nsight Compute:

    ncu --profile-from-start off --section SpeedOfLight --section Occupancy --section WarpStateStats \\
        --section ComputeWorkloadAnalysis --section InstructionStats --section LaunchStats \\
        python scripts/ncu_profile.py [seqlen] [head_dim] [tc | 3xtf32]

Workload as in the benchmark (batch = 16384 / seqlen, heads = 2048 / head_dim, float32, non-causal); each kernel
is compiled and run once before the profiled calls. With ``tc``: the tensor-core forward and backward on float16
instead; with ``3xtf32``: the float32 forward on tensor cores (it has no backward).
"""

import sys

import cupy
import numpy as np

import flashnumba

n = int(sys.argv[1]) if len(sys.argv) > 1 else 2048
d = int(sys.argv[2]) if len(sys.argv) > 2 else 64
mode = sys.argv[3] if len(sys.argv) > 3 else "simt"
rng = np.random.default_rng(0)
q, k, v, dout = (cupy.asarray(rng.standard_normal((16384 // n, n, 2048 // d, d), dtype=np.float32)) for _ in range(4))
if mode == "3xtf32":
    flashnumba.flash_attn_forward(q, k, v, kernel="3xtf32")
    cupy.cuda.Device().synchronize()
    cupy.cuda.profiler.start()
    flashnumba.flash_attn_forward(q, k, v, kernel="3xtf32")
    cupy.cuda.Device().synchronize()
    cupy.cuda.profiler.stop()
    print(f"profiled the 3xTF32 forward, float32, seqlen {n}, head_dim {d}")
    sys.exit()
if mode == "tc":
    q, k, v, dout = (x.astype(np.float16) for x in (q, k, v, dout))
    out, lse = flashnumba.flash_attn_forward(q, k, v, kernel="tc")
    flashnumba.flash_attn_backward(dout, q, k, v, out, lse, kernel="tc")
    cupy.cuda.Device().synchronize()
    cupy.cuda.profiler.start()
    flashnumba.flash_attn_forward(q, k, v, kernel="tc")
    flashnumba.flash_attn_backward(dout, q, k, v, out, lse, kernel="tc")
    cupy.cuda.Device().synchronize()
    cupy.cuda.profiler.stop()
    print(f"profiled the tensor-core forward and backward, float16, seqlen {n}, head_dim {d}")
    sys.exit()
out, lse = flashnumba.flash_attn_forward(q, k, v)
flashnumba.flash_attn_backward(dout, q, k, v, out, lse)
cupy.cuda.Device().synchronize()
cupy.cuda.profiler.start()
flashnumba.flash_attn_forward(q, k, v)
flashnumba.flash_attn_backward(dout, q, k, v, out, lse)
cupy.cuda.Device().synchronize()
cupy.cuda.profiler.stop()
print(f"profiled forward and backward, seqlen {n}, head_dim {d}, plans:\n{flashnumba.plan(q, k, v)}\n"
      f"{flashnumba.plan_backward(dout, q, k, v, out, lse)}")
