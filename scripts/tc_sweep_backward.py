"""Time the tensor-core backward's two kernels (dQ; dK/dV) and its D_i preprocess separately, over their tile
sizes (block_m, block_n), on the benchmark's workload (batch = 16384 / seqlen, nheads = 2048 / head_dim,
float16):

    python -P scripts/tc_sweep_backward.py [seqlen] [causal]

Each kernel is launched with the arguments flashnumba.flash_attn_backward builds for it (captured from
flashnumba.api.launch), 10 launches between two CUDA events, median of 5 such groups: kernel time only, no host
time. Both kernels take the same (block_m, block_n) today; the table shows which pair suits each, so that they
can be given their own. TFLOP/s of a kernel: the backward's FLOP count (2.5x the forward's) over its time alone.
"""

import sys

import cupy
import numpy as np

import flashnumba
from flashnumba import api


def per_launch_ms(fn, n=10):
    start, stop = cupy.cuda.Event(), cupy.cuda.Event()
    start.record()
    for _ in range(n):
        fn()
    stop.record()
    stop.synchronize()
    return cupy.cuda.get_elapsed_time(start, stop) / n


seqlen = int(sys.argv[1]) if len(sys.argv) > 1 else 4096
causal = len(sys.argv) > 2 and sys.argv[2] in ("1", "causal", "True")
rng = np.random.default_rng(0)
print(f"seqlen {seqlen}, causal {causal}; ms per launch (TFLOP/s at the backward's FLOP count)")
for d in (64, 128):
    batch, nheads = 16384 // seqlen, 2048 // d
    q, k, v, dout = (cupy.asarray(rng.standard_normal((batch, seqlen, nheads, d), dtype=np.float32))
                     .astype(np.float16) for _ in range(4))
    out, lse = flashnumba.flash_attn_forward(q, k, v, causal=causal, kernel="tc")
    flops = 2.5 * 4 * batch * nheads * seqlen * seqlen * d / (2 if causal else 1)
    for bm, bn in ((16, 64), (32, 32), (32, 64), (32, 128), (64, 32), (64, 64), (64, 128), (128, 32), (128, 64)):
        launches = []
        real_launch = api.launch

        def spy(fn, grid, block, smem, args):
            launches.append((fn, grid, block, smem, args))
            return real_launch(fn, grid, block, smem, args)

        api.launch = spy
        try:
            flashnumba.flash_attn_backward(dout, q, k, v, out, lse, causal=causal, kernel="tc", block_m=bm,
                                           block_n=bn)
        except Exception as err:  # noqa: BLE001  (a pair that does not fit)
            print(f"d={d} block_m={bm:3} block_n={bn:3}: {type(err).__name__}: {str(err)[:90]}")
            continue
        finally:
            api.launch = real_launch
        cupy.cuda.Device().synchronize()
        times = []
        for fn, grid, block, smem, args in launches:  # preprocess, dQ, dK/dV
            times.append(np.median([per_launch_ms(lambda: real_launch(fn, grid, block, smem, args))
                                    for _ in range(5)]))
        names = ("preprocess", "dQ", "dK/dV")
        cells = "  ".join(f"{n} {t:.3f} ({flops / t / 1e9:.0f})" for n, t in zip(names, times))
        print(f"d={d} block_m={bm:3} block_n={bn:3}: {cells}  total {sum(times):.3f} ({flops / sum(times) / 1e9:.0f})",
              flush=True)
