"""Forward kernel for float32 inputs on tensor cores: TF32 ``mma.sync`` (m16n8k8), and 3xTF32 for float32 accuracy.

The structure of :mod:`flashnumba.kernels.mma_forward` (warps of 16 query rows, S and O accumulated in registers, the
online softmax on the accumulator fragments, cp.async double buffering), with float32 tiles in shared memory and
the TF32 instruction of :mod:`flashnumba.kernels.ptx` (its layout: ``ptx.MMA_TF32_DOC``):

- ``precision="tf32"``: every operand rounded to TF32 (10 mantissa bits, ``ptx.to_tf32``), one mma per product:
  the error of a float16-like input rounding (about 2^-11 relative per operand), at the tensor cores' speed.
- ``precision="3xtf32"``: each operand split into big + small (``ptx.split_tf32``), three mma per product,
  A B ~ A_small B_big + A_big B_small + A_big B_big (the small x small term, ~2^-22, dropped): about float32's
  accuracy, as CUTLASS's 3xTF32 GEMM.

Fragments without data movement between lanes. The S accumulator of an 8-key tile holds, in lane (g, t), the
columns 2t and 2t + 1; the A operand of P V over the same 8 keys wants the columns t and t + 4. The B operand of
S = Q K^T takes column n of the tile from key pi(n) = n // 2 + 4 (n % 2): then columns 2t, 2t + 1 of S are keys
t, t + 4, and the S fragment is already P's A fragment::

    a0 = P[g, t] = s[0]    a1 = P[g + 8, t] = s[2]    a2 = P[g, t + 4] = s[1]    a3 = P[g + 8, t + 4] = s[3]

The operands are read from shared memory one float at a time (``ldmatrix`` gives 16-bit pairs, and TF32 needs
each float rounded or split first). Rows are padded so that the 32 lanes' reads fall in 32 distinct banks:
K_j (read at row pi(g), column t) by 4 floats, V_j (row t, column g) by 8.

float32 only, head_dim 64 or 128, causal or not (no other option; use the SIMT kernels for those). The backward
in the same products: :mod:`flashnumba.kernels.mma_tf32_backward`.
"""

from __future__ import annotations

import functools
import math

from . import ptx
from .._backend import cuda
from .common import LN2, NEG_INF, make_key_range, make_launch_order
from .mma_tiles import WARP_ROWS, make_load_rows, tile_landed
from .scalars import float32, uint32

HEAD_DIMS = (64, 128)  # the head dims the TF32 kernels are built and tuned for

PRECISIONS = ("tf32", "3xtf32")
PAD_K = 4  # floats added to a row of Q_i and K_j: conflict-free reads of (row pi(g), column t)
PAD_V = 8  # floats added to a row of V_j: conflict-free reads of (row t, column g)


def shared_bytes(D, B_c, warps):
    """Q_i (16 warps rows) and two K_j, V_j buffers (B_c rows each), float32."""
    return (WARP_ROWS * warps * (D + PAD_K) + 2 * B_c * (D + PAD_K) + 2 * B_c * (D + PAD_V)) * 4


@functools.lru_cache(maxsize=None)
def make_tf32_ops(three):
    """(mma3, operand), the TF32 kernels' two device pieces for ``three`` (3xTF32) or TF32:

    - mma3(a_big, a_small, b_big, b_small, c0, c1, c2, c3, i0, i1, i2, i3) -> c + A B, a_*[i0..i3] the A
      registers, b_* (2,) the B registers; three products with 3xTF32, smallest first, one with TF32 (a_small and
      b_small unused). With 3xTF32 the three start from zero and their sum is added to c with float32 adds: an
      ``mma`` aligns its products and its accumulator to the largest and truncates, so chained into c each would
      truncate toward zero relative to the whole running sum, a few times float32's error over a row
      (``scripts/tf32_error_model.py``); from zero, only relative to this step's own products.
    - operand(x, big, small, i): x rounded (TF32) or split (3xTF32) into big[i], small[i]."""
    THREE = bool(three)

    @cuda.jit(device=True, inline=True)
    def mma3(a_big, a_small, b_big, b_small, c0, c1, c2, c3, i0, i1, i2, i3):
        if THREE:
            z = float32(0.0)
            d0, d1, d2, d3 = ptx.mma_m16n8k8_tf32(a_small[i0], a_small[i1], a_small[i2], a_small[i3], b_big[0],
                                                  b_big[1], z, z, z, z)
            d0, d1, d2, d3 = ptx.mma_m16n8k8_tf32(a_big[i0], a_big[i1], a_big[i2], a_big[i3], b_small[0],
                                                  b_small[1], d0, d1, d2, d3)
            d0, d1, d2, d3 = ptx.mma_m16n8k8_tf32(a_big[i0], a_big[i1], a_big[i2], a_big[i3], b_big[0], b_big[1],
                                                  d0, d1, d2, d3)
            return c0 + d0, c1 + d1, c2 + d2, c3 + d3
        return ptx.mma_m16n8k8_tf32(a_big[i0], a_big[i1], a_big[i2], a_big[i3], b_big[0], b_big[1], c0, c1, c2, c3)

    @cuda.jit(device=True, inline=True)
    def operand(x, big, small, i):
        if THREE:
            hi, lo = ptx.split_tf32(x)
            big[i] = hi
            small[i] = lo
        else:
            big[i] = ptx.to_tf32(x)

    return mma3, operand


