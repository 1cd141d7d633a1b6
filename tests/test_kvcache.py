"""flash_attn_with_kvcache: the cache semantics of flash-attn (append in place, rotary, paged caches, batch index)
against the float64 NumPy reference (flashnumba.reference.kvcache_attention), which is itself checked against
plain attention and the complex-number form of the rotary embedding; the tolerance derived from the same
computation in the input's dtype."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import flashnumba
from conftest import FULL_COMPILE, PROFILE, assert_close_to_truth, eps, to_numpy
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


def test_reference_of_an_empty_batch():
    out, lse, kc, vc = ref.kvcache_attention(np.zeros((0, 2, 4, 8)), np.zeros((0, 5, 2, 8)), np.zeros((0, 5, 2, 8)))
    assert out.shape == (0, 2, 4, 8) and lse.shape == (0, 4, 2) and kc.shape == vc.shape == (0, 5, 2, 8)


@pytest.mark.parametrize("opts", [dict(causal=True), dict(window_size=(5, 2)), dict(alibi_slopes=[0.5, 0.25])])
def test_reference_left_padding_is_the_cache_without_it(opts):
    """cache_leftpad as flash-attn defines it: attention over the cache with its first positions cut away (the
    causal diagonal, a window and ALiBi's distances all taken from the end, so they do not move)."""
    rng = np.random.default_rng(2)
    q, k, v = (rng.standard_normal((2, 3, 2 if n == "q" else 1, 8)) for n in "qkv")
    kc, vc = (rng.standard_normal((2, 30, 1, 8)) for _ in range(2))
    lens, pad = np.array([20, 9]), np.array([7, 9])
    got = ref.kvcache_attention(q, kc, vc, k, v, cache_seqlens=lens, cache_leftpad=pad, **opts)
    for b in range(2):
        want = ref.kvcache_attention(q[b:b + 1], kc[b:b + 1, pad[b]:], vc[b:b + 1, pad[b]:], k[b:b + 1],
                                     v[b:b + 1], cache_seqlens=lens[b] - pad[b], **opts)
        np.testing.assert_allclose(got[0][b], want[0][0], atol=1e-14)
        np.testing.assert_allclose(got[1][b], want[1][0], atol=1e-14)
        np.testing.assert_array_equal(got[2][b, pad[b]:], want[2][0])


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


def _problem(rng, batch, seqlen_q, seqlen_new, nheads_k, groups, d, lens, paged, page, dtype, rotary_dim,
             leftpad=False):
    """A decoding problem: (q, k, v, k_cache, v_cache, the reference's keyword arguments); ``leftpad`` (where the
    cache is contiguous): each sequence's keys start at a drawn position in [0, its length]."""
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
        if leftpad:
            kw["cache_leftpad"] = np.array([rng.integers(0, n + 1) for n in lens], np.int32)
    if rotary_dim:
        cos, sin = _rotary_tables(need + seqlen_q + 1, rotary_dim)
        kw.update(rotary_cos=cos.astype(np.float32), rotary_sin=sin.astype(np.float32))
    return q, k, v, kc, vc, kw


def _check(q, k, v, kc, vc, kw, opts, call=None):
    """flash_attn_with_kvcache(..., **kw, **opts, **call) against the reference (which takes kw and opts)."""
    truth_o, truth_l, truth_kc, truth_vc = ref.kvcache_attention(q, kc, vc, k, v, **kw, **opts)
    base_o, base_l, _, _ = ref.kvcache_attention(q, kc, vc, k, v, dtype=np.dtype(q.dtype), **kw, **opts)
    before = [None if x is None else x.copy() for x in (q, k, v)]
    kc1, vc1 = kc.copy(), vc.copy()
    out, lse = flash_attn_with_kvcache(q, kc1, vc1, k, v, return_softmax_lse=True, **kw, **opts, **(call or {}))
    out, lse = to_numpy(out), to_numpy(lse)
    assert out.shape == q.shape and lse.shape == (q.shape[0], q.shape[2], q.shape[1])
    n = max(q.shape[-1], kc.shape[1])
    assert_close_to_truth("out", out, truth_o, base_o.astype(q.dtype), reduction=n)
    assert_close_to_truth("lse", lse, truth_l, base_l.astype(np.float32), reduction=n)
    np.testing.assert_array_equal(vc1, truth_vc)  # appended in place, exactly as the reference
    if "rotary_cos" in kw:  # keys rotated in float32 (as flash-attn), the reference in float64 then rounded once:
        ulp = eps(kc.dtype)  # a few units in the last place apart
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
       extra=st.sampled_from([{}, {"window_size": (4, 0)}, {"softcap": 3.0}, {"alibi": True}]), seed=st.integers(0, 99),
       leftpad=st.booleans())
