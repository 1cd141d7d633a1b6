"""Functions a user's score_mod may call that compile to the kernels' own instructions.

A score_mod is plain Python, and what it calls compiles as Numba compiles it: ``math.tanh`` on a float32 becomes
libdevice's ``tanhf``, about eighteen instructions a score (its exponential and reciprocal, a polynomial for small
arguments and two selects), where the built-in ``softcap`` of the Hopper kernels computes its tanh in about six. In
a tile loop that does little else per score the difference is several per cent of a kernel's time. :func:`tanh_approx`
is that tanh (``common.make_score_mod`` calls it for the Hopper kernels' softcap), offered to a score_mod:

    def softcap(score, b, h, q_idx, kv_idx):
        return 20.0 * tanh_approx(score * (1.0 / 20.0))

One function serves three places. In a kernel on the GPU it is ``ex2.approx`` and ``rcp.approx`` (a Numba
overload for the CUDA target). In the simulator a score is a NumPy float32, and on a float32 the function computes
the same formula with the stand-ins of those instructions (``ptx._sim_exp2_ftz``, ``_sim_rcp_approx``): the
simulator runs what the GPU runs. On a float64 (the float64 reference, ``flashnumba.reference``) it is NumPy's exact
tanh, the truth the kernels are compared with; on the GPU a float64 argument is float32's formula too.
"""

from __future__ import annotations

import math

import numpy as np

from . import ptx
from .._backend import SIMULATOR

TWO_LOG2E = np.float32(2.0 / math.log(2.0))  # exp(2 y) = 2^(2 y log2 e)


def tanh_approx(x):
    """tanh(x) as the Hopper kernels' softcap computes it: 1 - 2 / (2^(2 x log2 e) + 1), from ``ex2.approx.ftz``
    and ``rcp.approx.ftz``: about six instructions where ``math.tanh`` (libdevice's tanhf) takes about eighteen.

    Its error is absolute, within a few float32 ulps of 1 (about 3e-7), not relative: near 0, where tanh(x) is about
    x, a tiny x comes back to within that absolute error, not to float32's relative precision; large arguments give
    exactly +-1, NaN gives NaN. A softcap multiplies the result by the cap, whose scores then carry an absolute error
    of a few ulps of the cap, below float16's and bfloat16's rounding of the inputs.

    Called in a score_mod (``from flashnumba import tanh_approx``, or as ``flashnumba.tanh_approx``) it compiles
    into the kernels, where it takes any number as float32 and computes the formula. On the host it computes the
    same float32 formula on a NumPy float32 (a score in the simulator), a float16 or an integer (each made float32
    first, as the GPU does), and NumPy's exact tanh on a float64, a Python float or an array: the float64 reference
    (``flashnumba.reference`` at its default dtype) calls a score_mod with float64 scores. (A Python float that a
    score_mod makes in the simulator, ``math.sqrt(score)`` for example, is float64 here and float32 on the GPU: the
    simulator then computes this tanh exactly.)"""
    if isinstance(x, (float, np.float64, np.ndarray)):
        return np.tanh(x)
    x = np.float32(x)
    e = ptx._sim_exp2_ftz(x * TWO_LOG2E)
    return np.float32(np.float32(1.0) - np.float32(2.0) * ptx._sim_rcp_approx(e + np.float32(1.0)))


def _cuda_overloads():
    """:func:`tanh_approx` for the CUDA target: what a kernel compiles in its place."""
    from numba.core import errors, types
    from numba.cuda.extending import overload

    from .scalars import float32

    @overload(tanh_approx, target="cuda")
    def _tanh_approx(x):
        if not isinstance(x, (types.Float, types.Integer, types.Boolean)):
            raise errors.TypingError(f"flashnumba.tanh_approx takes one number (a score), not {x}")

        def impl(x):
            e = ptx.exp2_ftz(float32(x) * TWO_LOG2E)
            return float32(1.0) - float32(2.0) * ptx.rcp_approx(e + float32(1.0))

        return impl


if not SIMULATOR:
    _cuda_overloads()

# The functions here that a kernel calls as they are: a score_mod's device copy (common.as_device_function) keeps
# them, where it makes every other plain function it calls a device function of its own.
COMPILED = frozenset({tanh_approx})
