"""What every kernel shares: who sees whom, the score modifications, the dropout stream.

FlashAttention-2's Algorithms 1 and 2 visit, for a query tile Q_i, the key tiles K_j it can see, and mask the
entries S_ij of a tile that it cannot. The rules, the same in every kernel (forward and backward, SIMT and tensor
cores) and in ``flashnumba.reference``:

* query row i of a sequence sees key j iff i + diag - left <= j <= i + diag + right, with diag = seqlen_k -
  seqlen_q (the diagonal of the bottom-right-aligned causal mask), each bound only where it is compiled in
  (``has_left``, ``has_right``; causal is has_right with right = 0), and j < seqlen_k. The SIMT, TF32 and
  decoding kernels write this test out where they mask a score; the tensor-core forwards and the Hopper backward
  turn it into each row's column bounds (:func:`make_column_bounds`, :func:`make_tile_bounds`) and compare each
  score's compile-time column with them; the ``mma.sync`` backward calls :func:`make_outside`;
* the key tiles a query tile meets are those that intersect the union of its rows' bands: :func:`make_key_range`
  and :func:`make_key_tiles`;
* a batch entry's rows, for equal lengths or packed (varlen) sequences: :func:`make_sequence_geometry`;
* which tile and head a block computes, so that the blocks with the most causal work start first:
  :func:`make_launch_order`;
* the score before the softmax: softcap, then the ALiBi bias: :func:`make_score_mod`;
* the online softmax's steps on a lane's rows in the tensor-core kernels' register layout (a row spread over the
  four lanes of a quad): :func:`make_online_softmax`;
* the dropout mask: a Philox uniform drawn from (seed, offset, batch * nheads + head, i, j):
  :data:`dropout_uniform`, so that the backward regenerates exactly the forward's mask;
* a user's own score and mask functions (FlexAttention's ``score_mod`` and ``mask_mod``): :class:`Mods`, compiled
  into the kernels by :func:`make_user_mods`; the tensor-core forward keeps the mask_mod of a lane's scores in one
  bit each: :func:`make_mask_bits`.

Scores are kept in base 2 inside the kernels (exp2, with log2(e) folded into the scale): :data:`LOG2E` and
:data:`LN2` move between the bases; a row with no visible key keeps m_i = :data:`NEG_INF`.
"""

from __future__ import annotations

import functools
import math
import re
import types

from . import philox, ptx
from .._backend import cuda
from .score_math import COMPILED, tanh_approx
from .scalars import float32, int32, int64, uint32, uint64

# The dropout mask's random numbers (see philox.py), as device functions.
dropout_uniform = cuda.jit(device=True)(philox.make_uniform(cuda.jit(device=True)(philox.philox4x32_10)))

LOG2E = float32(math.log2(math.e))
LN2 = float32(math.log(2.0))
NEG_INF = float32(-math.inf)


class Variant(tuple):
    """Compile-time options of the v2/v3 kernels: (has_left, has_right, softcap, alibi, varlen, dropout)."""

    def __new__(cls, has_left=False, has_right=False, softcap=False, alibi=False, varlen=False, dropout=False):
        return super().__new__(cls, tuple(map(bool, (has_left, has_right, softcap, alibi, varlen, dropout))))


# Blocks that a group of heads spans in launch order (:func:`make_launch_order`): two waves on an H100's 132 SMs,
# so that within a group the longest blocks of every head start before the short ones fill the last wave.
GROUP_BLOCKS = 256


