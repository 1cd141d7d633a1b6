"""Hopper's warpgroup matrix multiply (``wgmma``) as inline PTX, with simulator stand-ins.

On Hopper (sm_90a) a *warpgroup*, four consecutive warps of a block (threads 128 i .. 128 i + 127), multiplies a
64 x 16 tile of A by the transpose of an N x 16 tile of B (D = A B^T, 64 x N, K = 16) in one asynchronous
instruction that reads
both operands straight from shared memory, where ``mma.sync`` (:mod:`.ptx`) needs each warp to load its fragments
into registers first. The operands are named by 64-bit *matrix descriptors*; the instruction is issued, the
warpgroup goes on, and its results are in the accumulator registers only after a wait:

    wgmma_fence(acc)                 wgmma.fence.sync.aligned        before the first wgmma that touches acc
    wgmma(acc, desc_a, desc_b, s)    wgmma.mma_async ... m64nNk16    acc = A B^T (+ acc where s != 0), issued
    wgmma_commit()                   wgmma.commit_group.sync.aligned the wgmma issued since the last commit: a group
    wgmma_wait(n, acc)               wgmma.wait_group.sync.aligned n until at most n groups are in flight

Several wgmma on one accumulator may be issued back to back (a K loop): each reads the accumulator the one
before wrote. Between the issue and the wait that retires its group, the accumulator must not be read or written
and the shared memory it reads must not be written. Shared memory written by ordinary stores must be made visible
to the instruction's ("async proxy") reads with ``fence_proxy_async()`` and then a barrier.

| name | PTX | |
| --- | --- | --- |
| ``smem_address(ary, i)`` | ``cvta`` of ary.flat[i] to the shared window | uint32 byte address |
| ``make_desc(addr, lbo, sbo)`` | (arithmetic; ``desc_bits`` on the host) | uint64 matrix descriptor, no swizzle |
| ``make_desc_swizzled(addr, lbo, sbo, mode)`` | (arithmetic; ``desc_bits_swizzled``) | of a swizzled operand |
| ``fence_proxy_async()`` | ``fence.proxy.async.shared::cta`` | stores before it seen by wgmma after a barrier |
| ``wgmma_ops(kind, N, regs_a, trans_b)`` | ``wgmma.*`` for m64nNk16, f32 += kind x kind | (mma, fence, wait) |
| ``wgmma_commit()`` | ``wgmma.commit_group.sync.aligned`` | |
| ``mbarrier_init(bar, n)`` | ``mbarrier.init.shared::cta.b64`` | 8 bytes of shared memory become a barrier |
| ``mbarrier_arrive(bar)`` | ``mbarrier.arrive.shared::cta.b64`` | one arrival |
| ``mbarrier_arrive_expect_tx(bar, b)`` | ``mbarrier.arrive.expect_tx.shared::cta.b64`` | and b bytes to come |
| ``mbarrier_try_wait(bar, parity)`` | ``mbarrier.try_wait.parity.shared::cta.b64`` | 1 once that phase is done |
| ``cp_async_bulk(dst, src, i, b, bar)`` | ``cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes`` | |
| ``tma_load_4d(dst, maps, i, c0, c1, c2, c3, bar)`` | ``cp.async.bulk.tensor.4d...complete_tx::bytes`` | a box |
| ``fence_tensormap(maps, i)`` | ``fence.proxy.tensormap::generic.acquire.sys`` | a map written by the host, seen |
| ``fence_mbarrier_init()`` | ``fence.mbarrier_init.release.cluster`` | initialised mbarriers seen by copies |
| ``cp_async_mbarrier_arrive(bar)`` | ``cp.async.mbarrier.arrive.noinc.shared::cta.b64`` | arrive once cp.async landed |
| ``named_barrier_sync(id, n)`` | ``bar.sync id, n`` | barrier ``id`` (1 .. 15) of ``n`` threads: arrive and wait |
| ``named_barrier_arrive(id, n)`` | ``bar.arrive id, n`` | arrive without waiting |
| ``elect_one()`` | ``elect.sync`` | uint32: 1 in one lane of the warp |
| ``setmaxnreg_inc(n)``, ``_dec(n)`` | ``setmaxnreg.{inc,dec}.sync.aligned.u32 n`` | a warpgroup's register budget |

**The pipeline's synchronisation.** A Hopper kernel's producer fills shared memory with bulk copies (one thread
issues them) and its consumers wait for them on an *mbarrier*: 8 bytes of shared memory counting the arrivals a
phase expects and the bytes of copies it waits for. A phase completes when every arrival and every byte is in;
the next phase then begins, and waiters name the phase they wait for by its parity (0, 1, 0, ...), as
``while mbarrier_try_wait(bar, phase & 1) == 0: pass``.

**The descriptor** (bits of the uint64): 0-13 the operand's shared address >> 4; 16-29 the *leading* byte
offset >> 4; 32-45 the *stride* byte offset >> 4; 49-51 a base offset (0 here); 62-63 the swizzle mode (0: none,
1: 128-byte, 2: 64-byte, 3: 32-byte). Without swizzle an operand is read as *core matrices* of 8 rows of 16
bytes (8 x 8 16-bit elements), each 128 contiguous bytes, row after row. Both operands here are K-major (the K
index runs along a row: A row-major 64 x 16, B stored N x 16, as Q and K are in attention), and element (r, k)
of the operand lies at::

    start + (r // 8) * SBO + (k // 8) * LBO + (r % 8) * 16 + (k % 8) * 2        bytes

so LBO steps to the next 8 columns of K (the second core matrix of a row of them) and SBO to the next 8 rows
(M for A, N for B). Packed densely, a 64 x 16 A tile has LBO = 128 and SBO = 256.

B may also be *MN-major* (``trans_b``: the instruction's imm-trans-b 1), as V is in O += P V: there B's rows
(N, the head dim) run along memory and its K (the keys) across, so each 16 bytes hold 8 consecutive rows of one
column of K, and element (r, k) lies at::

    start + (r // 8) * SBO + (k // 8) * LBO + (k % 8) * 16 + (r % 8) * 2        bytes

(LBO still steps K by 8 and SBO the rows by 8). A tile of keys x head dim stored as core matrices of 8 keys x 8
head dims, 128 bytes each, serves both products: read K-major it is K_j for S = Q K_j^T, read MN-major V_j for
P V_j, with LBO and SBO exchanged.

**The swizzled layouts** (``make_desc_swizzled``), those a tensor-map copy writes (below). With the 128-byte
swizzle a tile is rows of 64 16-bit elements (128 bytes a row), row after row, in which the 16-byte chunk c of row
r is stored at chunk c ^ (r % 8); the 64- and 32-byte swizzles are the same with rows of 32 and 16 elements and
chunk c at c ^ ((r // 2) % 4), c ^ ((r // 4) % 2). The hardware applies the exchange to the shared address itself
(bits 4 and up of the byte address XOR as many bits from bit 7: :func:`swizzle`), so a tile starts on 1024 bytes
for the row within the pattern to be the row within the tile. With S bytes a row (E = S / 2 elements), K-major
(Q_i, K_j; E head dims a row), element (r, k) lies at the swizzle of::

    start + (r // 8) * SBO + (r % 8) * S + k * 2                    SBO = 8 S, LBO unused (16)

and the next 16 of K are 32 bytes further along the row, or at the start of the next tile of rows (``rows`` x S
bytes on) once a row's E are used (a tile of D head dims is D / E such tiles). MN-major (V_j: a row is E head dims
of one key, the N of P V), element (n, k) lies at::

    start + (n % E) * 2 + (n // E) * LBO + (k % 8) * S + (k // 8) * SBO      SBO = 8 S, LBO = the next E head dims

so 16 keys are 16 S bytes on. Each row of 8 x 16 bytes a warp's tensor cores read spreads over the 32 banks.

**Tensor-map copies (TMA).** ``tma_load_4d`` has the SM's copy engine fetch a whole *box* of a 4-D tensor (one
thread issues it; no thread computes an address per 16 bytes, and nothing passes through L1) into shared memory,
counted on an mbarrier like ``cp_async_bulk``. The tensor is named by a 128-byte *tensor map* the host encodes
(``cuTensorMapEncodeTiled``: the base address, the dims innermost first, the byte strides, the box, the swizzle)
and writes to global memory; a thread makes the host's write visible to the copy engine (``fence_tensormap``)
before its first copy with it (``fence.proxy.tensormap`` needs PTX ISA 8.3: CUDA 12.3's compilers or later).
Coordinates are elements, innermost first; a box reaching past a dim reads zeros
there, and its bytes still count. With a swizzle the box's inner dim is a row's E elements (at most S bytes) and the
box lands as the swizzled rows above.

**A from registers** (``regs_a``), as P is in O += P V: thread (warp w, lane with g = lane >> 2, t = lane & 3)
holds four uint32 of two 16-bit elements each (the lower half first), in ``mma.sync``'s A layout::

    a0 = A[16w + g, 2t : 2t + 2]        a1 = A[16w + g + 8, 2t : 2t + 2]
    a2 = A[16w + g, 2t + 8 : 2t + 10]   a3 = A[16w + g + 8, 2t + 8 : 2t + 10]

the same places the accumulator below holds D's columns 2t, 2t + 1 of two adjacent 8-column tiles: so S's
accumulator, exponentiated and packed in pairs, is P's A operand with no data moved between threads.

**The accumulator** (float32, N / 2 registers a thread, ``acc`` a local array of that length): warp w of the
warpgroup holds rows 16 w .. 16 w + 15 of D (64 x N), in the layout of ``mma.sync``'s C fragment repeated along
N; with g = lane >> 2 and t = lane & 3, registers 4 j .. 4 j + 3 hold::

    acc[4j] = D[16w + g, 8j + 2t]        acc[4j + 1] = D[16w + g, 8j + 2t + 1]
    acc[4j + 2] = D[16w + g + 8, 8j + 2t]    acc[4j + 3] = D[16w + g + 8, 8j + 2t + 1]

**TF32 operands** (kind ``"tf32"``, float32 in shared memory or registers): one wgmma is m64nNk8, still 32 bytes
of K a row, so a core matrix is 8 rows of 4 float32 and element (r, k) of a K-major operand lies at::

    start + (r // 8) * SBO + (k // 4) * LBO + (r % 8) * 16 + (k % 4) * 4        bytes

Both operands are K-major (the instruction has no transpose for 32-bit types: for O += P V, V_j transposed in
shared memory). From registers, thread (w, g, t) holds one float32 a register, a_i = A[16w + g + 8 (i & 1),
t + 4 (i >> 1)]: columns t and t + 4 where the accumulator holds 2t and 2t + 1, so a P taken from S's accumulator
needs the keys of V_j in the order 0, 2, 4, 6, 1, 3, 5, 7 of each 8. The tensor cores drop the lower 13 bits of
each float32's mantissa (truncation; ``cvt.rna.tf32.f32`` first rounds to nearest).

**The stand-ins.** Under the simulator a wgmma records itself and fills the accumulator with NaN (reading it
before the wait reads garbage on the GPU); ``wgmma_wait`` retires the groups as the hardware does: the 128
threads meet at a barrier, exchange their accumulators and descriptors, the retired products are computed once
for the warpgroup, in order, from the shared memory as it is *at the wait* (float64 products, rounded once to
float32), each thread checks that the operands it saw at its issue are those bit for bit (else a barrier is
missing), and keeps its own fragment. ``smem_address`` gives each shared array of a block an address of its own
(1 KB aligned, below the 256 KB that the descriptor's 14 bits reach) and the descriptor's address is looked up
among them.
``fence_proxy_async`` does nothing there (the simulator has one view of memory). A tensor map there is the
stand-in :func:`sim_tensor_map` makes (its tensor kept by the process), and a copy lands, swizzled, with its
barrier's phase. The instructions need sm_90a:
kernels that use them are compiled for the architecture-specific target.
"""

