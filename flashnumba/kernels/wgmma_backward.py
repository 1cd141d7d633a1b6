"""Backward kernels on Hopper's warpgroup MMA: FlashAttention-2's Algorithm 2 with its products as ``wgmma``.

The algorithm is that of :mod:`flashnumba.kernels.mma_backward` (read it first: two kernels without atomics, so
the gradients are deterministic, each recomputing S and dP; one entry function, ``mma_backward.make_entry``, for
P and dS with every option); the machinery is that of :mod:`flashnumba.kernels.wgmma_forward` (read it second: a
warpgroup of 128 threads owns 64 rows of the products, the tensor cores read the shared operands through
descriptors, an accumulator turned into 16-bit pairs is the A operand of the next product, three buffers, the
products of one tile overlapped with the per-entry work of the next). What this module adds is which operand
lies where.

dQ, one block per query tile Q_i of B_r = 64 x warpgroups rows, looping over the key tiles K_j, V_j of B_c keys::

    S_ij  = Q_i K_j^T      wgmma m64nB_ck16, A = Q_i, B = K_j (both K-major in shared memory)    group 1
    dP_ij = dO_i V_j^T     wgmma m64nB_ck16, A = dO_i, B = V_j (K-major)                           group 1
    dS_ij = P_ij (dP_ij - D_i), P_ij from the logsumexp        (per entry, in the S and dP registers)
    dQ_i += dS_ij K_j      wgmma m64nDk16, A = dS_ij from registers, B = K_j read MN-major       group 2

It is the forward's loop with dP beside S and dS in place of P: K_j serves twice, as V_j does in the forward,
read K-major for S and MN-major for dQ (the core-matrix layout of wgmma_forward serves both).

dK, dV, one block per key tile K_j, V_j of B_c = 64 x warpgroups keys (of one key/value head), looping over the
query tiles Q_i, dO_i of B_r rows of each query head that shares it (GQA: in order, so the sums are
deterministic). Keys are the rows (M) of every product, so that P^T and dS^T come out where they are the A
operand of the next::

    S_ij^T  = K_j Q_i^T    wgmma m64nB_rk16, A = K_j, B = Q_i (K-major)                            group 1
    dP_ij^T = V_j dO_i^T   wgmma m64nB_rk16, A = V_j, B = dO_i (K-major)                           group 1
    P^T, dS^T per entry, L_i and D_i per column (query) from shared memory
    dV_j   += (P_ij Z_ij)^T dO_i    wgmma m64nDk16, A = P^T from registers, B = dO_i MN-major   group 2
    dK_j   += dS_ij^T Q_i           wgmma m64nDk16, A = dS^T from registers, B = Q_i MN-major   group 2

The pipeline of both (wgmma_forward's, one barrier a tile, every thread copying): at tile j the products of group
1 on tile j are issued, then group 2 of tile j - 1 behind them; the warpgroup waits for group 1 alone, computes
the entries of tile j while the tensor cores run group 2, waits for it, and packs its new A operands (which
overwrites the registers group 2 read). Three buffers of the looped-over tiles hold tiles j - 1 (read by group
2), j and j + 1 (in flight). The first tile's group 1 and the last tile's group 2 are issued outside the loop:
the assembler serialises every wgmma of a kernel where one sits behind a branch inside the loop, or where the
kernel makes any subroutine call (a 64-bit integer division, libdevice's tanhf: the options use call-free forms,
``make_entry(..., no_calls=True)``). With dropout, a tile's mask is drawn into one bit an entry while its S and
dP products run, before its entries are computed (the generator's rounds inside the loop over the entries would
leave that loop rolled and the tile's accumulators in local memory, which serialises the wgmma). The entries are
computed unmasked, and a second pass (:func:`make_mask_tile`) zeroes those past a sequence or out of the band only
in the tiles that reach there, as the forward masks its scores.

**Head dims above 128** (:data:`SPLIT_ABOVE`). A thread of the dK/dV kernel holds dK_j and dV_j of its keys, D
float32, beside S^T and dP^T: above head_dim 128 that is more than its registers (compiled for sm_90a, query tiles
of 32 spilled at 160 and the assembler serialised the wgmma). There the two warpgroups share one K_j, V_j of 64
keys, and warpgroup gw holds head dims DN gw .. DN gw + DN - 1 of dK_j and dV_j (DN = D / 2). S^T and dP^T sum over
every head dim, so the two split that sum: warpgroup gw multiplies its half of the head dims of
K_j, V_j, Q_i and dO_i, the two exchange these partial sums through shared memory (each writes its own and adds the
other's, between two barriers of their 256 threads), and both then hold the whole S^T and dP^T of the 64 keys,
compute the same entries and multiply them into their half of dK_j and dV_j, reading Q_i and dO_i MN-major from the
first head dim of that half. A half starts DN gw rows-of-the-tile elements into each tile (a multiple of 8 head
dims, or with tensor maps of whole boxes). Four products a tile, as at 128 and below, and 2 x 64 B_r float32 (its
partial S^T and dP^T) written, and as many read, through shared memory a warpgroup; ``exchange=False`` has each
warpgroup compute S^T and dP^T whole instead (six products a tile, no exchange), the form to compare with. The
dQ kernel holds dQ_i alone and keeps its layout (key tiles of 32 at head_dim 192 and 224; at 256, 48 keys in two
buffers where a producer copies with tensor maps, else 32).

**A user's score_mod, mask_mod and block masks** (``mods``, ``block_mask``; :func:`flashnumba.flex_attention_backward`
with ``kernel="wgmma"``), as in the forward: the score_mod and its derivative in the entry function
(``mma_backward.make_entry``, at every entry within the sequences), the mask_mod in a pass of its own after the
built-in one
(:func:`make_user_mask_tile`), in the tiles it may hide entries of; with a block mask the dQ kernel walks the key
blocks listed for its query block, the dK/dV kernel the query blocks listed for its key block, for each query head
of its key/value head in turn (with GQA the lists are one for every head: a mask made per head would give each head
its own count of tiles, which the iteration's head and tile, computed from its index, does not allow). Each tile's
list entry is read a tile ahead, behind the products: read at the top of the tile, it held the load of the tile's
full-or-partial state (addressed by it), and the tile's issue, behind a round trip to memory.

**Tensor-map copies** (``tma``, :func:`takes_tma`). With two warpgroups, a third, the producer, makes the copies
as the forward's does (:mod:`flashnumba.kernels.wgmma_forward`, "Tensor-map copies"): one thread copies the tiles
loaded once with the first stage (Q_i, dO_i; or K_j, V_j) and then each stage's two tiles with the copy engine,
swizzled rows of 64 head dims (32, the 64-byte swizzle, where 64 does not divide the head dim: 32, 96, 160,
224), announcing each stage's bytes on its ``full`` mbarrier; in the
dK/dV kernel a second warp of it writes the stage's log2(e) L_i and D_i and arrives there too (33 arrivals). The
warpgroups wait for ``full`` instead of the block's barrier, read the tiles through swizzled descriptors, and
arrive on the stage's ``empty`` mbarrier once the products of group 2 of that tile retired; the producer waits
for it before it refills the buffer. No thread of the two computes an address of a copy, and they no longer wait
for each other at a barrier a tile. The producer gives its registers to them (``setmaxnreg``:
:data:`PRODUCER_REGISTERS`, :data:`CONSUMER_REGISTERS`).
"""

from __future__ import annotations

import functools

from .scalars import float16, float32, int32, int64, uint16, uint32, uint64

from . import bf16, ptx, ptx_hopper as hop
from .._backend import cuda
from .block_mask import make_block_full
from .common import (LOG2E, NEG_INF, dropout_uniform, make_key_tiles, make_launch_order, make_sequence_geometry,
                     make_tile_bounds, make_user_mods)
from .mma_backward import _store_bf16, make_entry, make_stats
from .wgmma_forward import (HEAD_DIMS, STAGES, TMA_HEAD_DIMS, check_block_mask, init_stages, make_key_walk,
                            make_load_core, make_load_stage, make_swizzled_products, make_tma_producer, publish_tile,
                            swizzle_base, swizzle_span, takes_tma as forward_takes_tma, wait_phase)

