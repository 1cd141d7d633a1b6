"""Tile sweeps: ``python -m flashnumba sweep FAMILY`` times one kernel family over its tile candidates on this GPU.

For each head dim and each candidate (block_m, block_n, and num_threads where the family takes it) that suits the
family (:func:`flashnumba.tiling.check`) and fits this GPU's shared memory (:func:`flashnumba.tiling.fits`): the
plan is made with those tiles (:func:`flashnumba.plan` / :func:`flashnumba.plan_backward`), its kernels bound, and
the family's kernels launched back to back between two CUDA events: kernel time only, no host time, the median of
``--repeat`` groups. Per configuration: milliseconds, TFLOP/s (the pass's FLOP count over these kernels' time; for
``tc_dq`` and ``tc_dkdv``, the whole backward's count over that one kernel's time: a rate to compare the tiles of
one kernel, not a throughput), registers per thread, spills (None where the assembler's log stated none), local
memory per thread (stack), shared memory per block, the blocks that fit on one SM
(:func:`flashnumba.tools.resources.occupancy`), and whether it is the table's default here.

Families (the tables of :mod:`flashnumba.tiling`): forward ``v1``, ``v2``, ``v3``, ``tc``, ``tf32``, ``3xtf32``,
``wgmma`` (the Hopper forward: one or two warpgroups, its key tiles, each producer);
backward ``bwd_v1``, ``bwd_v2`` (dQ and dK/dV together, one tile for both), ``tc_dq``, ``tc_dkdv`` (each tensor-core
backward kernel with its own tiles; the API gives block_m and block_n to both backward kernels, so a configuration
the other kernel cannot take is recorded as an error; ``wgmma_dq``, ``wgmma_dkdv`` the same for the Hopper
backward), ``tc_dkdv_atomic`` (the dK/dV kernel that also adds dQ with
atomics, ``deterministic=False``; its conversion of dQ not timed). Workload: batch = 16384 / seqlen, heads =
2048 / head_dim.

Writes ``sweep-FAMILY.json`` and ``sweep-FAMILY.png`` (a heatmap per head dim: block_m x block_n, TFLOP/s, the
best over threads) to ``--out``. Needs a GPU and CuPy (matplotlib for the heatmap, tqdm for a progress bar).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys

import numpy as np

from .arguments import at_least

FAMILIES = {  # family: (pass, kernel= of the API, the tables of the launches timed)
    "v1": ("forward", "v1"), "v2": ("forward", "v2"), "v3": ("forward", "v3"), "tc": ("forward", "tc"),
    "tf32": ("forward", "tf32"), "3xtf32": ("forward", "3xtf32"),
    "bwd_v1": ("backward", "v1"), "bwd_v2": ("backward", "v2"), "tc_dq": ("backward", "tc"),
    "tc_dkdv": ("backward", "tc"), "tc_dkdv_atomic": ("backward", "tc"),
    "wgmma": ("forward", "wgmma"), "wgmma_dq": ("backward", "wgmma"), "wgmma_dkdv": ("backward", "wgmma"),
}
TILE_SIZES = (16, 32, 64, 128)
THREADS = (64, 128, 256)  # for the families that take num_threads (v2, v3, bwd_v2)
TC_THREADS = (16, 32)  # the tensor-core forward: query rows per warp


def candidates(family: str, D: int, limits) -> list:
    """The (block_m, block_n, num_threads) the family accepts at head dim D that fit ``limits``; num_threads None
    where the family derives it from its tiles."""
    from .. import tiling

    takes_threads = family in ("v2", "v3", "bwd_v2")
    if family.startswith("wgmma"):  # (the other multiples of 8 run padded to the head dim the kernels are built for)
        from ..planner import padded_head_dim

        D = padded_head_dim("wgmma", D) or D
    out = []
    grid = itertools.product(TILE_SIZES, TILE_SIZES, THREADS if takes_threads else TC_THREADS
                             if family == "tc" else (None,))
    if family == "wgmma":  # one or two warpgroups, its key tiles, each producer
        from ..kernels import wgmma_forward as wf

        grid = [(64 * w, n, wf.threads(w, p)) for w in wf.WARPGROUPS for n in wf.BLOCK_NS for p in wf.PRODUCER_WARPS]
    for m, n, nt in grid:
        if family == "tc":  # a warp per 16 query rows, or per 32 (two blocks of 16 a warp)
            nt = 32 * m // nt
        t = tiling.threads_of(family, tiling.Tiles(m, n, nt or max(m, n)), D)  # (bwd_v1: a thread per row)
        try:
            tiling.check(family, D, t)
        except ValueError:
            continue
        if tiling.fits(family, D, t, limits):
            out.append((m, n, nt))
    return out


def _arrays(dtype, seqlen, D, seed=0):
    import cupy

    batch, heads = max(1, 16384 // seqlen), max(1, 2048 // D)
    rng = np.random.default_rng(seed)
    dt = np.dtype(dtype)
    return [cupy.asarray(rng.standard_normal((batch, seqlen, heads, D), dtype=np.float32).astype(dt))
            for _ in range(4)]


def _flops(pass_, q, causal):
    batch, seqlen, heads, D = q.shape
    f = 4 * batch * heads * seqlen * seqlen * D / (2 if causal else 1)
    return f * (2.5 if pass_ == "backward" else 1.0)


def _plan(family, tiles, q, k, v, dout, causal):
    """The plan of one configuration and the arrays its launches take."""
    import flashnumba

    pass_, kernel = FAMILIES[family]
    m, n, nt = tiles
    kw = dict(causal=causal, kernel=kernel, block_m=m, block_n=n, num_threads=nt)
    if family == "tc_dkdv_atomic":
        kw["deterministic"] = False
    if pass_ == "forward":
        return flashnumba.plan(q, k, v, **kw), (q, k, v, None, None, None)
    out, lse = flashnumba.flash_attn_forward(q, k, v, causal=causal)
    return flashnumba.plan_backward(dout, q, k, v, out, lse, **kw), (dout, q, k, v, out, lse, None, None, None)


def _compile_one(job):
    """In a worker process: compile one configuration's kernels into the disk cache (no timing)."""
    family, D, tiles, dtype, seqlen, causal = job
    try:
        plan, _ = _plan(family, tiles, *_arrays(np.dtype(dtype), seqlen, D), causal)
        plan.resources()
    except Exception:  # noqa: BLE001  (the timed run records the error)
        pass


