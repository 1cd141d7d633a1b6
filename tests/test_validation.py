"""Every validation rule of the public API gives a clear error (flashnumba.api)."""

from __future__ import annotations

import numpy as np
import pytest

import flashnumba
from flashnumba import _arrays


def qkv(b=1, sq=4, sk=5, h=2, d=8, dtype=np.float32):
    rng = np.random.default_rng(0)
    return (rng.standard_normal((b, sq, h, d)).astype(dtype),
            rng.standard_normal((b, sk, h, d)).astype(dtype),
            rng.standard_normal((b, sk, h, d)).astype(dtype))


def test_wrong_rank():
    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"q must have 4 dimensions, got 3"):
        flashnumba.flash_attn_forward(q[0], k, v)


@pytest.mark.parametrize("which,shape,msg", [
    ("k", (2, 5, 2, 8), "batch mismatch"),
    ("v", (1, 5, 3, 8), "nheads mismatch"),
    ("k", (1, 5, 2, 7), "head_dim mismatch"),
    ("v", (1, 6, 2, 8), "same seqlen_k"),
])
def test_shape_mismatches(which, shape, msg):
    q, k, v = qkv()
    bad = np.zeros(shape, np.float32)
    args = dict(q=q, k=k, v=v)
    args[which] = bad
    with pytest.raises(ValueError, match=msg):
        flashnumba.flash_attn_forward(args["q"], args["k"], args["v"])


@pytest.mark.parametrize("kshape,msg", [((1, 5, 3, 8), "nheads mismatch"), ((1, 5, 2, 16), "head_dim mismatch"),
                                        ((2, 5, 2, 8), "batch mismatch")])
def test_q_vs_kv_mismatch(kshape, msg):
    q, _, _ = qkv()
    k = np.zeros(kshape, np.float32)
    with pytest.raises(ValueError, match=msg):
        flashnumba.flash_attn_forward(q, k, k.copy())


def test_mixed_dtypes():
    q, k, v = qkv()
    with pytest.raises(TypeError, match=r"k has dtype float16 but q has dtype float32"):
        flashnumba.flash_attn_forward(q, k.astype(np.float16), v)


@pytest.mark.parametrize("dtype", [np.float64, np.int32, np.complex64])
def test_unsupported_dtype(dtype):
    q, k, v = qkv(dtype=dtype)
    with pytest.raises(TypeError, match=r"q has dtype .*; supported dtypes are float32, float16, bfloat16"):
        flashnumba.flash_attn_forward(q, k, v)


def test_big_endian_input_says_how_to_convert():
    q, k, v = qkv()
    with pytest.raises(TypeError, match=r"big-endian: convert with astype\('float32'\)"):
        flashnumba.flash_attn_forward(q.astype(">f4"), k, v)


def test_no_heads_is_said_as_such():
    q, k, v = qkv(h=0)
    with pytest.raises(ValueError, match=r"q has no heads"):
        flashnumba.flash_attn_forward(q, k, v)


def test_head_dim_too_large():
    q, k, v = qkv(d=257)
    with pytest.raises(ValueError, match=r"head_dim must be in \[1, 256\], got 257"):
        flashnumba.flash_attn_forward(q, k, v)


def test_head_dim_zero():
    q, k, v = qkv(d=0)
    with pytest.raises(ValueError, match=r"head_dim must be in \[1, 256\], got 0"):
        flashnumba.flash_attn_forward(q, k, v)


def test_last_dimension_not_contiguous():
    q, k, v = qkv(d=16)
    with pytest.raises(ValueError, match=r"q: the last dimension must be contiguous"):
        flashnumba.flash_attn_forward(q[..., ::2], k[..., ::2], v[..., ::2])


def test_not_an_array():
    q, k, v = qkv()
    with pytest.raises(TypeError, match=r"k: expected a NumPy array or a CUDA array"):
        flashnumba.flash_attn_forward(q, k.tolist(), v)


