"""Backward kernels: FlashAttention-2, Algorithm 2, recomputing P from Q, K and the saved logsumexp L.

Nothing of size seqlen_q x seqlen_k is stored. Given dO, Q, K, V, O and L (from the forward)::

    D_i   = rowsum(dO_i * O_i)                          (preprocess, one float per query row)
    P_ij  = exp(scale * Q_i K_j^T - L_i)                recomputed, masked entries 0
    dV_j += P_ij^T dO_i
    dP_ij = dO_i V_j^T
    dS_ij = P_ij * (dP_ij - D_i)                        (with dropout: P_ij * (Z_ij dP_ij - D_i), dV from P_ij Z_ij)
    dK_j += scale * dS_ij^T Q_i
    dQ_i += scale * dS_ij K_j

Three launches, none with atomics, so the result is deterministic (bitwise identical run to run):

=================  =============================================================================================
kernel             what one block does
=================  =============================================================================================
``preprocess``     D_i for B_r query rows (one thread per row)
``dkdv_v1``        one K_j/V_j tile (one thread per key row j, k_j, v_j, dk_j, dv_j in local memory); loops over
                   the Q_i tiles that see it (causal: from the diagonal on), staging Q_i, dO_i, L_i, D_i in shared
``dq_v1``          one Q_i tile (one thread per query row, q_i, dO_i, dq_i local); loops over the K_j/V_j tiles it
                   sees (causal: up to the diagonal), staging K_j, V_j in shared
``dkdv_v2``        register-tiled version of dkdv_v1 (each thread owns a patch of S^T, dP^T, dK_j, dV_j; unsigned
                   indices as in forward v3); with GQA, loops over the query heads sharing its key/value head
``dq_v2``          register-tiled version of dq_v1 (the default backward, with every option of forward v3)
=================  =============================================================================================

P_ij is computed as exp2((scale * s - L_i) * log2(e)): the difference of the two large numbers is taken first,
in natural units, so that with large logits only the rounding of L_i itself (float32) limits the accuracy.
Accumulation is float32 for every input dtype. A query row that saw no key has L_i = -inf; its P_ij are 0
(masked), so its dQ_i is 0 and it adds nothing to dK, dV.

As in the forward kernels, q, k, v, dout and out are read through ``load`` and dq, dk, dv written through
``store`` (:func:`flashnumba.bf16.load_store`): with ``bf16``, the arrays are bfloat16 bit patterns (uint16).
lse and D_i are float32 for every dtype.
"""

from __future__ import annotations

import functools
import math

from .scalars import float32, uint32, uint64

from . import bf16 as _bf16, ptx
from .._backend import cuda
from .common import (LOG2E, NEG_INF, dropout_uniform, make_key_range, make_score_mod, make_sequence_geometry,
                     make_user_mods)


def shared_bytes_dkdv_v1(D, B_r, B_c):
    """Q_i and dO_i (B_r, D) float32, L_i and D_i (B_r,) float32."""
    return (2 * B_r * D + 2 * B_r) * 4


def shared_bytes_dq_v1(D, B_r, B_c):
    """K_j and V_j (B_c, D) float32."""
    return 2 * B_c * D * 4


@functools.lru_cache(maxsize=None)
def make_backward_preprocess(D, B_r, bf16=False):
    """D_i = rowsum(dO_i * O_i), one thread per row. Launch: grid (ceil(seqlen_q / B_r), batch * nheads), block
    (B_r,). The simplest version, and the one the simulator runs (a thread per row is 32x fewer simulated
    threads than :func:`make_backward_preprocess_warp`, which GPUs run)."""
    load, _ = _bf16.load_store(bf16)

    @cuda.jit
    def backward_preprocess(dout, out, delta):
        nheads = out.shape[2]
        seqlen_q = out.shape[1]
        b = cuda.blockIdx.y // nheads
        h = cuda.blockIdx.y % nheads
        i = cuda.blockIdx.x * B_r + cuda.threadIdx.x
        if i < seqlen_q:
            acc = float32(0.0)
            for c in range(D):
                acc += load(dout[b, i, h, c]) * load(out[b, i, h, c])
            delta[b, h, i] = acc

    return backward_preprocess