def test_drawn_caches(batch, seqlen_q, seqlen_new, nheads_k, groups, lens, paged, page, rotary, causal, extra, seed,
                      leftpad):
    rng = np.random.default_rng(seed)
    q, k, v, kc, vc, kw = _problem(rng, batch, seqlen_q, seqlen_new, nheads_k, groups, 16, lens[:batch], paged,
                                   page, np.float32, rotary[0], leftpad)
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
        (dict(kw, cache_seqlens=np.array([3, 2**63], np.uint64)), ValueError, "holds 9223372036854775808"),
    ]
    for bad, err, match in cases:
        with pytest.raises(err, match=match):
            flash_attn_with_kvcache(q, kc, vc, k, v, **bad)
    with pytest.raises(TypeError, match="k_cache has dtype float32 but q has dtype float16"):
        flash_attn_with_kvcache(q.astype(np.float16), kc, vc, **kw)
    with pytest.raises(ValueError, match="both k and v"):
        flash_attn_with_kvcache(q, kc, vc, k, None, **kw)
    with pytest.raises(ValueError, match="page size"):
        flash_attn_with_kvcache(q, kc[:, :8], vc[:, :8], k, v, cache_seqlens=np.array([1, 1], np.int32),
                                block_table=np.zeros((2, 1), np.int32))
    with pytest.raises(ValueError, match="rotary_cos and rotary_sin must both be given"):  # (sin alone was ignored)
        flash_attn_with_kvcache(q, kc, vc, k, v, **dict(kw, rotary_cos=None))
    flat, flat_v = (rng.standard_normal((3, 16, 2, 16)).astype(np.float32) for _ in range(2))
    flat0 = flat.copy()
    with pytest.raises(ValueError, match=r"names a cache sequence twice \(\[1, 1\]\)"):
        flash_attn_with_kvcache(q, flat, flat_v, k, v, cache_seqlens=np.array([3, 4], np.int32),
                                cache_batch_idx=np.array([1, 1], np.int32))
    np.testing.assert_array_equal(flat, flat0)
    flash_attn_with_kvcache(q, flat, flat_v, cache_seqlens=np.array([3, 4], np.int32),  # (reading twice: taken)
                            cache_batch_idx=np.array([1, 1], np.int32))
    read_only = vc.copy()
    read_only.flags.writeable = False
    with pytest.raises(ValueError, match="v_cache is a read-only NumPy array"):  # (k_cache was written first)
        flash_attn_with_kvcache(q, kc, read_only, k, v, **kw)
    np.testing.assert_array_equal(kc, kc0)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_arrays_the_attention_cannot_take_are_refused_before_the_append(dtype):
    """The gather path appends the new keys, then runs the varlen forward: what that forward would refuse (a dtype,
    a head_dim, no heads) is refused before the append, and arrays that are no arrays by their names."""
    rng = np.random.default_rng(7)

    def arrays(d=16, heads=2, dt=dtype):
        return [rng.standard_normal(s).astype(dt) for s in ((1, 1, heads, d), (1, 8, 2, d), (1, 8, 2, d),
                                                                (1, 1, 2, d), (1, 1, 2, d))]

    cases = [(arrays(dt=np.float64), TypeError, "q has dtype float64; supported dtypes are"),
             (arrays(d=264), ValueError, r"head_dim must be in \[1, 256\], got 264"),
             (arrays(heads=0), ValueError, "q and k_cache must have heads")]
    for (q, kc, vc, k, v), err, match in cases:
        kc0, vc0 = kc.copy(), vc.copy()
        with pytest.raises(err, match=match):
            flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=3)
        np.testing.assert_array_equal(kc, kc0)
        np.testing.assert_array_equal(vc, vc0)
    q, kc, vc, k, v = arrays()
    with pytest.raises(TypeError, match="^q: expected a NumPy array"):
        flash_attn_with_kvcache(q.tolist(), kc, vc, cache_seqlens=3)
    with pytest.raises(TypeError, match="^k_cache: expected a NumPy array"):
        flash_attn_with_kvcache(q, None, vc, cache_seqlens=3)
    with pytest.raises(TypeError, match="^rotary_cos: expected a NumPy array"):
        flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=3, rotary_cos=[[1.0]], rotary_sin=[[0.0]])


def test_a_strided_numpy_cache_is_written_in_place():
    """A cache that is a view with strides (every other head of a bigger array) takes the new keys and values in
    place, as a contiguous one does, and the rest of the bigger array stays as it was."""
    rng = np.random.default_rng(7)
    q, k, v = (rng.standard_normal((2, 1, 2, 16)).astype(np.float32) for _ in range(3))
    big = [rng.standard_normal((2, 24, 4, 16)).astype(np.float32) for _ in range(2)]
    whole = [b.copy() for b in big]
    lens = np.array([3, 10], np.int32)
    out = flash_attn_with_kvcache(q, whole[0][:, :, :2], whole[1][:, :, :2], k, v, cache_seqlens=lens)
    caches = [b[:, :, :2].copy() for b in big]
    want = flash_attn_with_kvcache(q, *caches, k, v, cache_seqlens=lens)
    np.testing.assert_array_equal(out, want)
    for w, b, c in zip(whole, big, caches):
        np.testing.assert_array_equal(w[:, :, :2], c)
        np.testing.assert_array_equal(w[:, :, 2:], b[:, :, 2:])


# ---------------------------------------------------------------------------------------------------------------
# the split-KV kernel (float16 / bfloat16): splits, the combine kernel, the reference's blocked version
# ---------------------------------------------------------------------------------------------------------------


@settings(max_examples=10 if flashnumba.SIMULATOR else 200, deadline=None)
@given(batch=st.integers(1, 2), seqlen_q=st.integers(1, 4), seqlen_k=st.integers(0, 70), nheads_k=st.integers(1, 2),
       groups=st.integers(1, 3), splits=st.integers(1, 5), causal=st.booleans(), seed=st.integers(0, 99))
