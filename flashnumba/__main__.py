"""Command line: ``python -m flashnumba info | demo``."""

from __future__ import annotations

import argparse
import sys


def _info(args):
    from . import _backend

    print(f"backend   : {_backend.BACKEND} ({_backend.REASON})")
    print(f"device    : {_backend.device_name()}")
    for pkg, ver in _backend.versions().items():
        print(f"{pkg:10}: {ver if ver is not None else 'not installed'}")
    return 0


def _demo(args):
    from .demo import run

    return run(size=args.size)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m flashnumba", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="backend, device and package versions")
    demo = sub.add_parser("demo", help="run the forward kernel, check it, time it, compare memory")
    demo.add_argument("--size", choices=["auto", "small", "large"], default="auto",
                      help="large: batch 4, 16 heads, seqlen 4096, head_dim 64 (GPU); small: simulator-sized")
    sub.add_parser("bench", help="benchmark against standard attention and peers (see --help)", add_help=False)
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["bench"]:  # the benchmark has its own options
        from .bench import main as bench_main

        return bench_main(argv[1:])
    args = parser.parse_args(argv)
    return {"info": _info, "demo": _demo}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
