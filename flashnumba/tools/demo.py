"""``python -m flashnumba demo``: one forward call on a realistic shape, checked, timed, and its memory compared
with standard (materialised) attention. Without a GPU the same runs on a small shape in the simulator."""

from __future__ import annotations

import numpy as np

from .. import _backend, reference
from ..api import flash_attn_forward
from .standard import standard_attention
from .timing import cuda_time_ms, peak_device_bytes


def _gib(n):
    for unit, div in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= div:
            return f"{n / div:.2f} {unit}"
    return f"{n} B"


def run(size="auto"):
    sim = _backend.SIMULATOR
    if size == "auto":
        size = "small" if sim else "large"
    if size == "large":
        batch, nheads, seqlen, d = 4, 16, 4096, 64
    else:
        batch, nheads, seqlen, d = 1, 2, 80, 64
    print(f"flashnumba demo on {_backend.device_name()} [{_backend.BACKEND}]")
    print(f"shape: batch {batch}, heads {nheads}, seqlen {seqlen}, head_dim {d}, float32")
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((batch, seqlen, nheads, d), dtype=np.float32) for _ in range(3))

    if sim:
        xq, xk, xv = q, k, v
    else:
        import cupy

        xq, xk, xv = (cupy.asarray(x) for x in (q, k, v))

    for causal in (False, True):
        (out, lse), flash_bytes = ((flash_attn_forward(xq, xk, xv, causal=causal), 0) if sim
                                   else peak_device_bytes(lambda: flash_attn_forward(xq, xk, xv, causal=causal)))
        out = out if sim else out.get()
        lse = lse if sim else lse.get()
        # error against the float64 reference, on one (batch, head) slice
        ro, rl = reference.attention_forward(q[:1, :, :1], k[:1, :, :1], v[:1, :, :1], causal=causal)
        err_o = float(np.abs(out[:1, :, :1] - ro).max())
        err_l = float(np.abs(lse[:1, :1] - rl).max())
        ms, _ = cuda_time_ms(lambda: flash_attn_forward(xq, xk, xv, causal=causal), repeat=1 if sim else 20)
        flops = 4 * batch * nheads * seqlen * seqlen * d / (2 if causal else 1)
        print(f"\ncausal={causal}")
        print(f"  max |out - reference| = {err_o:.2e}, max |lse - reference| = {err_l:.2e} (batch 0, head 0)")
        if sim:
            print(f"  simulator wall time: {ms:.0f} ms (a CPU emulation; not a GPU timing)")
            n2 = batch * nheads * seqlen * seqlen * 4
            print(f"  memory (computed, no GPU): flashnumba extra = out + lse = "
                  f"{_gib(out.nbytes + lse.nbytes)}; standard attention holds S and P = {_gib(2 * n2)}")
            continue
        print(f"  flashnumba kernel: {ms:.3f} ms, {flops / ms / 1e9:.1f} TFLOP/s (median of 20, CUDA events)")
        (_, _), std_bytes = peak_device_bytes(lambda: standard_attention(xq, xk, xv, causal=causal))
        std_ms, _ = cuda_time_ms(lambda: standard_attention(xq, xk, xv, causal=causal), repeat=20)
        print(f"  standard attention (CuPy, materialised): {std_ms:.3f} ms -> speed-up of flashnumba over it: "
              f"{std_ms / ms:.2f}x")
        print(f"  peak extra device memory: flashnumba {_gib(flash_bytes)}, standard {_gib(std_bytes)} "
              f"({std_bytes / max(flash_bytes, 1):.1f}x)")
    return 0
