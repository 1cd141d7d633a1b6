"""Forward kernel on Hopper's warpgroup MMA: FlashAttention-2's Algorithm 1 with S = Q K^T and O += P V as ``wgmma``.

The algorithm, the masking and the online softmax are those of :mod:`flashnumba.kernels.mma_forward` (read it
first); what changes is who multiplies and where the operands live. There each warp loads its fragments of K_j and
V_j from shared memory into registers (``ldmatrix``) and issues one ``mma.sync`` per 16 x 8 x 16 piece. Here a
*warpgroup* (four warps, 128 threads) owns 64 query rows and issues one ``wgmma`` per 16 columns of K: the tensor
cores read Q_i and K_j from shared memory themselves, through matrix descriptors
(:mod:`flashnumba.kernels.ptx_hopper`), and write S_ij (64 x B_c) into the warpgroup's registers; for O += P V the
A operand, P, comes from the same registers (the S accumulator, exponentiated and packed in pairs, sits where
wgmma's register A operand wants it) and V_j is read from shared memory, MN-major. Per key tile::

    S_ij = Q_i K_j^T         D / 16 wgmma m64nB_ck16 (A = Q_i, B = K_j, both from shared memory), one commit
    ...wait, then the online softmax of mma_forward on the S registers...
    O_i += P_ij V_j          B_c / 16 wgmma m64nDk16 (A = P_ij from registers, B = V_j MN-major), one commit

Launch geometry: grid (ceil(seqlen_q / B_r), batch * nheads), block 128 WG threads + 32 per producer warp
(:func:`threads`), B_r = 64 WG (WG = 1, 2 or 3 warpgroups); each block takes a query tile and a head in launch
order with the longest causal rows first (``common.make_launch_order``).
Warpgroup gw owns rows 64 gw .. 64 gw + 63 of Q_i; inside it warp w owns 16 rows and lane (g = lane >> 2,
t = lane & 3) rows g and g + 8 of them, and of S's and O's accumulators the columns 8 n + 2 t, 8 n + 2 t + 1:
register 4 n + x holds row g + 8 (x >> 1), column 8 n + 2 t + (x & 1) (the layout mma_forward's fragments have,
repeated along the columns).

Shared memory, dynamic: Q_i | K, V buffer 0 | 1 | 2, each tile stored as *core matrices* of 8 rows x 8 head
dims (128 contiguous bytes), column-block after column-block: head dims 8 c .. 8 c + 7 of rows 8 r .. 8 r + 7 lie
at (c rows / 8 + r) 128 bytes. Read K-major (LBO = rows x 16 bytes steps 8 head dims, SBO = 128 bytes 8 rows) the
tile is Q_i or K_j; read MN-major (LBO = 128 bytes steps 8 keys, SBO = B_c x 16 bytes 8 head dims) it is V_j. No
padding is needed: each core matrix is one 128-byte line of the 32 banks. The copies (``cp.async``, 16 bytes a
thread) go 8 rows x 4 column blocks a warp, so that each quarter-warp writes one whole core matrix (no bank
conflict) and each row is read 64 bytes at a time; each thread makes its landed copies visible to the tensor
cores' ("async proxy") reads with ``fence.proxy.async`` before the barrier that publishes a tile.

The pipeline. A wgmma is issued and runs on its own; the warpgroup waits only when it needs the result. So the
softmax of tile j runs while the tensor cores multiply P of tile j - 1 by V_j-1 (FlashAttention-3's overlap within
a warpgroup), and the copies of tile j + 1 fly meanwhile; three K, V buffers hold tiles j - 1 (its V still being
read), j and j + 1. Iteration j, one barrier::

    wait for tile j's copies; fence.proxy.async; barrier       (iteration j - 1 done: tile j - 2's buffer free)
    copy tile j + 1 into that buffer                              cp.async, in flight until iteration j + 1
    issue S_ij = Q_i K_j^T                                        group 1 (tensor cores)
    issue O_i += P_i,j-1 V_j-1                                    group 2 (tensor cores, after group 1)
    wait for group 1; softmax of S_ij -> alpha, P_ij (float32)    (CUDA cores, while group 2 runs)
    wait for group 2; O_i *= alpha; P_ij packed to 16 bits        (the A operand of the next iteration's group 2)

and one more iteration after the last tile issues its P V alone. Two warpgroups share each K_j, V_j tile (half the
shared-memory traffic a query row of one warpgroup alone would cost). In the machine code the assembler issues
the wait for group 2 straight after that for group 1, above the softmax's exponentials (the wait names none of
their registers); ``overlap`` (:func:`make_forward_wgmma`) keeps it below them, and measured with the ping-pong
below it gained nothing (docs/benchmarks.md, "The softmax beside the product").

**Warp specialisation** (``producer``). Above, every thread copies and a block-wide barrier a tile keeps the
warpgroups in step: both run their softmax at the same time, and the tensor cores wait meanwhile. With a
*producer*, four more warps (one warp is offered too, but a single warp's copies, each thread's address arithmetic
and ``cp.async`` issued from one of the SM's four schedulers, fall behind the tensor cores), the copies leave the
warpgroups: it copies tile j into buffer j % 3 as soon as both
warpgroups have released the tile that was there, and each thread of it arrives on that buffer's ``full``
mbarrier when its copies land (``cp.async.mbarrier.arrive``); a warpgroup waits for ``full`` instead of the
barrier, and arrives on the buffer's ``empty`` mbarrier once its P V of the tile retired. With no block-wide
barrier left, the two warpgroups take turns at the tensor cores (FlashAttention-3's ping-pong): each waits on
its own named barrier before issuing its products and lets the other go after, so that one's softmax runs while
the other's products do::

    producer      copy 0  copy 1  copy 2  (wait for tile 0 released) copy 3 ...
    warpgroup 0   [S_0] softmax          [S_1 PV_0] softmax          [S_2 PV_1] softmax ...
    warpgroup 1          [S_0] softmax             [S_1 PV_0] softmax           [S_2 PV_1] ...

([...]: issued in that warpgroup's turn.) The loop is the one above with the barrier and the copies replaced
(``tile_ready``, ``tile_done``, ``my_turn``, ``their_turn``).

**Tensor-map copies** (``tma``). With a producer warpgroup beside two that compute, one thread of it may make every
copy: a ``tma_load_4d`` a box of B_c keys x 64 head dims (two at head_dim 128; at 96, three of 32) that the SM's
copy engine fetches with no address arithmetic a thread and no pass through L1 (the path the per-thread copies are
bound by), writes swizzled (:mod:`flashnumba.kernels.ptx_hopper`) and counts on the stage's ``full`` mbarrier, where
the thread announces the stage's bytes first (``mbarrier_arrive_expect_tx``: the one arrival the phase waits for). A
tile then lies as rows of 64 head dims (128 bytes; the 16-byte chunks of row r exchanged by r % 8; where 64 does
not divide the head dim (32, 96, 160, 224) rows of 32, 64 bytes, the 64-byte swizzle), the next 64 head dims B_c
rows on, and the descriptors say so (K-major for Q_i and K_j, MN-major for V_j). Rows past the sequence come as
zeros from the copy engine. The host encodes the tensor maps of q, k and v (:mod:`flashnumba._tensormap`); packed
sequences keep the per-thread copies (a box would reach into the next sequence, where the kernel needs zeros).

**Persistent blocks** (``persistent``, with tensor maps). A block of a producer and two warpgroups that compute
fills an SM (its registers), so a block's start (Q_i and the first K_j, V_j fetched while nothing computes) and its end
(the last P V, the output's stores) leave the tensor cores idle, once per query tile: with short key loops (causal
rows at 4096 keys, a block mask's few blocks) a visible share. A persistent block (one an SM) instead takes work items
one after another, (query tile, batch entry, head), and its pipeline runs on across them: the producer copies the
next item's Q_i as soon as the last S of the item before has read it (``q_free``, an mbarrier the warpgroups arrive
on) and its first K_j, V_j into the next stages, while the warpgroups finish the last softmax and P V and store
the output.
Tile jt of an item is tile g0 + jt of the block's pipeline (g0: the tiles of its earlier items), which names its
buffer and phase. The blocks take pairs of query tiles in turn (pair P to block P mod G): a head's pairs one after
another (the blocks that run at once share their heads' K and V in the L2 cache), pair P of a head its query tiles P
and nq - 1 - P from the end, the longer first, whose causal rows together see about as many keys as any other
pair's: with single tiles in turn, the same blocks drew the longest causal rows again and again (docs/benchmarks.md,
"Persistent blocks")::

    producer   Q_a K_0 K_1 K_2 .. K_n         (q_free) Q_b K_0 K_1 ..
    warpgroups     [S_0] .. [S_n PV_n-1] S_n in -> q_free, softmax [PV_n] out_a   [S_0 of b] ..

**A user's score_mod, mask_mod and block masks** (``mods``, ``block_mask``; :func:`flashnumba.flex_attention`
with ``kernel="wgmma"``). The score_mod modifies each score after softcap and ALiBi, as they do. The mask_mod runs
in every tile that it may hide entries of (every tile without a block mask, a block mask's partial blocks with
one) before the tile's products are issued, leaving one bit a score that the mask's pass reads: its code then has
the registers the scores will take (evaluated beside them, with O_i and the packed P of the running product, a
mask of 128 keys spilled at head_dim 128). With a block mask the key loop visits the tiles of the key blocks it
lists for the query block, in order; the producer reads the same list for its copies, and the warpgroups read each
tile's first key and its block's state a tile ahead, behind the previous tile's products, so that these loads'
latency does not stand before the tile's mask bits and products (the state says whether the mask_mod runs).

**Registers where the work is.** The SM's 64K registers are shared by its threads: a block of 384 starts each at
168. The producer only copies, so with two warpgroups it gives back all but 56 (``setmaxnreg.dec``) and each
warpgroup that computes takes 224 (``setmaxnreg.inc``), which S_ij of 128 keys (64 a thread) beside O_i of 128
head dims (64 a thread) and P_ij packed need. The assembler honours this only in a kernel it sees whole, with the
block's threads and one block an SM in its launch bounds (:func:`rebalances`; ``flashnumba._launch.bounds``,
``assemble_whole``).

**Three warpgroups** (block_m 192, ``warpgroups=3``, with the producer warpgroup and tensor maps: 512 threads).
At head_dim 64 the softmax of a tile costs about as much as its two products, so with two warpgroups the tensor
cores wait while both are in their softmax. Three take their turns round a ring (named barriers 1, 2, 3: each
waits for the one before, warpgroup 0 for the last), so that two softmaxes may run while one warpgroup's products
do, and each K_j, V_j tile copied serves 192 query rows. The registers are the price: the producer keeps 32 and each
warpgroup takes 160 (:data:`REGISTERS`), room for 128 keys' scores beside O of 64 head dims, not for the per-score
options beside them (``tiling.wgmma_for_variant`` gives B_c 64 there), nor for O above head_dim 160 (:func:`check`).

**Head dims above 128.** Nothing in the loop changes: O's wgmma is m64nDk16 (N up to 256, the instruction's
largest), S's takes D / 16 k-steps, a tile copied with tensor maps is D / 64 boxes (D / 32 at 160 and 224). What
changes is room. O_i is D / 2 registers a thread, and Q_i with three K_j, V_j stages takes (B_r + 6 B_c) 2 D bytes
of shared memory: two warpgroups with tiles of 64 keys fit the SM's 227 KB up to head_dim 224, and head_dim 256
takes tiles of 48 keys (208 KB: S's wgmma is m64n48k16, P V three k-steps of 16 keys), or of 32 (160 KB) where the
options' per-score work needs the registers beside O's 128; tiles of 64 would take 256 KB.
"""

