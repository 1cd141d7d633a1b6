"""Time the TF32 / 3xTF32 forward over its tiles (block_n = B_c, warps), on the benchmark's workload
(batch = 16384 / seqlen, nheads = 2048 / head_dim, float32):

    python scripts/tf32_sweep.py [seqlen] [causal] [head_dims, e.g. 64,128]

TFLOP/s (4 * batch * nheads * seqlen^2 * head_dim per forward, halved when causal); CUDA events, median of 10
runs after 3 warm-up runs, through flashnumba.flash_attn_forward(kernel=precision, block_n=, block_m=16 * warps).
(docs/results/h200-2026-11-29-46277a7-sweep-tf32.txt also has a variant, since removed, that rounded or split
K_j, V_j once per tile in shared memory: slower in every configuration.)
"""

import sys

import cupy
import numpy as np

import flashnumba
from flashnumba.tools.timing import cuda_time_ms

n = int(sys.argv[1]) if len(sys.argv) > 1 else 4096
causal = len(sys.argv) > 2 and sys.argv[2] in ("1", "causal", "True")
head_dims = [int(x) for x in sys.argv[3].split(",")] if len(sys.argv) > 3 else [64, 128]
rng = np.random.default_rng(0)
for d in head_dims:
    batch, nheads = 16384 // n, 2048 // d
    q, k, v = (cupy.asarray(rng.standard_normal((batch, n, nheads, d), dtype=np.float32)) for _ in range(3))
    fl = 4 * batch * nheads * n * n * d / (2 if causal else 1)
    for precision in ("tf32", "3xtf32"):
        for bn, warps in ((32, 4), (64, 4), (32, 8), (64, 8), (16, 8)):
            try:
                ms, _ = cuda_time_ms(lambda: flashnumba.flash_attn_forward(q, k, v, causal=causal, kernel=precision,
                                                                           block_n=bn, block_m=16 * warps),
                                     warmup=3, repeat=10)
            except Exception as err:  # noqa: BLE001  (a configuration that does not fit)
                print(f"d={d} {precision} block_n={bn} warps={warps}: {type(err).__name__}: {str(err)[:80]}")
                continue
            print(f"d={d} {precision:6} block_n={bn:3} warps={warps}: {ms:8.3f} ms {fl / ms / 1e9:7.1f} TFLOP/s",
                  flush=True)
