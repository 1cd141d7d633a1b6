"""Validation: the arrays and options of a call, checked once, into named structures with clear errors.

What comes out: a :class:`Tensor` per array (its kind, shape, strides, dtype) and one :class:`Options` (the
masking, score and dropout options as the kernels take them). Nothing here launches anything or reads device
memory, except :func:`check_cu_seqlens`, which copies the (batch + 1) offsets of a varlen call to the host to check
them (``flashnumba.config.check_device_values`` turns that off).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from . import _arrays
from .kernels.simt_forward import Variant

MAX_HEAD_DIM = 256
DTYPES = (np.dtype(np.float32), np.dtype(np.float16))  # and bfloat16: see _arrays.bfloat16
DTYPE_NAMES = ("float32, float16, bfloat16 (NumPy arrays of ml_dtypes.bfloat16, or torch.bfloat16 CUDA "
               "tensors)")


@dataclass(frozen=True)
class Tensor:
    """An array argument as validated: the array itself, its kind (see :func:`flashnumba._arrays.kind`), shape,
    strides in bytes and NumPy dtype."""

    name: str
    array: object
    kind: str
    shape: tuple
    strides: tuple
    dtype: np.dtype

    @property
    def bf16(self) -> bool:
        return _arrays.is_bfloat16(self.dtype)


def inspect(name, x, rank) -> Tensor:
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
    return Tensor(name, x, k, shape, strides, dtype)


def check_same_place(tensors):
    places = {t.name: ("GPU" if _arrays.on_device(t.kind) else "host") for t in tensors}
    if len(set(places.values())) > 1:
        desc = ", ".join(f"{n} on the {p}" for n, p in places.items())
        raise ValueError(f"all arrays must be on the same side (all NumPy or all on the GPU), got {desc}")
    kinds = {t.kind for t in tensors if t.kind in ("cupy", "torch")}
    if len(kinds) > 1:
        raise TypeError("q, k, v and the other arrays of one call must be all torch tensors or all CuPy arrays, "
                        f"got {', '.join(f'{t.name}: {t.kind}' for t in tensors)}")


def check_dtypes(tensors):
    first = tensors[0]
    for t in tensors:
        if t.dtype not in DTYPES and not _arrays.is_bfloat16(t.dtype):
            hint = " (bfloat16 is taken as a NumPy ml_dtypes.bfloat16 array or a torch.bfloat16 CUDA tensor)" \
                if t.dtype.kind == "V" and t.dtype.itemsize == 2 else \
                f" (this one is {'big' if t.dtype.byteorder == '>' else 'little'}-endian: convert with " \
                f"astype('{t.dtype.newbyteorder('=').name}'))" if t.dtype.newbyteorder("=") in DTYPES else ""
            raise TypeError(f"{t.name} has dtype {t.dtype}; supported dtypes are {DTYPE_NAMES}{hint}")
        if _arrays.is_bfloat16(t.dtype) and t.kind not in ("numpy", "torch"):
            raise TypeError(f"{t.name} is a bfloat16 {t.kind} array; bfloat16 is taken as a NumPy "
                            "ml_dtypes.bfloat16 array or a torch.bfloat16 CUDA tensor")
        if t.dtype != first.dtype:
            raise TypeError(f"{t.name} has dtype {t.dtype} but {first.name} has dtype {first.dtype}; they must match")


def check_qkv(q, k, v):
    bq, sq, hq, dq = q.shape
    for t in (q, k, v):
        if t.shape[2] == 0:
            raise ValueError(f"{t.name} has no heads (shape {t.shape}): nheads must be at least 1")
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


# the largest magnitude of a scale the kernels take: they multiply by it, and by it times log2(e), in float32
_FLOAT32_SCALE_MAX = float(np.finfo(np.float32).max) / math.log2(math.e)


def check_scale(softmax_scale, head_dim, name="softmax_scale") -> float:
    if softmax_scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(softmax_scale, (bool, np.bool_)) or not isinstance(softmax_scale, (int, float, np.number)):
        raise TypeError(f"{name} must be a real number or None, got {type(softmax_scale).__name__}")
    s = float(softmax_scale)
    if not math.isfinite(s):
        raise ValueError(f"{name} must be finite, got {s}")
    if abs(s) > _FLOAT32_SCALE_MAX:  # (times log2(e) in float32 it would be inf, every score NaN)
        raise ValueError(f"{name} must be at most {_FLOAT32_SCALE_MAX:.4g} in magnitude (the kernels scale in "
                         f"float32), got {s}")
    return s


def check_flag(name, value) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
    return bool(value)


def _traced(value) -> bool:
    """Whether value is torch.compile's symbolic int (traced: the int of a run is checked when that run calls)."""
    return type(value).__name__ == "SymInt"


