"""3xTF32 on Hopper's wgmma: does chaining the products in the tensor cores' accumulator cost accuracy?

    python scripts/tf32_wgmma_error.py [--draws 20] [--repeat 1 8 64]

One warpgroup forms S = A B^T (64 x 16, K = 64, float32 inputs) three ways with ``wgmma`` m64n16k8 TF32 (A and B
split on the host into big = tf32(x) and small = tf32(x - big), to nearest, as ``cvt.rna.tf32.f32``):

* "tf32": A_big B_big^T, the eight k-steps chained in the accumulator (one product: TF32's own error);
* "3xtf32 chained": A_small B_big^T + A_big B_small^T + A_big B_big^T, all 24 chained in one accumulator;
* "3xtf32 per step": each k-step's three chained from zero in a scratch accumulator (two in turns), waited for,
  and added to the sum with float32 adds (what the ``mma.sync`` 3xTF32 kernels do, :mod:`flashnumba.kernels.mma_tf32`);
* "3xtf32 per 2 steps": the same, the six products of two k-steps chained from zero a scratch;
* "big per step": A_big B_big^T of each k-step from zero, added as above; the two small products
  (A_small B_big^T + A_big B_small^T, about 2^-11 of the sum) chained over every step in an accumulator of their
  own, added at the end (whose truncation, relative to their own small sum, is far below float32's rounding).

Each against the float64 product, as a multiple of a plain float32 computation's error (NumPy float32, the k-steps
summed in order), median and largest over the draws. ``--repeat R``: the k-steps run R times over the same tiles
into the same sums (R A B^T: a chain of 8 R k-steps, as O's accumulator runs over a long key loop). On the GPU
this measures the tensor cores' accumulation (they align the products to the largest and truncate:
``scripts/tf32_error_model.py``); the simulator's stand-in sums in float64 and rounds once, so there the two 3xTF32
forms agree (a smoke test of the script, not a measurement).
"""

from __future__ import annotations

import argparse

import numpy as np

from flashnumba._backend import SIMULATOR, cuda  # (first: it chooses the simulator before Numba reads its config)
from flashnumba.kernels import ptx_hopper as hop
from flashnumba.kernels.wgmma_tf32 import check_steps, make_in_turns, make_store_split, make_three_products
from numba import float32  # noqa: E402  (after the backend)
from tf32_error_model import split  # (this folder's: float32 -> TF32 big and small parts, to nearest)

M, N, K = 64, 16, 64
LBO, SBO = 128, 32 * K  # core matrices of 8 rows x 4 floats: the next 4 columns, the next 8 rows
NA, NB = M * K, N * K
NS = 2 * NA + 2 * NB  # A big, A small, B big, B small (40 KB: within the static 48)
MMA, FENCE, WAIT = hop.wgmma_ops("tf32", N)


