"""Backward kernels for float32 inputs on tensor cores: TF32 and 3xTF32 ``mma.sync`` (m16n8k8).

FlashAttention-2's Algorithm 2 as :mod:`flashnumba.kernels.mma_backward` runs it (D_i = rowsum(dO_i * O_i) first,
then a dQ kernel and a dK/dV kernel, no atomics: deterministic), with the float32 tiles and the products of the
TF32 forward (:mod:`flashnumba.kernels.mma_tf32`: ``precision="tf32"`` rounds each operand to TF32,
``"3xtf32"`` splits it in two and multiplies three times, about float32's accuracy; ``make_tf32_ops``).

dQ, one block per query tile Q_i (warp w owns its rows 16w .. 16w + 15), looping over the key tiles::

    S_ij  = Q_i K_j^T,  dP_ij = dO_i V_j^T      B operands: column n of an 8-key tile is key pi(n)
    P_ij  = exp2(scale log2(e) S_ij - log2(e) L_i),  dS_ij = P_ij (dP_ij - D_i)     (0 where masked)
    dQ_i += dS_ij K_j                           A = dS_ij's C fragments as they are; B = K[t, g], K[t + 4, g]
    finally dQ_i *= scale

dK, dV, one block per key tile K_j, V_j (warp w owns its keys 16w .. 16w + 15), looping over the query tiles,
the products taken transposed (keys as rows) so that P^T and dS^T come out as the A operands of the next::

    S_ij^T  = K_j Q_i^T,  dP_ij^T = V_j dO_i^T  B operands: column n of an 8-query tile is query pi(n)
    P_ij^T  = exp2(scale log2(e) S_ij^T - log2(e) L_i),  dS_ij^T = P_ij^T (dP_ij^T - D_i)  (L_i, D_i per column)
    dV_j   += P_ij^T dO_i,  dK_j += dS_ij^T Q_i  B = dO[t, g], Q[t, g] (rows t and t + 4 of each 8)
    finally dK_j *= scale

The permutation pi(n) = n // 2 + 4 (n % 2) is the forward's (the module docstring of mma_tf32 draws it): the C
fragment of an 8-column tile holds, in lane (g, t), columns 2t and 2t + 1, which pi makes the tile's entries t and
t + 4, just where the A operand of the next product wants them. Every tile in shared memory has rows of
D + PAD_K floats: the reads of (row pi(g), column t) fall in 32 distinct banks; those of (row t, column g) by two
lanes a bank. L_i and D_i of a query tile go to small arrays in shared memory, two buffers in turn.

float32 only, head_dim 64 or 128, causal or not, as the TF32 forward.
"""

from __future__ import annotations

import functools
import math

from . import ptx
from .._backend import cuda
from .common import make_key_range, make_launch_order, row_stats
from .mma_tf32 import HEAD_DIMS, PAD_K, PRECISIONS, make_load_a_step, make_tf32_ops
from .mma_tiles import WARP_ROWS, make_load_rows, tile_landed
from .scalars import float32, uint32


def shared_bytes_dq(D, block_m, block_n):
    """Q_i and dO_i (block_m rows), two K_j, V_j buffers (block_n rows), float32 rows of D + PAD_K."""
    return (2 * block_m + 4 * block_n) * (D + PAD_K) * 4


def shared_bytes_dkdv(D, block_m, block_n):
    """K_j and V_j (block_n rows), two Q_i, dO_i buffers (block_m rows), float32 rows of D + PAD_K; L_i and D_i
    (static, two buffers of block_m)."""
    return (2 * block_n + 4 * block_m) * (D + PAD_K) * 4


def _check(D, precision, tile, warps):
    if D not in HEAD_DIMS:
        raise ValueError(f"the TF32 backward supports head_dim in {HEAD_DIMS}, got {D}")
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    if tile % 8 or tile <= 0:
        raise ValueError(f"the tiles a TF32 backward block loops over take a positive multiple of 8 rows, got {tile}")
    if warps not in (1, 2, 4, 8):
        raise ValueError(f"warps must be 1, 2, 4 or 8, got {warps}")


