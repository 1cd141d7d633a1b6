"""Whether the assembler's figures survive CUDA's compute cache: the same kernel compiled in two fresh processes,
with ``CUDA_CACHE_DISABLE`` unset in their environment; each prints what one link without the toggle of
:func:`flashnumba._launch._jit_link` and then ``_launch.build``'s links report. The second process's links are
ones the cache has seen: with the cache serving them, the first line's log is empty, and the others' figures stay
known only if the toggle keeps the link out of the cache. On a GPU machine:

    python scripts/compile_log_check.py
"""

import os
import subprocess
import sys

CHILD = r"""
from numba import cuda
from flashnumba import _launch

def scale_in_place(a, factor):  # (the same source, so the same PTX and the same link, in both processes)
    i = cuda.grid(1)
    if i < a.size:
        a[i] *= factor

# the link without the environment toggle first (a cache hit in the second process: an empty log), then with it
from cuda.bindings import nvjitlink
ptx = _launch.compile_ptx(scale_in_place, "void(float32[::1], float32)", (9, 0, "a"))
_, raw = _launch._jit_link_once(nvjitlink, nvjitlink.InputType.PTX, ptx.encode(), ["-arch=sm_90a", "-verbose"], "link")
print("PTX assembled, the cache not kept out", len(raw), "bytes of log", _launch.resources_from_log(raw))
for whole in (False, True):
    cubin, log, ptx = _launch.build(scale_in_place, "void(float32[::1], float32)", (9, 0, "a"), None, whole)
    print("whole program" if whole else "PTX assembled", len(log), "bytes of log", _launch.resources_from_log(log))
"""

env = {k: v for k, v in os.environ.items() if k != "CUDA_CACHE_DISABLE"}
env.update(FLASHNUMBA_SIMULATOR="0", NUMBA_ENABLE_CUDASIM="0")
for run in ("first", "second"):
    out = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True)
    print(f"{run} process:\n{out.stdout}{out.stderr[-2000:] if out.returncode else ''}", flush=True)
