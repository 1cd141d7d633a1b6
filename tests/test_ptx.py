"""flashnumba.ptx: each instruction against NumPy and against the fragment layout its docstring draws.

The same kernels run in the simulator (where they check the stand-ins) and on a GPU (where they check the real
instructions); the expected values are built here, from the documented layout, with plain loops. The last test
compiles these kernels for sm_90 without a GPU and checks that the PTX holds the instructions.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from flashnumba.kernels import ptx
from flashnumba._backend import cuda
from numba import float32, uint16

LANES = np.arange(32)


def groups(lane):
    """(groupID, threadID_in_group) of a lane, as in the PTX ISA's fragment figures."""
    return lane >> 2, lane & 3


def packed(lo_bits, hi_bits):
    """One uint32 register from two 16-bit patterns, the lower index in bits 0-15."""
    return np.uint32(int(lo_bits) | (int(hi_bits) << 16))


# ---------------------------------------------------------------------------------------------------------------
# bfloat16 on the host, rounded to nearest even by choosing the nearer of the two neighbouring bf16 values
# ---------------------------------------------------------------------------------------------------------------

def bf16_bits(x):
    """bfloat16 bit patterns of float32 values (round to nearest, ties to even; overflow to inf)."""
    x = np.asarray(x, np.float32)
    out = np.empty(x.shape, np.uint16)
    for idx, v in np.ndenumerate(x):
        u = int(np.float32(v).view(np.uint32))
        sign, mag = u & 0x80000000, u & 0x7FFFFFFF
        if mag > 0x7F800000:  # NaN
            out[idx] = 0x7FFF
            continue
        down = mag & 0x7FFF0000  # the bf16 below (toward zero)
        exponent = max(down >> 23, 1)
        ulp = 2.0 ** (exponent - 127 - 7)  # spacing of bf16 values at this exponent (also past the largest)
        below = float(np.uint32(down).view(np.float32))
        rest = float(np.uint32(mag).view(np.float32)) - below if mag < 0x7F800000 else 0.0
        up = rest > ulp / 2 or (rest == ulp / 2 and (down >> 16) & 1)
        out[idx] = ((down >> 16) + up) | (sign >> 16)
    return out


def bf16_value(bits):
    return (np.asarray(bits, np.uint32) << 16).view(np.float32)


# ---------------------------------------------------------------------------------------------------------------
# Kernels
# ---------------------------------------------------------------------------------------------------------------

def make_mma_kernel(mma):
    """One warp: each lane gathers its A, B, C registers from global memory per the documented layout."""

    @cuda.jit
    def mma_kernel(A, B, C, D):  # A (16, 16), B (16, 8): 16-bit patterns; C, D (16, 8) float32
        lane = cuda.threadIdx.x
        g = lane >> 2
        t = lane & 3
        a0 = int(A[g, 2 * t]) | (int(A[g, 2 * t + 1]) << 16)
        a1 = int(A[g + 8, 2 * t]) | (int(A[g + 8, 2 * t + 1]) << 16)
        a2 = int(A[g, 2 * t + 8]) | (int(A[g, 2 * t + 9]) << 16)
        a3 = int(A[g + 8, 2 * t + 8]) | (int(A[g + 8, 2 * t + 9]) << 16)
        b0 = int(B[2 * t, g]) | (int(B[2 * t + 1, g]) << 16)
        b1 = int(B[2 * t + 8, g]) | (int(B[2 * t + 9, g]) << 16)
        d0, d1, d2, d3 = mma(a0, a1, a2, a3, b0, b1, C[g, 2 * t], C[g, 2 * t + 1], C[g + 8, 2 * t],
                             C[g + 8, 2 * t + 1])
        D[g, 2 * t] = d0
        D[g, 2 * t + 1] = d1
        D[g + 8, 2 * t] = d2
        D[g + 8, 2 * t + 1] = d3

    return mma_kernel


mma_f16_kernel = make_mma_kernel(ptx.mma_m16n8k16_f16)
mma_bf16_kernel = make_mma_kernel(ptx.mma_m16n8k16_bf16)


