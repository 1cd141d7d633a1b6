"""The causal mask_mod with a block mask at several tensor-core forward tiles, beside the built-in causal kernel,
8 documents' mask_mod on the Hopper forward at the planner's and one warpgroup's tiles, then the backward (the
causal and 8 documents' mask_mods with their block masks, at d=64 also with the dQ kernel's key tiles of 64 beside
the planner's 128); on compute capability 9.0 the default is the Hopper forward (B_c 128 at d=128, 64 its tiles
before the mask bits: "mod wgmma B_c 64"). On a GPU:

    python scripts/flex_tiles.py

(float16, seqlen 8192, batch 2, heads 2048 / head_dim; ms of one call per event pair.) With ``ncu D``: the built-in
causal forward and backward and the causal mask_mod's with the block mask at head_dim D, once each between
profiler start and stop, for Nsight Compute (``ncu --profile-from-start off ... python scripts/flex_tiles.py ncu
64``).
"""
import sys

import cupy
import numpy as np

import flashnumba
from flashnumba.tools.timing import cuda_time_ms
from flex_bench import causal_mod, doc_mod  # (the same masks as the benchmark's; this script's folder is on the path)


n = 8192


def arrays(d):
    """The arrays at head_dim d: q, k, v, dout (float16, batch 16384 / n, heads 2048 / d, drawn from a generator
    seeded with d), the causal mask_mod's block mask of 128, 8 documents' ids and their block mask."""
    rng = np.random.default_rng(d)
    q, k, v, dout = (cupy.asarray(rng.standard_normal((16384 // n, n, 2048 // d, d)).astype(np.float16))
                     for _ in range(4))
    bm = flashnumba.create_block_mask(causal_mod, 1, 1, n, n, like=q, BLOCK_SIZE=128)
    docs = cupy.asarray(np.repeat(np.arange(8), n // 8).astype(np.int32))
    bm_doc = flashnumba.create_block_mask(doc_mod, 1, 1, n, n, score_mod_args=(docs,), BLOCK_SIZE=128)
    return q, k, v, dout, bm, docs, bm_doc


def time_cases(d, cases):
    """Each (name, call) of ``cases`` once, then ms of one call per event pair; a failure is printed, not raised."""
    for name, fn in cases:
        try:
            fn()
            ms, _ = cuda_time_ms(fn, warmup=3, repeat=10)
            print(f"d={d} {name:28s} {ms:8.3f} ms", flush=True)
        except Exception as e:  # noqa: BLE001
            print(f"d={d} {name}: {type(e).__name__} {str(e)[:200]}", flush=True)


if len(sys.argv) > 2 and sys.argv[1] == "ncu":
    d = int(sys.argv[2])
    q, k, v, dout, bm, _, _ = arrays(d)
    out, lse = flashnumba.flash_attn_forward(q, k, v, causal=True)
    calls = [lambda: flashnumba.flash_attn_forward(q, k, v, causal=True),
             lambda: flashnumba.flash_attn_backward(dout, q, k, v, out, lse, causal=True),
             lambda: flashnumba.flex_attention(q, k, v, block_mask=bm),
             lambda: flashnumba.flex_attention_backward(dout, q, k, v, out, lse, block_mask=bm)]
    for fn in calls:
        fn()
    cupy.cuda.Device().synchronize()
    cupy.cuda.profiler.start()
    for fn in calls:
        fn()
    cupy.cuda.Device().synchronize()
    cupy.cuda.profiler.stop()
    print(f"profiled the built-in causal and the causal mask_mod, forward and backward, d={d}")
    sys.exit()
for d in (64, 128):
    q, k, v, _, bm, _, _ = arrays(d)
    cases = [("built-in causal", lambda: flashnumba.flash_attn_forward(q, k, v, causal=True)),
             ("mod default", lambda: flashnumba.flex_attention(q, k, v, block_mask=bm)),
             ("mod wgmma B_c 64", lambda: flashnumba.flex_attention(q, k, v, block_mask=bm, kernel="wgmma",
                                                                   block_n=64))]
    for m, bn, nt in ((128, 128, 256), (128, 64, 256), (128, 64, 128), (64, 64, 128)):
        cases.append((f"mod ({m}, {bn}, {nt})", lambda m=m, bn=bn, nt=nt: flashnumba.flex_attention(
            q, k, v, block_mask=bm, kernel="tc", block_m=m, block_n=bn, num_threads=nt)))
    print(d, "built-in", flashnumba.plan(q, k, v, causal=True).launches[0].tiles, flush=True)
    time_cases(d, cases)

# 8 documents' mask_mod with its block mask on the Hopper forward at the planner's tiles and at one warpgroup's (a
# short key loop: 8 tiles a query block, where one block of 384 threads an SM does not overlap one block's start
# and end with another's tiles)
for d in (64, 128):
    q, k, v, _, _, docs, bm_doc = arrays(d)
    cases = [("dense built-in", lambda: flashnumba.flash_attn_forward(q, k, v)),
             ("documents default", lambda: flashnumba.flex_attention(q, k, v, block_mask=bm_doc,
                                                                      score_mod_args=(docs,)))]
    for m, bn, nt in ((64, 128, 128), (64, 64, 128)):
        cases.append((f"documents wgmma ({m}, {bn}, {nt})", lambda m=m, bn=bn, nt=nt: flashnumba.flex_attention(
            q, k, v, block_mask=bm_doc, score_mod_args=(docs,), kernel="wgmma", block_m=m, block_n=bn,
            num_threads=nt)))
    time_cases(d, cases)

# the backward of the causal mask_mod with the block mask, and of 8 documents' mask_mod with its block mask, at the
# planner's tiles; at d=64 also with the dQ kernel's key tiles of 64 (the table's, without
# tiling.wgmma_dq_for_variant's 128 for a block-masked mask_mod)
from flashnumba import tiling  # noqa: E402


dq_tiles = tiling.wgmma_dq_for_variant
for d in (64, 128):
    q, k, v, dout, bm, docs, bm_doc = arrays(d)
    out, lse = flashnumba.flash_attn_forward(q, k, v, causal=True)
    cases = [("built-in causal bwd", lambda: flashnumba.flash_attn_backward(dout, q, k, v, out, lse, causal=True)),
             ("mod bwd default", lambda: flashnumba.flex_attention_backward(dout, q, k, v, out, lse, block_mask=bm)),
             ("documents bwd default", lambda: flashnumba.flex_attention_backward(
                 dout, q, k, v, out, lse, block_mask=bm_doc, score_mod_args=(docs,)))]
    for name, fn in cases + ([("mod bwd dQ keys 64", cases[1][1]), ("documents bwd dQ keys 64", cases[2][1])]
                             if d == 64 else []):
        if "dQ keys 64" in name:
            tiling.wgmma_dq_for_variant = lambda *a, block_masked=False, **kw: dq_tiles(*a, **kw)
            flashnumba.clear_plan_cache()
        fn()
        ms, _ = cuda_time_ms(fn, warmup=2, repeat=10)
        print(f"d={d} {name:28s} {ms:8.3f} ms", flush=True)
    tiling.wgmma_dq_for_variant = dq_tiles
    flashnumba.clear_plan_cache()
