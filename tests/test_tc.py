"""flashnumba.forward_tc: the tensor-core forward against the float64 reference, and its sm_90 PTX.

Tolerances as in conftest.check_forward: 3x the error of NumPy's float16 computation of the same attention, plus
a few ulps. The kernel rounds P_ij to float16 before P V (as FlashAttention-2 does); NumPy's float16 baseline
rounds every intermediate, so it is the looser of the two and bounds the kernel's error. Shapes are tiny: under
the simulator every mma is 32 Python threads meeting at a barrier.
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

import flashnumba
from conftest import GPU_SHAPES, check_backward, check_forward, random_qkv
from flashnumba import reference, tiling
from flashnumba._backend import cuda  # (module level: the simulator swaps a kernel's global cuda for its own)


def forward_tc(q, k, v, warps=None, rows=16, **kw):
    """The tensor-core forward with its tiles given as B_c (``block_n``), a number of warps and the query rows
    each owns (16 or 32: B_r = rows warps). Under a shared-memory cap (FLASHNUMBA_MAX_SHARED_BYTES) tiles that do
    not fit are skipped, not failed."""
    if warps is not None:
        kw.update(block_m=rows * warps, num_threads=32 * warps)
    try:
        return flashnumba.flash_attn_forward(q, k, v, kernel="tc", **kw)
    except ValueError as err:
        if tiling.shared_cap() is not None and "bytes of shared memory" in str(err):
            pytest.skip(f"these tiles do not fit the capped shared memory: {err}")
        raise


# (block_n, warps, rows per warp): the smallest blocks (16 keys, 1 warp of 16 or of 32 rows) in the simulator,
# where every mma is 32 Python threads meeting at a barrier; on a GPU, the defaults and larger blocks as well
BLOCKS = [(16, 1, 16), (16, 1, 32)] + ([] if flashnumba.SIMULATOR else [(None, None, 16), (32, 8, 16), (64, 4, 32),
                                                                         (32, 4, 32)])


@pytest.mark.parametrize("blocks", BLOCKS)
@pytest.mark.parametrize("seqlen_q, seqlen_k, nheads", [(17, 80, 1), (40, 17, 2)])
def test_forward_tc_matches_reference(seqlen_q, seqlen_k, nheads, blocks):
    rng = np.random.default_rng(seqlen_q * 100 + seqlen_k)
    q, k, v = random_qkv(rng, 1, seqlen_q, seqlen_k, nheads, 64, np.float16)
    out, lse = forward_tc(q, k, v, block_n=blocks[0], warps=blocks[1], rows=blocks[2])
    check_forward(out, lse, q, k, v)


@pytest.mark.parametrize("blocks", BLOCKS)
@pytest.mark.parametrize("seqlen_q, seqlen_k", [(40, 17)])
def test_forward_tc_causal(seqlen_q, seqlen_k, blocks):
    """Bottom-right aligned; with seqlen_q > seqlen_k the first rows see no key (out 0, lse -inf)."""
    rng = np.random.default_rng(7 + seqlen_q)
    q, k, v = random_qkv(rng, 1, seqlen_q, seqlen_k, 1, 64, np.float16)
    out, lse = forward_tc(q, k, v, causal=True, block_n=blocks[0], warps=blocks[1], rows=blocks[2])
    check_forward(out, lse, q, k, v, causal=True)


@pytest.mark.parametrize("seqlen_q, seqlen_k, causal, block_n, warps", [
    (16, 97, False, 16, 1),  # seven key tiles: both buffers, refilled in turn; the last tile partial
    (33, 65, True, 16, 1),  # causal: three query blocks, each stopping at its own diagonal, unmasked tiles below it
])
def test_forward_tc_pipeline_over_many_tiles(seqlen_q, seqlen_k, causal, block_n, warps):
    """Double buffering: every key tile reaches the kernel once, through both buffers, whatever the block sizes."""
    rng = np.random.default_rng(seqlen_k)
    q, k, v = random_qkv(rng, 1, seqlen_q, seqlen_k, 1, 64, np.float16)
    out, lse = forward_tc(q, k, v, causal=causal, block_n=block_n, warps=warps)
    check_forward(out, lse, q, k, v, causal=causal)


def test_forward_tc_bfloat16():
    """bfloat16 in and out (the bf16 mma; P_ij rounded to bfloat16), checked like test_bf16's kernels."""
    ml_dtypes = pytest.importorskip("ml_dtypes")
    rng = np.random.default_rng(11)
    q, k, v = random_qkv(rng, 1, 20, 40, 1, 64, ml_dtypes.bfloat16)
    for causal in (False, True):
        out, lse = forward_tc(q, k, v, causal=causal, block_n=16, warps=1)
        assert out.dtype == ml_dtypes.bfloat16 and lse.dtype == np.float32
        check_forward(out, lse, q, k, v, causal=causal)


@pytest.mark.parametrize("blocks", BLOCKS)
@pytest.mark.parametrize("scale", [0.3, -0.2])
def test_forward_tc_head_dim_128_and_scale(blocks, scale):
    """head_dim 128 (with two blocks of 16 rows a warp, Q_i's fragments read from shared memory per k-step); a
    negative scale (the row maximum of the raw scores is then not that of the scaled ones: no folded scale)."""
    rng = np.random.default_rng(3)
    q, k, v = random_qkv(rng, 1, 17, 40, 1, 128, np.float16)
    out, lse = forward_tc(q, k, v, softmax_scale=scale, block_n=blocks[0], warps=blocks[1], rows=blocks[2])
    check_forward(out, lse, q, k, v, softmax_scale=scale)


def test_forward_tc_rejects_what_it_does_not_support():
    rng = np.random.default_rng(0)
    q, k, v = random_qkv(rng, 1, 4, 4, 1, 64)
    with pytest.raises(TypeError, match="float16 or bfloat16"):
        forward_tc(q, k, v)
    q, k, v = random_qkv(rng, 1, 4, 4, 1, 64, np.float16)
    with pytest.raises(ValueError, match="multiple of 16"):
        forward_tc(q, k, v, block_n=24)
    with pytest.raises(ValueError, match="block_m"):
        forward_tc(q, k, v, warps=3)
    q, k, v = random_qkv(rng, 1, 4, 4, 1, 36, np.float16)
    with pytest.raises(ValueError, match="head_dim"):
        forward_tc(q, k, v)


def test_flash_attn_forward_kernel_tc():
    """The opt-in through the public API: the same kernel; window (-1, 0) is causal."""
    rng = np.random.default_rng(5)
    q, k, v = random_qkv(rng, 1, 16, 20, 1, 64, np.float16)
    out, lse = flashnumba.flash_attn_forward(q, k, v, window_size=(-1, 0), kernel="tc", block_m=16, block_n=16)
    check_forward(out, lse, q, k, v, causal=True)


