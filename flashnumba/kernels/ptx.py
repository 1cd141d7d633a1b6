"""Inline PTX for tensor-core kernels: mma.sync, ldmatrix, cp.async and f16/bf16 packing.

Numba exposes no tensor-core instruction, so the instructions a FlashAttention-2 kernel on Ampere and Hopper is
built from (the warp-level matrix multiply ``mma.sync``, the shared-memory fragment load ``ldmatrix`` and the
asynchronous global-to-shared copy ``cp.async``) are written here as Numba intrinsics that emit one inline PTX
instruction each (``numba.cuda.extending.intrinsic`` + ``llvmlite.ir.InlineAsm``). They need sm_80 or newer.

The CUDA simulator cannot run inline PTX, so under the simulator every name below is bound instead to a
pure-Python stand-in that reproduces the instruction: the same arguments, the same per-lane fragment layout, the
same rounding. A kernel calls ``ptx.mma_m16n8k16_f16(...)`` the same way in both modes; which implementation it
gets is chosen once, at import, from ``flashnumba._backend.SIMULATOR``.

| name | PTX | what one lane gives and gets |
| --- | --- | --- |
| ``mma_m16n8k16_f16`` | ``mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32`` | 4 + 2 uint32, 4 float32 -> 4 float32 |
| ``mma_m16n8k16_bf16`` | ``mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32`` | as above, bf16 halves |
| ``ldmatrix_x4`` | ``ldmatrix.sync.aligned.m8n8.x4.shared.b16`` | one row address -> 4 uint32 |
| ``ldmatrix_x4_trans`` | ``ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16`` | one row address -> 4 uint32 |
| ``cp_async_16`` | ``cp.async.cg.shared.global [dst], [src], 16`` | 16 bytes, global -> shared |
| ``cp_async_16_at`` | the same, source ``src[i0, i1, i2, i3]`` by its strides | 16 bytes, any 4-D layout |
| ``cp_async_commit`` | ``cp.async.commit_group`` | closes a group of copies |
| ``cp_async_wait(n)`` | ``cp.async.wait_group n`` (n a compile-time constant) | waits until <= n groups pend |
| ``cp_async_wait_all`` | ``cp.async.wait_all`` | waits for every copy |
| ``pack_f16x2(lo, hi)`` | ``cvt.rn.f16x2.f32`` | 2 float32 -> uint32 (lo in bits 0-15) |
| ``pack_bf16x2(lo, hi)`` | ``cvt.rn.bf16x2.f32`` | 2 float32 -> uint32 (lo in bits 0-15) |
| ``shfl_xor_f32(x, mask)`` | ``shfl.sync.bfly.b32`` (all 32 lanes) | float32 -> lane ``l ^ mask``'s float32 |
| ``mma_m16n8k8_tf32`` | ``mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32`` | 4 + 2 uint32 (tf32), 4 float32 -> 4 |
| ``to_tf32(x)`` | ``cvt.rna.tf32.f32`` | float32 -> uint32: x rounded to tf32 (10 mantissa bits) |
| ``split_tf32(x)`` | two ``cvt.rna.tf32.f32`` | float32 -> (big, small) tf32 with big + small = x to ~2^-22 |
| ``exp2_ftz(x)`` | ``ex2.approx.ftz.f32`` | float32 -> 2^x, results below 2^-126 flushed to 0 |
| ``rcp_approx(x)`` | ``rcp.approx.ftz.f32`` | float32 -> 1 / x within an ulp, with no subroutine |
| ``red_add_f32x2(a, i, x, y)`` | ``red.global.add.v2.f32`` (sm_90) | a[i] += x, a[i + 1] += y, atomically |
| ``st_global_b32(a, i, bits)`` | ``st.global.b32`` | a packed uint32 -> a[i], a[i + 1] (16-bit a) |

Registers. A "packed" uint32 holds two 16-bit values: the element with the smaller column (or row) index in
bits 0-15, the other in bits 16-31, which is how two consecutive 16-bit elements lie in memory.

Addresses. ``ldmatrix_x4`` and ``cp_async_16`` take an array and an element index into it (the element at that
index, in the array's C order, is where the 16 bytes begin). The address must be 16-byte aligned. Numba aligns a
shared array only to its element size, so the index alone does not guarantee it: keep each tile that these
instructions touch at a 16-byte multiple from the start of one shared array, and declare that array first (or
use dynamic shared memory). The stand-ins check the index part (byte offset a multiple of 16).

The stand-ins. Under the simulator every CUDA thread is a Python thread and all threads of a block run at once
(blocks run one after another), so the 32 lanes of a warp can meet: each warp-collective stand-in (mma,
ldmatrix) puts its lane's registers in a slot and waits once on a ``threading.Barrier`` of the warp (or
warpgroup); the last thread to arrive computes the collective's result once, before any thread leaves (an mma's
product, from the function lane 0 passed), and each lane takes its own part. Consecutive collectives alternate
between two sets of slots, so none is overwritten before every lane has read it (``shfl_xor_f32`` likewise). As on
the GPU, all 32 lanes must make the call (a warp whose lanes diverge around it waits until the barrier's timeout
and fails). ``cp_async_16`` reads its 16 source bytes
when issued but writes them only when a ``cp_async_wait``/``cp_async_wait_all`` retires their group, so a
kernel that forgets the wait reads stale shared memory in the simulator, as it may on the GPU. The mma stand-in
adds the exact products in float64 and rounds once to float32; the tensor cores' own summation rounds
differently in the last bits (exact for integer-valued inputs of moderate size).
"""

from __future__ import annotations

import threading

import numpy as np

from .._backend import SIMULATOR

