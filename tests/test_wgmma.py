"""The Hopper kernels (kernel="wgmma", :mod:`flashnumba.kernels.wgmma_forward` and
:mod:`flashnumba.kernels.wgmma_backward`) against the float64 reference.

In the simulator: one and two warpgroups, causal and not, every option, varlen, bfloat16 (each wgmma there is 128
Python threads meeting at a barrier: tiny shapes), and the sm_90a compile without a GPU (registers, no spills, no
serialised wgmma). On an H200: awkward and long shapes at the default tiles, and a Hypothesis property over shapes,
head dims, dtypes and options; tolerances as in conftest.check_forward and conftest.check_backward.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import assume, given, strategies as st

import flashnumba
from conftest import (FULL_COMPILE, GPU_SHAPES, UNREAD, check_backward, check_forward, check_machine_code,
                      compile_offline, random_qkv, shard, to_numpy)
from flashnumba import reference, tiling
from flashnumba._backend import cuda


def on_hopper():
    return not flashnumba.SIMULATOR and tuple(cuda.get_current_device().compute_capability) == (9, 0)


gpu_only = pytest.mark.skipif(flashnumba.SIMULATOR, reason="GPU sizes: minutes per case in the simulator")


@pytest.fixture(autouse=True)
def _hopper_or_simulator():
    if not flashnumba.SIMULATOR and not on_hopper():
        pytest.skip("kernel 'wgmma' runs on compute capability 9.0 (sm_90a) only")


def wgmma(q, k, v, warpgroups=1, block_n=64, producer=0, **kw):
    return flashnumba.flash_attn_forward(q, k, v, kernel="wgmma", block_m=64 * warpgroups, block_n=block_n,
                                         num_threads=128 * warpgroups + 32 * producer, **kw)


@pytest.mark.parametrize("causal", [False, True])
def test_one_warpgroup_matches_reference(causal):
    """Two query tiles (the second partial), keys over two tiles (the second partial): the pipeline, the masks."""
    rng = np.random.default_rng(1)
    q, k, v = random_qkv(rng, 1, 70, 90, 1, 64, np.float16)
    out, lse = wgmma(q, k, v, causal=causal)
    check_forward(out, lse, q, k, v, causal=causal)


def test_key_tiles_through_all_three_buffers():
    """Five key tiles of 64: the copies of tile j + 1 issued in the loop, every buffer used twice over."""
    rng = np.random.default_rng(2)
    q, k, v = random_qkv(rng, 1, 40, 300, 1, 64, np.float16)
    out, lse = wgmma(q, k, v)
    check_forward(out, lse, q, k, v)


@pytest.mark.parametrize("warpgroups, producer, causal", [(1, 1, False), (2, 4, True), (3, 4, True)])
def test_producer_warp_and_ping_pong(warpgroups, producer, causal):
    """Warp specialisation: the producer's copies (one warp, or four) through the three buffers on mbarriers (five
    key tiles, each buffer filled twice after its release), and with two or three warpgroups their turns on the
    named barriers, round the ring (a producer of one warp with two warpgroups: test_two_warpgroups_every_option);
    the wgmma stand-in fails where a buffer is overwritten before the products reading it retired. Three
    warpgroups: two query tiles of 192 rows, the second's third warpgroup past the sequence's end."""
    rng = np.random.default_rng(6 + warpgroups + producer)
    q, k, v = random_qkv(rng, 1, {1: 40, 2: 100, 3: 250}[warpgroups], 300, 1, 64, np.float16)
    out, lse = wgmma(q, k, v, warpgroups=warpgroups, producer=producer, causal=causal)
    check_forward(out, lse, q, k, v, causal=causal)


@pytest.mark.parametrize("warpgroups, producer", [(2, 0), (2, 1), (3, 4)])
def test_two_warpgroups_every_option(warpgroups, producer):
    """Two warpgroups (or three, with the producer warpgroup and tensor maps) sharing each K_j, V_j tile, GQA, a
    two-sided window, softcap, ALiBi and dropout at once."""
    rng = np.random.default_rng(5)
    nheads, nheads_k, sq, sk = 2, 1, 20 if warpgroups == 2 else 150, 70
    q, k, v = random_qkv(rng, 1, sq, sk, nheads, 64, np.float16)
    k, v = k[:, :, :nheads_k].copy(), v[:, :, :nheads_k].copy()
    opts = dict(window_size=(30, 9), softcap=2.5, alibi_slopes=np.array([0.3, 0.7], np.float32), dropout_p=0.3,
                dropout_seed=9, dropout_offset=4)
    ref = {n: x for n, x in opts.items() if not n.startswith("dropout")}
    ref["dropout_z"] = reference.dropout_z(9, 4, 1, nheads, sq, sk, 0.3)
    out, lse = wgmma(q, k, v, warpgroups=warpgroups, producer=producer, **opts)
    check_forward(out, lse, q, k, v, **ref)


@pytest.mark.parametrize("case", ["causal rows without keys", "gqa and options"])
def test_persistent_blocks_carry_the_pipeline_across_work_items(monkeypatch, case):
    """config.hopper_persistent, with two blocks (planner.persistent_blocks): each takes every other pair of query
    tiles (a head's tiles P and nq - 1 - P), its pipeline carried on across them (the stages' buffers and phases,
    Q_i's q_free): three causal query tiles (a pair and a tile alone a head), the first of which sees no key (items
    without a tile among the others), and GQA with softcap and ALiBi (three key tiles an item: the stages come round
    within and across items)."""
    monkeypatch.setattr(flashnumba.planner, "persistent_blocks", lambda limits: 2)
    monkeypatch.setattr(flashnumba.config, "hopper_persistent", True)
    rng = np.random.default_rng(40)
    if case == "causal rows without keys":  # (3 query tiles of 128 x 2 batch entries; rows 0 .. 199 see no key)
        q, k, v = random_qkv(rng, 2, 300, 100, 1, 64, np.float16)
        opts = dict(causal=True)
    else:  # (2 query tiles x 4 heads, 2 of K and V)
        q, k, v = random_qkv(rng, 1, 150, 300, 4, 64, np.float16)
        k, v = k[:, :, :2].copy(), v[:, :, :2].copy()
        opts = dict(softcap=2.5, alibi_slopes=np.array([0.3, 0.7, 0.1, 0.5], np.float32))
    launch = flashnumba.plan(q, k, v, kernel="wgmma", **opts).launches[0]
    assert launch.grid == (2,) and "persistent blocks" in launch.reason, launch
    out, lse = flashnumba.flash_attn_forward(q, k, v, kernel="wgmma", **opts)
    check_forward(out, lse, q, k, v, **opts)
    if case == "causal rows without keys":
        assert not to_numpy(out)[:, :200].any() and np.isneginf(to_numpy(lse)[:, :, :200]).all()


@pytest.mark.parametrize("case", ["causal", "gqa and options", "one tile"])
def test_overlap_gives_the_same_bits(monkeypatch, case):
    """config.hopper_overlap (each tile's softmax ended at the top of the next iteration) computes what the default
    does, bit for bit: causal rows over three key tiles (the stages come round; rows without keys), GQA with softcap,
    ALiBi and a window over two, and a single key tile (the last P V straight after the first softmax)."""
    rng = np.random.default_rng(41)
    if case == "causal":
        q, k, v = random_qkv(rng, 1, 200, 300, 1, 64, np.float16)
        opts = dict(causal=True)
    elif case == "gqa and options":
        q, k, v = random_qkv(rng, 1, 130, 200, 4, 32, np.float16)
        k, v = k[:, :, :2].copy(), v[:, :, :2].copy()
        opts = dict(softcap=2.5, alibi_slopes=np.array([0.3, 0.7, 0.1, 0.5], np.float32), window_size=(90, 20))
    else:
        q, k, v = random_qkv(rng, 2, 70, 100, 1, 64, np.float16)
        opts = {}
    out, lse = flashnumba.flash_attn_forward(q, k, v, kernel="wgmma", **opts)
    monkeypatch.setattr(flashnumba.config, "hopper_overlap", True)
    out_o, lse_o = flashnumba.flash_attn_forward(q, k, v, kernel="wgmma", **opts)
    check_forward(out_o, lse_o, q, k, v, **opts)
    assert_same_bits(out_o, lse_o, out, lse)


def test_persistent_blocks_where_the_plan_takes_them(monkeypatch):
    """config.hopper_persistent reaches the forwards that copy with tensor maps, grid (min(pairs of query tiles, SMs),)
    (132 on sm_90), but for ALiBi at head_dim 128 with 128 keys a tile (wgmma_forward.takes_persistent: its
    persistent kernel spills there)."""
    monkeypatch.setattr(flashnumba.config, "hopper_persistent", True)
    slopes = np.ones(8, np.float32)
    for D, n, opts, grid in ((64, 4096, dict(causal=True), (132,)), (128, 300, {}, (32,)),  # (16 heads, 2 pairs)
                             (96, 4096, dict(causal=True, alibi_slopes=slopes), (132,)),
                             (128, 4096, dict(causal=True, alibi_slopes=slopes), (32, 16))):
        q = np.zeros((2, n, 8, D), np.float16)
        launch = flashnumba.plan(q, q, q, kernel="wgmma", device="sm_90", **opts).launches[0]
        assert launch.grid == grid and ("persistent blocks" in launch.reason) == (len(grid) == 1), (D, opts, launch)
    # nor for three warpgroups (block_m 192), whose persistent kernel spills
    q = np.zeros((2, 4096, 8, 64), np.float16)
    launch = flashnumba.plan(q, q, q, kernel="wgmma", device="sm_90", block_m=192, num_threads=512).launches[0]
    assert launch.grid == (22, 16) and "persistent" not in launch.reason, launch


def test_varlen_bfloat16_and_scale():
    """Packed sequences (one empty), bfloat16, a negative scale (no exponent folding), head_dim 96."""
    bf16 = pytest.importorskip("ml_dtypes").bfloat16
    rng = np.random.default_rng(3)
    lens_q, lens_k = [5, 0, 70], [9, 3, 66]
    cu_q, cu_k = (np.concatenate([[0], np.cumsum(n)]).astype(np.int32) for n in (lens_q, lens_k))
    q = rng.standard_normal((cu_q[-1], 1, 96)).astype(bf16)
    k, v = (rng.standard_normal((cu_k[-1], 1, 96)).astype(bf16) for _ in range(2))
    out, lse = flashnumba.flash_attn_varlen_forward(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=True,
                                                    softmax_scale=-0.2, kernel="wgmma", block_m=64, block_n=64)
    for b in range(3):
        rq, rk = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        if rq.stop > rq.start:
            check_forward(out[None, rq], lse[None, :, rq], q[None, rq], k[None, rk], v[None, rk], causal=True,
                          softmax_scale=-0.2)


def test_head_dim_32():
    """Head_dim 32, forward and backward at the default tiles: rows of one 64-byte swizzled box copied with tensor
    maps by the producer warpgroup, causal; and packed sequences (one empty), where eight warps copy per thread in
    load_core's general form (its constant steps would cover 64 rows a pass, more than a tile of 32)."""
    rng = np.random.default_rng(32)
    q, k, v = random_qkv(rng, 1, 70, 150, 1, 32, np.float16)
    out, lse = flashnumba.flash_attn_forward(q, k, v, causal=True, kernel="wgmma")
    check_forward(out, lse, q, k, v, causal=True)
    dout = rng.standard_normal(out.shape).astype(q.dtype)
    grads = flashnumba.flash_attn_backward(dout, q, k, v, out, lse, causal=True, kernel="wgmma")[:3]
    check_backward(grads, dout, q, k, v, out, lse, causal=True)
    lens_q, lens_k = [5, 0, 70], [9, 3, 66]
    cu_q, cu_k = (np.concatenate([[0], np.cumsum(n)]).astype(np.int32) for n in (lens_q, lens_k))
    q = rng.standard_normal((cu_q[-1], 1, 32)).astype(np.float16)
    k, v = (rng.standard_normal((cu_k[-1], 1, 32)).astype(np.float16) for _ in range(2))
    args = (cu_q, cu_k, max(lens_q), max(lens_k))
    out, lse = flashnumba.flash_attn_varlen_forward(q, k, v, *args, causal=True, kernel="wgmma")
    dout = rng.standard_normal(out.shape).astype(q.dtype)
    dq, dk, dv = flashnumba.flash_attn_varlen_backward(dout, q, k, v, out, lse, *args, causal=True, kernel="wgmma")[:3]
    for b in range(3):
        rq, rk = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        if rq.stop > rq.start:
            one = (q[None, rq], k[None, rk], v[None, rk])
            check_forward(out[None, rq], lse[None, :, rq], *one, causal=True)
            check_backward((dq[None, rq], dk[None, rk], dv[None, rk]), dout[None, rq], *one, out[None, rq],
                           lse[None, :, rq], causal=True)


def test_head_dims_padded_to_a_multiple_of_32():
    """Head dims the Hopper kernels are not built for (multiples of 8, not of 32) run at the next multiple of 32:
    q, k, v (dout, out) copied with zero columns appended, the outputs cropped. Zero columns add nothing to q.k and
    give zero output and gradient columns, so the result is that of the head dim itself (the scale too: 1 /
    sqrt(40), not 1 / sqrt(64)). Head_dim 40 with GQA, causal, forward and backward; 72 in packed sequences
    (one empty), bfloat16; the callers' arrays untouched."""
    rng = np.random.default_rng(40)
    q, k, v = random_qkv(rng, 1, 70, 90, 2, 40, np.float16)
    k, v = k[:, :, :1].copy(), v[:, :, :1].copy()
    before = [x.copy() for x in (q, k, v)]
    p = flashnumba.plan(q, k, v, causal=True, kernel="wgmma")
    assert p.head_dim == 40 and "head_dim 40 run as 64" in p.launches[0].reason
    out, lse = flashnumba.flash_attn_forward(q, k, v, causal=True, kernel="wgmma")
    assert out.shape == q.shape and out.flags["C_CONTIGUOUS"]
    check_forward(out, lse, q, k, v, causal=True)
    dout = rng.standard_normal(out.shape).astype(q.dtype)
    grads = flashnumba.flash_attn_backward(dout, q, k, v, out, lse, causal=True, kernel="wgmma")[:3]
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]
    check_backward(grads, dout, q, k, v, out, lse, causal=True)
    assert all((x == y).all() for x, y in zip((q, k, v), before))
    bf16 = pytest.importorskip("ml_dtypes").bfloat16
    lens_q, lens_k = [5, 0, 40], [9, 3, 36]
    cu_q, cu_k = (np.concatenate([[0], np.cumsum(n)]).astype(np.int32) for n in (lens_q, lens_k))
    q = rng.standard_normal((cu_q[-1], 1, 72)).astype(bf16)
    k, v = (rng.standard_normal((cu_k[-1], 1, 72)).astype(bf16) for _ in range(2))
    args = (cu_q, cu_k, max(lens_q), max(lens_k))
    out, lse = flashnumba.flash_attn_varlen_forward(q, k, v, *args, kernel="wgmma")
    dout = rng.standard_normal(out.shape).astype(q.dtype)
    dq, dk, dv = flashnumba.flash_attn_varlen_backward(dout, q, k, v, out, lse, *args, kernel="wgmma")[:3]
    for b in range(3):
        rq, rk = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        if rq.stop > rq.start:
            one = (q[None, rq], k[None, rk], v[None, rk])
            check_forward(out[None, rq], lse[None, :, rq], *one)
            check_backward((dq[None, rq], dk[None, rk], dv[None, rk]), dout[None, rq], *one, out[None, rq],
                           lse[None, :, rq])


