"""One warp's tile operations on tensor cores: the building blocks of FlashAttention-2's matrix products.

Every tensor-core kernel (:mod:`.mma_forward`, :mod:`.mma_backward`, :mod:`.mma_tf32`) gives each warp blocks of
16 rows (:data:`WARP_ROWS`, the M of ``mma.sync.m16n8k16``) and works with these, built on the intrinsics of
:mod:`.ptx`:

* :func:`make_load_rows`, :func:`make_load_pair`: rows of a (batch, seqlen, nheads, D) array into shared
  memory with ``cp.async``, 16 bytes a copy, zeros past the end of the sequence;
* :func:`tile_landed`: the commit / wait / barrier step of the double buffer (FlashAttention-2's overlap of the
  copies of tile j + 1 with the products on tile j);
* :func:`make_load_a`: the A fragments of 16 rows (``ldmatrix``);
* :func:`make_mma_abt`: acc = A X^T (S = Q K^T, dP = dO V^T), :func:`make_mma_ab`: acc += P X (dQ += dS K,
  dV += P^T dO, ...), :func:`make_mma_atb`: acc += A X with A stored transposed (dQ += dS K from dS^T), with
  :func:`make_mma_into` the one m16n8k16 product behind them;
* :func:`make_load_a_rows`, :func:`make_mma_abt_rows`, :func:`make_mma_ab_rows`: the same for a warp of WM blocks
  of 16 rows (1 or 2), each fragment of K_j or V_j loaded once for all of them: the forward's and the decoding
  kernel's products (the unsuffixed ones are the backward's).

A head dim that is a multiple of 8 but not of 16 (24, 40, ...) is padded in shared memory to the next multiple of
16 (:func:`padded`), the k-step of ``mma.sync.m16n8k16``: the copies fill the columns past the head dim with
zeros, which add nothing to Q K^T, and only the head dim's columns are stored.

Matrices in shared memory are row-major with rows of D + :data:`PAD` elements; ``off`` is the element offset of
a matrix's first row in the one shared array. A row of D = 64 or 128 16-bit elements is 128 or 256 bytes: with
that stride the eight 16-byte rows an ``ldmatrix`` reads would all start in the same four of the 32 banks (an
8-way conflict); with D + 8 each row starts 16 bytes (four banks) further on, and the eight rows cover the 32
banks once.
"""

from __future__ import annotations

import functools

from . import ptx
from .._backend import cuda

WARP_ROWS = 16  # the M of mma.m16n8k16 (and m16n8k8): query rows per warp
HEAD_DIMS = tuple(range(8, 257, 8))  # head dims the tensor-core forward is built for (16-byte rows of 16 bits)
PAD = 8  # elements added to each shared-memory row (16 bytes): conflict-free ldmatrix


