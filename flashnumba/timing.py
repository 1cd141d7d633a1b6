"""Timing and memory measurement on the GPU (CuPy), with host fall-backs for the simulator."""

from __future__ import annotations

import time

import numpy as np

from ._backend import SIMULATOR


def cuda_time_ms(fn, *, warmup=3, repeat=10):
    """Median milliseconds of ``fn()`` over ``repeat`` runs, timed with CUDA events after ``warmup`` runs.

    Under the simulator: wall-clock time of each run, no warm-up (meaningless as a GPU figure; reported as such).
    Returns (median_ms, all_ms).
    """
    if SIMULATOR:
        times = []
        for _ in range(repeat):
            t0 = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - t0))
        return float(np.median(times)), times
    import cupy

    for _ in range(warmup):
        fn()
    cupy.cuda.Device().synchronize()
    times = []
    for _ in range(repeat):
        start, stop = cupy.cuda.Event(), cupy.cuda.Event()
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, stop))
    return float(np.median(times)), times


def peak_device_bytes(fn):
    """Device memory the call had to obtain: the CuPy memory pool is emptied, ``fn()`` runs, and the pool's
    total (live plus cached blocks it had to allocate) is read. Inputs allocated before the call are not counted.

    This is the footprint the call adds on top of its inputs, as a user of CuPy sees it.
    Returns (result of fn, bytes).
    """
    import cupy

    pool = cupy.get_default_memory_pool()
    cupy.cuda.Device().synchronize()
    pool.free_all_blocks()
    before = pool.total_bytes()
    result = fn()
    cupy.cuda.Device().synchronize()
    return result, pool.total_bytes() - before
