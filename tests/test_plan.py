"""Plans: every kernel family at every head dim and dtype it supports gets a fitting plan with default arguments on
each architecture flashnumba supports (shared-memory limits only: pure Python, no compile), the choice of family
and its reasons, the shared-memory cap, and clear errors for tiles that cannot fit."""

from __future__ import annotations

import numpy as np
import pytest

import flashnumba
from flashnumba import planner as planmod, tiling
from flashnumba._backend import cuda

ARCHS = list(tiling.ARCHS)


@pytest.fixture(autouse=True)
def _no_shared_cap(monkeypatch):
    """These tests read the tables at each architecture's own limits; the tests of the cap set it themselves."""
    monkeypatch.delenv("FLASHNUMBA_MAX_SHARED_BYTES", raising=False)


def _dims(table):
    """The head dims a family is built for."""
    from flashnumba.kernels import mma_tf32, wgmma_forward

    return {"tc": tiling.MMA_HEAD_DIMS, "tc_dq": tiling.MMA_BACKWARD_HEAD_DIMS,
            "tc_dkdv": tiling.MMA_BACKWARD_HEAD_DIMS, "tc_dkdv_atomic": tiling.MMA_BACKWARD_HEAD_DIMS,
            "tf32": mma_tf32.HEAD_DIMS, "3xtf32": mma_tf32.HEAD_DIMS, "tf32_dq": mma_tf32.HEAD_DIMS,
            "tf32_dkdv": mma_tf32.HEAD_DIMS, "wgmma": wgmma_forward.HEAD_DIMS}.get(table, range(1, 257))


@pytest.mark.parametrize("arch", ARCHS)
def test_every_family_has_a_fitting_default_at_every_head_dim(arch):
    lim = tiling.ARCHS[arch]
    for table in ("v1", "v2", "v3", "bwd_v1", "bwd_v2"):
        for d in range(1, 257):
            c = tiling.default(table, d, lim)
            assert tiling.fits(table, d, c.tiles, lim), (table, d, c)
    if lim.cc >= tiling.MMA_MIN_CC:
        for table in ("tc", "tc_dq", "tc_dkdv", "tc_dkdv_atomic", "tf32", "3xtf32"):
            for d in _dims(table):
                assert tiling.fits(table, d, tiling.default(table, d, lim).tiles, lim)
    if tuple(lim.cc) == (9, 0):  # (the Hopper kernel: sm_90a only)
        for d in _dims("wgmma"):
            assert tiling.fits("wgmma", d, tiling.default("wgmma", d, lim).tiles, lim)


@pytest.mark.parametrize("cap", [65536, 101376, 166912])
def test_defaults_fit_under_a_shared_memory_cap(cap, monkeypatch):
    monkeypatch.setenv("FLASHNUMBA_MAX_SHARED_BYTES", str(cap))
    lim = tiling.capped(tiling.ARCHS["sm_90"])
    assert lim.max_shared_per_block == cap
    for table in tiling.TABLES:
        if table.startswith("wgmma"):  # (Hopper's kernels, opt-in: the caps stand for smaller GPUs, without wgmma)
            continue
        for d in _dims(table):
            t = tiling.default(table, d, lim).tiles
            for part in tiling._parts(table):
                nbytes, static = tiling.shared_bytes(part, d, t)
                assert nbytes <= (tiling.STATIC_SHARED_LIMIT if static else cap)


