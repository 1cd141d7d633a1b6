"""Run the forward and backward kernels on a few awkward shapes, for compute-sanitizer:

    compute-sanitizer --tool memcheck python scripts/sanitize.py
    compute-sanitizer --tool racecheck python scripts/sanitize.py
"""

import os
import runpy

import numpy as np
import cupy
import ml_dtypes

import flashnumba

rng = np.random.default_rng(0)
cases = [  # (batch, seqlen_q, seqlen_k, nheads, head_dim, causal, forward kwargs, backward kwargs)
    (1, 77, 77, 2, 64, False, {}, {}),
    (1, 77, 77, 2, 64, True, {}, {}),
    (2, 33, 97, 1, 59, True, {}, dict(block_m=16, block_n=32)),
    (1, 100, 17, 2, 40, True, dict(block_m=32, block_n=16, num_threads=64), {}),
    (1, 65, 129, 1, 128, False, {}, {}),
    (1, 70, 70, 1, 256, True, {}, {}),
    (1, 77, 91, 2, 64, True, dict(kernel="v1"), dict(block_m=32, block_n=16)),
    (1, 50, 30, 1, 96, False, dict(kernel="v1"), {}),
    (1, 77, 91, 2, 64, True, dict(kernel="v2"), {}),
    (2, 33, 97, 1, 59, False, dict(kernel="v2", block_m=32, block_n=16, num_threads=64), {}),
]
if os.environ.get("SANITIZE_CASES") == "defaults":  # the default kernels only, three awkward shapes
    cases = [(2, 33, 97, 1, 59, True, {}, {}), (1, 77, 70, 2, 128, False, {}, {}), (1, 70, 81, 1, 256, True, {}, {})]
for b, sq, sk, h, d, causal, fkw, bkw in cases:
    q, k, v = (cupy.asarray(rng.standard_normal((b, s, h, d), dtype=np.float32)) for s in (sq, sk, sk))
    dout = cupy.asarray(rng.standard_normal((b, sq, h, d), dtype=np.float32))
    out, lse = flashnumba.flash_attn_forward(q, k, v, causal=causal, **fkw)
    dq, dk, dv = flashnumba.flash_attn_backward(dout, q, k, v, out, lse, causal=causal, **bkw)
    cupy.cuda.Device().synchronize()
    hq, hk, hv, hdo = (x.get() for x in (q, k, v, dout))
    ref, _ = flashnumba.reference.attention_forward(hq, hk, hv, causal=causal)
    grads = flashnumba.reference.attention_backward(hdo, hq, hk, hv, causal=causal)
    errs = [float(np.abs(x.get() - r).max()) for x, r in zip((out, dq, dk, dv), (ref, *grads))]
    print(b, sq, sk, h, d, causal, fkw, bkw, "max err out/dq/dk/dv", " ".join(f"{e:.1e}" for e in errs))

# The options (GQA, window, softcap, ALiBi, dropout) and a packed variable-length batch, default kernels.
b, sq, sk, h, hk, d = 2, 65, 97, 4, 2, 64
q, dout = (cupy.asarray(rng.standard_normal((b, sq, h, d), dtype=np.float32)) for _ in range(2))
k, v = (cupy.asarray(rng.standard_normal((b, sk, hk, d), dtype=np.float32)) for _ in range(2))
slopes = rng.uniform(0, 0.5, h).astype(np.float32)
opts = dict(causal=True, window_size=(40, 0), softcap=5.0, dropout_p=0.2, dropout_seed=7)
out, lse = flashnumba.flash_attn_forward(q, k, v, alibi_slopes=cupy.asarray(slopes), **opts)
grads = flashnumba.flash_attn_backward(dout, q, k, v, out, lse, alibi_slopes=cupy.asarray(slopes), **opts)
cupy.cuda.Device().synchronize()
z = flashnumba.reference.dropout_z(7, 0, b, h, sq, sk, 0.2)
ref_opts = dict(causal=True, window_size=(40, 0), softcap=5.0, alibi_slopes=slopes, dropout_z=z)
hq, hk_, hv, hdo = (x.get() for x in (q, k, v, dout))
ref, _ = flashnumba.reference.attention_forward(hq, hk_, hv, **ref_opts)
ref_grads = flashnumba.reference.attention_backward(hdo, hq, hk_, hv, **ref_opts)
errs = [float(np.abs(x.get() - r).max()) for x, r in zip((out, *grads), (ref, *ref_grads))]
print("options", opts, "max err out/dq/dk/dv", " ".join(f"{e:.1e}" for e in errs))

lens_q, lens_k = [0, 37, 70], [50, 0, 81]
cu_q = np.concatenate([[0], np.cumsum(lens_q)]).astype(np.int32)
cu_k = np.concatenate([[0], np.cumsum(lens_k)]).astype(np.int32)
q, dout = (cupy.asarray(rng.standard_normal((cu_q[-1], h, d), dtype=np.float32)) for _ in range(2))
k, v = (cupy.asarray(rng.standard_normal((cu_k[-1], hk, d), dtype=np.float32)) for _ in range(2))
cq, ck = cupy.asarray(cu_q), cupy.asarray(cu_k)
out, lse = flashnumba.flash_attn_varlen_forward(q, k, v, cq, ck, 70, 81, causal=True)
grads = flashnumba.flash_attn_varlen_backward(dout, q, k, v, out, lse, cq, ck, 70, 81, causal=True)
cupy.cuda.Device().synchronize()
hq, hk_, hv, hdo = (x.get() for x in (q, k, v, dout))
ref, _ = flashnumba.reference.attention_varlen_forward(hq, hk_, hv, cu_q, cu_k, causal=True)
ref_grads = flashnumba.reference.attention_varlen_backward(hdo, hq, hk_, hv, cu_q, cu_k, causal=True)
errs = [float(np.abs(x.get() - r).max()) for x, r in zip((out, *grads), (ref, *ref_grads))]
print("varlen", lens_q, lens_k, "max err out/dq/dk/dv", " ".join(f"{e:.1e}" for e in errs))

# bfloat16 (NumPy arrays of ml_dtypes.bfloat16, copied to the GPU and back): the shapes and options of the options
# case above, default kernels.
bf16 = ml_dtypes.bfloat16
q, dout = (rng.standard_normal((b, sq, h, d)).astype(bf16) for _ in range(2))
k, v = (rng.standard_normal((b, sk, hk, d)).astype(bf16) for _ in range(2))
out, lse = flashnumba.flash_attn_forward(q, k, v, alibi_slopes=slopes, **opts)
grads = flashnumba.flash_attn_backward(dout, q, k, v, out, lse, alibi_slopes=slopes, **opts)
ref, _ = flashnumba.reference.attention_forward(q, k, v, **ref_opts)
ref_grads = flashnumba.reference.attention_backward(dout, q, k, v, **ref_opts)
errs = [float(np.abs(x.astype(np.float64) - r).max()) for x, r in zip((out, *grads), (ref, *ref_grads))]
print("bfloat16", opts, "max err out/dq/dk/dv", " ".join(f"{e:.1e}" for e in errs))

runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), "sanitize_tc.py"))  # the tensor-core forward
