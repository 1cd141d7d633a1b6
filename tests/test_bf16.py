"""bfloat16 (flashnumba.bf16): the conversions bit for bit against ml_dtypes, run through the device functions the
kernels call, and every kernel with bfloat16 inputs against the float64 reference (NumPy arrays of
ml_dtypes.bfloat16; torch.bfloat16 CUDA tensors too on a GPU with torch)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import assume, given, settings, strategies as st

import flashnumba
from flashnumba import _arrays, reference
from flashnumba.kernels import bf16
from flashnumba._backend import cuda

from conftest import WORK_BUDGET, check_backward, check_forward, random_qkv, seqlens, to_numpy, to_type

ml_dtypes = pytest.importorskip("ml_dtypes")
BF16 = np.dtype(ml_dtypes.bfloat16)

# bfloat16 runs the same kernels as float32 (tested at length elsewhere): a few examples each suffice.
FEW = settings(max_examples=max(3, settings.default.max_examples // 3))
SMALL = dict(block_m=16, block_n=16, num_threads=32)


def array_types():
    """NumPy always; torch.bfloat16 CUDA tensors on a GPU where torch is installed."""
    types = ["numpy"]
    if not flashnumba.SIMULATOR:
        try:
            import torch  # noqa: F401

            types.append("torch")
        except ImportError:
            pass
    return types


# ------------------------------------------------------------------ the conversions, through the device functions


@cuda.jit
def _widen(bits, out):
    for i in range(cuda.grid(1), bits.size, cuda.gridsize(1)):
        out[i] = bf16.bf16_to_float32(bits[i])


@cuda.jit
def _narrow(x, bits):
    for i in range(cuda.grid(1), x.size, cuda.gridsize(1)):
        bits[i] = bf16.float32_to_bf16(x[i])


def _run(kernel, x, out_dtype):
    """kernel(x, out) over all of x; under the simulator (one Python thread per CUDA thread) by one thread."""
    xd = cuda.to_device(x)
    out = cuda.to_device(np.zeros(x.size, out_dtype))
    grid, block = (1, 1) if flashnumba.SIMULATOR else (256, 256)
    kernel[grid, block](xd, out)
    return out.copy_to_host()


def test_bf16_to_float32_is_exact_for_all_65536_patterns():
    bits = np.arange(2**16).astype(np.uint16)
    got = _run(_widen, bits, np.float32)
    want = bits.view(BF16).astype(np.float32)
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))  # NaN payloads and -0 included


KNOWN = {  # float32 bits -> bfloat16 bits, where rounding is easy to get wrong
    0x00000000: 0x0000, 0x80000000: 0x8000,  # +0, -0
    0x3F800000: 0x3F80, 0x3F807FFF: 0x3F80, 0x3F808001: 0x3F81,  # 1, then just below and above half an ulp more
    0x3F808000: 0x3F80, 0x3F818000: 0x3F82, 0xBF818000: 0xBF82,  # ties: to the even neighbour
    0x7F7F7FFF: 0x7F7F, 0x7F7F8000: 0x7F80, 0x7F7FFFFF: 0x7F80, 0xFF7FFFFF: 0xFF80,  # past the largest: to inf
    0x7F800000: 0x7F80, 0xFF800000: 0xFF80,  # +-inf
    0x7FC00000: 0x7FC0, 0xFFC00000: 0xFFC0, 0x7FFFFFFF: 0x7FC0, 0xFF800001: 0xFFC0,  # NaNs: the quiet NaN, signed;
    0x7F800001: 0x7FC0, 0x7F80FFFF: 0x7FC0, 0x7FFF8000: 0x7FC0,  # rounding them would give inf, or carry to -0
    0x00000001: 0x0000, 0x00008000: 0x0000, 0x00018000: 0x0002, 0x80000001: 0x8000,  # subnormals round too
    0x00400000: 0x0040, 0x007FFFFF: 0x0080, 0x807FFFFF: 0x8080,  # (no flush to zero)
}


def test_float32_to_bf16_rounds_to_nearest_even_like_ml_dtypes():
    rng = np.random.default_rng(0)
    patterns = np.concatenate([
        np.array(list(KNOWN), np.uint32),
        np.arange(2**16, dtype=np.uint32) << 16,  # every bfloat16 value: converts back to itself
        rng.integers(0, 2**32, 200_000, dtype=np.uint64).astype(np.uint32),
    ])
    x = patterns.view(np.float32)
    got = _run(_narrow, x, np.uint16)
    np.testing.assert_array_equal(got[: len(KNOWN)], list(KNOWN.values()))
    with np.errstate(invalid="ignore"):  # NumPy warns when it casts a NaN
        want = x.astype(BF16).view(np.uint16)
    bad = np.flatnonzero(got != want)
    assert bad.size == 0, (f"{bad.size} patterns differ, e.g. {patterns[bad[0]]:#010x} -> {got[bad[0]]:#06x}, "
                           f"ml_dtypes {want[bad[0]]:#06x}")


def test_outputs_are_poisoned_with_the_bf16_nan():
    _, dev = _arrays.empty((3, 5), BF16, "numpy")
    assert dev.dtype == np.uint16 and (dev.copy_to_host() == 0x7FC0).all()


# ------------------------------------------------------------------ the kernels against the reference


@FEW
@given(
    batch=st.integers(1, 2),
    nheads=st.integers(1, 2),
    seqlen_q=seqlens,
    seqlen_k=seqlens,
    head_dim=st.sampled_from([8, 24, 40, 59, 64]),
    causal=st.booleans(),
    kernel=st.sampled_from([("v1", "v1"), ("v2", "v2"), ("v3", "v2")]),  # forward, backward
    array_type=st.sampled_from(array_types()),
    seed=st.integers(0, 2**32 - 1),
)
def test_bf16_forward_and_backward_match_reference(batch, nheads, seqlen_q, seqlen_k, head_dim, causal, kernel,
                                                   array_type, seed):
    pad = lambda n: -(-n // 16) * 16  # noqa: E731
    assume(4 * batch * nheads * pad(seqlen_q) * pad(seqlen_k) * head_dim <= WORK_BUDGET // 2)
    rng = np.random.default_rng(seed)
    q, k, v = random_qkv(rng, batch, seqlen_q, seqlen_k, nheads, head_dim, BF16)
    dout = rng.standard_normal(q.shape).astype(BF16)
    dev = [to_type(x, array_type) for x in (q, k, v, dout)]
    blocks = dict(block_m=16, block_n=16) if kernel[0] == "v1" else SMALL
    out, lse = flashnumba.flash_attn_forward(*dev[:3], causal=causal, kernel=kernel[0], **blocks)
    assert type(out) is type(dev[0]) and type(lse) is type(dev[0])
    check_forward(out, lse, q, k, v, causal=causal)
    grads = flashnumba.flash_attn_backward(dev[3], *dev[:3], out, lse, causal=causal, kernel=kernel[1], **blocks)
    assert all(type(g) is type(dev[0]) for g in grads)
    check_backward(grads, dout, q, k, v, out, lse, causal=causal)


@FEW
@given(
    seqlen_q=st.integers(1, 33),
    seqlen_k=st.integers(1, 33),
    group=st.sampled_from([2, 3]),
    window=st.tuples(st.integers(-1, 20), st.integers(-1, 20)),
    softcap=st.sampled_from([0.0, 2.0]),
    alibi=st.booleans(),
    dropout_p=st.sampled_from([0.0, 0.3]),
    array_type=st.sampled_from(array_types()),
    seed=st.integers(0, 2**32 - 1),
)
def test_bf16_gqa_window_softcap_alibi_dropout_match_reference(seqlen_q, seqlen_k, group, window, softcap, alibi,
                                                               dropout_p, array_type, seed):
    rng = np.random.default_rng(seed)
    nheads_k, d = 1, 16
    q = rng.standard_normal((1, seqlen_q, nheads_k * group, d)).astype(BF16)
    k, v = (rng.standard_normal((1, seqlen_k, nheads_k, d)).astype(BF16) for _ in range(2))
    dout = rng.standard_normal(q.shape).astype(BF16)
    opts = dict(window_size=window, softcap=softcap)
    if alibi:
        opts["alibi_slopes"] = rng.uniform(0, 1, nheads_k * group).astype(np.float32)
    drop = dict(dropout_p=dropout_p, dropout_seed=seed, dropout_offset=3)
    ref_opts = dict(opts, dropout_z=reference.dropout_z(seed, 3, 1, nheads_k * group, seqlen_q, seqlen_k, dropout_p))
    dev = [to_type(x, array_type) for x in (q, k, v, dout)]
    kopts = dict(opts, alibi_slopes=to_type(opts["alibi_slopes"], array_type)) if alibi else opts
    out, lse = flashnumba.flash_attn_forward(*dev[:3], **kopts, **drop, **SMALL)
    check_forward(out, lse, q, k, v, **ref_opts)
    grads = flashnumba.flash_attn_backward(dev[3], *dev[:3], out, lse, **kopts, **drop, **SMALL)
    check_backward(grads, dout, q, k, v, out, lse, **ref_opts)


@FEW
@given(
    lens=st.lists(st.tuples(st.integers(0, 24), st.integers(0, 24)), min_size=1, max_size=3),
    causal=st.booleans(),
    softcap=st.sampled_from([0.0, 2.0]),
    array_type=st.sampled_from(array_types()),
    seed=st.integers(0, 2**32 - 1),
)
def test_bf16_varlen_matches_reference(lens, causal, softcap, array_type, seed):
    rng = np.random.default_rng(seed)
    lens_q, lens_k = zip(*lens)
    cu_q, cu_k = (np.concatenate([[0], np.cumsum(n)]).astype(np.int32) for n in (lens_q, lens_k))
    q, dout = (rng.standard_normal((cu_q[-1], 2, 16)).astype(BF16) for _ in range(2))
    k, v = (rng.standard_normal((cu_k[-1], 1, 16)).astype(BF16) for _ in range(2))
    opts = dict(causal=causal, softcap=softcap)
    dev = [to_type(x, array_type) for x in (q, k, v, dout, cu_q, cu_k)]
    mq, mk = max(lens_q), max(lens_k)
    out, lse = flashnumba.flash_attn_varlen_forward(*dev[:3], dev[4], dev[5], mq, mk, **opts, **SMALL)
    grads = flashnumba.flash_attn_varlen_backward(dev[3], *dev[:3], out, lse, dev[4], dev[5], mq, mk, **opts,
                                                  **SMALL)
    # each sequence is one batch of the dense checks (its own bottom-right causal corner)
    out, lse, grads = to_numpy(out), to_numpy(lse), [to_numpy(g) for g in grads]
    assert out.dtype == BF16 and all(g.dtype == BF16 for g in grads)
    for b in range(len(lens)):
        rq, rk = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        q_b, k_b, v_b, do_b, o_b = (x[None, r] for x, r in ((q, rq), (k, rk), (v, rk), (dout, rq), (out, rq)))
        l_b = lse[None, :, rq]
        if rq.stop > rq.start:
            check_forward(o_b, l_b, q_b, k_b, v_b, **opts)
        check_backward([grads[0][None, rq], grads[1][None, rk], grads[2][None, rk]], do_b, q_b, k_b, v_b, o_b, l_b,
                       **opts)


# ------------------------------------------------------------------ float32 with exact loads and rounded stores


def assert_ulps_apart(actual, desired, ulps):
    """Equal to within ``ulps`` units in the last place: the bit patterns, mapped to integers in the order of the
    values they encode (-0 and +0 both to 0), differ by at most ``ulps``."""
    bits = {2: np.int16, 4: np.int32}[actual.dtype.itemsize]
    lowest = np.iinfo(bits).min
    a, d = (np.where(b >= 0, b, lowest - b) for b in (x.view(bits).astype(np.int64) for x in (actual, desired)))
    worst = int(np.abs(a - d).max(initial=0))
    assert worst <= ulps, f"{worst} ulps apart (at most {ulps} allowed)"


def test_bf16_results_are_the_float32_kernels_rounded():
    """The bfloat16 kernels compute exactly what the float32 kernels compute from the same (exact) values, and
    round once: their results equal the float32 kernels' rounded to bfloat16, lse included.

    Bit for bit in the simulator, where both run the same Python arithmetic. On a GPU the two are separately
    compiled programs, and the compiler may fuse a multiply and an add into one FMA in one and not in the other
    (measured on the H200: 3 of 52 lse values 1 ulp apart). There, float32 results may differ by 2 ulps, and a
    bfloat16 result by 1 ulp (a float32 value 1 ulp away can round to the neighbouring bfloat16).
    """
    f32_ulps, bf16_ulps = (0, 0) if flashnumba.SIMULATOR else (2, 1)
    rng = np.random.default_rng(1)
    q = rng.standard_normal((1, 13, 4, 16)).astype(BF16)
    k, v = (rng.standard_normal((1, 21, 2, 16)).astype(BF16) for _ in range(2))
    dout = rng.standard_normal(q.shape).astype(BF16)
    slopes = np.array([0.1, 0.3, 0.2, 0.5], np.float32)
    opts = dict(causal=True, window_size=(9, 0), softcap=3.0, alibi_slopes=slopes, dropout_p=0.2, dropout_seed=5)
    f32 = [x.astype(np.float32) for x in (q, k, v, dout)]
    out, lse = flashnumba.flash_attn_forward(q, k, v, **opts, **SMALL)
    out32, lse32 = flashnumba.flash_attn_forward(*f32[:3], **opts, **SMALL)
    assert_ulps_apart(out, out32.astype(BF16), bf16_ulps)
    finite = np.isfinite(lse32)
    np.testing.assert_array_equal(lse[~finite], lse32[~finite])
    assert_ulps_apart(lse[finite], lse32[finite], f32_ulps)
    grads = flashnumba.flash_attn_backward(dout, q, k, v, out, lse, **opts, **SMALL)
    grads32 = flashnumba.flash_attn_backward(f32[3], *f32[:3], out.astype(np.float32), lse, **opts, **SMALL)
    for g, g32 in zip(grads, grads32):
        assert_ulps_apart(g, g32.astype(BF16), bf16_ulps)
    probs = flashnumba.attention_probs(q, k, v, lse, **opts)
    probs32 = flashnumba.attention_probs(*f32[:3], lse, **opts)
    assert probs.dtype == probs32.dtype == np.float32
    assert_ulps_apart(probs, probs32, f32_ulps)


# ------------------------------------------------------------------ validation


def test_bf16_mixed_with_other_dtypes_is_a_type_error():
    rng = np.random.default_rng(2)
    q, k, v = random_qkv(rng, 1, 5, 6, 1, 8, BF16)
    with pytest.raises(TypeError, match=r"k has dtype float32 but q has dtype bfloat16; they must match"):
        flashnumba.flash_attn_forward(q, k.astype(np.float32), v)
    out, lse = flashnumba.flash_attn_forward(q, k, v)
    with pytest.raises(TypeError, match=r"dout has dtype float16 but q has dtype bfloat16"):
        flashnumba.flash_attn_backward(np.ones(q.shape, np.float16), q, k, v, out, lse)
    with pytest.raises(TypeError, match=r"q has dtype uint16; supported dtypes are float32, float16, bfloat16"):
        flashnumba.flash_attn_forward(q.view(np.uint16), k.view(np.uint16), v.view(np.uint16))
    with pytest.raises(TypeError, match=r"lse must be float32"):
        flashnumba.flash_attn_backward(q, q, k, v, out, lse.astype(BF16))


def test_torch_bf16_tensors_in_and_out():
    torch = pytest.importorskip("torch")
    if flashnumba.SIMULATOR or not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    rng = np.random.default_rng(3)
    q, k, v = random_qkv(rng, 1, 17, 21, 2, 40, BF16)
    tq, tk, tv = (to_type(x, "torch") for x in (q, k, v))
    out, lse = flashnumba.flash_attn_forward(tq, tk, tv, causal=True)
    assert out.dtype == torch.bfloat16 and out.is_cuda and lse.dtype == torch.float32
    np.testing.assert_array_equal(to_numpy(out).view(np.uint16),
                                  flashnumba.flash_attn_forward(q, k, v, causal=True)[0].view(np.uint16))
    tq.requires_grad_(True)  # the kernels only read: a tensor that requires grad is used as it is
    flashnumba.flash_attn_forward(tq, tk, tv)
    with pytest.raises(ValueError, match=r"same side"):
        flashnumba.flash_attn_forward(tq, k, v)
    with pytest.raises(TypeError, match=r"k has dtype float16 but q has dtype bfloat16"):
        flashnumba.flash_attn_forward(tq, tk.half(), tv)


def test_bf16_device_arrays_other_than_torch_are_refused():
    """A bfloat16 array that is neither NumPy nor torch (here a Numba device array) cannot be given to the kernels
    as bits without guessing: it is refused, not computed on as numbers."""
    q = np.zeros((1, 4, 1, 8), BF16)
    try:
        dq = cuda.to_device(q)
    except Exception as err:  # noqa: BLE001
        pytest.skip(f"Numba cannot hold a bfloat16 device array here: {err}")
    with pytest.raises(TypeError, match="bfloat16 is taken as a NumPy ml_dtypes.bfloat16 array or a torch"):
        flashnumba.flash_attn_forward(dq, dq, dq)