@functools.lru_cache(maxsize=None)
def make_backward_preprocess_warp(D, B_r, bf16=False):
    """D_i = rowsum(dO_i * O_i), one warp per row, B_r rows per block. Launch: grid (ceil(seqlen_q / B_r),
    batch * nheads), block (32 * B_r,).

    Lane l of a row's warp adds the products of columns l, l + 32, l + 64, ...: the 32 lanes read 32
    consecutive elements at each step, one contiguous segment of the row. (With a thread per row,
    :func:`make_backward_preprocess`, each load of a warp touches 32 rows, 32 separate segments: the kernel then
    waits on memory most of its time; docs/benchmarks.md has the profile.) The 32 partial sums are then added
    across the warp by shuffles: at each step a lane adds the sum of the lane ``s`` away (xor), s = 16, 8, 4, 2, 1,
    after which every lane holds the row's sum; no shared memory, no barrier. The batch and head come from the
    block by a 32-bit unsigned division (a signed 64-bit one is a subroutine of many instructions, which in a
    kernel this short is most of its work)."""
    load, _ = _bf16.load_store(bf16)

    @cuda.jit
    def backward_preprocess_warp(dout, out, delta):
        nheads = out.shape[2]
        seqlen_q = out.shape[1]
        b = uint32(cuda.blockIdx.y) // uint32(nheads)
        h = uint32(cuda.blockIdx.y) - b * uint32(nheads)
        w = cuda.threadIdx.x >> 5  # this warp's row within the block
        lane = cuda.threadIdx.x & 31
        i = cuda.blockIdx.x * B_r + w
        acc = float32(0.0)
        if i < seqlen_q:
            for c in range(lane, D, 32):
                acc += load(dout[b, i, h, c]) * load(out[b, i, h, c])
        s = 16
        while s > 0:  # (every lane of the warp takes part in each shuffle)
            acc += ptx.shfl_xor_f32(acc, s)
            s >>= 1
        if lane == 0 and i < seqlen_q:
            delta[b, h, i] = acc

    return backward_preprocess_warp


@functools.lru_cache(maxsize=None)
def make_backward_dkdv_v1(D, B_r, B_c, causal, bf16=False):
    """dK_j, dV_j for one key tile per block, one thread per key row.

    Launch: grid (ceil(seqlen_k / B_c), batch * nheads), block (B_c,). Shared memory: Q_i, dO_i (B_r, D), L_i,
    D_i (B_r,), :func:`shared_bytes_dkdv_v1` bytes. Thread t owns key row j = blockIdx.x * B_c + t.
    """
    load, store = _bf16.load_store(bf16)

    @cuda.jit
    def backward_dkdv_v1(dout, q, k, v, lse, delta, dk, dv, scale):
        nheads = q.shape[2]
        seqlen_q = q.shape[1]
        seqlen_k = k.shape[1]
        t = cuda.threadIdx.x
        b = cuda.blockIdx.y // nheads
        h = cuda.blockIdx.y % nheads
        j = cuda.blockIdx.x * B_c + t  # this thread's key row
        diag = seqlen_k - seqlen_q  # causal: row i sees key j iff j <= i + diag

        Q_i = cuda.shared.array((B_r, D), float32)  # (B_r, D) fp32, shared
        dO_i = cuda.shared.array((B_r, D), float32)  # (B_r, D) fp32, shared
        L_i = cuda.shared.array(B_r, float32)  # (B_r,) lse
        D_i = cuda.shared.array(B_r, float32)  # (B_r,) rowsum(dO * O)
        k_j = cuda.local.array(D, float32)  # (D,)
        v_j = cuda.local.array(D, float32)  # (D,)
        dk_j = cuda.local.array(D, float32)  # (D,) accumulates sum_i dS_ij q_i
        dv_j = cuda.local.array(D, float32)  # (D,) accumulates sum_i P_ij dO_i

        col_ok = j < seqlen_k
        for c in range(D):
            k_j[c] = load(k[b, j, h, c]) if col_ok else float32(0.0)
            v_j[c] = load(v[b, j, h, c]) if col_ok else float32(0.0)
            dk_j[c] = 0.0
            dv_j[c] = 0.0

        # Query tiles that can see this key tile: causal rows i >= j0 - diag only.
        m_start = 0
        if causal:
            m_start = max(0, cuda.blockIdx.x * B_c - diag) // B_r * B_r
        for i0 in range(m_start, seqlen_q, B_r):
            # Load Q_i, dO_i, L_i, D_i: the B_c threads stride over the tile; rows past seqlen_q are zero.
            for e in range(t, B_r * D, B_c):
                r = e // D
                c = e % D
                ok = i0 + r < seqlen_q
                Q_i[r, c] = load(q[b, i0 + r, h, c]) if ok else float32(0.0)
                dO_i[r, c] = load(dout[b, i0 + r, h, c]) if ok else float32(0.0)
            for r in range(t, B_r, B_c):
                ok = i0 + r < seqlen_q
                L_i[r] = lse[b, h, i0 + r] if ok else NEG_INF
                D_i[r] = delta[b, h, i0 + r] if ok else float32(0.0)
            cuda.syncthreads()  # the Q_i tile is complete before any thread reads it

            if col_ok:
                for r in range(B_r):
                    i = i0 + r
                    if i >= seqlen_q or (causal and j > i + diag) or L_i[r] == NEG_INF:
                        continue  # P_ij = 0: masked, past the end, or a row that saw no key
                    # P_ij = exp(scale * q_i . k_j - L_i);  dP_ij = dO_i . v_j
                    s = float32(0.0)
                    dp = float32(0.0)
                    for c in range(D):
                        s += Q_i[r, c] * k_j[c]
                        dp += dO_i[r, c] * v_j[c]
                    p = float32(math.exp2((s * scale - L_i[r]) * LOG2E))
                    ds = p * (dp - D_i[r])  # dS_ij = P_ij (dP_ij - D_i)
                    for c in range(D):
                        dv_j[c] += p * dO_i[r, c]  # dV_j += P_ij dO_i
                        dk_j[c] += ds * Q_i[r, c]  # dK_j += dS_ij Q_i (times scale below)
            cuda.syncthreads()  # all threads are done with Q_i before the next tile overwrites it

        if col_ok:
            for c in range(D):
                dk[b, j, h, c] = store(dk_j[c] * scale)
                dv[b, j, h, c] = store(dv_j[c])

    return backward_dkdv_v1


