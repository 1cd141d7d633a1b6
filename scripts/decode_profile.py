"""Where a decoding step's time goes: the host (Python) side under cProfile, or the kernels under Nsight Compute.

    python scripts/decode_profile.py host [batch] [seqlen_k] [page]   # cProfile of 2000 calls, checked, unchecked
    ncu --profile-from-start off --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy \\
        --section WarpStateStats --section LaunchStats \\
        python scripts/decode_profile.py ncu [batch] [seqlen_k] [page]  # flashnumba's kernels, then cuDNN's
    python scripts/decode_profile.py stages [batch] [seqlen_k] [page]  # the kernel with 2 and 3 K, V buffers
    python scripts/decode_profile.py latency [batch] [seqlen_k] [page]  # host and device time of a call, with torch's
    python scripts/decode_profile.py prelaunch [batch] [seqlen_k] [page]  # host time from a call to its first launch
    python scripts/decode_profile.py breakdown [batch] [seqlen_k] [page]  # that time, part by part
    python scripts/decode_profile.py pairs [batch] [seqlen_k] [page]  # one call a pair: samples' spread, with and
                                                 # without an event recorded just before the first launch, cuDNN's
    python scripts/decode_profile.py splits [batch] [seqlen_k] [page]  # num_splits 0 (the plan's) and others, timed
    python scripts/decode_profile.py tiles [batch] [seqlen_k] [page]  # keys a warp, buffers and splits: GPU time
    python scripts/decode_profile.py deep [batch] [seqlen_k] [page]  # fewer blocks, more buffers, with torch's
                                                 # (DEEP_QUICK=1: 4 and 8 warps, the plan's split counts)

Workload as in ``python -m flashnumba bench --decode``: float16, head_dim 128, 32 query heads on 8 key/value
heads, one query token per sequence, every sequence holding seqlen_k keys (defaults: batch 32, seqlen_k 8192);
with ``page``, flashnumba reads the same keys from a paged cache of that page size (the pages shuffled).
"""

import cProfile
import os
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


def kernel_inputs():
    """(arrays, inspected, opts): the call's arrays in the decoding plan's order, as the planner takes them, for the
    modes that make their own plans."""
    from flashnumba import _validate

    kk, vv = (pool_k, pool_v) if page else (kc, vc)
    arrays = (q, kk, vv, lens, None, table, None)  # (no batch index: sequence b reads cache entry b)
    names = ("q", "k_cache", "v_cache", "seqlens_k", "batch_idx", "block_table")
    t = [None if x is None else _validate.inspect(nm, x, x.ndim) for nm, x in zip(names, arrays)]
    return arrays, t, _validate.check_options(t[0], t[1], False, (-1, -1), 0.0, None, 0.0, None)


def graph_ms(fn, calls=50, on_torch=False):
    """The GPU's time per call of ``fn`` with no host in the way: ``calls`` calls captured in a CUDA graph (CuPy's,
    or torch's with ``on_torch``), the graph replayed, host-timed; the least of 5 replays."""
    import time

    if on_torch:
        import torch

        s = torch.cuda.Stream()
        with torch.cuda.stream(s):
            fn()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(calls):
                fn()
        launch, sync = graph.replay, torch.cuda.synchronize
    else:
        stream = cupy.cuda.Stream(non_blocking=True)
        with stream:
            fn()
            stream.synchronize()
            stream.begin_capture()
            for _ in range(calls):
                fn()
            graph = stream.end_capture()
        launch = lambda: graph.launch(stream)  # noqa: E731
        sync = stream.synchronize
    launch()
    sync()
    best = []
    for _ in range(5):
        t = time.perf_counter()
        launch()
        sync()
        best.append((time.perf_counter() - t) * 1e3 / calls)
    return min(best)


def time_plans(label, t, opts, arrays, stages, splits_list):
    """The decoding plan with ``stages`` buffers (and the planner's warps and keys a warp as they are set) at each
    split count, timed from a CUDA graph, a line each; stops at a plan this GPU cannot hold."""
    from flashnumba import _launch, planner

    nbytes = 2 * kc.nbytes
    for splits in splits_list:
        try:
            p = planner.decode_plan(*t[:3], opts, seqlens=t[3], batch_idx=t[4], block_table=t[5], max_seqlen_k=n,
                                    return_lse=False, stages=stages, num_splits=splits)
        except ValueError as err:
            print(f"{label}: {err}")
            return
        call = _launch.Call(p)
        us = graph_ms(lambda: call.run(arrays)) * 1e3
        print(f"{label} num_splits {splits:2d}: {us:7.1f} us {nbytes / us / 1e6:5.2f} TB/s; grid {p.launches[0].grid}, "
              f"{p.launches[0].shared_bytes} B shared, {len(p.launches)} kernels", flush=True)


