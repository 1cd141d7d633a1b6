"""Regenerate the tables of docs/benchmarks.md and README.md that come from docs/results/latest/ (latency.json,
caps.json, train_tiny_gpt.json): each replaces what stands between its ``<!-- NAME:begin -->`` and
``<!-- NAME:end -->`` markers.

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


def train(d, prefix="results/latest/"):
    """The training comparison of examples/train_tiny_gpt.py: tokens/s, the last window's loss, the largest
    windowed gap to sdpa of flashnumba and of the reference ensemble, the tolerance and the verdict."""
    a = d["args"]
    out = [f"Measured on {d['device']}, {d['date']}; torch {d['torch']}, flashnumba {d['flashnumba']}. Command: "
           f"`python examples/train_tiny_gpt.py` ({a['steps']} steps, batch {a['batch']} x {a['context']} bytes, "
           f"AdamW lr {a['lr']}, {a['perturbed']} perturbed sdpa runs, {a['window']}-step means). Source: "
           f"[`{prefix}train_tiny_gpt.json`]({prefix}train_tiny_gpt.json).", "",
           "| dtype | attention | tokens/s | mean loss, last window | largest windowed gap to sdpa | tolerance | "
           "verdict |", "| --- | --- | ---: | ---: | ---: | ---: | --- |"]
    w = a["window"]
    for dtype, runs in d["runs"].items():
        v = d["verdict"].get(dtype, {})
        refs = v.get("reference_gaps", {})
        for kind in ("flashnumba", "sdpa", "sdpa-math"):
            if kind not in runs:
                continue
            r = runs[kind]
            last = sum(r["losses"][-w:]) / len(r["losses"][-w:])
            gap = v.get("max_gap_flashnumba_sdpa") if kind == "flashnumba" else refs.get(kind)
            verdict = ("agree" if v.get("agree") else "disagree") if kind == "flashnumba" and v else ""
            tol = f"{v['tolerance']:.4f}" if kind == "flashnumba" and v else ""
            out.append(f"| {dtype} | {kind} | {r['tokens_per_s']:,.0f} | {last:.4f} | "
                       f"{'-' if gap is None else f'{gap:.4f}'} | {tol} | {verdict} |")
    return out


TARGETS = {  # file: (marker name, table function, its arguments)
    "docs/benchmarks.md": [("latency", latency, {}), ("caps", caps, {}), ("train", train, {})],
    "README.md": [("train", train, {"prefix": "docs/results/latest/"})],
}
SOURCES = {"latency": "latency.json", "caps": "caps.json", "train": "train_tiny_gpt.json"}


def main():
    for rel, blocks in TARGETS.items():
        path = ROOT / rel
        text = path.read_text()
        for name, fn, kw in blocks:
            data = json.loads((LATEST / SOURCES[name]).read_text())
            block = "\n".join(fn(data, **kw))
            text, n = re.subn(rf"<!-- {name}:begin -->.*?<!-- {name}:end -->",
                              lambda m: f"<!-- {name}:begin -->\n{block}\n<!-- {name}:end -->", text, flags=re.S)
            if n != 1:
                raise SystemExit(f"{rel}: no <!-- {name}:begin --> ... <!-- {name}:end --> markers")
        path.write_text(text)


if __name__ == "__main__":
    main()
