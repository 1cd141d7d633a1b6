"""Forward kernels: FlashAttention-2, Algorithm 1, as Numba ``cuda.jit`` kernels.

Three versions, each a step from the blocked NumPy reference (:func:`flashnumba.reference.attention_forward_blocked`):

=========  ===========================================================  =========================================
version    what it adds                                                 what it costs
=========  ===========================================================  =========================================
``v1``     one thread per query row; K_j, V_j tiles in shared memory;    each thread re-reads the whole K_j tile;
           S row, q_i and O_i in thread-local arrays. ~The paper, line   O_i lives in local memory (d floats)
           by line.
``v2``     register tiling: each thread owns a (TM x TN) patch of S_ij   row max / row sum need a reduction across
           and a (TM x d/8) patch of O_i; Q_i, K_j^T, V_j and P_ij       the 8 threads of a row (through shared
           staged in shared memory; exp2 with log2(e) folded into the    memory); more shared memory (dynamic,
           scale; tiles outside the causal / window band skipped;        opted in above 48 KB)
           window, softcap, ALiBi, varlen and dropout as compile-time
           options (:class:`Variant`); GQA by a division in every
           kernel.
``v3``     v2 with unsigned index arithmetic: no negative-index          uint64 casts on every index, which the
           wraparound code per array access (the Numba-specific step;    reader must see past
           see :func:`make_forward_v3`). The default.
=========  ===========================================================  =========================================

All compute, for every query tile Q_i (B_r rows) of one (batch, head), over the key/value tiles j::

    S_ij = scale * Q_i K_j^T                    masked entries (j past seqlen_k, or causal) are -inf
    m_new = max(m_i, rowmax(S_ij))
    P_ij = exp(S_ij - m_new)
    l_i  = exp(m_i - m_new) * l_i + rowsum(P_ij)
    O_i  = exp(m_i - m_new) * O_i + P_ij V_j
    m_i  = m_new

then O_i / l_i and L_i = m_i + log(l_i). In the kernels S is kept in base 2 (scale * log2(e) is folded into Q),
so exp becomes exp2 and L_i = ln(2) * m_i + log(l_i). A row that sees no key keeps m_i = -inf and l_i = 0; it
writes O_i = 0 and L_i = -inf. Accumulation is float32 for every input dtype.

Every element of q, k, v is read through ``load`` (to float32) and every element of out is written through
``store`` (from float32): for float32 and float16 a plain conversion, for bfloat16 (uint16 bit patterns) the
conversions of :mod:`flashnumba.bf16`, chosen when the kernel is built.

Kernels are built by ``make_*`` factories, specialised on compile-time constants (head_dim D, block sizes,
causal for v1, a :class:`Variant` of options for v2/v3, ``bf16``), and cached per process.
"""

from __future__ import annotations

import functools
import math

from . import bf16 as _bf16
from .._backend import cuda
from .common import (LN2, LOG2E, NEG_INF, Variant, dropout_uniform, make_key_range, make_score_mod,
                     make_sequence_geometry, make_user_mods)
from .scalars import float32, int64, uint64


# ---------------------------------------------------------------------------------------------------------------
# v1: one thread per query row
# ---------------------------------------------------------------------------------------------------------------


def shared_bytes_v1(D, B_r, B_c):
    """Static shared memory of v1: K_j and V_j, (B_c, D) float32 each."""
    return 2 * B_c * D * 4