def test_reference_split_is_attention(batch, seqlen_q, seqlen_k, nheads_k, groups, splits, causal, seed):
    """The blocked NumPy version of split-KV (parts over the keys, then combine_splits) is attention."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((batch, seqlen_q, nheads_k * groups, 8))
    k, v = (rng.standard_normal((batch, seqlen_k, nheads_k, 8)) for _ in range(2))
    o, lse = ref.attention_forward_split(q, k, v, num_splits=splits, causal=causal, window_size=(5, -1))
    o1, lse1 = ref.attention_forward(q, k, v, causal=causal, window_size=(5, -1))
    np.testing.assert_allclose(o, o1, atol=1e-12)
    np.testing.assert_allclose(lse, lse1, atol=1e-12)


def _device(x):
    from flashnumba._backend import cuda

    return x if flashnumba.SIMULATOR else cuda.to_device(x)


def _host(x):
    return x if isinstance(x, np.ndarray) else x.copy_to_host()


@pytest.mark.parametrize("dtype,S,threads", [(np.float16, 4, 64), ("bfloat16", 4, 64), (np.float16, 37, 32)])
def test_combine_kernel_against_numpy(dtype, S, threads):
    """The second kernel of a split call alone: parts with -inf (no key) among them, a row no part saw; more
    splits than a warp's lanes and not a multiple of the splits read at once."""
    from flashnumba.kernels.mma_decode import make_combine
    from flashnumba import _arrays

    if dtype == "bfloat16" and _arrays.bfloat16() is None:
        pytest.skip("ml_dtypes is not installed")
    rng = np.random.default_rng(3)
    b, sq, h, d = 2, 3, 2, 40
    o_part = rng.standard_normal((S, b, sq, h, d)).astype(np.float32)
    lse_part = (3 * rng.standard_normal((S, b, h, sq))).astype(np.float32)
    lse_part[1, 0, 0, 0] = -np.inf
    lse_part[:, 1, 1, 2] = -np.inf
    want_o, want_l = ref.combine_splits(o_part, lse_part)
    bf = dtype == "bfloat16"
    out = _device(np.full((b, sq, h, d), 0x7FC0 if bf else np.nan, np.uint16 if bf else dtype))
    lse = _device(np.full((b, h, sq), np.nan, np.float32))
    make_combine("bfloat16" if bf else "float16")[(sq, b * h), (threads,)](_device(o_part), _device(lse_part), out, lse)
    got = _host(out)
    got = got.view(_arrays.bfloat16()).astype(np.float32) if bf else got.astype(np.float32)
    tol = 2 * np.finfo(np.float16).eps if not bf else 2 ** -7
    np.testing.assert_allclose(got, want_o, rtol=tol, atol=tol)
    np.testing.assert_allclose(_host(lse), want_l, rtol=1e-6, atol=1e-5)
    assert not got[1, 2, 1].any() and np.isneginf(_host(lse)[1, 1, 2])


@settings(max_examples=3 if flashnumba.SIMULATOR else 100, deadline=None)
@given(batch=st.integers(1, 2), seqlen_q=st.sampled_from([1, 1, 2, 6]), seqlen_new=st.sampled_from([0, 1, 3]),
       nheads_k=st.sampled_from([1, 2]), groups=st.sampled_from([1, 3, 4, 8]),
       lens=st.lists(st.sampled_from([0, 1, 15, 64, 100]), min_size=2, max_size=2), paged=st.booleans(),
       page=st.sampled_from([16, 48, 64]), d=st.sampled_from([16, 24, 64]), num_splits=st.sampled_from([0, 1, 2, 7]),
       rotary=st.sampled_from([(0, True), (8, False)]), causal=st.booleans(),
       extra=st.sampled_from([{}, {"window_size": (20, 0)}, {"softcap": 3.0}, {"alibi": True}]),
       bf16=st.booleans(), seed=st.integers(0, 99), leftpad=st.booleans())
def test_drawn_caches_on_the_split_kv_kernel(batch, seqlen_q, seqlen_new, nheads_k, groups, lens, paged, page, d,
                                             num_splits, rotary, causal, extra, bf16, seed, leftpad):
    """float16 / bfloat16 on the split-KV kernel: cache lengths 0 and 1, pages, splits from 1 to more than the
    tiles, GQA ratios, every option."""
    from flashnumba import _arrays

    rng = np.random.default_rng(seed)
    dtype = _arrays.bfloat16() if bf16 and _arrays.bfloat16() is not None else np.float16
    q, k, v, kc, vc, kw = _problem(rng, batch, seqlen_q, seqlen_new, nheads_k, groups, d, lens[:batch], paged,
                                   page, dtype, rotary[0], leftpad)
    opts = dict(causal=causal, rotary_interleaved=rotary[1])
    if extra.get("alibi"):
        opts["alibi_slopes"] = (0.3 / np.arange(1, nheads_k * groups + 1)).astype(np.float32)
    else:
        opts.update(extra)
    _check(q, k, v, kc, vc, kw, opts, dict(num_splits=num_splits, kernel="splitkv"))


@pytest.mark.parametrize("kernel", ["splitkv", "gather"])
def test_pages_of_several_tiles_and_queries_rotated_at_the_cache_length(kernel):
    """Fixed cases the drawn ones reach rarely: pages of 128 rows holding two key tiles of 64 (the second tile read
    at its offset in the page: from the page's start it passed every other test), and three new queries without
    causal or a window, all rotated at the cache's length (rotated at L + t they passed too)."""
    rng = np.random.default_rng(9)
    q, k, v, kc, vc, kw = _problem(rng, 1, 1, 1, 1, 2, 16, [100], True, 128, np.float16, 0)
    _check(q, k, v, kc, vc, kw, {}, dict(kernel=kernel))
    q, k, v, kc, vc, kw = _problem(rng, 2, 3, 2, 1, 2, 16, [7, 20], False, 16, np.float16, 8)
    _check(q, k, v, kc, vc, kw, dict(rotary_interleaved=False), dict(kernel=kernel))


@pytest.mark.parametrize("kernel", ["splitkv", "gather"])
def test_left_padding(kernel):
    """cache_leftpad: the keys below it are never attended to, whatever they hold (NaN here), positions stay the
    cache's (rotations, the causal diagonal, a window, ALiBi's distances); whole key tiles of padding skipped, a
    padding that ends inside a tile, one that leaves only the new keys, and one that leaves nothing (out 0)."""
    rng = np.random.default_rng(12)
    q, k, v, kc, vc, kw = _problem(rng, 4, 2, 2, 1, 2, 16, [100, 20, 5, 9], False, 0, np.float16, 8)
    kw["cache_leftpad"] = np.array([70, 3, 5, 0], np.int32)
    q, k, v = q[:3], k[:3], v[:3]  # (the fourth sequence's padding: below)
    kw["cache_seqlens"], kw["cache_batch_idx"], kw["cache_leftpad"] = (kw[n][:3] for n in (
        "cache_seqlens", "cache_batch_idx", "cache_leftpad"))
    for b, (entry, pad) in enumerate(zip(kw["cache_batch_idx"], kw["cache_leftpad"])):
        kc[entry, :pad] = np.nan  # (padding is read by no one)
        vc[entry, :pad] = np.nan
    alibi = (0.3 / np.arange(1, 3)).astype(np.float32)
    for opts in (dict(causal=True), dict(window_size=(30, 1), alibi_slopes=alibi), {}):
        _check(q, k, v, kc, vc, kw, opts, dict(kernel=kernel))
    q, _, _, kc, vc, kw = _problem(rng, 2, 1, 0, 1, 1, 16, [6, 40], False, 0, np.float16, 0)
    kw["cache_leftpad"] = np.array([6, 1], np.int32)  # the first sequence: nothing left to attend to
    out = to_numpy(flash_attn_with_kvcache(q, kc, vc, kernel=kernel, **kw))
    assert np.array_equal(out[0], np.zeros_like(out[0])) and np.isfinite(out[1]).all()


