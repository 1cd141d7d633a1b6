"""The public functions: flash-attn's names and conventions, each call validated, planned, then launched.

Layout as in flash-attn: q ``(batch, seqlen_q, nheads, head_dim)``, k and v ``(batch, seqlen_k, nheads_k,
head_dim)``, out like q, lse ``(batch, nheads, seqlen_q)`` float32 (natural log). Arrays may be NumPy arrays (copied
to the GPU and back, or run in the simulator), CuPy arrays, torch CUDA tensors, or any ``__cuda_array_interface__``
object; the results have the input's array type (CuPy for a foreign CUDA array when CuPy is installed, else Numba
device arrays). Inputs are only read; strided inputs whose last dimension is contiguous are used in place (the
tensor-core kernels copy an input whose other strides are not multiples of 16 bytes, or whose start is not 16-byte
aligned).

dtypes: float32, float16 and bfloat16, accumulated in float32. bfloat16 comes as NumPy arrays of
``ml_dtypes.bfloat16`` or as torch.bfloat16 CUDA tensors; CuPy has no bfloat16.

Fast calls. A call's plan and its bound kernels are kept, keyed by the arrays' types, shapes, strides, dtypes and
devices and by the options; a later call with the same key only writes its arrays' addresses and launches (the
host never waits for the GPU, except for NumPy inputs, whose results are copied back, and for varlen calls, whose
offsets are checked on the host: :func:`flashnumba._validate.check_cu_seqlens`). The plan is made when a key is
first seen: ``FLASHNUMBA_MAX_SHARED_BYTES`` and the current device are read then.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
import threading
from typing import Any

import numpy as np

from . import _arrays, _launch, config, planner as _plan
from ._validate import (Options, check_blocks, check_cu_seqlens, check_dropout_p, check_dtypes, check_flag,
                        check_forward_results, check_mods, check_options, check_qkv, check_same_place, check_seed,
                        check_stream, inspect, kernel_for_precision, mod_args_tuple, check_array_arg, check_scale)

Array = Any  # a NumPy or CuPy array, a torch CUDA tensor, or any __cuda_array_interface__ object
MAX_PROBS_ELEMENTS = 2**26  # return_attn_probs materialises (batch, nheads, seqlen_q, seqlen_k): small sizes only
MAX_CACHED_CALLS = 512

_calls: dict = {}


def _typed(values) -> tuple:
    """The options with their types (and a tuple's members with theirs): 1.0, True and 1 are equal keys, and a
    call that the checks refuse must not find the kept call of one they took."""
    return tuple([(type(v), _typed(v) if type(v) is tuple else v) for v in values])


def _key(tag, arrays, options):
    """The cache key of a call, or None where an array gives none; an unhashable option shows at the lookup
    (:func:`_lookup`, :func:`_cached`: the call is then planned afresh). The key is hashed once, by the lookup."""
    try:
        meta = _arrays.meta_key
        return (tag, config.hopper_tma, config.hopper_exchange, config.hopper_persistent, config.hopper_3xtf32,
                config.hopper_overlap,
                tuple([None if x is None else meta(x) for x in arrays]), _typed(options))
    except (TypeError, AttributeError, ValueError, ImportError):
        return None


def _lookup(key):
    """The kept call of ``key``, or None (None too for a key that cannot be hashed)."""
    try:
        return _calls.get(key)
    except TypeError:
        return None


def _cached(key, build):
    try:
        call = _calls.get(key)
    except TypeError:  # (an option that cannot be hashed: planned at every call)
        return build()
    if call is None:
        call = build()
        if key is not None:
            if len(_calls) >= MAX_CACHED_CALLS:
                _calls.clear()
            _calls[key] = call
    return call


def _seed(dropout_p, seed, offset):
    """The per-call dropout seed and offset (checked at every call: they are not part of a plan)."""
    if seed is None and offset == 0 and not dropout_p:
        return 0, 0
    return check_seed(float(dropout_p), seed, offset)


def _stream(stream, ref):
    """The stream handle of a ``stream=`` argument (None: the arrays' current stream, chosen at launch)."""
    if stream is None:
        return None
    if isinstance(ref, np.ndarray):
        raise ValueError("stream= applies to device arrays: NumPy inputs are copied to the GPU and back, and the "
                         "call waits for its results")
    return check_stream(stream)


def clear_plan_cache() -> None:
    """Forget the kept plans (they are made again at the next call); the compiled kernels stay."""
    _calls.clear()


# ---------------------------------------------------------------------------------------------------------------
# validation into plans
# ---------------------------------------------------------------------------------------------------------------


def check_forward_args(q, k, v, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                       alibi_slopes=None, dropout_p=0.0):
    """(Tensors of q, k, v, Options): every check of a forward call that reads only shapes, strides and dtypes
    (no device memory, no plan); :mod:`flashnumba.torch` runs it on meta tensors too."""
    tq, tk, tv = (inspect(n, x, 4) for n, x in (("q", q), ("k", k), ("v", v)))
    check_same_place((tq, tk, tv))
    check_dtypes((tq, tk, tv))
    check_qkv(tq, tk, tv)
    opts = check_options(tq, tk, causal, window_size, softcap, alibi_slopes, dropout_p, softmax_scale)
    return (tq, tk, tv), opts


def _forward_plan(q, k, v, softmax_scale, causal, window_size, softcap, alibi_slopes, dropout_p, block_m, block_n,
                  num_threads, kernel, device=None):
    (tq, tk, tv), opts = check_forward_args(q, k, v, softmax_scale, causal, window_size, softcap, alibi_slopes,
                                            dropout_p)
    block_m, block_n, num_threads = check_blocks(block_m, block_n, num_threads)
    p = _plan.forward_plan(tq, tk, tv, opts, kernel=kernel, block_m=block_m, block_n=block_n,
                           num_threads=num_threads, device=device)
    return p, opts


def _backward_plan(dout, q, k, v, out, lse, softmax_scale, causal, window_size, softcap, alibi_slopes, dropout_p,
                   block_m, block_n, num_threads, kernel, device=None, flex=None, deterministic=True,
                   block_mask=None, mods_table_tiles=frozenset()):
    tq, tk, tv = (inspect(n, x, 4) for n, x in (("q", q), ("k", k), ("v", v)))
    tdo, to, tl = inspect("dout", dout, 4), inspect("out", out, 4), inspect("lse", lse, 3)
    check_same_place((tq, tk, tv, tdo, to, tl))
    check_dtypes((tq, tk, tv, tdo, to))
    check_qkv(tq, tk, tv)
    batch, seqlen_q, nheads, _ = tq.shape
    check_forward_results(tq, tdo, to, tl, "(batch, nheads, seqlen_q)", (batch, nheads, seqlen_q),
                          "flash_attn_forward")
    opts = check_options(tq, tk, causal, window_size, softcap, alibi_slopes, dropout_p, softmax_scale)
    if flex is not None:  # flex_attention_backward's (score_mod, score_mod_grad, mask_mod, args, enable_gqa)
        mods, targs = check_mods(tq, tk, *flex[:4], flex[4], backward=True)
        opts = dataclasses.replace(opts, mods=mods, mod_args=targs, block_mask=None if block_mask is None else
                                   _check_block_mask(block_mask, tq, tk), mods_table_tiles=mods_table_tiles)
    block_m, block_n, num_threads = check_blocks(block_m, block_n, num_threads)
    check_flag("deterministic", deterministic)
    p = _plan.backward_plan(tdo, tq, tk, tv, to, tl, opts, kernel=kernel, block_m=block_m, block_n=block_n,
                            num_threads=num_threads, device=device, deterministic=bool(deterministic))
    return p, opts


def _warn(p):
    if p.fallback:
        _plan._warn_slow(p.pass_, p.fallback)


def plan(q: Array, k: Array, v: Array, *, softmax_scale: float | None = None, causal: bool = False,
         window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0, alibi_slopes: Array | None = None,
         dropout_p: float = 0.0, block_m: int | None = None, block_n: int | None = None,
         num_threads: int | None = None, kernel: str | None = None, device: str | None = None,
         precision: str | None = None) -> _plan.Plan:
    """The plan :func:`flash_attn_forward` would run for these arguments, without running it: the kernel family
    and why, each kernel's tiles, threads, shared memory and grid. ``device``: None for the current GPU, or an
    architecture ("sm_75", "sm_80", "sm_86", "sm_89", "sm_90") to plan for another. ``print(plan(...))`` shows
    it; ``plan(...).resources()`` compiles the kernels and reports registers and spills (no GPU needed: without
    one, start Python with ``FLASHNUMBA_SIMULATOR=0``)."""
    if precision is not None:
        kernel = kernel_for_precision(precision, kernel, q, "forward")
    return _forward_plan(q, k, v, softmax_scale, causal, window_size, softcap, alibi_slopes, dropout_p, block_m,
                         block_n, num_threads, kernel, device)[0]


def plan_backward(dout: Array, q: Array, k: Array, v: Array, out: Array, lse: Array, *,
                  softmax_scale: float | None = None, causal: bool = False, window_size: tuple[int, int] = (-1, -1),
                  softcap: float = 0.0, alibi_slopes: Array | None = None, dropout_p: float = 0.0,
                  block_m: int | None = None, block_n: int | None = None, num_threads: int | None = None,
                  kernel: str | None = None, device: str | None = None,
                  precision: str | None = None, deterministic: bool = True) -> _plan.Plan:
    """The plan :func:`flash_attn_backward` would run (see :func:`plan`)."""
    if precision is not None:
        kernel = kernel_for_precision(precision, kernel, q, "backward")
    return _backward_plan(dout, q, k, v, out, lse, softmax_scale, causal, window_size, softcap, alibi_slopes,
                          dropout_p, block_m, block_n, num_threads, kernel, device,
                          deterministic=deterministic)[0]


# ---------------------------------------------------------------------------------------------------------------
# forward
# ---------------------------------------------------------------------------------------------------------------


def flash_attn_forward(
    q: Array, k: Array, v: Array, *, softmax_scale: float | None = None, causal: bool = False,
    window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0, alibi_slopes: Array | None = None,
    dropout_p: float = 0.0, dropout_seed: int | None = None, dropout_offset: int = 0, block_m: int | None = None,
    block_n: int | None = None, num_threads: int | None = None, kernel: str | None = None, stream: Any = None,
    precision: str | None = None
) -> tuple[Array, Array]:
    """Exact attention by a tiled, fused kernel that never materialises the seqlen_q x seqlen_k matrix.

    Parameters
    ----------
    q : (batch, seqlen_q, nheads, head_dim) float32, float16 or bfloat16
    k, v : (batch, seqlen_k, nheads_k, head_dim), same dtype; nheads a multiple of nheads_k (GQA / MQA:
        query head h reads key/value head h // (nheads // nheads_k))
    softmax_scale : float, default 1 / sqrt(head_dim)
    causal : bool. Bottom-right aligned: query i sees key j iff j <= i + seqlen_k - seqlen_q.
    window_size : (left, right), -1 for unbounded: query i sees keys
        i + seqlen_k - seqlen_q - left <= j <= i + seqlen_k - seqlen_q + right. causal sets right = 0.
    softcap : scores become softcap * tanh(scores / softcap) before the softmax (0: off).
    alibi_slopes : (nheads,) or (batch, nheads) float32: bias -slope * |i + seqlen_k - seqlen_q - j|.
    dropout_p, dropout_seed, dropout_offset : dropout on P with probability dropout_p; the mask is a function
        of (dropout_seed, dropout_offset, b, h, i, j) (Philox, :mod:`flashnumba.kernels.philox`), so the backward
        given the same seed and offset regenerates it. A seed is required when dropout_p > 0.
    block_m, block_n : B_r query rows and B_c key rows per tile (defaults: the kernel family's table in
        :mod:`flashnumba.tiling`, the first choice that fits this GPU).
    num_threads : threads per block (kernels v2, v3; "tc": 32 per 16 or per 32 query rows; the others derive
        their threads from their tiles).
    kernel : None (default): chosen by the plan (:mod:`flashnumba.planner`): "tc" for float16 / bfloat16 where the
        tensor cores apply ("wgmma" on compute capability 9.0 at every head_dim a multiple of 32 up to 256 and,
        padded, the multiples of 8 from 40 with 4096 keys or more, unless a block mask is given; at 96 only with
        its tensor-map copies), else "v3". Or: "v3" (register-tiled with unsigned index
        arithmetic), "v2" (the same with Numba's default signed indexing), "v1" (one thread per row, the readable
        one): the SIMT kernels of
        flashnumba.kernels.simt_forward; "tc": the tensor-core kernel (float16 or bfloat16, head_dim a multiple of
        8 up to 256, every option; block_m 16 to 256 as 1, 2, 4 or 8 warps of 16 or 32 rows, block_n a multiple
        of 16; compute capability >= 8.0), flashnumba.kernels.mma_forward; "tf32",
        "3xtf32": float32 on tensor cores (opt-in; head_dim 64 or 128, causal or not, no other option): operands
        rounded to TF32 (about float16's precision), or split in two TF32 parts and multiplied three times (about
        float32's precision), flashnumba.kernels.mma_tf32; "wgmma": the Hopper kernel on warpgroup MMA (the
        default on compute capability 9.0 at every head_dim a multiple of 32 up to 256, both passes,
        flashnumba.tiling.WGMMA_DEFAULT_HEAD_DIMS (the forward at 96 where it copies with tensor maps: sequences
        of equal length, at most two options); 9.0
        only, float16 or bfloat16, head_dim a multiple of 32 up to 256 (the other multiples of 8 run at the next
        multiple of 32, on copies of q, k, v with zero columns appended, the output cropped), every option;
        block_m 64, 128 or 192 as one to three warpgroups (three with num_threads 512 and tensor maps, up to
        head_dim 160), block_n 32, 48, 64 or 128 (above head_dim 128 by default 64, at 256 48: the shared
        memory; 48 where the threads that copy take it, flashnumba.kernels.wgmma_forward.check); num_threads
        2 block_m, or + 32 or + 128 for a producer of one warp or four, the default),
        flashnumba.kernels.wgmma_forward; at head_dim 96
        without its tensor-map copies "tc" is the faster (docs/benchmarks.md).

    stream : the CUDA stream to launch on (see :func:`flashnumba._validate.check_stream`); None: the arrays'
        current stream (torch's for torch tensors, CuPy's for CuPy arrays). The outputs (and any temporary or
        copy) are allocated on that stream: use them there, or order the other stream after it.
    precision : float32 inputs only: "ieee" (the default, what None means): exact float32 arithmetic on the SIMT
        kernels; "3xtf32" and "tf32": the tensor-core kernels of those names (the same as ``kernel=``), faster
        (docs/benchmarks.md). TF32 rounds the operands to 10 mantissa bits (float16's error); 3xTF32 splits each
        operand in two and multiplies three times, each k-step's products summed from zero and added to the
        accumulator rounded to nearest, float32-class (within 2x of a plain float32 computation's error,
        tests/test_tf32.py). "ieee" is the default because it takes every option, head dim and the backward.

    Returns
    -------
    out : like q, in q's dtype (float32 accumulation)
    lse : (batch, nheads, seqlen_q) float32, natural-log logsumexp of each row of the scaled scores;
        -inf (and out = 0) for a row that sees no key.
    """
    if precision is not None:
        kernel = kernel_for_precision(precision, kernel, q, "forward")
    key = _key("fwd", (q, k, v, alibi_slopes), (softmax_scale, causal, window_size, softcap, dropout_p, block_m,
                                                block_n, num_threads, kernel))

    def build():
        p, _ = _forward_plan(q, k, v, softmax_scale, causal, window_size, softcap, alibi_slopes, dropout_p,
                             block_m, block_n, num_threads, kernel)
        _warn(p)
        return _launch.Call(p)

    call = _cached(key, build)
    seed, offset = _seed(dropout_p, dropout_seed, dropout_offset)
    out, lse = call.run((q, k, v, alibi_slopes, None, None), seed, offset, _stream(stream, q))
    return out, lse


def flash_attn_backward(dout: Array, q: Array, k: Array, v: Array, out: Array, lse: Array, *,
                        softmax_scale: float | None = None, causal: bool = False,
                        window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                        alibi_slopes: Array | None = None, dropout_p: float = 0.0, dropout_seed: int | None = None,
                        dropout_offset: int = 0, block_m: int | None = None, block_n: int | None = None,
                        num_threads: int | None = None, kernel: str | None = None,
                        stream: Any = None, precision: str | None = None,
                        deterministic: bool = True) -> tuple[Array, Array, Array]:
    """Gradients (dq, dk, dv) of attention, recomputing P tile by tile from q, k and the forward's lse.

    ``out`` and ``lse`` are what :func:`flash_attn_forward` returned for (q, k, v) with the same softmax_scale,
    causal, window_size, softcap, alibi_slopes and dropout arguments (with GQA, dk and dv are summed over the
    query heads that share a key/value head); dout is the gradient of the loss with respect to out (like q).
    Extra device memory is O(batch * nheads * seqlen_q): one float per query row (D_i = rowsum(dout * out)).
    Deterministic by default: no atomics, the same bits on every run.

    block_m, block_n: query and key tile sizes; num_threads: threads per block (v2); kernel: "v2" (register-tiled)
    or "v1" (one thread per row, the readable one), see flashnumba.kernels.simt_backward; "tc" (tensor cores:
    float16 or bfloat16, head_dim a multiple of 8 up to 256, every option;
    block_m and block_n in 16, 32, 64, 128; its dQ and dK/dV kernels each have their own tile table, ``tc_dq`` and
    ``tc_dkdv`` in flashnumba.tiling, and a block_m or block_n given applies to both), see
    flashnumba.kernels.mma_backward; "tf32", "3xtf32" (float32 on tensor cores, as ``precision=``); "wgmma"
    (Hopper's warpgroup MMA, compute capability 9.0 only, the default there at every multiple of 32: float16
    or bfloat16, head_dim a multiple of 32 up to 256 (other multiples of 8 padded, as in the forward), every
    option, deterministic; the dQ kernel takes 64 or 128
    query rows a block and tiles of 32, 64 or 128 keys, the dK/dV kernel 64 or 128 keys a block (above head_dim
    128, 64 keys on two warpgroups, each half of the head dims) and tiles of 32 or 64 queries; the plan gives them
    tiles of 32 where the per-entry options would spill, the dK/dV kernel at head_dim 128 tiles of 32 where a
    producer warpgroup copies with tensor maps, the dQ kernel at head_dim 64 with a right bound alone (causal), or
    a block-masked mask_mod alone, tiles of 128 keys (flashnumba.tiling, wgmma_dq_for_variant and
    wgmma_dkdv_for_variant); a block_m or block_n given applies to both, so block_m 64 and block_n 64 or 128
    (above head_dim 128, 64); no num_threads), see
    flashnumba.kernels.wgmma_backward. None (default): "tc" where it applies (as for the forward; "wgmma" on
    compute capability 9.0 where it applies, unless deterministic=False, a block mask or strided inputs), else
    "v2". stream: as for :func:`flash_attn_forward`.
    precision: float32 only, "ieee" (None: the same), or "tf32" / "3xtf32": the TF32 backward kernels
    (flashnumba.kernels.mma_tf32_backward; head_dim 64 or 128, causal or not), as for the forward; with
    flashnumba.config.hopper_3xtf32 set, "3xtf32" runs on Hopper's wgmma on compute capability 9.0
    (flashnumba.kernels.wgmma_tf32_backward: block_m the dK/dV kernel's query rows a tile, block_n the dQ kernel's
    keys a tile, 16 or 32 at head_dim 64, 16 at 128).
    deterministic: True (default); False, on the tensor cores, has the dK/dV kernel add dQ into a float32
    buffer with atomic adds (one kernel of five products instead of two of seven, FlashAttention-2's backward;
    extra memory 4 bytes per element of q), so dq's last bits vary from run to run (dk and dv do not). On the
    H200 it is not yet faster than the default (docs/benchmarks.md: the atomic adds cost what the second kernel
    did). The SIMT kernels have no such variant and stay deterministic.

    Returns dq like q, dk and dv like k, in the input dtype (float32 accumulation).
    """
    if precision is not None:
        kernel = kernel_for_precision(precision, kernel, q, "backward")
    key = _key("bwd", (dout, q, k, v, out, lse, alibi_slopes),
               (softmax_scale, causal, window_size, softcap, dropout_p, block_m, block_n, num_threads, kernel,
                deterministic))

    def build():
        p, _ = _backward_plan(dout, q, k, v, out, lse, softmax_scale, causal, window_size, softcap, alibi_slopes,
                              dropout_p, block_m, block_n, num_threads, kernel, deterministic=deterministic)
        _warn(p)
        return _launch.Call(p)

    call = _cached(key, build)
    seed, offset = _seed(dropout_p, dropout_seed, dropout_offset)
    dq, dk, dv = call.run((dout, q, k, v, out, lse, alibi_slopes, None, None), seed, offset, _stream(stream, q))
    return dq, dk, dv


# ---------------------------------------------------------------------------------------------------------------
# flash-attn's conveniences
# ---------------------------------------------------------------------------------------------------------------


def _check_keywords(function, names, target, given=()):
    """TypeError for a keyword argument (of ``names``) of ``function`` that neither it nor ``target`` (which it
    passes them to, with the arguments ``given`` of its own) takes, as Python would raise it, before any work (a
    dropout seed drawn, a kernel run)."""
    unknown = set(names).difference(_keywords(target)) | set(names).intersection(given)
    if unknown:
        raise TypeError(f"{function}() got an unexpected keyword argument {sorted(unknown)[0]!r}")


@functools.lru_cache(maxsize=None)
def _keywords(function) -> frozenset:
    import inspect as _inspect

    return frozenset(_inspect.signature(function).parameters)


def _check_func_flags(dropout_p, deterministic, return_attn_probs, kwargs, q, heads_of_batch, validate):
    """flash-attn's extra arguments; with dropout and no dropout_seed in kwargs, the call validated
    (``validate()``: a bad call leaves torch's generator where it was), then a fresh seed and offset
    (:func:`draw_dropout_seed`), kept for :func:`last_dropout_seed`."""
    check_flag("return_attn_probs", return_attn_probs)
    check_flag("deterministic", deterministic)
    check_dropout_p(dropout_p)
    if dropout_p and kwargs.get("dropout_seed") is None:
        if "dropout_offset" in kwargs:
            raise ValueError("dropout_offset was given without dropout_seed")
        validate()
        kwargs["dropout_seed"], kwargs["dropout_offset"] = _local.seed = draw_dropout_seed(q, heads_of_batch)


_local = threading.local()
_generator_lock = threading.Lock()  # a generator's offset read and advanced as one step among this process's calls
PHILOX_STEP = 32  # per (batch, head): how far flash-attn advances torch's generator offset at each dropout call
_MASK32 = 2**32 - 1


def _heads_of_batch(q, rank, cu_seqlens):
    """batch * nheads of a call (for the generator's advance), or 1 where q's shape is not yet checked."""
    try:
        shape = _arrays.shape_strides_dtype(q)[0]
        batch = shape[0] if cu_seqlens is None else _arrays.shape_strides_dtype(cu_seqlens)[0][0] - 1
        return int(batch) * int(shape[-2]) if len(shape) == rank else 1
    except Exception:  # noqa: BLE001  (validation reports bad arrays with its own message)
        return 1


def random_seed() -> int:
    """A fresh 64-bit dropout seed from the operating system's entropy."""
    return int(np.random.SeedSequence().generate_state(1, np.uint64)[0])


def draw_dropout_seed(q: Array, heads_of_batch: int = 1) -> tuple[int, int]:
    """A fresh (dropout_seed, dropout_offset) for a call with dropout on q.

    For torch tensors they come from torch's CUDA generator of q's device, so ``torch.manual_seed`` reproduces a
    run: the generator's seed and its Philox offset, which is then advanced as flash-attn advances it
    (``batch * nheads * 32``, ``heads_of_batch`` being batch * nheads), so the random numbers torch draws after
    the call are those it would draw after flash-attn's. The kernels' counter takes the offset's low 32 bits
    (:mod:`flashnumba.kernels.philox`); its high 32 bits are folded into the seed's, so every generator state
    gives its own mask. For other arrays: a seed from the operating system's entropy and offset 0.
    """
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(q, torch.Tensor) and q.is_cuda:
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError("dropout while a CUDA graph is being captured: torch's generator cannot be read "
                               "then; pass dropout_seed (and dropout_offset) to flashnumba's core API, or capture "
                               "without dropout")
        gen = torch.cuda.default_generators[q.device.index]
        with _generator_lock:
            seed, offset = gen.initial_seed() % 2**64, gen.get_offset()
            gen.set_offset(offset + PHILOX_STEP * max(int(heads_of_batch), 1))
        return seed ^ ((offset >> 32) << 32), offset & _MASK32
    return random_seed(), 0


def last_dropout_seed() -> tuple[int, int] | None:
    """(dropout_seed, dropout_offset) that this thread's last :func:`flash_attn_func` or
    :func:`flash_attn_varlen_func` call drew (dropout_p > 0 and no dropout_seed given): pass them to the backward
    to regenerate its mask. None before any such call."""
    return getattr(_local, "seed", None)


def flash_attn_func(q: Array, k: Array, v: Array, dropout_p: float = 0.0, softmax_scale: float | None = None,
                    causal: bool = False, window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                    alibi_slopes: Array | None = None, deterministic: bool = False, return_attn_probs: bool = False,
                    **kwargs) -> Array | tuple[Array, Array, Array]:
    """flash-attn's ``flash_attn_func``, with its argument names and defaults: returns the attention output.

    With ``dropout_p`` > 0 the mask comes from ``dropout_seed`` and ``dropout_offset`` (keyword arguments); when
    no seed is given a fresh one is drawn (:func:`draw_dropout_seed`: from torch's generator for torch tensors)
    and :func:`last_dropout_seed` returns it, for the backward. ``return_attn_probs=True`` returns
    (out, lse, P * Z) with the probabilities after dropout (small sizes; :func:`attention_probs`);
    ``deterministic`` is accepted (flashnumba is always deterministic). Other keyword arguments (``kernel``, block
    sizes, ``dropout_seed``, ``dropout_offset``, ``stream``) go to :func:`flash_attn_forward`.
    """
    opts = dict(softmax_scale=softmax_scale, causal=causal, window_size=window_size, softcap=softcap,
                alibi_slopes=alibi_slopes, dropout_p=dropout_p)
    if kwargs:
        _check_keywords("flash_attn_func", kwargs, flash_attn_forward)
    if check_flag("return_attn_probs", return_attn_probs):  # (too many refused before a seed or a kernel)
        (tq, tk, _), _ = check_forward_args(q, k, v, **opts)
        check_probs_size(tq.shape[0], tq.shape[2], tq.shape[1], tk.shape[1])
    _check_func_flags(dropout_p, deterministic, return_attn_probs, kwargs, q, _heads_of_batch(q, 4, None),
                      lambda: check_forward_args(q, k, v, **opts))
    out, lse = flash_attn_forward(q, k, v, **opts, **kwargs)
    if not return_attn_probs:
        return out
    seeds = {n: kwargs[n] for n in ("dropout_seed", "dropout_offset", "stream") if n in kwargs}
    return out, lse, attention_probs(q, k, v, lse, **opts, **seeds)


def check_probs_size(batch, nheads, seqlen_q, seqlen_k) -> None:
    """ValueError where the probabilities of :func:`attention_probs` would be more than MAX_PROBS_ELEMENTS."""
    if batch * nheads * seqlen_q * seqlen_k > MAX_PROBS_ELEMENTS:
        raise ValueError(f"return_attn_probs materialises batch * nheads * seqlen_q * seqlen_k = "
                         f"{batch * nheads * seqlen_q * seqlen_k} floats, more than the {MAX_PROBS_ELEMENTS} "
                         f"allowed for this debugging path")


def attention_probs(q: Array, k: Array, v: Array, lse: Array, *, softmax_scale: float | None = None,
                    causal: bool = False, window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                    alibi_slopes: Array | None = None, dropout_p: float = 0.0, dropout_seed: int | None = None,
                    dropout_offset: int = 0, stream: Any = None) -> Array:
    """The probabilities P_ij = exp(S_ij - L_i), times the dropout multiplier Z_ij (0 where dropped,
    1 / (1 - dropout_p) where kept), as a (batch, nheads, seqlen_q, seqlen_k) float32 array: the debugging
    path behind ``return_attn_probs=True``, for small sizes. ``lse`` is the forward's; the dropout arguments
    must be the forward's. Rows that see no key are 0."""
    tq, tk, tv = (inspect(n, x, 4) for n, x in (("q", q), ("k", k), ("v", v)))
    tl = inspect("lse", lse, 3)
    check_same_place((tq, tk, tv, tl))
    check_dtypes((tq, tk, tv))
    check_qkv(tq, tk, tv)
    batch, seqlen_q, nheads, head_dim = tq.shape
    seqlen_k = tk.shape[1]
    if tl.shape != (batch, nheads, seqlen_q) or tl.dtype != np.float32:
        raise ValueError(f"lse must be float32 of shape {(batch, nheads, seqlen_q)}, got {tl.dtype} {tl.shape}")
    check_probs_size(batch, nheads, seqlen_q, seqlen_k)
    opts = check_options(tq, tk, causal, window_size, softcap, alibi_slopes, dropout_p, softmax_scale)
    seed, offset = check_seed(opts.dropout_p, dropout_seed, dropout_offset)
    call = _launch.Call(_plan.probs_plan(tq, tk, tl, opts))
    return call.run((q, k, lse, alibi_slopes, None, None), seed, offset, _stream(stream, q))[0]


# ---------------------------------------------------------------------------------------------------------------
# variable-length (packed) batches
# ---------------------------------------------------------------------------------------------------------------


def _varlen_tensors(names_arrays, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, read_values=None):
    tq, tk, tv = (inspect(n, x, 3) for n, x in names_arrays[:3])
    check_same_place((tq, tk, tv))
    check_dtypes((tq, tk, tv))
    batch, tcq, tck, max_q, max_k = check_cu_seqlens(
        tq, tk, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
        read_values=config.check_device_values if read_values is None else read_values)
    check_qkv(*(_lead(t) for t in (tq, tk, tv)))
    return tq, tk, tv, batch, (tcq, tck), max_q, max_k


def check_varlen_args(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale=None,
                      causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None, dropout_p=0.0):
    """The checks of a varlen forward call that read only shapes, strides and dtypes (the offsets' values are not
    read): as :func:`check_forward_args`. Returns the batch size."""
    tq, tk, _, batch, _, _, _ = _varlen_tensors((("q", q), ("k", k), ("v", v)), cu_seqlens_q, cu_seqlens_k,
                                                max_seqlen_q, max_seqlen_k, read_values=False)
    check_options(tq, tk, causal, window_size, softcap, alibi_slopes, dropout_p, softmax_scale, batch=batch,
                  varlen=True, lengths=(max_seqlen_q, max_seqlen_k))
    return batch


def _varlen_call(tag, arrays, options, varlen_args, plan):
    """The kept Call of a varlen call, or a new one from ``plan(tq, tk, tv, batch, cu, max_q, max_k)``. The offsets
    are checked at every call (their values are not part of the key): NumPy ones always, device ones unless
    ``config.check_device_values`` is off."""
    key = _key(tag, arrays, options)
    call = _lookup(key)
    if call is not None and not config.check_device_values and not any(  # (NumPy offsets: checked, for free)
            isinstance(cu, np.ndarray) for cu in varlen_args[3:5]):
        return call
    q, k, v, cu_q, cu_k, max_q, max_k = varlen_args
    checked = _varlen_tensors((("q", q), ("k", k), ("v", v)), cu_q, cu_k, max_q, max_k)

    def build():
        p = plan(*checked)
        _warn(p)
        return _launch.Call(p)

    return call or _cached(key, build)


def _lead(t):
    """t with a leading axis of length 1 (shapes only: for the checks written for 4-D arrays)."""
    return type(t)(t.name, t.array, t.kind, (1, *t.shape), (0, *t.strides), t.dtype)


def flash_attn_varlen_forward(q: Array, k: Array, v: Array, cu_seqlens_q: Array, cu_seqlens_k: Array,
                              max_seqlen_q: int, max_seqlen_k: int, *, softmax_scale: float | None = None,
                              causal: bool = False, window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                              alibi_slopes: Array | None = None, dropout_p: float = 0.0,
                              dropout_seed: int | None = None, dropout_offset: int = 0, block_m: int | None = None,
                              block_n: int | None = None, num_threads: int | None = None,
                              kernel: str | None = None, stream: Any = None) -> tuple[Array, Array]:
    """Attention over a batch of packed sequences of different lengths (flash-attn's varlen layout).

    q (total_q, nheads, d), k and v (total_k, nheads_k, d); sequence b is rows cu_seqlens_q[b] ..
    cu_seqlens_q[b+1] of q and cu_seqlens_k[b] .. cu_seqlens_k[b+1] of k, v (int32 arrays of shape
    (batch + 1,), starting at 0, non-decreasing; sequences of length 0 allowed). max_seqlen_q / max_seqlen_k
    bound the lengths. Every option of :func:`flash_attn_forward` applies per sequence (causal and windows
    aligned to each sequence's bottom-right corner; ALiBi slopes (nheads,) or (batch, nheads)).
    The offsets are copied to the host and checked at every call (``flashnumba.config.check_device_values``;
    turn it off to capture varlen calls in a CUDA graph). ``stream``: as for :func:`flash_attn_forward`.

    Returns out (total_q, nheads, d) and lse (nheads, total_q) float32.
    """
    def build(tq, tk, tv, batch, cu, max_q, max_k):
        opts = check_options(tq, tk, causal, window_size, softcap, alibi_slopes, dropout_p, softmax_scale,
                             batch=batch, varlen=True, lengths=(max_q, max_k))
        bm, bn, nt = check_blocks(block_m, block_n, num_threads)
        return _plan.forward_plan(tq, tk, tv, opts, kernel=kernel, block_m=bm, block_n=bn, num_threads=nt,
                                  batch=batch, max_seqlen_q=max_q, cu=cu)

    call = _varlen_call("vfwd", (q, k, v, alibi_slopes, cu_seqlens_q, cu_seqlens_k),
                        (max_seqlen_q, max_seqlen_k, softmax_scale, causal, window_size, softcap, dropout_p, block_m,
                         block_n, num_threads, kernel), (q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                                         max_seqlen_k), build)
    seed, offset = _seed(dropout_p, dropout_seed, dropout_offset)
    out, lse = call.run((q, k, v, alibi_slopes, cu_seqlens_q, cu_seqlens_k), seed, offset, _stream(stream, q))
    return out, lse


def flash_attn_varlen_backward(dout: Array, q: Array, k: Array, v: Array, out: Array, lse: Array,
                               cu_seqlens_q: Array, cu_seqlens_k: Array, max_seqlen_q: int, max_seqlen_k: int, *,
                               softmax_scale: float | None = None, causal: bool = False,
                               window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                               alibi_slopes: Array | None = None, dropout_p: float = 0.0,
                               dropout_seed: int | None = None, dropout_offset: int = 0, block_m: int | None = None,
                               block_n: int | None = None, num_threads: int | None = None,
                               kernel: str | None = None, stream: Any = None,
                               deterministic: bool = True) -> tuple[Array, Array, Array]:
    """Gradients (dq, dk, dv) of :func:`flash_attn_varlen_forward`; dout and out (total_q, nheads, d), lse
    (nheads, total_q) as the forward returned them. ``deterministic``: as for :func:`flash_attn_backward`."""
    check_flag("deterministic", deterministic)

    def build(tq, tk, tv, batch, cu, max_q, max_k):
        tdo, to, tl = inspect("dout", dout, 3), inspect("out", out, 3), inspect("lse", lse, 2)
        check_same_place((tq, tk, tv, tdo, to, tl))
        check_dtypes((tq, tk, tv, tdo, to))
        check_forward_results(tq, tdo, to, tl, "(nheads, total_q)", (tq.shape[1], tq.shape[0]),
                              "flash_attn_varlen_forward")
        opts = check_options(tq, tk, causal, window_size, softcap, alibi_slopes, dropout_p, softmax_scale,
                             batch=batch, varlen=True, lengths=(max_q, max_k))
        bm, bn, nt = check_blocks(block_m, block_n, num_threads)
        return _plan.backward_plan(tdo, tq, tk, tv, to, tl, opts, kernel=kernel, block_m=bm, block_n=bn,
                                   num_threads=nt, batch=batch, max_seqlen_q=max_q, max_seqlen_k=max_k, cu=cu,
                                   deterministic=bool(deterministic))

    call = _varlen_call("vbwd", (dout, q, k, v, out, lse, alibi_slopes, cu_seqlens_q, cu_seqlens_k),
                        (max_seqlen_q, max_seqlen_k, softmax_scale, causal, window_size, softcap, dropout_p, block_m,
                         block_n, num_threads, kernel, deterministic),
                        (q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k), build)
    seed, offset = _seed(dropout_p, dropout_seed, dropout_offset)
    dq, dk, dv = call.run((dout, q, k, v, out, lse, alibi_slopes, cu_seqlens_q, cu_seqlens_k), seed, offset,
                          _stream(stream, q))
    return dq, dk, dv


def flash_attn_varlen_func(q: Array, k: Array, v: Array, cu_seqlens_q: Array, cu_seqlens_k: Array,
                           max_seqlen_q: int, max_seqlen_k: int, dropout_p: float = 0.0,
                           softmax_scale: float | None = None, causal: bool = False,
                           window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                           alibi_slopes: Array | None = None, deterministic: bool = False,
                           return_attn_probs: bool = False, **kwargs) -> Array:
    """flash-attn's ``flash_attn_varlen_func``, with its argument names and defaults: the output only
    (``return_attn_probs`` is not available for packed batches). With dropout and no ``dropout_seed``: as
    :func:`flash_attn_func`."""
    if kwargs:
        _check_keywords("flash_attn_varlen_func", kwargs, flash_attn_varlen_forward)
    if check_flag("return_attn_probs", return_attn_probs):  # (before a dropout seed is drawn)
        raise ValueError("return_attn_probs=True is not implemented for variable-length batches")
    _check_func_flags(dropout_p, deterministic, return_attn_probs, kwargs, q, _heads_of_batch(q, 3, cu_seqlens_q),
                      lambda: check_varlen_args(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                                softmax_scale, causal, window_size, softcap, alibi_slopes,
                                                dropout_p))
    return flash_attn_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                     softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                                     softcap=softcap, alibi_slopes=alibi_slopes, dropout_p=dropout_p, **kwargs)[0]


def attention_with_grad(q: Array, k: Array, v: Array, dout: Array, *, softmax_scale: float | None = None,
                        causal: bool = False, window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                        alibi_slopes: Array | None = None, dropout_p: float = 0.0, dropout_seed: int | None = None,
                        dropout_offset: int = 0, **kwargs) -> tuple[Array, Array, Array, Array]:
    """Forward and backward together, for users without an autograd system: returns (out, dq, dk, dv).

    Equivalent to ``out, lse = flash_attn_forward(q, k, v, ...)`` then
    ``flash_attn_backward(dout, q, k, v, out, lse, ...)``. ``kernel`` chooses the forward kernel,
    ``backward_kernel`` the backward's; ``block_m``, ``block_n`` and ``num_threads`` apply to the backward (the
    forward uses its defaults). With dropout and no ``dropout_seed``, a fresh seed (:func:`draw_dropout_seed`) serves
    both passes.
    """
    _check_keywords("attention_with_grad", kwargs.keys() - {"backward_kernel"}, flash_attn_backward,
                    given=("dout", "q", "k", "v", "out", "lse"))
    fwd_kw = {n: kwargs.pop(n) for n in ("kernel",) if n in kwargs}
    for n in ("stream", "precision"):
        if n in kwargs:
            fwd_kw[n] = kwargs[n]
    if dropout_p and dropout_seed is None:  # validated first: a bad call leaves torch's generator as it was
        check_forward_args(q, k, v, softmax_scale, causal, window_size, softcap, alibi_slopes, dropout_p)
        dropout_seed, dropout_offset = draw_dropout_seed(q, _heads_of_batch(q, 4, None))
    if "backward_kernel" in kwargs:
        kwargs["kernel"] = kwargs.pop("backward_kernel")
    opts = dict(softmax_scale=softmax_scale, causal=causal, window_size=window_size, softcap=softcap,
                alibi_slopes=alibi_slopes, dropout_p=dropout_p, dropout_seed=dropout_seed,
                dropout_offset=dropout_offset)
    out, lse = flash_attn_forward(q, k, v, **opts, **fwd_kw)
    dq, dk, dv = flash_attn_backward(dout, q, k, v, out, lse, **opts, **kwargs)
    return out, dq, dk, dv


# ---------------------------------------------------------------------------------------------------------------
# your own variant: score_mod and mask_mod (FlexAttention's interface)
# ---------------------------------------------------------------------------------------------------------------


def flex_attention(q: Array, k: Array, v: Array, score_mod=None, mask_mod=None, *, scale: float | None = None,
                   enable_gqa: bool = False, return_lse: bool = False, score_mod_args: tuple = (),
                   kernel: str | None = None, block_m: int | None = None, block_n: int | None = None,
                   num_threads: int | None = None, block_mask=None, stream: Any = None):
    """Attention with your own score modification and mask, FlexAttention's interface in flashnumba's layout.

    ``score_mod(score, b, h, q_idx, kv_idx, *score_mod_args)`` returns the modified score (score = scale q . k,
    natural units) and ``mask_mod(b, h, q_idx, kv_idx, *score_mod_args)`` whether query q_idx may see key kv_idx:
    plain Python functions of one entry, compiled by Numba as device functions into the kernels (in the
    simulator they run as Python, so a debugger steps through them). b: the batch entry, h: the query head,
    q_idx and kv_idx: positions in the sequences (no alignment shift: a bottom-right causal mask is ``q_idx + seqlen_k -
    seqlen_q >= kv_idx``), each an int32; score a float32, and a Python float in the functions float32 (as
    FlexAttention's compiler takes one beside the score); an integer and a float32 together are float64 in Numba,
    several times slower on a GPU: ``abs(np.float32(q_idx) - np.float32(kv_idx))`` keeps ALiBi in float32 (a
    function that computes in float64 draws a one-time :class:`flashnumba.planner.SlowPathWarning`), and
    ``flashnumba.tanh_approx`` is the Hopper kernels' softcap's tanh. ``score_mod_args``: up to 4 arrays on q's device
    that the functions read, indexed as they like (a bias table, document ids); a number is better closed over
    (each value compiles its own kernel). A function may call other plain Python functions (a
    score_mod built from two others): they are compiled with it. A function is compiled once per function object
    (define it once, not in a loop). One that Numba cannot compile, that takes the wrong arguments or that returns
    something other than one number raises a TypeError naming it before any launch (in the simulator, which compiles
    nothing, each function is called once on the host first, at score 1.0 and indices 0).

    q (batch, seqlen_q, nheads, head_dim), k and v (batch, seqlen_k, nheads_k, head_dim) in float32, float16 or
    bfloat16; nheads_k < nheads needs ``enable_gqa=True``. Returns out like q, or (out, lse) with
    ``return_lse``; a row that sees no key has out 0 and lse -inf. The functions run on the tensor-core forward
    for float16 / bfloat16 on a GPU (``kernel`` None or "tc") and on the register-tiled SIMT kernels otherwise
    (None, "v3" or "v2"); also on the Hopper forward (``kernel="wgmma"``, compute capability 9.0: the score_mod at
    every score, the mask_mod in the forward's mask pass, run only in the tiles it may hide entries of), which
    ``kernel=None`` takes there at the head dims of :data:`flashnumba.tiling.WGMMA_MODS_DEFAULT_HEAD_DIMS` for a
    score_mod and for a mask_mod with a block mask (its blocks multiples of 128);
    ``block_m``, ``block_n``, ``num_threads`` tile them as in :func:`flash_attn_forward`.
    ``block_mask``: a :class:`flashnumba.blockmask.BlockMask` of the mask_mod (``create_block_mask``, with the
    same score_mod_args): the tensor-core and Hopper forwards then skip the key blocks it hides entirely and
    evaluate the mask_mod only in the blocks it hides in part (the SIMT kernels evaluate it everywhere, as without
    it); pass it to :func:`flex_attention_backward` too. mask_mod may then be left out. Checked against
    :func:`flashnumba.reference.flex_attention_forward`.
    """
    mask_mod, score_mod_args = _block_mask_for(block_mask, mask_mod, score_mod_args)
    args = mod_args_tuple(score_mod_args)
    bm = () if block_mask is None else tuple(getattr(block_mask, n) for n in _BLOCK_MASK_ARRAYS[:3])
    blocks = None if block_mask is None else (block_mask.Q_BLOCK_SIZE, block_mask.KV_BLOCK_SIZE)
    key = _key("flex", (q, k, v) + args + bm, (scale, score_mod, mask_mod, enable_gqa, kernel, block_m, block_n,
                                               num_threads, blocks))

    def build():  # the functions and arrays are checked once per key, with the rest of the call
        check_scale(scale, 1, "scale")  # (FlexAttention's name for it, in the message)
        check_flag("enable_gqa", enable_gqa)
        (tq, tk, tv), opts = check_forward_args(q, k, v, softmax_scale=scale)
        mods, targs = check_mods(tq, tk, score_mod, None, mask_mod, score_mod_args, enable_gqa)
        opts = dataclasses.replace(opts, mods=mods, mod_args=targs,
                                   block_mask=None if block_mask is None else _check_block_mask(block_mask, tq, tk))
        bm, bn, nt = check_blocks(block_m, block_n, num_threads)

        def make(keep):
            return _plan.forward_plan(tq, tk, tv, dataclasses.replace(opts, mods_table_tiles=keep), kernel=kernel,
                                      block_m=bm, block_n=bn, num_threads=nt), mods

        return _launch.Call(_flex_compiled(make, ("wgmma",)))

    call = _cached(key, build)
    return_lse = check_flag("return_lse", return_lse)  # (not part of the key: checked at every call)
    out, lse = call.run((q, k, v, None, None, None) + args + (None,) * (len(_plan.MOD_PARAMS) - len(args)) + bm,
                        0, 0, _stream(stream, q))
    return (out, lse) if return_lse else out


def _check_block_mask(block_mask, tq, tk):
    """(Q block, KV block, Tensors of its arrays) of a BlockMask that suits q and k: its lengths theirs, its B and
    H 1 or theirs, its arrays on q's device."""
    batch, seqlen_q, nheads, _ = tq.shape
    if tuple(block_mask.seq_lengths) != (seqlen_q, tk.shape[1]):
        raise ValueError(f"block_mask was made for (Q_LEN, KV_LEN) = {tuple(block_mask.seq_lengths)}, the call has "
                         f"({seqlen_q}, {tk.shape[1]})")
    B, H = block_mask.state.shape[:2]
    if B not in (1, batch) or H not in (1, nheads):
        raise ValueError(f"block_mask has B = {B}, H = {H}: each must be 1 or the call's ({batch}, {nheads})")
    arrays = [check_array_arg(f"block_mask.{n}", getattr(block_mask, n), tq, "") for n in _BLOCK_MASK_ARRAYS]
    return (block_mask.Q_BLOCK_SIZE, block_mask.KV_BLOCK_SIZE, *arrays)


# a BlockMask's arrays in the order the plans take them (planner.BLOCK_MASK_PARAMS): the forward the first three,
# the backward all five
_BLOCK_MASK_ARRAYS = ("kv_num_blocks", "kv_indices", "state", "q_num_blocks", "q_indices")


def _block_mask_for(block_mask, mask_mod, score_mod_args):
    """(mask_mod, score_mod_args) of a call given a block mask: its own where the call leaves them out; checks that
    it is a BlockMask made for this mask_mod and these arrays (the kernels skip the blocks it classified as hidden
    and leave unmasked those it classified as full: with other arrays the mask_mod would hide other entries, and
    the result would depend on the kernel)."""
    if block_mask is None:
        return mask_mod, score_mod_args
    from .blockmask import BlockMask

    if not isinstance(block_mask, BlockMask):
        raise TypeError(f"block_mask must be a BlockMask (flashnumba.create_block_mask), got "
                        f"{type(block_mask).__name__}")
    if mask_mod is None:
        mask_mod = block_mask.mask_mod
    if mask_mod is not block_mask.mask_mod:
        raise ValueError("block_mask was made for another mask_mod than the one given")
    from ._validate import _takes

    if score_mod_args and _takes(mask_mod, 4 + len(score_mod_args)) and (  # (a mask_mod that reads them)
            len(score_mod_args) != len(block_mask.score_mod_args)
            or any(a is not b for a, b in zip(score_mod_args, block_mask.score_mod_args))):
        raise ValueError("block_mask was made with other score_mod_args than the ones given: pass the arrays given "
                         "to create_block_mask (the same objects), or leave score_mod_args out to use them")
    return mask_mod, score_mod_args or block_mask.score_mod_args


def flex_attention_backward(dout: Array, q: Array, k: Array, v: Array, out: Array, lse: Array, score_mod=None,
                            mask_mod=None, *, score_mod_grad=None, scale: float | None = None,
                            enable_gqa: bool = False, score_mod_args: tuple = (), kernel: str | None = None,
                            block_m: int | None = None, block_n: int | None = None, num_threads: int | None = None,
                            block_mask=None, stream: Any = None) -> tuple[Array, Array, Array]:
    """Gradients (dq, dk, dv) of :func:`flex_attention` (out and lse as it returned them, ``return_lse=True``).

    With a score_mod, ``score_mod_grad(score, b, h, q_idx, kv_idx, *score_mod_args)``, its derivative with respect
    to the score, is required (for an added bias, a function returning 1.0): without it no gradient can be
    right, and the call raises. Gradients with respect to the arrays of ``score_mod_args`` are not computed.
    Runs on the tensor cores for float16 / bfloat16 on a GPU (``kernel`` None or "tc": the functions compiled
    into :mod:`flashnumba.kernels.mma_backward`) and on the register-tiled SIMT backward otherwise (None or
    "v2"); also on the Hopper backward (``kernel="wgmma"``, compute capability 9.0; with fewer key/value heads than
    query heads, a block mask made for every head, H = 1), which ``kernel=None`` takes as :func:`flex_attention`
    does (:data:`flashnumba.tiling.WGMMA_MODS_DEFAULT_HEAD_DIMS`); ``block_m``,
    ``block_n``, ``num_threads`` tile them as in :func:`flash_attn_backward`. ``block_mask``: as in
    :func:`flex_attention` (the one the forward took): the tensor-core and Hopper kernels skip the blocks it hides
    entirely and evaluate the mask_mod only in those it hides in part; their tiles are then the largest of theirs
    (at most block_m, block_n) that divide its blocks."""
    mask_mod, score_mod_args = _block_mask_for(block_mask, mask_mod, score_mod_args)
    args = mod_args_tuple(score_mod_args)
    bm = () if block_mask is None else tuple(getattr(block_mask, n) for n in _BLOCK_MASK_ARRAYS)
    blocks = None if block_mask is None else (block_mask.Q_BLOCK_SIZE, block_mask.KV_BLOCK_SIZE)
    key = _key("flex_bwd", (dout, q, k, v, out, lse) + args + bm,
               (scale, score_mod, score_mod_grad, mask_mod, enable_gqa, kernel, block_m, block_n, num_threads,
                blocks))

    def build():
        check_scale(scale, 1, "scale")  # (FlexAttention's name for it, in the message)
        check_flag("enable_gqa", enable_gqa)

        def make(keep):
            p, opts = _backward_plan(dout, q, k, v, out, lse, scale, False, (-1, -1), 0.0, None, 0.0, block_m,
                                     block_n, num_threads, kernel,
                                     flex=(score_mod, score_mod_grad, mask_mod, score_mod_args, enable_gqa),
                                     block_mask=block_mask, mods_table_tiles=keep)
            return p, opts.mods

        return _launch.Call(_flex_compiled(make, ("wgmma_dq", "wgmma_dkdv")))

    call = _cached(key, build)
    return tuple(call.run((dout, q, k, v, out, lse, None, None, None) + args
                          + (None,) * (len(_plan.MOD_PARAMS) - len(args)) + bm, 0, 0, _stream(stream, q)))


def _flex_compiled(make, tables):
    """The plan of ``make(keep) -> (plan, mods)``, its kernels compiled now on a GPU, so that a function Numba
    cannot compile, or that returns something other than one number, is reported, naming it, before anything runs
    (and one that computes in float64 warned of).
    Beside a score_mod the kernels of ``tables`` first keep their table's tiles (``keep``): a light function (a
    bias from registers, a cap) fits them as the built-in options do; each kernel to which keeping gave other tiles
    and whose thread then takes local memory (spills, or a stack: conservative) is planned again with the smaller
    tiles a heavier function needs (compiled twice)."""
    from ._backend import SIMULATOR

    keep = frozenset() if SIMULATOR else frozenset(tables)
    p, mods = make(keep)
    if mods is None or SIMULATOR:
        return p
    _plan.compile_mods(p, mods)
    if mods.score_mod is not None:
        smaller = {s.table: s.tiles for s in make(frozenset())[0].launches}  # (planned, not compiled)
        spilled = {s.table for s in p.launches if s.table in keep and s.tiles != smaller.get(s.table)
                   and _launch.uses_local_memory(s, p.arrays, p.scalars, p.device)}
        if spilled:
            p, _ = make(keep - spilled)
            _plan.compile_mods(p, mods)
    _plan.warn_float64_mods(mods)
    return p


__all__ = ["Options", "flash_attn_forward", "flash_attn_backward", "flash_attn_func", "attention_probs",
           "attention_with_grad", "flash_attn_varlen_forward", "flash_attn_varlen_backward", "flash_attn_varlen_func",
           "plan", "plan_backward", "random_seed", "draw_dropout_seed", "last_dropout_seed", "clear_plan_cache",
           "check_forward_args", "check_varlen_args", "flex_attention", "flex_attention_backward"]
