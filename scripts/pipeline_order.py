"""Where the Hopper forward's tile loop waits, in its machine code: the loop (the first that holds a wgmma) compiled
offline for sm_90a at the planner's tiles, as runs of what it issues in order: HGMMA (wgmma), DEPBAR 0x1 / 0x0
(``wgmma.wait_group`` 1 and 0: S_ij in, then the running O += P V too), MUFU (the softmax's exponentials), F2FP (P
packed), FMUL (O rescaled), BAR / SYNCS (named barriers, mbarriers), BRA. With ``config.hopper_overlap`` off and on
(no GPU needed; nvdisasm from the test extra):

    FLASHNUMBA_SIMULATOR=0 python scripts/pipeline_order.py [--head-dims 64 128] [--causal]
"""

import argparse
import re

import numpy as np

from flashnumba import config, planner
from flashnumba.api import check_forward_args
from flex_sass_counts import compiled, tile_loop  # (scripts/)

KINDS = (("HGMMA", "HGMMA"), ("WARPGROUP.DEPBAR", "DEPBAR"), ("MUFU", "MUFU"), ("F2FP", "F2FP"), ("FMUL", "FMUL"),
         ("BAR", "BAR"), ("SYNCS", "SYNCS"), ("BRA", "BRA"))


def runs(loop):
    """The loop's instructions of KINDS as runs: 'MUFU x64' where 64 come one after another (others between)."""
    out = []
    for text in loop:
        op = re.sub(r"^@!?U?P\w+\s+", "", text)
        name = next((short for prefix, short in KINDS if op.startswith(prefix)), None)
        if name is None:
            continue
        if name == "DEPBAR":
            name += " " + op.split(",")[-1].strip()
        if out and out[-1][0] == name:
            out[-1][1] += 1
        else:
            out.append([name, 1])
    return " ".join(name if n == 1 else f"{name} x{n}" for name, n in out)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--causal", action="store_true")
    args = ap.parse_args()
    for d in args.head_dims:
        q = np.zeros((1, 1024, 2, d), np.float16)
        (tq, tk, tv), options = check_forward_args(q, q, q, causal=args.causal)
        for overlap in (False, True):
            with config.temporarily("hopper_overlap", overlap):
                plan = planner.forward_plan(tq, tk, tv, options, kernel="wgmma", device="sm_90")
            s = plan.launches[0]
            sass, r = compiled(plan, s)
            loop = tile_loop(sass)
            print(f"d={d} causal={args.causal} overlap={overlap} tiles={tuple(s.tiles)}: {len(loop)} instructions, "
                  f"{r['registers']} registers, {r['spill_stores']} bytes spilled\n  {runs(loop)}")


if __name__ == "__main__":
    main()
