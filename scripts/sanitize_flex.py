"""Run flex_attention's kernels (a user's score_mod and mask_mod compiled in) on awkward shapes, for
compute-sanitizer:

    compute-sanitizer --tool memcheck python scripts/sanitize_flex.py
    compute-sanitizer --tool racecheck python scripts/sanitize_flex.py

Each example of the tests (tests/test_flex.py) runs forward and backward on the tensor-core kernels (float16) and
on the SIMT kernels (float32), with GQA, seqlens that are not multiples of any tile, and a block mask, forward
and backward (create_block_mask's kernel too); on compute capability 9.0 each example also on the
Hopper kernels (kernel="wgmma"), forward and backward, with and without the block mask (the examples without a
mask_mod, without); every result is compared with the float64 reference.
"""

import os
import sys

import numpy as np

import flashnumba
from flashnumba import reference as ref

try:
    import cupy as xp
    SHAPES = ((1, 77, 93, 2, 2, 64), (2, 33, 150, 1, 4, 128))
    HOPPER = xp.cuda.Device().compute_capability == "90"
except ImportError:  # (a dry run in the simulator: NumPy arrays, small shapes)
    xp = np
    SHAPES = ((1, 9, 13, 1, 2, 16),)
    HOPPER = False

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
from test_flex import EXAMPLES  # noqa: E402

if os.environ.get("SANITIZE_FLEX_SHAPES") == "one":  # (the first shape only: a sanitizer's run is slow)
    SHAPES = SHAPES[:1]
NAMES = os.environ.get("SANITIZE_FLEX_EXAMPLES", ",".join(EXAMPLES)).split(",")  # (a subset, for racecheck)
rng = np.random.default_rng(0)


def _host(x):
    return x.get() if hasattr(x, "get") else x


for name in NAMES:
    score_mod, grad, mask_mod, make_args = EXAMPLES[name]
    for b, sq, sk, hk, groups, d in SHAPES:
        h = hk * groups
        args = make_args(sq, sk, rng) if make_args else ()
        q = rng.standard_normal((b, sq, h, d)).astype(np.float32)
        k, v = (rng.standard_normal((b, sk, hk, d)).astype(np.float32) for _ in range(2))
        dout = rng.standard_normal(q.shape).astype(np.float32)
        dargs = tuple(xp.asarray(a) for a in args)
        kw = dict(score_mod_args=dargs, enable_gqa=groups > 1)
        truth, _ = ref.flex_attention_forward(q, k, v, score_mod=score_mod, mask_mod=mask_mod, score_mod_args=args)
        dq_, dk_, dv_ = ref.flex_attention_backward(dout, q, k, v, score_mod=score_mod, score_mod_grad=grad,
                                                    mask_mod=mask_mod, score_mod_args=args)
        # float32 on the SIMT kernels, forward and backward
        cq, ck, cv, cdo = (xp.asarray(x) for x in (q, k, v, dout))
        out, lse = flashnumba.flex_attention(cq, ck, cv, score_mod, mask_mod, return_lse=True, **kw)
        grads = flashnumba.flex_attention_backward(cdo, cq, ck, cv, out, lse, score_mod, mask_mod,
                                                   score_mod_grad=grad, **kw)
        errs = [float(np.abs(_host(x) - r).max()) for x, r in zip((out, *grads), (truth, dq_, dk_, dv_))]
        # float16 on the tensor-core forward, without and with a block mask
        hq, hk_, hv = (xp.asarray(x.astype(np.float16)) for x in (q, k, v))
        out16, lse16 = flashnumba.flex_attention(hq, hk_, hv, score_mod, mask_mod, return_lse=True, **kw)
        errs.append(float(np.abs(_host(out16).astype(np.float64) - truth).max()))
        # and the float16 backward on the tensor cores
        grads16 = flashnumba.flex_attention_backward(xp.asarray(dout.astype(np.float16)), hq, hk_, hv, out16, lse16,
                                                     score_mod, mask_mod, score_mod_grad=grad, kernel="tc", **kw)
        errs += [float(np.abs(_host(x).astype(np.float64) - r).max()) for x, r in zip(grads16, (dq_, dk_, dv_))]
        if mask_mod is not None:
            bm = flashnumba.create_block_mask(mask_mod, b, 1, sq, sk, score_mod_args=dargs, like=hq)
            outbm, lsebm = flashnumba.flex_attention(hq, hk_, hv, score_mod, mask_mod, block_mask=bm, return_lse=True,
                                                     **kw)
            errs.append(float(np.abs(_host(outbm).astype(np.float64) - truth).max()))
            gbm = flashnumba.flex_attention_backward(xp.asarray(dout.astype(np.float16)), hq, hk_, hv, outbm, lsebm,
                                                     score_mod, score_mod_grad=grad, block_mask=bm, **kw)
            errs += [float(np.abs(_host(x).astype(np.float64) - r).max()) for x, r in zip(gbm, (dq_, dk_, dv_))]
        if HOPPER:  # the Hopper kernels, without and with the block mask (a mask_mod's)
            for extra in (dict(mask_mod=mask_mod),) + ((dict(block_mask=bm),) if mask_mod is not None else ()):
                ow, lw = flashnumba.flex_attention(hq, hk_, hv, score_mod, return_lse=True, kernel="wgmma", **extra,
                                                   **kw)
                gw = flashnumba.flex_attention_backward(xp.asarray(dout.astype(np.float16)), hq, hk_, hv, ow, lw,
                                                        score_mod, score_mod_grad=grad, kernel="wgmma", **extra, **kw)
                errs += [float(np.abs(_host(x).astype(np.float64) - r).max())
                         for x, r in zip((ow, *gw), (truth, dq_, dk_, dv_))]
        print(f"{name:24s} b{b} sq{sq} sk{sk} h{h}/{hk} d{d}: max err fp32 out/dq/dk/dv, fp16 out/dq/dk/dv "
              "(, block mask out/dq/dk/dv; Hopper without, with the block mask out/dq/dk/dv)",
              " ".join(f"{e:.1e}" for e in errs), flush=True)