def test_head_dims_above_128(monkeypatch):
    """Above head_dim 128 at the default tiles, forward and backward. Head_dim 160: the forward's rows five 64-byte
    swizzled boxes copied with tensor maps, B_c 64; the dK/dV kernel's two warpgroups on 64 keys each hold half of
    dK_j's and dV_j's head dims (80: not whole boxes, so copied per thread) and exchange partial S^T, dP^T, and with
    config.hopper_exchange off each computes them whole. Head_dim 256, causal with a window: the forward's B_c 48,
    the dK/dV kernel's halves two boxes each (tensor maps). The forward of packed sequences at head_dim 224
    (per-thread copies of seven 4-block groups a row, load_core's general form)."""
    rng = np.random.default_rng(256)
    for D, sq, sk, opts, dkdv_tma in ((160, 30, 70, dict(causal=True), False),
                                      (256, 50, 60, dict(causal=True, window_size=(40, 0)), True)):
        q, k, v = random_qkv(rng, 1, sq, sk, 1, D, np.float16)
        plan = flashnumba.plan(q, k, v, kernel="wgmma", device="sm_90", **opts)
        assert "tensor maps" in plan.launches[0].reason and plan.launches[0].tiles.block_n == (48 if D == 256 else 64)
        out, lse = flashnumba.flash_attn_forward(q, k, v, kernel="wgmma", **opts)
        check_forward(out, lse, q, k, v, **opts)
        dout = rng.standard_normal(out.shape).astype(q.dtype)
        plan = flashnumba.plan_backward(dout, q, k, v, out, lse, kernel="wgmma", device="sm_90", **opts)
        dkdv = plan.launches[2]
        assert (dkdv.tiles.block_n, dkdv.factory_args[3]) == (64, 2), dkdv  # (two warpgroups on 64 keys)
        assert ("tensor maps" in dkdv.reason) == dkdv_tma, dkdv
        assert dkdv.factory_args[-2] is True and "exchange the partial sums" in dkdv.reason, dkdv  # (then stages)
        grads = flashnumba.flash_attn_backward(dout, q, k, v, out, lse, kernel="wgmma", **opts)[:3]
        check_backward(grads, dout, q, k, v, out, lse, **opts)
        if D == 160:  # (the form without the exchange)
            with monkeypatch.context() as m:
                m.setattr(flashnumba.config, "hopper_exchange", False)
                plan = flashnumba.plan_backward(dout, q, k, v, out, lse, kernel="wgmma", device="sm_90", **opts)
                assert plan.launches[2].factory_args[-2] is False and "exchange" not in plan.launches[2].reason
                grads = flashnumba.flash_attn_backward(dout, q, k, v, out, lse, kernel="wgmma", **opts)[:3]
                check_backward(grads, dout, q, k, v, out, lse, **opts)
    lens_q, lens_k = [40, 0, 70], [9, 3, 75]
    cu_q, cu_k = (np.concatenate([[0], np.cumsum(n)]).astype(np.int32) for n in (lens_q, lens_k))
    q = rng.standard_normal((cu_q[-1], 1, 224)).astype(np.float16)
    k, v = (rng.standard_normal((cu_k[-1], 1, 224)).astype(np.float16) for _ in range(2))
    args = (cu_q, cu_k, max(lens_q), max(lens_k))
    out, lse = flashnumba.flash_attn_varlen_forward(q, k, v, *args, kernel="wgmma")
    for b in range(3):
        rq, rk = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        if rq.stop > rq.start:
            check_forward(out[None, rq], lse[None, :, rq], q[None, rq], k[None, rk], v[None, rk])


