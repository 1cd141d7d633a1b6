"""Forward kernel for float32 on Hopper's warpgroup MMA: 3xTF32 with ``wgmma`` (float32's accuracy on tensor cores).

The algorithm is :mod:`flashnumba.kernels.mma_tf32`'s 3xTF32 forward (read it first): each float32 operand x is
split into big = tf32(x) and small = tf32(x - big) (``ptx.split_tf32``, to nearest) and a product A B is formed as
A_small B_big + A_big B_small + A_big B_big. What changes is who splits and who multiplies. There every warp splits
the operands it reads from shared memory, at every use; here each tile is split once, as it is stored to shared
memory, and a warpgroup's ``wgmma`` (:mod:`flashnumba.kernels.ptx_hopper`, kind "tf32": m64nNk8) reads the parts
from there. Per key tile::

    K_j  -> K_big, K_small         (B_c x D, K-major: core matrices of 8 keys x 4 head dims)
    V_j  -> V^T_big, V^T_small     (D x B_c: TF32's B operand is K-major only, so V is stored transposed; in each
                                    8 keys the order 0, 2, 4, 6, 1, 3, 5, 7, below)
    S = Q_small K_big^T + Q_big K_small^T + Q_big K_big^T        3 D / 8 wgmma m64nB_ck8
    ...the online softmax of mma_tf32 on S's accumulator (exact exp2, float32)...
    O += P_small V_big + P_big V_small + P_big V_big             3 B_c / 8 wgmma m64nDk8, P from registers

**P from registers.** A TF32 A operand in registers holds, in thread (w, g, t), columns t and t + 4 of each 8 (one
float a register: a_i = A[16 w + g + 8 (i & 1), t + 4 (i >> 1)]), where S's accumulator holds columns 2t and 2t + 1.
Rather than move values between lanes, the keys are renamed: the A operand's column c of a k-step is key 2c (c < 4)
or 2 (c - 4) + 1 (c >= 4), so a thread's registers are (s[4c], s[4c + 2], s[4c + 1], s[4c + 3]) of k-step c, and
V^T stores its keys in that order. A sum over keys does not depend on their order.

**The accumulation** (``chained``). ``mma.sync``'s 3xTF32 needed each k-step's three products summed from zero and
added with float32 adds: chained into the running sum, the tensor cores' truncation (they align the products to the
largest term and drop what falls below) is relative to the whole sum, a few times float32's error
(``scripts/tf32_error_model.py``). With ``chained`` the products of a tile chain in the wgmma accumulator (S over
its D / 8 k-steps, O over every key tile); without, each k-step's three go to a scratch accumulator from zero,
are waited for and added (``scripts/tf32_wgmma_error.py`` measures which the tensor cores allow).

Launch geometry: grid (ceil(seqlen_q / B_r), batch * nheads), block 2 B_r: B_r = 64 query rows (one warpgroup) or
128 (two; warpgroup wg owns rows 64 wg .. 64 wg + 63, both multiply the same split K_j and V_j, so a split tile
serves twice the rows); warp w of a warpgroup owns rows 16 w .. 16 w + 15 of its 64, lane (g, t) rows g and g + 8
of them, the accumulators' layout of ptx_hopper. The blocks take their query tiles in launch order with the
longest causal rows first (``common.make_launch_order``). Shared memory, dynamic, float32 bits: Q_big | Q_small
| K_big | K_small | V^T_big | V^T_small | K_j+1 | V_j+1 (:func:`shared_bytes`). The tiles' loads are the pipeline:
while a tile's products run, the next tile's K and V are copied (``cp.async``) as they are into the last two
buffers; at the top of the next tile every thread splits them into the parts, and the copy of the one after
starts::

    copy K_0, V_0 | split Q_i
    tile j:  wait for the copies; barrier | split K_j, V_j^T | barrier | copy K_j+1, V_j+1 | S, softmax, O += P V

Q_i, loaded once, is read by each thread in batches of loads that are in flight together.

float32 only, head_dim 64 or 128, causal or not (the options of mma_tf32). The plan takes it for
``precision="3xtf32"`` on compute capability 9.0 where ``flashnumba.config.hopper_3xtf32`` is set ("chained" or
"per_step"; by default the ``mma.sync`` kernel runs: docs/benchmarks.md has the measured speed and error).
"""