def check_int(name, value, lo, hi) -> int:
    if _traced(value):
        return value
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if not lo <= int(value) <= hi:
        raise ValueError(f"{name} must be in [{lo}, {hi}], got {value}")
    return int(value)


def check_array_arg(name, x, tq, hint="") -> Tensor:
    """The Tensor of an array argument beside q (ALiBi slopes, a score_mod's arrays): of any rank, in q's place
    (device or host)."""
    if isinstance(x, np.generic) or not (hasattr(x, "shape") or hasattr(x, "__cuda_array_interface__")):
        raise TypeError(f"{name} must be an array{hint}, got {type(x).__name__}")
    try:
        _arrays.kind(x)  # (an array of a kind not taken, or in the wrong place: its message says which)
    except TypeError as err:
        raise TypeError(f"{name}: {err}") from None
    rank = len(_arrays.shape_strides_dtype(x)[0])
    if rank == 0:
        raise ValueError(f"{name} must have at least one dimension, got a 0-d array (pass a (1,) array and read x[0])")
    t = inspect(name, x, rank)
    if _arrays.on_device(t.kind) != _arrays.on_device(tq.kind):
        check_same_place((tq, t))
    return t


def mod_args_tuple(score_mod_args) -> tuple:
    """``score_mod_args`` as a tuple (of at most MOD_ARGS entries; each checked by :func:`check_mods`)."""
    from .kernels.common import MOD_ARGS

    if not isinstance(score_mod_args, (tuple, list)):
        raise TypeError(f"score_mod_args must be a tuple of arrays, got {type(score_mod_args).__name__}")
    if len(score_mod_args) > MOD_ARGS:
        raise ValueError(f"score_mod_args takes at most {MOD_ARGS} arrays, got {len(score_mod_args)}")
    return tuple(score_mod_args)


def _captured_arrays(fn, seen=None) -> list:
    """The names of the arrays (NumPy, CuPy, torch, any CUDA array) that ``fn``, or a plain function it calls,
    reads from a closure or its module's globals."""
    import types

    code = getattr(fn, "__code__", None)
    seen = set() if seen is None else seen
    if code is None or code in seen:
        return []
    seen.add(code)

    def is_array(x):
        return isinstance(x, np.ndarray) or hasattr(x, "__cuda_array_interface__") or \
            type(x).__module__.startswith("torch") and type(x).__name__ in ("Tensor", "Parameter")

    values = []
    for name, cell in zip(code.co_freevars, getattr(fn, "__closure__", None) or ()):
        try:
            values.append((name, cell.cell_contents))
        except ValueError:  # (a cell not yet filled)
            pass
    scope = getattr(fn, "__globals__", {})
    values += [(name, scope[name]) for name in code.co_names if name in scope]
    found = [name for name, x in values if is_array(x)]
    for _, x in values:  # (the functions it calls, compiled with it)
        if isinstance(x, types.FunctionType):
            found += _captured_arrays(x, seen)
    return found


def _takes(fn, n) -> bool:
    """Whether ``fn`` can be called with ``n`` positional arguments."""
    import inspect as _inspect

    try:
        _inspect.signature(fn).bind(*range(n))
    except TypeError:
        return False
    except ValueError:  # no signature to read (a builtin): let the compiler say
        return True
    return True