def test_key_tiles_of_48():
    """block_n=48 at head_dim 256 (three stages of 48 keys beside Q_i: 208 KB): S's wgmma m64n48k16, P V in three
    k-steps, tiles of six 1024-byte swizzle atoms a box; copied with tensor maps (causal, more keys than queries,
    the last tile part full), and by the producer's threads for packed sequences (one empty)."""
    rng = np.random.default_rng(48)
    tiles = dict(block_m=128, block_n=48, num_threads=384)
    q, k, v = random_qkv(rng, 1, 50, 110, 1, 256, np.float16)
    assert "tensor maps" in flashnumba.plan(q, k, v, kernel="wgmma", device="sm_90", causal=True,
                                            **tiles).launches[0].reason
    out, lse = flashnumba.flash_attn_forward(q, k, v, kernel="wgmma", causal=True, **tiles)
    check_forward(out, lse, q, k, v, causal=True)
    lens_q, lens_k = [40, 0, 30], [9, 3, 100]
    cu_q, cu_k = (np.concatenate([[0], np.cumsum(n)]).astype(np.int32) for n in (lens_q, lens_k))
    q = rng.standard_normal((cu_q[-1], 1, 256)).astype(np.float16)
    k, v = (rng.standard_normal((cu_k[-1], 1, 256)).astype(np.float16) for _ in range(2))
    out, lse = flashnumba.flash_attn_varlen_forward(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=True,
                                                    kernel="wgmma", **tiles)
    for b in range(3):
        rq, rk = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        if rq.stop > rq.start:
            check_forward(out[None, rq], lse[None, :, rq], q[None, rq], k[None, rk], v[None, rk], causal=True)
    with pytest.raises(ValueError, match="32 rows a pass"):  # (every warp copying rows of 64 head dims)
        flashnumba.plan(*random_qkv(rng, 1, 8, 8, 1, 64, np.float16), kernel="wgmma", device="sm_90", block_m=128,
                        block_n=48, num_threads=256)


def test_what_it_does_not_take_is_refused():
    q, k, v = random_qkv(np.random.default_rng(0), 1, 8, 8, 1, 20, np.float16)
    with pytest.raises(ValueError, match="head_dim a multiple of 8 up to 256"):
        flashnumba.flash_attn_forward(q, k, v, kernel="wgmma")
    q, k, v = random_qkv(np.random.default_rng(0), 1, 8, 8, 1, 64, np.float16)
    with pytest.raises(ValueError, match="block_m 64, 128 or 192"):
        flashnumba.flash_attn_forward(q, k, v, kernel="wgmma", block_m=32)
    with pytest.raises(ValueError, match="three warpgroups .* with a producer warpgroup only"):
        flashnumba.flash_attn_forward(q, k, v, kernel="wgmma", block_m=192, num_threads=384)
    cu = np.array([0, 8], np.int32)
    with pytest.raises(ValueError, match="three warpgroups .* packed sequences"):
        flashnumba.flash_attn_varlen_forward(q[0], k[0], v[0], cu, cu, 8, 8, kernel="wgmma", block_m=192,
                                             num_threads=512)
    with pytest.raises(ValueError, match="three warpgroups .* up to head_dim 160"):
        flashnumba.plan(*(np.zeros((1, 8, 1, 192), np.float16),) * 3, kernel="wgmma", device="sm_90", block_m=192)
    with flashnumba.config.temporarily("hopper_tma", False), pytest.raises(ValueError, match="hopper_tma = False"):
        flashnumba.plan(q, k, v, kernel="wgmma", device="sm_90", block_m=192)
    with pytest.raises(ValueError, match="num_threads"):
        flashnumba.flash_attn_forward(q, k, v, kernel="wgmma", num_threads=128)
    with pytest.raises(ValueError, match="num_threads"):
        flashnumba.flash_attn_forward(q, k, v, kernel="wgmma", block_m=64, num_threads=288)
    with pytest.raises(ValueError, match="producer"):
        flashnumba.kernels.wgmma_forward.make_forward_wgmma(64, (False,) * 6, 64, 2, producer=2)
    with pytest.raises(TypeError, match="float16 or bfloat16"):
        flashnumba.flash_attn_forward(*(x.astype(np.float32) for x in (q, k, v)), kernel="wgmma")
    out, lse = flashnumba.flash_attn_forward(q, k, v)
    with pytest.raises(ValueError, match="block_m 64 or 128"):
        flashnumba.flash_attn_backward(q, q, k, v, out, lse, kernel="wgmma", block_m=32, block_n=64)
    with pytest.raises(ValueError, match="takes no num_threads"):
        flashnumba.flash_attn_backward(q, q, k, v, out, lse, kernel="wgmma", num_threads=256)
    q, k, v = random_qkv(np.random.default_rng(0), 1, 8, 8, 1, 20, np.float16)
    out, lse = flashnumba.flash_attn_forward(q, k, v)
    with pytest.raises(ValueError, match="wgmma backward supports head_dim"):
        flashnumba.flash_attn_backward(q, q, k, v, out, lse, kernel="wgmma")
    q, k, v = random_qkv(np.random.default_rng(0), 1, 8, 8, 1, 256, np.float16)
    out, lse = np.zeros_like(q), np.zeros((1, 1, 8), np.float32)  # (the plan refuses before reading them)
    with pytest.raises(ValueError, match="need 525312 bytes of shared memory in the Hopper"):
        flashnumba.flash_attn_backward(q, q, k, v, out, lse, kernel="wgmma", block_n=128)
    from flashnumba.kernels import wgmma_backward
    with pytest.raises(ValueError, match="above head_dim 128 the wgmma dK/dV kernel takes block_n 64"):
        wgmma_backward.check(256, 32, 128, "dkdv")
    with pytest.raises(ValueError, match="runs two warpgroups on 64 keys"):
        wgmma_backward.make_backward_dkdv_wgmma(256, (False,) * 6, 32, 1)


@pytest.mark.parametrize("D, opts, tiles, note", [
    (64, {}, (128, 128, 384), ""),
    (64, dict(causal=True), (128, 128, 384), ""),
    (64, dict(dropout_p=0.1), (128, 128, 384), ""),
    (64, dict(window_size=(8, 0)), (128, 128, 384), ""),
    (64, dict(softcap=5.0), (128, 128, 384), ""),
    (64, dict(causal=True, softcap=5.0, dropout_p=0.1), (128, 64, 256), "without the producer + B_c 64"),
    (128, dict(causal=True), (128, 128, 384), ""),
    (128, dict(softcap=5.0, alibi_slopes=np.ones(2, np.float32)), (128, 128, 384), ""),
    (128, dict(window_size=(8, 2), softcap=5.0), (128, 64, 256), "without the producer + B_c 64"),
    # tiles partly given: what the caller left to the table is fitted to the options, what it gave is kept
    (64, dict(softcap=5.0, block_m=128), (128, 128, 384), ""),
    (64, dict(softcap=5.0, block_m=64), (64, 64, 256), "B_c 64"),
    (64, dict(softcap=5.0, num_threads=256), (128, 64, 256), "B_c 64"),
    (64, dict(causal=True, softcap=5.0, alibi_slopes=np.ones(2, np.float32), num_threads=384), (128, 64, 384),
     "B_c 64"),
    (64, dict(softcap=5.0, block_n=128), (128, 128, 384), ""),
    (64, dict(causal=True, softcap=5.0, dropout_p=0.1, block_n=128), (128, 128, 256), "without the producer"),
    # three warpgroups (160 registers a thread): B_c 128 at d = 64 but for the per-score options; always the producer
    (64, dict(causal=True, window_size=(8, 0), block_m=192, num_threads=512), (192, 128, 512), ""),
    (64, dict(softcap=5.0, block_m=192, num_threads=512), (192, 64, 512), "B_c 64"),
    (64, dict(causal=True, softcap=5.0, dropout_p=0.1, alibi_slopes=np.ones(2, np.float32), block_m=192,
              num_threads=512), (192, 32, 512), "B_c 32"),
    (96, dict(causal=True, block_m=192, num_threads=512), (192, 64, 512), "B_c 64"),
    (128, dict(causal=True, block_m=192, block_n=64, num_threads=512), (192, 64, 512), ""),
    # the rows alone given: the key tile the table gives with 128 rows is over the shared memory with 192; the next
    # one down that fits
    (128, dict(causal=True, block_m=192), (192, 64, 512), "B_c 64"),
    (64, dict(dropout_p=0.1, block_m=192, num_threads=512, block_n=128), (192, 128, 512), ""),
])
def test_the_plan_fits_the_tiles_to_the_options(D, opts, tiles, note):
    """The planner's tiles for the Hopper forward (tiling.wgmma_for_variant): B_c 128 with the producer warpgroup
    (whose registers the warpgroups take) and at most two options; no producer and B_c 64 with more; without the
    producer warpgroup, B_c 64 where the options' per-score work needs the registers; the plan's reason says
    which. Tiles a caller gives are kept."""
    q = np.zeros((1, 70, 2, D), np.float16)
    p = flashnumba.plan(q, q, q, kernel="wgmma", device="sm_90", **opts)
    (launch,) = p.launches
    assert tuple(launch.tiles) == tiles
    changed = [n for n in ("without the producer:", "B_c 64:", "B_c 32:") if n in launch.reason]
    assert changed == [n + ":" for n in note.split(" + ") if n]


def test_tensor_maps_where_there_are_keys():
    """The default tiles copy with tensor maps (q, k, v; rows of 128 bytes, of 64 at head_dim 96); with no keys
    (a map's dims cannot be zero) the kernel copies per thread and gives out 0, lse -inf."""
    for D, span in ((64, 128), (96, 64), (128, 128)):
        q = np.zeros((1, 70, 2, D), np.float16)
        (launch,) = flashnumba.plan(q, q, q, kernel="wgmma", device="sm_90").launches
        assert launch.tensor_maps == (("q", 128, span), ("k", 128, span), ("v", 128, span))
    q, k = np.ones((1, 5, 2, 64), np.float16), np.ones((1, 0, 2, 64), np.float16)
    (launch,) = flashnumba.plan(q, k, k, kernel="wgmma", device="sm_90").launches
    assert launch.tensor_maps == ()
    for tiles in ({}, dict(block_m=192)):  # (three warpgroups too: their producer copies Q_i per thread)
        out, lse = flashnumba.flash_attn_forward(q, k, k, kernel="wgmma", **tiles)
        assert (np.asarray(out, np.float32) == 0).all() and np.isneginf(lse).all()


def test_packed_sequences_with_dropout_take_64_keys():
    """Varlen with dropout: the one variant of at most two options whose 128 keys' scores spill even with the
    producer's registers moved to the warpgroups (scripts/wgmma_spills.py); alone, each keeps B_c 128."""
    from flashnumba.kernels.common import Variant
    t = tiling.Tiles(128, 128, 384)
    both, reason = tiling.wgmma_for_variant(t, Variant(varlen=True, dropout=True))
    assert both == tiling.Tiles(128, 64, 384) and reason.startswith("B_c 64: packed sequences with dropout")
    for one in (Variant(varlen=True), Variant(dropout=True)):
        assert tiling.wgmma_for_variant(t, one) == (t, "")