def _qkv(dtype, d, n=64, heads=4):
    rng = np.random.default_rng(0)
    return [rng.standard_normal((1, n, heads, d)).astype(dtype) for _ in range(3)]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_default_plans_on_each_architecture(arch, dtype):
    if dtype == "bfloat16":
        ml_dtypes = pytest.importorskip("ml_dtypes")
        dt = ml_dtypes.bfloat16
    else:
        dt = np.dtype(dtype)
    lim = tiling.ARCHS[arch]
    for d in (8, 40, 64, 96, 128, 256):
        q, k, v = _qkv(dt, d)
        for causal in (False, True):
            p = flashnumba.plan(q, k, v, causal=causal, device=arch)
            pb = flashnumba.plan_backward(q, q, k, v, q, np.zeros((1, 4, 64), np.float32), causal=causal,
                                          device=arch)
            for pl in (p, pb):
                for s in pl.launches:
                    assert s.shared_bytes <= lim.max_shared_per_block
                    assert int(np.prod(s.block)) <= 1024
                    assert s.grid[0] >= 1 and s.grid[1] == (4 if s.name != "dK/dV tc" else 4)
                text = str(pl)
                assert lim.name in text and pl.why in text
            # (a plan for a named architecture is that GPU's, in the simulator too: tensor cores from 8.0)
            if dt == np.float32 or arch == "sm_75":
                assert p.kernel == "v3" and pb.kernel == "v2"
            else:
                assert {p.kernel, pb.kernel} <= ({"tc", "wgmma"} if arch == "sm_90" else {"tc"})


def test_the_simulator_runs_the_simt_kernels_unless_asked_or_planning_for_a_named_gpu():
    """Without device=, the simulator's own default for float16 is the SIMT kernels (the simulated tensor cores are
    slow), said in the plan; a plan for a named architecture is what that GPU would run, and the checks of a kernel
    asked for hold for that architecture."""
    q, k, v = _qkv(np.float16, 64)
    p = flashnumba.plan(q, k, v)
    if flashnumba.SIMULATOR:
        assert p.kernel == "v3" and "the simulator" not in str(p.fallback)
    assert flashnumba.plan(q, k, v, device="sm_80").kernel == "tc"
    assert flashnumba.plan(q, k, v, device="sm_90").kernel == "wgmma"
    p = flashnumba.plan(q, k, v, device="sm_75")
    assert p.kernel == "v3" and "compute capability 7.5" in p.fallback
    with pytest.raises(ValueError, match="compute capability 9.0 only"):
        flashnumba.plan(q, k, v, kernel="wgmma", device="sm_80")
    with pytest.raises(ValueError, match="8.0 or newer"):
        flashnumba.plan(q, k, v, kernel="tc", device="sm_75")


def test_family_choice_and_reasons_for_a_gpu(monkeypatch):
    """What kernel=None chooses on a GPU (the simulator is told it is not one for this test)."""
    monkeypatch.setattr(planmod, "SIMULATOR", False)
    q, k, v = _qkv(np.float16, 64)
    p = planmod.forward_plan(*[_t(n, x) for n, x in zip("qkv", (q, k, v))], _opts(q, k), device="sm_80")
    assert p.kernel == "tc" and p.fallback is None
    p = planmod.forward_plan(*[_t(n, x) for n, x in zip("qkv", (q, k, v))], _opts(q, k), device="sm_75")
    assert p.kernel == "v3" and "compute capability 7.5" in p.fallback
    q, k, v = _qkv(np.float16, 80, n=4096, heads=1)  # (the Hopper forward is built for multiples of 32: 80 runs
    # padded to 96, from 4096 keys)
    p = planmod.forward_plan(*[_t(n, x) for n, x in zip("qkv", (q, k, v))], _opts(q, k), device="sm_90")
    assert p.kernel == "wgmma" and p.fallback is None and "run as 96" in p.launches[0].reason
    q, k, v = _qkv(np.float16, 80)  # (64 keys: the copies would cost more than they buy)
    p = planmod.forward_plan(*[_t(n, x) for n, x in zip("qkv", (q, k, v))], _opts(q, k), device="sm_90")
    assert p.kernel == "tc" and "4096 keys" in p.why
    q, k, v = _qkv(np.float16, 40)  # a multiple of 8, not of 16: padded in shared memory by the mma.sync kernel
    p = planmod.forward_plan(*[_t(n, x) for n, x in zip("qkv", (q, k, v))], _opts(q, k), device="sm_80")
    assert p.kernel == "tc" and p.fallback is None
    q, k, v = _qkv(np.float16, 36)
    p = planmod.forward_plan(*[_t(n, x) for n, x in zip("qkv", (q, k, v))], _opts(q, k), device="sm_90")
    assert p.kernel == "v3" and "head_dim" in p.fallback
    q, k, v = _qkv(np.float32, 64)
    p = planmod.forward_plan(*[_t(n, x) for n, x in zip("qkv", (q, k, v))], _opts(q, k), device="sm_90")
    assert p.kernel == "v3" and p.fallback is None
    with pytest.raises(ValueError, match="compute capability 8.0"):
        planmod.forward_plan(*[_t(n, x) for n, x in zip("qkv", _qkv(np.float16, 64))], _opts(q, k), kernel="tc",
                             device="sm_75")


