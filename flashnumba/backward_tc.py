"""Backward kernels on tensor cores: FlashAttention-2, Algorithm 2, with its five matrix products as ``mma.sync``.

The SIMT backward (:mod:`flashnumba.backward`) in the tile operations of :mod:`flashnumba.forward_tc`: float16 or
bfloat16 inputs, float32 accumulation, head_dim 64 or 128, nheads_k == nheads, causal or not. As there, D_i =
rowsum(dO_i * O_i) comes first (``backward.make_backward_preprocess``), then two kernels, neither with atomics,
so the gradients are deterministic:

dQ, one block per query tile Q_i (warp w owns its rows 16w .. 16w + 15), looping over the key tiles K_j, V_j::

    S_ij  = Q_i K_j^T                      mma_abt: A = Q_i (fragments), B = K_j^T
    P_ij  = exp2(scale log2(e) S_ij - log2(e) L_i)      (0 where masked)
    dP_ij = dO_i V_j^T                     mma_abt: A = dO_i, B = V_j^T
    dS_ij = P_ij * (dP_ij - D_i)
    dQ_i += dS_ij K_j                      mma_ab: A = dS_ij (its C fragments), B = K_j
    finally dQ_i *= scale

dK, dV, one block per key tile K_j, V_j (warp w owns its keys 16w .. 16w + 15), looping over the query tiles. The
products are taken transposed, keys as rows, so that P^T and dS^T come out of the mma in the C layout that is
already the A operand of the next product (the module docstring of forward_tc shows why)::

    S_ij^T  = K_j Q_i^T                    mma_abt: A = K_j, B = Q_i^T
    P_ij^T  = exp2(scale log2(e) S_ij^T - log2(e) L_i)  (L_i per column)
    dP_ij^T = V_j dO_i^T                   mma_abt: A = V_j, B = dO_i^T
    dS_ij^T = P_ij^T * (dP_ij^T - D_i)
    dV_j   += P_ij^T dO_i                  mma_ab: A = P_ij^T, B = dO_i
    dK_j   += dS_ij^T Q_i                  mma_ab: A = dS_ij^T, B = Q_i
    finally dK_j *= scale

P and dS are rounded to 16 bits as the A operand of their products, as in FlashAttention-2. The tiles a block loops
over are copied with cp.async into two buffers in turn (the next in flight while the warps work on the current
one); L_i and D_i of each query tile go to small float32 arrays in shared memory beside them. With causal
masking, the dQ blocks stop at their last visible key tile and the dK/dV blocks start at their first visible
query tile; tiles wholly inside the visible region skip the mask.
"""

from __future__ import annotations

import functools
import math

import numpy as np

from . import _arrays, backward, bf16, ptx
from ._backend import cuda
from .forward import LOG2E, NEG_INF
from .forward_tc import (HEAD_DIMS, PAD, WARP_ROWS, _c_contiguous, make_load_a, make_load_rows, make_mma_ab,
                         make_mma_abt)
from numba import float32, uint16, uint32
from numba.cuda.types import float16

TILES = (16, 32, 64, 128)  # block_m and block_n: multiples of the 16 rows of one warp


def default_blocks(D):
    """(block_m, block_n): query and key tile sizes of both kernels (the dQ kernel has block_m / 16 warps, the
    dK/dV kernel block_n / 16). (64, 64) for D = 64; (32, 64) for D = 128, which keeps the dK/dV kernel's
    accumulators (dK_j and dV_j rows: 2 x 64 registers a lane) and its P, dP tiles under 255 registers."""
    return (64 if D <= 64 else 32), 64


def shared_bytes_dq(D, block_m, block_n):
    """Q_i and dO_i (block_m rows), two K_j, V_j buffers (block_n rows), 16-bit elements, rows of D + PAD."""
    return (2 * block_m + 4 * block_n) * (D + PAD) * 2


