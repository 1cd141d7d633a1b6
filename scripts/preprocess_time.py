"""Time the backward's D_i preprocess (a warp a row) alone with CUDA events: batch 4, seqlen 4096, 16 heads,
head_dim 128, float16 (the shape of scripts/wgmma_ncu.py), after warm-up; prints microseconds a launch."""
import cupy
import numpy as np

from flashnumba.kernels import simt_backward
from flashnumba.planner import PREPROCESS_ROWS

rng = np.random.default_rng(0)
dout, out = (cupy.asarray(rng.standard_normal((4, 4096, 16, 128), np.float32).astype(np.float16)) for _ in range(2))
delta = cupy.empty((4, 16, 4096), np.float32)
rows = PREPROCESS_ROWS
kernel = simt_backward.make_backward_preprocess_warp(128, rows, False)
launch = kernel[(4096 // rows, 4 * 16), 32 * rows]
for _ in range(3):
    launch(dout, out, delta)
start, stop = cupy.cuda.Event(), cupy.cuda.Event()
start.record()
for _ in range(100):
    launch(dout, out, delta)
stop.record()
stop.synchronize()
want = (dout.astype(cupy.float64) * out.astype(cupy.float64)).sum(-1).transpose(0, 2, 1)
print(f"D_i preprocess: {cupy.cuda.get_elapsed_time(start, stop) * 10:.1f} us a launch (Numba's launch included), "
      f"largest error {float(cupy.abs(delta - want).max()):.2e}")