def test_head_dim_256_takes_48_keys_where_they_fit():
    """At head_dim 256 the plan takes key tiles of 48 with the producer warpgroup (three stages beside Q_i fit;
    compiled for sm_90a, no spills with up to two options); 32 for packed sequences with dropout (48 keys' scores
    spill there), more than two options (no producer), and a caller's threads without the producer where the
    options work per score. A caller's block_n is kept."""
    from flashnumba.kernels.common import Variant
    q = np.zeros((1, 70, 2, 256), np.float16)
    (launch,) = flashnumba.plan(q, q, q, kernel="wgmma", device="sm_90", causal=True).launches
    assert tuple(launch.tiles) == (128, 48, 384) and "B_c" not in launch.reason
    t = tiling.Tiles(128, 48, 384)
    for variant in (Variant(), Variant(True, False, False, False, False, True), Variant(False, False, True, True),
                    Variant(varlen=True), Variant(dropout=True)):
        assert tiling.wgmma_for_variant(t, variant) == (t, "")
    new, why = tiling.wgmma_for_variant(t, Variant(varlen=True, dropout=True))
    assert new == tiling.Tiles(128, 32, 384) and why.startswith("B_c 32: packed sequences with dropout")
    new, why = tiling.wgmma_for_variant(t, Variant(True, True, True))
    assert new == tiling.Tiles(128, 32, 256) and "B_c 32: more than two options" in why
    new, why = tiling.wgmma_for_variant(t._replace(num_threads=256), Variant(softcap=True), given=("num_threads",))
    assert new == tiling.Tiles(128, 32, 256) and why.startswith("B_c 32: the options' per-score work")
    assert tiling.wgmma_for_variant(t, Variant(varlen=True, dropout=True), given=("block_n",)) == (t, "")


def test_backward_tiles_of_48_at_256_in_two_buffers(monkeypatch):
    """At head_dim 256 the dQ kernel's key tiles of 48 and the dK/dV kernel's query tiles of 48 fit the shared
    memory with two buffers in the pipeline (three would take 272 and 257 KB), which the producer's mbarriers make
    safe: the plan says so; gradients against the float64 reference (causal, tiles part-full). Without the
    tensor-map copies two buffers are refused."""
    from flashnumba.kernels import wgmma_backward
    monkeypatch.setattr(tiling, "wgmma_dq_for_variant",
                        lambda t, variant, given=(), D=None, tma=False, block_masked=False:
                        (t._replace(block_n=48), "forced"))
    monkeypatch.setattr(tiling, "wgmma_dkdv_for_variant",
                        lambda t, variant, D, given=(), tma=False: (t._replace(block_m=48), "forced"))
    rng = np.random.default_rng(48)
    q, k, v = random_qkv(rng, 1, 70, 110, 1, 256, np.float16)
    out, lse = flashnumba.flash_attn_forward(q, k, v, kernel="wgmma", causal=True)
    dout = rng.standard_normal(out.shape).astype(q.dtype)
    plan = flashnumba.plan_backward(dout, q, k, v, out, lse, kernel="wgmma", device="sm_90", causal=True)
    dq, dkdv = plan.launches[1], plan.launches[2]
    assert dq.tiles.block_n == 48 and dkdv.tiles.block_m == 48
    for launch in (dq, dkdv):
        assert launch.factory_args[-1] == 2 and "2 buffers in the pipeline" in launch.reason, launch
        assert "tensor maps" in launch.reason and launch.shared_bytes <= tiling.ARCHS["sm_90"].max_shared_per_block
    grads = flashnumba.flash_attn_backward(dout, q, k, v, out, lse, kernel="wgmma", causal=True)[:3]
    check_backward(grads, dout, q, k, v, out, lse, causal=True)
    with pytest.raises(ValueError, match="or 2 with the tensor-map copies"):
        wgmma_backward.make_backward_dq_wgmma(256, dq.factory_args[1], 48, 2, tma=False, stages=2)

COMPILE = r"""
import json
from flashnumba import _launch
from flashnumba.kernels import wgmma_forward
from flashnumba.kernels.common import Variant
# per push: the defaults at d = 128 and 64 (tiles copied with tensor maps, wgmma_forward.takes_tma) and the
# producer's per-thread copies
cases = [(128, 128, 2, "float16", Variant(), False, "tma"), (64, 128, 2, "bfloat16", Variant(), True, "tma"),
         (128, 64, 2, "float16", Variant(), False, 4),
         (64, 128, 2, "float16", Variant(False, True), False, "persistent"),
         (64, 128, 3, "float16", Variant(False, True), False, "tma"),  # (three warpgroups: 160 registers a thread)
         (64, 128, 2, "float16", Variant(False, True), False, "overlap")]  # (config.hopper_overlap)
if FULL:
    # config.hopper_overlap: S_ij held beside the packed P in flight (with tensor maps; "overlap4": the producer's
    # per-thread copies, which keep the softmax's end where it is)
    cases += [(128, 128, 2, "float16", Variant(), False, "overlap"),
              (128, 128, 2, "bfloat16", Variant(True, True, True, True, False, True), True, "overlap"),
              (64, 128, 2, "bfloat16", Variant(True, True, True, False, False, False), False, "overlap"),
              (96, 128, 2, "float16", Variant(False, True, False, True, False, False), False, "overlap"),
              (32, 128, 2, "float16", Variant(), True, "overlap"),
              (160, 64, 2, "float16", Variant(False, True), False, "overlap"),
              (128, 64, 2, "bfloat16", Variant(False, False, False, False, True, True), True, "overlap4"),
              (224, 64, 2, "float16", Variant(False, True, False, False, True, False), True, "overlap4")]
if FULL:
    # three warpgroups at the tiles the plan gives them (tiling._wgmma_three_for_variant)
    cases += [(64, 128, 3, "bfloat16", Variant(True, True), True, "tma"),
              (64, 32, 3, "float16", Variant(True, True, True, True, False, True), False, "tma"),
              (32, 128, 3, "float16", Variant(), False, "tma"),
              (96, 64, 3, "bfloat16", Variant(False, True), True, "tma"),
              (128, 64, 3, "float16", Variant(False, True), False, "tma")]
if FULL:
    # persistent blocks (tensor maps): the pipeline's counters and Q_i's mbarrier carried across work items
    cases += [(128, 128, 2, "float16", Variant(), False, "persistent"),
              (128, 128, 2, "bfloat16", Variant(False, True, True, False, False, False), True, "persistent"),
              (96, 128, 2, "float16", Variant(False, True, False, True, False, False), False, "persistent")]
if FULL:
    cases += [(128, 128, 2, "float16", Variant(), False, False), (64, 128, 2, "bfloat16", Variant(), False, False),
              (128, 128, 2, "float16", Variant(), False, 4),
              (128, 128, 2, "float16", Variant(False, True, False, False, False, True), True, "tma"),
              (64, 128, 2, "bfloat16", Variant(True, True, True, False, False, False), False, "tma"),
              (128, 128, 2, "float16", Variant(False, False, True, True, False, False), False, "tma"),
              (96, 128, 2, "bfloat16", Variant(False, True), True, "tma")]
if FULL:
    cases += [(128, 64, 2, "float16", Variant(True, True, True, True, True, True), True, False),
              (128, 64, 2, "float16", Variant(True, False, False, True, False, False), True, 4),
              (128, 64, 2, "bfloat16", Variant(False, True, False, False, False, True), True, 4),
              (128, 64, 2, "float16", Variant(False, False, False, False, True, False), False, False),
              (128, 64, 2, "float16", Variant(False, False, False, False, False, True), False, False),
              (128, 64, 2, "float16", Variant(True, True, True, True, False, False), False, False),
              (96, 64, 2, "bfloat16", Variant(False, True), False, False),
              (96, 64, 2, "bfloat16", Variant(False, True), False, 4),
              (128, 128, 2, "bfloat16", Variant(False, True), True, False),
              # the default at d = 64: B_c 128 with the producer where the per-score work leaves the registers
              (64, 128, 2, "float16", Variant(False, True, False, False, True, False), True, 4),
              (64, 128, 2, "bfloat16", Variant(False, False, False, False, False, True), False, 4),
              # packed sequences with dropout: B_c 64 with the producer's registers moved (tiling.wgmma_for_variant)
              (128, 64, 2, "bfloat16", Variant(False, False, False, False, True, True), True, 4),
              # head_dim 32: rows of one 64-byte swizzled box; eight warps copying per thread take load_core's
              # general form
              (32, 128, 2, "bfloat16", Variant(False, True), True, "tma"),
              (32, 64, 2, "float16", Variant(True, True, True, True, True, True), False, False),
              # above head_dim 128: O of up to 128 registers beside S of 64 keys (32 at d = 256); five 64-byte
              # boxes a row at 160; seven 4-block groups a row copied per thread at 224
              (160, 64, 2, "float16", Variant(False, True), False, "tma"),
              (224, 64, 2, "float16", Variant(False, True, False, False, True, False), True, 4),
              (256, 32, 2, "bfloat16", Variant(True, True, True, True, False, False), False, "tma"),
              (256, 32, 2, "float16", Variant(True, True, True, True, True, True), True, False)]
out = {}
for D, n, wg, dt, var, gqa, producer in cases:
    tma = producer in ("tma", "persistent", "overlap")
    persistent = producer == "persistent"
    overlap = producer in ("overlap", "overlap4")
    producer = 4 if tma or overlap else int(producer)
    fn = wgmma_forward.make_forward_wgmma(D, var, n, wg, dt, gqa, True, producer, tma, persistent=persistent,
                                          overlap=overlap)
    nt = wgmma_forward.threads(wg, producer)
    el = "uint16" if dt == "bfloat16" else "float16"
    a4 = f"{el}[:, :, :, ::1]"
    # (the layouts the planner gives: ALiBi's slopes broadcast over the batch, the dummies of absent arrays)
    sig = (f"void({a4}, {a4}, {a4}, {a4}, float32[:, :, ::1], float32, float32, int64, int64, float32[:, :], "
           f"int32[:], int32[:], float32, float32, uint64, uint64, uint64[:, ::1], float32[:], float32[:], "
           f"float32[:], float32[:], int32[:, :, :], int32[:, :, :, :], int8[:, :, :, :])")
    whole = wgmma_forward.rebalances(wg, producer)  # (as the planner compiles it: _launch.compile_kernel)
    cubin, log, ptx = _launch.build(fn.py_func, sig, (9, 0, "a"), _launch.bounds(nt, whole), whole)
    out[f"{dt} D={D} B_c={n} {var} gqa={gqa} producer={producer} tma={tma} persistent={persistent}"
        f"{' overlap' if overlap else ''}"] = dict(
        ptx=ptx, log=log, whole=whole, tma=tma, take=wgmma_forward.REGISTERS.get(wg, (0, 0))[1], unread=unread(cubin),
        **_launch.resources_from_log(log))
print(json.dumps(out))
"""