def shared_bytes_dkdv(D, block_m, block_n):
    """K_j and V_j (block_n rows), two Q_i, dO_i buffers (block_m rows); L_i and D_i (static, not counted)."""
    return (2 * block_n + 4 * block_m) * (D + PAD) * 2


def _check(D, block_m, block_n, dtype):
    if D not in HEAD_DIMS:
        raise ValueError(f"the tensor-core kernels support head_dim in {HEAD_DIMS}, got {D}")
    for name, value in (("block_m", block_m), ("block_n", block_n)):
        if value not in TILES:
            raise ValueError(f"the tensor-core backward takes {name} in {TILES}, got {value}")
    if dtype not in ("float16", "bfloat16"):
        raise ValueError(f"dtype must be 'float16' or 'bfloat16', got {dtype!r}")


@cuda.jit(device=True, inline=True)
def _store_bf16(x):
    """float32 -> bfloat16 bits, rounded to nearest even by one cvt.rn.bf16x2 (bf16.float32_to_bf16's branches
    keep the dK/dV accumulators of head_dim 128 out of registers)."""
    return uint16(ptx.pack_bf16x2(x, float32(0.0)) & 0xFFFF)


@functools.lru_cache(maxsize=None)
def make_backward_dq_tc(D, causal, block_m, block_n, dtype="float16"):
    """The dQ kernel: grid (ceil(seqlen_q / block_m), batch * nheads), block (2 * block_m,) (block_m / 16 warps),
    dynamic shared memory :func:`shared_bytes_dq`.

    Arguments: (dout, q, k, v, lse, delta, dq, scale_log2, scale): dout, q, k, v, dq (batch, seqlen, nheads, D)
    C-contiguous 16-bit arrays (uint16 holding bfloat16 bits); lse, delta (batch, nheads, seqlen_q) float32;
    scale_log2 = softmax_scale * log2(e).
    """
    _check(D, block_m, block_n, dtype)
    is_bf16 = dtype == "bfloat16"
    store = bf16.load_store(is_bf16)[1]
    elem = uint16 if is_bf16 else float16
    B_R, B_C = block_m, block_n
    NT = 2 * B_R  # 32 threads per 16 rows
    LD = D + PAD
    KD, NS, NO = D // 16, B_C // 8, D // 8
    OFF_DO = B_R * LD  # dO_i after Q_i
    OFF_K = 2 * B_R * LD  # K buffer 0; buffer 1 lies BUF further on; V_j lies OFF_V after its K_j
    OFF_V = B_C * LD
    BUF = 2 * B_C * LD
    load_rows = make_load_rows(D, NT)
    load_a = make_load_a(D)
    mma_abt = make_mma_abt(D, B_C, dtype)  # S = Q_i K_j^T, dP = dO_i V_j^T
    mma_ab = make_mma_ab(B_C, D, dtype)  # dQ_i += dS K_j

    @cuda.jit
    def backward_dq_tc(dout, q, k, v, lse, delta, dq, scale_log2, scale):
        nheads = q.shape[2]
        seqlen_q = q.shape[1]
        seqlen_k = k.shape[1]
        tid = cuda.threadIdx.x
        warp = tid // 32
        lane = tid % 32
        g = lane >> 2
        t = lane & 3
        b = cuda.blockIdx.y // nheads
        h = cuda.blockIdx.y % nheads
        i0 = (cuda.gridDim.x - 1 - cuda.blockIdx.x) * B_R  # the longest causal rows first, as in the forward
        r0 = warp * WARP_ROWS
        diag = seqlen_k - seqlen_q

        smem = cuda.shared.array(0, elem)  # Q_i | dO_i | K, V buffer 0 | K, V buffer 1 (dynamic), shared
        af = cuda.local.array((KD, 4), uint32)  # A fragments: this warp's rows of Q_i, then of dO_i
        s = cuda.local.array((NS, 4), float32)  # S, then P
        dp = cuda.local.array((NS, 4), float32)  # dP, then dS
        acc = cuda.local.array((NO, 4), float32)  # dQ_i
        lrow = cuda.local.array(2, float32)  # log2(e) L_i of rows g, g + 8
        drow = cuda.local.array(2, float32)  # D_i of rows g, g + 8
        for x in range(2):
            i = i0 + r0 + g + 8 * x
            L = lse[b, h, i] if i < seqlen_q else float32(0.0)
            lrow[x] = L * LOG2E if L != NEG_INF else float32(0.0)  # no visible key: every entry is masked
            drow[x] = delta[b, h, i] if i < seqlen_q else float32(0.0)
        for n in range(NO):
            for x in range(4):
                acc[n, x] = 0.0

        n_end = seqlen_k
        if causal:
            n_end = max(0, min(seqlen_k, min(i0 + B_R, seqlen_q) - 1 + diag + 1))
        n_tiles = (n_end + B_C - 1) // B_C

        load_rows(smem, 0, q, b, i0, seqlen_q, h, B_R, tid)
        load_rows(smem, OFF_DO, dout, b, i0, seqlen_q, h, B_R, tid)
        if n_tiles > 0:
            load_rows(smem, OFF_K, k, b, 0, seqlen_k, h, B_C, tid)
            load_rows(smem, OFF_K + OFF_V, v, b, 0, seqlen_k, h, B_C, tid)
        ptx.cp_async_commit()

        for jt in range(n_tiles):
            j0 = jt * B_C
            buf = OFF_K + (jt & 1) * BUF
            if jt + 1 < n_tiles:  # tile j + 1 into the other buffer, freed by the barrier ending iteration j - 1
                nxt = OFF_K + ((jt + 1) & 1) * BUF
                load_rows(smem, nxt, k, b, j0 + B_C, seqlen_k, h, B_C, tid)
                load_rows(smem, nxt + OFF_V, v, b, j0 + B_C, seqlen_k, h, B_C, tid)
            ptx.cp_async_commit()
            ptx.cp_async_wait(1)  # all but the newest group have landed: tile j (and Q_i, dO_i)
            cuda.syncthreads()  # every thread's copies and zero stores of tile j are visible to all

            load_a(af, smem, r0 * LD, lane)
            mma_abt(s, af, smem, buf, lane)  # S = Q_i K_j^T
            load_a(af, smem, OFF_DO + r0 * LD, lane)
            mma_abt(dp, af, smem, buf + OFF_V, lane)  # dP = dO_i V_j^T

            masked = j0 + B_C > seqlen_k or (causal and j0 + B_C - 1 > i0 + diag)
            for n in range(NS):
                for x in range(4):
                    p = float32(math.exp2(s[n, x] * scale_log2 - lrow[x >> 1]))
                    if masked:
                        i = i0 + r0 + g + 8 * (x >> 1)
                        j = j0 + 8 * n + 2 * t + (x & 1)
                        if j >= seqlen_k or (causal and j > i + diag):
                            p = float32(0.0)
                    dp[n, x] = p * (dp[n, x] - drow[x >> 1])  # dS = P (dP - D_i)

            mma_ab(acc, dp, smem, buf, lane)  # dQ_i += dS K_j
            cuda.syncthreads()  # every warp is done with this buffer before iteration j + 1 copies tile j + 2 in
        ptx.cp_async_wait_all()  # no copy outlives the block (with no key tile, the prologue's are still in flight)

        for x in range(2):
            i = i0 + r0 + g + 8 * x
            if i < seqlen_q:
                for n in range(NO):
                    dq[b, i, h, 8 * n + 2 * t] = store(acc[n, 2 * x] * scale)
                    dq[b, i, h, 8 * n + 2 * t + 1] = store(acc[n, 2 * x + 1] * scale)

    return backward_dq_tc


