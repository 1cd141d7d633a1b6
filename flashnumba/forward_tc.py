"""Forward kernel on tensor cores: FlashAttention-2, Algorithm 1, with S = Q K^T and O += P V as ``mma.sync``.

The SIMT kernels of :mod:`flashnumba.forward` compute every product with float32 FMAs. This one hands the two
matrix products of each key tile to the tensor cores, through the intrinsics of :mod:`flashnumba.ptx`
(``mma_m16n8k16_f16``, ``ldmatrix_x4``, ``ldmatrix_x4_trans``, ``pack_f16x2``): float16 inputs, float32
accumulation. Everything else (the online softmax recurrence, masking, lse) is v1's, done on the accumulator
fragments in registers. A first version, kept simple: plain global loads (no cp.async pipeline), no swizzle
against shared-memory bank conflicts, float16 only, head_dim 64 or 128, nheads_k == nheads.

Launch geometry: grid (ceil(seqlen_q / B_r), batch * nheads), block 128 threads = 4 warps, B_r = 64. Warp w
owns query rows 16w .. 16w + 15 of the tile Q_i; lane l of it, with g = l >> 2 and t = l & 3 (the PTX ISA's
groupID and threadID_in_group), owns rows g and g + 8 of those 16, and of every (16 x 8) accumulator tile the
columns 2t and 2t + 1 (the C layout drawn in ``ptx.MMA_DOC``).

Per key tile K_j, V_j (B_c rows), FlashAttention-2 Algorithm 1, lines 8-11, in base 2::

    S_ij  = scale * log2(e) * Q_i K_j^T           masked entries (j >= seqlen_k, causal) are -inf
    m_new = max(m_i, rowmax(S_ij))
    P_ij  = exp2(S_ij - m_new)
    l_i   = exp2(m_i - m_new) * l_i + rowsum(P_ij)
    O_i   = exp2(m_i - m_new) * O_i + f16(P_ij) V_j
    m_i   = m_new

then (line 12-13) O_i / l_i and L_i = ln(2) m_i + log(l_i). As in FlashAttention-2, P_ij is rounded to float16
for the second product; l_i sums the unrounded float32 P_ij.

The fragment mapping, the reason no data moves between lanes between the two products. The S accumulator of
key columns 8n .. 8n + 7 is, in lane (g, t), s[n] = (S[g, 8n+2t], S[g, 8n+2t+1], S[g+8, 8n+2t], S[g+8, 8n+2t+1]).
The A operand of the P V mma over keys 16c .. 16c + 15 wants, in the same lane,
a0 = P[g, 16c+2t : +2], a1 = P[g+8, 16c+2t : +2], a2 = P[g, 16c+8+2t : +2], a3 = P[g+8, 16c+8+2t : +2], so::

    a0 = pack(s[2c][0], s[2c][1])      a2 = pack(s[2c+1][0], s[2c+1][1])
    a1 = pack(s[2c][2], s[2c][3])      a3 = pack(s[2c+1][2], s[2c+1][3])

Row statistics. A row's B_c scores are spread over the 4 lanes of a quad (same g). The row max must be known to
all 4 before P is formed: each lane writes its partial max to ``red`` in shared memory and reads the quad's four
back (a warp shuffle would do on the GPU, but the CUDA simulator has neither ``shfl_xor_sync`` nor ``syncwarp``,
so the exchange is ordered by ``syncthreads``, which is correct in both). The row sum needs no exchange per tile:
alpha = exp2(m_i - m_new) is the same in the 4 lanes, so each lane keeps l_i over its own columns and the four
partial sums are added once, at the end.

Shared memory, static: one float16 array holding Q_i (B_r, D), K_j (B_c, D), V_j (B_c, D), each starting at a
16-byte multiple (ldmatrix reads 16-byte rows), plus ``red`` (B_r, 4) float32. D=64, B_c=64: 24 KB + 1 KB;
D=128, B_c=32: 32 KB + 1 KB.
"""