@functools.lru_cache(maxsize=None)
def make_backward_dq_v1(D, B_r, B_c, causal, bf16=False):
    """dQ_i for one query tile per block, one thread per query row; no atomics.

    Launch: grid (ceil(seqlen_q / B_r), batch * nheads), block (B_r,). Shared memory: K_j, V_j (B_c, D),
    :func:`shared_bytes_dq_v1` bytes. Thread t owns query row i = blockIdx.x * B_r + t.
    """
    load, store = _bf16.load_store(bf16)
    key_range = make_key_range(B_r, B_c, False, causal)  # causal: the band's right bound, right = 0

    @cuda.jit
    def backward_dq_v1(dout, q, k, v, lse, delta, dq, scale):
        nheads = q.shape[2]
        seqlen_q = q.shape[1]
        seqlen_k = k.shape[1]
        t = cuda.threadIdx.x
        b = cuda.blockIdx.y // nheads
        h = cuda.blockIdx.y % nheads
        i = cuda.blockIdx.x * B_r + t
        diag = seqlen_k - seqlen_q

        K_j = cuda.shared.array((B_c, D), float32)  # (B_c, D) fp32, shared
        V_j = cuda.shared.array((B_c, D), float32)  # (B_c, D) fp32, shared
        q_i = cuda.local.array(D, float32)  # (D,)
        do_i = cuda.local.array(D, float32)  # (D,)
        dq_i = cuda.local.array(D, float32)  # (D,) accumulates sum_j dS_ij k_j

        row_ok = i < seqlen_q
        L = NEG_INF
        D_row = float32(0.0)
        if row_ok:
            L = lse[b, h, i]
            D_row = delta[b, h, i]
        for c in range(D):
            q_i[c] = load(q[b, i, h, c]) if row_ok else float32(0.0)
            do_i[c] = load(dout[b, i, h, c]) if row_ok else float32(0.0)
            dq_i[c] = 0.0

        _, n_end = key_range(cuda.blockIdx.x * B_r, seqlen_q, seqlen_k, diag, 0, 0)
        for j0 in range(0, n_end, B_c):
            for e in range(t, B_c * D, B_r):
                r = e // D
                c = e % D
                ok = j0 + r < seqlen_k
                K_j[r, c] = load(k[b, j0 + r, h, c]) if ok else float32(0.0)
                V_j[r, c] = load(v[b, j0 + r, h, c]) if ok else float32(0.0)
            cuda.syncthreads()  # K_j, V_j complete before any thread reads them

            if row_ok and L != NEG_INF:
                for jj in range(B_c):
                    j = j0 + jj
                    if j >= seqlen_k or (causal and j > i + diag):
                        continue  # masked: P_ij = 0
                    s = float32(0.0)
                    dp = float32(0.0)
                    for c in range(D):
                        s += q_i[c] * K_j[jj, c]
                        dp += do_i[c] * V_j[jj, c]
                    p = float32(math.exp2((s * scale - L) * LOG2E))
                    ds = p * (dp - D_row)
                    for c in range(D):
                        dq_i[c] += ds * K_j[jj, c]  # dQ_i += dS_ij K_j (times scale below)
            cuda.syncthreads()  # all threads are done with K_j, V_j before the next tile overwrites them

        if row_ok:
            for c in range(D):
                dq[b, i, h, c] = store(dq_i[c] * scale)

    return backward_dq_v1


