"""A first look on a GPU: each default plan of the common cases runs and matches the float64 reference (max error
printed beside float32 NumPy's for scale). Usage: python scripts/smoke_gpu.py"""

import numpy as np

import flashnumba
from flashnumba import reference

rng = np.random.default_rng(0)
for dtype in (np.float32, np.float16):
    for d in (64, 128, 40):
        for causal in (False, True):
            q, k, v, do = (rng.standard_normal((2, 100, 4, d)).astype(dtype) for _ in range(4))
            import cupy

            cq, ck, cv, cdo = (cupy.asarray(x) for x in (q, k, v, do))
            out, lse = flashnumba.flash_attn_forward(cq, ck, cv, causal=causal)
            dq, dk, dv = flashnumba.flash_attn_backward(cdo, cq, ck, cv, out, lse, causal=causal)
            ref_o, ref_l = reference.attention_forward(q, k, v, causal=causal)
            ref_g = reference.attention_backward(do, q, k, v, causal=causal)
            errs = [float(np.abs(cupy.asnumpy(a).astype(np.float64) - b).max())
                    for a, b in zip((out, dq, dk, dv), (ref_o, *ref_g))]
            p = flashnumba.plan(cq, ck, cv, causal=causal)
            print(f"{np.dtype(dtype).name:8} d={d:3} causal={causal!s:5} kernel={p.kernel:3} "
                  f"errors out/dq/dk/dv {' '.join(f'{e:.1e}' for e in errs)}")