def gpu_sizes(test):
    """GPU only: float16 and bfloat16, d 64 and 128, awkward and long sequences, causal and not."""
    for mark in (pytest.mark.parametrize("seqlen_q, seqlen_k, causal", GPU_SHAPES),
                 pytest.mark.parametrize("D", [64, 128]),
                 pytest.mark.parametrize("dtype", ["float16", "bfloat16"]),
                 pytest.mark.skipif(flashnumba.SIMULATOR, reason="GPU sizes: minutes per case in the simulator")):
        test = mark(test)
    return test


@gpu_sizes
def test_forward_tc_gpu_sizes(seqlen_q, seqlen_k, causal, D, dtype):
    """On the GPU: awkward and long sequences with the default blocks, 2 batches x 3 heads."""
    if dtype == "bfloat16":
        dtype = pytest.importorskip("ml_dtypes").bfloat16
    rng = np.random.default_rng(seqlen_q + seqlen_k + D)
    q, k, v = random_qkv(rng, 2, seqlen_q, seqlen_k, 3, D, dtype)
    out, lse = flashnumba.flash_attn_forward(q, k, v, causal=causal, kernel="tc")
    check_forward(out, lse, q, k, v, causal=causal)


@pytest.mark.parametrize("opts", [dict(num_threads=96), dict(block_m=48), dict(block_m=128, num_threads=64)])
def test_flash_attn_forward_kernel_tc_rejects_other_options(opts):
    q, k, v = random_qkv(np.random.default_rng(0), 1, 4, 4, 1, 64, np.float16)
    with pytest.raises(ValueError, match="kernel 'tc'"):
        flashnumba.flash_attn_forward(q, k, v, kernel="tc", **opts)


# ---------------------------------------------------------------------------------------------------------------
# The GPU path compiles: PTX for sm_90, assembled by nvJitLink, without a GPU
# ---------------------------------------------------------------------------------------------------------------

COMPILE = r"""
import json
from flashnumba import _launch, tiling
from flashnumba.kernels import mma_backward as backward_tc, mma_forward as forward_tc
from flashnumba.kernels.simt_forward import Variant
from flashnumba.tools import resources
DEV = tiling.ARCHS["sm_90"]
out = {}
f3 = "float32[:, :, ::1]"
for dtype, elem in (("float16", "float16"), ("bfloat16", "uint16")):
    a = f"{elem}[:, :, :, ::1]"  # C-contiguous, as the launch passes them
    for D in (64, 128):
        for name, variant in (("causal=False", Variant()), ("causal=True", Variant(has_right=True)),
                              ("every option", Variant(True, True, True, True, True, True))):
            if dtype == "bfloat16" and name != "every option":  # (bfloat16 changes only the mma and cvt)
                continue
            # per push: bfloat16's instructions with every option (float16 at d=128 with every option, the most
            # registers, compiles per push for sm_80 in tests/test_compile.py)
            if not FULL and (dtype, D, name) != ("bfloat16", 64, "every option"):
                continue
            key = f"{dtype} D={D} {name}"
            T = tiling.plain_rows_per_warp(tiling.default("tc", D, DEV).tiles, variant)
            sig = (f"void({a}, {a}, {a}, {a}, {f3}, float32, {resources._OPTS}, {resources._MODS}, "
                   f"{resources._BLOCK_MASK})")
            gqa = name == "every option"
            make = forward_tc.make_forward_tc(D, variant, T.block_n, T.num_threads // 32, dtype=dtype, gqa=gqa,
                                              wm=T.block_m // (T.num_threads // 2))
            text = _launch.compile_ptx(make.py_func, sig, (9, 0))
            out[key] = dict(ptx=text, **resources.ptx_resources(text))
            for kname, make, n, (bm, bn) in zip(("dq", "dkdv"), (backward_tc.make_backward_dq_tc,
                                                                  backward_tc.make_backward_dkdv_tc),
                                                 (1, 2),  # n gradient arrays
                                                 [tiling.default(f, D, DEV).tiles[:2] for f in ("tc_dq", "tc_dkdv")]):
                grads = ", ".join([a] * n + ["float32[:, :, :, :]"] * (n - 1))  # (dK/dV: and dq_acc, a dummy)
                bsig = (f"void({a}, {a}, {a}, {a}, {f3}, {f3}, {grads}, float32, float32, {resources._OPTS}, "
                        f"{resources._MODS}, {resources._BLOCK_MASK})")
                text = _launch.compile_ptx(make(D, variant, bm, bn, dtype).py_func, bsig, (9, 0))
                out[f"{key} {kname}"] = dict(ptx=text, **resources.ptx_resources(text))
print(json.dumps(out))
"""


def test_forward_tc_compiles_for_sm90():
    """Per push one set of three kernels (forward, dQ, dK/dV); conftest.FULL_COMPILE (the GPU profile, or
    FLASHNUMBA_FULL_COMPILE=1) all eight sets: float16 at d=64 and 128, plain, causal and every option, and
    bfloat16 at both with every option."""
    pytest.importorskip("cuda.bindings.nvjitlink")
    import json

    from conftest import FULL_COMPILE

    env = dict(os.environ, FLASHNUMBA_SIMULATOR="0", NUMBA_ENABLE_CUDASIM="0")
    proc = subprocess.run([sys.executable, "-c", f"FULL = {FULL_COMPILE!r}\n{COMPILE}"], env=env,
                          capture_output=True, text=True, timeout=600)
    if proc.returncode != 0 and "NVVM" in proc.stderr and "not found" in proc.stderr.lower():
        pytest.skip("NVVM is not installed (pip install numba-cuda[cu13])")
    assert proc.returncode == 0, proc.stderr[-3000:]
    kernels = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(kernels) == (24 if FULL_COMPILE else 3)
    for name, r in kernels.items():
        text = r["ptx"]
        assert ".target sm_90" in text
        kind = "bf16" if name.startswith("bfloat16") else "f16"
        needles = [f"mma.sync.aligned.m16n8k16.row.col.f32.{kind}.{kind}.f32", "ldmatrix.sync.aligned.m8n8.x4.shared",
                   "ldmatrix.sync.aligned.m8n8.x4.trans", f"cvt.rn.{kind}x2.f32", "cp.async.cg.shared.global",
                   "cp.async.wait_group 1"]
        if not name.endswith(("dq", "dkdv")):
            needles.append("shfl.sync.bfly.b32")  # the forward's row max
        for needle in needles:
            assert needle in text, f"{name}: no {needle!r} in its PTX"
        print(f"{name}: {r['registers']} registers, {r['spill_stores']} spill stores, {r['spill_loads']} spill loads")
        # no spills; but the dK/dV kernel at d=128 holds dK_j and dV_j (128 registers per thread) beside S^T, dP^T
        # and the masks' state, at the 255-register limit, and the assembler spills some bytes; how many depends
        # on its version (the H200 machine's: 8 + 8 plain, 12 + 16 causal, 80 + 108 with every option; here
        # 0, 4 + 8, 0). Allowed there, up to 256 bytes.
        allowed = 256 if name.endswith("dkdv") and "D=128" in name else 0
        assert 0 < r["registers"] <= 255 and r["spill_stores"] + r["spill_loads"] <= allowed


