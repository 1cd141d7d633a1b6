"""Time the tensor-core backward's two kernels (dQ; dK/dV) and its D_i preprocess separately, each over its own
tile sizes (block_m, block_n), on the benchmark's workload (batch = 16384 / seqlen, nheads = 2048 / head_dim,
float16):

    python scripts/tc_sweep_backward.py [seqlen] [causal] [head_dims, e.g. 64,128]

Each candidate is planned (``flashnumba.plan_backward(..., kernel="tc", block_m=, block_n=)``), its kernels bound
(``flashnumba._launch.Call``), and the kernel of interest launched 10 times between two CUDA events, median of 5
such groups: kernel time only, no host time. TFLOP/s of a kernel: the backward's FLOP count (2.5x the forward's)
over its time alone, so the dQ and dK/dV figures show each kernel's share.
"""

import sys

import cupy
import numpy as np

import flashnumba
from flashnumba import _launch
from flashnumba.tools.timing import cuda_events_ms

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
    arrays = (dout, q, k, v, out, lse, None, None, None)
    for kind, tiles, index in (("dQ", DQ_TILES[d], 1), ("dK/dV", DKDV_TILES[d], 2)):
        for bm, bn in tiles:
            try:
                plan = flashnumba.plan_backward(dout, q, k, v, out, lse, causal=causal, kernel="tc", block_m=bm,
                                                block_n=bn)
                call = _launch.Call(plan)
                values, outs, keep = call.prepare(arrays)
                if index == 1 and (bm, bn) == tiles[0]:
                    t = median_ms(lambda: call.bound[0](values, 0))
                    print(f"d={d} preprocess grid {plan.launches[0].grid}: {t:.3f} ms", flush=True)
                b = call.bound[index]
                t = median_ms(lambda: b(values, 0))
                r = b.compiled.resources
                print(f"d={d} {kind:5} block_m={bm:3} block_n={bn:3}: {t:.3f} ms ({flops / t / 1e9:.0f}) "
                      f"smem {b.spec.shared_bytes} regs {r['registers']} spills {r['spill_stores']}", flush=True)
            except Exception as err:  # noqa: BLE001  (a pair that does not fit)
                print(f"d={d} {kind} block_m={bm:3} block_n={bn:3}: {type(err).__name__}: {str(err)[:120]}")
