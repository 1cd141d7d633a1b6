"""The public functions: validation, block-size choice, launch.

Layout as in flash-attn: q ``(batch, seqlen_q, nheads, head_dim)``, k and v ``(batch, seqlen_k, nheads_k,
head_dim)``, out like q, lse ``(batch, nheads, seqlen_q)`` float32 (natural log). Arrays may be NumPy arrays (copied
to the GPU and back, or run in the simulator), CuPy arrays, or any ``__cuda_array_interface__`` object; the
results have the input's array type (CuPy for a foreign CUDA array when CuPy is installed, else Numba device
arrays). Inputs are only read; strided inputs whose last dimension is contiguous are used in place.

dtypes: float32, float16 and bfloat16, accumulated in float32. bfloat16 comes as NumPy arrays of
``ml_dtypes.bfloat16`` or as torch.bfloat16 CUDA tensors (the results are then torch tensors: bfloat16 outputs,
float32 lse); CuPy has no bfloat16.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from . import _arrays, backward, backward_tc, forward, forward_tc, forward_tf32
from ._backend import SIMULATOR, cuda, max_shared_memory_per_block

MAX_HEAD_DIM = 256
DTYPES = (np.dtype(np.float32), np.dtype(np.float16))  # and bfloat16: see _arrays.bfloat16
DTYPE_NAMES = ("float32, float16, bfloat16 (NumPy arrays of ml_dtypes.bfloat16, or torch.bfloat16 CUDA "
               "tensors)")
STATIC_SHARED_LIMIT = 48 * 1024  # CUDA's limit on static shared memory per block
PREPROCESS_ROWS = 8  # query rows per block of the backward's D_i kernel (a warp each)


# ---------------------------------------------------------------------------------------------------------------
# validation
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class _Tensor:
    name: str
    array: object
    kind: str
    shape: tuple
    strides: tuple
    dtype: np.dtype


def _inspect(name, x, rank) -> _Tensor:
    try:
        k = _arrays.kind(x)
    except TypeError as err:
        raise TypeError(f"{name}: {err}") from None
    shape, strides, dtype = _arrays.shape_strides_dtype(x)
    if len(shape) != rank:
        raise ValueError(f"{name} must have {rank} dimensions, got {len(shape)} (shape {shape})")
    if shape[-1] > 1 and strides[-1] != dtype.itemsize and all(shape):
        raise ValueError(
            f"{name}: the last dimension must be contiguous (stride {dtype.itemsize} bytes), "
            f"got stride {strides[-1]} bytes; pass a copy with a contiguous last dimension"
        )
    return _Tensor(name, x, k, shape, strides, dtype)


def _check_same_place(tensors):
    places = {t.name: ("GPU" if _arrays.on_device(t.kind) else "host") for t in tensors}
    if len(set(places.values())) > 1:
        desc = ", ".join(f"{n} on the {p}" for n, p in places.items())
        raise ValueError(f"all arrays must be on the same side (all NumPy or all on the GPU), got {desc}")


def _check_dtypes(tensors):
    first = tensors[0]
    for t in tensors:
        if t.dtype not in DTYPES and not _arrays.is_bfloat16(t.dtype):
            hint = " (bfloat16 is taken as a NumPy ml_dtypes.bfloat16 array or a torch.bfloat16 CUDA tensor)" \
                if t.dtype.kind == "V" and t.dtype.itemsize == 2 else ""
            raise TypeError(f"{t.name} has dtype {t.dtype}; supported dtypes are {DTYPE_NAMES}{hint}")
        if _arrays.is_bfloat16(t.dtype) and t.kind not in ("numpy", "torch"):
            raise TypeError(f"{t.name} is a bfloat16 {t.kind} array; bfloat16 is taken as a NumPy "
                            "ml_dtypes.bfloat16 array or a torch.bfloat16 CUDA tensor")
        if t.dtype != first.dtype:
            raise TypeError(f"{t.name} has dtype {t.dtype} but {first.name} has dtype {first.dtype}; they must match")


def _check_qkv(q, k, v):
    bq, sq, hq, dq = q.shape
    for t in (k, v):
        b, _, hh, d = t.shape
        if b != bq:
            raise ValueError(f"batch mismatch: q has batch {bq}, {t.name} has batch {b}")
        if hh == 0 or hq % hh:
            raise ValueError(f"nheads mismatch: q has {hq} heads, {t.name} has {hh}; the number of query heads "
                             f"must be a multiple of the number of key/value heads (GQA / MQA)")
        if d != dq:
            raise ValueError(f"head_dim mismatch: q has head_dim {dq}, {t.name} has head_dim {d}")
    if k.shape[1] != v.shape[1]:
        raise ValueError(f"k and v must have the same seqlen_k, got k {k.shape} and v {v.shape}")
    if k.shape[2] != v.shape[2]:
        raise ValueError(f"k and v must have the same number of heads, got k {k.shape} and v {v.shape}")
    if not 1 <= dq <= MAX_HEAD_DIM:
        raise ValueError(f"head_dim must be in [1, {MAX_HEAD_DIM}], got {dq}")


def _check_scale(softmax_scale, head_dim):
    if softmax_scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(softmax_scale, (bool, np.bool_)) or not isinstance(softmax_scale, (int, float, np.number)):
        raise TypeError(f"softmax_scale must be a real number or None, got {type(softmax_scale).__name__}")
    s = float(softmax_scale)
    if not math.isfinite(s):
        raise ValueError(f"softmax_scale must be finite, got {s}")
    return s


def _check_flag(name, value):
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
    return bool(value)


@dataclass
class _Options:
    """Masking and score options, validated, as the kernels take them."""

    variant: tuple  # forward.Variant: what is compiled in
    softcap: np.float32
    left: int
    right: int
    alibi: object  # (batch, nheads) float32 device array (a (1, 1) dummy without ALiBi)
    gqa: bool
    cu_q: object = None  # (batch + 1,) int32 device arrays (varlen), else a (1,) dummy
    cu_k: object = None
    dropout: tuple = (np.float32(0), np.float32(1), np.uint64(0), np.uint64(0))  # p, 1 / (1 - p), seed, offset

    @property
    def plain(self):
        """Only what kernel v1 supports: no window other than causal, no softcap, ALiBi, GQA, varlen, dropout."""
        has_left, _, softcap, alibi, varlen, dropout = self.variant
        return not (has_left or softcap or alibi or varlen or dropout or self.gqa or self.right > 0)

    @property
    def kernel_args(self):
        """The trailing arguments of the v2/v3 kernels."""
        return (self.softcap, np.int64(self.left), np.int64(self.right), self.alibi, self.cu_q, self.cu_k,
                *self.dropout)


_dummies = {}


def _dummy(name, shape, dtype):
    if name not in _dummies:  # small arrays the kernels take but, without the option, never read
        _dummies[name] = cuda.to_device(np.zeros(shape, dtype))
    return _dummies[name]


def _check_dropout(dropout_p, seed, offset):
    """(p, 1 / (1 - p), seed, offset) for the kernels; a seed is required when dropout_p > 0."""
    if isinstance(dropout_p, (bool, np.bool_)) or not isinstance(dropout_p, (int, float, np.number)):
        raise TypeError(f"dropout_p must be a number, got {type(dropout_p).__name__}")
    if not 0.0 <= float(dropout_p) < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
    if float(dropout_p) > 0 and seed is None:
        raise ValueError("dropout_p > 0 needs a dropout_seed (the backward must regenerate the forward's mask "
                         "from the same dropout_seed and dropout_offset)")
    for name, value in (("dropout_seed", 0 if seed is None else seed), ("dropout_offset", offset)):
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)) or not 0 <= value < 2**64:
            raise ValueError(f"{name} must be an int in [0, 2**64), got {value!r}")
    p = float(dropout_p)
    return np.float32(p), np.float32(1.0 / (1.0 - p)), np.uint64(0 if seed is None else seed), np.uint64(offset)


def _check_options(tq, tk, causal, window_size, softcap, alibi_slopes, batch=None, varlen=None,
                   dropout=(0.0, None, 0)) -> _Options:
    causal = _check_flag("causal", causal)
    try:
        left, right = window_size
    except (TypeError, ValueError):
        raise ValueError(f"window_size must be a pair (left, right), got {window_size!r}") from None
    for name, w in (("left", left), ("right", right)):
        if isinstance(w, (bool, np.bool_)) or not isinstance(w, (int, np.integer)) or w < -1:
            raise ValueError(f"window_size {name} must be an int >= -1 (-1: unbounded), got {w!r}")
    left, right = int(left), int(right)
    if causal:  # as in flash-attn: causal is the window (left, 0)
        right = 0
    if isinstance(softcap, (bool, np.bool_)) or not isinstance(softcap, (int, float, np.number)):
        raise TypeError(f"softcap must be a real number, got {type(softcap).__name__}")
    if not (math.isfinite(float(softcap)) and float(softcap) >= 0):
        raise ValueError(f"softcap must be finite and >= 0 (0: off), got {softcap}")
    nheads = tq.shape[-2]
    batch = tq.shape[0] if batch is None else batch
    if alibi_slopes is None:
        alibi = _dummy("alibi", (1, 1), np.float32)
    else:
        try:
            rank = len(_arrays.shape_strides_dtype(alibi_slopes)[0])
        except AttributeError:
            raise TypeError(f"alibi_slopes must be an array, got {type(alibi_slopes).__name__}") from None
        ta = _inspect("alibi_slopes", alibi_slopes, rank)
        _check_same_place((tq, ta))
        if ta.shape not in ((nheads,), (batch, nheads)):
            raise ValueError(f"alibi_slopes must have shape (nheads,) = ({nheads},) or (batch, nheads) = "
                             f"({batch}, {nheads}), got {ta.shape}")
        if ta.dtype != np.float32:
            raise TypeError(f"alibi_slopes must be float32, got {ta.dtype}")
        host = alibi_slopes if ta.kind == "numpy" else _arrays.to_host(alibi_slopes)
        alibi = cuda.to_device(np.ascontiguousarray(np.broadcast_to(host.reshape(-1, nheads), (batch, nheads))))
    drop = _check_dropout(*dropout)
    variant = forward.Variant(has_left=left >= 0, has_right=right >= 0, softcap=float(softcap) > 0,
                              alibi=alibi_slopes is not None, varlen=varlen is not None, dropout=drop[0] > 0)
    cu_q, cu_k = varlen if varlen is not None else (_dummy("cu", (1,), np.int32),) * 2
    return _Options(variant, np.float32(softcap), left, right, alibi, gqa=tk.shape[-2] != tq.shape[-2],
                    cu_q=cu_q, cu_k=cu_k, dropout=drop)


def _check_forward_results(tq, tdo, to, tl, lse_layout, lse_shape, forward_name):
    """dout and out shaped like q; lse float32 in the forward's layout."""
    for t in (tdo, to):
        if t.shape != tq.shape:
            raise ValueError(f"{t.name} must have the shape of q {tq.shape}, got {t.shape}")
    if tl.shape != lse_shape:
        raise ValueError(f"lse must have shape {lse_layout} = {lse_shape}, got {tl.shape}")
    if tl.dtype != np.float32:
        raise TypeError(f"lse must be float32 (as {forward_name} returns it), got {tl.dtype}")