@functools.lru_cache(maxsize=None)
def make_products(D, NS, LD, three):
    """(product_abt, product_cb), a warp's two products of the backward kernels on float32 tiles in shared memory
    (rows of LD floats), TF32 or 3xTF32 (``three``); ab, asm (4,) and bb, bs (2,) are the caller's operand registers:

    - product_abt(acc, smem, a0, b0, g, t, pg, ab, asm, bb, bs): acc (NS, 4) += A B^T, A the warp's 16 rows of D
      columns from element a0 (its row 0, column 0), B NS tiles of 8 rows from element b0, row n of a tile taken
      from row pi(n) (``pg`` = pi(g)): so that acc's C fragments are the A fragments of the next product;
    - product_cb(acc, frag, c, smem, b0, g, t, ab, asm, bb, bs): the k-step c (0 .. NS - 1) of acc (D / 8, 4) +=
      F B, F the (16, 8 NS) C fragments ``frag`` of a product_abt, B the 8 NS rows of D columns from element b0
      (rows t and t + 4 of each 8)."""
    KD, NO = D // 8, D // 8
    load_a_step = make_load_a_step(LD, three)
    mma3, operand = make_tf32_ops(three)

    @cuda.jit(device=True, inline=True)
    def product_abt(acc, smem, a0, b0, g, t, pg, ab, asm, bb, bs):
        for kk in range(KD):
            load_a_step(smem, a0 + g * LD + 8 * kk + t, ab, asm, 0)
            for nn in range(NS):
                e = b0 + (8 * nn + pg) * LD + 8 * kk + t
                operand(smem[e], bb, bs, 0)
                operand(smem[e + 4], bb, bs, 1)
                acc[nn, 0], acc[nn, 1], acc[nn, 2], acc[nn, 3] = mma3(ab, asm, bb, bs, acc[nn, 0], acc[nn, 1],
                                                                      acc[nn, 2], acc[nn, 3], 0, 1, 2, 3)

    @cuda.jit(device=True, inline=True)
    def product_cb(acc, frag, c, smem, b0, g, t, ab, asm, bb, bs):
        # (k-step c alone: the dK/dV kernel takes its two products a step each in turn, which keeps the 3xTF32
        # kernel at d = 64 within its registers; the two products one after the other spill there)
        operand(frag[c, 0], ab, asm, 0)  # A = (F[c, 0], F[c, 2], F[c, 1], F[c, 3]): columns t, t + 4
        operand(frag[c, 2], ab, asm, 1)
        operand(frag[c, 1], ab, asm, 2)
        operand(frag[c, 3], ab, asm, 3)
        for nd in range(NO):
            e = b0 + (8 * c + t) * LD + 8 * nd + g
            operand(smem[e], bb, bs, 0)
            operand(smem[e + 4 * LD], bb, bs, 1)
            acc[nd, 0], acc[nd, 1], acc[nd, 2], acc[nd, 3] = mma3(ab, asm, bb, bs, acc[nd, 0], acc[nd, 1],
                                                                  acc[nd, 2], acc[nd, 3], 0, 1, 2, 3)

    return product_abt, product_cb


