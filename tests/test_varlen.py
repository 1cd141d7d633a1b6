"""Variable-length (packed) batches: flash_attn_varlen_forward / _backward against the reference, per sequence."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, strategies as st

import flashnumba
from flashnumba import reference

from conftest import array_types, assert_close_to_truth, shard, to_numpy, to_type

BLOCKS = dict(block_m=16, block_n=16, num_threads=32)


def _packed(rng, lens_q, lens_k, nheads, nheads_k, d, dtype=np.float32):
    cu_q = np.concatenate([[0], np.cumsum(lens_q)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(lens_k)]).astype(np.int32)
    q = rng.standard_normal((cu_q[-1], nheads, d)).astype(dtype)
    k = rng.standard_normal((cu_k[-1], nheads_k, d)).astype(dtype)
    v = rng.standard_normal((cu_k[-1], nheads_k, d)).astype(dtype)
    dout = rng.standard_normal(q.shape).astype(dtype)
    return q, k, v, dout, cu_q, cu_k


def _check(q, k, v, dout, cu_q, cu_k, out, lse, grads, opts):
    dtype = q.dtype
    truth_o, truth_l = reference.attention_varlen_forward(q, k, v, cu_q, cu_k, **opts)
    base_o, base_l = reference.attention_varlen_forward(q, k, v, cu_q, cu_k, dtype=dtype, **opts)
    out, lse = to_numpy(out), to_numpy(lse)
    assert out.shape == q.shape and lse.shape == (q.shape[1], q.shape[0])
    assert not np.isnan(out).any() and not np.isnan(lse).any()
    longest_q, longest_k = int(np.diff(cu_q).max(initial=0)), int(np.diff(cu_k).max(initial=0))
    n = max(q.shape[-1], longest_k)
    assert_close_to_truth("out", out, truth_o, base_o.astype(dtype), reduction=n)
    assert_close_to_truth("lse", lse, truth_l, base_l.astype(np.float32), reduction=n)
    truth = reference.attention_varlen_backward(dout, q, k, v, cu_q, cu_k, **opts)
    base = reference.attention_varlen_backward(dout, q, k, v, cu_q, cu_k, dtype=dtype, **opts)
    for name, g, t, bl in zip(("dq", "dk", "dv"), grads, truth, base):
        g = to_numpy(g)
        assert not np.isnan(g).any(), name
        assert_close_to_truth(name, g, t, bl.astype(dtype), reduction=max(n, longest_q))


@pytest.mark.parametrize("alibi", [False, True], ids=["no-alibi", "alibi"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@shard(4)
@given(
    lens=st.lists(st.tuples(st.integers(0, 40), st.integers(0, 40)), min_size=1, max_size=4),
    nheads_k=st.integers(1, 2),
    group=st.integers(1, 2),
    head_dim=st.sampled_from([8, 24, 59]),
    window=st.sampled_from([(-1, -1), (8, 0), (5, 3)]),
    softcap=st.sampled_from([0.0, 2.0]),
    array_type=st.sampled_from(array_types()),
    seed=st.integers(0, 2**32 - 1),
)
def test_varlen_matches_reference(lens, nheads_k, group, head_dim, causal, window, softcap, alibi, array_type, seed):
    rng = np.random.default_rng(seed)
    lens_q, lens_k = zip(*lens)
    nheads = nheads_k * group
    q, k, v, dout, cu_q, cu_k = _packed(rng, lens_q, lens_k, nheads, nheads_k, head_dim)
    opts = dict(causal=causal, window_size=window, softcap=softcap)
    if alibi:
        opts["alibi_slopes"] = rng.uniform(0, 1, (len(lens), nheads)).astype(np.float32)
    dev = [to_type(x, array_type) for x in (q, k, v, dout, cu_q, cu_k)]
    kopts = dict(opts)
    if alibi:
        kopts["alibi_slopes"] = to_type(opts["alibi_slopes"], array_type)
    mq, mk = max(lens_q), max(lens_k)
    out, lse = flashnumba.flash_attn_varlen_forward(*dev[:3], dev[4], dev[5], mq, mk, **BLOCKS, **kopts)
    grads = flashnumba.flash_attn_varlen_backward(dev[3], *dev[:3], out, lse, dev[4], dev[5], mq, mk, **BLOCKS,
                                                  **kopts)
    _check(q, k, v, dout, cu_q, cu_k, out, lse, grads, opts)


def test_varlen_equals_padded_batch_for_equal_lengths():
    rng = np.random.default_rng(1)
    q, k, v, dout, cu_q, cu_k = _packed(rng, [19, 19], [23, 23], 2, 1, 16)
    out, lse = flashnumba.flash_attn_varlen_forward(q, k, v, cu_q, cu_k, 19, 23, causal=True, **BLOCKS)
    o4, l4 = flashnumba.flash_attn_forward(q.reshape(2, 19, 2, 16), k.reshape(2, 23, 1, 16), v.reshape(2, 23, 1, 16),
                                           causal=True, **BLOCKS)
    np.testing.assert_array_equal(out, o4.reshape(out.shape))
    np.testing.assert_array_equal(lse, l4.transpose(1, 0, 2).reshape(2, 38))


def test_varlen_empty_sequences_and_max_larger_than_needed():
    rng = np.random.default_rng(2)
    q, k, v, dout, cu_q, cu_k = _packed(rng, [0, 7, 3], [5, 0, 9], 1, 1, 8)
    out, lse = flashnumba.flash_attn_varlen_forward(q, k, v, cu_q, cu_k, 40, 40, **BLOCKS)
    grads = flashnumba.flash_attn_varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, 40, 40, **BLOCKS)
    assert (out[:7] == 0).all() and np.isneginf(lse[:, :7]).all()  # sequence 1 has queries but no keys
    assert (grads[1][:5] == 0).all()  # sequence 0 has keys but no queries
    _check(q, k, v, dout, cu_q, cu_k, out, lse, grads, {})


@pytest.mark.parametrize("change,err,msg", [
    (dict(cu_seqlens_q=np.array([0, 5, 9], np.int64)), TypeError, r"cu_seqlens_q must be int32"),
    (dict(cu_seqlens_q=np.array([1, 5, 10], np.int32)), ValueError, r"cu_seqlens_q must start at 0"),
    (dict(cu_seqlens_q=np.array([0, 6, 5], np.int32)), ValueError, r"must be non-decreasing"),
    # (lengths that differ: said first, before the values)
    (dict(cu_seqlens_q=np.array([0, 6, 5, 10], np.int32)), ValueError, r"must have the same length"),
    (dict(cu_seqlens_k=np.array([0, 4, 11], np.int32)), ValueError, r"cu_seqlens_k must end at the total"),
    (dict(cu_seqlens_k=np.array([0, 12], np.int32)), ValueError, r"must have the same length"),
    (dict(max_seqlen_q=4), ValueError, r"max_seqlen_q must be at least the longest sequence \(5\)"),
    (dict(max_seqlen_k=1.5), TypeError, r"max_seqlen_k must be an int"),
    (dict(kernel="v1"), ValueError, r"kernel v1 supports causal masking only"),
])
def test_varlen_validation(change, err, msg):
    rng = np.random.default_rng(3)
    q, k, v, dout, cu_q, cu_k = _packed(rng, [5, 5], [6, 6], 1, 1, 8)
    args = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=5, max_seqlen_k=6)
    kernel = change.pop("kernel", "v3")
    args.update(change)
    with pytest.raises(err, match=msg):
        flashnumba.flash_attn_varlen_forward(q, k, v, **args, kernel=kernel)


def test_numpy_offsets_are_checked_with_the_device_checks_off():
    """config.check_device_values off spares device offsets the host copy; NumPy offsets cost none, and are
    checked at every call, a kept kind of call included (unchecked, they would take the kernels outside the
    arrays)."""
    rng = np.random.default_rng(3)
    q, k, v, dout, cu_q, cu_k = _packed(rng, [5, 5], [6, 6], 1, 1, 8)
    with flashnumba.config.temporarily("check_device_values", False):
        flashnumba.flash_attn_varlen_forward(q, k, v, cu_q, cu_k, 5, 6, kernel="v3")
        with pytest.raises(ValueError, match="cu_seqlens_k must end at the total"):
            flashnumba.flash_attn_varlen_forward(q, k, v, cu_q, np.array([0, 6, 30], np.int32), 5, 6, kernel="v3")


def test_varlen_func():
    rng = np.random.default_rng(4)
    q, k, v, dout, cu_q, cu_k = _packed(rng, [9, 4], [9, 11], 2, 2, 8)
    out = flashnumba.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 9, 11, 0.0, None, True, **BLOCKS)
    ref, _ = reference.attention_varlen_forward(q, k, v, cu_q, cu_k, causal=True)
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-6)


def test_varlen_func_rejects_return_attn_probs():
    rng = np.random.default_rng(5)
    q, k, v, dout, cu_q, cu_k = _packed(rng, [3], [4], 1, 1, 8)
    with pytest.raises(ValueError, match=r"return_attn_probs=True is not implemented for variable-length"):
        flashnumba.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 3, 4, return_attn_probs=True)
