"""Forward kernel on tensor cores: FlashAttention-2, Algorithm 1, with S = Q K^T and O += P V as ``mma.sync``.

The SIMT kernels of :mod:`flashnumba.kernels.simt_forward` compute every product with float32 FMAs. This one hands
the two matrix products of each key tile to the tensor cores, through the intrinsics of
:mod:`flashnumba.kernels.ptx` (``mma_m16n8k16_*``, ``ldmatrix_x4``, ``ldmatrix_x4_trans``, ``pack_*x2``,
``cp_async_16``, ``shfl_xor_f32``): float16 or bfloat16 inputs, float32 accumulation. The online softmax recurrence,
the masking and lse are v1's, done on the accumulator fragments in registers. head_dim a multiple of 8 up to 256 (a
multiple of 16 in shared memory: :func:`flashnumba.kernels.mma_tiles.padded`), with every option of the SIMT
kernels (GQA, window, softcap, ALiBi, varlen, dropout), compiled in only where asked for (GQA too, unlike the SIMT
kernels).

Launch geometry: grid (ceil(seqlen_q / B_r), batch * nheads), block 32 * W threads = W warps, B_r = 16 WM W
(WM = 1 or 2 blocks of 16 rows a warp); each block takes a query tile and a head in launch order with the
longest causal rows first (``common.make_launch_order``). Warp w owns query rows 16 WM w .. 16 WM (w + 1) - 1
of the tile Q_i, as WM blocks of 16; lane l of it, with g = l >> 2 and t = l & 3 (the PTX ISA's groupID and
threadID_in_group), owns rows g and g + 8 of each block, and of every (16 x 8) accumulator tile the columns 2t
and 2t + 1 (the C layout drawn in ``ptx.MMA_DOC``).

Per key tile K_j, V_j (B_c rows), FlashAttention-2 Algorithm 1, lines 8-11, in base 2::

    S_ij  = scale * log2(e) * Q_i K_j^T           masked entries (j >= seqlen_k, causal) are -inf
    m_new = max(m_i, rowmax(S_ij))                (of the raw Q_i K_j^T, times the scale, where scale > 0)
    P_ij  = exp2(S_ij - m_new)
    l_i   = exp2(m_i - m_new) * l_i + rowsum(P_ij)
    O_i   = exp2(m_i - m_new) * O_i + P_ij V_j      (P_ij rounded to the input's 16-bit type)
    m_i   = m_new

then (lines 12-13) O_i / l_i and L_i = ln(2) m_i + log(l_i). As in FlashAttention-2, P_ij is rounded to 16 bits
for the second product; l_i sums the unrounded float32 P_ij.

The fragment mapping, the reason no data moves between lanes between the two products. The S accumulator of
key columns 8n .. 8n + 7 is, in lane (g, t), s[n] = (S[g, 8n+2t], S[g, 8n+2t+1], S[g+8, 8n+2t], S[g+8, 8n+2t+1]).
The A operand of the P V mma over keys 16c .. 16c + 15 wants, in the same lane,
a0 = P[g, 16c+2t : +2], a1 = P[g+8, 16c+2t : +2], a2 = P[g, 16c+8+2t : +2], a3 = P[g+8, 16c+8+2t : +2], so::

    a0 = pack(s[2c][0], s[2c][1])      a2 = pack(s[2c+1][0], s[2c+1][1])
    a1 = pack(s[2c][2], s[2c][3])      a3 = pack(s[2c+1][2], s[2c+1][3])

Row statistics. A row's B_c scores are spread over the 4 lanes of a quad (same g): two butterfly shuffles
(``shfl_xor_f32`` with lane masks 1 and 2) give each of the four the row's max. The row sum needs no exchange per
tile: alpha = exp2(m_i - m_new) is the same in the 4 lanes, so each lane keeps l_i over its own columns and the
four partial sums are added once, at the end.

Memory pipeline. Q_i, K_j and V_j go from global to shared memory with ``cp.async`` (16 bytes = 8 elements per
copy, no registers in between), K_j and V_j into two buffers in turn: while the warps compute on tile j, the
copies of tile j + 1 are in flight (FlashAttention-2's double buffering). Rows past the end of the sequence are
filled with zeros by plain stores instead (a V row of garbage could hold a NaN, and 0 * NaN is NaN).

Shared memory, dynamic: Q_i (B_r, D) | K_j (B_c, D) | V_j | K_j+1 | V_j+1, rows padded to D + 8 elements. A row of
D = 64 or 128 16-bit elements is 128 or 256 bytes: with that stride the eight 16-byte rows an ``ldmatrix`` reads
would all start in the same four of the 32 banks (an 8-way conflict); with D + 8 each row starts 16 bytes (four
banks) further on, and the eight rows cover the 32 banks once.
"""

