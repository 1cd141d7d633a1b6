"""Machine instructions of the Hopper kernels' tile loops for a user's function, beside the built-in option it
reproduces, compiled for sm_90a at the planner's tiles (no GPU needed; nvdisasm from the test extra):

    FLASHNUMBA_SIMULATOR=0 python scripts/flex_sass_counts.py [--mod causal|docs|alibi|softcap|softcap-approx|bias]
        [--docs] [--head-dims 64 128] [--forward]

For each kernel (forward, dQ, dK/dV; ``--forward``: the forward alone) it prints the whole kernel's instruction
count and, for the innermost loop that holds wgmma instructions (the tile loop: from a backward branch's target to
the branch), its length and most frequent opcodes. ``--mod``: the causal mask_mod with a block mask of 128 (the
default; ``--docs``: the documents' mask_mod, two arrays of ids), or a score_mod of scripts/flex_score_mods.py:
ALiBi with the causal block mask (built-in: ``alibi_slopes`` and ``causal``), tanh softcap through math.tanh or
flashnumba.tanh_approx (built-in: ``softcap``), the relative-bias table with the causal block mask (no built-in).
The static counts hold every branch of the loop, a mask_mod's among them, which runs in the partial tiles alone.
"""

import argparse
import collections
import dataclasses
import re

import numpy as np

import flex_score_mods as fsm  # (scripts/: the score_mods timed there)
from flashnumba import _launch, _validate, planner
from flashnumba.api import _check_block_mask, check_forward_args
from flashnumba.blockmask import BlockMask
from flashnumba.tools.sass import disassemble


def doc_mod(b, h, i, j, doc_q, doc_k):
    return doc_q[i] == doc_k[j]


def cases(n):
    """name: (the built-in options it reproduces or None, score_mod, its derivative, mask_mod, the arrays they
    read); the score_mods are scripts/flex_score_mods.py's."""
    slopes, table = np.zeros(2, np.float32), np.zeros((2, 2 * n + 1), np.float32)
    ids = (np.zeros(n, np.int32), np.zeros(n, np.int32))
    return {"causal": (dict(causal=True), None, None, fsm.causal_mod, ()),
            "docs": (None, None, None, doc_mod, ids),
            "alibi": (dict(causal=True, alibi_slopes=slopes), fsm.alibi_mod, fsm.one, fsm.causal_mod, (slopes,)),
            "softcap": (dict(softcap=fsm.SOFTCAP), fsm.softcap_mod, fsm.softcap_grad, None, ()),
            "softcap-approx": (dict(softcap=fsm.SOFTCAP), fsm.softcap_approx_mod, fsm.softcap_approx_grad, None, ()),
            "bias": (None, fsm.bias_mod, fsm.one, fsm.causal_mod, (table,))}


def plans(d, name, builtin, forward_only=False, n=1024, table_tiles=False):
    """The forward's and backward's plans at head_dim d (float16, 2 heads, seqlen n) for the sm_90 GPU: the
    built-in options of case ``name``, or its functions, a mask_mod with a block mask of 128 (its arrays made
    here: no GPU to classify); ``table_tiles``: a score_mod at the table's tiles (those a GPU tries first)."""
    options, score_mod, grad, mask_mod, args = cases(n)[name]
    q = np.zeros((1, n, 2, d), np.float16)
    (tq, tk, tv), opts = check_forward_args(q, q, q, **(options if builtin else {}))
    if not builtin:
        mods, targs = _validate.check_mods(tq, tk, score_mod, grad, mask_mod, args, False, backward=True)
        opts = dataclasses.replace(opts, mods=mods, mod_args=targs, mods_table_tiles=frozenset(
            ("wgmma", "wgmma_dq", "wgmma_dkdv") if table_tiles else ()))
        if mask_mod is not None:
            bm = BlockMask.unclassified(mask_mod, args, (n, n), 128, 128)
            opts = dataclasses.replace(opts, block_mask=_check_block_mask(bm, tq, tk))
    forward = planner.forward_plan(tq, tk, tv, opts, kernel="wgmma", device="sm_90")
    if forward_only:
        return [(forward, forward.launches[0])]
    lse = np.zeros((1, 2, n), np.float32)
    tdo, to, tl = (_validate.inspect(name, x, nd) for name, x, nd in (("dout", q, 4), ("out", q, 4), ("lse", lse, 3)))
    backward = planner.backward_plan(tdo, tq, tk, tv, to, tl, opts, kernel="wgmma", device="sm_90")
    return [(forward, forward.launches[0])] + [(backward, s) for s in backward.launches[1:]]