@functools.lru_cache(maxsize=None)
def make_backward_dq_tf32(D, causal, precision, B_c, warps):
    """The dQ kernel: arguments (dout, q, k, v, lse, delta, dq, scale_log2, scale), dout, q, k, v, dq (batch,
    seqlen, nheads, D) float32 C-contiguous, lse and delta (batch, nheads, seqlen_q) float32 (the forward's
    logsumexp, the preprocess's D_i), scale_log2 = softmax_scale * log2(e). Launch: grid (ceil(seqlen_q / (16
    warps)), batch * nheads), block (32 * warps,), dynamic shared memory :func:`shared_bytes_dq` (block_m = 16
    warps, block_n = B_c)."""
    _check(D, precision, B_c, warps)
    THREE = precision == "3xtf32"
    B_R = WARP_ROWS * warps
    NT = 32 * warps
    LD = D + PAD_K
    NS, NO = B_c // 8, D // 8  # 8-key tiles of S (k-steps of dS K); 8-dim tiles of dQ
    OFF_DO = B_R * LD  # dO_i after Q_i
    OFF_K = 2 * B_R * LD  # K buffer 0; buffer 1 lies BUF further on; V_j lies OFF_V after its K_j
    OFF_V = B_c * LD
    BUF = 2 * B_c * LD
    load_rows = make_load_rows(D, NT, LD, 4, per_column=False)  # 4 floats per 16-byte copy
    product_abt, product_cb = make_products(D, NS, LD, THREE)
    key_range = make_key_range(B_R, B_c, False, causal)  # causal: the band's right bound, right = 0
    launch_order_q = make_launch_order(True, causal)

    @cuda.jit
    def backward_dq_tf32(dout, q, k, v, lse, delta, dq, scale_log2, scale):
        nheads = q.shape[2]
        seqlen_q = q.shape[1]
        seqlen_k = k.shape[1]
        tid = cuda.threadIdx.x
        warp = tid // 32
        lane = tid % 32
        g = lane >> 2
        t = lane & 3
        pg = (g >> 1) + 4 * (g & 1)  # pi(g): the key this lane feeds as column g of an S tile
        tile, bh = launch_order_q()  # the longest causal rows first (common.make_launch_order)
        b = bh // nheads
        h = bh % nheads
        i0 = tile * B_R
        r0 = warp * WARP_ROWS
        diag = seqlen_k - seqlen_q

        smem = cuda.shared.array(0, float32)  # Q_i | dO_i | K, V buffer 0 | K, V buffer 1 (dynamic), shared
        ab = cuda.local.array(4, uint32)  # one A operand (big parts), and its small parts (3xTF32)
        asm = cuda.local.array(4, uint32)
        bb = cuda.local.array(2, uint32)  # one B operand
        bs = cuda.local.array(2, uint32)
        s = cuda.local.array((NS, 4), float32)  # S, then P
        dp = cuda.local.array((NS, 4), float32)  # dP, then dS
        acc = cuda.local.array((NO, 4), float32)  # dQ_i
        lrow = cuda.local.array(2, float32)  # log2(e) L_i of rows g, g + 8
        drow = cuda.local.array(2, float32)  # D_i of rows g, g + 8
        for x in range(2):
            lrow[x], drow[x] = row_stats(lse, delta, b, h, i0 + r0 + g + 8 * x, seqlen_q)
        for n in range(NO):
            for x in range(4):
                acc[n, x] = 0.0

        _, n_end = key_range(i0, seqlen_q, seqlen_k, diag, 0, 0)
        n_tiles = (n_end + B_c - 1) // B_c

        load_rows(smem, 0, q, b, i0, seqlen_q, h, B_R, tid)
        load_rows(smem, OFF_DO, dout, b, i0, seqlen_q, h, B_R, tid)
        if n_tiles > 0:
            load_rows(smem, OFF_K, k, b, 0, seqlen_k, h, B_c, tid)
            load_rows(smem, OFF_K + OFF_V, v, b, 0, seqlen_k, h, B_c, tid)
        ptx.cp_async_commit()

        for jt in range(n_tiles):
            j0 = jt * B_c
            buf = OFF_K + (jt & 1) * BUF
            if jt + 1 < n_tiles:  # tile j + 1 into the other buffer, freed by the barrier ending iteration j - 1
                nxt = OFF_K + ((jt + 1) & 1) * BUF
                load_rows(smem, nxt, k, b, j0 + B_c, seqlen_k, h, B_c, tid)
                load_rows(smem, nxt + OFF_V, v, b, j0 + B_c, seqlen_k, h, B_c, tid)
            tile_landed()  # tile j (and Q_i, dO_i) landed and visible to every thread

            # S = Q_i K_j^T and dP = dO_i V_j^T, one step of 8 dims at a time; B: key 8 nn + pi(g), dims t, t + 4
            for nn in range(NS):
                for x in range(4):
                    s[nn, x] = 0.0
                    dp[nn, x] = 0.0
            product_abt(s, smem, r0 * LD, buf, g, t, pg, ab, asm, bb, bs)  # S = Q_i K_j^T
            product_abt(dp, smem, OFF_DO + r0 * LD, buf + OFF_V, g, t, pg, ab, asm, bb, bs)  # dP = dO_i V_j^T

            # P from the logsumexp, dS = P (dP - D_i); s[nn, x] is row g + 8 (x >> 1), key t + 4 (x & 1)
            masked = j0 + B_c > seqlen_k or (causal and j0 + B_c - 1 > i0 + diag)
            for nn in range(NS):
                for x in range(4):
                    p = float32(math.exp2(s[nn, x] * scale_log2 - lrow[x >> 1]))
                    if masked:
                        i = i0 + r0 + g + 8 * (x >> 1)
                        j = j0 + 8 * nn + t + 4 * (x & 1)
                        if j >= seqlen_k or (causal and j > i + diag):
                            p = float32(0.0)
                    dp[nn, x] = p * (dp[nn, x] - drow[x >> 1])

            for c in range(NS):
                product_cb(acc, dp, c, smem, buf, g, t, ab, asm, bb, bs)  # dQ_i += dS K_j
            cuda.syncthreads()  # every warp is done with this buffer before iteration j + 1 copies tile j + 2 in
        ptx.cp_async_wait_all()  # no copy outlives the block (with no tile to visit, the prologue's are in flight)

        for x in range(2):
            i = i0 + r0 + g + 8 * x
            if i < seqlen_q:
                for n in range(NO):
                    dq[b, i, h, 8 * n + 2 * t] = acc[n, 2 * x] * scale
                    dq[b, i, h, 8 * n + 2 * t + 1] = acc[n, 2 * x + 1] * scale

    return backward_dq_tf32


