"""Decoding against a KV cache: flash-attn's ``flash_attn_with_kvcache``.

An inference step appends the new tokens' keys and values to a cache (contiguous per sequence, or in pages
through a block table), rotates the new keys and the queries (rotary embedding), and attends from the queries to
everything the cache holds. :func:`flash_attn_with_kvcache` does these steps with array operations and runs the
attention on the varlen forward kernels (:func:`flashnumba.flash_attn_varlen_forward`), the keys and values of
each sequence gathered from the cache into one packed array first. The semantics are those of
:func:`flashnumba.reference.kvcache_attention`, the float64 NumPy reference the tests compare with.

Still to come: a split-KV (flash-decoding) kernel that reads the cache in place, several blocks per sequence,
the query heads that share a key/value head together; this version copies the keys and values it attends to.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from . import _arrays
from .api import flash_attn_varlen_forward
from .reference import rotate_pairs

MIN_PAGE_SIZE = 16  # rows per page of a paged cache: at least one tile of the kernels' smallest key tiles


def _xp(x):
    kind = _arrays.kind(x)
    if kind == "numpy":
        return np
    if kind == "cupy":
        return _arrays.cupy
    raise TypeError(f"flash_attn_with_kvcache takes NumPy or CuPy arrays, got {type(x).__name__} (from torch: "
                    f"flashnumba.torch does not offer it yet)")


def _host_ints(name, x, shape):
    """An integer array argument as host int64, checked for shape (its values are checked by the caller)."""
    a = _arrays.to_host(x) if hasattr(x, "__cuda_array_interface__") else np.asarray(x)
    if a.dtype.kind not in "iu":
        raise TypeError(f"{name} must hold integers (int32), got dtype {a.dtype}")
    if a.shape != shape:
        raise ValueError(f"{name} must have shape {shape}, got {a.shape}")
    return a.astype(np.int64)


def _rotate(x, cos, sin, pos, interleaved):
    """x (n, heads, d) rotated at positions ``pos`` (n,) in float32 (as flash-attn), returned in x's dtype: the
    reference's rotation (:func:`flashnumba.reference.rotate_pairs`) on x's array module."""
    c = cos[pos].astype(np.float32)[:, None, :]
    s = sin[pos].astype(np.float32)[:, None, :]
    return rotate_pairs(x.astype(np.float32), c, s, interleaved).astype(x.dtype)


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
                            cache_seqlens=None, cache_batch_idx=None, block_table=None, softmax_scale=None,
                            causal=False, window_size=(-1, -1), softcap=0.0, rotary_interleaved=True,
                            alibi_slopes=None, num_splits=0, return_softmax_lse=False) -> Any:
    """Attention of q against a KV cache, with flash-attn 2.8's arguments and semantics.

    q (batch, seqlen_q, nheads, head_dim); k_cache, v_cache (batch_cache, seqlen_cache, nheads_k, head_dim), or
    with ``block_table`` (batch, max_pages) int32 a paged cache (num_pages, page_size, nheads_k, head_dim), page
    size at least :data:`MIN_PAGE_SIZE`. ``cache_seqlens`` (an int, or (batch,) int32): the keys the cache holds
    per sequence before the call. ``k``, ``v`` (batch, seqlen_new, nheads_k, head_dim), optional: written into the
    cache in place at positions cache_seqlens .. + seqlen_new - 1 (the only arrays modified), k rotated first.
    ``rotary_cos``, ``rotary_sin`` (seqlen_ro, rotary_dim / 2): rotary embedding of the new k and of q (at
    positions cache_seqlens + t when causal or windowed, else all at cache_seqlens), ``rotary_interleaved``
    (GPT-J pairs) or not (GPT-NeoX halves). ``cache_batch_idx`` (batch,): the cache entry of each sequence (not
    with a block table). causal (bottom-right aligned), window_size, softcap, alibi_slopes, softmax_scale as
    :func:`flashnumba.flash_attn_forward`. ``num_splits`` is accepted for compatibility (0 or a positive int) and
    has no effect yet. Returns out like q, and with ``return_softmax_lse`` also lse (batch, nheads, seqlen_q)
    float32.

    The integer arguments are read on the host and checked: positions beyond the cache, pages outside the pool,
    new keys that would not fit, rotary tables too short raise ValueError before anything is written.
    """
    xp = _xp(q)
    for name, x in (("k_cache", k_cache), ("v_cache", v_cache), ("k", k), ("v", v)):
        if x is not None and _xp(x) is not xp:
            raise TypeError(f"{name} must be the same kind of array as q ({type(q).__name__})")
    if q.ndim != 4 or k_cache.ndim != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(f"q must be 4-D and k_cache, v_cache 4-D of one shape, got {q.shape}, {k_cache.shape}, "
                         f"{v_cache.shape}")
    batch, seqlen_q, nheads, d = q.shape
    nheads_k = k_cache.shape[2]
    if k_cache.shape[3] != d or nheads % nheads_k:
        raise ValueError(f"k_cache {k_cache.shape} does not suit q {q.shape}: head_dim must match and nheads be a "
                         f"multiple of nheads_k")
    if not (q.dtype == k_cache.dtype == v_cache.dtype):
        raise TypeError(f"q, k_cache and v_cache must share a dtype, got {q.dtype}, {k_cache.dtype}, {v_cache.dtype}")
    if (k is None) != (v is None):
        raise ValueError("give both k and v (the new keys and values), or neither")
    if not isinstance(num_splits, (int, np.integer)) or isinstance(num_splits, bool) or num_splits < 0:
        raise ValueError(f"num_splits must be an int >= 0, got {num_splits!r}")
    paged = block_table is not None
    if paged:
        if cache_batch_idx is not None:
            raise ValueError("cache_batch_idx cannot be combined with block_table (a paged cache)")
        page = k_cache.shape[1]
        if page < MIN_PAGE_SIZE:
            raise ValueError(f"the page size (k_cache.shape[1]) must be at least {MIN_PAGE_SIZE}, got {page}")
        if getattr(block_table, "ndim", 0) != 2:
            raise ValueError(f"block_table must be (batch, max_pages), got shape {getattr(block_table, 'shape', None)}")
        bt = _host_ints("block_table", block_table, (batch, block_table.shape[1]))
        if bt.size and (bt.min() < 0 or bt.max() >= k_cache.shape[0]):
            raise ValueError(f"block_table holds pages outside the pool of {k_cache.shape[0]}: "
                             f"{int(bt.min())} .. {int(bt.max())}")
        capacity = bt.shape[1] * page
    else:
        capacity = k_cache.shape[1]
        if cache_batch_idx is None:
            cbi = np.arange(batch)
            if k_cache.shape[0] < batch:
                raise ValueError(f"k_cache holds {k_cache.shape[0]} sequences, q {batch}: pass cache_batch_idx")
        else:
            cbi = _host_ints("cache_batch_idx", cache_batch_idx, (batch,))
            if cbi.min() < 0 or cbi.max() >= k_cache.shape[0]:
                raise ValueError(f"cache_batch_idx must lie in [0, {k_cache.shape[0]}), got "
                                 f"{int(cbi.min())} .. {int(cbi.max())}")
    if cache_seqlens is None:
        lens = np.zeros(batch, np.int64)
    elif isinstance(cache_seqlens, (int, np.integer)) and not isinstance(cache_seqlens, bool):
        lens = np.full(batch, int(cache_seqlens), np.int64)
    else:
        lens = _host_ints("cache_seqlens", cache_seqlens, (batch,))
    seqlen_new = 0
    if k is not None:
        if k.shape != (batch, k.shape[1], nheads_k, d) or v.shape != k.shape:
            raise ValueError(f"k and v must have shape (batch, seqlen_new, nheads_k, head_dim) = ({batch}, n, "
                             f"{nheads_k}, {d}), got {k.shape}, {v.shape}")
        if k.dtype != q.dtype or v.dtype != q.dtype:
            raise TypeError(f"k and v must have q's dtype {q.dtype}")
        seqlen_new = k.shape[1]
    if lens.min(initial=0) < 0 or lens.max(initial=0) + seqlen_new > capacity:
        raise ValueError(f"cache_seqlens + seqlen_new must lie in [0, {capacity}] (the cache's capacity), got "
                         f"{int(lens.min())} .. {int(lens.max()) + seqlen_new}")
    rotary = rotary_cos is not None
    if rotary:
        if rotary_sin is None or rotary_cos.ndim != 2 or rotary_sin.shape != rotary_cos.shape:
            raise ValueError("rotary_cos and rotary_sin must both be given, (seqlen_ro, rotary_dim / 2)")
        if 2 * rotary_cos.shape[1] > d:
            raise ValueError(f"rotary_dim {2 * rotary_cos.shape[1]} exceeds head_dim {d}")
        need = int(lens.max(initial=0)) + max(seqlen_new, seqlen_q)
        if rotary_cos.shape[0] < need:
            raise ValueError(f"rotary tables of {rotary_cos.shape[0]} positions; this call needs {need}")
        cos, sin = xp.asarray(rotary_cos), xp.asarray(rotary_sin)

    # where each position of each sequence lives: (cache row, position within it)
    def rows(b_idx, pos):
        if paged:
            return xp.asarray(bt[b_idx, pos // page]), xp.asarray(pos % page)
        return xp.asarray(cbi[b_idx]), xp.asarray(pos)

    # 1. the new keys and values into the cache, in place (keys rotated at their positions)
    if seqlen_new:
        b_idx = np.repeat(np.arange(batch), seqlen_new)
        pos = (lens[:, None] + np.arange(seqlen_new)[None, :]).reshape(-1)
        knew = k.reshape(batch * seqlen_new, nheads_k, d)
        if rotary:
            knew = _rotate(knew, cos, sin, xp.asarray(pos), rotary_interleaved)
        r = rows(b_idx, pos)
        k_cache[r] = knew
        v_cache[r] = v.reshape(batch * seqlen_new, nheads_k, d)
    # 2. the keys and values each sequence attends to, packed; q rotated
    seqlen_k = lens + seqlen_new
    b_idx = np.repeat(np.arange(batch), seqlen_k)
    pos = np.concatenate([np.arange(n) for n in seqlen_k]) if batch else np.zeros(0, np.int64)
    r = rows(b_idx, pos)
    kp, vp = k_cache[r], v_cache[r]
    qp = q.reshape(batch * seqlen_q, nheads, d)
    if rotary:  # positions L + t when causal or windowed, else L for every row (one token)
        local = causal or tuple(window_size) != (-1, -1)
        qpos = (lens[:, None] + np.arange(seqlen_q)[None, :]).reshape(-1) if local else np.repeat(lens, seqlen_q)
        qp = _rotate(qp, cos, sin, xp.asarray(qpos), rotary_interleaved)
    else:
        qp = xp.ascontiguousarray(qp)
    cu_q = (np.arange(batch + 1) * seqlen_q).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(seqlen_k)]).astype(np.int32)
    # 3. attention on the varlen kernels
    out, lse = flash_attn_varlen_forward(qp, kp, vp, xp.asarray(cu_q), xp.asarray(cu_k), seqlen_q,
                                         int(seqlen_k.max(initial=0)), softmax_scale=softmax_scale, causal=causal,
                                         window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes)
    out = out.reshape(batch, seqlen_q, nheads, d)
    if return_softmax_lse:
        return out, lse.reshape(nheads, batch, seqlen_q).transpose(1, 0, 2)
    return out

