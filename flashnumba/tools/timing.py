"""Timing and memory measurement on the GPU (CuPy), with host fall-backs for the simulator."""

from __future__ import annotations

import math
import time

import numpy as np

from .._backend import SIMULATOR


def cuda_time_ms(fn, *, warmup=3, repeat=10):
    """Median milliseconds of ``fn()`` over ``repeat`` runs, timed with CUDA events after ``warmup`` runs, one
    call between two events (so the host's work before the call's first kernel is on the clock).

    Under the simulator: wall-clock time of each run, no warm-up (meaningless as a GPU figure; reported as such).
    Returns (median_ms, all_ms).
    """
    ms, times, _ = cuda_time_calls_ms(fn, warmup=warmup, repeat=repeat)
    return ms, times


def cuda_time_calls_ms(fn, *, warmup=3, repeat=10, group_ms=0.0, max_calls=100):
    """As :func:`cuda_time_ms`, with ``group_ms`` > 0: each of the ``repeat`` samples is k calls back to back
    between two events, divided by k, with k (at most ``max_calls``) chosen from the last warm-up call so that a
    sample lasts about ``group_ms``. This is the time per call of repeated calls, where a call's host work
    overlaps the previous call's kernels (as in a training loop; torch.utils.benchmark times calls so too).

    Returns (median_ms, all_ms, k).
    """
    if SIMULATOR:
        times = []
        for _ in range(repeat):
            t0 = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - t0))
        return float(np.median(times)), times, 1
    import cupy

    for _ in range(max(warmup - 1, 0)):
        fn()
    cupy.cuda.Device().synchronize()
    calls = 1
    if warmup > 0:
        last = cuda_events_ms(fn, 1)
        if group_ms > 0:
            calls = int(min(max_calls, max(1, math.ceil(group_ms / max(last, 1e-3)))))
    times = [cuda_events_ms(fn, calls) for _ in range(repeat)]
    return float(np.median(times)), times, calls


def cuda_events_ms(fn, calls=1):
    """Milliseconds per call of ``calls`` calls of ``fn()`` back to back between two CUDA events (one sample of
    :func:`cuda_time_calls_ms`; a GPU only)."""
    import cupy

    start, stop = cupy.cuda.Event(), cupy.cuda.Event()
    start.record()
    for _ in range(calls):
        fn()
    stop.record()
    stop.synchronize()
    return cupy.cuda.get_elapsed_time(start, stop) / calls


def peak_device_bytes(fn, lib="cupy"):
    """Device memory the call had to obtain, on top of its inputs. ``lib="cupy"``: the CuPy memory pool is emptied,
    ``fn()`` runs, and the pool's total (live plus cached blocks it had to allocate) is read, the footprint as a
    user of CuPy sees it; ``lib="torch"``: the peak of torch's allocator during ``fn()`` above what was allocated
    before. Returns (result of fn, bytes).
    """
    if lib == "torch":
        import torch

        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        result = fn()
        torch.cuda.synchronize()
        return result, torch.cuda.max_memory_allocated() - base
    import cupy

    pool = cupy.get_default_memory_pool()
    cupy.cuda.Device().synchronize()
    pool.free_all_blocks()
    before = pool.total_bytes()
    result = fn()
    cupy.cuda.Device().synchronize()
    return result, pool.total_bytes() - before