def test_hopper_default_choice(monkeypatch):
    """On compute capability 9.0 kernel=None takes the Hopper kernels at their default head dims, and the
    mma.sync kernels, with the reason in the plan, for block masks, deterministic=False and (without CuPy only)
    strided inputs."""
    import dataclasses

    from flashnumba._validate import check_options

    monkeypatch.setattr(planmod, "SIMULATOR", False)
    lse = np.zeros((1, 4, 64), np.float32)

    def plans(d, n=64, **kw):
        q, k, v = _qkv(np.float16, d, n=n)
        lse_n = lse if n == 64 else np.zeros((1, 4, n), np.float32)
        return (flashnumba.plan(q, k, v, device="sm_90"),
                flashnumba.plan_backward(q, q, k, v, q, lse_n, device="sm_90", **kw))

    assert tiling.WGMMA_DEFAULT_HEAD_DIMS == {"forward": (32, 64, 96, 128, 160, 192, 224, 256),
                                              "backward": (32, 64, 96, 128, 160, 192, 224, 256)}  # (measured)
    for d in (32, 64, 96, 128, 160, 192, 224, 256):
        fwd, bwd = plans(d)
        assert fwd.kernel == ("wgmma" if d in tiling.WGMMA_DEFAULT_HEAD_DIMS["forward"] else "tc")
        assert bwd.kernel == ("wgmma" if d in tiling.WGMMA_DEFAULT_HEAD_DIMS["backward"] else "tc")
        assert fwd.fallback is None and bwd.fallback is None
        if fwd.kernel == "tc":
            assert "not wgmma" in fwd.why and "head_dim" in fwd.why
    # other multiples of 8 from 40 on: padded to the next multiple of 32 (measured the faster at 40 .. 200)
    assert tiling.WGMMA_PADDED_DEFAULT_HEAD_DIMS["forward"][:4] == (40, 48, 56, 72)
    assert tiling.WGMMA_PADDED_DEFAULT_HEAD_DIMS["backward"][-3:] == (232, 240, 248)
    assert plans(40, n=4096)[1].kernel == "wgmma" and plans(24, n=4096)[1].kernel == "tc"
    assert plans(40)[1].kernel == "tc" and "4096 keys" in plans(40)[1].why  # (short: the copies would not pay)
    monkeypatch.setattr(tiling, "WGMMA_PADDED_DEFAULT_HEAD_DIMS", {"forward": (80,), "backward": ()})
    fwd, bwd = plans(80, n=4096)
    assert fwd.kernel == "wgmma" and "head_dim 80 run as 96" in fwd.launches[0].reason and fwd.head_dim == 80
    assert bwd.kernel == "tc" and "not wgmma" in bwd.why
    monkeypatch.setattr(planmod._arrays, "cupy", None)  # (numba device arrays: the padded copies need CuPy)
    q, k, v = (cuda.to_device(x) for x in _qkv(np.float16, 80, n=4096, heads=1))
    assert "need CuPy" in flashnumba.plan(q, k, v, device="sm_90").why
    with pytest.raises(ValueError, match="needs CuPy"):  # (asked for: refused by the plan, before any launch)
        flashnumba.plan(q, k, v, device="sm_90", kernel="wgmma")
    monkeypatch.undo()
    monkeypatch.setattr(planmod, "SIMULATOR", False)
    fwd, bwd = plans(128, deterministic=False)
    assert bwd.kernel == "tc" and "deterministic=False" in bwd.why
    fwd, bwd = planmod.forward_plan(*[_t(n, x) for n, x in zip("qkv", _qkv(np.float16, 128))],
                                    _opts(*_qkv(np.float16, 128)[:2]), device="sm_80"), None
    assert fwd.kernel == "tc" and "wgmma" not in fwd.why
    # a strided q (heads before rows) takes the Hopper kernels as a contiguous one does (they copy it: the same
    # bits whatever the layout), and keeps mma.sync (which reads it in place) only without CuPy; a block mask
    # keeps mma.sync
    q, k, v = _qkv(np.float16, 128)
    tq = dataclasses.replace(_t("q", q), kind="cai", strides=(64 * 4 * 256, 256, 64 * 256, 2))
    lim = tiling.ARCHS["sm_90"]
    monkeypatch.setattr(planmod._arrays, "cupy", object())
    assert planmod._hopper_blocker("forward", tq, (tq,), _opts(q, k), lim, True) is None
    monkeypatch.setattr(planmod._arrays, "cupy", None)
    assert "strided" in planmod._hopper_blocker("forward", tq, (tq,), _opts(q, k), lim, True)
    opts = dataclasses.replace(check_options(tq, _t("k", k), False, (-1, -1), 0.0, None, 0.0, None),
                               block_mask=(128, 128))
    assert "block mask" in planmod._hopper_blocker("forward", _t("q", q), (_t("q", q),), opts, lim, True)
    assert planmod._hopper_blocker("forward", _t("q", q), (_t("q", q),), _opts(q, k), lim, True) is None
    # at head_dim 96 the Hopper forward only with its tensor-map copies: packed sequences, more than two options
    # compiled in, or the copies switched off keep mma.sync (the backward is the Hopper one there still)
    q96, k96 = _qkv(np.float16, 96)[:2]
    o96 = _opts(q96, k96)
    assert planmod._hopper_blocker("forward", _t("q", q96), (), o96, lim, True) is None
    for changed in (dict(varlen=True), dict(left=8, right=0, softcap=2.0)):
        why = planmod._hopper_blocker("forward", _t("q", q96), (), dataclasses.replace(o96, **changed), lim, True)
        assert "tensor-map copies" in why, changed
        assert planmod._hopper_blocker("backward", _t("q", q96), (), dataclasses.replace(o96, **changed), lim,
                                       True) is None
    monkeypatch.setattr(planmod.config, "hopper_tma", False)
    assert "tensor-map copies" in planmod._hopper_blocker("forward", _t("q", q96), (), o96, lim, True)
    assert planmod._hopper_blocker("forward", _t("q", q), (), _opts(q, k), lim, True) is None
    monkeypatch.setattr(planmod.config, "hopper_tma", True)
    # a shared-memory cap that leaves room for the mma.sync kernels only (a 99 KB GPU's, on the H200)
    capped = dataclasses.replace(lim, max_shared_per_block=101376)
    for pass_ in ("forward", "backward"):
        why = planmod._hopper_blocker(pass_, _t("q", q), (_t("q", q),), _opts(q, k), capped, True)
        assert "101376 bytes of shared memory" in why, why


