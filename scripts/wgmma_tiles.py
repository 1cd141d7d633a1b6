"""Tiles of the Hopper forward at seqlen 4096 (batch 4, heads 2048 / d), float16: TFLOP/s back to back.
Arguments: the configurations block_m:block_n:num_threads to run (default: the list below); num_threads
2 block_m + 32 or + 128 adds a producer of one warp or four (warp specialisation)."""
import sys

import cupy
import numpy as np

import flashnumba
from flashnumba.tools.timing import cuda_time_calls_ms

CONFIGS = ((128, 64, 256), (128, 64, 288), (128, 64, 384), (64, 64, 128), (64, 64, 160), (64, 64, 256))
configs = [tuple(map(int, a.split(":"))) for a in sys.argv[1:]] or CONFIGS
rng = np.random.default_rng(0)
for d in (64, 128):
    h, n, b = 2048 // d, 4096, 4
    q, k, v = (cupy.asarray(rng.standard_normal((b, n, h, d), np.float32).astype(np.float16)) for _ in range(3))
    for causal in (False, True):
        flops = 4 * b * h * n * n * d / (2 if causal else 1)
        for tiles in configs:
            try:
                fn = lambda: flashnumba.flash_attn_forward(q, k, v, causal=causal, kernel="wgmma",  # noqa: E731
                                                           block_m=tiles[0], block_n=tiles[1],
                                                           num_threads=tiles[2])
                ms, _, _ = cuda_time_calls_ms(fn, warmup=3, repeat=10, group_ms=20.0)
                print(f"d={d} causal={causal} tiles={tiles}: {ms:.3f} ms {flops / ms / 1e9:.1f} TFLOP/s", flush=True)
            except Exception as err:  # noqa: BLE001
                print(f"d={d} causal={causal} tiles={tiles}: {type(err).__name__}: {str(err)[:100]}")