from __future__ import annotations

import functools
import math

from .scalars import float16, float32, int32, int64, uint16, uint32, uint64

from . import ptx, ptx_hopper as hop
from .._backend import cuda
from .block_mask import make_block_full
from .common import (LN2, LOG2E, NEG_INF, dropout_uniform, make_column_bounds, make_key_tiles, make_launch_order,
                     make_mask_bits, make_online_softmax, make_score_mod, make_sequence_geometry,
                     make_user_score_within)

HEAD_DIMS = tuple(range(32, 257, 32))  # multiples of 32 (the copies' 4 column blocks a warp), N of O's wgmma <= 256
BLOCK_NS = (32, 48, 64, 128)  # keys a tile (N of S's wgmma, K of O's: multiples of 16; below 64 where three stages of
# 64 keys do not fit, head_dim 256)
WARPGROUPS = (1, 2, 3)  # of 64 query rows: B_r 64, 128 or 192
CORE = 64  # elements (16-bit) of a core matrix: 8 rows x 8 head dims, 128 bytes


STAGES = 3  # K_j, V_j buffers: tile j + 1 in flight while tile j's S and tile j - 1's P V are computed


PRODUCER_WARPS = (0, 1, 4)  # warps of the producer: none, one, or a warpgroup (one warp on each scheduler)
# A block of two warpgroups and a producer warpgroup (384 threads) starts each thread at 168 registers (the SM's 64K
# over 384, in steps of 8). The producer only copies: it gives registers back and the warpgroups that compute take
# them (setmaxnreg; 128 x 56 + 256 x 224 = 64512 of 65536), which scores of 128 keys beside O of 128 head dims need.
# (With 40 the producer's copies of packed sequences with dropout's arguments spill.)
PRODUCER_REGISTERS, CONSUMER_REGISTERS = 56, 224
# Three warpgroups and the producer (512 threads) start at 128: the producer, whose one thread copies with tensor
# maps, keeps 32 and the three take 160 each (128 x 32 + 384 x 160 = 65536), room for scores of 128 keys beside O of
# 64 head dims.
REGISTERS = {2: (PRODUCER_REGISTERS, CONSUMER_REGISTERS), 3: (32, 160)}


def rebalances(warpgroups, producer) -> bool:
    """Whether the block moves the producer's registers to the warpgroups (two or three of them and a producer
    warpgroup: :data:`REGISTERS`). Such a kernel must be assembled as the whole program
    (``flashnumba._launch.assemble_whole``)."""
    return warpgroups in REGISTERS and int(producer) == 4


def threads(warpgroups, producer=0):
    """Threads of a block: 128 a warpgroup, and 32 a warp of the producer (warp specialisation)."""
    return 128 * warpgroups + 32 * int(producer)


def producer_warps(block_m, num_threads):
    """The producer's warps in a block of ``num_threads`` with ``block_m`` query rows (the inverse of
    :func:`threads`); None where the threads are not those of a producer of :data:`PRODUCER_WARPS`."""
    extra = num_threads - 2 * block_m
    return extra // 32 if extra % 32 == 0 and extra // 32 in PRODUCER_WARPS else None