def test_bad_left_padding_is_refused_before_anything_is_written():
    rng = np.random.default_rng(13)
    q, k, v, kc, vc, kw = _problem(rng, 2, 1, 1, 1, 1, 16, [6, 40], False, 0, np.float16, 0)
    kc0 = kc.copy()
    for pad, err in (([7, 0], "cache_leftpad must lie in"), ([-1, 0], "cache_leftpad must lie in"),
                     ([1, 2, 3], "cache_leftpad must have shape"), (np.array([0.5, 1.0]), "integers")):
        with pytest.raises((ValueError, TypeError), match=err):
            flash_attn_with_kvcache(q, kc, vc, k, v, cache_leftpad=np.array(pad) if isinstance(pad, list) else pad,
                                    **kw)
    np.testing.assert_array_equal(kc, kc0)
    q, k, v, kc, vc, kw = _problem(rng, 2, 1, 1, 1, 1, 16, [6, 40], True, 16, np.float16, 0)
    kc0 = kc.copy()
    with pytest.raises(ValueError, match="cache_leftpad cannot be combined with block_table"):
        flash_attn_with_kvcache(q, kc, vc, k, v, cache_leftpad=np.zeros(2, np.int32), **kw)
    np.testing.assert_array_equal(kc, kc0)


@pytest.mark.parametrize("kernel", ["splitkv", "gather"])
def test_a_causal_key_past_a_tile_and_new_keys_across_a_page(kernel):
    """Fixed cases the drawn ones reach rarely: one query under causal seeing 65 keys (64 in the cache, one new),
    the last alone in the split-KV kernel's second tile of 64 (a key range that ends one short of the last row's
    last key drops that tile); and new keys written from positions 14 and 30 of a cache in pages of 16, the last
    ones on the next page (each new key's page found from its own position, not from the cache's length)."""
    rng = np.random.default_rng(10)
    q, k, v, kc, vc, kw = _problem(rng, 1, 1, 1, 1, 2, 16, [64], False, 16, np.float16, 0)
    _check(q, k, v, kc, vc, kw, dict(causal=True), dict(kernel=kernel))
    q, k, v, kc, vc, kw = _problem(rng, 2, 1, 5, 1, 2, 16, [14, 30], True, 16, np.float16, 0)
    _check(q, k, v, kc, vc, kw, {}, dict(kernel=kernel))


def test_split_kv_on_cupy_arrays_appends_in_place():
    """On the GPU with CuPy arrays: the cache updated in place on the device, the result as with NumPy."""
    cupy = pytest.importorskip("cupy") if not flashnumba.SIMULATOR else pytest.skip("a GPU test")
    rng = np.random.default_rng(9)
    q, k, v, kc, vc, kw = _problem(rng, 3, 1, 1, 2, 4, 128, [300, 0, 1000], True, 64, np.float16, 0)
    truth_o, truth_l, truth_kc, truth_vc = ref.kvcache_attention(q, kc, vc, k, v, **kw)
    base_o, base_l, _, _ = ref.kvcache_attention(q, kc, vc, k, v, dtype=np.float16, **kw)
    dkc, dvc = cupy.asarray(kc), cupy.asarray(vc)
    out, lse = flash_attn_with_kvcache(cupy.asarray(q), dkc, dvc, cupy.asarray(k), cupy.asarray(v),
                                       return_softmax_lse=True, **{n: cupy.asarray(x) for n, x in kw.items()})
    assert isinstance(out, cupy.ndarray)
    assert_close_to_truth("out", cupy.asnumpy(out), truth_o, base_o.astype(np.float16), reduction=1001)
    assert_close_to_truth("lse", cupy.asnumpy(lse), truth_l, base_l.astype(np.float32), reduction=1001)
    np.testing.assert_array_equal(cupy.asnumpy(dkc), truth_kc)
    np.testing.assert_array_equal(cupy.asnumpy(dvc), truth_vc)


def test_device_values_are_read_back_only_when_asked():
    """On the GPU with CuPy arrays: lengths beyond the cache given as a device array are not read back by default
    (no synchronisation; the kernels keep them inside the arrays: nothing is written outside the cache), and with
    config.check_cache_values on they are read and refused before anything is written."""
    cupy = pytest.importorskip("cupy") if not flashnumba.SIMULATOR else pytest.skip("a GPU test")
    rng = np.random.default_rng(10)
    q, k, v, kc, vc, kw = _problem(rng, 2, 1, 1, 2, 2, 64, [3, 5], False, 16, np.float16, 0)
    capacity = kc.shape[1]
    dkc, dvc = cupy.asarray(kc), cupy.asarray(vc)
    dev = dict(cache_seqlens=cupy.asarray(np.array([3, capacity + 4], np.int32)),
               cache_batch_idx=cupy.asarray(kw["cache_batch_idx"]))
    out = flash_attn_with_kvcache(cupy.asarray(q), dkc, dvc, cupy.asarray(k), cupy.asarray(v), **dev)
    assert np.isfinite(cupy.asnumpy(out)).all()
    want = kc.copy()
    want[kw["cache_batch_idx"][0], 3] = k[0, 0]  # sequence 0's key; sequence 1's falls outside: not written
    np.testing.assert_array_equal(cupy.asnumpy(dkc), want)
    with flashnumba.config.temporarily("check_cache_values", True):
        with pytest.raises(ValueError, match="capacity"):
            flash_attn_with_kvcache(cupy.asarray(q), dkc, dvc, cupy.asarray(k), cupy.asarray(v), **dev)
    np.testing.assert_array_equal(cupy.asnumpy(dkc), want)


