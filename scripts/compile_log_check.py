"""Whether the assembler's figures survive CUDA's compute cache: the same kernel compiled in three fresh processes,
each printing what ``_launch.build``'s two links (PTX assembled as one unit, and the whole program) report. The
first two start with ``CUDA_CACHE_DISABLE`` unset: the second's links are ones the cache has seen, and a link the
cache serves leaves the log empty (figures None). The third sets it itself before it imports numba, as the tests'
conftest does. On a GPU machine:

    python scripts/compile_log_check.py
"""

import os
import subprocess
import sys

CHILD = r"""
import os, sys
if sys.argv[1] == "set":
    os.environ["CUDA_CACHE_DISABLE"] = "1"
from numba import cuda
from flashnumba import _launch

def scale_in_place(a, factor):  # (the same source, so the same PTX and the same link, in every process)
    i = cuda.grid(1)
    if i < a.size:
        a[i] *= factor

for whole in (False, True):
    cubin, log, ptx = _launch.build(scale_in_place, "void(float32[::1], float32)", (9, 0, "a"), None, whole)
    print("  whole program" if whole else "  PTX assembled", len(log), "bytes of log", _launch.resources_from_log(log))
"""

env = {k: v for k, v in os.environ.items() if k != "CUDA_CACHE_DISABLE"}
env.update(FLASHNUMBA_SIMULATOR="0", NUMBA_ENABLE_CUDASIM="0")
for run, setting in (("first, unset", "unset"), ("second, unset", "unset"), ("third, set at its start", "set")):
    out = subprocess.run([sys.executable, "-c", CHILD, setting], env=env, capture_output=True, text=True)
    print(f"{run}:\n{out.stdout}{out.stderr[-2000:] if out.returncode else ''}", flush=True)