@cuda.jit
def ldmatrix_kernel(src, addr, out, out_trans):  # src (512,) uint16; addr (32,) int32; out* (32, 4) uint32
    tile = cuda.shared.array(512, uint16)  # (32, 16) 16-bit patterns, shared
    lane = cuda.threadIdx.x
    for j in range(16):
        tile[lane * 16 + j] = src[lane * 16 + j]
    cuda.syncthreads()  # the whole tile is written before any lane's ldmatrix reads rows of others
    r0, r1, r2, r3 = ptx.ldmatrix_x4(tile, addr[lane])
    out[lane, 0] = r0
    out[lane, 1] = r1
    out[lane, 2] = r2
    out[lane, 3] = r3
    r0, r1, r2, r3 = ptx.ldmatrix_x4_trans(tile, addr[lane])
    out_trans[lane, 0] = r0
    out_trans[lane, 1] = r1
    out_trans[lane, 2] = r2
    out_trans[lane, 3] = r3


WARPS_PER_BLOCK = 2


@cuda.jit
def gemm_16x16x16_kernel(AB, D):  # AB (n, 512) float16 bits: A (16, 16) then B (16, 16), row-major; D (n, 16, 16)
    tile = cuda.shared.array((WARPS_PER_BLOCK, 512), uint16)  # per warp: A at 0..255, B at 256..511, shared
    warp = cuda.threadIdx.x // 32
    lane = cuda.threadIdx.x % 32
    n = cuda.blockIdx.x * WARPS_PER_BLOCK + warp  # the product this warp computes
    for j in range(16):
        tile[warp, lane * 16 + j] = AB[n, lane * 16 + j]
    cuda.syncthreads()  # A and B are in shared memory before ldmatrix reads them
    # lane l points at row l % 16, column 8 * (l // 16): the four 8x8 quadrants, top-left, bottom-left, ...
    row_start = warp * 512 + (lane % 16) * 16 + 8 * (lane // 16)  # element index into the whole tile array
    a0, a1, a2, a3 = ptx.ldmatrix_x4(tile, row_start)  # the A fragment
    b0, b1, b2, b3 = ptx.ldmatrix_x4_trans(tile, 256 + row_start)  # B fragments of columns 0..7 and 8..15
    zero = float32(0.0)
    # D[:, 0:8] = A B[:, 0:8];  D[:, 8:16] = A B[:, 8:16]
    d0, d1, d2, d3 = ptx.mma_m16n8k16_f16(a0, a1, a2, a3, b0, b1, zero, zero, zero, zero)
    e0, e1, e2, e3 = ptx.mma_m16n8k16_f16(a0, a1, a2, a3, b2, b3, zero, zero, zero, zero)
    g = lane >> 2
    t = lane & 3
    D[n, g, 2 * t] = d0
    D[n, g, 2 * t + 1] = d1
    D[n, g + 8, 2 * t] = d2
    D[n, g + 8, 2 * t + 1] = d3
    D[n, g, 2 * t + 8] = e0
    D[n, g, 2 * t + 9] = e1
    D[n, g + 8, 2 * t + 8] = e2
    D[n, g + 8, 2 * t + 9] = e3


@cuda.jit
def cp_async_kernel(src, first, second):  # src (256,) float32; first, second (128,) float32
    tile = cuda.shared.array(256, float32)  # (2, 32 lanes, 4) float32, shared
    lane = cuda.threadIdx.x
    ptx.cp_async_16(tile, lane * 4, src, lane * 4)  # group 0: src[0:128]
    ptx.cp_async_commit()
    ptx.cp_async_16(tile, 128 + lane * 4, src, 128 + lane * 4)  # group 1: src[128:256]
    ptx.cp_async_commit()
    ptx.cp_async_wait(1)  # this lane's group 0 has landed (group 1 may still be in flight)
    cuda.syncthreads()  # ... and so has every lane's: read a neighbour's 16 bytes
    other = (lane + 1) % 32
    for j in range(4):
        first[other * 4 + j] = tile[other * 4 + j]
    ptx.cp_async_wait_all()  # group 1 too
    cuda.syncthreads()  # every lane's group 1 has landed
    for j in range(4):
        second[other * 4 + j] = tile[128 + other * 4 + j]


def make_pack_kernel(pack):
    @cuda.jit
    def pack_kernel(lo, hi, out):  # lo, hi, out (n,): float32, float32, uint32
        i = cuda.grid(1)
        if i < out.size:
            out[i] = pack(lo[i], hi[i])

    return pack_kernel


pack_f16_kernel = make_pack_kernel(ptx.pack_f16x2)
pack_bf16_kernel = make_pack_kernel(ptx.pack_bf16x2)


@cuda.jit
def store_pairs_kernel(out, words):  # out (2, 3, 4, 8): 16-bit elements; words (48,): uint32
    i = cuda.grid(1)
    if i < words.size:  # word i: row i // 4 of out's last axis, columns 2 (i % 4) and 2 (i % 4) + 1
        ptx.st_global_b32(out, 2 * i, words[i])

# Every kernel above with its argument types, for the offline sm_90 compile
SIGNATURES = {  # C-contiguous arrays, as a launch with contiguous device arrays types them
    "mma_f16_kernel": "void(uint16[:, ::1], uint16[:, ::1], float32[:, ::1], float32[:, ::1])",
    "mma_bf16_kernel": "void(uint16[:, ::1], uint16[:, ::1], float32[:, ::1], float32[:, ::1])",
    "ldmatrix_kernel": "void(uint16[::1], int32[::1], uint32[:, ::1], uint32[:, ::1])",
    "gemm_16x16x16_kernel": "void(uint16[:, ::1], float32[:, :, ::1])",
    "cp_async_kernel": "void(float32[::1], float32[::1], float32[::1])",
    "pack_f16_kernel": "void(float32[::1], float32[::1], uint32[::1])",
    "pack_bf16_kernel": "void(float32[::1], float32[::1], uint32[::1])",
    "store_pairs_kernel": "void(float16[:, :, :, ::1], uint32[::1])",
    "shfl_kernel": "void(float32[:, ::1], float32[:, ::1])",
    "tf32_kernel": "void(float32[::1], uint32[::1], uint32[::1], uint32[::1])",
    "mma_tf32_kernel": "void(float32[:, ::1], float32[:, ::1], float32[:, ::1], float32[:, ::1])",
}


# ---------------------------------------------------------------------------------------------------------------
# mma.sync
# ---------------------------------------------------------------------------------------------------------------

def run_mma(dtype, A, B, C):
    """D from the kernel, and A, B as the 16-bit values it was given (float64)."""
    if dtype == "float16":
        A_bits, B_bits = A.astype(np.float16).view(np.uint16), B.astype(np.float16).view(np.uint16)
        A16, B16 = A_bits.view(np.float16), B_bits.view(np.float16)
        kernel = mma_f16_kernel
    else:
        A_bits, B_bits = bf16_bits(A), bf16_bits(B)
        A16, B16 = bf16_value(A_bits), bf16_value(B_bits)
        kernel = mma_bf16_kernel
    D = np.full((16, 8), np.nan, np.float32)
    D_dev = cuda.to_device(D)
    kernel[1, 32](cuda.to_device(A_bits), cuda.to_device(B_bits), cuda.to_device(C.astype(np.float32)), D_dev)
    return D_dev.copy_to_host(), A16.astype(np.float64), B16.astype(np.float64)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_mma_integer_inputs_exact(dtype):
    rng = np.random.default_rng(0)
    A = rng.integers(-8, 9, (16, 16)).astype(np.float32)
    B = rng.integers(-8, 9, (16, 8)).astype(np.float32)
    C = rng.integers(-100, 101, (16, 8)).astype(np.float32)
    D, _, _ = run_mma(dtype, A, B, C)
    np.testing.assert_array_equal(D, A.astype(np.float64) @ B + C)  # every partial sum is a small integer


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_mma_random_inputs(dtype):
    rng = np.random.default_rng(1)
    A = rng.standard_normal((16, 16)).astype(np.float32)
    B = rng.standard_normal((16, 8)).astype(np.float32)
    C = rng.standard_normal((16, 8)).astype(np.float32)
    D, A16, B16 = run_mma(dtype, A, B, C)
    truth = A16 @ B16 + C  # the products of the rounded inputs, in float64
    # float32 accumulation of 17 terms: a few ulps of float32 per term, relative to the sum of magnitudes
    tol = 17 * np.finfo(np.float32).eps * (np.abs(A16) @ np.abs(B16) + np.abs(C))
    assert (np.abs(D - truth) <= tol).all(), np.abs(D - truth).max()


def test_ldmatrix_then_mma_is_a_16x16x16_gemm():
    """Two blocks of two warps, each warp its own product: the warps of a block do not mix their lanes."""
    rng = np.random.default_rng(2)
    n = 2 * WARPS_PER_BLOCK
    A = rng.integers(-8, 9, (n, 16, 16)).astype(np.float16)
    B = rng.integers(-8, 9, (n, 16, 16)).astype(np.float16)
    AB = np.concatenate([A.reshape(n, -1), B.reshape(n, -1)], axis=1).view(np.uint16)
    D = cuda.to_device(np.full((n, 16, 16), np.nan, np.float32))
    gemm_16x16x16_kernel[2, 32 * WARPS_PER_BLOCK](cuda.to_device(AB), D)
    np.testing.assert_array_equal(D.copy_to_host(), A.astype(np.float64) @ B.astype(np.float64))


# ---------------------------------------------------------------------------------------------------------------
# ldmatrix
# ---------------------------------------------------------------------------------------------------------------

def test_ldmatrix_x4_and_trans_follow_the_documented_layout():
    rng = np.random.default_rng(3)
    src = rng.permutation(512).astype(np.uint16)  # every element different: a misplaced one shows
    # each lane points at a random 16-byte aligned row: row r of the (32, 16) tile, first or second half
    addr = (rng.permutation(32) * 16 + 8 * rng.integers(0, 2, 32)).astype(np.int32)
    out = cuda.to_device(np.zeros((32, 4), np.uint32))
    out_trans = cuda.to_device(np.zeros((32, 4), np.uint32))
    ldmatrix_kernel[1, 32](cuda.to_device(src), cuda.to_device(addr), out, out_trans)
    rows = [src[a:a + 8] for a in addr]  # the row each lane pointed at
    expect = np.zeros((32, 4), np.uint32)
    expect_trans = np.zeros((32, 4), np.uint32)
    for lane in LANES:
        g, t = groups(lane)
        for i in range(4):
            M = rows[8 * i:8 * i + 8]  # matrix i: the rows lanes 8i .. 8i+7 pointed at
            expect[lane, i] = packed(M[g][2 * t], M[g][2 * t + 1])
            expect_trans[lane, i] = packed(M[2 * t][g], M[2 * t + 1][g])
    np.testing.assert_array_equal(out.copy_to_host(), expect)
    np.testing.assert_array_equal(out_trans.copy_to_host(), expect_trans)


# ---------------------------------------------------------------------------------------------------------------
# cp.async
# ---------------------------------------------------------------------------------------------------------------

def test_cp_async_copies_land_after_wait():
    src = np.arange(256, dtype=np.float32) * 1.5 - 7
    first = cuda.to_device(np.full(128, np.nan, np.float32))
    second = cuda.to_device(np.full(128, np.nan, np.float32))
    cp_async_kernel[1, 32](cuda.to_device(src), first, second)
    np.testing.assert_array_equal(first.copy_to_host(), src[:128])
    np.testing.assert_array_equal(second.copy_to_host(), src[128:])


# ---------------------------------------------------------------------------------------------------------------
# Packing two float32 into f16x2 / bf16x2
# ---------------------------------------------------------------------------------------------------------------

def rounding_cases():
    """float32 values that exercise round-to-nearest-even in float16 and bfloat16, plus random ones."""
    f16_ulp_at_1, bf16_ulp_at_1 = 2.0**-10, 2.0**-7
    special = [0.0, -0.0, 1.0, -2.5, np.inf, -np.inf, 65504.0, 65519.0, 65520.0, 1e30, -3.4e38, 3.4028235e38,
               2.0**-24, 2.0**-25, 3 * 2.0**-26, 2.0**-130, 1e-40, 6e-8]
    for ulp in (f16_ulp_at_1, bf16_ulp_at_1):  # ties, either side of ties, at 1 and at 1 + ulp
        for base in (1.0, 1.0 + ulp):
            special += [base + ulp / 2, base + ulp / 2 * (1 + 2.0**-12), base + ulp / 2 * (1 - 2.0**-12)]
    special += [-x for x in special]
    rng = np.random.default_rng(4)
    randoms = list(rng.standard_normal(200) * 10.0 ** rng.integers(-6, 6, 200))
    return np.array(special + randoms, np.float32)


def run_pack(kernel, x):
    lo, hi = x, x[::-1].copy()
    out = cuda.to_device(np.zeros(x.size, np.uint32))
    kernel[(x.size + 63) // 64, 64](cuda.to_device(lo), cuda.to_device(hi), out)
    out = out.copy_to_host()
    return lo, hi, (out & 0xFFFF).astype(np.uint16), (out >> 16).astype(np.uint16)


def test_pack_f16x2_rounds_like_numpy_float16():
    lo, hi, got_lo, got_hi = run_pack(pack_f16_kernel, rounding_cases())
    with np.errstate(over="ignore"):  # NumPy rounds to nearest even, and overflows to inf on purpose here
        np.testing.assert_array_equal(got_lo, lo.astype(np.float16).view(np.uint16))
        np.testing.assert_array_equal(got_hi, hi.astype(np.float16).view(np.uint16))


def test_pack_bf16x2_rounds_to_nearest_even():
    lo, hi, got_lo, got_hi = run_pack(pack_bf16_kernel, rounding_cases())
    np.testing.assert_array_equal(got_lo, bf16_bits(lo))
    np.testing.assert_array_equal(got_hi, bf16_bits(hi))


@pytest.mark.parametrize("kernel, exponent_mask", [(pack_f16_kernel, 0x7C00), (pack_bf16_kernel, 0x7F80)])
def test_pack_keeps_nan(kernel, exponent_mask):
    _, _, got_lo, got_hi = run_pack(kernel, np.array([np.nan, 1.0, -np.nan], np.float32))
    for bits in (got_lo[[0, 2]], got_hi[[0, 2]]):
        mantissa_mask = 0x7FFF ^ exponent_mask
        assert ((bits & exponent_mask) == exponent_mask).all() and ((bits & mantissa_mask) != 0).all()


@pytest.mark.parametrize("dtype", [np.float16, np.uint16])
def test_st_global_b32_stores_a_packed_pair(dtype):
    """Word i lands in elements 2 i (its bits 0-15) and 2 i + 1 (bits 16-31) of a 4-D C-contiguous array, as the
    Hopper forward stores O: one store for a lane's two neighbouring columns; the other half of the array, written
    by no lane, keeps its NaN."""
    rng = np.random.default_rng(5)
    words = rng.integers(0, 2**32, 48, dtype=np.uint64).astype(np.uint32)
    out = np.full((2, 3, 4, 8), 0x7E00, np.uint16).view(dtype)
    dev = cuda.to_device(out)
    store_pairs_kernel[2, 32](dev, cuda.to_device(words))
    got = dev.copy_to_host().view(np.uint16).reshape(-1)
    np.testing.assert_array_equal(got[0:96:2], words & 0xFFFF)
    np.testing.assert_array_equal(got[1:96:2], words >> 16)
    assert (got[96:] == 0x7E00).all()


def test_bf16_reference_against_float64_rounding():
    """The host bf16 rounding used above, against a few values worked by hand."""
    x = np.array([1.0 + 2.0**-8, 1.0 + 3 * 2.0**-8, 1.0 + 2.0**-8 + 2.0**-20, 3.4028235e38, -0.0], np.float32)
    np.testing.assert_array_equal(bf16_bits(x), [0x3F80, 0x3F82, 0x3F81, 0x7F80, 0x8000])


@cuda.jit
def shfl_kernel(x, out):  # x, out (nwarps * 32, 5): column c of out is x's column c shuffled with mask 1 << c
    tid = cuda.threadIdx.x
    for c in range(5):
        out[tid, c] = ptx.shfl_xor_f32(x[tid, c], 1 << c)


def test_shfl_xor_exchanges_within_the_warp():
    x = np.random.default_rng(0).standard_normal((64, 5)).astype(np.float32)
    x[3, 0] = np.inf
    x[5, 1] = -np.inf
    out = cuda.to_device(np.full_like(x, np.nan))
    shfl_kernel[1, 64](cuda.to_device(x), out)
    lanes = np.arange(64)
    expected = np.stack([x[lanes ^ (1 << c), c] for c in range(5)], axis=1)  # lane ^ mask stays in its warp
    np.testing.assert_array_equal(out.copy_to_host(), expected)


# ---------------------------------------------------------------------------------------------------------------
# TF32: the conversion, the 3xTF32 split, and the m16n8k8 mma
# ---------------------------------------------------------------------------------------------------------------

def tf32_host(x):
    """tf32 bit patterns of float32 values, rounded to nearest with ties away from zero, worked from the values:
    the two tf32 neighbours of |x| and the nearer one (the upper one on a tie)."""
    x = np.asarray(x, np.float32)
    out = np.empty(x.shape, np.uint32)
    for idx, v in np.ndenumerate(x):
        u = int(np.float32(v).view(np.uint32))
        sign, mag = u & 0x80000000, u & 0x7FFFFFFF
        if mag > 0x7F800000:
            out[idx] = 0x7FFFFFFF
            continue
        down = mag & 0xFFFFE000
        up = down + 0x2000
        lo = float(np.uint32(down).view(np.float32))
        hi = float(np.uint32(up).view(np.float32)) if up < 0x7F800000 else float(np.float32(2.0**128 - 2.0**104))
        if mag == 0x7F800000:
            out[idx] = u
            continue
        a = float(np.uint32(mag).view(np.float32))
        pick = up if (a - lo) >= (hi - a) else down  # ties away from zero
        out[idx] = (min(pick, 0x7F800000)) | sign
    return out


@cuda.jit
def tf32_kernel(x, bits, big, small):
    i = cuda.grid(1)
    if i < x.size:
        bits[i] = ptx.to_tf32(x[i])
        b, s = ptx.split_tf32(x[i])
        big[i] = b
        small[i] = s


def run_tf32(x):
    outs = [cuda.to_device(np.zeros(x.size, np.uint32)) for _ in range(3)]
    tf32_kernel[(x.size + 63) // 64, 64](cuda.to_device(x), *outs)
    return [o.copy_to_host() for o in outs]


def test_to_tf32_rounds_to_nearest_ties_away():
    ulp = 2.0**-10  # tf32's spacing in [1, 2)
    x = np.array([1.0, 1.0 + ulp / 2, 1.0 + ulp / 2 - 2.0**-23, 1.0 + 1.5 * ulp, -(1.0 + ulp / 2), 3.0e38,
                  3.4028235e38, np.inf, -np.inf, 0.0, -0.0, 1e-40, -1e-40, 2.0**-126], np.float32)
    rng = np.random.default_rng(0)
    scales = np.float32(10.0) ** rng.integers(-30, 30, 2000).astype(np.float32)
    x = np.concatenate([x, rng.standard_normal(2000).astype(np.float32) * scales])
    bits, _, _ = run_tf32(x.astype(np.float32))
    np.testing.assert_array_equal(bits, tf32_host(x))
    assert (bits & 0x1FFF == 0).all()
    nan_bits, _, _ = run_tf32(np.array([np.nan], np.float32))
    assert np.isnan(nan_bits.view(np.float32)).all()


def test_split_tf32_is_big_plus_small():
    x = np.random.default_rng(1).standard_normal(4096).astype(np.float32)
    bits, big, small = run_tf32(x)
    np.testing.assert_array_equal(big, bits)
    total = big.view(np.float32).astype(np.float64) + small.view(np.float32).astype(np.float64)
    # x - big is exact, and small keeps its top 11 significant bits: the rest is below 2^-11 of it
    assert (np.abs(total - x) <= 2.0**-11 * np.abs(x - big.view(np.float32)) + 1e-45).all()
    assert (np.abs(total - x) <= 2.0**-21 * np.abs(x)).all()


@cuda.jit
def mma_tf32_kernel(A, B, C, D):  # A (16, 8), B (8, 8), C, D (16, 8) float32; operands rounded to tf32 here
    lane = cuda.threadIdx.x
    g = lane >> 2
    t = lane & 3
    d0, d1, d2, d3 = ptx.mma_m16n8k8_tf32(ptx.to_tf32(A[g, t]), ptx.to_tf32(A[g + 8, t]), ptx.to_tf32(A[g, t + 4]),
                                          ptx.to_tf32(A[g + 8, t + 4]), ptx.to_tf32(B[t, g]), ptx.to_tf32(B[t + 4, g]),
                                          C[g, 2 * t], C[g, 2 * t + 1], C[g + 8, 2 * t], C[g + 8, 2 * t + 1])
    D[g, 2 * t] = d0
    D[g, 2 * t + 1] = d1
    D[g + 8, 2 * t] = d2
    D[g + 8, 2 * t + 1] = d3


def run_mma_tf32(A, B, C):
    D = cuda.to_device(np.full((16, 8), np.nan, np.float32))
    mma_tf32_kernel[1, 32](*(cuda.to_device(np.ascontiguousarray(x, np.float32)) for x in (A, B, C)), D)
    return D.copy_to_host()


def test_mma_tf32_follows_the_documented_layout():
    """Integer inputs (exact in tf32, every partial sum exact): any misplaced element changes D."""
    rng = np.random.default_rng(3)
    A, B, C = (rng.integers(-8, 9, shape).astype(np.float32) for shape in ((16, 8), (8, 8), (16, 8)))
    np.testing.assert_array_equal(run_mma_tf32(A, B, C), A.astype(np.float64) @ B + C)


def test_mma_tf32_random_inputs():
    rng = np.random.default_rng(4)
    A, B, C = (rng.standard_normal(shape).astype(np.float32) for shape in ((16, 8), (8, 8), (16, 8)))
    A32, B32 = (tf32_host(x).view(np.float32).astype(np.float64) for x in (A, B))
    truth = A32 @ B32 + C
    tol = 9 * np.finfo(np.float32).eps * (np.abs(A32) @ np.abs(B32) + np.abs(C))  # float32 sums of 9 terms
    D = run_mma_tf32(A, B, C)
    assert (np.abs(D - truth) <= tol).all(), np.abs(D - truth).max()


# ---------------------------------------------------------------------------------------------------------------
# The GPU path compiles: PTX for sm_90, assembled by nvJitLink, without a GPU
# ---------------------------------------------------------------------------------------------------------------

COMPILE = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
import test_ptx
from flashnumba import _launch
out = {}
for name, sig in test_ptx.SIGNATURES.items():
    text = _launch.compile_ptx(getattr(test_ptx, name).py_func, sig, (9, 0))
    r = _launch.resources_from_log(_launch.assemble(text, (9, 0))[1])
    out[name] = dict(ptx=text, registers=r["registers"], spill=r["spill_stores"] + r["spill_loads"])
print(json.dumps(out))
"""


def test_kernels_compile_for_sm90():
    pytest.importorskip("cuda.bindings.nvjitlink")
    from conftest import compile_offline

    kernels = compile_offline(COMPILE, os.path.dirname(__file__))
    expected = {
        "mma_f16_kernel": ["mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32"],
        "mma_bf16_kernel": ["mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32"],
        "ldmatrix_kernel": ["ldmatrix.sync.aligned.m8n8.x4.shared.b16", "ldmatrix.sync.aligned.m8n8.x4.trans"],
        "gemm_16x16x16_kernel": ["ldmatrix.sync.aligned.m8n8.x4.shared.b16", "mma.sync.aligned.m16n8k16"],
        "cp_async_kernel": ["cp.async.cg.shared.global", "cp.async.commit_group", "cp.async.wait_group 1",
                            "cp.async.wait_all"],
        "pack_f16_kernel": ["cvt.rn.f16x2.f32"],
        "pack_bf16_kernel": ["cvt.rn.bf16x2.f32"],
        "store_pairs_kernel": ["st.global.b32"],
        "shfl_kernel": ["shfl.sync.bfly.b32"],
        "tf32_kernel": ["cvt.rna.tf32.f32"],
        "mma_tf32_kernel": ["mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32", "cvt.rna.tf32.f32"],
    }
    for name, needles in expected.items():
        text = kernels[name]["ptx"]
        assert ".target sm_90" in text
        for needle in needles:
            assert needle in text, f"{name}: no {needle!r} in its PTX"
        assert 0 < kernels[name]["registers"] <= 255 and kernels[name]["spill"] == 0