# Above this head dim a thread cannot hold dK_j and dV_j of its keys (D float32) beside S^T and dP^T: the dK/dV
# kernel's two warpgroups share 64 keys, each holding half of dK_j's and dV_j's head dims (module docstring)
SPLIT_ABOVE = 128
WARPGROUPS = (1, 2)
DQ_BLOCK_NS = (32, 48, 64, 128)  # keys a tile of the dQ kernel (N of its S and dP)
DKDV_BLOCK_MS = (32, 48, 64)  # queries a tile of the dK/dV kernel (N of its S^T and dP^T; 128 spills)


# With tensor-map copies the producer warpgroup (one thread copying, one warp fetching L_i and D_i) keeps 40
# registers a thread (with 24 its loops spill) and the two warpgroups that compute take 232 (128 x 40 + 256 x 232 =
# 64512 of 65536). The dK/dV kernel holds dK_j, dV_j, S^T and dP^T of its keys: at head_dim 128 with query tiles
# of 64 that spills under 232 (and under 240), so there it copies with tensor maps only with query tiles of 32.
PRODUCER_REGISTERS, CONSUMER_REGISTERS = 40, 232
NBARS = 2 * STAGES  # (tensor maps) the full and empty mbarriers of the stages
DQ_MAPS = ("q", "dout", "k", "v")  # the tensor maps of each kernel, in the order of its ``maps`` argument
DKDV_MAPS = ("k", "v", "q", "dout")


def threads(warpgroups, tma=False):
    """Threads of a block: 128 a warpgroup, and 128 more for the producer of the tensor-map copies."""
    return 128 * warpgroups + (128 if tma else 0)