MMA_DOC = """D = A B + C for one 16x8x16 tile, A (16 x 16) and B (16 x 8) in {dtype}, C and D (16 x 8) in float32.

    Warp-collective: all 32 lanes call it; lane ``l`` passes its registers of the fragments, with
    g = l >> 2 (groupID, 0..7) and t = l & 3 (threadID_in_group, 0..3):

      A, row-major 16x16, 4 packed registers a0..a3 (lo half = even column, hi half = odd column):
        a0 = A[g,     2t : 2t+2]          cols  0..7 | cols 8..15
        a1 = A[g + 8, 2t : 2t+2]         +-----------+-----------+
        a2 = A[g,     2t+8 : 2t+10]  rows 0..7  |    a0     |    a2     |
        a3 = A[g + 8, 2t+8 : 2t+10]  rows 8..15 |    a1     |    a3     |

      B, 16x8 (k x n) read column by column ("col"), 2 packed registers b0, b1 (lo half = even row):
        b0 = B[2t : 2t+2,     g]         rows 0..7 of B -> b0, rows 8..15 -> b1
        b1 = B[2t+8 : 2t+10, g]

      C and D, 16x8 float32, 4 registers each:
        c0 = C[g, 2t]    c1 = C[g, 2t+1]    c2 = C[g+8, 2t]    c3 = C[g+8, 2t+1]

    So lane l owns rows g and g+8 of the output, columns 2t and 2t+1. Returns (d0, d1, d2, d3) in C's layout.
    """

MMA_TF32_DOC = """D = A B + C for one 16x8x8 tile, A (16 x 8) and B (8 x 8) in tf32, C and D (16 x 8) in float32.

    TF32 is float32 with 10 mantissa bits (1 + 8 + 10 of its 32; the low 13 bits zero): ``to_tf32`` rounds a
    float32 to it. One element per register, not two: with g = l >> 2 and t = l & 3, lane l passes

      A, row-major 16x8, 4 registers:      B, 8x8 (k x n) read by column, 2 registers:
        a0 = A[g,     t]                     b0 = B[t,     g]
        a1 = A[g + 8, t]                     b1 = B[t + 4, g]
        a2 = A[g,     t + 4]
        a3 = A[g + 8, t + 4]

      C and D as for the 16-bit mma: c0 = C[g, 2t], c1 = C[g, 2t+1], c2 = C[g+8, 2t], c3 = C[g+8, 2t+1].

    A float32 row-major tile in shared memory gives (a0, a1, a2, a3) to ``ldmatrix_x4`` read as 16-bit pairs:
    matrix i is then 8 rows x 4 float32 (16 bytes), and lane (g, t) receives float t of row g, i.e. matrices
    (rows 0-7, cols 0-3), (rows 8-15, cols 0-3), (rows 0-7, cols 4-7), (rows 8-15, cols 4-7). The stand-in
    reads each operand with its low 13 bits cleared; pass ``to_tf32`` (or ``split_tf32``) results, whose low
    bits are zero. 3xTF32 (CUTLASS's float32 emulation): with x = big + small for both operands,
    A B ~ A_big B_big + A_big B_small + A_small B_big, three mma into one accumulator, about float32's accuracy.
    """

LDMATRIX_DOC = """Load four 8x8 matrices of 16-bit elements from shared memory, one fragment register each.

    Warp-collective. Lane l gives the address of one 8-element (16-byte) row, as ``ary`` and the element
    ``index`` of its first element: lanes 0-7 the rows 0..7 of matrix 0, lanes 8-15 those of matrix 1, lanes
    16-23 of matrix 2, lanes 24-31 of matrix 3 (rows may lie anywhere, each 16-byte aligned). With
    g = l >> 2 and t = l & 3, lane l receives r_i from matrix M_i:

      ldmatrix_x4:        r_i = M_i[g, 2t]  (lo) | M_i[g, 2t+1]  (hi)     row g, columns 2t, 2t+1
      ldmatrix_x4_trans:  r_i = M_i[2t, g]  (lo) | M_i[2t+1, g]  (hi)     column g, rows 2t, 2t+1

    E.g. with A (16 x 16, row-major) and lane l pointing at A[l % 16, 8 * (l // 16)], ldmatrix_x4 returns
    exactly the A fragment (a0, a1, a2, a3) of ``mma_m16n8k16_*``; with B (16 x 16, k x n, row-major) and the
    same addressing, ldmatrix_x4_trans returns (b0, b1) of the n-tile B[:, 0:8] and (b0, b1) of B[:, 8:16].
    """


# ---------------------------------------------------------------------------------------------------------------
# Simulator stand-ins
# ---------------------------------------------------------------------------------------------------------------

_WARP = 32
_BARRIER_TIMEOUT_S = 300.0  # the simulator is slow; a lane that never arrives fails the kernel after this