from __future__ import annotations

import functools
import math

import numpy as np

from . import _arrays, ptx
from ._backend import cuda
from .forward import LN2, LOG2E, NEG_INF
from numba import float32, uint32
from numba.cuda.types import float16  # numba-cuda's own float16 (numba.types.float16 does not type in kernels)

B_R = 64  # query rows per block: 4 warps x 16
NUM_THREADS = 128
WARP_ROWS = 16  # the M of mma.m16n8k16
HEAD_DIMS = (64, 128)
STATIC_SHARED_LIMIT = 48 * 1024


def default_block_n(D):
    """B_c: 64 keys per tile for D=64, 32 for D=128 (Q_i, K_j, V_j then fit the 48 KB of static shared memory)."""
    return 64 if D <= 64 else 32


def shared_bytes(D, B_c):
    """Q_i, K_j, V_j float16 and red (B_r, 4) float32."""
    return (B_R + 2 * B_c) * D * 2 + B_R * 4 * 4


@functools.lru_cache(maxsize=None)
def make_forward_tc(D, causal, B_c=None):
    """The tensor-core forward kernel for head_dim D (64 or 128), B_c keys per tile (a multiple of 16).

    Arguments: (q, k, v, out, lse, scale_log2): q, k, v, out (batch, seqlen, nheads, D) float16, lse
    (batch, nheads, seqlen_q) float32, scale_log2 = softmax_scale * log2(e). Launch: grid (ceil(seqlen_q / 64),
    batch * nheads), block (128,). ``causal``: query i sees key j iff j <= i + seqlen_k - seqlen_q.
    """
    B_c = default_block_n(D) if B_c is None else B_c
    if D not in HEAD_DIMS:
        raise ValueError(f"the tensor-core kernel supports head_dim in {HEAD_DIMS}, got {D}")
    if B_c % 16 or B_c <= 0:
        raise ValueError(f"B_c must be a positive multiple of 16, got {B_c}")
    if shared_bytes(D, B_c) > STATIC_SHARED_LIMIT:
        raise ValueError(f"D={D}, B_c={B_c} need {shared_bytes(D, B_c)} bytes of shared memory, more than 48 KB")
    KD = D // 16  # k-steps of S = Q K^T (16 head dims each)
    NS = B_c // 8  # (16 x 8) tiles of S per warp
    KC = B_c // 16  # k-steps of O += P V (16 keys each)
    NO = D // 8  # (16 x 8) tiles of O per warp
    OFF_K = B_R * D  # element offsets into smem; multiples of 8 elements = 16 bytes
    OFF_V = OFF_K + B_c * D
    SMEM = OFF_V + B_c * D  # the shared array's length (a constant: shapes must be known when compiling)

    @cuda.jit
    def forward_tc(q, k, v, out, lse, scale_log2):
        nheads = q.shape[2]
        seqlen_q = q.shape[1]
        seqlen_k = k.shape[1]
        tid = cuda.threadIdx.x
        warp = tid // 32
        lane = tid % 32
        g = lane >> 2  # groupID: rows g and g + 8 of the warp's 16
        t = lane & 3  # threadID_in_group: columns 2t, 2t + 1 of each 8-wide tile
        b = cuda.blockIdx.y // nheads
        h = cuda.blockIdx.y % nheads
        i0 = cuda.blockIdx.x * B_R  # first query row of Q_i
        r0 = warp * WARP_ROWS  # first row of this warp inside Q_i
        diag = seqlen_k - seqlen_q  # causal: row i sees keys j <= i + diag

        smem = cuda.shared.array(SMEM, float16)  # Q_i (B_R, D) | K_j (B_c, D) | V_j (B_c, D), shared
        red = cuda.shared.array((B_R, 4), float32)  # (B_r, 4) per-lane partial row max / row sum, shared
        qa = cuda.local.array((KD, 4), uint32)  # A fragments of this warp's 16 rows of Q_i, one per k-step
        s = cuda.local.array((NS, 4), float32)  # S_ij, then P_ij: C fragments of the warp's (16, B_c)
        o = cuda.local.array((NO, 4), float32)  # O_i: C fragments of the warp's (16, D)
        m = cuda.local.array(2, float32)  # m_i of rows g, g + 8 (base 2), the same in the 4 lanes of a quad
        l = cuda.local.array(2, float32)  # this lane's partial l_i of rows g, g + 8 (its columns only)
        alpha = cuda.local.array(2, float32)
        m_use = cuda.local.array(2, float32)

        # Q_i to shared memory once; rows past seqlen_q are zero (read nothing out of bounds)
        for e in range(tid, B_R * D, NUM_THREADS):
            r = e // D
            c = e % D
            smem[e] = q[b, i0 + r, h, c] if i0 + r < seqlen_q else float16(0)
        for x in range(2):
            m[x] = NEG_INF
            l[x] = 0.0
        for n in range(NO):
            for x in range(4):
                o[n, x] = 0.0

        # Key tiles to visit: all, or (causal) up to the last key the block's last row sees
        n_end = seqlen_k
        if causal:
            last_row = min(i0 + B_R, seqlen_q) - 1
            n_end = max(0, min(seqlen_k, last_row + diag + 1))

        for j0 in range(0, n_end, B_c):
            # K_j, V_j to shared memory; rows past seqlen_k are zero
            for e in range(tid, B_c * D, NUM_THREADS):
                jj = e // D
                c = e % D
                inside = j0 + jj < seqlen_k
                smem[OFF_K + e] = k[b, j0 + jj, h, c] if inside else float16(0)
                smem[OFF_V + e] = v[b, j0 + jj, h, c] if inside else float16(0)
            cuda.syncthreads()  # K_j, V_j (and, on the first tile, Q_i) complete before ldmatrix reads them

            if j0 == 0:
                # Q_i's A fragments: lane l points at row r0 + l % 16, column 16 kk + 8 (l // 16)
                for kk in range(KD):
                    a0, a1, a2, a3 = ptx.ldmatrix_x4(smem, (r0 + lane % 16) * D + 16 * kk + 8 * (lane // 16))
                    qa[kk, 0] = a0
                    qa[kk, 1] = a1
                    qa[kk, 2] = a2
                    qa[kk, 3] = a3

            # S_ij = Q_i K_j^T. B = K_j^T (D x B_c) in "col" layout is K_j row-major: non-transposing ldmatrix.
            # One x4 load covers 16 keys x 16 dims: lanes 0-7 keys n0..n0+7, dims 16kk..+7 (b0 of tile n0),
            # lanes 8-15 the same keys, dims +8..+15 (b1), lanes 16-31 the same for keys n0+8..n0+15.
            for n in range(NS):
                for x in range(4):
                    s[n, x] = 0.0
            for kk in range(KD):
                for n2 in range(NS // 2):
                    key = 16 * n2 + (lane & 7) + 8 * (lane >> 4)
                    col = 16 * kk + 8 * ((lane >> 3) & 1)
                    b0, b1, b2, b3 = ptx.ldmatrix_x4(smem, OFF_K + key * D + col)
                    d0, d1, d2, d3 = ptx.mma_m16n8k16_f16(qa[kk, 0], qa[kk, 1], qa[kk, 2], qa[kk, 3], b0, b1,
                                                          s[2 * n2, 0], s[2 * n2, 1], s[2 * n2, 2], s[2 * n2, 3])
                    s[2 * n2, 0] = d0
                    s[2 * n2, 1] = d1
                    s[2 * n2, 2] = d2
                    s[2 * n2, 3] = d3
                    d0, d1, d2, d3 = ptx.mma_m16n8k16_f16(qa[kk, 0], qa[kk, 1], qa[kk, 2], qa[kk, 3], b2, b3,
                                                          s[2 * n2 + 1, 0], s[2 * n2 + 1, 1], s[2 * n2 + 1, 2],
                                                          s[2 * n2 + 1, 3])
                    s[2 * n2 + 1, 0] = d0
                    s[2 * n2 + 1, 1] = d1
                    s[2 * n2 + 1, 2] = d2
                    s[2 * n2 + 1, 3] = d3

            # scale to base 2, mask, and this lane's partial max of rows g (x = 0, 1) and g + 8 (x = 2, 3)
            mx0 = NEG_INF
            mx1 = NEG_INF
            for n in range(NS):
                for x in range(4):
                    i = i0 + r0 + g + 8 * (x >> 1)
                    j = j0 + 8 * n + 2 * t + (x & 1)
                    val = s[n, x] * scale_log2
                    if j >= seqlen_k or (causal and j > i + diag):
                        val = NEG_INF
                    s[n, x] = val
                    if x < 2:
                        mx0 = max(mx0, val)
                    else:
                        mx1 = max(mx1, val)
            red[r0 + g, t] = mx0
            red[r0 + g + 8, t] = mx1
            cuda.syncthreads()  # the quad's four partial maxima are visible to each of its lanes

            # m_new = max(m_i, rowmax(S_ij)); alpha = exp2(m_i - m_new)
            for x in range(2):
                row = r0 + g + 8 * x
                mx = max(max(m[x], red[row, 0]), max(red[row, 1], max(red[row, 2], red[row, 3])))
                m_use[x] = mx if mx != NEG_INF else float32(0.0)  # no key seen yet: avoid -inf - -inf
                alpha[x] = float32(math.exp2(m[x] - m_use[x]))
                m[x] = mx

            # P_ij = exp2(S_ij - m_new) (0 where masked); l_i = alpha l_i + rowsum(P_ij) over this lane's columns
            ps0 = float32(0.0)
            ps1 = float32(0.0)
            for n in range(NS):
                for x in range(4):
                    p = float32(math.exp2(s[n, x] - m_use[x >> 1]))
                    s[n, x] = p
                    if x < 2:
                        ps0 += p
                    else:
                        ps1 += p
            l[0] = alpha[0] * l[0] + ps0
            l[1] = alpha[1] * l[1] + ps1

            # O_i = alpha O_i + f16(P_ij) V_j. A = P_ij from the S fragments (see the module docstring);
            # B = V_j (B_c x D) row-major is "row" layout for B: transposing ldmatrix. Lane l points at key
            # 16c + l % 16, dim 16 n2 + 8 (l // 16): (b0, b1) of dims 16 n2 .. +7, then of dims 16 n2 + 8 .. +15.
            for n in range(NO):
                o[n, 0] *= alpha[0]
                o[n, 1] *= alpha[0]
                o[n, 2] *= alpha[1]
                o[n, 3] *= alpha[1]
            for c in range(KC):
                a0 = ptx.pack_f16x2(s[2 * c, 0], s[2 * c, 1])
                a1 = ptx.pack_f16x2(s[2 * c, 2], s[2 * c, 3])
                a2 = ptx.pack_f16x2(s[2 * c + 1, 0], s[2 * c + 1, 1])
                a3 = ptx.pack_f16x2(s[2 * c + 1, 2], s[2 * c + 1, 3])
                for n2 in range(NO // 2):
                    b0, b1, b2, b3 = ptx.ldmatrix_x4_trans(smem, OFF_V + (16 * c + lane % 16) * D + 16 * n2
                                                           + 8 * (lane // 16))
                    d0, d1, d2, d3 = ptx.mma_m16n8k16_f16(a0, a1, a2, a3, b0, b1, o[2 * n2, 0], o[2 * n2, 1],
                                                          o[2 * n2, 2], o[2 * n2, 3])
                    o[2 * n2, 0] = d0
                    o[2 * n2, 1] = d1
                    o[2 * n2, 2] = d2
                    o[2 * n2, 3] = d3
                    d0, d1, d2, d3 = ptx.mma_m16n8k16_f16(a0, a1, a2, a3, b2, b3, o[2 * n2 + 1, 0],
                                                          o[2 * n2 + 1, 1], o[2 * n2 + 1, 2], o[2 * n2 + 1, 3])
                    o[2 * n2 + 1, 0] = d0
                    o[2 * n2 + 1, 1] = d1
                    o[2 * n2 + 1, 2] = d2
                    o[2 * n2 + 1, 3] = d3
            cuda.syncthreads()  # every warp is done with K_j, V_j and red before the next tile overwrites them

        # l_i: the sum of the quad's four partial sums
        red[r0 + g, t] = l[0]
        red[r0 + g + 8, t] = l[1]
        cuda.syncthreads()  # the quad's partial row sums are visible to each of its lanes

        # O_i = O_i / l_i, L_i = ln(2) m_i + log(l_i); a row that saw no key gets 0 and -inf
        for x in range(2):
            row = r0 + g + 8 * x
            i = i0 + row
            if i < seqlen_q:
                l_row = (red[row, 0] + red[row, 1]) + (red[row, 2] + red[row, 3])
                inv_l = float32(1.0) / l_row if l_row != 0 else float32(0.0)
                for n in range(NO):
                    out[b, i, h, 8 * n + 2 * t] = float16(o[n, 2 * x] * inv_l)
                    out[b, i, h, 8 * n + 2 * t + 1] = float16(o[n, 2 * x + 1] * inv_l)
                if t == 0:
                    lse[b, h, i] = float32(m[x] * LN2 + math.log(l_row)) if l_row != 0 else NEG_INF

    return forward_tc


def flash_attn_forward_tc(q, k, v, causal=False, softmax_scale=None):
    """Attention by the tensor-core kernel: q (batch, seqlen_q, nheads, D), k and v (batch, seqlen_k, nheads, D),
    float16, D in (64, 128). Arrays as :func:`flashnumba.flash_attn_forward` takes them (NumPy, CuPy, Numba
    device arrays). Returns out (like q, float16) and lse (batch, nheads, seqlen_q) float32 (natural log)."""
    from . import api

    tq, tk, tv = (api._inspect(n, x, 4) for n, x in (("q", q), ("k", k), ("v", v)))
    api._check_same_place((tq, tk, tv))
    for t in (tq, tk, tv):
        if t.dtype != np.float16:
            raise TypeError(f"the tensor-core kernel takes float16 only; {t.name} has dtype {t.dtype}")
    api._check_qkv(tq, tk, tv)
    batch, seqlen_q, nheads, D = tq.shape
    if tk.shape[2] != nheads:
        raise ValueError(f"the tensor-core kernel needs as many key/value heads as query heads (no GQA), got "
                         f"{tk.shape[2]} and {nheads}")
    if D not in HEAD_DIMS:
        raise ValueError(f"the tensor-core kernel supports head_dim in {HEAD_DIMS}, got {D}")
    causal = api._check_flag("causal", causal)
    scale = api._check_scale(softmax_scale, D)
    like = tq.kind
    out_user, out_dev = _arrays.empty(tq.shape, tq.dtype, like)
    lse_user, lse_dev = _arrays.empty((batch, nheads, seqlen_q), np.float32, like)
    if batch * nheads * seqlen_q:
        qd, kd, vd = (_arrays.to_kernel(t.array, t.kind) for t in (tq, tk, tv))
        fn = make_forward_tc(D, causal)
        grid = (-(-seqlen_q // B_R), batch * nheads)
        fn[grid, NUM_THREADS](qd, kd, vd, out_dev, lse_dev, np.float32(scale * LOG2E))
    return _arrays.to_caller(out_user, out_dev, like), _arrays.to_caller(lse_user, lse_dev, like)