def _check_not_v1(kernel, opts, what):
    if kernel == "v1" and not opts.plain:
        raise ValueError(f"{what} kernel v1 supports causal masking only (no window, softcap, ALiBi, GQA, varlen "
                         f"or dropout); "
                         f"use the default kernel")


# ---------------------------------------------------------------------------------------------------------------
# block sizes
# ---------------------------------------------------------------------------------------------------------------


def default_blocks(kernel: str, head_dim: int) -> tuple[int, int, int]:
    """(block_m, block_n, num_threads) used when the caller gives none."""
    if kernel == "v1":
        return 64, (32 if head_dim <= 128 else 16), 64
    # From the block-size sweep on an H200 (notebooks/02_block_sizes.ipynb, float32, seqlen 2048).
    if head_dim <= 64:
        return 128, 64, 128
    if head_dim <= 128:
        return 64, 32, 128
    return 32, 32, 128


def _check_int(name, value, lo, hi):
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if not lo <= int(value) <= hi:
        raise ValueError(f"{name} must be in [{lo}, {hi}], got {value}")
    return int(value)


def resolve_blocks(kernel, head_dim, block_m=None, block_n=None, num_threads=None):
    """Validate (or choose) block sizes for a kernel; returns (block_m, block_n, num_threads, shared bytes)."""
    if kernel not in forward.KERNELS:
        raise ValueError(f"kernel must be one of {forward.KERNELS}, got {kernel!r}")
    dm, dn, dt = default_blocks(kernel, head_dim)
    block_m = dm if block_m is None else _check_int("block_m", block_m, 1, 1024)
    block_n = dn if block_n is None else _check_int("block_n", block_n, 1, 1024)
    num_threads = dt if num_threads is None else _check_int("num_threads", num_threads, 1, 1024)
    d = head_dim
    if kernel == "v1":
        num_threads = block_m  # one thread per query row
        smem, limit = forward.shared_bytes_v1(d, block_m, block_n), STATIC_SHARED_LIMIT
    else:
        forward.tiling_v2(d, block_m, block_n, num_threads)  # raises ValueError on a bad combination
        smem, limit = forward.shared_bytes_v2(d, block_m, block_n), max_shared_memory_per_block()
    if smem > limit:
        raise ValueError(
            f"block_m={block_m}, block_n={block_n} with head_dim={head_dim} need {smem} bytes of shared memory "
            f"for kernel {kernel}, more than the {limit} bytes a block may use; choose smaller blocks"
        )
    return block_m, block_n, num_threads, smem


