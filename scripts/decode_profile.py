"""Where a decoding step's time goes: the host (Python) side under cProfile, or the kernels under Nsight Compute.

    python scripts/decode_profile.py host [batch] [seqlen_k]       # cProfile of 2000 calls, checked and unchecked
    ncu --profile-from-start off --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy \\
        --section WarpStateStats --section LaunchStats \\
        python scripts/decode_profile.py ncu [batch] [seqlen_k]     # flashnumba's kernels, then cuDNN's

Workload as in ``python -m flashnumba bench --decode``: float16, head_dim 128, 32 query heads on 8 key/value
heads, one query token per sequence, every sequence holding seqlen_k keys (defaults: batch 32, seqlen_k 8192).
"""

import cProfile
import pstats
import sys

import cupy
import numpy as np

import flashnumba

mode = sys.argv[1] if len(sys.argv) > 1 else "host"
batch = int(sys.argv[2]) if len(sys.argv) > 2 else 32
n = int(sys.argv[3]) if len(sys.argv) > 3 else 8192
rng = np.random.default_rng(0)
q = cupy.asarray(rng.standard_normal((batch, 1, 32, 128), np.float32).astype(np.float16))
kc, vc = (cupy.asarray(rng.standard_normal((batch, n, 8, 128), np.float32).astype(np.float16)) for _ in range(2))
lens = cupy.full(batch, n, np.int32)


def step():
    return flashnumba.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens)


step()
cupy.cuda.Device().synchronize()
if mode == "host":
    for checked in (True, False):
        flashnumba.config.check_device_values = checked
        for _ in range(50):
            step()
        cupy.cuda.Device().synchronize()
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(2000):
            step()
        prof.disable()
        cupy.cuda.Device().synchronize()
        print(f"=== check_device_values={checked}: batch {batch}, seqlen_k {n}, 2000 calls")
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)
elif mode == "ncu":
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    tq = torch.as_tensor(q, device="cuda").transpose(1, 2)
    tk, tv = (torch.as_tensor(x, device="cuda").transpose(1, 2) for x in (kc, vc))
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, enable_gqa=True)
        torch.cuda.synchronize()
        cupy.cuda.profiler.start()
        step()
        cupy.cuda.Device().synchronize()
        torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, enable_gqa=True)
        torch.cuda.synchronize()
        cupy.cuda.profiler.stop()
    print(f"profiled flash_attn_with_kvcache (its kernels in launch order) and cuDNN's SDPA, batch {batch}, "
          f"seqlen_k {n}")
else:
    raise SystemExit(f"mode must be host or ncu, got {mode!r}")