from __future__ import annotations

import functools
import math

from . import bf16, ptx
from .._backend import cuda
from .block_mask import make_block_full, make_block_tiles
from .common import (LN2, LOG2E, NEG_INF, dropout_uniform, make_column_bounds, make_key_tiles, make_launch_order,
                     make_mask_bits, make_online_softmax, make_score_mod, make_sequence_geometry,
                     make_user_score_within)
from .mma_tiles import (HEAD_DIMS, PAD, WARP_ROWS, make_load_a_rows, make_load_pair, make_load_rows,
                        make_mma_ab_rows, make_mma_abt_rows, padded, tile_landed)
from .scalars import float16, float32, int32, uint16, uint32, uint64


def shared_bytes(D, B_c, B_r):
    """Q_i (B_r rows) and two K_j, V_j buffers (B_c rows each), 16-bit elements, rows of padded(D) + PAD."""
    return (B_r + 4 * B_c) * (padded(D) + PAD) * 2


ROWS_PER_WARP = (16, 32)  # query rows a warp owns: one or two blocks of 16 (WM = 1, 2)


def mask_bits_fit(B_c, wm):
    """Whether a lane's scores of a tile (2 wm of its rows x B_c / 4 of its keys) fit the one 64-bit word of mask
    bits a mask_mod leaves (:func:`flashnumba.kernels.common.make_mask_bits`)."""
    return wm * B_c // 2 <= 64


