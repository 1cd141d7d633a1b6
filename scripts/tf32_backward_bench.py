"""The TF32 / 3xTF32 backward's time beside the SIMT one and torch's memory-efficient float32 backward, and its
error against the float64 truth as a multiple of NumPy's float32 backward on 24 random draws. On a GPU with torch:

    python scripts/tf32_backward_bench.py
"""
import sys

import cupy
import numpy as np
import torch

import flashnumba
from flashnumba import reference
from flashnumba.tools.timing import cuda_time_ms

sys.path.insert(0, "tests")
from conftest import max_err  # noqa: E402

for d in (64, 128):
    for n, causal in ((4096, False), (4096, True)):
        batch, heads = 16384 // n, 2048 // d
        rng = np.random.default_rng(d)
        q, k, v, dout = (cupy.asarray(rng.standard_normal((batch, n, heads, d)).astype(np.float32)) for _ in range(4))
        out, lse = flashnumba.flash_attn_forward(q, k, v, causal=causal)
        fl = 2.5 * 4.0 * batch * heads * n * n * d * (0.5 if causal else 1.0)
        for prec in ("ieee", "tf32", "3xtf32"):
            def fn(p=prec):
                return flashnumba.flash_attn_backward(dout, q, k, v, out, lse, causal=causal, precision=p)
            fn()
            ms, _ = cuda_time_ms(fn, warmup=2, repeat=5)
            print(f"d={d} n={n} causal={causal} bwd {prec:7s} {ms:8.3f} ms {fl / ms / 1e9:6.1f} TFLOP/s", flush=True)
        tq, tk, tv = (torch.as_tensor(x, device="cuda").transpose(1, 2).detach().requires_grad_(True)
                      for x in (q, k, v))
        tdo = torch.as_tensor(dout, device="cuda").transpose(1, 2)
        from torch.nn.attention import SDPBackend, sdpa_kernel
        with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
            o = torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=causal)

            def tb():
                return torch.autograd.grad(o, (tq, tk, tv), tdo, retain_graph=True)
            tb()
            ms, _ = cuda_time_ms(tb, warmup=2, repeat=5)
        print(f"d={d} n={n} causal={causal} bwd torch efficient {ms:8.3f} ms {fl / ms / 1e9:6.1f} TFLOP/s", flush=True)
        del tq, tk, tv, o

ratios = []
for seed in range(24):
    rng = np.random.default_rng(1000 + seed)
    sq, sk = (int(x) for x in np.exp(rng.uniform(np.log(16), np.log(2000), 2)).round())
    d, causal = int(rng.choice([64, 128])), bool(seed % 2)
    q, k, v, dout = (rng.standard_normal((1, n_, 2, d)).astype(np.float32) for n_ in (sq, sk, sk, sq))
    out, lse = (cupy.asnumpy(x) for x in flashnumba.flash_attn_forward(q, k, v, causal=causal))
    truth = reference.attention_backward(dout, q, k, v, causal=causal)
    base = reference.attention_backward_blocked(dout, q, k, v, out, lse, causal=causal, dtype=np.float32)
    row = []
    for prec in ("3xtf32", "ieee"):
        grads = flashnumba.flash_attn_backward(dout, q, k, v, out, lse, causal=causal, precision=prec)
        row.append([max_err(np.asarray(g), t) / max_err(b, t) for g, t, b in zip(grads, truth, base)])
    ratios.append(row)
    print(f"err ratio {sq}x{sk} d={d} causal={causal}: 3xtf32 dq/dk/dv " + " ".join(f"{x:.2f}" for x in row[0])
          + "  ieee " + " ".join(f"{x:.2f}" for x in row[1]), flush=True)
r = np.array(ratios)
print("3xtf32 median", np.median(r[:, 0]), "max", r[:, 0].max(), "ieee median", np.median(r[:, 1]), "max",
      r[:, 1].max())
