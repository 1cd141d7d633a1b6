"""Execute notebooks in place without a Jupyter kernel, recording their outputs as Jupyter would.

    python scripts/run_notebook.py notebooks/02_block_sizes.ipynb [...]

For machines without jupyter/nbclient (the GPU machine): code cells run in order in one namespace; each cell's
stdout and stderr become ``stream`` outputs, the value of a final expression an ``execute_result`` (none where
the cell ends in ";"), and every matplotlib figure left open a ``display_data`` PNG (as the inline backend shows
them). A cell that raises records the traceback as an ``error`` output, and the script stops there and exits
non-zero (as nbclient does).
"""

from __future__ import annotations

import ast
import base64
import contextlib
import io
import json
import os
import sys
import time
import traceback

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def _figures():
    outputs = []
    for num in plt.get_fignums():
        buf = io.BytesIO()
        plt.figure(num).savefig(buf, format="png", bbox_inches="tight", dpi=80)
        outputs.append({"output_type": "display_data", "metadata": {},
                        "data": {"image/png": base64.b64encode(buf.getvalue()).decode(), "text/plain": ["<Figure>"]}})
    plt.close("all")
    return outputs


def _stream(name, text):
    return {"output_type": "stream", "name": name, "text": text.splitlines(keepends=True)}


def run(path):
    with open(path) as f:
        nb = json.load(f)
    namespace = {"__name__": "__main__"}
    count, ok = 0, True
    for cell in nb["cells"]:
        if cell["cell_type"] != "code":
            continue
        count += 1
        source = "".join(cell["source"])
        out, err, outputs, result = io.StringIO(), io.StringIO(), [], None
        t0 = time.time()
        try:
            tree = ast.parse(source)
            last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                exec(compile(tree, f"<cell {count}>", "exec"), namespace)
                if last is not None:
                    result = eval(compile(ast.Expression(last.value), f"<cell {count}>", "eval"), namespace)
        except Exception as e:  # noqa: BLE001
            ok = False
            tb = traceback.format_exception(type(e), e, e.__traceback__)
            outputs_error = {"output_type": "error", "ename": type(e).__name__, "evalue": str(e), "traceback": tb}
        if out.getvalue():
            outputs.append(_stream("stdout", out.getvalue()))
        if err.getvalue():
            outputs.append(_stream("stderr", err.getvalue()))
        outputs.extend(_figures())
        if result is not None and ok and not source.rstrip().endswith(";"):  # (a final ";" hides it, as in Jupyter)
            outputs.append({"output_type": "execute_result", "execution_count": count, "metadata": {},
                            "data": {"text/plain": repr(result).splitlines(keepends=True)}})
        if not ok:
            outputs.append(outputs_error)
        cell["outputs"], cell["execution_count"] = outputs, count
        print(f"{path}: cell {count} {'ok' if ok else 'FAILED'} in {time.time() - t0:.1f} s", flush=True)
        _write(nb, path)  # after every cell: a run cut short keeps what it computed
        if not ok:
            print("".join(outputs_error["traceback"]), file=sys.stderr)
            break
    _write(nb, path)
    return ok


def _write(nb, path):
    with open(path, "w") as f:
        json.dump(nb, f, indent=1, ensure_ascii=False)
        f.write("\n")


if __name__ == "__main__":
    paths = sys.argv[1:]
    missing = [p for p in paths if not os.path.isfile(p)]
    if not paths or missing:
        gone = f"; not found: {', '.join(missing)}" if missing else ""
        print(f"usage: python scripts/run_notebook.py NOTEBOOK.ipynb ...{gone}", file=sys.stderr)
        sys.exit(2)
    sys.exit(0 if all([run(p) for p in paths]) else 1)