def precompile(jobs, workers):
    """Compile the configurations' kernels in ``workers`` processes into the disk cache
    (:mod:`flashnumba._cache`), from which the timed run then loads them: a sweep is mostly compile time, and
    compiles are independent. Does nothing where the cache is disabled or ``workers`` < 2."""
    from .. import _cache

    if workers < 2 or _cache.directory() is None or len(jobs) < 2:
        return
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(min(workers, len(jobs)), mp_context=multiprocessing.get_context("spawn")) as pool:
        list(pool.map(_compile_one, jobs))


def measure(family, D, tiles, q, k, v, dout, causal, repeat, limits):
    """One configuration: the family's kernels of its plan, timed alone."""
    import cupy

    from .. import _launch, tiling
    from .resources import occupancy
    from .timing import cuda_events_ms

    pass_ = FAMILIES[family][0]
    m, n, nt = tiles
    plan, arrays = _plan(family, tiles, q, k, v, dout, causal)
    call = _launch.Call(plan)
    values, outs, keep = call.prepare(arrays)
    timed = [b for b in call.bound if b.spec.table == family]
    stream = cupy.cuda.get_current_stream().ptr

    def launch():
        for b in timed:
            b(values, stream)

    launch()
    cupy.cuda.Device().synchronize()
    ms = float(np.median([cuda_events_ms(launch, 10) for _ in range(repeat)]))
    res = [b.compiled.resources for b in timed]
    threads = [int(np.prod(b.spec.block)) for b in timed]
    default = tiling.default(family, D, limits).tiles
    is_default = (default.block_m, default.block_n) == (m, n) and (nt is None or default.num_threads == nt)
    row = dict(block_m=m, block_n=n, num_threads=threads[0] if nt is None else nt, ms=round(ms, 4),
               tflops=round(_flops(pass_, q, causal) / ms / 1e9, 2), registers=None, spill_bytes=None,
               stack_bytes=None, shared_bytes=None, blocks_per_sm=None, default=is_default)
    if all(r["registers"] is not None for r in res):  # (the assembler's log, else the loaded kernel's attributes)
        shared = [b.spec.shared_bytes + r["static_shared_bytes"] for b, r in zip(timed, res)]
        blocks = [occupancy(r["registers"], s, t, limits)[0] for t, r, s in zip(threads, res, shared)]
        spills = [None if r["spill_stores"] is None else r["spill_stores"] + r["spill_loads"] for r in res]
        row.update(registers=max(r["registers"] for r in res), shared_bytes=max(shared), blocks_per_sm=min(blocks),
                   spill_bytes=None if None in spills else max(spills),
                   stack_bytes=max(r["stack_bytes"] for r in res))
    return row


