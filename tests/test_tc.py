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
from conftest import check_forward, random_qkv
from flashnumba import forward_tc


@pytest.mark.parametrize("seqlen_q, seqlen_k, nheads", [(16, 16, 1), (17, 80, 1), (80, 17, 2), (64, 64, 1)])
def test_forward_tc_matches_reference(seqlen_q, seqlen_k, nheads):
    rng = np.random.default_rng(seqlen_q * 100 + seqlen_k)
    q, k, v = random_qkv(rng, 1, seqlen_q, seqlen_k, nheads, 64, np.float16)
    out, lse = forward_tc.flash_attn_forward_tc(q, k, v)
    check_forward(out, lse, q, k, v)


@pytest.mark.parametrize("seqlen_q, seqlen_k", [(17, 80), (80, 17)])
def test_forward_tc_causal(seqlen_q, seqlen_k):
    """Bottom-right aligned; with seqlen_q > seqlen_k the first rows see no key (out 0, lse -inf)."""
    rng = np.random.default_rng(7 + seqlen_q)
    q, k, v = random_qkv(rng, 1, seqlen_q, seqlen_k, 1, 64, np.float16)
    out, lse = forward_tc.flash_attn_forward_tc(q, k, v, causal=True)
    check_forward(out, lse, q, k, v, causal=True)


def test_forward_tc_head_dim_128_and_scale():
    rng = np.random.default_rng(3)
    q, k, v = random_qkv(rng, 1, 17, 40, 1, 128, np.float16)
    out, lse = forward_tc.flash_attn_forward_tc(q, k, v, softmax_scale=0.3)
    check_forward(out, lse, q, k, v, softmax_scale=0.3)


def test_forward_tc_rejects_what_it_does_not_support():
    rng = np.random.default_rng(0)
    q, k, v = random_qkv(rng, 1, 4, 4, 1, 64)
    with pytest.raises(TypeError, match="float16"):
        forward_tc.flash_attn_forward_tc(q, k, v)
    q, k, v = random_qkv(rng, 1, 4, 4, 1, 40, np.float16)
    with pytest.raises(ValueError, match="head_dim"):
        forward_tc.flash_attn_forward_tc(q, k, v)
    q, k, v = random_qkv(rng, 1, 4, 4, 2, 64, np.float16)
    with pytest.raises(ValueError, match="GQA"):
        forward_tc.flash_attn_forward_tc(q, k[:, :, :1], v[:, :, :1])


def test_flash_attn_forward_kernel_tc():
    """The opt-in through the public API: the same kernel; window (-1, 0) is causal."""
    rng = np.random.default_rng(5)
    q, k, v = random_qkv(rng, 1, 16, 20, 1, 64, np.float16)
    out, lse = flashnumba.flash_attn_forward(q, k, v, window_size=(-1, 0), kernel="tc")
    check_forward(out, lse, q, k, v, causal=True)


@pytest.mark.parametrize("opts", [dict(softcap=1.0), dict(window_size=(3, 0)), dict(block_m=64),
                                  dict(dropout_p=0.1, dropout_seed=1)])
def test_flash_attn_forward_kernel_tc_rejects_other_options(opts):
    q, k, v = random_qkv(np.random.default_rng(0), 1, 4, 4, 1, 64, np.float16)
    with pytest.raises(ValueError, match="kernel 'tc'"):
        flashnumba.flash_attn_forward(q, k, v, kernel="tc", **opts)


# ---------------------------------------------------------------------------------------------------------------
# The GPU path compiles: PTX for sm_90, assembled by nvJitLink, without a GPU
# ---------------------------------------------------------------------------------------------------------------

COMPILE = r"""
import json
from flashnumba import forward_tc, resources
a = "float16[:, :, :, :]"
sig = f"void({a}, {a}, {a}, {a}, float32[:, :, :], float32)"
out = {}
for D in (64, 128):
    for causal in (False, True):
        text = resources._compile_ptx(forward_tc.make_forward_tc(D, causal).py_func, sig, (9, 0))
        r = resources.ptx_resources(text)
        out[f"D={D} causal={causal}"] = dict(ptx=text, **r)
print(json.dumps(out))
"""


def test_forward_tc_compiles_for_sm90():
    pytest.importorskip("cuda.bindings.nvjitlink")
    import json

    env = dict(os.environ, FLASHNUMBA_SIMULATOR="0", NUMBA_ENABLE_CUDASIM="0")
    proc = subprocess.run([sys.executable, "-c", COMPILE], env=env, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0 and "NVVM" in proc.stderr and "not found" in proc.stderr.lower():
        pytest.skip("NVVM is not installed (pip install numba-cuda[cu13])")
    assert proc.returncode == 0, proc.stderr[-3000:]
    kernels = json.loads(proc.stdout.strip().splitlines()[-1])
    for name, r in kernels.items():
        text = r["ptx"]
        assert ".target sm_90" in text
        for needle in ("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32", "ldmatrix.sync.aligned.m8n8.x4.shared",
                       "ldmatrix.sync.aligned.m8n8.x4.trans", "cvt.rn.f16x2.f32"):
            assert needle in text, f"{name}: no {needle!r} in its PTX"
        print(f"{name}: {r['registers']} registers, {r['spill_stores']} spill stores, {r['spill_loads']} spill loads")
        assert 0 < r["registers"] <= 255