def test_default_kernel_is_tc_where_it_applies():
    """kernel=None picks the tensor-core forward on a GPU for float16 (options or not), and v3 otherwise (always
    in the simulator, or when block sizes are given; wgmma on Hopper): the results are those of the kernel it
    names, bit for bit."""
    rng = np.random.default_rng(2)
    q, k, v = random_qkv(rng, 1, 20, 24, 1, 64, np.float16)
    # the tensor cores' family: tc (mma.sync), or wgmma on Hopper
    chosen = flashnumba.plan(q, k, v, causal=True, softcap=2.0).kernel
    assert (chosen == "v3") if flashnumba.SIMULATOR else (chosen in ("tc", "wgmma"))
    for got, want in [(flashnumba.flash_attn_forward(q, k, v, causal=True, softcap=2.0),
                       flashnumba.flash_attn_forward(q, k, v, causal=True, softcap=2.0, kernel=chosen)),
                      (flashnumba.flash_attn_forward(q, k, v, block_m=32),  # block sizes given: the SIMT kernel
                       flashnumba.flash_attn_forward(q, k, v, block_m=32, kernel="v3"))]:
        np.testing.assert_array_equal(got[0], want[0])
        np.testing.assert_array_equal(got[1], want[1])


# ---------------------------------------------------------------------------------------------------------------
# The backward (flashnumba.backward_tc)
# ---------------------------------------------------------------------------------------------------------------

def run_backward_tc(rng, batch, seqlen_q, seqlen_k, nheads, D, dtype, causal, **blocks):
    """Forward (any kernel) then the tensor-core backward; returns (grads, dout, q, k, v, out, lse)."""
    q, k, v = random_qkv(rng, batch, seqlen_q, seqlen_k, nheads, D, dtype)
    dout = rng.standard_normal(q.shape).astype(dtype)
    out, lse = flashnumba.flash_attn_forward(q, k, v, causal=causal)
    grads = flashnumba.flash_attn_backward(dout, q, k, v, out, lse, causal=causal, kernel="tc", **blocks)
    return grads, dout, q, k, v, out, lse


@pytest.mark.parametrize("seqlen_q, seqlen_k, causal, D", [
    (17, 40, False, 64),  # three key tiles per query block, two query tiles per key block: both buffers
    (40, 17, True, 64),  # bottom-right causal: the first rows see no key (zero gradient)
    (17, 20, True, 128),  # d=128: both tiles partial (the defaults' 128-key dK/dV blocks: tests on the GPU)
])
def test_backward_tc_matches_reference(seqlen_q, seqlen_k, causal, D):
    rng = np.random.default_rng(seqlen_q * 7 + seqlen_k)
    blocks = dict(block_m=16, block_n=32 if D == 128 else 16)
    grads, dout, q, k, v, out, lse = run_backward_tc(rng, 1, seqlen_q, seqlen_k, 1, D, np.float16, causal, **blocks)
    check_backward(grads, dout, q, k, v, out, lse, causal=causal)


def test_backward_tc_tiles_per_kernel():
    """The dQ and dK/dV kernels have their own default tiles; a block_m or block_n given applies to both."""
    dev = tiling.ARCHS["sm_90"]

    def tiles(D, **given):
        return tuple(tiling.resolve(f, D, dev, **given)[0][:2] for f in ("tc_dq", "tc_dkdv"))

    assert tiles(128) == ((64, 32), (64, 128))
    assert tiles(128, block_m=16) == ((16, 32), (16, 128))
    assert tiling.shared_bytes("tc_dq", 128, tiling.Tiles(16, 32, 32))[0] == 2 * (2 * 16 + 4 * 32) * (128 + 8)
    assert tiles(64, block_m=32, block_n=32) == ((32, 32), (32, 32))
    with pytest.raises(ValueError, match="block_n"):
        tiles(64, block_n=48)


def test_backward_tc_query_tile_larger_than_the_block():
    """block_m > 2 block_n: the dK/dV kernel's 2 block_n threads load the L_i, D_i of block_m query rows."""
    rng = np.random.default_rng(12)
    grads, dout, q, k, v, out, lse = run_backward_tc(rng, 1, 40, 16, 1, 64, np.float16, False, block_m=64,
                                                     block_n=16)
    check_backward(grads, dout, q, k, v, out, lse)


def test_backward_tc_bfloat16():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    rng = np.random.default_rng(4)
    grads, dout, q, k, v, out, lse = run_backward_tc(rng, 1, 20, 24, 1, 64, ml_dtypes.bfloat16, True,
                                                     block_m=16, block_n=16)
    assert all(g.dtype == ml_dtypes.bfloat16 for g in grads)
    check_backward(grads, dout, q, k, v, out, lse, causal=True)


# (seqlen_q, seqlen_k, nheads, nheads_k, D, block_m, block_n, options): each way the atomic dQ splits its work
ATOMIC_CASES = [
    (40, 17, 1, 1, 16, 64, 16, dict(causal=True)),  # one warp takes the four 16-row slabs of dQ_i in turn
    (20, 33, 2, 1, 24, 16, 32, dict(window_size=(9, 4))),  # two warps split dQ_i's (padded) columns; GQA
    (17, 23, 1, 1, 40, 32, 32, dict(softcap=3.0, alibi_slopes=np.array([0.3], np.float32))),
    (20, 20, 1, 1, 16, 16, 16, dict(dropout_p=0.3, dropout_seed=7)),
    (50, 33, 1, 1, 16, 64, 32, {}),  # two warps, four 16-row slabs of dQ_i: each warp takes two (w and w + 2)
]


