"""Regenerate the tables of docs/benchmarks.md, docs/testing.md and README.md that come from docs/results/latest/
(latency.json, caps.json, train_tiny_gpt.json, bench.json, check-*.json): each replaces what stands between its
``<!-- NAME:begin -->`` and ``<!-- NAME:end -->`` markers.

    python scripts/update_docs_tables.py
"""

import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LATEST = ROOT / "docs" / "results" / "latest"


def _env(e, command=None):
    """The sentence of where, when and with what a table was measured; ``command``: the run's own record of its
    command line, where it keeps one (a script's; older environments named every command ``python -m flashnumba``)."""
    v = e["versions"]
    return (f"Measured on {e['device']}, {e['date'][:10]}; numba {v.get('numba')}, numba-cuda {v.get('numba-cuda')}, "
            f"numpy {v.get('numpy')}, CuPy {v.get('cupy')}, torch {v.get('torch')}. "
            f"Command: `{command or e['command']}`.")


def latency(d):
    shape = "x".join(map(str, d["shape"]))
    out = [_env(d["environment"]) + " Source: [`results/latest/latency.json`](results/latest/latency.json).", "",
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


# flashnumba's default path in a benchmark JSON, by dtype (runs made before `bench` had the "flashnumba" entry
# name the default kernels): and the peers shown beside it
DEFAULT_PATH = {"float16": ("flashnumba", "flashnumba_tc"), "float32": ("flashnumba", "flashnumba_v3")}
PEERS = {"float16": ("torch_sdpa_flash", "torch_sdpa_cudnn"), "float32": ("torch_sdpa_efficient", "standard_cupy")}
PEER_NAMES = {"torch_sdpa_flash": "FlashAttention-2 (torch)", "torch_sdpa_cudnn": "cuDNN (torch)",
              "torch_sdpa_efficient": "mem-efficient (torch)", "standard_cupy": "standard (CuPy)"}


def headline(d, dtype, source, prefix="docs/results/latest/", seqlen=4096, ours=None):
    """One dtype's headline: flashnumba's default kernels (or ``ours``) beside the peers, TFLOP/s at one seqlen."""
    rows = [r for r in d["rows"] if "ms" in r and r["seqlen"] == seqlen and r["dtype"] == dtype]
    ours = ours or next(i for i in DEFAULT_PATH[dtype] if any(r["impl"] == i for r in rows))
    peers = [p for p in PEERS[dtype] if any(r["impl"] == p for r in rows)]
    tf = {(r["impl"], r["head_dim"], r["causal"], r["pass_"]): r["tflops"] for r in rows}
    single = {(r["impl"], r["head_dim"], r["causal"], r["pass_"]): r["tflops_single"] for r in rows
              if "tflops_single" in r}
    e = d["environment"]
    timing = ("calls back to back" if d.get("group_ms") else "one call per pair of CUDA events (its host time on "
              "the clock)")
    if single:
        timing += "; after the slash, one call per pair of CUDA events"
    batch = 16384 // seqlen
    named = ours.startswith("flashnumba_") and ours not in DEFAULT_PATH[dtype]
    what = "kernels" if named else "default kernels on the run's date"  # (the defaults change; the run's stay)
    out = [f"{dtype}, seqlen {seqlen}, batch {batch}, heads = 2048 / head_dim, TFLOP/s; flashnumba's {what} "
           f"(`{ours}`). {e['device']}, {e['date'][:10]}, {timing}; source: "
           f"[`{prefix}{source}`]({prefix}{source}).", "",
           "| head_dim | causal | pass | flashnumba | " + " | ".join(PEER_NAMES[p] for p in peers) +
           " | flashnumba / " + PEER_NAMES[peers[0]].split(" (")[0] + " |",
           "| ---: | --- | --- | ---: | " + " | ".join("---:" for _ in peers) + " | ---: |"]
    order = {"fwd": 0, "bwd": 1, "fwd+bwd": 2}
    for (impl, hd, causal, pass_), value in sorted(tf.items(), key=lambda kv: (kv[0][1], kv[0][2], order[kv[0][3]])):
        if impl != ours:
            continue
        key = (impl, hd, causal, pass_)
        others = [tf.get((p, hd, causal, pass_)) for p in peers]
        ratio = f"{value / others[0]:.2f}" if others[0] else "-"
        cell = f"{value:.0f}"
        if single:  # both timing modes: "back to back / one call per sample"
            s_others = [single.get((p, hd, causal, pass_)) for p in peers]
            cell += f" / {single[key]:.0f}" if key in single else ""
            others = [f"{o:.0f} / {so:.0f}" if o is not None and so is not None else o
                      for o, so in zip(others, s_others)]
            if key in single and s_others[0]:
                ratio += f" / {single[key] / s_others[0]:.2f}"
        out.append(f"| {hd} | {'yes' if causal else 'no'} | {pass_} | {cell} | "
                   + " | ".join("-" if o is None else (o if isinstance(o, str) else f"{o:.0f}") for o in others)
                   + f" | {ratio} |")
    return out


def headlines(data, prefix="docs/results/latest/"):
    """float16 from the latest tensor-core run beside FlashAttention-2 and cuDNN (bench-tc.json, seqlen 4096 and
    16384), float32 from the full benchmark (bench.json)."""
    out = []
    for seqlen in (4096, 16384):
        out += headline(data["bench-tc.json"], "float16", "bench-tc.json", prefix, seqlen) + [""]
    out += headline(data["bench.json"], "float32", "bench.json", prefix)
    return out


def numerics(_data=None, prefix="results/latest/"):
    """The checker's reports (``python -m flashnumba check ... --per-dtype --out``: check-*.json): one row per
    implementation and dtype, one column per property: pass, FAIL (error / tolerance where measured), n/a; then
    each distinct failure's note once, with the smallest failing example."""
    paths = sorted(LATEST.glob("check-*.json"))
    reports = [json.loads(p.read_text()) for p in paths]
    if not reports:
        return ["(no report committed yet: `python -m flashnumba check TARGET ... --per-dtype --out "
                "docs/results/latest`)"]
    names = [res["name"] for res in reports[0]["results"]]
    out = ["| implementation | dtype | " + " | ".join(names) + " |",
           "| --- | --- | " + " | ".join("---" for _ in names) + " |"]
    notes = {}
    for r in reports:
        cells = []
        for name in names:
            res = next((x for x in r["results"] if x["name"] == name), None)
            if res is None or res["passed"] is None:
                cells.append("n/a")
            elif res["passed"]:
                cells.append("pass")
            else:
                key = (name, res["note"])
                notes.setdefault(key, (len(notes) + 1, res.get("example") or {}, []))[2].append(
                    f"{r['implementation']} {'/'.join(r['dtypes'])}")
                ratio = f" {res['ratio']:.3g}x" if res.get("tolerance") else ""
                cells.append(f"**FAIL**{ratio} [{notes[key][0]}]")
        out.append(f"| {r['implementation']} | {'/'.join(r['dtypes'])} | " + " | ".join(cells) + " |")
    out.append("")
    for (name, note), (i, example, where) in notes.items():
        ex = ", ".join(f"{k}={v}" for k, v in example.items())
        out.append(f"[{i}] {name}: {note}" + (f"; smallest example: {ex}" if ex else "") +
                   f" ({', '.join(where)}).")
        out.append("")
    files = ", ".join(f"[{p.name}]({prefix}{p.name})" for p in paths)
    return out + [f"Reports: {files}."]


def hopper(d, source, prefix="results/latest/"):
    """The Hopper kernels (kernel="wgmma") of one run beside FlashAttention-2 and cuDNN, float16 at seqlen 4096 and
    16384: the forward (bench-wgmma.json), the backward (bench-wgmma-bwd.json), both at the other head dims
    (bench-wgmma-head-dims.json)."""
    out = []
    for seqlen in (4096, 16384):
        out += headline(d, "float16", source, prefix, seqlen, ours="flashnumba_wgmma") + [""]
    return out[:-1]


def hopper_summary(d, prefix="docs/results/latest/"):
    """The README's line on the Hopper forward: its speed against FlashAttention-2, cuDNN and the mma.sync kernel
    over bench-wgmma.json's shapes (both timing modes against the peers)."""
    ours, span = _spans(d)
    dims = sorted({k[0] for k in ours})
    if any(r["impl"] == _mma_impl(d) for r in d["rows"]):
        mma = " and ".join(f"{span(_mma_impl(d), ('tflops',), h)} at head_dim {h}" for h in dims)
        mma = f"against the `mma.sync` kernel {mma}"
    else:  # (a run without the mma.sync kernel)
        mma = "the `mma.sync` kernel not in that run"
    if any(r["impl"] == "flashnumba_wgmma_cp_async" for r in d["rows"]):
        mma += (f"; the copy engine's tensor-map copies {span('flashnumba_wgmma_cp_async', ('tflops',))} the same "
                f"kernel's per-thread copies")
    tiles = {h: sorted({tuple(x[1:]) for k, r in ours.items() if k[0] == h for x in r.get("kernels", ())})
             for h in dims}  # (the rows of runs that record their kernels' tiles)
    if all(tiles.values()):
        mma += ", at tiles (block_m, block_n, threads) " + " and ".join(
            f"{' '.join(map(str, tiles[h]))} (head_dim {h})" for h in dims)
    env = d["environment"]
    return [f"- Hopper: a forward on warpgroup MMA with a producer warpgroup (tiles copied by the copy engine) and two "
            f"consumers taking turns "
            f"(`kernel=\"wgmma\"`, `kernel=None`'s on compute capability 9.0 at every multiple of 32 up to 256 "
            f"and, padded to the next, the other multiples of 8 from 40 (from 4096 keys); "
            f"`flashnumba/kernels/wgmma_forward.py`), correct on the H200 at "
            f"{span('torch_sdpa_flash')} FlashAttention-2's speed and {span('torch_sdpa_cudnn')} cuDNN's (both timing "
            f"modes), {mma} (float16 forward, seqlen 4096 and 16384, "
            f"{env['date'][:10]}: [bench-wgmma.json]({prefix}bench-wgmma.json); "
            f"{_section(prefix, 'How fast is the Hopper forward?')})."]


def padded(data, prefix="results/latest/"):
    """The Hopper kernels at head dims that are not multiples of 32, run padded to the next (flashnumba_wgmma),
    beside the mma.sync kernels at the head dim itself (flashnumba_tc) and FlashAttention-2, from the runs in
    ``data`` (file name: bench JSON), both timing modes."""
    rows, envs = {}, []
    for source, d in data.items():
        envs.append((source, d["environment"]))
        for r in d["rows"]:
            if r.get("tflops"):
                rows[(r["impl"], r["head_dim"], r["seqlen"], r["causal"], r["pass_"])] = r
    e = envs[0][1]
    out = [f"float16, batch 16384 / seqlen, heads 2048 / head_dim (rounded down), TFLOP/s of the caller's head dim "
           f"(the padded columns not counted); {e['device']}, {e['date'][:10]}, calls back to back / one call per "
           f"pair of CUDA events; sources: " + ", ".join(f"[`{s}`]({prefix}{s})" for s, _ in envs) + ".", "",
           "| head_dim (run as) | seqlen | causal | pass | Hopper, padded | mma.sync | FlashAttention-2 (torch) "
           "| Hopper / mma.sync | Hopper / FlashAttention-2 |",
           "| ---: | ---: | --- | --- | ---: | ---: | ---: | ---: | ---: |"]

    def two(r):
        return f"{r['tflops']:.0f} / {r['tflops_single']:.0f}"

    def ratio(a, b):
        return f"{a['tflops'] / b['tflops']:.2f} / {a['tflops_single'] / b['tflops_single']:.2f}"

    for key in sorted((k[1:] for k in rows if k[0] == "flashnumba_wgmma"), key=lambda k: (*k[:3], k[3] != "fwd")):
        hd, seqlen, causal, pass_ = key
        w, t, f = (rows.get((impl,) + key) for impl in ("flashnumba_wgmma", "flashnumba_tc", "torch_sdpa_flash"))
        if t is None or f is None:
            continue
        out.append(f"| {hd} ({-(-hd // 32) * 32}) | {seqlen} | {'yes' if causal else 'no'} | {pass_} | "
                   f"{two(w)} | {two(t)} | {two(f)} | {ratio(w, t)} | {ratio(w, f)} |")
    return out


def _spans(d):
    """span(peer, modes, head_dim): the range of flashnumba_wgmma's TFLOP/s over a peer's across d's rows."""
    rows = {(r["impl"], r["head_dim"], r["seqlen"], r["causal"]): r for r in d["rows"] if r.get("tflops")}
    ours = {k[1:]: r for k, r in rows.items() if k[0] == "flashnumba_wgmma"}

    def span(peer, modes=("tflops", "tflops_single"), head_dim=None):
        x = [ours[k][m] / rows[(peer,) + k][m] for k in ours for m in modes
             if (peer,) + k in rows and rows[(peer,) + k].get(m) and (head_dim is None or k[0] == head_dim)]
        return f"{min(x):.2f}-{max(x):.2f}x"

    return ours, span


def _mma_impl(d):
    """The mma.sync kernels' rows of a Hopper run: flashnumba_tc, or flashnumba in the runs made while it was the
    default on the H200."""
    return "flashnumba_tc" if any(r["impl"] == "flashnumba_tc" for r in d["rows"]) else "flashnumba"


def hopper_backward_summary(d, prefix="docs/results/latest/"):
    """The README's line on the Hopper backward, over bench-wgmma-bwd.json's shapes."""
    ours, span = _spans(d)
    dims = sorted({k[0] for k in ours})
    impl = _mma_impl(d)
    mma = (", against the `mma.sync` backward " + " and ".join(f"{span(impl, ('tflops',), h)} at head_dim {h}"
                                                               for h in dims)
           if any(r["impl"] == impl for r in d["rows"]) else "")  # (a run without the mma.sync rows: none)
    env = d["environment"]
    return [f"- Hopper backward: dQ and dK/dV kernels on warpgroup MMA, deterministic (`kernel=\"wgmma\"` for the "
            f"backward, `kernel=None`'s on compute capability 9.0 at every multiple of 32 up to 256 "
            f"and, padded to the next, the other multiples of 8 from 40 (from 4096 keys); "
            f"`flashnumba/kernels/wgmma_backward.py`), correct on the H200 at "
            f"{span('torch_sdpa_flash')} FlashAttention-2's speed and {span('torch_sdpa_cudnn')} cuDNN's (both timing "
            f"modes){mma} (float16, seqlen 4096 and 16384, {env['date'][:10]}: "
            f"[bench-wgmma-bwd.json]({prefix}bench-wgmma-bwd.json); "
            f"{_section(prefix, 'How fast is the Hopper backward?')}, which gives the later runs)."]


def _section(prefix, title):
    """A link to a section of docs/benchmarks.md from the file whose results are under ``prefix``."""
    anchor = "".join(c for c in title.lower() if c.isalnum() or c in " -").replace(" ", "-")
    return f"[docs/benchmarks.md, \"{title}\"]({prefix.replace('results/latest/', '')}benchmarks.md#{anchor})"


def decode(d, prefix="results/latest/"):
    """bench --decode: TB/s of K and V read per implementation and workload, both timing modes."""
    w = d["workload"]
    out = [_env(d["environment"]) + f" Source: [`bench-decode.json`]({prefix}bench-decode.json).", "",
           f"{w['dtype']}, {w['nheads']} query heads on {w['nheads_k']} key/value heads, head_dim {w['head_dim']}, "
           f"one query token per sequence; bytes of K and V read per second (back to back / one call per event "
           f"pair), and the fraction of the device-to-device copy rate measured in the same run "
           f"({d['copy_bandwidth_tb_s']:.2f} TB/s):", "",
           "| workload | implementation | TB/s back to back | TB/s one call a pair | of the copy rate | ms |",
           "| --- | --- | ---: | ---: | ---: | ---: |"]
    for r in d["rows"]:
        if "tb_s" not in r:
            out.append(f"| {r['workload']} | {r['impl']} | - | - | - | ({r.get('error', 'not run')}) |")
            continue
        out.append(f"| {r['workload']} | {r['impl']} | {r['tb_s']:.2f} | {r['tb_s_single']:.2f} | "
                   f"{r['copy_fraction']:.2f} | {r['ms']:.3f} |")
    return out


def flex(d, prefix="results/latest/"):
    """scripts/flex_bench.py: flex_attention's masks beside the built-in kernels and torch's FlexAttention."""
    out = [_env(d["environment"], d.get("command")) + f" Source: [`flex-bench.json`]({prefix}flex-bench.json).", "",
           "float16, batch = 16384 / seqlen, heads = 2048 / head_dim; ms of one call per pair of CUDA events, "
           "TFLOP/s of the entries the mask leaves (a backward counted as 2.5 forwards):", "",
           "| head_dim | seqlen | case | ms | TFLOP/s |", "| ---: | ---: | --- | ---: | ---: |"]
    for r in d["rows"]:
        if "ms" in r:
            out.append(f"| {r['head_dim']} | {r['seqlen']} | {r['case']} | {r['ms']:.3f} | {r['tflops']:.1f} |")
    out += ["", "Largest difference from FlexAttention in float32 on the same mask (flashnumba float16 / "
            "FlexAttention float16):", ""]
    for r in d["rows"]:
        if r["case"].startswith("max |out"):
            out.append(f"- d={r['head_dim']}, {r['case'][len('max |out - float32 flex| '):]}: {r['value']:.2e} / "
                       f"{r['torch_flex_value']:.2e}")
    grads = [r for r in d["rows"] if r["case"].startswith("max |grad")]
    if grads:
        out += ["", "Largest difference of dq, dk, dv from FlexAttention's float16 gradients on the same mask:", ""]
        out += [f"- d={r['head_dim']}, {r['case'][len('max |grad - torch flex grad| '):]}: {r['value']:.2e}"
                for r in grads]
    return out


def float32_tc(data, prefix="results/latest/"):
    """The float32 tensor-core forwards beside torch's memory-efficient float32 kernel (bench-tf32-d64.json, the
    3xTF32 forward at head_dim 64 re-reading Q_i; bench-tf32.json; the run of the 3xTF32 forward before its k-steps
    started from zero, bench-tf32-chained.json), and their error against the float64 truth as a multiple of NumPy's
    float32 attention's (scripts/tf32_error.py: tf32-error*.json)."""
    out = []
    for source, title in (("bench-tf32-d64.json", "head_dim 64 now"),
                          ("bench-tf32.json", "k-steps from zero (head_dim 64 then keeping Q_i in registers)"),
                          ("bench-tf32-chained.json", "before: 3xTF32 chaining its mma")):
        d = data[source]
        rows = {(r["impl"], r["head_dim"], r["seqlen"], r["causal"]): r for r in d["rows"] if r.get("tflops")}
        ours = sorted({k[0] for k in rows if k[0] != "torch_sdpa_efficient"})
        out += [f"**{title}**: " + _env(d["environment"]) + f" Source: [`{source}`]({prefix}{source}).", "",
                "TFLOP/s back to back / one call per event pair, and the ratio to torch's memory-efficient kernel "
                "(back to back):", "",
                "| head_dim | seqlen | causal | " + " | ".join(ours + ["torch_sdpa_efficient"]) + " |",
                "| ---: | ---: | --- |" + " ---: |" * (len(ours) + 1)]
        for key in sorted({k[1:] for k in rows}):
            peer = rows.get(("torch_sdpa_efficient",) + key)
            cells = []
            for impl in ours + ["torch_sdpa_efficient"]:
                r = rows.get((impl,) + key)
                cell = "-" if r is None else f"{r['tflops']:.1f} / {r.get('tflops_single', float('nan')):.1f}"
                if r is not None and peer is not None and impl != "torch_sdpa_efficient":
                    cell += f" ({r['tflops'] / peer['tflops']:.2f}x)"
                cells.append(cell)
            out.append(f"| {key[0]} | {key[1]} | {key[2]} | " + " | ".join(cells) + " |")
        out.append("")
    out += ["Error against the float64 truth as a multiple of NumPy's float32 attention's on the same inputs (max |O - "
            "O_float64| over the output; `python scripts/tf32_error.py`, random shapes, seqlen 1-4096; draws where "
            "float32 was exact, such as seqlen_k 1, are left out of the ratios and counted):", "",
            "| run | kernel | draws | median | 90th percentile | largest | over 2x | float32 exact |",
            "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for source, run in (("tf32-error.json", "now"), ("tf32-error-chained.json", "3xTF32 chaining its mma")):
        draws = data[source]["draws"]
        kernels = [k[:-len("_ratio")] for k in draws[0] if k.endswith("_ratio")]
        for name in kernels:
            r = sorted(x[f"{name}_ratio"] for x in draws if x["float32_error"] > 0)
            exact = [x[f"{name}_error"] for x in draws if x["float32_error"] == 0]
            q = lambda f: r[min(len(r) - 1, int(f * len(r)))]  # noqa: E731
            out.append(f"| [{run}]({prefix}{source}) | {name} | {len(r)} | {q(0.5):.2f}x | {q(0.9):.2f}x | "
                       f"{r[-1]:.2f}x | {sum(x > 2 for x in r)} | "
                       f"{len(exact)} (error up to {max(exact, default=0):.1e}) |")
    return out


def tf32_wgmma(d):
    """The 3xTF32 forward on wgmma (per-step accumulation) beside the mma.sync one and torch's memory-efficient
    float32 backend, TFLOP/s in both timing modes, ratios back to back (bench-3xtf32-wgmma-h100.json)."""
    rows = {(r["impl"], r["head_dim"], r["seqlen"], r["causal"]): r for r in d["rows"] if r.get("tflops")}
    out = ["| head_dim | seqlen | causal | 3xTF32 wgmma (per step) | 3xTF32 mma.sync | torch memory-efficient | "
           "wgmma / mma.sync | wgmma / torch |", "| ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: |"]
    for _, hd, seqlen, causal in sorted((k for k in rows if k[0] == "flashnumba_3xtf32_wgmma_per_step"),
                                        key=lambda k: (k[1], k[3], k[2])):
        w, m, t = (rows[(impl, hd, seqlen, causal)] for impl in ("flashnumba_3xtf32_wgmma_per_step",
                                                                  "flashnumba_3xtf32", "torch_sdpa_efficient"))
        two = " | ".join(f"{r['tflops']:.1f} / {r['tflops_single']:.1f}" for r in (w, m, t))
        out.append(f"| {hd} | {seqlen} | {'yes' if causal else 'no'} | {two} | {w['tflops'] / m['tflops']:.2f}x | "
                   f"{w['tflops'] / t['tflops']:.2f}x |")
    return out


TARGETS = {  # file: (marker name, table function, its arguments)
    "docs/benchmarks.md": [("latency", latency, {}), ("caps", caps, {}), ("train", train, {}),
                           ("headline", headlines, {"prefix": "results/latest/"}), ("decode", decode, {}),
                           ("flex", flex, {}), ("hopper", hopper, {"source": "bench-wgmma.json"}),
                           ("hopper-backward", hopper, {"source": "bench-wgmma-bwd.json"}),
                           ("hopper-head-dims", hopper, {"source": "bench-wgmma-head-dims.json"}),
                           ("float32-tc", float32_tc, {}), ("hopper-padded", padded, {}),
                           ("tf32-wgmma", tf32_wgmma, {})],
    "docs/testing.md": [("numerics", numerics, {})],
    "README.md": [("train", train, {"prefix": "docs/results/latest/"}), ("headline", headlines, {}),
                  ("hopper-summary", hopper_summary, {}), ("hopper-backward-summary", hopper_backward_summary, {})],
}
SOURCES = {"latency": "latency.json", "caps": "caps.json", "train": "train_tiny_gpt.json",
           "headline": ("bench.json", "bench-tc.json"), "numerics": None, "decode": "bench-decode.json",
           "flex": "flex-bench.json", "hopper": "bench-wgmma.json", "hopper-summary": "bench-wgmma.json",
           "hopper-backward": "bench-wgmma-bwd.json", "hopper-backward-summary": "bench-wgmma-bwd.json",
           "hopper-head-dims": "bench-wgmma-head-dims.json",
           "hopper-padded": ("bench-wgmma-padded-80-h100.json", "bench-wgmma-padded-h100.json"),
           "tf32-wgmma": "bench-3xtf32-wgmma-h100.json",
           "float32-tc": ("bench-tf32-d64.json", "bench-tf32.json", "bench-tf32-chained.json", "tf32-error.json",
                          "tf32-error-chained.json")}


def main():
    for rel, blocks in TARGETS.items():
        path = ROOT / rel
        text = path.read_text()
        for name, fn, kw in blocks:
            source = SOURCES[name]
            if isinstance(source, tuple):
                data = {f: json.loads((LATEST / f).read_text()) for f in source}
            else:
                data = json.loads((LATEST / source).read_text()) if source else None
            block = "\n".join(fn(data, **kw))
            text, n = re.subn(rf"<!-- {name}:begin -->.*?<!-- {name}:end -->",
                              lambda m: f"<!-- {name}:begin -->\n{block}\n<!-- {name}:end -->", text, flags=re.S)
            if n != 1:
                raise SystemExit(f"{rel}: no <!-- {name}:begin --> ... <!-- {name}:end --> markers")
        path.write_text(text)


if __name__ == "__main__":
    main()
