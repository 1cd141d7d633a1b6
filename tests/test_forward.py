"""Forward kernels against the float64 NumPy reference (flashnumba.forward, flashnumba.api)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import assume, given, strategies as st

import flashnumba
from flashnumba import reference, tiling
from flashnumba._backend import cuda
from flashnumba.kernels.common import GROUP_BLOCKS, make_launch_order

from conftest import (
    seqlens,
    HEAD_DIMS,
    WORK_BUDGET,
    array_types,
    check_forward,
    random_qkv,
    shard,
    to_type,
)

# Block configurations the property tests draw from: (kernel, block_m, block_n, num_threads).
# Small ones keep the simulator fast; B_r != B_c on purpose; the defaults (None) are always included.
BLOCKS = [
    ("v1", 16, 16, None),
    ("v1", 8, 32, None),
    ("v1", None, None, None),
    ("v2", 16, 16, 32),
    ("v2", 8, 16, 64),
    ("v2", 32, 8, 64),
    ("v2", None, None, None),
    ("v3", 16, 16, 32),
    ("v3", 16, 24, 64),
    ("v3", None, None, None),
]


def _padded_work(batch, nheads, seqlen_q, seqlen_k, head_dim, kernel, block_m, block_n, num_threads):
    """The simulated work of one example: the tiles the call will run (the planner's, the simulator's own default
    where none are drawn), padding included."""
    (bm, bn, _), _ = tiling.resolve(kernel, head_dim, flashnumba.planner.current_device(), block_m, block_n,
                                    num_threads, simulated=flashnumba.SIMULATOR)
    pq = -(-seqlen_q // bm) * bm
    pk = -(-seqlen_k // bn) * bn
    return batch * nheads * pq * pk * max(head_dim, 8)


def _fits(kernel, head_dim, block_m, block_n, num_threads):
    """Whether a drawn block configuration is valid for head_dim (invalid ones are tested in test_validation)."""
    try:
        tiling.resolve(kernel, head_dim, flashnumba.planner.current_device(), block_m, block_n, num_threads)
    except ValueError:
        return False
    return True


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
def test_forward_matches_reference(batch, nheads, seqlen_q, seqlen_k, head_dim, causal, blocks, scale, dtype,
                                   array_type, seed):
    kernel, block_m, block_n, num_threads = blocks
    assume(_fits(kernel, head_dim, block_m, block_n, num_threads))
    assume(_padded_work(batch, nheads, seqlen_q, seqlen_k, head_dim, kernel, block_m, block_n, num_threads)
           <= WORK_BUDGET)
    rng = np.random.default_rng(seed)
    q, k, v = random_qkv(rng, batch, seqlen_q, seqlen_k, nheads, head_dim, dtype)
    out, lse = flashnumba.flash_attn_forward(
        *(to_type(x, array_type) for x in (q, k, v)),
        softmax_scale=scale, causal=causal, kernel=kernel,
        block_m=block_m, block_n=block_n, num_threads=num_threads,
    )
    assert type(out) is type(to_type(q, array_type))
    check_forward(out, lse, q, k, v, softmax_scale=scale, causal=causal)


@pytest.mark.parametrize("kernel", ["v1", "v2", "v3"])
@given(seqlen=st.integers(2, 40), head_dim=st.sampled_from([8, 40, 59]), seed=st.integers(0, 2**32 - 1))
def test_permuting_keys_and_values_jointly_leaves_output_unchanged(kernel, seqlen, head_dim, seed):
    rng = np.random.default_rng(seed)
    q, k, v = random_qkv(rng, 1, 9, seqlen, 2, head_dim)
    perm = rng.permutation(seqlen)
    kw = dict(kernel=kernel, block_m=16, block_n=16, num_threads=None if kernel == "v1" else 32)
    out1, lse1 = flashnumba.flash_attn_forward(q, k, v, **kw)
    out2, lse2 = flashnumba.flash_attn_forward(q, k[:, perm], v[:, perm], **kw)
    # the same sums in another order: equal up to float32 rounding
    np.testing.assert_allclose(out1, out2, rtol=1e-5, atol=2e-6)
    np.testing.assert_allclose(lse1, lse2, rtol=1e-6, atol=2e-6)


@pytest.mark.parametrize("kernel", ["v1", "v2", "v3"])
@given(seqlen_k=st.integers(1, 50), causal=st.booleans(), seed=st.integers(0, 2**32 - 1))
def test_output_lies_within_the_range_of_v(kernel, seqlen_k, causal, seed):
    rng = np.random.default_rng(seed)
    q, k, v = random_qkv(rng, 1, 13, seqlen_k, 1, 24, scale=3.0)
    out, lse = flashnumba.flash_attn_forward(q, k, v, causal=causal, kernel=kernel, block_m=16, block_n=8,
                                             num_threads=None if kernel == "v1" else 32)
    sees = reference.causal_mask(13, seqlen_k) if causal else np.ones((13, seqlen_k), bool)
    for i in range(13):
        if not sees[i].any():
            continue
        vis = v[0, sees[i], 0, :]  # the values row i averages
        eps = 1e-5 * np.abs(vis).max()
        assert (out[0, i, 0] >= vis.min(axis=0) - eps).all() and (out[0, i, 0] <= vis.max(axis=0) + eps).all()


# ------------------------------------------------------------------ fixed regression examples

KERNEL_ARGS = [
    dict(kernel="v1", block_m=16, block_n=16),
    dict(kernel="v2", block_m=16, block_n=16, num_threads=32),
    dict(kernel="v3", block_m=16, block_n=16, num_threads=32),
]


@pytest.mark.parametrize("kw", KERNEL_ARGS)
def test_fully_masked_rows_give_zero_output_and_minus_inf_lse(kw):
    # causal with seqlen_q > seqlen_k: the first seqlen_q - seqlen_k rows see no key
    rng = np.random.default_rng(1)
    q, k, v = random_qkv(rng, 1, 20, 7, 2, 16)
    out, lse = flashnumba.flash_attn_forward(q, k, v, causal=True, **kw)
    assert (out[:, :13] == 0).all()
    assert np.isneginf(lse[:, :, :13]).all()
    check_forward(out, lse, q, k, v, causal=True)


@pytest.mark.parametrize("kw", KERNEL_ARGS)
def test_empty_keys_give_zero_output(kw):
    rng = np.random.default_rng(2)
    q, k, v = random_qkv(rng, 1, 5, 0, 1, 8)
    out, lse = flashnumba.flash_attn_forward(q, k, v, **kw)
    assert (out == 0).all() and np.isneginf(lse).all()


@pytest.mark.parametrize("kw", KERNEL_ARGS)
@pytest.mark.parametrize("causal", [False, True])
def test_large_logits(kw, causal):
    rng = np.random.default_rng(3)
    q, k, v = random_qkv(rng, 1, 33, 41, 2, 40, scale=10.0)  # scores ~ 100 * N(0, 1)
    out, lse = flashnumba.flash_attn_forward(q, k, v, causal=causal, **kw)
    check_forward(out, lse, q, k, v, causal=causal)


@pytest.mark.parametrize("kw", KERNEL_ARGS)
def test_seqlen_one(kw):
    rng = np.random.default_rng(4)
    q, k, v = random_qkv(rng, 2, 1, 1, 3, 59)
    out, lse = flashnumba.flash_attn_forward(q, k, v, causal=True, **kw)
    np.testing.assert_allclose(out, v, rtol=0, atol=0)  # one key: softmax is exactly 1
    check_forward(out, lse, q, k, v, causal=True)


@pytest.mark.parametrize("kernel", ["v1", "v2", "v3"])
def test_blocks_larger_than_the_sequence(kernel):
    rng = np.random.default_rng(5)
    q, k, v = random_qkv(rng, 1, 3, 5, 1, 16)
    out, lse = flashnumba.flash_attn_forward(q, k, v, kernel=kernel, block_m=32, block_n=64,
                                             num_threads=None if kernel == "v1" else 64)
    check_forward(out, lse, q, k, v)


def test_the_gpus_default_tiles():
    """The tiles the default plan gives on a GPU (the simulator's own default is one warp on 16 x 16 tiles):
    query and key tiles each part full, causal, GQA."""
    rng = np.random.default_rng(8)
    q, k, v = random_qkv(rng, 1, 150, 90, 2, 40)
    k, v = k[:, :, :1].copy(), v[:, :, :1].copy()
    (launch,) = flashnumba.plan(q, k, v, causal=True, device="sm_90").launches
    t = launch.tiles
    assert (launch.name, t.block_m, t.block_n, t.num_threads) == ("forward v3", 128, 64, 128)
    out, lse = flashnumba.flash_attn_forward(q, k, v, causal=True, block_m=t.block_m, block_n=t.block_n,
                                             num_threads=t.num_threads)
    check_forward(out, lse, q, k, v, causal=True)


@pytest.mark.parametrize("seqlen,d", [(0, 8), (5, 8)])
def test_zero_batch_or_seqlen_returns_empty(seqlen, d):
    q = np.zeros((2, seqlen, 3, d), np.float32)
    kv = np.zeros((2, 4, 3, d), np.float32)
    out, lse = flashnumba.flash_attn_forward(q, kv, kv)
    assert out.shape == q.shape and lse.shape == (2, 3, seqlen)
    q0 = np.zeros((0, 5, 3, d), np.float32)
    out, lse = flashnumba.flash_attn_forward(q0, kv[:0], kv[:0])
    assert out.shape == (0, 5, 3, d) and lse.shape == (0, 3, 5)


@pytest.mark.parametrize("kw", KERNEL_ARGS)
def test_strided_inputs_are_used_in_place(kw):
    rng = np.random.default_rng(6)
    qkv = rng.standard_normal((2, 19, 3, 2, 24)).astype(np.float32)  # packed (batch, seq, 3, heads, d)
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    assert not q.flags.c_contiguous
    out, lse = flashnumba.flash_attn_forward(q, k, v, causal=True, **kw)
    check_forward(out, lse, q, k, v, causal=True)


@pytest.mark.parametrize("kw", KERNEL_ARGS)
def test_inputs_are_not_modified(kw):
    rng = np.random.default_rng(7)
    q, k, v = random_qkv(rng, 1, 18, 21, 2, 16)
    copies = [x.copy() for x in (q, k, v)]
    flashnumba.flash_attn_forward(q, k, v, causal=True, **kw)
    for x, c in zip((q, k, v), copies):
        np.testing.assert_array_equal(x, c)


@pytest.mark.parametrize("kw", KERNEL_ARGS)
def test_nan_in_one_query_row_stays_in_that_row(kw):
    rng = np.random.default_rng(8)
    q, k, v = random_qkv(rng, 2, 20, 20, 2, 16)
    q[1, 7, 0, 3] = np.nan
    with flashnumba.config.temporarily("poison_outputs", False):  # a NaN must come from the input, not poisoning
        out, lse = flashnumba.flash_attn_forward(q, k, v, **kw)
    assert np.isnan(out[1, 7, 0]).all() and np.isnan(lse[1, 0, 7])
    bad = np.zeros(out.shape, bool)
    bad[1, 7, 0] = True
    assert not np.isnan(out[~bad]).any()
    lse_bad = np.zeros(lse.shape, bool)
    lse_bad[1, 0, 7] = True
    assert not np.isnan(lse[~lse_bad]).any()


# ---------------------------------------------------------------------------------------------------------------
# The order in which the blocks take their tiles (common.make_launch_order)
# ---------------------------------------------------------------------------------------------------------------

def _make_launch_order_kernel(from_end, grouped):
    order = make_launch_order(from_end, grouped)

    @cuda.jit
    def kernel(out):  # out[at] = (tile, bh) of the block at place ``at`` of the launch order
        tile, bh = order()
        at = cuda.blockIdx.y * cuda.gridDim.x + cuda.blockIdx.x
        out[at, 0] = tile
        out[at, 1] = bh

    return kernel


LAUNCH_ORDER_KERNELS = {(e, g): _make_launch_order_kernel(e, g) for e in (True, False) for g in (True, False)}


@pytest.mark.parametrize("nt, nbh", [(3, 200), (300, 2), (32, 9), (1, 5)])
@pytest.mark.parametrize("from_end", [True, False])
@pytest.mark.parametrize("grouped", [True, False])
def test_launch_order_takes_every_tile_once_longest_first_in_each_group(nt, nbh, from_end, grouped):
    """Every (tile, bh) of the grid exactly once. Grouped (uneven work: causal, a block mask): the heads in groups
    of ceil(GROUP_BLOCKS / nt), and within a group the tiles longest first (query tiles from the end, key tiles
    from the start), each for all of the group's heads in turn, so that under a causal mask the long blocks start
    before the short ones; else one head after another."""
    out = cuda.to_device(np.full((nt * nbh, 2), -1, np.int64))
    LAUNCH_ORDER_KERNELS[from_end, grouped][(nt, nbh), 1](out)
    got = out.copy_to_host()
    assert sorted(map(tuple, got)) == [(t, bh) for t in range(nt) for bh in range(nbh)]
    g = -(-GROUP_BLOCKS // nt) if grouped else 1
    expected = []
    for first in range(0, nbh, g):
        for x in range(nt):
            expected += [(nt - 1 - x if from_end else x, bh) for bh in range(first, min(first + g, nbh))]
    np.testing.assert_array_equal(got, expected)
