"""Backward kernels on tensor cores: FlashAttention-2, Algorithm 2, with its five matrix products as ``mma.sync``.

The SIMT backward (:mod:`flashnumba.kernels.simt_backward`) in the tile operations of
:mod:`flashnumba.kernels.mma_tiles`: float16 or bfloat16 inputs, float32 accumulation, head_dim a multiple of 8
up to 256 (:data:`BACKWARD_HEAD_DIMS`; padded to a multiple of 16 in shared memory, as the forward), with every
option of the SIMT kernels (window, softcap, ALiBi, GQA, varlen, dropout; :func:`make_entry` holds the
per-entry part). As there, D_i = rowsum(dO_i * O_i) comes first (``simt_backward.make_backward_preprocess_warp``),
then two kernels, neither with atomics, so the gradients are deterministic:

dQ, one block per query tile Q_i (warp w owns its rows 16w .. 16w + 15), looping over the key tiles K_j, V_j::

    S_ij  = Q_i K_j^T                      mma_abt: A = Q_i (fragments), B = K_j^T
    P_ij  = exp2(scale log2(e) S_ij - log2(e) L_i)      (0 where masked; softcap, ALiBi: as the forward)
    dP_ij = dO_i V_j^T                     mma_abt: A = dO_i, B = V_j^T
    dS_ij = P_ij * (Z_ij dP_ij - D_i) * softcap'(S_ij) (Z_ij: the forward's dropout mask over 1 - p, or 1)
    dQ_i += dS_ij K_j                      mma_ab: A = dS_ij (its C fragments), B = K_j
    finally dQ_i *= scale

dK, dV, one block per key tile K_j, V_j of one key/value head (warp w owns its keys 16w .. 16w + 15), looping
over the query tiles of each query head that shares it (GQA: in order, so the sum is deterministic). The
products are taken transposed, keys as rows, so that P^T and dS^T come out of the mma in the C layout that is
already the A operand of the next product (the module docstring of mma_forward shows why)::

    S_ij^T  = K_j Q_i^T                    mma_abt: A = K_j, B = Q_i^T
    P_ij^T  = exp2(scale log2(e) S_ij^T - log2(e) L_i)  (L_i per column)
    dP_ij^T = V_j dO_i^T                   mma_abt: A = V_j, B = dO_i^T
    dS_ij^T = P_ij^T * (dP_ij^T - D_i)
    dV_j   += (P_ij keep_ij)^T dO_i        mma_ab: A = (P_ij keep_ij)^T, B = dO_i (times 1 / (1 - p_drop) at the end)
    dK_j   += dS_ij^T Q_i                  mma_ab: A = dS_ij^T, B = Q_i
    finally dK_j *= scale

Above d = 160 (:func:`column_parts`) dK_j and dV_j of 16 keys no longer fit one warp's registers: two warps share
each block of 16 keys, both form its S^T and dP^T (their A fragments read per k-step), and each accumulates the
dK_j, dV_j columns of one half of the head dim (padded to 32: :func:`dkdv_dim`), so the first two products are
computed twice. The dQ kernel keeps its warp's rows and reads their A fragments per k-step there.

FlashAttention-2 itself runs one kernel of five products: its dK/dV kernel also adds dQ_i += dS_ij K_j into a
float32 buffer with atomic adds. ``make_backward_dkdv_tc(..., atomic_dq=...)`` is that kernel (the API's
``deterministic=False``), followed by :func:`make_dq_convert`; the order of the adds, and so dQ's last bits, then
vary from run to run.

P and dS are rounded to 16 bits as the A operand of their products, as in FlashAttention-2. The tiles a block loops
over are copied with cp.async into two buffers in turn (the next in flight while the warps work on the current
one); L_i and D_i of each query tile go to small float32 arrays in shared memory beside them, loaded into
registers with the tile's copies and stored after its products (a load waited for at once would hold every
warp at the barrier for the memory's latency, once a tile). With causal or
window masking, the blocks visit only the tiles that meet their band; tiles wholly inside it skip the mask.
"""

from __future__ import annotations

import functools


from . import bf16, ptx
from .._backend import cuda
from .block_mask import make_block_full, make_block_tiles
from .common import (LOG2E, NEG_INF, dropout_uniform, make_key_tiles, make_launch_order, make_outside,
                     make_score_mod, make_sequence_geometry, make_user_mods, make_user_score_within)
from .mma_tiles import (HEAD_DIMS, PAD, WARP_ROWS, make_load_a, make_load_pair, make_mma_ab, make_mma_abt,
                        make_mma_atb, padded, tile_landed)
from .scalars import float16, float32, uint16, uint32

TILES = (16, 32, 64, 128)  # block_m and block_n: multiples of the 16 rows of one warp
BACKWARD_HEAD_DIMS = HEAD_DIMS  # every multiple of 8 up to 256
# Beyond d = 160 the dK/dV kernel's dK_j and dV_j of 16 keys x d (2 x d / 8 x 4 floats a lane) and the products'
# operands no longer fit in a warp's 255 registers a lane: there each key block has two warps, each holding the
# dK_j, dV_j columns of one half of the head dim, and the dQ kernel reads its A fragments per k-step.
SPLIT_ABOVE = 160
DQ_CHUNK = 16  # columns of dQ_i a warp forms at a time in the atomic variant (16 floats a lane beside dK_j, dV_j)


