"""Choose where the kernels run, before ``numba.cuda`` is first imported.

Numba decides once, when ``numba.cuda`` is imported, whether ``cuda.jit`` compiles real kernels or runs them in
the CUDA simulator (``NUMBA_ENABLE_CUDASIM=1``: one Python thread per CUDA thread). flashnumba makes that choice
for the user:

* ``FLASHNUMBA_SIMULATOR=1`` (or ``NUMBA_ENABLE_CUDASIM=1``) forces the simulator;
* ``FLASHNUMBA_SIMULATOR=0`` forces the real GPU backend (and fails loudly if there is none);
* otherwise the CUDA driver is asked, through ``ctypes``, whether it sees a device; if not, the simulator.

If ``numba.cuda`` was imported before flashnumba, its choice stands and is reported as it is.

Two compatibility shims live here, applied before Numba compiles anything:

* numba-cuda 0.30 calls ``numpy.row_stack``, which numpy 2.5 removed; where it is missing it is aliased to
  ``numpy.vstack`` (the function it always was).
* ``math.exp2`` appeared in Python 3.11; under the simulator on Python 3.10 the kernels' ``math.exp2`` calls are
  served by ``2.0 ** x``.
"""

from __future__ import annotations

import ctypes
import math
import os
import sys

import numpy as np

if not hasattr(np, "row_stack"):  # numpy >= 2.5 removed it; numba-cuda 0.30.4 still calls it
    np.row_stack = np.vstack


def _driver_sees_a_gpu() -> tuple[bool, str]:
    """Ask libcuda directly (no numba import) whether a CUDA device is usable."""
    for name in ("libcuda.so.1", "libcuda.so", "nvcuda.dll", "libcuda.dylib"):
        try:
            lib = ctypes.CDLL(name)
            break
        except OSError:
            continue
    else:
        return False, "no CUDA driver library found"
    if lib.cuInit(0) != 0:
        return False, "cuInit failed"
    count = ctypes.c_int(0)
    if lib.cuDeviceGetCount(ctypes.byref(count)) != 0 or count.value == 0:
        return False, "the CUDA driver reports no device"
    return True, f"{count.value} CUDA device(s)"


def _choose() -> tuple[bool, str]:
    """Return (use_simulator, reason) and set NUMBA_ENABLE_CUDASIM accordingly."""
    if "numba.cuda" in sys.modules:
        from numba.cuda.core import config as cuda_config  # already decided

        sim = bool(cuda_config.ENABLE_CUDASIM)
        return sim, "numba.cuda was imported before flashnumba"
    forced = os.environ.get("FLASHNUMBA_SIMULATOR", "").strip()
    if forced not in ("", "0", "1"):
        raise ValueError(f"FLASHNUMBA_SIMULATOR must be '0' or '1', got {forced!r}")
    if forced == "1" or os.environ.get("NUMBA_ENABLE_CUDASIM", "0") not in ("", "0"):
        sim, reason = True, "simulator requested by the environment"
    elif forced == "0":
        sim, reason = False, "GPU backend requested by FLASHNUMBA_SIMULATOR=0"
    else:
        ok, why = _driver_sees_a_gpu()
        sim, reason = (not ok), why
    os.environ["NUMBA_ENABLE_CUDASIM"] = "1" if sim else "0"
    return sim, reason


SIMULATOR, REASON = _choose()

if SIMULATOR:
    if not hasattr(math, "exp2"):  # Python 3.10: the simulator runs the kernels' math calls in Python
        math.exp2 = lambda x: 2.0**x
    print(
        f"flashnumba: running kernels in the Numba CUDA simulator ({REASON}); this is slow, use small shapes.",
        file=sys.stderr,
    )

from numba import cuda  # noqa: E402  (must come after the choice above)

BACKEND = "simulator" if SIMULATOR else "cuda"


def device_name() -> str:
    if SIMULATOR:
        return "Numba CUDA simulator (no GPU)"
    dev = cuda.get_current_device()
    cc = dev.compute_capability
    return f"{dev.name.decode() if isinstance(dev.name, bytes) else dev.name} (compute capability {cc[0]}.{cc[1]})"


def versions() -> dict:
    """Versions of the packages flashnumba runs on (None where a package is not installed)."""
    from importlib import metadata

    out = {"python": sys.version.split()[0]}
    for pkg in ("numpy", "numba", "numba-cuda", "cuda-bindings"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            out[pkg] = None
    # CuPy is published under several names (cupy, cupy-cuda12x, cupy-cuda13x): report whichever is installed
    out["cupy"] = None
    for pkg in ("cupy", "cupy-cuda13x", "cupy-cuda12x"):
        try:
            out["cupy"] = f"{metadata.version(pkg)} ({pkg})"
            break
        except metadata.PackageNotFoundError:
            continue
    return out