def test_host_and_device_mixed():
    q, k, v = qkv()
    kd = flashnumba._backend.cuda.to_device(k)  # a device array (simulated under the simulator)
    assert _arrays.on_device(_arrays.kind(kd))
    with pytest.raises(ValueError, match=r"same side .* q on the host, k on the GPU"):
        flashnumba.flash_attn_forward(q, kd, v)


@pytest.mark.parametrize("kw,err,msg", [
    (dict(block_m=64, block_n=256, kernel="v1"), ValueError, r"need \d+ bytes of shared memory"),
    (dict(block_m=128, block_n=1024, kernel="v2", num_threads=128), ValueError, r"need \d+ bytes of shared memory"),
    (dict(block_n=12, kernel="v2"), ValueError, r"block_n must be a multiple of 8"),
    (dict(block_m=24, num_threads=128, kernel="v2"), ValueError, r"block_m must be a multiple of"),
    (dict(num_threads=48, kernel="v2"), ValueError, r"num_threads must be a multiple of 32"),
    (dict(block_m=0), ValueError, r"block_m must be in \[1, 1024\]"),
    (dict(block_n=2.5), TypeError, r"block_n must be an int"),
    (dict(kernel="v9"), ValueError, r"kernel must be one of"),
    (dict(causal="yes"), TypeError, r"causal must be a bool"),
    (dict(softmax_scale="0.1"), TypeError, r"softmax_scale must be a real number"),
    (dict(softmax_scale=float("nan")), ValueError, r"softmax_scale must be finite"),
    # (finite in float64, not times log2(e) in the kernels' float32: every score would be NaN)
    (dict(softmax_scale=3e38), ValueError, r"softmax_scale must be at most"),
])
def test_bad_options(kw, err, msg):
    q, k, v = qkv(d=128)
    with pytest.raises(err, match=msg):
        flashnumba.flash_attn_forward(q, k, v, **kw)


def test_a_refused_option_is_refused_after_an_equal_one_was_taken():
    """(1.0, 0) and (True, 0) equal (1, 0) as Python values: the kept call of a good window must not let them by."""
    q, k, v = qkv()
    flashnumba.flash_attn_forward(q, k, v, kernel="v2", window_size=(1, 0))
    for bad in ((1.0, 0), (True, 0)):
        with pytest.raises(ValueError, match="window_size left must be an int"):
            flashnumba.flash_attn_forward(q, k, v, kernel="v2", window_size=bad)


def test_a_bad_call_with_dropout_draws_no_seed(monkeypatch):
    """With dropout and no seed, the call is validated before a seed is drawn: a bad call leaves torch's generator
    (or the entropy source) untouched."""
    from flashnumba import api

    drawn = []
    monkeypatch.setattr(api, "draw_dropout_seed", lambda *a: drawn.append(a) or (1, 0))
    q, k, v = qkv()
    bad_k = np.zeros((1, 5, 2, 7), np.float32)
    with pytest.raises(ValueError, match="head_dim mismatch"):
        flashnumba.flash_attn_func(q, bad_k, v, dropout_p=0.1)
    with pytest.raises(ValueError, match="head_dim mismatch"):
        flashnumba.attention_with_grad(q, bad_k, v, q, dropout_p=0.1)
    cu = np.array([0, 4], np.int32)
    with pytest.raises(ValueError, match="head_dim mismatch"):
        flashnumba.flash_attn_varlen_func(q[0], bad_k[0, :4], v[0, :4], cu, cu, 4, 4, dropout_p=0.1)
    with pytest.raises(ValueError, match="window_size"):
        flashnumba.flash_attn_func(q, k, v, dropout_p=0.1, window_size=(-2, 0))
    # a keyword that nothing takes, and what the varlen functions do not give
    with pytest.raises(TypeError, match="flash_attn_func\\(\\) got an unexpected keyword argument 'seed'"):
        flashnumba.flash_attn_func(q, k, v, dropout_p=0.1, seed=3)
    with pytest.raises(TypeError, match="flash_attn_varlen_func\\(\\) got an unexpected keyword argument 'seed'"):
        flashnumba.flash_attn_varlen_func(q[0], k[0, :4], v[0, :4], cu, cu, 4, 4, dropout_p=0.1, seed=3)
    with pytest.raises(TypeError, match="attention_with_grad\\(\\) got an unexpected keyword argument 'seed'"):
        flashnumba.attention_with_grad(q, k, v, q, dropout_p=0.1, seed=3)
    with pytest.raises(ValueError, match="return_attn_probs=True is not implemented for variable-length"):
        flashnumba.flash_attn_varlen_func(q[0], k[0, :4], v[0, :4], cu, cu, 4, 4, dropout_p=0.1,
                                          return_attn_probs=True)
    with pytest.raises(TypeError, match="attention_with_grad\\(\\) got an unexpected keyword argument 'out'"):
        flashnumba.attention_with_grad(q, k, v, q, dropout_p=0.1, out=q)  # (flash_attn_backward's, given by it)
    monkeypatch.setattr(api, "MAX_PROBS_ELEMENTS", 10)
    with pytest.raises(ValueError, match="more than the 10 allowed"):
        flashnumba.flash_attn_func(q, k, v, dropout_p=0.1, return_attn_probs=True)
    assert drawn == []