@pytest.mark.parametrize("case", ATOMIC_CASES)
def test_backward_tc_atomic_dq_matches_reference(case):
    """deterministic=False: the dK/dV kernel adds dQ_i += dS K_j with atomics into float32 (then one conversion);
    the gradients meet the same bar as the deterministic kernels', with each option."""
    sq, sk, nheads, nheads_k, D, bm, bn, opts = case
    rng = np.random.default_rng(sq + 5 * D)
    q, k, v = random_qkv(rng, 1, sq, sk, nheads, D, np.float16)
    k, v = k[:, :, :nheads_k].copy(), v[:, :, :nheads_k].copy()
    dout = rng.standard_normal(q.shape).astype(np.float16)
    out, lse = flashnumba.flash_attn_forward(q, k, v, kernel="tc", block_m=16, block_n=16, **opts)
    p = flashnumba.plan_backward(dout, q, k, v, out, lse, kernel="tc", block_m=bm, block_n=bn, deterministic=False,
                                 device="sm_90", **{n: x for n, x in opts.items() if n != "dropout_seed"})
    assert [s.name for s in p.launches] == ["D_i preprocess", "dK/dV tc + dQ", "dQ convert"]
    grads = flashnumba.flash_attn_backward(dout, q, k, v, out, lse, kernel="tc", block_m=bm, block_n=bn,
                                           deterministic=False, **opts)
    ref = {n: x for n, x in opts.items() if not n.startswith("dropout")}
    if "dropout_p" in opts:
        ref["dropout_z"] = reference.dropout_z(7, 0, 1, nheads, sq, sk, opts["dropout_p"])
    check_backward(grads, dout, q, k, v, out, lse, **ref)


@pytest.mark.skipif(not flashnumba.SIMULATOR, reason="code for sm_80 does not load on a GPU of another major version")
def test_backward_tc_atomic_dq_before_hopper(monkeypatch):
    """Planned for an A100 (sm_80, no vector reduction): two scalar atomic adds a lane's column pair."""
    monkeypatch.setattr(flashnumba.planner, "current_device", lambda: tiling.ARCHS["sm_80"])
    flashnumba.clear_plan_cache()
    q = np.zeros((1, 20, 1, 24), np.float16)
    lse = np.zeros((1, 1, 20), np.float32)
    p = flashnumba.plan_backward(q, q, q, q, q, lse, kernel="tc", block_m=16, block_n=32, deterministic=False)
    assert p.launches[1].factory_args[-2] is True  # atomic_dq (sm_90: "v2"; the last: the block mask's blocks)
    rng = np.random.default_rng(80)
    grads, dout, q, k, v, out, lse = run_backward_tc(rng, 1, 20, 37, 1, 24, np.float16, True, block_m=16,
                                                     block_n=32, deterministic=False)
    flashnumba.clear_plan_cache()
    check_backward(grads, dout, q, k, v, out, lse, causal=True)


def test_backward_tc_atomic_dq_two_warps_a_key_block():
    """Above d = 160 two warps share each block of 16 keys in dK/dV: one of them writes dS^T for the atomic dQ."""
    rng = np.random.default_rng(176)
    grads, dout, q, k, v, out, lse = run_backward_tc(rng, 1, 18, 17, 1, 176, np.float16, True, block_m=16,
                                                     block_n=16, deterministic=False)
    check_backward(grads, dout, q, k, v, out, lse, causal=True)


def test_deterministic_flag():
    """deterministic is a bool; False plans the atomic dQ on the tensor cores only (the SIMT backward has none);
    the atomic tiles are their own table."""
    q = np.zeros((1, 64, 2, 128), np.float16)
    lse = np.zeros((1, 2, 64), np.float32)
    with pytest.raises(TypeError, match="deterministic"):
        flashnumba.flash_attn_backward(q, q, q, q, q, lse, deterministic="no")
    names = [s.name for s in flashnumba.plan_backward(q, q, q, q, q, lse, kernel="tc", device="sm_90").launches]
    assert names == ["D_i preprocess", "dQ tc", "dK/dV tc"]
    p = flashnumba.plan_backward(q, q, q, q, q, lse, kernel="tc", device="sm_90", deterministic=False)
    assert [s.name for s in p.launches] == ["D_i preprocess", "dK/dV tc + dQ", "dQ convert"]
    assert (p.launches[1].tiles.block_m, p.launches[1].tiles.block_n) == (32, 128)
    assert p.launches[1].table == "tc_dkdv_atomic" and p.launches[1].factory_args[-2] == "v2"
    q32, lse32 = q.astype(np.float32), lse
    p = flashnumba.plan_backward(q32, q32, q32, q32, q32, lse32, device="sm_90", deterministic=False)
    assert [s.name for s in p.launches] == ["D_i preprocess", "dQ v2", "dK/dV v2"]


def test_backward_tc_rejects_what_it_does_not_support():
    rng = np.random.default_rng(0)
    q, k, v = random_qkv(rng, 1, 4, 4, 2, 64, np.float16)
    out, lse = flashnumba.flash_attn_forward(q, k, v)
    with pytest.raises(ValueError, match="block_m"):
        flashnumba.flash_attn_backward(q, q, k, v, out, lse, kernel="tc", block_m=24)
    with pytest.raises(ValueError, match="kernel 'tc'"):
        flashnumba.flash_attn_backward(q, q, k, v, out, lse, kernel="tc", num_threads=64)
    q32, k32, v32 = random_qkv(rng, 1, 4, 4, 1, 64)
    o32, l32 = flashnumba.flash_attn_forward(q32, k32, v32)
    with pytest.raises(TypeError, match="float16 or bfloat16"):
        flashnumba.flash_attn_backward(q32, q32, k32, v32, o32, l32, kernel="tc")


@gpu_sizes
def test_backward_tc_gpu_sizes(seqlen_q, seqlen_k, causal, D, dtype):
    """On the GPU: awkward and long sequences, default tiles, 2 batches x 3 heads; and deterministic."""
    if dtype == "bfloat16":
        dtype = pytest.importorskip("ml_dtypes").bfloat16
    rng = np.random.default_rng(seqlen_q + 3 * seqlen_k + D)
    grads, dout, q, k, v, out, lse = run_backward_tc(rng, 2, seqlen_q, seqlen_k, 3, D, dtype, causal)
    check_backward(grads, dout, q, k, v, out, lse, causal=causal)
    again = flashnumba.flash_attn_backward(dout, q, k, v, out, lse, causal=causal, kernel="tc")
    for g, h in zip(grads, again):
        np.testing.assert_array_equal(np.asarray(g).view(np.uint16), np.asarray(h).view(np.uint16))


def test_default_backward_kernel_is_tc_where_it_applies():
    rng = np.random.default_rng(6)
    q, k, v = random_qkv(rng, 1, 16, 20, 1, 16, np.float16)
    dout = rng.standard_normal(q.shape).astype(np.float16)
    out, lse = flashnumba.flash_attn_forward(q, k, v, causal=True)
    chosen = "v2" if flashnumba.SIMULATOR else "tc"
    got = flashnumba.flash_attn_backward(dout, q, k, v, out, lse, causal=True)
    want = flashnumba.flash_attn_backward(dout, q, k, v, out, lse, causal=True, kernel=chosen)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)


