"""Every kernel the default plans choose (and the tensor-core and TF32 kernels chosen with ``kernel=``) builds for
sm_75, sm_80, sm_86 and sm_90 without a GPU, and fits that architecture: registers (255 a thread, 64 K a block),
shared memory (static + dynamic within what a block may use there), no stack frame that would spill to local
memory beyond what the assembler reports. (sm_89 is left out: its limits a block are sm_86's, so its plans choose
the same kernels, and it has the same instructions.)

Runs in subprocesses with FLASHNUMBA_SIMULATOR=0 (the test session itself may be using the simulator); the plans
are made for each architecture's limits (``device="sm_80"``). NVVM (numba-cuda) compiles the kernels to PTX for
sm_75 and for sm_80, and nvJitLink assembles them for each target: sm_80, sm_86 and sm_90 share one subprocess,
in which every kernel of their plans is compiled to PTX for sm_80 (once where plans share it) and assembled for
its target, as the CUDA driver assembles PTX written for an older architecture. (Those assembled from sm_80's PTX
for another target are not stored in the disk cache; the GPU profile compiles every kernel for the GPU's own
architecture.) The Hopper kernels that sm_90's default plans choose (wgmma, setmaxnreg) have only their own
sm_90a PTX.

Per push (the ``ci`` profile, conftest.FULL_COMPILE false) sm_75 and sm_80 compile the default plans of three
cases, one a kernel family's tightest fit: float32 at d=256 (the SIMT kernels' largest tiles in shared memory),
float16 at d=128 with every option (the tensor-core kernels with the most state), bfloat16 at d=128. The ``gpu``
profile, or ``FLASHNUMBA_FULL_COMPILE=1``, compiles every case below for every architecture and the ``kernel=``
tensor-core and TF32 kernels at other head dims.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import FULL_COMPILE
from flashnumba import tiling

SCRIPT = r"""
import json, sys
import numpy as np
import flashnumba
from flashnumba import _launch, planner
ptx_of = {}  # a kernel's PTX, compiled once for sm_80 where its target is sm_80 or newer
real_compile_ptx, real_store = _launch.compile_ptx, _launch._cache.store
def compile_kernel(spec, sig, cc):
    cc = tuple(cc)[:2]
    if spec.arch_specific:  # (the Hopper kernels: their own sm_90a PTX, no other target's)
        return _launch.compile_kernel(spec, sig, cc)
    base = (8, 0) if cc >= (8, 0) else cc
    key = _launch._cache_key(spec, sig, base)
    def compile_ptx(pyfunc, signature, target, launch_bounds=None):
        if key not in ptx_of:
            ptx_of[key] = real_compile_ptx(pyfunc, signature, base, launch_bounds)
        return ptx_of[key].replace(f".target sm_{base[0]}{base[1]}", f".target sm_{target[0]}{target[1]}", 1)
    _launch.compile_ptx = compile_ptx
    if cc != base:  # (not stored under the target's key: it is not that target's own compile)
        _launch._cache.store = lambda *args, **kwargs: None
    try:
        return _launch.compile_kernel(spec, sig, cc)
    finally:
        _launch.compile_ptx = real_compile_ptx
        _launch._cache.store = real_store
planner.compile_kernel = compile_kernel
result = {}
for arch in sys.argv[1:]:
  rng = np.random.default_rng(0)
  rows = result[arch] = []
  exec(BODY)
print(json.dumps(result))
"""

BODY = r"""
def add(p):
    for r, s in zip(p.resources(), p.launches):
        threads = int(np.prod(s.block))
        rows.append(dict(plan=f"{p.pass_} {p.kernel} {p.dtype} d={p.head_dim} {p.options}", kernel=r["kernel"],
                         threads=threads, dynamic_shared=s.shared_bytes,
                         **{k: v for k, v in r.items() if k != "kernel"}))