def check_mods(tq, tk, score_mod, score_mod_grad, mask_mod, score_mod_args, enable_gqa, backward=False):
    """(Mods or None, the argument arrays as Tensors): a user's functions checked before anything is compiled or
    launched: callables taking (score, b, h, q_idx, kv_idx, *args) / (b, h, q_idx, kv_idx, *args), at most
    MOD_ARGS arrays on q's device, GQA only with ``enable_gqa`` (as FlexAttention), and in the backward the
    score_mod's derivative."""
    from .kernels.common import Mods

    args = [check_array_arg(f"score_mod_args[{n}]", a, tq, " (close over a number in the function instead)")
            for n, a in enumerate(mod_args_tuple(score_mod_args))]
    n = len(args)
    with_args = []
    for name, fn, lead in (("score_mod", score_mod, 5), ("score_mod_grad", score_mod_grad, 5),
                           ("mask_mod", mask_mod, 4)):
        with_args.append(False)
        if fn is None:
            continue
        if not callable(fn):
            hint = " (a block mask goes in block_mask=; FlexAttention's fifth argument is block_mask, " \
                   "flashnumba's mask_mod)" if type(fn).__name__ == "BlockMask" else ""
            raise TypeError(f"{name} must be a function, got {type(fn).__name__}{hint}")
        captured = _captured_arrays(fn)
        if captured:
            where = "closure" if captured[0] in fn.__code__.co_freevars else "global"
            raise TypeError(f"{name} {getattr(fn, '__name__', fn)!r} reads the array {captured[0]!r} from a {where}: "
                            f"pass it in score_mod_args and take it as a parameter (an array read from a closure or "
                            f"a global is taken into a kernel when it is first compiled, a NumPy one as constants, "
                            f"so that its later changes go unseen on a GPU, where the simulator reads it at each "
                            f"call)")
        what = "(score, b, h, q_idx, kv_idx" if lead == 5 else "(b, h, q_idx, kv_idx"
        if n and _takes(fn, lead + n):
            with_args[-1] = True
        elif not _takes(fn, lead):
            raise TypeError(f"{name} {getattr(fn, '__name__', fn)!r} must take {what}), or those and the "
                            f"{n} arrays of score_mod_args" if n else f"{name} {getattr(fn, '__name__', fn)!r} must "
                            f"take {what}): {lead} arguments")
    if score_mod_grad is not None and score_mod is None:
        raise ValueError("score_mod_grad is the derivative of a score_mod, and none was given")
    if backward and score_mod is not None and score_mod_grad is None:
        raise ValueError("the backward through a score_mod needs its derivative with respect to the score: pass "
                         "score_mod_grad (for an added bias, a function returning 1.0)")
    if tk.shape[-2] != tq.shape[-2] and not enable_gqa:
        raise ValueError(f"k and v have {tk.shape[-2]} heads and q {tq.shape[-2]}: pass enable_gqa=True for grouped "
                         f"query attention (as FlexAttention)")
    if score_mod is None and mask_mod is None:
        return None, tuple(args)
    if not backward:
        score_mod_grad, with_args[1] = None, False
    from ._backend import SIMULATOR

    if SIMULATOR and all(tq.shape[:3]) and tk.shape[-3]:  # (a call without an entry calls no function)
        for role, fn, w in zip(("score_mod", "score_mod_grad", "mask_mod"), (score_mod, score_mod_grad, mask_mod),
                               with_args):
            if fn is not None:
                _try_on_the_host(role, fn, [a.array for a in args] if w else [])
    return Mods(score_mod, score_mod_grad, mask_mod, n, tuple(with_args)), tuple(args)


def _try_on_the_host(role, fn, arrays):
    """In the simulator, where nothing is compiled, a user's function is called once here as the kernels will call
    it first, at score 1.0 and b = h = q_idx = kv_idx = 0 (an entry every call with entries has), so that one that
    raises or returns something other than one number (a tuple, None: what a GPU's compile refuses,
    :func:`flashnumba.kernels.common.refuse_broken`) is reported, naming it, before any launch rather than from
    inside a kernel's thread."""
    from .kernels.common import must_return

    score = role != "mask_mod"
    call = (np.float32(1.0),) * score + (np.int32(0),) * 4 + tuple(arrays)
    label = f"{role} {getattr(fn, '__name__', fn)!r}"
    try:
        with np.errstate(all="ignore"):
            result = fn(*call)
    except Exception as err:  # noqa: BLE001  (whatever the user's code raises, named)
        if isinstance(err, AttributeError) and "numba.cuda" in str(err):
            return  # (cuda.threadIdx and the like exist inside a simulated kernel only: the kernel runs it there)
        where = "score 1.0 and indices 0" if score else "indices 0"
        raise TypeError(f"{label} raised {type(err).__name__} at {where}: {err}") from err
    if isinstance(result, np.ndarray) and result.shape == ():
        result = result[()]
    if not isinstance(result, (bool, int, float, np.bool_, np.integer, np.floating)):
        raise TypeError(must_return(role, fn, type(result).__name__))


PRECISIONS = ("ieee", "tf32", "3xtf32")
_SIMT = {"forward": ("v1", "v2", "v3"), "backward": ("v1", "v2")}