def test_wgmma_forward_compiles_for_sm90a():
    """Without a GPU: the kernels assemble for sm_90a with S and O in registers (no local memory, no spills) and
    the wgmma not serialised by the assembler (which it does where it cannot keep an in-flight operand's
    registers apart)."""
    pytest.importorskip("cuda.bindings.nvjitlink")
    compiled = compile_offline(f"FULL = {FULL_COMPILE!r}\n{UNREAD}{COMPILE}")
    assert len(compiled) == (47 if FULL_COMPILE else 6)
    for name, r in compiled.items():
        assert ".target sm_90a" in r["ptx"]
        copies = (("cp.async.bulk.tensor.4d.shared::cluster.global.tile", "fence.proxy.tensormap::generic.acquire")
                  if r["tma"] else ("fence.proxy.async.shared::cta", "cp.async.cg.shared.global"))
        for needle in ("wgmma.mma_async.sync.aligned", "wgmma.fence.sync.aligned", "wgmma.commit_group.sync.aligned",
                       *copies):
            assert needle in r["ptx"], f"{name}: no {needle!r}"
        if r["tma"]:  # (no per-thread copy left on the producer's path)
            assert "cp.async.cg.shared.global" not in r["ptx"], name
        print(f"{name}: {r['registers']} registers, {r['spill_stores']} spill stores")
        assert r["spill_stores"] == 0 and r["spill_loads"] == 0, f"{name}: {r['log'][-600:]}"
        assert "serialized" not in r["log"], f"{name}: {r['log'][-600:]}"
        # a producer warpgroup's registers moved to the warpgroups that compute: the assembler honours setmaxnreg
        # (it ignores it, C7504 or C7508, where the kernel is not the whole program or its entry count unknown)
        inc = f"setmaxnreg.inc.sync.aligned.u32 {r['take']}"
        assert (inc in r["ptx"]) == r["whole"], name
        assert "setmaxnreg" not in r["log"], f"{name}: {r['log'][-600:]}"
    check_machine_code(compiled)


# ---------------------------------------------------------------------------------------------------------------
# on the H200
# ---------------------------------------------------------------------------------------------------------------

@gpu_only
@pytest.mark.parametrize("seqlen_q, seqlen_k, causal", GPU_SHAPES)
@pytest.mark.parametrize("D", [32, 64, 96, 128])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("threads", [None, 288, 384])
def test_gpu_sizes_default_tiles(seqlen_q, seqlen_k, causal, D, dtype, threads):
    """At the default tiles, and with a producer of one warp or four (288, 384 threads with two warpgroups)."""
    if dtype == "bfloat16":
        dtype = pytest.importorskip("ml_dtypes").bfloat16
    rng = np.random.default_rng(seqlen_q + seqlen_k + D)
    q, k, v = random_qkv(rng, 2, seqlen_q, seqlen_k, 3, D, dtype)
    out, lse = flashnumba.flash_attn_forward(q, k, v, causal=causal, kernel="wgmma", num_threads=threads,
                                             block_m=None if threads is None else 128)
    check_forward(out, lse, q, k, v, causal=causal)


@gpu_only
@pytest.mark.parametrize("seqlen_q, seqlen_k, causal", GPU_SHAPES)
@pytest.mark.parametrize("D", [160, 192, 224, 256])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_gpu_sizes_head_dims_above_128(seqlen_q, seqlen_k, causal, D, dtype):
    """The forward above head_dim 128 at the default tiles (B_c 64, at 256 48; tensor-map copies)."""
    test_gpu_sizes_default_tiles(seqlen_q, seqlen_k, causal, D, dtype, None)


SHARDS = 8


def drawn_case(batch, nheads_k, group, seqlen_q, seqlen_k, D, dtype, causal, window, softcap, alibi, dropout, seed):
    """(rng, q, k, v, the options, the reference's options) of a drawn example: nheads_k * group query heads on
    nheads_k key/value heads, the options drawn (dropout as the reference's explicit mask)."""
    if dtype == "bfloat16":
        dtype = pytest.importorskip("ml_dtypes").bfloat16
    rng = np.random.default_rng(seed)
    nheads = nheads_k * group
    q, k, v = random_qkv(rng, batch, seqlen_q, seqlen_k, nheads, D, dtype)
    k, v = k[:, :, :nheads_k].copy(), v[:, :, :nheads_k].copy()
    opts = dict(causal=causal, softcap=softcap)
    if window is not None:
        opts["window_size"] = window
    if alibi:
        opts["alibi_slopes"] = rng.uniform(0.01, 1.0, nheads).astype(np.float32)
    ref = dict(opts)
    if dropout:
        opts.update(dropout_p=dropout, dropout_seed=seed % 1000, dropout_offset=3)
        ref["dropout_z"] = reference.dropout_z(seed % 1000, 3, batch, nheads, seqlen_q, seqlen_k, dropout)
    return rng, q, k, v, opts, ref


def packed_sequences(dtype, seed):
    """(lens_q, lens_k, cu_q, cu_k, q, k, v) of the varlen tests: awkward lengths (one empty sequence, one longer
    than several tiles), 4 query heads on 2 key/value heads, head_dim 128."""
    if dtype == "bfloat16":
        dtype = pytest.importorskip("ml_dtypes").bfloat16
    rng = np.random.default_rng(seed)
    lens_q, lens_k = [5, 0, 700, 129], [9, 3, 650, 300]
    cu_q, cu_k = (np.concatenate([[0], np.cumsum(n)]).astype(np.int32) for n in (lens_q, lens_k))
    q = rng.standard_normal((cu_q[-1], 4, 128)).astype(dtype)
    k, v = (rng.standard_normal((cu_k[-1], 2, 128)).astype(dtype) for _ in range(2))
    return lens_q, lens_k, cu_q, cu_k, q, k, v


# What the drawn GPU tests below draw that decides a plan: head dims, tiles (block_m, block_n[, num_threads]) and
# the options. test_every_drawn_gpu_case_has_a_plan plans each combination without a GPU, so that no test draws
# tiles the planner refuses (a refusal fails a test on the GPU as a wrong result does)
WINDOWS, SOFTCAPS, DROPOUTS = [None, (33, 70), (100, 0)], [0.0, 3.0], [0.0, 0.2]
DRAWN_FORWARD = ([32, 64, 96, 128], [None, (128, 128, 256), (128, 64, 256), (64, 64, 128), (128, 64, 288),
                                     (64, 64, 160), (128, 64, 384), (128, 128, 384), (192, 64, 512),
                                     (192, 128, 512)])
DRAWN_PADDED = ([40, 56, 72, 80, 104, 120, 136], [None])
DRAWN_ABOVE_128 = ([160, 192, 224, 256], [None, (128, 32, 256), (64, 32, 128), (128, 32, 288), (128, 32, 384),
                                          (128, 48, 384)])
DRAWN_BACKWARD = ([32, 64, 96, 128, 160, 192, 224, 256], [None, (64, 64), (64, 128)])


def forward_tiles_drawn(D, tiles):
    """Whether the drawn forward test takes these tiles: any but three warpgroups with 128 keys a tile at head_dim
    128 (Q_i and three stages need 246,784 bytes of shared memory, more than sm_90 has: the plan refuses them)."""
    return not (tiles == (192, 128, 512) and D > 96)


def backward_tiles_drawn(D, tiles):
    """Whether the drawn backward test takes these tiles: any up to head_dim 128, the default above it, and
    (64, 64) up to 160 (above it the dK/dV kernel's query tiles of 64 with its warpgroups' exchange buffers need
    more shared memory than sm_90 has: the plan refuses them)."""
    return D <= 128 or tiles is None or (tiles == (64, 64) and D <= 160)


@gpu_only
@pytest.mark.parametrize("part", range(SHARDS))
@shard(SHARDS)
@given(batch=st.integers(1, 2), nheads_k=st.integers(1, 2), group=st.sampled_from([1, 2, 4]),
       seqlen_q=st.integers(1, 600), seqlen_k=st.integers(1, 600), D=st.sampled_from(DRAWN_FORWARD[0]),
       dtype=st.sampled_from(["float16", "bfloat16"]), tiles=st.sampled_from(DRAWN_FORWARD[1]),
       causal=st.booleans(), window=st.sampled_from(WINDOWS), softcap=st.sampled_from(SOFTCAPS),
       alibi=st.booleans(), dropout=st.sampled_from(DROPOUTS), seed=st.integers(0, 2**32 - 1))
def test_drawn_shapes_and_options_gpu(part, batch, nheads_k, group, seqlen_q, seqlen_k, D, dtype, tiles, causal,
                                      window, softcap, alibi, dropout, seed):
    """Hypothesis over shapes (GQA groups, lengths 1 .. 600 each way), head dims, dtypes, tiles and every option;
    the compiled specialisations are few (the options' set, D, dtype, tiles), so the examples are many."""
    assume(forward_tiles_drawn(D, tiles))
    rng, q, k, v, opts, ref = drawn_case(batch, nheads_k, group, seqlen_q, seqlen_k, D, dtype, causal, window,
                                         softcap, alibi, dropout, seed)
    blocks = {} if tiles is None else dict(block_m=tiles[0], block_n=tiles[1], num_threads=tiles[2])
    out, lse = flashnumba.flash_attn_forward(q, k, v, kernel="wgmma", **blocks, **opts)
    check_forward(out, lse, q, k, v, **ref)