@functools.lru_cache(maxsize=None)
def make_forward_tc(D, variant, B_c, warps, dtype="float16", gqa=False, strided=False, positive_scale=True, wm=1,
                    mods=None, block_mask=None):
    """The tensor-core forward kernel for head_dim D (a multiple of 8 up to 256; in shared memory and the products
    a multiple of 16, :func:`flashnumba.kernels.mma_tiles.padded`), B_c keys per tile (a multiple of 16),
    ``warps`` warps of ``wm`` blocks of 16 query rows each (B_r = 16 wm warps), ``dtype`` "float16" or
    "bfloat16", and the options compiled in by ``variant`` (a :class:`flashnumba.kernels.common.Variant`: window
    bounds, softcap, ALiBi, varlen, dropout). ``gqa``: fewer key/value heads than query heads. It is compiled in,
    so that a kernel without GQA carries no integer division mapping a query head to its key/value head: that
    division, although computed once per thread, slowed the causal kernel measurably (docs/benchmarks.md, "A
    division that cost 30%").

    ``wm`` = 2 (FlashAttention-2's arrangement: 4 warps on 128 rows) lets each fragment of K_j and V_j that a warp
    loads from shared memory feed two ``mma`` instead of one, halving the shared-memory reads per product, at the
    price of twice the accumulator registers a warp holds (S and O of 32 rows). Q_i's A fragments stay in
    registers for the whole key loop where they fit (wm = 1, or D <= 64); otherwise they are read again from
    shared memory at each k-step.

    Arguments, as the SIMT kernels' (:func:`flashnumba.kernels.simt_forward.make_forward_v3`): (q, k, v, out, lse,
    scale_q, softcap, left, right, alibi, cu_q, cu_k, p_drop, rp_keep, seed, offset); q, k, v, out (batch, seqlen,
    nheads(_k), D) C-contiguous (or strided q, k, v: ``strided``), float16 or uint16 holding bfloat16 bits ((1,
    total, nheads, D) for varlen); lse (batch, nheads, seqlen_q) float32; scale_q = softmax_scale * log2(e), or
    softmax_scale with softcap or ALiBi (the score is then modified in natural units first). Query i sees key j iff
    i + diag - left <= j <= i + diag + right, diag = seqlen_k - seqlen_q (each bound only where compiled in).
    Launch: grid (ceil(max_seqlen_q / B_r), batch * nheads), block (32 * warps,), dynamic shared memory
    :func:`shared_bytes`. ``strided``: q, k, v may be strided views, read in place
    (:func:`flashnumba.kernels.mma_tiles.make_copy16`). ``positive_scale``: scale_q > 0, so that the row maximum
    of the raw scores Q_i K_j^T gives that of the scaled ones, and the scale folds into the exponent's FMA,
    exp2(s scale_q - m), as FlashAttention-2 does: one instruction a score fewer (the planner passes
    softmax_scale > 0; a zero or negative scale, or a score modification, multiplies first). ``mods``: a user's
    score_mod and mask_mod (:class:`flashnumba.kernels.common.Mods`), called for the entries within the
    sequences; the arrays they read are a0 .. a3 (dummies where unused). The mask_mod is evaluated for a tile
    before S_ij exists, into one bit a score (:func:`flashnumba.kernels.common.make_mask_bits`): its code then has
    the registers S_ij will take, which lets it run in warps of 32 rows; a lane's scores fit one 64-bit word, so
    wm * B_c is at most 128 with a mask_mod. ``block_mask``: (QB, KB), the block
    sizes of a :class:`flashnumba.blockmask.BlockMask` given as bm_num, bm_idx, bm_state (the last arguments,
    dummies without one; QB a multiple of B_r, KB of B_c): the key loop visits only the key blocks bm_idx lists
    for the query block, and evaluates the mask_mod only in those whose state is partial.
    """
    if D not in HEAD_DIMS:
        raise ValueError(f"the tensor-core kernel supports head_dim a multiple of 8 up to 256, got {D}")
    if B_c % 16 or B_c <= 0:
        raise ValueError(f"B_c must be a positive multiple of 16, got {B_c}")
    if warps not in (1, 2, 4, 8):
        raise ValueError(f"warps must be 1, 2, 4 or 8, got {warps}")
    if wm not in (1, 2):
        raise ValueError(f"wm (blocks of 16 rows per warp) must be 1 or 2, got {wm}")
    if dtype not in ("float16", "bfloat16"):
        raise ValueError(f"dtype must be 'float16' or 'bfloat16', got {dtype!r}")
    if mods is not None and mods.mask_mod is not None and not mask_bits_fit(B_c, wm):
        raise ValueError(f"with a mask_mod, wm * B_c must be at most 128, got {wm} * {B_c}")
    HAS_LEFT, HAS_RIGHT, SOFTCAP, ALIBI, VARLEN, DROPOUT = variant
    USER_SCORE = mods is not None and mods.score_mod is not None
    USER_MASK = mods is not None and mods.mask_mod is not None
    score_within = make_user_score_within(mods)
    hide, hidden = make_mask_bits(mods)
    SCORE_MOD = SOFTCAP or ALIBI or USER_SCORE  # the score formed in natural units, modified, then base 2
    BM = block_mask is not None
    QB, KB = block_mask if BM else (16 * wm * warps, B_c)  # (the tiles themselves without a block mask)
    FOLD = positive_scale and not SCORE_MOD  # the scale folded into exp2's argument (docstring)
    score_mod = make_score_mod(SOFTCAP, ALIBI, float32_distance=True)
    GQA = bool(gqa)
    sequence = make_sequence_geometry(VARLEN)
    is_bf16 = dtype == "bfloat16"
    store = bf16.load_store(is_bf16)[1]  # float32 -> the output element (bf16 bits, or float32 the store rounds)
    elem = uint16 if is_bf16 else float16  # shared memory holds the 16-bit patterns as they come
    WM = wm
    B_R = WARP_ROWS * WM * warps
    NT = 32 * warps  # threads per block
    DG, D = D, padded(D)  # the arrays' head dim; the shared rows' and the products' (zeros past DG)
    LD = D + PAD  # shared-memory row stride, elements
    KD = D // 16  # k-steps of S = Q K^T (16 head dims each)
    Q_REGS = WM == 1 or D <= 64  # Q_i's fragments kept in registers (else read per k-step)
    QK = KD if Q_REGS else 1
    NR = 2 * WM  # rows a lane holds statistics for: g and g + 8 of each block
    NS = B_c // 8  # (16 x 8) tiles of S per block of 16 rows
    NO = D // 8  # (16 x 8) tiles of O per block of 16 rows
    NOG = DG // 8  # those stored (within the head dim)
    OFF_K = B_R * LD  # K buffer 0; buffer 1 lies BUF further on; V_j lies OFF_V after its K_j
    OFF_V = B_c * LD
    BUF = 2 * B_c * LD

    load_rows = make_load_rows(D, NT, strided=strided, DG=DG)
    load_kv = make_load_pair(D, NT, B_c, OFF_V, strided, DG)  # K_j and V_j of one buffer
    load_a = make_load_a_rows(D, WM)
    mma_abt = make_mma_abt_rows(D, B_c, dtype, WM, not Q_REGS)  # S_ij = Q_i K_j^T
    mma_ab = make_mma_ab_rows(B_c, D, dtype, WM)  # O_i += P_ij V_j
    key_tiles = make_key_tiles(B_R, B_c, HAS_LEFT, HAS_RIGHT)
    column_bounds = make_column_bounds(B_c, HAS_LEFT, HAS_RIGHT)
    launch_order = make_launch_order(True, HAS_RIGHT or BM)  # (uneven work: causal, a block mask)
    quad_max, new_max, prob = make_online_softmax(FOLD)
    SUB = KB // B_c  # key tiles per block of a block mask
    tile_start = make_block_tiles(BM, KB, B_c)  # first key of the jt-th key tile the block visits
    block_full = make_block_full(BM, KB)  # whether a block mask lists a key's block as full

    @cuda.jit
    def forward_tc(q, k, v, out, lse, scale_q, softcap, left, right, alibi, cu_q, cu_k, p_drop, rp_keep, seed,
                   offset, a0, a1, a2, a3, bm_num, bm_idx, bm_state):
        nheads = q.shape[2]
        tid = cuda.threadIdx.x
        warp = tid // 32
        lane = tid % 32
        g = lane >> 2  # groupID: rows g and g + 8 of each block of 16
        t = lane & 3  # threadID_in_group: columns 2t, 2t + 1 of each 8-wide tile
        # the query tile and head: with causal masking the blocks with the most key tiles start first and the
        # short ones fill the tail of the launch (common.make_launch_order)
        tile, bh = launch_order()
        b = bh // nheads
        h = bh % nheads
        hk = h  # the key/value head of query head h (GQA / MQA: see the docstring for why this is compiled in)
        if GQA:
            hk = h // (nheads // k.shape[2])
        i0 = tile * B_R  # first query row of Q_i
        r0 = warp * (WARP_ROWS * WM)  # first row of this warp inside Q_i; its block w starts at r0 + 16 w
        bb, q0, k0, seqlen_q, seqlen_k = sequence(b, q.shape[1], k.shape[1], cu_q, cu_k)
        diag = seqlen_k - seqlen_q  # row i sees keys i + diag - left <= j <= i + diag + right
        slope = alibi[b, h] if ALIBI else float32(0.0)
        if i0 >= seqlen_q:  # (VARLEN) a block past the end of a shorter sequence: nothing to do
            return

        smem = cuda.shared.array(0, elem)  # Q_i | K, V buffer 0 | K, V buffer 1 (dynamic), shared
        qa = cuda.local.array((WM, QK, 4), uint32)  # A fragments of the warp's rows of Q_i (per k-step if Q_REGS)
        pa = cuda.local.array((WM, 4), uint32)  # P_ij's A fragments of one k-step of the second product
        s = cuda.local.array((WM, NS, 4), float32)  # S_ij, then P_ij: C fragments of the warp's (16 WM, B_c)
        o = cuda.local.array((WM, NO, 4), float32)  # O_i: C fragments of the warp's (16 WM, D)
        # per row r = 2 w + x (rows g + 8 x of block w): m_i (base 2, the same in the 4 lanes of a quad), this
        # lane's partial l_i (its columns only), alpha, and the maximum the exponent subtracts
        m = cuda.local.array(NR, float32)
        l = cuda.local.array(NR, float32)
        alpha = cuda.local.array(NR, float32)
        m_use = cuda.local.array(NR, float32)
        for r in range(NR):
            m[r] = NEG_INF
            l[r] = 0.0
        for w in range(WM):
            for n in range(NO):
                for x in range(4):
                    o[w, n, x] = 0.0

        # Key tiles to visit: those that meet the band the block's rows see (causal / window), or the non-empty
        # blocks of a block mask
        last_row, n_start, n_tiles = key_tiles(i0, seqlen_q, seqlen_k, diag, left, right)
        qb = i0 // QB
        bbm = b if bm_num.shape[0] > 1 else 0  # (a block mask made for B = 1 or H = 1 serves every entry)
        hbm = h if bm_num.shape[1] > 1 else 0
        if BM:
            n_tiles = bm_num[bbm, hbm, qb] * SUB

        # Prologue: Q_i and the first key tile in flight, one commit group. j0, j1: the first keys of this tile
        # and the next (a block mask's lists are read a tile ahead of their use, so that no copy waits on them);
        # full0, full1: whether their blocks are a block mask's full ones
        j0 = tile_start(0, n_start, bm_idx, bbm, hbm, qb)
        j1 = tile_start(1, n_start, bm_idx, bbm, hbm, qb) if n_tiles > 1 else 0
        full0 = USER_MASK and n_tiles > 0 and block_full(bm_state, bbm, hbm, qb, j0)
        full1 = False
        load_rows(smem, 0, q, bb, q0 + i0, q0 + seqlen_q, h, B_R, tid)
        if n_tiles > 0:
            load_kv(smem, OFF_K, k, v, bb, k0 + j0, k0 + seqlen_k, hk, tid)
        ptx.cp_async_commit()

        for jt in range(n_tiles):
            if not BM:  # (the tiles one after the other: nothing to read ahead)
                j0 = tile_start(jt, n_start, bm_idx, bbm, hbm, qb)
                j1 = tile_start(jt + 1, n_start, bm_idx, bbm, hbm, qb)
            buf = OFF_K + (jt & 1) * BUF
            # Tile j + 1 into the other buffer (freed by the barrier that ended iteration j - 1), its own group
            if jt + 1 < n_tiles:
                load_kv(smem, OFF_K + ((jt + 1) & 1) * BUF, k, v, bb, k0 + j1, k0 + seqlen_k, hk, tid)
                full1 = USER_MASK and block_full(bm_state, bbm, hbm, qb, j1)
            j2 = tile_start(jt + 2, n_start, bm_idx, bbm, hbm, qb) if BM and jt + 2 < n_tiles else 0
            tile_landed()  # tile j (and Q_i) landed and visible to every thread

            # the user's mask_mod, in every tile but a block mask's full ones, evaluated before S_ij exists: its
            # code then has the registers S_ij will hold, and leaves one bit a score (set: hidden)
            partial = USER_MASK and not full0
            bits = uint64(0)
            if partial:
                for w in range(WM):
                    for n in range(NS):
                        for x in range(4):
                            bits = hide(bits, (w * NS + n) * 4 + x, b, h, i0 + r0 + 16 * w + g + 8 * (x >> 1),
                                        j0 + 8 * n + 2 * t + (x & 1), seqlen_q, seqlen_k, a0, a1, a2, a3)

            if Q_REGS and jt == 0:
                load_a(qa, smem, r0 * LD, lane)  # Q_i's A fragments (this warp's rows), kept in registers
            mma_abt(s, qa, smem, r0 * LD, buf, lane)  # S_ij = Q_i K_j^T

            # scores in base 2 (softcap and ALiBi in natural units first); the mask only where the tile reaches
            # past the sequence or out of some row's band
            masked = (j0 + B_c > seqlen_k or (HAS_RIGHT and j0 + B_c - 1 > i0 + diag + right)
                      or (HAS_LEFT and j0 < last_row + diag - left))
            # (each step its own loop nest over the fragments: small bodies, which the compiler unrolls fully,
            # so that s and o stay in registers)
            if not FOLD:
                for w in range(WM):
                    for n in range(NS):
                        for x in range(4):
                            val = s[w, n, x] * scale_q
                            if SCORE_MOD:  # cap, ALiBi bias, the user's score_mod, then base 2
                                i = i0 + r0 + 16 * w + g + 8 * (x >> 1)
                                j = j0 + 8 * n + 2 * t + (x & 1)
                                val, _ = score_mod(val, softcap, slope, i, j, diag)
                                if USER_SCORE:  # (at indices clamped into the sequences, no branch a score)
                                    val, _ = score_within(val, b, h, i, j, seqlen_q, seqlen_k, a0, a1, a2, a3)
                                val *= LOG2E
                            s[w, n, x] = val
            if masked or partial:  # (this lane's keys: j0 + 2 t + c, c = 8 n + (x & 1); each row's c from lo to hi)
                for w in range(WM):
                    lo0, hi0 = column_bounds(i0 + r0 + 16 * w + g, j0 + 2 * t, seqlen_k, diag, left, right)
                    lo1, hi1 = column_bounds(i0 + r0 + 16 * w + g + 8, j0 + 2 * t, seqlen_k, diag, left, right)
                    for n in range(NS):
                        for x in range(4):
                            c = int32(8 * n + (x & 1))  # (int32 like the bounds: a 64-bit constant widens each test)
                            if c >= (hi0 if x < 2 else hi1) or (HAS_LEFT and c < (lo0 if x < 2 else lo1)):
                                s[w, n, x] = NEG_INF
                            elif partial and hidden(bits, (w * NS + n) * 4 + x):
                                s[w, n, x] = NEG_INF
            for w in range(WM):
                # this lane's partial max of rows g (x = 0, 1) and g + 8 (x = 2, 3) of block w (FOLD: of the raw
                # scores, scaled in the exponent)
                mx0 = NEG_INF
                mx1 = NEG_INF
                for n in range(NS):
                    mx0 = max(mx0, max(s[w, n, 0], s[w, n, 1]))
                    mx1 = max(mx1, max(s[w, n, 2], s[w, n, 3]))
                # the rows' max over their quad; m_new = max(m_i, rowmax(S_ij)); alpha = exp2(m_i - m_new)
                mx0 = quad_max(mx0)
                mx1 = quad_max(mx1)
                new_max(m, m_use, alpha, 2 * w, mx0, scale_q)
                new_max(m, m_use, alpha, 2 * w + 1, mx1, scale_q)

                # P_ij = exp2(S_ij - m_new) (0 where masked); l_i = alpha l_i + rowsum(P_ij) over this lane's
                # columns, before dropout (L_i is the true logsumexp); then P_ij keep_ij for the product with V_j
                # (the 1 / (1 - p_drop) of Z_ij = keep_ij / (1 - p_drop) waits for the epilogue: P_ij stays <= 1,
                # so its 16-bit rounding cannot overflow however close p_drop is to 1)
                ps0 = float32(0.0)
                ps1 = float32(0.0)
                for n in range(NS):
                    for x in range(4):
                        p = prob(s[w, n, x], m_use[2 * w + (x >> 1)], scale_q)
                        if x < 2:
                            ps0 += p
                        else:
                            ps1 += p
                        if DROPOUT:  # keep_ij drawn from (seed, offset, b, h, i, j)
                            u = dropout_uniform(seed, offset, b * nheads + h, i0 + r0 + 16 * w + g + 8 * (x >> 1),
                                                j0 + 8 * n + 2 * t + (x & 1))
                            if u < p_drop:
                                p = float32(0.0)
                        s[w, n, x] = p
                l[2 * w] = alpha[2 * w] * l[2 * w] + ps0
                l[2 * w + 1] = alpha[2 * w + 1] * l[2 * w + 1] + ps1

                # O_i = alpha O_i (then + P_ij V_j below)
                for n in range(NO):
                    o[w, n, 0] *= alpha[2 * w]
                    o[w, n, 1] *= alpha[2 * w]
                    o[w, n, 2] *= alpha[2 * w + 1]
                    o[w, n, 3] *= alpha[2 * w + 1]
            mma_ab(o, s, pa, smem, buf + OFF_V, lane)  # O_i += P_ij V_j (P_ij: the S fragments, rounded to 16 bits)
            cuda.syncthreads()  # every warp is done with this buffer before iteration j + 1 copies tile j + 2 in
            if BM:
                j0 = j1
                j1 = j2
                full0 = full1
        ptx.cp_async_wait_all()  # no copy outlives the block (with no tile to visit, the prologue's are in flight)

        # l_i: the sum of the quad's four partial sums
        for r in range(NR):
            l[r] += ptx.shfl_xor_f32(l[r], 1)
            l[r] += ptx.shfl_xor_f32(l[r], 2)

        # O_i = O_i / l_i (times 1 / (1 - p_drop) with dropout), L_i = ln(2) m_i + log(l_i); a row that saw no
        # key gets 0 and -inf
        for w in range(WM):
            for x in range(2):
                r = 2 * w + x
                i = i0 + r0 + 16 * w + g + 8 * x
                if i < seqlen_q:
                    inv_l = (rp_keep if DROPOUT else float32(1.0)) / l[r] if l[r] != 0 else float32(0.0)
                    for n in range(NOG):
                        out[bb, q0 + i, h, 8 * n + 2 * t] = store(o[w, n, 2 * x] * inv_l)
                        out[bb, q0 + i, h, 8 * n + 2 * t + 1] = store(o[w, n, 2 * x + 1] * inv_l)
                    if t == 0:
                        lse[bb, h, q0 + i] = float32(m[r] * LN2 + math.log(l[r])) if l[r] != 0 else NEG_INF

    return forward_tc
