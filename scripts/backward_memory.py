"""Peak extra device memory of one backward call (batch 1, 16 heads, seqlen 16384, head_dim 64, float32).

    python scripts/backward_memory.py [seqlen ...]
"""

import sys

import cupy
import numpy as np

import flashnumba
from flashnumba.tools.timing import cuda_time_ms, peak_device_bytes

for n in [int(a) for a in sys.argv[1:]] or [16384]:
    batch, heads, d = 1, 16, 64
    rng = np.random.default_rng(0)
    q, k, v, dout = (cupy.asarray(rng.standard_normal((batch, n, heads, d), dtype=np.float32)) for _ in range(4))
    out, lse = flashnumba.flash_attn_forward(q, k, v)
    (dq, dk, dv), extra = peak_device_bytes(lambda: flashnumba.flash_attn_backward(dout, q, k, v, out, lse))
    grads_bytes = dq.nbytes + dk.nbytes + dv.nbytes
    ms, _ = cuda_time_ms(lambda: flashnumba.flash_attn_backward(dout, q, k, v, out, lse), warmup=1, repeat=3)
    n2 = batch * heads * n * n * 4
    print(f"seqlen {n}: backward peak extra device memory {extra / 2**20:.1f} MiB "
          f"(dq+dk+dv {grads_bytes / 2**20:.1f} MiB, D_i {batch * heads * n * 4 / 2**20:.2f} MiB); "
          f"one seqlen x seqlen float32 buffer would be {n2 / 2**30:.1f} GiB; backward {ms:.1f} ms")
