"""The 3xTF32 forward and backward on Hopper's wgmma (:mod:`flashnumba.kernels.wgmma_tf32`,
:mod:`flashnumba.kernels.wgmma_tf32_backward`) against the float64 reference.

The kernels run where ``flashnumba.config.hopper_3xtf32`` asks for them (off by default). In the
simulator: causal and not, partial query and key tiles, both accumulations (chained in the wgmma accumulator,
and each k-step from zero), each tile size, one and two warpgroups (forward), head_dim 64 and 128; compiled for
sm_90a without a GPU (no spills, no serialised wgmma). On a GPU of compute capability 9.0: GPU sizes, Hypothesis
over shapes and tiles, and the error as a multiple of float32's.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import flashnumba
from conftest import (FULL_COMPILE, UNREAD, check_backward, check_machine_code, check_forward, compile_offline,
                      float32_class_backward_draw, float32_class_draw, random_qkv, shard, to_numpy)
from flashnumba import config
from flashnumba._backend import cuda
from flashnumba.kernels import wgmma_tf32, wgmma_tf32_backward


def hopper_or_simulator():
    if not flashnumba.SIMULATOR and tuple(cuda.get_current_device().compute_capability) != (9, 0):
        pytest.skip("wgmma runs on compute capability 9.0 (sm_90a) only")


def run(q, k, v, causal, block_n=32, chained=True, block_m=64):
    """(out, lse) of the forward with precision="3xtf32" on the wgmma kernel (config.hopper_3xtf32)."""
    hopper_or_simulator()
    tiles = dict(block_m=block_m, block_n=block_n)
    with config.temporarily("hopper_3xtf32", "chained" if chained else "per_step"):
        try:
            p = flashnumba.plan(q, k, v, causal=causal, precision="3xtf32", **tiles)
        except ValueError as e:  # (the GPU profile's run with the shared memory capped, as on smaller GPUs)
            if "bytes of shared memory, more than" in str(e):
                pytest.skip(str(e))
            raise
        assert p.launches[0].name == "forward 3xtf32 wgmma" and tuple(p.launches[0].tiles) == (block_m, block_n,
                                                                                                 2 * block_m)
        out, lse = flashnumba.flash_attn_forward(q, k, v, causal=causal, precision="3xtf32", **tiles)
    return np.asarray(out), np.asarray(lse)


@pytest.mark.parametrize("D, causal, seqlen_q, seqlen_k, block_n, chained, block_m", [
    (64, False, 70, 45, 32, True, 64),  # two query tiles (the second partial), two key tiles (the second partial)
    (64, True, 40, 70, 32, False, 64),  # each k-step's products from zero; causal, more keys than queries
    (128, True, 70, 100, 32, True, 64),
    (64, True, 100, 130, 64, False, 64),
    (128, False, 5, 20, 16, False, 64),
    (64, False, 130, 40, 16, False, 128),  # two warpgroups: the second tile's second warpgroup past the queries
    (128, True, 70, 40, 32, True, 128),  # causal with 30 queries more than keys: rows that see no key
])
def test_3xtf32_wgmma_matches_the_reference(D, causal, seqlen_q, seqlen_k, block_n, chained, block_m):
    rng = np.random.default_rng(D + seqlen_q)
    q, k, v = random_qkv(rng, 1, seqlen_q, seqlen_k, 2, D)
    out, lse = run(q, k, v, causal, block_n, chained, block_m)
    check_forward(out, lse, q, k, v, causal=causal)


def test_what_it_does_not_take_is_refused(monkeypatch):
    monkeypatch.setattr(config, "hopper_3xtf32", "chained")
    q = np.zeros((1, 8, 1, 64), np.float32)
    with pytest.raises(ValueError, match="block_n in"):
        flashnumba.plan(q, q, q, precision="3xtf32", block_n=128)
    q128 = np.zeros((1, 8, 1, 128), np.float32)
    with pytest.raises(ValueError, match="head_dim 128 takes block_m in"):  # (256 KB of buffers)
        flashnumba.plan(q128, q128, q128, precision="3xtf32", block_n=64)
    with pytest.raises(ValueError, match="no num_threads"):
        flashnumba.plan(q, q, q, precision="3xtf32", num_threads=128)
    # its own shared memory against the device's (a cap): at head_dim 64, (64, 16) needs 56 KB, (64, 32) 80 KB
    monkeypatch.setenv("FLASHNUMBA_MAX_SHARED_BYTES", "65536")
    assert flashnumba.plan(q, q, q, precision="3xtf32").launches[0].shared_bytes == 57344
    with pytest.raises(ValueError, match="81920 bytes of shared memory, more than the 65536"):
        flashnumba.plan(q, q, q, precision="3xtf32", block_n=32)
    monkeypatch.delenv("FLASHNUMBA_MAX_SHARED_BYTES")
    monkeypatch.setattr(config, "hopper_3xtf32", "sometimes")
    with pytest.raises(ValueError, match="hopper_3xtf32 must be"):
        flashnumba.plan(q, q, q, precision="3xtf32")
    with pytest.raises(ValueError, match="head_dim"):
        wgmma_tf32.make_forward_3xtf32_wgmma(96, False)
    with pytest.raises(ValueError, match="block_n"):
        wgmma_tf32.make_forward_3xtf32_wgmma(64, False, 48)


COMPILE = r"""
import json
from flashnumba import _launch
from flashnumba.kernels import wgmma_tf32
a = "float32[:, :, :, ::1]"
sig = f"void({a}, {a}, {a}, {a}, float32[:, :, ::1], float32)"
out = {}
for D, n, chained, m in ((64, 32, True, 64), (64, 64, True, 64), (128, 32, True, 64), (128, 16, False, 64),
                         (128, 32, False, 64), (64, 16, False, 128), (128, 16, False, 128), (128, 32, False, 128),
                         (64, 64, False, 64), (64, 64, False, 128), (128, 32, True, 128)):
    fn = wgmma_tf32.make_forward_3xtf32_wgmma(D, True, n, chained, m)
    cubin, log, ptx = _launch.build(fn.py_func, sig, (9, 0, "a"), _launch.bounds(2 * m, False), False)
    out[f"D={D} B_c={n} chained={chained} B_r={m}"] = dict(ptx=ptx, log=log, unread=unread(cubin),
                                                          **_launch.resources_from_log(log))
