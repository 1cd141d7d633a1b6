"""The reference of user score and mask modifications (flashnumba.reference.flex_*): each built-in option
written as a score_mod or mask_mod gives the built-in reference's result, over drawn shapes; variants without a
built-in counterpart (document masking, a learned relative-position bias) against their own definitions."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from flashnumba import reference as ref

shapes = st.tuples(st.integers(1, 2), st.integers(1, 9), st.integers(1, 9), st.sampled_from([1, 2]),
                   st.sampled_from([1, 2]), st.sampled_from([4, 8]))


def _inputs(seed, batch, sq, sk, nheads_k, groups, d):
    rng = np.random.default_rng(seed)
    h = nheads_k * groups
    return (rng.standard_normal((batch, sq, h, d)), rng.standard_normal((batch, sk, nheads_k, d)),
            rng.standard_normal((batch, sk, nheads_k, d)), rng.standard_normal((batch, sq, h, d)))


def _close(a, b):
    for x, y in zip(a, b):
        np.testing.assert_allclose(x, y, rtol=1e-12, atol=1e-12)


@settings(max_examples=30, deadline=None)
@given(shape=shapes, seed=st.integers(0, 99), left=st.integers(-1, 4), right=st.integers(-1, 4),
       cap=st.sampled_from([0.0, 2.0]), alibi=st.booleans())
def test_built_in_options_as_mods(shape, seed, left, right, cap, alibi):
    """Window (causal when right = 0) as a mask_mod; softcap then ALiBi as a score_mod with its derivative."""
    batch, sq, sk, nheads_k, groups, d = shape
    q, k, v, dout = _inputs(seed, *shape)
    nheads = nheads_k * groups
    slopes = np.linspace(0.25, 1.0, nheads) if alibi else None
    diag = sk - sq

    def mask_mod(b, h, i, j):
        return (left < 0 or j >= i + diag - left) and (right < 0 or j <= i + diag + right)

    def score_mod(x, b, h, i, j):
        if cap > 0:
            x = cap * math.tanh(x / cap)
        if alibi:
            x -= slopes[h] * abs(i + diag - j)
        return x

    def score_mod_grad(x, b, h, i, j):
        return 1.0 - math.tanh(x / cap) ** 2 if cap > 0 else 1.0

    opts = dict(window_size=(left, right), softcap=cap, alibi_slopes=slopes)
    flex = dict(score_mod=score_mod, mask_mod=mask_mod)
    _close(ref.flex_attention_forward(q, k, v, **flex), ref.attention_forward(q, k, v, **opts))
    _close(ref.flex_attention_backward(dout, q, k, v, score_mod_grad=score_mod_grad, **flex),
           ref.attention_backward(dout, q, k, v, **opts))


def test_document_masking_is_attention_within_each_document():
    """Packed documents (ids as an argument of the mask_mod): each document attends to itself alone, as the
    varlen reference computes it."""
    rng = np.random.default_rng(0)
    lens = [3, 5, 1, 4]
    doc = np.repeat(np.arange(len(lens)), lens)
    n = doc.size
    q, k, v = (rng.standard_normal((1, n, 2, 8)) for _ in range(3))

    def same_document(b, h, i, j, doc):
        return doc[i] == doc[j]

    out, lse = ref.flex_attention_forward(q, k, v, mask_mod=same_document, score_mod_args=(doc,))
    cu = np.concatenate([[0], np.cumsum(lens)])
    vout, vlse = ref.attention_varlen_forward(q[0], k[0], v[0], cu, cu)
    np.testing.assert_allclose(out[0], vout, atol=1e-12)
    np.testing.assert_allclose(lse[0], vlse, atol=1e-12)


def test_learned_relative_bias_against_its_definition_and_finite_differences():
    """score + bias[i - j + seqlen_k - 1] (an additive bias: derivative 1): the forward as the formula, the
    backward against central differences of sum(out * dout)."""
    rng = np.random.default_rng(1)
    sq, sk, d = 5, 7, 4
    q, k, v, dout = (rng.standard_normal(s) for s in ((1, sq, 1, d), (1, sk, 1, d), (1, sk, 1, d), (1, sq, 1, d)))
    bias = rng.standard_normal(sq + sk - 1)

    def rel_bias(x, b, h, i, j, bias):
        return x + bias[i - j + sk - 1]

    def one(x, b, h, i, j, bias):
        return 1.0

    kw = dict(score_mod=rel_bias, score_mod_args=(bias,))
    out, lse = ref.flex_attention_forward(q, k, v, **kw)
    i, j = np.arange(sq)[:, None], np.arange(sk)[None, :]
    s = q[0, :, 0] @ k[0, :, 0].T / math.sqrt(d) + bias[i - j + sk - 1]
    p = np.exp(s - s.max(1, keepdims=True))
    np.testing.assert_allclose(out[0, :, 0], (p / p.sum(1, keepdims=True)) @ v[0, :, 0], atol=1e-12)
    grads = ref.flex_attention_backward(dout, q, k, v, score_mod_grad=one, **kw)
    for idx, x in enumerate((q, k, v)):
        u = rng.standard_normal(x.shape)
        h = 1e-6
        args = [q, k, v]
        args[idx] = x + h * u
        plus = np.sum(ref.flex_attention_forward(*args, **kw)[0] * dout)
        args[idx] = x - h * u
        minus = np.sum(ref.flex_attention_forward(*args, **kw)[0] * dout)
        assert abs((plus - minus) / (2 * h) - np.sum(grads[idx] * u)) < 1e-6


def test_a_row_that_sees_no_key_and_a_missing_derivative():
    q, k, v, dout = _inputs(2, 1, 4, 3, 1, 1, 4)
    out, lse = ref.flex_attention_forward(q, k, v, mask_mod=lambda b, h, i, j: i != 2)
    assert not out[0, 2].any() and lse[0, 0, 2] == -np.inf
    dq, dk, dv = ref.flex_attention_backward(dout, q, k, v, mask_mod=lambda b, h, i, j: i != 2)
    assert not dq[0, 2].any()
    with pytest.raises(ValueError, match="score_mod_grad"):
        ref.flex_attention_backward(dout, q, k, v, score_mod=lambda x, b, h, i, j: 2 * x)


def test_block_mask_classes_tiles():
    """Causal, seqlen 10, tiles of 4: diagonal tiles partial, those below full, those above empty; the last
    (short) tiles are judged on the entries within the sequences."""
    blocks = ref.flex_block_mask(lambda b, h, i, j: j <= i, 1, 1, 10, 10, 4, 4)[0, 0]
    assert blocks.tolist() == [[ref.PARTIAL, ref.EMPTY, ref.EMPTY],
                               [ref.FULL, ref.PARTIAL, ref.EMPTY],
                               [ref.FULL, ref.FULL, ref.PARTIAL]]
