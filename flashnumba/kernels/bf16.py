"""bfloat16 <-> float32, bit by bit, as device functions.

Numba has no bfloat16 array type, so bfloat16 data reaches the kernels as ``uint16`` arrays holding the bit
patterns, and every load and store converts. bfloat16 is the upper half of a float32::

    float32   s eeeeeeee mmmmmmm mmmmmmmmmmmmmmmm     sign 1, exponent 8 (bias 127), mantissa 23 bits
    bfloat16  s eeeeeeee mmmmmmm                      sign 1, exponent 8 (bias 127), mantissa 7 bits

* bfloat16 -> float32 is exact: the 16 bits become the upper half of a float32 whose lower half is zero.
* float32 -> bfloat16 drops the lower 16 bits, rounding to nearest, ties to even, as the hardware's
  ``cvt.rn.bf16.f32`` does: add 0x7FFF plus the lowest kept bit, then shift. Values past the largest
  bfloat16 round to +-inf and subnormals round like any other value (no flush to zero). A NaN becomes the
  quiet NaN 0x7FC0 with its sign, as in ml_dtypes (NumPy's bfloat16); rounding it could carry its payload
  into the exponent and make it an infinity. (Which NaN is a convention: CUDA's own software conversion
  gives 0x7FFF.)

The kernel factories choose their conversions when a kernel is built (:func:`load_store`): bfloat16 kernels
get the two functions below, float32 and float16 kernels a plain ``float32(x)`` and an identity, inlined, so
that they compile to the same code as without this module.

Reinterpreting a float32's bits as an integer is one ``mov`` on the GPU (libdevice's ``float_as_int`` and
``int_as_float``). The CUDA simulator has no libdevice, so there the same reinterpretation goes through a
NumPy scalar view; everything else below runs unchanged in both.
"""

from __future__ import annotations

import numpy as np
from .scalars import float32, int32, uint16, uint32

from .._backend import SIMULATOR, cuda

if SIMULATOR:

    @cuda.jit(device=True)
    def _bits_to_float(bits):
        """The float32 whose bit pattern is the low 32 bits of ``bits``."""
        return np.uint32(int(bits) & 0xFFFFFFFF).view(np.float32)

    @cuda.jit(device=True)
    def _float_to_bits(x):
        """The bit pattern of float32 ``x``, as a uint32."""
        return np.float32(x).view(np.uint32)

else:
    from numba.cuda import libdevice

    @cuda.jit(device=True)
    def _bits_to_float(bits):
        """The float32 whose bit pattern is the low 32 bits of ``bits`` (one ``mov.b32``)."""
        return libdevice.int_as_float(int32(bits))

    @cuda.jit(device=True)
    def _float_to_bits(x):
        """The bit pattern of float32 ``x``, as a uint32 (one ``mov.b32``)."""
        return uint32(libdevice.float_as_int(x))


@cuda.jit(device=True)
def bf16_to_float32(x):
    """float32 of the bfloat16 with bit pattern ``x`` (uint16, or int16 holding the same bits): exact."""
    return _bits_to_float((uint32(x) & 0xFFFF) << 16)


@cuda.jit(device=True)
def float32_to_bf16(x):
    """The bit pattern (uint16) of float32 ``x`` rounded to bfloat16, to nearest, ties to even."""
    bits = _float_to_bits(x)
    if (bits & 0x7FFFFFFF) > 0x7F800000:  # NaN: the quiet NaN, sign kept
        return uint16(((bits >> 16) & 0x8000) | 0x7FC0)
    lsb = (bits >> 16) & 1  # the lowest bit that is kept: ties go to where it is 0
    # A carry out of the mantissa raises the exponent (to inf at most); the sum fits in 32 bits (NaN excluded).
    return uint16(uint32(bits + 0x7FFF + lsb) >> 16)


@cuda.jit(device=True, inline="always")
def _load_float(x):
    """float32 or float16 element -> float32 (a no-op or the hardware conversion)."""
    return float32(x)


@cuda.jit(device=True, inline="always")
def _store_float(x):
    """float32 -> float32 or float16: the array store converts (round to nearest even)."""
    return x


def load_store(bf16: bool):
    """(load, store) for a kernel factory: ``load(a[idx])`` gives a float32, ``a[idx] = store(x)`` writes the
    float32 ``x`` in the array's element type. bfloat16 arrays are uint16 bit patterns."""
    if bf16:
        return bf16_to_float32, float32_to_bf16
    return _load_float, _store_float
