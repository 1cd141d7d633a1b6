"""The NumPy references (flashnumba.reference): dense float64 attention, the blocked version, the gradient."""

from __future__ import annotations

import numpy as np
import pytest

from flashnumba import reference

from conftest import assert_reference_gradient_matches_finite_differences, random_qkv


def test_dense_reference_matches_a_row_by_row_softmax():
    rng = np.random.default_rng(0)
    q, k, v = random_qkv(rng, 1, 6, 9, 2, 5)
    out, lse = reference.attention_forward(q, k, v, softmax_scale=0.7)
    for h in range(2):
        for i in range(6):
            s = 0.7 * k[0, :, h].astype(np.float64) @ q[0, i, h].astype(np.float64)
            p = np.exp(s - s.max())
            np.testing.assert_allclose(out[0, i, h], (p / p.sum()) @ v[0, :, h], rtol=1e-12)
            np.testing.assert_allclose(lse[0, h, i], s.max() + np.log(p.sum()), rtol=1e-12)


def test_causal_mask_is_bottom_right_aligned():
    m = reference.causal_mask(2, 5)
    np.testing.assert_array_equal(m, [[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]])
    m = reference.causal_mask(4, 2)  # first two rows see nothing
    np.testing.assert_array_equal(m, [[0, 0], [0, 0], [1, 0], [1, 1]])


