"""Backward kernels against the float64 reference gradient (flashnumba.backward, flashnumba.api)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import assume, given, strategies as st

import flashnumba
from flashnumba import tiling

from conftest import (
    seqlens,
    HEAD_DIMS,
    WORK_BUDGET,
    array_types,
    assert_reference_gradient_matches_finite_differences,
    check_backward,
    random_qkv,
    shard,
    to_numpy,
    to_type,
)

# (kernel, block_m, block_n, num_threads); small ones keep the simulator fast; the defaults always included
BLOCKS = [
    ("v1", 16, 16, None),
    ("v1", 8, 32, None),
    ("v1", 32, 8, None),
    ("v1", None, None, None),
    ("v2", 16, 16, 32),
    ("v2", 8, 16, 64),
    ("v2", 32, 16, 64),
    ("v2", None, None, None),
]
KERNEL_ARGS = [dict(kernel="v1", block_m=16, block_n=16), dict(kernel="v2", block_m=16, block_n=16, num_threads=32)]


def _grads(dout, q, k, v, *, causal=False, softmax_scale=None, **kw):
    """Forward kernel, then backward kernel: returns ((dq, dk, dv), out, lse)."""
    out, lse = flashnumba.flash_attn_forward(q, k, v, causal=causal, softmax_scale=softmax_scale)
    grads = flashnumba.flash_attn_backward(dout, q, k, v, out, lse, causal=causal, softmax_scale=softmax_scale, **kw)
    return grads, out, lse


def test_reference_gradient_matches_finite_differences():
    rng = np.random.default_rng(0)
    for causal, (sq, sk) in ((False, (3, 4)), (True, (4, 3)), (True, (3, 5))):
        q, k, v = (x.astype(np.float64) for x in random_qkv(rng, 1, sq, sk, 2, 3))
        dout = rng.standard_normal(q.shape)
        assert_reference_gradient_matches_finite_differences(q, k, v, dout, causal=causal, softmax_scale=0.8)


@pytest.mark.parametrize("dtype", [np.float32, np.float16], ids=["float32", "float16"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@shard(4)
@given(
    batch=st.integers(1, 2),
    nheads=st.integers(1, 3),
    seqlen_q=seqlens,
    seqlen_k=seqlens,
    head_dim=st.sampled_from(HEAD_DIMS),
    blocks=st.sampled_from(BLOCKS),
    scale=st.one_of(st.none(), st.floats(0.05, 2.0)),
    array_type=st.sampled_from(array_types()),
    seed=st.integers(0, 2**32 - 1),
)
def test_backward_matches_reference(batch, nheads, seqlen_q, seqlen_k, head_dim, causal, blocks, scale, dtype,
                                    array_type, seed):
    kernel, block_m, block_n, num_threads = blocks
    try:  # invalid block configurations are tested in test_backward_block_sizes_checked
        bm, bn, _ = tiling.resolve(f"bwd_{kernel}", head_dim, flashnumba.planner.current_device(), block_m, block_n,
                                   num_threads)[0]
    except ValueError:
        assume(False)
    # forward + dq + dkdv: about three passes over the padded score matrix
    work = 3 * batch * nheads * (-(-seqlen_q // bm) * bm) * (-(-seqlen_k // bn) * bn) * max(head_dim, 8)
    assume(work <= WORK_BUDGET)
    rng = np.random.default_rng(seed)
    q, k, v = random_qkv(rng, batch, seqlen_q, seqlen_k, nheads, head_dim, dtype)
    dout = rng.standard_normal(q.shape).astype(dtype)
    args = [to_type(x, array_type) for x in (dout, q, k, v)]
    grads, out, lse = _grads(*args, causal=causal, softmax_scale=scale, kernel=kernel, block_m=block_m,
                             block_n=block_n, num_threads=num_threads)
    assert all(type(g) is type(args[0]) for g in grads)
    check_backward(grads, dout, q, k, v, out, lse, softmax_scale=scale, causal=causal)


@pytest.mark.parametrize("kw", KERNEL_ARGS)
@pytest.mark.parametrize("causal", [False, True])
def test_backward_is_deterministic(causal, kw):
    rng = np.random.default_rng(1)
    q, k, v = random_qkv(rng, 1, 21, 29, 1, 24)
    dout = rng.standard_normal(q.shape).astype(np.float32)
    first = _grads(dout, q, k, v, causal=causal, **kw)[0]
    for _ in range(2):
        again = _grads(dout, q, k, v, causal=causal, **kw)[0]
        for a, b in zip(first, again):
            assert np.array_equal(to_numpy(a), to_numpy(b))  # bitwise


@pytest.mark.parametrize("kw", KERNEL_ARGS)
def test_fully_masked_rows_get_zero_gradient(kw):
    rng = np.random.default_rng(2)
    q, k, v = random_qkv(rng, 1, 20, 7, 2, 16)  # causal: rows 0..12 see no key
    dout = rng.standard_normal(q.shape).astype(np.float32)
    (dq, dk, dv), out, lse = _grads(dout, q, k, v, causal=True, **kw)
    assert (dq[:, :13] == 0).all()
    check_backward((dq, dk, dv), dout, q, k, v, out, lse, causal=True)


@pytest.mark.parametrize("kw", KERNEL_ARGS)
@pytest.mark.parametrize("causal", [False, True])
def test_backward_large_logits(causal, kw):
    rng = np.random.default_rng(3)
    q, k, v = random_qkv(rng, 1, 33, 41, 1, 40, scale=10.0)
    dout = rng.standard_normal(q.shape).astype(np.float32)
    grads, out, lse = _grads(dout, q, k, v, causal=causal, **kw)
    check_backward(grads, dout, q, k, v, out, lse, causal=causal)


def test_the_gpus_default_tiles():
    """The tiles the default backward plan gives on a GPU (the simulator's own default is one warp on 16 x 16
    tiles; these take 256 simulated threads, so one tile of each, part full): causal."""
    rng = np.random.default_rng(9)
    q, k, v = random_qkv(rng, 1, 45, 40, 1, 40)
    dout = rng.standard_normal(q.shape).astype(np.float32)
    out, lse = flashnumba.flash_attn_forward(q, k, v, causal=True)
    launches = flashnumba.plan_backward(dout, q, k, v, out, lse, causal=True, device="sm_90").launches
    (t,) = {x.tiles for x in launches if x.tiles is not None}
    assert [x.name for x in launches] == ["D_i preprocess", "dQ v2", "dK/dV v2"] and t.num_threads == 256
    grads = flashnumba.flash_attn_backward(dout, q, k, v, out, lse, causal=True, block_m=t.block_m,
                                           block_n=t.block_n, num_threads=t.num_threads)
    check_backward(grads, dout, q, k, v, out, lse, causal=True)


def test_attention_with_grad_equals_forward_then_backward():
    rng = np.random.default_rng(4)
    q, k, v = random_qkv(rng, 1, 19, 23, 2, 8)
    dout = rng.standard_normal(q.shape).astype(np.float32)
    out, dq, dk, dv = flashnumba.attention_with_grad(q, k, v, dout, causal=True, block_m=16, block_n=16,
                                                     num_threads=32)
    o2, lse = flashnumba.flash_attn_forward(q, k, v, causal=True)
    g2 = flashnumba.flash_attn_backward(dout, q, k, v, o2, lse, causal=True, block_m=16, block_n=16, num_threads=32)
    assert np.array_equal(out, o2)
    for a, b in zip((dq, dk, dv), g2):
        assert np.array_equal(a, b)


def test_backward_inputs_not_modified():
    rng = np.random.default_rng(5)
    q, k, v = random_qkv(rng, 1, 9, 11, 1, 8)
    dout = rng.standard_normal(q.shape).astype(np.float32)
    out, lse = flashnumba.flash_attn_forward(q, k, v)
    arrays = (dout, q, k, v, out, lse)
    copies = [a.copy() for a in arrays]
    flashnumba.flash_attn_backward(*arrays, block_m=16, block_n=16, num_threads=32)
    for a, c in zip(arrays, copies):
        np.testing.assert_array_equal(a, c)


def _fwd(d=8):
    rng = np.random.default_rng(6)
    q, k, v = random_qkv(rng, 1, 5, 6, 2, d)
    out, lse = flashnumba.flash_attn_forward(q, k, v)
    return np.ones_like(q), q, k, v, out, lse


@pytest.mark.parametrize("which,make,err,msg", [
    ("dout", lambda a: a[:, :4], ValueError, r"dout must have the shape of q"),
    ("out", lambda a: a[:, :, :1], ValueError, r"out must have the shape of q"),
    ("lse", lambda a: a[:, :, :4], ValueError, r"lse must have shape \(batch, nheads, seqlen_q\)"),
    ("lse", lambda a: a.astype(np.float64), TypeError, r"lse must be float32"),
    ("dout", lambda a: a.astype(np.float16), TypeError, r"dout has dtype float16 but q has dtype float32"),
    ("out", lambda a: a.astype(np.float64), TypeError, r"out has dtype float64"),
    ("lse", lambda a: a[0], ValueError, r"lse must have 3 dimensions"),
])
def test_backward_validation(which, make, err, msg):
    args = dict(zip(("dout", "q", "k", "v", "out", "lse"), _fwd()))
    args[which] = make(args[which])
    with pytest.raises(err, match=msg):
        flashnumba.flash_attn_backward(args["dout"], args["q"], args["k"], args["v"], args["out"], args["lse"])


@pytest.mark.parametrize("kw,err,msg", [
    (dict(kernel="v1", block_m=128, block_n=128), ValueError, r"shared memory in the backward dK/dV kernel v1"),
    (dict(kernel="v2", block_m=256, block_n=256, num_threads=128), ValueError, r"shared memory in the backward"),
    (dict(kernel="v2", block_m=12), ValueError, r"block_m must be a multiple of 8"),
    (dict(kernel="v2", block_n=24, num_threads=128), ValueError, r"block_n must be a multiple of"),
    (dict(kernel="v2", num_threads=40), ValueError, r"num_threads must be a multiple of 32"),
    (dict(kernel="v3"), ValueError, r"kernel must be one of"),
])
def test_backward_block_sizes_checked(kw, err, msg):
    with pytest.raises(err, match=msg):
        flashnumba.flash_attn_backward(*_fwd(d=128), **kw)


@pytest.mark.parametrize("bf16", [False, True])
@pytest.mark.parametrize("seqlen, head_dim, rows", [(1, 40, 8), (17, 59, 8), (33, 128, 4)])
def test_preprocess_kernels_match_numpy(seqlen, head_dim, rows, bf16):
    """D_i = rowsum(dO * O) by both kernels: a thread per row (the simulator's) and a warp per row (a GPU's),
    head dims below, between and at multiples of the warp's 32 lanes, a row count not a multiple of the block's.
    Outputs NaN-filled first, so a row left unwritten fails."""
    from numba import cuda

    from flashnumba.kernels import simt_backward as backward
    from flashnumba._arrays import BITS, bfloat16

    if bf16 and bfloat16() is None:
        pytest.skip("ml_dtypes is not installed")
    rng = np.random.default_rng(seqlen + head_dim)
    dtype = bfloat16() if bf16 else np.float32
    dout, out = (rng.standard_normal((2, seqlen, 2, head_dim)).astype(dtype) for _ in range(2))
    want = (dout.astype(np.float64) * out.astype(np.float64)).sum(-1).transpose(0, 2, 1)
    dev = [cuda.to_device(x.view(BITS) if bf16 else x) for x in (dout, out)]
    for make, block, per_block in ((backward.make_backward_preprocess, 64, 64),
                                   (backward.make_backward_preprocess_warp, 32 * rows, rows)):
        delta = cuda.to_device(np.full((2, 2, seqlen), np.nan, np.float32))
        make(head_dim, per_block, bf16=bf16)[(-(-seqlen // per_block), 4), block](*dev, delta)
        np.testing.assert_allclose(delta.copy_to_host(), want, rtol=1e-5, atol=1e-5 * np.sqrt(head_dim))
