"""Hopper's warpgroup matrix multiply (``wgmma``) as inline PTX, with simulator stand-ins.

On Hopper (sm_90a) a *warpgroup*, four consecutive warps of a block (threads 128 i .. 128 i + 127), multiplies a
64 x N tile of A by an N x 16 tile of B (transposed: D = A B^T, K = 16) in one asynchronous instruction that reads
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
| ``fence_proxy_async()`` | ``fence.proxy.async.shared::cta`` | stores before it seen by wgmma after a barrier |
| ``wgmma_ops(kind, N)`` | ``wgmma.*`` for m64nNk16, f32 += kind x kind | (mma, fence, wait) for N / 2 registers |
| ``wgmma_commit()`` | ``wgmma.commit_group.sync.aligned`` | |

**The descriptor** (bits of the uint64): 0-13 the operand's shared address >> 4; 16-29 the *leading* byte
offset >> 4; 32-45 the *stride* byte offset >> 4; 49-51 a base offset (0 here); 62-63 the swizzle mode (0: none;
the 128-, 64- and 32-byte swizzles are not yet offered). An operand is read as *core matrices* of 8 rows of 16
bytes (8 x 8 16-bit elements), each 128 contiguous bytes, row after row. Both operands here are K-major (the K
index runs along a row: A row-major 64 x 16, B stored N x 16, as Q and K are in attention), and element (r, k)
of the operand lies at::

    start + (r // 8) * SBO + (k // 8) * LBO + (r % 8) * 16 + (k % 8) * 2        bytes

so LBO steps to the next 8 columns of K (the second core matrix of a row of them) and SBO to the next 8 rows
(M for A, N for B). Packed densely, a 64 x 16 A tile has LBO = 128 and SBO = 256.

**The accumulator** (float32, N / 2 registers a thread, ``acc`` a local array of that length): warp w of the
warpgroup holds rows 16 w .. 16 w + 15 of D (64 x N), in the layout of ``mma.sync``'s C fragment repeated along
N; with g = lane >> 2 and t = lane & 3, registers 4 j .. 4 j + 3 hold::

    acc[4j] = D[16w + g, 8j + 2t]        acc[4j + 1] = D[16w + g, 8j + 2t + 1]
    acc[4j + 2] = D[16w + g + 8, 8j + 2t]    acc[4j + 3] = D[16w + g + 8, 8j + 2t + 1]

**The stand-ins.** Under the simulator a wgmma records itself and fills the accumulator with NaN (reading it
before the wait reads garbage on the GPU); ``wgmma_wait`` retires the groups as the hardware does: the 128
threads meet at a barrier, exchange their accumulators and descriptors, and each computes the retired products
in order from the shared memory as it is *at the wait* (float64 products, rounded once to float32), then keeps
its own fragment. ``smem_address`` gives each shared array of a block an address of its own (1 KB aligned, below
the 256 KB that the descriptor's 14 bits reach) and the descriptor's address is looked up among them.
``fence_proxy_async`` does nothing there (the simulator has one view of memory). The instructions need sm_90a:
kernels that use them are compiled for the architecture-specific target.
"""

from __future__ import annotations

import threading

import numpy as np
from numba import int64

from .._backend import SIMULATOR, cuda
from . import ptx

WARPGROUP = 128
M = 64  # rows of D (and of A) per wgmma
K = 16  # the K of one wgmma (16-bit operands)
SMEM_WINDOW = 1 << 18  # bytes the descriptor's address field reaches (14 bits of address >> 4)


def desc_bits(addr, lbo, sbo):
    """The matrix descriptor of a K-major operand without swizzle at shared address ``addr`` (16-byte aligned),
    leading byte offset ``lbo`` and stride byte offset ``sbo`` (multiples of 16): module docstring. (In a kernel:
    ``make_desc``, the same as a device function.)"""
    return ((int64(addr) & 0x3FFFF) >> 4) | (((int64(lbo) & 0x3FFFF) >> 4) << 16) | (
        ((int64(sbo) & 0x3FFFF) >> 4) << 32)


