"""Time the tensor-core backward's two kernels (dQ; dK/dV) and its D_i preprocess separately, each over its own
tile sizes (block_m, block_n), on the benchmark's workload (batch = 16384 / seqlen, nheads = 2048 / head_dim,
float16):

    python -P scripts/tc_sweep_backward.py [seqlen] [causal] [head_dims, e.g. 64,128]

The arguments of each kernel are those flashnumba.flash_attn_backward builds (captured from flashnumba.api.launch
at the default tiles; they do not depend on the tiles); each candidate kernel is launched 10 times between two
CUDA events, median of 5 such groups: kernel time only, no host time. TFLOP/s of a kernel: the backward's FLOP
count (2.5x the forward's) over its time alone, so the dQ and dK/dV figures show each kernel's share.
"""

import sys

import cupy
import numpy as np

import flashnumba
from flashnumba import api, backward_tc, forward
from flashnumba.timing import cuda_events_ms

# (block_m, block_n) candidates of each kernel (the dQ kernel has block_m / 16 warps, dK/dV block_n / 16)
DQ_TILES = {64: ((64, 64), (64, 32), (128, 32), (128, 64)),
            128: ((32, 64), (64, 32), (64, 64), (128, 32), (128, 64))}
DKDV_TILES = {64: ((64, 64), (32, 64), (32, 128), (64, 128)),
              128: ((32, 64), (16, 64), (64, 64), (16, 128), (32, 128))}


def median_ms(fn):
    fn()
    cupy.cuda.Device().synchronize()
    return float(np.median([cuda_events_ms(fn, 10) for _ in range(5)]))


seqlen = int(sys.argv[1]) if len(sys.argv) > 1 else 4096
causal = len(sys.argv) > 2 and sys.argv[2] in ("1", "causal", "True")
head_dims = [int(x) for x in sys.argv[3].split(",")] if len(sys.argv) > 3 else [64, 128]
rng = np.random.default_rng(0)
print(f"seqlen {seqlen}, causal {causal}; ms per launch (TFLOP/s at the backward's FLOP count)")
for d in head_dims:
    batch, nheads = 16384 // seqlen, 2048 // d
    q, k, v, dout = (cupy.asarray(rng.standard_normal((batch, seqlen, nheads, d), dtype=np.float32))
                     .astype(np.float16) for _ in range(4))
    out, lse = flashnumba.flash_attn_forward(q, k, v, causal=causal, kernel="tc")
    flops = 2.5 * 4 * batch * nheads * seqlen * seqlen * d / (2 if causal else 1)
    launches = []
    real_launch = api.launch

    def spy(fn, grid, block, smem, args):
        launches.append((fn, grid, block, smem, args))
        return real_launch(fn, grid, block, smem, args)

    api.launch = spy
    try:
        dq_ref = flashnumba.flash_attn_backward(dout, q, k, v, out, lse, causal=causal, kernel="tc")[0].copy()
    finally:
        api.launch = real_launch
    (pre, pgrid, pblock, psmem, pargs), (_, _, _, _, dq_args), (_, _, _, _, dkdv_args) = launches
    t = median_ms(lambda: real_launch(pre, pgrid, pblock, psmem, pargs))
    print(f"d={d} preprocess grid {pgrid} block {pblock}: {t:.3f} ms", flush=True)
    variant = forward.Variant(has_right=causal)
    for kind, tiles in (("dQ", DQ_TILES[d]), ("dK/dV", DKDV_TILES[d])):
        for bm, bn in tiles:
            try:
                if kind == "dQ":
                    fn = backward_tc.make_backward_dq_tc(d, variant, bm, bn)
                    grid, block, smem = (-(-seqlen // bm), batch * nheads), (2 * bm,), backward_tc.shared_bytes_dq(d, bm, bn)
                    args = dq_args
                else:
                    fn = backward_tc.make_backward_dkdv_tc(d, variant, bm, bn)
                    grid, block = (-(-seqlen // bn), batch * nheads), (2 * bn,)
                    smem, args = backward_tc.shared_bytes_dkdv(d, bm, bn), dkdv_args
                t = median_ms(lambda: real_launch(fn, grid, block, smem, args))
                extra = ""
                if kind == "dQ":  # the same result at every tile? (float32 sums in another order: close, not equal)
                    err = float(cupy.abs(cupy.asarray(args[6]).astype(np.float32)
                                         - dq_ref.astype(np.float32)).max())
                    extra = f"  max |dQ - dQ(default)| {err:.2e}"
                regs = fn.get_regs_per_thread()
                regs = ",".join(map(str, regs.values())) if isinstance(regs, dict) else regs
                print(f"d={d} {kind:5} block_m={bm:3} block_n={bn:3}: {t:.3f} ms ({flops / t / 1e9:.0f}) "
                      f"smem {smem} regs {regs}{extra}", flush=True)
            except Exception as err:  # noqa: BLE001  (a pair that does not fit)
                print(f"d={d} {kind} block_m={bm:3} block_n={bn:3}: {type(err).__name__}: {str(err)[:120]}")