def check(D, block_m, block_n, num_threads):
    """ValueError unless the forward takes these tiles at head_dim D (:data:`HEAD_DIMS`): block_m 64 a warpgroup
    (:data:`WARPGROUPS`), block_n in :data:`BLOCK_NS`, num_threads those of the warpgroups and a producer of
    :data:`PRODUCER_WARPS` (:func:`threads`; None: not such a count), and both tiles a multiple of the rows that the
    threads copying per thread (the producer's, or without one every thread) take a pass (:func:`pass_rows`)."""
    if D not in HEAD_DIMS:
        raise ValueError(f"the wgmma forward supports head_dim in {HEAD_DIMS}, got {D}")
    if block_m not in tuple(64 * w for w in WARPGROUPS) or block_n not in BLOCK_NS:
        raise ValueError(f"the wgmma forward takes block_m 64, 128 or 192 (one to three warpgroups of 64 rows) and "
                         f"block_n in {BLOCK_NS}, got {block_m}, {block_n}")
    pw = producer_warps(block_m, num_threads) if num_threads is not None else None
    if pw is None:
        allowed = tuple(threads(block_m // 64, p) for p in PRODUCER_WARPS)
        raise ValueError(f"the wgmma forward takes num_threads in {allowed} at block_m {block_m} (128 a warpgroup "
                         f"of 64 rows, and 32 a warp of the producer), got {num_threads}")
    if block_m == 192 and pw != 4:
        raise ValueError(f"the wgmma forward takes three warpgroups (block_m 192) with a producer warpgroup only "
                         f"(num_threads 512: their registers are the producer's), got {num_threads}")
    if block_m == 192 and D > 160:  # (at 192, O of 96 registers beside S spilled 176 bytes, compiled for sm_90a)
        raise ValueError(f"the wgmma forward takes three warpgroups (block_m 192) up to head_dim 160, where O beside "
                         f"the scores fits their 160 registers a thread; got head_dim {D}")
    copiers = 32 * pw if pw else 2 * block_m
    rows = pass_rows(D, copiers)
    if block_m % rows or block_n % rows:
        raise ValueError(f"at head_dim {D} the wgmma forward's {copiers} copying threads take {rows} rows a pass: "
                         f"block_m and block_n must be multiples of it, got {block_m}, {block_n}")


def shared_bytes(D, B_c, B_r, tma=False):
    """Q_i (B_r rows) and :data:`STAGES` K_j, V_j buffers (B_c rows each), 16-bit elements, unpadded; with
    tensor-map copies, room to start them on 1024 bytes."""
    return (B_r + 2 * STAGES * B_c) * D * 2 + (hop.SWIZZLE_ALIGN if tma else 0)


TMA_HEAD_DIMS = HEAD_DIMS  # head dims whose rows are whole swizzled rows (swizzle_span)


def swizzle_span(D):
    """Bytes of a swizzled row of the tiles copied with tensor maps: 128 (64 head dims) where they divide a row of
    D head dims, else 64 (32; head_dim 96: three such rows, head_dim 32: one, 160: five, 224: seven)."""
    return 128 if D % 64 == 0 else 64


def takes_tma(D, variant, warpgroups, producer) -> bool:
    """Whether the forward copies with tensor maps: with a producer warpgroup beside two or three that compute,
    head_dim in :data:`TMA_HEAD_DIMS`, and sequences of equal length (a box reaching past a packed sequence's end
    would read the next sequence's rows where the kernel needs zeros)."""
    return rebalances(warpgroups, producer) and D in TMA_HEAD_DIMS and not variant[4]


def takes_persistent(D, variant, B_c, warpgroups=2) -> bool:
    """Whether the persistent form of the forward (with tensor maps: :func:`takes_tma`) keeps its registers at these
    tiles: two warpgroups (with three, 160 registers a thread, its walk over the work items spilled 60 bytes beside
    128 keys' scores at head_dim 64, compiled for sm_90a), and not with ALiBi at head_dim 128 and above with 128 keys
    a tile, where that walk beside the slope and O of 128 head dims spill 64-84 bytes (the per-tile blocks none)."""
    return warpgroups == 2 and not (variant[3] and D >= 128 and B_c >= 128)


def _constant_steps(D, NT):
    """Whether :func:`make_load_core`'s NT threads copy rows of D head dims in constant steps: the warps a multiple
    of D / 32 (the 4-block groups of a row), at most four rows of them, or D / 32 a multiple of the warps."""
    CB, NW = D // 32, NT // 32
    return (NW % CB == 0 and NW // CB <= 4) or CB % NW == 0


def pass_rows(D, NT):
    """Rows that :func:`make_load_core`'s NT threads copy a pass at head_dim D: the tiles they copy must be a
    multiple of it (8 rows a warp's pass, times the warps that share a row group in the constant-stepped form)."""
    return 8 * max(NT // 32 // (D // 32), 1) if _constant_steps(D, NT) else 8


@functools.lru_cache(maxsize=None)
def make_load_core(D, NT):
    """load_core(smem, off, src, b, row0, row_end, h, rows, tid): start the copy, by threads tid = 0 .. NT - 1, of
    ``rows`` (a multiple of :func:`pass_rows`) rows of src[b, row0 + r, h, :] (C-contiguous (batch, seqlen, nheads,
    D)) into the core-matrix layout of the module docstring at element ``off``; rows at or past ``row_end`` become
    zeros (a row of garbage could hold a NaN, and 0 * NaN is NaN). Each warp copies 8 rows x 4 blocks of 8 head
    dims at a time: lane l the row 8 r + (l % 8) and the block 4 c + l // 8, so lanes 8 q .. 8 q + 7 fill one core
    matrix. Where the warps are a multiple of D / 32 (the 4-block groups of a row), or D / 32 a multiple of the
    warps (a single producer warp), each thread keeps its column blocks and steps its row, its source and its
    destination by constants (no division a copy)."""
    CB = D // 32  # groups of 4 column blocks per row
    NW = NT // 32

    # (passes of at most 32 rows; eight warps on rows of 32 head dims, 64 a pass, take the general form)
    if _constant_steps(D, NT):
        RB = pass_rows(D, NT) // 8  # 8-row blocks the warps cover at a time
        CG = max(CB // NW, 1)  # column groups each warp takes, NW apart

        @cuda.jit(device=True, inline=True)
        def load_core(smem, off, src, b, row0, row_end, h, rows, tid):
            lane = tid & 31
            w = uint32(tid) >> 5  # (unsigned: w % CB and w // CB need no sign fix-up)
            rl = lane & 7
            for cg in range(CG):
                c = 4 * (w % CB + cg * NW) + (lane >> 3)  # (CB a constant: a shift or a multiply, once a call)
                r = 8 * (w // CB) + rl
                dst = off + (c * (rows // 8) + w // CB) * CORE + rl * 8
                g = ((b * src.shape[1] + row0 + r) * src.shape[2] + h) * D + 8 * c  # src[b, row0 + r, h, 8 c], flat
                step = 8 * RB * src.shape[2] * D
                for it in range(rows // (8 * RB)):
                    if row0 + r < row_end:
                        ptx.cp_async_16(smem, dst, src, g)
                    else:
                        for e in range(8):
                            smem[dst + e] = 0
                    r += 8 * RB
                    dst += RB * CORE
                    g += step
    else:
        @cuda.jit(device=True, inline=True)
        def load_core(smem, off, src, b, row0, row_end, h, rows, tid):
            lane = tid % 32
            rl = lane % 8
            cl = lane // 8
            for it in range((rows // 8 * CB * 32 + NT - 1) // NT):
                wc = (tid + it * NT) // 32  # this warp's 8-row x 4-block piece
                if wc < rows // 8 * CB:
                    rb = wc // CB
                    c = 4 * (wc - rb * CB) + cl  # block of 8 head dims
                    r = 8 * rb + rl
                    dst = off + (c * (rows // 8) + rb) * CORE + rl * 8
                    if row0 + r < row_end:
                        ptx.cp_async_16(smem, dst, src,
                                        ((b * src.shape[1] + row0 + r) * src.shape[2] + h) * D + 8 * c)
                    else:
                        for e in range(8):
                            smem[dst + e] = 0

    return load_core


@cuda.jit(device=True, inline=True)
def publish_tile():
    """The copies of the tile (and of Q_i) landed, seen by the tensor cores (fence.proxy.async), and every
    thread past the barrier: every warpgroup is done with the tile before, so the buffer of the one before
    that is free."""
    ptx.cp_async_wait_all()
    hop.fence_proxy_async()
    cuda.syncthreads()


@functools.lru_cache(maxsize=None)
def make_load_stage(D, NT, rows, first, second, buf):
    """load_stage(smem, it, a, b, bb, row0, row_end, h, tid): start the copies, by threads tid = 0 .. NT - 1, of
    ``rows`` rows of a and of b from row0 (:func:`make_load_core`) into buffer it % STAGES, a at element
    ``first`` + (it % STAGES) ``buf`` and b ``second`` elements after it, as one commit group: a pipeline stage of
    two tiles (the forward's K_j, V_j; the backward's K_j, V_j or Q_i, dO_i)."""
    load_core = make_load_core(D, NT)

    @cuda.jit(device=True, inline=True)
    def load_stage(smem, it, a, b, bb, row0, row_end, h, tid):
        nb = first + (it % STAGES) * buf
        load_core(smem, nb, a, bb, row0, row_end, h, rows, tid)
        load_core(smem, nb + second, b, bb, row0, row_end, h, rows, tid)
        ptx.cp_async_commit()

    return load_stage


@cuda.jit(device=True, inline=True)
def wait_phase(bars, i, parity):
    """Until the phase of parity ``parity`` of mbarrier bars[i] has completed."""
    addr = hop.smem_address(bars, i)
    while hop.mbarrier_try_wait(addr, parity) == 0:
        pass


@cuda.jit(device=True, inline=True)
def swizzle_base(smem):
    """The element of ``smem`` (16-bit elements) from which tiles start on :data:`SWIZZLE_ALIGN` bytes, as the
    swizzled copies need (the kernels' shared_bytes leave the room)."""
    return ((hop.SWIZZLE_ALIGN - (hop.smem_address(smem, 0) & (hop.SWIZZLE_ALIGN - 1)))
            & (hop.SWIZZLE_ALIGN - 1)) >> 1


@cuda.jit(device=True, inline=True)
def init_stages(bars, full, empty, fence, tid, stages):
    """Thread 0 makes bars[0 .. stages - 1] the stages' ``full`` mbarriers (``full`` arrivals a phase) and
    bars[stages ..] their ``empty`` ones (``empty`` arrivals), the inits made visible to the copy engine where
    ``fence`` (tensor-map copies); then every thread of the block past a barrier."""
    if tid == 0:
        for st in range(stages):
            hop.mbarrier_init(hop.smem_address(bars, st), full)
            hop.mbarrier_init(hop.smem_address(bars, stages + st), empty)
        if fence:
            hop.fence_mbarrier_init()
    cuda.syncthreads()


def check_block_mask(block_mask, rows, cols):
    """ValueError unless a Hopper kernel's tiles of ``rows`` queries and ``cols`` keys divide the (QB, KB) blocks of
    a block mask (None: none): a tile never straddles two blocks."""
    if block_mask is not None and (block_mask[0] % rows or block_mask[1] % cols):
        raise ValueError(f"the block mask's blocks {tuple(block_mask)} must be multiples of the tiles ({rows}, "
                         f"{cols})")


@functools.lru_cache(maxsize=None)
def make_key_walk(block_mask, B_c, user_mask):
    """(first_key, part_of) of the kernels that loop over key tiles (the forward, the dQ kernel):

    * ``first_key(jt, n_start, qb, blocks)``: the first key of the jt-th key tile the block visits, from n_start on
      one after the other, or with a block mask of (QB, KB) blocks the tiles of the key blocks blocks[qb] lists
      (blocks: bm_idx[b, h], read only then);
    * ``part_of(state, bbm, hbm, qb, j0)``: whether the user's mask_mod (``user_mask``: whether there is one) runs
      in the tile from key j0: in every tile but a block mask's full ones."""
    BM = block_mask is not None
    KB = block_mask[1] if BM else B_c
    SUB = KB // B_c  # key tiles a block of the block mask
    block_full = make_block_full(BM, KB)

    @cuda.jit(device=True, inline=True)
    def first_key(jt, n_start, qb, blocks):
        if BM:
            return blocks[qb, jt // SUB] * KB + (jt % SUB) * B_c
        return n_start + jt * B_c

    @cuda.jit(device=True, inline=True)
    def part_of(state, bbm, hbm, qb, j0):
        return user_mask and not block_full(state, bbm, hbm, qb, j0)

    return first_key, part_of


@functools.lru_cache(maxsize=None)
def make_copy_box_rows(D):
    """copy_box_rows(smem, off, maps, m, bb, row0, h, rows, bar): copy ``rows`` rows of tensor map m of ``maps``
    (a (batch, seqlen, nheads, D) tensor) from row0, batch entry bb, head h, all D head dims, into element ``off``
    onwards, counted on the mbarrier at address ``bar``: D / E boxes of swizzled rows of E head dims
    (:func:`swizzle_span`), one after the other."""
    E = swizzle_span(D) // 2

    @cuda.jit(device=True, inline=True)
    def copy_box_rows(smem, off, maps, m, bb, row0, h, rows, bar):
        for part in range(D // E):
            hop.tma_load_4d(hop.smem_address(smem, off + part * rows * E), maps, m * hop.MAP_WORDS, part * E, h,
                            row0, bb, bar)

    return copy_box_rows


@functools.lru_cache(maxsize=None)
def make_swizzled_products(kind, D):
    """The products on tiles copied with tensor maps (swizzled rows of E head dims, a tile of R rows being D / E
    such tiles of R rows one after the other), as two factories of device functions:

    * ``make_abt(N, K=D)`` -> ``issue_abt(acc, a_addr, rows_a, b_addr, rows_b)``: acc = A B^T (64 x N over K head
      dims), K / 16 wgmma with A (64 rows at a_addr of a tile of rows_a) and B (N rows of a tile of rows_b) K-major:
      the next 16 head dims 32 bytes on within a swizzled row, the next E a tile of rows on (K < D: the addresses
      are those of the first head dim taken, a multiple of E into the rows); not committed;
    * ``make_ab(regs, N=D)`` -> ``issue_ab(acc, pa, b_addr, rows_b)``: acc += A B (64 x N, K = 16 ``regs``), A from
      the registers pa (``regs`` k-steps), B MN-major (N head dims of a tile of rows_b rows from b_addr, a multiple
      of E head dims into it: the next E head dims a tile of rows on, the next 16 rows 16 swizzled rows on); not
      committed."""
    SPAN = swizzle_span(D)
    E = SPAN // 2
    MODE = hop.SWIZZLE_MODES[SPAN]

    def make_abt(N, K=D):
        mma, fence, _ = hop.wgmma_ops(kind, N)
        KS = K // 16

        @cuda.jit(device=True, inline=True)
        def issue_abt(acc, a_addr, rows_a, b_addr, rows_b):
            da = hop.make_desc_swizzled(a_addr, 16, 8 * SPAN, MODE)
            db = hop.make_desc_swizzled(b_addr, 16, 8 * SPAN, MODE)
            fence(acc)
            for ks in range(KS):
                mma(acc, da + ((16 * ks // E) * rows_a * SPAN + (32 * ks) % SPAN) // 16,
                    db + ((16 * ks // E) * rows_b * SPAN + (32 * ks) % SPAN) // 16, ks)

        return issue_abt

    def make_ab(regs, N=D):
        mma, fence, _ = hop.wgmma_ops(kind, N, regs_a=True, trans_b=True)

        @cuda.jit(device=True, inline=True)
        def issue_ab(acc, pa, b_addr, rows_b):
            db = hop.make_desc_swizzled(b_addr, rows_b * SPAN, 8 * SPAN, MODE)
            fence(acc)
            for kc in range(regs):
                mma(acc, pa[kc, 0], pa[kc, 1], pa[kc, 2], pa[kc, 3], db + kc * SPAN, 1)

        return issue_ab

    return make_abt, make_ab


def make_tma_producer(D, first_maps, first_rows, first_gap, stage_rows, stage_at, stage_gap, buf, coords,
                      stages=STAGES):
    """produce(smem, base, bars, maps, bb, first_h, first_row0, n_tiles, c0, c1, c2, c3, idx, g0): the copies of a
    producer thread with the copy engine, for the forward and both backward kernels. With tile 0 it copies the tiles
    a block loads once: ``first_maps`` tiles of ``first_rows`` rows (maps 0, 1, ...: the forward's Q_i; the dQ
    kernel's Q_i, dO_i; the dK/dV kernel's K_j, V_j), ``first_gap`` elements apart from ``base``. Then the pipeline
    stage of tile jt, two tiles of ``stage_rows`` rows (the next two maps, head and first row ``coords(jt, c0, c1, c2,
    c3, idx)``; idx: an array the coordinates may read, a block mask's list), into buffer (g0 + jt) % stages at element
    base + ``stage_at`` + ((g0 + jt) % stages) ``buf``, ``stage_gap`` apart, once the consumers have released the
    tile that was there (bars[stages + (g0 + jt) % stages], ``empty``). Each stage's bytes are announced on its
    ``full`` mbarrier (bars[(g0 + jt) % stages]: the one arrival of this thread) and counted there as they land.
    ``g0``: the tiles this block's pipeline carried before (0; a persistent forward's earlier work items).
    ``stages``: the buffers of the pipeline (:data:`STAGES`; the backward at head_dim 256 with tiles of 48 has room
    for two)."""
    copy_box_rows = make_copy_box_rows(D)
    N_MAPS = first_maps + 2
    FIRST_BYTES = first_maps * first_rows * D * 2
    STAGE_BYTES = 2 * stage_rows * D * 2

    @cuda.jit(device=True, inline=True)
    def produce(smem, base, bars, maps, bb, first_h, first_row0, n_tiles, c0, c1, c2, c3, idx, g0):
        if g0 == 0:
            for m in range(N_MAPS):
                hop.fence_tensormap(maps, m * hop.MAP_WORDS)
        for jt in range(n_tiles):
            gt = g0 + jt
            st = gt % stages
            if gt >= stages:
                wait_phase(bars, stages + st, (gt // stages + 1) & 1)  # tile gt - stages released
            full = hop.smem_address(bars, st)
            hop.mbarrier_arrive_expect_tx(full, STAGE_BYTES + (FIRST_BYTES if jt == 0 else 0))
            if jt == 0:
                for m in range(first_maps):
                    copy_box_rows(smem, base + m * first_gap, maps, m, bb, first_row0, first_h, first_rows, full)
            h, row0 = coords(jt, c0, c1, c2, c3, idx)
            nb = base + stage_at + st * buf
            copy_box_rows(smem, nb, maps, first_maps, bb, row0, h, stage_rows, full)
            copy_box_rows(smem, nb + stage_gap, maps, first_maps + 1, bb, row0, h, stage_rows, full)

    return produce


@functools.lru_cache(maxsize=None)
def make_forward_wgmma(D, variant, B_c, warpgroups, dtype="float16", gqa=False, positive_scale=True, producer=0,
                       tma=False, mods=None, block_mask=None, persistent=False, overlap=False):
    """The Hopper forward kernel for head_dim D (:data:`HEAD_DIMS`), B_c keys a tile (:data:`BLOCK_NS`), ``warpgroups``
    warpgroups of 64 query rows (B_r = 64 warpgroups), ``dtype`` "float16" or "bfloat16", and the options of ``variant``
    (:class:`flashnumba.kernels.common.Variant`: window bounds, softcap, ALiBi, varlen, dropout) compiled in as in
    :func:`flashnumba.kernels.mma_forward.make_forward_tc`, whose arguments it takes, with the tensor maps after the
    options': (q, k, v, out, lse, scale_q, softcap, left, right, alibi, cu_q, cu_k, p_drop, rp_keep, seed, offset, maps,
    a0, a1, a2, a3, bm_num, bm_idx, bm_state); q, k, v, out C-contiguous. ``mods``: a user's score_mod and mask_mod
    (:class:`flashnumba.kernels.common.Mods`), called for the entries within the sequences, reading the arrays a0 .. a3:
    the score_mod at every score after softcap and ALiBi (as in make_forward_tc), the mask_mod before the products of
    the tiles it may hide entries of (``mask_tile``). ``block_mask``: (QB, KB) as in make_forward_tc (multiples of
    B_r and B_c): the key loop, the producer's copies among it, visits only the key blocks bm_idx lists for the query
    block, and the mask_mod runs only in the partial ones. With ``producer`` (warps, one of :data:`PRODUCER_WARPS`) more
    warps of the block make every copy, the warpgroups wait for tiles on mbarriers and, two or three, take turns at the
    tensor cores (module docstring: warp specialisation). Compiled for sm_90a (wgmma). With ``tma`` (:func:`takes_tma`)
    the producer's one thread copies each tile with the copy engine (module docstring: tensor-map copies), ``maps``
    holding the tensor maps of q, k and v (:mod:`flashnumba._tensormap`); without, ``maps`` is not read. Launch: grid
    (ceil(max_seqlen_q / B_r), batch * nheads), block (:func:`threads`,), dynamic shared memory :func:`shared_bytes`.
    ``persistent`` (with ``tma``): grid (G,) for any G up to the ceil(ceil(seqlen_q / B_r) / 2) batch nheads pairs of
    query tiles, each block taking pair blockIdx.x and every G-th after it (module docstring: persistent blocks).
    ``overlap``: with tensor-map copies and two warpgroups below head_dim 256, each tile's softmax ends at the top
    of the next iteration (:func:`finish_tile`), so that it runs beside the product in flight."""
    check(D, 64 * warpgroups, B_c, threads(warpgroups, producer))
    if dtype not in ("float16", "bfloat16"):
        raise ValueError(f"dtype must be 'float16' or 'bfloat16', got {dtype!r}")
    check_block_mask(block_mask, 64 * warpgroups, B_c)
    BM = block_mask is not None
    QB = block_mask[0] if BM else 64 * warpgroups
    SUB = block_mask[1] // B_c if BM else 1  # key tiles a block of the block mask
    USER_MASK = mods is not None and mods.mask_mod is not None
    USER_SCORE = mods is not None and mods.score_mod is not None
    score_within = make_user_score_within(mods)
    hide, hidden = make_mask_bits(mods)
    HAS_LEFT, HAS_RIGHT, SOFTCAP, ALIBI, VARLEN, DROPOUT = variant
    TMA = bool(tma)
    if TMA and not takes_tma(D, variant, warpgroups, producer):
        raise ValueError(f"the wgmma forward copies with tensor maps only with a producer warpgroup and two or three "
                         f"that compute, head_dim in {TMA_HEAD_DIMS}, sequences of equal length; got head_dim {D}, "
                         f"{warpgroups} warpgroups, producer {producer}, varlen {bool(VARLEN)}")
    SCORE_MOD = SOFTCAP or ALIBI or USER_SCORE  # the score formed in natural units, modified, then base 2
    FOLD = positive_scale and not SCORE_MOD  # the scale folded into exp2's argument (mma_forward's docstring)
    score_mod = make_score_mod(SOFTCAP, ALIBI, no_calls=True)
    GQA = bool(gqa)
    sequence = make_sequence_geometry(VARLEN)
    is_bf16 = dtype == "bfloat16"
    kind = "bf16" if is_bf16 else "f16"
    pack = ptx.pack_bf16x2 if is_bf16 else ptx.pack_f16x2
    elem = uint16 if is_bf16 else float16
    B_R = 64 * warpgroups
    NC = 128 * warpgroups  # the warpgroups' threads (with a producer warp, the consumers)
    PW = int(producer)
    PRODUCER = PW > 0
    PINGPONG = PRODUCER and warpgroups > 1  # (without a producer a block-wide barrier a tile keeps them in step)
    REBALANCE = rebalances(warpgroups, producer)
    GIVE, TAKE = REGISTERS.get(warpgroups, (0, 0))  # (with REBALANCE) the producer's registers, the consumers'
    PERSIST = bool(persistent)
    # ``overlap``: with tensor-map copies and two warpgroups a tile's softmax ends (finish_tile) at the top of the
    # next iteration, with S_ij's registers held beside P packed for the product in flight; elsewhere it ends where
    # the softmax does: three warpgroups' 160 registers a thread spilled 8 bytes at d = 64, causal, and at d = 256
    # (O of 128 registers, with a window, softcap and ALiBi), with the per-thread copies (packed sequences with
    # dropout at d = 128) and without a producer (d = 128 with every option) the assembler serialised the wgmma
    FINISH_NEXT = bool(overlap) and TMA and warpgroups == 2 and D < 256
    if PERSIST and not TMA:
        raise ValueError("the wgmma forward is persistent only where it copies with tensor maps")
    Q_FREE = 2 * STAGES  # (persistent) the mbarrier of Q_i's buffer: every consumer thread done with it
    NBARS = 2 * STAGES + PERSIST if PRODUCER else 1
    NS = B_c // 2  # S accumulator registers a thread: 64 x B_c over 128 threads
    NO = D // 2  # O accumulator registers a thread
    KD = D // 16  # k-steps of S = Q K^T
    KC = B_c // 16  # k-steps of O += P V
    OFF_K = B_R * D  # K buffer 0; buffer 1 lies BUF further on; V_j lies OFF_V after its K_j
    OFF_V = B_c * D
    BUF = 2 * B_c * D
    # descriptor strides, bytes (module docstring): Q_i and K_j K-major, V_j MN-major
    LBO_Q, LBO_K, SBO_V = 16 * B_R, 16 * B_c, 16 * B_c
    SPAN = swizzle_span(D)  # bytes of a swizzled row (tensor-map copies)
    mma_s, fence_s, wait_s = hop.wgmma_ops(kind, B_c)
    mma_o, fence_o, wait_o = hop.wgmma_ops(kind, D, regs_a=True, trans_b=True)
    load_core = make_load_core(D, NC)
    load_core_p = make_load_core(D, 32 * max(PW, 1))  # the producer's
    make_abt_sw, make_ab_sw = make_swizzled_products(kind, D)
    issue_abt_sw = make_abt_sw(B_c)
    issue_ab_sw = make_ab_sw(KC)
    key_tiles = make_key_tiles(B_R, B_c, HAS_LEFT, HAS_RIGHT)
    launch_order = make_launch_order(True, HAS_RIGHT or BM)  # (uneven work: causal, a block mask)
    column_bounds = make_column_bounds(B_c, HAS_LEFT, HAS_RIGHT)
    quad_max, new_max, prob = make_online_softmax(FOLD)  # (mma_forward's steps, on the same register layout)

    @cuda.jit(device=True, inline=True)
    def mask_tile(partial, b, h, i0, r0, t, j0, seqlen_q, seqlen_k, a0, a1, a2, a3):
        """The user's mask_mod on this lane's scores of the tile of keys from j0 where the tile is ``partial``
        (none: 0), before S_ij = Q_i K_j^T is issued: one bit a score (bit 4 n + x: register s[4 n + x]), set where
        it hides the entry. Evaluated here its code has the registers the products' results will take (beside them,
        with O_i and the packed P of the product still running, 128 keys' scores spilled at head_dim 128), and the
        softmax reads one word."""
        bits = uint64(0)
        if USER_MASK:  # (a constant: partial, read a tile ahead, is a variable, and without a mask_mod no hide)
            if partial:
                for n in range(NS // 4):
                    for x in range(4):
                        bits = hide(bits, 4 * n + x, int64(b), int64(h), i0 + r0 + 8 * (x >> 1),
                                    j0 + 8 * n + 2 * t + (x & 1), seqlen_q, seqlen_k, a0, a1, a2, a3)
        return bits

    @cuda.jit(device=True, inline=True)
    def softmax_tile(s, m, l, alpha, m_use, i0, r0, t, j0, b, h, nheads, seqlen_q, seqlen_k, diag, last_row, scale_q,
                     softcap, slope, left, right, p_drop, seed, offset, partial, bits, a0, a1, a2, a3):
        """The online softmax of mma_forward on this lane's rows g and g + 8 of S_ij (registers s): scores in
        base 2 (softcap and ALiBi in natural units first), masked where the tile reaches past the sequence or out
        of a row's band, and where the user's mask_mod hides them in a ``partial`` tile (``bits``, :func:`mask_tile`),
        m_i, alpha = exp2(m_old - m_new), P_ij = exp2(S_ij - m_new) into s (0 where masked; dropout applied after
        l_i has summed it), l_i."""
        masked = (j0 + B_c > seqlen_k or (HAS_RIGHT and j0 + B_c - 1 > i0 + diag + right)
                  or (HAS_LEFT and j0 < last_row + diag - left))
        if not FOLD:
            for n in range(NS // 4):
                for x in range(4):
                    val = s[4 * n + x] * scale_q
                    if SCORE_MOD:  # (softcap, ALiBi, then the user's score_mod: mma_forward's order)
                        i = i0 + r0 + 8 * (x >> 1)
                        j = j0 + 8 * n + 2 * t + (x & 1)
                        val, _ = score_mod(val, softcap, slope, i, j, diag)
                        if USER_SCORE:  # (at indices clamped into the sequences, no branch a score)
                            val, _ = score_within(val, b, h, i, j, seqlen_q, seqlen_k, a0, a1, a2, a3)
                        val *= LOG2E
                    s[4 * n + x] = val
        if masked or partial:  # (this lane's keys: j0 + 2 t + c, c = 8 n + (x & 1); each row's c from lo to hi)
            for half in range(2):  # (rows g, then g + 8: one row's bounds live at a time)
                lo, hi = column_bounds(i0 + r0 + 8 * half, j0 + 2 * t, seqlen_k, diag, left, right)
                for n in range(NS // 4):
                    for x in range(2 * half, 2 * half + 2):
                        c = int32(8 * n + (x & 1))  # (int32 like the bounds: a 64-bit constant widens each test)
                        if c >= hi or (HAS_LEFT and c < lo):
                            s[4 * n + x] = NEG_INF
                        elif USER_MASK and hidden(bits, 4 * n + x):  # (bits: 0 outside partial tiles)
                            s[4 * n + x] = NEG_INF
        mx0 = NEG_INF
        mx1 = NEG_INF
        for n in range(NS // 4):
            mx0 = max(mx0, max(s[4 * n], s[4 * n + 1]))
            mx1 = max(mx1, max(s[4 * n + 2], s[4 * n + 3]))
        mx0 = quad_max(mx0)
        mx1 = quad_max(mx1)
        new_max(m, m_use, alpha, 0, mx0, scale_q)
        new_max(m, m_use, alpha, 1, mx1, scale_q)
        ps0 = float32(0.0)
        ps1 = float32(0.0)
        for n in range(NS // 4):
            for x in range(4):
                p = prob(s[4 * n + x], m_use[x >> 1], scale_q)
                if x < 2:
                    ps0 += p
                else:
                    ps1 += p
                if DROPOUT:
                    u = dropout_uniform(seed, offset, b * nheads + h, i0 + r0 + 8 * (x >> 1),
                                        j0 + 8 * n + 2 * t + (x & 1))
                    if u < p_drop:
                        p = float32(0.0)
                s[4 * n + x] = p
        l[0] = alpha[0] * l[0] + ps0
        l[1] = alpha[1] * l[1] + ps1

    @cuda.jit(device=True, inline=True)
    def finish_tile(o, pa, s, alpha, bars, jt_retired, retired):
        """The end of a tile's softmax: wait for the P V in flight (that of tile jt_retired, whose buffer this
        thread then releases where ``retired``), O_i *= alpha, P_ij packed (:func:`rescale_and_pack`). Taken at the
        top of the next iteration (``FINISH_NEXT``), behind the wait for the next tile's copies: the wait for the
        product names none of the registers the softmax's exponentials write, and the assembler issues an
        instruction as early as its block allows, so that at the end of the softmax, in the same block, it took the
        wait above the exponentials and the softmax no longer ran beside the product."""
        wait_o(0, o)
        if retired:
            tile_done(bars, jt_retired)
        rescale_and_pack(o, pa, s, alpha)

    @cuda.jit(device=True, inline=True)
    def rescale_and_pack(o, pa, s, alpha):
        """O_i *= alpha (rows g, g + 8), and P_ij (s) packed in pairs into pa, the A operand of O += P V: the
        16 keys of step c are s[8 c .. 8 c + 7] (module docstring of ptx_hopper)."""
        for n in range(NO // 4):
            o[4 * n] *= alpha[0]
            o[4 * n + 1] *= alpha[0]
            o[4 * n + 2] *= alpha[1]
            o[4 * n + 3] *= alpha[1]
        for c in range(KC):
            for r in range(4):
                pa[c, r] = pack(s[8 * c + 2 * r], s[8 * c + 2 * r + 1])

    # load_tile(smem, jt, k, v, ...): the copies of K_j, V_j (tile jt) into buffer jt % STAGES, one commit group
    load_tile = make_load_stage(D, NC, B_c, OFF_K, OFF_V, BUF)

    first_key, part_of = make_key_walk(block_mask, B_c, USER_MASK)

    @cuda.jit(device=True, inline=True)
    def produce(smem, bars, q, k, v, bb, q_row0, q_end, h, k0, n_start, qb, blocks, k_end, hk, n_tiles, lane):
        """The producer (thread ``lane`` of its warps): Q_i with the first tile, then K_j, V_j of tile jt (keys from
        k0 + :func:`first_key`) into buffer jt % STAGES once the warpgroups have released the tile that was there
        (bars[STAGES + jt % STAGES], ``empty``), arriving on bars[jt % STAGES] (``full``) when its copies land. It
        never waits for a copy itself; where a tile reaches past the sequence's end, the zeros it stored are made
        visible to the tensor cores first (fence.proxy.async: only there, a fence may wait for the copies in
        flight)."""
        load_core_p(smem, 0, q, bb, q_row0, q_end, h, B_R, lane)
        for jt in range(n_tiles):
            st = jt % STAGES
            if jt >= STAGES:
                wait_phase(bars, STAGES + st, (jt // STAGES + 1) & 1)  # tile jt - STAGES released
            nb = OFF_K + st * BUF
            row0 = k0 + first_key(jt, n_start, qb, blocks)
            load_core_p(smem, nb, k, bb, row0, k_end, hk, B_c, lane)
            load_core_p(smem, nb + OFF_V, v, bb, row0, k_end, hk, B_c, lane)
            if row0 + B_c > k_end or (jt == 0 and q_row0 + B_R > q_end):
                hop.fence_proxy_async()
            hop.cp_async_mbarrier_arrive(hop.smem_address(bars, st))
        ptx.cp_async_wait_all()  # (no copy in flight when the warp exits)

    @cuda.jit(device=True, inline=True)
    def key_tile(jt, hk, n_start, qb, _c3, blocks):
        """(head, first key) of tile jt: the producer's coordinates of K_j, V_j."""
        return hk, first_key(jt, n_start, qb, blocks)

    # the producer's copies with the copy engine (one thread): Q_i with the first tile, then K_j, V_j
    produce_tma = make_tma_producer(D, 1, B_R, 0, B_c, OFF_K, OFF_V, BUF, key_tile)

    @cuda.jit(device=True, inline=True)
    def tile_ready(smem, bars, jt, n_tiles, k, v, bb, k_next, row_end, hk, tid):
        """Tile jt's K_j, V_j are in their buffer, seen by the tensor cores. With a producer: wait for its phase of
        ``full`` (fence.proxy.async: the landed copies seen by the tensor cores). Without: :func:`publish_tile`,
        then start the copies of tile jt + 1 (keys from row k_next) into the buffer that barrier freed."""
        if PRODUCER:
            wait_phase(bars, jt % STAGES, (jt // STAGES) & 1)
            if not TMA:  # (the copy engine's writes are the tensor cores' proxy already)
                hop.fence_proxy_async()
        else:
            publish_tile()
            if jt + 1 < n_tiles:
                load_tile(smem, jt + 1, k, v, bb, k_next, row_end, hk, tid)

    @cuda.jit(device=True, inline=True)
    def tile_done(bars, jt):
        """This thread is done with tile jt (its S and P V retired): with a producer, one arrival on ``empty``."""
        if PRODUCER:
            hop.mbarrier_arrive(hop.smem_address(bars, STAGES + jt % STAGES))

    @cuda.jit(device=True, inline=True)
    def my_turn(gw):
        """Ping-pong: wait until the warpgroup before (gw - 1, warpgroup 0 after the last) has issued its products
        (named barrier 1 + gw)."""
        if PINGPONG:
            hop.named_barrier_sync(1 + gw, 2 * 128)

    @cuda.jit(device=True, inline=True)
    def their_turn(gw):
        """Ping-pong: this warpgroup's products are issued; the next one's turn (named barrier 1 + (gw + 1) % WG)."""
        if PINGPONG and warpgroups == 2:  # (2 - gw: the modulo's instructions cost the persistent d = 96 kernel
            hop.named_barrier_arrive(2 - gw, 2 * 128)  # with ALiBi 80 bytes of spills)
        elif PINGPONG:
            hop.named_barrier_arrive(1 + (gw + 1) % warpgroups, 2 * 128)

    @cuda.jit(device=True, inline=True)
    def q_read(bars, last):
        """Persistent: after the ``last`` S of a work item retired, Q_i's last reader, one arrival on ``q_free``: the
        producer may copy the next item's Q_i while this item's last softmax, P V and stores run."""
        if PERSIST:
            if last:
                hop.mbarrier_arrive(hop.smem_address(bars, Q_FREE))

    @cuda.jit(device=True, inline=True)
    def issue_s(s, q_addr, kv_addr, jt):
        """Issue S_ij = Q_i K_j^T (K_j in buffer jt % STAGES): D / 16 wgmma on the accumulator s, one group."""
        if TMA:  # (swizzled rows)
            issue_abt_sw(s, q_addr, B_R, kv_addr + (jt % STAGES) * BUF * 2, B_c)
        else:
            dq = hop.make_desc(q_addr, LBO_Q, 128)
            dk = hop.make_desc(kv_addr + (jt % STAGES) * BUF * 2, LBO_K, 128)
            fence_s(s)
            for ks in range(KD):  # (the next 16 head dims: 2 LBO further on, in the descriptor's 16-byte units)
                mma_s(s, dq + ks * (LBO_Q // 8), dk + ks * (LBO_K // 8), ks)
        hop.wgmma_commit()

    @cuda.jit(device=True, inline=True)
    def issue_pv(o, pa, kv_addr, jt):
        """Issue O_i += P V_j (V_j in buffer jt % STAGES, MN-major; P from the registers pa): B_c / 16 wgmma,
        one group."""
        if TMA:  # (swizzled rows, one a key)
            issue_ab_sw(o, pa, kv_addr + ((jt % STAGES) * BUF + OFF_V) * 2, B_c)
        else:
            dv = hop.make_desc(kv_addr + ((jt % STAGES) * BUF + OFF_V) * 2, 128, SBO_V)
            fence_o(o)
            for kc in range(KC):  # (the next 16 keys: 256 bytes further on)
                mma_o(o, pa[kc, 0], pa[kc, 1], pa[kc, 2], pa[kc, 3], dv + kc * 16, 1)
        hop.wgmma_commit()

    @cuda.jit(device=True, inline=True)
    def locate(w, q, k, cu_q, cu_k, left, right, bm_num):
        """The geometry of work item w: (b, h, hk, i0, bb, q0, k0, seqlen_q, seqlen_k, diag, last_row, n_start,
        n_tiles, qb, bbm, hbm). A block's own item (w unread): :func:`~flashnumba.kernels.common.make_launch_order`;
        persistent: w = 2 P + half, the half-th query tile of pair P (:func:`next_item`)."""
        nheads = q.shape[2]
        # (32-bit unsigned divisions: a 64-bit one is a subroutine call, and the assembler serialises the wgmma of
        # a kernel that makes calls)
        if PERSIST:
            nq = uint32((q.shape[1] + B_R - 1) // B_R)  # (sequences of equal length: the tensor-map copies')
            pairs = (nq + uint32(1)) >> 1  # a head's pairs of query tiles
            bh = uint32(w >> 1) // pairs
            pair = uint32(w >> 1) - bh * pairs
            b = bh // uint32(nheads)
            h = uint32(bh - b * uint32(nheads))
            i0 = int64(pair if (w & 1) else nq - uint32(1) - pair) * B_R  # (the longer first)
        else:
            tile, own = launch_order()  # (the longest causal rows first; own: its (batch, head) index)
            b = uint32(own) // uint32(nheads)
            h = uint32(uint32(own) - b * uint32(nheads))
            i0 = int64(tile) * B_R
        hk = h
        if GQA:
            hk = h // uint32(uint32(nheads) // uint32(k.shape[2]))
        bb, q0, k0, seqlen_q, seqlen_k = sequence(b, q.shape[1], k.shape[1], cu_q, cu_k)
        diag = seqlen_k - seqlen_q
        last_row, n_start, n_tiles = key_tiles(i0, seqlen_q, seqlen_k, diag, left, right)
        # with a block mask, its listed key blocks (a block mask made for B = 1 or H = 1 serves every entry)
        qb = i0 // QB
        bbm = uint32(b) if bm_num.shape[0] > 1 else uint32(0)  # (both sides one unsigned type: not a float64)
        hbm = uint32(h) if bm_num.shape[1] > 1 else uint32(0)
        if BM:
            n_tiles = bm_num[bbm, hbm, qb] * SUB
        return b, h, hk, i0, bb, q0, k0, seqlen_q, seqlen_k, diag, last_row, n_start, n_tiles, qb, bbm, hbm

    @cuda.jit(device=True, inline=True)
    def next_item(w, g0, n_tiles, total, nq):
        """(w, g0, more): the block's next work item after w (of n_tiles tiles), the tiles through its pipeline before
        it, and whether there is one (a block's own item is its only one). Persistent: a block takes pairs of query
        tiles, pair blockIdx.x and every gridDim.x-th after it out of ``total``: pair P of a head (ceil(nq / 2) a
        head, a head's after one another) is its query tiles P and nq - 1 - P from the end, whose causal rows
        together see about nq key tiles whatever P is, so the blocks' shares come out even; items w = 2 P and
        2 P + 1, the second absent where the two are one tile (the middle of an odd nq)."""
        if not PERSIST:
            return w, g0, False
        pair = uint32(w >> 1) % uint32((nq + 1) >> 1)
        if (w & 1) == 0 and uint32(nq - 1) - pair != pair:
            return w + 1, g0 + n_tiles, True
        w = 2 * ((w >> 1) + cuda.gridDim.x)
        return w, g0 + n_tiles, (w >> 1) < total

    @cuda.jit
    def forward_wgmma(q, k, v, out, lse, scale_q, softcap, left, right, alibi, cu_q, cu_k, p_drop, rp_keep, seed,
                      offset, maps, a0, a1, a2, a3, bm_num, bm_idx, bm_state):
        nheads = q.shape[2]
        tid = cuda.threadIdx.x
        gw = tid >> 7  # warpgroup: rows 64 gw .. 64 gw + 63 of Q_i
        lane = tid & 31
        g = lane >> 2
        t = lane & 3
        r0 = 64 * gw + 16 * ((tid >> 5) & 3) + g  # this lane's first row in Q_i; its second is r0 + 8
        # work items: the block's own, or (persistent) the query tiles of pairs blockIdx.x, then every gridDim.x-th
        nq = (q.shape[1] + B_R - 1) // B_R
        w = 2 * int64(cuda.blockIdx.x)
        total = int64((nq + 1) // 2) * q.shape[0] * nheads  # (persistent) pairs
        (b, h, hk, i0, bb, q0, k0, seqlen_q, seqlen_k, diag, last_row, n_start, n_tiles, qb, bbm,
         hbm) = locate(w, q, k, cu_q, cu_k, left, right, bm_num)
        if i0 >= seqlen_q:
            return

        smem = cuda.shared.array(0, elem)  # Q_i | K, V buffers 0, 1, 2 (dynamic), core matrices or swizzled rows
        bars = cuda.shared.array(NBARS, uint64)  # full[0 .. 2], empty[0 .. 2] (persistent: q_free): mbarriers
        base = 0  # where Q_i starts in smem: with tensor-map copies, on 1024 bytes (shared_bytes leaves room)
        if TMA:
            base = swizzle_base(smem)
        if PERSIST and tid == 0:  # q_free: every consumer thread done with a work item's Q_i
            hop.mbarrier_init(hop.smem_address(bars, Q_FREE), NC)
        if PRODUCER:  # full: the producer's copies landed (with TMA: one arrival and the bytes); empty: every
            # consumer thread done
            init_stages(bars, 1 if TMA else 32 * PW, NC, TMA, tid, STAGES)
        if PRODUCER and tid >= NC:
            if REBALANCE:
                hop.setmaxnreg_dec(GIVE)
            if TMA:
                if tid == NC:
                    g0 = 0  # tiles through the pipeline before this work item's
                    copied = 0  # (persistent) work items whose Q_i was copied
                    while True:
                        if not PERSIST or n_tiles > 0:
                            if PERSIST and copied > 0:  # (the last one's Q_i read by its last S)
                                wait_phase(bars, Q_FREE, (copied - 1) & 1)
                            produce_tma(smem, base, bars, maps, bb, h, i0, n_tiles, hk, n_start, qb, 0,
                                        bm_idx[bbm, hbm], g0)
                            copied += 1
                        w, g0, more = next_item(w, g0, n_tiles, total, nq)
                        if not more:
                            break
                        (b, h, hk, i0, bb, q0, k0, seqlen_q, seqlen_k, diag, last_row, n_start, n_tiles, qb, bbm,
                         hbm) = locate(w, q, k, cu_q, cu_k, left, right, bm_num)
            else:
                produce(smem, bars, q, k, v, bb, q0 + i0, q0 + seqlen_q, h, k0, n_start, qb, bm_idx[bbm, hbm],
                        k0 + seqlen_k, hk, n_tiles, tid - NC)
            return

        if REBALANCE:
            hop.setmaxnreg_inc(TAKE)
        s = cuda.local.array(NS, float32)  # S_ij, then P_ij: this thread's part of the warpgroup's 64 x B_c
        o = cuda.local.array(NO, float32)  # O_i: its part of the warpgroup's 64 x D
        pa = cuda.local.array((KC, 4), uint32)  # P_ij packed: the A operand of O += P_ij V_j, step by step
        m = cuda.local.array(2, float32)  # rows g, g + 8: m_i (base 2), this lane's partial l_i, alpha
        l = cuda.local.array(2, float32)
        alpha = cuda.local.array(2, float32)
        m_use = cuda.local.array(2, float32)
        # this warpgroup's 64 rows: 8 core matrices further, or 64 swizzled rows
        q_addr = hop.smem_address(smem, base) + gw * 64 * (SPAN if TMA else 16)
        kv_addr = hop.smem_address(smem, base + OFF_K)
        blocks = bm_idx[bbm, hbm]  # (within the dummy's bounds without a block mask: read only with one)

        if not PRODUCER:
            load_core(smem, 0, q, bb, q0 + i0, q0 + seqlen_q, h, B_R, tid)
            if n_tiles > 0:
                load_tile(smem, 0, k, v, bb, k0 + first_key(0, n_start, qb, blocks), k0 + seqlen_k, hk, tid)
            ptx.cp_async_commit()
        if PINGPONG and gw == warpgroups - 1:
            their_turn(gw)  # warpgroup 0 takes the first turn

        g0 = 0  # tiles through the pipeline before this work item's (buffer and phase of tile jt: g0 + jt's)
        while True:
            for r in range(2):
                m[r] = NEG_INF
                l[r] = 0.0
            for n in range(NO):
                o[n] = 0.0
            slope = alibi[b, h] if ALIBI else float32(0.0)
            # The first tile: S_i0 alone, its softmax, P_i0 packed (module docstring: the pipeline)
            j_next = first_key(1, n_start, qb, blocks) if n_tiles > 1 else 0
            if n_tiles > 0:
                j0 = first_key(0, n_start, qb, blocks)
                partial = part_of(bm_state, bbm, hbm, qb, j0)
                bits = mask_tile(partial, b, h, i0, r0, t, j0, seqlen_q, seqlen_k, a0, a1, a2, a3)
                tile_ready(smem, bars, g0, n_tiles, k, v, bb, k0 + j_next, k0 + seqlen_k, hk, tid)
                my_turn(gw)
                issue_s(s, q_addr, kv_addr, g0)
                their_turn(gw)
                wait_s(0, s)
                q_read(bars, n_tiles == 1)
                softmax_tile(s, m, l, alpha, m_use, i0, r0, t, j0, b, h, nheads, seqlen_q, seqlen_k, diag, last_row,
                             scale_q, softcap, slope, left, right, p_drop, seed, offset, partial, bits, a0, a1, a2, a3)
                if not FINISH_NEXT:
                    rescale_and_pack(o, pa, s, alpha)
            # Tile j: S_ij issued, O_i += P_i,j-1 V_j-1 issued behind it, the softmax of S_ij while that runs. The
            # tile's first key and whether the mask_mod runs there are read a tile ahead (with a block mask, loads
            # from its lists), behind the products, so that their latency does not stand before each tile's mask
            # and issue. (Without a producer the copies of tile j + 1 start before the products, from the first key
            # read there.)
            partial_next = part_of(bm_state, bbm, hbm, qb, j_next) if n_tiles > 1 else False
            for jt in range(1, n_tiles):
                j0 = j_next
                partial = partial_next
                bits = mask_tile(partial, b, h, i0, r0, t, j0, seqlen_q, seqlen_k, a0, a1, a2, a3)
                if not PRODUCER and jt + 1 < n_tiles:
                    j_next = first_key(jt + 1, n_start, qb, blocks)
                tile_ready(smem, bars, g0 + jt, n_tiles, k, v, bb, k0 + j_next, k0 + seqlen_k, hk, tid)
                if FINISH_NEXT:  # (tile j - 2's buffer, released here, is refilled only once ``empty`` says so)
                    finish_tile(o, pa, s, alpha, bars, g0 + jt - 2, jt > 1)
                my_turn(gw)
                issue_s(s, q_addr, kv_addr, g0 + jt)
                issue_pv(o, pa, kv_addr, g0 + jt - 1)
                their_turn(gw)
                if jt + 1 < n_tiles:
                    if PRODUCER:
                        j_next = first_key(jt + 1, n_start, qb, blocks)
                    partial_next = part_of(bm_state, bbm, hbm, qb, j_next)
                wait_s(1, s)  # S_ij in; the product with V_j-1 may still run
                q_read(bars, jt == n_tiles - 1)
                softmax_tile(s, m, l, alpha, m_use, i0, r0, t, j0, b, h, nheads, seqlen_q, seqlen_k, diag, last_row,
                             scale_q, softcap, slope, left, right, p_drop, seed, offset, partial, bits, a0, a1, a2, a3)
                if not FINISH_NEXT:
                    finish_tile(o, pa, s, alpha, bars, g0 + jt - 1, True)
            # The last tile's P V
            if n_tiles > 0:
                if FINISH_NEXT:
                    finish_tile(o, pa, s, alpha, bars, g0 + n_tiles - 2, n_tiles > 1)
                my_turn(gw)
                issue_pv(o, pa, kv_addr, g0 + n_tiles - 1)
                their_turn(gw)
                wait_o(0, o)
                if PERSIST:
                    tile_done(bars, g0 + n_tiles - 1)
            if not PRODUCER:
                ptx.cp_async_wait_all()  # (with no tile, the prologue's copy of Q_i is still in flight)

            for r in range(2):
                l[r] += ptx.shfl_xor_f32(l[r], 1)
                l[r] += ptx.shfl_xor_f32(l[r], 2)
            for x in range(2):
                i = i0 + r0 + 8 * x
                if i < seqlen_q:
                    # (1 / l as rcp.approx: a division's slow path would be a call, which serialises the wgmma)
                    inv_l = (rp_keep if DROPOUT else float32(1.0)) * ptx.rcp_approx(l[x]) if l[x] != 0 else float32(0.0)
                    # (a lane's two neighbouring columns packed as P is, one 4-byte store: half the stores)
                    at = ((bb * out.shape[1] + q0 + i) * out.shape[2] + h) * out.shape[3] + 2 * t
                    for n in range(NO // 4):
                        ptx.st_global_b32(out, at + 8 * n, pack(o[4 * n + 2 * x] * inv_l, o[4 * n + 2 * x + 1] * inv_l))
                    if t == 0:
                        lse[bb, h, q0 + i] = float32(m[x] * LN2 + math.log(l[x])) if l[x] != 0 else NEG_INF
            w, g0, more = next_item(w, g0, n_tiles, total, nq)
            if not more:
                break
            (b, h, hk, i0, bb, q0, k0, seqlen_q, seqlen_k, diag, last_row, n_start, n_tiles, qb, bbm,
             hbm) = locate(w, q, k, cu_q, cu_k, left, right, bm_num)
            blocks = bm_idx[bbm, hbm]
        if PINGPONG and gw == 0:
            my_turn(gw)  # (the last warpgroup's last arrival: every named barrier phase completed)

    return forward_wgmma
