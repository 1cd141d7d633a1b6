"""Decoding against a KV cache: flash-attn's ``flash_attn_with_kvcache``.

An inference step appends the new tokens' keys and values to a cache (contiguous per sequence, or in pages
through a block table), rotates the new keys and the queries (rotary embedding), and attends from the queries to
everything the cache holds. :func:`flash_attn_with_kvcache` runs one plan of three kernels
(:mod:`flashnumba.kernels.mma_decode`): the append and rotations, the split-KV attention, which reads the cache in
place (the query heads that share a key/value head together, the keys of each sequence split over several
blocks), and the exact combination of the splits. The semantics are those of
:func:`flashnumba.reference.kvcache_attention`, the float64 NumPy reference the tests compare with.

float32 caches, GPUs without ``mma.sync`` (compute capability < 8.0) and ``kernel="gather"`` take the other path:
each sequence's keys and values gathered from the cache into one packed array, then the varlen forward kernels.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

from . import _arrays, _launch, config, planner as _plan, tiling
from ._backend import SIMULATOR
from ._validate import MAX_HEAD_DIM, check_dtypes, check_flag, check_options, inspect
from .api import _cached, _key, flash_attn_varlen_forward

MIN_PAGE_SIZE = 16  # rows per page of a paged cache: at least one tile of the kernels' smallest key tiles


def _side(name, x):
    """'numpy' or 'device' (a CuPy array or a torch CUDA tensor): where a call's array ``name`` lives."""
    try:
        kind = _arrays.kind(x)
    except TypeError as err:
        raise TypeError(f"{name}: {err}") from None
    if kind == "numpy":
        return "numpy"
    if kind in ("cupy", "torch"):
        return "device"
    raise TypeError(f"{name}: flash_attn_with_kvcache takes NumPy arrays, CuPy arrays or torch CUDA tensors, got "
                    f"{type(x).__name__}")


def _ints(name, x, shape, read):
    """An integer argument (NumPy, CuPy or torch, or a Python int for cache_seqlens): (the kernels' array, int32
    and C-contiguous, its host copy as int64 or None). Shape and dtype are checked; a device array is copied to the
    host only where ``read`` (to check its values: one synchronisation)."""
    if isinstance(x, (int, np.integer)) and not isinstance(x, bool):
        host = np.full(shape, int(x), np.int64)
        return host.astype(np.int32), host
    try:
        kind = _arrays.kind(x)  # (isinstance checks first: no CuPy array interface built at every call)
    except TypeError:  # (a list, say)
        kind = None
    a = x if kind is not None else np.asarray(x)
    # (a torch tensor's dtype as NumPy's; CuPy's and NumPy's as they are)
    dtype = _arrays.shape_strides_dtype(a)[2] if kind == "torch" else np.dtype(a.dtype)
    if dtype.kind not in "iu":
        raise TypeError(f"{name} must hold integers (int32), got dtype {dtype}")
    if tuple(a.shape) != shape:
        raise ValueError(f"{name} must have shape {shape}, got {tuple(a.shape)}")
    if kind in (None, "numpy"):
        host = _int64(name, np.asarray(a))
        return host.astype(np.int32), host
    if kind == "torch":
        torch = sys.modules["torch"]
        dev = a if (a.dtype == torch.int32 and a.is_contiguous()) else a.to(torch.int32).contiguous()
    elif kind == "cupy":
        cp = _arrays.cupy
        dev = a if (a.dtype == np.int32 and a.flags.c_contiguous) else cp.ascontiguousarray(a.astype(np.int32))
    else:
        raise TypeError(f"{name} must be a NumPy array, a CuPy array or a torch tensor, got {type(x).__name__}")
    return dev, (_int64(name, _arrays.to_host(a)) if read else None)