# ---------------------------------------------------------------------------------------------------------------
# launching
# ---------------------------------------------------------------------------------------------------------------

_opted_in: set = set()


def launch(kernel_fn, grid, block, shared_bytes, args):
    """Launch a cuda.jit kernel, opting in to more than 48 KB of dynamic shared memory where it needs it."""
    if shared_bytes > STATIC_SHARED_LIMIT and not SIMULATOR:
        sig = tuple(kernel_fn.typeof_pyval(a) for a in args)
        key = (id(kernel_fn), sig, shared_bytes)
        if key not in _opted_in:
            compiled = kernel_fn.compile(sig)
            cufunc = compiled._codelibrary.get_cufunc()
            from numba.cuda.cudadrv.driver import binding, driver

            attr = binding.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
            driver.cuKernelSetAttribute(attr, shared_bytes, cufunc.handle, cufunc.device.id)
            _opted_in.add(key)
    kernel_fn[grid, block, 0, shared_bytes](*args)


def tensor_core_applies(tensors, opts, block_m=None, block_n=None, num_threads=None) -> bool:
    """Whether ``kernel=None`` chooses the tensor-core kernels: a GPU of compute capability >= 8.0 (not the
    simulator), float16 or bfloat16, head_dim 64 or 128, no block sizes given, and arrays the kernels can
    address (C-contiguous, or CuPy or torch arrays, which they copy). Every option is supported."""
    tq = tensors[0]
    if SIMULATOR or (block_m, block_n, num_threads) != (None, None, None):
        return False
    if not (tq.dtype == np.float16 or _arrays.is_bfloat16(tq.dtype)) or tq.shape[-1] not in forward_tc.HEAD_DIMS:
        return False
    if any(t.kind in ("numba", "cai") and not _is_c_layout(t.shape, t.strides, t.dtype.itemsize) for t in tensors):
        return False
    return cuda.get_current_device().compute_capability >= (8, 0)


def _is_c_layout(shape, strides, itemsize):
    """Whether (shape, strides) lay the elements out in C order (an axis of length 1 may have any stride)."""
    step = itemsize
    for n, stride in zip(reversed(shape), reversed(strides)):
        if n != 1 and stride != step:
            return False
        step *= n
    return True


