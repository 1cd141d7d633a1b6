"""The real kernels compile to PTX for sm_90 and assemble, without a GPU; their resources are reported.

Runs in a subprocess with FLASHNUMBA_SIMULATOR=0, because the test session itself may be using the simulator.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

SCRIPT = r"""
import json, sys
from flashnumba import resources, api, forward
ALL = forward.Variant(has_left=True, has_right=True, softcap=True, alibi=True, varlen=True, dropout=True)
rows = []
for kernel in ("v1", "v2", "v3"):
    for d in (40, 64, 128, 256):
        for dtype in ("float32", "float16") + (("bfloat16",) if d == 128 else ()):
            bm, bn, nt, smem = api.resolve_blocks(kernel, d)
            ptx = resources.kernel_ptx(kernel, d, bm, bn, nt, causal=True, dtype=dtype)
            assert ".target sm_90" in ptx
            r = resources.ptx_resources(ptx)
            del r["log"]
            rows.append(dict(kernel=kernel, head_dim=d, dtype=dtype, block_m=bm, block_n=bn, threads=nt,
                             dynamic_shared=0 if kernel == "v1" else smem, **r))
for kernel in ("v1", "v2"):
    for d in (40, 64, 128, 256):
        bm, bn, nt, smem = api.resolve_blocks_backward(d, kernel=kernel)
        for part, ptx in resources.backward_ptx(kernel, d, bm, bn, nt, causal=True).items():
            assert ".target sm_90" in ptx
            r = resources.ptx_resources(ptx)
            del r["log"]
            dyn = 0 if kernel == "v1" else smem[0 if part == "dkdv" else 1]
            rows.append(dict(kernel=f"bwd_{part}_{kernel}", head_dim=d, dtype="float32", block_m=bm, block_n=bn,
                             threads=nt, dynamic_shared=dyn, **r))
# bfloat16 (uint16 bit patterns, converted on load and store): the v1 backward at one head_dim; the forward
# kernels at head_dim 128 above, and the v2 backward with every option below
bm, bn, nt, smem = api.resolve_blocks_backward(64, kernel="v1")
for part, ptx in resources.backward_ptx("v1", 64, bm, bn, nt, causal=True, dtype="bfloat16").items():
    r = resources.ptx_resources(ptx)
    del r["log"]
    rows.append(dict(kernel=f"bwd_{part}_v1", head_dim=64, dtype="bfloat16", block_m=bm, block_n=bn, threads=nt,
                     dynamic_shared=0, **r))
# every option compiled in (window, softcap, ALiBi): the kernels type-check for the GPU with all of them
for d in (59, 128):
    bm, bn, nt, smem = api.resolve_blocks("v3", d)
    for dtype in ("float32", "float16", "bfloat16"):
        r = resources.ptx_resources(resources.kernel_ptx("v3", d, bm, bn, nt, dtype=dtype, variant=ALL))
        del r["log"]
        rows.append(dict(kernel="v3+all", head_dim=d, dtype=dtype, block_m=bm, block_n=bn, threads=nt,
                         dynamic_shared=smem, **r))
    bm, bn, nt, smem = api.resolve_blocks_backward(d)
    for dtype in ("float32", "bfloat16"):
        for part, ptx in resources.backward_ptx("v2", d, bm, bn, nt, dtype=dtype, variant=ALL).items():
            r = resources.ptx_resources(ptx)
            del r["log"]
            rows.append(dict(kernel=f"bwd_{part}_v2+all", head_dim=d, dtype=dtype, block_m=bm, block_n=bn,
                             threads=nt, dynamic_shared=smem[0 if part == "dkdv" else 1], **r))
# the return_attn_probs debugging kernel, every option but varlen
for dtype, bf16 in (("float32", False), ("bfloat16", True)):
    probs = forward.make_probs_kernel(64, forward.Variant(True, True, True, True, False, True), bf16=bf16)
    a = "uint16[:, :, :, :]" if bf16 else "float32[:, :, :, :]"
    ptx = resources._compile_ptx(probs.py_func, f"void({a}, {a}, float32[:, :, :], float32[:, :, :, :], float32, "
                                 "float32, int64, int64, float32[:, :], float32, float32, uint64, uint64)", (9, 0))
    r = resources.ptx_resources(ptx)
    del r["log"]
    rows.append(dict(kernel="probs+all", head_dim=64, dtype=dtype, block_m=1, block_n=0, threads=128,
                     dynamic_shared=0, **r))
print(json.dumps(rows))
"""


def test_kernels_compile_for_sm90_and_report_resources():
    pytest.importorskip("cuda.bindings.nvjitlink")
    env = dict(os.environ, FLASHNUMBA_SIMULATOR="0", NUMBA_ENABLE_CUDASIM="0")
    proc = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0 and "NVVM" in proc.stderr and "not found" in proc.stderr.lower():
        pytest.skip("NVVM is not installed (pip install numba-cuda[cu13])")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(proc.stdout.strip().splitlines()[-1])
    print()
    print(f"{'kernel':16} {'d':>4} {'dtype':8} {'B_r':>4} {'B_c':>4} {'thr':>4} {'regs':>5} "
          f"{'smem(static)':>12} {'smem(dyn)':>9} {'spill st/ld':>11}")
    for r in rows:
        print(f"{r['kernel']:16} {r['head_dim']:4} {r['dtype']:8} {r['block_m']:4} {r['block_n']:4} {r['threads']:4} "
              f"{r['registers']:5} {r['shared_bytes']:12} {r['dynamic_shared']:9} "
              f"{r['spill_stores']:5}/{r['spill_loads']:<5}")
        assert 0 < r["registers"] <= 255
        # ptxas counts the 1 KB that sm_80+ reserves per block for the system in its "smem" of any kernel that
        # uses shared memory; the 227 KB a block may opt in to excludes it (the backward at d=128 uses exactly
        # 227 KB of dynamic shared memory on the H200)
        own_static = r["shared_bytes"] - 1024 if r["shared_bytes"] >= 1024 else r["shared_bytes"]
        assert own_static + r["dynamic_shared"] <= 227 * 1024


def test_occupancy_calculator():
    from flashnumba.resources import occupancy

    # 128 threads, 168 registers (the v3 forward at d=64), 68096 + 1024 bytes of shared memory
    assert occupancy(168, 68096, 128)[:3] == (3, 12, 12 / 64)  # 3 by registers, and 3 by shared memory
    assert occupancy(32, 0, 256)[:3] == (8, 64, 1.0)
    assert occupancy(16, 0, 1024) == (2, 64, 1.0, "threads")
    assert occupancy(255, 0, 128)[:2] == (2, 8) and occupancy(255, 0, 128)[3] == "registers"
    assert occupancy(64, 150016, 128)[0] == 1  # the dK/dV kernel at d=128: one block by shared memory
    assert occupancy(64, 150016, 128)[3] == "shared memory"