# ---------------------------------------------------------------------------------------------------------------
# The options (GQA, window, softcap, ALiBi, dropout, varlen), forward and backward
# ---------------------------------------------------------------------------------------------------------------

def test_tc_options_match_reference():
    """Every option at once in the simulator (GQA, a two-sided window, softcap, ALiBi, dropout), forward and
    backward, over several tiles each way; each option alone, and causal, at the default tiles on a GPU
    (test_tc_options_gpu_default_tiles). One case: every mma here is 32 simulated threads at a barrier."""
    rng = np.random.default_rng(5)
    nheads, nheads_k, sq, sk = 2, 1, 20, 33
    q, k, v = random_qkv(rng, 1, sq, sk, nheads, 64, np.float16)
    k, v = k[:, :, :nheads_k].copy(), v[:, :, :nheads_k].copy()
    dout = rng.standard_normal(q.shape).astype(np.float16)
    opts = dict(window_size=(6, 2), softcap=2.5, alibi_slopes=np.array([0.3, 0.7], np.float32), dropout_p=0.3,
                dropout_seed=9, dropout_offset=4)
    ref_opts = {n: x for n, x in opts.items() if not n.startswith("dropout")}
    ref_opts["dropout_z"] = reference.dropout_z(9, 4, 1, nheads, sq, sk, 0.3)
    kernel_opts = dict(opts, kernel="tc", block_m=16, block_n=16)
    out, lse = flashnumba.flash_attn_forward(q, k, v, **kernel_opts)
    check_forward(out, lse, q, k, v, **ref_opts)
    grads = flashnumba.flash_attn_backward(dout, q, k, v, out, lse, **kernel_opts)
    check_backward(grads, dout, q, k, v, out, lse, **ref_opts)


def test_tc_gqa_over_several_key_value_heads_with_dropout():
    """Two batch entries, four query heads on two key/value heads, dropout, tiles of 16 over two query and two key
    tiles: the dK/dV kernel of key/value head 1 sums query heads 2 and 3 (each tile of Q_i, dO_i, L_i and D_i read
    at its own head, hk * group + it // nt), each entry with the forward's dropout stream of its batch entry and
    query head (b * nheads + h). test_tc_options_match_reference has one key/value head and one batch entry, where
    a head found as hk + it // nt, or a stream as b * nheads_k + h, passes."""
    rng = np.random.default_rng(41)
    batch, nheads, nheads_k, sq, sk = 2, 4, 2, 20, 24
    q, k, v = random_qkv(rng, batch, sq, sk, nheads, 32, np.float16)
    k, v = k[:, :, :nheads_k].copy(), v[:, :, :nheads_k].copy()
    dout = rng.standard_normal(q.shape).astype(np.float16)
    kernel_opts = dict(dropout_p=0.2, dropout_seed=3, dropout_offset=1, kernel="tc", block_m=16, block_n=16)
    out, lse = flashnumba.flash_attn_forward(q, k, v, **kernel_opts)
    grads = flashnumba.flash_attn_backward(dout, q, k, v, out, lse, **kernel_opts)
    check_backward(grads, dout, q, k, v, out, lse,
                   dropout_z=reference.dropout_z(3, 1, batch, nheads, sq, sk, 0.2))


def test_tc_one_sided_left_window():
    """A left window alone (no right bound, no causal) over tiles of 16 at seqlen 40: key tiles lie inside every
    row's right bound and the sequence yet left of the later rows' left bound, so the masking decision of a tile
    rests on the window's left edge alone (a decision from the tile's first query row instead of its last passed
    every other test), forward and backward."""
    rng = np.random.default_rng(12)
    q, k, v = random_qkv(rng, 1, 40, 40, 1, 32, np.float16)
    dout = rng.standard_normal(q.shape).astype(np.float16)
    opts = dict(window_size=(3, -1), kernel="tc", block_m=16, block_n=16)
    out, lse = flashnumba.flash_attn_forward(q, k, v, **opts)
    check_forward(out, lse, q, k, v, window_size=(3, -1))
    grads = flashnumba.flash_attn_backward(dout, q, k, v, out, lse, **opts)
    check_backward(grads, dout, q, k, v, out, lse, window_size=(3, -1))


def test_tc_window_reaching_one_row_into_a_query_tile():
    """Window (1, 0) at seqlen 40, tiles of 16: key 15 is seen by row 16, the first row of the second query tile,
    so the dK/dV kernel of the first key tile visits two query tiles (rows below min(j0 + B_c, seqlen_k) - diag +
    left; one less and it visits one, which the other window tests, whose bounds end inside a tile, pass)."""
    rng = np.random.default_rng(16)
    q, k, v = random_qkv(rng, 1, 40, 40, 1, 32, np.float16)
    dout = rng.standard_normal(q.shape).astype(np.float16)
    opts = dict(window_size=(1, 0), kernel="tc", block_m=16, block_n=16)
    out, lse = flashnumba.flash_attn_forward(q, k, v, **opts)
    grads = flashnumba.flash_attn_backward(dout, q, k, v, out, lse, **opts)
    check_backward(grads, dout, q, k, v, out, lse, window_size=(1, 0))


def test_tc_varlen_matches_reference():
    """Packed sequences, one empty, causal: each sequence checked as a batch of one."""
    rng = np.random.default_rng(3)
    lens_q, lens_k = [5, 0, 20], [9, 3, 17]
    cu_q, cu_k = (np.concatenate([[0], np.cumsum(n)]).astype(np.int32) for n in (lens_q, lens_k))
    q, dout = (rng.standard_normal((cu_q[-1], 1, 64)).astype(np.float16) for _ in range(2))
    k, v = (rng.standard_normal((cu_k[-1], 1, 64)).astype(np.float16) for _ in range(2))  # (GQA: options test)
    opts = dict(causal=True, kernel="tc", block_m=16, block_n=16)
    out, lse = flashnumba.flash_attn_varlen_forward(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), **opts)
    grads = flashnumba.flash_attn_varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, max(lens_q), max(lens_k),
                                                  **opts)
    for b in range(len(lens_q)):
        rq, rk = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        q_b, k_b, v_b, do_b, o_b = (x[None, r] for x, r in ((q, rq), (k, rk), (v, rk), (dout, rq), (out, rq)))
        l_b = lse[None, :, rq]
        if rq.stop > rq.start:
            check_forward(o_b, l_b, q_b, k_b, v_b, causal=True)
        check_backward([grads[0][None, rq], grads[1][None, rk], grads[2][None, rk]], do_b, q_b, k_b, v_b, o_b, l_b,
                       causal=True)