def make_products():
    """The kernel (its sizes closed over: a shared array's size must be a constant)."""
    ns, na, nb, sbo, nr = NS, NA, NB, SBO, N // 2
    where, _ = make_store_split(K)  # element e of an operand at word e: (row, column) of it
    chain, per_step = make_three_products(N)
    check_steps(K // 8, N)

    @cuda.jit(device=True, inline=True)
    def issue_two(scratch, a_small, a_big, b_big, b_small, kk):  # k-steps 2 kk and 2 kk + 1, from zero
        FENCE(scratch)
        chain(scratch, a_small + 32 * kk, a_big + 32 * kk, b_big + 32 * kk, b_small + 32 * kk, 2, 0)
        hop.wgmma_commit()

    @cuda.jit(device=True, inline=True)
    def issue_big(scratch, a_small, a_big, b_big, b_small, kk):  # A_big B_big^T of k-step kk, from zero
        FENCE(scratch)
        MMA(scratch, a_big + 16 * kk, b_big + 16 * kk, 0)
        hop.wgmma_commit()

    pairs_in_turns = make_in_turns(issue_two, WAIT, nr)
    big_in_turns = make_in_turns(issue_big, WAIT, nr)

    @cuda.jit
    def products(ab, as_, bb, bs, out, reps):
        """out[0] tf32, out[1] 3xtf32 chained, out[2] 3xtf32 per step, out[3] per 2 steps, out[4] big per step
        (64 x 16 each)."""
        smem = cuda.shared.array(ns, float32)
        tid = cuda.threadIdx.x
        for e in range(tid, na, 128):
            r, k = where(e)
            smem[e] = ab[r, k]
            smem[na + e] = as_[r, k]
        for e in range(tid, nb, 128):
            r, k = where(e)
            smem[2 * na + e] = bb[r, k]
            smem[2 * na + nb + e] = bs[r, k]
        hop.fence_proxy_async()
        cuda.syncthreads()
        a_big = hop.make_desc(hop.smem_address(smem, 0), LBO, sbo)
        a_small = hop.make_desc(hop.smem_address(smem, na), LBO, sbo)
        b_big = hop.make_desc(hop.smem_address(smem, 2 * na), LBO, sbo)
        b_small = hop.make_desc(hop.smem_address(smem, 2 * na + nb), LBO, sbo)
        one = cuda.local.array(nr, float32)
        chained = cuda.local.array(nr, float32)
        step = cuda.local.array(nr, float32)  # (two scratch accumulators, in turns)
        step2 = cuda.local.array(nr, float32)
        total = cuda.local.array(nr, float32)
        pairs = cuda.local.array(nr, float32)
        bigs = cuda.local.array(nr, float32)
        smalls = cuda.local.array(nr, float32)
        for i in range(nr):
            total[i] = 0.0
            pairs[i] = 0.0
            bigs[i] = 0.0
        for rep in range(reps):  # (the 3xTF32 kernel's own two accumulations: wgmma_tf32.make_three_products)
            FENCE(one)
            FENCE(chained)
            for ks in range(K // 8):  # (a k-step: 8 columns, two core matrices, 256 bytes on: 16 in the
                MMA(one, a_big + 16 * ks, b_big + 16 * ks, rep + ks)  # descriptor's units)
            chain(chained, a_small, a_big, b_big, b_small, K // 8, rep)
            hop.wgmma_commit()
            WAIT(0, chained)
        WAIT(0, one)
        for rep in range(reps):
            per_step(total, step, step2, a_small, a_big, b_big, b_small, K // 8)
        for rep in range(reps):
            pairs_in_turns(pairs, step, step2, a_small, a_big, b_big, b_small, 0, K // 16)
        FENCE(smalls)
        for rep in range(reps):
            for ks in range(K // 8):
                MMA(smalls, a_small + 16 * ks, b_big + 16 * ks, min(rep + ks, 1))
                MMA(smalls, a_big + 16 * ks, b_small + 16 * ks, 1)
        hop.wgmma_commit()
        for rep in range(reps):
            big_in_turns(bigs, step, step2, a_small, a_big, b_big, b_small, 0, K // 8)
        WAIT(0, smalls)
        for i in range(nr):
            bigs[i] += smalls[i]
        w = tid // 32
        g = (tid % 32) >> 2
        t = tid & 3
        for j in range(N // 8):
            for x in range(4):
                r = 16 * w + g + 8 * (x >> 1)
                c = 8 * j + 2 * t + (x & 1)
                out[0, r, c] = one[4 * j + x]
                out[1, r, c] = chained[4 * j + x]
                out[2, r, c] = total[4 * j + x]
                out[3, r, c] = pairs[4 * j + x]
                out[4, r, c] = bigs[4 * j + x]

    return products


products = make_products()


def float32_in_order(a, b, reps=1):
    """reps A B^T in float32, the k-steps of 8 summed in order (each step's 8 products summed in float32 too)."""
    acc = np.zeros((a.shape[0], b.shape[0]), np.float32)
    for _ in range(reps):
        for ks in range(0, K, 8):
            acc += (a[:, ks:ks + 8] @ b[:, ks:ks + 8].T).astype(np.float32)
    return acc


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--draws", type=int, default=20)
    ap.add_argument("--repeat", type=int, nargs="+", default=[1, 8, 64])
    args = ap.parse_args()
    if not SIMULATOR and cuda.get_current_device().compute_capability != (9, 0):
        raise SystemExit("wgmma needs compute capability 9.0")
    where = "simulator (stand-in: float64 sums)" if SIMULATOR else cuda.get_current_device().name
    print(f"S = R A B^T, 64 x 16, K = 64, standard normal float32, {args.draws} draws, {where}: max |error| as a "
          f"multiple of float32's (k-steps summed in order)")
    for reps in args.repeat:
        rng = np.random.default_rng(0)
        ratios = {"tf32": [], "3xtf32 chained": [], "3xtf32 per step": [], "3xtf32 per 2 steps": [],
                  "big per step": []}
        for _ in range(args.draws):
            a = rng.standard_normal((M, K)).astype(np.float32)
            b = rng.standard_normal((N, K)).astype(np.float32)
            (ab, as_), (bb, bs) = split(a), split(b)
            out = cuda.to_device(np.full((5, M, N), np.nan, np.float32))
            products[1, 128](*(cuda.to_device(np.ascontiguousarray(x)) for x in (ab, as_, bb, bs)), out, reps)
            got = out.copy_to_host().astype(np.float64)
            truth = reps * (a.astype(np.float64) @ b.T.astype(np.float64))
            plain = np.abs(float32_in_order(a, b, reps) - truth).max()
            for name, x in zip(ratios, got):
                ratios[name].append(np.abs(x - truth).max() / plain)
        for name, r in ratios.items():
            print(f"  R = {reps:3}  {name:18} median {np.median(r):7.2f}x  largest {np.max(r):7.2f}x")


if __name__ == "__main__":
    main()