def kernel_for_precision(precision, kernel, q, pass_):
    """The kernel= that ``precision`` asks for on float32 inputs: "ieee" the SIMT kernels (exact float32
    arithmetic; None leaves the choice of v1/v2/v3 to the plan), "tf32" and "3xtf32" the tensor-core kernels of
    that name (forward and backward). A kernel= that contradicts it, or a precision for 16-bit inputs, is an error."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS} (or None), got {precision!r}")
    dtype = _arrays.shape_strides_dtype(q)[2]
    if np.dtype(dtype) != np.float32:
        raise ValueError(f"precision= chooses how float32 inputs are multiplied; q has dtype {dtype} (float16 and "
                         f"bfloat16 run as they are, with float32 accumulation)")
    if precision == "ieee":
        if kernel not in (None,) + _SIMT[pass_]:
            raise ValueError(f"precision='ieee' runs the SIMT kernels {_SIMT[pass_]}; kernel={kernel!r} contradicts it")
        return kernel
    if kernel not in (None, precision):
        raise ValueError(f"precision={precision!r} runs kernel {precision!r}; kernel={kernel!r} contradicts it")
    return precision


def check_blocks(block_m, block_n, num_threads):
    """The caller's tile arguments: None or an int in [1, 1024]."""
    return tuple(None if v is None else check_int(n, v, 1, 1024)
                 for n, v in (("block_m", block_m), ("block_n", block_n), ("num_threads", num_threads)))


def check_dropout_p(dropout_p) -> float:
    if isinstance(dropout_p, (bool, np.bool_)) or not isinstance(dropout_p, (int, float, np.number)):
        raise TypeError(f"dropout_p must be a number, got {type(dropout_p).__name__}")
    if not 0.0 <= float(dropout_p) < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
    return float(dropout_p)


def check_seed(dropout_p: float, seed, offset) -> tuple:
    """(seed, offset) as uint64 for the kernels; a seed is required when dropout_p > 0. Checked on every call
    (they are not part of a plan)."""
    if dropout_p > 0 and seed is None:
        raise ValueError("dropout_p > 0 needs a dropout_seed (the backward must regenerate the forward's mask "
                         "from the same dropout_seed and dropout_offset)")
    # (the Philox counter holds the offset in one 32-bit word: an offset of 2**32 or more would give the mask of
    # the offset less 2**32; flashnumba.draw_dropout_seed folds a generator's high offset bits into the seed)
    for name, value, top in (("dropout_seed", 0 if seed is None else seed, 64), ("dropout_offset", offset, 32)):
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)) or not 0 <= value < 2**top:
            raise ValueError(f"{name} must be an int in [0, 2**{top}), got {value!r}")
    return np.uint64(0 if seed is None else seed), np.uint64(offset)


def check_stream(stream):
    """The CUDA stream handle (an int) of a ``stream=`` argument, or None for the arrays' own current stream (torch's
    for torch tensors, CuPy's for CuPy arrays). Taken: an int handle (0: the legacy default stream), a torch
    ``Stream`` (``.cuda_stream``), a CuPy ``Stream`` (``.ptr``), a Numba stream (``int(stream)``)."""
    if stream is None:
        return None
    for attr in ("cuda_stream", "ptr"):
        handle = getattr(stream, attr, None)
        if isinstance(handle, (int, np.integer)):
            return int(handle)
    if isinstance(stream, (bool, np.bool_)) or not hasattr(stream, "__int__"):
        raise TypeError(f"stream must be None, an int handle, or a torch, CuPy or Numba stream, got "
                        f"{type(stream).__module__}.{type(stream).__name__}")
    handle = int(stream)
    if handle < 0:
        raise ValueError(f"stream handle must be >= 0, got {handle}")
    return handle


