"""``python -m flashnumba demo``: the path a user gets by default, for each dtype: the plan (kernel family and
tiles), one forward call checked against the float64 reference, timed, and its speed and memory compared with
standard (materialised) attention. Without a GPU the same runs on a small shape in the simulator."""

from __future__ import annotations

import sys
import time

import numpy as np

from .. import _arrays, _backend, reference
from ..api import flash_attn_forward, plan
from .standard import standard_attention
from .timing import cuda_time_ms, peak_device_bytes


def _gib(n):
    for unit, div in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= div:
            return f"{n / div:.2f} {unit}"
    return f"{n} B"


def _dtypes():
    """(name, NumPy dtype) of each dtype the demo can run here: bfloat16 needs ml_dtypes, and on a GPU torch
    (CuPy has no bfloat16)."""
    out = [("float16", np.dtype(np.float16)), ("float32", np.dtype(np.float32))]
    bf16 = _arrays.bfloat16()
    if bf16 is not None:
        if _backend.SIMULATOR:
            out.append(("bfloat16", bf16))
        else:
            try:
                import torch  # noqa: F401

                out.append(("bfloat16", bf16))
            except ImportError:
                print("(bfloat16: on a GPU it runs on torch tensors; torch is not installed)")
    return out


def _device(x):
    if _backend.SIMULATOR:
        return x
    if x.dtype.name == "bfloat16":
        import torch

        return torch.from_numpy(x.view(np.int16)).cuda().view(torch.bfloat16)
    import cupy

    return cupy.asarray(x)


def run(size="auto"):
    sim = _backend.SIMULATOR
    if size == "auto":
        size = "small" if sim else "large"
    if size == "large" and sim:  # (hours: each simulated thread is a Python thread)
        print("flashnumba demo: --size large is the GPU's shape (batch 4, 16 heads, seqlen 4096); in the simulator "
              "it would take hours: run --size small", file=sys.stderr)
        return 2
    batch, nheads, seqlen, d = (4, 16, 4096, 64) if size == "large" else (1, 2, 80, 64)
    print(f"flashnumba demo on {_backend.device_name()} [{_backend.BACKEND}]")
    print(f"shape: batch {batch}, heads {nheads}, seqlen {seqlen}, head_dim {d}; causal; the default plan "
          f"(kernel=None) for each dtype")
    rng = np.random.default_rng(0)
    host = [rng.standard_normal((batch, seqlen, nheads, d), dtype=np.float32) for _ in range(3)]
    flops = 4 * batch * nheads * seqlen * seqlen * d / 2
    for name, dtype in _dtypes():
        q, k, v = (x.astype(dtype) for x in host)
        xq, xk, xv = (_device(x) for x in (q, k, v))
        p = plan(xq, xk, xv, causal=True)
        tiles = ", ".join(f"{s.name}: B_r {s.tiles.block_m}, B_c {s.tiles.block_n}, {int(np.prod(s.block))} threads"
                          for s in p.launches if s.tiles is not None)
        print(f"\n{name}: kernel {p.kernel!r} ({tiles})")
        print(f"  why: {p.why}" + (f" (the faster path does not apply: {p.fallback})" if p.fallback else ""))
        call = lambda: flash_attn_forward(xq, xk, xv, causal=True)  # noqa: E731
        if sim:  # (the one call is also the one timed: simulated calls are slow)
            t0 = time.perf_counter()
            (out, lse), flash_bytes = call(), 0
            ms = 1e3 * (time.perf_counter() - t0)
        else:
            (out, lse), flash_bytes = peak_device_bytes(call, "torch" if name == "bfloat16" else "cupy")
        out = _arrays.to_host(out)
        # the error on one (batch, head) slice: the float64 reference, and the same attention computed in this dtype
        one = [x[:1, :, :1] for x in (q, k, v)]
        truth, _ = reference.attention_forward(*one, causal=True)
        base, _ = reference.attention_forward(*one, causal=True, dtype=dtype)
        err = float(np.abs(out[:1, :, :1].astype(np.float64) - truth).max())
        base_err = float(np.abs(base.astype(np.float64) - truth).max())
        plain = "float32 rounded to bfloat16" if name == "bfloat16" else name  # (as the reference computes it)
        print(f"  max |out - float64 reference| = {err:.2e} (plain attention in {plain}: {base_err:.2e}; "
              f"batch 0, head 0)")
        if sim:
            n2 = batch * nheads * seqlen * seqlen * 4
            print(f"  simulator wall time: {ms:.0f} ms (a CPU emulation, not a GPU timing); memory: flashnumba "
                  f"adds out + lse = {_gib(out.nbytes + batch * nheads * seqlen * 4)}, standard attention holds "
                  f"S and P = {_gib(2 * n2)}")
            continue
        ms, _ = cuda_time_ms(call, repeat=20)
        print(f"  flashnumba: {ms:.3f} ms, {flops / ms / 1e9:.1f} TFLOP/s (median of 20, CUDA events), peak extra "
              f"memory {_gib(flash_bytes)}")
        if name == "bfloat16":
            continue  # standard attention runs on CuPy, which has no bfloat16
        (_, _), std_bytes = peak_device_bytes(lambda: standard_attention(xq, xk, xv, causal=True))
        std_ms, _ = cuda_time_ms(lambda: standard_attention(xq, xk, xv, causal=True), repeat=20)
        print(f"  standard attention (CuPy, materialised): {std_ms:.3f} ms, peak extra memory {_gib(std_bytes)}: "
              f"flashnumba is {std_ms / ms:.2f}x faster and needs {std_bytes / max(flash_bytes, 1):.0f}x less memory")
    return 0