def _int64(name, host):
    """An integer array's values as int64 (an unsigned value beyond int64's range refused as itself, not wrapped)."""
    if host.dtype.kind == "u" and host.size and int(host.max()) > np.iinfo(np.int64).max:
        raise ValueError(f"{name} holds {int(host.max())}, beyond any cache")
    return host.astype(np.int64)


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
                            cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, block_table=None,
                            softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                            rotary_interleaved=True, alibi_slopes=None, num_splits=0, return_softmax_lse=False, *,
                            kernel=None) -> Any:
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
    with a block table; an entry named twice in a call that appends, checked where the values are read, is refused:
    both sequences would write its rows). ``cache_leftpad`` (batch,) int32, not with a block table: where each
    sequence's keys start in its cache row (positions below it are left padding, never attended to; in [0,
    cache_seqlens]); positions (rotations, masks) stay those of the cache. causal (bottom-right aligned),
    window_size, softcap, alibi_slopes, softmax_scale as :func:`flashnumba.flash_attn_forward`. ``num_splits``: the
    parts each sequence's keys are cut into (0: chosen from the GPU's SM count and the work,
    :func:`flashnumba.planner.decode_splits`; 1: none).
    Returns out like q, and with ``return_softmax_lse`` also lse (batch, nheads, seqlen_q) float32. The arrays are
    NumPy, CuPy or torch CUDA tensors (all of one side; :mod:`flashnumba.torch` has the same function for torch code).

    ``kernel`` (flashnumba's own): None, "splitkv" (float16 / bfloat16, head_dim a multiple of 8 up to 256, a
    GPU of compute capability >= 8.0; the caches C-contiguous) or "gather" (any dtype: the keys each sequence
    attends to copied into a packed array for the varlen forward). None takes "splitkv" where it applies.

    The integer arguments given as ints or NumPy arrays are checked on the host before anything is written
    (positions beyond the cache, pages outside the pool, new keys that would not fit, rotary tables too short:
    ValueError). Device arrays are not read back (a decoding step makes no host round trip and can be captured in
    a CUDA graph) unless ``flashnumba.config.check_cache_values`` is on; the kernels keep their values inside the
    arrays (:func:`flashnumba.kernels.mma_decode.make_append` and :mod:`flashnumba.config` say with what
    result). The gather path reads the lengths anyway, and checks them.
    """
    if cache_seqlens is None and k is not None:
        raise ValueError("new keys k need cache_seqlens (where to write them)")
    return_softmax_lse = check_flag("return_softmax_lse", return_softmax_lse)
    if k is not None:  # (a read-only NumPy cache refused before either cache is written)
        for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
            if isinstance(cache, np.ndarray) and not cache.flags.writeable:
                raise ValueError(f"{name} is a read-only NumPy array; the new keys and values are written into it")
    # what the shapes, dtypes, options and the kernel choice decide: checked once per kind of call, then kept
    lens_array = cache_seqlens is not None and not isinstance(cache_seqlens, (int, np.integer))
    key = _key("kvcache", (q, k_cache, v_cache, k, v, cache_seqlens if lens_array else None, cache_batch_idx,
                           block_table, rotary_cos, rotary_sin, alibi_slopes, cache_leftpad),
               (causal, tuple(window_size) if isinstance(window_size, list) else window_size, softcap,
                rotary_interleaved, softmax_scale, num_splits, kernel, bool(return_softmax_lse),
                None if lens_array else type(cache_seqlens)))
    st = _cached(key, lambda: _Static(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_batch_idx,
                                      block_table, causal, window_size, softcap, alibi_slopes, softmax_scale,
                                      num_splits, kernel, bool(return_softmax_lse), rotary_interleaved,
                                      cache_leftpad is not None))
    batch, seqlen_q, capacity, seqlen_new, page = st.batch, st.seqlen_q, st.capacity, st.seqlen_new, st.page
    read = config.check_cache_values or not st.splitkv  # device integer arrays copied to the host and checked
    table = bt = bidx = None
    if st.paged:
        table, bt = _ints("block_table", block_table, (batch, block_table.shape[1]), read)
    elif cache_batch_idx is not None:
        bidx, cbi = _ints("cache_batch_idx", cache_batch_idx, (batch,), read)
        if cbi is not None and batch and (cbi.min() < 0 or cbi.max() >= k_cache.shape[0]):
            raise ValueError(f"cache_batch_idx must lie in [0, {k_cache.shape[0]}), got "
                             f"{int(cbi.min())} .. {int(cbi.max())}")
        if cbi is not None and seqlen_new and len(np.unique(cbi)) < batch:  # (two writers of one sequence's rows)
            raise ValueError(f"cache_batch_idx names a cache sequence twice ({cbi.tolist()[:8]}) in a call that "
                             f"appends new keys: both would write its rows")
    # (None: every sequence holds the whole cache, as in flash-attn)
    lens_in, lens = _ints("cache_seqlens", capacity if cache_seqlens is None else cache_seqlens, (batch,), read)
    if lens is not None and (lens.min(initial=0) < 0 or lens.max(initial=0) + seqlen_new > capacity):
        raise ValueError(f"cache_seqlens + seqlen_new must lie in [0, {capacity}] (the cache's capacity), got "
                         f"{int(lens.min())} .. {int(lens.max()) + seqlen_new}")
    pads_in = pads = None
    if cache_leftpad is not None:  # (the lengths before the step bound it: the new keys are never padding)
        pads_in, pads = _ints("cache_leftpad", cache_leftpad, (batch,), read)
        top = lens if lens is not None else np.full(batch, capacity, np.int64)
        if pads is not None and batch and ((pads < 0) | (pads > top)).any():
            raise ValueError(f"cache_leftpad must lie in [0, cache_seqlens] for each sequence, got "
                             f"{pads.tolist()[:8]} against {top.tolist()[:8]}")
    if st.paged and bt is not None and lens is not None:  # the pages the sequences use (a table may be padded past)
        used = np.arange(bt.shape[1])[None, :] < -(-(lens + seqlen_new) // page)[:, None]
        bad = used & ((bt < 0) | (bt >= k_cache.shape[0]))
        if bad.any():
            raise ValueError(f"block_table holds pages outside the pool of {k_cache.shape[0]}: "
                             f"{bt[bad][:4].tolist()} among those the sequences use")
    if st.rotary:
        # q at positions L + t (causal or windowed) or L; the new keys at L .. L + seqlen_new - 1 (lengths on the
        # device unread: flash-attn's own rule, tables as long as the cache)
        need = capacity if lens is None else int(lens.max(initial=0)) + max(seqlen_new, seqlen_q if st.local else 1)
        if rotary_cos.shape[0] < need:
            raise ValueError(f"rotary tables of {rotary_cos.shape[0]} positions; this call needs {need}")
    arrays = (q, k_cache, v_cache, lens_in, bidx, table, alibi_slopes if st.opts.alibi is not None else None, k, v,
              rotary_cos, rotary_sin, pads_in)
    if st.splitkv:
        # the new keys in, the rotations, the attention on the split-KV kernel reading the cache in place: one plan
        res = st.call(arrays).run(arrays)  # [out, lse], or [out] (lse then in the call's scratch)
        return tuple(res) if return_softmax_lse else res[0]
    return _gather(st, arrays, return_softmax_lse, softmax_scale, causal, window_size, softcap, alibi_slopes)


def _gather(st, arrays, return_lse, softmax_scale, causal, window_size, softcap, alibi_slopes):
    """The other path: the step's appends and rotations (:func:`flashnumba.planner.append_plan`), then the keys and
    values each sequence attends to (the lengths read, and clipped to the cache as the split-KV kernel clips them)
    copied into packed arrays for the varlen forward kernels. torch tensors go through CuPy views of the same
    memory (so not bfloat16, which CuPy lacks: :class:`_Static` refuses it)."""
    q, k_cache, v_cache = arrays[:3]
    torch_side = _arrays.kind(q) == "torch"
    qp, seqlens = q, arrays[3]
    if st.step.runs:
        res = st.append_call(arrays).run(arrays)  # [seqlens_out] or [seqlens_out, q_rot]
        seqlens = res[0]
        qp = res[1] if st.rotary else q
    if torch_side:  # (the integer arrays are read on the host below, whatever their kind)
        cupy = _arrays.cupy
        qp, k_cache, v_cache = (cupy.asarray(x.detach()) for x in (qp, k_cache, v_cache))
        if alibi_slopes is not None and _arrays.kind(alibi_slopes) == "torch":
            alibi_slopes = cupy.asarray(alibi_slopes.detach())
    xp = np if _arrays.kind(qp) == "numpy" else _arrays.cupy
    batch, seqlen_q, nheads, d = st.batch, st.seqlen_q, st.nheads, st.d
    end = np.clip(_arrays.to_host(seqlens).astype(np.int64), 0, st.capacity)
    start = np.zeros(batch, np.int64) if arrays[11] is None else np.clip(
        _arrays.to_host(arrays[11]).astype(np.int64), 0, end)  # (left padding: never attended to)
    seqlen_k = end - start
    b_idx = np.repeat(np.arange(batch), seqlen_k)
    pos = np.concatenate([np.arange(a, n) for a, n in zip(start, end)]) if batch else np.zeros(0, np.int64)
    if st.paged:
        table = xp.asarray(_arrays.to_host(arrays[5]))
        r = table[xp.asarray(b_idx), xp.asarray(pos // st.page)], xp.asarray(pos % st.page)
    else:
        entry = b_idx if arrays[4] is None else _arrays.to_host(arrays[4]).astype(np.int64)[b_idx]
        r = xp.asarray(entry), xp.asarray(pos)
    kp, vp = k_cache[r], v_cache[r]
    qp = qp.reshape(batch * seqlen_q, nheads, d)
    cu_q = (np.arange(batch + 1) * seqlen_q).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(seqlen_k)]).astype(np.int32)
    out, lse = flash_attn_varlen_forward(qp, kp, vp, xp.asarray(cu_q), xp.asarray(cu_k), seqlen_q,
                                         int(seqlen_k.max(initial=0)), softmax_scale=softmax_scale, causal=causal,
                                         window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes)
    out = out.reshape(batch, seqlen_q, nheads, d)
    lse = lse.reshape(nheads, batch, seqlen_q).transpose(1, 0, 2)
    if torch_side:
        torch = sys.modules["torch"]
        out, lse = (torch.as_tensor(x, device=q.device) for x in (out, lse))
    return (out, lse) if return_lse else out


class _Static:
    """What a call's shapes, dtypes, options and kernel choice decide, checked (ValueError / TypeError) once per
    kind of call and kept (:func:`flashnumba.api._cached`): the values of the integer arrays are checked at every
    call, these are not (they cannot change between calls of one key). ``call(arrays)``: the split-KV kernels'
    launcher, ``append_call(arrays)`` the gather path's first step, each planned at the first call that runs it."""

    def __init__(self, q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_batch_idx, block_table, causal,
                 window_size, softcap, alibi_slopes, softmax_scale, num_splits, kernel, return_lse=True,
                 interleaved=True, leftpad=False):
        self.return_lse = return_lse
        side = _side("q", q)
        for name, x in (("k_cache", k_cache), ("v_cache", v_cache), ("k", k), ("v", v)):
            if (x is not None or name.endswith("cache")) and _side(name, x) != side:
                raise TypeError(f"{name} must be on q's side ({side}), got {type(x).__name__}")
        # every check of the arrays' shapes and dtypes comes before anything is written (the gather path appends
        # the new keys first, then runs the varlen forward, whose own checks would come too late)
        tq, tk, tv = (inspect(n, x, 4) for n, x in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)))
        if tv.shape != tk.shape:
            raise ValueError(f"k_cache and v_cache must have one shape, got {tk.shape}, {tv.shape}")
        check_dtypes((tq, tk, tv))
        batch, self.seqlen_q, self.nheads, d = tq.shape
        self.batch, self.d = batch, d
        self.nheads_k = nheads_k = tk.shape[2]
        if self.nheads == 0 or nheads_k == 0:
            raise ValueError(f"q and k_cache must have heads, got q {tq.shape}, k_cache {tk.shape}")
        if tk.shape[3] != d or self.nheads % nheads_k:
            raise ValueError(f"k_cache {tk.shape} does not suit q {tq.shape}: head_dim must match and nheads "
                             f"be a multiple of nheads_k")
        if not 1 <= d <= MAX_HEAD_DIM:
            raise ValueError(f"head_dim must be in [1, {MAX_HEAD_DIM}], got {d}")
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
            if leftpad:  # (as flash-attn: a page table already says where each sequence's keys are)
                raise ValueError("cache_leftpad cannot be combined with block_table (a paged cache)")
            self.page = page = tk.shape[1]
            if page < MIN_PAGE_SIZE:
                raise ValueError(f"the page size (k_cache.shape[1]) must be at least {MIN_PAGE_SIZE}, got {page}")
            if len(getattr(block_table, "shape", ())) != 2:
                raise ValueError(f"block_table must be (batch, max_pages), got shape "
                                 f"{getattr(block_table, 'shape', None)}")
            self.capacity = block_table.shape[1] * page
        else:
            self.capacity = tk.shape[1]
            if cache_batch_idx is None and tk.shape[0] < batch:
                raise ValueError(f"k_cache holds {tk.shape[0]} sequences, q {batch}: pass cache_batch_idx")
        self.seqlen_new = 0
        tnew = (None, None)
        if k is not None:
            tnew = tuple(inspect(n, x, 4) if len(x.shape) == 4 else None for n, x in (("k", k), ("v", v)))
            if None in tnew or tnew[0].shape != (batch, tnew[0].shape[1], nheads_k, d) or (
                    tnew[1].shape != tnew[0].shape):
                raise ValueError(f"k and v must have shape (batch, seqlen_new, nheads_k, head_dim) = ({batch}, n, "
                                 f"{nheads_k}, {d}), got {tuple(k.shape)}, {tuple(v.shape)}")
            if tnew[0].dtype != tq.dtype or tnew[1].dtype != tq.dtype:
                raise TypeError(f"k and v must have q's dtype {tq.dtype}")
            self.seqlen_new = tnew[0].shape[1]
        self.rotary = rotary_cos is not None
        if rotary_sin is not None and rotary_cos is None:
            raise ValueError("rotary_cos and rotary_sin must both be given, (seqlen_ro, rotary_dim / 2)")
        self.opts = check_options(tq, tk, causal, window_size, softcap, alibi_slopes, 0.0, softmax_scale)
        self.local = (self.opts.left, self.opts.right) != (-1, -1)  # (causal: right 0)
        trot = (None, None)
        if self.rotary:
            for name, x in (("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin)):
                if x is not None:
                    _side(name, x)  # (an array of some kind: a list is refused by name)
            if rotary_sin is None or len(rotary_cos.shape) != 2 or tuple(rotary_sin.shape) != tuple(rotary_cos.shape):
                raise ValueError("rotary_cos and rotary_sin must both be given, (seqlen_ro, rotary_dim / 2)")
            trot = (inspect("rotary_cos", rotary_cos, 2), inspect("rotary_sin", rotary_sin, 2))
            if trot[0].dtype != trot[1].dtype or not (trot[0].dtype.kind == "f" or _arrays.is_bfloat16(trot[0].dtype)):
                raise TypeError(f"rotary_cos and rotary_sin must be floating point of one dtype, got {trot[0].dtype}, "
                                f"{trot[1].dtype}")
            if _side("rotary_cos", rotary_cos) != side and side == "numpy":
                raise TypeError("rotary_cos and rotary_sin must be NumPy arrays where q is one")
            if 2 * trot[0].shape[1] > d:
                raise ValueError(f"rotary_dim {2 * trot[0].shape[1]} exceeds head_dim {d}")
        interleaved = check_flag("rotary_interleaved", interleaved)
        self.step = _plan.DecodeStep(*tnew, *trot, interleaved=interleaved, local=self.local)
        # the options and the kernel
        self.splitkv = _use_splitkv(kernel, tq, tk, tv)
        if not self.splitkv and tq.kind == "torch":  # (the gather path runs on CuPy views of the tensors)
            if tq.bf16:
                raise TypeError("bfloat16 torch tensors decode on the split-KV kernel only (head_dim a multiple of "
                                "8, C-contiguous caches, compute capability 8.0 or newer); this call takes the "
                                "gather path")
            if _arrays.cupy is None:
                raise ImportError("torch tensors on the gather path (float32, or kernel='gather') need CuPy")
        self._call = self._append = None

    def _tensors(self, arrays):
        """The Tensors the planner takes: q, k_cache, v_cache, the lengths, the batch index, the block table."""
        tq, tk, tv = (inspect(n, x, 4) for n, x in zip(("q", "k_cache", "v_cache"), arrays[:3]))
        t = [None if x is None else inspect(n, x, len(x.shape)) for n, x in
             zip(("seqlens_k", "batch_idx", "block_table", "leftpad"), arrays[3:6] + arrays[11:12])]
        return tq, tk, tv, t

    def call(self, arrays) -> _launch.Call:
        """The split-KV launcher (the step's appends and rotations, the attention, the combine) for arrays in
        :func:`flash_attn_with_kvcache`'s order, planned at the first call."""
        if self._call is None:
            tq, tk, tv, t = self._tensors(arrays)
            p = _plan.decode_plan(tq, tk, tv, self.opts, seqlens=t[0], batch_idx=t[1], block_table=t[2],
                                  leftpad=t[3], max_seqlen_k=self.capacity, num_splits=self.num_splits,
                                  return_lse=self.return_lse, step=self.step)
            self._call = _launch.Call(p)
        return self._call

    def append_call(self, arrays) -> _launch.Call:
        """The gather path's first step (appends and rotations) alone, planned at the first call."""
        if self._append is None:
            tq, tk, tv, t = self._tensors(arrays)
            p = _plan.append_plan(tq, tk, tv, self.opts, seqlens=t[0], batch_idx=t[1], block_table=t[2],
                                  step=self.step)
            self._append = _launch.Call(p)
        return self._append


def _use_splitkv(kernel, tq, tk, tv) -> bool:
    """Whether the call runs on the split-KV kernel (see :func:`flash_attn_with_kvcache`'s ``kernel``)."""
    if kernel not in (None, "splitkv", "gather"):
        raise ValueError(f"kernel must be None, 'splitkv' or 'gather', got {kernel!r}")
    if kernel == "gather":
        return False
    blocker = None
    if not (tq.dtype == np.float16 or tq.bf16):
        blocker = f"it takes float16 or bfloat16, not {tq.dtype}"
    elif tq.shape[-1] not in tiling.MMA_HEAD_DIMS:
        blocker = f"it is built for head_dim a multiple of 8 up to 256, not {tq.shape[-1]}"
    elif not all(_launch.is_c_layout(t.shape, t.strides, t.dtype.itemsize) for t in (tk, tv)):
        blocker = "it reads C-contiguous caches (k_cache, v_cache)"
    elif not (_arrays.starts_aligned(tk.array) and _arrays.starts_aligned(tv.array)):
        blocker = "its 16-byte copies need caches that start on 16 bytes"
    elif not SIMULATOR and tuple(_plan.current_device().cc) < tiling.MMA_MIN_CC:
        blocker = "it needs compute capability 8.0 or newer (mma.sync, cp.async)"
    if blocker and kernel == "splitkv":
        raise ValueError(f"kernel='splitkv' does not apply: {blocker}")
    return blocker is None
