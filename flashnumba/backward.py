"""Backward kernels: FlashAttention-2, Algorithm 2, recomputing P from Q, K and the saved logsumexp L.

Nothing of size seqlen_q x seqlen_k is stored. Given dO, Q, K, V, O and L (from the forward)::

    D_i   = rowsum(dO_i * O_i)                          (preprocess, one float per query row)
    P_ij  = exp(scale * Q_i K_j^T - L_i)                recomputed, masked entries 0
    dV_j += P_ij^T dO_i
    dP_ij = dO_i V_j^T
    dS_ij = P_ij * (dP_ij - D_i)
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
=================  =============================================================================================

P_ij is computed as exp2((scale * s - L_i) * log2(e)): the difference of the two large numbers is taken first,
in natural units, so that with large logits only the rounding of L_i itself (float32) limits the accuracy. Accumulation is float32 for every input dtype. A query row that saw no key has
L_i = -inf; its P_ij are 0 (masked), so its dQ_i is 0 and it adds nothing to dK, dV.
"""

from __future__ import annotations

import functools
import math

from numba import float32

from ._backend import cuda
from .forward import LOG2E, NEG_INF


def shared_bytes_dkdv_v1(D, B_r, B_c):
    """Q_i and dO_i (B_r, D) float32, L_i and D_i (B_r,) float32."""
    return (2 * B_r * D + 2 * B_r) * 4


def shared_bytes_dq_v1(D, B_r, B_c):
    """K_j and V_j (B_c, D) float32."""
    return 2 * B_c * D * 4


@functools.lru_cache(maxsize=None)
def make_backward_preprocess(D, B_r):
    """D_i = rowsum(dO_i * O_i). Launch: grid (ceil(seqlen_q / B_r), batch * nheads), block (B_r,)."""

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
                acc += float32(dout[b, i, h, c]) * float32(out[b, i, h, c])
            delta[b, h, i] = acc

    return backward_preprocess


@functools.lru_cache(maxsize=None)
def make_backward_dkdv_v1(D, B_r, B_c, causal):
    """dK_j, dV_j for one key tile per block, one thread per key row.

    Launch: grid (ceil(seqlen_k / B_c), batch * nheads), block (B_c,). Shared memory: Q_i, dO_i (B_r, D), L_i,
    D_i (B_r,), :func:`shared_bytes_dkdv_v1` bytes. Thread t owns key row j = blockIdx.x * B_c + t.
    """

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
            k_j[c] = float32(k[b, j, h, c]) if col_ok else float32(0.0)
            v_j[c] = float32(v[b, j, h, c]) if col_ok else float32(0.0)
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
                Q_i[r, c] = float32(q[b, i0 + r, h, c]) if ok else float32(0.0)
                dO_i[r, c] = float32(dout[b, i0 + r, h, c]) if ok else float32(0.0)
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
                dk[b, j, h, c] = dk_j[c] * scale
                dv[b, j, h, c] = dv_j[c]

    return backward_dkdv_v1


@functools.lru_cache(maxsize=None)
def make_backward_dq_v1(D, B_r, B_c, causal):
    """dQ_i for one query tile per block, one thread per query row; no atomics.

    Launch: grid (ceil(seqlen_q / B_r), batch * nheads), block (B_r,). Shared memory: K_j, V_j (B_c, D),
    :func:`shared_bytes_dq_v1` bytes. Thread t owns query row i = blockIdx.x * B_r + t.
    """

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
            q_i[c] = float32(q[b, i, h, c]) if row_ok else float32(0.0)
            do_i[c] = float32(dout[b, i, h, c]) if row_ok else float32(0.0)
            dq_i[c] = 0.0

        n_end = seqlen_k
        if causal:
            last_row = min(cuda.blockIdx.x * B_r + B_r, seqlen_q) - 1
            n_end = max(0, min(seqlen_k, last_row + diag + 1))
        for j0 in range(0, n_end, B_c):
            for e in range(t, B_c * D, B_r):
                r = e // D
                c = e % D
                ok = j0 + r < seqlen_k
                K_j[r, c] = float32(k[b, j0 + r, h, c]) if ok else float32(0.0)
                V_j[r, c] = float32(v[b, j0 + r, h, c]) if ok else float32(0.0)
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
                dq[b, i, h, c] = dq_i[c] * scale

    return backward_dq_v1