print(json.dumps(out))
"""


def test_3xtf32_wgmma_compiles_for_sm90a():
    """Compiled for sm_90a without a GPU: the TF32 wgmma in the PTX, no spills, no serialised wgmma (a called
    routine in the kernel, such as a 64-bit division or a division's slow path, serialises every one), and every
    wgmma result read in the machine code (:func:`check_machine_code`)."""
    pytest.importorskip("cuda.bindings.nvjitlink")
    compiled = compile_offline(UNREAD + COMPILE, os.path.dirname(__file__))
    for name, r in compiled.items():
        n = name.split("B_c=")[1].split()[0]
        assert f"wgmma.mma_async.sync.aligned.m64n{n}k8.f32.tf32.tf32" in r["ptx"], name
        assert r["spill_stores"] == 0 and r["spill_loads"] == 0, (name, r["log"][-600:])
        assert "serialized" not in r["log"], (name, r["log"][-600:])
    check_machine_code(compiled)


@pytest.mark.skipif(flashnumba.SIMULATOR, reason="GPU sizes: minutes per case in the simulator")
@pytest.mark.parametrize("block_m, block_n", [(64, 32), (64, 16), (128, 16)])
@pytest.mark.parametrize("chained", [True, False])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("seqlen_q, seqlen_k, causal", [(1, 1, False), (63, 65, True), (97, 1000, False),
                                                         (1000, 97, True), (2048, 2048, False)])
def test_3xtf32_wgmma_gpu_sizes(seqlen_q, seqlen_k, causal, D, chained, block_m, block_n):
    rng = np.random.default_rng(seqlen_q + seqlen_k + D)
    q, k, v = random_qkv(rng, 2, seqlen_q, seqlen_k, 3, D)
    out, lse = run(q, k, v, causal, block_n, chained, block_m)
    check_forward(out, lse, q, k, v, causal=causal)


@pytest.mark.skipif(flashnumba.SIMULATOR, reason="GPU sizes: minutes per case in the simulator")
@pytest.mark.parametrize("part", range(4))
@shard(4)
@given(batch=st.integers(1, 2), nheads=st.integers(1, 3), seqlen_q=st.integers(1, 600), seqlen_k=st.integers(1, 600),
       D=st.sampled_from(wgmma_tf32.HEAD_DIMS), causal=st.booleans(),
       tiles=st.sampled_from([(m, n) for m in wgmma_tf32.BLOCK_MS for n in (16, 32, 64)]),
       seed=st.integers(0, 2**32 - 1))
def test_drawn_shapes_gpu(part, batch, nheads, seqlen_q, seqlen_k, D, causal, tiles, seed):
    """Hypothesis over shapes (lengths 1 .. 600 each way), head dims, causal and every tile, each k-step's
    products from zero (the float32-class accumulation); the specialisations are few, so the examples are many."""
    block_m, block_n = tiles if tiles[1] in wgmma_tf32.BLOCK_NS[D] else (tiles[0], 16)
    rng = np.random.default_rng(seed)
    q, k, v = random_qkv(rng, batch, seqlen_q, seqlen_k, nheads, D)
    out, lse = run(q, k, v, causal, block_n, False, block_m)
    check_forward(out, lse, q, k, v, causal=causal)


@pytest.mark.skipif(flashnumba.SIMULATOR, reason="the simulator's wgmma sums exactly; the tensor cores truncate")
@pytest.mark.parametrize("chained", [True, False])
def test_3xtf32_wgmma_error_against_float32(chained):
    """float32-class means at most 2x the error of NumPy's float32 attention on each draw: asserted for the
    accumulation that keeps each k-step's products from zero; the chained one's ratios are printed (what the
    tensor cores' truncation costs over a long chain decides which the plan will take)."""
    ratios = []
    for seed in range(8):
        err, base_err, _ = float32_class_draw(seed, lambda q, k, v, causal: run(q, k, v, causal, 32, chained)[0])
        ratios.append(err / base_err)
    print(f"chained={chained}: error / float32's: median {np.median(ratios):.2f}, largest {max(ratios):.2f}")
    if not chained:
        assert max(ratios) <= 2.0, ratios


# ---------------------------------------------------------------------------------------------------------------
# the backward
# ---------------------------------------------------------------------------------------------------------------


def run_backward(dout, q, k, v, out, lse, causal, block_m=16, block_n=16, chained=False):
    """(dq, dk, dv) of the backward with precision="3xtf32" on the wgmma kernels (config.hopper_3xtf32): block_m
    the dK/dV kernel's query rows a tile, block_n the dQ kernel's keys a tile."""
    hopper_or_simulator()
    tiles = dict(block_m=block_m, block_n=block_n)
    with config.temporarily("hopper_3xtf32", "chained" if chained else "per_step"):
        try:
            p = flashnumba.plan_backward(dout, q, k, v, out, lse, causal=causal, precision="3xtf32", **tiles)
        except ValueError as e:  # (the GPU profile's run with the shared memory capped, as on smaller GPUs)
            if "bytes of shared memory, more than" in str(e):
                pytest.skip(str(e))
            raise
        assert [(s.name, tuple(s.tiles)) for s in p.launches[1:]] == [
            ("dQ 3xtf32 wgmma", (64, block_n, 128)), ("dK/dV 3xtf32 wgmma", (block_m, 64, 128))]
        return flashnumba.flash_attn_backward(dout, q, k, v, out, lse, causal=causal, precision="3xtf32", **tiles)


def backward_case(rng, batch, seqlen_q, seqlen_k, nheads, D, causal):
    """(dout, q, k, v, out, lse): random inputs and the exact forward's out and lse."""
    q, k, v = random_qkv(rng, batch, seqlen_q, seqlen_k, nheads, D)
    dout = rng.standard_normal(q.shape).astype(np.float32)
    out, lse = (to_numpy(x) for x in flashnumba.flash_attn_forward(q, k, v, causal=causal))
    return dout, q, k, v, out, lse


@pytest.mark.parametrize("D, causal, seqlen_q, seqlen_k, block_m, block_n, chained, batch, nheads", [
    (64, True, 70, 45, 32, 32, False, 1, 1),  # two 64-row blocks each way (the second partial), partial loop tiles
    (64, True, 90, 30, 16, 16, True, 2, 1),  # chained; causal with 60 queries more than keys: rows that see no key
    (128, False, 20, 40, 16, 16, False, 1, 1),
])
def test_3xtf32_wgmma_backward_matches_the_reference(D, causal, seqlen_q, seqlen_k, block_m, block_n, chained, batch,
                                                     nheads):
    dout, q, k, v, out, lse = backward_case(np.random.default_rng(D + seqlen_q), batch, seqlen_q, seqlen_k, nheads, D,
                                            causal)
    grads = run_backward(dout, q, k, v, out, lse, causal, block_m, block_n, chained)
    check_backward(grads, dout, q, k, v, out, lse, causal=causal)


def test_what_the_backward_does_not_take_is_refused(monkeypatch):
    monkeypatch.setattr(config, "hopper_3xtf32", "per_step")
    x = np.zeros((1, 8, 1, 128), np.float32)
    lse = np.zeros((1, 1, 8), np.float32)
    with pytest.raises(ValueError, match=r"block_n \(the dQ kernel's keys a tile\) in \(16,\)"):  # (256 KB)
        flashnumba.plan_backward(x, x, x, x, x, lse, precision="3xtf32", block_n=32)
    with pytest.raises(ValueError, match="no num_threads"):
        flashnumba.plan_backward(x, x, x, x, x, lse, precision="3xtf32", num_threads=128)
    # its own shared memory against the device's (a cap): at head_dim 128 the dK/dV kernel needs 208 KB
    monkeypatch.setenv("FLASHNUMBA_MAX_SHARED_BYTES", "200000")
    with pytest.raises(ValueError, match="dK/dV kernel on wgmma at head_dim 128 needs 213120 bytes"):
        flashnumba.plan_backward(x, x, x, x, x, lse, precision="3xtf32")
    monkeypatch.delenv("FLASHNUMBA_MAX_SHARED_BYTES")
    with pytest.raises(ValueError, match="head_dim"):
        wgmma_tf32_backward.make_backward_dq_3xtf32_wgmma(96, False)
    with pytest.raises(ValueError, match="rows a loop tile"):
        wgmma_tf32_backward.make_backward_dkdv_3xtf32_wgmma(64, False, 48)


COMPILE_BACKWARD = r"""
import json
from flashnumba import _launch
from flashnumba.kernels import wgmma_tf32_backward as wb
a, r = "float32[:, :, :, ::1]", "float32[:, :, ::1]"
sigs = dict(dq=f"void({a}, {a}, {a}, {a}, {r}, {r}, {a}, float32, float32)",
            dkdv=f"void({a}, {a}, {a}, {a}, {r}, {r}, {a}, {a}, float32, float32)")
makes = dict(dq=wb.make_backward_dq_3xtf32_wgmma, dkdv=wb.make_backward_dkdv_3xtf32_wgmma)
out = {}
builds = [(which, D, n, chained, causal) for which in makes for D, ns in wb.LOOP_ROWS.items() for n in ns
          for chained in (False, True) for causal in (False, True)]
for which, D, n, chained, causal in builds:
    if not FULL and (which, D, n, chained, causal) not in (
            ("dq", 64, 32, False, True), ("dkdv", 64, 32, False, True), ("dq", 128, 16, False, True),
            ("dkdv", 128, 16, False, True), ("dkdv", 128, 16, True, False)):
        continue  # (per push: these five; FULL_COMPILE: every build)
    fn = makes[which](D, causal, n, chained)
    cubin, log, ptx = _launch.build(fn.py_func, sigs[which], (9, 0, "a"), None, False)
    name = f"{which} D={D} loop={n} chained={chained} causal={causal}"
    out[name] = dict(ptx=ptx, log=log, unread=unread(cubin), **_launch.resources_from_log(log))
print(json.dumps(out))
"""


def test_3xtf32_wgmma_backward_compiles_for_sm90a():
    """Compiled for sm_90a without a GPU: both kernels' TF32 wgmma (from shared memory and with the A operand in
    registers) in the PTX, no spills (the dK/dV kernel at head_dim 128 keeps dK_j, dV_j and a scratch of 64
    registers each: 244 a thread), no serialised wgmma, and every wgmma result read in the machine code
    (:func:`check_machine_code`: at head_dim 64 S's first register was not, with S and dP sharing their scratch
    accumulators); five builds per push, FULL_COMPILE every one (both
    kernels, head dims, loop tiles, accumulations, causal or not)."""
    pytest.importorskip("cuda.bindings.nvjitlink")
    compiled = compile_offline(f"FULL = {FULL_COMPILE!r}\n{UNREAD}{COMPILE_BACKWARD}", os.path.dirname(__file__))
    assert len(compiled) == (24 if FULL_COMPILE else 5)
    for name, r in compiled.items():
        D, n = name.split("D=")[1].split()[0], name.split("loop=")[1].split()[0]
        assert f"wgmma.mma_async.sync.aligned.m64n{n}k8.f32.tf32.tf32" in r["ptx"], name
        assert f"wgmma.mma_async.sync.aligned.m64n{D}k8.f32.tf32.tf32" in r["ptx"], name
        assert r["spill_stores"] == 0 and r["spill_loads"] == 0, (name, r["log"][-600:])
        assert "serialized" not in r["log"], (name, r["log"][-600:])
    check_machine_code(compiled)


@pytest.mark.skipif(flashnumba.SIMULATOR, reason="GPU sizes: minutes per case in the simulator")
@pytest.mark.parametrize("chained", [True, False])
@pytest.mark.parametrize("D, block_m, block_n", [(64, 16, 16), (64, 32, 32), (128, 16, 16)])
@pytest.mark.parametrize("seqlen_q, seqlen_k, causal", [(1, 1, False), (63, 65, True), (97, 1000, False),
                                                         (1000, 97, True), (2048, 2048, False)])
def test_3xtf32_wgmma_backward_gpu_sizes(seqlen_q, seqlen_k, causal, D, block_m, block_n, chained):
    dout, q, k, v, out, lse = backward_case(np.random.default_rng(seqlen_q + seqlen_k + D), 2, seqlen_q, seqlen_k, 3,
                                            D, causal)
    grads = run_backward(dout, q, k, v, out, lse, causal, block_m, block_n, chained)
    check_backward(grads, dout, q, k, v, out, lse, causal=causal)


@pytest.mark.skipif(flashnumba.SIMULATOR, reason="GPU sizes: minutes per case in the simulator")
@pytest.mark.parametrize("part", range(4))
@shard(4)
@given(batch=st.integers(1, 2), nheads=st.integers(1, 3), seqlen_q=st.integers(1, 600), seqlen_k=st.integers(1, 600),
       D=st.sampled_from(wgmma_tf32.HEAD_DIMS), causal=st.booleans(), tiles=st.sampled_from([(16, 16), (16, 32),
                                                                                             (32, 16), (32, 32)]),
       seed=st.integers(0, 2**32 - 1))
def test_drawn_shapes_backward_gpu(part, batch, nheads, seqlen_q, seqlen_k, D, causal, tiles, seed):
    """Hypothesis over shapes, head dims, causal and every loop tile, each k-step's products from zero."""
    block_m, block_n = (m if m in wgmma_tf32_backward.LOOP_ROWS[D] else 16 for m in tiles)
    dout, q, k, v, out, lse = backward_case(np.random.default_rng(seed), batch, seqlen_q, seqlen_k, nheads, D, causal)
    grads = run_backward(dout, q, k, v, out, lse, causal, block_m, block_n)
    check_backward(grads, dout, q, k, v, out, lse, causal=causal)


@pytest.mark.skipif(flashnumba.SIMULATOR, reason="the simulator's wgmma sums exactly; the tensor cores truncate")
@pytest.mark.parametrize("chained", [True, False])
def test_3xtf32_wgmma_backward_error_against_float32(chained):
    """The gradients' error against the float64 truth as a multiple of NumPy's float32 backward's (the same
    algorithm from the same out and lse), the draws of the mma.sync 3xTF32 backward's test (tests/test_tf32.py):
    at most 2x on the median for each k-step's products from zero; the ratios are printed (chained: what the
    tensor cores' truncation costs). No draw may pass 10x: single draws of the mma.sync 3xTF32 and the SIMT
    backwards reach 4-6x (tests/test_tf32.py), a wrong gradient is orders of magnitude off, and a median alone
    would let one head dim's gradients be wrong where the other's are right."""
    ratios = []
    for seed in range(24):
        ratios += float32_class_backward_draw(seed, lambda dout, q, k, v, out, lse, causal: run_backward(
            dout, q, k, v, out, lse, causal, chained=chained))
    median = float(np.median(ratios))
    print(f"chained={chained}: error / float32's: median {median:.2f}, largest {max(ratios):.2f}")
    if not chained:
        assert median <= 2.0, f"median {median:.2f}x NumPy float32's error (largest {max(ratios):.2f})"
        assert max(ratios) <= 10.0, ratios