from __future__ import annotations

import functools
import math

from . import ptx, ptx_hopper as hop
from .._backend import cuda
from .common import LN2, NEG_INF, make_key_range, make_launch_order, make_online_softmax
from .scalars import float32, uint32

HEAD_DIMS = (64, 128)
BLOCK_MS = (64, 128)  # query rows a block: one warpgroup, or two sharing each K_j and V_j
DEFAULT_BLOCK_M = 64  # (the one measured)
# keys a tile (N of S's wgmma, K of O's: multiples of 8), per head_dim: those whose buffers fit the 227 KB of shared
# memory a block may have with 128 rows too (at D 128, 64 keys would need 256 KB with 64 rows)
BLOCK_NS = {64: (16, 32, 64), 128: (16, 32)}
DEFAULT_BLOCK_N = 16  # the fastest at both head dims (docs/benchmarks.md)
# Q_i's elements a thread loads from global memory before it splits and stores them, their loads in flight together
# (a latency a batch, not an element); 8 divides a thread's share of Q_i (D / 2 at every B_r)
LOADS = 8


def shared_bytes(D, B_c, B_r=64):
    """Q_i's big and small parts (B_r x D), K_j's (B_c x D) and V_j^T's (D x B_c), and K_j+1 and V_j+1 as copied,
    float32."""
    return 4 * (2 * B_r * D + 6 * B_c * D)


