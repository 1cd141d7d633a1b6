"""Machine instructions of the forwards' tile loops where tiles are masked (causal, a window), compiled offline at
the planner's tiles: the Hopper forward for sm_90a, the ``mma.sync`` forward for sm_80 (no GPU needed; nvdisasm from
the test extra). Each line: kernel, head dim, options, tiles, the kernel's instructions, its tile loop (the first
loop, in the order of the backward branches, that holds a tensor-core instruction), registers, spilled bytes.

    FLASHNUMBA_SIMULATOR=0 python scripts/masked_tile_counts.py [--head-dims 64 128] [--backward | --many-options]

``--many-options``: the ``mma.sync`` forward with several options at once (a window, softcap, ALiBi, dropout).
``--backward``: the backward's dQ and dK/dV kernels instead (the ``mma.sync`` ones for sm_80, the Hopper ones for
sm_90a).
"""

import argparse

import numpy as np

from flashnumba import _validate, planner
from flashnumba.api import check_forward_args
from flex_sass_counts import compiled, instructions, loop_bodies  # (scripts/)

CASES = ((((8, 0), "sm_80"), "tc", dict(causal=True)), (((8, 0), "sm_80"), "tc", dict(window_size=(100, 7))),
         (((9, 0, "a"), "sm_90"), "wgmma", dict(causal=True)),
         (((9, 0, "a"), "sm_90"), "wgmma", dict(window_size=(100, 7))))
SLOPES = np.ones(2, np.float32)
MANY = ((((8, 0), "sm_80"), "tc", dict(window_size=(8, 3), softcap=5.0, alibi_slopes=SLOPES, dropout_p=0.1)),
        (((8, 0), "sm_80"), "tc", dict(causal=True, softcap=5.0, alibi_slopes=SLOPES, dropout_p=0.1)),
        (((8, 0), "sm_80"), "tc", dict(causal=True, dropout_p=0.1)))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--backward", action="store_true")
    ap.add_argument("--many-options", action="store_true", help="the mma.sync forward with several options at once")
    args = ap.parse_args()
    for d in args.head_dims:
        for (arch, device), kernel, opts in MANY if args.many_options else CASES:
            for plan, s in launches(d, device, kernel, opts, args.backward):
                report(plan, s, arch, kernel, d, {k: v for k, v in opts.items() if k != "alibi_slopes"})


def launches(d, device, kernel, opts, backward):
    """(plan, launch) of the kernels to count: the forward, or the backward's dQ and dK/dV kernels."""
    q = np.zeros((1, 1024, 2, d), np.float16)
    (tq, tk, tv), options = check_forward_args(q, q, q, **opts)
    if not backward:
        plan = planner.forward_plan(tq, tk, tv, options, kernel=kernel, device=device)
        return [(plan, plan.launches[0])]
    lse = np.zeros((1, 2, 1024), np.float32)
    tdo, to, tl = (_validate.inspect(name, x, nd) for name, x, nd in (("dout", q, 4), ("out", q, 4), ("lse", lse, 3)))
    plan = planner.backward_plan(tdo, tq, tk, tv, to, tl, options, kernel=kernel, device=device)
    return [(plan, s) for s in plan.launches[1:]]


def report(plan, s, arch, kernel, d, opts):
    """One line: the launch's kernel compiled for ``arch``, its instructions, tile loop, registers and spills."""
    sass, r = compiled(plan, s, arch)
    found, labels = instructions(sass)
    loop = next((body for body in loop_bodies(found, labels) if any("MMA" in t for t in body)), [])
    print(f"{kernel:5s} {s.name:12s} d={d} {opts} tiles={tuple(s.tiles)}: {len(found)} instructions, tile loop "
          f"{len(loop)}; {r['registers']} registers, {r['spill_stores']} bytes spilled", flush=True)


if __name__ == "__main__":
    main()
