"""Run the split-KV decoding kernels on awkward caches, for compute-sanitizer (memcheck, racecheck):

    compute-sanitizer --tool memcheck python scripts/sanitize_decode.py

Cache lengths 0, 1 and a page's end, splits from 1 to more than the tiles, paged and contiguous caches, the
query heads of a key/value head as rows (GQA 4 and 8), seqlen_q > 1 with causal and window masks, head dims 40
and 256; then lengths, pages and batch indices outside the cache that the host did not check, with and without
new keys to append (and rotation positions past the tables); a whole step with new keys and rotations. Each result is
compared with the float64 reference (a loose check: the test suite has the tolerances).
"""

import cupy
import numpy as np

import flashnumba
from flashnumba import reference as ref

rng = np.random.default_rng(0)
cases = [  # (batch, seqlen_q, nheads, nheads_k, d, lens, page or 0, num_splits, options)
    (2, 1, 8, 2, 128, [0, 1], 0, 1, {}),
    (2, 1, 32, 4, 128, [300, 64], 64, 0, {}),
    (3, 1, 8, 1, 64, [17, 16, 200], 16, 7, dict(causal=True)),
    (2, 5, 4, 2, 40, [90, 3], 0, 3, dict(causal=True, window_size=(20, 0))),
    (1, 3, 8, 8, 256, [130], 32, 2, dict(softcap=5.0, alibi_slopes=np.linspace(0.1, 1, 8).astype(np.float32))),
    (2, 1, 8, 2, 64, [5, 40], 0, 50, {}),  # more splits than tiles
]
for batch, sq, h, hk, d, lens, page, splits, opts in cases:
    q = rng.standard_normal((batch, sq, h, d)).astype(np.float16)
    cap = max(max(lens), 1)
    if page:
        per = -(-cap // page)
        kc, vc = (rng.standard_normal((batch * per + 1, page, hk, d)).astype(np.float16) for _ in range(2))
        kw = dict(block_table=cupy.asarray(rng.permutation(batch * per + 1)[:batch * per].reshape(batch, per)
                                           .astype(np.int32)))
        rkw = dict(block_table=cupy.asnumpy(kw["block_table"]))
    else:
        kc, vc = (rng.standard_normal((batch, cap, hk, d)).astype(np.float16) for _ in range(2))
        kw, rkw = {}, {}
    o_ref, _, _, _ = ref.kvcache_attention(q, kc, vc, cache_seqlens=np.array(lens, np.int32), **rkw, **opts)
    copts = {n: (cupy.asarray(x) if isinstance(x, np.ndarray) else x) for n, x in opts.items()}
    out = flashnumba.flash_attn_with_kvcache(cupy.asarray(q), cupy.asarray(kc), cupy.asarray(vc),
                                             cache_seqlens=cupy.asarray(np.array(lens, np.int32)),
                                             num_splits=splits, **kw, **copts)
    err = float(np.abs(cupy.asnumpy(out).astype(np.float64) - o_ref).max())
    print(f"decode batch {batch} seqlen_q {sq} heads {h}/{hk} d {d} lens {lens} page {page} splits {splits} "
          f"{opts and sorted(opts)}: max error {err:.2e}")
    assert err < 2e-2, err
# values the host does not check (device arrays, config.check_cache_values off, the default): lengths past the
# cache, a page outside the pool, a batch index outside the cache, new keys that would land outside; the kernels
# must stay inside the arrays
q = cupy.asarray(rng.standard_normal((2, 1, 8, 64)).astype(np.float16))
kc, vc = (cupy.asarray(rng.standard_normal((2, 128, 2, 64)).astype(np.float16)) for _ in range(2))
flashnumba.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=cupy.asarray(np.array([5000, -3], np.int32)),
                                   cache_batch_idx=cupy.asarray(np.array([1, 9], np.int32)), num_splits=3)
kp, vp = (x.reshape(4, 64, 2, 64) for x in (kc, vc))
flashnumba.flash_attn_with_kvcache(q, kp, vp, cache_seqlens=cupy.asarray(np.array([128, 128], np.int32)),
                                   block_table=cupy.asarray(np.array([[0, 99], [-5, 3]], np.int32)))
knew, vnew = (cupy.asarray(rng.standard_normal((2, 3, 2, 64)).astype(np.float16)) for _ in range(2))
# (tables as long as the cache, as lengths on the device need; positions past them, from lengths past the cache)
cos, sin = (cupy.asarray(rng.standard_normal((128, 16)).astype(np.float32)) for _ in range(2))
for bad in (dict(cache_seqlens=cupy.asarray(np.array([126, -2], np.int32)), cache_batch_idx=cupy.asarray(
        np.array([0, 7], np.int32))), dict(cache_seqlens=cupy.asarray(np.array([100, 1000], np.int32)))):
    flashnumba.flash_attn_with_kvcache(q, kc, vc, knew, vnew, rotary_cos=cos, rotary_sin=sin, causal=True, **bad)
flashnumba.flash_attn_with_kvcache(q, kp, vp, knew, vnew, rotary_cos=cos, rotary_sin=sin,
                                   cache_seqlens=cupy.asarray(np.array([62, 126], np.int32)),
                                   block_table=cupy.asarray(np.array([[0, 99], [-5, 3]], np.int32)))
# a whole step on good values: new keys appended in place and rotated with the queries, against the reference
kc0, vc0 = cupy.asnumpy(kc), cupy.asnumpy(vc)
lens = np.array([20, 0], np.int32)
out = flashnumba.flash_attn_with_kvcache(q, kc, vc, knew, vnew, rotary_cos=cos, rotary_sin=sin, causal=True,
                                         cache_seqlens=cupy.asarray(lens), rotary_interleaved=False)
o_ref, _, kc_ref, _ = ref.kvcache_attention(cupy.asnumpy(q), kc0, vc0, cupy.asnumpy(knew), cupy.asnumpy(vnew),
                                            rotary_cos=cupy.asnumpy(cos), rotary_sin=cupy.asnumpy(sin),
                                            cache_seqlens=lens, causal=True, rotary_interleaved=False)
err = float(np.abs(cupy.asnumpy(out).astype(np.float64) - o_ref).max())
kerr = float(np.abs(cupy.asnumpy(kc).astype(np.float64) - kc_ref.astype(np.float64)).max())
print(f"decode step with 3 new keys, rotary (halves), causal: max error {err:.2e}, cache {kerr:.2e}")
assert err < 2e-2 and kerr < 1e-2, (err, kerr)
cupy.cuda.Device().synchronize()
print("sanitize_decode done")