@functools.lru_cache(maxsize=None)
def make_backward_dkdv_tf32(D, causal, precision, B_m, warps):
    """The dK/dV kernel: arguments (dout, q, k, v, lse, delta, dk, dv, scale_log2, scale), as the dQ kernel's with
    dk, dv like k. Launch: grid (ceil(seqlen_k / (16 warps)), batch * nheads), block (32 * warps,), dynamic shared
    memory :func:`shared_bytes_dkdv` (block_m = B_m query rows a tile, block_n = 16 warps keys)."""
    _check(D, precision, B_m, warps)
    THREE = precision == "3xtf32"
    B_N = WARP_ROWS * warps  # keys of the block
    NT = 32 * warps
    LD = D + PAD_K
    NS, NO = B_m // 8, D // 8  # 8-query tiles of S^T (k-steps of P^T dO, dS^T Q); 8-dim tiles of dK, dV
    OFF_V = B_N * LD  # V_j after K_j
    OFF_Q = 2 * B_N * LD  # Q buffer 0; buffer 1 lies BUF further on; dO_i lies OFF_DO after its Q_i
    OFF_DO = B_m * LD
    BUF = 2 * B_m * LD
    SR = -(-B_m // NT)  # query rows of L_i and D_i a thread fetches
    load_rows = make_load_rows(D, NT, LD, 4, per_column=False)
    product_abt, product_cb = make_products(D, NS, LD, THREE)
    launch_order_k = make_launch_order(False, causal)

    @cuda.jit(device=True, inline=True)
    def put_stats(lsm, dsm, sel, lse, delta, b, h, row0, seqlen_q, tid):
        """log2(e) L_i and D_i of the query rows row0 .. row0 + B_m - 1 into buffer ``sel`` (0 past the end of the
        sequence, and 0 for a row that sees no key: its entries are all masked)."""
        for x in range(SR):
            r = tid + x * NT
            if r < B_m:
                lsm[sel, r], dsm[sel, r] = row_stats(lse, delta, b, h, row0 + r, seqlen_q)

    @cuda.jit
    def backward_dkdv_tf32(dout, q, k, v, lse, delta, dk, dv, scale_log2, scale):
        nheads = q.shape[2]
        seqlen_q = q.shape[1]
        seqlen_k = k.shape[1]
        tid = cuda.threadIdx.x
        warp = tid // 32
        lane = tid % 32
        g = lane >> 2
        t = lane & 3
        pg = (g >> 1) + 4 * (g & 1)  # pi(g): the query this lane feeds as column g of an S^T tile
        tile, bh = launch_order_k()  # the key tiles that see the most causal queries first
        b = bh // nheads
        h = bh % nheads
        j0 = tile * B_N  # first key of K_j
        r0 = warp * WARP_ROWS  # this warp's keys inside K_j
        diag = seqlen_k - seqlen_q

        smem = cuda.shared.array(0, float32)  # K_j | V_j | Q, dO buffer 0 | Q, dO buffer 1 (dynamic), shared
        lsm = cuda.shared.array((2, B_m), float32)  # log2(e) L_i of the query tile, two buffers, shared
        dsm = cuda.shared.array((2, B_m), float32)  # D_i of the query tile, two buffers, shared
        ab = cuda.local.array(4, uint32)
        asm = cuda.local.array(4, uint32)
        bb = cuda.local.array(2, uint32)
        bs = cuda.local.array(2, uint32)
        s = cuda.local.array((NS, 4), float32)  # S^T, then P^T (this warp's 16 keys x B_m queries)
        dp = cuda.local.array((NS, 4), float32)  # dP^T, then dS^T
        dv_acc = cuda.local.array((NO, 4), float32)
        dk_acc = cuda.local.array((NO, 4), float32)
        for n in range(NO):
            for x in range(4):
                dv_acc[n, x] = 0.0
                dk_acc[n, x] = 0.0

        # query tiles that see these keys: causal, rows i >= j0 - diag
        m_begin = max(0, j0 - diag) // B_m if causal else 0
        nt = max(0, (seqlen_q + B_m - 1) // B_m - m_begin)

        load_rows(smem, 0, k, b, j0, seqlen_k, h, B_N, tid)
        load_rows(smem, OFF_V, v, b, j0, seqlen_k, h, B_N, tid)
        if nt > 0:
            load_rows(smem, OFF_Q, q, b, m_begin * B_m, seqlen_q, h, B_m, tid)
            load_rows(smem, OFF_Q + OFF_DO, dout, b, m_begin * B_m, seqlen_q, h, B_m, tid)
            put_stats(lsm, dsm, 0, lse, delta, b, h, m_begin * B_m, seqlen_q, tid)
        ptx.cp_async_commit()

        for it in range(nt):
            i0 = (m_begin + it) * B_m
            sel = it & 1
            buf = OFF_Q + sel * BUF
            if it + 1 < nt:  # the next query tile into the other buffers, freed by the barrier ending it - 1
                nxt = OFF_Q + (1 - sel) * BUF
                load_rows(smem, nxt, q, b, i0 + B_m, seqlen_q, h, B_m, tid)
                load_rows(smem, nxt + OFF_DO, dout, b, i0 + B_m, seqlen_q, h, B_m, tid)
            tile_landed()  # this tile (and K_j, V_j) landed; L_i and D_i visible to all

            # S^T = K_j Q_i^T and dP^T = V_j dO_i^T; B: query 8 nn + pi(g), dims t, t + 4
            for nn in range(NS):
                for x in range(4):
                    s[nn, x] = 0.0
                    dp[nn, x] = 0.0
            product_abt(s, smem, r0 * LD, buf, g, t, pg, ab, asm, bb, bs)  # S^T = K_j Q_i^T
            product_abt(dp, smem, OFF_V + r0 * LD, buf + OFF_DO, g, t, pg, ab, asm, bb, bs)  # dP^T = V_j dO_i^T
            if it + 1 < nt:  # the next tile's L_i and D_i into the buffers the last iteration read
                put_stats(lsm, dsm, 1 - sel, lse, delta, b, h, i0 + B_m, seqlen_q, tid)

            # P^T, dS^T; s[nn, x] is key g + 8 (x >> 1), query column c = 8 nn + t + 4 (x & 1)
            masked = i0 + B_m > seqlen_q or j0 + B_N > seqlen_k or (causal and j0 + B_N - 1 > i0 + diag)
            for nn in range(NS):
                for x in range(4):
                    c = 8 * nn + t + 4 * (x & 1)
                    p = float32(math.exp2(s[nn, x] * scale_log2 - lsm[sel, c]))
                    if masked:
                        i = i0 + c
                        j = j0 + r0 + g + 8 * (x >> 1)
                        if i >= seqlen_q or j >= seqlen_k or (causal and j > i + diag):
                            p = float32(0.0)
                    s[nn, x] = p
                    dp[nn, x] = p * (dp[nn, x] - dsm[sel, c])

            for c in range(NS):
                product_cb(dv_acc, s, c, smem, buf + OFF_DO, g, t, ab, asm, bb, bs)  # dV_j += P^T dO_i
                product_cb(dk_acc, dp, c, smem, buf, g, t, ab, asm, bb, bs)  # dK_j += dS^T Q_i
            cuda.syncthreads()  # every warp is done with these buffers before the next iteration refills them
        ptx.cp_async_wait_all()  # no copy outlives the block (with no tile to visit, the prologue's are in flight)

        for x in range(2):
            j = j0 + r0 + g + 8 * x
            if j < seqlen_k:
                for n in range(NO):
                    dk[b, j, h, 8 * n + 2 * t] = dk_acc[n, 2 * x] * scale
                    dk[b, j, h, 8 * n + 2 * t + 1] = dk_acc[n, 2 * x + 1] * scale
                    dv[b, j, h, 8 * n + 2 * t] = dv_acc[n, 2 * x]
                    dv[b, j, h, 8 * n + 2 * t + 1] = dv_acc[n, 2 * x + 1]

    return backward_dkdv_tf32
