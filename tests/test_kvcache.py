"""flash_attn_with_kvcache: the cache semantics of flash-attn (append in place, rotary, paged caches, batch index)
against the float64 NumPy reference (flashnumba.reference.kvcache_attention), which is itself checked against
plain attention and the complex-number form of the rotary embedding; the tolerance derived from the same
computation in the input's dtype."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import flashnumba
from conftest import assert_close_to_truth, to_numpy
from flashnumba import reference as ref
from flashnumba.decode import flash_attn_with_kvcache


def _rotary_tables(n, rotary_dim):
    theta = np.outer(np.arange(n), 1.0 / 10000 ** (np.arange(rotary_dim // 2) / (rotary_dim // 2)))
    return np.cos(theta), np.sin(theta)


def test_reference_rotary_is_the_complex_product():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((5, 2, 10))
    cos, sin = _rotary_tables(16, 6)
    pos = np.array([0, 3, 4, 9, 15])
    e = np.exp(1j * np.arctan2(sin, cos))[pos][:, None, :]
    r = ref.apply_rotary(x, cos, sin, pos, interleaved=True)
    z = (x[..., 0:6:2] + 1j * x[..., 1:6:2]) * e
    np.testing.assert_allclose(r[..., 0:6:2] + 1j * r[..., 1:6:2], z, atol=1e-12)
    r = ref.apply_rotary(x, cos, sin, pos, interleaved=False)
    z = (x[..., 0:3] + 1j * x[..., 3:6]) * e
    np.testing.assert_allclose(r[..., 0:3] + 1j * r[..., 3:6], z, atol=1e-12)
    np.testing.assert_array_equal(r[..., 6:], x[..., 6:])


def test_reference_with_an_empty_cache_is_causal_attention():
    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal((2, 6, 4 if n == "q" else 2, 8)) for n in "qkv")
    kc, vc = np.zeros((2, 9, 2, 8)), np.zeros((2, 9, 2, 8))
    out, lse, kc2, vc2 = ref.kvcache_attention(q, kc, vc, k, v, cache_seqlens=0, causal=True)
    o, l = ref.attention_forward(q, k, v, causal=True)
    np.testing.assert_allclose(out, o, atol=1e-14)
    np.testing.assert_allclose(lse, l, atol=1e-14)
    np.testing.assert_array_equal(kc2[:, :6], k)
    assert not kc.any()  # the reference modifies nothing


def _problem(rng, batch, seqlen_q, seqlen_new, nheads_k, groups, d, lens, paged, page, dtype, rotary_dim):
    nheads = nheads_k * groups
    q = rng.standard_normal((batch, seqlen_q, nheads, d)).astype(dtype)
    k = v = None
    if seqlen_new:
        k, v = (rng.standard_normal((batch, seqlen_new, nheads_k, d)).astype(dtype) for _ in range(2))
    need = max(lens) + seqlen_new
    kw = dict(cache_seqlens=np.array(lens, np.int32))
    if paged:
        per_seq = -(-max(need, 1) // page)
        pool = batch * per_seq + 2
        kc, vc = (rng.standard_normal((pool, page, nheads_k, d)).astype(dtype) for _ in range(2))
        kw["block_table"] = rng.permutation(pool)[:batch * per_seq].reshape(batch, per_seq).astype(np.int32)
    else:
        kc, vc = (rng.standard_normal((batch + 1, max(need, 1) + 3, nheads_k, d)).astype(dtype) for _ in range(2))
        kw["cache_batch_idx"] = rng.permutation(batch + 1)[:batch].astype(np.int32)
    if rotary_dim:
        cos, sin = _rotary_tables(need + seqlen_q + 1, rotary_dim)
        kw.update(rotary_cos=cos.astype(np.float32), rotary_sin=sin.astype(np.float32))
    return q, k, v, kc, vc, kw


def _check(q, k, v, kc, vc, kw, opts):
    truth_o, truth_l, truth_kc, truth_vc = ref.kvcache_attention(q, kc, vc, k, v, **kw, **opts)
    base_o, base_l, _, _ = ref.kvcache_attention(q, kc, vc, k, v, dtype=np.dtype(q.dtype), **kw, **opts)
    before = [None if x is None else x.copy() for x in (q, k, v)]
    kc1, vc1 = kc.copy(), vc.copy()
    out, lse = flash_attn_with_kvcache(q, kc1, vc1, k, v, return_softmax_lse=True, **kw, **opts)
    out, lse = to_numpy(out), to_numpy(lse)
    assert out.shape == q.shape and lse.shape == (q.shape[0], q.shape[2], q.shape[1])
    n = max(q.shape[-1], kc.shape[1])
    assert_close_to_truth("out", out, truth_o, base_o.astype(q.dtype), reduction=n)
    assert_close_to_truth("lse", lse, truth_l, base_l.astype(np.float32), reduction=n)
    np.testing.assert_array_equal(vc1, truth_vc)  # appended in place, exactly as the reference
    if "rotary_cos" in kw:  # keys rotated in float32 (as flash-attn), the reference in float64 then rounded once:
        ulp = np.finfo(kc.dtype).eps  # a few units in the last place apart
        np.testing.assert_allclose(kc1.astype(np.float64), truth_kc.astype(np.float64), rtol=4 * ulp, atol=4 * ulp)
    else:
        np.testing.assert_array_equal(kc1, truth_kc)
    for x, b in zip((q, k, v), before):
        assert x is None or np.array_equal(x, b)  # nothing else modified


@settings(max_examples=4 if flashnumba.SIMULATOR else 300, deadline=None)
@given(batch=st.integers(1, 3), seqlen_q=st.sampled_from([1, 2, 5]), seqlen_new=st.sampled_from([0, 1, 5]),
       nheads_k=st.sampled_from([1, 2]), groups=st.sampled_from([1, 2]), lens=st.lists(st.sampled_from([0, 1, 7, 20]),
       min_size=3, max_size=3), paged=st.booleans(), page=st.sampled_from([16, 32]),
       rotary=st.sampled_from([(0, True), (8, True), (16, False)]), causal=st.booleans(),
       extra=st.sampled_from([{}, {"window_size": (4, 0)}, {"softcap": 3.0}, {"alibi": True}]), seed=st.integers(0, 99))
def test_drawn_caches(batch, seqlen_q, seqlen_new, nheads_k, groups, lens, paged, page, rotary, causal, extra, seed):
    rng = np.random.default_rng(seed)
    q, k, v, kc, vc, kw = _problem(rng, batch, seqlen_q, seqlen_new, nheads_k, groups, 16, lens[:batch], paged,
                                   page, np.float32, rotary[0])
    opts = dict(causal=causal, rotary_interleaved=rotary[1])
    if extra.get("alibi"):
        opts["alibi_slopes"] = (0.3 / np.arange(1, nheads_k * groups + 1)).astype(np.float32)
    else:
        opts.update(extra)
    _check(q, k, v, kc, vc, kw, opts)


def test_float16_paged_with_rotary():
    rng = np.random.default_rng(5)
    q, k, v, kc, vc, kw = _problem(rng, 2, 1, 1, 2, 2, 16, [17, 3], True, 16, np.float16, 8)
    _check(q, k, v, kc, vc, kw, dict(causal=True))


def test_bad_input_is_refused_before_anything_is_written():
    rng = np.random.default_rng(6)
    q, k, v, kc, vc, kw = _problem(rng, 2, 1, 1, 2, 1, 16, [3, 4], True, 16, np.float32, 8)
    kc0 = kc.copy()
    cases = [
        (dict(kw, cache_seqlens=np.array([16, 4], np.int32)), ValueError, "capacity"),
        (dict(kw, block_table=kw["block_table"] + 100), ValueError, "outside the pool"),
        (dict(kw, rotary_cos=kw["rotary_cos"][:3], rotary_sin=kw["rotary_sin"][:3]), ValueError, "rotary tables"),
        (dict(kw, cache_batch_idx=np.array([0, 1], np.int32)), ValueError, "cannot be combined"),
        (dict(kw, cache_seqlens=np.array([1.0, 2.0])), TypeError, "integers"),
        (dict(kw, num_splits=-1), ValueError, "num_splits"),
    ]
    for bad, err, match in cases:
        with pytest.raises(err, match=match):
            flash_attn_with_kvcache(q, kc, vc, k, v, **bad)
    with pytest.raises(TypeError, match="share a dtype"):
        flash_attn_with_kvcache(q.astype(np.float16), kc, vc, **kw)
    with pytest.raises(ValueError, match="both k and v"):
        flash_attn_with_kvcache(q, kc, vc, k, None, **kw)
    with pytest.raises(ValueError, match="page size"):
        flash_attn_with_kvcache(q, kc[:, :8], vc[:, :8], k, v, cache_seqlens=np.array([1, 1], np.int32),
                                block_table=np.zeros((2, 1), np.int32))
    np.testing.assert_array_equal(kc, kc0)
