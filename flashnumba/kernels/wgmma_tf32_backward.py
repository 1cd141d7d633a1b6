"""Backward kernels for float32 on Hopper's warpgroup MMA: 3xTF32 with ``wgmma`` (float32's accuracy on tensor cores).

FlashAttention-2's Algorithm 2 as :mod:`flashnumba.kernels.mma_tf32_backward` runs it (D_i = rowsum(dO_i * O_i)
first, then a dQ kernel and a dK/dV kernel, no atomics: deterministic), with the products of the 3xTF32 forward
on wgmma (:mod:`flashnumba.kernels.wgmma_tf32`, read it first): each tile split once into its big and small TF32
parts as it is stored to shared memory, a warpgroup's ``wgmma`` reading the parts from there, and each k-step's
three products from zero in a scratch accumulator, added with float32 adds (``chained``: in the accumulator).

A TF32 operand read from shared memory is K-major only, so a tile that is the B operand of a product over its rows
is stored transposed as well (``split_transposed`` of make_tile_io, its rows renamed in each 8 so that an
accumulator's registers are the A operand of the next product, as P's are in the forward).

dQ, one warpgroup a query tile Q_i (64 rows), looping over the key tiles (B_c keys)::

    S_ij  = Q_i K_j^T,  dP_ij = dO_i V_j^T      A: Q_i, dO_i (split once); B: K_j, V_j as they lie
    P_ij  = exp2(scale log2(e) S_ij - log2(e) L_i),  dS_ij = P_ij (dP_ij - D_i)     (0 where masked)
    dQ_i += dS_ij K_j                           A: dS_ij's registers; B: K_j^T
    finally dQ_i *= scale

dK, dV, one warpgroup a key tile K_j, V_j (64 keys), looping over the query tiles (B_r queries), the products
taken transposed (keys as rows)::

    S_ij^T  = K_j Q_i^T,  dP_ij^T = V_j dO_i^T  A: K_j, V_j (split once); B: Q_i, dO_i as they lie
    P_ij^T  = exp2(scale log2(e) S_ij^T - log2(e) L_i),  dS_ij^T = P_ij^T (dP_ij^T - D_i)   (L_i, D_i a column)
    dV_j   += P_ij^T dO_i,  dK_j += dS_ij^T Q_i  A: P^T's, dS^T's registers; B: dO_i^T, Q_i^T
    finally dK_j *= scale

The loop's tiles are the forward's pipeline: while a tile's products run, the next tile is copied (``cp.async``)
as it lies into the last buffers; at the top of the next iteration every thread splits it into the parts::

    copy tile 0 | split the block's own tiles
    tile t:  wait for the copies; barrier | split tile t (as it lies and transposed) | barrier | copy tile t + 1 |
             the products, P, dS, the products

Shared memory, dynamic, float32 bits (:func:`shared_bytes_dq`, :func:`shared_bytes_dkdv`): the block's own two
tiles' parts (Q_i and dO_i, or K_j and V_j: 64 rows each), then the loop tile's parts as they lie and transposed,
then its two copies; last, the dK/dV kernel's L_i and D_i of the query tile (fetched a tile ahead into registers).
The buffers are one dynamic array with no static shared array before it, so each lies at a multiple of 16 bytes
from the start of shared memory, as a matrix descriptor needs (it drops an address's low four bits).

S and dP's scratch: with per-step accumulation, S's k-steps and dP's each run in turns through two scratch
accumulators. S and dP take two pairs of their own: with one pair for both, the assembler (nvJitLink 13.5 for
sm_90a, at head_dim 64) dropped the adds of the first register of every S k-step and took P's first element from
dP's sum, though the PTX was right (on the GPU the gradients came out wrong; in the simulator, right). Eight
registers a pair at a loop tile of 16 keys or queries; the kernels' registers did not grow.

float32 only, head_dim 64 or 128, causal or not (the options of the TF32 backward). The plan takes them for
``precision="3xtf32"`` on compute capability 9.0 where ``flashnumba.config.hopper_3xtf32`` is set.
"""