# ---------------------------------------------------------------------------------------------------------------
# v2: register-tiled, as the forward kernel v3 (8 threads share a row group; unsigned shared-memory indices)
# ---------------------------------------------------------------------------------------------------------------

TX = 8  # threads that share one row group of a score tile


def _tiling(rows, cols, D, num_threads, rows_name, cols_name):
    """(TY, TM, TN, DC) for a (rows x cols) score tile over num_threads threads laid out as (TY, 8)."""
    if num_threads % 32 or not 32 <= num_threads <= 1024:
        raise ValueError(f"num_threads must be a multiple of 32 in [32, 1024], got {num_threads}")
    TY = num_threads // TX
    if cols % TX:
        raise ValueError(f"{cols_name} must be a multiple of {TX} for the backward kernel v2, got {cols}")
    if rows % TY:
        raise ValueError(f"{rows_name} must be a multiple of num_threads/{TX} = {TY} for the backward kernel v2, "
                         f"got {rows}")
    return TY, rows // TY, cols // TX, (D + TX - 1) // TX


def _layout_dkdv_v2(D, B_r, B_c):
    """Word offsets of the dK/dV kernel's shared buffers: K_j^T, V_j^T (D, B_c+1); Q_i^T, dO_i^T (D, B_r+1);
    Q_i, dO_i (B_r, D); P_ij, dS_ij stored [query][key] (B_r, B_c+1); L_i, D_i (B_r,). Returns offsets, total."""
    KS, QS, PS = B_c + 1, B_r + 1, B_c + 1
    sizes = [D * KS, D * KS, D * QS, D * QS, B_r * D, B_r * D, B_r * PS, B_r * PS, B_r, B_r]
    offs = [sum(sizes[:n]) for n in range(len(sizes))]
    return (KS, QS, PS, *offs, sum(sizes))


def _layout_dq_v2(D, B_r, B_c):
    """Word offsets of the dQ kernel's shared buffers: Q_i^T, dO_i^T (D, B_r+1); K_j^T, V_j^T (D, B_c+1);
    K_j (B_c, D); dS_ij stored [key][query] (B_c, B_r+1). Returns offsets, total."""
    QS, KS, SS = B_r + 1, B_c + 1, B_r + 1
    sizes = [D * QS, D * QS, D * KS, D * KS, B_c * D, B_c * SS]
    offs = [sum(sizes[:n]) for n in range(len(sizes))]
    return (QS, KS, SS, *offs, sum(sizes))


def shared_bytes_dkdv_v2(D, B_r, B_c):
    return _layout_dkdv_v2(D, B_r, B_c)[-1] * 4


def shared_bytes_dq_v2(D, B_r, B_c):
    return _layout_dq_v2(D, B_r, B_c)[-1] * 4


def check_blocks_v2(D, B_r, B_c, num_threads):
    """Raise ValueError unless (B_r, B_c, num_threads) tile both v2 kernels."""
    _tiling(B_c, B_r, D, num_threads, "block_n", "block_m")  # dK/dV: rows are keys, columns queries
    _tiling(B_r, B_c, D, num_threads, "block_m", "block_n")  # dQ: rows are queries, columns keys


