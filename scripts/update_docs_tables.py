"""Regenerate the tables of docs/benchmarks.md that come from docs/results/latest/ (latency.json, caps.json):
each replaces what stands between its ``<!-- NAME:begin -->`` and ``<!-- NAME:end -->`` markers.

    python scripts/update_docs_tables.py
"""

import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LATEST = ROOT / "docs" / "results" / "latest"


def _env(e):
    v = e["versions"]
    return (f"Measured on {e['device']}, {e['date'][:10]}; numba {v.get('numba')}, numba-cuda {v.get('numba-cuda')}, "
            f"numpy {v.get('numpy')}, CuPy {v.get('cupy')}, torch {v.get('torch')}. Command: `{e['command']}`.")


def latency(d):
    shape = "x".join(map(str, d["shape"]))
    out = [_env(d["environment"]) + f" Source: [`results/latest/latency.json`](results/latest/latency.json).", "",
           f"Per call, {shape} (batch x seqlen x heads x head_dim), {d['dtype']}, microseconds:", "",
           "| impl | pass | kernel | back to back | one call per event pair | host time | kernels alone |",
           "| --- | --- | --- | ---: | ---: | ---: | ---: |"]
    for r in d["per_call"]:
        k = r.get("kernels_us")
        out.append(f"| {r['impl']} | {r['pass_']} | {r['kernel']} | {r['back_to_back_us']:.1f} | "
                   f"{r['single_us']:.1f} | "
                   f"{r['host_us']:.1f} | {'-' if k is None else f'{k:.1f}'} |")
    out += ["", "The first forward and backward (causal, same shape) in a new process, seconds:", "",
            "| kernel cache | import flashnumba | first forward | first backward | kernels compiled (s) | loaded |",
            "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for r in d["first_call"]:
        comp = [k for k in r["kernels"] if not k["cached"]]
        out.append(f"| {r['cache']} | {r['import_s']:.2f} | {r['first_forward_s']:.2f} | {r['first_backward_s']:.2f} | "
                   f"{len(comp)} ({sum(k['seconds'] for k in comp):.1f}) | {len(r['kernels']) - len(comp)} |")
    return out


def caps(d):
    rows = d["rows"]
    base = {(r["dtype"], r["head_dim"], r["pass_"]): r["tflops"] for r in rows if r["cap"] is None}
    out = [_env(d["environment"]) + " Source: [`results/latest/caps.json`](results/latest/caps.json).", "",
           f"seqlen {d['seqlen']}, batch = 16384 / seqlen, heads = 2048 / head_dim, non-causal; TFLOP/s of calls "
           "back to back:", "",
           "| shared memory cap (bytes) | dtype | head_dim | pass | kernel | tiles | TFLOP/s | vs no cap |",
           "| --- | --- | ---: | --- | --- | --- | ---: | ---: |"]
    for r in rows:
        rel = r["tflops"] / base[(r["dtype"], r["head_dim"], r["pass_"])]
        out.append(f"| {r['cap'] or 'none (227 KB)'} | {r['dtype']} | {r['head_dim']} | {r['pass_']} | {r['kernel']} | "
                   f"{r['tiles']} | {r['tflops']:.1f} | {rel:.2f} |")
    return out


def main():
    path = ROOT / "docs" / "benchmarks.md"
    text = path.read_text()
    for name, fn in (("latency", latency), ("caps", caps)):
        data = json.loads((LATEST / f"{name}.json").read_text())
        block = "\n".join(fn(data))
        text, n = re.subn(rf"<!-- {name}:begin -->.*?<!-- {name}:end -->",
                          lambda m: f"<!-- {name}:begin -->\n{block}\n<!-- {name}:end -->", text, flags=re.S)
        if n != 1:
            raise SystemExit(f"docs/benchmarks.md: no <!-- {name}:begin --> ... <!-- {name}:end --> markers")
    path.write_text(text)


if __name__ == "__main__":
    main()