def test_slow_path_warning_once_and_silenced(monkeypatch):
    monkeypatch.setattr(planmod, "_warned", set())
    with pytest.warns(planmod.SlowPathWarning, match="compute capability 7.5"):
        planmod._warn_slow("forward", "compute capability 7.5 has no mma.sync")
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        planmod._warn_slow("forward", "compute capability 7.5 has no mma.sync")  # once only
        monkeypatch.setattr(flashnumba.config, "warn_slow_path", False)
        planmod._warn_slow("forward", "another reason")


def _t(name, x):
    from flashnumba._validate import inspect

    return inspect(name, x, 4)


def _opts(q, k):
    from flashnumba._validate import check_options

    return check_options(_t("q", q), _t("k", k), False, (-1, -1), 0.0, None, 0.0, None)


def test_tiles_that_cannot_fit_name_the_limit_and_what_fits():
    q, k, v = _qkv(np.float32, 128)
    with pytest.raises(ValueError) as err:
        flashnumba.plan(q, k, v, block_m=128, block_n=128, num_threads=256, device="sm_86")
    msg = str(err.value)
    assert "101376" in msg and "bytes" in msg and "tiles that fit" in msg and "block_m 64" in msg
    with pytest.raises(ValueError, match="48 KB"):
        flashnumba.plan(q, k, v, kernel="v1", block_m=64, block_n=64)