@functools.lru_cache(maxsize=None)
def make_backward_dkdv_v2(D, B_r, B_c, num_threads, variant, bf16=False, mods=None):
    """dK_j, dV_j for one key tile per block, register-tiled.

    Launch: grid (ceil(seqlen_k / B_c), batch * nheads_k), block (num_threads,), dynamic shared memory
    :func:`shared_bytes_dkdv_v2`. Thread (ty, tx) owns key rows ty*TM + rr of the tile and, in the
    (B_c x B_r) tiles S^T and dP^T, query columns tx + 8n; in dK and dV, feature columns tx + 8n.

    Per query tile i:  S^T = K_j Q_i^T and dP^T = V_j dO_i^T (registers, TM x TN);  P^T, dS^T to shared;
    dV_j += P^T dO_i and dK_j += dS^T Q_i (registers, TM x DC). With GQA the block loops over the query heads
    that share its key/value head, in order, so dK and dV are summed deterministically. ``variant`` and
    ``bf16`` and ``mods`` as in :func:`flashnumba.kernels.simt_forward.make_forward_v2` (the user's score_mod
    enters dS through its derivative, ``score_mod_grad``).
    """
    load, store = _bf16.load_store(bf16)
    HAS_LEFT, HAS_RIGHT, SOFTCAP, ALIBI, VARLEN, DROPOUT = variant
    score_mod = make_score_mod(SOFTCAP, ALIBI)
    USER_SCORE = mods is not None and mods.score_mod is not None
    USER_MASK = mods is not None and mods.mask_mod is not None
    user_score, user_mask = make_user_mods(mods)
    sequence = make_sequence_geometry(VARLEN)
    I = uint64  # noqa: E741  (unsigned indices, shared and global: see simt_forward.make_forward_v3)
    TY, TM, TN, DC = _tiling(B_c, B_r, D, num_threads, "block_n", "block_m")
    KS, QS, PS, OFF_KT, OFF_VT, OFF_QT, OFF_OT, OFF_Q, OFF_O, OFF_P, OFF_S, OFF_L, OFF_D, _ = (
        I(x) for x in _layout_dkdv_v2(D, B_r, B_c))
    NT = num_threads
    uD = I(D)

    @cuda.jit
    def backward_dkdv_v2(dout, q, k, v, lse, delta, dk, dv, scale, softcap, left, right, alibi, cu_q, cu_k, p_drop,
                         rp_keep, seed, offset, a0, a1, a2, a3):
        nheads = q.shape[2]
        nheads_k = k.shape[2]
        group = nheads // nheads_k  # query heads per key/value head
        seqlen_q = q.shape[1]
        seqlen_k = k.shape[1]
        t = cuda.threadIdx.x
        ty = t // TX
        tx = t % TX
        b = cuda.blockIdx.y // nheads_k
        hk = cuda.blockIdx.y % nheads_k
        j0 = cuda.blockIdx.x * B_c
        bb, q0, k0, seqlen_q, seqlen_k = sequence(b, seqlen_q, seqlen_k, cu_q, cu_k)
        diag = seqlen_k - seqlen_q  # row i sees key j iff i + diag - left <= j <= i + diag + right
        if j0 >= seqlen_k:  # (VARLEN) a block past the end of a shorter sequence: nothing to do
            return

        smem = cuda.shared.array(0, float32)
        # K_j^T, V_j^T (D, B_c) at OFF_KT, OFF_VT (row stride KS); Q_i^T, dO_i^T (D, B_r) at OFF_QT, OFF_OT
        # (stride QS); Q_i, dO_i (B_r, D) at OFF_Q, OFF_O; P_ij, dS_ij (B_r, B_c) at OFF_P, OFF_S (stride PS);
        # L_i, D_i (B_r,) at OFF_L, OFF_D.
        S = cuda.local.array((TM, TN), float32)  # S^T, then P^T: keys x queries
        dP = cuda.local.array((TM, TN), float32)  # dP^T, then dS^T
        dV = cuda.local.array((TM, DC), float32)
        dK = cuda.local.array((TM, DC), float32)
        qc = cuda.local.array(TN, float32)
        oc = cuda.local.array(TN, float32)
        a_r = cuda.local.array(DC, float32)
        b_r = cuda.local.array(DC, float32)

        # K_j^T, V_j^T once; keys past seqlen_k are zero.
        for e in range(t, B_c * D, NT):
            jj = e // D
            c = e % D
            kx = float32(0.0)
            vx = float32(0.0)
            if j0 + jj < seqlen_k:
                kx = load(k[I(bb), I(k0 + j0 + jj), I(hk), I(c)])
                vx = load(v[I(bb), I(k0 + j0 + jj), I(hk), I(c)])
            smem[OFF_KT + I(c) * KS + I(jj)] = kx
            smem[OFF_VT + I(c) * KS + I(jj)] = vx
        for rr in range(TM):
            for n in range(DC):
                dV[rr, n] = 0.0
                dK[rr, n] = 0.0

        # Query rows that can see this key tile: i >= j0 - diag - right and i <= j_last - diag + left.
        m_start = 0
        m_end = seqlen_q
        if HAS_RIGHT:
            m_start = max(0, j0 - diag - right) // B_r * B_r
        if HAS_LEFT:
            m_end = max(0, min(seqlen_q, min(j0 + B_c, seqlen_k) - diag + left))
        for g in range(group):  # the query heads that share key/value head hk, in order (deterministic sum)
            h = hk * group + g
            slope = alibi[I(b), I(h)] if ALIBI else float32(0.0)
            for i0 in range(m_start, m_end, B_r):
                # Q_i, dO_i in both layouts, L_i, D_i; rows past seqlen_q are zero (L = -inf: no P).
                for e in range(t, B_r * D, NT):
                    r = e // D
                    c = e % D
                    qx = float32(0.0)
                    ox = float32(0.0)
                    if i0 + r < seqlen_q:
                        qx = load(q[I(bb), I(q0 + i0 + r), I(h), I(c)])
                        ox = load(dout[I(bb), I(q0 + i0 + r), I(h), I(c)])
                    smem[OFF_QT + I(c) * QS + I(r)] = qx
                    smem[OFF_OT + I(c) * QS + I(r)] = ox
                    smem[OFF_Q + I(r) * uD + I(c)] = qx
                    smem[OFF_O + I(r) * uD + I(c)] = ox
                for r in range(t, B_r, NT):
                    ok = i0 + r < seqlen_q
                    smem[OFF_L + I(r)] = lse[I(bb), I(h), I(q0 + i0 + r)] if ok else NEG_INF
                    smem[OFF_D + I(r)] = delta[I(bb), I(h), I(q0 + i0 + r)] if ok else float32(0.0)
                cuda.syncthreads()  # K^T, V^T (first tile), Q_i, dO_i, L_i, D_i complete before they are read

                # S^T = K_j Q_i^T and dP^T = V_j dO_i^T, this thread's (TM, TN) patch
                for rr in range(TM):
                    for n in range(TN):
                        S[rr, n] = 0.0
                        dP[rr, n] = 0.0
                for c in range(D):
                    q_row = OFF_QT + I(c) * QS + I(tx)  # Q_i^T[c, tx::8]
                    o_row = OFF_OT + I(c) * QS + I(tx)  # dO_i^T[c, tx::8]
                    for n in range(TN):
                        qc[n] = smem[q_row + I(TX * n)]
                        oc[n] = smem[o_row + I(TX * n)]
                    k_row = OFF_KT + I(c) * KS + I(ty * TM)  # K_j^T[c, ty*TM : ty*TM + TM]
                    v_row = OFF_VT + I(c) * KS + I(ty * TM)
                    for rr in range(TM):
                        kv = smem[k_row + I(rr)]
                        vv = smem[v_row + I(rr)]
                        for n in range(TN):
                            S[rr, n] += kv * qc[n]
                            dP[rr, n] += vv * oc[n]

                # P_ij = exp(scale S_ij - L_i) (0 where masked);  dS_ij = P_ij (dP_ij - D_i);  both to shared
                for rr in range(TM):
                    j = j0 + ty * TM + rr
                    for n in range(TN):
                        r = tx + TX * n
                        i = i0 + r
                        L = smem[OFF_L + I(r)]
                        p = float32(0.0)
                        # the score as the forward formed it; dcap = d(modified score) / d(scale q.k)
                        x, dcap = score_mod(S[rr, n] * scale, softcap, slope, i, j, diag)
                        if (j < seqlen_k and L != NEG_INF and (not HAS_LEFT or j >= i + diag - left)
                                and (not HAS_RIGHT or j <= i + diag + right)
                                and (not USER_MASK or user_mask(b, h, i, j, a0, a1, a2, a3))):
                            if USER_SCORE:  # (L != -inf: row i lies within the sequence)
                                x, dmod = user_score(x, b, h, i, j, a0, a1, a2, a3)
                                dcap *= dmod
                            p = float32(math.exp2((x - L) * LOG2E))
                        z = float32(1.0)  # Z_ij: the forward's dropout mask times 1 / (1 - p_drop), regenerated
                        if DROPOUT:
                            u = dropout_uniform(seed, offset, b * nheads + h, i, j)
                            z = rp_keep if u >= p_drop else float32(0.0)
                        smem[OFF_P + I(r) * PS + I(ty * TM + rr)] = p * z  # dV_j uses the dropped P
                        smem[OFF_S + I(r) * PS + I(ty * TM + rr)] = p * (z * dP[rr, n] - smem[OFF_D + I(r)]) * dcap
                cuda.syncthreads()  # P_ij and dS_ij complete

                # dV_j += P_ij^T dO_i;  dK_j += dS_ij^T Q_i  (times scale at the end)
                for r in range(B_r):
                    o_row = OFF_O + I(r) * uD + I(tx)  # dO_i[r, tx::8]
                    q_row = OFF_Q + I(r) * uD + I(tx)  # Q_i[r, tx::8]
                    for n in range(DC):
                        inside = tx + TX * n < D
                        a_r[n] = smem[o_row + I(TX * n)] if inside else float32(0.0)
                        b_r[n] = smem[q_row + I(TX * n)] if inside else float32(0.0)
                    p_row = OFF_P + I(r) * PS + I(ty * TM)
                    s_row = OFF_S + I(r) * PS + I(ty * TM)
                    for rr in range(TM):
                        p = smem[p_row + I(rr)]
                        ds = smem[s_row + I(rr)]
                        for n in range(DC):
                            dV[rr, n] += p * a_r[n]
                            dK[rr, n] += ds * b_r[n]
                cuda.syncthreads()  # all reads of this query tile done before the next one overwrites it

        for rr in range(TM):
            j = j0 + ty * TM + rr
            if j < seqlen_k:
                for n in range(DC):
                    c = tx + TX * n
                    if c < D:
                        dk[I(bb), I(k0 + j), I(hk), I(c)] = store(dK[rr, n] * scale)
                        dv[I(bb), I(k0 + j), I(hk), I(c)] = store(dV[rr, n])

    return backward_dkdv_v2