def padded(D: int) -> int:
    """The head dim in shared memory and in the products: D rounded up to a multiple of 16 (the k-step of
    m16n8k16); the columns past D are zeros."""
    return -(-D // 16) * 16


def _kind(dtype):
    """(mma_into, pack) for "float16" or "bfloat16": see :func:`make_mma_into`; pack is the intrinsic."""
    if dtype == "bfloat16":
        return make_mma_into(ptx.mma_m16n8k16_bf16), ptx.pack_bf16x2
    return make_mma_into(ptx.mma_m16n8k16_f16), ptx.pack_f16x2


@functools.lru_cache(maxsize=None)
def make_mma_into(mma):
    """mma_into(acc, n, a0, a1, a2, a3, b0, b1): acc[n, 0..3] += A B for one m16n8k16 tile, A given by its
    fragment registers a0..a3 and B by b0, b1, with ``mma`` (the float16 or bfloat16 intrinsic)."""

    @cuda.jit(device=True, inline=True)
    def mma_into(acc, n, a0, a1, a2, a3, b0, b1):
        d0, d1, d2, d3 = mma(a0, a1, a2, a3, b0, b1, acc[n, 0], acc[n, 1], acc[n, 2], acc[n, 3])
        acc[n, 0] = d0
        acc[n, 1] = d1
        acc[n, 2] = d2
        acc[n, 3] = d3

    return mma_into


@functools.lru_cache(maxsize=None)
def make_copy16(D, strided=False):
    """copy16(smem, dst, src, b, row0, r, h, c): start the cp.async of the 16 bytes at src[b, row0 + r, h, c] to
    smem element ``dst``. A C-contiguous src (``strided`` False) is addressed from its shape; a strided one (a view
    such as q of a packed qkv: last dimension contiguous, other strides multiples of 16 bytes) from its strides,
    so it is read in place (:func:`flashnumba.kernels.ptx.cp_async_16_at`)."""
    if strided:
        @cuda.jit(device=True, inline=True)
        def copy16(smem, dst, src, b, row0, r, h, c):
            ptx.cp_async_16_at(smem, dst, src, b, row0 + r, h, c)
    else:
        @cuda.jit(device=True, inline=True)
        def copy16(smem, dst, src, b, row0, r, h, c):
            ptx.cp_async_16(smem, dst, src, ((b * src.shape[1] + row0 + r) * src.shape[2] + h) * D + c)
    return copy16


@functools.lru_cache(maxsize=None)
def make_load_rows(D, NT, LD=None, per_copy=8, strided=False, DG=None, per_column=True):
    """load_rows(smem, off, src, b, row0, row_end, h, rows, tid): start the copy of ``rows`` rows of
    src[b, row0 + r, h, :] (a (batch, seqlen, nheads, DG) array, C-contiguous unless ``strided``, see
    :func:`make_copy16`) to smem rows off + r of D elements (row stride ``LD`` elements, D + PAD unless given),
    16 bytes = ``per_copy`` elements (8 of 16 bits, 4 of float32) per cp.async, spread over the NT threads of the
    block; rows at or past ``row_end`` (the end of the sequence), and the columns from DG (the array's head dim,
    D unless given) to D, become zeros (plain stores: a row of garbage could hold a NaN, and 0 * NaN is NaN).
    ``per_column``: where NT is a multiple of the chunks per row, each thread copies one column of rows NT / CH
    apart (one division a call instead of one a copy; the TF32 and 3xTF32 kernels, forward and backward, keep
    the division per copy, which holds no row index across the copies: the 3xTF32 forward is at the register
    limit); from a C-contiguous source it computes the
    64-bit index of its first chunk once and steps it by NT / CH rows (a handful of instructions a copy instead
    of the products of the full index)."""
    if LD is None:
        LD = D + PAD
    if DG is None:
        DG = D
    CH = D // per_copy  # 16-byte chunks per row
    copy16 = make_copy16(DG, strided)
    if per_column and NT % CH == 0:  # each thread copies one column of rows RS apart: one division a call
        RS = NT // CH

        @cuda.jit(device=True, inline=True)
        def load_rows(smem, off, src, b, row0, row_end, h, rows, tid):
            r = tid // CH
            c = (tid - r * CH) * per_copy
            g = ((b * src.shape[1] + row0 + r) * src.shape[2] + h) * DG + c  # src[b, row0 + r, h, c], flat
            step = RS * src.shape[2] * DG  # RS rows further on (a C-contiguous source)
            for it in range((rows + RS - 1) // RS):
                if rows % RS == 0 or r < rows:
                    if row0 + r < row_end and (DG == D or c < DG):
                        if strided:  # (addressed from its strides, per copy)
                            copy16(smem, off + r * LD + c, src, b, row0, r, h, c)
                        else:
                            ptx.cp_async_16(smem, off + r * LD + c, src, g)
                    else:
                        _zeros(smem, off + r * LD + c, per_copy)
                r += RS
                g += step
    else:
        @cuda.jit(device=True, inline=True)
        def load_rows(smem, off, src, b, row0, row_end, h, rows, tid):
            for it in range((rows * CH + NT - 1) // NT):
                e = tid + it * NT
                if e < rows * CH:
                    r = e // CH
                    c = (e % CH) * per_copy
                    _copy_or_zero(copy16, smem, off + r * LD + c, src, b, row0, r, h, c,
                                  row0 + r < row_end and c < DG, per_copy)

    return load_rows


@cuda.jit(device=True, inline=True)
def _copy_or_zero(copy16, smem, dst, src, b, row0, r, h, c, inside, per_copy):
    """The cp.async of one 16-byte chunk (``inside`` the sequence and the head dim), or zeros in its place (plain
    stores: a row of garbage could hold a NaN, and 0 * NaN is NaN)."""
    if inside:
        copy16(smem, dst, src, b, row0, r, h, c)
    else:
        _zeros(smem, dst, per_copy)


@cuda.jit(device=True, inline=True)
def _zeros(smem, dst, per_copy):
    """Zeros in place of one 16-byte chunk (plain stores)."""
    for x in range(per_copy):
        smem[dst + x] = 0  # (a float16 constant captured from Python fails NVVM)


@functools.lru_cache(maxsize=None)
def make_load_pair(D, NT, rows, second, strided=False, DG=None):
    """load_pair(smem, off, x, y, b, row0, row_end, h, tid): :func:`make_load_rows` of ``rows`` rows of x to
    smem from element ``off`` and of the same rows of y from ``off + second``: the two matrices of one tile of a
    double buffer (K_j and V_j, or Q_i and dO_i), copied as one."""
    load_rows = make_load_rows(D, NT, strided=strided, DG=DG)

    @cuda.jit(device=True, inline=True)
    def load_pair(smem, off, x, y, b, row0, row_end, h, tid):
        load_rows(smem, off, x, b, row0, row_end, h, rows, tid)
        load_rows(smem, off + second, y, b, row0, row_end, h, rows, tid)

    return load_pair


@cuda.jit(device=True, inline=True)
def tile_landed():
    """The step of the cp.async double buffer between issuing the copies of tile j + 1 (into the buffer that
    tile j - 1 used) and computing on tile j: close the copies just issued as one commit group (an empty one
    after the last tile keeps the count uniform), wait until every group but that newest one has landed (tile j,
    and whatever the prologue copied with it), and a barrier, so that every thread's copies and zero stores of
    tile j are visible to all."""
    ptx.cp_async_commit()
    ptx.cp_async_wait(1)
    cuda.syncthreads()


@functools.lru_cache(maxsize=None)
def make_load_a(D):
    """load_a(frag, smem, off, lane): the A fragments frag[kk, 0..3] (one per 16 columns) of the 16 rows
    starting at element ``off``: lane l points at row l % 16, column 16 kk + 8 (l // 16)."""
    LD = D + PAD

    @cuda.jit(device=True, inline=True)
    def load_a(frag, smem, off, lane):
        for kk in range(D // 16):
            a0, a1, a2, a3 = ptx.ldmatrix_x4(smem, off + (lane % 16) * LD + 16 * kk + 8 * (lane // 16))
            frag[kk, 0] = a0
            frag[kk, 1] = a1
            frag[kk, 2] = a2
            frag[kk, 3] = a3

    return load_a


@functools.lru_cache(maxsize=None)
def make_mma_abt(D, N, dtype, a_in_smem=False):
    """mma_abt(acc, frag, smem, off, lane): acc = A X^T, A (16 x D) given by its fragments ``frag`` (load_a),
    X (N x D) the N rows of smem starting at element ``off``; acc[n, 0..3] is the C fragment of columns
    8n .. 8n + 7. With ``a_in_smem``: mma_abt(acc, smem, a_off, off, lane), A's fragments read per k-step from
    the 16 rows at element ``a_off`` (no registers held for them across the product: what large head dims need).

    B = X^T (D x N) in "col" layout is X row-major: non-transposing ldmatrix. One x4 load covers 16 rows of X
    x 16 columns: lanes 0-7 rows n0..n0+7, columns 16kk..+7 (b0 of tile n0), lanes 8-15 the same rows, columns
    +8..+15 (b1), lanes 16-31 the same for rows n0+8..n0+15."""
    LD = D + PAD
    mma_into, _ = _kind(dtype)

    @cuda.jit(device=True, inline=True)
    def k_step(acc, kk, a0, a1, a2, a3, smem, off, lane):
        for n2 in range(N // 16):
            row = 16 * n2 + (lane & 7) + 8 * (lane >> 4)
            col = 16 * kk + 8 * ((lane >> 3) & 1)
            b0, b1, b2, b3 = ptx.ldmatrix_x4(smem, off + row * LD + col)
            mma_into(acc, 2 * n2, a0, a1, a2, a3, b0, b1)
            mma_into(acc, 2 * n2 + 1, a0, a1, a2, a3, b2, b3)

    if a_in_smem:
        @cuda.jit(device=True, inline=True)
        def mma_abt(acc, smem, a_off, off, lane):
            for n in range(N // 8):
                for x in range(4):
                    acc[n, x] = 0.0
            for kk in range(D // 16):
                a0, a1, a2, a3 = ptx.ldmatrix_x4(smem, a_off + (lane % 16) * LD + 16 * kk + 8 * (lane // 16))
                k_step(acc, kk, a0, a1, a2, a3, smem, off, lane)
    else:
        @cuda.jit(device=True, inline=True)
        def mma_abt(acc, frag, smem, off, lane):
            for n in range(N // 8):
                for x in range(4):
                    acc[n, x] = 0.0
            for kk in range(D // 16):
                k_step(acc, kk, frag[kk, 0], frag[kk, 1], frag[kk, 2], frag[kk, 3], smem, off, lane)

    return mma_abt


@functools.lru_cache(maxsize=None)
def _make_b_rows_step(D, dtype, ld):
    """b_rows_step(acc, c, a0, a1, a2, a3, smem, off, lane): acc += A X[16c .. 16c + 15, :] for one 16-row k-step
    of X (rows of ``ld`` elements from ``off``), A's fragments given. B = X (row-major) is "row" layout for B:
    transposing ldmatrix. Lane l points at row 16c + l % 16, column 16 n2 + 8 (l // 16): (b0, b1) of columns
    16 n2 .. +7, then of columns 16 n2 + 8 .. +15."""
    mma_into, _ = _kind(dtype)

    @cuda.jit(device=True, inline=True)
    def b_rows_step(acc, c, a0, a1, a2, a3, smem, off, lane):
        for n2 in range(D // 16):
            b0, b1, b2, b3 = ptx.ldmatrix_x4_trans(smem, off + (16 * c + lane % 16) * ld + 16 * n2 + 8 * (lane // 16))
            mma_into(acc, 2 * n2, a0, a1, a2, a3, b0, b1)
            mma_into(acc, 2 * n2 + 1, a0, a1, a2, a3, b2, b3)

    return b_rows_step


@functools.lru_cache(maxsize=None)
def make_mma_ab(N, D, dtype, ld=None):
    """mma_ab(acc, p, smem, off, lane): acc += P X, P (16 x N) given as C fragments p[n, 0..3] (rounded to 16
    bits here; the module docstring of :mod:`.mma_forward` shows why a C fragment is already the A fragment),
    X (N x D) the N rows of smem starting at element ``off``; acc[n, 0..3] is the C fragment of columns
    8n .. 8n + 7 (D / 8 of them). ``ld``: the rows' stride in elements, D + PAD unless given (X the first D
    columns from ``off`` of wider rows: a warp's share of a product split by columns)."""
    _, pack = _kind(dtype)
    step = _make_b_rows_step(D, dtype, D + PAD if ld is None else ld)

    @cuda.jit(device=True, inline=True)
    def mma_ab(acc, p, smem, off, lane):
        for c in range(N // 16):
            a0 = pack(p[2 * c, 0], p[2 * c, 1])
            a1 = pack(p[2 * c, 2], p[2 * c, 3])
            a2 = pack(p[2 * c + 1, 0], p[2 * c + 1, 1])
            a3 = pack(p[2 * c + 1, 2], p[2 * c + 1, 3])
            step(acc, c, a0, a1, a2, a3, smem, off, lane)

    return mma_ab


@functools.lru_cache(maxsize=None)
def make_mma_atb(N, D, dtype, lda, ldx):
    """mma_atb(acc, smem, a_off, off, lane): acc += A X with A (16 x N) stored transposed in shared memory (A^T:
    N rows of ``lda`` elements from ``a_off``, the 16 columns of A's rows) and X (N x D, rows of ``ldx``
    elements from ``off``); acc[n, 0..3] is the C fragment of columns 8n .. 8n + 7. (dQ_i += dS_ij K_j where the
    kernel holds dS^T: the dK/dV kernel's atomic dQ.)

    A's fragments come from A^T with the transposing ldmatrix: (a0, a1, a2, a3) are A[0:8, 0:8], A[8:16, 0:8],
    A[0:8, 8:16], A[8:16, 8:16], that is the transposes of A^T[0:8, 0:8], A^T[0:8, 8:16], A^T[8:16, 0:8],
    A^T[8:16, 8:16]: lane l points at row 16c + l % 8 + 8 (l // 16) of A^T, column 8 ((l // 8) % 2)."""
    step = _make_b_rows_step(D, dtype, ldx)

    @cuda.jit(device=True, inline=True)
    def mma_atb(acc, smem, a_off, off, lane):
        for c in range(N // 16):
            a0, a1, a2, a3 = ptx.ldmatrix_x4_trans(smem, a_off + (16 * c + (lane & 7) + 8 * (lane >> 4)) * lda
                                                   + 8 * ((lane >> 3) & 1))
            step(acc, c, a0, a1, a2, a3, smem, off, lane)

    return mma_atb


# ---------------------------------------------------------------------------------------------------------------
# a warp of several 16-row blocks: the fragments of K_j and V_j loaded once for all of them
# ---------------------------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def make_load_a_rows(D, WM):
    """load_a_rows(frag, smem, off, lane): the A fragments frag[w, kk, 0..3] of the WM blocks of 16 rows that
    start at element ``off`` (block w at row 16 w), as :func:`make_load_a` for each."""
    LD = D + PAD

    @cuda.jit(device=True, inline=True)
    def load_a_rows(frag, smem, off, lane):
        for w in range(WM):
            for kk in range(D // 16):
                a0, a1, a2, a3 = ptx.ldmatrix_x4(smem, off + (16 * w + lane % 16) * LD + 16 * kk + 8 * (lane // 16))
                frag[w, kk, 0] = a0
                frag[w, kk, 1] = a1
                frag[w, kk, 2] = a2
                frag[w, kk, 3] = a3

    return load_a_rows


@functools.lru_cache(maxsize=None)
def _mma_into_rows(dtype):
    """mma_into_rows(acc, w, n, a0, a1, a2, a3, b0, b1): acc[w, n, 0..3] += A B for one m16n8k16 tile."""
    mma = ptx.mma_m16n8k16_bf16 if dtype == "bfloat16" else ptx.mma_m16n8k16_f16

    @cuda.jit(device=True, inline=True)
    def mma_into_rows(acc, w, n, a0, a1, a2, a3, b0, b1):
        d0, d1, d2, d3 = mma(a0, a1, a2, a3, b0, b1, acc[w, n, 0], acc[w, n, 1], acc[w, n, 2], acc[w, n, 3])
        acc[w, n, 0] = d0
        acc[w, n, 1] = d1
        acc[w, n, 2] = d2
        acc[w, n, 3] = d3

    return mma_into_rows


@functools.lru_cache(maxsize=None)
def make_mma_abt_rows(D, N, dtype, WM, a_in_smem):
    """mma_abt_rows(acc, frag, smem, a_off, off, lane): acc[w] = A_w X^T for the WM blocks A_w of 16 rows of a
    warp, X (N x D) the N rows of smem from element ``off`` (:func:`make_mma_abt`'s layout). Each x4 ldmatrix of
    X feeds WM ``mma``: with WM = 2 a warp reads K_j from shared memory half as often per product as with one block
    (FlashAttention-2 gives each warp of its 128-row tiles two such blocks). The A fragments are ``frag[w, kk]``
    (:func:`make_load_a_rows`, kept in registers), or, with ``a_in_smem``, read per k-step from the rows at
    ``a_off`` into frag[w, 0] (registers for O at large head dims leave none to keep Q_i in)."""
    LD = D + PAD
    mma_into = _mma_into_rows(dtype)
    KM = 0 if a_in_smem else 1  # frag's k-step index: kk, or always 0 (reloaded per k-step)

    @cuda.jit(device=True, inline=True)
    def mma_abt_rows(acc, frag, smem, a_off, off, lane):
        for w in range(WM):
            for n in range(N // 8):
                for x in range(4):
                    acc[w, n, x] = 0.0
        for kk in range(D // 16):
            if a_in_smem:
                for w in range(WM):
                    a0, a1, a2, a3 = ptx.ldmatrix_x4(smem, a_off + (16 * w + lane % 16) * LD + 16 * kk
                                                     + 8 * (lane // 16))
                    frag[w, 0, 0] = a0
                    frag[w, 0, 1] = a1
                    frag[w, 0, 2] = a2
                    frag[w, 0, 3] = a3
            k = kk * KM
            for n2 in range(N // 16):
                row = 16 * n2 + (lane & 7) + 8 * (lane >> 4)
                col = 16 * kk + 8 * ((lane >> 3) & 1)
                b0, b1, b2, b3 = ptx.ldmatrix_x4(smem, off + row * LD + col)
                for w in range(WM):
                    mma_into(acc, w, 2 * n2, frag[w, k, 0], frag[w, k, 1], frag[w, k, 2], frag[w, k, 3], b0, b1)
                    mma_into(acc, w, 2 * n2 + 1, frag[w, k, 0], frag[w, k, 1], frag[w, k, 2], frag[w, k, 3], b2, b3)

    return mma_abt_rows


@functools.lru_cache(maxsize=None)
def make_mma_ab_rows(N, D, dtype, WM):
    """mma_ab_rows(acc, p, pa, smem, off, lane): acc[w] += P_w X for the WM blocks of 16 rows of a warp, P_w
    given as C fragments p[w, n, 0..3] (rounded to 16 bits into ``pa``, a (WM, 4) uint32 scratch), X (N x D) the N
    rows of smem from element ``off`` (:func:`make_mma_ab`'s layout); each transposing ldmatrix of X feeds WM
    ``mma``."""
    LD = D + PAD
    mma_into = _mma_into_rows(dtype)
    pack = ptx.pack_bf16x2 if dtype == "bfloat16" else ptx.pack_f16x2

    @cuda.jit(device=True, inline=True)
    def mma_ab_rows(acc, p, pa, smem, off, lane):
        for c in range(N // 16):
            for w in range(WM):
                pa[w, 0] = pack(p[w, 2 * c, 0], p[w, 2 * c, 1])
                pa[w, 1] = pack(p[w, 2 * c, 2], p[w, 2 * c, 3])
                pa[w, 2] = pack(p[w, 2 * c + 1, 0], p[w, 2 * c + 1, 1])
                pa[w, 3] = pack(p[w, 2 * c + 1, 2], p[w, 2 * c + 1, 3])
            for n2 in range(D // 16):
                b0, b1, b2, b3 = ptx.ldmatrix_x4_trans(smem, off + (16 * c + lane % 16) * LD + 16 * n2
                                                       + 8 * (lane // 16))
                for w in range(WM):
                    mma_into(acc, w, 2 * n2, pa[w, 0], pa[w, 1], pa[w, 2], pa[w, 3], b0, b1)
                    mma_into(acc, w, 2 * n2 + 1, pa[w, 0], pa[w, 1], pa[w, 2], pa[w, 3], b2, b3)

    return mma_ab_rows