from __future__ import annotations

import functools
import math

from . import ptx, ptx_hopper as hop
from .._backend import cuda
from .common import make_key_range, row_stats
from .scalars import float32, uint32
from .wgmma_tf32 import HEAD_DIMS, make_register_products, make_smem_products, make_tile_io

ROWS = 64  # the block's own rows (one warpgroup): query rows of the dQ kernel, keys of the dK/dV kernel
NT = 128
# rows of a loop tile (keys of dQ, queries of dK/dV: N of the first products, K of the last), per head_dim
LOOP_ROWS = {64: (16, 32), 128: (16,)}  # (at 128, 32 would need 256 KB and 288 KB)
DEFAULT_LOOP_ROWS = 16


def shared_bytes_dq(D, B_c):
    """Q_i's and dO_i's parts (64 x D each), K_j's and V_j's (B_c x D), K_j^T's (D x B_c), K_j+1 and V_j+1 as
    copied; float32."""
    return 4 * (4 * ROWS * D + 8 * B_c * D)


def shared_bytes_dkdv(D, B_r):
    """K_j's and V_j's parts (64 x D each), Q_i's and dO_i's as they lie and transposed (B_r x D each), Q_i+1 and
    dO_i+1 as copied, L_i and D_i (B_r each); float32."""
    return 4 * (4 * ROWS * D + 10 * B_r * D + 2 * B_r)


def _check(D, loop_rows, what):
    if D not in HEAD_DIMS:
        raise ValueError(f"the 3xTF32 wgmma backward supports head_dim in {HEAD_DIMS}, got {D}")
    if loop_rows not in LOOP_ROWS[D]:
        raise ValueError(f"the 3xTF32 wgmma {what} kernel at head_dim {D} takes {LOOP_ROWS[D]} rows a loop tile, "
                         f"got {loop_rows}")


