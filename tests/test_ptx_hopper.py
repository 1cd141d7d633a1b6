"""flashnumba.kernels.ptx_hopper: the warpgroup matrix multiply against NumPy and against the layouts its docstring
draws (the descriptor's fields, the core matrices of a K-major operand, the accumulator's fragment).

The same kernels run in the simulator (where they check the stand-ins) and on a GPU of compute capability 9.0
(where they check the real instructions, compiled for sm_90a); elsewhere the GPU tests skip.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
from numba import float32, uint16, uint32, uint64
from numba.cuda.types import float16

from flashnumba._backend import SIMULATOR, cuda
from flashnumba.kernels import ptx, ptx_hopper as hop

LBO, SBO = 128, 256  # bytes: the second 8 columns of K; the next 8 rows (a densely packed K-major tile of K = 16)


def needs_hopper():
    if not SIMULATOR and cuda.get_current_device().compute_capability < (9, 0):
        pytest.skip("wgmma needs compute capability 9.0 (Hopper)")


def test_descriptor_fields():
    """Bits 0-13 the address, 16-29 the leading and 32-45 the stride byte offset, each in 16-byte units; no
    swizzle in bits 62-63."""
    d = hop.desc_bits(0x1230, LBO, SBO)
    assert d & 0x3FFF == 0x123 and (d >> 16) & 0x3FFF == LBO // 16 and (d >> 32) & 0x3FFF == SBO // 16
    assert d >> 62 == 0 and hop._decode(d) == (0x1230, LBO, SBO, 0)
    assert hop._decode(hop.desc_bits(0x3FFF0, 16, 2048)) == (0x3FFF0, 16, 2048, 0)


def core_index(r, k):
    """Element (r, k) of a K-major tile laid out in core matrices (LBO, SBO above), as an element index."""
    return ((r // 8) * SBO + (k // 8) * LBO + (r % 8) * 16 + (k % 8) * 2) // 2


@cuda.jit(device=True)
def store_fragment(d, acc, w, g, t, tiles):
    """D (64 x 8 tiles) from this thread's accumulator registers, in the layout the module docstring draws."""
    for j in range(tiles):
        d[16 * w + g, 8 * j + 2 * t] = acc[4 * j]
        d[16 * w + g, 8 * j + 2 * t + 1] = acc[4 * j + 1]
        d[16 * w + g + 8, 8 * j + 2 * t] = acc[4 * j + 2]
        d[16 * w + g + 8, 8 * j + 2 * t + 1] = acc[4 * j + 3]