def test_too_many_probabilities_are_refused_before_the_forward_runs(monkeypatch):
    """return_attn_probs materialises batch * nheads * seqlen_q * seqlen_k floats: above the limit the call is
    refused before any kernel runs (the forward ran first, then the probabilities were refused)."""
    from flashnumba import _launch, api

    runs = []
    run = _launch.Call.run
    monkeypatch.setattr(_launch.Call, "run", lambda self, *a: runs.append(1) or run(self, *a))
    monkeypatch.setattr(api, "MAX_PROBS_ELEMENTS", 10)
    q, k, v = qkv()
    with pytest.raises(ValueError, match="more than the 10 allowed"):
        flashnumba.flash_attn_func(q, k, v, return_attn_probs=True)
    assert runs == []


def test_precision_chooses_the_float32_kernels_and_refuses_contradictions():
    q, k, v = qkv(d=64)
    assert flashnumba.plan(q, k, v, precision="3xtf32").kernel == "3xtf32"
    assert flashnumba.plan(q, k, v, precision="tf32", kernel="tf32").kernel == "tf32"
    assert flashnumba.plan(q, k, v, precision="ieee").kernel == "v3"
    assert flashnumba.plan(q, k, v, precision="ieee", kernel="v1").kernel == "v1"
    out, lse = flashnumba.flash_attn_forward(q, k, v, precision="ieee")
    ref, ref_lse = flashnumba.flash_attn_forward(q, k, v)
    assert np.array_equal(out, ref) and np.array_equal(lse, ref_lse)  # "ieee" is the default
    with pytest.raises(ValueError, match="precision must be one of"):
        flashnumba.plan(q, k, v, precision="fp32")
    with pytest.raises(ValueError, match="contradicts"):
        flashnumba.plan(q, k, v, precision="ieee", kernel="tf32")
    with pytest.raises(ValueError, match="contradicts"):
        flashnumba.plan(q, k, v, precision="3xtf32", kernel="tf32")
    h = [x.astype(np.float16) for x in (q, k, v)]
    with pytest.raises(ValueError, match="float32 inputs"):
        flashnumba.plan(*h, precision="ieee")
    lse = np.zeros((1, 2, 4), np.float32)
    assert flashnumba.plan_backward(q, q, k, v, q, lse, precision="3xtf32").kernel == "3xtf32"
    assert flashnumba.plan_backward(q, q, k, v, q, lse, precision="tf32").kernel == "tf32"
    with pytest.raises(ValueError, match="'3xtf32'"):  # the TF32 kernels take causal masking only
        flashnumba.plan_backward(q, q, k, v, q, lse, precision="3xtf32", softcap=1.0)
    assert flashnumba.plan_backward(q, q, k, v, q, lse, precision="ieee").kernel == "v2"
