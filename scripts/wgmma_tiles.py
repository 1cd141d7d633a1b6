"""Tiles of the Hopper forward, float16, batch 16384 / seqlen, heads 2048 / d: TFLOP/s in both timing modes (calls
back to back, and one call per pair of CUDA events), beside torch's flash backend (FlashAttention-2) in the same run
where torch is installed.

    python scripts/wgmma_tiles.py [block_m:block_n:num_threads ...] [--head-dims 64 128] [--seqlens 4096]

num_threads 2 block_m + 32 or + 128 adds a producer of one warp or four (warp specialisation); without
configurations, the list below."""
import argparse

import cupy
import numpy as np

import flashnumba
from flashnumba.tools.timing import cuda_time_calls_ms, cuda_time_ms

CONFIGS = ("128:64:256", "128:64:288", "128:64:384", "64:64:128", "64:64:160", "64:64:256")
p = argparse.ArgumentParser()
p.add_argument("configs", nargs="*", default=CONFIGS)
p.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
p.add_argument("--seqlens", type=int, nargs="+", default=[4096])
args = p.parse_args()
configs = [tuple(map(int, a.split(":"))) for a in args.configs]
try:
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
except ImportError:
    torch = None
rng = np.random.default_rng(0)
print(f"# {cupy.cuda.runtime.getDeviceProperties(0)['name'].decode()}, flashnumba {flashnumba.__version__}"
      f"{', torch ' + torch.__version__ if torch else ''}")


def report(name, fn, flops):
    try:
        back, _, _ = cuda_time_calls_ms(fn, warmup=3, repeat=10, group_ms=20.0)
        one, _ = cuda_time_ms(fn, warmup=1, repeat=10)
        print(f"  {name:22s} {flops / back / 1e9:7.1f} TFLOP/s back to back, {flops / one / 1e9:7.1f} one call a "
              f"pair ({back:.3f} / {one:.3f} ms)", flush=True)
    except Exception as err:  # noqa: BLE001
        print(f"  {name:22s} {type(err).__name__}: {str(err)[:120]}", flush=True)


for d in args.head_dims:
    for n in args.seqlens:
        h, b = 2048 // d, max(1, 16384 // n)
        q, k, v = (cupy.asarray(rng.standard_normal((b, n, h, d), np.float32).astype(np.float16)) for _ in range(3))
        for causal in (False, True):
            flops = 4 * b * h * n * n * d / (2 if causal else 1)
            print(f"d={d} seqlen={n} batch={b} heads={h} causal={causal}", flush=True)
            for tiles in configs:
                report(f"wgmma {tiles[0]}x{tiles[1]}, {tiles[2]}", lambda: flashnumba.flash_attn_forward(
                    q, k, v, causal=causal, kernel="wgmma", block_m=tiles[0], block_n=tiles[1], num_threads=tiles[2]),
                    flops)
            if torch is not None:
                tq, tk, tv = (torch.as_tensor(x, device="cuda").transpose(1, 2) for x in (q, k, v))

                def fa2():
                    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                        return torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=causal)

                report("torch flash (FA2)", fa2, flops)
