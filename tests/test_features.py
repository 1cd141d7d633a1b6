"""GQA / MQA, sliding window, softcap and ALiBi, forward and backward, against the float64 reference."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import assume, given, strategies as st

import flashnumba
from flashnumba import reference
from flashnumba._backend import cuda  # a module global: the simulator gives kernels its own cuda by that name

from conftest import WORK_BUDGET, array_types, check_backward, check_forward, seqlens, shard, to_type

windows = st.tuples(st.integers(-1, 40), st.integers(-1, 40))


@st.composite
def features(draw):
    """A random combination of the options; ALiBi slopes of either shape."""
    batch, nheads_k = draw(st.integers(1, 2)), draw(st.integers(1, 2))
    group = draw(st.sampled_from([1, 2, 3]))
    opts = dict(causal=draw(st.booleans()), window_size=draw(windows),
                softcap=draw(st.sampled_from([0.0, 0.0, 1.0, 5.0])))
    if draw(st.booleans()):
        shape = draw(st.sampled_from([(nheads_k * group,), (batch, nheads_k * group)]))
        n = int(np.prod(shape))
        slopes = draw(st.lists(st.floats(0.0, 1.0), min_size=n, max_size=n))
        opts["alibi_slopes"] = np.asarray(slopes).reshape(shape).astype(np.float32)
    return batch, nheads_k, group, opts


def _inputs(rng, batch, seqlen_q, seqlen_k, nheads_k, group, head_dim, dtype):
    q = rng.standard_normal((batch, seqlen_q, nheads_k * group, head_dim)).astype(dtype)
    k = rng.standard_normal((batch, seqlen_k, nheads_k, head_dim)).astype(dtype)
    v = rng.standard_normal((batch, seqlen_k, nheads_k, head_dim)).astype(dtype)
    dout = rng.standard_normal(q.shape).astype(dtype)
    return q, k, v, dout


@pytest.mark.parametrize("dtype", [np.float32, np.float16], ids=["float32", "float16"])
@pytest.mark.parametrize("kernel", ["v2", "v3"])
@shard(4)
@given(
    feats=features(),
    seqlen_q=seqlens,
    seqlen_k=seqlens,
    head_dim=st.sampled_from([8, 24, 40, 59, 64]),
    array_type=st.sampled_from(array_types()),
    seed=st.integers(0, 2**32 - 1),
)
def test_features_forward_and_backward_match_reference(feats, seqlen_q, seqlen_k, head_dim, kernel, dtype,
                                                       array_type, seed):
    batch, nheads_k, group, opts = feats
    pad = lambda n: -(-n // 16) * 16  # noqa: E731
    assume(4 * batch * nheads_k * group * pad(seqlen_q) * pad(seqlen_k) * head_dim <= WORK_BUDGET)
    rng = np.random.default_rng(seed)
    q, k, v, dout = _inputs(rng, batch, seqlen_q, seqlen_k, nheads_k, group, head_dim, dtype)
    dev = [to_type(x, array_type) for x in (q, k, v, dout)]
    kopts = dict(opts)
    if "alibi_slopes" in opts:
        kopts["alibi_slopes"] = to_type(opts["alibi_slopes"], array_type)
    blocks = dict(block_m=16, block_n=16, num_threads=32)
    out, lse = flashnumba.flash_attn_forward(*dev[:3], kernel=kernel, **blocks, **kopts)
    check_forward(out, lse, q, k, v, **opts)
    grads = flashnumba.flash_attn_backward(dev[3], *dev[:3], out, lse, **blocks, **kopts)
    check_backward(grads, dout, q, k, v, out, lse, **opts)


def test_causal_is_window_minus_one_zero():
    rng = np.random.default_rng(1)
    q, k, v, _ = _inputs(rng, 1, 23, 19, 2, 1, 16, np.float32)
    a = flashnumba.flash_attn_forward(q, k, v, causal=True, block_m=16, block_n=16, num_threads=32)
    b = flashnumba.flash_attn_forward(q, k, v, window_size=(-1, 0), block_m=16, block_n=16, num_threads=32)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)


def test_gqa_equals_repeated_heads():
    """GQA gives what the same kernel gives on key/value heads repeated for every query head."""
    rng = np.random.default_rng(2)
    q, k, v, dout = _inputs(rng, 1, 17, 21, 2, 3, 8, np.float32)
    kw = dict(block_m=16, block_n=16, num_threads=32, causal=True)
    out, dq, dk, dv = flashnumba.attention_with_grad(q, k, v, dout, **kw)
    kr, vr = np.repeat(k, 3, axis=2), np.repeat(v, 3, axis=2)
    out2, dq2, dk2, dv2 = flashnumba.attention_with_grad(q, kr, vr, dout, **kw)
    np.testing.assert_array_equal(out, out2)
    np.testing.assert_array_equal(dq, dq2)
    np.testing.assert_allclose(dk, dk2.reshape(1, 21, 2, 3, 8).sum(axis=3), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(dv, dv2.reshape(1, 21, 2, 3, 8).sum(axis=3), rtol=1e-5, atol=1e-6)


def test_window_with_no_visible_key_gives_zero_and_minus_inf():
    rng = np.random.default_rng(3)
    q, k, v, dout = _inputs(rng, 1, 10, 30, 1, 1, 8, np.float32)
    # seqlen_q 10, seqlen_k 5: the diagonal is j = i - 5, so with window (0, 0) rows 0..4 see no key
    out, lse = flashnumba.flash_attn_forward(q, k[:, :5], v[:, :5], window_size=(0, 0), block_m=16, block_n=16,
                                             num_threads=32)
    ref_o, ref_l = reference.attention_forward(q, k[:, :5], v[:, :5], window_size=(0, 0))
    assert np.isneginf(ref_l[0, 0, :5]).all() and np.isneginf(lse[0, 0, :5]).all()
    assert (out[0, :5] == 0).all()
    check_forward(out, lse, q, k[:, :5], v[:, :5], window_size=(0, 0))


@pytest.mark.parametrize("kw,err,msg", [
    (dict(window_size=(1,)), ValueError, r"window_size must be a pair"),
    (dict(window_size=(-2, 0)), ValueError, r"window_size left must be an int in \[-1, 2\*\*62\)"),
    (dict(window_size=(0, 1.5)), ValueError, r"window_size right must be an int in \[-1, 2\*\*62\)"),
    (dict(window_size=(2**63, 0)), ValueError, r"window_size left must be an int in \[-1, 2\*\*62\)"),
    (dict(softcap=-1.0), ValueError, r"softcap must be finite and >= 0"),
    (dict(softcap="1"), TypeError, r"softcap must be a real number"),
    (dict(softcap=1e39), ValueError, r"softcap must be 0 or in \["),  # (float32 inf: all NaN)
    (dict(softcap=1e38), ValueError, r"softcap must be 0 or in \["),  # (its reciprocal subnormal: flushed to 0)
    (dict(softcap=1e-46), ValueError, r"softcap must be 0 or in \["),  # (float32 0: a division by 0)
    (dict(alibi_slopes=np.ones(3, np.float32)), ValueError, r"alibi_slopes must have shape \(nheads,\)"),
    (dict(alibi_slopes=np.ones((2, 2), np.float32)), ValueError, r"alibi_slopes must have shape"),
    (dict(alibi_slopes=np.ones(4, np.float64)), TypeError, r"alibi_slopes must be float32"),
    (dict(alibi_slopes=[0.1] * 4), TypeError, r"alibi_slopes"),
    (dict(kernel="v1", window_size=(3, 0)), ValueError, r"kernel v1 supports causal masking only"),
    (dict(kernel="v1", softcap=1.0), ValueError, r"kernel v1 supports causal masking only"),
])
def test_feature_validation(kw, err, msg):
    rng = np.random.default_rng(4)
    q, k, v, _ = _inputs(rng, 1, 5, 6, 2, 2, 8, np.float32)
    with pytest.raises(err, match=msg):
        flashnumba.flash_attn_forward(q, k, v, **kw)


def test_gqa_validation_and_v1():
    rng = np.random.default_rng(5)
    q = rng.standard_normal((1, 5, 4, 8)).astype(np.float32)
    k = rng.standard_normal((1, 6, 3, 8)).astype(np.float32)
    with pytest.raises(ValueError, match=r"multiple of the number of key/value heads"):
        flashnumba.flash_attn_forward(q, k, k)
    with pytest.raises(ValueError, match=r"k and v must have the same number of heads"):
        flashnumba.flash_attn_forward(q, k[:, :, :2], k[:, :, :1])
    with pytest.raises(ValueError, match=r"kernel v1 supports causal masking only"):
        flashnumba.flash_attn_forward(q, k[:, :, :2], k[:, :, :2], kernel="v1")


@pytest.mark.parametrize("kw,err,msg", [
    (dict(dropout_p=1.0), ValueError, r"dropout_p must be in \[0, 1\)"),
    (dict(return_attn_probs="yes"), TypeError, r"return_attn_probs must be a bool"),
    (dict(deterministic="no"), TypeError, r"deterministic must be a bool"),
])
def test_flash_attn_func_arguments(kw, err, msg):
    rng = np.random.default_rng(6)
    q, k, v, _ = _inputs(rng, 1, 5, 6, 1, 1, 8, np.float32)
    with pytest.raises(err, match=msg):
        flashnumba.flash_attn_func(q, k, v, **kw)


def test_flash_attn_func_positional_order_matches_flash_attn():
    rng = np.random.default_rng(7)
    q, k, v, _ = _inputs(rng, 1, 9, 9, 1, 1, 8, np.float32)
    # flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, ...)
    out = flashnumba.flash_attn_func(q, k, v, 0.0, 0.5, True, (3, 0), 2.0, None, block_m=16, block_n=16,
                                     num_threads=32)
    ref, _ = reference.attention_forward(q, k, v, softmax_scale=0.5, causal=True, window_size=(3, 0), softcap=2.0)
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-6)


def test_alibi_refuses_sequences_of_2_to_the_24_positions():
    """ALiBi's distances are float32 in the kernels, exact below 2^24 positions: a longer sequence (q's or k's, or a
    varlen call's max_seqlen) is refused before anything is planned rather than biased by rounded distances."""
    long = np.broadcast_to(np.zeros((1, 1, 1, 8), np.float16), (1, 2**24, 1, 8))  # (no memory: stride 0)
    short = np.zeros((1, 4, 1, 8), np.float16)
    slopes = np.ones(1, np.float32)
    for q, k in ((long, short), (short, long)):
        with pytest.raises(ValueError, match="shorter than 2\\*\\*24"):
            flashnumba.plan(q, k, k, alibi_slopes=slopes)
    flashnumba.plan(short, short, short, alibi_slopes=slopes)
    cu = np.array([0, 4], np.int32)
    with pytest.raises(ValueError, match="shorter than 2\\*\\*24"):
        flashnumba.api.check_varlen_args(short[0], short[0], short[0], cu, cu, 4, 2**24, alibi_slopes=slopes)