@functools.lru_cache(maxsize=None)
def make_store_split(cols):
    """store_split(smem, big, small, e, x): x split into TF32 parts at element e of two K-major operands of ``cols``
    columns (core matrices of 8 rows x 4 columns, 128 bytes each, the next 4 columns LBO = 128 bytes on, the next 8
    rows SBO = 32 cols bytes on), and where_of(e) -> (row, column) of element e: numbering the elements so, element e
    lies at word e (32 a block of 8 rows x 4 columns, the blocks row-block by row-block), and a warp's stores of 32
    consecutive elements fill 32 banks."""
    QUADS = cols // 4

    @cuda.jit(device=True, inline=True)
    def where_of(e):
        blk = e // 32
        lane = e - 32 * blk
        return 8 * (blk // QUADS) + (lane >> 2), 4 * (blk - QUADS * (blk // QUADS)) + (lane & 3)

    @cuda.jit(device=True, inline=True)
    def store_split(smem, big, small, e, x):
        hi, lo = ptx.split_tf32(x)
        smem[big + e] = hi
        smem[small + e] = lo

    return where_of, store_split


def turns(N):
    """The k-steps of a run of make_three_products(N)'s per_step: 8, or 4 at N 64 (compiled for sm_90a, a run of 16
    steps at N 16 and one of 8 at N 64 were left as loops, and the assembler serialised every wgmma: C7511,
    C7514; a run's loop must be unrolled for the accumulators in flight to stay in registers)."""
    return 8 if N <= 32 else 4


def check_steps(steps, N):
    """ValueError unless make_three_products(N)'s per_step takes ``steps`` k-steps (its docstring)."""
    if steps % 2 or steps % min(turns(N), steps):
        raise ValueError(f"per_step at N {N} takes an even number of k-steps, at most {turns(N)} or a multiple "
                         f"of it: {steps}")


@functools.lru_cache(maxsize=None)
def make_in_turns(issue, wait, NR):
    """in_turns(acc, sa, sb, x1, x2, x3, x4, first, n): steps first .. first + n - 1 (n even) of a sum of k-steps,
    each step's products issued from zero into a scratch accumulator by ``issue(scratch, x1, x2, x3, x4, step)``
    (fenced and committed), waited for (``wait``) and added to acc (NR float32 a thread) in step order; sa and sb
    take turns, step k + 1's products running while step k's are added (make_three_products' timeline)."""

    @cuda.jit(device=True, inline=True)
    def in_turns(acc, sa, sb, x1, x2, x3, x4, first, n):
        issue(sa, x1, x2, x3, x4, first)
        for kk in range(first, first + n, 2):
            issue(sb, x1, x2, x3, x4, kk + 1)
            wait(1, sa)  # step kk's products (step kk + 1's may still run)
            for i in range(NR):
                acc[i] += sa[i]
            if kk + 2 < first + n:
                issue(sa, x1, x2, x3, x4, kk + 2)
                wait(1, sb)
            else:
                wait(0, sb)
            for i in range(NR):
                acc[i] += sb[i]

    return in_turns


@functools.lru_cache(maxsize=None)
def make_three_products(N):
    """(chain, per_step), the two accumulations of acc (64 x N) += A B^T in 3xTF32 over ``steps`` k-steps of 8
    columns, A and B each given as the descriptors of their small and big parts in shared memory (K-major; a k-step
    is two core matrices, 256 bytes on: 16 in the descriptor's units):

    * ``chain(acc, a_small, a_big, b_big, b_small, steps, first)``: A_small B_big^T + A_big B_small^T + A_big B_big^T
      of every step issued on acc, chained (from zero where ``first`` is 0, else onto acc); not fenced, committed
      or waited for;
    * ``per_step(acc, sa, sb, a_small, a_big, b_big, b_small, steps)``: each step's three from zero in a scratch
      accumulator, waited for and added to acc with float32 adds, step after step. Two scratch accumulators take
      turns (``steps`` even): step k + 1's products run on the tensor cores while step k's are added, so a step's
      latency is waited for once, not twice (``steps`` even, and at most :func:`turns` (N) or a multiple of it:
      :func:`check_steps`)::

          issue 0 (sa) | issue 1 (sb) | wait sa, add | issue 2 (sa) | wait sb, add | issue 3 (sb) | wait sa, add ...

      in runs of at most :func:`turns` (N) steps, each drained before the next."""
    mma, fence, wait = hop.wgmma_ops("tf32", N)
    NR = N // 2
    RUN = turns(N)

    @cuda.jit(device=True, inline=True)
    def chain(acc, a_small, a_big, b_big, b_small, steps, first):
        for kk in range(steps):
            o = 16 * kk
            mma(acc, a_small + o, b_big + o, first + kk)
            mma(acc, a_big + o, b_small + o, 1)
            mma(acc, a_big + o, b_big + o, 1)

    @cuda.jit(device=True, inline=True)
    def issue_step(scratch, a_small, a_big, b_big, b_small, kk):
        o = 16 * kk
        fence(scratch)
        chain(scratch, a_small + o, a_big + o, b_big + o, b_small + o, 1, 0)
        hop.wgmma_commit()

    steps_in_turns = make_in_turns(issue_step, wait, NR)

    @cuda.jit(device=True, inline=True)
    def per_step(acc, sa, sb, a_small, a_big, b_big, b_small, steps):
        run = min(RUN, steps)  # (steps a multiple of it: each run's loop has constant bounds, unrolled)
        for first in range(0, steps, run):
            steps_in_turns(acc, sa, sb, a_small, a_big, b_big, b_small, first, run)

    return chain, per_step


@functools.lru_cache(maxsize=None)
def make_tile_io(D, rows, NT):
    """(load_rows, copy_tile, split_natural, split_transposed), the moves of a tile of ``rows`` rows x D float32
    columns between global memory and a block of NT threads' shared memory (``smem`` as uint32, ``fsmem`` the same
    memory as float32; offsets in words):

    * ``load_rows(smem, big, small, x, b, h, row0, nrows, count, tid)``: rows row0 .. of x[b, :, h, :] (``count``
      elements, zero past row nrows) split into the K-major parts at words big and small (:func:`make_store_split`
      of D columns): :data:`LOADS` a thread loaded together, then split and stored (a load's latency once a batch,
      not once an element);
    * ``copy_tile(fsmem, raw, x, b, h, row0, nrows, tid)``: start copying the ``rows`` rows from row0 to word
      ``raw`` on (cp.async, 16 bytes a copy): copy ch takes row 8 (ch >> 3) // (D / 4) + (ch & 7), columns
      4 ((ch >> 3) % (D / 4)) .. + 3, to words 4 ch .. 4 ch + 3, which lays the tile out as the K-major core
      matrices of make_store_split (a warp's 32 copies: 8 rows of 64 contiguous bytes in global memory, 512
      contiguous bytes in shared memory). Rows from nrows on are zeroed with stores instead;
    * ``split_natural(smem, fsmem, raw, big, small, tid)``: a copied tile split into its parts, as it lies (the B
      operand of a product over the head dims, rows x D);
    * ``split_transposed(smem, fsmem, raw, big, small, tid)``: a copied tile split into the parts of its transpose
      (D x rows, K-major: the B operand of a product over the rows), position c of each 8 holding row pi(c) = 2c
      (c < 4) or 2 (c - 4) + 1: the rows in the order of an accumulator's registers used as a TF32 A operand
      (module docstring)."""
    where_d, store_d = make_store_split(D)
    where_r, store_r = make_store_split(rows)
    COPIES = rows * D // (4 * NT)  # 16-byte copies a thread
    QUADS = D // 4

    @cuda.jit(device=True, inline=True)
    def load_rows(smem, big, small, x, b, h, row0, nrows, count, tid):
        vals = cuda.local.array(LOADS, float32)
        for u0 in range(0, count // NT, LOADS):
            for u in range(LOADS):
                r, c = where_d(tid + NT * (u0 + u))
                vals[u] = x[b, row0 + r, h, c] if row0 + r < nrows else float32(0.0)
            for u in range(LOADS):
                store_d(smem, big, small, tid + NT * (u0 + u), vals[u])

    @cuda.jit(device=True, inline=True)
    def copy_tile(fsmem, raw, x, b, h, row0, nrows, tid):
        for u in range(COPIES):
            ch = tid + NT * u
            blk = ch >> 3
            r = 8 * (blk // QUADS) + (ch & 7)
            if row0 + r < nrows:
                ptx.cp_async_16_at(fsmem, raw + 4 * ch, x, b, row0 + r, h, 4 * (blk - QUADS * (blk // QUADS)))
            else:
                for x4 in range(4):
                    fsmem[raw + 4 * ch + x4] = float32(0.0)

    @cuda.jit(device=True, inline=True)
    def split_natural(smem, fsmem, raw, big, small, tid):
        for u in range(rows * D // NT):
            e = tid + NT * u
            store_d(smem, big, small, e, fsmem[raw + e])

    @cuda.jit(device=True, inline=True)
    def split_transposed(smem, fsmem, raw, big, small, tid):
        for u in range(rows * D // NT):
            e = tid + NT * u
            d, c = where_r(e)
            r = (c & ~7) + (2 * (c & 3) + ((c >> 2) & 1))  # (r, d) lies at word e' with where_d(e') = (r, d)
            store_r(smem, big, small, e, fsmem[raw + 32 * (QUADS * (r >> 3) + (d >> 2)) + 4 * (r & 7) + (d & 3)])

    return load_rows, copy_tile, split_natural, split_transposed


@functools.lru_cache(maxsize=None)
def make_smem_products(N, steps, chained):
    """products(acc, sa, sb, a_big, a_small, b_big, b_small): acc (64 x N) = A_small B_big^T + A_big B_small^T +
    A_big B_big^T over ``steps`` k-steps, both operands read from shared memory (descriptors of their parts),
    waited for: chained in acc, or each k-step from zero in the scratch accumulators sa, sb (in turns) and added
    (:func:`make_three_products`)."""
    _, fence, wait = hop.wgmma_ops("tf32", N)
    chain, per_step = make_three_products(N)
    NR = N // 2
    if not chained:
        check_steps(steps, N)

    @cuda.jit(device=True, inline=True)
    def products(acc, sa, sb, a_big, a_small, b_big, b_small):
        if chained:
            fence(acc)
            chain(acc, a_small, a_big, b_big, b_small, steps, 0)
            hop.wgmma_commit()
            wait(0, acc)
        else:
            for i in range(NR):
                acc[i] = 0.0
            per_step(acc, sa, sb, a_small, a_big, b_big, b_small, steps)

    return products


@functools.lru_cache(maxsize=None)
def make_register_products(N, steps, chained, in_turns):
    """(pack, products), acc (64 x N) += F B in 3xTF32, F (64 x 8 steps) an accumulator's registers, B (8 steps x N)
    in shared memory, K-major (the transposed parts of :func:`make_tile_io`):

    * ``pack(fb, fs, f)``: F's registers f (an accumulator of N = 8 steps) split into the big and small TF32 parts of
      the A operand of each k-step c, fb[c, 0 .. 3] and fs[c, 0 .. 3] (columns t, t + 4 of the step are its
      accumulator columns 2t, 2t + 1: module docstring);
    * ``products(acc, sa, sb, fb, fs, b_big, b_small)``: F_small B_big + F_big B_small + F_big B_big added to acc,
      waited for: chained in acc, or each k-step from zero in a scratch accumulator and added; with ``in_turns``
      two scratch accumulators take turns (sb then has N / 2 registers a thread too, else it is not used)."""
    mma, fence, wait = hop.wgmma_ops("tf32", N, regs_a=True)
    NR = N // 2

    @cuda.jit(device=True, inline=True)
    def pack(fb, fs, f):
        for c in range(steps):
            for r in range(4):
                hi, lo = ptx.split_tf32(f[4 * c + 2 * (r & 1) + (r >> 1)])
                fb[c, r] = hi
                fs[c, r] = lo

    @cuda.jit(device=True, inline=True)
    def issue(scratch, fb, fs, b_big, b_small, c):
        """k-step c's three products from zero in scratch."""
        fence(scratch)
        mma(scratch, fs[c, 0], fs[c, 1], fs[c, 2], fs[c, 3], b_big + 16 * c, 0)
        mma(scratch, fb[c, 0], fb[c, 1], fb[c, 2], fb[c, 3], b_small + 16 * c, 1)
        mma(scratch, fb[c, 0], fb[c, 1], fb[c, 2], fb[c, 3], b_big + 16 * c, 1)
        hop.wgmma_commit()

    steps_in_turns = make_in_turns(issue, wait, NR)

    @cuda.jit(device=True, inline=True)
    def products(acc, sa, sb, fb, fs, b_big, b_small):
        if chained:
            fence(acc)
            for c in range(steps):
                mma(acc, fs[c, 0], fs[c, 1], fs[c, 2], fs[c, 3], b_big + 16 * c, 1)
                mma(acc, fb[c, 0], fb[c, 1], fb[c, 2], fb[c, 3], b_small + 16 * c, 1)
                mma(acc, fb[c, 0], fb[c, 1], fb[c, 2], fb[c, 3], b_big + 16 * c, 1)
            hop.wgmma_commit()
            wait(0, acc)
        elif in_turns:
            steps_in_turns(acc, sa, sb, fb, fs, b_big, b_small, 0, steps)
        else:
            for c in range(steps):
                issue(sa, fb, fs, b_big, b_small, c)
                wait(0, sa)
                for i in range(NR):
                    acc[i] += sa[i]

    return pack, products


@functools.lru_cache(maxsize=None)
def make_forward_3xtf32_wgmma(D, causal, B_c=32, chained=True, B_r=64):
    """The 3xTF32 forward on wgmma for head_dim D (:data:`HEAD_DIMS`), B_c keys a tile (:data:`BLOCK_NS` of D), B_r
    query rows a block (:data:`BLOCK_MS`: one or two warpgroups, the second sharing the first's K_j and V_j and
    their split), causal or not; ``chained``: the products summed in the wgmma accumulator (module docstring).
    Arguments: (q, k, v, out, lse, scale_log2) as :func:`flashnumba.kernels.mma_tf32.make_forward_tf32`'s (float32,
    C-contiguous, q's heads as many as k's). Compiled for sm_90a. Launch: grid (ceil(seqlen_q / B_r), batch *
    nheads), block (2 B_r,), dynamic shared memory :func:`shared_bytes`."""
    if D not in HEAD_DIMS:
        raise ValueError(f"the 3xTF32 wgmma forward supports head_dim in {HEAD_DIMS}, got {D}")
    if B_c not in BLOCK_NS[D]:
        raise ValueError(f"the 3xTF32 wgmma forward at head_dim {D} takes block_n in {BLOCK_NS[D]}, got {B_c}")
    if B_r not in BLOCK_MS:
        raise ValueError(f"the 3xTF32 wgmma forward takes block_m in {BLOCK_MS}, got {B_r}")
    BR, NT = B_r, 2 * B_r  # (a warpgroup of 128 threads a 64 rows)
    CHAINED = bool(chained)
    NS = B_c // 2  # S accumulator registers a thread
    NO = D // 2  # O accumulator registers a thread
    KD = D // 8  # k-steps of S
    KC = B_c // 8  # k-steps of O += P V
    # O's k-steps in turns between two scratch accumulators where a second one fits the registers (D / 2 more a
    # thread: at head_dim 64, not at 128); each run of them is the tile's KC steps
    O_TURNS = D <= 64 and not chained
    RK, RV = 2 * BR * D + 4 * B_c * D, 2 * BR * D + 5 * B_c * D  # K_j and V_j as copied (float32 words)
    QB, QS = 0, BR * D  # word offsets in shared memory
    KB, KS = 2 * BR * D, 2 * BR * D + B_c * D
    VB, VS = 2 * BR * D + 2 * B_c * D, 2 * BR * D + 3 * B_c * D
    SBO_D, SBO_C = 32 * D, 32 * B_c  # bytes: 8 rows of D columns (Q, K), of B_c columns (V^T)
    products_s = make_smem_products(B_c, KD, CHAINED)
    pack_p, products_o = make_register_products(D, KC, CHAINED, O_TURNS)
    load_rows, copy_tile, split_natural, split_transposed = make_tile_io(D, B_c, NT)
    key_range = make_key_range(BR, B_c, False, causal)
    launch_order_q = make_launch_order(True, causal)
    # (the steps of the online softmax on the accumulator's rows, with float32's exact exp2: the scores are scaled
    # to base 2 before the mask)
    quad_max, new_max, prob = make_online_softmax(False, exact=True)

    @cuda.jit
    def forward_3xtf32_wgmma(q, k, v, out, lse, scale_log2):
        nheads = q.shape[2]
        seqlen_q = q.shape[1]
        seqlen_k = k.shape[1]
        tid = cuda.threadIdx.x
        wg = tid // 128  # the warpgroup: query rows 64 wg .. 64 wg + 63 of the block
        w = (tid // 32) & 3
        g = (tid % 32) >> 2
        t = tid & 3
        tile, bh = launch_order_q()  # the longest causal rows first (common.make_launch_order)
        b = uint32(bh) // uint32(nheads)  # (32-bit: a 64-bit division is a called routine, and a call
        h = uint32(uint32(bh) - b * uint32(nheads))  # in the kernel serialises every wgmma)
        i0 = tile * BR
        diag = seqlen_k - seqlen_q

        smem = cuda.shared.array(0, uint32)  # the six parts and the two copied tiles (module docstring)
        fsmem = cuda.shared.array(0, float32)  # (the same memory as float32: the copied tiles)
        s = cuda.local.array(NS, float32)
        o = cuda.local.array(NO, float32)
        scratch_s = cuda.local.array(NS, float32)  # (each k-step's products, in turns: chained=False)
        scratch_s2 = cuda.local.array(NS, float32)
        scratch_o = cuda.local.array(NO, float32)
        scratch_o2 = cuda.local.array(NO if O_TURNS else 1, float32)  # (O's steps in turns: head_dim 64)
        pb = cuda.local.array((KC, 4), uint32)  # P's big parts, the A operand of k-step c
        ps = cuda.local.array((KC, 4), uint32)
        m = cuda.local.array(2, float32)
        l = cuda.local.array(2, float32)
        alpha = cuda.local.array(2, float32)
        m_use = cuda.local.array(2, float32)
        for x in range(2):
            m[x] = NEG_INF
            l[x] = 0.0
        for i in range(NO):
            o[i] = 0.0

        qb = hop.make_desc(hop.smem_address(smem, QB + 64 * D * wg), 128, SBO_D)  # (this warpgroup's 64 rows)
        qs = hop.make_desc(hop.smem_address(smem, QS + 64 * D * wg), 128, SBO_D)
        kb = hop.make_desc(hop.smem_address(smem, KB), 128, SBO_D)
        ks = hop.make_desc(hop.smem_address(smem, KS), 128, SBO_D)
        vb = hop.make_desc(hop.smem_address(smem, VB), 128, SBO_C)
        vs = hop.make_desc(hop.smem_address(smem, VS), 128, SBO_C)

        _, n_end = key_range(i0, seqlen_q, seqlen_k, diag, 0, 0)
        n_tiles = (n_end + B_c - 1) // B_c
        if n_tiles > 0:  # K_0 and V_0 copied while Q_i is split
            copy_tile(fsmem, RK, k, b, h, 0, seqlen_k, tid)
            copy_tile(fsmem, RV, v, b, h, 0, seqlen_k, tid)
            ptx.cp_async_commit()
        load_rows(smem, QB, QS, q, b, h, i0, seqlen_q, BR * D, tid)  # Q_i, split once
        for jt in range(n_tiles):
            j0 = jt * B_c
            ptx.cp_async_wait_all()
            cuda.syncthreads()  # (K_j, V_j copied; every thread's products of tile j - 1 retired)
            split_natural(smem, fsmem, RK, KB, KS, tid)  # K_j
            split_transposed(smem, fsmem, RV, VB, VS, tid)  # V_j^T (keys in the order of P's registers)
            hop.fence_proxy_async()  # (the stores seen by the tensor cores' reads)
            cuda.syncthreads()  # (the copied tiles consumed: K_j+1 and V_j+1 copied there during tile j's products)
            if jt + 1 < n_tiles:
                copy_tile(fsmem, RK, k, b, h, j0 + B_c, seqlen_k, tid)
                copy_tile(fsmem, RV, v, b, h, j0 + B_c, seqlen_k, tid)
                ptx.cp_async_commit()

            products_s(s, scratch_s, scratch_s2, qb, qs, kb, ks)  # S = Q_i K_j^T

            # scale to base 2, mask, the online softmax (s[4 n + x]: row g + 8 (x >> 1), key 8 n + 2 t + (x & 1))
            masked = j0 + B_c > seqlen_k or (causal and j0 + B_c - 1 > i0 + diag)
            mx0 = NEG_INF
            mx1 = NEG_INF
            for n in range(NS // 4):
                for x in range(4):
                    val = s[4 * n + x] * scale_log2
                    if masked:
                        i = i0 + 64 * wg + 16 * w + g + 8 * (x >> 1)
                        j = j0 + 8 * n + 2 * t + (x & 1)
                        if j >= seqlen_k or (causal and j > i + diag):
                            val = NEG_INF
                    s[4 * n + x] = val
                    if x < 2:
                        mx0 = max(mx0, val)
                    else:
                        mx1 = max(mx1, val)
            new_max(m, m_use, alpha, 0, quad_max(mx0), scale_log2)
            new_max(m, m_use, alpha, 1, quad_max(mx1), scale_log2)
            ps0 = float32(0.0)
            ps1 = float32(0.0)
            for n in range(NS // 4):
                for x in range(4):
                    p = prob(s[4 * n + x], m_use[x >> 1], scale_log2)
                    s[4 * n + x] = p
                    if x < 2:
                        ps0 += p
                    else:
                        ps1 += p
            l[0] = alpha[0] * l[0] + ps0
            l[1] = alpha[1] * l[1] + ps1
            for n in range(NO // 4):
                o[4 * n] *= alpha[0]
                o[4 * n + 1] *= alpha[0]
                o[4 * n + 2] *= alpha[1]
                o[4 * n + 3] *= alpha[1]
            pack_p(pb, ps, s)  # P's A operand of k-step c: columns t, t + 4 are keys 2t, 2t + 1 (V^T's order)
            products_o(o, scratch_o, scratch_o2, pb, ps, vb, vs)  # O_i += P V_j

        for x in range(2):
            l[x] += ptx.shfl_xor_f32(l[x], 1)
            l[x] += ptx.shfl_xor_f32(l[x], 2)
        for x in range(2):
            i = i0 + 64 * wg + 16 * w + g + 8 * x
            if i < seqlen_q:
                inv_l = float32(0.0)
                if l[x] != 0:  # 1 / l: the approximate reciprocal and one Newton step (a division's slow path is
                    inv_l = ptx.rcp_approx(l[x])  # a called routine, which would serialise the wgmma)
                    inv_l = cuda.fma(inv_l, cuda.fma(-l[x], inv_l, float32(1.0)), inv_l)
                for n in range(NO // 4):
                    out[b, i, h, 8 * n + 2 * t] = o[4 * n + 2 * x] * inv_l
                    out[b, i, h, 8 * n + 2 * t + 1] = o[4 * n + 2 * x + 1] * inv_l
                if t == 0:
                    lse[b, h, i] = float32(m[x] * LN2 + math.log(l[x])) if l[x] != 0 else NEG_INF

    return forward_3xtf32_wgmma