@functools.lru_cache(maxsize=None)
def make_load_a_step(LD, three):
    """load_a_step(smem, e, big, small, i): the A registers of one 8-column step of a 16-row tile in shared memory
    (row stride LD floats) into big[i:i+4] (and small, 3xTF32), rounded or split (:func:`make_tf32_ops`):
    a0 = X[g, t], a1 = X[g + 8, t], a2 = X[g, t + 4], a3 = X[g + 8, t + 4], from the element ``e`` = (g's row,
    column t)."""
    _, operand = make_tf32_ops(three)

    @cuda.jit(device=True, inline=True)
    def load_a_step(smem, e, big, small, i):
        operand(smem[e], big, small, i)
        operand(smem[e + 8 * LD], big, small, i + 1)
        operand(smem[e + 4], big, small, i + 2)
        operand(smem[e + 8 * LD + 4], big, small, i + 3)

    return load_a_step


@functools.lru_cache(maxsize=None)
def make_forward_tf32(D, causal, precision, B_c, warps):
    """The TF32 forward kernel. Arguments: (q, k, v, out, lse, scale_log2), q, k, v, out (batch, seqlen,
    nheads, D) float32 C-contiguous, lse (batch, nheads, seqlen_q) float32. Launch: grid
    (ceil(seqlen_q / (16 warps)), batch * nheads), block (32 * warps,), dynamic shared memory :func:`shared_bytes`.
    """
    if D not in HEAD_DIMS:
        raise ValueError(f"the TF32 kernel supports head_dim in {HEAD_DIMS}, got {D}")
    if B_c % 8 or B_c <= 0:
        raise ValueError(f"B_c must be a positive multiple of 8, got {B_c}")
    if warps not in (1, 2, 4, 8):
        raise ValueError(f"warps must be 1, 2, 4 or 8, got {warps}")
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    THREE = precision == "3xtf32"
    B_R = WARP_ROWS * warps
    NT = 32 * warps
    LDK, LDV = D + PAD_K, D + PAD_V
    KD = D // 8  # k-steps of S = Q K^T (8 dims each)
    # Q_i's A registers are rounded once and kept for TF32. 3xTF32 re-reads and splits them at every key tile:
    # kept, their big and small parts (2 x 64 registers at D=128) beside O's would spill at D=128, and at D=64 they
    # hold the kernel at the 255-register limit, where the re-read runs as fast with 130
    Q_IN_REGS = not THREE
    QREGS = 4 * KD if Q_IN_REGS else 4  # (a local array's length must be a constant)
    NS = B_c // 8  # 8-key tiles of S (and k-steps of P V)
    NO = D // 8  # 8-dim tiles of O
    OFF_K = B_R * LDK  # K buffer 0; buffer 1 lies KBUF further on
    KBUF = B_c * LDK
    OFF_V = OFF_K + 2 * KBUF  # V buffer 0; buffer 1 lies VBUF further on
    VBUF = B_c * LDV
    load_q = make_load_rows(D, NT, LDK, 4, per_column=False)  # 4 floats per 16-byte copy
    load_v = make_load_rows(D, NT, LDV, 4, per_column=False)
    key_range = make_key_range(B_R, B_c, False, causal)  # causal: the band's right bound, right = 0
    launch_order_q = make_launch_order(True, causal)

    mma3, operand = make_tf32_ops(THREE)

    load_q_step = make_load_a_step(LDK, THREE)

    @cuda.jit
    def forward_tf32(q, k, v, out, lse, scale_log2):
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

        smem = cuda.shared.array(0, float32)  # Q_i | K buffers 0, 1 | V buffers 0, 1 (dynamic), shared
        qb = cuda.local.array(QREGS, uint32)  # Q_i's A registers (big parts), 4 per k-step
        qs = cuda.local.array(QREGS, uint32)  # (small parts, 3xTF32)
        bb = cuda.local.array(2, uint32)  # one B operand (big, small)
        bs = cuda.local.array(2, uint32)
        pb = cuda.local.array(4, uint32)  # one A operand of P (big, small)
        psm = cuda.local.array(4, uint32)
        s = cuda.local.array((NS, 4), float32)
        o = cuda.local.array((NO, 4), float32)
        m = cuda.local.array(2, float32)
        l = cuda.local.array(2, float32)
        alpha = cuda.local.array(2, float32)
        m_use = cuda.local.array(2, float32)
        for x in range(2):
            m[x] = NEG_INF
            l[x] = 0.0
        for n in range(NO):
            for x in range(4):
                o[n, x] = 0.0

        _, n_end = key_range(i0, seqlen_q, seqlen_k, diag, 0, 0)
        n_tiles = (n_end + B_c - 1) // B_c

        load_q(smem, 0, q, b, i0, seqlen_q, h, B_R, tid)
        if n_tiles > 0:
            load_q(smem, OFF_K, k, b, 0, seqlen_k, h, B_c, tid)
            load_v(smem, OFF_V, v, b, 0, seqlen_k, h, B_c, tid)
        ptx.cp_async_commit()

        for jt in range(n_tiles):
            j0 = jt * B_c
            kbuf = OFF_K + (jt & 1) * KBUF
            vbuf = OFF_V + (jt & 1) * VBUF
            if jt + 1 < n_tiles:  # tile j + 1 into the other buffers, freed by the barrier ending iteration j - 1
                load_q(smem, OFF_K + ((jt + 1) & 1) * KBUF, k, b, j0 + B_c, seqlen_k, h, B_c, tid)
                load_v(smem, OFF_V + ((jt + 1) & 1) * VBUF, v, b, j0 + B_c, seqlen_k, h, B_c, tid)
            tile_landed()  # tile j (and Q_i) landed and visible to every thread

            # S = Q_i K_j^T, 8 dims a step (A: load_q_step). B: column n of tile nn is key 8 nn + pi(n):
            # b0 = K[pi(g), t], b1 = K[pi(g), t + 4]
            if Q_IN_REGS:  # one S tile at a time (4 accumulators live), Q's registers rounded at the first tile
                if jt == 0:
                    for kk in range(KD):
                        load_q_step(smem, (r0 + g) * LDK + 8 * kk + t, qb, qs, 4 * kk)
                for nn in range(NS):
                    c0 = float32(0.0)
                    c1 = float32(0.0)
                    c2 = float32(0.0)
                    c3 = float32(0.0)
                    for kk in range(KD):
                        kr = kbuf + (8 * nn + pg) * LDK + 8 * kk + t
                        operand(smem[kr], bb, bs, 0)
                        operand(smem[kr + 4], bb, bs, 1)
                        c0, c1, c2, c3 = mma3(qb, qs, bb, bs, c0, c1, c2, c3, 4 * kk, 4 * kk + 1, 4 * kk + 2,
                                              4 * kk + 3)
                    s[nn, 0] = c0
                    s[nn, 1] = c1
                    s[nn, 2] = c2
                    s[nn, 3] = c3
            else:  # one step of 8 dims at a time over all S tiles, Q's 4 registers of the step split anew
                for nn in range(NS):
                    for x in range(4):
                        s[nn, x] = 0.0
                for kk in range(KD):
                    load_q_step(smem, (r0 + g) * LDK + 8 * kk + t, qb, qs, 0)
                    for nn in range(NS):
                        kr = kbuf + (8 * nn + pg) * LDK + 8 * kk + t
                        operand(smem[kr], bb, bs, 0)
                        operand(smem[kr + 4], bb, bs, 1)
                        s[nn, 0], s[nn, 1], s[nn, 2], s[nn, 3] = mma3(qb, qs, bb, bs, s[nn, 0], s[nn, 1],
                                                                      s[nn, 2], s[nn, 3], 0, 1, 2, 3)

            # scale to base 2, mask, row max over the quad (s[nn, x]: row g + 8 (x >> 1), key t + 4 (x & 1))
            masked = j0 + B_c > seqlen_k or (causal and j0 + B_c - 1 > i0 + diag)
            mx0 = NEG_INF
            mx1 = NEG_INF
            for nn in range(NS):
                for x in range(4):
                    val = s[nn, x] * scale_log2
                    if masked:
                        i = i0 + r0 + g + 8 * (x >> 1)
                        j = j0 + 8 * nn + t + 4 * (x & 1)
                        if j >= seqlen_k or (causal and j > i + diag):
                            val = NEG_INF
                    s[nn, x] = val
                    if x < 2:
                        mx0 = max(mx0, val)
                    else:
                        mx1 = max(mx1, val)
            mx0 = max(mx0, ptx.shfl_xor_f32(mx0, 1))
            mx0 = max(mx0, ptx.shfl_xor_f32(mx0, 2))
            mx1 = max(mx1, ptx.shfl_xor_f32(mx1, 1))
            mx1 = max(mx1, ptx.shfl_xor_f32(mx1, 2))
            for x in range(2):
                mx = max(m[x], mx0 if x == 0 else mx1)
                m_use[x] = mx if mx != NEG_INF else float32(0.0)
                alpha[x] = float32(math.exp2(m[x] - m_use[x]))
                m[x] = mx
            ps0 = float32(0.0)
            ps1 = float32(0.0)
            for nn in range(NS):
                for x in range(4):
                    p = float32(math.exp2(s[nn, x] - m_use[x >> 1]))
                    s[nn, x] = p
                    if x < 2:
                        ps0 += p
                    else:
                        ps1 += p
            l[0] = alpha[0] * l[0] + ps0
            l[1] = alpha[1] * l[1] + ps1
            for n in range(NO):
                o[n, 0] *= alpha[0]
                o[n, 1] *= alpha[0]
                o[n, 2] *= alpha[1]
                o[n, 3] *= alpha[1]

            # O_i += P V_j, 8 keys a step: A = (s[c, 0], s[c, 2], s[c, 1], s[c, 3]); B = V[t, g], V[t + 4, g]
            for c in range(NS):
                operand(s[c, 0], pb, psm, 0)
                operand(s[c, 2], pb, psm, 1)
                operand(s[c, 1], pb, psm, 2)
                operand(s[c, 3], pb, psm, 3)
                for nd in range(NO):
                    vr = vbuf + (8 * c + t) * LDV + 8 * nd + g
                    operand(smem[vr], bb, bs, 0)
                    operand(smem[vr + 4 * LDV], bb, bs, 1)
                    o[nd, 0], o[nd, 1], o[nd, 2], o[nd, 3] = mma3(pb, psm, bb, bs, o[nd, 0], o[nd, 1], o[nd, 2],
                                                                  o[nd, 3], 0, 1, 2, 3)
            cuda.syncthreads()  # every warp is done with these buffers before iteration j + 1 refills them
        ptx.cp_async_wait_all()  # no copy outlives the block (with no tile to visit, the prologue's are in flight)

        for x in range(2):
            l[x] += ptx.shfl_xor_f32(l[x], 1)
            l[x] += ptx.shfl_xor_f32(l[x], 2)
        for x in range(2):
            i = i0 + r0 + g + 8 * x
            if i < seqlen_q:
                inv_l = float32(1.0) / l[x] if l[x] != 0 else float32(0.0)
                for n in range(NO):
                    out[b, i, h, 8 * n + 2 * t] = o[n, 2 * x] * inv_l
                    out[b, i, h, 8 * n + 2 * t + 1] = o[n, 2 * x + 1] * inv_l
                if t == 0:
                    lse[b, h, i] = float32(m[x] * LN2 + math.log(l[x])) if l[x] != 0 else NEG_INF

    return forward_tf32