def test_the_hopper_kernels_alibi_distance_is_the_integer_one():
    """The Hopper kernels' ALiBi (``make_score_mod`` with ``no_calls``; the other forwards and dQ kernels with
    ``float32_distance``) takes |i + diag - j| as a difference of float32 indices: the same score as the dK/dV
    kernels' integer distance, bit for bit, wherever indices and distances stay below 2^24 (diag negative too), so a
    backward recomputes the forward's P whichever form each kernel takes."""
    from numba import float32

    from flashnumba.kernels.common import make_score_mod

    rng = np.random.default_rng(7)
    forms = (make_score_mod(False, True, no_calls=True), make_score_mod(False, True),
             make_score_mod(False, True, float32_distance=True))

    @cuda.jit
    def evaluate(xs, slope, idx, out):  # each form's score of case c, as a kernel computes it (device functions)
        c = cuda.grid(1)
        if c < xs.size:
            i, j, diag = idx[c, 0], idx[c, 1], idx[c, 2]
            out[0, c] = forms[0](xs[c], float32(0.0), slope, i, j, diag)[0]
            out[1, c] = forms[1](xs[c], float32(0.0), slope, i, j, diag)[0]
            out[2, c] = forms[2](xs[c], float32(0.0), slope, i, j, diag)[0]

    slope = np.float32(0.37)
    cases = [(0, 0, 0), (5, 9, -3), (2**24 - 1, 0, 0), (0, 2**24 - 1, 0), (2**23, 2**23 - 7, 2**23)]
    cases += [tuple(int(x) for x in rng.integers(0, 2**20, 2)) + (int(rng.integers(-2**20, 2**20)),)
              for _ in range(200)]
    idx = np.array(cases, np.int64)
    xs = rng.standard_normal(len(cases)).astype(np.float32)
    out = cuda.to_device(np.full((3, len(cases)), np.nan, np.float32))
    evaluate[(len(cases) + 63) // 64, 64](cuda.to_device(xs), slope, cuda.to_device(idx), out)
    got = out.copy_to_host()
    distance = np.abs(idx[:, 0] + idx[:, 2] - idx[:, 1])
    # x - slope * d rounded twice, or once where the compiler fuses it into an FMA (the GPU does; computed here in
    # float64, where slope * d is exact, then rounded to float32): a distance off by one moves the score by the
    # slope, far more than either rounding
    want = (xs - slope * distance.astype(np.float32)).astype(np.float32)
    fused = (xs.astype(np.float64) - np.float64(slope) * distance).astype(np.float32)
    for form in range(3):
        np.testing.assert_array_equal(got[form], got[0], err_msg=f"form {form} beside form 0")
    wrong = (got[0] != want) & (got[0] != fused)
    assert not wrong.any(), (idx[wrong][:5], got[0][wrong][:5], want[wrong][:5])
