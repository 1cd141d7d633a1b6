"""Command line: ``python -m flashnumba info | demo | bench | sweep | check | cache`` (each with ``--help``)."""

from __future__ import annotations

import argparse
import sys

from .tools.arguments import at_least


def _info(args):
    import numpy as np

    from . import _backend, _cache, planner
    from .api import plan, plan_backward

    print(f"backend   : {_backend.BACKEND} ({_backend.REASON})")
    print(f"device    : {_backend.device_name()}")
    for pkg, ver in _backend.versions().items():
        print(f"{pkg:10}: {ver if ver is not None else 'not installed'}")
    c = _cache.info()
    print(f"cache     : {c['directory'] or 'disabled'} ({c['entries']} kernels, {c['bytes'] / 2**20:.1f} MiB)")
    try:
        dev = planner.resolve_device(args.arch)
    except ValueError as err:
        print(f"flashnumba info: --arch: {err}", file=sys.stderr)
        return 2
    print(f"\nplans for batch {args.batch}, seqlen {args.seqlen}, {args.heads} heads, causal, on {dev.name}:")
    dtypes = [np.float32, np.float16]
    try:
        import ml_dtypes

        dtypes.append(ml_dtypes.bfloat16)
    except ImportError:
        pass
    for dtype in dtypes:
        for d in args.head_dims:
            shape = (args.batch, args.seqlen, args.heads, d)
            q = np.zeros(shape, dtype)  # only shapes and dtypes are read
            lse = np.zeros((args.batch, args.heads, args.seqlen), np.float32)
            print()
            try:
                print(plan(q, q, q, causal=True, device=args.arch))
                print(plan_backward(q, q, q, q, q, lse, causal=True, device=args.arch))
            except (ValueError, TypeError) as err:  # (a shape no kernel takes: said, as a call would say it)
                print(f"{np.dtype(dtype).name}, head_dim {d}: {err}")
    return 0


def _demo(args):
    from .tools.demo import run

    return run(size=args.size)


def _properties():
    from .check import PROPERTIES

    return PROPERTIES


def _check(args):
    import json
    import os

    from .check import PROPERTIES, adapter
    from .tools.check_report import one_report

    def refuse(message):  # (the caller's mistake: one line, exit 2, before anything runs)
        print(f"flashnumba check: {message}", file=sys.stderr)
        return 2

    kwargs = dict(head_dims=args.head_dims, examples=args.examples, max_seqlen=args.max_seqlen, seed=args.seed,
                  properties=args.properties or PROPERTIES)
    asked = list(dict.fromkeys(args.dtypes)) if args.dtypes else None  # (each once)
    jobs = []  # (target, dtypes) of each report
    for target in args.targets:
        try:  # (a name that is no implementation: one line, not a traceback)
            impl = adapter(target)
        except (ValueError, ImportError, AttributeError, TypeError) as err:
            return refuse(f"{target}: {err}")
        skipped = [d for d in asked or () if d not in impl.dtypes]
        if skipped:
            print(f"flashnumba check: {target} takes {', '.join(impl.dtypes)}; not run for {', '.join(skipped)}",
                  file=sys.stderr)
        runs = [[d] for d in (asked or impl.dtypes)] if args.per_dtype else [asked]
        for dtypes in runs:
            if dtypes is not None and not set(dtypes) & set(impl.dtypes):
                continue
            jobs.append((target, None if dtypes is None else [d for d in dtypes if d in impl.dtypes]))
    if not jobs:
        return refuse("nothing to run: no target takes the dtypes asked for")
    if args.json and len(jobs) > 1:
        return refuse(f"--json writes one report, and this run makes {len(jobs)}: use --out DIR for several")
    if args.json and not os.path.isdir(os.path.dirname(os.path.abspath(args.json))):
        return refuse(f"--json {args.json}: its folder does not exist")
    if args.json and os.path.isdir(args.json):
        return refuse(f"--json {args.json} is a folder: name the file (or use --out DIR)")
    if args.out:
        try:
            os.makedirs(args.out, exist_ok=True)
        except OSError as err:
            return refuse(f"--out {args.out}: {err}")
    if args.jobs > 1 and len(jobs) > 1:  # reports in worker processes (each compiles its own kernels)
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        with ProcessPoolExecutor(min(args.jobs, len(jobs)), mp_context=multiprocessing.get_context("spawn")) as pool:
            futures = [pool.submit(one_report, t, d, kwargs) for t, d in jobs]
            results = [f.result() for f in futures]  # in the order asked for
    else:
        results = (one_report(t, d, kwargs) for t, d in jobs)
    failed = False
    for (target, dts), (text, data, passed) in zip(jobs, results):
        print(text, flush=True)
        failed |= not passed
        if args.json:
            with open(args.json, "w") as f:
                json.dump(data, f, indent=1)
            print(f"wrote {args.json}")
        if args.out:
            name = target.replace(":", "-") + ("" if dts is None else "-" + "-".join(dts))
            with open(os.path.join(args.out, f"check-{name}.json"), "w") as f:
                json.dump(data, f, indent=1)
    return 1 if failed else 0


