"""The float32 forwards' error against the float64 truth, as a multiple of a plain float32 computation's (GPU).

    python scripts/tf32_error.py [--draws 200] [--seed 0] [--out tf32-error.json]

For each draw: a random shape (seqlen_q and seqlen_k log-uniform in 1..4096, ``--longest``; head_dim 64 or 128,
causal or not, one or two sequences of one to four heads; inputs standard normal as in the tests), the float64
reference, NumPy's float32 computation of the same attention (the baseline: what a plain float32 implementation achieves), and each
float32 kernel ("ieee": the SIMT default; "3xtf32"; "tf32"). The figure is max |O - O_float64| over the kernel's
output divided by the baseline's; float32-class accuracy means a ratio of at most 2 (flash-attn's rule). Printed:
each draw's ratios, then the median and the largest ratio of each kernel.
"""

from __future__ import annotations

import argparse
import json
import math

import numpy as np

import flashnumba
from flashnumba import reference

if not flashnumba.SIMULATOR:
    import cupy

KERNELS = {"ieee": dict(precision="ieee"), "3xtf32": dict(kernel="3xtf32"), "tf32": dict(kernel="tf32")}


def max_err(a, b):
    return float(np.max(np.abs(np.asarray(a, np.float64) - b))) if np.size(b) else 0.0


def draw(rng, longest):
    seqlen_q, seqlen_k = (int(round(math.exp(rng.uniform(0, math.log(longest))))) for _ in range(2))
    return dict(batch=int(rng.integers(1, 3)), seqlen_q=seqlen_q, seqlen_k=seqlen_k, nheads=int(rng.integers(1, 5)),
                head_dim=int(rng.choice([64, 128])), causal=bool(rng.integers(0, 2)))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--draws", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--longest", type=int, default=4096, help="the longest seqlen drawn")
    p.add_argument("--kernels", nargs="+", default=list(KERNELS), choices=list(KERNELS))
    p.add_argument("--label", default="", help="a name for this run in the JSON")
    p.add_argument("--out", default=None, help="JSON file for the draws and the summary")
    a = p.parse_args(argv)
    rng = np.random.default_rng(a.seed)
    rows = []
    for n in range(a.draws):
        s = draw(rng, a.longest)
        shape_q = (s["batch"], s["seqlen_q"], s["nheads"], s["head_dim"])
        shape_k = (s["batch"], s["seqlen_k"], s["nheads"], s["head_dim"])
        q, k, v = (rng.standard_normal(sh).astype(np.float32) for sh in (shape_q, shape_k, shape_k))
        truth, _ = reference.attention_forward(q, k, v, causal=s["causal"])
        base, _ = reference.attention_forward(q, k, v, causal=s["causal"], dtype=np.float32)
        finite = np.isfinite(truth)
        base_err = max_err(base[finite], truth[finite])
        row = dict(s, float32_error=base_err)
        qd, kd, vd = (q, k, v) if flashnumba.SIMULATOR else (cupy.asarray(x) for x in (q, k, v))
        for name in a.kernels:
            out, _ = flashnumba.flash_attn_forward(qd, kd, vd, causal=s["causal"], **KERNELS[name])
            out = out.get() if hasattr(out, "get") else np.asarray(out)
            err = max_err(out[finite], truth[finite])
            row[f"{name}_error"] = err
            row[f"{name}_ratio"] = err / base_err if base_err else (0.0 if err == 0 else math.inf)
        rows.append(row)
        print(f"{n:4} b={s['batch']} {s['seqlen_q']:5}x{s['seqlen_k']:<5} h={s['nheads']} d={s['head_dim']:3} "
              f"causal={s['causal']!s:5} float32 {base_err:.3g}  "
              + "  ".join(f"{m} {row[m + '_ratio']:.2f}x" for m in a.kernels), flush=True)
    summary = {}
    for name in a.kernels:
        r = np.array([row[f"{name}_ratio"] for row in rows])
        summary[name] = dict(median=float(np.median(r)), p90=float(np.quantile(r, 0.9)), max=float(r.max()),
                             over_2x=int((r > 2).sum()))
        print(f"{name:7} ratio to float32's error: median {summary[name]['median']:.2f}x, p90 "
              f"{summary[name]['p90']:.2f}x, max {summary[name]['max']:.2f}x, over 2x: {summary[name]['over_2x']} "
              f"of {len(rows)}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(dict(label=a.label, seed=a.seed, draws=rows, summary=summary,
                           versions=dict(flashnumba=flashnumba.__version__, numpy=np.__version__)), f, indent=1)


if __name__ == "__main__":
    main()