@pytest.mark.parametrize("splits", [1, 4])
@pytest.mark.parametrize("return_lse", [False, True])
def test_the_plan_discards_what_nothing_reads(splits, return_lse):
    """lse is discarded where it is not returned and no combine reads it; the partials wherever the keys are not
    split (the kernel then never touches them); nothing returned is ever discarded."""
    from flashnumba import _validate, planner

    q, kc = np.zeros((2, 1, 8, 64), np.float16), np.zeros((4, 64, 2, 64), np.float16)
    tq, tk, tv = (_validate.inspect(n, x, 4) for n, x in (("q", q), ("k_cache", kc), ("v_cache", kc)))
    opts = _validate.check_options(tq, tk, False, (-1, -1), 0.0, None, 0.0, None)
    p = planner.decode_plan(tq, tk, tv, opts, seqlens=_validate.inspect("seqlens_k", np.zeros(2, np.int32), 1),
                            batch_idx=None, block_table=None, max_seqlen_k=4096, num_splits=splits,
                            return_lse=return_lse, device="sm_80")
    discarded = {o.name for o in p.outputs if o.discarded}
    want = {"o_part", "lse_part"} | ({"lse"} if not return_lse else set()) if splits == 1 else set()
    assert discarded == want
    assert not any(o.returned and o.discarded for o in p.outputs)


def test_discarded_outputs_share_one_buffer_and_change_nothing():
    """Without splits and without return_softmax_lse the kernel's lse (and the partials' stand-ins) go to the
    process's one sink: no scratch is allocated a call, the output is the one with lse returned, bit for bit, and
    calls on two streams at once, writing the sink together, both give it. With splits the partials stay the
    call's own (the combine reads them)."""
    cupy = pytest.importorskip("cupy") if not flashnumba.SIMULATOR else pytest.skip("a GPU test")
    from flashnumba import _launch, api

    rng = np.random.default_rng(11)
    q, _, _, kc, vc, kw = _problem(rng, 4, 1, 0, 2, 4, 128, [700, 0, 1, 1500], False, 16, np.float16, 0)
    dq, dkc, dvc = cupy.asarray(q), cupy.asarray(kc), cupy.asarray(vc)
    dev = {n: cupy.asarray(x) for n, x in kw.items()}
    for splits in (1, 3):
        want, _ = flash_attn_with_kvcache(dq, dkc, dvc, num_splits=splits, return_softmax_lse=True, **dev)
        api.clear_plan_cache()
        got = flash_attn_with_kvcache(dq, dkc, dvc, num_splits=splits, **dev)
        (call,) = [c._call for k, c in api._calls.items() if k and k[0] == "kvcache"]
        discarded = {o.name for o in call.plan.outputs if o.discarded}
        assert discarded == ({"lse", "o_part", "lse_part"} if splits == 1 else set())
        assert (call.scratch_bytes == 0) == (splits == 1)
        sink = _launch._sinks[(cupy.cuda.Device().id, "other")][-1]
        assert splits > 1 or call.base["lse"] == sink[2]
        np.testing.assert_array_equal(cupy.asnumpy(got), cupy.asnumpy(want))
        streams = [cupy.cuda.Stream(non_blocking=True) for _ in range(2)]
        outs = []
        for _ in range(20):
            for s in streams:
                with s:
                    outs.append(flash_attn_with_kvcache(dq, dkc, dvc, num_splits=splits, **dev))
        for s in streams:
            s.synchronize()
        for o in outs:
            np.testing.assert_array_equal(cupy.asnumpy(o), cupy.asnumpy(want))


def test_a_kept_kind_of_call_reads_each_calls_own_integer_arrays():
    """The second call of a kind passes its device lengths, batch index or block table straight to the kernels:
    each call's own values count (a call with other lengths gives what a fresh plan gives for them), and an int64
    array, which must be converted, is converted at every call."""
    cupy = pytest.importorskip("cupy") if not flashnumba.SIMULATOR else pytest.skip("a GPU test")
    from flashnumba import api

    rng = np.random.default_rng(12)
    for paged in (False, True):
        q, _, _, kc, vc, kw = _problem(rng, 3, 1, 0, 2, 4, 64, [300, 40, 200], paged, 32, np.float16, 0)
        dq, dkc, dvc = cupy.asarray(q), cupy.asarray(kc), cupy.asarray(vc)
        dev = {n: cupy.asarray(x) for n, x in kw.items()}
        other = [np.array([5, 290, 0]), np.array([17, 1, 111])]
        for dtype in (np.int32, np.int64):
            got = []
            api.clear_plan_cache()
            for lens in other:  # (the first call plans, the second is a kept kind's)
                got.append(cupy.asnumpy(flash_attn_with_kvcache(
                    dq, dkc, dvc, **{**dev, "cache_seqlens": cupy.asarray(lens.astype(dtype))})))
            for lens, g in zip(other, got):
                api.clear_plan_cache()
                want = flash_attn_with_kvcache(dq, dkc, dvc, **{**dev, "cache_seqlens": cupy.asarray(lens, np.int32)})
                np.testing.assert_array_equal(g, cupy.asnumpy(want))
            assert not np.array_equal(got[0], got[1])