def _cache_cmd(args):
    from . import _cache

    if args.action == "clear":
        where = _cache.directory()
        print(f"removed {_cache.clear()} files from {where}" if where else
              "the kernel cache is disabled (FLASHNUMBA_CACHE_DIR=off): nothing to remove")
    else:
        c = _cache.info()
        print(f"directory: {c['directory'] or 'disabled (FLASHNUMBA_CACHE_DIR=off)'}")
        print(f"entries  : {c['entries']} compiled kernels, {c['bytes'] / 2**20:.1f} MiB")
    return 0


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m flashnumba", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    info = sub.add_parser("info", help="backend, device, package versions, kernel cache, and the plans of a "
                                       "standard shape")
    info.add_argument("--arch", default=None, help="plan for this architecture instead of the current GPU "
                                                   "(sm_75, sm_80, sm_86, sm_89, sm_90)")
    info.add_argument("--batch", type=at_least(1), default=4)
    info.add_argument("--seqlen", type=at_least(1), default=4096)
    info.add_argument("--heads", type=at_least(1), default=16)
    info.add_argument("--head-dims", type=at_least(1), nargs="+", default=[64, 128])
    demo = sub.add_parser("demo", help="run the forward kernel, check it, time it, compare memory")
    demo.add_argument("--size", choices=["auto", "small", "large"], default="auto",
                      help="large: batch 4, 16 heads, seqlen 4096, head_dim 64 (GPU); small: simulator-sized")
    check = sub.add_parser("check", help="run the numerics battery on an attention implementation "
                                         "(flashnumba.check); exit status 1 when a property fails or none was "
                                         "checked")
    check.add_argument("targets", nargs="+", metavar="target",
                       help="a built-in adapter (numpy-reference, flashnumba, flash-attn, torch-sdpa-flash, -cudnn, "
                            "-efficient, -math) or module:name, name being a flashnumba.check.Implementation (which "
                            "declares its options, backward, dtypes) or a NumPy function fn(q, k, v, causal=False) "
                            "-> out or (out, lse), checked with causal as its one option; several run one after "
                            "another")
    check.add_argument("--dtypes", nargs="+", default=None, choices=["float32", "float16", "bfloat16"])
    check.add_argument("--head-dims", type=at_least(1), nargs="+", default=None)
    check.add_argument("--examples", type=at_least(1), default=50, help="drawn problems per accuracy property")
    check.add_argument("--max-seqlen", type=at_least(1), default=80)
    check.add_argument("--seed", type=int, default=0, help="the search's seed: the same examples at each run of one "
                                                           "seed, others for another")
    check.add_argument("--properties", nargs="+", default=None, choices=_properties(), help="a subset of the battery")
    check.add_argument("--per-dtype", action="store_true", help="one report per dtype")
    check.add_argument("--jobs", type=at_least(1), default=1,
                       help="reports run in this many processes at once (their kernels compile in parallel)")
    check.add_argument("--json", default=None, help="write the report as JSON here (one target)")
    check.add_argument("--out", default=None, help="write check-TARGET[-DTYPE].json for every report here")
    cache = sub.add_parser("cache", help="the compiled-kernel cache on disk: info or clear")
    cache.add_argument("action", choices=["info", "clear"])
    sub.add_parser("bench", help="benchmark against standard attention and peers (see bench --help)",
                   add_help=False)
    sub.add_parser("sweep", help="time a kernel family over its tile sizes on this GPU (see sweep --help)",
                   add_help=False)
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["bench"]:  # the benchmark and the sweep have their own options
        from .tools.bench import main as bench_main

        return bench_main(argv[1:])
    if argv[:1] == ["sweep"]:
        from .tools.sweep import main as sweep_main

        return sweep_main(argv[1:])
    args = parser.parse_args(argv)
    return {"info": _info, "demo": _demo, "check": _check, "cache": _cache_cmd}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