class _Rendezvous:
    """Where the simulated threads of one warp (32) or warpgroup (128) exchange their registers for a collective
    instruction: one barrier a round. The rounds alternate between two sets of slots: a thread that has left round
    n can write round n + 1's slots at once, and round n + 2, which reuses round n's, cannot begin before every
    thread has left round n (each must arrive at round n + 1 first)."""

    def __init__(self, size):
        self.slots = ([None] * size, [None] * size)
        self.combine = [None, None]  # each set's combine (lane 0's) and its result
        self.result = [None, None]
        self.turn = [0] * size  # each thread's next set
        self.rounds = 0  # rounds completed: its parity is the set the round now completing used
        self.barrier = threading.Barrier(size, action=self._complete, timeout=_BARRIER_TIMEOUT_S)

    def _complete(self):
        """Run once a round, by the last thread to arrive, before any leaves: the round's combine."""
        p = self.rounds & 1
        self.rounds += 1
        if self.combine[p] is not None:
            try:
                self.result[p] = (True, self.combine[p](list(self.slots[p])))
            except Exception as e:  # (every lane raises it: none waits for a lane that left)
                self.result[p] = (False, e)

    def exchange(self, lane, value, combine=None):
        """Put this thread's value in, return all the threads' values once every one has put its own; or, with
        ``combine``, what ``combine(values)`` returns, computed once for the whole group (by the last thread to
        arrive), as the hardware computes a collective instruction's result once (a matrix product that every
        lane would otherwise rebuild from every lane's registers). An exception in it is raised in every lane."""
        p = self.turn[lane]
        self.turn[lane] = p ^ 1
        self.slots[p][lane] = value
        if lane == 0:
            self.combine[p] = combine
        self.barrier.wait()  # every thread has written its slot (and the round's combine has run)
        if combine is None:
            return list(self.slots[p])
        ok, result = self.result[p]
        if not ok:
            raise result
        return result


_rendezvous_lock = threading.Lock()


def _group_exchange(value, size, what, combine=None):
    """(rank in the group, values of all ``size`` threads of the group) for the calling simulated CUDA thread,
    the groups being threads size * i .. size * i + size - 1 of its block (a warp, a warpgroup); with
    ``combine``, (rank, combine(values)) computed once for the group (:meth:`_Rendezvous.exchange`)."""
    thread = threading.current_thread()
    mine = thread.__dict__.setdefault("_flashnumba_groups", {})  # (a simulated thread serves one block)
    if size not in mine:
        manager = thread._manager  # the simulator's BlockManager: one per launch, runs the blocks one by one
        tid = thread.thread_id  # threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z)
        nthreads = int(np.prod(manager._block_dim))
        group = tid // size
        if (group + 1) * size > nthreads:
            raise RuntimeError(f"a {what}-collective instruction needs all {size} threads; {what} {group} of a "
                               f"block of {nthreads} threads is partial")
        with _rendezvous_lock:
            groups = manager.__dict__.setdefault("_flashnumba_groups", {})
            key = (tuple(thread.blockIdx), size, group)
            if key not in groups:
                groups[key] = _Rendezvous(size)
            mine[size] = (tid % size, groups[key])
    rank, rendezvous = mine[size]
    return rank, rendezvous.exchange(rank, value, combine)


def _warp_exchange(value, combine=None):
    """(lane, values of all 32 lanes) for the calling simulated CUDA thread (or (lane, combine(values)))."""
    return _group_exchange(value, _WARP, "warp", combine)


def _host_array(ary):
    """The NumPy array behind a simulated kernel's array argument (shared and local arrays already are)."""
    item = getattr(ary, "_item", None)  # a global array inside a simulated kernel
    if item is not None:
        return item._ary
    return np.asarray(ary)


def _bytes_at(ary, index, nbytes):
    """A writable uint8 view of nbytes of ``ary`` starting at element ``index`` (C order)."""
    a = _host_array(ary)
    if not a.flags.c_contiguous:
        raise ValueError("ldmatrix / cp.async addresses must lie in a C-contiguous array")
    start = int(index) * a.itemsize
    if start % 16:
        raise ValueError(f"address of element {index} is {start} bytes into its array, not 16-byte aligned")
    flat = a.reshape(-1).view(np.uint8)
    if start + nbytes > flat.size:
        raise IndexError(f"{nbytes} bytes at element {index} run past the end of an array of {flat.size} bytes")
    return flat[start:start + nbytes]


def _u32(x):
    return int(x) & 0xFFFFFFFF


def _f16_values(bits):
    """float16 bit patterns (uint16, any shape) as float64 values."""
    return np.asarray(bits, np.uint16).view(np.float16).astype(np.float64)


def _bf16_values(bits):
    """bfloat16 bit patterns (uint16, any shape) as float64 values (a bfloat16 is the top half of a float32)."""
    return (np.asarray(bits, np.uint32) << 16).view(np.float32).astype(np.float64)


_LANES = np.arange(_WARP)
_G, _T = _LANES >> 2, _LANES & 3  # each lane's groupID and threadID_in_group (MMA_DOC)


def _sim_mma(values, lane_regs):
    """D (16 x 8, float32) from all lanes' (a0..a3, b0, b1, c0..c3), following the layout in MMA_DOC; ``values``
    turns 16-bit patterns into float64 (:func:`_f16_values`, :func:`_bf16_values`)."""
    regs = np.array([r[:6] for r in lane_regs], np.uint32)  # (lane, a0 a1 a2 a3 b0 b1)
    lo, hi = values(regs & 0xFFFF), values(regs >> 16)  # the lower element of each register, the upper one
    A, B, C = np.empty((16, 16)), np.empty((16, 8)), np.empty((16, 8))
    g, t2 = _G, 2 * _T
    for i, (row, col) in enumerate(((g, t2), (g + 8, t2), (g, t2 + 8), (g + 8, t2 + 8))):  # a0 .. a3
        A[row, col], A[row, col + 1] = lo[:, i], hi[:, i]
    B[t2, g], B[t2 + 1, g], B[t2 + 8, g], B[t2 + 9, g] = lo[:, 4], hi[:, 4], lo[:, 5], hi[:, 5]
    c = np.array([r[6:] for r in lane_regs], np.float64)
    C[g, t2], C[g, t2 + 1], C[g + 8, t2], C[g + 8, t2 + 1] = c[:, 0], c[:, 1], c[:, 2], c[:, 3]
    # products of 16-bit floats are exact in float64, and so are sums of 16 of them in all but extreme cases
    return (A @ B + C).astype(np.float32)