@functools.lru_cache(maxsize=None)
def make_forward_v1(D, B_r, B_c, causal, bf16=False):
    """Forward kernel v1: one thread per query row, K_j/V_j tiles in shared memory (bfloat16 arrays, as
    uint16 bit patterns, when ``bf16``).

    Launch: grid (ceil(seqlen_q / B_r), batch * nheads), block (B_r,). Thread t owns query row i = blockIdx.x *
    B_r + t: it keeps q_i (scaled), o_i (D floats) and s (B_c floats) in local memory and m_i, l_i in
    registers. Shared memory: K_j and V_j, 2 * B_c * D * 4 bytes.
    """
    load, store = _bf16.load_store(bf16)
    key_range = make_key_range(B_r, B_c, False, causal)  # causal: the band's right bound, right = 0

    @cuda.jit
    def forward_v1(q, k, v, out, lse, scale_log2):
        nheads = q.shape[2]
        seqlen_q = q.shape[1]
        seqlen_k = k.shape[1]
        t = cuda.threadIdx.x
        b = cuda.blockIdx.y // nheads
        h = cuda.blockIdx.y % nheads
        i = cuda.blockIdx.x * B_r + t  # this thread's query row
        diag = seqlen_k - seqlen_q  # causal: row i sees keys j <= i + diag

        K_j = cuda.shared.array((B_c, D), float32)  # (B_c, D) fp32, shared
        V_j = cuda.shared.array((B_c, D), float32)  # (B_c, D) fp32, shared
        q_i = cuda.local.array(D, float32)  # (D,) this row of Q, times scale * log2(e)
        o_i = cuda.local.array(D, float32)  # (D,) running un-normalised output
        s = cuda.local.array(B_c, float32)  # (B_c,) this row of S_ij (base 2)

        row_ok = i < seqlen_q
        for c in range(D):
            q_i[c] = load(q[b, i, h, c]) * scale_log2 if row_ok else float32(0.0)
            o_i[c] = 0.0
        m_i = NEG_INF
        l_i = float32(0.0)

        # Key tiles this block must visit: all of them, or (causal) up to the last key its last row sees.
        _, n_end = key_range(cuda.blockIdx.x * B_r, seqlen_q, seqlen_k, diag, 0, 0)

        for j0 in range(0, n_end, B_c):
            # Load K_j, V_j: the B_r threads stride over the B_c * D elements; rows past seqlen_k are zero.
            for e in range(t, B_c * D, B_r):
                r = e // D
                c = e % D
                if j0 + r < seqlen_k:
                    K_j[r, c] = load(k[b, j0 + r, h, c])
                    V_j[r, c] = load(v[b, j0 + r, h, c])
                else:
                    K_j[r, c] = 0.0
                    V_j[r, c] = 0.0
            cuda.syncthreads()  # K_j, V_j complete before any thread reads them

            if row_ok:
                # S_ij = scale * q_i K_j^T (base 2), masked entries -inf;  m_new = max(m_i, rowmax(S_ij))
                m_new = m_i
                for jj in range(B_c):
                    j = j0 + jj
                    x = NEG_INF
                    if j < seqlen_k and (not causal or j <= i + diag):
                        x = float32(0.0)
                        for c in range(D):
                            x += q_i[c] * K_j[jj, c]
                    s[jj] = x
                    m_new = max(m_new, x)
                m_use = m_new if m_new != NEG_INF else float32(0.0)  # no key seen yet: avoid -inf - -inf
                # P_ij = exp2(S_ij - m_new);  alpha = exp2(m_i - m_new) rescales what was accumulated so far
                alpha = float32(math.exp2(m_i - m_use))
                p_sum = float32(0.0)
                for c in range(D):
                    o_i[c] *= alpha
                for jj in range(B_c):
                    p = float32(math.exp2(s[jj] - m_use))  # exp2(-inf) = 0 for masked entries
                    p_sum += p
                    for c in range(D):
                        o_i[c] += p * V_j[jj, c]  # O_i += P_ij V_j
                l_i = alpha * l_i + p_sum
                m_i = m_new
            cuda.syncthreads()  # every row is done with K_j, V_j before the next tile overwrites them

        if row_ok:
            # O_i = O_i / l_i,  L_i = m_i + log(l_i) (back to natural log); a row that saw no key gets 0, -inf
            # (l_i is NaN, not 0, when an input was NaN: the NaN then reaches out and lse)
            inv_l = float32(1.0) / l_i if l_i != 0 else float32(0.0)
            for c in range(D):
                out[b, i, h, c] = store(o_i[c] * inv_l)
            lse[b, h, i] = float32(m_i * LN2 + math.log(l_i)) if l_i != 0 else NEG_INF

    return forward_v1


# ---------------------------------------------------------------------------------------------------------------
# v2: register-tiled
# ---------------------------------------------------------------------------------------------------------------

TX = 8  # threads that share one row group of S_ij (consecutive lanes of one warp)


