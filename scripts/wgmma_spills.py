"""Registers and spills of the Hopper kernels at given tiles, for every variant with at most two options, without
a GPU (compiled for sm_90a and assembled offline): the data behind the planner's tile rules for the wgmma forward
(:func:`flashnumba.tiling.wgmma_for_variant`) and its backward's tables above head_dim 128.

    FLASHNUMBA_SIMULATOR=0 NUMBA_ENABLE_CUDASIM=0 python scripts/wgmma_spills.py D B_c [producer warps] [--gqa] [--bf16]
        [--tma] [--only=FLAGS] [--backward=dq|dkdv] [--no-exchange]

``--tma``: the tensor-map copies where the variant takes them (not with packed sequences); ``--only=left+softcap``
compiles that one variant (``--only=none``: no option). ``--backward=dq``: the dQ kernel with B_c keys a tile and
two warpgroups; ``--backward=dkdv``: the dK/dV kernel with B_c queries a tile and two warpgroups (above head_dim
128, both on 64 keys, exchanging partial S^T and dP^T; ``--no-exchange``: each computing them whole); the producer
warpgroup there is the tensor maps' (``--tma``), the producer argument unused.

Prints one line a variant (the option flags named as in :class:`flashnumba.kernels.common.Variant`): registers,
spill stores and loads, and whether the assembler serialised a wgmma.
"""

import itertools
import sys
from concurrent.futures import ProcessPoolExecutor

NAMES = ("left", "right", "softcap", "alibi", "varlen", "dropout")


TAIL = ("uint64[:, ::1], float32[:], float32[:], float32[:], float32[:], int32[:, :, :], int32[:, :, :, :], "
        "int8[:, :, :, :])")


def compile_one(job):
    D, n, producer, gqa, dtype, tma, backward, exchange, flags = job
    from flashnumba import _launch
    from flashnumba.kernels import wgmma_backward, wgmma_forward
    from flashnumba.kernels.common import Variant

    var = Variant(*(name in flags for name in NAMES))
    a4 = f"{'uint16' if dtype == 'bfloat16' else 'float16'}[:, :, :, ::1]"
    if backward:  # (the dQ kernel: n keys a tile; the dK/dV kernel: n queries a tile)
        tma = tma and wgmma_backward.takes_tma(D, var, 2, backward, n)
        make = wgmma_backward.make_backward_dq_wgmma if backward == "dq" else wgmma_backward.make_backward_dkdv_wgmma
        fn = make(D, var, n, 2, dtype, gqa, tma, **({} if backward == "dq" else {"exchange": exchange}))
        nt, whole = wgmma_backward.threads(2, tma), tma
        outs = a4 if backward == "dq" else f"{a4}, {a4}"
        sig = (f"void({a4}, {a4}, {a4}, {a4}, float32[:, :, ::1], float32[:, :, ::1], {outs}, float32, float32, "
               f"float32, int64, int64, float32[:, :], int32[:], int32[:], float32, float32, uint64, uint64, {TAIL}")
    else:
        tma = tma and wgmma_forward.takes_tma(D, var, 2, producer)
        fn = wgmma_forward.make_forward_wgmma(D, var, n, 2, dtype, gqa, True, producer, tma)
        nt, whole = wgmma_forward.threads(2, producer), wgmma_forward.rebalances(2, producer)
        sig = (f"void({a4}, {a4}, {a4}, {a4}, float32[:, :, ::1], float32, float32, int64, int64, float32[:, :], "
               f"int32[:], int32[:], float32, float32, uint64, uint64, {TAIL}")
    log = _launch.build(fn.py_func, sig, (9, 0, "a"), _launch.bounds(nt, whole), whole)[1]
    r = _launch.resources_from_log(log)
    return flags + (("tma",) if tma else ()), r["registers"], r["spill_stores"], r["spill_loads"], "serialized" in log


def main():
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    D, n = int(args[0]), int(args[1])
    producer = int(args[2]) if len(args) > 2 else 4
    gqa = "--gqa" in sys.argv
    dtype = "bfloat16" if "--bf16" in sys.argv else "float16"
    tma = "--tma" in sys.argv
    exchange = "--no-exchange" not in sys.argv  # (the dK/dV kernel above head_dim 128: partial sums exchanged)
    variants = [()] + [(a,) for a in NAMES] + list(itertools.combinations(NAMES, 2))
    only = [a.split("=", 1)[1] for a in sys.argv if a.startswith("--only=")]
    if only:
        variants = [() if o == "none" else tuple(o.split("+")) for o in only]
    backward = next((a.split("=", 1)[1] for a in sys.argv if a.startswith("--backward=")), None)
    if backward not in (None, "dq", "dkdv"):
        raise SystemExit(f"--backward takes dq or dkdv, got {backward!r}")
    print(f"{backward or 'forward'}: D={D} {'B_c' if backward != 'dkdv' else 'B_r'}={n} producer warps "
          f"{producer if not backward else '(tensor maps)'} gqa={gqa}, {dtype}, two warpgroups")
    with ProcessPoolExecutor(2) as pool:
        jobs = [(D, n, producer, gqa, dtype, tma, backward, exchange, v) for v in variants]
        for flags, regs, st, ld, ser in pool.map(compile_one, jobs):
            print(f"  {'+'.join(flags) or 'none':18s} {regs!s:>4} registers, spills {st!s:>5} stores {ld!s:>5} loads"
                  f"{', wgmma serialised' if ser else ''}", flush=True)


if __name__ == "__main__":
    main()