def flash_attn_forward(
    q, k, v, *, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
    dropout_p=0.0, dropout_seed=None, dropout_offset=0, block_m=None, block_n=None, num_threads=None, kernel=None
):
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
        of (dropout_seed, dropout_offset, b, h, i, j) (Philox, :mod:`flashnumba.philox`), so the backward
        given the same seed and offset regenerates it. A seed is required when dropout_p > 0.
    block_m, block_n : B_r query rows and B_c key rows per tile (defaults: :func:`default_blocks`).
    num_threads : threads per block (kernels v2, v3; v1 uses one thread per query row).
    kernel : "v3" (register-tiled with unsigned index arithmetic), "v2" (the same with Numba's default signed
        indexing) or "v1" (one thread per row, the readable one): the SIMT kernels of flashnumba.forward.
        "tc": the tensor-core kernel (float16 or bfloat16, head_dim 64 or 128, every option; block_m in 16,
        32, 64, 128, block_n a multiple of 16; a GPU of compute capability >= 8.0). See
        flashnumba.forward_tc. None (default): "tc" where it applies (:func:`tensor_core_applies`), else "v3".
        "tf32", "3xtf32": float32 on tensor cores (opt-in; head_dim 64 or 128, causal or not, no other option):
        operands rounded to TF32 (about float16's precision), or split in two TF32 parts and multiplied three
        times (about float32's precision). See flashnumba.forward_tf32.

    Returns
    -------
    out : like q, in q's dtype (float32 accumulation)
    lse : (batch, nheads, seqlen_q) float32, natural-log logsumexp of each row of the scaled scores;
        -inf (and out = 0) for a row that sees no key.
    """
    tq, tk, tv = (_inspect(n, x, 4) for n, x in (("q", q), ("k", k), ("v", v)))
    _check_same_place((tq, tk, tv))
    _check_dtypes((tq, tk, tv))
    _check_qkv(tq, tk, tv)
    opts = _check_options(tq, tk, causal, window_size, softcap, alibi_slopes,
                          dropout=(dropout_p, dropout_seed, dropout_offset))
    batch, seqlen_q, nheads, head_dim = tq.shape
    if kernel in forward_tf32.PRECISIONS:
        if not opts.plain or num_threads is not None or block_m is not None:
            raise ValueError(f"kernel {kernel!r} supports causal masking only (no window, softcap, ALiBi, GQA, varlen "
                             f"or dropout) and takes block_n only")
        return forward_tf32.flash_attn_forward_tf32(q, k, v, causal=opts.right == 0, softmax_scale=softmax_scale,
                                                    precision=kernel, block_n=block_n)
    scale = _check_scale(softmax_scale, head_dim)
    kernel, block_m, block_n, num_threads, smem = _forward_plan(kernel, (tq, tk, tv), opts, block_m, block_n,
                                                                num_threads)

    return _forward(tq, tk, tv, opts, scale, kernel, block_m, block_n, num_threads, smem, batch, seqlen_q)


def _forward_plan(kernel, tensors, opts, block_m, block_n, num_threads):
    """(kernel, block_m, block_n, num_threads, shared bytes) of a forward call: kernel None chooses "tc" where
    it applies, else "v3"; the blocks are validated (or chosen) for that kernel."""
    if kernel is None:
        kernel = "tc" if tensor_core_applies(tensors, opts, block_m, block_n, num_threads) else "v3"
    if kernel == "tc":
        if num_threads is not None:
            raise ValueError("kernel 'tc' takes no num_threads: its threads follow from block_m (32 per 16 rows)")
        forward_tc.check_inputs(tensors[0])
        block_m, block_n, smem = forward_tc.resolve_blocks(tensors[0].shape[-1], block_m, block_n)
        return kernel, block_m, block_n, None, smem
    block_m, block_n, num_threads, smem = resolve_blocks(kernel, tensors[0].shape[-1], block_m, block_n,
                                                         num_threads)
    _check_not_v1(kernel, opts, "forward")
    return kernel, block_m, block_n, num_threads, smem


def _forward(tq, tk, tv, opts, scale, kernel, block_m, block_n, num_threads, smem, batch, max_seqlen_q):
    """Allocate the outputs and launch a forward kernel. tq, tk, tv are 4-D (for varlen, (1, total, h, d)
    views); the grid covers ``batch`` sequences of at most ``max_seqlen_q`` query rows."""
    like = tq.kind
    _, total_q, nheads, head_dim = tq.shape
    out_user, out_dev = _arrays.empty(tq.shape, tq.dtype, like)
    lse_user, lse_dev = _arrays.empty((tq.shape[0], nheads, total_q), np.float32, like)
    if batch * nheads * max_seqlen_q == 0 or total_q == 0:
        return _arrays.to_caller(out_user, out_dev, like), _arrays.to_caller(lse_user, lse_dev, like)
    bf16 = _arrays.is_bfloat16(tq.dtype)  # a kernel of its own, on uint16 bit patterns
    scale_log2 = np.float32(scale * forward.LOG2E)
    grid = (-(-max_seqlen_q // block_m), batch * nheads)
    # with softcap or ALiBi the register-tiled and tensor-core kernels form scale * q.k in natural units first
    scale_q = np.float32(scale) if (opts.variant[2] or opts.variant[3]) else scale_log2
    if kernel == "tc":
        qd, kd, vd = (forward_tc.to_kernel_c(t) for t in (tq, tk, tv))
        fn = forward_tc.make_forward_tc(head_dim, opts.variant, block_n, block_m // 16,
                                        "bfloat16" if bf16 else "float16", gqa=tk.shape[2] != nheads)
        launch(fn, grid, (2 * block_m,), smem, (qd, kd, vd, out_dev, lse_dev, scale_q, *opts.kernel_args))
        return _arrays.to_caller(out_user, out_dev, like), _arrays.to_caller(lse_user, lse_dev, like)
    qd, kd, vd = (_arrays.to_kernel(t.array, t.kind) for t in (tq, tk, tv))
    if kernel == "v1":
        fn = forward.make_forward_v1(head_dim, block_m, block_n, opts.right == 0, bf16=bf16)
        launch(fn, grid, (block_m,), 0, (qd, kd, vd, out_dev, lse_dev, scale_log2))
    else:
        make = forward.make_forward_v2 if kernel == "v2" else forward.make_forward_v3
        fn = make(head_dim, block_m, block_n, num_threads, opts.variant, bf16=bf16)
        launch(fn, grid, (num_threads,), smem, (qd, kd, vd, out_dev, lse_dev, scale_q, *opts.kernel_args))
    return _arrays.to_caller(out_user, out_dev, like), _arrays.to_caller(lse_user, lse_dev, like)


MAX_PROBS_ELEMENTS = 2**26  # return_attn_probs materialises (batch, nheads, seqlen_q, seqlen_k): small sizes only


def _check_func_flags(dropout_p, deterministic, return_attn_probs, kwargs):
    """flash-attn's extra arguments; with dropout and no dropout_seed in kwargs, a fresh random seed."""
    _check_flag("return_attn_probs", return_attn_probs)
    _check_flag("deterministic", deterministic)
    _check_dropout(dropout_p, 0, 0)
    if dropout_p and kwargs.get("dropout_seed") is None:
        kwargs["dropout_seed"] = random_seed()


def random_seed() -> int:
    """A fresh 64-bit dropout seed from the operating system's entropy."""
    return int(np.random.SeedSequence().generate_state(1, np.uint64)[0])


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                    alibi_slopes=None, deterministic=False, return_attn_probs=False, **kwargs):
    """flash-attn's ``flash_attn_func``, with its argument names and defaults: returns the attention output.

    With ``dropout_p`` > 0 the mask comes from ``dropout_seed`` (a keyword argument; a fresh random seed when
    it is not given). ``return_attn_probs=True`` returns (out, lse, P * Z) with the probabilities after dropout
    (small sizes; :func:`attention_probs`); ``deterministic`` is accepted (flashnumba is always deterministic).
    Other keyword arguments (``kernel``, block sizes, ``dropout_seed``, ``dropout_offset``) go to
    :func:`flash_attn_forward`.
    """
    _check_func_flags(dropout_p, deterministic, return_attn_probs, kwargs)
    opts = dict(softmax_scale=softmax_scale, causal=causal, window_size=window_size, softcap=softcap,
                alibi_slopes=alibi_slopes, dropout_p=dropout_p)
    out, lse = flash_attn_forward(q, k, v, **opts, **kwargs)
    if not return_attn_probs:
        return out
    seeds = {n: kwargs[n] for n in ("dropout_seed", "dropout_offset") if n in kwargs}
    return out, lse, attention_probs(q, k, v, lse, **opts, **seeds)


def attention_probs(q, k, v, lse, *, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                    alibi_slopes=None, dropout_p=0.0, dropout_seed=None, dropout_offset=0):
    """The probabilities P_ij = exp(S_ij - L_i), times the dropout multiplier Z_ij (0 where dropped,
    1 / (1 - dropout_p) where kept), as a (batch, nheads, seqlen_q, seqlen_k) float32 array: the debugging
    path behind ``return_attn_probs=True``, for small sizes. ``lse`` is the forward's; the dropout arguments
    must be the forward's. Rows that see no key are 0."""
    tq, tk, tv = (_inspect(n, x, 4) for n, x in (("q", q), ("k", k), ("v", v)))
    tl = _inspect("lse", lse, 3)
    _check_same_place((tq, tk, tv, tl))
    _check_dtypes((tq, tk, tv))
    _check_qkv(tq, tk, tv)
    batch, seqlen_q, nheads, head_dim = tq.shape
    seqlen_k = tk.shape[1]
    if tl.shape != (batch, nheads, seqlen_q) or tl.dtype != np.float32:
        raise ValueError(f"lse must be float32 of shape {(batch, nheads, seqlen_q)}, got {tl.dtype} {tl.shape}")
    if batch * nheads * seqlen_q * seqlen_k > MAX_PROBS_ELEMENTS:
        raise ValueError(f"return_attn_probs materialises batch * nheads * seqlen_q * seqlen_k = "
                         f"{batch * nheads * seqlen_q * seqlen_k} floats, more than the {MAX_PROBS_ELEMENTS} "
                         f"allowed for this debugging path")
    opts = _check_options(tq, tk, causal, window_size, softcap, alibi_slopes,
                          dropout=(dropout_p, dropout_seed, dropout_offset))
    scale = _check_scale(softmax_scale, head_dim)
    like = tq.kind
    probs_user, probs_dev = _arrays.empty((batch, nheads, seqlen_q, seqlen_k), np.float32, like)
    if batch * nheads * seqlen_q * seqlen_k:
        qd, kd, ld = (_arrays.to_kernel(t.array, t.kind) for t in (tq, tk, tl))
        fn = forward.make_probs_kernel(head_dim, opts.variant, bf16=_arrays.is_bfloat16(tq.dtype))
        launch(fn, (seqlen_q, batch * nheads), (min(128, max(32, seqlen_k)),), 0,
               (qd, kd, ld, probs_dev, np.float32(scale), opts.softcap, np.int64(opts.left), np.int64(opts.right),
                opts.alibi, *opts.dropout))
    return _arrays.to_caller(probs_user, probs_dev, like)


# ---------------------------------------------------------------------------------------------------------------
# backward
# ---------------------------------------------------------------------------------------------------------------


BACKWARD_KERNELS = ("v1", "v2")


def default_blocks_backward(head_dim: int, kernel: str = "v2") -> tuple[int, int, int]:
    """(block_m, block_n, num_threads) of the backward kernels when the caller gives none."""
    if kernel == "v1":
        if head_dim <= 64:
            return 64, 64, 64
        return (32, 32, 32) if head_dim <= 128 else (16, 16, 16)
    # From the block-size sweep on an H200 (notebooks/02_block_sizes.ipynb, float32, seqlen 2048).
    if head_dim <= 64:
        return 64, 128, 256
    return (64, 64, 256) if head_dim <= 128 else (16, 32, 128)


def resolve_blocks_backward(head_dim, block_m=None, block_n=None, num_threads=None, kernel="v2"):
    """Validate (or choose) the backward's block sizes: returns (block_m, block_n, num_threads, (smem_dkdv,
    smem_dq)); v1's shared memory is static (48 KB at most), v2's dynamic."""
    if kernel not in BACKWARD_KERNELS:
        raise ValueError(f"kernel must be one of {BACKWARD_KERNELS} for the backward, got {kernel!r}")
    dm, dn, dt = default_blocks_backward(head_dim, kernel)
    block_m = dm if block_m is None else _check_int("block_m", block_m, 1, 1024)
    block_n = dn if block_n is None else _check_int("block_n", block_n, 1, 1024)
    num_threads = dt if num_threads is None else _check_int("num_threads", num_threads, 1, 1024)
    if kernel == "v1":
        smem = (backward.shared_bytes_dkdv_v1(head_dim, block_m, block_n),
                backward.shared_bytes_dq_v1(head_dim, block_m, block_n))
        limit = STATIC_SHARED_LIMIT
    else:
        backward.check_blocks_v2(head_dim, block_m, block_n, num_threads)
        smem = (backward.shared_bytes_dkdv_v2(head_dim, block_m, block_n),
                backward.shared_bytes_dq_v2(head_dim, block_m, block_n))
        limit = max_shared_memory_per_block()
    for name, nbytes in zip(("dK/dV", "dQ"), smem):
        if nbytes > limit:
            raise ValueError(
                f"block_m={block_m}, block_n={block_n} with head_dim={head_dim} need {nbytes} bytes of shared memory "
                f"in the backward {name} kernel {kernel}, more than {limit}; choose smaller blocks"
            )
    return block_m, block_n, num_threads, smem


def flash_attn_backward(dout, q, k, v, out, lse, *, softmax_scale=None, causal=False, window_size=(-1, -1),
                        softcap=0.0, alibi_slopes=None, dropout_p=0.0, dropout_seed=None, dropout_offset=0,
                        block_m=None, block_n=None, num_threads=None, kernel=None):
    """Gradients (dq, dk, dv) of attention, recomputing P tile by tile from q, k and the forward's lse.

    ``out`` and ``lse`` are what :func:`flash_attn_forward` returned for (q, k, v) with the same softmax_scale,
    causal, window_size, softcap, alibi_slopes and dropout arguments (with GQA, dk and dv are summed over the
    query heads that share a key/value head); dout is the gradient of the loss with respect to out (like q).
    Extra device memory is O(batch * nheads * seqlen_q): one float per query row (D_i = rowsum(dout * out)).
    Deterministic: no atomics.

    block_m, block_n: query and key tile sizes; num_threads: threads per block (v2); kernel: "v2"
    (register-tiled) or "v1" (one thread per row, the readable one), see flashnumba.backward; "tc" (tensor
    cores: float16 or bfloat16, head_dim 64 or 128, every option; block_m and block_n in
    16, 32, 64, 128; its dQ and dK/dV kernels each have their own default tiles,
    flashnumba.backward_tc.DEFAULT_TILES, and a block_m or block_n given applies to both), see
    flashnumba.backward_tc. None (default): "tc" where it applies (as for the forward,
    :func:`tensor_core_applies`), else "v2".

    Returns dq like q, dk and dv like k, in the input dtype (float32 accumulation).
    """
    tq, tk, tv = (_inspect(n, x, 4) for n, x in (("q", q), ("k", k), ("v", v)))
    tdo, to, tl = _inspect("dout", dout, 4), _inspect("out", out, 4), _inspect("lse", lse, 3)
    _check_same_place((tq, tk, tv, tdo, to, tl))
    _check_dtypes((tq, tk, tv, tdo, to))
    _check_qkv(tq, tk, tv)
    batch, seqlen_q, nheads, head_dim = tq.shape
    _check_forward_results(tq, tdo, to, tl, "(batch, nheads, seqlen_q)", (batch, nheads, seqlen_q),
                           "flash_attn_forward")
    opts = _check_options(tq, tk, causal, window_size, softcap, alibi_slopes,
                          dropout=(dropout_p, dropout_seed, dropout_offset))
    scale = _check_scale(softmax_scale, head_dim)
    kernel, block_m, block_n, num_threads, smem = _backward_plan(kernel, (tq, tk, tv, tdo, to), opts, block_m,
                                                                 block_n, num_threads)
    return _backward(tdo, tq, tk, tv, to, tl, opts, scale, kernel, block_m, block_n, num_threads, smem, batch,
                     seqlen_q, tk.shape[1])


def _backward_plan(kernel, tensors, opts, block_m, block_n, num_threads):
    """(kernel, block_m, block_n, num_threads, (shared bytes of dK/dV, of dQ)) of a backward call: kernel None
    chooses "tc" where it applies, else "v2"; the blocks are validated (or chosen) for that kernel. For "tc",
    whose two kernels have their own tiles, block_m and block_n come back as the (block_m, block_n) pairs of the
    dQ and of the dK/dV kernel."""
    if kernel is None:
        kernel = "tc" if tensor_core_applies(tensors, opts, block_m, block_n, num_threads) else "v2"
    if kernel == "tc":
        if num_threads is not None:
            raise ValueError("kernel 'tc' takes no num_threads: its threads follow from block_m and block_n (32 per "
                             "16 rows)")
        forward_tc.check_inputs(tensors[0])
        dq_tiles, dkdv_tiles, smem = backward_tc.resolve_blocks(tensors[0].shape[-1], block_m, block_n)
        return kernel, dq_tiles, dkdv_tiles, None, smem
    block_m, block_n, num_threads, smem = resolve_blocks_backward(tensors[0].shape[-1], block_m, block_n,
                                                                  num_threads, kernel)
    _check_not_v1(kernel, opts, "backward")
    return kernel, block_m, block_n, num_threads, smem


def _backward(tdo, tq, tk, tv, to, tl, opts, scale, kernel, block_m, block_n, num_threads, smem, batch,
              max_seqlen_q, max_seqlen_k):
    """Allocate the gradients and launch the backward kernels (4-D tensors, or (1, total, h, d) views)."""
    like = tq.kind
    lead, total_q, nheads, head_dim = tq.shape
    dq_user, dq_dev = _arrays.empty(tq.shape, tq.dtype, like)
    dk_user, dk_dev = _arrays.empty(tk.shape, tk.dtype, like)
    dv_user, dv_dev = _arrays.empty(tv.shape, tv.dtype, like)
    result = [(dq_user, dq_dev), (dk_user, dk_dev), (dv_user, dv_dev)]
    if batch * nheads == 0 or (total_q == 0 and tk.shape[1] == 0):
        return tuple(_arrays.to_caller(u, d, like) for u, d in result)

    if kernel == "tc":  # cp.async and ldmatrix address C-contiguous arrays
        dod, qd, kd, vd = (forward_tc.to_kernel_c(t) for t in (tdo, tq, tk, tv))
    else:
        dod, qd, kd, vd = (_arrays.to_kernel(t.array, t.kind) for t in (tdo, tq, tk, tv))
    od, ld = (_arrays.to_kernel(t.array, t.kind) for t in (to, tl))
    delta_user, delta = _arrays.empty((lead, nheads, total_q), np.float32, like)  # D_i, O(seqlen_q)
    bf16 = _arrays.is_bfloat16(tq.dtype)
    scale32 = np.float32(scale)
    causal = opts.right == 0 and not opts.variant[0]  # what kernel v1 implements
    if kernel == "tc":  # each kernel its own (block_m, block_n)
        (dq_m, dq_n), (kv_m, kv_n) = block_m, block_n
    else:
        dq_m, dq_n = kv_m, kv_n = block_m, block_n
    grid_q = (-(-max_seqlen_q // dq_m), batch * nheads)  # a block per B_r query rows
    grid_k = (-(-max_seqlen_k // kv_n), batch * tk.shape[2])  # a block per B_c key rows
    if total_q:  # D_i = rowsum(dO_i * O_i), row by row over the whole (lead, total_q) layout
        if SIMULATOR:  # a thread per row (32x fewer simulated threads)
            pre = backward.make_backward_preprocess(head_dim, 64, bf16=bf16)
            launch(pre, (-(-total_q // 64), lead * nheads), (64,), 0, (dod, od, delta))
        else:  # a warp per row: coalesced loads
            rows = PREPROCESS_ROWS
            pre = backward.make_backward_preprocess_warp(head_dim, rows, bf16=bf16)
            launch(pre, (-(-total_q // rows), lead * nheads), (32 * rows,), 0, (dod, od, delta))
    if kernel == "tc":
        dtype = "bfloat16" if bf16 else "float16"
        gqa = tk.shape[2] != nheads
        smem_dkdv, smem_dq = smem
        args = (np.float32(scale * forward.LOG2E), scale32, *opts.kernel_args)
        if max_seqlen_q:
            dq_fn = backward_tc.make_backward_dq_tc(head_dim, opts.variant, dq_m, dq_n, dtype, gqa)
            launch(dq_fn, grid_q, (2 * dq_m,), smem_dq, (dod, qd, kd, vd, ld, delta, dq_dev, *args))
        if max_seqlen_k:
            dkdv_fn = backward_tc.make_backward_dkdv_tc(head_dim, opts.variant, kv_m, kv_n, dtype, gqa)
            launch(dkdv_fn, grid_k, (2 * kv_n,), smem_dkdv, (dod, qd, kd, vd, ld, delta, dk_dev, dv_dev, *args))
    elif kernel == "v1":
        if max_seqlen_q:
            dq_fn = backward.make_backward_dq_v1(head_dim, block_m, block_n, causal, bf16=bf16)
            launch(dq_fn, grid_q, (block_m,), 0, (dod, qd, kd, vd, ld, delta, dq_dev, scale32))
        if max_seqlen_k:
            dkdv_fn = backward.make_backward_dkdv_v1(head_dim, block_m, block_n, causal, bf16=bf16)
            launch(dkdv_fn, grid_k, (block_n,), 0, (dod, qd, kd, vd, ld, delta, dk_dev, dv_dev, scale32))
    else:
        smem_dkdv, smem_dq = smem
        if max_seqlen_q:
            dq_fn = backward.make_backward_dq_v2(head_dim, block_m, block_n, num_threads, opts.variant, bf16=bf16)
            launch(dq_fn, grid_q, (num_threads,), smem_dq,
                   (dod, qd, kd, vd, ld, delta, dq_dev, scale32, *opts.kernel_args))
        if max_seqlen_k:
            dkdv_fn = backward.make_backward_dkdv_v2(head_dim, block_m, block_n, num_threads, opts.variant,
                                                     bf16=bf16)
            launch(dkdv_fn, grid_k, (num_threads,), smem_dkdv,
                   (dod, qd, kd, vd, ld, delta, dk_dev, dv_dev, scale32, *opts.kernel_args))
    del delta_user
    return tuple(_arrays.to_caller(u, d, like) for u, d in result)


# ---------------------------------------------------------------------------------------------------------------
# variable-length (packed) batches
# ---------------------------------------------------------------------------------------------------------------


def _check_varlen(tq, tk, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k):
    """Validate cu_seqlens and max_seqlen; returns (batch, (cu_q, cu_k) on the device, max_q, max_k)."""
    host = []
    for name, cu, total in (("cu_seqlens_q", cu_seqlens_q, tq.shape[0]), ("cu_seqlens_k", cu_seqlens_k, tk.shape[0])):
        t = _inspect(name, cu, 1)
        _check_same_place((tq, t))
        if t.dtype != np.int32:
            raise TypeError(f"{name} must be int32, got {t.dtype}")
        h = _arrays.to_host(cu)
        if h.shape[0] < 1 or h[0] != 0:
            raise ValueError(f"{name} must start at 0 (shape (batch + 1,)), got {h[:4].tolist()}...")
        if (np.diff(h) < 0).any():
            raise ValueError(f"{name} must be non-decreasing, got {h.tolist()}")
        if h[-1] != total:
            raise ValueError(f"{name} must end at the total number of rows ({total}), got {int(h[-1])}")
        host.append(h)
    if host[0].shape != host[1].shape:
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must have the same length (batch + 1), got "
                         f"{host[0].shape[0]} and {host[1].shape[0]}")
    maxes = []
    for name, given, h in (("max_seqlen_q", max_seqlen_q, host[0]), ("max_seqlen_k", max_seqlen_k, host[1])):
        longest = int(np.diff(h).max()) if h.shape[0] > 1 else 0
        given = _check_int(name, given, 0, 2**31 - 1)
        if given < longest:
            raise ValueError(f"{name} must be at least the longest sequence ({longest}), got {given}")
        maxes.append(given)
    cu = tuple(cuda.to_device(np.ascontiguousarray(h)) for h in host)
    return host[0].shape[0] - 1, cu, maxes[0], maxes[1]


def _view4(t):
    """A (1, total, nheads, d) view of a packed (total, nheads, d) tensor, as a _Tensor."""
    arr = _arrays.with_leading_axis(t.array, t.kind)
    shape, strides, dtype = _arrays.shape_strides_dtype(arr)
    return _Tensor(t.name, arr, t.kind, shape, strides, dtype)


def flash_attn_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *,
                              softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                              alibi_slopes=None, dropout_p=0.0, dropout_seed=None, dropout_offset=0, block_m=None,
                              block_n=None, num_threads=None, kernel=None):
    """Attention over a batch of packed sequences of different lengths (flash-attn's varlen layout).

    q (total_q, nheads, d), k and v (total_k, nheads_k, d); sequence b is rows cu_seqlens_q[b] ..
    cu_seqlens_q[b+1] of q and cu_seqlens_k[b] .. cu_seqlens_k[b+1] of k, v (int32 arrays of shape
    (batch + 1,), starting at 0, non-decreasing; sequences of length 0 allowed). max_seqlen_q / max_seqlen_k
    bound the lengths. Every option of :func:`flash_attn_forward` applies per sequence (causal and windows
    aligned to each sequence's bottom-right corner; ALiBi slopes (nheads,) or (batch, nheads)).

    Returns out (total_q, nheads, d) and lse (nheads, total_q) float32.
    """
    tq, tk, tv = (_inspect(n, x, 3) for n, x in (("q", q), ("k", k), ("v", v)))
    _check_same_place((tq, tk, tv))
    _check_dtypes((tq, tk, tv))
    batch, cu, max_q, max_k = _check_varlen(tq, tk, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    tq, tk, tv = (_view4(t) for t in (tq, tk, tv))
    _check_qkv(tq, tk, tv)
    opts = _check_options(tq, tk, causal, window_size, softcap, alibi_slopes, batch=batch, varlen=cu,
                          dropout=(dropout_p, dropout_seed, dropout_offset))
    head_dim = tq.shape[3]
    scale = _check_scale(softmax_scale, head_dim)
    kernel, block_m, block_n, num_threads, smem = _forward_plan(kernel, (tq, tk, tv), opts, block_m, block_n,
                                                                num_threads)
    out, lse = _forward(tq, tk, tv, opts, scale, kernel, block_m, block_n, num_threads, smem, batch, max_q)
    return out[0], lse[0]


def flash_attn_varlen_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *,
                               softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                               alibi_slopes=None, dropout_p=0.0, dropout_seed=None, dropout_offset=0, block_m=None,
                               block_n=None, num_threads=None, kernel=None):
    """Gradients (dq, dk, dv) of :func:`flash_attn_varlen_forward`; dout and out (total_q, nheads, d), lse
    (nheads, total_q) as the forward returned them."""
    tq, tk, tv = (_inspect(n, x, 3) for n, x in (("q", q), ("k", k), ("v", v)))
    tdo, to, tl = _inspect("dout", dout, 3), _inspect("out", out, 3), _inspect("lse", lse, 2)
    _check_same_place((tq, tk, tv, tdo, to, tl))
    _check_dtypes((tq, tk, tv, tdo, to))
    _check_forward_results(tq, tdo, to, tl, "(nheads, total_q)", (tq.shape[1], tq.shape[0]),
                           "flash_attn_varlen_forward")
    batch, cu, max_q, max_k = _check_varlen(tq, tk, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    tq, tk, tv, tdo, to, tl = (_view4(t) for t in (tq, tk, tv, tdo, to, tl))
    _check_qkv(tq, tk, tv)
    opts = _check_options(tq, tk, causal, window_size, softcap, alibi_slopes, batch=batch, varlen=cu,
                          dropout=(dropout_p, dropout_seed, dropout_offset))
    head_dim = tq.shape[3]
    scale = _check_scale(softmax_scale, head_dim)
    kernel, block_m, block_n, num_threads, smem = _backward_plan(kernel, (tq, tk, tv, tdo, to), opts, block_m,
                                                                 block_n, num_threads)
    dq, dk, dv = _backward(tdo, tq, tk, tv, to, tl, opts, scale, kernel, block_m, block_n, num_threads, smem,
                           batch, max_q, max_k)
    return dq[0], dk[0], dv[0]


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False, **kwargs):
    """flash-attn's ``flash_attn_varlen_func``, with its argument names and defaults: the output only
    (``return_attn_probs`` is not available for packed batches)."""
    _check_func_flags(dropout_p, deterministic, return_attn_probs, kwargs)
    if return_attn_probs:
        raise ValueError("return_attn_probs=True is not implemented for variable-length batches")
    return flash_attn_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                     softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                                     softcap=softcap, alibi_slopes=alibi_slopes, dropout_p=dropout_p, **kwargs)[0]


def attention_with_grad(q, k, v, dout, *, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                        alibi_slopes=None, dropout_p=0.0, dropout_seed=None, dropout_offset=0, **kwargs):
    """Forward and backward together, for users without an autograd system: returns (out, dq, dk, dv).

    Equivalent to ``out, lse = flash_attn_forward(q, k, v, ...)`` then
    ``flash_attn_backward(dout, q, k, v, out, lse, ...)``. ``kernel`` chooses the forward kernel,
    ``backward_kernel`` the backward's; ``block_m``, ``block_n`` and ``num_threads`` apply to the backward (the
    forward uses its defaults). With dropout and no ``dropout_seed``, a fresh random seed serves both passes.
    """
    fwd_kw = {n: kwargs.pop(n) for n in ("kernel",) if n in kwargs}
    if dropout_p and dropout_seed is None:
        dropout_seed = random_seed()
    if "backward_kernel" in kwargs:
        kwargs["kernel"] = kwargs.pop("backward_kernel")
    opts = dict(softmax_scale=softmax_scale, causal=causal, window_size=window_size, softcap=softcap,
                alibi_slopes=alibi_slopes, dropout_p=dropout_p, dropout_seed=dropout_seed,
                dropout_offset=dropout_offset)
    out, lse = flash_attn_forward(q, k, v, **opts, **fwd_kw)
    dq, dk, dv = flash_attn_backward(dout, q, k, v, out, lse, **opts, **kwargs)
    return out, dq, dk, dv
