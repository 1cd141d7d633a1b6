"""Decoding against a KV cache: flash-attn's ``flash_attn_with_kvcache``.

An inference step appends the new tokens' keys and values to a cache (contiguous per sequence, or in pages
through a block table), rotates the new keys and the queries (rotary embedding), and attends from the queries to
everything the cache holds. :func:`flash_attn_with_kvcache` appends and rotates with array operations (on the few
new rows) and runs the attention on the split-KV kernel (:mod:`flashnumba.kernels.mma_decode`), which reads the
cache in place: the query heads that share a key/value head together, the keys of each sequence split over
several blocks, the parts combined exactly by a second kernel. The semantics are those of
:func:`flashnumba.reference.kvcache_attention`, the float64 NumPy reference the tests compare with.

float32 caches, GPUs without ``mma.sync`` (compute capability < 8.0) and ``kernel="gather"`` take the other path:
each sequence's keys and values gathered from the cache into one packed array, then the varlen forward kernels.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from . import _arrays, _launch, config, planner as _plan, tiling
from ._backend import SIMULATOR
from ._validate import check_options, inspect
from .api import _cached, _key, flash_attn_varlen_forward
from .reference import rotate_pairs

MIN_PAGE_SIZE = 16  # rows per page of a paged cache: at least one tile of the kernels' smallest key tiles


def _xp(x):
    kind = _arrays.kind(x)
    if kind == "numpy":
        return np
    if kind == "cupy":
        return _arrays.cupy
    raise TypeError(f"flash_attn_with_kvcache takes NumPy or CuPy arrays, got {type(x).__name__} (torch tensors: "
                    f"flashnumba.torch.flash_attn_with_kvcache)")


def _ints(name, x, shape, xp, read):
    """An integer array argument (NumPy, CuPy or a Python int for cache_seqlens): (on the device side as int32
    C-contiguous, on the host as int64 or None). Shape and dtype are checked; a device array is copied to the
    host only where ``read`` (to check its values: one synchronisation)."""
    if isinstance(x, (int, np.integer)) and not isinstance(x, bool):
        host = np.full(shape, int(x), np.int64)
        return xp.asarray(host.astype(np.int32)), host
    kind = _arrays.kind(x) if hasattr(x, "__cuda_array_interface__") or isinstance(x, np.ndarray) else None
    a = x if kind is not None else np.asarray(x)
    if a.dtype.kind not in "iu":
        raise TypeError(f"{name} must hold integers (int32), got dtype {a.dtype}")
    if tuple(a.shape) != shape:
        raise ValueError(f"{name} must have shape {shape}, got {tuple(a.shape)}")
    if kind in (None, "numpy"):
        host = np.asarray(a).astype(np.int64)
        return xp.asarray(host.astype(np.int32)), host
    if kind != "cupy" or xp is np:
        raise TypeError(f"{name} must be a NumPy or CuPy array on q's side, got {type(x).__name__}")
    dev = a if (a.dtype == np.int32 and a.flags.c_contiguous) else xp.ascontiguousarray(a.astype(np.int32))
    return dev, (_arrays.to_host(a).astype(np.int64) if read else None)


def _rotate(x, cos, sin, pos, interleaved):
    """x (n, heads, d) rotated at positions ``pos`` (n,) in float32 (as flash-attn), returned in x's dtype: the
    reference's rotation (:func:`flashnumba.reference.rotate_pairs`) on x's array module."""
    c = cos[pos].astype(np.float32)[:, None, :]
    s = sin[pos].astype(np.float32)[:, None, :]
    return rotate_pairs(x.astype(np.float32), c, s, interleaved).astype(x.dtype)


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
                            cache_seqlens=None, cache_batch_idx=None, block_table=None, softmax_scale=None,
                            causal=False, window_size=(-1, -1), softcap=0.0, rotary_interleaved=True,
                            alibi_slopes=None, num_splits=0, return_softmax_lse=False, *, kernel=None) -> Any:
    """Attention of q against a KV cache, with flash-attn 2.8's arguments and semantics.

    q (batch, seqlen_q, nheads, head_dim); k_cache, v_cache (batch_cache, seqlen_cache, nheads_k, head_dim), or
    with ``block_table`` (batch, max_pages) int32 a paged cache (num_pages, page_size, nheads_k, head_dim), page
    size at least :data:`MIN_PAGE_SIZE`. ``cache_seqlens`` (an int, or (batch,) int32): the keys the cache holds
    per sequence before the call (None: the whole cache, its capacity; new keys then need it). ``k``, ``v``
    (batch, seqlen_new, nheads_k, head_dim), optional: written into the cache in place at positions
    cache_seqlens .. + seqlen_new - 1 (the only arrays modified), k rotated first.
    ``rotary_cos``, ``rotary_sin`` (seqlen_ro, rotary_dim / 2): rotary embedding of the new k and of q (at
    positions cache_seqlens + t when causal or windowed, else all at cache_seqlens), ``rotary_interleaved``
    (GPT-J pairs) or not (GPT-NeoX halves). ``cache_batch_idx`` (batch,): the cache entry of each sequence (not
    with a block table). causal (bottom-right aligned), window_size, softcap, alibi_slopes, softmax_scale as
    :func:`flashnumba.flash_attn_forward`. ``num_splits``: the parts each sequence's keys are cut into (0: chosen
    from the GPU's SM count and the work, :func:`flashnumba.planner.decode_splits`; 1: none). Returns out like
    q, and with ``return_softmax_lse`` also lse (batch, nheads, seqlen_q) float32.

    ``kernel`` (flashnumba's own): None, "splitkv" (float16 / bfloat16, head_dim a multiple of 8 up to 256, a
    GPU of compute capability >= 8.0; the caches C-contiguous) or "gather" (any dtype: the keys each sequence
    attends to copied into a packed array for the varlen forward). None takes "splitkv" where it applies.

    The integer arguments are checked on the host before anything is written (positions beyond the cache, pages
    outside the pool, new keys that would not fit, rotary tables too short: ValueError); device arrays are copied
    to the host for it, unless ``flashnumba.config.check_device_values`` is off (a decoding step then makes no
    host round trip; see :mod:`flashnumba.config` for what unchecked values do).
    """
    if cache_seqlens is None and k is not None:
        raise ValueError("new keys k need cache_seqlens (where to write them)")
    # what the shapes, dtypes, options and the kernel choice decide: checked once per kind of call, then kept
    lens_array = cache_seqlens is not None and not isinstance(cache_seqlens, (int, np.integer))
    key = _key("kvcache", (q, k_cache, v_cache, k, v, cache_seqlens if lens_array else None, cache_batch_idx,
                           block_table, rotary_cos, rotary_sin, alibi_slopes),
               (causal, tuple(window_size) if isinstance(window_size, list) else window_size, softcap,
                rotary_interleaved, softmax_scale, num_splits, kernel, bool(return_softmax_lse),
                None if lens_array else type(cache_seqlens)))
    st = _cached(key, lambda: _Static(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_batch_idx,
                                      block_table, causal, window_size, softcap, alibi_slopes, softmax_scale,
                                      num_splits, kernel, bool(return_softmax_lse)))
    xp, batch, seqlen_q, nheads, nheads_k, d = st.xp, st.batch, st.seqlen_q, st.nheads, st.nheads_k, st.d
    capacity, seqlen_new, paged, page = st.capacity, st.seqlen_new, st.paged, st.page
    read = config.check_device_values  # device integer arrays copied to the host and checked
    bt = None
    if paged:
        table, bt = _ints("block_table", block_table, (batch, block_table.shape[1]), xp, read)
    elif cache_batch_idx is None:
        bidx = _arange(xp, batch)
    else:
        bidx, cbi = _ints("cache_batch_idx", cache_batch_idx, (batch,), xp, read)
        if cbi is not None and batch and (cbi.min() < 0 or cbi.max() >= k_cache.shape[0]):
            raise ValueError(f"cache_batch_idx must lie in [0, {k_cache.shape[0]}), got "
                             f"{int(cbi.min())} .. {int(cbi.max())}")
    # (None: every sequence holds the whole cache, as in flash-attn)
    lens_dev, lens = _ints("cache_seqlens", capacity if cache_seqlens is None else cache_seqlens, (batch,), xp, read)
    if lens is not None and (lens.min(initial=0) < 0 or lens.max(initial=0) + seqlen_new > capacity):
        raise ValueError(f"cache_seqlens + seqlen_new must lie in [0, {capacity}] (the cache's capacity), got "
                         f"{int(lens.min())} .. {int(lens.max()) + seqlen_new}")
    if paged and bt is not None and lens is not None:  # the pages the sequences use (a table may be padded past them)
        used = np.arange(bt.shape[1])[None, :] < -(-(lens + seqlen_new) // page)[:, None]
        bad = used & ((bt < 0) | (bt >= k_cache.shape[0]))
        if bad.any():
            raise ValueError(f"block_table holds pages outside the pool of {k_cache.shape[0]}: "
                             f"{bt[bad][:4].tolist()} among those the sequences use")
    rotary, local = st.rotary, st.local
    if rotary:
        # q at positions L + t (causal or windowed) or L; the new keys at L .. L + seqlen_new - 1 (cache_seqlens
        # unread: flash-attn's own rule, tables as long as the cache)
        need = capacity if lens is None else int(lens.max(initial=0)) + max(seqlen_new, seqlen_q if local else 1)
        if rotary_cos.shape[0] < need:
            raise ValueError(f"rotary tables of {rotary_cos.shape[0]} positions; this call needs {need}")
        cos, sin = xp.asarray(rotary_cos), xp.asarray(rotary_sin)
    opts, splitkv = st.opts, st.splitkv

    # where each position of each sequence lives: (cache row, position within it), on the arrays' side
    def rows(b_idx, pos):
        if paged:
            return table[b_idx, pos // page], pos % page
        return bidx[b_idx], pos

    # 1. the new keys and values into the cache, in place (keys rotated at their positions)
    if seqlen_new:
        b_idx = xp.repeat(xp.arange(batch), seqlen_new)
        pos = (lens_dev[:, None] + xp.arange(seqlen_new)[None, :]).reshape(-1)
        knew = k.reshape(batch * seqlen_new, nheads_k, d)
        if rotary:
            knew = _rotate(knew, cos, sin, pos, rotary_interleaved)
        r = rows(b_idx, pos)
        k_cache[r] = knew
        v_cache[r] = v.reshape(batch * seqlen_new, nheads_k, d)
    # 2. q rotated (positions L + t when causal or windowed, else L for every row: one token)
    seqlens_dev = lens_dev + seqlen_new if seqlen_new else lens_dev
    qp = q
    if rotary:
        steps = xp.arange(seqlen_q)[None, :] if local else xp.zeros((1, seqlen_q), np.int64)
        qpos = (lens_dev[:, None] + steps).reshape(-1)
        qp = _rotate(q.reshape(batch * seqlen_q, nheads, d), cos, sin, qpos, rotary_interleaved).reshape(q.shape)
    qp = xp.ascontiguousarray(qp)
    if not _arrays.starts_aligned(qp):  # (a view that does not start on 16 bytes: the 16-byte copies need it)
        qp = qp.copy()
    if splitkv:
        # 3. attention on the split-KV kernel, reading the cache in place
        arrays = (qp, k_cache, v_cache, seqlens_dev, None if paged else bidx, table if paged else None,
                  None if opts.alibi is None else alibi_slopes)
        res = st.call(arrays).run(arrays)  # [out, lse], or [out] (lse then in the call's scratch)
        return tuple(res) if return_softmax_lse else res[0]
    # 3. the keys and values each sequence attends to, packed, on the varlen forward kernels (the lengths read,
    # and clipped to the cache as the split-KV kernel clips them)
    seqlen_k = np.clip(_arrays.to_host(seqlens_dev).astype(np.int64), 0, capacity)
    b_idx = np.repeat(np.arange(batch), seqlen_k)
    pos = np.concatenate([np.arange(n) for n in seqlen_k]) if batch else np.zeros(0, np.int64)
    r = rows(xp.asarray(b_idx), xp.asarray(pos))
    kp, vp = k_cache[r], v_cache[r]
    qp = qp.reshape(batch * seqlen_q, nheads, d)
    cu_q = (np.arange(batch + 1) * seqlen_q).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(seqlen_k)]).astype(np.int32)
    out, lse = flash_attn_varlen_forward(qp, kp, vp, xp.asarray(cu_q), xp.asarray(cu_k), seqlen_q,
                                         int(seqlen_k.max(initial=0)), softmax_scale=softmax_scale, causal=causal,
                                         window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes)
    out = out.reshape(batch, seqlen_q, nheads, d)
    if return_softmax_lse:
        return out, lse.reshape(nheads, batch, seqlen_q).transpose(1, 0, 2)
    return out


class _Static:
    """What a call's shapes, dtypes, options and kernel choice decide, checked (ValueError / TypeError) once per
    kind of call and kept (:func:`flashnumba.api._cached`): the values of the integer arrays are checked at every
    call, these are not (they cannot change between calls of one key). ``call(arrays)``: the split-KV kernels'
    launcher, planned at the first call that runs them."""

    def __init__(self, q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_batch_idx, block_table, causal,
                 window_size, softcap, alibi_slopes, softmax_scale, num_splits, kernel, return_lse=True):
        self.xp = xp = _xp(q)
        self.return_lse = return_lse
        for name, x in (("k_cache", k_cache), ("v_cache", v_cache), ("k", k), ("v", v)):
            if x is not None and _xp(x) is not xp:
                raise TypeError(f"{name} must be the same kind of array as q ({type(q).__name__})")
        if q.ndim != 4 or k_cache.ndim != 4 or v_cache.shape != k_cache.shape:
            raise ValueError(f"q must be 4-D and k_cache, v_cache 4-D of one shape, got {q.shape}, "
                             f"{k_cache.shape}, {v_cache.shape}")
        batch, self.seqlen_q, self.nheads, d = q.shape
        self.batch, self.d = batch, d
        self.nheads_k = nheads_k = k_cache.shape[2]
        if k_cache.shape[3] != d or self.nheads % nheads_k:
            raise ValueError(f"k_cache {k_cache.shape} does not suit q {q.shape}: head_dim must match and nheads "
                             f"be a multiple of nheads_k")
        if not (q.dtype == k_cache.dtype == v_cache.dtype):
            raise TypeError(f"q, k_cache and v_cache must share a dtype, got {q.dtype}, {k_cache.dtype}, "
                            f"{v_cache.dtype}")
        if (k is None) != (v is None):
            raise ValueError("give both k and v (the new keys and values), or neither")
        if not isinstance(num_splits, (int, np.integer)) or isinstance(num_splits, bool) or num_splits < 0:
            raise ValueError(f"num_splits must be an int >= 0, got {num_splits!r}")
        self.num_splits = int(num_splits)
        self.paged = block_table is not None
        self.page = 0
        if self.paged:
            if cache_batch_idx is not None:
                raise ValueError("cache_batch_idx cannot be combined with block_table (a paged cache)")
            self.page = page = k_cache.shape[1]
            if page < MIN_PAGE_SIZE:
                raise ValueError(f"the page size (k_cache.shape[1]) must be at least {MIN_PAGE_SIZE}, got {page}")
            if getattr(block_table, "ndim", 0) != 2:
                raise ValueError(f"block_table must be (batch, max_pages), got shape "
                                 f"{getattr(block_table, 'shape', None)}")
            self.capacity = block_table.shape[1] * page
        else:
            self.capacity = k_cache.shape[1]
            if cache_batch_idx is None and k_cache.shape[0] < batch:
                raise ValueError(f"k_cache holds {k_cache.shape[0]} sequences, q {batch}: pass cache_batch_idx")
        self.seqlen_new = 0
        if k is not None:
            if k.shape != (batch, k.shape[1], nheads_k, d) or v.shape != k.shape:
                raise ValueError(f"k and v must have shape (batch, seqlen_new, nheads_k, head_dim) = ({batch}, n, "
                                 f"{nheads_k}, {d}), got {k.shape}, {v.shape}")
            if k.dtype != q.dtype or v.dtype != q.dtype:
                raise TypeError(f"k and v must have q's dtype {q.dtype}")
            self.seqlen_new = k.shape[1]
        self.rotary = rotary_cos is not None
        self.local = causal or tuple(window_size) != (-1, -1)
        if self.rotary:
            if rotary_sin is None or rotary_cos.ndim != 2 or rotary_sin.shape != rotary_cos.shape:
                raise ValueError("rotary_cos and rotary_sin must both be given, (seqlen_ro, rotary_dim / 2)")
            if 2 * rotary_cos.shape[1] > d:
                raise ValueError(f"rotary_dim {2 * rotary_cos.shape[1]} exceeds head_dim {d}")
        # the options and the kernel
        self.splitkv = _use_splitkv(kernel, q, k_cache, v_cache)
        self.opts = check_options(inspect("q", q, 4), inspect("k_cache", k_cache, 4), causal, window_size, softcap,
                                  alibi_slopes, 0.0, softmax_scale)  # (no array kept: a cache may be large)
        self._call = None

    def call(self, arrays) -> _launch.Call:
        """The split-KV launcher for arrays (q rotated and contiguous, k_cache, v_cache, the lengths, the batch
        index or the block table, the ALiBi slopes), planned at the first call."""
        if self._call is None:
            tq, tk, tv = (inspect(n, x, 4) for n, x in zip(("q", "k_cache", "v_cache"), arrays[:3]))
            t = [None if x is None else inspect(n, x, x.ndim) for n, x in
                 zip(("seqlens_k", "batch_idx", "block_table"), arrays[3:6])]
            p = _plan.decode_plan(tq, tk, tv, self.opts, seqlens=t[0], batch_idx=t[1], block_table=t[2],
                                  max_seqlen_k=self.capacity, num_splits=self.num_splits,
                                  return_lse=self.return_lse)
            self._call = _launch.Call(p)
        return self._call


_aranges: dict = {}


def _arange(xp, n):
    """A device (or NumPy) arange(n) int32, made once per size and device."""
    key = (xp.__name__, n, xp.cuda.Device().id if xp is not np else None)
    if key not in _aranges:
        _aranges[key] = xp.arange(n, dtype=np.int32)
    return _aranges[key]


def _use_splitkv(kernel, q, k_cache, v_cache) -> bool:
    """Whether the call runs on the split-KV kernel (see :func:`flash_attn_with_kvcache`'s ``kernel``)."""
    if kernel not in (None, "splitkv", "gather"):
        raise ValueError(f"kernel must be None, 'splitkv' or 'gather', got {kernel!r}")
    if kernel == "gather":
        return False
    blocker = None
    sixteen = q.dtype == np.float16 or _arrays.is_bfloat16(q.dtype)
    if not sixteen:
        blocker = f"it takes float16 or bfloat16, not {q.dtype}"
    elif q.shape[-1] not in tiling.MMA_HEAD_DIMS:
        blocker = f"it is built for head_dim a multiple of 8 up to 256, not {q.shape[-1]}"
    elif not (k_cache.flags.c_contiguous and v_cache.flags.c_contiguous):
        blocker = "it reads C-contiguous caches (k_cache, v_cache)"
    elif not (_arrays.starts_aligned(k_cache) and _arrays.starts_aligned(v_cache)):
        blocker = "its 16-byte copies need caches that start on 16 bytes"
    elif not SIMULATOR and tuple(_plan.current_device().cc) < tiling.MMA_MIN_CC:
        blocker = "it needs compute capability 8.0 or newer (mma.sync, cp.async)"
    if blocker and kernel == "splitkv":
        raise ValueError(f"kernel='splitkv' does not apply: {blocker}")
    return blocker is None