cases = [(np.float32, 64, {}), (np.float32, 128, {"causal": True}), (np.float32, 256, {}),
         (np.float16, 64, {"causal": True}), (np.float16, 128, {}), (np.float16, 96, {}),
         (np.float16, 128, dict(window_size=(8, 3), softcap=5.0, alibi_slopes=np.ones(4, np.float32),
                                dropout_p=0.1))]
import ml_dtypes
cases.append((ml_dtypes.bfloat16, 128, {"causal": True}))
if not FULL:  # per push: one case a family (see the module docstring)
    cases = [cases[2], cases[6], cases[7]]
for dtype, d, opts in cases:
    q, k, v = (rng.standard_normal((1, 64, 4, d)).astype(dtype) for _ in range(3))
    add(flashnumba.plan(q, k, v, device=arch, **opts))
    out, lse = q.copy(), np.zeros((1, 4, 64), np.float32)
    add(flashnumba.plan_backward(q, q, k, v, out, lse, device=arch, **opts))
if FULL and arch != "sm_75":  # kernel="tc" at other head dims: 96 and 40 (both passes), 160 (both), 256 (forward)
    for d, opts in ((96, {}), (40, {}), (160, {"causal": True})):
        q, k, v = (rng.standard_normal((1, 64, 4, d)).astype(np.float16) for _ in range(3))
        add(flashnumba.plan(q, k, v, kernel="tc", device=arch, **opts))
        add(flashnumba.plan_backward(q, q, k, v, q.copy(), np.zeros((1, 4, 64), np.float32), kernel="tc",
                                     device=arch, **opts))
    q = rng.standard_normal((1, 64, 4, 256)).astype(np.float16)
    add(flashnumba.plan(q, q, q, kernel="tc", device=arch))
    for kernel in ("tf32", "3xtf32"):
        q, k, v = (rng.standard_normal((1, 64, 4, 128)).astype(np.float32) for _ in range(3))
        add(flashnumba.plan(q, k, v, kernel=kernel, causal=True, device=arch))