if mode == "host":
    for checked in (True, False):
        flashnumba.config.check_cache_values = checked
        for _ in range(50):
            step()
        cupy.cuda.Device().synchronize()
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(2000):
            step()
        prof.disable()
        cupy.cuda.Device().synchronize()
        print(f"=== check_cache_values={checked}: batch {batch}, seqlen_k {n}, 2000 calls")
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)
elif mode == "prelaunch":  # what one call a pair of events adds to the GPU's time: the host's time before the first
    # kernel is launched (each kernel launch wrapped to note the time it is reached)
    import time

    from flashnumba import _launch

    marks = []
    launch = _launch.Bound.__call__

    def noted(self, values, stream):
        marks.append(time.perf_counter_ns())
        return launch(self, values, stream)

    _launch.Bound.__call__ = noted
    for checked in (False, True):
        flashnumba.config.check_cache_values = checked
        first, whole = [], []
        for _ in range(2000):
            marks.clear()
            cupy.cuda.Device().synchronize()
            t = time.perf_counter_ns()
            step()
            end = time.perf_counter_ns()
            first.append((marks[0] - t) / 1e3)
            whole.append((end - t) / 1e3)
        print(f"batch {batch}, seqlen_k {n}, page {page or 'none'}, check_cache_values={checked}: host us from the "
              f"call to its first launch, median {np.median(first):.1f} (10th percentile {np.percentile(first, 10):.1f});"
              f" the whole call {np.median(whole):.1f}; {len(marks)} launches")
    # the same on the GPU's clock: one call between two events (as the bench's one-call-a-pair mode times it),
    # with a third recorded just before the first kernel's launch
    first_event = []

    def evented(self, values, stream):
        if not first_event:
            ev = cupy.cuda.Event()
            ev.record(cupy.cuda.ExternalStream(stream))
            first_event.append(ev)
        return launch(self, values, stream)

    _launch.Bound.__call__ = evented
    flashnumba.config.check_cache_values = False
    before, after = [], []
    for _ in range(200):
        first_event.clear()
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        cupy.cuda.Device().synchronize()
        start.record()
        step()
        end.record()
        end.synchronize()
        before.append(cupy.cuda.get_elapsed_time(start, first_event[0]) * 1e3)
        after.append(cupy.cuda.get_elapsed_time(first_event[0], end) * 1e3)
    print(f"one call a pair of events: start -> before the first launch {np.median(before):.1f} us, from there to "
          f"the end {np.median(after):.1f} us (medians of 200; the kernels alone from a CUDA graph: mode latency)")
    _launch.Bound.__call__ = launch