def _lane_fragment(lane, D):
    """Lane ``lane``'s (d0, d1, d2, d3) of an mma's D (16 x 8), as MMA_DOC lays them."""
    g, t = lane >> 2, lane & 3
    return D[g, 2 * t], D[g, 2 * t + 1], D[g + 8, 2 * t], D[g + 8, 2 * t + 1]


def _make_sim_mma(values, dtype):
    def mma(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
        regs = tuple(_u32(r) for r in (a0, a1, a2, a3, b0, b1)) + tuple(float(c) for c in (c0, c1, c2, c3))
        return _lane_fragment(*_warp_exchange(regs, lambda everyone: _sim_mma(values, everyone)))

    mma.__doc__ = MMA_DOC.format(dtype=dtype)
    return mma


def _make_sim_ldmatrix(trans):
    def ldmatrix(ary, index):
        row = _bytes_at(ary, index, 16).view(np.uint16).astype(np.uint32)  # this lane's 8-element row
        lane, rows = _warp_exchange(row)
        g, t = lane >> 2, lane & 3
        regs = []
        for i in range(4):  # matrix i: rows given by lanes 8i .. 8i+7
            M = rows[8 * i:8 * i + 8]
            lo, hi = (M[2 * t][g], M[2 * t + 1][g]) if trans else (M[g][2 * t], M[g][2 * t + 1])
            regs.append(np.uint32(lo | (hi << 16)))
        return tuple(regs)

    ldmatrix.__doc__ = LDMATRIX_DOC
    return ldmatrix


def _thread_state(name, make):
    """What the calling simulated CUDA thread keeps under ``name`` between instructions, made by ``make()`` at its
    first use (the instructions in flight that belong to one thread)."""
    thread = threading.current_thread()
    state = getattr(thread, name, None)
    if state is None:
        state = make()
        setattr(thread, name, state)
    return state


def _cp_async_state():
    """This simulated thread's copies: (issued but not committed, committed groups oldest first)."""
    return _thread_state("_flashnumba_cp_async", lambda: ([], []))


def _sim_cp_async_16(dst, dst_index, src, src_index):
    """Copy 16 bytes from global ``src[src_index:]`` to shared ``dst[dst_index:]`` asynchronously: they are
    guaranteed to have landed only after a cp_async_wait that retires their group."""
    data = _bytes_at(src, src_index, 16).copy()  # the source is read when the copy is issued
    _cp_async_state()[0].append((_bytes_at(dst, dst_index, 16), data))


def _sim_cp_async_16_at(dst, dst_index, src, i0, i1, i2, i3):
    """As cp_async_16, from the 16 bytes that start at element ``src[i0, i1, i2, i3]`` of a 4-D array in any
    layout (its strides give the address: a view such as q of a packed qkv is read in place). The 16 bytes must
    be contiguous and 16-byte aligned in memory: the last dimension contiguous, the other strides multiples of
    16 bytes, the array's start 16-byte aligned (the caller checks these)."""
    a = _host_array(src)
    n = 16 // a.itemsize
    row = a[int(i0), int(i1), int(i2)]
    if a.strides[3] != a.itemsize or int(i3) + n > row.shape[0]:
        raise ValueError("cp_async_16_at: the 16 bytes must lie in the contiguous last dimension")
    data = np.ascontiguousarray(row[int(i3):int(i3) + n]).view(np.uint8).copy()
    _cp_async_state()[0].append((_bytes_at(dst, dst_index, 16), data))


def _sim_cp_async_commit():
    """Close the group of cp_async_16 copies issued by this thread since the last commit."""
    pending, groups = _cp_async_state()
    groups.append(list(pending))
    pending.clear()


def _sim_cp_async_wait(n):
    """Wait until at most ``n`` of this thread's committed groups are still in flight (n: a constant)."""
    groups = _cp_async_state()[1]
    while len(groups) > n:
        for target, data in groups.pop(0):
            target[:] = data


def _sim_cp_async_wait_all():
    """Wait for every copy this thread issued, committed or not."""
    _sim_cp_async_commit()
    _sim_cp_async_wait(0)


_red_lock = threading.Lock()


def _sim_red_add_f32x2(ary, index, x, y):
    """Atomically add x to the float32 ``ary.flat[index]`` and y to ``ary.flat[index + 1]`` (C order; index
    even: the two floats are one 8-byte aligned vector). One instruction for the two float32 sums of a lane's C
    fragment pair, where two atomic adds would each touch the same 32-byte sector (Hopper's vector reduction;
    sm_90 and newer)."""
    a = _host_array(ary)
    if a.dtype != np.float32 or not a.flags.c_contiguous:
        raise ValueError("red_add_f32x2: a C-contiguous float32 array")
    if int(index) % 2:
        raise ValueError(f"red_add_f32x2: element {index} is not 8-byte aligned")
    flat = a.reshape(-1)
    with _red_lock:
        flat[int(index)] += np.float32(x)
        flat[int(index) + 1] += np.float32(y)


def _sim_st_global_b32(ary, index, bits):
    """Store the packed uint32 ``bits`` into the 16-bit elements ``ary.flat[index]`` (bits 0-15) and
    ``ary.flat[index + 1]`` (bits 16-31) of a C-contiguous array (index even: the pair is one 4-byte aligned word):
    one store for two neighbouring outputs of a lane's fragment, packed as the products' operands are."""
    a = _host_array(ary)
    if a.itemsize != 2 or not a.flags.c_contiguous:
        raise ValueError("st_global_b32: a C-contiguous array of 16-bit elements")
    if int(index) % 2:
        raise ValueError(f"st_global_b32: element {index} is not 4-byte aligned")
    flat = a.reshape(-1).view(np.uint16)
    flat[int(index)] = int(bits) & 0xFFFF
    flat[int(index) + 1] = (int(bits) >> 16) & 0xFFFF


def _sim_pack_f16x2(lo, hi):
    """uint32 holding float16(lo) in bits 0-15 and float16(hi) in bits 16-31, rounded to nearest even."""
    x = np.array([lo, hi], np.float32)
    with np.errstate(over="ignore"):  # beyond 65520 rounds to inf, as on the GPU
        bits = x.astype(np.float16).view(np.uint16).astype(np.uint32)
    bits[np.isnan(x)] = 0x7FFF  # NaN becomes the canonical NaN
    return np.uint32(bits[0] | (bits[1] << 16))


def _sim_shfl_xor_f32(x, lane_mask):
    """The float32 ``x`` of lane ``l ^ lane_mask``, for lane l (a butterfly exchange; all 32 lanes call it).
    With lane_mask 1 then 2, the four lanes of a quad (the lanes sharing g = l >> 2 of an mma fragment) each
    see the other three: how a row's statistic, spread over the quad, is combined."""
    lane, values = _warp_exchange(np.float32(x))
    return values[lane ^ int(lane_mask)]


def _sim_rcp_approx(x):
    """1 / x in float32 as ``rcp.approx.ftz.f32``: one instruction of the special-function unit, within an ulp
    (here rounded exactly). A float32 division ``1 / x`` compiles to ``rcp.rn.f32``, whose slow path for
    subnormals is a subroutine call, and the assembler serialises the wgmma of a kernel that makes any call: the
    Hopper kernels' 1 / l takes this one (l >= 1 there: no subnormal to lose)."""
    with np.errstate(divide="ignore"):
        return np.float32(np.float32(1.0) / np.float32(x))


def _sim_exp2_ftz(x):
    """2**x in float32 as ``ex2.approx.ftz.f32``: one instruction of the special-function unit (relative error
    about 2^-22), -inf -> 0, and a result below 2^-126 (a subnormal) flushed to 0. ``math.exp2`` compiles to the
    same instruction without ``.ftz``, wrapped in three more that keep subnormal results; a softmax weight below
    2^-126 next to the row's maximum (weight 1) changes no sum, so the kernels' exponentials use this one."""
    with np.errstate(over="ignore"):  # beyond 128 gives inf, as on the GPU
        r = np.float32(np.exp2(np.float32(x)))
    return np.float32(0.0) if r < np.float32(2.0 ** -126) else r


def _tf32_bits(x):
    """tf32 bits (in a uint32) of float32 x, rounded to nearest, ties away from zero, as cvt.rna.tf32.f32: add
    half of the lowest kept bit to the magnitude and clear the 13 bits below it."""
    u = int(np.array(x, np.float32).view(np.uint32))
    if (u & 0x7FFFFFFF) > 0x7F800000:
        return 0x7FFFFFFF  # NaN stays a NaN
    return ((u + 0x1000) & 0xFFFFE000) & 0xFFFFFFFF  # a carry out of the mantissa raises the exponent (to inf)


def _bits_value(bits):
    return float(np.uint32(bits).view(np.float32))


def _sim_to_tf32(x):
    """uint32 holding float32 ``x`` rounded to tf32 (nearest, ties away from zero; the low 13 bits zero)."""
    return np.uint32(_tf32_bits(x))


def _sim_split_tf32(x):
    """(big, small): big = to_tf32(x), small = to_tf32(x - big) (the difference is exact in float32)."""
    big = _tf32_bits(x)
    with np.errstate(invalid="ignore"):  # inf - inf is NaN, as on the GPU
        rest = np.float32(np.float32(x) - np.float32(_bits_value(big)))
    return np.uint32(big), np.uint32(_tf32_bits(rest))


def _sim_mma_tf32(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
    regs = tuple(_u32(r) for r in (a0, a1, a2, a3, b0, b1)) + tuple(float(c) for c in (c0, c1, c2, c3))
    return _lane_fragment(*_warp_exchange(regs, _tf32_product))


def _tf32_product(everyone):
    """D (16 x 8, float32) of m16n8k8 TF32 from all lanes' (a0..a3, b0, b1, c0..c3), as MMA_TF32_DOC lays them."""
    A = np.empty((16, 8))
    B = np.empty((8, 8))
    C = np.empty((16, 8))
    value = lambda r: _bits_value(r & 0xFFFFE000)  # noqa: E731  (the hardware reads the top 19 bits)
    for ln, (ra0, ra1, ra2, ra3, rb0, rb1, rc0, rc1, rc2, rc3) in enumerate(everyone):
        g, t = ln >> 2, ln & 3
        A[g, t], A[g + 8, t], A[g, t + 4], A[g + 8, t + 4] = (value(r) for r in (ra0, ra1, ra2, ra3))
        B[t, g], B[t + 4, g] = value(rb0), value(rb1)
        C[g, 2 * t], C[g, 2 * t + 1], C[g + 8, 2 * t], C[g + 8, 2 * t + 1] = rc0, rc1, rc2, rc3
    return (A @ B + C).astype(np.float32)  # products of tf32 values are exact in float64


_sim_mma_tf32.__doc__ = MMA_TF32_DOC


def _bf16_bits(x):
    """bfloat16 bits of float32 x, rounded to nearest even: add 0x7FFF plus the lowest kept bit, truncate."""
    u = int(np.array(x, np.float32).view(np.uint32))
    if (u & 0x7FFFFFFF) > 0x7F800000:
        return 0x7FFF  # NaN becomes the canonical NaN
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) & 0xFFFF  # overflow of the 32 bits cannot happen below NaN


def _sim_pack_bf16x2(lo, hi):
    """uint32 holding bfloat16(lo) in bits 0-15 and bfloat16(hi) in bits 16-31, rounded to nearest even."""
    return np.uint32(_bf16_bits(lo) | (_bf16_bits(hi) << 16))


# ---------------------------------------------------------------------------------------------------------------
# The GPU: one inline PTX instruction per intrinsic
# ---------------------------------------------------------------------------------------------------------------

def _codegen():
    """The pieces every inline-PTX intrinsic is built from (only with the real numba.cuda): ``asm`` (one inline
    PTX statement), ``address`` (the generic address of ary.flat[idx]), ``shared_address`` (its 32-bit shared
    window address), ``check_address`` (typing: a C-contiguous array and an integer index) and ``statement`` (an
    intrinsic of one operand-less PTX statement; ``literal_statement`` of one with a compile-time integer)."""
    from llvmlite import ir
    from numba import types
    from numba.core.errors import TypingError

    i32, i64 = ir.IntType(32), ir.IntType(64)

    def asm(builder, ret, args, text, constraints, side_effect):
        fnty = ir.FunctionType(ret, [a.type for a in args])
        return builder.call(ir.InlineAsm(fnty, text, constraints, side_effect=side_effect), args)

    def address(context, builder, aryty, ary, idxty, idx):
        """Generic 64-bit address of ary.flat[idx] (Numba's array data pointer is a generic pointer)."""
        data = context.make_array(aryty)(context, builder, ary).data
        ptr = builder.gep(data, [context.cast(builder, idx, idxty, types.intp)])
        return builder.ptrtoint(ptr, i64)

    def shared_address(context, builder, aryty, ary, idxty, idx):
        """32-bit shared-window address of ary.flat[idx], ary a shared array: the generic pointer Numba holds is
        cast back to the shared address space, so that the compiler sees the same base in every tile operation
        and folds each constant offset into the instruction (``LDSM [R+imm]``) instead of computing a 64-bit
        generic address per call and converting it (``cvta.to.shared``)."""
        data = context.make_array(aryty)(context, builder, ary).data
        ptr = builder.gep(data, [context.cast(builder, idx, idxty, types.intp)])
        shared = builder.addrspacecast(ptr, ir.PointerType(ptr.type.pointee, 3))
        return builder.ptrtoint(shared, i32)

    def check_address(aryty, idxty, what):
        if not isinstance(aryty, types.Array) or not isinstance(idxty, types.Integer):
            raise TypingError(f"{what}: expected (array, integer element index), got ({aryty}, {idxty})")
        if aryty.layout != "C":  # the address is data + index: only right for a C-contiguous array
            raise TypingError(f"{what}: the array must be C-contiguous (layout 'C'), got layout {aryty.layout!r}")

    def statement(name, text):
        """An intrinsic of no operand: the one PTX statement ``text``, ordered with memory accesses."""
        from numba.cuda.extending import intrinsic

        def stmt(typingctx):
            def codegen(context, builder, sig, args):
                asm(builder, ir.VoidType(), [], text, "~{memory}", side_effect=True)
                return context.get_dummy_value()

            return types.none(), codegen

        stmt.__name__ = name
        return intrinsic(stmt)

    def literal_statement(name, template):
        """An intrinsic of one compile-time integer n: the PTX statement ``template.format(n=n)``."""
        from numba.cuda.extending import intrinsic

        def stmt(typingctx, n):
            if not isinstance(n, types.IntegerLiteral):
                raise TypingError(f"{name}(n): n must be a compile-time integer constant")
            text = template.format(n=n.literal_value)

            def codegen(context, builder, sig, args):
                asm(builder, ir.VoidType(), [], text, "~{memory}", side_effect=True)
                return context.get_dummy_value()

            return types.none(n), codegen

        stmt.__name__ = name
        return intrinsic(stmt)

    return asm, address, shared_address, check_address, statement, literal_statement


def _gpu_intrinsics():
    """Build the intrinsics (only with the real numba.cuda: the simulator has no code generator)."""
    from llvmlite import ir
    from numba import types
    from numba.core import cgutils
    from numba.core.errors import TypingError
    from numba.cuda.extending import intrinsic

    i32, i64, f32 = ir.IntType(32), ir.IntType(64), ir.FloatType()
    asm, address, shared_address, check_address, statement, literal_statement = _codegen()

    # cp.async of 16 bytes: $0 the 32-bit shared address, $1 the generic address of the source
    CP_ASYNC = ("{ .reg .u64 src_addr; cvta.to.global.u64 src_addr, $1; "
                "cp.async.cg.shared.global [$0], [src_addr], 16; }")

    def make_mma(kind):
        text = (f"mma.sync.aligned.m16n8k16.row.col.f32.{kind}.{kind}.f32 "
                "{$0, $1, $2, $3}, {$4, $5, $6, $7}, {$8, $9}, {$10, $11, $12, $13};")

        def mma(typingctx, a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
            sig = types.UniTuple(types.float32, 4)(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3)

            def codegen(context, builder, sig, args):
                regs = [context.cast(builder, v, ty, types.uint32) for v, ty in zip(args[:6], sig.args[:6])]
                accs = [context.cast(builder, v, ty, types.float32) for v, ty in zip(args[6:], sig.args[6:])]
                d = asm(builder, ir.LiteralStructType([f32] * 4), regs + accs, text,
                        # side_effect: a warp-collective instruction must not be moved into a branch where
                        # only some lanes would run it (as CUTLASS marks its mma asm volatile)
                        "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f", side_effect=True)
                return context.make_tuple(builder, sig.return_type, [builder.extract_value(d, i) for i in range(4)])

            return sig, codegen

        mma.__name__ = f"mma_m16n8k16_{kind}"
        return intrinsic(mma)

    def make_ldmatrix(trans):
        qualifier = ".trans" if trans else ""
        # ldmatrix wants a shared-window address: convert the generic one
        text = f"ldmatrix.sync.aligned.m8n8.x4{qualifier}.shared.b16 {{$0, $1, $2, $3}}, [$4];"

        def ldmatrix(typingctx, ary, index):
            check_address(ary, index, "ldmatrix")
            sig = types.UniTuple(types.uint32, 4)(ary, index)

            def codegen(context, builder, sig, args):
                addr = shared_address(context, builder, sig.args[0], args[0], sig.args[1], args[1])
                r = asm(builder, ir.LiteralStructType([i32] * 4), [addr], text, "=r,=r,=r,=r,r,~{memory}",
                        side_effect=True)
                return context.make_tuple(builder, sig.return_type, [builder.extract_value(r, i) for i in range(4)])

            return sig, codegen

        ldmatrix.__name__ = "ldmatrix_x4_trans" if trans else "ldmatrix_x4"
        return intrinsic(ldmatrix)

    @intrinsic
    def cp_async_16(typingctx, dst, dst_index, src, src_index):
        check_address(dst, dst_index, "cp_async_16 destination")
        check_address(src, src_index, "cp_async_16 source")
        sig = types.none(dst, dst_index, src, src_index)

        def codegen(context, builder, sig, args):
            d = shared_address(context, builder, sig.args[0], args[0], sig.args[1], args[1])
            s = address(context, builder, sig.args[2], args[2], sig.args[3], args[3])
            asm(builder, ir.VoidType(), [d, s], CP_ASYNC, "r,l,~{memory}", side_effect=True)
            return context.get_dummy_value()

        return sig, codegen

    @intrinsic
    def cp_async_16_at(typingctx, dst, dst_index, src, i0, i1, i2, i3):
        check_address(dst, dst_index, "cp_async_16_at destination")
        if not isinstance(src, types.Array) or src.ndim != 4:
            raise TypingError(f"cp_async_16_at source: expected a 4-D array, got {src}")
        if not all(isinstance(t, types.Integer) for t in (i0, i1, i2, i3)):
            raise TypingError("cp_async_16_at: the source indices must be integers")
        sig = types.none(dst, dst_index, src, i0, i1, i2, i3)

        def codegen(context, builder, sig, args):
            d = shared_address(context, builder, sig.args[0], args[0], sig.args[1], args[1])
            ary = context.make_array(sig.args[2])(context, builder, args[2])
            s = builder.ptrtoint(ary.data, i64)
            for idx, ty, stride in zip(args[3:], sig.args[3:], cgutils.unpack_tuple(builder, ary.strides, 4)):
                s = builder.add(s, builder.mul(context.cast(builder, idx, ty, types.intp), stride))
            asm(builder, ir.VoidType(), [d, s], CP_ASYNC, "r,l,~{memory}", side_effect=True)
            return context.get_dummy_value()

        return sig, codegen

    cp_async_wait = literal_statement("cp_async_wait", "cp.async.wait_group {n};")

    def make_pack(kind):
        text = f"cvt.rn.{kind}x2.f32 $0, $1, $2;"  # the first source goes to the upper half

        def pack(typingctx, lo, hi):
            sig = types.uint32(lo, hi)

            def codegen(context, builder, sig, args):
                lo_, hi_ = (context.cast(builder, v, ty, types.float32) for v, ty in zip(args, sig.args))
                return asm(builder, i32, [hi_, lo_], text, "=r,f,f", side_effect=False)

            return sig, codegen

        pack.__name__ = f"pack_{kind}x2"
        return intrinsic(pack)

    @intrinsic
    def mma_m16n8k8_tf32(typingctx, a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
        text = ("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 "
                "{$0, $1, $2, $3}, {$4, $5, $6, $7}, {$8, $9}, {$10, $11, $12, $13};")
        sig = types.UniTuple(types.float32, 4)(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3)

        def codegen(context, builder, sig, args):
            regs = [context.cast(builder, v, ty, types.uint32) for v, ty in zip(args[:6], sig.args[:6])]
            accs = [context.cast(builder, v, ty, types.float32) for v, ty in zip(args[6:], sig.args[6:])]
            d = asm(builder, ir.LiteralStructType([f32] * 4), regs + accs, text,
                    "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f", side_effect=True)  # side effect: as the 16-bit mma
            return context.make_tuple(builder, sig.return_type, [builder.extract_value(d, i) for i in range(4)])

        return sig, codegen

    def make_unary(name, text, result):
        """An intrinsic of one float32 operand and one instruction ``text`` ($0 the result, $1 the operand),
        returning uint32 (``result`` "r") or float32 ("f")."""
        ret, ty = (i32, types.uint32) if result == "r" else (f32, types.float32)

        def unary(typingctx, x):
            sig = ty(x)

            def codegen(context, builder, sig, args):
                v = context.cast(builder, args[0], sig.args[0], types.float32)
                return asm(builder, ret, [v], text, f"={result},f", side_effect=False)

            return sig, codegen

        unary.__name__ = name
        return intrinsic(unary)

    to_tf32 = make_unary("to_tf32", "cvt.rna.tf32.f32 $0, $1;", "r")
    exp2_ftz = make_unary("exp2_ftz", "ex2.approx.ftz.f32 $0, $1;", "f")
    rcp_approx = make_unary("rcp_approx", "rcp.approx.ftz.f32 $0, $1;", "f")

    @intrinsic
    def split_tf32(typingctx, x):
        sig = types.UniTuple(types.uint32, 2)(x)
        text = ("{ .reg .b32 big; .reg .f32 fbig, rest; cvt.rna.tf32.f32 big, $2; mov.b32 fbig, big; "
                "sub.f32 rest, $2, fbig; cvt.rna.tf32.f32 $1, rest; mov.b32 $0, big; }")

        def codegen(context, builder, sig, args):
            v = context.cast(builder, args[0], sig.args[0], types.float32)
            r = asm(builder, ir.LiteralStructType([i32, i32]), [v], text, "=r,=r,f", side_effect=False)
            return context.make_tuple(builder, sig.return_type, [builder.extract_value(r, i) for i in range(2)])

        return sig, codegen

    @intrinsic
    def red_add_f32x2(typingctx, ary, index, x, y):
        check_address(ary, index, "red_add_f32x2")
        sig = types.none(ary, index, x, y)

        def codegen(context, builder, sig, args):
            a = address(context, builder, sig.args[0], args[0], sig.args[1], args[1])
            v = [context.cast(builder, w, ty, types.float32) for w, ty in zip(args[2:], sig.args[2:])]
            asm(builder, ir.VoidType(), [a] + v, "{ .reg .u64 g; cvta.to.global.u64 g, $0; "
                "red.global.add.v2.f32 [g], {$1, $2}; }", "l,f,f,~{memory}", side_effect=True)
            return context.get_dummy_value()

        return sig, codegen

    @intrinsic
    def st_global_b32(typingctx, ary, index, bits):
        check_address(ary, index, "st_global_b32")
        sig = types.none(ary, index, bits)

        def codegen(context, builder, sig, args):
            a = address(context, builder, sig.args[0], args[0], sig.args[1], args[1])
            v = context.cast(builder, args[2], sig.args[2], types.uint32)
            asm(builder, ir.VoidType(), [a, v], "{ .reg .u64 g; cvta.to.global.u64 g, $0; st.global.b32 [g], $1; }",
                "l,r,~{memory}", side_effect=True)
            return context.get_dummy_value()

        return sig, codegen

    @intrinsic
    def shfl_xor_f32(typingctx, x, lane_mask):
        sig = types.float32(x, lane_mask)

        def codegen(context, builder, sig, args):
            v = context.cast(builder, args[0], sig.args[0], types.float32)
            m = context.cast(builder, args[1], sig.args[1], types.uint32)
            # side_effect: warp-collective, like mma; c = 0x1f (the whole warp is one segment), all lanes take part
            return asm(builder, f32, [v, m], "shfl.sync.bfly.b32 $0, $1, $2, 0x1f, 0xffffffff;", "=f,f,r",
                       side_effect=True)

        return sig, codegen

    found = dict(
        shfl_xor_f32=shfl_xor_f32, exp2_ftz=exp2_ftz, rcp_approx=rcp_approx,
        mma_m16n8k8_tf32=mma_m16n8k8_tf32, to_tf32=to_tf32, split_tf32=split_tf32,
        mma_m16n8k16_f16=make_mma("f16"), mma_m16n8k16_bf16=make_mma("bf16"),
        ldmatrix_x4=make_ldmatrix(False), ldmatrix_x4_trans=make_ldmatrix(True),
        cp_async_16=cp_async_16, cp_async_16_at=cp_async_16_at,
        cp_async_commit=statement("cp_async_commit", "cp.async.commit_group;"),
        cp_async_wait=cp_async_wait, cp_async_wait_all=statement("cp_async_wait_all", "cp.async.wait_all;"),
        pack_f16x2=make_pack("f16"), pack_bf16x2=make_pack("bf16"), red_add_f32x2=red_add_f32x2,
        st_global_b32=st_global_b32,
    )
    # each intrinsic carries the docstring of its stand-in, which states the semantics and the layout
    stand_ins = _simulator_stand_ins()
    for name, fn in found.items():
        fn.__doc__ = stand_ins[name].__doc__
    return found


def _simulator_stand_ins():
    return dict(
        mma_m16n8k16_f16=_make_sim_mma(_f16_values, "float16"),
        mma_m16n8k16_bf16=_make_sim_mma(_bf16_values, "bfloat16"),
        ldmatrix_x4=_make_sim_ldmatrix(trans=False), ldmatrix_x4_trans=_make_sim_ldmatrix(trans=True),
        cp_async_16=_sim_cp_async_16, cp_async_16_at=_sim_cp_async_16_at, cp_async_commit=_sim_cp_async_commit,
        cp_async_wait=_sim_cp_async_wait,
        cp_async_wait_all=_sim_cp_async_wait_all, pack_f16x2=_sim_pack_f16x2, pack_bf16x2=_sim_pack_bf16x2,
        shfl_xor_f32=_sim_shfl_xor_f32, exp2_ftz=_sim_exp2_ftz, rcp_approx=_sim_rcp_approx,
        mma_m16n8k8_tf32=_sim_mma_tf32, to_tf32=_sim_to_tf32,
        split_tf32=_sim_split_tf32, red_add_f32x2=_sim_red_add_f32x2, st_global_b32=_sim_st_global_b32,
    )


if SIMULATOR:
    globals().update(_simulator_stand_ins())
else:
    globals().update(_gpu_intrinsics())

__all__ = ["mma_m16n8k16_f16", "mma_m16n8k16_bf16", "ldmatrix_x4", "ldmatrix_x4_trans", "cp_async_16",
           "cp_async_16_at", "cp_async_commit", "cp_async_wait", "cp_async_wait_all", "pack_f16x2", "pack_bf16x2",
           "shfl_xor_f32", "exp2_ftz", "rcp_approx",
           "mma_m16n8k8_tf32", "to_tf32", "split_tf32", "red_add_f32x2", "st_global_b32"]
