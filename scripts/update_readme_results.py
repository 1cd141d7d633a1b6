"""Regenerate the README's results tables from committed benchmark JSON files.

    python scripts/update_readme_results.py docs/results/RUN1.json:4096 docs/results/RUN2.json:1024,4096:float16:128

One table per file, in the order given, of its rows of one dtype (after the second colon; float32 when none is
given) at the listed seqlens (after the first colon; all when none are listed) and head dims (after the third
colon; all when none are listed). Replaces what stands between the
README's `<!-- results:begin -->` and `<!-- results:end -->` markers.
"""

import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def markdown(result, source, seqlens=None, dtype="float32", head_dims=None):
    env = result["environment"]
    v = env["versions"]
    rows = [r for r in result["rows"] if "ms" in r and r["dtype"] == dtype  # the full table: docs/
            and (not seqlens or r["seqlen"] in seqlens) and (not head_dims or r["head_dim"] in head_dims)]
    std = {(r["dtype"], r["head_dim"], r["seqlen"], r["causal"], r["pass_"]): r["ms"]
           for r in rows if r["impl"] == "standard_cupy"}
    at_dims = " at head_dim " + ", ".join(map(str, sorted(head_dims))) if head_dims else ""
    group = result.get("group_ms", 0)  # runs before --group-ms timed one call per sample
    timing = (f"median of 10 samples of calls back to back (about {group:g} ms each), CUDA events" if group else
              "median of 10 runs (one call between two CUDA events)")
    lines = [
        f"Measured on {env['device']}, {env['date'][:10]}; numba {v.get('numba')}, numba-cuda {v.get('numba-cuda')}, "
        f"numpy {v.get('numpy')}, CuPy {v.get('cupy-cuda13x') or v.get('cupy')}, torch {v.get('torch')}. "
        f"Command: `{env['command']}`. Source: [`{source}`]({source}). Workload: batch = 16384 / seqlen, "
        f"heads = 2048 / head_dim; {timing}. {dtype} rows{at_dims}; the rest and the "
        f"analysis are in "
        f"[docs/benchmarks.md](docs/benchmarks.md).",
        "",
        "| impl | dtype | head_dim | seqlen | causal | pass | ms | TFLOP/s | x standard | peak extra MiB |",
        "| --- | --- | ---: | ---: | --- | --- | ---: | ---: | ---: | ---: |",
    ]
    for r in sorted(rows, key=lambda r: (r["head_dim"], r["seqlen"], r["causal"],
                                         r["pass_"], -r["tflops"])):
        s = std.get((r["dtype"], r["head_dim"], r["seqlen"], r["causal"], r["pass_"]))
        x = f"{s / r['ms']:.2f}" if s else "-"
        lines.append(f"| {r['impl']} | {r['dtype']} | {r['head_dim']} | {r['seqlen']} | {r['causal']} | "
                     f"{r['pass_']} | {r['ms']:.2f} | {r['tflops']:.1f} | {x} | {r['peak_bytes'] / 2**20:.0f} |")
    return "\n".join(lines)


def main(specs):
    blocks = []
    for spec in specs:
        path, _, rest = spec.partition(":")
        which, _, rest = rest.partition(":")
        dtype, _, dims = rest.partition(":")
        seqlens = {int(n) for n in which.split(",")} if which else None
        head_dims = {int(n) for n in dims.split(",")} if dims else None
        result = json.loads(Path(path).read_text())
        blocks.append(markdown(result, Path(path).resolve().relative_to(ROOT).as_posix(), seqlens, dtype or "float32",
                               head_dims))
    readme = ROOT / "README.md"
    text = readme.read_text()
    block = "\n\n".join(blocks)
    new, n = re.subn(r"(<!-- results:begin -->\n).*?(<!-- results:end -->)",
                     lambda m: m.group(1) + block + "\n" + m.group(2), text, flags=re.S)
    if n != 1:
        sys.exit("README.md has no <!-- results:begin --> ... <!-- results:end --> block")
    readme.write_text(new)


if __name__ == "__main__":
    main(sys.argv[1:])
