"""The 3xTF32 forward on wgmma (``config.hopper_3xtf32 = "per_step"``) at each of its tiles (query rows a block: one
or two warpgroups; keys a tile): the data behind ``wgmma_tf32.DEFAULT_BLOCK_M`` and ``DEFAULT_BLOCK_N``; with
``--backward``, the 3xTF32 backward on wgmma at each loop tile (``wgmma_tf32_backward.LOOP_ROWS``) beside the
``mma.sync`` 3xTF32 backward (TFLOP/s counted as 2.5 forwards).

    python scripts/tf32_wgmma_tiles.py [--backward] [--no-forward]

Float32, seqlen 4096, batch = 16384 / seqlen, nheads = 2048 / head_dim (the benchmark's workload), causal and not;
the median of 5 calls, each between a pair of CUDA events, after a warm-up call. Needs a GPU of compute capability
9.0.
"""

import sys

import cupy as cp
import numpy as np

import flashnumba
from flashnumba import config
from flashnumba.kernels import wgmma_tf32, wgmma_tf32_backward


def median_ms(call):
    """The median of 5 calls, each between a pair of CUDA events, after a warm-up call."""
    call()
    cp.cuda.Device().synchronize()
    e0, e1 = cp.cuda.Event(), cp.cuda.Event()
    ts = []
    for _ in range(5):
        e0.record()
        call()
        e1.record()
        e1.synchronize()
        ts.append(cp.cuda.get_elapsed_time(e0, e1))
    return float(np.median(ts))


config.hopper_3xtf32 = "per_step"
print(f"{cp.cuda.runtime.getDeviceProperties(0)['name'].decode()}, float32, seqlen 4096, precision='3xtf32'")
for D, ns in () if "--no-forward" in sys.argv else wgmma_tf32.BLOCK_NS.items():
    for m, n in ((m, n) for m in wgmma_tf32.BLOCK_MS for n in ns):
        N = 4096
        B, H = 16384 // N, 2048 // D
        q, k, v = (cp.random.standard_normal((B, N, H, D), dtype=cp.float32) for _ in range(3))
        for causal in (False, True):
            def call():
                return flashnumba.flash_attn_forward(q, k, v, causal=causal, precision="3xtf32", block_m=m,
                                                  block_n=n)
            ms = median_ms(call)
            flops = 4 * B * H * N * N * D / (2 if causal else 1)
            print(f"D={D} B_r={m} B_c={n} causal={causal}: {ms:.3f} ms {flops / ms / 1e9:.1f} TFLOP/s", flush=True)

for D, ns in wgmma_tf32_backward.LOOP_ROWS.items() if "--backward" in sys.argv else ():
    N = 4096
    B, H = 16384 // N, 2048 // D
    q, k, v, dout = (cp.random.standard_normal((B, N, H, D), dtype=cp.float32) for _ in range(4))
    for causal in (False, True):
        out, lse = flashnumba.flash_attn_forward(q, k, v, causal=causal)
        flops = 2.5 * 4 * B * H * N * N * D / (2 if causal else 1)
        for name, setting, tiles in [("mma.sync", None, {})] + [(f"wgmma loop tile {n}", "per_step",
                                                                  dict(block_m=n, block_n=n)) for n in ns]:
            with config.temporarily("hopper_3xtf32", setting):
                ms = median_ms(lambda: flashnumba.flash_attn_backward(dout, q, k, v, out, lse, causal=causal,
                                                                      precision="3xtf32", **tiles))
            print(f"backward D={D} causal={causal} {name}: {ms:.3f} ms {flops / ms / 1e9:.1f} TFLOP/s", flush=True)