# what the drawn tests of a setting that must not change a bit draw beside the head dims
SAME_BITS_DRAWS = dict(batch=st.integers(1, 3), nheads_k=st.integers(1, 2), group=st.sampled_from([1, 2, 4]),
                       seqlen_q=st.integers(1, 1200), seqlen_k=st.integers(1, 1200),
                       dtype=st.sampled_from(["float16", "bfloat16"]), causal=st.booleans(),
                       window=st.sampled_from(WINDOWS), softcap=st.sampled_from(SOFTCAPS), alibi=st.booleans(),
                       dropout=st.sampled_from(DROPOUTS), seed=st.integers(0, 2**32 - 1))


def assert_same_bits(out_a, lse_a, out, lse):
    """out and lse of a setting equal the default's bit for bit."""
    assert np.array_equal(to_numpy(lse_a), to_numpy(lse)), "lse"
    assert np.array_equal(to_numpy(out_a).view(np.uint16), to_numpy(out).view(np.uint16)), "out"


@gpu_only
@pytest.mark.parametrize("part", range(SHARDS // 2))
@shard(SHARDS // 2)
@given(D=st.sampled_from([32, 64, 96, 128, 256]), blocks=st.sampled_from([1, 3, 132]), **SAME_BITS_DRAWS)
def test_drawn_persistent_blocks_give_the_same_bits_gpu(part, batch, nheads_k, group, seqlen_q, seqlen_k, D, dtype,
                                                        causal, window, softcap, alibi, dropout, blocks, seed):
    """config.hopper_persistent over drawn shapes and options at the default tiles, on 1, 3 or 132 blocks
    (planner.persistent_blocks): every work item computes what its own block computes, so out and lse equal the
    per-tile blocks' bit for bit, and both pass the reference's check."""
    rng, q, k, v, opts, ref = drawn_case(batch, nheads_k, group, seqlen_q, seqlen_k, D, dtype, causal, window,
                                         softcap, alibi, dropout, seed)
    out, lse = flashnumba.flash_attn_forward(q, k, v, kernel="wgmma", **opts)
    check_forward(out, lse, q, k, v, **ref)
    saved = flashnumba.planner.persistent_blocks
    flashnumba.planner.persistent_blocks = lambda limits: blocks
    try:
        with flashnumba.config.temporarily("hopper_persistent", True):
            out_p, lse_p = flashnumba.flash_attn_forward(q, k, v, kernel="wgmma", **opts)
    finally:
        flashnumba.planner.persistent_blocks = saved
    assert_same_bits(out_p, lse_p, out, lse)


@gpu_only
@pytest.mark.parametrize("part", range(SHARDS // 2))
@shard(SHARDS // 2)
@given(D=st.sampled_from([32, 64, 96, 128, 160]), **SAME_BITS_DRAWS)
def test_drawn_overlap_gives_the_same_bits_gpu(part, batch, nheads_k, group, seqlen_q, seqlen_k, D, dtype, causal,
                                               window, softcap, alibi, dropout, seed):
    """config.hopper_overlap over drawn shapes and options at the default tiles: the same operations in the same
    order, each tile's softmax ended a step later, so out and lse equal the default's bit for bit, and both pass
    the reference's check."""
    rng, q, k, v, opts, ref = drawn_case(batch, nheads_k, group, seqlen_q, seqlen_k, D, dtype, causal, window,
                                         softcap, alibi, dropout, seed)
    out, lse = flashnumba.flash_attn_forward(q, k, v, kernel="wgmma", **opts)
    check_forward(out, lse, q, k, v, **ref)
    with flashnumba.config.temporarily("hopper_overlap", True):
        out_o, lse_o = flashnumba.flash_attn_forward(q, k, v, kernel="wgmma", **opts)
    assert_same_bits(out_o, lse_o, out, lse)


@gpu_only
@pytest.mark.parametrize("part", range(SHARDS))  # (nearly every example compiles its own kernels, about 30 s:
@shard(SHARDS)                                   # four shards of the profile's 60 ran past a call's 420 s)
@given(batch=st.integers(1, 2), nheads_k=st.integers(1, 2), group=st.sampled_from([1, 2]),
       seqlen_q=st.integers(1, 500), seqlen_k=st.integers(1, 500), D=st.sampled_from(DRAWN_PADDED[0]),
       dtype=st.sampled_from(["float16", "bfloat16"]), causal=st.booleans(), window=st.sampled_from(WINDOWS),
       softcap=st.sampled_from(SOFTCAPS), alibi=st.booleans(), dropout=st.sampled_from(DROPOUTS),
       seed=st.integers(0, 2**32 - 1))
def test_drawn_padded_head_dims_gpu(part, batch, nheads_k, group, seqlen_q, seqlen_k, D, dtype, causal, window,
                                    softcap, alibi, dropout, seed):
    """The head dims that run padded to the next multiple of 32 (kernel=None's on compute capability 9.0 from 40),
    forward and backward at the default tiles, over shapes, GQA, dtypes and every option."""
    rng, q, k, v, opts, ref = drawn_case(batch, nheads_k, group, seqlen_q, seqlen_k, D, dtype, causal, window,
                                         softcap, alibi, dropout, seed)
    out, lse = flashnumba.flash_attn_forward(q, k, v, kernel="wgmma", **opts)
    check_forward(out, lse, q, k, v, **ref)
    dout = rng.standard_normal(out.shape).astype(q.dtype)
    grads = flashnumba.flash_attn_backward(dout, q, k, v, out, lse, kernel="wgmma", **opts)[:3]
    check_backward(grads, dout, q, k, v, out, lse, **ref)


@gpu_only
@pytest.mark.parametrize("part", range(SHARDS // 2))
@shard(SHARDS // 2)
@given(batch=st.integers(1, 2), nheads_k=st.integers(1, 2), group=st.sampled_from([1, 2]),
       seqlen_q=st.integers(1, 400), seqlen_k=st.integers(1, 400), D=st.sampled_from(DRAWN_ABOVE_128[0]),
       dtype=st.sampled_from(["float16", "bfloat16"]), tiles=st.sampled_from(DRAWN_ABOVE_128[1]),
       causal=st.booleans(), window=st.sampled_from(WINDOWS), softcap=st.sampled_from(SOFTCAPS),
       alibi=st.booleans(), dropout=st.sampled_from(DROPOUTS), seed=st.integers(0, 2**32 - 1))
def test_drawn_head_dims_above_128_gpu(part, batch, nheads_k, group, seqlen_q, seqlen_k, D, dtype, tiles, causal,
                                       window, softcap, alibi, dropout, seed):
    """The property above over the head dims above 128, at the default tiles or tiles of 32 keys that fit every
    one of them (every warp copying, a producer warp, a producer warpgroup), or of 48 with a producer warpgroup."""
    rng, q, k, v, opts, ref = drawn_case(batch, nheads_k, group, seqlen_q, seqlen_k, D, dtype, causal, window,
                                         softcap, alibi, dropout, seed)
    blocks = {} if tiles is None else dict(block_m=tiles[0], block_n=tiles[1], num_threads=tiles[2])
    out, lse = flashnumba.flash_attn_forward(q, k, v, kernel="wgmma", **blocks, **opts)
    check_forward(out, lse, q, k, v, **ref)


@gpu_only
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("threads", [None, 288, 384])
def test_varlen_gpu(dtype, threads):
    """Packed sequences of awkward lengths (one empty, one longer than several tiles), GQA, causal and a window:
    each sequence checked as a batch of one against the float64 reference."""
    lens_q, lens_k, cu_q, cu_k, q, k, v = packed_sequences(dtype, 11)
    for opts in (dict(causal=True), dict(window_size=(100, 20))):
        out, lse = flashnumba.flash_attn_varlen_forward(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k),
                                                        kernel="wgmma", block_m=128, num_threads=threads, **opts)
        for b in range(len(lens_q)):
            rq, rk = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
            if rq.stop > rq.start:
                check_forward(out[None, rq], lse[None, :, rq], q[None, rq], k[None, rk], v[None, rk], **opts)


# ---------------------------------------------------------------------------------------------------------------
# the backward
# ---------------------------------------------------------------------------------------------------------------


def wgmma_backward(q, k, v, tiles=(64, 64), **opts):
    """The backward through kernel="wgmma" at tiles (block_m, block_n), both kernels' (dQ: block_m query rows, a
    warpgroup per 64, tiles of block_n keys; dK/dV: block_n keys, a warpgroup per 64, tiles of block_m queries),
    None for the defaults; its inputs from the default forward."""
    rng = np.random.default_rng(q.shape[1] + k.shape[1])
    out, lse = flashnumba.flash_attn_forward(q, k, v, **opts)
    dout = rng.standard_normal(out.shape).astype(q.dtype)
    blocks = {} if tiles is None else dict(block_m=tiles[0], block_n=tiles[1])
    grads = flashnumba.flash_attn_backward(dout, q, k, v, out, lse, kernel="wgmma", **blocks, **opts)
    return grads[:3], dout, out, lse


@pytest.mark.parametrize("causal, dropout", [(False, 0.0), (True, 0.3)])
def test_backward_one_warpgroup_matches_reference(causal, dropout):
    """dQ over two key tiles and dK/dV over two query tiles (the second of each partial): the pipelines, the masks,
    L_i and D_i per column; with dropout, its mask drawn into bits at tiles of 64 (a wrong entry index there fails
    it)."""
    rng = np.random.default_rng(21)
    q, k, v = random_qkv(rng, 1, 70, 90, 1, 64, np.float16)
    opts = dict(dropout_p=dropout, dropout_seed=5, dropout_offset=2) if dropout else {}
    grads, dout, out, lse = wgmma_backward(q, k, v, causal=causal, **opts)
    ref = dict(dropout_z=reference.dropout_z(5, 2, 1, 1, 70, 90, dropout)) if dropout else {}
    check_backward(grads, dout, q, k, v, out, lse, causal=causal, **ref)


def test_backward_keys_no_query_sees():
    """A window that leaves the first two key tiles unseen by every query: the dK/dV kernel's blocks with no query
    tile write zeros and return before any copy; the third tile's keys get their gradients."""
    rng = np.random.default_rng(23)
    q, k, v = random_qkv(rng, 1, 6, 150, 1, 64, np.float16)
    grads, dout, out, lse = wgmma_backward(q, k, v, window_size=(3, 0))
    check_backward(grads, dout, q, k, v, out, lse, window_size=(3, 0))
    assert not np.asarray(grads[1])[:, :141].any() and np.asarray(grads[1])[:, 141:].any()


def test_one_sided_left_window():
    """A left window alone over tiles of 64 at seqlen 128: the second key tile lies inside every row's right bound
    and the sequence yet left of the later rows' left bound in the second query tile, so the masking decision rests
    on the window's left edge alone (a decision from the tile's first query row instead of its last passed every
    other test), forward and both backward kernels."""
    rng = np.random.default_rng(23)
    q, k, v = random_qkv(rng, 1, 128, 128, 1, 32, np.float16)
    out, lse = flashnumba.flash_attn_forward(q, k, v, window_size=(3, -1), kernel="wgmma", block_m=64, block_n=64)
    check_forward(out, lse, q, k, v, window_size=(3, -1))
    grads, dout, out, lse = wgmma_backward(q, k, v, tiles=(64, 64), window_size=(3, -1))
    check_backward(grads, dout, q, k, v, out, lse, window_size=(3, -1))


def test_backward_two_warpgroups_every_option():
    """At the default tiles: two warpgroups sharing each tile in both kernels (dQ's key tiles and dK/dV's query
    tiles of 32, as the planner gives them with more than two per-entry options), GQA (the dK/dV kernel summing two
    query heads in order), a two-sided window, softcap, ALiBi and dropout at once, head_dim 96, bfloat16."""
    bf16 = pytest.importorskip("ml_dtypes").bfloat16
    rng = np.random.default_rng(22)
    nheads, nheads_k, sq, sk = 2, 1, 20, 45
    q, k, v = random_qkv(rng, 1, sq, sk, nheads, 96, bf16)
    k, v = k[:, :, :nheads_k].copy(), v[:, :, :nheads_k].copy()
    opts = dict(window_size=(30, 9), softcap=2.5, alibi_slopes=np.array([0.3, 0.7], np.float32), dropout_p=0.3,
                dropout_seed=9, dropout_offset=4)
    ref = {n: x for n, x in opts.items() if not n.startswith("dropout")}
    ref["dropout_z"] = reference.dropout_z(9, 4, 1, nheads, sq, sk, 0.3)
    grads, dout, out, lse = wgmma_backward(q, k, v, tiles=None, **opts)
    check_backward(grads, dout, q, k, v, out, lse, **ref)


def test_backward_gqa_over_several_key_value_heads():
    """Four query heads on two key/value heads, causal, tiles part-full: the dK/dV kernel of key/value head 1 sums
    query heads 2 and 3 (hk * group + it // nt). The other backward tests here have one key/value head, where a
    head found as hk + it // nt passes."""
    rng = np.random.default_rng(15)
    q, k, v = random_qkv(rng, 1, 40, 50, 4, 32, np.float16)
    k, v = k[:, :, :2].copy(), v[:, :, :2].copy()
    grads, dout, out, lse = wgmma_backward(q, k, v, causal=True)
    check_backward(grads, dout, q, k, v, out, lse, causal=True)


@pytest.mark.parametrize("D, opts, dq, dkdv, note", [
    # (two warpgroups: a producer warpgroup copying with tensor maps, 384 threads; the dK/dV kernel at d = 128 only
    # with query tiles of 32, wgmma_backward.takes_tma, which it takes for them; a caller's query tiles of 64 keep
    # every thread copying)
    (128, {}, (128, 64, 384), (32, 128, 384), True),
    (128, dict(causal=True), (128, 64, 384), (32, 128, 384), True),
    (64, dict(causal=True), (128, 128, 384), (64, 128, 384), False),
    (128, dict(dropout_p=0.1), (128, 64, 384), (32, 128, 384), True),
    (96, dict(alibi_slopes=np.ones(2, np.float32)), (128, 64, 384), (32, 128, 384), True),
    (64, dict(dropout_p=0.1, causal=True), (128, 64, 384), (64, 128, 384), False),
    (128, dict(dropout_p=0.1, block_m=64), (64, 64, 128), (64, 128, 256), False),
    (128, dict(block_n=64), (128, 64, 384), (64, 64, 128), False),
    (64, dict(window_size=(9, 4), softcap=3.0), (128, 32, 384), (32, 128, 384), True),
    (64, dict(window_size=(9, 4), softcap=3.0, block_n=64), (128, 64, 384), (32, 64, 128), True),
    # head_dim 256: the dQ kernel's key tiles of 48 (two buffers, the copy engine's) with window bounds alone
    (256, dict(causal=True), (128, 48, 384), (32, 64, 384), True),  # (dK/dV: its table's query tiles of 32)
    (256, dict(softcap=3.0), (128, 32, 384), (32, 64, 384), True),
])
def test_the_backward_plan_fits_the_tiles(D, opts, dq, dkdv, note):
    """The Hopper backward's tiles: each kernel's table, the dK/dV kernel's query tiles of 32 where ALiBi or
    dropout would spill above d = 64 or more than two per-entry options at any head dim, the dQ kernel's key
    tiles of 32 with more than two (tiling.wgmma_dkdv_for_variant, wgmma_dq_for_variant; said in the plan), the
    dK/dV kernel's query tiles of 32 at d = 128 where a producer copies with tensor maps, the dQ kernel's key tiles
    of 128 at d = 64 with a right bound alone, the tiles a caller gives applied to both kernels."""
    q = np.zeros((1, 70, 2, D), np.float16)
    lse = np.zeros((1, 2, 70), np.float32)
    p = flashnumba.plan_backward(q, q, q, q, q, lse, kernel="wgmma", device="sm_90", **opts)
    tiles = {x.name: tuple(x.tiles) for x in p.launches if x.tiles is not None}
    assert tiles == {"dQ wgmma": dq, "dK/dV wgmma": dkdv}
    reasons = " ".join(x.reason for x in p.launches if x.tiles is not None)
    assert ("tiles of 32" in reasons) == note


BACKWARD_COMPILE = r"""
import json
from flashnumba import _launch
from flashnumba.kernels import wgmma_backward as wb
from flashnumba.kernels.common import Variant
plain = Variant()
# per push: the defaults, with the tensor-map copies and the producer warpgroup (wgmma_backward.takes_tma), at
# d = 128 (the dK/dV kernel's query tiles of 32) and at d = 64 (the dQ kernel's key tiles of 128, causal), and the
# per-thread copies of one kernel
cases = [("dq", 128, 64, 2, "float16", plain, "tma"), ("dkdv", 128, 32, 2, "float16", plain, "tma"),
         ("dq", 64, 128, 2, "float16", Variant(False, True), "tma"), ("dkdv", 64, 64, 2, "bfloat16", plain, False)]
if FULL:
    cases += [("dq", 128, 64, 2, "float16", plain, False), ("dkdv", 128, 64, 2, "float16", plain, False),
              ("dkdv", 64, 64, 2, "bfloat16", plain, "tma")]
    every = Variant(True, True, True, True, True, True)
    # (the tiles the planner gives: with more than two per-entry options, dQ's key tiles and dK/dV's query tiles
    # of 32; above d = 64 the same for dK/dV with ALiBi or dropout: tiling.wgmma_dq_for_variant, _dkdv_for_variant)
    cases += [("dq", 128, 32, 2, "bfloat16", every, True), ("dkdv", 128, 32, 2, "bfloat16", every, True),
              ("dq", 64, 32, 2, "bfloat16", every, True), ("dkdv", 64, 32, 2, "bfloat16", every, True),
              ("dq", 128, 64, 2, "float16", Variant(False, False, True, True), True),
              ("dkdv", 64, 64, 2, "float16", Variant(False, False, False, False, False, True), False),
              ("dkdv", 128, 64, 2, "float16", Variant(False, True, True), True),
              ("dq", 96, 64, 2, "float16", Variant(False, True), False),
              ("dkdv", 96, 64, 2, "float16", Variant(False, True), True),
              # (packed causal sequences at d = 64: no tensor maps, so key tiles of 64; with 128 and no producer
              # to give it registers, the dQ kernel spills)
              ("dq", 64, 64, 2, "float16", Variant(False, True, False, False, True), False),
              ("dkdv", 64, 64, 1, "float16", Variant(False, True, False, False, True, True), True),
              ("dq", 128, 32, 2, "bfloat16", Variant(True, True, True, True, False, True), "tma"),
              ("dkdv", 128, 32, 2, "bfloat16", Variant(True, True, True, True, False, True), "tma"),
              ("dkdv", 128, 32, 2, "float16", Variant(False, False, False, False, False, True), "tma"),
              ("dkdv", 96, 64, 2, "float16", Variant(False, True), "tma"),
              ("dq", 32, 64, 2, "float16", plain, "tma"), ("dkdv", 32, 64, 2, "bfloat16", Variant(False, True), "tma"),
              ("dkdv", 32, 64, 2, "float16", Variant(False, True, False, False, True), False),
              # above head_dim 128: dQ_i of up to 128 registers beside key tiles of 32 (64 at 160); the dK/dV
              # kernel's two warpgroups on 64 keys, each half of the head dims, exchanging partial S^T and dP^T
              # (tensor maps at 256: whole boxes; per-thread copies from 192 spill with ALiBi: docs/benchmarks.md)
              ("dq", 256, 32, 2, "bfloat16", Variant(False, True, False, False, False, True), "tma"),
              ("dkdv", 256, 32, 2, "float16", Variant(True, True), "tma"),
              ("dq", 160, 64, 2, "float16", Variant(False, True), "tma"),
              ("dkdv", 160, 32, 2, "float16", Variant(False, True), True),
              ("dkdv", 192, 32, 2, "float16", Variant(False, True, False, False, True, True), False),
              ("dkdv", 224, 32, 2, "bfloat16", Variant(False, True, False, False, True), False)]
out = {}
for which, D, loop, wg, dt, var, gqa in cases:
    tma = gqa == "tma"
    el = "uint16" if dt == "bfloat16" else "float16"
    a4 = f"{el}[:, :, :, ::1]"
    make = wb.make_backward_dq_wgmma if which == "dq" else wb.make_backward_dkdv_wgmma
    fn = make(D, var, loop, wg, dt, bool(gqa), tma)
    outs = a4 if which == "dq" else f"{a4}, {a4}"
    sig = (f"void({a4}, {a4}, {a4}, {a4}, float32[:, :, ::1], float32[:, :, ::1], {outs}, float32, float32, "
           f"float32, int64, int64, float32[:, :], int32[:], int32[:], float32, float32, uint64, uint64, "
           f"uint64[:, ::1], float32[:], float32[:], float32[:], float32[:], int32[:, :, :], int32[:, :, :, :], "
           f"int8[:, :, :, :])")
    # (as the planner compiles them: with the producer's setmaxnreg, the whole program)
    cubin, log, ptx = _launch.build(fn.py_func, sig, (9, 0, "a"), _launch.bounds(wb.threads(wg, tma), tma), tma)
    out[f"{which} {dt} D={D} loop={loop} {var} gqa={gqa}"] = dict(ptx=ptx, log=log, tma=tma, unread=unread(cubin),
                                                                  **_launch.resources_from_log(log))
print(json.dumps(out))
"""


def test_wgmma_backward_compiles_for_sm90a():
    """Without a GPU: the dQ and dK/dV kernels assemble for sm_90a with their accumulators in registers (no
    spills) and their wgmma not serialised (no subroutine call: the options' call-free forms)."""
    pytest.importorskip("cuda.bindings.nvjitlink")
    compiled = compile_offline(f"FULL = {FULL_COMPILE!r}\n{UNREAD}{BACKWARD_COMPILE}")
    assert len(compiled) == (31 if FULL_COMPILE else 4)
    for name, r in compiled.items():
        assert ".target sm_90a" in r["ptx"] and "wgmma.mma_async.sync.aligned" in r["ptx"], name
        assert ("cp.async.bulk.tensor.4d" in r["ptx"]) == r["tma"], name
        assert ("cp.async.cg.shared.global" in r["ptx"]) != r["tma"], name
        assert "setmaxnreg" not in r["log"], f"{name}: {r['log'][-600:]}"
        print(f"{name}: {r['registers']} registers, {r['spill_stores']} spill stores")
        assert r["spill_stores"] == 0 and r["spill_loads"] == 0, f"{name}: {r['log'][-600:]}"
        assert "serialized" not in r["log"], f"{name}: {r['log'][-600:]}"
    check_machine_code(compiled)


@gpu_only
@pytest.mark.parametrize("seqlen_q, seqlen_k, causal", GPU_SHAPES)
@pytest.mark.parametrize("D", [32, 64, 96, 128])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_backward_gpu_sizes_default_tiles(seqlen_q, seqlen_k, causal, D, dtype):
    if dtype == "bfloat16":
        dtype = pytest.importorskip("ml_dtypes").bfloat16
    rng = np.random.default_rng(seqlen_q + 3 * seqlen_k + D)
    q, k, v = random_qkv(rng, 2, seqlen_q, seqlen_k, 3, D, dtype)
    grads, dout, out, lse = wgmma_backward(q, k, v, tiles=None, causal=causal)
    check_backward(grads, dout, q, k, v, out, lse, causal=causal)


@gpu_only
@pytest.mark.parametrize("seqlen_q, seqlen_k, causal", GPU_SHAPES)
@pytest.mark.parametrize("D", [160, 192, 224, 256])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_backward_gpu_sizes_head_dims_above_128(seqlen_q, seqlen_k, causal, D, dtype):
    """The backward above head_dim 128 at the default tiles: the dK/dV kernel's two warpgroups on 64 keys, each
    half of the head dims."""
    test_backward_gpu_sizes_default_tiles(seqlen_q, seqlen_k, causal, D, dtype)


@gpu_only
@pytest.mark.parametrize("part", range(SHARDS))
@shard(SHARDS)
@given(batch=st.integers(1, 2), nheads_k=st.integers(1, 2), group=st.sampled_from([1, 2, 4]),
       seqlen_q=st.integers(1, 400), seqlen_k=st.integers(1, 400), D=st.sampled_from(DRAWN_BACKWARD[0]),
       dtype=st.sampled_from(["float16", "bfloat16"]), tiles=st.sampled_from(DRAWN_BACKWARD[1]),
       causal=st.booleans(), window=st.sampled_from(WINDOWS), softcap=st.sampled_from(SOFTCAPS),
       alibi=st.booleans(), dropout=st.sampled_from(DROPOUTS), seed=st.integers(0, 2**32 - 1))
def test_backward_drawn_shapes_and_options_gpu(part, batch, nheads_k, group, seqlen_q, seqlen_k, D, dtype, tiles,
                                               causal, window, softcap, alibi, dropout, seed):
    """Hypothesis over shapes, GQA groups, head dims, dtypes, both kernels' tiles and every option (above head_dim
    128 the default tiles, or (64, 64) up to 160: backward_tiles_drawn)."""
    assume(backward_tiles_drawn(D, tiles))
    rng, q, k, v, opts, ref = drawn_case(batch, nheads_k, group, seqlen_q, seqlen_k, D, dtype, causal, window,
                                         softcap, alibi, dropout, seed)
    out, lse = flashnumba.flash_attn_forward(q, k, v, **opts)
    dout = rng.standard_normal(out.shape).astype(q.dtype)
    blocks = {} if tiles is None else dict(block_m=tiles[0], block_n=tiles[1])
    grads = flashnumba.flash_attn_backward(dout, q, k, v, out, lse, kernel="wgmma", **blocks, **opts)
    check_backward(grads[:3], dout, q, k, v, out, lse, **ref)


def test_every_drawn_gpu_case_has_a_plan():
    """The drawn GPU tests' head dims, tiles and options, each combination planned for sm_90 without a GPU (with one
    and four query heads a key/value head, a single query and keys past the tiles): every one the tests may draw has
    a plan, forward and, where the test runs it, backward, so that only a kernel's result can fail them there. And the
    tiles the drawn tests leave out are refused as such: (64, 64) above 160 in the backward (the dK/dV kernel's exchange
    buffers), (192, 128) at 128 in the forward."""
    import itertools

    # (space, whether the test runs the backward, the forward kernels it may run: kernel="wgmma", or for the backward
    # test kernel=None's on compute capability 9.0, the Hopper or the mma.sync forward; the simulator's kernel=None
    # plans the SIMT kernels, so both are planned by name, and which tiles the test takes)
    anywhere = lambda D, t: True  # noqa: E731
    spaces = [(DRAWN_FORWARD, False, ("wgmma",), forward_tiles_drawn), (DRAWN_PADDED, True, ("wgmma",), anywhere),
              (DRAWN_ABOVE_128, False, ("wgmma",), anywhere), (DRAWN_BACKWARD, True, ("wgmma", "tc"),
                                                                backward_tiles_drawn)]
    planned = 0
    for (dims, tile_list), backward, forwards, taken in spaces:
        for D, tiles, causal, window, softcap, alibi, dropout, group, (sq, sk) in itertools.product(
                dims, tile_list, (False, True), WINDOWS, SOFTCAPS, (False, True), DROPOUTS, (1, 4),
                ((1, 400), (300, 257))):
            if not taken(D, tiles):
                continue
            q, k = np.zeros((1, sq, group, D), np.float16), np.zeros((1, sk, 1, D), np.float16)
            opts = dict(causal=causal, softcap=softcap, dropout_p=dropout, window_size=window or (-1, -1))
            if alibi:
                opts["alibi_slopes"] = np.ones(group, np.float32)
            blocks = dict(zip(("block_m", "block_n", "num_threads"), tiles or ()))
            for kernel in forwards:
                flashnumba.plan(q, k, k, kernel=kernel, device="sm_90", **({} if backward else blocks), **opts)
            if backward:  # (at the tiles drawn)
                flashnumba.plan_backward(q, q, k, k, q, np.zeros((1, group, sq), np.float32), kernel="wgmma",
                                         device="sm_90", **blocks, **opts)
            planned += 1
    assert planned > 10000
    lse = np.zeros((1, 2, 70), np.float32)
    for D in (192, 224):
        q = np.zeros((1, 70, 2, D), np.float16)
        with pytest.raises(ValueError, match="shared memory"):
            flashnumba.plan_backward(q, q, q, q, q, lse, kernel="wgmma", device="sm_90", block_m=64, block_n=64)
    q = np.zeros((1, 70, 2, 128), np.float16)
    with pytest.raises(ValueError, match="shared memory"):
        flashnumba.plan(q, q, q, kernel="wgmma", device="sm_90", block_m=192, block_n=128, num_threads=512)


@gpu_only
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_backward_varlen_gpu(dtype):
    """Packed sequences of awkward lengths (one empty), GQA, causal and a window: each sequence's gradients
    checked as a batch of one."""
    lens_q, lens_k, cu_q, cu_k, q, k, v = packed_sequences(dtype, 12)
    rng = np.random.default_rng(13)  # (dout)
    for opts in (dict(causal=True), dict(window_size=(100, 20))):
        out, lse = flashnumba.flash_attn_varlen_forward(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), **opts)
        dout = rng.standard_normal(out.shape).astype(q.dtype)
        dq, dk, dv = flashnumba.flash_attn_varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, max(lens_q),
                                                           max(lens_k), kernel="wgmma", **opts)[:3]
        for b in range(len(lens_q)):
            rq, rk = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
            if rq.stop > rq.start:
                check_backward((dq[None, rq], dk[None, rk], dv[None, rk]), dout[None, rq], q[None, rq],
                               k[None, rk], v[None, rk], out[None, rq], lse[None, :, rq], **opts)