@functools.lru_cache(maxsize=None)
def make_backward_dq_v2(D, B_r, B_c, num_threads, variant, bf16=False, mods=None):
    """dQ_i for one query tile per block, register-tiled; no atomics.

    Launch: grid (ceil(seqlen_q / B_r), batch * nheads), block (num_threads,), dynamic shared memory
    :func:`shared_bytes_dq_v2`. Thread (ty, tx) owns query rows ty*TM + rr and, in S and dP, key columns
    tx + 8n; in dQ, feature columns tx + 8n.

    Per key tile j:  S = Q_i K_j^T, dP = dO_i V_j^T (registers);  dS^T to shared;  dQ_i += dS K_j.
    ``variant``, ``bf16`` and ``mods`` as in :func:`flashnumba.kernels.simt_forward.make_forward_v2`.
    """
    load, store = _bf16.load_store(bf16)
    HAS_LEFT, HAS_RIGHT, SOFTCAP, ALIBI, VARLEN, DROPOUT = variant
    score_mod = make_score_mod(SOFTCAP, ALIBI, float32_distance=True)  # (not the dK/dV kernel: more registers)
    USER_SCORE = mods is not None and mods.score_mod is not None
    USER_MASK = mods is not None and mods.mask_mod is not None
    user_score, user_mask = make_user_mods(mods)
    key_range = make_key_range(B_r, B_c, HAS_LEFT, HAS_RIGHT)
    sequence = make_sequence_geometry(VARLEN)
    I = uint64  # noqa: E741
    TY, TM, TN, DC = _tiling(B_r, B_c, D, num_threads, "block_m", "block_n")
    QS, KS, SS, OFF_QT, OFF_OT, OFF_KT, OFF_VT, OFF_K, OFF_S, _ = (I(x) for x in _layout_dq_v2(D, B_r, B_c))
    NT = num_threads
    uD = I(D)

    @cuda.jit
    def backward_dq_v2(dout, q, k, v, lse, delta, dq, scale, softcap, left, right, alibi, cu_q, cu_k, p_drop, rp_keep,
                       seed, offset, a0, a1, a2, a3):
        nheads = q.shape[2]
        seqlen_q = q.shape[1]
        seqlen_k = k.shape[1]
        t = cuda.threadIdx.x
        ty = t // TX
        tx = t % TX
        b = cuda.blockIdx.y // nheads
        h = cuda.blockIdx.y % nheads
        hk = h // (nheads // k.shape[2])  # the key/value head of query head h (GQA / MQA)
        i0 = cuda.blockIdx.x * B_r
        bb, q0, k0, seqlen_q, seqlen_k = sequence(b, seqlen_q, seqlen_k, cu_q, cu_k)
        diag = seqlen_k - seqlen_q  # row i sees key j iff i + diag - left <= j <= i + diag + right
        slope = alibi[I(b), I(h)] if ALIBI else float32(0.0)
        if i0 >= seqlen_q:  # (VARLEN) a block past the end of a shorter sequence: nothing to do
            return

        smem = cuda.shared.array(0, float32)
        # Q_i^T, dO_i^T (D, B_r) at OFF_QT, OFF_OT (stride QS); K_j^T, V_j^T (D, B_c) at OFF_KT, OFF_VT
        # (stride KS); K_j (B_c, D) at OFF_K; dS_ij stored [key][query] (B_c, B_r) at OFF_S (stride SS).
        S = cuda.local.array((TM, TN), float32)
        dP = cuda.local.array((TM, TN), float32)
        dQ = cuda.local.array((TM, DC), float32)
        L = cuda.local.array(TM, float32)  # L_i of this thread's rows
        Di = cuda.local.array(TM, float32)  # D_i of this thread's rows
        kc = cuda.local.array(TN, float32)
        vc = cuda.local.array(TN, float32)
        k_r = cuda.local.array(DC, float32)

        for e in range(t, B_r * D, NT):
            r = e // D
            c = e % D
            qx = float32(0.0)
            ox = float32(0.0)
            if i0 + r < seqlen_q:
                qx = load(q[I(bb), I(q0 + i0 + r), I(h), I(c)])
                ox = load(dout[I(bb), I(q0 + i0 + r), I(h), I(c)])
            smem[OFF_QT + I(c) * QS + I(r)] = qx
            smem[OFF_OT + I(c) * QS + I(r)] = ox
        for rr in range(TM):
            i = i0 + ty * TM + rr
            L[rr] = lse[I(bb), I(h), I(q0 + i)] if i < seqlen_q else NEG_INF
            Di[rr] = delta[I(bb), I(h), I(q0 + i)] if i < seqlen_q else float32(0.0)
            for n in range(DC):
                dQ[rr, n] = 0.0

        n_start, n_end = key_range(i0, seqlen_q, seqlen_k, diag, left, right)
        for j0 in range(n_start, n_end, B_c):
            for e in range(t, B_c * D, NT):
                jj = e // D
                c = e % D
                kx = float32(0.0)
                vx = float32(0.0)
                if j0 + jj < seqlen_k:
                    kx = load(k[I(bb), I(k0 + j0 + jj), I(hk), I(c)])
                    vx = load(v[I(bb), I(k0 + j0 + jj), I(hk), I(c)])
                smem[OFF_KT + I(c) * KS + I(jj)] = kx
                smem[OFF_VT + I(c) * KS + I(jj)] = vx
                smem[OFF_K + I(jj) * uD + I(c)] = kx
            cuda.syncthreads()  # Q_i^T, dO_i^T (first tile), K_j, V_j complete before they are read

            # S = Q_i K_j^T and dP = dO_i V_j^T, this thread's (TM, TN) patch
            for rr in range(TM):
                for n in range(TN):
                    S[rr, n] = 0.0
                    dP[rr, n] = 0.0
            for c in range(D):
                k_row = OFF_KT + I(c) * KS + I(tx)
                v_row = OFF_VT + I(c) * KS + I(tx)
                for n in range(TN):
                    kc[n] = smem[k_row + I(TX * n)]
                    vc[n] = smem[v_row + I(TX * n)]
                q_row = OFF_QT + I(c) * QS + I(ty * TM)
                o_row = OFF_OT + I(c) * QS + I(ty * TM)
                for rr in range(TM):
                    qv = smem[q_row + I(rr)]
                    ov = smem[o_row + I(rr)]
                    for n in range(TN):
                        S[rr, n] += qv * kc[n]
                        dP[rr, n] += ov * vc[n]

            # dS_ij = P_ij (dP_ij - D_i), P_ij = exp(scale S_ij - L_i), 0 where masked; to shared as dS^T
            for rr in range(TM):
                i = i0 + ty * TM + rr
                for n in range(TN):
                    jj = tx + TX * n
                    j = j0 + jj
                    ds = float32(0.0)
                    if (j < seqlen_k and L[rr] != NEG_INF and (not HAS_LEFT or j >= i + diag - left)
                            and (not HAS_RIGHT or j <= i + diag + right)
                            and (not USER_MASK or user_mask(b, h, i, j, a0, a1, a2, a3))):
                        # the score as the forward formed it; dcap = d(modified score) / d(scale q.k)
                        x, dcap = score_mod(S[rr, n] * scale, softcap, slope, i, j, diag)
                        if USER_SCORE:
                            x, dmod = user_score(x, b, h, i, j, a0, a1, a2, a3)
                            dcap *= dmod
                        p = float32(math.exp2((x - L[rr]) * LOG2E))
                        z = float32(1.0)  # Z_ij, as in the dK/dV kernel
                        if DROPOUT:
                            u = dropout_uniform(seed, offset, b * nheads + h, i, j)
                            z = rp_keep if u >= p_drop else float32(0.0)
                        ds = p * (z * dP[rr, n] - Di[rr]) * dcap
                    smem[OFF_S + I(jj) * SS + I(ty * TM + rr)] = ds
            cuda.syncthreads()  # dS_ij complete

            # dQ_i += dS_ij K_j  (times scale at the end)
            for jj in range(B_c):
                k_row = OFF_K + I(jj) * uD + I(tx)  # K_j[jj, tx::8]
                for n in range(DC):
                    k_r[n] = smem[k_row + I(TX * n)] if tx + TX * n < D else float32(0.0)
                s_row = OFF_S + I(jj) * SS + I(ty * TM)
                for rr in range(TM):
                    ds = smem[s_row + I(rr)]
                    for n in range(DC):
                        dQ[rr, n] += ds * k_r[n]
            cuda.syncthreads()  # all reads of K_j, V_j, dS_ij done before the next tile overwrites them

        for rr in range(TM):
            i = i0 + ty * TM + rr
            if i < seqlen_q:
                for n in range(DC):
                    c = tx + TX * n
                    if c < D:
                        dq[I(bb), I(q0 + i), I(h), I(c)] = store(dQ[rr, n] * scale)

    return backward_dq_v2