"""


ALL_ARCH_GROUPS = [("sm_75",), ("sm_80", "sm_86", "sm_90")]  # one subprocess each (sm_89: see above)
# per push the SIMT targets and the first tensor-core one: sm_86 assembles sm_80's PTX (its plans differ in tiles,
# not in kernels), and sm_90's default plans take the Hopper kernels, which tests/test_wgmma.py compiles per push
ARCH_GROUPS = ALL_ARCH_GROUPS if FULL_COMPILE else [("sm_75",), ("sm_80",)]


@pytest.mark.parametrize("archs", ARCH_GROUPS, ids=["-".join(g) for g in ARCH_GROUPS])
def test_planned_kernels_compile_and_fit(archs, tmp_path):
    pytest.importorskip("cuda.bindings.nvjitlink")
    assert set(tiling.ARCHS) - {"sm_89"} == {a for g in ALL_ARCH_GROUPS for a in g}  # every other target tested
    env = dict(os.environ, FLASHNUMBA_SIMULATOR="0", NUMBA_ENABLE_CUDASIM="0",
               FLASHNUMBA_CACHE_DIR=os.environ.get("FLASHNUMBA_TEST_CACHE_DIR", str(tmp_path / "cache")))
    env.pop("FLASHNUMBA_MAX_SHARED_BYTES", None)
    script = f"BODY = {BODY!r}\nFULL = {FULL_COMPILE!r}\n{SCRIPT}"
    proc = subprocess.run([sys.executable, "-c", script, *archs], env=env, capture_output=True, text=True,
                          timeout=2400)
    if proc.returncode != 0 and "NVVM" in proc.stderr and "not found" in proc.stderr.lower():
        pytest.skip("NVVM is not installed (pip install numba-cuda[cu13])")
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    for arch in archs:
        _check_fit(arch, result[arch])


def _check_fit(arch, rows):
    lim = tiling.ARCHS[arch]
    print(f"\n{arch}: {lim.name}, {lim.max_shared_per_block} bytes of shared memory per block")
    print(f"{'plan':52} {'kernel':16} {'thr':>4} {'regs':>5} {'static':>7} {'dynamic':>8} {'spill st/ld':>11}")
    kinds = set()
    for r in rows:
        print(f"{r['plan'][:52]:52} {r['kernel']:16} {r['threads']:4} {r['registers']:5} {r['static_shared_bytes']:7} "
              f"{r['dynamic_shared']:8} {r['spill_stores']:5}/{r['spill_loads']:<5}")
        kinds.add(r["plan"].split()[1])
        assert 0 < r["registers"] <= tiling.MAX_REGISTERS_PER_THREAD
        assert r["registers"] * r["threads"] <= 65536  # registers of one block
        # ptxas counts the 1 KB that sm_80+ reserves per block in the "smem" of a kernel that uses shared memory;
        # what a block may opt in to excludes it
        static = r["static_shared_bytes"] - 1024 if r["static_shared_bytes"] >= 1024 and lim.cc >= (8, 0) \
            else r["static_shared_bytes"]
        assert static <= tiling.STATIC_SHARED_LIMIT
        assert static + r["dynamic_shared"] <= lim.max_shared_per_block, r
    # the tensor-core families where the architecture has mma.sync m16n8k16 (on sm_90 the default plans take the
    # Hopper kernels at some head dims, and on it alone); the SIMT ones on sm_75
    assert bool(kinds & {"tc", "wgmma"}) == (lim.cc >= (8, 0))
    assert "wgmma" not in kinds or tuple(lim.cc) == (9, 0)
    assert "v3" in kinds and "v2" in kinds


def test_occupancy_calculator():
    from flashnumba.tools.resources import occupancy

    # 128 threads, 168 registers (the v3 forward at d=64), 68096 + 1024 bytes of shared memory
    assert occupancy(168, 68096, 128)[:3] == (3, 12, 12 / 64)  # 3 by registers, and 3 by shared memory
    assert occupancy(32, 0, 256)[:3] == (8, 64, 1.0)
    assert occupancy(16, 0, 1024) == (2, 64, 1.0, "threads")
    assert occupancy(255, 0, 128)[:2] == (2, 8) and occupancy(255, 0, 128)[3] == "registers"
    assert occupancy(64, 150016, 128)[0] == 1  # the dK/dV kernel at d=128: one block by shared memory
    assert occupancy(64, 150016, 128)[3] == "shared memory"
    assert occupancy(32, 0, 1024, tiling.ARCHS["sm_75"]) == (1, 32, 1.0, "threads")


def test_resources_are_read_from_the_assemblers_log_and_unknown_without_it():
    """The figures a plan reports come from the assembler's log; where it states none (CUDA's compute cache served
    the link and no assembler ran: an empty log), each is None, never an unmeasured 0."""
    from flashnumba._launch import resources_from_log

    log = ("ptxas info    : Function properties for k\n"
           "ptxas         .     8 bytes stack frame, 24 bytes spill stores, 20 bytes spill loads\n"
           "ptxas info    : Used 168 registers, used 16 barriers, 8 bytes cumulative stack size, 48 bytes smem\n")
    assert resources_from_log(log) == dict(registers=168, static_shared_bytes=48, spill_stores=24, spill_loads=20,
                                           stack_bytes=8)
    assert resources_from_log("ptxas info    : Used 10 registers, used 0 barriers")["spill_stores"] == 0
    assert set(resources_from_log("").values()) == {None}
    assert set(resources_from_log("info    : 8 bytes gmem\n").values()) == {None}


def test_a_loaded_kernel_states_its_registers_and_local_memory_where_the_log_did_not():
    """Where the log stated nothing, the loaded kernel's attributes give registers, static shared memory and local
    memory (the driver's figures, each asked by its own attribute); spills stay unknown."""
    import types

    from flashnumba._launch import loaded_resources

    names = ("CU_FUNC_ATTRIBUTE_NUM_REGS", "CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES", "CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES")
    values = dict(zip(names, (232, 16, 40)))
    asked = []

    def get(attribute, function):
        asked.append((attribute, function))
        return 0, values[attribute]

    drv = types.SimpleNamespace(CUfunction_attribute=types.SimpleNamespace(**{n: n for n in names}),
                                cuFuncGetAttribute=get)
    r = loaded_resources(drv, "fn")
    assert r == dict(registers=232, static_shared_bytes=16, stack_bytes=40)
    assert asked == [(n, "fn") for n in names]
    drv.cuFuncGetAttribute = lambda attribute, function: (1, 0)
    with pytest.raises(RuntimeError, match="cuFuncGetAttribute"):
        loaded_resources(drv, "fn")


BOUND = r"""
import numpy as np, flashnumba
from flashnumba import _launch
_launch._function = lambda compiled, device_id, shared_bytes: 0  # no GPU: nothing to load
rng = np.random.default_rng(0)
n = 0
cases = [(np.float16, 128, dict(dropout_p=0.2, window_size=(5, 1))),  # tensor cores; the seed and offset patched
         (np.float32, 40, dict(alibi_slopes=np.ones(4, np.float32), softcap=3.0)),  # SIMT; the slopes' array
         (np.float16, 64, dict(causal=True))]
if not FULL:  # per push: the first, at d=64 (the layout is the same at every d; it compiles faster)
    cases = [(np.float16, 64, cases[0][2])]
for dtype, d, opts in cases:
    q = rng.standard_normal((2, 50, 4, d)).astype(dtype)
    lse = np.zeros((2, 4, 50), np.float32)
    for p in (flashnumba.plan(q, q, q, device="sm_90", **opts),
              flashnumba.plan_backward(q, q, q, q, q, lse, device="sm_90", **opts)):
        for s in p.launches:
            b = _launch.Bound(s, p.arrays, p.scalars, (9, 0), 0)  # raises if the layout differs from the PTX's
            values = {name: 4096 * (i + 1) for i, name in enumerate(list(p.arrays) + ["seed", "offset"])}
            b.launch = lambda *args: None
            b(values, 0)
            for slot, name in b.patches:
                assert b.words[slot] == values[name]
            fixed = dict(b.patches[:1])  # a constant address written once: no longer patched, kept at every call
            b.fix({name: 77 for name in fixed.values()})
            b(values, 0)
            assert all(b.words[slot] == 77 for slot in fixed) and not set(fixed) & {s for s, _ in b.patches}
            n += 1
print(n)
"""


def test_launch_parameters_match_the_compiled_kernels(tmp_path):
    """The parameter buffer the launch layer builds for each kernel of a plan has the PTX's own parameter sizes in
    order, and the per-call pointers land in their slots (offline: compiled, not loaded). Per push, the plans of
    the tensor-core family with its per-call and array parameters (dropout's seed and offset, a window);
    FULL_COMPILE, the SIMT family with ALiBi's slopes and a plain causal tensor-core plan too."""
    pytest.importorskip("cuda.bindings.nvjitlink")
    env = dict(os.environ, FLASHNUMBA_SIMULATOR="0", NUMBA_ENABLE_CUDASIM="0",
               FLASHNUMBA_CACHE_DIR=os.environ.get("FLASHNUMBA_TEST_CACHE_DIR", str(tmp_path / "cache")))
    proc = subprocess.run([sys.executable, "-c", f"FULL = {FULL_COMPILE!r}\n{BOUND}"], env=env, capture_output=True,
                          text=True, timeout=1500)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert int(proc.stdout.strip().splitlines()[-1]) == (12 if FULL_COMPILE else 4)  # 4 launches a plan pair