elif mode == "breakdown":  # the host time before the first launch, part by part: each part of a call timed alone
    import time

    from flashnumba import _arrays, _launch, api, decode

    def us(fn, calls=20000):
        for _ in range(200):
            fn()
        rounds = []
        for _ in range(5):
            cupy.cuda.Device().synchronize()
            t = time.perf_counter_ns()
            for _ in range(calls // 5):
                fn()
            rounds.append((time.perf_counter_ns() - t) / (calls // 5) / 1e3)
        return min(rounds)

    st = next(c for k, c in api._calls.items() if k and k[0] == "kvcache")
    call = st.call(None)
    kk, vv = (pool_k, pool_v) if page else (kc, vc)
    arrays = (q, kk, vv, lens, None, table, None, None, None, None, None)
    key_args = (q, kk, vv, None, None, lens, None, table, None, None, None)
    opts = (False, (-1, -1), 0.0, True, None, 0, None, False, None)
    values, outs, keep = call.prepare(arrays)
    stream = call._stream(q)
    bound = call.bound[0]
    parts = {
        "the whole call (no sync)": step,
        "decode._key (the plan key)": lambda: api._key("kvcache", key_args, opts),
        "  _arrays.meta_key(q)": lambda: _arrays.meta_key(q),
        "decode._ints (cache_seqlens)": lambda: decode._ints("cache_seqlens", lens, (batch,), False),
        "Call.prepare (addresses, outputs, scratch)": lambda: call.prepare(arrays),
        "  cupy.empty(out)": lambda: cupy.empty(q.shape, q.dtype),
        "  cupy.empty(scratch bytes)": lambda: cupy.empty((call.scratch_bytes,), np.uint8),
        "  x.data.ptr": lambda: q.data.ptr,
        "Call._stream": lambda: call._stream(q),
        "Bound.__call__ (one launch)": lambda: bound(values, stream),
    }
    print(f"batch {batch}, seqlen_k {n}, page {page or 'none'}: host us (best of 5 rounds; calls back to back, "
          f"so the launches queue)")
    for name, fn in parts.items():
        print(f"  {name:44s} {us(fn, 1000 if fn is step or name.startswith('Bound') else 20000):7.2f}")
        cupy.cuda.Device().synchronize()
elif mode == "pairs":  # one call a pair of events, as the bench times it, with more samples and their spread
    import time

    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from flashnumba import _launch
    from flashnumba.tools.timing import cuda_time_calls_ms

    tq = torch.as_tensor(q, device="cuda").transpose(1, 2)
    tk, tv = (torch.as_tensor(x, device="cuda").transpose(1, 2) for x in (kc, vc))

    def cudnn():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, enable_gqa=True)

    launch = _launch.Bound.__call__
    primed = []

    def evented(self, values, stream):  # an event recorded on the stream just before the call's first launch
        if not primed:
            ev = cupy.cuda.Event()
            ev.record(cupy.cuda.ExternalStream(stream))
            primed.append(ev)
        return launch(self, values, stream)

    def step_primed():
        primed.clear()
        return step()

    nbytes = 2 * kc.nbytes
    print(f"batch {batch}, seqlen_k {n}: one call a pair of events (bench's procedure, 300 samples), us; TB/s of "
          f"the median")
    for name, fn, patched in (("flashnumba", step, False), ("flashnumba, event before the launch", step_primed, True),
                              ("torch cuDNN", cudnn, False), ("flashnumba again", step, False)):
        _launch.Bound.__call__ = evented if patched else launch
        back, _, k = cuda_time_calls_ms(fn, warmup=3, repeat=10, group_ms=20.0)
        med, times, _ = cuda_time_calls_ms(fn, warmup=3, repeat=300)
        t = np.array(times) * 1e3
        print(f"  {name:38s} median {med * 1e3:6.1f}  p10 {np.percentile(t, 10):6.1f}  p90 {np.percentile(t, 90):6.1f}"
              f"  min {t.min():6.1f}  ({nbytes / med / 1e9:.2f} TB/s; back to back {back * 1e3:6.1f} us)")
    _launch.Bound.__call__ = launch
    print("allocation on this host (us a call, best of 5 x 4000):")
    for name, fn in (("cupy.empty(q.shape, float16)", lambda: cupy.empty(q.shape, np.float16)),
                     ("cupy.ndarray(q.shape, float16)", lambda: cupy.ndarray(q.shape, np.float16)),
                     ("cupy.cuda.alloc(q.nbytes)", lambda: cupy.cuda.alloc(q.nbytes)),
                     ("torch.empty(q.shape, float16, cuda)", lambda: torch.empty(q.shape, dtype=torch.float16,
                                                                                 device="cuda"))):
        best = []
        for _ in range(5):
            t0 = time.perf_counter_ns()
            for _ in range(4000):
                fn()
            best.append((time.perf_counter_ns() - t0) / 4000 / 1e3)
        print(f"  {name:38s} {min(best):6.2f}")
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
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, enable_gqa=True)
            torch.cuda.synchronize()
        cupy.cuda.profiler.stop()
    print(f"profiled flash_attn_with_kvcache (its kernels in launch order), cuDNN's and flash's SDPA, batch {batch}, "
          f"seqlen_k {n}, page size {page or 'none (contiguous)'}")
elif mode == "stages":  # the kernel's K, V buffers (the plan's ``stages``): each count timed, calls back to back
    from flashnumba import _launch, planner

    arrays, t, opts = kernel_inputs()
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
elif mode == "tiles":  # the kernel's tile (KW keys a warp), buffers and splits: the GPU's time from a CUDA graph
    from flashnumba import planner

    arrays, t, opts = kernel_inputs()
    print(f"batch {batch}, seqlen_k {n}, page {page or 'none'}: us a call from a CUDA graph of 50 calls (min of 5)")
    for kw in (16, 32):
        planner.DECODE_KW = kw
        for stages in (2, 3):
            time_plans(f"KW {kw:2d} stages {stages}", t, opts, arrays, stages, (0, 8, 16, 32, 48))
elif mode == "deep":  # fewer, longer blocks with more K, V buffers (warps, keys a warp, buffers, splits), beside
    # torch flash and cuDNN: the GPU's time from CUDA graphs
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from flashnumba import planner

    arrays, t, opts = kernel_inputs()
    nbytes = 2 * kc.nbytes
    tq = torch.as_tensor(q, device="cuda").transpose(1, 2)
    tk, tv = (torch.as_tensor(x, device="cuda").transpose(1, 2) for x in (kc, vc))
    print(f"batch {batch}, seqlen_k {n}, page {page or 'none'}: us a call from a CUDA graph of 50 calls (min of 5)")
    for name, backend in (("torch flash", SDPBackend.FLASH_ATTENTION), ("torch cuDNN", SDPBackend.CUDNN_ATTENTION)):
        def peer(backend=backend):
            with sdpa_kernel(backend):
                return torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, enable_gqa=True)
        peer()
        us = graph_ms(peer, on_torch=True) * 1e3
        print(f"{name:12s} {us:7.1f} us {nbytes / us / 1e6:5.2f} TB/s", flush=True)
    configs = ((4, 16, 2, (0, 24, 48)), (4, 16, 4, (16, 24, 32)), (4, 16, 6, (16, 32)), (8, 16, 2, (0, 16, 24)),
               (8, 16, 3, (16, 24)), (4, 32, 3, (16, 24)))
    if os.environ.get("DEEP_QUICK"):  # the two the plan chooses between, each with the plan's split count
        configs = ((4, 16, 2, (0,)), (8, 16, 2, (0,)))
    for warps, kw, stages, splits in configs:
        planner.DECODE_WARPS, planner.DECODE_KW = (warps,), kw
        time_plans(f"warps {warps} KW {kw:2d} stages {stages}", t, opts, arrays, stages, splits)