def column_parts(D):
    """Warps that share one block of 16 keys in the dK/dV kernel, each with its part of the head dim's columns."""
    return 2 if D > SPLIT_ABOVE else 1


def dkdv_dim(D):
    """The head dim of the dK/dV kernel's shared rows and products: padded to 16 (:func:`padded`), and to 32
    where two warps split the columns, so that each half is whole 16-column k-steps."""
    return -(-D // 32) * 32 if column_parts(D) > 1 else padded(D)


def dkdv_threads(D, block_n):
    """Threads of a dK/dV block: a warp per 16 keys and column part."""
    return 32 * (block_n // WARP_ROWS) * column_parts(D)


def shared_bytes_dq(D, block_m, block_n):
    """Q_i and dO_i (block_m rows), two K_j, V_j buffers (block_n rows), 16-bit elements, rows of padded(D) + PAD."""
    return (2 * block_m + 4 * block_n) * (padded(D) + PAD) * 2


def shared_bytes_dkdv(D, block_m, block_n, atomic_dq=False):
    """K_j and V_j (block_n rows), two Q_i, dO_i buffers (block_m rows); L_i and D_i (static, not counted); with
    ``atomic_dq`` dS^T too (block_n rows of block_m)."""
    return (2 * block_n + 4 * block_m) * (dkdv_dim(D) + PAD) * 2 + (
        block_n * (block_m + PAD) * 2 if atomic_dq else 0)


def dq_parts(D, block_m, block_n):
    """(slabs, column parts, slabs a warp) of the atomic dQ_i += dS_ij K_j in the dK/dV kernel: dQ_i's block_m
    rows are 16-row slabs, each split by columns over the warps beside it (whole 16-column k-steps of the padded
    head dim); with fewer warps than slabs a warp takes several."""
    warps, slabs = dkdv_threads(D, block_n) // 32, block_m // WARP_ROWS
    cols = 1
    while 2 * cols * slabs <= warps and (dkdv_dim(D) // 16) % (2 * cols) == 0:
        cols *= 2
    return slabs, cols, max(1, slabs // warps)


def _check(D, block_m, block_n, dtype):
    if D not in BACKWARD_HEAD_DIMS:
        raise ValueError(f"the tensor-core backward supports head_dim in {BACKWARD_HEAD_DIMS}, got {D}")
    for name, value in (("block_m", block_m), ("block_n", block_n)):
        if value not in TILES:
            raise ValueError(f"the tensor-core backward takes {name} in {TILES}, got {value}")
    if dtype not in ("float16", "bfloat16"):
        raise ValueError(f"dtype must be 'float16' or 'bfloat16', got {dtype!r}")


@cuda.jit(device=True, inline=True)
def _store_bf16(x):
    """float32 -> bfloat16 bits, rounded to nearest even by one cvt.rn.bf16x2 (bf16.float32_to_bf16's branches
    keep the dK/dV accumulators of head_dim 128, and dQ's of 256, out of registers)."""
    return uint16(ptx.pack_bf16x2(x, float32(0.0)) & 0xFFFF)


@functools.lru_cache(maxsize=None)
def make_entry(variant, mods=None, no_calls=False, keep_given=False, float32_distance=False):
    """entry(sv, dpv, i, j, l2, di, masked, partial, ...) -> (P_ij keep_ij, dS_ij) of one entry, from sv =
    (Q_i K_j^T)_ij, dpv = (dO_i V_j^T)_ij, l2 = log2(e) L_i and di = D_i: the score as the forward formed it
    (softcap, ALiBi, then a user's score_mod), P recomputed from the logsumexp, 0 where ``masked`` and the entry
    lies outside the sequence or the band, or where ``partial`` and a user's mask_mod hides it (a block mask's
    full blocks pass partial False: the mask_mod shows all of them), the forward's dropout mask regenerated, and
    dS = P (Z dP - D_i) times the derivative of the score's modifications (softcap's, the user's score_mod_grad). The
    user's functions (``mods``, :func:`flashnumba.kernels.common.make_user_mods`) are called with indices within the
    sequences (an entry past them with the last row's or key's, its result then unused), the score_mod only where
    the mask_mod shows the entry. ``no_calls``: softcap's tanh without a subroutine call (the Hopper kernels',
    :func:`flashnumba.kernels.common.make_score_mod`); ``float32_distance``: only ALiBi's distance in that form.
    ``keep_given``: the entry takes one more argument, ``kept``, whether the dropout mask keeps it, drawn beforehand
    by the caller (the Hopper kernels draw a tile's mask apart from the entries: the generator's rounds inside the
    loop over a tile's entries leave that loop rolled, and the tile's registers then in local memory)."""
    HAS_LEFT, HAS_RIGHT, SOFTCAP, ALIBI, _, DROPOUT = variant
    USER_SCORE = mods is not None and mods.score_mod is not None
    USER_MASK = mods is not None and mods.mask_mod is not None
    _, user_mask = make_user_mods(mods)
    score_within = make_user_score_within(mods)
    SCORE_MOD = SOFTCAP or ALIBI or USER_SCORE
    score_mod = make_score_mod(SOFTCAP, ALIBI, no_calls, float32_distance)
    outside = make_outside(HAS_LEFT, HAS_RIGHT)

    @cuda.jit(device=True, inline=True)
    def entry_kept(sv, dpv, i, j, l2, di, masked, partial, seqlen_q, seqlen_k, diag, scale_log2, scale, softcap, left,
                   right, slope, p_drop, rp_keep, seed, offset, b, h, bh, a0, a1, a2, a3, kept):
        dcap = float32(1.0)  # d(modified score) / d(scale q.k)
        shown = True  # by the user's mask_mod
        if USER_MASK and partial:
            shown = i < seqlen_q and j < seqlen_k and user_mask(b, h, i, j, a0, a1, a2, a3)
        if SCORE_MOD:
            x, dcap = score_mod(sv * scale, softcap, slope, i, j, diag)
            if USER_SCORE and shown:  # (at indices within the sequences, as in the forward)
                x, dmod = score_within(x, b, h, i, j, seqlen_q, seqlen_k, a0, a1, a2, a3)
                dcap *= dmod
            p = ptx.exp2_ftz(x * LOG2E - l2)
        else:  # one FMA and the exponential
            p = ptx.exp2_ftz(cuda.fma(sv, scale_log2, -l2))
        if masked:
            if outside(i, j, seqlen_q, seqlen_k, diag, left, right):
                p = float32(0.0)
                dcap = float32(1.0)  # (the score_mod's derivative at the clamped entry stays out of dS)
        if USER_MASK and not shown:
            p = float32(0.0)
        if DROPOUT:
            if not keep_given:
                kept = dropout_uniform(seed, offset, bh, i, j) >= p_drop
            if kept:  # Z_ij = 1 / (1 - p_drop)
                return p, p * (rp_keep * dpv - di) * dcap
            return float32(0.0), -p * di * dcap
        return p, p * (dpv - di) * dcap

    if keep_given:
        return entry_kept

    @cuda.jit(device=True, inline=True)
    def entry(sv, dpv, i, j, l2, di, masked, partial, seqlen_q, seqlen_k, diag, scale_log2, scale, softcap, left,
              right, slope, p_drop, rp_keep, seed, offset, b, h, bh, a0, a1, a2, a3):
        return entry_kept(sv, dpv, i, j, l2, di, masked, partial, seqlen_q, seqlen_k, diag, scale_log2, scale,
                          softcap, left, right, slope, p_drop, rp_keep, seed, offset, b, h, bh, a0, a1, a2, a3, False)

    return entry


@functools.lru_cache(maxsize=None)
def make_stats(B_R, NT):
    """(fetch_stats, put_stats) of the dK/dV kernels, which read L_i and D_i per column of S_ij^T from shared
    memory:

    * ``fetch_stats(st, lse, delta, bb, h, row0, row_end, tid)``: L_i and D_i of the query rows row0 + tid,
      row0 + tid + NT, ... of a tile of B_R rows into the registers st (2, ceil(B_R / NT)); the loads are left in
      flight, for the caller to put after work that hides their latency;
    * ``put_stats(lsm, dsm, sel, st, tid)``: log2(e) L_i and D_i from st into row ``sel`` of lsm, dsm (0 past the
      end of the sequence, and 0 for a row that sees no key: its entries are all masked)."""
    SR = -(-B_R // NT)

    @cuda.jit(device=True, inline=True)
    def fetch_stats(st, lse, delta, bb, h, row0, row_end, tid):
        for x in range(SR):
            r = tid + x * NT
            i = row0 + r
            inside = r < B_R and i < row_end
            st[0, x] = lse[bb, h, i] if inside else float32(0.0)
            st[1, x] = delta[bb, h, i] if inside else float32(0.0)

    @cuda.jit(device=True, inline=True)
    def put_stats(lsm, dsm, sel, st, tid):
        for x in range(SR):
            r = tid + x * NT
            if r < B_R:
                L = st[0, x]
                lsm[sel, r] = L * LOG2E if L != NEG_INF else float32(0.0)
                dsm[sel, r] = st[1, x]

    return fetch_stats, put_stats


@functools.lru_cache(maxsize=None)
def make_backward_dq_tc(D, variant, block_m, block_n, dtype="float16", gqa=False, strided=False, mods=None,
                        block_mask=None):
    """The dQ kernel: grid (ceil(max_seqlen_q / block_m), batch * nheads), block (2 * block_m,) (block_m / 16
    warps), dynamic shared memory :func:`shared_bytes_dq`.

    Arguments: (dout, q, k, v, lse, delta, dq, scale_log2, scale, softcap, left, right, alibi, cu_q, cu_k, p_drop,
    rp_keep, seed, offset, a0, a1, a2, a3, bm_num, bm_idx, bm_state): dout, q, k, v, dq C-contiguous 16-bit arrays
    (uint16 holding bfloat16 bits) laid out as the forward's; lse, delta (batch, nheads, seqlen_q) float32;
    scale_log2 = softmax_scale * log2(e); the rest as the SIMT kernels take them
    (:func:`flashnumba.kernels.simt_backward.make_backward_dq_v2`), a0 .. a3 the arrays of a user's score_mod /
    mask_mod (``mods``, :func:`make_entry`). ``strided``: dout, q, k, v may be strided views, read in place
    (:func:`flashnumba.kernels.mma_tiles.make_copy16`). ``block_mask``: (QB, KB), the block sizes of a
    :class:`flashnumba.blockmask.BlockMask` (QB a multiple of block_m, KB of block_n) given as its key-block lists
    bm_num, bm_idx, bm_state (dummies without one): the key loop visits the key blocks listed for the query block
    and evaluates the mask_mod only in the partial ones, as the forward does.
    """
    _check(D, block_m, block_n, dtype)
    HAS_LEFT, HAS_RIGHT, SOFTCAP, ALIBI, VARLEN, DROPOUT = variant
    GQA = bool(gqa)  # fewer key/value heads than query heads (compiled in: see mma_forward.make_forward_tc)
    sequence = make_sequence_geometry(VARLEN)
    entry = make_entry(variant, mods, float32_distance=True)  # (not the dK/dV kernel: more registers)
    is_bf16 = dtype == "bfloat16"
    store = _store_bf16 if is_bf16 else bf16.load_store(False)[1]
    elem = uint16 if is_bf16 else float16
    B_R, B_C = block_m, block_n
    NT = 2 * B_R  # 32 threads per 16 rows
    DG, D = D, padded(D)  # the arrays' head dim; the shared rows' and the products' (zeros past DG)
    A_SMEM = DG > SPLIT_ABOVE  # Q_i's and dO_i's fragments read per k-step (dQ_i's registers leave none for them)
    LD = D + PAD
    KD, NS, NO, NOG = D // 16, B_C // 8, D // 8, DG // 8
    OFF_DO = B_R * LD  # dO_i after Q_i
    OFF_K = 2 * B_R * LD  # K buffer 0; buffer 1 lies BUF further on; V_j lies OFF_V after its K_j
    OFF_V = B_C * LD
    BUF = 2 * B_C * LD
    load_qdo = make_load_pair(D, NT, B_R, OFF_DO, strided, DG)  # Q_i and dO_i
    load_kv = make_load_pair(D, NT, B_C, OFF_V, strided, DG)  # K_j and V_j of one buffer
    load_a = make_load_a(D)
    mma_abt = make_mma_abt(D, B_C, dtype, A_SMEM)  # S = Q_i K_j^T, dP = dO_i V_j^T
    mma_ab = make_mma_ab(B_C, D, dtype)  # dQ_i += dS K_j
    key_tiles = make_key_tiles(B_R, B_C, HAS_LEFT, HAS_RIGHT)
    USER_MASK = mods is not None and mods.mask_mod is not None
    BM = block_mask is not None
    launch_order_dq = make_launch_order(True, HAS_RIGHT or BM)  # (uneven work: causal, a block mask)
    QB, KB = block_mask if BM else (B_R, B_C)
    SUB = KB // B_C  # key tiles per block of a block mask
    tile_start = make_block_tiles(BM, KB, B_C)  # first key of the jt-th key tile the block visits
    block_full = make_block_full(BM, KB)  # whether a block mask lists a key's block as full

    @cuda.jit
    def backward_dq_tc(dout, q, k, v, lse, delta, dq, scale_log2, scale, softcap, left, right, alibi, cu_q, cu_k,
                       p_drop, rp_keep, seed, offset, a0, a1, a2, a3, bm_num, bm_idx, bm_state):
        nheads = q.shape[2]
        tid = cuda.threadIdx.x
        warp = tid // 32
        lane = tid % 32
        g = lane >> 2
        t = lane & 3
        tile, bh = launch_order_dq()  # the longest causal rows first, as in the forward
        b = bh // nheads
        h = bh % nheads
        hk = h  # the key/value head of query head h (compiled in only for GQA, as in mma_forward)
        if GQA:
            hk = h // (nheads // k.shape[2])
        i0 = tile * B_R
        r0 = warp * WARP_ROWS
        bb, q0, k0, seqlen_q, seqlen_k = sequence(b, q.shape[1], k.shape[1], cu_q, cu_k)
        diag = seqlen_k - seqlen_q
        slope = alibi[b, h] if ALIBI else float32(0.0)
        if i0 >= seqlen_q:  # (VARLEN) a block past the end of a shorter sequence: nothing to do
            return

        smem = cuda.shared.array(0, elem)  # Q_i | dO_i | K, V buffer 0 | K, V buffer 1 (dynamic), shared
        af = cuda.local.array((1 if A_SMEM else KD, 4), uint32)  # A fragments: this warp's rows of Q_i, of dO_i
        s = cuda.local.array((NS, 4), float32)  # S
        dp = cuda.local.array((NS, 4), float32)  # dP, then dS
        acc = cuda.local.array((NO, 4), float32)  # dQ_i
        lrow = cuda.local.array(2, float32)  # log2(e) L_i of rows g, g + 8
        drow = cuda.local.array(2, float32)  # D_i of rows g, g + 8
        for x in range(2):
            i = i0 + r0 + g + 8 * x
            L = lse[bb, h, q0 + i] if i < seqlen_q else float32(0.0)
            lrow[x] = L * LOG2E if L != NEG_INF else float32(0.0)  # no visible key: every entry is masked
            drow[x] = delta[bb, h, q0 + i] if i < seqlen_q else float32(0.0)
        for n in range(NO):
            for x in range(4):
                acc[n, x] = 0.0

        last_row, n_start, n_tiles = key_tiles(i0, seqlen_q, seqlen_k, diag, left, right)  # (as the forward)
        qb = i0 // QB
        bbm = b if bm_num.shape[0] > 1 else 0  # (a block mask made for B = 1 or H = 1 serves every entry)
        hbm = h if bm_num.shape[1] > 1 else 0
        if BM:
            n_tiles = bm_num[bbm, hbm, qb] * SUB

        load_qdo(smem, 0, q, dout, bb, q0 + i0, q0 + seqlen_q, h, tid)
        if n_tiles > 0:
            load_kv(smem, OFF_K, k, v, bb, k0 + tile_start(0, n_start, bm_idx, bbm, hbm, qb), k0 + seqlen_k, hk,
                    tid)
        ptx.cp_async_commit()

        for jt in range(n_tiles):
            j0 = tile_start(jt, n_start, bm_idx, bbm, hbm, qb)
            buf = OFF_K + (jt & 1) * BUF
            if jt + 1 < n_tiles:  # tile j + 1 into the other buffer, freed by the barrier ending iteration j - 1
                load_kv(smem, OFF_K + ((jt + 1) & 1) * BUF, k, v, bb,
                        k0 + tile_start(jt + 1, n_start, bm_idx, bbm, hbm, qb), k0 + seqlen_k, hk, tid)
            tile_landed()  # tile j (and Q_i, dO_i) landed and visible to every thread

            if A_SMEM:
                mma_abt(s, smem, r0 * LD, buf, lane)  # S = Q_i K_j^T
                mma_abt(dp, smem, OFF_DO + r0 * LD, buf + OFF_V, lane)  # dP = dO_i V_j^T
            else:
                load_a(af, smem, r0 * LD, lane)
                mma_abt(s, af, smem, buf, lane)  # S = Q_i K_j^T
                load_a(af, smem, OFF_DO + r0 * LD, lane)
                mma_abt(dp, af, smem, buf + OFF_V, lane)  # dP = dO_i V_j^T

            masked = (j0 + B_C > seqlen_k or (HAS_RIGHT and j0 + B_C - 1 > i0 + diag + right)
                      or (HAS_LEFT and j0 < last_row + diag - left))
            partial = USER_MASK and not block_full(bm_state, bbm, hbm, qb, j0)
            for n in range(NS):
                for x in range(4):
                    i = i0 + r0 + g + 8 * (x >> 1)
                    j = j0 + 8 * n + 2 * t + (x & 1)
                    _, ds = entry(s[n, x], dp[n, x], i, j, lrow[x >> 1], drow[x >> 1], masked, partial, seqlen_q,
                                  seqlen_k, diag, scale_log2, scale, softcap, left, right, slope, p_drop, rp_keep,
                                  seed, offset, b, h, b * nheads + h, a0, a1, a2, a3)
                    dp[n, x] = ds

            mma_ab(acc, dp, smem, buf, lane)  # dQ_i += dS K_j
            cuda.syncthreads()  # every warp is done with this buffer before iteration j + 1 copies tile j + 2 in
        ptx.cp_async_wait_all()  # no copy outlives the block (with no tile to visit, the prologue's are in flight)

        for x in range(2):
            i = i0 + r0 + g + 8 * x
            if i < seqlen_q:
                for n in range(NOG):
                    dq[bb, q0 + i, h, 8 * n + 2 * t] = store(acc[n, 2 * x] * scale)
                    dq[bb, q0 + i, h, 8 * n + 2 * t + 1] = store(acc[n, 2 * x + 1] * scale)

    return backward_dq_tc


@functools.lru_cache(maxsize=None)
def make_backward_dkdv_tc(D, variant, block_m, block_n, dtype="float16", gqa=False, strided=False, mods=None,
                          atomic_dq=False, block_mask=None):
    """The dK/dV kernel: grid (ceil(max_seqlen_k / block_n), batch * nheads_k), block (:func:`dkdv_threads`:
    block_n / 16 warps, twice as many above d = 160), dynamic shared memory :func:`shared_bytes_dkdv`. With GQA a
    block sums over the nheads / nheads_k query heads of its key/value head, in order.

    Arguments: (dout, q, k, v, lse, delta, dk, dv, dq_acc, scale_log2, scale, ...), as the dQ kernel's with dk, dv
    like k. ``atomic_dq``: the kernel also adds dQ_i += dS_ij K_j (unscaled) into dq_acc, float32 like q and zero
    at the start, with atomic adds (FlashAttention-2's backward: five products where the two deterministic kernels
    take seven; the order of the adds, and so the last bits of dQ, vary from run to run); ``atomic_dq="v2"``
    (sm_90 and newer): each lane adds its two neighbouring columns with one vector reduction
    (:func:`flashnumba.kernels.ptx.red_add_f32x2`), half the instructions and whole 32-byte sectors. dS^T goes to shared
    memory, and the block's warps split dQ_i by 16-row slabs and columns (:func:`dq_parts`), each reading dS
    through the transposing ldmatrix (:func:`flashnumba.kernels.mma_tiles.make_mma_atb`) over all the block's
    keys. Without it dq_acc is not touched (a dummy). ``block_mask``: (QB, KB) as the dQ kernel's, given as the
    query-block lists of each key block, bm_qnum and bm_qidx, and bm_state (the last arguments, after a0 .. a3;
    dummies without one): the block visits, for each query head of its key/value head in order, the query blocks
    listed for its key block, and evaluates the mask_mod only in the partial ones.
    """
    _check(D, block_m, block_n, dtype)
    HAS_LEFT, HAS_RIGHT, SOFTCAP, ALIBI, VARLEN, DROPOUT = variant
    GQA = bool(gqa)  # fewer key/value heads than query heads (compiled in: see mma_forward.make_forward_tc)
    sequence = make_sequence_geometry(VARLEN)
    entry = make_entry(variant, mods)
    is_bf16 = dtype == "bfloat16"
    store = _store_bf16 if is_bf16 else bf16.load_store(False)[1]
    elem = uint16 if is_bf16 else float16
    B_R, B_C = block_m, block_n
    CS = column_parts(D)  # warps a block of 16 keys (each holds dK_j, dV_j of DH of the head dim's columns)
    NT = dkdv_threads(D, B_C)
    DG, D = D, dkdv_dim(D)
    LD = D + PAD
    DH = D // CS
    KD, NS, NO = D // 16, B_R // 8, DH // 8
    OFF_V = B_C * LD  # V_j after K_j
    OFF_Q = 2 * B_C * LD  # Q buffer 0; buffer 1 lies BUF further on; dO_i lies OFF_DO after its Q_i
    OFF_DO = B_R * LD
    BUF = 2 * B_R * LD
    load_kv = make_load_pair(D, NT, B_C, OFF_V, strided, DG)  # K_j and V_j
    load_qdo = make_load_pair(D, NT, B_R, OFF_DO, strided, DG)  # Q_i and dO_i of one buffer
    load_a = make_load_a(D)
    mma_abt = make_mma_abt(D, B_R, dtype, CS > 1)  # S^T = K_j Q_i^T, dP^T = V_j dO_i^T
    mma_ab = make_mma_ab(B_R, DH, dtype, LD)  # dV_j += P^T dO_i, dK_j += dS^T Q_i (this warp's DH columns)
    ATOMIC = bool(atomic_dq)
    VEC_RED = atomic_dq == "v2"  # (sm_90) one red.global.add.v2.f32 for a lane's two neighbouring columns
    LDS = B_R + PAD  # dS^T in shared memory: B_C key rows of B_R queries, after the Q, dO buffers
    OFF_DS = OFF_Q + 2 * BUF
    RS, CQ, SPW = dq_parts(DG, B_R, B_C)  # dQ_i's 16-row slabs, column parts, slabs a warp
    DQW = D // CQ  # dQ_i columns of one warp, taken DQC at a time (the dK_j, dV_j accumulators stay in registers)
    DQC = min(DQW, DQ_CHUNK)
    NQ, NCH = DQC // 8, DQW // DQC  # C fragments a chunk, chunks a slab
    mma_atb = make_mma_atb(B_C, DQC, dtype, LDS, LD)  # dQ_i += dS K_j

    SR = -(-B_R // NT)  # query rows of L_i and D_i a thread fetches (B_R may exceed the block's NT threads)
    USER_MASK = mods is not None and mods.mask_mod is not None
    BM = block_mask is not None
    # one head after another: the grouped order's tile and head, kept in registers, spilled 8-12 bytes at
    # head_dim 128, causal or with a window (255 registers)
    launch_order_dkdv = make_launch_order(False, False)
    QB, KB = block_mask if BM else (B_R, B_C)
    SUBQ = QB // B_R  # query tiles per block of a block mask
    query_start = make_block_tiles(BM, QB, B_R)  # first row of the n-th query tile of a head's list
    block_full = make_block_full(BM, KB)  # whether a block mask lists a query block's key block as full

    @cuda.jit(device=True, inline=True)
    def next_listed(hc, rank, hk, group, bm_qnum, bbm, kb):
        """(BM) The query tile after the rank-th of query head hk * group + hc in the key block's lists: the next
        of that head's, else the first of the next head that has any; hc = group past the last. (-1, -1): the
        first."""
        rank += 1
        while hc < group and (hc < 0 or rank >= bm_qnum[bbm, hk * group + hc if bm_qnum.shape[1] > 1 else 0,
                                                        kb] * SUBQ):
            hc += 1
            rank = 0
        return hc, rank

    # L_i and D_i of a query tile: fetched into registers with its copies, put after its products
    fetch_stats, put_stats = make_stats(B_R, NT)

    @cuda.jit
    def backward_dkdv_tc(dout, q, k, v, lse, delta, dk, dv, dq_acc, scale_log2, scale, softcap, left, right, alibi,
                         cu_q, cu_k, p_drop, rp_keep, seed, offset, a0, a1, a2, a3, bm_qnum, bm_qidx, bm_state):
        nheads = q.shape[2]
        nheads_k = k.shape[2]
        group = nheads // nheads_k  # query heads per key/value head
        tid = cuda.threadIdx.x
        warp = tid // 32
        lane = tid % 32
        g = lane >> 2
        t = lane & 3
        tile, bh = launch_order_dkdv()  # (the first key tiles see the most causal queries: they start first)
        b = bh // nheads_k
        hk = bh % nheads_k
        j0 = tile * B_C  # first key of K_j
        r0 = (warp // CS) * WARP_ROWS  # this warp's keys inside K_j
        c0 = (warp % CS) * DH  # and its first column of dK_j, dV_j
        bb, q0, k0, seqlen_q, seqlen_k = sequence(b, q.shape[1], k.shape[1], cu_q, cu_k)
        diag = seqlen_k - seqlen_q
        if j0 >= seqlen_k:  # (VARLEN) a block past the end of a shorter sequence: nothing to do
            return

        smem = cuda.shared.array(0, elem)  # K_j | V_j | Q, dO buffer 0 | Q, dO buffer 1 (dynamic), shared
        lsm = cuda.shared.array((2, B_R), float32)  # log2(e) L_i of the query tile, two buffers, shared
        dsm = cuda.shared.array((2, B_R), float32)  # D_i of the query tile, two buffers, shared
        af = cuda.local.array((1 if CS > 1 else KD, 4), uint32)  # A fragments: this warp's rows of K_j, of V_j
        s = cuda.local.array((NS, 4), float32)  # S^T, then (P keep)^T (this warp's 16 keys x B_R queries)
        dp = cuda.local.array((NS, 4), float32)  # dP^T, then dS^T
        dv_acc = cuda.local.array((NO, 4), float32)  # dV_j
        dk_acc = cuda.local.array((NO, 4), float32)  # dK_j
        dqa = cuda.local.array((NQ, 4), float32)  # (ATOMIC) this warp's part of dS_ij K_j
        st = cuda.local.array((2, SR), float32)  # L_i, D_i of the next query tile, on their way to shared memory
        for n in range(NO):
            for x in range(4):
                dv_acc[n, x] = 0.0
                dk_acc[n, x] = 0.0

        # Query tiles that meet the band of these keys: rows j0 - diag - right .. j_last - diag + left
        m_begin = 0
        m_rows = seqlen_q
        if HAS_RIGHT:
            m_begin = max(0, j0 - diag - right) // B_R
        if HAS_LEFT:
            m_rows = max(0, min(seqlen_q, min(j0 + B_C, seqlen_k) - diag + left))
        nt = max(0, (m_rows + B_R - 1) // B_R - m_begin)  # query tiles per query head
        total = group * nt  # iteration it: query head hk * group + it // nt, tile m_begin + it % nt
        # (BM) the query tiles the key block's lists give each query head of the group, in turn: (hc, rank) is
        # iteration it's (the head's place in the group, the tile's in that head's list)
        kb = j0 // KB
        bbm = b if bm_qnum.shape[0] > 1 else 0  # (a block mask made for B = 1 or H = 1 serves every entry)
        hc, rank = -1, -1
        if BM:
            total = 0
            for x in range(group):
                total += bm_qnum[bbm, hk * group + x if bm_qnum.shape[1] > 1 else 0, kb] * SUBQ
            hc, rank = next_listed(hc, rank, hk, group, bm_qnum, bbm, kb)

        load_kv(smem, 0, k, v, bb, k0 + j0, k0 + seqlen_k, hk, tid)
        if total > 0:
            h = hk * group
            row = q0 + m_begin * B_R
            if BM:
                h += hc
                row = q0 + query_start(rank, 0, bm_qidx, bbm, h if bm_qnum.shape[1] > 1 else 0, kb)
            load_qdo(smem, OFF_Q, q, dout, bb, row, q0 + seqlen_q, h, tid)
            fetch_stats(st, lse, delta, bb, h, row, q0 + seqlen_q, tid)
            put_stats(lsm, dsm, 0, st, tid)
        ptx.cp_async_commit()

        for it in range(total):
            h = hk  # without GQA the loop is over the query tiles of head hk alone: no division
            i0 = (m_begin + it) * B_R
            if BM:
                h = hk * group + hc
                i0 = query_start(rank, 0, bm_qidx, bbm, h if bm_qnum.shape[1] > 1 else 0, kb)
            elif GQA:
                h = hk * group + int(uint32(it) // uint32(nt))  # (signed again: i0, h enter signed sums)
                i0 = (m_begin + int(uint32(it) % uint32(nt))) * B_R
            sel = it & 1
            buf = OFF_Q + sel * BUF
            if it + 1 < total:  # the next query tile into the other buffers, freed by the barrier ending it - 1
                h2 = hk
                row2 = q0 + i0 + B_R
                if BM:
                    hc, rank = next_listed(hc, rank, hk, group, bm_qnum, bbm, kb)
                    h2 = hk * group + hc
                    row2 = q0 + query_start(rank, 0, bm_qidx, bbm, h2 if bm_qnum.shape[1] > 1 else 0, kb)
                elif GQA:
                    h2 = hk * group + int(uint32(it + 1) // uint32(nt))
                    row2 = q0 + (m_begin + int(uint32(it + 1) % uint32(nt))) * B_R
                load_qdo(smem, OFF_Q + (1 - sel) * BUF, q, dout, bb, row2, q0 + seqlen_q, h2, tid)
                fetch_stats(st, lse, delta, bb, h2, row2, q0 + seqlen_q, tid)
            tile_landed()  # this tile (and K_j, V_j) landed; its copies, zero stores, L_i and D_i visible to all

            if CS > 1:  # (both warps of a key block form the whole S^T and dP^T)
                mma_abt(s, smem, r0 * LD, buf, lane)  # S^T = K_j Q_i^T
                mma_abt(dp, smem, OFF_V + r0 * LD, buf + OFF_DO, lane)  # dP^T = V_j dO_i^T
            else:
                load_a(af, smem, r0 * LD, lane)
                mma_abt(s, af, smem, buf, lane)  # S^T = K_j Q_i^T
                load_a(af, smem, OFF_V + r0 * LD, lane)
                mma_abt(dp, af, smem, buf + OFF_DO, lane)  # dP^T = V_j dO_i^T
            if it + 1 < total:  # the next tile's L_i and D_i into the buffers the last iteration read
                put_stats(lsm, dsm, 1 - sel, st, tid)

            slope = alibi[b, h] if ALIBI else float32(0.0)
            last_row = min(i0 + B_R, seqlen_q) - 1
            masked = (i0 + B_R > seqlen_q or j0 + B_C > seqlen_k or (HAS_RIGHT and j0 + B_C - 1 > i0 + diag + right)
                      or (HAS_LEFT and j0 < last_row + diag - left))
            partial = USER_MASK and not block_full(bm_state, bbm, h if bm_qnum.shape[1] > 1 else 0, i0 // QB, j0)
            for n in range(NS):
                for x in range(4):
                    c = 8 * n + 2 * t + (x & 1)  # query column inside Q_i
                    pz, ds = entry(s[n, x], dp[n, x], i0 + c, j0 + r0 + g + 8 * (x >> 1), lsm[sel, c], dsm[sel, c],
                                   masked, partial, seqlen_q, seqlen_k, diag, scale_log2, scale, softcap, left, right,
                                   slope, p_drop, rp_keep, seed, offset, b, h, b * nheads + h, a0, a1, a2, a3)
                    s[n, x] = pz
                    dp[n, x] = ds
            if ATOMIC and c0 == 0:  # dS^T of this warp's keys to shared memory (one warp of a column pair)
                for n in range(NS):
                    for x in range(4):
                        smem[OFF_DS + (r0 + g + 8 * (x >> 1)) * LDS + 8 * n + 2 * t + (x & 1)] = store(dp[n, x])

            mma_ab(dv_acc, s, smem, buf + OFF_DO + c0, lane)  # dV_j += (P keep)^T dO_i
            mma_ab(dk_acc, dp, smem, buf + c0, lane)  # dK_j += dS^T Q_i
            if ATOMIC:
                cuda.syncthreads()  # dS^T of every key of the block written
                if warp < RS * CQ:
                    for part in range(SPW * NCH):
                        m0 = (warp % RS + (part // NCH) * (NT // 32)) * WARP_ROWS  # the slab's first row
                        cq0 = (warp // RS) * DQW + (part % NCH) * DQC  # and first column of dQ_i
                        for n in range(NQ):
                            for x in range(4):
                                dqa[n, x] = 0.0
                        mma_atb(dqa, smem, OFF_DS + m0, cq0, lane)  # dQ_i[m0 .. m0 + 15] += dS K_j
                        for x in range(2):
                            i = i0 + m0 + g + 8 * x
                            if i < seqlen_q:
                                row = ((bb * dq_acc.shape[1] + q0 + i) * nheads + h) * DG  # (VEC_RED) flat index
                                for n in range(NQ):
                                    c = cq0 + 8 * n + 2 * t
                                    if D == DG or c < DG:
                                        if VEC_RED:
                                            ptx.red_add_f32x2(dq_acc, row + c, dqa[n, 2 * x], dqa[n, 2 * x + 1])
                                        else:
                                            cuda.atomic.add(dq_acc, (bb, q0 + i, h, c), dqa[n, 2 * x])
                                            cuda.atomic.add(dq_acc, (bb, q0 + i, h, c + 1), dqa[n, 2 * x + 1])
            cuda.syncthreads()  # every warp is done with these buffers before the next iteration refills them
        ptx.cp_async_wait_all()  # no copy outlives the block (with no tile to visit, the prologue's are in flight)

        zscale = rp_keep if DROPOUT else float32(1.0)  # dV_j = (P Z)^T dO with Z = keep / (1 - p_drop)
        for x in range(2):
            j = j0 + r0 + g + 8 * x
            if j < seqlen_k:
                for n in range(NO):
                    c = c0 + 8 * n + 2 * t
                    if D == DG or c < DG:  # (the columns past the head dim are padding)
                        dk[bb, k0 + j, hk, c] = store(dk_acc[n, 2 * x] * scale)
                        dk[bb, k0 + j, hk, c + 1] = store(dk_acc[n, 2 * x + 1] * scale)
                        dv[bb, k0 + j, hk, c] = store(dv_acc[n, 2 * x] * zscale)
                        dv[bb, k0 + j, hk, c + 1] = store(dv_acc[n, 2 * x + 1] * zscale)

    return backward_dkdv_tc


@functools.lru_cache(maxsize=None)
def make_dq_convert(D, dtype="float16", rows=4, threads=256):
    """dq = scale * dq_acc in the inputs' dtype, after the atomic dK/dV kernel: grid (ceil(seqlen / rows), lead),
    block (threads,); the threads of a block step through the nheads * D contiguous floats of each of its rows.
    Arguments: (dq_acc, dq, scale), dq_acc float32 and dq 16-bit, both C-contiguous (lead, seqlen, nheads, D)."""
    store = _store_bf16 if dtype == "bfloat16" else bf16.load_store(False)[1]

    @cuda.jit
    def dq_convert(dq_acc, dq, scale):
        b = cuda.blockIdx.y
        width = dq.shape[2] * D
        for r in range(rows):
            i = cuda.blockIdx.x * rows + r
            if i < dq.shape[1]:
                for e in range(cuda.threadIdx.x, width, threads):
                    h = e // D
                    c = e - h * D
                    dq[b, i, h, c] = store(dq_acc[b, i, h, c] * scale)

    return dq_convert
