"""The scalar types the kernels cast with and make arrays of: ``float32(x)``, ``uint32(i)``, ``uint64(i)``, ...

On a GPU these are Numba's types: a cast in a kernel compiles to one conversion, and ``cuda.local.array(n,
float32)`` to registers. In the simulator a kernel runs as Python, and calling a Numba type goes through its
generic ``Type.__call__`` (an import and an abstract-class check on every call) before it reaches NumPy's scalar
constructor, which does the cast: index arithmetic such as ``OFF + uint64(j) * W`` in an inner loop spent about
half of a simulated thread's time there. In the simulator each type is therefore the same Numba type whose
``__call__`` is that constructor: the same values, the same 16-, 32- and 64-bit wrap-around,
the same errors, and still a Numba type where the simulator's ``cuda.local.array`` and ``cuda.shared.array``
read one as a dtype.
"""

from numba import float32, int32, int64, uint16, uint32, uint64
from numba.cuda.types import float16  # numba-cuda's own float16 (numba.types.float16 does not type in kernels)

from .._backend import SIMULATOR

__all__ = ["float16", "float32", "int32", "int64", "uint16", "uint32", "uint64"]


def _simulated(numba_type):
    """``numba_type`` with a direct cast: a subclass of its Numba class whose call is NumPy's constructor itself
    (no Python frame between; a call with a Numba type, a signature, is not a cast a kernel makes and fails)."""
    import numpy as np

    cast = staticmethod(getattr(np, numba_type.name))
    return type(f"Simulated{type(numba_type).__name__}", (type(numba_type),), {"__call__": cast})(numba_type.name)


if SIMULATOR:
    float16, float32, int32, int64, uint16, uint32, uint64 = (
        _simulated(t) for t in (float16, float32, int32, int64, uint16, uint32, uint64))