elif mode == "latency":  # a call's host time, its GPU time alone (calls replayed from a CUDA graph), and the two modes
    import time

    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    tq = torch.as_tensor(q, device="cuda").transpose(1, 2)
    tk, tv = (torch.as_tensor(x, device="cuda").transpose(1, 2) for x in (kc, vc))

    def peer(backend):
        def fn():
            with sdpa_kernel(backend):
                return torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, enable_gqa=True)
        return fn

    def checked():
        with flashnumba.config.temporarily("check_cache_values", True):
            return step()

    def host_us(fn, calls=25, rounds=20):
        times = []
        for _ in range(rounds):
            torch.cuda.synchronize()
            t = time.perf_counter()
            for _ in range(calls):
                fn()
            times.append((time.perf_counter() - t) / calls * 1e6)
            torch.cuda.synchronize()
        return float(np.median(times))

    from flashnumba.tools.timing import cuda_time_calls_ms

    print(f"batch {batch}, seqlen_k {n}, page {page or 'none'} (torch: the contiguous cache): host us a call "
          f"(median of 20 x 25 calls); GPU us a "
          f"call from a CUDA graph of 50 calls (host-timed, min of 5); back to back and one call a pair (events)")
    impls = (("flashnumba", step), ("flashnumba checked", checked),
             ("torch flash", peer(SDPBackend.FLASH_ATTENTION)), ("torch cuDNN", peer(SDPBackend.CUDNN_ATTENTION)))
    for name, fn in impls:
        for _ in range(20):
            fn()
        torch.cuda.synchronize()
        host = host_us(fn)
        try:
            gpu = f"{graph_ms(fn, on_torch=fn is not step) * 1e3:7.1f}" if fn is not checked else "  (syncs)"
        except Exception as err:  # noqa: BLE001  (a call that cannot be captured: say so)
            gpu = f"not captured ({type(err).__name__}: {str(err)[:80]})"
        back, _, k = cuda_time_calls_ms(fn, warmup=3, repeat=10, group_ms=20.0)
        pair, _, _ = cuda_time_calls_ms(fn, warmup=1, repeat=10)
        print(f"{name:22s} host {host:6.1f} us   GPU {gpu} us   back to back {back * 1e3:6.1f} us ({k} calls)   "
              f"pair {pair * 1e3:6.1f} us")
elif mode == "splits":
    from flashnumba.tools.timing import cuda_time_calls_ms

    nbytes = 2 * kc.nbytes
    kk, vv = (pool_k, pool_v) if page else (kc, vc)
    print(f"batch {batch}, seqlen_k {n}, page {page or 'none'}")
    for s in ((0, 1, 2, 3, 4, 8) if batch >= 8 else (0, 16, 32, 42, 48, 64, 96, 128)):
        def fn(s=s):
            return flashnumba.flash_attn_with_kvcache(q, kk, vv, cache_seqlens=lens, block_table=table, num_splits=s)
        back, _, _ = cuda_time_calls_ms(fn, warmup=3, repeat=10, group_ms=20.0)
        pair, _, _ = cuda_time_calls_ms(fn, warmup=1, repeat=10)
        grids = [c.call(None).plan.launches[0].grid for k, c in flashnumba.api._calls.items()  # (the grid: splits)
                 if k and k[0] == "kvcache" and c._call is not None and c.num_splits == s]
        print(f"num_splits {s:3d}: back to back {nbytes / back / 1e9:.2f} TB/s, pair {nbytes / pair / 1e9:.2f} TB/s, "
              f"grid {grids[-1] if grids else '?'}")
else:
    raise SystemExit(f"mode must be host, prelaunch, breakdown, pairs, ncu, stages, tiles, deep, latency or splits, got {mode!r}")