@functools.lru_cache(maxsize=None)
def make_backward_dq_3xtf32_wgmma(D, causal, B_c=DEFAULT_LOOP_ROWS, chained=False):
    """The dQ kernel: arguments (dout, q, k, v, lse, delta, dq, scale_log2, scale) as
    :func:`flashnumba.kernels.mma_tf32_backward.make_backward_dq_tf32`'s. Compiled for sm_90a. Launch: grid
    (ceil(seqlen_q / 64), batch * nheads), block (128,), dynamic shared memory :func:`shared_bytes_dq`."""
    _check(D, B_c, "dQ")
    CHAINED = bool(chained)
    NS = B_c // 2  # S, dP accumulator registers a thread
    NQ = D // 2  # dQ accumulator registers a thread
    KD, KC = D // 8, B_c // 8  # k-steps of S and dP; of dQ += dS K
    TURNS = D <= 64 and not CHAINED  # dQ's k-steps in turns (a second scratch of D / 2 registers: at 64)
    QB, QS, OB, OS = 0, ROWS * D, 2 * ROWS * D, 3 * ROWS * D  # Q_i, dO_i parts (word offsets)
    KB, KS = 4 * ROWS * D, 4 * ROWS * D + B_c * D
    VB, VS = 4 * ROWS * D + 2 * B_c * D, 4 * ROWS * D + 3 * B_c * D
    TB, TS = 4 * ROWS * D + 4 * B_c * D, 4 * ROWS * D + 5 * B_c * D  # K_j^T
    RK, RV = 4 * ROWS * D + 6 * B_c * D, 4 * ROWS * D + 7 * B_c * D  # K_j+1, V_j+1 as copied
    SBO_D, SBO_C = 32 * D, 32 * B_c
    products_s = make_smem_products(B_c, KD, CHAINED)
    pack, products_dq = make_register_products(D, KC, CHAINED, TURNS)
    load_rows, copy_tile, split_natural, split_transposed = make_tile_io(D, B_c, NT)  # (load_rows: any count)
    key_range = make_key_range(ROWS, B_c, False, causal)

    @cuda.jit
    def backward_dq_3xtf32_wgmma(dout, q, k, v, lse, delta, dq, scale_log2, scale):
        nheads = q.shape[2]
        seqlen_q = q.shape[1]
        seqlen_k = k.shape[1]
        tid = cuda.threadIdx.x
        w = tid // 32
        g = (tid % 32) >> 2
        t = tid & 3
        b = uint32(cuda.blockIdx.y) // uint32(nheads)  # (32-bit: a 64-bit division is a called routine, which
        h = uint32(uint32(cuda.blockIdx.y) - b * uint32(nheads))  # serialises every wgmma)
        i0 = (cuda.gridDim.x - 1 - cuda.blockIdx.x) * ROWS  # the longest causal rows first
        diag = seqlen_k - seqlen_q

        smem = cuda.shared.array(0, uint32)
        fsmem = cuda.shared.array(0, float32)
        s = cuda.local.array(NS, float32)  # S, then P
        dp = cuda.local.array(NS, float32)  # dP, then dS
        sa = cuda.local.array(NS, float32)  # (each k-step's products, in turns)
        sb = cuda.local.array(NS, float32)
        da = cuda.local.array(NS, float32)  # (dP's own: module docstring, "S and dP's scratch")
        db = cuda.local.array(NS, float32)
        acc = cuda.local.array(NQ, float32)  # dQ_i
        qa = cuda.local.array(NQ, float32)  # (dQ's k-steps from zero)
        qa2 = cuda.local.array(NQ if TURNS else 1, float32)
        fb = cuda.local.array((KC, 4), uint32)  # dS's parts, the A operand of k-step c
        fs = cuda.local.array((KC, 4), uint32)
        lrow = cuda.local.array(2, float32)  # log2(e) L_i of rows g, g + 8
        drow = cuda.local.array(2, float32)  # D_i of rows g, g + 8
        for x in range(2):
            lrow[x], drow[x] = row_stats(lse, delta, b, h, i0 + 16 * w + g + 8 * x, seqlen_q)
        for i in range(NQ):
            acc[i] = 0.0

        qb = hop.make_desc(hop.smem_address(smem, QB), 128, SBO_D)
        qs = hop.make_desc(hop.smem_address(smem, QS), 128, SBO_D)
        ob = hop.make_desc(hop.smem_address(smem, OB), 128, SBO_D)
        os_ = hop.make_desc(hop.smem_address(smem, OS), 128, SBO_D)
        kb = hop.make_desc(hop.smem_address(smem, KB), 128, SBO_D)
        ks = hop.make_desc(hop.smem_address(smem, KS), 128, SBO_D)
        vb = hop.make_desc(hop.smem_address(smem, VB), 128, SBO_D)
        vs = hop.make_desc(hop.smem_address(smem, VS), 128, SBO_D)
        tb = hop.make_desc(hop.smem_address(smem, TB), 128, SBO_C)
        ts = hop.make_desc(hop.smem_address(smem, TS), 128, SBO_C)

        _, n_end = key_range(i0, seqlen_q, seqlen_k, diag, 0, 0)
        n_tiles = (n_end + B_c - 1) // B_c
        if n_tiles > 0:  # K_0 and V_0 copied while Q_i and dO_i are split
            copy_tile(fsmem, RK, k, b, h, 0, seqlen_k, tid)
            copy_tile(fsmem, RV, v, b, h, 0, seqlen_k, tid)
            ptx.cp_async_commit()
        load_rows(smem, QB, QS, q, b, h, i0, seqlen_q, ROWS * D, tid)
        load_rows(smem, OB, OS, dout, b, h, i0, seqlen_q, ROWS * D, tid)
        for jt in range(n_tiles):
            j0 = jt * B_c
            ptx.cp_async_wait_all()
            cuda.syncthreads()  # (K_j, V_j copied; every thread's products of tile j - 1 retired)
            split_natural(smem, fsmem, RK, KB, KS, tid)
            split_natural(smem, fsmem, RV, VB, VS, tid)
            split_transposed(smem, fsmem, RK, TB, TS, tid)  # K_j^T, keys in the order of dS's registers
            hop.fence_proxy_async()  # (the stores seen by the tensor cores' reads)
            cuda.syncthreads()  # (the copies consumed: K_j+1 and V_j+1 copied there during tile j's products)
            if jt + 1 < n_tiles:
                copy_tile(fsmem, RK, k, b, h, j0 + B_c, seqlen_k, tid)
                copy_tile(fsmem, RV, v, b, h, j0 + B_c, seqlen_k, tid)
                ptx.cp_async_commit()

            products_s(s, sa, sb, qb, qs, kb, ks)  # S = Q_i K_j^T
            products_s(dp, da, db, ob, os_, vb, vs)  # dP = dO_i V_j^T

            # P from the logsumexp, dS = P (dP - D_i); s[4 n + x] is row g + 8 (x >> 1), key 8 n + 2 t + (x & 1)
            masked = j0 + B_c > seqlen_k or (causal and j0 + B_c - 1 > i0 + diag)
            for n in range(NS // 4):
                for x in range(4):
                    p = float32(math.exp2(s[4 * n + x] * scale_log2 - lrow[x >> 1]))
                    if masked:
                        i = i0 + 16 * w + g + 8 * (x >> 1)
                        j = j0 + 8 * n + 2 * t + (x & 1)
                        if j >= seqlen_k or (causal and j > i + diag):
                            p = float32(0.0)
                    dp[4 * n + x] = p * (dp[4 * n + x] - drow[x >> 1])

            pack(fb, fs, dp)
            products_dq(acc, qa, qa2, fb, fs, tb, ts)  # dQ_i += dS K_j
        ptx.cp_async_wait_all()  # (no copy outlives the block)

        for x in range(2):
            i = i0 + 16 * w + g + 8 * x
            if i < seqlen_q:
                for n in range(NQ // 4):
                    dq[b, i, h, 8 * n + 2 * t] = acc[4 * n + 2 * x] * scale
                    dq[b, i, h, 8 * n + 2 * t + 1] = acc[4 * n + 2 * x + 1] * scale

    return backward_dq_3xtf32_wgmma


@functools.lru_cache(maxsize=None)
def make_backward_dkdv_3xtf32_wgmma(D, causal, B_r=DEFAULT_LOOP_ROWS, chained=False):
    """The dK/dV kernel: arguments (dout, q, k, v, lse, delta, dk, dv, scale_log2, scale) as
    :func:`flashnumba.kernels.mma_tf32_backward.make_backward_dkdv_tf32`'s. Compiled for sm_90a. Launch: grid
    (ceil(seqlen_k / 64), batch * nheads), block (128,), dynamic shared memory :func:`shared_bytes_dkdv`."""
    _check(D, B_r, "dK/dV")
    CHAINED = bool(chained)
    NS = B_r // 2  # S^T, dP^T accumulator registers a thread
    NK = D // 2  # dK, dV accumulator registers a thread
    KD, KC = D // 8, B_r // 8  # k-steps of S^T and dP^T; of dV += P^T dO and dK += dS^T Q
    TURNS = D <= 64 and not CHAINED
    KB, KS, VB, VS = 0, ROWS * D, 2 * ROWS * D, 3 * ROWS * D  # K_j, V_j parts (word offsets)
    base = 4 * ROWS * D
    QB, QS, OB, OS = base, base + B_r * D, base + 2 * B_r * D, base + 3 * B_r * D  # Q_i, dO_i as they lie
    QTB, QTS = base + 4 * B_r * D, base + 5 * B_r * D  # Q_i^T
    OTB, OTS = base + 6 * B_r * D, base + 7 * B_r * D  # dO_i^T
    RQ, RO = base + 8 * B_r * D, base + 9 * B_r * D  # Q_i+1, dO_i+1 as copied
    LS, DS = base + 10 * B_r * D, base + 10 * B_r * D + B_r  # log2(e) L_i and D_i of the query tile
    SBO_D, SBO_R = 32 * D, 32 * B_r
    products_s = make_smem_products(B_r, KD, CHAINED)
    pack, products_kv = make_register_products(D, KC, CHAINED, TURNS)
    load_rows, copy_tile, split_natural, split_transposed = make_tile_io(D, B_r, NT)  # (load_rows: any count)

    @cuda.jit
    def backward_dkdv_3xtf32_wgmma(dout, q, k, v, lse, delta, dk, dv, scale_log2, scale):
        nheads = q.shape[2]
        seqlen_q = q.shape[1]
        seqlen_k = k.shape[1]
        tid = cuda.threadIdx.x
        w = tid // 32
        g = (tid % 32) >> 2
        t = tid & 3
        b = uint32(cuda.blockIdx.y) // uint32(nheads)
        h = uint32(uint32(cuda.blockIdx.y) - b * uint32(nheads))
        j0 = cuda.blockIdx.x * ROWS  # first key of K_j
        diag = seqlen_k - seqlen_q

        smem = cuda.shared.array(0, uint32)
        fsmem = cuda.shared.array(0, float32)
        s = cuda.local.array(NS, float32)  # S^T, then P^T (keys g, g + 8 of the warp's 16 x B_r queries)
        dp = cuda.local.array(NS, float32)  # dP^T, then dS^T
        sa = cuda.local.array(NS, float32)
        sb = cuda.local.array(NS, float32)
        da = cuda.local.array(NS, float32)  # (dP^T's own: module docstring, "S and dP's scratch")
        db = cuda.local.array(NS, float32)
        dk_acc = cuda.local.array(NK, float32)
        dv_acc = cuda.local.array(NK, float32)
        ka = cuda.local.array(NK, float32)  # (dK's, dV's k-steps from zero)
        ka2 = cuda.local.array(NK if TURNS else 1, float32)
        fb = cuda.local.array((KC, 4), uint32)  # P^T's, then dS^T's parts
        fs = cuda.local.array((KC, 4), uint32)
        for i in range(NK):
            dk_acc[i] = 0.0
            dv_acc[i] = 0.0

        kb = hop.make_desc(hop.smem_address(smem, KB), 128, SBO_D)
        ks = hop.make_desc(hop.smem_address(smem, KS), 128, SBO_D)
        vb = hop.make_desc(hop.smem_address(smem, VB), 128, SBO_D)
        vs = hop.make_desc(hop.smem_address(smem, VS), 128, SBO_D)
        qb = hop.make_desc(hop.smem_address(smem, QB), 128, SBO_D)
        qs = hop.make_desc(hop.smem_address(smem, QS), 128, SBO_D)
        ob = hop.make_desc(hop.smem_address(smem, OB), 128, SBO_D)
        os_ = hop.make_desc(hop.smem_address(smem, OS), 128, SBO_D)
        qtb = hop.make_desc(hop.smem_address(smem, QTB), 128, SBO_R)
        qts = hop.make_desc(hop.smem_address(smem, QTS), 128, SBO_R)
        otb = hop.make_desc(hop.smem_address(smem, OTB), 128, SBO_R)
        ots = hop.make_desc(hop.smem_address(smem, OTS), 128, SBO_R)

        # query tiles that see these keys: causal, rows i >= j0 - diag
        m_begin = max(0, j0 - diag) // B_r if causal else 0
        nt = max(0, (seqlen_q + B_r - 1) // B_r - m_begin)
        # (thread r < B_r: log2(e) L_i, D_i of row r of the next query tile, fetched a tile ahead)
        nl, nd = row_stats(lse, delta, b, h, m_begin * B_r + tid if tid < B_r else seqlen_q, seqlen_q)
        if nt > 0:  # Q_0 and dO_0 copied while K_j and V_j are split
            copy_tile(fsmem, RQ, q, b, h, m_begin * B_r, seqlen_q, tid)
            copy_tile(fsmem, RO, dout, b, h, m_begin * B_r, seqlen_q, tid)
            ptx.cp_async_commit()
        load_rows(smem, KB, KS, k, b, h, j0, seqlen_k, ROWS * D, tid)
        load_rows(smem, VB, VS, v, b, h, j0, seqlen_k, ROWS * D, tid)
        for it in range(nt):
            i0 = (m_begin + it) * B_r
            ptx.cp_async_wait_all()
            cuda.syncthreads()  # (Q_i, dO_i copied; every thread's products of the last tile retired)
            split_natural(smem, fsmem, RQ, QB, QS, tid)
            split_natural(smem, fsmem, RO, OB, OS, tid)
            split_transposed(smem, fsmem, RQ, QTB, QTS, tid)  # Q_i^T, dO_i^T: queries in the order of P^T's
            split_transposed(smem, fsmem, RO, OTB, OTS, tid)  # registers
            if tid < B_r:
                fsmem[LS + tid] = nl
                fsmem[DS + tid] = nd
            hop.fence_proxy_async()
            cuda.syncthreads()  # (the copies consumed, L_i and D_i visible)
            if it + 1 < nt:
                copy_tile(fsmem, RQ, q, b, h, i0 + B_r, seqlen_q, tid)
                copy_tile(fsmem, RO, dout, b, h, i0 + B_r, seqlen_q, tid)
                ptx.cp_async_commit()
                nl, nd = row_stats(lse, delta, b, h, i0 + B_r + tid if tid < B_r else seqlen_q, seqlen_q)

            products_s(s, sa, sb, kb, ks, qb, qs)  # S^T = K_j Q_i^T
            products_s(dp, da, db, vb, vs, ob, os_)  # dP^T = V_j dO_i^T

            # P^T, dS^T; s[4 n + x] is key g + 8 (x >> 1) of warp w's 16, query column c = 8 n + 2 t + (x & 1)
            masked = i0 + B_r > seqlen_q or j0 + ROWS > seqlen_k or (causal and j0 + ROWS - 1 > i0 + diag)
            for n in range(NS // 4):
                for x in range(4):
                    c = 8 * n + 2 * t + (x & 1)
                    p = float32(math.exp2(s[4 * n + x] * scale_log2 - fsmem[LS + c]))
                    if masked:
                        i = i0 + c
                        j = j0 + 16 * w + g + 8 * (x >> 1)
                        if i >= seqlen_q or j >= seqlen_k or (causal and j > i + diag):
                            p = float32(0.0)
                    s[4 * n + x] = p
                    dp[4 * n + x] = p * (dp[4 * n + x] - fsmem[DS + c])

            pack(fb, fs, s)
            products_kv(dv_acc, ka, ka2, fb, fs, otb, ots)  # dV_j += P^T dO_i
            pack(fb, fs, dp)
            products_kv(dk_acc, ka, ka2, fb, fs, qtb, qts)  # dK_j += dS^T Q_i
        ptx.cp_async_wait_all()

        for x in range(2):
            j = j0 + 16 * w + g + 8 * x
            if j < seqlen_k:
                for n in range(NK // 4):
                    dk[b, j, h, 8 * n + 2 * t] = dk_acc[4 * n + 2 * x] * scale
                    dk[b, j, h, 8 * n + 2 * t + 1] = dk_acc[4 * n + 2 * x + 1] * scale
                    dv[b, j, h, 8 * n + 2 * t] = dv_acc[4 * n + 2 * x]
                    dv[b, j, h, 8 * n + 2 * t + 1] = dv_acc[4 * n + 2 * x + 1]

    return backward_dkdv_3xtf32_wgmma