def compiled(plan, s, arch=(9, 0, "a")):
    """(machine code as text, resources from the assembler's log) of launch ``s`` of ``plan`` compiled for ``arch``
    as the planner would compile it (its launch bounds, whole program or not)."""
    fn = s.factory(*s.factory_args)
    cubin, log, _ = _launch.build(fn.py_func, f"void({', '.join(s.signature(plan.arrays, plan.scalars))})", arch,
                                  _launch.launch_bounds(s), s.whole_program)
    return disassemble(cubin), _launch.resources_from_log(log)


def instructions(sass):
    """[(address, text)] of the machine code, and {label: address}."""
    found, labels, pending = [], {}, []
    for line in sass.splitlines():
        label = re.match(r"\s*(\.L_x_\d+):", line)
        if label:
            pending.append(label.group(1))
            continue
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?);", line)
        if m:
            address = int(m.group(1), 16)
            labels.update(dict.fromkeys(pending, address))
            pending = []
            found.append((address, m.group(2).strip()))
    return found, labels


def loop_bodies(found, labels):
    """The instructions of each loop of :func:`instructions`' code (from a backward branch's target to the branch),
    in the order of their branches."""
    for address, text in found:
        m = re.search(r"\bBRA\b.*?\((\.L_x_\d+)\)", text)
        if m and labels.get(m.group(1), address) < address:
            yield [t for a, t in found if labels[m.group(1)] <= a <= address]


def tile_loop(sass):
    """The instructions of the first loop (in the order of their backward branches) that holds a wgmma."""
    return next((body for body in loop_bodies(*instructions(sass)) if any("GMMA" in t for t in body)), [])


def opcode(text):
    return re.sub(r"^@!?U?P\w+\s+", "", text).split()[0].split(".")[0]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--mod", choices=["causal", "docs", "alibi", "softcap", "softcap-approx", "bias"],
                    default="causal")
    ap.add_argument("--docs", action="store_true", help="the documents' mask_mod (--mod docs)")
    ap.add_argument("--forward", action="store_true", help="the forward kernel alone")
    ap.add_argument("--table-tiles", action="store_true",
                    help="a score_mod at the table's tiles, which a GPU tries first (without: the smaller tiles it "
                         "takes where those spill, as the planner gives them here)")
    args = ap.parse_args()
    name = "docs" if args.docs else args.mod
    for d in args.head_dims:
        for builtin in (True, False) if cases(1024)[name][0] is not None else (False,):
            for p, s in plans(d, name, builtin, args.forward, table_tiles=args.table_tiles):
                sass, r = compiled(p, s)
                loop = tile_loop(sass)
                what = f"built-in {name}" if builtin else f"{name} mod" + (" + block mask" if cases(1024)[name][3]
                                                                            is not None else "")
                top = ", ".join(f"{k} {v}" for k, v in collections.Counter(map(opcode, loop)).most_common(8))
                print(f"d={d} {what:24} {s.name:14} tiles={tuple(s.tiles)}: {len(instructions(sass)[0])} "
                      f"instructions, tile loop {len(loop)} ({top}); {r['registers']} registers, "
                      f"{r['spill_stores']} bytes spilled", flush=True)


if __name__ == "__main__":
    main()
