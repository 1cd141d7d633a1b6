"""Time the tensor-core forward over its block sizes (block_n = B_c, warps = B_r / 16) on the benchmark's
workload (batch = 16384 / seqlen, nheads = 2048 / head_dim, float16):

    python scripts/tc_sweep.py [seqlen] [causal]

Prints TFLOP/s (4 * batch * nheads * seqlen^2 * head_dim per forward, halved when causal) per configuration;
CUDA events, median of 10 runs after 3 warm-up runs.
"""

import sys

import cupy
import numpy as np

import flashnumba
from flashnumba.tools.timing import cuda_time_ms

n = int(sys.argv[1]) if len(sys.argv) > 1 else 4096
causal = len(sys.argv) > 2 and sys.argv[2] in ("1", "causal", "True")
rng = np.random.default_rng(0)
for d in (64, 128):
    batch, nheads = 16384 // n, 2048 // d
    q, k, v = (cupy.asarray(rng.standard_normal((batch, n, nheads, d), dtype=np.float32)).astype(np.float16)
               for _ in range(3))
    fl = 4 * batch * nheads * n * n * d / (2 if causal else 1)
    for bm, bn in ((64, 64), (64, 32), (64, 128), (128, 64), (128, 32), (32, 64), (128, 128)):
        try:
            ms, _ = cuda_time_ms(lambda: flashnumba.flash_attn_forward(q, k, v, causal=causal, kernel="tc",
                                                                        block_m=bm, block_n=bn), warmup=3, repeat=10)
        except Exception as err:  # noqa: BLE001  (a configuration that does not fit)
            print(f"d={d} block_m={bm} block_n={bn}: {type(err).__name__}: {err}")
            continue
        print(f"d={d} seqlen={n} causal={causal} block_m={bm} block_n={bn}: {ms:.3f} ms {fl / ms / 1e9:.1f} TFLOP/s",
              flush=True)