def sweep(family, head_dims, seqlen, causal, dtype, repeat=5, progress=True, workers=None):
    """Rows of :func:`measure` for every candidate of ``family`` at each head dim, on the current GPU; the
    kernels compiled first in ``workers`` processes (default: the CPU count, at most 16; see :func:`precompile`)."""
    from .. import planner
    from ..kernels import mma_forward, mma_tf32

    if family not in FAMILIES:
        raise ValueError(f"family must be one of {', '.join(FAMILIES)}, got {family!r}")
    limits = planner.current_device()
    if dtype is None:
        dtype = "float16" if family in ("tc", "tc_dq", "tc_dkdv", "tc_dkdv_atomic", "wgmma", "wgmma_dq",
                                        "wgmma_dkdv") else "float32"
    if family in ("tc", "tc_dq", "tc_dkdv", "tc_dkdv_atomic", "tf32", "3xtf32"):
        allowed = mma_tf32.HEAD_DIMS if "tf32" in family else mma_forward.HEAD_DIMS
        head_dims = [d for d in head_dims if d in allowed] or list(allowed)
    jobs = [(d, t) for d in head_dims for t in candidates(family, d, limits)]
    workers = min(16, os.cpu_count() or 1) if workers is None else workers
    precompile([(family, d, t, _numpy_dtype(dtype).name, seqlen, causal) for d, t in jobs], workers)
    bar = _progress(len(jobs), f"sweep {family}") if progress else None
    rows, arrays = [], {}
    for d, tiles in jobs:
        if d not in arrays:
            arrays = {d: _arrays(_numpy_dtype(dtype), seqlen, d)}
        try:
            row = measure(family, d, tiles, *arrays[d], causal, repeat, limits)
        except Exception as err:  # noqa: BLE001  (a configuration the compiler or the device refuses)
            row = dict(block_m=tiles[0], block_n=tiles[1], num_threads=tiles[2], error=f"{type(err).__name__}: {err}")
        rows.append(dict(head_dim=d, **row))
        if bar is not None:
            bar.update(1)
            if "tflops" in row:
                bar.set_postfix_str(f"d={d} {tiles[0]}x{tiles[1]} {row['tflops']:.0f} TFLOP/s")
    if bar is not None:
        bar.close()
    return dict(family=family, pass_=FAMILIES[family][0], seqlen=seqlen, causal=causal, dtype=dtype,
                device=limits.name, rows=rows)


def _numpy_dtype(name):
    if name == "bfloat16":
        raise ValueError("the sweep runs on CuPy arrays, which have no bfloat16: sweep float16 (the tensor-core "
                         "kernels take the same tiles for both)")
    return np.dtype(name)


def _progress(total, desc):
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc=desc, unit="config")