def test_shared_memory_cap_from_the_environment(monkeypatch):
    monkeypatch.setenv("FLASHNUMBA_MAX_SHARED_BYTES", "65536")
    q, k, v = _qkv(np.float32, 128)
    p = flashnumba.plan(q, k, v)
    assert p.device.max_shared_per_block == 65536 and "capped" in p.device.name
    assert p.launches[0].shared_bytes <= 65536
    monkeypatch.setenv("FLASHNUMBA_MAX_SHARED_BYTES", "lots")
    with pytest.raises(ValueError, match="FLASHNUMBA_MAX_SHARED_BYTES"):
        flashnumba.plan(q, k, v)


def test_plan_to_dict_and_unknown_arch():
    q, k, v = _qkv(np.float32, 64)
    d = flashnumba.plan(q, k, v, causal=True, device="sm_89").to_dict()
    # the H200's first choice (128, 64) needs 102912 bytes at d=64, more than sm_89's 101376: the next one
    assert d["arch"] == "sm_89" and d["launches"][0]["block_m"] == 64 and d["options"] == "causal"
    assert flashnumba.plan(q, k, v, device="sm_90").to_dict()["launches"][0]["block_m"] == 128
    with pytest.raises(ValueError, match="unknown architecture"):
        flashnumba.plan(q, k, v, device="sm_61")


def test_arrays_on_another_gpu_are_refused(monkeypatch):
    """Planning for the current GPU checks that CuPy arrays and torch tensors are on it (stand-ins with the
    attributes CuPy and torch expose: ``x.device.id``, ``x.device.index``)."""
    from types import SimpleNamespace

    from flashnumba._validate import Tensor

    monkeypatch.setattr(planmod, "SIMULATOR", False)
    monkeypatch.setattr(planmod.cuda, "get_current_device", lambda: SimpleNamespace(id=0), raising=False)
    monkeypatch.setattr(planmod, "current_device", lambda: tiling.ARCHS["sm_90"])
    on = lambda kind, dev: Tensor("q", SimpleNamespace(device=SimpleNamespace(id=dev, index=dev)), kind, (1,), (4,),
                                  np.dtype(np.float32))  # noqa: E731
    assert planmod.resolve_device(None, (on("cupy", 0), on("torch", 0))) is tiling.ARCHS["sm_90"]
    for kind in ("cupy", "torch"):
        with pytest.raises(ValueError, match="q is on GPU 1, but the kernels run on GPU 0"):
            planmod.resolve_device(None, (on(kind, 1),))