DECODE_COMPILE_SCRIPT = r"""
import itertools
import numpy as np
from flashnumba import _validate, planner
# every option set with and without pages at head dims 40 (padded) and 128 (the most registers), the dtype and
# the split alternating, left padding in half the contiguous ones; per push (FULL false) three of the twelve: each
# option set, head dim, dtype, split count and cache layout at least once, softcap with ALiBi at d=128, left padding
for n, (d, (left, right, softcap, alibi), paged) in enumerate(itertools.product(
        (40, 128), ((-1, -1, 0.0, False), (32, 0, 0.0, False), (-1, 0, 5.0, True)), (False, True))):
    if not FULL and n not in (1, 2, 11):
        continue
    dtype, splits = ("float16", "bfloat16")[n % 2], (1, 4)[(n // 2) % 2]
    q = np.zeros((2, 1, 8, d), np.float16)
    kc = np.zeros((4, 64, 2, d), np.float16)
    tq, tk, tv = (_validate.inspect(n, x, 4) for n, x in (("q", q), ("k_cache", kc), ("v_cache", kc)))
    opts = _validate.check_options(tq, tk, False, (left, right), softcap, np.ones(8, np.float32) if alibi else None,
                                   0.0, None)
    i32 = np.zeros((2,), np.int32)
    t = _validate.inspect("seqlens_k", i32, 1)
    bt = _validate.inspect("block_table", np.zeros((2, 2), np.int32), 2) if paged else None
    bi = None if paged else _validate.inspect("batch_idx", i32, 1)
    if dtype == "bfloat16":  # (the plan reads the dtype's name from q)
        import dataclasses
        from flashnumba import _arrays
        tq = dataclasses.replace(tq, dtype=_arrays.bfloat16())
    lp = _validate.inspect("leftpad", i32, 1) if n % 4 == 2 else None
    p = planner.decode_plan(tq, tk, tv, opts, seqlens=t, batch_idx=bi, block_table=bt, max_seqlen_k=4096,
                            num_splits=splits, device="sm_80", leftpad=lp)
    for r in p.resources():  # (softcap with ALiBi, which keeps tanh's work beside O, may spill a few registers)
        assert r["spill_stores"] == 0 or softcap, (d, dtype, left, right, softcap, alibi, paged, splits, r)
    print("compiled", d, dtype, left, right, softcap, alibi, paged, splits, lp is not None)
"""


def test_split_kv_kernels_compile_for_the_gpu():
    """The split-KV kernel and the combine compile for sm_80 with every option (no GPU needed), without spills but
    with softcap and ALiBi together: the simulator runs them as Python, where a construct NVVM refuses would pass
    unnoticed. (Per push 3 of the 12 plans; conftest.FULL_COMPILE, all.)"""
    import os
    import subprocess
    import sys

    pytest.importorskip("ml_dtypes")
    env = dict(os.environ, FLASHNUMBA_SIMULATOR="0", NUMBA_ENABLE_CUDASIM="0")
    r = subprocess.run([sys.executable, "-c", f"FULL = {FULL_COMPILE!r}\n{DECODE_COMPILE_SCRIPT}"], capture_output=True,
                       text=True, env=env, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                       timeout=1500)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.count("compiled") == (2 * 3 * 2 if FULL_COMPILE else 3)


def test_unchecked_device_values_stay_inside_the_arrays():
    """Lengths, pages and batch indices the host did not read (device arrays with config.check_device_values off)
    cannot make the kernel read outside the arrays: lengths are clipped to the cache's capacity, a page outside the
    pool reads as zeros, a cache_batch_idx outside the cache gives no keys (out 0, lse -inf). Run through the plan
    directly, on NumPy arrays, whose values the host would otherwise check (the simulator raises on any index
    outside an array)."""
    from flashnumba import _launch, _validate, planner

    rng = np.random.default_rng(11)
    q = rng.standard_normal((3, 1, 4, 16)).astype(np.float16)
    kc, vc = (rng.standard_normal((3, 64, 2, 16)).astype(np.float16) for _ in range(2))
    tq, tk, tv = (_validate.inspect(n, x, 4) for n, x in (("q", q), ("k_cache", kc), ("v_cache", kc)))
    opts = _validate.check_options(tq, tk, False, (-1, -1), 0.0, None, 0.0, None)
    lens = np.array([1000, 10, 5], np.int32)  # beyond the capacity of 64
    bidx = np.array([0, 7, 2], np.int32)  # 7: outside the cache
    t = [_validate.inspect(n, x, 1) for n, x in (("seqlens_k", lens), ("batch_idx", bidx))]
    p = planner.decode_plan(tq, tk, tv, opts, seqlens=t[0], batch_idx=t[1], block_table=None, max_seqlen_k=64,
                            num_splits=2)
    out, lse = (to_numpy(x) for x in _launch.Call(p).run((q, kc, vc, lens, bidx, None, None)))
    o0, l0 = ref.attention_forward(q[:1], kc[:1], vc[:1])  # sequence 0: the whole cache (64 keys)
    np.testing.assert_allclose(out[0], o0[0], atol=2e-3)
    np.testing.assert_allclose(lse[0], l0[0], atol=1e-3)
    assert not out[1].any() and np.isneginf(lse[1]).all()  # no keys
    # a paged cache with a page outside the pool: its keys read as zeros (scores 0, values 0)
    pages = np.array([[0, 9]], np.int32)  # page 9 outside a pool of 3
    kp, vp = (x.reshape(6, 32, 2, 16)[:3] for x in (kc, vc))
    tk, tv = _validate.inspect("k_cache", kp, 4), _validate.inspect("v_cache", vp, 4)
    t = [_validate.inspect(n, x, x.ndim) for n, x in (("seqlens_k", lens[:1]), ("block_table", pages))]
    p = planner.decode_plan(_validate.inspect("q", q[:1], 4), tk, tv, opts, seqlens=t[0],
                            batch_idx=None, block_table=t[1], max_seqlen_k=64, num_splits=1)
    out, lse = (to_numpy(x) for x in _launch.Call(p).run((q[:1], kp, vp, lens[:1], None, pages, None)))
    keys = np.concatenate([kp[0], np.zeros_like(kp[0])])[None]
    vals = np.concatenate([vp[0], np.zeros_like(vp[0])])[None]
    o1, l1 = ref.attention_forward(q[:1], keys, vals)
    np.testing.assert_allclose(out, o1, atol=2e-3)
    np.testing.assert_allclose(lse, l1, atol=1e-3)