def test_tc_dropout_close_to_one_does_not_overflow():
    """dropout_p = 0.99999: a kept entry is scaled by 1 / (1 - p) = 1e5, more than float16 holds. The kernels
    round P_ij (<= 1) to 16 bits and apply 1 / (1 - p) in float32 afterwards, as FlashAttention-2 does; with one
    key (P_ij = 1) a kernel that rounded P_ij / (1 - p) would get inf. Seed 302 keeps entry (0, 0, 31, 0)."""
    rng = np.random.default_rng(0)
    q, k, v = random_qkv(rng, 1, 32, 1, 1, 64, np.float16)
    v = (v * np.float16(1e-3)).astype(np.float16)  # the kept row's output, 1e5 v, stays finite in float16
    dout = rng.standard_normal(q.shape).astype(np.float16)
    opts = dict(dropout_p=0.99999, dropout_seed=302, dropout_offset=0)
    z = reference.dropout_z(302, 0, 1, 1, 32, 1, 0.99999)
    assert z.sum() > 0
    out, lse = flashnumba.flash_attn_forward(q, k, v, kernel="tc", block_m=16, block_n=16, **opts)
    assert np.isfinite(np.asarray(out, np.float32)).all()
    check_forward(out, lse, q, k, v, dropout_z=z)
    grads = flashnumba.flash_attn_backward(dout, q, k, v, out, lse, kernel="tc", block_m=16, block_n=16, **opts)
    check_backward(grads, dout, q, k, v, out, lse, dropout_z=z)


@pytest.mark.skipif(flashnumba.SIMULATOR, reason="GPU sizes: minutes per case in the simulator")
@pytest.mark.parametrize("case", ["plain", "causal", "gqa-window", "softcap-alibi-causal", "dropout"])
@pytest.mark.parametrize("D", [40, 64, 128, 176, 256])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_backward_tc_atomic_dq_gpu(case, D, dtype):
    """On the GPU, deterministic=False (the atomic dQ) at its default tiles, over several tiles each way, with
    each option: the float64 reference's bar (check_backward), as the deterministic kernels meet it."""
    if dtype == "bfloat16":
        dtype = pytest.importorskip("ml_dtypes").bfloat16
    rng = np.random.default_rng(D + 3 * len(case))
    nheads, nheads_k, sq, sk = (4, 2, 300, 517) if "gqa" in case else (3, 3, 517, 300)
    q, k, v = random_qkv(rng, 2, sq, sk, nheads, D, dtype)
    k, v = k[:, :, :nheads_k].copy(), v[:, :, :nheads_k].copy()
    dout = rng.standard_normal(q.shape).astype(dtype)
    opts, ref = {}, {}
    if case == "causal":
        opts = dict(causal=True)
    elif case == "gqa-window":
        opts = dict(window_size=(70, 33))
    elif case == "softcap-alibi-causal":
        opts = dict(causal=True, softcap=2.5, alibi_slopes=np.array([0.3, 0.7, 0.05], np.float32))
    elif case == "dropout":
        opts = dict(dropout_p=0.2, dropout_seed=5, dropout_offset=1)
        ref = dict(dropout_z=reference.dropout_z(5, 1, 2, nheads, sq, sk, 0.2))
    ref_opts = {n: x for n, x in opts.items() if not n.startswith("dropout")} | ref
    out, lse = flashnumba.flash_attn_forward(q, k, v, kernel="tc", **opts)
    grads = flashnumba.flash_attn_backward(dout, q, k, v, out, lse, kernel="tc", deterministic=False, **opts)
    check_backward(grads, dout, q, k, v, out, lse, **ref_opts)


@pytest.mark.skipif(flashnumba.SIMULATOR, reason="GPU sizes: minutes per case in the simulator")
@pytest.mark.parametrize("case", ["gqa-window", "softcap-alibi-causal", "dropout", "window-causal-gqa"])
@pytest.mark.parametrize("D", [64, 128, 256])  # (256: two warps a key block in dK/dV)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_tc_options_gpu_default_tiles(case, D, dtype):
    """On the GPU: every option with the default tiles, on sequences that span several tiles in both directions;
    kernel=None gives the same bits as the kernel its plan names (on compute capability 9.0 the Hopper kernels at
    some head dims: those checked against the reference here too)."""
    if dtype == "bfloat16":
        dtype = pytest.importorskip("ml_dtypes").bfloat16
    rng = np.random.default_rng(D + len(case))
    nheads, nheads_k, sq, sk = (4, 2, 300, 517) if "gqa" in case else (3, 3, 517, 300)
    q, k, v = random_qkv(rng, 2, sq, sk, nheads, D, dtype)
    k, v = k[:, :, :nheads_k].copy(), v[:, :, :nheads_k].copy()
    dout = rng.standard_normal(q.shape).astype(dtype)
    ref = {}
    if case == "gqa-window":
        opts = dict(window_size=(70, 33))
    elif case == "window-causal-gqa":
        opts = dict(window_size=(129, 0), causal=True)
    elif case == "softcap-alibi-causal":
        opts = dict(causal=True, softcap=2.5, alibi_slopes=np.array([0.3, 0.7, 0.05], np.float32))
    else:
        opts = dict(dropout_p=0.2, dropout_seed=5, dropout_offset=1)
        ref = dict(dropout_z=reference.dropout_z(5, 1, 2, nheads, sq, sk, 0.2))
    ref_opts = {n: x for n, x in opts.items() if not n.startswith("dropout")} | ref
    out, lse = flashnumba.flash_attn_forward(q, k, v, kernel="tc", **opts)
    check_forward(out, lse, q, k, v, **ref_opts)
    grads = flashnumba.flash_attn_backward(dout, q, k, v, out, lse, kernel="tc", **opts)
    check_backward(grads, dout, q, k, v, out, lse, **ref_opts)
    plan_opts = {n: x for n, x in opts.items() if n not in ("dropout_seed", "dropout_offset")}
    forward_family = flashnumba.plan(q, k, v, **plan_opts).kernel
    out2, lse2 = flashnumba.flash_attn_forward(q, k, v, **opts)
    if forward_family != "tc":
        check_forward(out2, lse2, q, k, v, **ref_opts)
        out, lse = flashnumba.flash_attn_forward(q, k, v, kernel=forward_family, **opts)
    backward_family = flashnumba.plan_backward(dout, q, k, v, out, lse, **plan_opts).kernel
    grads2 = flashnumba.flash_attn_backward(dout, q, k, v, out, lse, **opts)
    if backward_family != "tc":
        check_backward(grads2, dout, q, k, v, out, lse, **ref_opts)
    if (forward_family, backward_family) != ("tc", "tc"):
        grads = flashnumba.flash_attn_backward(dout, q, k, v, out, lse, kernel=backward_family, **opts)
    for a, b in zip((out, lse, *grads), (out2, lse2, *grads2)):
        np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))