from __future__ import annotations

import functools
import threading

import numpy as np
from .scalars import int64

from .._backend import SIMULATOR, cuda
from . import ptx

WARPGROUP = 128
M = 64  # rows of D (and of A) per wgmma
K = 16  # the K of one wgmma (16-bit operands)
KINDS = {"f16": 16, "bf16": 16, "tf32": 8}  # the operand types and the K of one wgmma with them: 32 bytes a row
SMEM_WINDOW = 1 << 18  # bytes the descriptor's address field reaches (14 bits of address >> 4)


def desc_bits(addr, lbo, sbo):
    """The matrix descriptor of a K-major operand without swizzle at shared address ``addr`` (16-byte aligned),
    leading byte offset ``lbo`` and stride byte offset ``sbo`` (multiples of 16): module docstring. (In a kernel:
    ``make_desc``, the same as a device function.)"""
    return ((int64(addr) & 0x3FFFF) >> 4) | (((int64(lbo) & 0x3FFFF) >> 4) << 16) | (
        ((int64(sbo) & 0x3FFFF) >> 4) << 32)


make_desc = cuda.jit(device=True, inline=True)(desc_bits)

SWIZZLE_MODES = {128: 1, 64: 2, 32: 3}  # the descriptor's swizzle mode (bits 62-63) by the bytes a row holds
SWIZZLE_SPANS = {mode: span for span, mode in SWIZZLE_MODES.items()}
SWIZZLE_ALIGN = 1024  # bytes on which a swizzled tile starts (the 8 rows of the widest pattern)


def desc_bits_swizzled(addr, lbo, sbo, mode):
    """The matrix descriptor of an operand stored with a swizzle (module docstring) at shared address ``addr``;
    ``lbo`` and ``sbo`` as drawn there, ``mode`` the swizzle's (:data:`SWIZZLE_MODES`). (In a kernel:
    ``make_desc_swizzled``.)"""
    return ((int64(addr) & 0x3FFFF) >> 4) | (((int64(lbo) & 0x3FFFF) >> 4) << 16) | (
        ((int64(sbo) & 0x3FFFF) >> 4) << 32) | (int64(mode) << 62)


make_desc_swizzled = cuda.jit(device=True, inline=True)(desc_bits_swizzled)