def test_unchecked_values_write_nothing_outside_the_cache():
    """The append kernel on values the host did not read (run through the plan directly, as above): a new key whose
    position falls outside the cache (past its capacity, or negative), on a page outside the pool or in a cache
    entry outside the cache is not written, and every other array element is left as it was; a key whose rotation
    position lies past the rotary tables is rotated by their last row; the attention then sees the keys the cache
    holds (clipped to its capacity)."""
    from flashnumba import _launch, _validate, planner

    rng = np.random.default_rng(13)
    q = rng.standard_normal((4, 1, 2, 16)).astype(np.float16)
    kc, vc = (rng.standard_normal((3, 32, 1, 16)).astype(np.float16) for _ in range(2))
    knew, vnew = (rng.standard_normal((4, 2, 1, 16)).astype(np.float16) for _ in range(2))
    cos, sin = (x.astype(np.float32) for x in _rotary_tables(20, 8))  # positions 0 .. 19
    lens = np.array([31, -1, 3, 25], np.int32)  # sequence 0: its second key past the capacity; 1: first negative
    bidx = np.array([0, 1, 5, 2], np.int32)  # sequence 2: outside the cache; 3: rotated past the tables
    names = ("q", "k_cache", "v_cache", "seqlens_k", "batch_idx", "k", "v", "rotary_cos", "rotary_sin")
    t = dict(zip(names, (_validate.inspect(n, x, x.ndim) for n, x in
                         zip(names, (q, kc, vc, lens, bidx, knew, vnew, cos, sin)))))
    opts = _validate.check_options(t["q"], t["k_cache"], False, (-1, -1), 0.0, None, 0.0, None)
    step = planner.DecodeStep(t["k"], t["v"], t["rotary_cos"], t["rotary_sin"], interleaved=True)
    p = planner.decode_plan(t["q"], t["k_cache"], t["v_cache"], opts, seqlens=t["seqlens_k"],
                            batch_idx=t["batch_idx"], block_table=None, max_seqlen_k=32, num_splits=2, step=step)
    kc1, vc1 = kc.copy(), vc.copy()
    out, lse = (to_numpy(x) for x in _launch.Call(p).run((q, kc1, vc1, lens, bidx, None, None, knew, vnew, cos,
                                                           sin)))
    want_k, want_v = kc.copy(), vc.copy()
    for b, (first, entry) in enumerate(zip(lens, bidx)):
        for t_new in range(2):
            pos = first + t_new
            if 0 <= pos < 32 and 0 <= entry < 3:
                row = ref.apply_rotary(knew[b, t_new][None].astype(np.float64), cos, sin, np.array([min(pos, 19)]),
                                       interleaved=True)[0]
                want_k[entry, pos] = row.astype(np.float16)
                want_v[entry, pos] = vnew[b, t_new]
    np.testing.assert_array_equal(vc1, want_v)
    ulp = eps(np.float16)  # (rotated in float32, the reference in float64: a few units in the last place)
    np.testing.assert_allclose(kc1.astype(np.float64), want_k.astype(np.float64), rtol=4 * ulp, atol=4 * ulp)
    assert not out[2].any() and np.isneginf(lse[2]).all()  # entry 5: no keys
    assert np.isfinite(out).all()


# (a minute each in the simulator: per push 3 only, the odd count; the default, 2, runs in every other test here;
# all three in the GPU profile. The simulator's plans take 4 warps a block: here 8, so that they run there too)
@pytest.mark.parametrize("stages", [3] if PROFILE == "ci" else [2, 3, 4])
def test_every_buffer_count_gives_the_same_attention(stages, monkeypatch):
    """The kernel's K, V buffers (the plan's ``stages``; the default is one of them) change the pipeline, not the
    result: contiguous and paged caches of several tiles (128 keys a tile: 8 warps), one split and three, against
    float64."""
    from flashnumba import _launch, _validate, planner

    monkeypatch.setattr(planner, "DECODE_WARPS", (8,))

    rng = np.random.default_rng(stages)
    q = rng.standard_normal((2, 1, 4, 16)).astype(np.float16)
    kc, vc = (rng.standard_normal((2, 256, 2, 16)).astype(np.float16) for _ in range(2))
    lens = np.array([256, 150], np.int32)
    opts = _validate.check_options(_validate.inspect("q", q, 4), _validate.inspect("k_cache", kc, 4), False,
                                   (-1, -1), 0.0, None, 0.0, None)
    truth_o, truth_l, _, _ = ref.kvcache_attention(q, kc, vc, cache_seqlens=lens)
    base_o, base_l, _, _ = ref.kvcache_attention(q, kc, vc, cache_seqlens=lens, dtype=np.float16)
    pages = np.array([[3, 0], [1, 2]], np.int32)  # sequence b's keys in pages pages[b] of 128
    kp, vp = (np.empty((4, 128, 2, 16), np.float16) for _ in range(2))
    for b in range(2):
        for i in range(2):
            kp[pages[b, i]], vp[pages[b, i]] = kc[b, 128 * i:128 * (i + 1)], vc[b, 128 * i:128 * (i + 1)]
    for paged, splits in ((False, 1), (True, 3)):
        k_, v_ = (kp, vp) if paged else (kc, vc)
        arrays = (q, k_, v_, lens, None if paged else np.arange(2, dtype=np.int32), pages if paged else None, None)
        t = [None if x is None else _validate.inspect(n, x, x.ndim) for n, x in
             zip(("q", "k_cache", "v_cache", "seqlens_k", "batch_idx", "block_table"), arrays)]
        p = planner.decode_plan(*t[:3], opts, seqlens=t[3], batch_idx=t[4], block_table=t[5], max_seqlen_k=256,
                                num_splits=splits, stages=stages)
        out, lse = (to_numpy(x) for x in _launch.Call(p).run(arrays))
        assert_close_to_truth("out", out, truth_o, base_o.astype(np.float16), reduction=256)
        assert_close_to_truth("lse", lse, truth_l, base_l.astype(np.float32), reduction=256)


