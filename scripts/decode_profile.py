"""Where a decoding step's time goes: the host (Python) side under cProfile, or the kernels under Nsight Compute.

    python scripts/decode_profile.py host [batch] [seqlen_k] [page]   # cProfile of 2000 calls, checked, unchecked
    ncu --profile-from-start off --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy \\
        --section WarpStateStats --section LaunchStats \\
        python scripts/decode_profile.py ncu [batch] [seqlen_k] [page]  # flashnumba's kernels, then cuDNN's
    python scripts/decode_profile.py stages [batch] [seqlen_k] [page]  # the kernel with 2 and 3 K, V buffers

Workload as in ``python -m flashnumba bench --decode``: float16, head_dim 128, 32 query heads on 8 key/value
heads, one query token per sequence, every sequence holding seqlen_k keys (defaults: batch 32, seqlen_k 8192);
with ``page``, flashnumba reads the same keys from a paged cache of that page size (the pages shuffled).
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
page = int(sys.argv[4]) if len(sys.argv) > 4 else 0
table = None
if page:  # sequence b's page i is page table[b, i] of the pool: the same keys, in shuffled pages
    per = n // page
    table = cupy.asarray(rng.permutation(batch * per).astype(np.int32).reshape(batch, per))
    pool_k, pool_v = (cupy.empty((batch * per, page, 8, 128), np.float16) for _ in range(2))
    pool_k[table.reshape(-1)] = kc.reshape(batch * per, page, 8, 128)
    pool_v[table.reshape(-1)] = vc.reshape(batch * per, page, 8, 128)


def step():
    if page:
        return flashnumba.flash_attn_with_kvcache(q, pool_k, pool_v, cache_seqlens=lens, block_table=table)
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
          f"seqlen_k {n}, page size {page or 'none (contiguous)'}")
elif mode == "stages":  # the kernel's K, V buffers (the plan's ``stages``): each count timed, calls back to back
    from flashnumba import _launch, _validate, planner

    kk, vv = (pool_k, pool_v) if page else (kc, vc)
    arrays = (q, kk, vv, lens, None if page else cupy.arange(batch, dtype=np.int32), table, None)
    names = ("q", "k_cache", "v_cache", "seqlens_k", "batch_idx", "block_table")
    t = [None if x is None else _validate.inspect(nm, x, x.ndim) for nm, x in zip(names, arrays)]
    opts = _validate.check_options(t[0], t[1], False, (-1, -1), 0.0, None, 0.0, None)
    nbytes = 2 * kc.nbytes
    for stages in (2, 3):
        p = planner.decode_plan(*t[:3], opts, seqlens=t[3], batch_idx=t[4], block_table=t[5], max_seqlen_k=n,
                                return_lse=False, stages=stages)
        call = _launch.Call(p)
        for _ in range(20):
            call.run(arrays)
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        start.record()
        for _ in range(200):
            call.run(arrays)
        end.record()
        end.synchronize()
        ms = cupy.cuda.get_elapsed_time(start, end) / 200
        print(f"stages {stages}: {ms:.4f} ms, {nbytes / ms / 1e9:.2f} TB/s; {p.launches[0].grid} grid, "
              f"{p.launches[0].shared_bytes} B shared ({p.launches[0].reason})")
else:
    raise SystemExit(f"mode must be host, ncu or stages, got {mode!r}")