def test_rows_without_keys_are_zero_with_minus_inf_lse():
    rng = np.random.default_rng(1)
    q, k, v = random_qkv(rng, 1, 4, 2, 1, 3)
    out, lse = reference.attention_forward(q, k, v, causal=True)
    assert (out[0, :2] == 0).all() and np.isneginf(lse[0, 0, :2]).all()
    assert np.isfinite(out).all()


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("blocks", [(8, 16), (16, 8), (64, 64), (1, 1)])
def test_blocked_reference_equals_dense(causal, blocks):
    rng = np.random.default_rng(2)
    q, k, v = random_qkv(rng, 2, 37, 29, 2, 24)
    o1, l1 = reference.attention_forward(q, k, v, causal=causal)
    o2, l2 = reference.attention_forward_blocked(q, k, v, causal=causal, block_m=blocks[0], block_n=blocks[1])
    np.testing.assert_allclose(o2, o1, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(l2, l1, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", [(2, 37, 29, 2, 24), (1, 29, 37, 1, 5), (1, 1, 1, 1, 3)])
def test_blocked_backward_equals_dense_gradient(causal, shape):
    b, sq, sk, h, d = shape
    rng = np.random.default_rng(3)
    q, k, v = random_qkv(rng, b, sq, sk, h, d)
    dout = rng.standard_normal(q.shape)
    out, lse = reference.attention_forward(q, k, v, causal=causal, softmax_scale=0.6)
    dense = reference.attention_backward(dout, q, k, v, causal=causal, softmax_scale=0.6)
    blocked = reference.attention_backward_blocked(dout, q, k, v, out, lse, causal=causal, softmax_scale=0.6,
                                                   block_m=8, block_n=16)
    for a, c in zip(blocked, dense):
        np.testing.assert_allclose(a, c, rtol=1e-10, atol=1e-12)


FEATURES = [
    dict(),
    dict(window_size=(3, 1)),
    dict(window_size=(-1, 2), causal=True),  # causal sets right = 0
    dict(window_size=(0, -1)),
    dict(softcap=1.5),
    dict(alibi_slopes=[0.5, 0.125]),
    dict(alibi_slopes=[[0.5, 0.25], [0.3, 0.0]]),
    dict(window_size=(4, 0), softcap=2.0, alibi_slopes=[0.25, 0.5]),
]


def _gqa_qkv(rng, b, sq, sk, h, hk, d):
    return (rng.standard_normal((b, sq, h, d)), rng.standard_normal((b, sk, hk, d)),
            rng.standard_normal((b, sk, hk, d)))


@pytest.mark.parametrize("opts", FEATURES)
@pytest.mark.parametrize("hk", [2, 1])  # GQA (2 query heads per kv head) and MQA
def test_reference_features_gradient_matches_finite_differences(opts, hk):
    rng = np.random.default_rng(5)
    q, k, v = _gqa_qkv(rng, 2, 4, 5, 2, hk, 3)
    dout = rng.standard_normal(q.shape)
    assert_reference_gradient_matches_finite_differences(q, k, v, dout, softmax_scale=0.9, **opts)


@pytest.mark.parametrize("opts", FEATURES)
def test_blocked_references_equal_dense_with_features(opts):
    rng = np.random.default_rng(6)
    q, k, v = _gqa_qkv(rng, 2, 19, 23, 2, 1, 8)
    dout = rng.standard_normal(q.shape)
    out, lse = reference.attention_forward(q, k, v, **opts)
    o2, l2 = reference.attention_forward_blocked(q, k, v, block_m=8, block_n=16, **opts)
    np.testing.assert_allclose(o2, out, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(l2, lse, rtol=1e-12, atol=1e-12)
    dense = reference.attention_backward(dout, q, k, v, **opts)
    blocked = reference.attention_backward_blocked(dout, q, k, v, out, lse, block_m=8, block_n=16, **opts)
    for a, c in zip(blocked, dense):
        np.testing.assert_allclose(a, c, rtol=1e-10, atol=1e-12)


def test_window_mask_examples():
    m = reference.visibility_mask(3, 5, window_size=(1, 0))  # diag = 2: row i sees keys i+1 .. i+2
    np.testing.assert_array_equal(m, [[0, 1, 1, 0, 0], [0, 0, 1, 1, 0], [0, 0, 0, 1, 1]])
    np.testing.assert_array_equal(reference.visibility_mask(4, 4, window_size=(-1, 0)),
                                  reference.causal_mask(4, 4))


def test_bfloat16_baseline_is_float32_with_out_rounded_to_bfloat16():
    bf16 = pytest.importorskip("ml_dtypes").bfloat16
    rng = np.random.default_rng(7)
    q, k, v = (x.astype(bf16) for x in random_qkv(rng, 1, 6, 9, 2, 5))
    out, lse = reference.attention_forward(q, k, v, causal=True, dtype=bf16)
    out32, lse32 = reference.attention_forward(q, k, v, causal=True, dtype=np.float32)
    assert out.dtype == bf16 and lse.dtype == np.float32  # lse stays float32, as the kernels return it
    np.testing.assert_array_equal(out.view(np.uint16), out32.astype(bf16).view(np.uint16))
    np.testing.assert_array_equal(lse, lse32)
    grads = reference.attention_backward(q, q, k, v, dtype=bf16)
    assert all(g.dtype == bf16 for g in grads)


@pytest.mark.parametrize("opts", FEATURES)
def test_backward_terms_bound_the_gradients(opts):
    """attention_backward_terms (the checker's size of the terms each gradient sums) is the gradient's formula on
    absolute values: it bounds |dq|, |dk|, |dv| element by element, and stays of the terms' size where the
    gradient cancels (one key: P = 1, dP - D = 0, dq = dk = 0)."""
    rng = np.random.default_rng(7)
    q, k, v = _gqa_qkv(rng, 2, 9, 11, 2, 1, 8)
    dout = rng.standard_normal(q.shape)
    for a, g in zip(reference.attention_backward_terms(dout, q, k, v, **opts),
                    reference.attention_backward(dout, q, k, v, **opts)):
        assert a.shape == g.shape and np.all(a >= np.abs(g) * (1 - 1e-12))
    q, k, v = _gqa_qkv(rng, 1, 6, 1, 2, 2, 8)
    dout = rng.standard_normal(q.shape)
    dq, dk, _ = reference.attention_backward(dout, q, k, v)
    tq, tk, _ = reference.attention_backward_terms(dout, q, k, v)
    assert np.abs(dq).max() < 1e-12 and np.abs(dk).max() < 1e-12
    assert tq.min() > 0.01 and tk.min() > 0.01