@pytest.mark.skipif(flashnumba.SIMULATOR, reason="needs a GPU")
def test_tc_varlen_device_arrays_take_the_tensor_cores():
    """Packed Numba device arrays (given a leading axis through the CUDA array interface, not a copy) are
    C-contiguous, so kernel=None gives them the tensor-core kernels: the same bits as the family the plan names
    (kernel="tc", or "wgmma" on Hopper)."""
    from numba import cuda

    rng = np.random.default_rng(4)
    lens = [70, 0, 200]
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    q, k, v = (rng.standard_normal((cu[-1], 2, 64)).astype(np.float16) for _ in range(3))
    dq, dk, dv, dcu = (cuda.to_device(x) for x in (q, k, v, cu))
    args = (dcu, dcu, max(lens), max(lens))
    family = flashnumba.plan(q[None], k[None], v[None], causal=True).kernel  # tc, or wgmma on Hopper
    assert family in ("tc", "wgmma")
    o_tc, l_tc = flashnumba.flash_attn_varlen_forward(dq, dk, dv, *args, causal=True, kernel=family)
    o_def, l_def = flashnumba.flash_attn_varlen_forward(dq, dk, dv, *args, causal=True)
    o_simt, _ = flashnumba.flash_attn_varlen_forward(dq, dk, dv, *args, causal=True, kernel="v3")
    np.testing.assert_array_equal(o_tc.copy_to_host().view(np.uint16), o_def.copy_to_host().view(np.uint16))
    np.testing.assert_array_equal(l_tc.copy_to_host(), l_def.copy_to_host())
    assert not np.array_equal(o_tc.copy_to_host().view(np.uint16), o_simt.copy_to_host().view(np.uint16))


def _device(x):
    """A device array of x: CuPy on a GPU where installed, else Numba's (simulated under the simulator)."""
    if not flashnumba.SIMULATOR:
        try:
            import cupy

            return cupy.asarray(x)
        except ImportError:
            pass
    from numba import cuda

    return cuda.to_device(x)


def _host(x):
    return x.get() if hasattr(x, "get") else x.copy_to_host()


def test_tc_reads_packed_views_in_place():
    """q, k, v as views of one packed (batch, seqlen, 3, nheads, d) device array are read in place by the tensor-core
    kernels (their strides, :func:`flashnumba.kernels.ptx.cp_async_16_at`): the plan copies nothing, and forward
    and backward give the bits of contiguous copies (bfloat16 views: tests/test_torch.py)."""
    rng = np.random.default_rng(8)
    qkv = rng.standard_normal((1, 17, 3, 1, 64)).astype(np.float16)
    dout = rng.standard_normal((1, 17, 1, 64)).astype(np.float16)
    bits = qkv
    packed = _device(bits)
    views = [packed[:, :, i] for i in range(3)]
    copies = [_device(np.ascontiguousarray(bits[:, :, i])) for i in range(3)]
    p = flashnumba.plan(*views, causal=True, kernel="tc")
    assert p.launches[0].factory_args[6] is True  # strided: read in place
    assert not any(s.copy for s in p.inputs)
    opts = dict(causal=True, kernel="tc", block_n=16, block_m=16)
    o1, l1 = flashnumba.flash_attn_forward(*views, **opts)
    o2, l2 = flashnumba.flash_attn_forward(*copies, **opts)
    np.testing.assert_array_equal(_host(o1), _host(o2))
    np.testing.assert_array_equal(_host(l1), _host(l2))
    d = _device(dout)
    g1 = flashnumba.flash_attn_backward(d, *views, o1, l1, **opts)
    g2 = flashnumba.flash_attn_backward(d, *copies, o2, l2, **opts)
    for a, b in zip(g1, g2):
        np.testing.assert_array_equal(_host(a), _host(b))
    check_forward(_host(o1), _host(l1), *(np.ascontiguousarray(qkv[:, :, i]) for i in range(3)), causal=True)


@pytest.mark.skipif(flashnumba.SIMULATOR, reason="device addresses: needs a GPU")
def test_tc_copies_an_input_that_does_not_start_on_16_bytes():
    """A C-contiguous array whose start is not 16-byte aligned (a view one element into a buffer) is copied
    before the 16-byte copies of the tensor-core kernels read it: the same bits as an aligned copy."""
    cupy = pytest.importorskip("cupy")
    rng = np.random.default_rng(9)
    q = rng.standard_normal((1, 40, 2, 64)).astype(np.float16)
    buf = cupy.zeros(q.size + 1, np.float16)
    buf[1:] = cupy.asarray(q.reshape(-1))
    odd = buf[1:].reshape(q.shape)
    assert odd.data.ptr % 16
    a, la = flashnumba.flash_attn_forward(odd, odd, odd, kernel="tc")
    b, lb = flashnumba.flash_attn_forward(cupy.asarray(q), cupy.asarray(q), cupy.asarray(q), kernel="tc")
    assert bool((a == b).all()) and bool((la == lb).all())


# ---------------------------------------------------------------------------------------------------------------
# Every head dim a multiple of 8 up to 256, forward and backward; a multiple of 8 but not of 16 padded to 16 in
# shared memory (kernel=None takes every one of them on a GPU); above 160 the dK/dV kernel splits the columns of
# dK_j and dV_j between two warps a key block (padded to 32) and the dQ kernel reads A fragments per k-step
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("D", [32, 96, 40])
def test_forward_tc_other_head_dims(D):
    rng = np.random.default_rng(D)
    q, k, v = random_qkv(rng, 1, 17, 33, 1, D, np.float16)
    out, lse = forward_tc(q, k, v, causal=True, block_n=16, warps=1)
    check_forward(out, lse, q, k, v, causal=True)


@pytest.mark.parametrize("D", [96, 24, 176])
def test_backward_tc_other_head_dims(D):
    rng = np.random.default_rng(D)
    sq, sk = (9, 12) if D > 160 else (17, 20)  # (176: one tile each way, the simulator's minutes are per mma)
    grads, dout, q, k, v, out, lse = run_backward_tc(rng, 1, sq, sk, 1, D, np.float16, True, block_m=16,
                                                      block_n=16)
    check_backward(grads, dout, q, k, v, out, lse, causal=True)