def tiling_v2(D, B_r, B_c, num_threads):
    """Per-thread tile of v2: returns (TY, TM, TN, DC) or raises ValueError.

    The num_threads threads form a (TY, TX=8) grid. Thread (ty, tx) owns rows ty*TM + r (r < TM) of S_ij and
    O_i, columns tx + 8*n (n < TN) of S_ij and columns tx + 8*n (n < DC = ceil(D/8)) of O_i.
    """
    if num_threads % 32 or not 32 <= num_threads <= 1024:
        raise ValueError(f"num_threads must be a multiple of 32 in [32, 1024], got {num_threads}")
    TY = num_threads // TX
    if B_c % TX:
        raise ValueError(f"block_n must be a multiple of {TX} for kernels v2 and v3, got {B_c}")
    if B_r % TY:
        raise ValueError(f"block_m must be a multiple of num_threads/{TX} = {TY} for kernels v2 and v3, got {B_r}")
    return TY, B_r // TY, B_c // TX, (D + TX - 1) // TX


def _smem_layout_v2(D, B_r, B_c):
    """Offsets (in float32 words) of v2's shared buffers inside one dynamic shared array, and the total.

    Q_i^T (D, B_r+1), K_j^T (D, B_c+1), V_j (B_c, D), P_ij^T (B_c, B_r), red (B_r, 8). The +1 pads the rows
    of the transposed buffers so that the transposing stores (consecutive threads, consecutive d) fall in
    different banks.
    """
    QS = B_r + 1  # row stride of Q_i^T
    KS = B_c + 1  # row stride of K_j^T
    off_q = 0
    off_k = off_q + D * QS
    off_v = off_k + D * KS
    off_p = off_v + B_c * D
    off_red = off_p + B_c * B_r
    total = off_red + B_r * TX
    return QS, KS, off_q, off_k, off_v, off_p, off_red, total


def shared_bytes_v2(D, B_r, B_c):
    return _smem_layout_v2(D, B_r, B_c)[-1] * 4


@functools.lru_cache(maxsize=None)
def make_forward_v2(D, B_r, B_c, num_threads, variant, bf16=False, mods=None):
    """Forward kernel v2: register-tiled S_ij and O_i.

    ``variant`` = :class:`Variant` (has_left, has_right, softcap, alibi, varlen, dropout): which masks, score
    modifiers, sequence layout and dropout are compiled in; their values are kernel arguments. Causal is
    has_right with right = 0. Arguments: (q, k, v, out, lse, scale_q, softcap, left, right, alibi (batch,
    nheads), cu_q, cu_k (batch + 1,) int32, p_drop, rp_keep = 1 / (1 - p_drop), seed, offset (uint64)). With
    varlen, q, k, v, out are (1, total, nheads, d) views and lse (1, nheads, total_q).

    Launch: grid (ceil(seqlen_q / B_r), batch * nheads), block (num_threads,), dynamic shared memory
    :func:`shared_bytes_v2` bytes (for D=64, B_r=B_c=64: 68,096 bytes, 66.5 KiB; needs the >48 KB opt-in on the GPU).
    Thread (ty, tx) keeps in registers: S (TM x TN), O (TM x DC), m_i, l_i for its TM rows.

    Per key tile: load K_j^T, V_j; S = Q_i K_j^T from shared (TM + TN loads per TM * TN FMAs); row max and
    row sum reduced over the 8 threads of a row through ``red``; P_ij^T to shared; O += P_ij V_j.
    ``bf16``: q, k, v, out are bfloat16 (uint16 bit patterns). ``mods``: a user's score_mod and mask_mod
    (:class:`flashnumba.kernels.common.Mods`), applied after the built-in score modifications and masks; the
    arrays they read are the last arguments, a0 .. a3 (dummies where unused, as without ``mods``).
    """
    return _make_register_tiled(D, B_r, B_c, num_threads, variant, int64, bf16, mods)


@functools.lru_cache(maxsize=None)
def make_forward_v3(D, B_r, B_c, num_threads, variant, bf16=False, mods=None):
    """Forward kernel v3: v2 with unsigned index arithmetic (shared and global memory).

    The trick, specific to Numba: an array index of a *signed* integer type gets a negative-index wraparound
    (``i < 0 ? i + len : i``), five 64-bit integer instructions per access, which LLVM cannot remove when the
    index is a product of thread indices and loop counters. In v2's inner loops that is ~10 integer
    instructions per shared-memory load, for one or two FMAs. Unsigned indices (uint64: every operand,
    constants included, must be unsigned, or Numba promotes the mix to float64) skip the wraparound.
    The same holds for the 4-D global arrays (four wraparounds per element loaded); v3 indexes them unsigned
    too. The arithmetic is otherwise identical to v2.
    """
    return _make_register_tiled(D, B_r, B_c, num_threads, variant, uint64, bf16, mods)


