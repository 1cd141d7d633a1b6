"""Host time of the API: the tensor-core forward and backward at seqlen 4096 (float16, the benchmark's workload),
timed three ways with CUDA events (median of 7 groups):

- kernels only: the launches flashnumba.api builds, captured and replayed, 10 back to back per group;
- API, one call per event pair (as the benchmark times every implementation): the host's work before the first
  launch is on the clock;
- API, 10 calls back to back per event pair: where the API does not wait for the GPU, its host work overlaps
  the previous call's kernels.

    python scripts/host_time.py [seqlen]
"""

import sys

import cupy
import numpy as np

import flashnumba
from flashnumba import api
from flashnumba.timing import cuda_events_ms


def median_ms(fn, n):
    fn()
    cupy.cuda.Device().synchronize()
    return float(np.median([cuda_events_ms(fn, n) for _ in range(7)]))


def captured(call):
    launches, real = [], api.launch

    def spy(*a):
        launches.append(a)
        return real(*a)

    api.launch = spy
    try:
        call()
    finally:
        api.launch = real
    return lambda: [real(*a) for a in launches]


seqlen = int(sys.argv[1]) if len(sys.argv) > 1 else 4096
rng = np.random.default_rng(0)
print(f"seqlen {seqlen}: ms per call; kernels only | API one call per event pair | API 10 back to back")
for d in (64, 128):
    for causal in (False, True):
        batch, nheads = 16384 // seqlen, 2048 // d
        q, k, v, do = (cupy.asarray(rng.standard_normal((batch, seqlen, nheads, d), dtype=np.float32))
                       .astype(np.float16) for _ in range(4))
        out, lse = flashnumba.flash_attn_forward(q, k, v, causal=causal)
        calls = {"forward": lambda: flashnumba.flash_attn_forward(q, k, v, causal=causal),
                 "backward": lambda: flashnumba.flash_attn_backward(do, q, k, v, out, lse, causal=causal)}
        for name, call in calls.items():
            kern = median_ms(captured(call), 10)
            one = median_ms(call, 1)
            ten = median_ms(call, 10)
            print(f"d={d} causal={causal!s:5} {name:8}: {kern:.3f} | {one:.3f} (+{one - kern:.3f}) | "
                  f"{ten:.3f} (+{ten - kern:.3f})", flush=True)