@functools.lru_cache(maxsize=None)
def wgmma_kernel(kind, N, regs_a=False, trans_b=False):
    """One warpgroup: A (64 x 16) and B (N x 16) into shared memory in core matrices (B MN-major with
    ``trans_b``; with ``regs_a`` A goes to registers instead, from its bits), D = A B^T issued, then D += A B^T
    chained on the same accumulator, one commit, one wait; D written from the fragments."""
    mma, fence, wait = hop.wgmma_ops(kind, N, regs_a, trans_b)
    NA, NB, NR = 64 * 16, N * 16, N // 2
    NS = NA + NB  # (a shared array's size must be one constant)
    elem = float16 if kind == "f16" else uint16
    LBO_B, SBO_B = (128, 256) if trans_b else (LBO, SBO)  # (MN-major: 8 keys by 8 rows a core matrix)

    @cuda.jit
    def kernel(a, b, d):
        smem = cuda.shared.array(NS, elem)
        tid = cuda.threadIdx.x
        w = tid // 32
        g = (tid % 32) >> 2
        t = tid & 3
        if not regs_a:
            for e in range(tid, NA, 128):
                r = e // 16
                k = e - 16 * r
                smem[((r // 8) * SBO + (k // 8) * LBO + (r % 8) * 16 + (k % 8) * 2) // 2] = a[r, k]
        for e in range(tid, NB, 128):
            r = e // 16
            k = e - 16 * r
            if trans_b:
                smem[NA + ((r // 8) * SBO_B + (k // 8) * LBO_B + (k % 8) * 16 + (r % 8) * 2) // 2] = b[r, k]
            else:
                smem[NA + ((r // 8) * SBO + (k // 8) * LBO + (r % 8) * 16 + (k % 8) * 2) // 2] = b[r, k]
        hop.fence_proxy_async()
        cuda.syncthreads()
        acc = cuda.local.array(NR, float32)
        for i in range(NR):
            acc[i] = 0.0
        db = hop.make_desc(hop.smem_address(smem, NA), LBO_B, SBO_B)
        fence(acc)
        if regs_a:  # (a holds the elements' bits: two to a register, the lower column in the lower half)
            r0 = 16 * w + g
            a0 = uint32(a[r0, 2 * t]) | (uint32(a[r0, 2 * t + 1]) << 16)
            a1 = uint32(a[r0 + 8, 2 * t]) | (uint32(a[r0 + 8, 2 * t + 1]) << 16)
            a2 = uint32(a[r0, 2 * t + 8]) | (uint32(a[r0, 2 * t + 9]) << 16)
            a3 = uint32(a[r0 + 8, 2 * t + 8]) | (uint32(a[r0 + 8, 2 * t + 9]) << 16)
            mma(acc, a0, a1, a2, a3, db, 0)
            mma(acc, a0, a1, a2, a3, db, 1)
        else:
            da = hop.make_desc(hop.smem_address(smem, 0), LBO, SBO)
            mma(acc, da, db, 0)
            mma(acc, da, db, 1)
        hop.wgmma_commit()
        wait(0, acc)
        store_fragment(d, acc, w, g, t, N // 8)

    return kernel


def _bits(x, kind):
    """(what the kernel reads, the values as float64): float16, or bfloat16 as uint16 bits (x exact in it)."""
    if kind == "f16":
        h = x.astype(np.float16)
        return h, h.astype(np.float64)
    f = x.astype(np.float32)
    bits = (f.view(np.uint32) >> 16).astype(np.uint16)
    return bits, (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


def run_wgmma(kind, N, A, B, regs_a=False, trans_b=False):
    needs_hopper()
    a, a64 = _bits(A, kind)
    b, b64 = _bits(B, kind)
    if regs_a:
        a = a.view(np.uint16)
    d = cuda.to_device(np.full((64, N), np.nan, np.float32))
    wgmma_kernel(kind, N, regs_a, trans_b)[1, 128](cuda.to_device(a), cuda.to_device(b), d)
    return d.copy_to_host(), 2 * (a64 @ b64.T)


@pytest.mark.parametrize("kind,N", [("f16", 8), ("f16", 64), ("bf16", 64), ("f16", 256)])
def test_wgmma_integer_inputs_exact(kind, N):
    """Small integers: every product and sum is exact, so D must equal 2 A B^T bit for bit, which checks the
    operands' core-matrix layout, the descriptor and the accumulator fragment all at once."""
    rng = np.random.default_rng(N)
    D, truth = run_wgmma(kind, N, rng.integers(-4, 5, (64, 16)), rng.integers(-4, 5, (N, 16)))
    np.testing.assert_array_equal(D, truth)


@pytest.mark.parametrize("kind,N,regs_a,trans_b", [("f16", 64, True, False), ("bf16", 64, False, True),
                                                    ("f16", 128, True, True), ("bf16", 32, True, True)])
def test_wgmma_a_from_registers_and_mn_major_b_exact(kind, N, regs_a, trans_b):
    """The two forms O += P V takes: A from the threads' registers (the fragment drawn in the module docstring)
    and B MN-major (8 rows of one K column a 16-byte line); exact on small integers, as above."""
    rng = np.random.default_rng(N + 7)
    D, truth = run_wgmma(kind, N, rng.integers(-4, 5, (64, 16)), rng.integers(-4, 5, (N, 16)), regs_a, trans_b)
    np.testing.assert_array_equal(D, truth)


@pytest.mark.parametrize("kind", ["f16", "bf16"])
def test_wgmma_random_inputs(kind):
    rng = np.random.default_rng(3)
    A, B = rng.standard_normal((64, 16)), rng.standard_normal((128, 16))
    D, truth = run_wgmma(kind, 128, A, B)
    a64, b64 = _bits(A, kind)[1], _bits(B, kind)[1]
    # float32 accumulation of 2 x 16 products: a few float32 ulps of the sum of magnitudes
    tol = 33 * np.finfo(np.float32).eps * 2 * (np.abs(a64) @ np.abs(b64).T)
    assert (np.abs(D - truth) <= tol).all(), np.abs(D - truth).max()


@functools.lru_cache(maxsize=None)
def wgmma_tf32_kernel(N, regs_a=False):
    """As :func:`wgmma_kernel` with TF32 operands (float32, K = 8): A (64 x 8) and B (N x 8) K-major in core matrices
    of 8 rows x 4 floats (LBO 128: the second 4 columns; SBO 256: the next 8 rows), or A in registers (one float
    each: rows g, g + 8, columns t, t + 4); D = A B^T, then D += A B^T chained, one commit, one wait."""
    mma, fence, wait = hop.wgmma_ops("tf32", N, regs_a)
    NA, NB, NR = 64 * 8, N * 8, N // 2
    NS = NA + NB  # (a shared array's size must be one constant)

    @cuda.jit
    def kernel(a, b, d):
        smem = cuda.shared.array(NS, float32)
        tid = cuda.threadIdx.x
        w = tid // 32
        g = (tid % 32) >> 2
        t = tid & 3
        if not regs_a:
            for e in range(tid, NA, 128):
                r = e // 8
                k = e - 8 * r
                smem[((r // 8) * 256 + (k // 4) * 128 + (r % 8) * 16 + (k % 4) * 4) // 4] = a[r, k]
        for e in range(tid, NB, 128):
            r = e // 8
            k = e - 8 * r
            smem[NA + ((r // 8) * 256 + (k // 4) * 128 + (r % 8) * 16 + (k % 4) * 4) // 4] = b[r, k]
        hop.fence_proxy_async()
        cuda.syncthreads()
        acc = cuda.local.array(NR, float32)
        for i in range(NR):
            acc[i] = 0.0
        db = hop.make_desc(hop.smem_address(smem, NA), 128, 256)
        fence(acc)
        if regs_a:  # (a holds the float32's bits: one to a register)
            r0 = 16 * w + g
            a0, a1, a2, a3 = a[r0, t], a[r0 + 8, t], a[r0, t + 4], a[r0 + 8, t + 4]
            mma(acc, a0, a1, a2, a3, db, 0)
            mma(acc, a0, a1, a2, a3, db, 1)
        else:
            da = hop.make_desc(hop.smem_address(smem, 0), 128, 256)
            mma(acc, da, db, 0)
            mma(acc, da, db, 1)
        hop.wgmma_commit()
        wait(0, acc)
        store_fragment(d, acc, w, g, t, N // 8)

    return kernel


def run_wgmma_tf32(N, A, B, regs_a=False):
    needs_hopper()
    a, b = (np.ascontiguousarray(x, np.float32) for x in (A, B))
    if regs_a:
        a = a.view(np.uint32)
    d = cuda.to_device(np.full((64, N), np.nan, np.float32))
    wgmma_tf32_kernel(N, regs_a)[1, 128](cuda.to_device(a), cuda.to_device(b), d)
    return d.copy_to_host()


def _truncated_tf32(x):
    """float32 values as the tensor cores read them for TF32 (the lower 13 mantissa bits dropped), float64."""
    return (np.asarray(x, np.float32).view(np.uint32) & np.uint32(0xFFFFE000)).view(np.float32).astype(np.float64)


@pytest.mark.parametrize("N, regs_a", [(8, False), (64, False), (64, True), (256, True)])
def test_wgmma_tf32_exact_and_truncating(N, regs_a):
    """TF32 operands: on small integers D = 2 A B^T bit for bit (the core matrices of 4 floats, the register
    fragment of columns t and t + 4); on random float32 the products are of the operands truncated to TF32 (not
    rounded: against the rounded operands the difference is far above float32's accumulation error)."""
    rng = np.random.default_rng(N + regs_a)
    A, B = rng.integers(-4, 5, (64, 8)).astype(np.float32), rng.integers(-4, 5, (N, 8)).astype(np.float32)
    np.testing.assert_array_equal(run_wgmma_tf32(N, A, B, regs_a), 2 * (A.astype(np.float64) @ B.T))
    A, B = rng.standard_normal((64, 8)).astype(np.float32), rng.standard_normal((N, 8)).astype(np.float32)
    D = run_wgmma_tf32(N, A, B, regs_a)
    a, b = _truncated_tf32(A), _truncated_tf32(B)
    truth = 2 * (a @ b.T)
    tol = 17 * np.finfo(np.float32).eps * 2 * (np.abs(a) @ np.abs(b).T)
    assert (np.abs(D - truth) <= tol).all(), np.abs(D - truth).max()
    exact = 2 * (A.astype(np.float64) @ B.T.astype(np.float64))
    assert np.abs(D - exact).max() > 10 * tol.max()  # (the truncation shows: TF32 keeps 10 mantissa bits)


def test_wgmma_tf32_refuses_an_mn_major_b():
    with pytest.raises(ValueError, match="K-major only"):
        hop.wgmma_ops("tf32", 64, trans_b=True)


def test_the_operand_layout_is_the_documented_one():
    """The stand-in reads element (r, k) of an operand where core_index puts it (the layout the kernels write)."""
    assert [core_index(r, k) for r, k in ((0, 0), (0, 7), (0, 8), (1, 0), (7, 15), (8, 0), (9, 9))] == [
        0, 7, 64, 8, 56 + 64 + 7, 128, 128 + 8 + 64 + 1]


@pytest.mark.skipif(not SIMULATOR, reason="the stand-in's own behaviour")
def test_the_accumulator_reads_nan_until_the_wait():
    """In the simulator a thread that reads its accumulator between the wgmma and the wait reads NaN (on the GPU
    the registers are being written asynchronously: what it reads is undefined)."""
    mma, fence, wait = hop.wgmma_ops("f16", 8)

    @cuda.jit
    def early(a, out):
        smem = cuda.shared.array(64 * 16 + 8 * 16, float16)
        tid = cuda.threadIdx.x
        for e in range(tid, 64 * 16 + 8 * 16, 128):
            smem[e] = 1.0
        cuda.syncthreads()
        acc = cuda.local.array(4, float32)
        for i in range(4):
            acc[i] = 0.0
        da = hop.make_desc(hop.smem_address(smem, 0), LBO, SBO)
        db = hop.make_desc(hop.smem_address(smem, 64 * 16), LBO, SBO)
        fence(acc)
        mma(acc, da, db, 0)
        out[tid, 0] = acc[0]
        hop.wgmma_commit()
        wait(0, acc)
        out[tid, 1] = acc[0]

    out = np.zeros((128, 2), np.float32)
    early[1, 128](np.zeros(1, np.float32), out)
    assert np.isnan(out[:, 0]).all() and (out[:, 1] == 16).all()


@cuda.jit
def setmaxnreg_kernel(out):
    """(Compiled only.) Warpgroup 0 gives registers back, warpgroup 1 takes more: a producer and a consumer."""
    if cuda.threadIdx.x < 128:
        hop.setmaxnreg_dec(40)
    else:
        hop.setmaxnreg_inc(232)
    out[cuda.threadIdx.x] = 1.0


COMPILE = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
import test_ptx_hopper as t
from flashnumba import _launch
from numba import cuda
out = {}
for name, sig in (("bulk_copy_kernel", "void(float32[:, ::1], float32[:, ::1])"), ("elect_kernel", "void(uint32[::1])"),
                  ("setmaxnreg_kernel", "void(float32[::1])"),
                  ("producer_consumer_kernel", "void(float32[::1], float32[:, ::1])"),
                  ("ping_pong_kernel", "void(uint32[::1])"),
                  ("tma_kernel",
                   "void(uint64[:, ::1], int32[:, ::1], float16[::1], float32[:, ::1], float32[:, ::1])")):
    fn = getattr(t, name)
    fn = fn(128) if name == "tma_kernel" else fn
    ptx = _launch.compile_ptx(fn.py_func, sig, (9, 0, "a"))
    out[name] = dict(ptx=ptx, log=_launch.assemble(ptx, (9, 0, "a"))[1])
for kind, N, ra, tb in (("f16", 64, False, False), ("bf16", 256, False, False), ("f16", 128, True, True),
                        ("tf32", 64, False, False), ("tf32", 128, True, False)):
    el = {"f16": "float16", "bf16": "uint16", "tf32": "float32"}[kind]
    sig = f"void({('uint32' if kind == 'tf32' else 'uint16') if ra else el}[:, ::1], {el}[:, ::1], float32[:, ::1])"
    fn = t.wgmma_tf32_kernel(N, ra) if kind == "tf32" else t.wgmma_kernel(kind, N, ra, tb)
    ptx = _launch.compile_ptx(fn.py_func, sig, (9, 0, "a"))
    out[f"{kind}-{N}-{int(ra)}{int(tb)}"] = dict(ptx=ptx, log=_launch.assemble(ptx, (9, 0, "a"))[1])
print(json.dumps(out))
"""


def test_wgmma_compiles_for_sm90a():
    """The kernels above compile for the architecture-specific target without a GPU (the simulator runs them as
    Python, where a construct NVVM or ptxas refuses would pass unnoticed): the PTX holds the instructions, and the
    assembler keeps the accumulators in registers (no local memory, no spills) and does not serialise the wgmma."""
    pytest.importorskip("cuda.bindings.nvjitlink")
    import os

    from conftest import compile_offline

    compiled = compile_offline(COMPILE, os.path.dirname(__file__))
    for name, needles in (("bulk_copy_kernel", ["mbarrier.init.shared::cta.b64", "mbarrier.arrive.expect_tx",
                                                "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes",
                                                "mbarrier.try_wait.parity.shared::cta.b64"]),
                          ("elect_kernel", ["elect.sync"]),
                          ("setmaxnreg_kernel", ["setmaxnreg.dec.sync.aligned.u32 40",
                                                 "setmaxnreg.inc.sync.aligned.u32 232"]),
                          ("producer_consumer_kernel", ["cp.async.mbarrier.arrive.noinc.shared::cta.b64"]),
                          ("ping_pong_kernel", ["bar.sync", "bar.arrive"]),
                          ("tma_kernel", ["fence.mbarrier_init.release.cluster",
                                          "fence.proxy.tensormap::generic.acquire.sys",
                                          "cp.async.bulk.tensor.4d.shared::cluster.global.tile"])):
        for needle in needles:
            assert needle in compiled[name]["ptx"], f"{name}: no {needle!r} in its PTX"
    for name, r in compiled.items():
        if "-" not in name:
            continue
        kind, N, _ = name.split("-")
        assert ".target sm_90a" in r["ptx"]
        k = 8 if kind == "tf32" else 16
        for needle in (f"wgmma.mma_async.sync.aligned.m64n{N}k{k}.f32.{kind}.{kind}", "wgmma.fence.sync.aligned",
                       "wgmma.commit_group.sync.aligned", "wgmma.wait_group.sync.aligned 0",
                       "fence.proxy.async.shared::cta"):
            assert needle in r["ptx"], f"{name}: no {needle!r} in its PTX"
        assert "0 bytes spill stores" in r["log"] and "0 bytes lmem" in r["log"], r["log"][-800:]
        assert "serialized" not in r["log"], r["log"][-800:]


# ---------------------------------------------------------------------------------------------------------------
# mbarrier, the bulk copy, elect, setmaxnreg
# ---------------------------------------------------------------------------------------------------------------

@cuda.jit
def bulk_copy_kernel(src, out):
    """Two phases of one mbarrier: an elected thread expects 1 KB and issues the bulk copy of one row of src into
    shared memory; every thread waits for the phase (parity 0, then 1) and copies the row out."""
    data = cuda.shared.array(256, float32)
    bar = cuda.shared.array(1, uint64)
    tid = cuda.threadIdx.x
    b = hop.smem_address(bar, 0)
    d = hop.smem_address(data, 0)
    if tid == 0:
        hop.mbarrier_init(b, 1)
    cuda.syncthreads()
    for phase in range(2):
        if tid == 0:
            hop.fence_proxy_async()  # (the reads of the phase before, then the copy's writes)
            hop.mbarrier_arrive_expect_tx(b, 1024)
            hop.cp_async_bulk(d, src, 256 * phase, 1024, b)
        while hop.mbarrier_try_wait(b, phase) == 0:
            pass
        for e in range(tid, 256, cuda.blockDim.x):
            out[phase, e] = data[e]
        cuda.syncthreads()


def test_bulk_copies_land_in_the_phase_they_complete():
    needs_hopper()
    src = np.arange(512, dtype=np.float32).reshape(2, 256)
    out = cuda.to_device(np.full((2, 256), np.nan, np.float32))
    bulk_copy_kernel[1, 64](cuda.to_device(src), out)
    np.testing.assert_array_equal(out.copy_to_host(), src)


@cuda.jit
def elect_kernel(out):
    out[cuda.threadIdx.x] = hop.elect_one()


def test_elect_one_picks_one_lane_a_warp():
    needs_hopper()
    out = cuda.to_device(np.zeros(128, np.uint32))
    elect_kernel[1, 128](out)
    got = out.copy_to_host().reshape(4, 32)
    assert (got.sum(axis=1) == 1).all(), got


@pytest.mark.skipif(not SIMULATOR, reason="the stand-in's own behaviour")
def test_a_phase_waits_for_every_expected_byte():
    """The stand-in's barrier: an arrival that expects bytes not yet copied leaves the phase open (try_wait 0),
    and the copy that brings them completes it (try_wait 1 for parity 0, then 0 for parity 1)."""

    @cuda.jit
    def phases(src, out):
        data = cuda.shared.array(8, float32)
        bar = cuda.shared.array(1, uint64)
        b = hop.smem_address(bar, 0)
        hop.mbarrier_init(b, 1)
        hop.mbarrier_arrive_expect_tx(b, 32)
        out[0] = hop.mbarrier_try_wait(b, 0)
        hop.cp_async_bulk(hop.smem_address(data, 0), src, 0, 32, b)
        out[1] = hop.mbarrier_try_wait(b, 0)
        out[2] = hop.mbarrier_try_wait(b, 1)
        out[3] = data[7]

    out = np.zeros(4, np.float32)
    phases[1, 1](np.arange(8, dtype=np.float32), out)
    assert out.tolist() == [0, 1, 0, 7]


# ---------------------------------------------------------------------------------------------------------------
# a producer warp's cp.async completing on an mbarrier; two warpgroups taking turns on named barriers
# ---------------------------------------------------------------------------------------------------------------

@cuda.jit
def producer_consumer_kernel(src, out):
    """Warp 0 copies each 128-float row of src into one shared buffer with cp.async and arrives on ``full`` when
    its copies land; warps 1-3 wait for that phase, copy the buffer out, and arrive on ``empty``, which the
    producer waits for before the next row: four rounds through one buffer, no syncthreads in the loop."""
    data = cuda.shared.array(128, float32)
    bars = cuda.shared.array(2, uint64)
    tid = cuda.threadIdx.x
    full = hop.smem_address(bars, 0)
    empty = hop.smem_address(bars, 1)
    if tid == 0:
        hop.mbarrier_init(full, 32)  # the producer warp's 32 threads
        hop.mbarrier_init(empty, 96)  # the consumers
    cuda.syncthreads()
    for it in range(4):
        if tid < 32:
            if it > 0:
                while hop.mbarrier_try_wait(empty, (it - 1) & 1) == 0:
                    pass
            ptx.cp_async_16(data, 4 * tid, src, 128 * it + 4 * tid)
            hop.cp_async_mbarrier_arrive(full)
        else:
            while hop.mbarrier_try_wait(full, it & 1) == 0:
                pass
            for e in range(tid - 32, 128, 96):
                out[it, e] = data[e]
            hop.mbarrier_arrive(empty)


def test_cp_async_arrives_on_an_mbarrier_when_its_copies_land():
    needs_hopper()
    src = np.arange(512, dtype=np.float32)
    out = cuda.to_device(np.full((4, 128), np.nan, np.float32))
    producer_consumer_kernel[1, 128](cuda.to_device(src), out)
    np.testing.assert_array_equal(out.copy_to_host(), src.reshape(4, 128))


@cuda.jit
def ping_pong_kernel(out):
    """Two warpgroups take turns on named barriers 1 and 2: warpgroup 0 writes turn 0, lets warpgroup 1 go
    (arrive on 2) and waits for its own turn (sync on 1), and so on; the shared log must read 0, 1, 2, ..."""
    log = cuda.shared.array(8, uint32)
    n = cuda.shared.array(1, uint32)
    tid = cuda.threadIdx.x
    wg = tid // 128
    if tid == 0:
        n[0] = 0
    cuda.syncthreads()
    for turn in range(4):
        if wg == 1:
            hop.named_barrier_sync(2, 256)  # warpgroup 0's turn before this one is done
        if tid % 128 == 0:
            log[n[0]] = 2 * turn + wg
            n[0] += 1
        cuda.threadfence_block()
        if wg == 0:
            hop.named_barrier_arrive(2, 256)  # warpgroup 1's turn
            hop.named_barrier_sync(1, 256)  # and back
        else:
            hop.named_barrier_arrive(1, 256)
    cuda.syncthreads()
    if tid < 8:
        out[tid] = log[tid]


def test_two_warpgroups_take_turns_on_named_barriers():
    needs_hopper()
    out = cuda.to_device(np.zeros(8, np.uint32))
    ping_pong_kernel[1, 256](out)
    assert out.copy_to_host().tolist() == [0, 1, 2, 3, 4, 5, 6, 7]


# ---------------------------------------------------------------------------------------------------------------
# tensor-map copies and the 128-byte swizzle
# ---------------------------------------------------------------------------------------------------------------

TMA_ROWS = 64  # rows of a box
TMA_SMEM = TMA_ROWS * (64 + 128) + 512  # 16-bit elements: A and B (below), room to start them on 1024 bytes
_mma_k64, _fence_k64, _wait_k64 = hop.wgmma_ops("f16", 64)
_mma_mn128, _fence_mn128, _wait_mn128 = hop.wgmma_ops("f16", 128, trans_b=True)


@functools.lru_cache(maxsize=None)
def tma_kernel(span):
    """One warpgroup; rows of ``span`` bytes (E = span / 2 head dims), swizzled. Thread 0 copies with one tensor
    map a box of TMA_ROWS rows x E head dims for A (head dims 0 .. E - 1 at coords[0]) and the 128 / E boxes of B
    (head dims 0 .. 127 at coords[1]) into a 1024-byte aligned tile A | B, counted on one mbarrier. Then raw: the
    shared bytes as they landed (the swizzle); d_k: A[:, 16:32] B[:, E + 16:E + 32]^T (K-major: both operands 32
    bytes into their rows, B's second box; N = 64 rows of B); d_mn: A[:, 0:16] B[16:32, :] (B MN-major: N = 128
    head dims over B's boxes, LBO between them; K = keys 16-31, 16 rows in)."""
    E, NB = span // 2, 128 // (span // 2)
    mode = hop.SWIZZLE_MODES[span]
    TOTAL = TMA_ROWS * (E + 128)

    @cuda.jit
    def kernel(maps, coords, raw, d_k, d_mn):
        smem = cuda.shared.array(TMA_SMEM, float16)
        bar = cuda.shared.array(1, uint64)
        tid = cuda.threadIdx.x
        base = ((1024 - (hop.smem_address(smem, 0) & 1023)) & 1023) >> 1
        b = hop.smem_address(bar, 0)
        if tid == 0:
            hop.mbarrier_init(b, 1)
            hop.fence_mbarrier_init()
        cuda.syncthreads()
        if tid == 0:
            hop.fence_tensormap(maps, 0)
            hop.mbarrier_arrive_expect_tx(b, 2 * TOTAL)
            hop.tma_load_4d(hop.smem_address(smem, base), maps, 0, 0, coords[0, 1], coords[0, 2], coords[0, 3], b)
            for part in range(NB):
                hop.tma_load_4d(hop.smem_address(smem, base + TMA_ROWS * E * (1 + part)), maps, 0, E * part,
                                coords[1, 1], coords[1, 2], coords[1, 3], b)
        while hop.mbarrier_try_wait(b, 0) == 0:
            pass
        for e in range(tid, TOTAL, 128):
            raw[e] = smem[base + e]
        a_addr = hop.smem_address(smem, base)
        b_addr = hop.smem_address(smem, base + TMA_ROWS * E)
        acc = cuda.local.array(32, float32)
        for i in range(32):
            acc[i] = 0.0
        _fence_k64(acc)
        _mma_k64(acc, hop.make_desc_swizzled(a_addr + 32, 16, 8 * span, mode),
                 hop.make_desc_swizzled(b_addr + TMA_ROWS * span + 32, 16, 8 * span, mode), 0)
        hop.wgmma_commit()
        _wait_k64(0, acc)
        w, g, t = tid // 32, (tid % 32) >> 2, tid & 3
        for j in range(8):
            for x in range(4):
                d_k[16 * w + g + 8 * (x >> 1), 8 * j + 2 * t + (x & 1)] = acc[4 * j + x]
        acc2 = cuda.local.array(64, float32)
        for i in range(64):
            acc2[i] = 0.0
        _fence_mn128(acc2)
        _mma_mn128(acc2, hop.make_desc_swizzled(a_addr, 16, 8 * span, mode),
                   hop.make_desc_swizzled(b_addr + 16 * span, TMA_ROWS * span, 8 * span, mode), 0)
        hop.wgmma_commit()
        _wait_mn128(0, acc2)
        for j in range(16):
            for x in range(4):
                d_mn[16 * w + g + 8 * (x >> 1), 8 * j + 2 * t + (x & 1)] = acc2[4 * j + x]

    return kernel


@pytest.mark.parametrize("span", [128, 64])
def test_tensor_map_copies_land_swizzled_and_wgmma_reads_them(span):
    """A box lands as rows of ``span`` bytes, chunk c of row r at the swizzle's place (c ^ (r % 8) for 128 bytes,
    c ^ ((r // 2) % 4) for 64), zeros past the tensor's rows (rows 40 .. 103 of 100); wgmma reads such tiles
    K-major from 32 bytes into their rows and MN-major across several boxes of head dims (the Hopper forward's
    S = Q K^T and O += P V): exact on small integers."""
    needs_hopper()
    from flashnumba import _tensormap

    E = span // 2
    rng = np.random.default_rng(11)
    x = rng.integers(-4, 5, (2, 100, 3, 128)).astype(np.float16)  # (batch, seqlen, nheads, head_dim)
    coords = np.array([[0, 1, 40, 1], [0, 2, 10, 0]], np.int32)  # (dim, head, row, batch), innermost first
    dx = cuda.to_device(x)
    if SIMULATOR:
        maps = _tensormap.sim_maps([(dx, TMA_ROWS, span)])
    else:
        maps = _tensormap.device_maps([(dx.device_ctypes_pointer.value, x.shape, TMA_ROWS, span)], 0)
        maps = cuda.from_cuda_array_interface(dict(shape=(1, hop.MAP_WORDS), typestr="<u8", data=(maps, False),
                                                   version=3, strides=None), owner=None, sync=False)
    raw = cuda.to_device(np.full(TMA_ROWS * (E + 128), np.nan, np.float16))
    d_k, d_mn = (cuda.to_device(np.full((64, n), np.nan, np.float32)) for n in (64, 128))
    tma_kernel(span)[1, 128](maps, cuda.to_device(coords), raw, d_k, d_mn)
    a = np.zeros((TMA_ROWS, E))
    a[:60] = x[1, 40:100, 1, :E]  # (rows 100 .. 103 past the tensor: zeros)
    bt = x[0, 10:10 + TMA_ROWS, 2, :].astype(np.float64)  # 64 keys x 128 head dims
    tiles = np.concatenate([a] + [bt[:, E * p:E * p + E] for p in range(128 // E)])  # the boxes, row after row
    want = np.empty(tiles.size)
    at = hop.swizzle(np.arange(tiles.size) * 2, span) // 2  # element e of the rows lands at element at[e]
    want[at] = tiles.reshape(-1)
    np.testing.assert_array_equal(raw.copy_to_host().astype(np.float64), want)
    np.testing.assert_array_equal(d_k.copy_to_host(), a[:, 16:32] @ bt[:, E + 16:E + 32].T)
    np.testing.assert_array_equal(d_mn.copy_to_host(), a[:, :16] @ bt[16:32, :])