@functools.lru_cache(maxsize=None)
def make_backward_dkdv_tc(D, causal, block_m, block_n, dtype="float16"):
    """The dK/dV kernel: grid (ceil(seqlen_k / block_n), batch * nheads), block (2 * block_n,) (block_n / 16
    warps), dynamic shared memory :func:`shared_bytes_dkdv`.

    Arguments: (dout, q, k, v, lse, delta, dk, dv, scale_log2, scale), as the dQ kernel's with dk, dv like k.
    """
    _check(D, block_m, block_n, dtype)
    is_bf16 = dtype == "bfloat16"
    store = _store_bf16 if is_bf16 else bf16.load_store(False)[1]
    elem = uint16 if is_bf16 else float16
    B_R, B_C = block_m, block_n
    NT = 2 * B_C
    LD = D + PAD
    KD, NS, NO = D // 16, B_R // 8, D // 8
    OFF_V = B_C * LD  # V_j after K_j
    OFF_Q = 2 * B_C * LD  # Q buffer 0; buffer 1 lies BUF further on; dO_i lies OFF_DO after its Q_i
    OFF_DO = B_R * LD
    BUF = 2 * B_R * LD
    load_rows = make_load_rows(D, NT)
    load_a = make_load_a(D)
    mma_abt = make_mma_abt(D, B_R, dtype)  # S^T = K_j Q_i^T, dP^T = V_j dO_i^T
    mma_ab = make_mma_ab(B_R, D, dtype)  # dV_j += P^T dO_i, dK_j += dS^T Q_i

    @cuda.jit(device=True, inline=True)
    def load_stats(lsm, dsm, sel, lse, delta, b, h, i0, seqlen_q, tid):
        """log2(e) L_i and D_i of the query tile at row i0 into buffer ``sel`` (0 past the end, and 0 for a row
        that sees no key: its entries are all masked); B_R rows over the NT threads (B_R may exceed NT)."""
        for r in range(tid, B_R, NT):
            i = i0 + r
            L = lse[b, h, i] if i < seqlen_q else float32(0.0)
            lsm[sel, r] = L * LOG2E if L != NEG_INF else float32(0.0)
            dsm[sel, r] = delta[b, h, i] if i < seqlen_q else float32(0.0)

    @cuda.jit
    def backward_dkdv_tc(dout, q, k, v, lse, delta, dk, dv, scale_log2, scale):
        nheads = q.shape[2]
        seqlen_q = q.shape[1]
        seqlen_k = k.shape[1]
        tid = cuda.threadIdx.x
        warp = tid // 32
        lane = tid % 32
        g = lane >> 2
        t = lane & 3
        b = cuda.blockIdx.y // nheads
        h = cuda.blockIdx.y % nheads
        j0 = cuda.blockIdx.x * B_C  # first key of K_j (the first key tiles see the most queries: they start first)
        r0 = warp * WARP_ROWS  # this warp's keys inside K_j
        diag = seqlen_k - seqlen_q

        smem = cuda.shared.array(0, elem)  # K_j | V_j | Q, dO buffer 0 | Q, dO buffer 1 (dynamic), shared
        lsm = cuda.shared.array((2, B_R), float32)  # log2(e) L_i of the query tile, two buffers, shared
        dsm = cuda.shared.array((2, B_R), float32)  # D_i of the query tile, two buffers, shared
        af = cuda.local.array((KD, 4), uint32)  # A fragments: this warp's rows of K_j, then of V_j
        s = cuda.local.array((NS, 4), float32)  # S^T, then P^T (this warp's 16 keys x B_R queries)
        dp = cuda.local.array((NS, 4), float32)  # dP^T, then dS^T
        dv_acc = cuda.local.array((NO, 4), float32)  # dV_j
        dk_acc = cuda.local.array((NO, 4), float32)  # dK_j
        for n in range(NO):
            for x in range(4):
                dv_acc[n, x] = 0.0
                dk_acc[n, x] = 0.0

        m_begin = 0  # query tiles to visit: (causal) from the first that sees key j0
        if causal:
            m_begin = max(0, j0 - diag) // B_R
        m_end = (seqlen_q + B_R - 1) // B_R

        load_rows(smem, 0, k, b, j0, seqlen_k, h, B_C, tid)
        load_rows(smem, OFF_V, v, b, j0, seqlen_k, h, B_C, tid)
        if m_begin < m_end:
            load_rows(smem, OFF_Q, q, b, m_begin * B_R, seqlen_q, h, B_R, tid)
            load_rows(smem, OFF_Q + OFF_DO, dout, b, m_begin * B_R, seqlen_q, h, B_R, tid)
            load_stats(lsm, dsm, 0, lse, delta, b, h, m_begin * B_R, seqlen_q, tid)
        ptx.cp_async_commit()

        for it in range(m_begin, m_end):
            i0 = it * B_R
            sel = (it - m_begin) & 1
            buf = OFF_Q + sel * BUF
            if it + 1 < m_end:  # query tile i + 1 into the other buffers, freed by the barrier ending iteration i - 1
                nxt = OFF_Q + (1 - sel) * BUF
                load_rows(smem, nxt, q, b, i0 + B_R, seqlen_q, h, B_R, tid)
                load_rows(smem, nxt + OFF_DO, dout, b, i0 + B_R, seqlen_q, h, B_R, tid)
                load_stats(lsm, dsm, 1 - sel, lse, delta, b, h, i0 + B_R, seqlen_q, tid)
            ptx.cp_async_commit()
            ptx.cp_async_wait(1)  # all but the newest group have landed: tile i (and K_j, V_j)
            cuda.syncthreads()  # tile i's copies, zero stores, L_i and D_i are visible to all

            load_a(af, smem, r0 * LD, lane)
            mma_abt(s, af, smem, buf, lane)  # S^T = K_j Q_i^T
            load_a(af, smem, OFF_V + r0 * LD, lane)
            mma_abt(dp, af, smem, buf + OFF_DO, lane)  # dP^T = V_j dO_i^T

            masked = i0 + B_R > seqlen_q or j0 + B_C > seqlen_k or (causal and j0 + B_C - 1 > i0 + diag)
            for n in range(NS):
                for x in range(4):
                    c = 8 * n + 2 * t + (x & 1)  # query column inside Q_i
                    p = float32(math.exp2(s[n, x] * scale_log2 - lsm[sel, c]))
                    if masked:
                        i = i0 + c
                        j = j0 + r0 + g + 8 * (x >> 1)
                        if i >= seqlen_q or j >= seqlen_k or (causal and j > i + diag):
                            p = float32(0.0)
                    s[n, x] = p
                    dp[n, x] = p * (dp[n, x] - dsm[sel, c])  # dS^T = P^T (dP^T - D_i)

            mma_ab(dv_acc, s, smem, buf + OFF_DO, lane)  # dV_j += P^T dO_i
            mma_ab(dk_acc, dp, smem, buf, lane)  # dK_j += dS^T Q_i
            cuda.syncthreads()  # every warp is done with these buffers before iteration i + 1 refills them
        ptx.cp_async_wait_all()  # no copy outlives the block (with no query tile, the prologue's are still in flight)

        for x in range(2):
            j = j0 + r0 + g + 8 * x
            if j < seqlen_k:
                for n in range(NO):
                    dk[b, j, h, 8 * n + 2 * t] = store(dk_acc[n, 2 * x] * scale)
                    dk[b, j, h, 8 * n + 2 * t + 1] = store(dk_acc[n, 2 * x + 1] * scale)
                    dv[b, j, h, 8 * n + 2 * t] = store(dv_acc[n, 2 * x])
                    dv[b, j, h, 8 * n + 2 * t + 1] = store(dv_acc[n, 2 * x + 1])

    return backward_dkdv_tc