def _make_register_tiled(D, B_r, B_c, num_threads, variant, I, bf16, mods=None):
    """The register-tiled forward kernel, with every array index computed in integer type ``I``."""
    load, store = _bf16.load_store(bf16)
    HAS_LEFT, HAS_RIGHT, SOFTCAP, ALIBI, VARLEN, DROPOUT = variant
    sequence = make_sequence_geometry(VARLEN)
    USER_SCORE = mods is not None and mods.score_mod is not None
    USER_MASK = mods is not None and mods.mask_mod is not None
    user_score, user_mask = make_user_mods(mods)
    # S is then formed in natural units, modified, and only then moved to base 2
    SCORE_MOD = SOFTCAP or ALIBI or USER_SCORE
    score_mod = make_score_mod(SOFTCAP, ALIBI, float32_distance=True)  # (ALiBi: no spills, a shorter loop)
    key_range = make_key_range(B_r, B_c, HAS_LEFT, HAS_RIGHT)
    TY, TM, TN, DC = tiling_v2(D, B_r, B_c, num_threads)
    QS, KS, OFF_Q, OFF_K, OFF_V, OFF_P, OFF_RED, _ = (I(x) for x in _smem_layout_v2(D, B_r, B_c))
    NT = num_threads
    uD, uB_r = I(D), I(B_r)

    @cuda.jit(fastmath=False)
    def forward_register_tiled(q, k, v, out, lse, scale_q, softcap, left, right, alibi, cu_q, cu_k, p_drop, rp_keep,
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
        diag = seqlen_k - seqlen_q  # row i sees keys i + diag - left <= j <= i + diag + right
        slope = alibi[I(b), I(h)] if ALIBI else float32(0.0)
        if i0 >= seqlen_q:  # (VARLEN) a block past the end of a shorter sequence: nothing to do
            return

        smem = cuda.shared.array(0, float32)  # views below are offsets into this one buffer
        # smem[OFF_Q + c*QS + r]   Q_i^T  (D, B_r) fp32, times scale_q (scale*log2(e), or scale)
        # smem[OFF_K + c*KS + jj]  K_j^T  (D, B_c) fp32
        # smem[OFF_V + jj*D + c]   V_j    (B_c, D) fp32
        # smem[OFF_P + jj*B_r + r] P_ij^T (B_c, B_r) fp32
        # smem[OFF_RED + r*8 + x]  red    (B_r, 8)  fp32, per-thread partial row max / row sum

        S = cuda.local.array((TM, TN), float32)  # this thread's patch of S_ij, then P_ij
        O = cuda.local.array((TM, DC), float32)  # this thread's patch of O_i
        m = cuda.local.array(TM, float32)  # m_i of its rows (base 2)
        l = cuda.local.array(TM, float32)  # l_i of its rows
        alpha = cuda.local.array(TM, float32)
        m_use = cuda.local.array(TM, float32)
        kr = cuda.local.array(TN, float32)  # K_j^T[c, tx::8], this thread's columns
        vr = cuda.local.array(DC, float32)  # V_j[jj, tx::8], this thread's columns

        # Load Q_i^T once, pre-scaled; rows past seqlen_q are zero.
        for e in range(t, B_r * D, NT):
            r = e // D
            c = e % D
            x = float32(0.0)
            if i0 + r < seqlen_q:
                x = load(q[I(bb), I(q0 + i0 + r), I(h), I(c)]) * scale_q
            smem[OFF_Q + I(c) * QS + I(r)] = x
        for rr in range(TM):
            m[rr] = NEG_INF
            l[rr] = 0.0
            for n in range(DC):
                O[rr, n] = 0.0

        # Key tiles this block must visit: those that intersect the band its rows see (causal / window).
        n_start, n_end = key_range(i0, seqlen_q, seqlen_k, diag, left, right)

        for j0 in range(n_start, n_end, B_c):
            # Load K_j^T and V_j; rows past seqlen_k are zero.
            for e in range(t, B_c * D, NT):
                jj = e // D
                c = e % D
                kx = float32(0.0)
                vx = float32(0.0)
                if j0 + jj < seqlen_k:
                    kx = load(k[I(bb), I(k0 + j0 + jj), I(hk), I(c)])
                    vx = load(v[I(bb), I(k0 + j0 + jj), I(hk), I(c)])
                smem[OFF_K + I(c) * KS + I(jj)] = kx
                smem[OFF_V + I(jj) * uD + I(c)] = vx
            cuda.syncthreads()  # Q_i^T (first tile), K_j^T, V_j complete before they are read

            # S_ij = Q_i K_j^T for this thread's (TM, TN) patch
            for rr in range(TM):
                for n in range(TN):
                    S[rr, n] = 0.0
            for c in range(D):
                q_row = OFF_Q + I(c) * QS + I(ty * TM)  # Q_i^T[c, ty*TM : ty*TM + TM]
                k_row = OFF_K + I(c) * KS + I(tx)  # K_j^T[c, tx :: 8]
                for n in range(TN):
                    kr[n] = smem[k_row + I(TX * n)]  # TN loads, reused by the TM rows
                for rr in range(TM):
                    qv = smem[q_row + I(rr)]
                    for n in range(TN):
                        S[rr, n] += qv * kr[n]

            # softcap, ALiBi, mask; and this thread's partial row max
            for rr in range(TM):
                i = i0 + ty * TM + rr
                mx = NEG_INF
                for n in range(TN):
                    j = j0 + tx + TX * n
                    x = S[rr, n]
                    inside = i < seqlen_q and j < seqlen_k  # (a user's functions may index by i and j)
                    if SCORE_MOD:  # x = scale q.k: cap it, add the ALiBi bias, the user's score_mod; base 2
                        x, _ = score_mod(x, softcap, slope, i, j, diag)
                        if USER_SCORE and inside:
                            x, _ = user_score(x, b, h, i, j, a0, a1, a2, a3)
                        x *= LOG2E
                    if j >= seqlen_k or (HAS_LEFT and j < i + diag - left) or (HAS_RIGHT and j > i + diag + right):
                        x = NEG_INF
                    elif USER_MASK and inside and not user_mask(b, h, i, j, a0, a1, a2, a3):
                        x = NEG_INF
                    S[rr, n] = x
                    mx = max(mx, x)
                smem[OFF_RED + I((ty * TM + rr) * TX + tx)] = mx
            cuda.syncthreads()  # partial row maxima visible to the row's 8 threads

            # m_new = max(m_i, rowmax(S_ij)); alpha = exp2(m_i - m_new); P_ij = exp2(S_ij - m_new)
            for rr in range(TM):
                mx = m[rr]
                for x in range(TX):
                    mx = max(mx, smem[OFF_RED + I((ty * TM + rr) * TX + x)])
                m_use[rr] = mx if mx != NEG_INF else float32(0.0)  # no key seen yet: avoid -inf - -inf
                alpha[rr] = float32(math.exp2(m[rr] - m_use[rr]))
                m[rr] = mx
            cuda.syncthreads()  # every thread has read its row maxima before red is reused for row sums

            for rr in range(TM):
                ps = float32(0.0)
                for n in range(TN):
                    p = float32(math.exp2(S[rr, n] - m_use[rr]))  # 0 for masked entries
                    ps += p  # l_i sums the probabilities before dropout: L_i is the true logsumexp
                    if DROPOUT:  # P_ij * Z_ij, Z_ij = keep / (1 - p_drop), keep drawn from (seed, offset, b, h, i, j)
                        u = dropout_uniform(seed, offset, b * nheads + h, i0 + ty * TM + rr, j0 + tx + TX * n)
                        p = p * rp_keep if u >= p_drop else float32(0.0)
                    smem[OFF_P + I(tx + TX * n) * uB_r + I(ty * TM + rr)] = p
                smem[OFF_RED + I((ty * TM + rr) * TX + tx)] = ps
            cuda.syncthreads()  # P_ij^T and the partial row sums complete

            # l_i = alpha * l_i + rowsum(P_ij);  O_i = alpha * O_i + P_ij V_j
            for rr in range(TM):
                ps = float32(0.0)
                for x in range(TX):
                    ps += smem[OFF_RED + I((ty * TM + rr) * TX + x)]
                l[rr] = alpha[rr] * l[rr] + ps
                for n in range(DC):
                    O[rr, n] *= alpha[rr]
            for jj in range(B_c):
                p_row = OFF_P + I(jj) * uB_r + I(ty * TM)  # P_ij^T[jj, ty*TM : ty*TM + TM]
                v_row = OFF_V + I(jj) * uD + I(tx)  # V_j[jj, tx :: 8]
                for n in range(DC):
                    vr[n] = smem[v_row + I(TX * n)] if tx + TX * n < D else float32(0.0)  # reused by TM rows
                for rr in range(TM):
                    p = smem[p_row + I(rr)]
                    for n in range(DC):
                        O[rr, n] += p * vr[n]
            cuda.syncthreads()  # all reads of K_j^T, V_j, P_ij^T, red done before the next tile overwrites them

        # O_i = O_i / l_i,  L_i = ln(2) m_i + log(l_i); a row that saw no key gets 0 and -inf
        for rr in range(TM):
            i = i0 + ty * TM + rr
            if i < seqlen_q:
                inv_l = float32(1.0) / l[rr] if l[rr] != 0 else float32(0.0)  # NaN l (NaN input) stays NaN
                for n in range(DC):
                    c = tx + TX * n
                    if c < D:
                        out[I(bb), I(q0 + i), I(h), I(c)] = store(O[rr, n] * inv_l)
                if tx == 0:
                    lse[I(bb), I(h), I(q0 + i)] = float32(m[rr] * LN2 + math.log(l[rr])) if l[rr] != 0 else NEG_INF

    return forward_register_tiled


# ---------------------------------------------------------------------------------------------------------------
# debugging: the probabilities themselves
# ---------------------------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def make_probs_kernel(D, variant, bf16=False):
    """P_ij Z_ij = exp(S_ij - L_i) times the dropout multiplier, written out in full (batch, nheads, seqlen_q,
    seqlen_k): the ``return_attn_probs`` debugging path, for small sizes. S_ij is formed exactly as in the
    register-tiled kernels (softcap, ALiBi, masks, GQA, dropout; not varlen) from the forward's L_i.

    Launch: grid (seqlen_q, batch * nheads), block (up to 128,): block (i, b*h) is one row, its threads stride
    over the keys j. ``bf16``: q and k are bfloat16 (uint16 bit patterns); probs is float32 always.
    """
    HAS_LEFT, HAS_RIGHT, SOFTCAP, ALIBI, VARLEN, DROPOUT = variant
    score_mod = make_score_mod(SOFTCAP, ALIBI)
    load, _ = _bf16.load_store(bf16)

    @cuda.jit
    def attn_probs(q, k, lse, probs, scale, softcap, left, right, alibi, p_drop, rp_keep, seed, offset):
        nheads = q.shape[2]
        seqlen_q = q.shape[1]
        seqlen_k = k.shape[1]
        i = cuda.blockIdx.x
        b = cuda.blockIdx.y // nheads
        h = cuda.blockIdx.y % nheads
        hk = h // (nheads // k.shape[2])
        diag = seqlen_k - seqlen_q
        L = lse[b, h, i]
        slope = alibi[b, h] if ALIBI else float32(0.0)
        for j in range(cuda.threadIdx.x, seqlen_k, cuda.blockDim.x):
            x = float32(0.0)
            for c in range(D):
                x += load(q[b, i, h, c]) * load(k[b, j, hk, c])
            x, _ = score_mod(x * scale, softcap, slope, i, j, diag)
            p = float32(0.0)
            if L != NEG_INF and (not HAS_LEFT or j >= i + diag - left) and (not HAS_RIGHT or j <= i + diag + right):
                p = float32(math.exp2((x - L) * LOG2E))
            if DROPOUT:
                u = dropout_uniform(seed, offset, b * nheads + h, i, j)
                p = p * rp_keep if u >= p_drop else float32(0.0)
            probs[b, h, i, j] = p

    return attn_probs