@settings(max_examples=200, deadline=None)
@given(blocks=st.integers(1, 5000), n_tiles=st.integers(0, 600), sms=st.integers(1, 200), per_sm=st.integers(1, 8))
def test_the_split_count_is_the_quickest_by_waves_and_tiles(blocks, n_tiles, sms, per_sm):
    """num_splits=0's choice: between 1 and the tiles (at most MAX_SPLITS), 1 where there is one tile or less; no
    other count takes fewer waves x (tiles a block + the fixed part), and none fewer does as well."""
    import dataclasses
    import math

    from flashnumba import planner, tiling

    lim = dataclasses.replace(tiling.ARCHS["sm_90"], sm_count=sms)
    n = planner.decode_splits(blocks, n_tiles, lim, per_sm)
    assert 1 <= n <= max(1, min(n_tiles, planner.MAX_SPLITS))
    if n_tiles <= 1:
        assert n == 1
        return
    slots = sms * per_sm

    def cost(k):
        return math.ceil(blocks * k / slots) * (math.ceil(n_tiles / k) + planner.DECODE_FIXED_TILES)

    counts = range(1, min(n_tiles, planner.MAX_SPLITS) + 1)
    assert cost(n) == min(cost(k) for k in counts)
    assert all(cost(k) > cost(n) for k in counts if k < n)


@pytest.mark.parametrize("blocks,n_tiles,want", [(8, 128, 32), (8, 512, 32), (32, 128, 8), (256, 128, 1)])
def test_the_split_count_of_the_measured_workloads(blocks, n_tiles, want):
    """The counts the H200 measured fastest (docs/benchmarks.md, "How fast is decoding?"; 132 SMs, two blocks an
    SM): batch 1 at seqlen_k 8192 and 32768 (8 key/value heads; 128 and 512 tiles of 64 keys), batch 4 and 32 at
    8192."""
    import dataclasses

    from flashnumba import planner, tiling

    lim = dataclasses.replace(tiling.ARCHS["sm_90"], sm_count=132)
    assert planner.decode_splits(blocks, n_tiles, lim, 2) == want


def test_no_cache_seqlens_is_the_whole_cache_and_bad_options_write_nothing():
    """cache_seqlens=None: every sequence attends to its whole cache (flash-attn's meaning); new keys without it,
    and options that are refused, raise before the cache is written."""
    rng = np.random.default_rng(12)
    q, k, v, kc, vc, kw = _problem(rng, 2, 1, 1, 2, 2, 16, [3, 4], False, 16, np.float16, 0)
    kw.pop("cache_seqlens")
    out = to_numpy(flash_attn_with_kvcache(q, kc, vc, **kw))
    o, _, _, _ = ref.kvcache_attention(q, kc, vc, **kw)
    base, _, _, _ = ref.kvcache_attention(q, kc, vc, dtype=np.float16, **kw)
    assert_close_to_truth("out", out, o, base.astype(np.float16), reduction=kc.shape[1])
    kc0 = kc.copy()
    with pytest.raises(ValueError, match="need cache_seqlens"):
        flash_attn_with_kvcache(q, kc, vc, k, v, **kw)
    lens = np.array([3, 4], np.int32)
    for bad, err in ((dict(kernel="bogus"), ValueError), (dict(window_size=(3,)), ValueError),
                     (dict(alibi_slopes=np.ones(3, np.float32)), ValueError), (dict(softcap=-1.0), ValueError),
                     (dict(window_size=None), ValueError), (dict(rotary_interleaved="no"), TypeError),
                     (dict(return_softmax_lse=2), TypeError)):
        with pytest.raises(err):
            flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=lens, **kw, **bad)
        np.testing.assert_array_equal(kc, kc0)


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_values_are_checked_at_every_call_of_a_kept_kind(paged):
    """A call's shapes, dtypes and options are checked once and kept; the values of its integer arrays are not:
    after a good call, the same kind of call with lengths beyond the cache, a page outside the pool, a batch
    index outside the cache or rotary tables too short still raises, and writes nothing."""
    rng = np.random.default_rng(21)
    q, k, v, kc, vc, kw = _problem(rng, 2, 1, 1, 1, 2, 16, [3, 5], paged, 16, np.float16, 8)
    _check(q, k, v, kc, vc, kw, {})
    kc0 = kc.copy()
    capacity = kw["block_table"].shape[1] * kc.shape[1] if paged else kc.shape[1]
    bad = [dict(cache_seqlens=np.array([3, capacity], np.int32))]
    if paged:
        table = kw["block_table"].copy()
        table[1, 0] = kc.shape[0]
        bad.append(dict(block_table=table))
    else:
        bad.append(dict(cache_batch_idx=np.array([0, kc.shape[0]], np.int32)))
    bad.append(dict(cache_seqlens=np.array([3, kw["rotary_cos"].shape[0]], np.int32)))  # (rotary too short too)
    for change in bad:
        with pytest.raises(ValueError):
            flash_attn_with_kvcache(q, kc, vc, k, v, **(kw | change))
        np.testing.assert_array_equal(kc, kc0)


@pytest.mark.parametrize("arch", ["sm_75", "sm_80", "sm_86", "sm_90"])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_decode_plans_fit_each_architecture(arch, d):
    """The decoding plan's shared memory fits every architecture's limit (fewer warps where a block would not)."""
    from flashnumba import _validate, planner, tiling

    q = np.zeros((2, 1, 8, d), np.float16)
    kc = np.zeros((2, 4096, 2, d), np.float16)
    tq, tk, tv = (_validate.inspect(n, x, 4) for n, x in (("q", q), ("k_cache", kc), ("v_cache", kc)))
    opts = _validate.check_options(tq, tk, False, (-1, -1), 0.0, None, 0.0, None)
    t = _validate.inspect("seqlens_k", np.zeros(2, np.int32), 1)
    p = planner.decode_plan(tq, tk, tv, opts, seqlens=t, batch_idx=t, block_table=None, max_seqlen_k=4096,
                            device=arch)
    assert p.launches[0].shared_bytes <= tiling.ARCHS[arch].max_shared_per_block
    assert 1 <= p.launches[0].grid[0] <= planner.MAX_SPLITS
    many = planner.decode_plan(tq, tk, tv, opts, seqlens=t, batch_idx=t, block_table=None, max_seqlen_k=4096,
                               num_splits=10 ** 6, device=arch)
    assert many.launches[0].grid[0] == planner.MAX_SPLITS
