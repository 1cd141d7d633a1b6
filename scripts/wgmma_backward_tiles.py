"""The Hopper backward at other tiles than the planner's: TFLOP/s of one configuration, calls back to back between
two CUDA events after warm-up, float16, batch 16384 / seqlen, 2048 / head_dim heads, causal and not. One
configuration a process (the plans are cached):

    python scripts/wgmma_backward_tiles.py default [--head-dims 64 128] [--seqlens 4096]
    python scripts/wgmma_backward_tiles.py dkdv=64      # the dK/dV kernel's query tiles forced to 64 (or 48, 32)
    python scripts/wgmma_backward_tiles.py dqn=128      # the dQ kernel's key tiles forced to 128 (or 64, 48, 32)
    python scripts/wgmma_backward_tiles.py dqn=48+dkdv=48 --head-dims 256   # both (two buffers at 256)

A forced tile replaces the planner's own rule for that kernel (tiling.wgmma_dkdv_for_variant,
wgmma_dq_for_variant); whether a producer copies with tensor maps, and with how many buffers, then follows from the
tiles, as in the planner.
"""
import argparse

import cupy
import numpy as np

import flashnumba
from flashnumba import tiling

ap = argparse.ArgumentParser()
ap.add_argument("config", nargs="?", default="default")
ap.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
ap.add_argument("--seqlens", type=int, nargs="+", default=[4096])
args = ap.parse_args()
config = args.config
for part in config.split("+"):
    if part.startswith("dkdv="):
        m = int(part.split("=")[1])
        tiling.wgmma_dkdv_for_variant = (lambda t, variant, D, given=(), tma=False, m=m:
                                         (t._replace(block_m=m), "forced"))
    elif part.startswith("dqn="):
        n = int(part.split("=")[1])
        tiling.wgmma_dq_for_variant = (lambda t, variant, given=(), D=None, tma=False, block_masked=False, n=n:
                                       (t._replace(block_n=n), "forced"))
    elif part != "default":
        raise SystemExit(f"unknown configuration {part!r}: default, dkdv=M, dqn=N or both joined by +")
rng = np.random.default_rng(0)
for S, D in ((S, D) for S in args.seqlens for D in args.head_dims):
    for causal in (False, True):
        B, H = 16384 // S, 2048 // D
        q, k, v, dout = (cupy.asarray(rng.standard_normal((B, S, H, D), np.float32).astype(np.float16))
                         for _ in range(4))
        out, lse = flashnumba.flash_attn_forward(q, k, v, causal=causal)
        kw = dict(kernel="wgmma", causal=causal)
        try:
            p = flashnumba.plan_backward(dout, q, k, v, out, lse, **kw)
            desc = " | ".join(f"{x.name} {tuple(x.tiles)[:3]}" for x in p.launches if x.tiles)
            for _ in range(3):
                flashnumba.flash_attn_backward(dout, q, k, v, out, lse, **kw)
            e0, e1 = cupy.cuda.Event(), cupy.cuda.Event()
            calls = 20
            e0.record()
            for _ in range(calls):
                flashnumba.flash_attn_backward(dout, q, k, v, out, lse, **kw)
            e1.record()
            e1.synchronize()
            ms = cupy.cuda.get_elapsed_time(e0, e1) / calls
            flops = 2.5 * 4 * B * H * S * S * D * (0.5 if causal else 1)
            print(f"{config} d={D} seqlen={S} causal={causal}: {ms:.3f} ms {flops / ms / 1e9:.1f} TFLOP/s  [{desc}]",
                  flush=True)
        except ValueError as ex:  # tiles that do not fit
            print(f"{config} d={D} seqlen={S} causal={causal}: {ex}", flush=True)