def test_call_key_names_the_device_of_arrays_that_do_not_carry_it(monkeypatch):
    """A kept call is planned for a GPU: the key of NumPy arrays (copied to the current device) and of
    ``__cuda_array_interface__`` objects (which say nothing of their device) holds the current device, so that a
    process that switches GPUs plans afresh for the other (CuPy arrays and torch tensors carry their own)."""
    from flashnumba import _arrays

    class Cai:  # a bare __cuda_array_interface__ object
        __cuda_array_interface__ = dict(shape=(2, 8), typestr="<f2", data=(4096, False), strides=None, version=3)

    for x in (np.zeros((2, 8), np.float16), Cai()):
        monkeypatch.setattr(_arrays, "current_device", lambda: 0)
        on0 = _arrays.meta_key(x)
        assert _arrays.meta_key(x) == on0
        monkeypatch.setattr(_arrays, "current_device", lambda: 1)
        assert _arrays.meta_key(x) != on0


@pytest.mark.skipif(not flashnumba.SIMULATOR, reason="the simulator's launch")
def test_a_simulated_launch_puts_back_the_switch_interval(monkeypatch):
    """A simulated kernel runs with a short thread switch interval (_launch.SimBound) and leaves the caller's."""
    import sys

    from flashnumba import _launch

    calls = []

    class Sys:  # (sys, recording the intervals _launch sets)
        modules = sys.modules
        getswitchinterval = staticmethod(sys.getswitchinterval)

        @staticmethod
        def setswitchinterval(x):
            calls.append(x)
            sys.setswitchinterval(x)

    q = np.random.default_rng(0).standard_normal((1, 5, 1, 8)).astype(np.float32)
    saved = sys.getswitchinterval()
    monkeypatch.setattr(_launch, "sys", Sys)
    try:
        sys.setswitchinterval(0.01)
        flashnumba.flash_attn_forward(q, q, q)
        assert sys.getswitchinterval() == pytest.approx(0.01)
    finally:
        sys.setswitchinterval(saved)
    assert calls[0] == pytest.approx(_launch.SIM_SWITCH_INTERVAL_S) and calls[-1] == pytest.approx(0.01)


@pytest.mark.skipif(not flashnumba.SIMULATOR, reason="the simulator's shared arrays")
def test_every_thread_of_a_simulated_block_gets_the_same_shared_array(monkeypatch):
    # Numba's simulator looks a static shared array up, and makes and stores it where it finds none, in two steps:
    # two threads could each make one and the block's writes then go to an array it never reads. Here the first
    # simulated thread to make the array waits (as an interrupted thread would) until a second one has missed it
    # too; each must still get the same array.
    import threading

    from numba.cuda.simulator.kernel import BlockThread

    made = []
    both_missed = threading.Barrier(2)
    empty = np.empty

    def slow_empty(*args, **kwargs):
        if isinstance(threading.current_thread(), BlockThread):
            made.append(threading.get_ident())
            if len(made) <= 2:
                try:
                    both_missed.wait(timeout=10)
                except threading.BrokenBarrierError:
                    pass
        return empty(*args, **kwargs)

    @cuda.jit
    def rotate(out):
        s = cuda.shared.array((32,), np.float32)
        t = cuda.threadIdx.x
        s[t] = t
        cuda.syncthreads()
        out[t] = s[(t + 1) % 32]

    out = np.zeros(32, np.float32)
    monkeypatch.setattr(np, "empty", slow_empty)
    rotate[1, 32](out)
    monkeypatch.undo()
    assert len(made) > 1 and not both_missed.broken  # (the race was there to lose)
    np.testing.assert_array_equal(out, (np.arange(32) + 1) % 32)


def test_config_temporarily_restores_and_refuses_unknown_names():
    from flashnumba import config
    before = config.hopper_tma
    with config.temporarily("hopper_tma", not before):
        assert config.hopper_tma is (not before)
    assert config.hopper_tma is before
    with pytest.raises(RuntimeError):
        with config.temporarily("hopper_tma", not before):
            raise RuntimeError("inside")
    assert config.hopper_tma is before  # (restored on an exception too)
    with pytest.raises(ValueError, match="no setting"):
        with config.temporarily("hopper_tmaa", False):
            pass