@dataclass(frozen=True)
class Options:
    """The masking, score and dropout options of a call, validated; seed and offset travel per call.

    Query i sees key j iff i + diag - left <= j <= i + diag + right (diag = seqlen_k - seqlen_q; -1: unbounded;
    causal is right = 0). ``alibi``: the validated (nheads,) or (batch, nheads) float32 slopes, or None.
    """

    scale: float
    left: int
    right: int
    softcap: float
    alibi: Tensor | None
    dropout_p: float
    varlen: bool
    gqa: bool
    mods: object = None  # a user's score_mod / mask_mod (flashnumba.kernels.common.Mods), or None
    mod_args: tuple = ()  # the Tensors of the arrays they read
    block_mask: tuple | None = None  # (Q block, KV block, Tensors of kv_num_blocks, kv_indices, state), or None
    # the kernels (tables "wgmma", "wgmma_dq", "wgmma_dkdv") that keep their table's tiles beside a score_mod,
    # instead of the smaller ones its per-score work may need (tried first: flashnumba.api._flex_compiled)
    mods_table_tiles: frozenset = frozenset()

    @property
    def variant(self) -> Variant:
        """What the v2/v3 and tensor-core kernels compile in."""
        return Variant(has_left=self.left >= 0, has_right=self.right >= 0, softcap=self.softcap > 0,
                       alibi=self.alibi is not None, varlen=self.varlen, dropout=self.dropout_p > 0)

    @property
    def causal(self) -> bool:
        """Exactly the causal mask (right = 0, no left bound): what kernel v1 implements."""
        return self.right == 0 and self.left < 0

    @property
    def plain(self) -> bool:
        """Only what kernel v1 (and the TF32 kernels) support: no window other than causal, no softcap, ALiBi,
        GQA, varlen or dropout."""
        has_left, _, softcap, alibi, varlen, dropout = self.variant
        return not (has_left or softcap or alibi or varlen or dropout or self.gqa or self.right > 0
                    or self.mods is not None)

    def describe(self) -> str:
        parts = []
        if self.causal:
            parts.append("causal")
        elif self.left >= 0 or self.right >= 0:
            parts.append(f"window ({self.left}, {self.right})")
        if self.softcap:
            parts.append(f"softcap {self.softcap:g}")
        if self.alibi is not None:
            parts.append("ALiBi")
        if self.gqa:
            parts.append("GQA")
        if self.varlen:
            parts.append("varlen")
        if self.dropout_p:
            parts.append(f"dropout {self.dropout_p:g}")
        if self.mods is not None:
            parts += [f"{n} {getattr(f, '__name__', '?')}" for n, f in (("score_mod", self.mods.score_mod),
                                                                       ("mask_mod", self.mods.mask_mod)) if f]
        return ", ".join(parts) or "no mask"


def check_window(window_size) -> tuple[int, int]:
    """(left, right) of a ``window_size`` pair of ints >= -1 (-1: unbounded)."""
    try:
        left, right = window_size
    except (TypeError, ValueError):
        raise ValueError(f"window_size must be a pair (left, right), got {window_size!r}") from None
    for name, w in (("left", left), ("right", right)):
        if _traced(w):
            continue
        if isinstance(w, (bool, np.bool_)) or not isinstance(w, (int, np.integer)) or not -1 <= w < 2**62:
            raise ValueError(f"window_size {name} must be an int in [-1, 2**62) (-1: unbounded; the kernels take "
                             f"int64), got {w!r}")
    return tuple(w if _traced(w) else int(w) for w in (left, right))


# ALiBi's distance |i + seqlen_k - seqlen_q - j| is computed in float32 by most kernels (exact below 2^24 positions)
ALIBI_MAX_POSITIONS = 2 ** 24


def check_softcap(softcap) -> float:
    """softcap as a float: a real number, 0 (off) or positive where it and its reciprocal are normal float32 numbers
    (the kernels divide by it in float32, some as a product with its approximate reciprocal, which flushes a
    subnormal to 0: a larger softcap would make every score 0, a smaller one infinite)."""
    if isinstance(softcap, (bool, np.bool_)) or not isinstance(softcap, (int, float, np.number)):
        raise TypeError(f"softcap must be a real number, got {type(softcap).__name__}")
    if not (math.isfinite(float(softcap)) and float(softcap) >= 0):
        raise ValueError(f"softcap must be finite and >= 0 (0: off), got {softcap}")
    tiny = float(np.finfo(np.float32).tiny)  # (the smallest normal float32)
    if softcap and not tiny <= float(softcap) <= 1.0 / tiny:
        raise ValueError(f"softcap must be 0 or in [{tiny:.3g}, {1.0 / tiny:.3g}] (it and its reciprocal are taken in "
                         f"float32), got {softcap}")
    return float(softcap)