def test_backward_tc_two_warps_above_d160():
    """Above d = 160 the dQ kernel reads the A fragments of Q_i and dO_i per k-step from shared memory, each warp at
    its own rows: block_m 32 (two warps) at d = 176, where test_backward_tc_other_head_dims runs one warp (whose rows
    start at 0, so a read from row 0 passes there)."""
    rng = np.random.default_rng(177)
    grads, dout, q, k, v, out, lse = run_backward_tc(rng, 1, 20, 12, 1, 176, np.float16, True, block_m=32,
                                                      block_n=16)
    check_backward(grads, dout, q, k, v, out, lse, causal=True)


def test_padding_the_head_dim_with_zero_columns_changes_nothing():
    """head_dim 40 runs as 48 in shared memory, the 8 columns past 40 zeros: the same bits as a head_dim 48 call
    whose last 8 columns of q, k and v are zeros (at the same softmax scale), forward and backward."""
    rng = np.random.default_rng(40)
    q, k, v = random_qkv(rng, 1, 17, 21, 1, 40, np.float16)
    dout = rng.standard_normal(q.shape).astype(np.float16)
    zeros = [np.concatenate([x, np.zeros(x.shape[:-1] + (8,), x.dtype)], axis=-1) for x in (q, k, v, dout)]
    kw = dict(causal=True, kernel="tc", block_m=16, block_n=16, softmax_scale=40 ** -0.5)
    out, lse = flashnumba.flash_attn_forward(q, k, v, **kw)
    out48, lse48 = flashnumba.flash_attn_forward(*zeros[:3], **kw)
    assert out.shape == q.shape and np.array_equal(out, out48[..., :40]) and np.array_equal(lse, lse48)
    assert not out48[..., 40:].any()
    grads = flashnumba.flash_attn_backward(dout, q, k, v, out, lse, **kw)
    grads48 = flashnumba.flash_attn_backward(zeros[3], *zeros[:3], out48, lse48, **kw)
    for g, g48 in zip(grads, grads48):
        assert g.shape == q.shape[:-1] + (40,) or g.shape == k.shape
        assert np.array_equal(g, g48[..., :40])


def test_head_dims_beyond_the_tensor_cores_are_refused_or_fall_back():
    q = np.zeros((1, 8, 1, 36), np.float16)  # not a multiple of 8
    with pytest.raises(ValueError, match="multiple of 8 up to 256"):
        flashnumba.plan(q, q, q, kernel="tc")
    lse = np.zeros((1, 1, 8), np.float32)
    with pytest.raises(ValueError, match="tensor-core backward supports head_dim a multiple of 8 up to 256"):
        flashnumba.plan_backward(q, q, q, q, q, lse, kernel="tc")
    q = np.zeros((1, 8, 1, 264), np.float16)  # beyond 256: no kernel takes it
    with pytest.raises(ValueError, match=r"head_dim must be in \[1, 256\]"):
        flashnumba.plan(q, q, q, kernel="tc")
    for D, parts in ((160, 1), (192, 2), (256, 2)):  # above 160, two warps a block of 16 keys in dK/dV
        q = np.zeros((1, 8, 1, D), np.float16)
        p = flashnumba.plan_backward(q, q, q, q, q, lse, kernel="tc", block_m=16, block_n=32)
        assert p.kernel == "tc" and [s.block[0] for s in p.launches[1:]] == [32, 64 * parts], (D, p)


GPU_HEAD_DIMS = [d for d in tiling.MMA_HEAD_DIMS if d not in (64, 128)]  # the multiples of 8 to 256


@pytest.mark.skipif(flashnumba.SIMULATOR, reason="GPU sizes: minutes per case in the simulator")
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("D", GPU_HEAD_DIMS)
def test_tc_every_head_dim_gpu(D, dtype):
    """kernel="tc" at every head dim it is built for, awkward lengths, causal and not, with the default tiles,
    forward and backward."""
    import ml_dtypes

    np_dtype = np.float16 if dtype == "float16" else ml_dtypes.bfloat16
    rng = np.random.default_rng(D)
    for sq, sk, causal in ((1, 97, False), (300, 257, True)):
        q, k, v = random_qkv(rng, 2, sq, sk, 2, D, np_dtype)
        out, lse = flashnumba.flash_attn_forward(q, k, v, causal=causal, kernel="tc")
        check_forward(out, lse, q, k, v, causal=causal)
        if D in tiling.MMA_BACKWARD_HEAD_DIMS:
            dout = rng.standard_normal(q.shape).astype(np_dtype)
            grads = flashnumba.flash_attn_backward(dout, q, k, v, out, lse, causal=causal, kernel="tc")
            check_backward(grads, dout, q, k, v, out, lse, causal=causal)


# ---------------------------------------------------------------------------------------------------------------
# The tile copies alone
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("row0, row_end, rows", [(20, 30, 13), (25, 37, 16), (0, 37, 16)])
def test_tile_copy_rows_padding_and_zeros(row0, row_end, rows):
    """mma_tiles.make_load_rows, each thread's source index stepped by whole rows: rows row0 .. row0 + rows - 1 of
    src[b, :, h, :] land in shared memory at a stride of D + PAD elements; rows at or past row_end (read or not:
    the simulator raises on a read outside the array) and the columns from the head dim (56) to the padded one
    (64) are zeros; the PAD columns and the rows past ``rows`` keep what they held."""
    from numba.cuda.types import float16

    from flashnumba.kernels import mma_tiles, ptx

    DG, D, NT, MAX_ROWS = 56, 64, 32, 16
    LD = D + mma_tiles.PAD
    SIZE = MAX_ROWS * LD  # (a shared array's size must be one constant: a product of two is not, on a GPU)
    load = mma_tiles.make_load_rows(D, NT, DG=DG)

    @cuda.jit
    def copy(src, init, out, b, row0, row_end, h, rows):
        smem = cuda.shared.array(SIZE, float16)
        tid = cuda.threadIdx.x
        for e in range(tid, SIZE, NT):
            smem[e] = init[e]
        cuda.syncthreads()
        load(smem, 0, src, b, row0, row_end, h, rows, tid)
        ptx.cp_async_wait_all()
        cuda.syncthreads()
        for e in range(tid, SIZE, NT):
            out[e] = smem[e]

    rng = np.random.default_rng(row0 + rows)
    src = (rng.standard_normal((2, 37, 3, DG)) + 3).astype(np.float16)  # no element is 0
    init = np.full(MAX_ROWS * LD, -7, np.float16)
    out = np.zeros_like(init)
    copy[1, NT](src, init, out, 1, row0, row_end, 2, rows)
    got = out.reshape(MAX_ROWS, LD)
    want = init.reshape(MAX_ROWS, LD).copy()
    for r in range(rows):
        want[r, :D] = 0
        if row0 + r < row_end:
            want[r, :DG] = src[1, row0 + r, 2]
    np.testing.assert_array_equal(got, want)
