"""flashnumba: FlashAttention as readable Numba ``cuda.jit`` kernels on CuPy arrays.

The kernels run on an NVIDIA GPU when there is one and in the Numba CUDA simulator when there is not (see
:mod:`flashnumba._backend`). Start from :mod:`flashnumba.reference` (NumPy), then :mod:`flashnumba.kernels`
(its docstring gives the reading order); which kernel runs with which tiles is :mod:`flashnumba.planner` and
:mod:`flashnumba.tiling`.
"""

from . import _backend  # first: chooses GPU or simulator before numba.cuda is imported
from ._backend import BACKEND, SIMULATOR
from . import config, reference, tiling
from .api import (
    attention_probs,
    clear_plan_cache,
    draw_dropout_seed,
    last_dropout_seed,
    plan,
    plan_backward,
    attention_with_grad,
    flash_attn_backward,
    flash_attn_forward,
    flash_attn_func,
    flash_attn_varlen_backward,
    flash_attn_varlen_forward,
    flash_attn_varlen_func,
    flex_attention,
    flex_attention_backward,
)
from .decode import flash_attn_with_kvcache
from .blockmask import BlockMask, create_block_mask
from .kernels.score_math import tanh_approx  # (for a score_mod: the Hopper kernels' softcap's tanh)

__version__ = "0.1.0"

__all__ = [
    "BACKEND",
    "SIMULATOR",
    "config",
    "reference",
    "flash_attn_forward",
    "flash_attn_func",
    "flash_attn_backward",
    "attention_with_grad",
    "attention_probs",
    "flash_attn_varlen_forward",
    "flash_attn_varlen_backward",
    "flash_attn_varlen_func",
    "flex_attention",
    "flex_attention_backward",
    "flash_attn_with_kvcache",
    "create_block_mask",
    "BlockMask",
    "tanh_approx",
    "plan",
    "plan_backward",
    "clear_plan_cache",
    "draw_dropout_seed",
    "last_dropout_seed",
    "tiling",
]


def __getattr__(name):
    """``flashnumba.check`` (the checker of attention implementations) and ``flashnumba.torch`` (the autograd
    functions) on first use: neither is imported with the package (``flashnumba.torch`` imports torch)."""
    if name in ("check", "torch"):
        import importlib

        try:
            return importlib.import_module(f".{name}", __name__)
        except ImportError as err:  # (an attribute that cannot be had: hasattr() says False; the import says why)
            raise AttributeError(f"flashnumba.{name} is not available: {err}") from err
    raise AttributeError(f"module 'flashnumba' has no attribute {name!r}")
