"""Registers and spills of the Hopper forward at given tiles, for every variant with at most two options, without
a GPU (compiled for sm_90a and assembled offline): the data behind the planner's tile rules for the wgmma forward
(:func:`flashnumba.tiling.wgmma_for_variant`).

    FLASHNUMBA_SIMULATOR=0 NUMBA_ENABLE_CUDASIM=0 python scripts/wgmma_spills.py D B_c [producer warps] [--gqa] [--bf16]
        [--tma] [--only=FLAGS]

``--tma``: the tensor-map copies where the variant takes them (not with packed sequences); ``--only=left+softcap``
compiles that one variant (``--only=none``: no option).

Prints one line a variant (the option flags named as in :class:`flashnumba.kernels.common.Variant`): registers,
spill stores and loads, and whether the assembler serialised a wgmma.
"""

import itertools
import sys
from concurrent.futures import ProcessPoolExecutor

NAMES = ("left", "right", "softcap", "alibi", "varlen", "dropout")


def compile_one(job):
    D, n, producer, gqa, dtype, tma, flags = job
    from flashnumba import _launch
    from flashnumba.kernels import wgmma_forward
    from flashnumba.kernels.common import Variant

    var = Variant(*(name in flags for name in NAMES))
    tma = tma and wgmma_forward.takes_tma(D, var, 2, producer)
    fn = wgmma_forward.make_forward_wgmma(D, var, n, 2, dtype, gqa, True, producer, tma)
    nt = wgmma_forward.threads(2, producer)
    a4 = f"{'uint16' if dtype == 'bfloat16' else 'float16'}[:, :, :, ::1]"
    sig = (f"void({a4}, {a4}, {a4}, {a4}, float32[:, :, ::1], float32, float32, int64, int64, float32[:, :], "
           f"int32[:], int32[:], float32, float32, uint64, uint64, uint64[:, ::1], float32[:], float32[:], "
           f"float32[:], float32[:], int32[:, :, :], int32[:, :, :, :], int8[:, :, :, :])")
    whole = wgmma_forward.rebalances(2, producer)
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
    variants = [()] + [(a,) for a in NAMES] + list(itertools.combinations(NAMES, 2))
    only = [a.split("=", 1)[1] for a in sys.argv if a.startswith("--only=")]
    if only:
        variants = [() if o == "none" else tuple(o.split("+")) for o in only]
    print(f"D={D} B_c={n} producer warps {producer} gqa={gqa}, {dtype}, two warpgroups")
    with ProcessPoolExecutor(2) as pool:
        for flags, regs, st, ld, ser in pool.map(compile_one, [(D, n, producer, gqa, dtype, tma, v)
                                                               for v in variants]):
            print(f"  {'+'.join(flags) or 'none':18s} {regs:4d} registers, spills {st:5d} stores {ld:5d} loads"
                  f"{', wgmma serialised' if ser else ''}", flush=True)


if __name__ == "__main__":
    main()
