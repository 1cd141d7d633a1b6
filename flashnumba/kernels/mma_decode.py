"""Decoding on tensor cores: split-KV attention (flash-decoding) against a KV cache read in place.

At decode time each sequence has one query token (or a few) and a long cache of keys and values: the work is
reading K and V once, and the forward kernel's grid (one block per query tile and query head) has too few blocks
to read them at the memory's speed, each walking the whole cache alone, and every query head that shares a
key/value head reading it again. This kernel changes the grid, not the algorithm:

* **the query heads that share a key/value head are rows of one tile.** With G = nheads / nheads_k, the rows of
  a block are the pairs (t, gh) of query position t and head hk G + gh, row r = t G + gh: for one query token
  and G = 4, four rows of one (16 x D) block of ``mma.sync``, so each K_j, V_j tile is read once for all G heads;
* **the key range is split** (the grid's x): split s of S takes tiles s ceil(n / S) .. of the n key tiles the
  rows can see, so batch x nheads_k x S blocks read the cache at once;
* **the warps of a block split each tile**: warp w takes keys 16 w .. 16 w + 15 (``KW`` keys) of every tile, each
  warp keeping its own m, l and O for the block's 16 rows (the rows are too few to give the warps rows).

Every (warp, split) pair is an attention over part of the keys, with its own running max m, sum l and
unnormalised output O. Partial results combine exactly, by the same algebra as the online softmax
(:func:`flashnumba.reference.combine_splits` is the blocked NumPy version): with L_s = m_s + log(l_s) the
logsumexp of part s and O_s = (its unnormalised output) / l_s::

    L   = log(sum_s exp(L_s))              = M + log(sum_s exp(L_s - M)),   M = max_s L_s
    O   = sum_s exp(L_s - L) O_s

(a part that saw no key has L_s = -inf and weight 0). The warps of a block combine through shared memory at the
end (in base 2, from their m and l); the splits, through a second kernel (:func:`make_combine`) that reads each
split's O_s (float32) and L_s. With one split the first kernel writes the output itself.

The cache: k_cache, v_cache (batch_cache, capacity, nheads_k, D) with ``batch_idx`` the cache row of each
sequence, or, ``paged``, (num_pages, page_size, nheads_k, D) with ``block_table`` (batch, max_pages) the page of
each page_size keys; ``seqlens_k`` (batch,) the keys of each sequence. Keys are read straight from the cache with
``cp.async`` (a paged cache: one block-table entry a tile where a page holds whole tiles, else one a row), rows
past seqlens_k are zeros, and nothing past them is read. The rest is the tensor-core forward's
(:mod:`.mma_forward`): the fragment layout, the online softmax on the accumulators, the cp.async pipeline of K_j,
V_j tiles (here :data:`STAGES` buffers by default: one tile in flight while the warps use the other), the
masks (query row t sees key j iff t + diag - left <= j <= t + diag + right, diag = seqlen_k - seqlen_q) and the
score modifications (softcap, ALiBi by query head).

A decoding step's new keys and values, and the rotary embedding of them and of the queries, come first, from a
small kernel of the same plan (:func:`make_append`): a row of elements a block, so that a step is at most three
launches: the append (new keys or rotary tables), the split-KV kernel and the combine (more than one split).
"""

from __future__ import annotations

import functools
import math

from . import bf16, ptx
from .._backend import cuda
from .common import LN2, LOG2E, NEG_INF, make_score_mod
from .mma_tiles import HEAD_DIMS, PAD, WARP_ROWS, make_mma_ab_rows, make_mma_abt_rows, padded
from .scalars import float16, float32, uint16, uint32

ROWS = WARP_ROWS  # rows (query position, head) of a block: one m16 block
# K_j, V_j buffers by default: one tile in flight while the warps compute on the other. The blocks of an SM together
# keep enough reads in flight, and the smaller buffers leave room for a third block an SM (and for smaller GPUs)
STAGES = 2
MAX_SPLITS = 128  # splits of a sequence's keys at most (the combine holds their weights in shared memory)
UNROLL = 8  # splits the combine reads at once


def _reused_bytes(D, warps, KW, stages=STAGES):
    """Q's 16 rows and ``stages`` K_j, V_j buffers of warps x KW rows (16-bit, rows of padded(D) + PAD), or the
    warps' m, l and O (float32) for the combine at the end, which reuses them: the larger."""
    LD = padded(D) + PAD
    return max((ROWS + 2 * stages * warps * KW) * LD * 2, warps * (2 * ROWS + ROWS * padded(D)) * 4)