def check_options(tq, tk, causal, window_size, softcap, alibi_slopes, dropout_p, softmax_scale, batch=None,
                  varlen=False, lengths=None) -> Options:
    """The masking, score and dropout options of a call as :class:`Options`. ``lengths``: (max_seqlen_q,
    max_seqlen_k) of a varlen call (else q's and k's sequence lengths), which ALiBi's positions must stay below."""
    causal = check_flag("causal", causal)
    left, right = check_window(window_size)
    if causal:  # as in flash-attn: causal is the window (left, 0)
        right = 0
    softcap = check_softcap(softcap)
    nheads = tq.shape[-2]
    batch = tq.shape[0] if batch is None else batch
    alibi = None
    if alibi_slopes is not None:
        alibi = check_array_arg("alibi_slopes", alibi_slopes, tq)
        if alibi.shape not in ((nheads,), (batch, nheads)):
            raise ValueError(f"alibi_slopes must have shape (nheads,) = ({nheads},) or (batch, nheads) = "
                             f"({batch}, {nheads}), got {alibi.shape}")
        if alibi.dtype != np.float32:
            raise TypeError(f"alibi_slopes must be float32, got {alibi.dtype}")
        longest = max(lengths if lengths is not None else (tq.shape[-3], tk.shape[-3]))
        if longest >= ALIBI_MAX_POSITIONS:
            raise ValueError(f"alibi_slopes takes sequences shorter than 2**24 = {ALIBI_MAX_POSITIONS} positions (the "
                             f"kernels compute ALiBi's distances in float32, exact below that), got {longest}")
    p = check_dropout_p(dropout_p)
    scale = check_scale(softmax_scale, tq.shape[-1])
    return Options(scale=scale, left=left, right=right, softcap=float(softcap), alibi=alibi, dropout_p=p,
                   varlen=varlen, gqa=tk.shape[-2] != tq.shape[-2])


def check_forward_results(tq, tdo, to, tl, lse_layout, lse_shape, forward_name):
    """dout and out shaped like q; lse float32 in the forward's layout."""
    for t in (tdo, to):
        if t.shape != tq.shape:
            raise ValueError(f"{t.name} must have the shape of q {tq.shape}, got {t.shape}")
    if tl.shape != lse_shape:
        raise ValueError(f"lse must have shape {lse_layout} = {lse_shape}, got {tl.shape}")
    if tl.dtype != np.float32:
        raise TypeError(f"lse must be float32 (as {forward_name} returns it), got {tl.dtype}")


def check_cu_seqlens(tq, tk, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, read_values=True):
    """Validate the varlen offsets and maxima: returns (batch, cu_q Tensor, cu_k Tensor, max_q, max_k).

    Shapes and dtypes are checked always, and the values of NumPy arrays (on the host: free to read). The values
    (starting at 0, non-decreasing, ending at the number of rows, no sequence longer than max_seqlen) of device
    arrays are device memory: ``read_values`` copies them to the host to check them (a synchronisation); offsets
    that break these rules make the kernels read and write outside the arrays, so ``read_values=False`` is for
    callers that guarantee them.
    """
    out, longest = [], []
    named = (("cu_seqlens_q", cu_seqlens_q, tq.shape[0]), ("cu_seqlens_k", cu_seqlens_k, tk.shape[0]))
    for name, cu, _ in named:
        t = inspect(name, cu, 1)
        check_same_place((tq, t))
        if t.dtype != np.int32:
            raise TypeError(f"{name} must be int32, got {t.dtype}")
        if t.shape[0] < 1:
            raise ValueError(f"{name} must have shape (batch + 1,), got {t.shape}")
        out.append(t)
    tcq, tck = out
    if tcq.shape != tck.shape:
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must have the same length (batch + 1), got "
                         f"{tcq.shape[0]} and {tck.shape[0]}")
    for t, (name, _, total) in zip(out, named):
        longest.append(None)
        if read_values or t.kind == "numpy":
            if t.kind != "numpy" and _arrays.capturing(t.array):
                raise RuntimeError(f"{name} is read on the host to check it (flashnumba.config.check_device_values), "
                                   f"which a CUDA graph capture cannot do: capture with check_device_values off (the "
                                   f"offsets are then trusted: values that break the rules take the kernels outside "
                                   f"the arrays)")
            h = _arrays.to_host(t.array)
            if h[0] != 0:
                raise ValueError(f"{name} must start at 0 (shape (batch + 1,)), got {h[:4].tolist()}...")
            if (np.diff(h) < 0).any():
                raise ValueError(f"{name} must be non-decreasing, got {h.tolist()}")
            if h[-1] != total:
                raise ValueError(f"{name} must end at the total number of rows ({total}), got {int(h[-1])}")
            longest[-1] = int(np.diff(h).max()) if h.shape[0] > 1 else 0
    maxes = []
    for i, (name, given) in enumerate((("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k))):
        given = check_int(name, given, 0, 2**31 - 1)
        if longest[i] is not None and given < longest[i]:
            raise ValueError(f"{name} must be at least the longest sequence ({longest[i]}), got {given}")
        maxes.append(given)
    return tcq.shape[0] - 1, tcq, tck, maxes[0], maxes[1]