def flash_attn_backward_tc(dout, q, k, v, out, lse, causal=False, softmax_scale=None, block_m=None,
                           block_n=None):
    """Gradients (dq, dk, dv) by the tensor-core kernels; arguments as :func:`flashnumba.flash_attn_backward`
    (float16 or bfloat16, head_dim 64 or 128, nheads_k == nheads, causal or not). block_m, block_n: query and
    key tiles (in 16, 32, 64, 128; defaults :func:`default_blocks`)."""
    from . import api

    names = ("dout", "q", "k", "v", "out")
    tdo, tq, tk, tv, to = (api._inspect(n, x, 4) for n, x in zip(names, (dout, q, k, v, out)))
    tl = api._inspect("lse", lse, 3)
    api._check_same_place((tdo, tq, tk, tv, to, tl))
    api._check_dtypes((tdo, tq, tk, tv, to))
    for t in (tdo, tq, tk, tv, to):
        if t.dtype != np.float16 and not _arrays.is_bfloat16(t.dtype):
            raise TypeError(f"the tensor-core kernels take float16 or bfloat16; {t.name} has dtype {t.dtype}")
    api._check_qkv(tq, tk, tv)
    batch, seqlen_q, nheads, D = tq.shape
    api._check_forward_results(tq, tdo, to, tl, "(batch, nheads, seqlen_q)", (batch, nheads, seqlen_q),
                               "flash_attn_forward")
    if tk.shape[2] != nheads:
        raise ValueError(f"the tensor-core kernels need as many key/value heads as query heads (no GQA), got "
                         f"{tk.shape[2]} and {nheads}")
    causal = api._check_flag("causal", causal)
    scale = api._check_scale(softmax_scale, D)
    dm, dn = default_blocks(D) if D in HEAD_DIMS else (64, 64)
    block_m = dm if block_m is None else block_m
    block_n = dn if block_n is None else block_n
    dtype = "bfloat16" if _arrays.is_bfloat16(tq.dtype) else "float16"
    dq_fn = make_backward_dq_tc(D, causal, block_m, block_n, dtype)  # validates D and the tiles
    dkdv_fn = make_backward_dkdv_tc(D, causal, block_m, block_n, dtype)
    smem_dq, smem_dkdv = shared_bytes_dq(D, block_m, block_n), shared_bytes_dkdv(D, block_m, block_n)
    limit = api.max_shared_memory_per_block()
    if max(smem_dq, smem_dkdv) > limit:
        raise ValueError(f"head_dim {D}, block_m {block_m}, block_n {block_n} need {max(smem_dq, smem_dkdv)} bytes "
                         f"of shared memory, more than the {limit} a block may use; choose smaller tiles")
    like = tq.kind
    result = [_arrays.empty(t.shape, t.dtype, like) for t in (tq, tk, tv)]
    seqlen_k = tk.shape[1]
    if batch * nheads and (seqlen_q or seqlen_k):
        dod, qd, kd, vd, od = (_arrays.to_kernel(_c_contiguous(t), t.kind) for t in (tdo, tq, tk, tv, to))
        for name, x in zip(names, (dod, qd, kd, vd)):
            if not x.is_c_contiguous():
                raise ValueError(f"the tensor-core kernels need C-contiguous arrays; {name} is not (copy it, e.g. "
                                 f"with cupy.ascontiguousarray)")
        ld = _arrays.to_kernel(tl.array, tl.kind)
        (_, dq), (_, dk), (_, dv) = result
        args = (np.float32(scale * LOG2E), np.float32(scale))
        delta = cuda.device_array((batch, nheads, seqlen_q), np.float32)  # D_i, O(seqlen_q)
        if seqlen_q:
            pre = backward.make_backward_preprocess(D, 64, bf16=dtype == "bfloat16")
            api.launch(pre, (-(-seqlen_q // 64), batch * nheads), (64,), 0, (dod, od, delta))
            api.launch(dq_fn, (-(-seqlen_q // block_m), batch * nheads), (2 * block_m,), smem_dq,
                       (dod, qd, kd, vd, ld, delta, dq, *args))
        if seqlen_k:
            api.launch(dkdv_fn, (-(-seqlen_k // block_n), batch * nheads), (2 * block_n,), smem_dkdv,
                       (dod, qd, kd, vd, ld, delta, dk, dv, *args))
    return tuple(_arrays.to_caller(u, d, like) for u, d in result)