def shared_bytes(D, warps, KW, stages=STAGES):
    """The tiles or the combine (:func:`_reused_bytes`), then the 16 rows' ALiBi slopes (float32)."""
    return _reused_bytes(D, warps, KW, stages) + 4 * ROWS


@functools.lru_cache(maxsize=None)
def make_decode_tc(D, warps, KW, dtype="float16", has_left=False, has_right=False, softcap=False, alibi=False,
                   paged=False, split=False, stages=STAGES, indexed=True, leftpad=False):
    """The split-KV decoding kernel for head_dim D (a multiple of 8 up to 256), ``warps`` warps of ``KW`` keys each
    per tile (a multiple of 16), ``dtype`` "float16" or "bfloat16", options compiled in as flagged; ``paged``: the
    cache in pages (block_table); ``split``: several splits, written to o_part / lse_part for :func:`make_combine`
    (else to out / lse); ``stages`` K_j, V_j buffers (2 or more: stages - 1 tiles in flight); ``indexed``: (not
    paged) sequence b reads cache entry batch_idx[b], else entry b; ``leftpad``: (not paged) sequence b's keys
    start at position leftpad[b] of its cache row (left padding below it), else at 0.

    Arguments: (q, k_cache, v_cache, out, lse, o_part, lse_part, seqlens_k, batch_idx, block_table, alibi,
    leftpad, scale_q, softcap, left, right). q (batch, seqlen_q, nheads, D), out like it, lse (batch, nheads, seqlen_q)
    float32; k_cache, v_cache as in the module docstring, C-contiguous, float16 or uint16 holding bfloat16 bits;
    o_part (splits, batch, seqlen_q, nheads, D) and lse_part (splits, batch, nheads, seqlen_q) float32 (natural
    log); seqlens_k, batch_idx, leftpad (batch,) int32, block_table (batch, max_pages) int32 (dummies where not
    used); alibi (batch, nheads) float32. scale_q = softmax_scale * log2(e), or softmax_scale with softcap or ALiBi.

    Launch: grid (splits, batch * nheads_k, ceil(seqlen_q * G / 16)), block (32 * warps,), dynamic shared memory
    :func:`shared_bytes` (with the same ``stages``).
    """
    if D not in HEAD_DIMS:
        raise ValueError(f"the decoding kernel supports head_dim a multiple of 8 up to 256, got {D}")
    if KW % 16 or KW <= 0 or warps not in (1, 2, 4, 8):
        raise ValueError(f"KW must be a positive multiple of 16 and warps 1, 2, 4 or 8, got {KW}, {warps}")
    if stages < 2:
        raise ValueError(f"stages must be at least 2, got {stages}")
    STAGES = stages
    is_bf16 = dtype == "bfloat16"
    store = bf16.load_store(is_bf16)[1]
    elem = uint16 if is_bf16 else float16
    SCORE_MOD = softcap or alibi
    score_mod = make_score_mod(softcap, alibi)
    HAS_LEFT, HAS_RIGHT, PAGED, SPLIT, ALIBI, INDEXED = has_left, has_right, paged, split, alibi, indexed
    LEFTPAD = leftpad and not paged
    DG, D = D, padded(D)
    LD = D + PAD
    BC = warps * KW  # keys per tile of the block
    NT = 32 * warps
    CH = D // 8  # 16-byte chunks per row
    NS = KW // 8  # (16 x 8) tiles of S per warp
    NO = D // 8  # (16 x 8) tiles of O
    OFF_K = ROWS * LD  # K buffer 0; buffer s lies s BUF further on; V_j lies OFF_V after its K_j
    OFF_V = BC * LD
    BUF = 2 * BC * LD
    WAIT = STAGES - 1  # copy groups left in flight when a tile is used
    MS = 2 * ROWS + ROWS * D  # float32 per warp in the combine: m, l, O of the 16 rows
    SLOPES = _reused_bytes(DG, warps, KW, stages) // 4  # the ALiBi slopes of the 16 rows (float32), past both
    # S = Q K_w^T (K_w: the warp's KW keys of the tile), Q's A fragments read from shared memory at each k-step:
    # kept in registers they would leave too few for O at head_dim 128 (the cache's reads, not the products,
    # bound this kernel)
    mma_abt = make_mma_abt_rows(D, KW, dtype, 1, True)
    mma_ab = make_mma_ab_rows(KW, D, dtype, 1)  # O += P V_w

    @cuda.jit(device=True, inline=True)
    def load_q(smem, q, b, hk, G, ri0, R, tid):
        """The block's 16 rows of Q (row r: query position (ri0 + r) // G, head hk G + (ri0 + r) % G) into smem
        rows 0 .. 15; rows past R and columns past DG are zeros."""
        for e in range(tid, ROWS * CH, NT):
            r = e // CH
            c = (e - r * CH) * 8
            rr = ri0 + r
            dst = r * LD + c
            if rr < R and (DG == D or c < DG):
                t = rr // G
                h = hk * G + rr - t * G
                ptx.cp_async_16(smem, dst, q, ((b * q.shape[1] + t) * q.shape[2] + h) * DG + c)
            else:
                for x in range(8):
                    smem[dst + x] = 0

    @cuda.jit(device=True, inline=True)
    def load_kv(smem, off, k_cache, v_cache, b, bb, hk, j0, first_key, seqlen_k, block_table, tid):
        """Keys j0 .. j0 + BC - 1 of sequence b from the cache (a paged one through block_table) into smem from
        element ``off`` (K) and off + OFF_V (V); rows at or past seqlen_k, and (left padding) rows before
        first_key, are zeros (padding is never read: whatever it holds, NaN included, P V stays finite). Pages that
        hold whole tiles (page size a multiple of BC; tiles start at multiples of BC) cost one block-table read a
        tile, issued before the copies; smaller pages one a row."""
        P = k_cache.shape[1]
        HK = k_cache.shape[2]
        whole = not PAGED or P % BC == 0
        base = bb * P + j0  # the tile's first row in the cache
        ok = True  # (a page outside the pool, which the host did not check, reads as zeros)
        if PAGED and whole and j0 < seqlen_k:
            page = block_table[b, j0 // P]
            ok = 0 <= page < k_cache.shape[0]
            base = page * P + j0 % P
        r0 = tid // CH  # (where CH divides NT, a thread's column is the same in every step)
        c0 = (tid - r0 * CH) * 8
        for it in range((BC * CH + NT - 1) // NT):
            e = tid + it * NT
            if (BC * CH) % NT == 0 or e < BC * CH:
                if NT % CH == 0:
                    r = r0 + it * (NT // CH)
                    c = c0
                else:
                    r = e // CH
                    c = (e - r * CH) * 8
                j = j0 + r
                dst = off + r * LD + c
                row = base + r
                if PAGED and not whole and j < seqlen_k:
                    page = block_table[b, j // P]
                    ok = 0 <= page < k_cache.shape[0]
                    row = page * P + j % P
                if ok and j < seqlen_k and (not LEFTPAD or j >= first_key) and (DG == D or c < DG):
                    src = (row * HK + hk) * DG + c
                    ptx.cp_async_16(smem, dst, k_cache, src)
                    ptx.cp_async_16(smem, dst + OFF_V, v_cache, src)
                else:
                    for x in range(8):
                        smem[dst + x] = 0
                        smem[dst + OFF_V + x] = 0

    @cuda.jit
    def decode_tc(q, k_cache, v_cache, out, lse, o_part, lse_part, seqlens_k, batch_idx, block_table, alibi,
                  leftpad, scale_q, softcap, left, right):
        HK = k_cache.shape[2]
        SQ = q.shape[1]
        G = q.shape[2] // HK
        R = SQ * G  # rows (query position, head) of this key/value head
        tid = cuda.threadIdx.x
        warp = tid // 32
        lane = tid % 32
        g = lane >> 2  # rows g and g + 8 of the block
        t4 = lane & 3  # columns 2 t4, 2 t4 + 1 of each 8-wide tile
        split = cuda.blockIdx.x
        b = cuda.blockIdx.y // HK
        hk = cuda.blockIdx.y % HK
        ri0 = cuda.blockIdx.z * ROWS
        # this sequence's keys, clipped to the cache's capacity, and its cache row; values the host did not check
        # (device arrays, config.check_cache_values off) cannot make the kernel read outside the arrays: a
        # cache_batch_idx outside the cache gives the sequence no keys
        cap = block_table.shape[1] * k_cache.shape[1] if PAGED else k_cache.shape[1]
        seqlen_k = min(max(seqlens_k[b], 0), cap)
        bb = 0
        if not PAGED:
            bb = batch_idx[b] if INDEXED else b
            if bb < 0 or bb >= k_cache.shape[0]:
                bb = 0
                seqlen_k = 0
        # (left padding) the first key attended to; positions stay the cache's, so the masks' diagonal too
        first_key = min(max(leftpad[b], 0), seqlen_k) if LEFTPAD else 0
        diag = seqlen_k - SQ
        # this lane's rows' query positions; (ALiBi) the slopes of the rows' heads, in shared memory (registers
        # are short at head_dim 128)
        pos0 = (ri0 + g) // G
        pos1 = (ri0 + g + 8) // G
        red = cuda.shared.array(0, float32)  # the same memory as float32: slopes, and the warps' combine
        if ALIBI and tid < ROWS:
            rs = min(ri0 + tid, R - 1)
            red[SLOPES + tid] = alibi[b, hk * G + rs - (rs // G) * G]

        # the key tiles the block's rows see (left padding, causal / window), and this split's share of them
        n_start = first_key // BC * BC
        n_end = seqlen_k
        if HAS_LEFT:
            n_start = max(first_key, ri0 // G + diag - left) // BC * BC
        if HAS_RIGHT:
            n_end = max(0, min(seqlen_k, (min(ri0 + ROWS, R) - 1) // G + diag + right + 1))
        n_tiles = max(0, (n_end - n_start + BC - 1) // BC)
        per = (n_tiles + cuda.gridDim.x - 1) // cuda.gridDim.x
        first = split * per
        count = max(0, min(n_tiles, first + per) - first)

        smem = cuda.shared.array(0, elem)  # Q | K, V buffer 0 | K, V buffer 1 (dynamic), shared
        qa = cuda.local.array((1, 1, 4), uint32)  # A fragments of Q's 16 rows, one k-step at a time
        s = cuda.local.array((1, NS, 4), float32)  # S, then P: the warp's (16, KW)
        pa = cuda.local.array((1, 4), uint32)  # P's A fragments of one k-step of O += P V
        o = cuda.local.array((1, NO, 4), float32)  # O: (16, D)
        m = cuda.local.array(2, float32)  # rows g, g + 8: running max (base 2), this lane's partial sum
        l = cuda.local.array(2, float32)
        m_use = cuda.local.array(2, float32)
        for x in range(2):
            m[x] = NEG_INF
            l[x] = 0.0
        for n in range(NO):
            for x in range(4):
                o[0, n, x] = 0.0

        # Prologue: Q and tiles 0 .. STAGES - 2 in flight, Q with tile 0 as one commit group, each further tile as
        # the next (an empty group where there is none)
        load_q(smem, q, b, hk, G, ri0, R, tid)
        for st in range(STAGES - 1):
            if st < count:
                load_kv(smem, OFF_K + st * BUF, k_cache, v_cache, b, bb, hk, n_start + (first + st) * BC, first_key,
                        seqlen_k, block_table, tid)
            ptx.cp_async_commit()
        for it in range(count):
            j0 = n_start + (first + it) * BC
            buf = OFF_K + (it % STAGES) * BUF
            # tile it + STAGES - 1 into the buffer tile it - 1 used (freed by the barrier that ended iteration
            # it - 1), its own group; then wait until all groups but the STAGES - 1 newest landed (tile it), and a
            # barrier
            if it + STAGES - 1 < count:
                load_kv(smem, OFF_K + ((it + STAGES - 1) % STAGES) * BUF, k_cache, v_cache, b, bb, hk,
                        j0 + (STAGES - 1) * BC, first_key, seqlen_k, block_table, tid)
            ptx.cp_async_commit()
            ptx.cp_async_wait(WAIT)
            cuda.syncthreads()
            mma_abt(s, qa, smem, 0, buf + warp * KW * LD, lane)
            jw = j0 + warp * KW  # the warp's first key
            for n in range(NS):
                for x in range(4):
                    pos = pos0 if x < 2 else pos1
                    j = jw + 8 * n + 2 * t4 + (x & 1)
                    val = s[0, n, x] * scale_q
                    if SCORE_MOD:
                        val, _ = score_mod(val, softcap, red[SLOPES + g + 8 * (x >> 1)] if ALIBI else float32(0.0),
                                           pos, j, diag)
                        val *= LOG2E
                    if j >= seqlen_k or (LEFTPAD and j < first_key) or (HAS_LEFT and j < pos + diag - left) or (
                            HAS_RIGHT and j > pos + diag + right):
                        val = NEG_INF
                    s[0, n, x] = val
            # the online softmax of the warp's rows (as the forward): the row max over the quad, then P, l, O
            mx0 = NEG_INF
            mx1 = NEG_INF
            for n in range(NS):
                mx0 = max(mx0, max(s[0, n, 0], s[0, n, 1]))
                mx1 = max(mx1, max(s[0, n, 2], s[0, n, 3]))
            mx0 = max(mx0, ptx.shfl_xor_f32(mx0, 1))
            mx0 = max(mx0, ptx.shfl_xor_f32(mx0, 2))
            mx1 = max(mx1, ptx.shfl_xor_f32(mx1, 1))
            mx1 = max(mx1, ptx.shfl_xor_f32(mx1, 2))
            a0 = float32(1.0)
            a1 = float32(1.0)
            for x in range(2):
                mx = max(m[x], mx0 if x == 0 else mx1)
                m_use[x] = mx if mx != NEG_INF else float32(0.0)
                alpha = ptx.exp2_ftz(m[x] - m_use[x])
                if x == 0:
                    a0 = alpha
                else:
                    a1 = alpha
                m[x] = mx
            ps0 = float32(0.0)
            ps1 = float32(0.0)
            for n in range(NS):
                for x in range(4):
                    p = ptx.exp2_ftz(s[0, n, x] - m_use[x >> 1])
                    if x < 2:
                        ps0 += p
                    else:
                        ps1 += p
                    s[0, n, x] = p
            l[0] = a0 * l[0] + ps0
            l[1] = a1 * l[1] + ps1
            if a0 != 1.0 or a1 != 1.0:  # O rescaled only where a row's max grew (after the first tiles, seldom)
                for n in range(NO):
                    o[0, n, 0] *= a0
                    o[0, n, 1] *= a0
                    o[0, n, 2] *= a1
                    o[0, n, 3] *= a1
            mma_ab(o, s, pa, smem, buf + OFF_V + warp * KW * LD, lane)
            cuda.syncthreads()  # every warp is done with this buffer before the next iteration copies into it
        ptx.cp_async_wait_all()
        for x in range(2):
            l[x] += ptx.shfl_xor_f32(l[x], 1)
            l[x] += ptx.shfl_xor_f32(l[x], 2)

        # the warps' partial results combined (module docstring), through the shared memory the tiles used
        cuda.syncthreads()
        base = warp * MS
        if t4 == 0:
            red[base + g] = m[0]
            red[base + g + 8] = m[1]
            red[base + ROWS + g] = l[0]
            red[base + ROWS + g + 8] = l[1]
        for n in range(NO):
            red[base + 2 * ROWS + g * D + 8 * n + 2 * t4] = o[0, n, 0]
            red[base + 2 * ROWS + g * D + 8 * n + 2 * t4 + 1] = o[0, n, 1]
            red[base + 2 * ROWS + (g + 8) * D + 8 * n + 2 * t4] = o[0, n, 2]
            red[base + 2 * ROWS + (g + 8) * D + 8 * n + 2 * t4 + 1] = o[0, n, 3]
        cuda.syncthreads()
        for e in range(tid, ROWS * DG, NT):
            r = e // DG
            c = e - r * DG
            rr = ri0 + r
            if rr < R:
                mm = NEG_INF
                for w in range(warps):
                    mm = max(mm, red[w * MS + r])
                ll = float32(0.0)
                acc = float32(0.0)
                if mm != NEG_INF:
                    for w in range(warps):
                        f = ptx.exp2_ftz(red[w * MS + r] - mm)
                        ll += red[w * MS + ROWS + r] * f
                        acc += red[w * MS + 2 * ROWS + r * D + c] * f
                t = rr // G
                h = hk * G + rr - t * G
                val = acc / ll if ll != 0 else float32(0.0)
                lval = float32(mm * LN2 + math.log(ll)) if ll != 0 else NEG_INF
                if SPLIT:
                    o_part[split, b, t, h, c] = val
                    if c == 0:
                        lse_part[split, b, h, t] = lval
                else:
                    out[b, t, h, c] = store(val)
                    if c == 0:
                        lse[b, h, t] = lval

    return decode_tc


@functools.lru_cache(maxsize=None)
def make_combine(dtype="float16"):
    """The second kernel of a split call: out and lse from the splits' o_part and lse_part (module docstring).

    One block per (query position, batch x head). The splits' L_s are read at once (a thread each) into shared
    memory; the first warp takes their max M and sum (lanes over the splits, then a butterfly of shuffles, so every
    lane holds the same L in a fixed order) and turns each L_s into its weight exp(L_s - L); then each thread sums
    its columns' w_s O_s, ``UNROLL`` splits at a time, so that as many loads are in flight instead of one: the
    partial results sit in L2 and the kernel's time is the latency of its rounds of reads (one a split, without
    the unrolling).

    Arguments: (o_part, lse_part, out, lse) as :func:`make_decode_tc`'s, at most :data:`MAX_SPLITS` splits.
    Launch: grid (seqlen_q, batch * nheads), block (32 * ceil(D / 32),) at most 256 threads (32 at least), each
    thread some columns of the row."""
    store = bf16.load_store(dtype == "bfloat16")[1]

    @cuda.jit
    def combine(o_part, lse_part, out, lse):
        t = cuda.blockIdx.x
        H = out.shape[2]
        b = cuda.blockIdx.y // H
        h = cuda.blockIdx.y % H
        S = o_part.shape[0]
        tid = cuda.threadIdx.x
        w = cuda.shared.array(MAX_SPLITS, float32)  # the splits' L_s, then their weights exp(L_s - L)
        total = cuda.shared.array(1, float32)  # L
        for sp in range(tid, S, cuda.blockDim.x):
            w[sp] = lse_part[sp, b, h, t]
        cuda.syncthreads()
        if tid < 32:
            mm = NEG_INF
            for sp in range(tid, S, 32):
                mm = max(mm, w[sp])
            for x in (16, 8, 4, 2, 1):
                mm = max(mm, ptx.shfl_xor_f32(mm, x))
            ll = float32(0.0)
            if mm != NEG_INF:
                for sp in range(tid, S, 32):
                    ll += math.exp(w[sp] - mm)
            for x in (16, 8, 4, 2, 1):
                ll += ptx.shfl_xor_f32(ll, x)
            big = float32(mm + math.log(ll)) if ll != 0 else NEG_INF
            for sp in range(tid, S, 32):  # (each lane rewrites only the entries it read)
                w[sp] = math.exp(w[sp] - big) if ll != 0 else float32(0.0)
            if tid == 0:
                total[0] = big
            for sp in range(S + tid, (S + UNROLL - 1) // UNROLL * UNROLL, 32):
                w[sp] = float32(0.0)  # the last round's splits past S weigh nothing
        cuda.syncthreads()
        part = cuda.local.array(UNROLL, float32)
        for c in range(tid, out.shape[3], cuda.blockDim.x):
            acc = float32(0.0)
            for s0 in range(0, S, UNROLL):
                # UNROLL loads with no branch between them, so all are in flight before the first sum needs one
                # (past S: split S - 1 again, weight 0)
                for u in range(UNROLL):
                    part[u] = o_part[min(s0 + u, S - 1), b, t, h, c]
                for u in range(UNROLL):
                    acc += w[s0 + u] * part[u]
            out[b, t, h, c] = store(acc)
        if tid == 0:
            lse[b, h, t] = total[0]

    return combine


APPEND_THREADS = 128  # threads of the append kernel: a row of new keys or queries is nheads x D elements


@functools.lru_cache(maxsize=None)
def make_append(dtype="float16", new=True, rotary=False, interleaved=True, local=False, paged=False, indexed=False,
                cos_dtype="float32"):
    """The kernel that runs before the attention of a decoding step: the new keys and values written into the
    cache at their positions (the keys rotated), the queries rotated, each sequence's key count after the step.

    Block (t, b) takes row t of sequence b, its threads the nheads x D elements of the row. With L = seqlens_k[b]
    (the keys the cache held before the step): new key t goes to position p = L + t of the cache (row p of cache
    entry batch_idx[b], b without ``indexed``, or with ``paged`` row p % P of page block_table[b, p // P]), rotated
    at angle row p; query t is rotated at row L + t (``local``: causal or windowed) or L, into q_rot; and
    seqlens_out[b] = L + seqlen_new. The rotation (``rotary``; rotary_cos, rotary_sin (seqlen_ro, rotary_dim / 2))
    turns each pair (x1, x2) of the first rotary_dim columns, the columns 2i and 2i + 1 (``interleaved``, GPT-J) or
    i and i + rotary_dim / 2 (GPT-NeoX), into (x1 c - x2 s, x1 s + x2 c) in float32, rounded once to the dtype, as
    :func:`flashnumba.reference.rotate_pairs`; the other columns are copied as they are.

    Values the host did not check (device arrays) cannot take the kernel outside the arrays: a position outside
    the cache, a page outside the pool or a cache entry outside the cache is not written (the attention then
    clips the sequence to the cache, reads that page as zeros, gives that entry no keys), and a rotation
    position past the tables takes their last row.

    Arguments: (q, k_new, v_new, rotary_cos, rotary_sin, k_cache, v_cache, q_rot, seqlens_k, seqlens_out,
    batch_idx, block_table); arrays of the dtype are float16, float32 or uint16 holding bfloat16 bits, the tables
    of ``cos_dtype``; the integers int32 (dummies where not used). Launch: grid (max(seqlen_new, seqlen_q) or 1,
    batch), any block size (:data:`APPEND_THREADS`)."""
    load, store = bf16.load_store(dtype == "bfloat16")
    cload = bf16.load_store(cos_dtype == "bfloat16")[0]
    NEW, ROTARY, INTERLEAVED, LOCAL, PAGED, INDEXED = new, rotary, interleaved, local, paged, indexed

    @cuda.jit(device=True, inline=True)
    def rotated(x, b, t, h, c, pos, rcos, rsin):
        """Element c of row (b, t, h) of x after the rotation at table row pos (c below rotary_dim)."""
        half = rcos.shape[1]
        if INTERLEAVED:
            i = c >> 1
            lead = (c & 1) == 0  # x1 of its pair
            mate = c ^ 1
        else:
            lead = c < half
            i = c if lead else c - half
            mate = c + half if lead else c - half
        pos = min(max(pos, 0), rcos.shape[0] - 1)
        cs = cload(rcos[pos, i])
        sn = cload(rsin[pos, i])
        xv = load(x[b, t, h, c])
        xm = load(x[b, t, h, mate])
        if lead:
            return xv * cs - xm * sn
        return xm * sn + xv * cs

    @cuda.jit
    def append(q, k_new, v_new, rotary_cos, rotary_sin, k_cache, v_cache, q_rot, seqlens_k, seqlens_out, batch_idx,
               block_table):
        t = cuda.blockIdx.x
        b = cuda.blockIdx.y
        tid = cuda.threadIdx.x
        NT = cuda.blockDim.x
        D = q.shape[3]
        RD = 2 * rotary_cos.shape[1] if ROTARY else 0
        L = seqlens_k[b]
        SN = k_new.shape[1] if NEW else 0
        if t == 0 and tid == 0:
            seqlens_out[b] = L + SN
        if NEW and t < SN:
            p = L + t
            P = k_cache.shape[1]
            ok = p >= 0 and p < (block_table.shape[1] * P if PAGED else P)
            entry = b
            row = p
            if PAGED:
                entry = block_table[b, p // P] if ok else 0
                row = p - (p // P) * P
            elif INDEXED:
                entry = batch_idx[b]
            if ok and entry >= 0 and entry < k_cache.shape[0]:
                HK = k_new.shape[2]
                for e in range(tid, HK * D, NT):
                    h = e // D
                    c = e - h * D
                    if ROTARY and c < RD:
                        k_cache[entry, row, h, c] = store(rotated(k_new, b, t, h, c, p, rotary_cos, rotary_sin))
                    else:
                        k_cache[entry, row, h, c] = k_new[b, t, h, c]
                    v_cache[entry, row, h, c] = v_new[b, t, h, c]
        if ROTARY and t < q.shape[1]:
            pos = L + t if LOCAL else L
            H = q.shape[2]
            for e in range(tid, H * D, NT):
                h = e // D
                c = e - h * D
                if c < RD:
                    q_rot[b, t, h, c] = store(rotated(q, b, t, h, c, pos, rotary_cos, rotary_sin))
                else:
                    q_rot[b, t, h, c] = q[b, t, h, c]

    return append
