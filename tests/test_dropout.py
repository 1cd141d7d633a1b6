"""Dropout: the Philox stream, the kernels' mask against the reference, determinism, the drop fraction."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, strategies as st

import flashnumba
from flashnumba import reference
from flashnumba.kernels import philox

from conftest import check_backward, check_forward, random_qkv

BLOCKS = dict(block_m=16, block_n=16, num_threads=32)


@pytest.mark.parametrize("ctr,key,first", [
    ((0, 0, 0, 0), (0, 0), 0x6627E8D5),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, 0x408F276D),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0), 0xD16CFE09),
])
def test_philox_known_answers(ctr, key, first):
    """The published known-answer vectors of Philox-4x32-10 (first output word)."""
    out = philox.philox4x32_10(*(np.uint64(x) for x in ctr), *(np.uint64(x) for x in key))
    assert int(out) == first


def test_drop_fraction_is_within_001_of_p():
    for p in (0.1, 0.5, 0.9):
        keep = philox.keep_mask(7, 3, 2, 4, 512, 512, p)
        assert abs((1 - keep.mean()) - p) < 0.01


def test_different_seeds_and_offsets_give_different_masks():
    a = philox.keep_mask(1, 0, 1, 1, 64, 64, 0.5)
    assert (a != philox.keep_mask(2, 0, 1, 1, 64, 64, 0.5)).mean() > 0.4
    assert (a != philox.keep_mask(1, 1, 1, 1, 64, 64, 0.5)).mean() > 0.4
    np.testing.assert_array_equal(a, philox.keep_mask(1, 0, 1, 1, 64, 64, 0.5))


@given(
    seqlen_q=st.integers(1, 50),
    seqlen_k=st.integers(1, 50),
    nheads_k=st.integers(1, 2),
    causal=st.booleans(),
    p=st.sampled_from([0.1, 0.5, 0.9]),
    seed=st.integers(0, 2**64 - 1),
    offset=st.integers(0, 2**32 - 1),
    data_seed=st.integers(0, 2**32 - 1),
)
def test_dropout_forward_and_backward_match_reference(seqlen_q, seqlen_k, nheads_k, causal, p, seed, offset,
                                                      data_seed):
    rng = np.random.default_rng(data_seed)
    nheads = 2
    q = rng.standard_normal((2, seqlen_q, nheads, 24)).astype(np.float32)
    k, v = (rng.standard_normal((2, seqlen_k, nheads_k, 24)).astype(np.float32) for _ in range(2))
    dout = rng.standard_normal(q.shape).astype(np.float32)
    drop = dict(dropout_p=p, dropout_seed=seed, dropout_offset=offset)
    out, lse = flashnumba.flash_attn_forward(q, k, v, causal=causal, **drop, **BLOCKS)
    z = reference.dropout_z(seed, offset, 2, nheads, seqlen_q, seqlen_k, p)
    check_forward(out, lse, q, k, v, causal=causal, dropout_z=z)
    grads = flashnumba.flash_attn_backward(dout, q, k, v, out, lse, causal=causal, **drop, **BLOCKS)
    check_backward(grads, dout, q, k, v, out, lse, causal=causal, dropout_z=z)


def test_dropout_is_deterministic_and_needs_a_seed():
    rng = np.random.default_rng(1)
    q, k, v = random_qkv(rng, 1, 20, 24, 2, 16)
    dout = rng.standard_normal(q.shape).astype(np.float32)
    a = flashnumba.attention_with_grad(q, k, v, dout, dropout_p=0.3, dropout_seed=99, **BLOCKS)
    b = flashnumba.attention_with_grad(q, k, v, dout, dropout_p=0.3, dropout_seed=99, **BLOCKS)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)
    c = flashnumba.attention_with_grad(q, k, v, dout, dropout_p=0.3, dropout_seed=100, **BLOCKS)
    assert not np.array_equal(a[0], c[0])
    with pytest.raises(ValueError, match=r"dropout_p > 0 needs a dropout_seed"):
        flashnumba.flash_attn_forward(q, k, v, dropout_p=0.3)
    with pytest.raises(ValueError, match=r"dropout_p must be in \[0, 1\)"):
        flashnumba.flash_attn_forward(q, k, v, dropout_p=1.0, dropout_seed=1)
    with pytest.raises(ValueError, match=r"dropout_seed must be an int in \[0, 2\*\*64\)"):
        flashnumba.flash_attn_forward(q, k, v, dropout_p=0.1, dropout_seed=-1)
    # (the counter's offset word is 32 bits: 2**32 would repeat offset 0's mask)
    with pytest.raises(ValueError, match=r"dropout_offset must be an int in \[0, 2\*\*32\)"):
        flashnumba.flash_attn_forward(q, k, v, dropout_p=0.1, dropout_seed=1, dropout_offset=2**32)
    with pytest.raises(ValueError, match=r"kernel v1 supports causal masking only"):
        flashnumba.flash_attn_forward(q, k, v, dropout_p=0.1, dropout_seed=1, kernel="v1")


def test_flash_attn_func_with_dropout_draws_a_seed():
    rng = np.random.default_rng(2)
    q, k, v = random_qkv(rng, 1, 9, 9, 1, 8)
    a = flashnumba.flash_attn_func(q, k, v, 0.5, **BLOCKS)
    b = flashnumba.flash_attn_func(q, k, v, 0.5, **BLOCKS)
    assert not np.array_equal(a, b)  # two fresh seeds
    c = flashnumba.flash_attn_func(q, k, v, 0.5, dropout_seed=5, **BLOCKS)
    np.testing.assert_array_equal(c, flashnumba.flash_attn_func(q, k, v, 0.5, dropout_seed=5, **BLOCKS))


@pytest.mark.parametrize("opts", [dict(), dict(causal=True, window_size=(9, 0), softcap=2.0)])
def test_return_attn_probs_gives_the_dropped_probabilities(opts):
    rng = np.random.default_rng(3)
    q = rng.standard_normal((2, 13, 4, 16)).astype(np.float32)
    k, v = (rng.standard_normal((2, 21, 2, 16)).astype(np.float32) for _ in range(2))
    slopes = np.array([0.1, 0.2, 0.3, 0.4], np.float32)
    out, lse, probs = flashnumba.flash_attn_func(q, k, v, 0.4, None, alibi_slopes=slopes, return_attn_probs=True,
                                                 dropout_seed=11, dropout_offset=2, **opts, **BLOCKS)
    z = reference.dropout_z(11, 2, 2, 4, 13, 21, 0.4)
    ref = reference.attention_probs(q, k, v, alibi_slopes=slopes, dropout_z=z, **opts)
    assert probs.shape == (2, 4, 13, 21) and probs.dtype == np.float32
    np.testing.assert_array_equal(probs == 0, ref == 0)  # the same entries dropped (or masked)
    np.testing.assert_allclose(probs, ref, rtol=1e-5, atol=1e-6)
    ref_out, _ = reference.attention_forward(q, k, v, alibi_slopes=slopes, dropout_z=z, **opts)
    np.testing.assert_allclose(out, ref_out, rtol=1e-5, atol=1e-5)


def test_kernel_drop_fraction_is_within_001_of_p():
    """Measured on the kernel's own P * Z: the fraction of (visible) probabilities dropped."""
    rng = np.random.default_rng(4)
    q, k, v = random_qkv(rng, 1, 96, 192, 1, 8)
    for p in (0.2, 0.7):
        _, _, probs = flashnumba.flash_attn_func(q, k, v, p, return_attn_probs=True, dropout_seed=2024, **BLOCKS)
        assert abs((probs == 0).mean() - p) < 0.01