make_desc = cuda.jit(device=True, inline=True)(desc_bits)


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
    table, block = _smem_table()
    with _smem_lock:
        arrays = table.setdefault(block, {})
        if id(base) not in arrays:
            end = max((addr + arr.nbytes for addr, arr in arrays.values()), default=0)
            addr = -(-end // 1024) * 1024
            if addr + base.nbytes > SMEM_WINDOW:
                raise ValueError("the shared arrays of a block exceed the 256 KB a descriptor can address")
            arrays[id(base)] = (addr, base)
        addr, _ = arrays[id(base)]
    offset = a.__array_interface__["data"][0] - base.__array_interface__["data"][0]
    return np.uint32(addr + offset + int(index) * a.itemsize)


def _sim_smem_bytes(address, nbytes):
    """A uint8 view of ``nbytes`` of this block's shared memory from ``address``."""
    table, block = _smem_table()
    for addr, arr in table.get(block, {}).values():
        if addr <= address and address + nbytes <= addr + arr.nbytes:
            return arr.reshape(-1).view(np.uint8)[address - addr:address - addr + nbytes]
    raise ValueError(f"address {address} ({nbytes} bytes) lies in no shared array of this block")


def _sim_operand(desc, rows, halves):
    """The K-major operand (rows x 16, float64) a descriptor names, read from shared memory now."""
    addr, lbo, sbo, swizzle = _decode(desc)
    if swizzle:
        raise NotImplementedError("the stand-in reads unswizzled operands only (swizzle mode 0)")
    if addr % 16:
        raise ValueError(f"an operand's address must be 16-byte aligned, got {addr}")
    out = np.empty((rows, K))
    for r in range(rows):
        for kc in range(K // 8):
            start = addr + (r // 8) * sbo + kc * lbo + (r % 8) * 16
            out[r, 8 * kc:8 * kc + 8] = halves(_sim_smem_bytes(start, 16).view(np.uint16))
    return out


def _f16_values(bits):
    return bits.view(np.float16).astype(np.float64)


def _bf16_values(bits):
    return (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


def _fragment_index(N):
    """(rows, cols) of D for register i of thread r of the warpgroup: two (128, N / 2) index arrays."""
    r = np.arange(WARPGROUP)[:, None]
    i = np.arange(N // 2)[None, :]
    warp, lane = r // 32, r % 32
    g, t, j, x = lane >> 2, lane & 3, i // 4, i % 4
    return 16 * warp + g + 8 * (x >> 1), 8 * j + 2 * t + (x & 1)


def _wgmma_state():
    """This simulated thread's wgmma: (issued, not committed; committed groups, oldest first)."""
    thread = threading.current_thread()
    state = getattr(thread, "_flashnumba_wgmma", None)
    if state is None:
        state = thread._flashnumba_wgmma = ([], [])
    return state


def _wgmma_results():
    """The full D (64 x N, float64) that each of this simulated thread's accumulators last received, by id: what
    a wgmma chained on it (issued before that result was retired) starts from."""
    thread = threading.current_thread()
    results = getattr(thread, "_flashnumba_wgmma_d", None)
    if results is None:
        results = thread._flashnumba_wgmma_d = {}
    return results


def _make_sim_ops(kind, N):
    halves = _f16_values if kind == "f16" else _bf16_values
    rows, cols = _fragment_index(N)

    def mma(acc, desc_a, desc_b, scale_d):
        a = ptx._host_array(acc)
        if a.shape[0] != N // 2:
            raise ValueError(f"wgmma m64n{N}k16: the accumulator holds {N // 2} float32 a thread, got {a.shape}")
        issued = _wgmma_state()[0] + [op for group in _wgmma_state()[1] for op in group]
        chained = any(op[0] is a for op in issued)  # reads what an earlier wgmma in flight writes
        _wgmma_state()[0].append((a, None if chained else a.copy(), int(desc_a), int(desc_b), bool(scale_d)))
        a[:] = np.nan  # in flight: the registers hold nothing a thread may read

    def fence(acc):
        pass  # (orders register accesses before the wgmma that follow: nothing to do in the simulator)

    def wait(n, acc):
        pending, groups = _wgmma_state()
        retired = []
        while len(groups) > int(n):
            retired += groups.pop(0)
        mine = [(c, da, db, s) for _, c, da, db, s in retired]
        rank, everyone = ptx._group_exchange(mine, WARPGROUP, "warpgroup")
        results = _wgmma_results()  # the full D each accumulator last received, by this thread's array
        for i, (a, c, da, db, s) in enumerate(retired):
            if c is None:
                d = results[id(a)].copy()
            else:
                d = np.zeros((M, N))
                d[rows, cols] = np.array([everyone[r][i][0] for r in range(WARPGROUP)], np.float64)
            A = _sim_operand(da, M, halves)
            B = _sim_operand(db, N, halves)
            results[id(a)] = A @ B.T + (d if s else 0.0)
        for a, *_ in retired:
            a[:] = results[id(a)][rows[rank], cols[rank]].astype(np.float32)

    mma.__doc__ = (f"acc (this thread's {N // 2} float32 of D, 64 x {N}) = A B^T (+ acc where scale_d != 0), "
                   f"A and B {kind} read through the descriptors desc_a (64 x 16) and desc_b ({N} x 16): issued, "
                   f"the result there after the wait that retires it (module docstring).")
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


# ---------------------------------------------------------------------------------------------------------------
# The GPU
# ---------------------------------------------------------------------------------------------------------------

def _gpu_intrinsics():
    from llvmlite import ir
    from numba import types
    from numba.core.errors import TypingError
    from numba.cuda.extending import intrinsic

    asm, _, shared_address, check_address, statement = ptx._codegen()
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

    def make_ops(kind, N):
        n = N // 2
        regs = ", ".join(f"${i}" for i in range(n))
        text = ("{ .reg .pred p; setp.ne.b32 p, $%d, 0; wgmma.mma_async.sync.aligned.m64n%dk16.f32.%s.%s {%s}, "
                "$%d, $%d, p, 1, 1, 0, 0; }" % (2 * n + 2, N, kind, kind, regs, 2 * n, 2 * n + 1))

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

        mma.__name__, fence.__name__, wait.__name__ = f"wgmma_m64n{N}k16_{kind}", "wgmma_fence", "wgmma_wait"
        return intrinsic(mma), intrinsic(fence), intrinsic(wait)

    return dict(smem_address=smem_address, make_ops=make_ops,
                wgmma_commit=statement("wgmma_commit", "wgmma.commit_group.sync.aligned;"),
                fence_proxy_async=statement("fence_proxy_async", "fence.proxy.async.shared::cta;"))


_ops_cache: dict = {}


def wgmma_ops(kind, N):
    """(mma, fence, wait) of ``wgmma.mma_async.sync.aligned.m64nNk16.f32.kind.kind`` for kind "f16" or "bf16" and
    N a multiple of 8 up to 256, both operands K-major in shared memory (module docstring)."""
    if kind not in ("f16", "bf16") or N % 8 or not 8 <= N <= 256:
        raise ValueError(f"wgmma m64nNk16 takes kind 'f16' or 'bf16' and N a multiple of 8 up to 256, got "
                         f"{kind!r}, {N}")
    key = (kind, N)
    if key not in _ops_cache:
        _ops_cache[key] = _make_sim_ops(kind, N) if SIMULATOR else _GPU["make_ops"](kind, N)
    return _ops_cache[key]


if SIMULATOR:
    smem_address, wgmma_commit, fence_proxy_async = _sim_smem_address, _sim_commit, _sim_fence_proxy_async
else:
    _GPU = _gpu_intrinsics()
    smem_address, wgmma_commit, fence_proxy_async = (_GPU[n] for n in ("smem_address", "wgmma_commit",
                                                                       "fence_proxy_async"))
    for _name, _stand_in in (("smem_address", _sim_smem_address), ("wgmma_commit", _sim_commit),
                             ("fence_proxy_async", _sim_fence_proxy_async)):
        globals()[_name].__doc__ = _stand_in.__doc__

__all__ = ["desc_bits", "make_desc", "smem_address", "fence_proxy_async", "wgmma_ops", "wgmma_commit"]