@functools.lru_cache(maxsize=None)
def make_launch_order(from_end, grouped):
    """launch_order() -> (tile, bh): the tile along the grid's x axis (a query tile, or the dK/dV kernels' key tile)
    and the index along its y axis (batch entry times heads plus head) that this block computes. The GPU starts a
    grid's blocks in the order of blockIdx.y * gridDim.x + blockIdx.x, each wherever a block has ended, so the
    blocks that start last set when the launch ends. Under a causal mask a query tile's work grows with its
    distance from the start (the last ones first: ``from_end``) and a key tile's with its distance from the end
    (the first ones first). Taking the tiles of one head after another, longest first, the last heads' longest
    blocks still start in the last waves. Here the heads go in groups of g = ceil(:data:`GROUP_BLOCKS` /
    gridDim.x) (the last group the rest) and a group's blocks go tile by tile, longest first, each tile for all of
    the group's heads in turn: only the group's own short blocks end the launch, and a group's keys and values are
    few enough to stay in the L2 cache while its blocks run. A bijection of the grid: every (tile, bh) once.

    ``grouped`` False (where every block does the same work: no causal mask or right bound, no block mask): the
    tiles of one head after another, tile and bh the special registers' values themselves (blockIdx.x, counted from
    the end where ``from_end``, and blockIdx.y), which the compiler may read again rather than keep live: the
    grouped order's, computed, stay in registers (at head_dim 128 a user's relative bias with document masking
    spilled 12 bytes in the Hopper dK/dV kernel with it), and so do the special registers' values once converted
    (16 bytes with a user's ALiBi and causal mask and a block mask there). Callers convert them as before the
    order: ``uint32(bh)`` for the 32-bit divisions."""

    if not grouped:  # (the special registers themselves, as the kernels read them before the order)
        @cuda.jit(device=True, inline=True)
        def head_after_head():
            return (cuda.gridDim.x - 1 - cuda.blockIdx.x) if from_end else cuda.blockIdx.x, cuda.blockIdx.y

        return head_after_head

    @cuda.jit(device=True, inline=True)
    def launch_order():
        # (each operand of a division a uint32: Numba's integer arithmetic is 64-bit, and a 64-bit division is a
        # subroutine call, for which the assembler serialises the Hopper kernels' wgmma)
        nt = uint32(cuda.gridDim.x)
        g = uint32(uint32(GROUP_BLOCKS - 1) + nt) // nt  # heads a group
        first = uint32(uint32(uint32(cuda.blockIdx.y) // g) * g)  # the block's group's first bh
        size = min(g, uint32(uint32(cuda.gridDim.y) - first))
        at = uint32(uint32(uint32(cuda.blockIdx.y) - first) * nt + uint32(cuda.blockIdx.x))  # its place in the group
        x = uint32(at // size)  # the x-th longest tile of the group's heads
        tile = uint32(nt - uint32(1) - x) if from_end else x
        # (as signed 64-bit values, which a kernel's index arithmetic takes without wrapping: in the simulator a
        # uint32 stays one through products with Python integers, and a difference below 0 would wrap)
        return int64(tile), int64(first + uint32(at - x * size))

    return launch_order


def make_sequence_geometry(varlen):
    """The device function that places batch entry ``b`` in the arrays, for the register-tiled kernels:

        bb, q0, k0, seqlen_q, seqlen_k = sequence(b, seqlen_q, seqlen_k, cu_q, cu_k)

    ``bb`` indexes the arrays' leading dimension, ``q0`` and ``k0`` are the rows of its first query and key,
    and seqlen_q, seqlen_k its lengths. Equal lengths: (b, 0, 0, seqlen_q, seqlen_k) as given. ``varlen``
    (packed sequences, the arrays viewed as (1, total, nheads, d)): entry b is rows cu_q[b] .. cu_q[b+1] of q
    and cu_k[b] .. cu_k[b+1] of k and v."""

    @cuda.jit(device=True)
    def sequence(b, seqlen_q, seqlen_k, cu_q, cu_k):
        if varlen:
            q0 = cu_q[b]
            k0 = cu_k[b]
            return 0, q0, k0, cu_q[b + 1] - q0, cu_k[b + 1] - k0
        return b, 0, 0, seqlen_q, seqlen_k

    return sequence


def make_score_mod(softcap_on, alibi_on, no_calls=False, float32_distance=False):
    """The device function that modifies a score before the softmax, as every kernel does it (and as
    ``flashnumba.reference._scores``):

        x, dcap = score_mod(x, softcap, slope, i, j, diag)

    x = scale q_i . k_j becomes softcap * tanh(x / softcap) (``softcap_on``), then x - slope |i + diag - j| (the
    ALiBi bias, ``alibi_on``); dcap = d(new x) / d(x) = 1 - tanh^2 (1 without a softcap), which the backward
    multiplies into dS. The forward ignores dcap and the compiler drops it.

    ``no_calls``: the tanh as 1 - 2 / (exp(2 y) + 1) from ``ex2.approx`` and ``rcp.approx`` (within a few float32
    ulps of 1 in absolute terms: :func:`.score_math.tanh_approx`, which a user's score_mod may call too), for the
    Hopper kernels: a float32 division and libdevice's tanhf have slow paths that are subroutine calls, and the
    assembler serialises the wgmma of a kernel that makes any call. With it too, ALiBi's distance in float32 from
    the 32-bit indices: Numba computes integer arithmetic in 64 bits, and |i + diag - j| then costs a 64-bit sum,
    absolute value and conversion a score, where float32(i) + float32(diag) is one per row, float32(j) one per
    column, and a score one subtraction (its absolute value an operand modifier). Exact below 2^24 (every index and
    distance a float32 holds exactly). ``float32_distance``: that distance alone, for the other kernels whose loops
    it shortens without more registers (a kernel may take either form: the two distances are the same number)."""

    F32_DISTANCE = no_calls or float32_distance

    @cuda.jit(device=True, inline=True)
    def score_mod(x, softcap, slope, i, j, diag):
        dcap = float32(1.0)
        if softcap_on and no_calls:
            th = tanh_approx(float32(x * ptx.rcp_approx(softcap)))
            x = softcap * th
            dcap = float32(1.0) - th * th
        elif softcap_on:
            th = float32(math.tanh(x / softcap))
            x = softcap * th
            dcap = float32(1.0) - th * th
        if alibi_on and F32_DISTANCE:  # (the row's part and the column's hoisted out of a tile's scores)
            x -= slope * abs((float32(int32(i)) + float32(int32(diag))) - float32(int32(j)))
        elif alibi_on:
            x -= slope * float32(abs(i + diag - j))
        return x, dcap

    return score_mod


@functools.lru_cache(maxsize=None)
def make_online_softmax(fold, exact=False):
    """(quad_max, new_max, prob): the steps of the online softmax on one row of a tile of scores as the tensor-core
    kernels hold it (``mma.sync``'s C fragment, and ``wgmma``'s accumulator, which repeats it): each row spread
    over the four lanes of a quad (lanes 4 g .. 4 g + 3), each lane holding some of its columns.

    * ``quad_max(mx)``: a lane's partial row maximum -> the row's, over its quad (a butterfly over lane bits 0, 1);
    * ``new_max(m, m_use, alpha, r, mx, scale_q)``: row r's running maximum m[r] (base 2) -> m_new = max(m_i,
      mx), with alpha[r] = exp2(m_i - m_new) and m_use[r] the maximum the exponent subtracts (0 for a row that
      saw no key yet: no -inf - -inf);
    * ``prob(sv, mu, scale_q)``: P = exp2(S - m_use) of one score.

    With ``fold`` the scores are the raw products Q K^T and the scale (times log2(e), positive) is applied in the
    exponent, one FMA: exp2(S scale - m); mx is then the raw maximum, scaled here. With ``exact`` the exponentials
    are float32's ``exp2`` (libdevice, about 1 ulp) instead of ``ex2.approx.ftz`` (2 ulp, subnormals flushed): the
    float32 kernels' choice."""

    @cuda.jit(device=True, inline=True)
    def quad_max(mx):
        mx = max(mx, ptx.shfl_xor_f32(mx, 1))
        return max(mx, ptx.shfl_xor_f32(mx, 2))

    @cuda.jit(device=True, inline=True)
    def new_max(m, m_use, alpha, r, mx, scale_q):
        if fold:
            mx *= scale_q  # (-inf stays -inf: scale_q > 0)
        mx = max(m[r], mx)
        m_use[r] = mx if mx != NEG_INF else float32(0.0)
        alpha[r] = float32(math.exp2(m[r] - m_use[r])) if exact else ptx.exp2_ftz(m[r] - m_use[r])
        m[r] = mx

    @cuda.jit(device=True, inline=True)
    def prob(sv, mu, scale_q):
        if fold:  # one FMA and the exponential
            x = cuda.fma(sv, scale_q, -mu)
        else:
            x = sv - mu
        return float32(math.exp2(x)) if exact else ptx.exp2_ftz(x)

    return quad_max, new_max, prob


@cuda.jit(device=True, inline=True)
def row_stats(lse, delta, b, h, i, seqlen_q):
    """(log2(e) L_i, D_i) of query row i for the backward's P = exp2(scale log2(e) S - log2(e) L_i) and dS =
    P (dP - D_i): (0, 0) past the end of the sequence, and log2(e) L_i 0 for a row that sees no key (L_i -inf:
    every entry of its row is masked)."""
    if i >= seqlen_q:
        return float32(0.0), float32(0.0)
    L = lse[b, h, i]
    return (L * LOG2E if L != NEG_INF else float32(0.0)), delta[b, h, i]


def make_key_range(B_r, B_c, has_left, has_right):
    """key_range(i0, seqlen_q, seqlen_k, diag, left, right) -> (n_start, n_end): the keys that the query rows
    i0 .. i0 + B_r - 1 (within the sequence) can see lie in n_start .. n_end - 1. Row i sees keys
    i + diag - left .. i + diag + right (each bound only where compiled in), so the first row gives the lower
    end, rounded down to a multiple of B_c so that the tiles stay aligned, and the last row the upper end,
    clipped to 0 .. seqlen_k."""

    @cuda.jit(device=True, inline=True)
    def key_range(i0, seqlen_q, seqlen_k, diag, left, right):
        n_start = 0
        n_end = seqlen_k
        if has_left:
            n_start = max(0, i0 + diag - left) // B_c * B_c
        if has_right:
            last_row = min(i0 + B_r, seqlen_q) - 1
            n_end = max(0, min(seqlen_k, last_row + diag + right + 1))
        return n_start, n_end

    return key_range


@functools.lru_cache(maxsize=None)
def make_column_bounds(B_c, has_left, has_right):
    """column_bounds(i, col0, seqlen_k, diag, left, right) -> (lo, hi): the keys col0 + c that query row i sees,
    as the columns lo <= c < hi of a lane whose columns of the tile start at key col0 (both int32, clamped to
    0 .. B_c). The masked tiles' loops then test each score's compile-time column c against the row's two bounds,
    one 32-bit comparison a bound, instead of the key's 64-bit index against the sequence's end and the band.
    Transposed (rows keys j, columns queries): key j is seen by the queries j - diag - right .. j - diag + left,
    the same band with diag negated and the bounds exchanged (:func:`make_tile_bounds`)."""

    @cuda.jit(device=True, inline=True)
    def column_bounds(i, col0, seqlen_k, diag, left, right):
        hi = seqlen_k - col0
        if has_right:
            hi = min(hi, i + diag + right + 1 - col0)
        lo = hi - hi  # (0 of hi's type)
        if has_left:
            lo = i + diag - left - col0
        return int32(min(max(lo, 0), B_c)), int32(min(max(hi, 0), B_c))

    return column_bounds


@functools.lru_cache(maxsize=None)
def make_tile_bounds(B, has_left, has_right, keys_are_rows):
    """(tile_bounds, floored). tile_bounds(row, col0, seqlen_q, seqlen_k, diag, left, right) -> (lo, hi): the
    entries of a tile's row that lie within the sequences and the band, as a lane's columns lo <= c < hi (keys or
    queries col0 + c, clamped to 0 .. B): rows are queries and columns keys (:func:`make_column_bounds`), or, where
    ``keys_are_rows`` (the backward's S^T), rows keys and columns queries (the same, diag negated and the window's
    bounds exchanged: the left one caps the queries, the right one floors them); a row past its sequence keeps
    none. ``floored``: whether lo can be above 0, where the window floors the columns (``has_left`` for keys,
    ``has_right`` for queries), so that a caller tests c < lo only then."""
    floored = has_right if keys_are_rows else has_left
    bounds = make_column_bounds(B, floored, has_left if keys_are_rows else has_right)

    @cuda.jit(device=True, inline=True)
    def tile_bounds(row, col0, seqlen_q, seqlen_k, diag, left, right):
        if keys_are_rows:
            lo, hi = bounds(row, col0, seqlen_q, -diag, right, left)
            if row >= seqlen_k:
                hi = int32(0)
        else:
            lo, hi = bounds(row, col0, seqlen_k, diag, left, right)
            if row >= seqlen_q:
                hi = int32(0)
        return lo, hi

    return tile_bounds, floored


def make_outside(has_left, has_right):
    """outside(i, j, seqlen_q, seqlen_k, diag, left, right): whether the entry of query i and key j lies past a
    sequence or out of the query's band (keys i + diag - left .. i + diag + right): the `mma.sync` backward's mask
    (its dK/dV kernel at d = 128 spilled with :func:`make_tile_bounds`)."""

    @cuda.jit(device=True, inline=True)
    def outside(i, j, seqlen_q, seqlen_k, diag, left, right):
        return (i >= seqlen_q or j >= seqlen_k or (has_left and j < i + diag - left)
                or (has_right and j > i + diag + right))

    return outside


@functools.lru_cache(maxsize=None)
def make_key_tiles(B_r, B_c, has_left, has_right):
    """key_tiles(i0, seqlen_q, seqlen_k, diag, left, right) -> (last_row, n_start, n_tiles): the key range of
    :func:`make_key_range` as n_tiles tiles of B_c keys from key n_start, the last possibly reaching past
    seqlen_k, and the last query row within the sequence (the kernels test it to skip the mask of tiles inside
    every row's band). For the kernels that count their tiles (the cp.async pipelines prefetch tile j + 1 while
    j is used)."""
    key_range = make_key_range(B_r, B_c, has_left, has_right)

    @cuda.jit(device=True, inline=True)
    def key_tiles(i0, seqlen_q, seqlen_k, diag, left, right):
        last_row = min(i0 + B_r, seqlen_q) - 1
        n_start, n_end = key_range(i0, seqlen_q, seqlen_k, diag, left, right)
        return last_row, n_start, max(0, (n_end - n_start + B_c - 1) // B_c)

    return key_tiles


MOD_ARGS = 4  # arrays a user's score_mod / mask_mod may read (kernel parameters a0 .. a3; dummies where unused)


class Mods:
    """A user's ``score_mod(score, b, h, q_idx, kv_idx, *args)``, its derivative ``score_mod_grad`` (same
    arguments; for the backward) and ``mask_mod(b, h, q_idx, kv_idx, *args)``, plain Python functions that the
    kernels compile as device functions; ``nargs``, the number of arrays (at most :data:`MOD_ARGS`), and
    ``with_args``, for each of the three functions whether it takes them (a function may leave them out).
    Equal when the functions are the same objects: a kernel is compiled once per set of functions (a function's
    identity, not its text, names it, so these kernels are not stored in the disk cache)."""

    __slots__ = ("score_mod", "score_mod_grad", "mask_mod", "nargs", "with_args")

    def __init__(self, score_mod=None, score_mod_grad=None, mask_mod=None, nargs=0, with_args=(True, True, True)):
        self.score_mod, self.score_mod_grad, self.mask_mod, self.nargs = score_mod, score_mod_grad, mask_mod, nargs
        self.with_args = tuple(bool(w) for w in with_args)

    def _key(self):
        return (id(self.score_mod), id(self.score_mod_grad), id(self.mask_mod), self.nargs, self.with_args)

    def __eq__(self, other):
        return isinstance(other, Mods) and self._key() == other._key()

    def __hash__(self):
        return hash(self._key())

    def __repr__(self):
        names = ", ".join(f"{n}={getattr(f, '__qualname__', '?')}@{id(f):x}" for n, f in
                          (("score_mod", self.score_mod), ("score_mod_grad", self.score_mod_grad),
                           ("mask_mod", self.mask_mod)) if f is not None)
        return f"Mods({names}, nargs={self.nargs})"


def _fixed_arity(name, params, body, namespace):
    """A device function ``name(params)`` returning ``body``, written out (its arity is the user's)."""
    exec(f"def {name}({', '.join(params)}):\n    return {body}\n", namespace)  # noqa: S102
    return cuda.jit(device=True, inline=True)(namespace[name])


@functools.lru_cache(maxsize=None)
def as_device_function(fn):
    """``fn`` as a Numba device function, with the plain Python functions it calls (through its globals or its
    closure, to any depth) made device functions too, so that a user's score_mod may call another, as
    ``alibi(softcap(x, ...), ...)``, and the Python floats it reads (constants, globals, closure cells) weak:
    float32 (:func:`_weak_floats`). A function that is already a Numba dispatcher, or one of :mod:`.score_math`'s
    (``tanh_approx``), is kept as it is; the user's own function and its globals are left untouched (the device
    version reads a copy)."""
    return _as_device(fn, {})


def _as_device(fn, seen):
    if not isinstance(fn, types.FunctionType) or fn in COMPILED:  # (COMPILED: compiled as they are)
        return fn
    if fn in seen:
        return seen[fn]
    seen[fn] = None  # a function that calls itself is left for Numba to refuse
    code = fn.__code__
    env = dict(fn.__globals__)
    for name in _names(code):
        value = env.get(name)
        if isinstance(value, types.FunctionType) and value is not fn:
            env[name] = _as_device(value, seen)
        elif name in env:
            env[name] = _float32_of(value)
    closure = fn.__closure__
    if closure:
        closure = tuple(_device_cell(c, seen) for c in closure)
    copy = types.FunctionType(_weak_floats(code), env, fn.__name__, _float32_of(fn.__defaults__), closure)
    copy.__kwdefaults__ = _float32_of(fn.__kwdefaults__)
    copy.__qualname__ = fn.__qualname__
    seen[fn] = cuda.jit(device=True)(copy)
    return seen[fn]


def named_functions(mods):
    """(role, function) of each of the user's functions that :class:`Mods` holds."""
    return [(n, f) for n, f in (("score_mod", mods.score_mod), ("score_mod_grad", mods.score_mod_grad),
                                ("mask_mod", mods.mask_mod)) if f is not None]


def must_return(role, fn, returned) -> str:
    """The error's words for the user's function ``fn`` in ``role`` that returned ``returned`` (a type's name)."""
    what = "one bool (True keeps the entry)" if role == "mask_mod" else "one number (the score)"
    return f"{role} {getattr(fn, '__name__', fn)!r} returns {returned}; it must return {what}"


def refuse_broken(mods, who, compile_them, errors=Exception):
    """Runs ``compile_them()``, which compiles kernels holding the user's functions of :class:`Mods`; a function
    Numba cannot compile, or whose compiled version returns something other than one number (Numba compiles what
    the kernels make of a result: ``bool()`` of a tuple is True, of None False), raises a TypeError that names it
    and the problem, prefixed by ``who`` (the call). ``errors``: the exceptions of ``compile_them`` that are the
    compile's. Returns what ``compile_them`` returned."""
    try:
        result = compile_them()
    except errors as err:
        raise TypeError(f"{who}: {why_not_compiled(mods, err)}") from err
    wrong = wrong_return(mods)
    if wrong:
        raise TypeError(f"{who}: {wrong}")
    return result


def wrong_return(mods):
    """:func:`must_return`'s line for the first of the user's functions whose compiled versions return something
    other than one number (none in the simulator, which compiles nothing), or None."""
    from numba.core import types as nbtypes

    for role, fn in named_functions(mods):
        for cres in getattr(as_device_function(fn), "overloads", {}).values():
            returned = cres.signature.return_type
            if not isinstance(returned, (nbtypes.Number, nbtypes.Boolean)):
                return must_return(role, fn, returned)
    return None


def why_not_compiled(mods, err) -> str:
    """Why a kernel with the user's functions of :class:`Mods` did not compile, in a line that names the function:
    :func:`wrong_return`'s, else the innermost error Numba's message states (``NameError: name 'helper' is not
    defined``)."""
    wrong = wrong_return(mods)
    if wrong:
        return wrong
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(err))  # (Numba colours its messages on a terminal)
    stated = re.findall(r"^\s*(\w*(?:Error|Exception): .+)$", text, re.M)
    detail = stated[-1].strip() if stated else (text.splitlines() or [type(err).__name__])[0]
    names = ", ".join(f"{n} {getattr(f, '__name__', f)!r}" for n, f in named_functions(mods))
    return f"{names} could not be compiled into the kernels: {detail[:300]}"


_FLOAT64_KINDS = {"mul": "a product", "sub": "a difference", "add": "a sum", "truediv": "a quotient",
                  "floordiv": "a quotient", "pow": "a power", "call": "a call's result"}


def float64_use(fn) -> list:
    """What ``fn``'s compiled device versions (:func:`as_device_function`) compute in float64, as words ("a
    product", "variable y"); empty before a kernel that calls it is compiled, and in the simulator. Numba types an
    integer and a float32 together as float64, as NumPy does (``slope * abs(q_idx - kv_idx)``), and a GPU runs
    float64 several times slower than float32."""
    return sorted(_float64_use(as_device_function(fn), set()))


def _float64_use(dispatcher, visited):
    """:func:`float64_use` of one device function and the device functions it calls (its globals and closure)."""
    if id(dispatcher) in visited:
        return set()
    visited.add(id(dispatcher))
    found = set()
    for cres in getattr(dispatcher, "overloads", {}).values():
        for name, ty in cres.fndesc.typemap.items():
            if str(ty) != "float64" or name.startswith("arg.") or "return_value" in name:
                continue
            if not name.startswith("$"):
                found.add(f"variable {name.split('.')[0]}")
                continue
            m = re.match(r"\$\d*(?:binop_i?|inplace_binop_i?)?([a-z]+?)\d*(?:\.\d+)?$", name)
            if m and m.group(1) in _FLOAT64_KINDS:
                found.add(_FLOAT64_KINDS[m.group(1)])
    py = getattr(dispatcher, "py_func", None)
    if py is not None:
        called = [py.__globals__.get(n) for n in _names(py.__code__)]
        called += [_contents(c) for c in py.__closure__ or ()]  # (the copy's)
        for f in called:
            if hasattr(f, "overloads") and f is not dispatcher:
                found |= _float64_use(f, visited)
    return found


def _contents(cell):
    """What a closure cell holds (None for an empty one)."""
    try:
        return cell.cell_contents
    except ValueError:
        return None


def _device_cell(cell, seen):
    """A closure cell of the device copy: a plain function it holds made a device function, its floats (alone or
    in a tuple) float32, anything else the cell itself."""
    value = _contents(cell)
    if isinstance(value, types.FunctionType):
        return types.CellType(_as_device(value, seen))
    if type(value) in (float, tuple):
        return types.CellType(_float32_of(value))
    return cell


_FLOAT32_MAX = 3.4028234663852886e38


def _float32_of(value):
    """A Python float as float32 (within float32's range; beyond it, where it would become infinite, it stays),
    the same through tuples and dicts (default values); anything else as it is."""
    if type(value) is float:
        return float32(value) if abs(value) <= _FLOAT32_MAX or value != value or abs(value) == math.inf else value
    if type(value) is tuple:
        return tuple(_float32_of(v) for v in value)
    if type(value) is dict:
        return {k: _float32_of(v) for k, v in value.items()}
    return value


def _names(code):
    """The global names ``code`` and the code it holds (nested functions, lambdas) read."""
    return set(code.co_names).union(*(_names(c) for c in code.co_consts if isinstance(c, types.CodeType)))


def _weak_floats(code):
    """``code`` with its Python float constants as float32 (and those of the code it holds: a nested function's).
    Numba types a Python float as float64, and with it every product it enters: ``math.tanh(score / 20.0)`` would
    run libdevice's double-precision tanh at each score, several times slower on a GPU than the float32 one. Here a
    Python float is float32, as FlexAttention's compiler takes one beside a float32 score, and the function computes
    what it computes in the simulator, where the score is a NumPy float32 (NumPy 2 keeps a Python float weak). Unlike
    NumPy 2's, the constant is rounded to float32 beside an integer or a float64 too (``q_idx * 0.1`` multiplies by
    float32's 0.1); one beyond float32's range stays float64."""
    consts = tuple(_weak_floats(c) if isinstance(c, types.CodeType) else _float32_of(c) for c in code.co_consts)
    return code.replace(co_consts=consts)


@functools.lru_cache(maxsize=None)
def make_user_mods(mods):
    """(user_score, user_mask): the user's functions of :class:`Mods` behind a fixed signature::

        x, dmod = user_score(x, b, h, i, j, a0, a1, a2, a3)    # x: the score in natural units
        visible = user_mask(b, h, i, j, a0, a1, a2, a3)

    each passing the first ``mods.nargs`` arrays on; a missing score_mod is the identity (dmod 1), a missing
    derivative 1, a missing mask_mod True. b, h, q_idx and kv_idx reach the user's functions as int32, as in
    FlexAttention (the kernels' indices: 64-bit ones take two instructions for each add and compare). The kernels
    call them only with indices within the sequences, so a function may index its arrays by q_idx and kv_idx."""
    if mods is None:
        return None, None
    given = [f"a{n}" for n in range(mods.nargs)]
    s_args, g_args, m_args = (given if w else [] for w in mods.with_args)
    every = ["a0", "a1", "a2", "a3"]
    ns = {"float32": float32, "int32": int32}
    ns["score"] = (as_device_function(mods.score_mod) if mods.score_mod is not None
                   else _fixed_arity("score", ["x", "b", "h", "i", "j"] + s_args, "x", ns))
    ns["grad"] = (as_device_function(mods.score_mod_grad) if mods.score_mod_grad is not None
                  else _fixed_arity("grad", ["x", "b", "h", "i", "j"] + g_args, "float32(1.0)", ns))
    ns["mask"] = (as_device_function(mods.mask_mod) if mods.mask_mod is not None
                  else _fixed_arity("mask", ["b", "h", "i", "j"] + m_args, "True", ns))
    idx = ["int32(b)", "int32(h)", "int32(i)", "int32(j)"]
    score = ", ".join(["x"] + idx + s_args)
    grad = ", ".join(["x"] + idx + g_args)
    user_score = _fixed_arity("user_score", ["x", "b", "h", "i", "j"] + every,
                              f"float32(score({score})), float32(grad({grad}))", ns)
    user_mask = _fixed_arity("user_mask", ["b", "h", "i", "j"] + every,
                             f"bool(mask({', '.join(idx + m_args)}))", ns)
    return user_score, user_mask


@functools.lru_cache(maxsize=None)
def make_user_score_within(mods):
    """``score_within(x, b, h, i, j, seqlen_q, seqlen_k, a0, a1, a2, a3) -> (x, dmod)``: the user's score_mod
    (:func:`make_user_mods`) at an entry of a tile, its indices clamped into the sequences (an entry past a
    sequence's end takes the last row's or key's; the kernels mask it or never store it). The tensor-core kernels
    call it at every entry: no branch a score, so that what the function reads at fixed indices (``slopes[h]``)
    is read once a tile, and the clamp is two 32-bit minima."""
    user_score, _ = make_user_mods(mods)

    @cuda.jit(device=True, inline=True)
    def score_within(x, b, h, i, j, seqlen_q, seqlen_k, a0, a1, a2, a3):
        return user_score(x, b, h, min(int32(i), int32(seqlen_q - 1)), min(int32(j), int32(seqlen_k - 1)),
                          a0, a1, a2, a3)

    return score_within


@functools.lru_cache(maxsize=None)
def make_mask_bits(mods):
    """(hide, hidden) for a user's mask_mod in the tensor-core forward, which evaluates it for a tile before its
    products (its code then has the registers that the products' results will hold, and a lane keeps one bit a
    score, at most 64 scores, instead)::

        bits = hide(bits, e, b, h, i, j, seqlen_q, seqlen_k, a0, a1, a2, a3)   # bit e set: mask_mod hides (i, j)
        hidden(bits, e)                                                         # whether bit e is set

    ``hide`` calls the mask_mod only for entries within the sequences (which it leaves shown); ``e`` is a
    constant once the kernels' loops over a lane's fragments are unrolled, so that the bits stay in a register."""
    _, user_mask = make_user_mods(mods)

    @cuda.jit(device=True, inline=True)
    def hide(bits, e, b, h, i, j, seqlen_q, seqlen_k, a0, a1, a2, a3):
        if i < seqlen_q and j < seqlen_k and not user_mask(b, h, i, j, a0, a1, a2, a3):
            return bits | (uint64(1) << uint64(e))
        return bits

    @cuda.jit(device=True, inline=True)
    def hidden(bits, e):
        return (bits >> uint64(e)) & uint64(1) != uint64(0)

    return hide, hidden
