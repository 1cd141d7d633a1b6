"""One forward and one backward call of the default kernels, between profiler start and stop, for Nsight Compute:

    ncu --profile-from-start off --section SpeedOfLight --section Occupancy --section WarpStateStats \\
        --section ComputeWorkloadAnalysis --section InstructionStats --section LaunchStats \\
        python scripts/ncu_profile.py [seqlen] [head_dim] [tc | 3xtf32]

Workload as in the benchmark (batch = 16384 / seqlen, heads = 2048 / head_dim, float32, non-causal); each kernel
is compiled and run once before the profiled calls. With ``tc``: the tensor-core forward and backward on float16
instead; with ``3xtf32``: the float32 forward on tensor cores (it has no backward); with ``fa2``: torch's
FlashAttention-2 (SDPA's flash backend) forward and backward on the same float16 inputs, for comparison.
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
if mode == "fa2":
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    tq, tk, tv, tdo = (torch.as_tensor(x.astype(np.float16), device="cuda").transpose(1, 2) for x in (q, k, v, dout))
    tq, tk, tv = (x.detach().requires_grad_() for x in (tq, tk, tv))
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        for profiled in (False, True):
            if profiled:
                torch.cuda.synchronize()
                cupy.cuda.profiler.start()
            o = torch.nn.functional.scaled_dot_product_attention(tq, tk, tv)
            o.backward(tdo)
            torch.cuda.synchronize()
    cupy.cuda.profiler.stop()
    print(f"profiled torch's flash backend (FlashAttention-2) forward and backward, float16, seqlen {n}, head_dim {d}")
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
