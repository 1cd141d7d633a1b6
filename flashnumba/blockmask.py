"""Block masks: a mask_mod classified block by block, so that :func:`flashnumba.flex_attention` skips the
blocks it hides entirely and runs those it shows entirely without evaluating it (FlexAttention's
``create_block_mask``).

A :class:`BlockMask` holds, per batch entry, head and query block of ``Q_BLOCK_SIZE`` rows, the key blocks of
``KV_BLOCK_SIZE`` rows that are not empty (``kv_num_blocks``, ``kv_indices``, ascending), per key block the query
blocks that are not empty (``q_num_blocks``, ``q_indices``: the same pairs, listed the other way round for the
backward's dK/dV kernel, which loops over the queries of its keys), and each block's state (``state``: EMPTY 0,
PARTIAL 1, FULL 2, as :func:`flashnumba.reference.flex_block_mask`). The tensor-core kernels, forward and
backward, read them: they visit only the listed blocks, and evaluate the mask_mod only in the partial ones.
Elsewhere (the SIMT kernels) the mask_mod is evaluated at every entry, as without a block mask: the same result,
without the savings.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from . import _arrays
from ._backend import SIMULATOR, cuda
from ._validate import check_mods, inspect, mod_args_tuple
from .kernels.block_mask import THREADS, make_classify
from .kernels.common import refuse_broken


@dataclass(frozen=True)
class BlockMask:
    """The blocks of a mask_mod (see the module docstring). Arrays on the device of the q it was made for (NumPy
    in the simulator); B and H may be 1 (the same mask for every batch entry or head)."""

    mask_mod: Any
    score_mod_args: tuple
    seq_lengths: tuple  # (Q_LEN, KV_LEN)
    Q_BLOCK_SIZE: int
    KV_BLOCK_SIZE: int
    kv_num_blocks: Any  # (B, H, query blocks) int32
    kv_indices: Any  # (B, H, query blocks, key blocks) int32: the non-empty key blocks first, ascending
    state: Any  # (B, H, query blocks, key blocks) int8
    q_num_blocks: Any  # (B, H, key blocks) int32
    q_indices: Any  # (B, H, key blocks, query blocks) int32: the non-empty query blocks first, ascending

    @classmethod
    def unclassified(cls, mask_mod, score_mod_args, seq_lengths, q_block, kv_block) -> "BlockMask":
        """A block mask of the shapes :func:`create_block_mask` gives for one batch entry and head, NumPy zeros in its
        lists (no block classified): to plan and compile a call without a GPU, where a plan reads only the blocks'
        sizes and the arrays' shapes (classifying takes a kernel: a GPU, or the simulator)."""
        nq, nk = -(-seq_lengths[0] // q_block), -(-seq_lengths[1] // kv_block)
        by_query, by_key = np.zeros((1, 1, nq, nk), np.int32), np.zeros((1, 1, nk, nq), np.int32)
        return cls(mask_mod, tuple(score_mod_args), tuple(seq_lengths), q_block, kv_block, by_query[..., 0].copy(),
                   by_query, by_query.astype(np.int8), by_key[..., 0].copy(), by_key)

    def density(self) -> float:
        """The fraction of (query block, key block) pairs that are not empty."""
        num = _arrays.to_host(self.kv_num_blocks)
        return float(num.sum()) / max(1, int(np.prod(self.state.shape)))

    def __repr__(self):
        return (f"BlockMask(mask_mod={getattr(self.mask_mod, '__name__', '?')}, shape={tuple(self.state.shape)}, "
                f"blocks=({self.Q_BLOCK_SIZE}, {self.KV_BLOCK_SIZE}), density={self.density():.3f})")


def create_block_mask(mask_mod, B, H, Q_LEN, KV_LEN, *, score_mod_args: tuple = (), BLOCK_SIZE=128,
                      like=None) -> BlockMask:
    """Classify ``mask_mod(b, h, q_idx, kv_idx, *score_mod_args)`` in blocks of ``BLOCK_SIZE`` (an int, or
    (query rows, key rows)) for B batch entries and H heads (1 or None: the same for all) of Q_LEN queries and KV_LEN
    keys, evaluating it on the device (one kernel, every entry once). ``like``: an array on the side to use (q), else
    that of the first array of score_mod_args (NumPy ones: the result in NumPy), else CuPy's current device. Pass
    the result to :func:`flashnumba.flex_attention` (``block_mask=``) with the same mask_mod and score_mod_args.
    """
    if not callable(mask_mod):
        raise TypeError(f"mask_mod must be a function (b, h, q_idx, kv_idx, *score_mod_args) -> bool, got "
                        f"{type(mask_mod).__name__}")
    if isinstance(BLOCK_SIZE, (int, np.integer)):
        qb = kb = BLOCK_SIZE
    elif isinstance(BLOCK_SIZE, (tuple, list, np.ndarray)) and len(BLOCK_SIZE) == 2:
        qb, kb = BLOCK_SIZE
    else:
        raise ValueError(f"BLOCK_SIZE must be an int or a pair (query rows, key rows), got {BLOCK_SIZE!r}")
    B, H = (1 if n is None else n for n in (B, H))  # (None: the same for every batch entry / head, as FlexAttention)
    for name, n in (("B", B), ("H", H), ("Q_LEN", Q_LEN), ("KV_LEN", KV_LEN), ("BLOCK_SIZE", qb), ("BLOCK_SIZE", kb)):
        if not isinstance(n, (int, np.integer)) or isinstance(n, bool) or n < 1:
            raise ValueError(f"{name} must be a positive int, got {n!r}")
    if qb % 16 or kb % 16:
        raise ValueError(f"BLOCK_SIZE must be multiples of 16 (the kernels' tiles divide it), got ({qb}, {kb})")
    args = mod_args_tuple(score_mod_args)
    source = "like"
    if like is None and args:  # the arrays the mask reads say where it lives (NumPy ones: on the host)
        like, source = args[0], "score_mod_args[0]"
    if like is not None and (isinstance(like, np.generic) or not hasattr(like, "reshape")):
        raise TypeError(f"{source} must be an array, got {type(like).__name__}")
    if like is None:
        like = np.zeros((1, 1, 1, 1), np.float32) if SIMULATOR or _arrays.cupy is None else \
            _arrays.cupy.zeros((1, 1, 1, 1), np.float32)
    tq = inspect("like", like if getattr(like, "ndim", 0) == 4 else like.reshape(1, 1, 1, -1), 4)
    mods, targs = check_mods(tq, tq, None, None, mask_mod, args, True)
    nq, nk = -(-Q_LEN // qb), -(-KV_LEN // kb)
    xp = np if SIMULATOR or tq.kind == "numpy" or _arrays.cupy is None else _arrays.cupy
    state = xp.zeros((B, H, nq, nk), np.int8)
    kernel_args = [t.array for t in targs] + [xp.zeros(1, np.float32)] * (4 - len(targs))
    launch = make_classify(mods, qb, kb)[(nq, nk, B * H), (THREADS,)]

    def classify():
        if xp is np and not SIMULATOR:  # NumPy arrays on a GPU: copied there and back once, explicitly
            dev = cuda.to_device(state)
            launch(dev, Q_LEN, KV_LEN, *[cuda.to_device(a) if isinstance(a, np.ndarray) else a for a in kernel_args])
            return dev.copy_to_host()
        launch(state, Q_LEN, KV_LEN, *kernel_args)
        return state

    from numba.core.errors import NumbaError

    # (the kernel compiles at its first launch: a mask_mod Numba cannot type, or one returning no bool, is refused)
    state = refuse_broken(mods, "create_block_mask", classify, NumbaError)
    num, order = _lists(state, xp)
    q_num, q_order = _lists(xp.ascontiguousarray(state.transpose(0, 1, 3, 2)), xp)
    return BlockMask(mask_mod, args, (Q_LEN, KV_LEN), qb, kb, num, order, state, q_num, q_order)


def _lists(state, xp):
    """(counts, indices) of the non-empty blocks along state's last axis: their number, and their indices first,
    ascending (the empty ones after them)."""
    n = state.shape[-1]
    key = (state == 0).astype(np.int32) * n + xp.arange(n, dtype=np.int32)
    order = xp.argsort(key, axis=-1).astype(np.int32)
    return (state != 0).sum(axis=-1).astype(np.int32), xp.ascontiguousarray(order)