def swizzle(byte_address, span):
    """Where the swizzle of ``span``-byte rows (128, 64 or 32) stores the byte at shared address ``byte_address``
    (an int or an integer NumPy array): bits 4-6 XOR bits 7-9 for 128 bytes, bits 4-5 XOR 7-8 for 64, bit 4 XOR
    bit 7 for 32."""
    return byte_address ^ (((byte_address >> 7) & (span // 16 - 1)) << 4)


def _decode(desc):
    """(address, lbo, sbo, swizzle) of a descriptor."""
    desc = int(desc)
    return ((desc & 0x3FFF) << 4, ((desc >> 16) & 0x3FFF) << 4, ((desc >> 32) & 0x3FFF) << 4, (desc >> 62) & 3)


# ---------------------------------------------------------------------------------------------------------------
# Simulator stand-ins
# ---------------------------------------------------------------------------------------------------------------

_smem_lock = threading.Lock()


def _smem_table():
    """This block's shared arrays: {id(array): (address, array)}, kept on the simulator's block manager."""
    thread = threading.current_thread()
    return thread._manager.__dict__.setdefault("_flashnumba_smem", {}), tuple(thread.blockIdx)


def _sim_smem_address(ary, index):
    """The shared-window byte address of ary.flat[index] (ary a shared array; C order)."""
    a = ptx._host_array(ary)
    base = a.base if a.base is not None and isinstance(a.base, np.ndarray) else a
    # (by where its memory lies: each thread's view of the dynamic shared memory is an array object of its own)
    key = (base.__array_interface__["data"][0], base.nbytes)
    table, block = _smem_table()
    with _smem_lock:
        arrays = table.setdefault(block, {})
        if key not in arrays:
            end = max((addr + arr.nbytes for addr, arr in arrays.values()), default=0)
            addr = -(-end // 1024) * 1024
            if addr + base.nbytes > SMEM_WINDOW:
                raise ValueError("the shared arrays of a block exceed the 256 KB a descriptor can address")
            arrays[key] = (addr, base)
        addr, _ = arrays[key]
    offset = a.__array_interface__["data"][0] - base.__array_interface__["data"][0]
    return np.uint32(addr + offset + int(index) * a.itemsize)


def _sim_smem_bytes(address, nbytes):
    """A uint8 view of ``nbytes`` of this block's shared memory from ``address``."""
    table, block = _smem_table()
    for addr, arr in table.get(block, {}).values():
        if addr <= address and address + nbytes <= addr + arr.nbytes:
            return arr.reshape(-1).view(np.uint8)[address - addr:address - addr + nbytes]
    raise ValueError(f"address {address} ({nbytes} bytes) lies in no shared array of this block")


def _sim_operand(desc, rows, halves, mn_major=False, esize=2):
    """The operand (rows x K, float64: row r, column k) a descriptor names, read from shared memory now; K-major,
    or MN-major (``mn_major``: 8 consecutive rows of one column of K in each 16 bytes). ``esize``: the bytes of an
    element, 2 (K = 16) or 4 (TF32, K = 8; K-major only); ``halves`` turns the elements' bits into values."""
    if esize == 4:
        return _sim_operand_32(desc, rows, halves)
    addr, lbo, sbo, mode = _decode(desc)
    if mode not in (0,) + tuple(SWIZZLE_SPANS):
        raise NotImplementedError(f"the stand-in reads operands without swizzle or with the 128-, 64- or 32-byte "
                                  f"one, got mode {mode}")
    if addr % 16:
        raise ValueError(f"an operand's address must be 16-byte aligned, got {addr}")
    if mode:
        span = SWIZZLE_SPANS[mode]
        phys = swizzle(addr + _swizzled_offsets(rows, lbo, sbo, mn_major, span), span)
        lo = int(phys.min())
        return halves(_sim_smem_bytes(lo, int(phys.max()) + 2 - lo).view(np.uint16)[(phys - lo) // 2])
    offsets, span = _operand_offsets(rows, lbo, sbo, mn_major)
    try:  # (one gather where the operand lies within one shared array, as it does in the kernels)
        return halves(_sim_smem_bytes(addr, span).view(np.uint16)[offsets])
    except ValueError:
        pass  # (else chunk by chunk, which names a chunk that lies in no shared array)
    out = np.empty((rows, K))
    if mn_major:
        for k in range(K):
            for rc in range(rows // 8):
                start = addr + rc * sbo + (k // 8) * lbo + (k % 8) * 16
                out[8 * rc:8 * rc + 8, k] = halves(_sim_smem_bytes(start, 16).view(np.uint16))
        return out
    for r in range(rows):
        for kc in range(K // 8):
            start = addr + (r // 8) * sbo + kc * lbo + (r % 8) * 16
            out[r, 8 * kc:8 * kc + 8] = halves(_sim_smem_bytes(start, 16).view(np.uint16))
    return out


def _sim_operand_32(desc, rows, values):
    """:func:`_sim_operand` of 32-bit elements (TF32, K = 8, K-major): element (r, k) at (r // 8) SBO + (k // 4) LBO
    + (r % 8) 16 + (k % 4) 4 bytes without swizzle, or the swizzle of (r // 8) SBO + (r % 8) span + 4 k."""
    addr, lbo, sbo, mode = _decode(desc)
    if addr % 16:
        raise ValueError(f"an operand's address must be 16-byte aligned, got {addr}")
    r, k = np.arange(rows)[:, None], np.arange(8)[None, :]
    if mode:
        span = SWIZZLE_SPANS[mode]
        byte = swizzle(addr + (r // 8) * sbo + (r % 8) * span + 4 * k, span) - addr
    else:
        byte = (r // 8) * sbo + (k // 4) * lbo + (r % 8) * 16 + (k % 4) * 4
    lo = int(byte.min())
    return values(_sim_smem_bytes(addr + lo, int(byte.max()) + 4 - lo).view(np.uint32)[(byte - lo) // 4])


def _tf32_values(bits):
    """float32 bit patterns (uint32, any shape) as the tensor cores read them for TF32, float64: the lower 13 bits
    of the mantissa dropped (truncated, not rounded: round with ``cvt.rna.tf32.f32`` first for nearest)."""
    return (np.asarray(bits, np.uint32) & np.uint32(0xFFFFE000)).view(np.float32).astype(np.float64)


@functools.lru_cache(maxsize=None)
def _operand_offsets(rows, lbo, sbo, mn_major):
    """(16-bit element offsets from the operand's address of its elements (r, k), rows x K; the bytes from the
    address to the last element's end): where :func:`_sim_operand` reads, as one index array."""
    r, k = np.arange(rows)[:, None], np.arange(K)[None, :]
    if mn_major:
        byte = (r // 8) * sbo + (k // 8) * lbo + (k % 8) * 16 + (r % 8) * 2
    else:
        byte = (r // 8) * sbo + (k // 8) * lbo + (r % 8) * 16 + (k % 8) * 2
    return byte // 2, int(byte.max()) + 2


@functools.lru_cache(maxsize=None)
def _swizzled_offsets(rows, lbo, sbo, mn_major, span):
    """Byte offsets from the start, before the swizzle, of the elements (r, k) (rows x K) of an operand swizzled in
    rows of ``span`` bytes (module docstring)."""
    r, k = np.arange(rows)[:, None], np.arange(K)[None, :]
    if sbo % (8 * span):
        raise ValueError(f"a swizzled operand of {span}-byte rows steps 8 rows (or keys) by a multiple of "
                         f"{8 * span} bytes, got {sbo}")
    if mn_major:
        e = span // 2
        return (r % e) * 2 + (r // e) * lbo + (k % 8) * span + (k // 8) * sbo
    return (r // 8) * sbo + (r % 8) * span + k * 2


def _sim_register_operand(everyone_regs, halves, tf32=False):
    """The A operand (64 x 16, float64) held in the 128 threads' registers: thread r's four uint32 (two 16-bit
    elements each, the lower half first) at the places the module docstring draws; with ``tf32`` (64 x 8) one
    float32 each, register i at row 16 w + g + 8 (i & 1), column t + 4 (i >> 1)."""
    if tf32:
        out = np.empty((M, 8))
        for r, regs in enumerate(everyone_regs):
            warp, lane = r // 32, r % 32
            for i, reg in enumerate(regs):
                out[16 * warp + (lane >> 2) + 8 * (i & 1), (lane & 3) + 4 * (i >> 1)] = halves(np.uint32(reg))
        return out
    out = np.empty((M, K))
    for r, regs in enumerate(everyone_regs):
        warp, lane = r // 32, r % 32
        g, t = lane >> 2, lane & 3
        for i, reg in enumerate(regs):
            row = 16 * warp + g + 8 * (i & 1)
            col = 2 * t + 8 * (i >> 1)
            out[row, col:col + 2] = halves(np.array([reg & 0xFFFF, (reg >> 16) & 0xFFFF], np.uint16))
    return out


def _fragment_index(N):
    """(rows, cols) of D for register i of thread r of the warpgroup: two (128, N / 2) index arrays."""
    r = np.arange(WARPGROUP)[:, None]
    i = np.arange(N // 2)[None, :]
    warp, lane = r // 32, r % 32
    g, t, j, x = lane >> 2, lane & 3, i // 4, i % 4
    return 16 * warp + g + 8 * (x >> 1), 8 * j + 2 * t + (x & 1)


def _wgmma_state():
    """This simulated thread's wgmma: (issued, not committed; committed groups, oldest first)."""
    return ptx._thread_state("_flashnumba_wgmma", lambda: ([], []))


def _wgmma_results():
    """The full D (64 x N, float64) that each of this simulated thread's accumulators last received, by id: what
    a wgmma chained on it (issued before that result was retired) starts from."""
    return ptx._thread_state("_flashnumba_wgmma_d", dict)


def _make_sim_ops(kind, N, regs_a=False, trans_b=False):
    halves = {"f16": ptx._f16_values, "bf16": ptx._bf16_values, "tf32": _tf32_values}[kind]
    esize = 4 if kind == "tf32" else 2
    rows, cols = _fragment_index(N)

    def issue(acc, operand_a, desc_b, scale_d):
        a = ptx._host_array(acc)
        if a.shape[0] != N // 2:
            raise ValueError(f"wgmma m64n{N}k{KINDS[kind]}: the accumulator holds {N // 2} float32 a thread, got "
                             f"{a.shape}")
        issued = _wgmma_state()[0] + [op for group in _wgmma_state()[1] for op in group]
        chained = any(op[0] is a for op in issued)  # reads what an earlier wgmma in flight writes
        # the operands as they are at the issue: the hardware may read them any time until the wait, so they must
        # be in place now and stay so (checked at the wait)
        seen = (None if regs_a else _sim_operand(operand_a, M, halves, esize=esize),
                _sim_operand(int(desc_b), N, halves, mn_major=trans_b, esize=esize))
        # (the accumulator's values only where the product adds to them: otherwise the registers may hold anything,
        # a signalling NaN among it)
        start = a.copy() if scale_d else np.zeros_like(a)
        _wgmma_state()[0].append((a, None if chained else start, operand_a, int(desc_b), bool(scale_d), seen))
        a[:] = np.nan  # in flight: the registers hold nothing a thread may read

    if regs_a:
        def mma(acc, a0, a1, a2, a3, desc_b, scale_d):
            issue(acc, tuple(ptx._u32(x) for x in (a0, a1, a2, a3)), desc_b, scale_d)
    else:
        def mma(acc, desc_a, desc_b, scale_d):
            issue(acc, int(desc_a), desc_b, scale_d)

    def fence(acc):
        pass  # (orders register accesses before the wgmma that follow: nothing to do in the simulator)

    def wait(n, acc):
        pending, groups = _wgmma_state()
        retired = []
        while len(groups) > int(n):
            retired += groups.pop(0)
        mine = [(c, da, db, s) for _, c, da, db, s, _ in retired]
        results = _wgmma_results()  # the full D each accumulator last received, by this thread's array

        def products(everyone):
            """The retired products' operands and full D, once for the warpgroup (from lane 0's view of the
            chains: every thread's is the same)."""
            latest, out = {}, []
            for i, (a, c, da, db, s, _) in enumerate(retired):
                if c is None:
                    d = latest[id(a)] if id(a) in latest else results[id(a)]  # (chained on a retired D)
                else:
                    d = np.zeros((M, N))
                    d[rows, cols] = np.array([everyone[r][i][0] for r in range(WARPGROUP)], np.float64)
                if regs_a:
                    A = _sim_register_operand([everyone[r][i][1] for r in range(WARPGROUP)], halves, esize == 4)
                else:
                    A = _sim_operand(da, M, halves, esize=esize)
                B = _sim_operand(db, N, halves, mn_major=trans_b, esize=esize)
                latest[id(a)] = A @ B.T + (d if s else 0.0)
                out.append((A.tobytes(), B.tobytes(), latest[id(a)]))
            return out

        rank, done = ptx._group_exchange(mine, WARPGROUP, "warpgroup", products)
        for (a, c, da, db, s, seen), (A, B, D) in zip(retired, done):
            # (each thread's operands as it saw them at its issue, against those at the wait, bit for bit)
            if not ((regs_a or seen[0].tobytes() == A) and seen[1].tobytes() == B):
                raise RuntimeError("the shared memory a wgmma reads changed between its issue and its wait (or was "
                                   "not yet written, by every thread, at the issue: a missing barrier)")
            results[id(a)] = D
        for a, *_ in retired:
            a[:] = results[id(a)][rows[rank], cols[rank]].astype(np.float32)

    KK = KINDS[kind]
    each = "one float32" if esize == 4 else "two elements"
    a_from = (f"A from this thread's registers a0 .. a3 (four uint32 of {each} each)" if regs_a
              else f"A read through the descriptor desc_a (64 x {KK}, K-major)")
    mma.__doc__ = (f"acc (this thread's {N // 2} float32 of D, 64 x {N}) = A B^T (+ acc where scale_d != 0), "
                   f"{kind} operands: {a_from}, B through desc_b ({N} x {KK}, "
                   f"{'MN-major' if trans_b else 'K-major'}): issued, the result there after the wait that "
                   f"retires it (module docstring).")
    fence.__doc__ = "``wgmma.fence.sync.aligned``: before the first wgmma that reads or writes acc's registers."
    wait.__doc__ = ("``wgmma.wait_group.sync.aligned n`` (n a constant): until at most n committed groups are in "
                    "flight; acc holds the results of those retired.")
    return mma, fence, wait


def _sim_commit():
    """Close the group of wgmma this thread issued since the last commit."""
    pending, groups = _wgmma_state()
    groups.append(list(pending))
    pending.clear()


def _sim_fence_proxy_async():
    """``fence.proxy.async.shared::cta``: this thread's stores to shared memory before it are seen by the
    asynchronous reads (wgmma) issued after it (and, for other threads' reads, after a barrier)."""


class _MBarrier:
    """The state of one simulated mbarrier: the arrivals a phase expects, those still missing, the bytes of
    transactions still pending, the phases completed so far, and the bulk copies not yet landed."""

    def __init__(self, count):
        self.count, self.left, self.tx, self.phases, self.copies = count, count, 0, 0, []
        self.deferred = []  # cp.async copies whose thread arrived on this barrier: they land with the phase

    def settle(self):
        """Land the copies in flight, and complete the phase where every arrival and every byte is in."""
        for target, data in self.copies:
            target[:] = data
            self.tx -= data.size
        self.copies.clear()
        if self.left == 0 and self.tx == 0:
            for target, data in self.deferred:
                target[:] = data
            self.deferred.clear()
            self.phases += 1
            self.left = self.count
        elif self.left == 0 and self.tx < 0:  # (bytes may land before their expect_tx: not an error until then)
            raise RuntimeError("an mbarrier received more transaction bytes than its phase expected")


_mbar_lock = threading.Condition()  # guards every mbarrier; notified when one may have completed a phase
_TRY_WAIT_S = 0.002  # how long a simulated try_wait waits for its phase before it answers 0


def _mbarrier(bar):
    table, block = _smem_table()
    if int(bar) % 8:
        raise ValueError(f"an mbarrier must lie on 8 bytes, got address {bar}")
    _sim_smem_bytes(int(bar), 8)  # (it must lie in this block's shared memory)
    return table.setdefault(("mbarrier", block), {})


def _sim_mbarrier_init(bar, count):
    """``mbarrier.init.shared::cta.b64 [bar], count``: the 8 bytes of shared memory at ``bar`` become a barrier
    whose phases complete when ``count`` arrivals (and every byte of transactions expected) are in. One thread
    initialises it; the others use it after a ``syncthreads``."""
    with _mbar_lock:
        _mbarrier(bar)[int(bar)] = _MBarrier(int(count))


def _sim_mbarrier_arrive(bar):
    """``mbarrier.arrive.shared::cta.b64``: one arrival on the barrier's current phase."""
    with _mbar_lock:
        m = _mbarrier(bar)[int(bar)]
        m.left -= 1
        m.settle()
        _mbar_lock.notify_all()


def _sim_mbarrier_arrive_expect_tx(bar, nbytes):
    """``mbarrier.arrive.expect_tx.shared::cta.b64``: the current phase also waits for ``nbytes`` bytes of bulk
    copies (:func:`cp_async_bulk` naming this barrier), and one arrival."""
    with _mbar_lock:
        m = _mbarrier(bar)[int(bar)]
        m.tx += int(nbytes)
        m.left -= 1
        m.settle()
        _mbar_lock.notify_all()


def _sim_mbarrier_try_wait(bar, parity):
    """``mbarrier.try_wait.parity.shared::cta.b64``: 1 once the phase of parity ``parity`` (0 for the first, 1
    for the second, 0 again ...) has completed, else 0 (call it in a loop). Phases complete in order; the
    copies of a phase land before it completes. Like the hardware's, it may wait a while for the phase (here up
    to :data:`_TRY_WAIT_S`, woken by any arrival or copy) before it answers 0."""
    with _mbar_lock:
        m = _mbarrier(bar)[int(bar)]
        m.settle()
        if m.phases % 2 == int(parity) % 2:
            _mbar_lock.wait(_TRY_WAIT_S)
            m.settle()
        return np.uint32(m.phases % 2 != int(parity) % 2)


def _sim_cp_async_bulk(dst, src, src_index, nbytes, bar):
    """``cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes``: ``nbytes`` (a multiple of 16)
    contiguous bytes from global ``src.flat[src_index:]`` to shared address ``dst`` (16-byte aligned), issued by
    one thread; the copy counts its bytes against the expected transactions of the barrier ``bar``, and is seen
    in shared memory by the threads that waited for the barrier's phase. (The stand-in reads the source now and
    writes the destination when the phase is settled.)"""
    if int(nbytes) % 16 or int(dst) % 16:
        raise ValueError(f"cp.async.bulk copies multiples of 16 bytes to 16-byte aligned addresses, got {nbytes} "
                         f"bytes to {dst}")
    data = ptx._bytes_at(src, src_index, int(nbytes)).copy()
    target = _sim_smem_bytes(int(dst), int(nbytes))
    with _mbar_lock:
        _mbarrier(bar)[int(bar)].copies.append((target, data))
        _mbar_lock.notify_all()


_MAP_MAGIC = 0x7E45_0A11  # the first word of a stand-in tensor map
MAP_WORDS = 16  # uint64 words of a tensor map (128 bytes)
_sim_tensors: dict = {}  # a stand-in map's handle -> the strided view of its tensor (outermost dim first)
_sim_tensors_lock = threading.Lock()
_sim_next_handle = 0
SIM_MAPS_KEPT = 256  # stand-in maps whose tensors the process keeps (the latest: a launch uses its maps at once)


def sim_tensor_map(array, dims, strides, box, span=128):
    """The simulator's tensor map (:data:`MAP_WORDS` uint64, as the driver's is 128 bytes) of ``array``'s memory
    seen as a tensor of ``dims`` (elements, innermost first) with byte ``strides`` of the dims after the first, read
    in boxes of ``box`` elements, with the swizzle of ``span``-byte rows (128, 64, 32) or none (0). The same checks
    as the driver's encoding; the process keeps the strided view the map names (the map holds its handle)."""
    host = ptx._host_array(array)
    rank = len(dims)
    item = host.itemsize
    if not 1 <= rank <= 5 or len(strides) != rank - 1 or len(box) != rank:
        raise ValueError(f"a tensor map takes 1 to 5 dims, rank - 1 strides and a box of rank dims, got {dims}, "
                         f"{strides}, {box}")
    if any(s_ % 16 for s_ in strides) or (box[0] * item) % 16 or any(not 1 <= b <= 256 for b in box):
        raise ValueError(f"tensor map: strides must be multiples of 16 bytes, the box's inner dim a multiple of 16 "
                         f"bytes and every box dim in 1 .. 256, got strides {strides}, box {box}")
    if span not in (0,) + tuple(SWIZZLE_MODES) or (span and box[0] * item > span):
        raise ValueError(f"tensor map: a swizzle of 32-, 64- or 128-byte rows (or 0, none) with the box's inner dim "
                         f"at most that many bytes, got {span}, {box[0] * item} bytes")
    if not host.flags.c_contiguous or any(d < 1 for d in dims) or (
            sum((d - 1) * s_ for d, s_ in zip(dims, (item,) + tuple(strides))) + item > host.nbytes):
        raise ValueError(f"the stand-in's tensor map must lie within its C-contiguous array ({host.nbytes} bytes), "
                         f"got dims {dims}, strides {strides}")
    view = np.lib.stride_tricks.as_strided(host.reshape(-1), shape=tuple(reversed(dims)),
                                           strides=tuple(reversed((item,) + tuple(strides))), writeable=False)
    with _sim_tensors_lock:
        global _sim_next_handle
        _sim_next_handle += 1
        handle = _sim_next_handle
        _sim_tensors[handle] = view
        _sim_tensors.pop(handle - SIM_MAPS_KEPT, None)
    words = np.zeros(MAP_WORDS, np.uint64)
    words[:5] = (_MAP_MAGIC, handle, rank, span, item)
    words[5:5 + rank] = box
    return words


def _sim_tma_load_4d(dst, maps, index, c0, c1, c2, c3, bar):
    """``cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [dst], [map, {c0, c1, c2,
    c3}], [bar]``: the box of the tensor map ``maps.flat[index:index + 16]`` at coordinates (c0, c1, c2, c3)
    (elements, innermost first; zeros where the box reaches past a dim) to shared address ``dst`` (128-byte
    aligned), rows of the box's inner dim after one another, with the map's swizzle; its bytes count against the
    expected transactions of ``bar``. One thread issues it. (The stand-in reads the tensor now and writes shared
    memory when the phase is settled.)"""
    words = ptx._host_array(maps).reshape(-1)[int(index):int(index) + MAP_WORDS]
    if words.size != MAP_WORDS or int(words[0]) != _MAP_MAGIC:
        raise ValueError(f"no tensor map at word {index} (make one with sim_tensor_map)")
    rank, span, item = int(words[2]), int(words[3]), int(words[4])
    if rank != 4:
        raise ValueError(f"tma_load_4d takes a map of a 4-D tensor, got rank {rank}")
    view = _sim_tensors[int(words[1])]
    box = [int(b) for b in words[5:5 + rank]]
    coords = [int(c0), int(c1), int(c2), int(c3)]
    block = np.zeros(tuple(reversed(box)), view.dtype)
    src, to = [], []
    for d in reversed(range(rank)):
        n = view.shape[rank - 1 - d]
        lo, hi = max(coords[d], 0), min(coords[d] + box[d], n)
        src.append(slice(lo, max(lo, hi)))
        to.append(slice(lo - coords[d], max(lo, hi) - coords[d]))
    block[tuple(to)] = view[tuple(src)]
    data = block.reshape(-1).view(np.uint8)
    dst = int(dst)
    if dst % 128:
        raise ValueError(f"a tensor-map copy lands on 128-byte aligned shared memory, got address {dst}")
    if span:
        at = swizzle(dst + np.arange(data.size), span) - dst
        moved = np.empty_like(data)
        moved[at] = data
        data = moved
    target = _sim_smem_bytes(dst, data.size)
    with _mbar_lock:
        _mbarrier(bar)[int(bar)].copies.append((target, data))
        _mbar_lock.notify_all()


def _sim_fence_tensormap(maps, index):
    """``fence.proxy.tensormap::generic.acquire.sys [map], 128``: the tensor map at ``maps.flat[index]``, written
    by the host before the launch, is seen by this thread's tensor-map copies after it (a thread fences before its
    first copy with the map)."""
    ptx._host_array(maps)


def _sim_fence_mbarrier_init():
    """``fence.mbarrier_init.release.cluster``: the mbarriers this thread initialised are seen by the copy engine's
    arrivals (tensor-map copies complete on them) after the barrier that follows."""


def _sim_cp_async_mbarrier_arrive(bar):
    """``cp.async.mbarrier.arrive.noinc.shared::cta.b64``: one arrival on the barrier's current phase, made when
    every ``cp.async`` this thread issued before it has landed (committed or not; ``.noinc``: the arrival is one of
    the count the barrier was initialised with). So a producer's threads copy a tile with cp.async and arrive, and
    the consumers that waited for the phase see the tile, with no cp.async wait in the producer. (The stand-in
    lands those copies when the phase completes, the latest the hardware may.)"""
    pending, groups = ptx._cp_async_state()
    copies = list(pending) + [c for group in groups for c in group]
    pending.clear()
    groups.clear()
    with _mbar_lock:
        m = _mbarrier(bar)[int(bar)]
        m.deferred += copies
        m.left -= 1
        m.settle()
        _mbar_lock.notify_all()


class _NamedBarrier:
    """One of a block's 16 hardware barriers in the simulator: the threads a phase expects, those arrived, and
    the phases completed (each ``named_barrier_sync`` waits for the phase it arrived in)."""

    def __init__(self):
        self.cond = threading.Condition()
        self.arrived, self.phases, self.count = 0, 0, None

    def arrive(self, count, wait):
        with self.cond:
            if self.count is not None and self.count != count:
                raise RuntimeError(f"threads arrive at one named barrier expecting {self.count} and {count}")
            self.count = count
            phase = self.phases
            self.arrived += 1
            if self.arrived == count:
                self.arrived, self.phases, self.count = 0, self.phases + 1, None
                self.cond.notify_all()
            elif wait:
                while self.phases == phase:
                    self.cond.wait()


_named_lock = threading.Lock()


def _named_barrier(bar_id, count):
    if not 0 < int(bar_id) < 16 or int(count) % 32 or int(count) <= 0:
        raise ValueError(f"a named barrier takes an id in 1 .. 15 (0 is syncthreads') and a thread count that is a "
                         f"positive multiple of 32, got {bar_id}, {count}")
    table, block = _smem_table()
    with _named_lock:
        return table.setdefault(("named", block, int(bar_id)), _NamedBarrier())


def _sim_named_barrier_sync(bar_id, count):
    """``bar.sync id, count``: this thread arrives at hardware barrier ``id`` (1 .. 15) and waits until ``count``
    threads (a multiple of 32: whole warps) have arrived in this phase, by ``named_barrier_sync`` or
    ``named_barrier_arrive``. Two warpgroups take turns with two of them (FlashAttention-3's ping-pong): each
    syncs on its own before its matrix products and arrives on the other's after them."""
    _named_barrier(bar_id, count).arrive(int(count), wait=True)


def _sim_named_barrier_arrive(bar_id, count):
    """``bar.arrive id, count``: this thread arrives at hardware barrier ``id`` without waiting (it lets the
    threads that sync there go on once ``count`` have arrived)."""
    _named_barrier(bar_id, count).arrive(int(count), wait=False)


def _sim_elect_one():
    """``elect.sync``: 1 in one lane of the warp (the stand-in elects lane 0, as the hardware elects the
    lowest-numbered active lane), 0 in the others; all 32 lanes call it."""
    lane, _ = ptx._warp_exchange(None)
    return np.uint32(lane == 0)


def _make_sim_setmaxnreg(inc):
    def setmaxnreg(n):
        if int(n) % 8 or not 24 <= int(n) <= 256:
            raise ValueError(f"setmaxnreg takes a multiple of 8 in 24 .. 256, got {n}")
        ptx._group_exchange(None, WARPGROUP, "warpgroup")

    what = "ask for up to" if inc else "give back all but"
    setmaxnreg.__doc__ = (f"``setmaxnreg.{'inc' if inc else 'dec'}.sync.aligned.u32 n`` (n a constant, a multiple "
                          f"of 8 in 24 .. 256): the warpgroup's threads {what} n registers each, so that a producer "
                          f"warpgroup gives registers to the consumers (a whole warpgroup calls it; the stand-in "
                          f"only meets there).")
    return setmaxnreg


# ---------------------------------------------------------------------------------------------------------------
# The GPU
# ---------------------------------------------------------------------------------------------------------------

def _gpu_intrinsics():
    from llvmlite import ir
    from numba import types
    from numba.core.errors import TypingError
    from numba.cuda.extending import intrinsic

    asm, address, shared_address, check_address, statement, literal_statement = ptx._codegen()
    f32 = ir.FloatType()

    @intrinsic
    def smem_address(typingctx, ary, index):
        check_address(ary, index, "smem_address")

        def codegen(context, builder, sig, args):
            return shared_address(context, builder, sig.args[0], args[0], sig.args[1], args[1])

        return types.uint32(ary, index), codegen

    def registers(context, builder, aryty, ary, n):
        """(the data pointer, the n float32 of a local array, loaded)."""
        data = context.make_array(aryty)(context, builder, ary).data
        ptrs = [builder.gep(data, [ir.Constant(ir.IntType(64), i)]) for i in range(n)]
        return ptrs, [builder.load(p) for p in ptrs]

    def through(builder, ptrs, values, text, extra, extra_constraints):
        """Pass the accumulator's registers through one asm statement (tied in and out, so that nothing reads
        or writes them across it) and store them back."""
        n = len(values)
        constraints = ",".join(["=f"] * n + [str(i) for i in range(n)] + extra_constraints + ["~{memory}"])
        out = asm(builder, ir.LiteralStructType([f32] * n), list(values) + extra, text, constraints,
                  side_effect=True)
        for i, p in enumerate(ptrs):
            builder.store(builder.extract_value(out, i), p)

    def check_acc(acc, what):
        if not isinstance(acc, types.Array) or acc.dtype != types.float32 or acc.ndim != 1:
            raise TypingError(f"{what}: the accumulator must be a 1-D float32 (local) array, got {acc}")

    def make_ops(kind, N, regs_a=False, trans_b=False):
        n = N // 2
        regs = ", ".join(f"${i}" for i in range(n))
        shape = f"m64n{N}k{KINDS[kind]}.f32.{kind}.{kind}"
        # the immediates after scale_d: scale_a, scale_b, then (16-bit kinds only) trans_a with A in shared memory
        # and trans_b
        tail = "" if kind == "tf32" else f", {int(trans_b)}" if regs_a else f", 0, {int(trans_b)}"
        if regs_a:  # {a0, a1, a2, a3}, desc_b, scale_d, scale_a, scale_b[, trans_b]
            text = ("{ .reg .pred p; setp.ne.b32 p, $%d, 0; wgmma.mma_async.sync.aligned.%s {%s}, "
                    "{$%d, $%d, $%d, $%d}, $%d, p, 1, 1%s; }"
                    % (2 * n + 5, shape, regs, *range(2 * n, 2 * n + 5), tail))
        else:  # desc_a, desc_b, scale_d, scale_a, scale_b[, trans_a, trans_b]
            text = ("{ .reg .pred p; setp.ne.b32 p, $%d, 0; wgmma.mma_async.sync.aligned.%s {%s}, "
                    "$%d, $%d, p, 1, 1%s; }" % (2 * n + 2, shape, regs, 2 * n, 2 * n + 1, tail))

        if regs_a:
            def mma(typingctx, acc, a0, a1, a2, a3, desc_b, scale_d):
                check_acc(acc, "wgmma")

                def codegen(context, builder, sig, args):
                    ptrs, vals = registers(context, builder, sig.args[0], args[0], n)
                    a = [context.cast(builder, v, t, types.uint32) for v, t in zip(args[1:5], sig.args[1:5])]
                    db = context.cast(builder, args[5], sig.args[5], types.uint64)
                    s = context.cast(builder, args[6], sig.args[6], types.int32)
                    through(builder, ptrs, vals, text, a + [db, s], ["r"] * 4 + ["l", "r"])
                    return context.get_dummy_value()

                return types.none(acc, a0, a1, a2, a3, desc_b, scale_d), codegen
        else:
            def mma(typingctx, acc, desc_a, desc_b, scale_d):
                check_acc(acc, "wgmma")

                def codegen(context, builder, sig, args):
                    ptrs, vals = registers(context, builder, sig.args[0], args[0], n)
                    da, db = (context.cast(builder, v, t, types.uint64) for v, t in zip(args[1:3], sig.args[1:3]))
                    s = context.cast(builder, args[3], sig.args[3], types.int32)
                    through(builder, ptrs, vals, text, [da, db, s], ["l", "l", "r"])
                    return context.get_dummy_value()

                return types.none(acc, desc_a, desc_b, scale_d), codegen

        def fence(typingctx, acc):
            check_acc(acc, "wgmma_fence")

            def codegen(context, builder, sig, args):
                ptrs, vals = registers(context, builder, sig.args[0], args[0], n)
                through(builder, ptrs, vals, "wgmma.fence.sync.aligned;", [], [])
                return context.get_dummy_value()

            return types.none(acc), codegen

        def wait(typingctx, count, acc):
            if not isinstance(count, types.IntegerLiteral):
                raise TypingError("wgmma_wait(n, acc): n must be a compile-time integer constant")
            check_acc(acc, "wgmma_wait")
            text_wait = f"wgmma.wait_group.sync.aligned {count.literal_value};"

            def codegen(context, builder, sig, args):
                ptrs, vals = registers(context, builder, sig.args[1], args[1], n)
                through(builder, ptrs, vals, text_wait, [], [])
                return context.get_dummy_value()

            return types.none(count, acc), codegen

        mma.__name__ = f"wgmma_m64n{N}k{KINDS[kind]}_{kind}" + ("_rs" if regs_a else "") + ("_tb" if trans_b else "")
        fence.__name__, wait.__name__ = "wgmma_fence", "wgmma_wait"
        return intrinsic(mma), intrinsic(fence), intrinsic(wait)

    i32 = ir.IntType(32)

    def u32(context, builder, v, t):
        return context.cast(builder, v, t, types.uint32)

    def bar_codegen(text, nargs):
        def codegen(context, builder, sig, vals):
            ops = [u32(context, builder, v, t) for v, t in zip(vals, sig.args)]
            asm(builder, ir.VoidType(), ops, text, ",".join(["r"] * nargs + ["~{memory}"]), side_effect=True)
            return context.get_dummy_value()

        return codegen

    def make_bar(name, text, nargs):
        """An intrinsic of ``nargs`` (1 or 2) uint32 operands ($0: the barrier's address) and no result."""
        if nargs == 1:
            def bar_op(typingctx, bar):
                return types.none(bar), bar_codegen(text, 1)
        else:
            def bar_op(typingctx, bar, value):
                return types.none(bar, value), bar_codegen(text, 2)

        bar_op.__name__ = name
        return intrinsic(bar_op)

    @intrinsic
    def mbarrier_try_wait(typingctx, bar, parity):
        text = ("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [$1], $2; selp.u32 $0, 1, 0, p; }")

        def codegen(context, builder, sig, vals):
            ops = [u32(context, builder, v, t) for v, t in zip(vals, sig.args)]
            return asm(builder, i32, ops, text, "=r,r,r,~{memory}", side_effect=True)

        return types.uint32(bar, parity), codegen

    @intrinsic
    def cp_async_bulk(typingctx, dst, src, src_index, nbytes, bar):
        check_address(src, src_index, "cp_async_bulk source")
        text = ("{ .reg .u64 g; cvta.to.global.u64 g, $1; "
                "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [$0], [g], $2, [$3]; }")

        def codegen(context, builder, sig, vals):
            g = address(context, builder, sig.args[1], vals[1], sig.args[2], vals[2])
            ops = [u32(context, builder, vals[0], sig.args[0]), g, u32(context, builder, vals[3], sig.args[3]),
                   u32(context, builder, vals[4], sig.args[4])]
            asm(builder, ir.VoidType(), ops, text, "r,l,r,r,~{memory}", side_effect=True)
            return context.get_dummy_value()

        return types.none(dst, src, src_index, nbytes, bar), codegen

    @intrinsic
    def tma_load_4d(typingctx, dst, maps, index, c0, c1, c2, c3, bar):
        check_address(maps, index, "tma_load_4d's tensor map")
        text = ("cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes "
                "[$0], [$1, {$2, $3, $4, $5}], [$6];")

        def codegen(context, builder, sig, vals):
            m = address(context, builder, sig.args[1], vals[1], sig.args[2], vals[2])
            coords = [context.cast(builder, v, t, types.int32) for v, t in zip(vals[3:7], sig.args[3:7])]
            ops = [u32(context, builder, vals[0], sig.args[0]), m] + coords + [u32(context, builder, vals[7],
                                                                                   sig.args[7])]
            asm(builder, ir.VoidType(), ops, text, "r,l,r,r,r,r,r,~{memory}", side_effect=True)
            return context.get_dummy_value()

        return types.none(dst, maps, index, c0, c1, c2, c3, bar), codegen

    @intrinsic
    def fence_tensormap(typingctx, maps, index):
        check_address(maps, index, "fence_tensormap")

        def codegen(context, builder, sig, vals):
            m = address(context, builder, sig.args[0], vals[0], sig.args[1], vals[1])
            asm(builder, ir.VoidType(), [m], "fence.proxy.tensormap::generic.acquire.sys [$0], 128;",
                "l,~{memory}", side_effect=True)
            return context.get_dummy_value()

        return types.none(maps, index), codegen

    def make_named(name, text):
        def named(typingctx, bar_id, count):
            return types.none(bar_id, count), bar_codegen(text, 2)

        named.__name__ = name
        return intrinsic(named)

    @intrinsic
    def elect_one(typingctx):
        text = "{ .reg .pred p; elect.sync _|p, 0xffffffff; selp.u32 $0, 1, 0, p; }"

        def codegen(context, builder, sig, vals):
            return asm(builder, i32, [], text, "=r", side_effect=True)

        return types.uint32(), codegen

    return dict(smem_address=smem_address, make_ops=make_ops,
                mbarrier_init=make_bar("mbarrier_init", "mbarrier.init.shared::cta.b64 [$0], $1;", 2),
                mbarrier_arrive=make_bar("mbarrier_arrive",
                                         "{ .reg .b64 st; mbarrier.arrive.shared::cta.b64 st, [$0]; }", 1),
                mbarrier_arrive_expect_tx=make_bar(
                    "mbarrier_arrive_expect_tx",
                    "{ .reg .b64 st; mbarrier.arrive.expect_tx.shared::cta.b64 st, [$0], $1; }", 2),
                mbarrier_try_wait=mbarrier_try_wait, cp_async_bulk=cp_async_bulk, elect_one=elect_one,
                tma_load_4d=tma_load_4d, fence_tensormap=fence_tensormap,
                fence_mbarrier_init=statement("fence_mbarrier_init", "fence.mbarrier_init.release.cluster;"),
                cp_async_mbarrier_arrive=make_bar("cp_async_mbarrier_arrive",
                                                  "cp.async.mbarrier.arrive.noinc.shared::cta.b64 [$0];", 1),
                named_barrier_sync=make_named("named_barrier_sync", "bar.sync $0, $1;"),
                named_barrier_arrive=make_named("named_barrier_arrive", "bar.arrive $0, $1;"),
                setmaxnreg_inc=literal_statement("setmaxnreg_inc", "setmaxnreg.inc.sync.aligned.u32 {n};"),
                setmaxnreg_dec=literal_statement("setmaxnreg_dec", "setmaxnreg.dec.sync.aligned.u32 {n};"),
                wgmma_commit=statement("wgmma_commit", "wgmma.commit_group.sync.aligned;"),
                fence_proxy_async=statement("fence_proxy_async", "fence.proxy.async.shared::cta;"))


_ops_cache: dict = {}


def wgmma_ops(kind, N, regs_a=False, trans_b=False):
    """(mma, fence, wait) of ``wgmma.mma_async.sync.aligned.m64nNk16.f32.kind.kind`` for kind "f16" or "bf16", or
    ``m64nNk8.f32.tf32.tf32`` for "tf32", and N a multiple of 8 up to 256 (module docstring). A is read from shared
    memory, K-major, through a descriptor (``mma(acc, desc_a, desc_b, scale_d)``), or with ``regs_a`` from each
    thread's registers (``mma(acc, a0, a1, a2, a3, desc_b, scale_d)``); B from shared memory, K-major, or MN-major
    with ``trans_b`` (16-bit kinds only: TF32 operands are K-major, and the tensor cores drop the lower 13 bits of
    each float32's mantissa)."""
    if kind not in KINDS or N % 8 or not 8 <= N <= 256:
        raise ValueError(f"wgmma takes kind 'f16', 'bf16' or 'tf32' and N a multiple of 8 up to 256, got "
                         f"{kind!r}, {N}")
    if kind == "tf32" and trans_b:
        raise ValueError("wgmma with TF32 operands reads B K-major only (no trans_b)")
    key = (kind, N, bool(regs_a), bool(trans_b))
    if key not in _ops_cache:
        _ops_cache[key] = (_make_sim_ops if SIMULATOR else _GPU["make_ops"])(kind, N, bool(regs_a), bool(trans_b))
    return _ops_cache[key]


_STAND_INS = dict(smem_address=_sim_smem_address, wgmma_commit=_sim_commit, fence_proxy_async=_sim_fence_proxy_async,
                  mbarrier_init=_sim_mbarrier_init, mbarrier_arrive=_sim_mbarrier_arrive,
                  mbarrier_arrive_expect_tx=_sim_mbarrier_arrive_expect_tx, mbarrier_try_wait=_sim_mbarrier_try_wait,
                  cp_async_bulk=_sim_cp_async_bulk, elect_one=_sim_elect_one, tma_load_4d=_sim_tma_load_4d,
                  fence_tensormap=_sim_fence_tensormap, fence_mbarrier_init=_sim_fence_mbarrier_init,
                  cp_async_mbarrier_arrive=_sim_cp_async_mbarrier_arrive,
                  named_barrier_sync=_sim_named_barrier_sync, named_barrier_arrive=_sim_named_barrier_arrive,
                  setmaxnreg_inc=_make_sim_setmaxnreg(True), setmaxnreg_dec=_make_sim_setmaxnreg(False))
if SIMULATOR:
    globals().update(_STAND_INS)
else:
    _GPU = _gpu_intrinsics()
    for _name, _stand_in in _STAND_INS.items():  # each intrinsic carries its stand-in's docstring
        globals()[_name] = _GPU[_name]
        _GPU[_name].__doc__ = _stand_in.__doc__

__all__ = ["desc_bits", "make_desc", "desc_bits_swizzled", "make_desc_swizzled", "swizzle", "sim_tensor_map",
           "wgmma_ops",
           *_STAND_INS]