def heatmap(result, path=None):
    """A heatmap per head dim: block_m (rows) x block_n (columns), TFLOP/s (the best over threads), the default
    framed; saved to ``path`` (and closed), or, without a path, the figure returned (a notebook shows it)."""
    import matplotlib.pyplot as plt

    dims = sorted({r["head_dim"] for r in result["rows"]})
    fig, axes = plt.subplots(1, len(dims), figsize=(4.5 * len(dims), 4), squeeze=False)
    for ax, d in zip(axes[0], dims):
        grid = np.full((len(TILE_SIZES), len(TILE_SIZES)), np.nan)
        for r in result["rows"]:
            if r["head_dim"] == d and "tflops" in r:
                i, j = TILE_SIZES.index(r["block_m"]), TILE_SIZES.index(r["block_n"])
                grid[i, j] = np.nanmax([grid[i, j], r["tflops"]])
        im = ax.imshow(grid, cmap="viridis")
        for (i, j), value in np.ndenumerate(grid):
            if not np.isnan(value):
                ax.text(j, i, f"{value:.0f}", ha="center", va="center", color="w", fontsize=9)
        for r in result["rows"]:
            if r["head_dim"] == d and r.get("default"):
                i, j = TILE_SIZES.index(r["block_m"]), TILE_SIZES.index(r["block_n"])
                ax.add_patch(plt.Rectangle((j - 0.5, i - 0.5), 1, 1, fill=False, ec="red", lw=2))
        ax.set_xticks(range(len(TILE_SIZES)), TILE_SIZES)
        ax.set_yticks(range(len(TILE_SIZES)), TILE_SIZES)
        ax.set_xlabel("block_n (B_c)")
        ax.set_ylabel("block_m (B_r)")
        ax.set_title(f"head_dim {d}")
        fig.colorbar(im, ax=ax, label="TFLOP/s")
    fig.suptitle(f"{result['family']} ({result['pass_']}), {result['dtype']}, seqlen {result['seqlen']}"
                 f"{', causal' if result['causal'] else ''}, {result['device']}; red: the default")
    fig.tight_layout()
    if path is None:
        return fig
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m flashnumba sweep", description=__doc__.split("\n\n")[0])
    p.add_argument("family", choices=list(FAMILIES), help="the kernel family (a table of flashnumba.tiling)")
    p.add_argument("--head-dims", type=at_least(1), nargs="+", default=[64, 128])
    p.add_argument("--seqlen", type=at_least(1), default=4096)
    p.add_argument("--causal", action="store_true")
    p.add_argument("--dtype", choices=["float32", "float16"], default=None,
                   help="default: float16 for the tensor-core families, float32 for the others")
    p.add_argument("--repeat", type=at_least(1), default=5, help="groups of 10 launches timed per configuration")
    p.add_argument("--out", default=".", help="directory for sweep-FAMILY.json and sweep-FAMILY.png")
    p.add_argument("--workers", type=at_least(1), default=None,
                   help="processes compiling the configurations first (default: the CPU count, at most 16)")
    args = p.parse_args(argv)
    # the spills come from the assembler's log, which a link served by CUDA's compute cache leaves empty
    # (flashnumba._launch._jit_link: set before numba's import it is seen to work; here, after it, a row's None
    # says where the log stated nothing); registers and local memory (stack) from the loaded kernel where it did
    os.environ.setdefault("CUDA_CACHE_DISABLE", "1")
    from .._backend import SIMULATOR

    if SIMULATOR:
        print("the sweep times kernels on a GPU; this machine runs the simulator "
              "(see which configurations would be swept: flashnumba.tools.sweep.candidates)", file=sys.stderr)
        return 2
    result = sweep(args.family, args.head_dims, args.seqlen, args.causal, args.dtype, args.repeat,
                   workers=args.workers)
    print(f"{'d':>4} {'B_r':>4} {'B_c':>4} {'thr':>4} {'ms':>8} {'TFLOP/s':>8} {'regs':>5} {'spill':>6} "
          f"{'stack':>6} {'smem':>7} {'blk/SM':>6}")
    for r in result["rows"]:
        if "error" in r:
            print(f"{r['head_dim']:4} {r['block_m']:4} {r['block_n']:4}  {r['error'][:90]}")
            continue
        print(f"{r['head_dim']:4} {r['block_m']:4} {r['block_n']:4} {r['num_threads']:4} {r['ms']:8.3f} "
              f"{r['tflops']:8.1f} {r['registers']!s:>5} {r['spill_bytes']!s:>6} {r['stack_bytes']!s:>6} "
              f"{r['shared_bytes']!s:>7} "
              f"{r['blocks_per_sm']!s:>6}{'  default' if r['default'] else ''}")
    os.makedirs(args.out, exist_ok=True)
    base = os.path.join(args.out, f"sweep-{args.family}")
    with open(base + ".json", "w") as f:
        json.dump(result, f, indent=1)
    try:
        import matplotlib

        matplotlib.use("Agg")  # a file, no display
        heatmap(result, base + ".png")
    except ImportError:
        print("(matplotlib is not installed: no heatmap)")
    print(f"wrote {base}.json" + (f", {base}.png" if os.path.exists(base + ".png") else ""))
    return 0