def takes_tma(D, variant, warpgroups, which="dq", block_m=64) -> bool:
    """Whether a backward kernel (``which``: "dq" or "dkdv", the latter with query tiles of ``block_m``) copies with
    tensor maps (a producer warpgroup beside two that compute): as the forward
    (:func:`flashnumba.kernels.wgmma_forward.takes_tma`), head_dim in its TMA_HEAD_DIMS and sequences of equal
    length; the dK/dV kernel above head_dim 96 only with query tiles of 32 (:data:`CONSUMER_REGISTERS`; of 48 above
    :data:`SPLIT_ABOVE`, where each warpgroup holds half of dK_j's and dV_j's head dims), and above
    :data:`SPLIT_ABOVE` only where each warpgroup's half of the head dims is whole boxes of swizzled rows (head_dim
    256: two of 64)."""
    if which == "dkdv" and D > SPLIT_ABOVE and (D // 2) % (swizzle_span(D) // 2):
        return False
    return forward_takes_tma(D, variant, warpgroups, 4) and (which == "dq" or D <= 96 or block_m <= 32
                                                               or (D > SPLIT_ABOVE and block_m <= 48))


def dkdv_warpgroups(D, block_n):
    """The dK/dV kernel's warpgroups for ``block_n`` keys a block: one a 64 of them, or above :data:`SPLIT_ABOVE`
    two on the 64 (each half of the head dims)."""
    return 2 if D > SPLIT_ABOVE else block_n // 64


def shared_bytes_dq(D, block_m, block_n, tma=False, stages=STAGES):
    """Q_i and dO_i (block_m rows), ``stages`` K_j, V_j buffers (block_n rows), 16-bit elements; with
    tensor-map copies, room to start them on 1024 bytes."""
    return (2 * block_m + 2 * stages * block_n) * D * 2 + (hop.SWIZZLE_ALIGN if tma else 0)


def check_stages(stages, tma):
    """``stages`` if the pipeline may run that many buffers: :data:`STAGES`, or two with a producer warpgroup (its
    mbarriers hold each copy until the products that read the buffer have retired; a thread copying its own next
    tile would overwrite the buffer that the last tile's products may still read)."""
    if stages == STAGES or (stages == 2 and tma):
        return stages
    raise ValueError(f"the wgmma backward runs {STAGES} buffers, or 2 with the tensor-map copies of a producer "
                     f"warpgroup; got {stages} (tensor maps: {bool(tma)})")


def pipeline(which, D, block_m, block_n, tma, limit, exchange=True):
    """(stages, bytes) of a kernel (``which``: "dq" or "dkdv") at these tiles: :data:`STAGES` buffers where their
    shared memory fits ``limit``, else two where a producer copies with tensor maps (``tma``) and they fit (head_dim
    256 with tiles of 48); bytes: the dynamic shared memory with them (:func:`shared_bytes_dq`,
    :func:`shared_bytes_dkdv`)."""
    def nbytes(stages):
        return (shared_bytes_dq(D, block_m, block_n, tma, stages) if which == "dq"
                else shared_bytes_dkdv(D, block_m, block_n, tma, exchange, stages))

    stages = STAGES if nbytes(STAGES) <= limit or not tma or nbytes(2) > limit else 2
    return stages, nbytes(stages)


def exchanges(D, exchange=True) -> bool:
    """Whether the dK/dV kernel's warpgroups exchange partial S^T and dP^T: above :data:`SPLIT_ABOVE`, unless
    ``exchange`` is False (module docstring)."""
    return D > SPLIT_ABOVE and bool(exchange)


def shared_bytes_dkdv(D, block_m, block_n, tma=False, exchange=True, stages=STAGES):
    """K_j and V_j (block_n rows), ``stages`` Q_i, dO_i buffers (block_m rows), 16-bit elements (dynamic; log2(e)
    L_i and D_i of each buffer's queries, 2 stages block_m float32, are static arrays besides); with tensor-map
    copies, room to start them on 1024 bytes; where the warpgroups exchange partial sums (:func:`exchanges`), the
    two warpgroups' S^T and dP^T after them (2 x 2 x 64 block_m float32)."""
    return ((2 * block_n + 2 * stages * block_m) * D * 2 + (hop.SWIZZLE_ALIGN if tma else 0)
            + (2 * 2 * 64 * block_m * 4 if exchanges(D, exchange) else 0))


def check(D, block_m, block_n, which, dtype=None):
    """ValueError unless the tiles suit the kernel (``which``: "dq" or "dkdv"), and the dtype where given."""
    if D not in HEAD_DIMS:
        raise ValueError(f"the wgmma backward supports head_dim in {HEAD_DIMS}, got {D}")
    rows, loop, loops = (block_m, block_n, DQ_BLOCK_NS) if which == "dq" else (block_n, block_m, DKDV_BLOCK_MS)
    if rows not in tuple(64 * w for w in WARPGROUPS) or loop not in loops:
        names = ("block_m", "block_n") if which == "dq" else ("block_n", "block_m")
        raise ValueError(f"the wgmma {'dQ' if which == 'dq' else 'dK/dV'} kernel takes {names[0]} 64 or 128 (one or "
                         f"two warpgroups of 64 rows) and {names[1]} in {loops}, got block_m {block_m}, block_n "
                         f"{block_n}")
    if which == "dkdv" and D > SPLIT_ABOVE and block_n != 64:
        raise ValueError(f"above head_dim {SPLIT_ABOVE} the wgmma dK/dV kernel takes block_n 64 (two warpgroups on 64 "
                         f"keys, each half of dK_j's and dV_j's head dims), got {block_n}")
    if dtype is not None and dtype not in ("float16", "bfloat16"):
        raise ValueError(f"dtype must be 'float16' or 'bfloat16', got {dtype!r}")


def _common(D, dtype):
    is_bf16 = dtype == "bfloat16"
    kind = "bf16" if is_bf16 else "f16"
    store = _store_bf16 if is_bf16 else bf16.load_store(False)[1]
    pack = ptx.pack_bf16x2 if is_bf16 else ptx.pack_f16x2
    elem = uint16 if is_bf16 else float16
    return kind, store, pack, elem


@functools.lru_cache(maxsize=None)
def make_pieces(D, dtype):
    """What both kernels share (beside wgmma_forward's ``publish_tile`` and ``make_load_stage``): three factories of
    device functions:

    * ``make_issue_abt(N, K=D)`` -> ``issue_abt(acc, a_addr, lbo_a, b_addr, lbo_b)``: acc = A B^T (64 x N over K
      head dims), K / 16 wgmma with A and B K-major in shared memory at those byte addresses (of the first head dim
      taken), LBO those strides; not committed;
    * ``make_issue_ab(KC, N=D)`` -> ``issue_ab(acc, pa, b_addr, sbo)``: acc += A B (64 x N, K = 16 KC), A from the
      registers pa, B MN-major (N head dims from b_addr, SBO ``sbo`` bytes between its blocks of 8); not committed;
    * ``make_pack(KC)`` -> ``pack_a(pa, acc)``: the accumulator (64 x 16 KC) as that 16-bit A operand (the 16
      columns of k-step c are acc[8 c .. 8 c + 7]: wgmma_forward's rescale_and_pack)."""
    kind, _, pack, _ = _common(D, dtype)

    def make_issue_abt(N, K=D):
        mma, fence, _ = hop.wgmma_ops(kind, N)
        KS = K // 16

        @cuda.jit(device=True, inline=True)
        def issue_abt(acc, a_addr, lbo_a, b_addr, lbo_b):
            da = hop.make_desc(a_addr, lbo_a, 128)
            db = hop.make_desc(b_addr, lbo_b, 128)
            fence(acc)
            for ks in range(KS):  # (the next 16 head dims: 2 LBO further on, in the descriptor's 16-byte units)
                mma(acc, da + ks * (lbo_a // 8), db + ks * (lbo_b // 8), ks)

        return issue_abt

    def make_issue_ab(KC, N=D):
        mma, fence, _ = hop.wgmma_ops(kind, N, regs_a=True, trans_b=True)

        @cuda.jit(device=True, inline=True)
        def issue_ab(acc, pa, b_addr, sbo):
            db = hop.make_desc(b_addr, 128, sbo)
            fence(acc)
            for kc in range(KC):  # (the next 16 rows of B: 256 bytes further on)
                mma(acc, pa[kc, 0], pa[kc, 1], pa[kc, 2], pa[kc, 3], db + kc * 16, 1)

        return issue_ab

    def make_pack(KC):
        @cuda.jit(device=True, inline=True)
        def pack_a(pa, acc):
            for c in range(KC):
                for r in range(4):
                    pa[c, r] = pack(acc[8 * c + 2 * r], acc[8 * c + 2 * r + 1])

        return pack_a

    return make_issue_abt, make_issue_ab, make_pack


@functools.lru_cache(maxsize=None)
def make_mask_tile(NS, has_left, has_right, keys_are_rows):
    """mask_tile(x, y, row0, col0, seqlen_q, seqlen_k, diag, left, right): 0 into this lane's entries of x and y
    (accumulators of S-shaped tiles, NS registers: rows row0 and row0 + 8, columns col0 + 8 n and col0 + 8 n + 1)
    that lie past a sequence or outside their query's band; the rows are keys and the columns queries where
    ``keys_are_rows`` (the dK/dV kernel's S^T). Both kernels compute a tile's entries unmasked and call this only
    for the tiles that reach past a sequence or a band (the forward's way): with the tests inside the loop over the
    entries, the compiler turns their branch into predicated instructions that every tile would then execute. Each
    row's entries that stay are its columns lo <= c < hi (:func:`~flashnumba.kernels.common.make_tile_bounds`,
    computed once a row), so that each entry compares its compile-time column with them."""
    # (columns c = 8 n + (e & 1), n < NS / 4; floored: the window floors queries, or keys)
    bounds, floored = make_tile_bounds(2 * NS, has_left, has_right, keys_are_rows)

    @cuda.jit(device=True, inline=True)
    def mask_tile(x, y, row0, col0, seqlen_q, seqlen_k, diag, left, right):
        for half in range(2):  # (rows row0, then row0 + 8: one row's bounds live at a time)
            lo, hi = bounds(row0 + 8 * half, col0, seqlen_q, seqlen_k, diag, left, right)
            for n in range(NS // 4):
                for e in range(2 * half, 2 * half + 2):
                    c = int32(8 * n + (e & 1))  # (int32 like the bounds: a 64-bit constant widens each test)
                    if c >= hi or (floored and c < lo):
                        x[4 * n + e] = float32(0.0)
                        y[4 * n + e] = float32(0.0)

    return mask_tile


@functools.lru_cache(maxsize=None)
def make_user_mask_tile(NS, mods, keys_are_rows):
    """user_mask_tile(x, y, row0, col0, seqlen_q, seqlen_k, b, h, a0, a1, a2, a3): 0 into this lane's entries of x
    and y (as :func:`make_mask_tile`'s) that a user's mask_mod (:class:`flashnumba.kernels.common.Mods`) hides,
    called for the entries within the sequences only (it may index its arrays by them); the kernels run it in the
    tiles it may hide entries of (with a block mask, its partial blocks). Without a mask_mod it does nothing."""
    _, user_mask = make_user_mods(mods)
    USER_MASK = mods is not None and mods.mask_mod is not None

    @cuda.jit(device=True, inline=True)
    def user_mask_tile(x, y, row0, col0, seqlen_q, seqlen_k, b, h, a0, a1, a2, a3):
        if not USER_MASK:
            return
        for n in range(NS // 4):
            for e in range(4):
                r = row0 + 8 * (e >> 1)
                c = col0 + 8 * n + (e & 1)
                i, j = (c, r) if keys_are_rows else (r, c)
                if i < seqlen_q and j < seqlen_k and not user_mask(b, h, i, j, a0, a1, a2, a3):
                    x[4 * n + e] = float32(0.0)
                    y[4 * n + e] = float32(0.0)

    return user_mask_tile


@functools.lru_cache(maxsize=None)
def make_issue_sdp(D, dtype, tma, rows_a, rows_b, gap, K=None):
    """issue_sdp(s, dp, a1, a2, b): group 1 of both kernels, one commit: s = A1 B^T and dp = A2 B'^T (64 x rows_b,
    over K head dims, all D by default), A1 and A2 this warpgroup's 64 rows (at byte addresses a1, a2) of tiles of
    rows_a rows, B a tile of rows_b rows at byte address b and B' ``gap`` bytes after it: S_ij = Q_i K_j^T,
    dP_ij = dO_i V_j^T (dQ kernel) or S^T = K_j Q_i^T, dP^T = V_j dO_i^T (dK/dV kernel); swizzled rows with
    ``tma``, else core matrices."""
    kind = _common(D, dtype)[0]
    K = D if K is None else K
    if tma:
        issue = make_swizzled_products(kind, D)[0](rows_b, K)
        A, B = rows_a, rows_b  # (the tiles' rows)
    else:
        issue = make_pieces(D, dtype)[0](rows_b, K)
        A, B = 16 * rows_a, 16 * rows_b  # (the LBO of each)

    @cuda.jit(device=True, inline=True)
    def issue_sdp(s, dp, a1, a2, b):
        issue(s, a1, A, b, B)
        issue(dp, a2, A, b + gap, B)
        hop.wgmma_commit()

    return issue_sdp


@functools.lru_cache(maxsize=None)
def make_backward_dq_wgmma(D, variant, block_n, warpgroups, dtype="float16", gqa=False, tma=False, mods=None,
                           block_mask=None, stages=STAGES):
    """The dQ kernel (module docstring) for head_dim D (:data:`HEAD_DIMS`), block_n keys a tile (:data:`DQ_BLOCK_NS`),
    ``warpgroups`` warpgroups of 64 query rows, the options of ``variant`` compiled in as in
    :func:`flashnumba.kernels.mma_backward.make_backward_dq_tc`, whose arguments it takes, the tensor maps after the
    options': (dout, q, k, v, lse, delta, dq, scale_log2, scale, softcap, left, right, alibi, cu_q, cu_k, p_drop,
    rp_keep, seed, offset, maps, a0, a1, a2, a3, bm_num, bm_idx, bm_state). ``mods``, ``block_mask``: a user's mask_mod
    and a block mask's (QB, KB) blocks, as the forward's (:func:`flashnumba.kernels.wgmma_forward.make_forward_wgmma`).
    With ``tma`` (:func:`takes_tma`) a producer warpgroup copies the tiles with the copy engine (module docstring),
    ``maps`` holding the tensor maps of :data:`DQ_MAPS`; without, every thread copies and ``maps`` is not read.
    ``stages``: the K_j, V_j buffers of the pipeline (:func:`check_stages`, :func:`pipeline`). Compiled
    for sm_90a. Launch: grid (ceil(max_seqlen_q / B_r), batch * nheads), block (:func:`threads`,), dynamic shared memory
    :func:`shared_bytes_dq`."""
    B_R, B_C = 64 * warpgroups, block_n
    check(D, B_R, B_C, "dq", dtype)
    check_block_mask(block_mask, B_R, B_C)
    BM = block_mask is not None
    QB = block_mask[0] if BM else B_R
    SUB = block_mask[1] // B_C if BM else 1  # key tiles a block of the block mask
    USER_MASK = mods is not None and mods.mask_mod is not None
    HAS_LEFT, HAS_RIGHT, _, ALIBI, VARLEN, DROPOUT = variant
    launch_order_dq = make_launch_order(True, HAS_RIGHT or BM)  # (uneven work: causal, a block mask)
    TMA = bool(tma)
    if TMA and not takes_tma(D, variant, warpgroups):
        raise ValueError(f"the wgmma dQ kernel copies with tensor maps only with two warpgroups, head_dim in "
                         f"{TMA_HEAD_DIMS} and sequences of equal length; got head_dim {D}, {warpgroups} warpgroups, "
                         f"varlen {bool(VARLEN)}")
    NST = check_stages(stages, TMA)  # K_j, V_j buffers
    GQA = bool(gqa)
    sequence = make_sequence_geometry(VARLEN)
    entry = make_entry(variant, mods, no_calls=True, keep_given=True)
    kind, store, _, elem = _common(D, dtype)
    NC = threads(warpgroups)  # the threads that compute (with tensor maps, the producer's 128 follow them)
    NS = B_C // 2  # S and dP accumulator registers a thread: 64 x B_c over 128 threads
    NO = D // 2  # dQ accumulator registers a thread
    KC = B_C // 16  # k-steps of dQ += dS K
    OFF_DO = B_R * D  # dO_i after Q_i
    OFF_K = 2 * B_R * D  # K buffer 0; buffer 1 lies BUF further on; V_j lies OFF_V after its K_j
    OFF_V = B_C * D
    BUF = 2 * B_C * D
    SPAN = swizzle_span(D)  # bytes of a swizzled row (tensor-map copies)
    _, make_issue_ab, make_pack = make_pieces(D, dtype)
    issue_ab = make_issue_ab(KC)
    _, make_ab_sw = make_swizzled_products(kind, D)
    issue_ab_sw = make_ab_sw(KC)
    pack_a = make_pack(KC)
    wait_s = hop.wgmma_ops(kind, B_C)[2]
    wait_o = hop.wgmma_ops(kind, D, regs_a=True, trans_b=True)[2]
    load_core = make_load_core(D, NC)
    load_tile = make_load_stage(D, NC, B_C, OFF_K, OFF_V, BUF)  # K_j, V_j of tile jt into buffer jt % NST
    key_tiles = make_key_tiles(B_R, B_C, HAS_LEFT, HAS_RIGHT)
    mask_tile = make_mask_tile(NS, HAS_LEFT, HAS_RIGHT, False)
    user_mask_tile = make_user_mask_tile(NS, mods, False)

    first_key, part_of = make_key_walk(block_mask, B_C, USER_MASK)  # (the forward's walk of a block mask)

    @cuda.jit(device=True, inline=True)
    def key_tile(jt, hk, n_start, qb, _c3, blocks):
        """(head, first key) of tile jt: the producer's coordinates of K_j, V_j."""
        return hk, first_key(jt, n_start, qb, blocks)

    # the producer's copies (one thread): Q_i, dO_i with the first tile, then K_j, V_j
    produce = make_tma_producer(D, 2, B_R, OFF_DO, B_C, OFF_K, OFF_V, BUF, key_tile, NST)

    issue_two = make_issue_sdp(D, dtype, TMA, B_R, B_C, OFF_V * 2)

    @cuda.jit(device=True, inline=True)
    def issue_sdp(s, dp, q_addr, do_addr, kv_addr, jt):
        """Group 1: S_ij = Q_i K_j^T and dP_ij = dO_i V_j^T (tile jt's buffer), one commit."""
        issue_two(s, dp, q_addr, do_addr, kv_addr + (jt % NST) * BUF * 2)

    @cuda.jit(device=True, inline=True)
    def issue_dq(acc, pa, kv_addr, jt):
        """Group 2: dQ_i += dS_ij K_j (K_j of tile jt's buffer read MN-major), one commit."""
        if TMA:
            issue_ab_sw(acc, pa, kv_addr + (jt % NST) * BUF * 2, B_C)
        else:
            issue_ab(acc, pa, kv_addr + (jt % NST) * BUF * 2, 16 * B_C)
        hop.wgmma_commit()

    @cuda.jit(device=True, inline=True)
    def tile_ready(smem, bars, jt, n_tiles, k, v, bb, k_next, row_end, hk, tid):
        """Tile jt's K_j, V_j (and with the first, Q_i, dO_i) are in their buffer, seen by the tensor cores. With
        tensor maps: wait for its phase of ``full``. Without: :func:`publish_tile`, then start the copies of tile
        jt + 1 (keys from row k_next) into the buffer that barrier freed."""
        if TMA:
            wait_phase(bars, jt % NST, (jt // NST) & 1)
        else:
            publish_tile()
            if jt + 1 < n_tiles:
                load_tile(smem, jt + 1, k, v, bb, k_next, row_end, hk, tid)

    @cuda.jit(device=True, inline=True)
    def keep_bits(i0, r0, t, j0, p_drop, seed, offset, bh):
        """(DROPOUT) Bit 4 n + x: whether the dropout mask keeps this lane's entry 4 n + x of the tile (row
        r0 + 8 (x >> 1), key j0 + 8 n + 2 t + (x & 1))."""
        bits = uint64(0)
        if DROPOUT:
            for e in range(NS):
                if dropout_uniform(seed, offset, bh, i0 + r0 + 8 * ((e & 3) >> 1),
                                   j0 + 8 * (e >> 2) + 2 * t + (e & 1)) >= p_drop:
                    bits |= uint64(1) << uint64(e)
        return bits

    @cuda.jit(device=True, inline=True)
    def ds_tile(s, dp, lrow, drow, i0, r0, t, j0, seqlen_q, seqlen_k, diag, last_row, scale_log2, scale, softcap,
                left, right, slope, p_drop, rp_keep, seed, offset, b, h, bh, bits, aa):
        """dS_ij into dp (rows r0, r0 + 8 of Q_i; this lane's columns of the tile from key j0)."""
        masked = (j0 + B_C > seqlen_k or (HAS_RIGHT and j0 + B_C - 1 > i0 + diag + right)
                  or (HAS_LEFT and j0 < last_row + diag - left))
        for n in range(NS // 4):
            for x in range(4):
                _, ds = entry(s[4 * n + x], dp[4 * n + x], i0 + r0 + 8 * (x >> 1), j0 + 8 * n + 2 * t + (x & 1),
                              lrow[x >> 1], drow[x >> 1], False, False, seqlen_q, seqlen_k, diag, scale_log2, scale,
                              softcap, left, right, slope, p_drop, rp_keep, seed, offset, b, h, bh, aa[0], aa[1],
                              aa[2], aa[3],
                              (bits >> uint64(4 * n + x)) & uint64(1) != 0)
                dp[4 * n + x] = ds
        if masked:
            mask_tile(dp, dp, i0 + r0, j0 + 2 * t, seqlen_q, seqlen_k, diag, left, right)

    @cuda.jit
    def backward_dq_wgmma(dout, q, k, v, lse, delta, dq, scale_log2, scale, softcap, left, right, alibi, cu_q, cu_k,
                          p_drop, rp_keep, seed, offset, maps, a0, a1, a2, a3, bm_num, bm_idx, bm_state):
        nheads = q.shape[2]
        tid = cuda.threadIdx.x
        gw = tid >> 7  # warpgroup: rows 64 gw .. 64 gw + 63 of Q_i
        lane = tid & 31
        t = lane & 3
        # (32-bit unsigned divisions, a 64-bit one being a subroutine call; then signed 64-bit values, as unsigned
        # and signed 64-bit operands together give a float64)
        tile, bh = launch_order_dq()  # (the longest causal rows first)
        bu = uint32(bh) // uint32(nheads)
        b = int64(bu)
        h = int64(uint32(bh) - bu * uint32(nheads))
        hk = h
        if GQA:
            hk = int64(uint32(h) // (uint32(nheads) // uint32(k.shape[2])))
        i0 = tile * B_R
        r0 = 64 * gw + 16 * ((tid >> 5) & 3) + (lane >> 2)  # this lane's first row in Q_i; its second is r0 + 8
        bb, q0, k0, seqlen_q, seqlen_k = sequence(b, q.shape[1], k.shape[1], cu_q, cu_k)
        diag = seqlen_k - seqlen_q
        slope = alibi[b, h] if ALIBI else float32(0.0)
        if i0 >= seqlen_q:
            return

        smem = cuda.shared.array(0, elem)  # Q_i | dO_i | K, V buffers 0, 1, 2 (dynamic), core matrices or swizzled
        bars = cuda.shared.array(NBARS, uint64)  # (tensor maps) full[0 .. 2], empty[0 .. 2]: mbarriers
        last_row, n_start, n_tiles = key_tiles(i0, seqlen_q, seqlen_k, diag, left, right)
        # with a block mask, its listed key blocks (one made for B = 1 or H = 1 serves every entry)
        qb = i0 // QB
        bbm = b if bm_num.shape[0] > 1 else int64(0)
        hbm = h if bm_num.shape[1] > 1 else int64(0)
        blocks = bm_idx[bbm, hbm]  # (within the dummy's bounds without a block mask: read only with one)
        if BM:
            n_tiles = bm_num[bbm, hbm, qb] * SUB
        base = 0  # where Q_i starts in smem: with tensor-map copies, on 1024 bytes (shared_bytes_dq leaves room)
        if TMA:
            base = swizzle_base(smem)
            init_stages(bars, 1, NC, True, tid, NST)  # full: the producer's one arrival and the bytes; empty: consumers
            if tid >= NC:
                hop.setmaxnreg_dec(PRODUCER_REGISTERS)
                if tid == NC:
                    produce(smem, base, bars, maps, bb, h, i0, n_tiles, hk, n_start, qb, 0, blocks, 0)
                return
            hop.setmaxnreg_inc(CONSUMER_REGISTERS)

        s = cuda.local.array(NS, float32)  # S_ij, then nothing (P is not kept)
        dp = cuda.local.array(NS, float32)  # dP_ij, then dS_ij
        acc = cuda.local.array(NO, float32)  # dQ_i
        pa = cuda.local.array((KC, 4), uint32)  # dS_ij packed: the A operand of dQ_i += dS_ij K_j
        lrow = cuda.local.array(2, float32)  # log2(e) L_i of rows r0, r0 + 8
        drow = cuda.local.array(2, float32)  # D_i
        for x in range(2):
            i = i0 + r0 + 8 * x
            L = lse[bb, h, q0 + i] if i < seqlen_q else float32(0.0)
            lrow[x] = L * LOG2E if L != NEG_INF else float32(0.0)  # no visible key: every entry is masked
            drow[x] = delta[bb, h, q0 + i] if i < seqlen_q else float32(0.0)
        for n in range(NO):
            acc[n] = 0.0
        # this warpgroup's 64 rows: 8 core matrices further, or 64 swizzled rows
        q_addr = hop.smem_address(smem, base) + gw * 64 * (SPAN if TMA else 16)
        do_addr = hop.smem_address(smem, base + OFF_DO) + gw * 64 * (SPAN if TMA else 16)
        kv_addr = hop.smem_address(smem, base + OFF_K)
        bh = b * nheads + h

        if not TMA:
            load_core(smem, 0, q, bb, q0 + i0, q0 + seqlen_q, h, B_R, tid)
            load_core(smem, OFF_DO, dout, bb, q0 + i0, q0 + seqlen_q, h, B_R, tid)
            if n_tiles > 0:
                load_tile(smem, 0, k, v, bb, k0 + first_key(0, n_start, qb, blocks), k0 + seqlen_k, hk, tid)
            ptx.cp_async_commit()

        # The first tile: S, dP alone, dS, packed
        j_next = first_key(1, n_start, qb, blocks) if n_tiles > 1 else 0
        if n_tiles > 0:
            j0 = first_key(0, n_start, qb, blocks)
            partial = part_of(bm_state, bbm, hbm, qb, j0)
            tile_ready(smem, bars, 0, n_tiles, k, v, bb, k0 + j_next, k0 + seqlen_k, hk, tid)
            issue_sdp(s, dp, q_addr, do_addr, kv_addr, 0)
            bits = keep_bits(i0, r0, t, j0, p_drop, seed, offset, bh)
            wait_s(0, s)
            wait_s(0, dp)
            ds_tile(s, dp, lrow, drow, i0, r0, t, j0, seqlen_q, seqlen_k, diag, last_row, scale_log2, scale,
                    softcap, left, right, slope, p_drop, rp_keep, seed, offset, b, h, bh, bits, (a0, a1, a2, a3))
            if partial:  # (the user's mask_mod: dS 0 where it hides an entry)
                user_mask_tile(dp, dp, i0 + r0, j0 + 2 * t, seqlen_q, seqlen_k, b, h, a0, a1, a2, a3)
            pack_a(pa, dp)
        # Tile j: S, dP issued, dQ_i += dS_i,j-1 K_j-1 behind them, dS of tile j while that runs. The tile's first
        # key is read a tile ahead (with a block mask, a load from its list), behind the products: the load of
        # whether the mask_mod runs there, addressed by it, then goes out at once and is used after the wait.
        # (Without tensor maps the copies of tile j + 1 start before the products, from the first key read there.)
        for jt in range(1, n_tiles):
            j0 = j_next if BM else first_key(jt, n_start, qb, blocks)  # (without one, arithmetic: no registers held)
            partial = part_of(bm_state, bbm, hbm, qb, j0)  # (read before the wait: its latency hides behind it)
            if not TMA and jt + 1 < n_tiles:
                j_next = first_key(jt + 1, n_start, qb, blocks)
            tile_ready(smem, bars, jt, n_tiles, k, v, bb, k0 + j_next, k0 + seqlen_k, hk, tid)
            issue_sdp(s, dp, q_addr, do_addr, kv_addr, jt)
            issue_dq(acc, pa, kv_addr, jt - 1)
            if TMA and BM and jt + 1 < n_tiles:
                j_next = first_key(jt + 1, n_start, qb, blocks)
            bits = keep_bits(i0, r0, t, j0, p_drop, seed, offset, bh)
            wait_s(1, s)
            wait_s(1, dp)
            ds_tile(s, dp, lrow, drow, i0, r0, t, j0, seqlen_q, seqlen_k, diag, last_row, scale_log2, scale,
                    softcap, left, right, slope, p_drop, rp_keep, seed, offset, b, h, bh, bits, (a0, a1, a2, a3))
            if partial:
                user_mask_tile(dp, dp, i0 + r0, j0 + 2 * t, seqlen_q, seqlen_k, b, h, a0, a1, a2, a3)
            wait_o(0, acc)
            if TMA:  # (tile jt - 1 read by its products: its buffer free for the producer)
                hop.mbarrier_arrive(hop.smem_address(bars, NST + (jt - 1) % NST))
            pack_a(pa, dp)
        # The last tile's dQ product
        if n_tiles > 0:
            issue_dq(acc, pa, kv_addr, n_tiles - 1)
            wait_o(0, acc)
        if not TMA:
            ptx.cp_async_wait_all()  # (with no tile, the prologue's copies are still in flight)

        for x in range(2):
            i = i0 + r0 + 8 * x
            if i < seqlen_q:
                for n in range(NO // 4):
                    dq[bb, q0 + i, h, 8 * n + 2 * t] = store(acc[4 * n + 2 * x] * scale)
                    dq[bb, q0 + i, h, 8 * n + 2 * t + 1] = store(acc[4 * n + 2 * x + 1] * scale)

    return backward_dq_wgmma


@functools.lru_cache(maxsize=None)
def make_backward_dkdv_wgmma(D, variant, block_m, warpgroups, dtype="float16", gqa=False, tma=False, mods=None,
                             block_mask=None, exchange=True, stages=STAGES):
    """The dK/dV kernel (module docstring) for head_dim D, block_m queries a tile (:data:`DKDV_BLOCK_MS`),
    ``warpgroups`` warpgroups of 64 keys (above :data:`SPLIT_ABOVE`: two on 64 keys, each half of the head dims), the
    options of ``variant`` compiled in; arguments (dout, q, k, v, lse, delta,
    dk, dv, scale_log2, scale, softcap, left, right, alibi, cu_q, cu_k, p_drop, rp_keep, seed, offset, maps, a0, a1, a2,
    a3, bm_qnum, bm_qidx, bm_state). ``mods``: a user's mask_mod, as the dQ kernel's; ``block_mask``: (QB, KB), the
    blocks of a block mask whose query-block lists (bm_qnum, bm_qidx) the loop walks, for each query head of the
    key/value head in order; with GQA the mask must be one for every head (H = 1: each head then walks the same list).
    With ``tma`` (:func:`takes_tma`) a producer warpgroup copies the tiles with the copy engine and one warp of it
    fetches L_i and D_i (module docstring), ``maps`` holding the tensor maps of :data:`DKDV_MAPS`; without, every thread
    copies and ``maps`` is not read. ``exchange``: above :data:`SPLIT_ABOVE`, whether the warpgroups split S^T and
    dP^T by head dims and exchange the partial sums (:func:`exchanges`; module docstring). ``stages``: the Q_i, dO_i
    buffers of the pipeline (:func:`check_stages`). Compiled for sm_90a.
    Launch: grid (ceil(max_seqlen_k / B_c), batch * nheads_k), block (:func:`threads`,), dynamic shared memory
    :func:`shared_bytes_dkdv`."""
    SPLIT = D > SPLIT_ABOVE  # two warpgroups on 64 keys, each half of the head dims of dK_j and dV_j
    if SPLIT and warpgroups != 2:
        raise ValueError(f"above head_dim {SPLIT_ABOVE} the wgmma dK/dV kernel runs two warpgroups on 64 keys, got "
                         f"{warpgroups}")
    B_R, B_C = block_m, 64 if SPLIT else 64 * warpgroups
    check(D, B_R, B_C, "dkdv", dtype)
    check_block_mask(block_mask, B_R, B_C)
    BM = block_mask is not None
    QB, KB = block_mask if BM else (B_R, B_C)
    block_full = make_block_full(BM, KB)  # (whether the block of key j0 is a full one for the query block)
    SUB = QB // B_R  # query tiles a block of the block mask
    USER_MASK = mods is not None and mods.mask_mod is not None
    HAS_LEFT, HAS_RIGHT, _, ALIBI, VARLEN, DROPOUT = variant
    # (uneven work: causal; with a block mask too, but there the computed order spilled beside a user's functions)
    launch_order_dkdv = make_launch_order(False, HAS_RIGHT)
    TMA = bool(tma)
    if TMA and not takes_tma(D, variant, warpgroups, "dkdv", B_R):
        raise ValueError(f"the wgmma dK/dV kernel copies with tensor maps only with two warpgroups, head_dim in "
                         f"{TMA_HEAD_DIMS} (128 with query tiles of 32) and sequences of equal length; got head_dim "
                         f"{D}, {warpgroups} warpgroups, query tiles of {B_R}, varlen {bool(VARLEN)}")
    NST = check_stages(stages, TMA)  # Q_i, dO_i buffers
    GQA = bool(gqa)
    sequence = make_sequence_geometry(VARLEN)
    entry = make_entry(variant, mods, no_calls=True, keep_given=True)
    kind, store, _, elem = _common(D, dtype)
    NC = threads(warpgroups)  # the threads that compute (with tensor maps, the producer's 128 follow them)
    NS = B_R // 2  # S^T and dP^T accumulator registers a thread: 64 x B_r over 128 threads
    DN = D // 2 if SPLIT else D  # head dims of dK_j, dV_j a warpgroup holds (N of their products)
    EXCH = exchanges(D, exchange)  # (SPLIT) S^T and dP^T over DN head dims a warpgroup, the partial sums exchanged
    NO = DN // 2  # dK and dV accumulator registers a thread
    KC = B_R // 16  # k-steps of dV += P^T dO, dK += dS^T Q
    SR = -(-B_R // NC)  # queries of L_i and D_i a thread fetches a tile
    SRP = -(-B_R // 32)  # the same for the producer's warp that fetches them (tensor maps)
    OFF_V = B_C * D  # V_j after K_j
    OFF_Q = 2 * B_C * D  # Q buffer 0; buffer 1 lies BUF further on; dO_i lies OFF_DO after its Q_i
    OFF_DO = B_R * D
    BUF = 2 * B_R * D
    OFF_X = OFF_Q + NST * BUF  # (EXCH) the warpgroups' partial S^T, dP^T after the buffers (64 B_r float32 each)
    SPAN = swizzle_span(D)  # bytes of a swizzled row (tensor-map copies)
    _, make_issue_ab, make_pack = make_pieces(D, dtype)
    issue_ab = make_issue_ab(KC, DN)
    _, make_ab_sw = make_swizzled_products(kind, D)
    issue_ab_sw = make_ab_sw(KC, DN)
    pack_a = make_pack(KC)
    wait_s = hop.wgmma_ops(kind, B_R)[2]
    wait_o = hop.wgmma_ops(kind, DN, regs_a=True, trans_b=True)[2]
    load_core = make_load_core(D, NC)
    mask_tile = make_mask_tile(NS, HAS_LEFT, HAS_RIGHT, True)
    user_mask_tile = make_user_mask_tile(NS, mods, True)

    @cuda.jit(device=True, inline=True)
    def tile_of(it, hk, group, nt, m_begin, lists):
        """(query head, first row) of iteration it: head hk * group + it // nt, tile m_begin + it % nt; with a
        block mask (m_begin: the key block; lists: bm_qidx[b], read only then), the (it % nt)-th tile of the query
        blocks it lists for the key block."""
        h = hk
        r = it
        if GQA:
            u = uint32(it) // uint32(nt)
            h = hk * group + int64(u)
            r = int64(uint32(it) - u * uint32(nt))
        if BM:  # (the tile within its block by unsigned division: r >= 0, and a signed one keeps a rounding term)
            ru = uint64(r)
            row = int64(ru % uint64(SUB)) * B_R
            return h, lists[h if lists.shape[0] > 1 else int64(0), m_begin, int64(ru // uint64(SUB))] * QB + row
        return h, (m_begin + r) * B_R

    @cuda.jit(device=True, inline=True)
    def part_of(state, bbm, h, i0, j0):
        """Whether the user's mask_mod runs in the tile of queries from i0 (keys from j0): in every tile but a
        block mask's full ones."""
        return USER_MASK and not block_full(state, bbm, h if state.shape[1] > 1 else int64(0), i0 // QB, j0)

    load_tile = make_load_stage(D, NC, B_R, OFF_Q, OFF_DO, BUF)  # Q_i, dO_i of iteration it into buffer it % NST
    # L_i and D_i of a query tile, fetched while the products are issued and put before the wait for S^T (not held
    # through the entries, whose registers d = 128 needs); with tensor maps, by a warp of the producer
    fetch_stats, put_stats = make_stats(B_R, NC)
    fetch_stats_p, put_stats_p = make_stats(B_R, 32)
    # the producer's copies (one thread): K_j, V_j with the first tile, then Q_i, dO_i of each (at tile_of's rows)
    produce = make_tma_producer(D, 2, B_C, OFF_V, B_R, OFF_Q, OFF_DO, BUF, tile_of, NST)

    @cuda.jit(device=True, inline=True)
    def produce_stats(lsm, dsm, bars, lse, delta, bb, q0, seqlen_q, hk, group, nt, m_begin, lists, total, lane):
        """The producer's second warp (thread ``lane``): log2(e) L_i and D_i of iteration it's queries into row
        it % NST of lsm, dsm once the consumers have released the tile that was there, then one arrival each
        on that stage's ``full`` mbarrier (which the copies' thread announces the bytes on)."""
        stp = cuda.local.array((2, SRP), float32)
        for it in range(total):
            st = it % NST
            if it >= NST:
                wait_phase(bars, NST + st, (it // NST + 1) & 1)
            h, i0 = tile_of(it, hk, group, nt, m_begin, lists)
            fetch_stats_p(stp, lse, delta, bb, h, q0 + i0, q0 + seqlen_q, lane)
            put_stats_p(lsm, dsm, st, stp, lane)
            hop.mbarrier_arrive(hop.smem_address(bars, st))

    issue_two = make_issue_sdp(D, dtype, TMA, B_C, B_R, OFF_DO * 2, DN if EXCH else D)

    @cuda.jit(device=True, inline=True)
    def issue_sdp(s, dp, k_addr, v_addr, q_base, it):
        """Group 1: S^T = K_j Q_i^T and dP^T = V_j dO_i^T (Q_i, dO_i of iteration it's buffer), one commit (EXCH:
        over the head dims from the addresses given, this warpgroup's half)."""
        issue_two(s, dp, k_addr, v_addr, q_base + (it % NST) * BUF * 2)

    @cuda.jit(device=True, inline=True)
    def exchange_sums(xs, x0, s, dp, gw, u):
        """(EXCH) S^T and dP^T whole in both warpgroups from their halves: thread u of warpgroup gw writes its
        partial sums to its rows of xs (from float32 x0, one row a register, 128 threads a row: no bank conflicts),
        and after a barrier of the two warpgroups adds those of thread u of the other (the same entries of the
        tile: both hold the same keys); the barrier before the writes keeps them from overwriting what the other
        still reads of the last tile. Both add the same two numbers: equal sums, bit for bit."""
        hop.named_barrier_sync(1, NC)
        own = x0 + gw * (2 * NS * 128) + u
        for e in range(NS):
            xs[own + e * 128] = s[e]
            xs[own + (NS + e) * 128] = dp[e]
        hop.named_barrier_sync(1, NC)
        other = x0 + (1 - gw) * (2 * NS * 128) + u
        for e in range(NS):
            s[e] += xs[other + e * 128]
            dp[e] += xs[other + (NS + e) * 128]

    @cuda.jit(device=True, inline=True)
    def issue_dkdv(dva, dka, pp, pd, q_base, it, half):
        """Group 2: dV_j += (P Z)^T dO_i and dK_j += dS^T Q_i (iteration it's buffer, read MN-major; with SPLIT the
        warpgroup's DN head dims, ``half`` bytes into each tile), one commit."""
        nb = q_base + (it % NST) * BUF * 2 + half
        if TMA:
            issue_ab_sw(dva, pp, nb + OFF_DO * 2, B_R)
            issue_ab_sw(dka, pd, nb, B_R)
        else:
            issue_ab(dva, pp, nb + OFF_DO * 2, 16 * B_R)
            issue_ab(dka, pd, nb, 16 * B_R)
        hop.wgmma_commit()

    @cuda.jit(device=True, inline=True)
    def keep_bits(i0, j0, r0, t, p_drop, seed, offset, bh):
        """(DROPOUT) Bit 4 n + x: whether the dropout mask keeps this lane's entry 4 n + x of the tile (query
        i0 + 8 n + 2 t + (x & 1), key j0 + r0 + 8 (x >> 1))."""
        bits = uint64(0)
        if DROPOUT:
            for e in range(NS):
                if dropout_uniform(seed, offset, bh, i0 + 8 * (e >> 2) + 2 * t + (e & 1),
                                   j0 + r0 + 8 * ((e & 3) >> 1)) >= p_drop:
                    bits |= uint64(1) << uint64(e)
        return bits

    @cuda.jit(device=True, inline=True)
    def entries(s, dp, lsm, dsm, sel, i0, j0, r0, t, seqlen_q, seqlen_k, diag, scale_log2, scale, softcap, left,
                right, slope, p_drop, rp_keep, seed, offset, b, h, bh, bits, aa):
        """(P Z)^T into s and dS^T into dp (this lane's keys r0, r0 + 8 of K_j; its query columns of the tile)."""
        last_row = min(i0 + B_R, seqlen_q) - 1
        masked = (i0 + B_R > seqlen_q or j0 + B_C > seqlen_k or (HAS_RIGHT and j0 + B_C - 1 > i0 + diag + right)
                  or (HAS_LEFT and j0 < last_row + diag - left))
        for n in range(NS // 4):
            for x in range(4):
                c = 8 * n + 2 * t + (x & 1)  # query column inside Q_i
                pz, ds = entry(s[4 * n + x], dp[4 * n + x], i0 + c, j0 + r0 + 8 * (x >> 1), lsm[sel, c],
                               dsm[sel, c], False, False, seqlen_q, seqlen_k, diag, scale_log2, scale, softcap, left,
                               right, slope, p_drop, rp_keep, seed, offset, b, h, bh, aa[0], aa[1], aa[2], aa[3],
                               (bits >> uint64(4 * n + x)) & uint64(1) != 0)
                s[4 * n + x] = pz
                dp[4 * n + x] = ds
        if masked:
            mask_tile(s, dp, j0 + r0, i0 + 2 * t, seqlen_q, seqlen_k, diag, left, right)

    @cuda.jit(device=True, inline=True)
    def put_dkdv(dk, dv, dka, dva, bb, k0, hk, j0, r0, c0, t, seqlen_k, scale, rp_keep):
        """dK_j, dV_j of this lane's keys r0, r0 + 8 (head dims from c0) to dk, dv (dV_j = (P Z)^T dO: Z = keep /
        (1 - p_drop))."""
        zscale = rp_keep if DROPOUT else float32(1.0)
        for x in range(2):
            j = j0 + r0 + 8 * x
            if j < seqlen_k:
                for n in range(NO // 4):
                    c = c0 + 8 * n + 2 * t
                    dk[bb, k0 + j, hk, c] = store(dka[4 * n + 2 * x] * scale)
                    dk[bb, k0 + j, hk, c + 1] = store(dka[4 * n + 2 * x + 1] * scale)
                    dv[bb, k0 + j, hk, c] = store(dva[4 * n + 2 * x] * zscale)
                    dv[bb, k0 + j, hk, c + 1] = store(dva[4 * n + 2 * x + 1] * zscale)

    @cuda.jit
    def backward_dkdv_wgmma(dout, q, k, v, lse, delta, dk, dv, scale_log2, scale, softcap, left, right, alibi, cu_q,
                            cu_k, p_drop, rp_keep, seed, offset, maps, a0, a1, a2, a3, bm_qnum, bm_qidx, bm_state):
        nheads = q.shape[2]
        tid = cuda.threadIdx.x
        gw = tid >> 7  # warpgroup: keys 64 gw .. 64 gw + 63 of K_j (SPLIT: all 64, head dims DN gw .. of dK_j, dV_j)
        lane = tid & 31
        t = lane & 3
        # (32-bit unsigned divisions, then signed 64-bit values: the dQ kernel's)
        nk = uint32(k.shape[2])
        tile, bh = launch_order_dkdv()  # (the key tiles that see the most causal rows first)
        bu = uint32(bh) // nk
        b = int64(bu)
        hk = int64(uint32(bh) - bu * nk)
        group = int64(1)
        if GQA:
            group = int64(uint32(nheads) // nk)
        j0 = tile * B_C  # first key of K_j
        # this lane's first key in K_j (its second is r0 + 8), and its warpgroup's first head dim of dK_j, dV_j
        r0 = (0 if SPLIT else 64 * gw) + 16 * ((tid >> 5) & 3) + (lane >> 2)
        c0 = gw * DN if SPLIT else 0
        bb, q0, k0, seqlen_q, seqlen_k = sequence(b, q.shape[1], k.shape[1], cu_q, cu_k)
        diag = seqlen_k - seqlen_q
        if j0 >= seqlen_k:
            return

        smem = cuda.shared.array(0, elem)  # K_j | V_j | Q, dO buffers 0, 1, 2 (dynamic), core matrices or swizzled
        xs = cuda.shared.array(0, float32)  # (EXCH) the same memory as float32: the partial sums after the buffers
        lsm = cuda.shared.array((NST, B_R), float32)  # log2(e) L_i of each buffer's queries
        dsm = cuda.shared.array((NST, B_R), float32)  # D_i
        bars = cuda.shared.array(NBARS, uint64)  # (tensor maps) full[0 .. 2], empty[0 .. 2]: mbarriers
        s = cuda.local.array(NS, float32)  # S^T, then (P Z)^T: this thread's part of its warpgroup's 64 x B_r
        dp = cuda.local.array(NS, float32)  # dP^T, then dS^T
        dva = cuda.local.array(NO, float32)  # dV_j
        dka = cuda.local.array(NO, float32)  # dK_j
        pp = cuda.local.array((KC, 4), uint32)  # (P Z)^T packed: the A operand of dV_j += (P Z)^T dO_i
        pd = cuda.local.array((KC, 4), uint32)  # dS^T packed: that of dK_j += dS^T Q_i
        st = cuda.local.array((2, SR), float32)  # L_i, D_i of the next tile, on their way to shared memory

        # Query tiles that meet the band of these keys: rows j0 - diag - right .. j_last - diag + left
        # (unsigned divisions: both are >= 0, and a signed one by a power of two keeps a rounding term)
        m_begin = 0
        m_rows = seqlen_q
        if HAS_RIGHT:
            m_begin = int64(uint32(max(0, j0 - diag - right)) // uint32(B_R))
        if HAS_LEFT:
            m_rows = max(0, min(seqlen_q, min(j0 + B_C, seqlen_k) - diag + left))
        nt = max(0, int64(uint32(m_rows + B_R - 1) // uint32(B_R)) - m_begin)  # query tiles per query head
        # with a block mask, the query blocks it lists for this key block (one made for B = 1 serves every entry;
        # with GQA it is one for every head)
        bbm = b if bm_qnum.shape[0] > 1 else int64(0)
        lists = bm_qidx[bbm]  # (within the dummy's bounds without a block mask: read only with one)
        kb = j0 // KB
        if BM:
            m_begin = kb
            nt = int64(bm_qnum[bbm, hk if bm_qnum.shape[1] > 1 else int64(0), kb]) * SUB
        total = group * nt
        if total == 0:  # no query sees these keys: dK_j = dV_j = 0 (and no condition on total below)
            if tid < NC:
                for n in range(NO):
                    dva[n] = 0.0
                    dka[n] = 0.0
                put_dkdv(dk, dv, dka, dva, bb, k0, hk, j0, r0, c0, t, seqlen_k, scale, rp_keep)
            return

        base = 0  # where K_j starts in smem: with tensor-map copies, on 1024 bytes (shared_bytes_dkdv leaves room)
        if TMA:
            base = swizzle_base(smem)
            init_stages(bars, 1 + 32, NC, True, tid, NST)  # full: the copies' thread and the statistics' warp
            if tid >= NC:
                hop.setmaxnreg_dec(PRODUCER_REGISTERS)
                if tid == NC:
                    produce(smem, base, bars, maps, bb, hk, j0, total, hk, group, nt, m_begin, lists, 0)
                elif tid >= NC + 32 and tid < NC + 64:
                    produce_stats(lsm, dsm, bars, lse, delta, bb, q0, seqlen_q, hk, group, nt, m_begin, lists, total,
                                  tid - NC - 32)
                return
            hop.setmaxnreg_inc(CONSUMER_REGISTERS)
        # (SPLIT) bytes into a Q_i or dO_i tile where this warpgroup's head dims start: DN gw / 8 blocks of 8 head
        # dims (B_r rows of 16 bytes each), or DN gw / E boxes (B_r swizzled rows each); either way DN gw B_r elements
        half = c0 * B_R * 2
        # where S^T and dP^T read K_j, V_j: this warpgroup's 64 keys, 8 core matrices further or 64 swizzled rows
        # (SPLIT: both warpgroups' the same 64; EXCH: from this warpgroup's first head dim, DN gw B_c elements in)
        keys_at = c0 * B_C * 2 if EXCH else (0 if SPLIT else gw * 64 * (SPAN if TMA else 16))
        k_addr = hop.smem_address(smem, base) + keys_at
        v_addr = hop.smem_address(smem, base + OFF_V) + keys_at
        q_base = hop.smem_address(smem, base + OFF_Q)
        sdp_base = q_base + half if EXCH else q_base
        x0 = (base + OFF_X) >> 1  # (EXCH) the float32 where the partial sums start (base and OFF_X are even)
        u = tid & 127

        h, i0 = tile_of(0, hk, group, nt, m_begin, lists)
        if not TMA:
            load_core(smem, 0, k, bb, k0 + j0, k0 + seqlen_k, hk, B_C, tid)
            load_core(smem, OFF_V, v, bb, k0 + j0, k0 + seqlen_k, hk, B_C, tid)
            load_tile(smem, 0, q, dout, bb, q0 + i0, q0 + seqlen_q, h, tid)
            fetch_stats(st, lse, delta, bb, h, q0 + i0, q0 + seqlen_q, tid)
            put_stats(lsm, dsm, 0, st, tid)
            ptx.cp_async_commit()
        for n in range(NO):  # (zeroed after the copies are addressed: the prologue needs the registers)
            dva[n] = 0.0
            dka[n] = 0.0

        # The first tile: S^T, dP^T alone, the entries, packed
        h_next, i_next = tile_of(1, hk, group, nt, m_begin, lists) if total > 1 else (h, i0)
        if TMA:
            wait_phase(bars, 0, 0)
        else:
            publish_tile()
            if total > 1:
                load_tile(smem, 1, q, dout, bb, q0 + i_next, q0 + seqlen_q, h_next, tid)
                fetch_stats(st, lse, delta, bb, h_next, q0 + i_next, q0 + seqlen_q, tid)
        issue_sdp(s, dp, k_addr, v_addr, sdp_base, 0)
        if not TMA and total > 1:
            put_stats(lsm, dsm, 1, st, tid)
        bits = keep_bits(i0, j0, r0, t, p_drop, seed, offset, b * nheads + h)
        partial = part_of(bm_state, bbm, h, i0, j0)
        wait_s(0, s)
        wait_s(0, dp)
        if EXCH:
            exchange_sums(xs, x0, s, dp, gw, u)
        slope = alibi[b, h] if ALIBI else float32(0.0)
        entries(s, dp, lsm, dsm, 0, i0, j0, r0, t, seqlen_q, seqlen_k, diag, scale_log2, scale, softcap, left,
                right, slope, p_drop, rp_keep, seed, offset, b, h, b * nheads + h, bits, (a0, a1, a2, a3))
        if partial:  # (the user's mask_mod: P and dS 0 where it hides an entry)
            user_mask_tile(s, dp, j0 + r0, i0 + 2 * t, seqlen_q, seqlen_k, b, h, a0, a1, a2, a3)
        pack_a(pp, s)
        pack_a(pd, dp)
        # Tile i: S^T, dP^T issued, dV, dK of tile i - 1 behind them, the entries of tile i while those run. The
        # tile's query head and first row are read a tile ahead (with a block mask, a load from its list), behind
        # the products: the load of whether the mask_mod runs there, addressed by them, then goes out at once and is
        # used after the wait
        sel = 0
        phase = 0  # (tensor maps) the parity of buffer sel's phase of ``full``: flips as sel comes round
        for it in range(1, total):
            h, i0 = (h_next, i_next) if BM else tile_of(it, hk, group, nt, m_begin, lists)  # (as the dQ kernel's)
            partial = part_of(bm_state, bbm, h, i0, j0)  # (read before the wait: its latency hides behind it)
            # (it % NST, stepped: the remainder each tile spills under CUDA 13.0's assembler at d = 128)
            done = sel
            sel = sel + 1 if sel < NST - 1 else 0
            if TMA:
                if sel == 0:
                    phase ^= 1
                wait_phase(bars, sel, phase)
            else:
                publish_tile()
                if it + 1 < total:  # (the next tile's entry read here, where its copies start)
                    h_next, i_next = tile_of(it + 1, hk, group, nt, m_begin, lists)
                    load_tile(smem, it + 1, q, dout, bb, q0 + i_next, q0 + seqlen_q, h_next, tid)
                    fetch_stats(st, lse, delta, bb, h_next, q0 + i_next, q0 + seqlen_q, tid)
            issue_sdp(s, dp, k_addr, v_addr, sdp_base, it)
            issue_dkdv(dva, dka, pp, pd, q_base, it - 1, half)
            if TMA and BM and it + 1 < total:
                h_next, i_next = tile_of(it + 1, hk, group, nt, m_begin, lists)
            if not TMA and it + 1 < total:  # (buffer sel + 1 was last read two tiles ago, before this barrier)
                put_stats(lsm, dsm, (it + 1) % NST, st, tid)
            bits = keep_bits(i0, j0, r0, t, p_drop, seed, offset, b * nheads + h)
            wait_s(1, s)
            wait_s(1, dp)
            if EXCH:
                exchange_sums(xs, x0, s, dp, gw, u)
            slope = alibi[b, h] if ALIBI else float32(0.0)
            entries(s, dp, lsm, dsm, sel, i0, j0, r0, t, seqlen_q, seqlen_k, diag, scale_log2, scale, softcap, left,
                    right, slope, p_drop, rp_keep, seed, offset, b, h, b * nheads + h, bits,
                    (a0, a1, a2, a3))
            if partial:
                user_mask_tile(s, dp, j0 + r0, i0 + 2 * t, seqlen_q, seqlen_k, b, h, a0, a1, a2, a3)
            wait_o(0, dva)
            wait_o(0, dka)
            if TMA:  # (tile it - 1 read by its products, its statistics by its entries: its buffer free)
                hop.mbarrier_arrive(hop.smem_address(bars, NST + done))
            pack_a(pp, s)
            pack_a(pd, dp)
        # The last tile's dV, dK products
        issue_dkdv(dva, dka, pp, pd, q_base, total - 1, half)
        wait_o(0, dva)
        wait_o(0, dka)
        if not TMA:
            ptx.cp_async_wait_all()  # (every copy landed before the kernel ends)

        put_dkdv(dk, dv, dka, dva, bb, k0, hk, j0, r0, c0, t, seqlen_k, scale, rp_keep)

    return backward_dkdv_wgmma
