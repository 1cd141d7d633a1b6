"""The tensor-core forward and backward (kernel="tc") on a few awkward shapes, for compute-sanitizer
(scripts/sanitize.py runs it too):

    compute-sanitizer --tool racecheck python scripts/sanitize_tc.py

seqlen not a multiple of the tiles, causal on and off, float16 and bfloat16, the default blocks and others; the
atomic-dQ backward (deterministic=False). SANITIZE_TC_PARTS (default "tc,options,tf32,atomic") picks the parts.
"""

import os

import cupy
import ml_dtypes
import numpy as np

import flashnumba

rng = np.random.default_rng(0)
PARTS = os.environ.get("SANITIZE_TC_PARTS", "tc,options,tf32,atomic").split(",")
cases = [  # (batch, seqlen_q, seqlen_k, nheads, head_dim, causal, dtype, block_m, block_n)
    (1, 77, 91, 2, 64, True, np.float16, None, None),
    (2, 65, 40, 1, 128, False, np.float16, None, None),
    (1, 50, 129, 1, 64, False, np.float16, None, None),
    (1, 200, 333, 1, 128, True, ml_dtypes.bfloat16, None, None),
    (1, 130, 70, 2, 64, True, np.float16, 128, 32),
    (1, 33, 100, 1, 128, False, ml_dtypes.bfloat16, 16, 16),
    (1, 97, 70, 2, 256, True, np.float16, None, None),  # above d = 160: two warps a key block in dK/dV
    (1, 70, 97, 1, 176, False, ml_dtypes.bfloat16, None, None),  # 176 padded to 192 there
]
for b, sq, sk, h, d, causal, dtype, bm, bn in cases if "tc" in PARTS else ():
    hq, hk, hv = (rng.standard_normal((b, s, h, d)).astype(dtype) for s in (sq, sk, sk))
    hdo = rng.standard_normal((b, sq, h, d)).astype(dtype)
    out, lse = flashnumba.flash_attn_forward(hq, hk, hv, causal=causal, kernel="tc", block_m=bm, block_n=bn)
    grads = flashnumba.flash_attn_backward(hdo, hq, hk, hv, out, lse, causal=causal, kernel="tc",
                                           block_m=bm if bm != 128 else 64, block_n=bn)
    cupy.cuda.Device().synchronize()
    f32 = [x.astype(np.float32) for x in (hq, hk, hv, hdo)]
    ref, _ = flashnumba.reference.attention_forward(*f32[:3], causal=causal)
    ref_grads = flashnumba.reference.attention_backward(f32[3], *f32[:3], causal=causal)
    errs = [float(np.abs(x.astype(np.float64) - r).max()) for x, r in zip((out, *grads), (ref, *ref_grads))]
    print("tc", b, sq, sk, h, d, causal, np.dtype(dtype).name, bm, bn, "max err out/dq/dk/dv",
          " ".join(f"{e:.1e}" for e in errs))

# Every option at once (GQA, window, softcap, ALiBi, dropout), float16 and bfloat16, default tiles
for d, dtype in ((64, np.float16), (128, ml_dtypes.bfloat16)) if "options" in PARTS else ():
    hq, hdo = (rng.standard_normal((2, 150, 4, d)).astype(dtype) for _ in range(2))
    hk, hv = (rng.standard_normal((2, 211, 2, d)).astype(dtype) for _ in range(2))
    opts = dict(causal=True, window_size=(60, 0), softcap=5.0, alibi_slopes=np.float32([0.1, 0.2, 0.3, 0.4]),
                dropout_p=0.2, dropout_seed=7, kernel="tc")
    out, lse = flashnumba.flash_attn_forward(hq, hk, hv, **opts)
    grads = flashnumba.flash_attn_backward(hdo, hq, hk, hv, out, lse, **opts)
    cupy.cuda.Device().synchronize()
    print("tc every option", d, np.dtype(dtype).name, "finite:", all(np.isfinite(np.asarray(x, np.float32)).all()
                                                                  for x in (out, *grads)))

# The TF32 forward (float32 on tensor cores), both modes
hq, hk, hv = (rng.standard_normal((1, 97, 2, 64)).astype(np.float32) for _ in range(3))
ref, _ = flashnumba.reference.attention_forward(hq, hk, hv, causal=True)
for kernel in ("tf32", "3xtf32") if "tf32" in PARTS else ():
    out, _ = flashnumba.flash_attn_forward(hq, hk, hv, causal=True, kernel=kernel)
    print(kernel, "max err out", f"{float(np.abs(out - ref).max()):.1e}")

# The atomic dQ (deterministic=False): the dK/dV kernel's adds into float32, default tiles and others, GQA
for b, sq, sk, h, hk_, d, causal, dtype, bm, bn in ((1, 77, 91, 2, 1, 64, True, np.float16, None, None),
                                                    (2, 65, 140, 2, 2, 128, False, ml_dtypes.bfloat16, None, None),
                                                    (1, 97, 70, 2, 2, 256, True, np.float16, None, None),
                                                    (1, 50, 33, 1, 1, 40, False, np.float16, 64, 16)
                                                    ) if "atomic" in PARTS else ():
    hq, hdo = (rng.standard_normal((b, sq, h, d)).astype(dtype) for _ in range(2))
    hk, hv = (rng.standard_normal((b, sk, hk_, d)).astype(dtype) for _ in range(2))
    out, lse = flashnumba.flash_attn_forward(hq, hk, hv, causal=causal, kernel="tc")
    grads = flashnumba.flash_attn_backward(hdo, hq, hk, hv, out, lse, causal=causal, kernel="tc", block_m=bm,
                                           block_n=bn, deterministic=False)
    cupy.cuda.Device().synchronize()
    f32 = [x.astype(np.float32) for x in (hq, hk, hv, hdo)]
    ref_grads = flashnumba.reference.attention_backward(f32[3], *f32[:3], causal=causal)
    errs = [float(np.abs(x.astype(np.float64) - r).max()) for x, r in zip(grads, ref_grads)]
    print("atomic dQ", b, sq, sk, h, hk_, d, causal, np.dtype(dtype).name, bm, bn, "max err dq/dk/dv",
          " ".join(f"{e:.1e}" for e in errs))
