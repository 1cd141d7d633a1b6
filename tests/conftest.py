"""Shared test set-up: Hypothesis profiles, output poisoning, derived tolerances.

Profiles (``FLASHNUMBA_TEST_PROFILE``, default ``gpu`` on a GPU and ``ci`` under the simulator):

* ``ci``  : simulator-sized shapes (seqlen <= 100, a bounded amount of work per example), few examples;
* ``gpu`` : larger shapes (seqlen up to 300), more examples.

``FULL_COMPILE`` (the ``gpu`` profile, or ``FLASHNUMBA_FULL_COMPILE=1``): the offline compile tests build every
kernel of their lists; otherwise (the ``ci`` profile) one representative of each kind, so that the per-push run
without a GPU stays near 15 minutes (docs/testing.md says which run where).
"""

from __future__ import annotations

import os

# A kernel's link that CUDA's compute cache serves runs no assembler, and its log then states no registers or spills
# (on a GPU machine the cache holds the kernels of the last run): the tests that read those figures keep out of it,
# set before numba is imported (set later, around a link, it was seen not to take).
os.environ.setdefault("CUDA_CACHE_DISABLE", "1")

import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, settings, strategies as st

import flashnumba
from flashnumba import reference

flashnumba.config.poison_outputs = True  # every output is NaN-filled before the kernel runs


PROFILE = os.environ.get("FLASHNUMBA_TEST_PROFILE", "ci" if flashnumba.SIMULATOR else "gpu")
settings.register_profile(
    "ci",
    max_examples=int(os.environ.get("FLASHNUMBA_CI_EXAMPLES", "8")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    derandomize=False,
    print_blob=True,
)
# FLASHNUMBA_SHRINK=0: a failing example is reported as drawn, not shrunk first (on the GPU each shrinking step may
# compile another kernel specialisation, and a call's time limit can end a run before any failure is reported)
SHRINK = os.environ.get("FLASHNUMBA_SHRINK", "1") not in ("", "0")
settings.register_profile(
    "gpu",
    max_examples=int(os.environ.get("FLASHNUMBA_GPU_EXAMPLES", "60")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    print_blob=True,
    phases=tuple(Phase) if SHRINK else tuple(p for p in Phase if p != Phase.shrink),
)
settings.load_profile(PROFILE)
FULL_COMPILE = PROFILE == "gpu" or os.environ.get("FLASHNUMBA_FULL_COMPILE", "0") not in ("", "0")

# Bounds on the shapes the property tests draw, per profile.
MAX_SEQLEN = 100 if PROFILE == "ci" else 300
# Largest batch*heads*padded_q*padded_k*head_dim one example may cost under the simulator.
WORK_BUDGET = 300_000 if PROFILE == "ci" else 10**12

HEAD_DIMS = [1, 8, 16, 24, 40, 59, 64, 80, 96, 128, 256]
AWKWARD_SEQLENS = [1, 2, 17, 63, 64, 65, 97]
# The sequence lengths the property tests draw: the awkward ones on purpose, or any up to MAX_SEQLEN.
seqlens = st.one_of(st.sampled_from(AWKWARD_SEQLENS), st.integers(1, MAX_SEQLEN))

def shard(n):
    """Settings for one of ``n`` pytest-parametrized shards of a property test: each runs 1/n of the profile's
    examples, so the shards together run as many as one test would, and pytest-xdist spreads them over workers
    (on a GPU, where each example compiles its own kernel specialisation, one long test is the slowest worker)."""
    return settings(max_examples=max(1, -(-settings().max_examples // n)))


# (seqlen_q, seqlen_k, causal) of the GPU-only size tests of the tensor-core and Hopper forwards: one query or one
# key, lengths off the tiles, long sequences, more queries than keys and the reverse
GPU_SHAPES = [(1, 1, False), (1, 300, True), (63, 65, True), (97, 1000, False), (1000, 97, True), (513, 2047, True),
              (2048, 2048, False)]

requires_gpu = pytest.mark.skipif(flashnumba.SIMULATOR, reason="needs a CUDA GPU")


def array_types():
    """The array types a test body runs against: NumPy always, CuPy when on a GPU with CuPy installed."""
    types = ["numpy"]
    if not flashnumba.SIMULATOR:
        try:
            import cupy  # noqa: F401

            types.append("cupy")
        except ImportError:
            pass
    return types


def to_type(x, kind):
    if kind == "cupy":
        import cupy

        return cupy.asarray(x)
    if kind == "torch":  # bfloat16 as torch.bfloat16, through its bits (torch cannot read NumPy's bfloat16)
        import torch

        if x.dtype.name == "bfloat16":
            return torch.from_numpy(x.view(np.int16)).cuda().view(torch.bfloat16)
        return torch.from_numpy(x).cuda()
    return x


def to_numpy(x):
    if isinstance(x, np.ndarray):
        return x
    if type(x).__module__.startswith("torch"):
        import torch

        if x.dtype == torch.bfloat16:
            import ml_dtypes

            return x.view(torch.int16).cpu().numpy().view(ml_dtypes.bfloat16)
        return x.cpu().numpy()
    if hasattr(x, "get"):
        return x.get()
    return x.copy_to_host()


def random_qkv(rng, batch, seqlen_q, seqlen_k, nheads, head_dim, dtype=np.float32, scale=1.0):
    q = (scale * rng.standard_normal((batch, seqlen_q, nheads, head_dim))).astype(dtype)
    k = (scale * rng.standard_normal((batch, seqlen_k, nheads, head_dim))).astype(dtype)
    v = rng.standard_normal((batch, seqlen_k, nheads, head_dim)).astype(dtype)
    return q, k, v


def float32_class_draw(seed, forward):
    """(err, base_err, shape) of ``forward(q, k, v, causal) -> out`` on a shape drawn from ``seed`` (lengths
    log-uniform in 16 .. 3000, head_dim 64 or 128, causal on odd seeds, float32): its largest error against the
    float64 truth and that of NumPy's float32 attention, where the truth is finite ("float32-class": err <= 2
    base_err)."""
    rng = np.random.default_rng(seed)
    seqlen_q, seqlen_k = (int(x) for x in np.exp(rng.uniform(np.log(16), np.log(3000), 2)).round())
    D, causal = int(rng.choice([64, 128])), bool(seed % 2)
    q, k, v = random_qkv(rng, 1, seqlen_q, seqlen_k, 2, D)
    truth, _ = reference.attention_forward(q, k, v, causal=causal)
    base, _ = reference.attention_forward(q, k, v, causal=causal, dtype=np.float32)
    out = to_numpy(forward(q, k, v, causal))
    finite = np.isfinite(truth)
    err, base_err = (max_err(x[finite], truth[finite]) for x in (out, base))
    return err, base_err, f"{seqlen_q}x{seqlen_k} d={D} causal={causal}"


def float32_class_backward_draw(seed, backward):
    """[err / base_err of dq, dk, dv] of ``backward(dout, q, k, v, out, lse, causal) -> (dq, dk, dv)`` on a shape
    drawn from ``seed`` (lengths log-uniform in 16 .. 2000, head_dim 64 or 128, causal on odd seeds, float32; out
    and lse from the exact forward): each gradient's largest error against the float64 truth as a multiple of
    that of NumPy's float32 backward (the same algorithm from the same out and lse)."""
    rng = np.random.default_rng(1000 + seed)
    seqlen_q, seqlen_k = (int(x) for x in np.exp(rng.uniform(np.log(16), np.log(2000), 2)).round())
    D, causal = int(rng.choice([64, 128])), bool(seed % 2)
    q, k, v, dout = (rng.standard_normal((1, n, 2, D)).astype(np.float32)
                     for n in (seqlen_q, seqlen_k, seqlen_k, seqlen_q))
    out, lse = (to_numpy(x) for x in flashnumba.flash_attn_forward(q, k, v, causal=causal))
    truth = reference.attention_backward(dout, q, k, v, causal=causal)
    base = reference.attention_backward_blocked(dout, q, k, v, out, lse, causal=causal, dtype=np.float32)
    grads = backward(dout, q, k, v, out, lse, causal)
    return [max_err(to_numpy(g), t) / max_err(b, t) for g, t, b in zip(grads, truth, base)]


def max_err(a, b):
    """max |a - b| where both are finite; inf where one is NaN or they disagree on +-inf."""
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    if a.size == 0:
        return 0.0
    same_inf = np.isinf(a) & np.isinf(b) & (np.sign(a) == np.sign(b))
    if np.isnan(a).any() or np.isnan(b).any() or (np.isinf(a) ^ np.isinf(b)).any():
        return np.inf
    d = np.where(same_inf, 0.0, np.abs(np.where(same_inf, 0.0, a) - np.where(same_inf, 0.0, b)))
    return float(d.max())


def eps(dtype):
    """Machine epsilon of a float dtype; NumPy's finfo does not know ml_dtypes.bfloat16 (2**-7)."""
    dtype = np.dtype(dtype)
    if dtype.name == "bfloat16":
        import ml_dtypes

        return float(ml_dtypes.finfo(dtype).eps)
    return float(np.finfo(dtype).eps)


# The kernel may have ERR_FACTOR times the baseline's error, plus a floor of FLOOR_ULPS ulps of the output dtype at
# the output's magnitude (so that a baseline that happens to be exact does not demand exactness), plus FLOOR_ULPS
# float32 ulps times sqrt(n) for the kernel's float32 accumulation of n-term sums.
ERR_FACTOR = 3.0
FLOOR_ULPS = 4


def assert_close_to_truth(name, got, truth, baseline, reduction=1):
    """Derived tolerance: |got - truth| <= ERR_FACTOR * |baseline - truth| + floor, with
    floor = FLOOR_ULPS * max(1, |truth|) * (eps(dtype) + sqrt(reduction) * eps(float32)).

    ``truth`` is the float64 reference; ``baseline`` the same reference computed in the input's dtype by NumPy
    (what a plain implementation in that precision achieves). ``reduction`` is the longest sum the kernel
    accumulates (head_dim for the dot products, seqlen_k for P V, seqlen_q for dK and dV): the kernels add the
    terms one after another in float32, whose rounding error grows like sqrt(n) ulps (the statistical estimate
    for recursive summation, Higham, "Accuracy and Stability of Numerical Algorithms", 2nd ed., section 4.2),
    while NumPy's BLAS adds in blocks and pairs; ex2.approx and lg2.approx add a few ulps more. On shapes where
    the baseline happens to be nearly exact, this term is what the kernel is allowed.
    """
    got = to_numpy(got)
    truth = np.asarray(truth)
    finite = truth[np.isfinite(truth)]
    magnitude = max(1.0, float(np.abs(finite).max())) if finite.size else 1.0
    floor = FLOOR_ULPS * magnitude * (eps(got.dtype) + np.sqrt(reduction) * eps(np.float32))
    base_err = max_err(baseline, truth)
    err = max_err(got, truth)
    tol = ERR_FACTOR * base_err + floor
    assert err <= tol, f"{name}: max error {err:.3g} > {tol:.3g} (baseline error {base_err:.3g})"


def check_forward(out, lse, q, k, v, *, softmax_scale=None, causal=False, **opts):
    """Check (out, lse) against the float64 reference with tolerances derived from a NumPy run in q's dtype.
    ``opts``: window_size, softcap, alibi_slopes, as given to the kernel."""
    q, k, v = (to_numpy(x) for x in (q, k, v))
    dtype = np.dtype(q.dtype)
    truth_o, truth_l = reference.attention_forward(q, k, v, softmax_scale=softmax_scale, causal=causal, **opts)
    base_o, base_l = reference.attention_forward(q, k, v, softmax_scale=softmax_scale, causal=causal, dtype=dtype,
                                                 **opts)
    out, lse = to_numpy(out), to_numpy(lse)
    assert out.shape == q.shape and out.dtype == dtype
    assert lse.shape == (q.shape[0], q.shape[2], q.shape[1]) and lse.dtype == np.float32
    assert not np.isnan(out).any(), "out has NaN (an element was not written, or the kernel produced NaN)"
    assert not np.isnan(lse).any(), "lse has NaN"
    n = max(q.shape[-1], k.shape[1])
    assert_close_to_truth("out", out, truth_o, base_o.astype(dtype), reduction=n)
    assert_close_to_truth("lse", lse, truth_l, base_l.astype(np.float32), reduction=n)


def check_backward(grads, dout, q, k, v, out, lse, *, softmax_scale=None, causal=False, **opts):
    """Check (dq, dk, dv) against the float64 reference gradient.

    The kernels were given ``out`` and ``lse`` (from the forward kernel); the baseline is the same algorithm
    (FlashAttention-2's backward, P recomputed from lse) run by NumPy in the input's dtype from the same out
    and lse. Its error against the truth is what a plain implementation achieves from those inputs; the
    kernels may have ERR_FACTOR times it plus a floor, as for the forward.
    """
    dout, q, k, v, out, lse = (to_numpy(x) for x in (dout, q, k, v, out, lse))
    dtype = np.dtype(q.dtype)
    truth = reference.attention_backward(dout, q, k, v, softmax_scale=softmax_scale, causal=causal, **opts)
    base = reference.attention_backward_blocked(dout, q, k, v, out, lse, softmax_scale=softmax_scale,
                                                causal=causal, dtype=dtype, **opts)
    n = max(q.shape[-1], q.shape[1], k.shape[1])
    for name, g, t, bl, like in zip(("dq", "dk", "dv"), grads, truth, base, (q, k, v)):
        g = to_numpy(g)
        assert g.shape == like.shape and g.dtype == dtype, f"{name}: {g.shape} {g.dtype}"
        assert not np.isnan(g).any(), f"{name} has NaN (an element was not written, or the kernel produced NaN)"
        assert_close_to_truth(name, g, t, bl.astype(dtype), reduction=n)


def assert_reference_gradient_matches_finite_differences(q, k, v, dout, **opts):
    """reference.attention_backward against central differences of reference.attention_forward (float64)."""
    grads = reference.attention_backward(dout, q, k, v, **opts)

    def loss(q_, k_, v_):
        return float((reference.attention_forward(q_, k_, v_, **opts)[0] * dout).sum())

    eps = 1e-6
    for which, g in enumerate(grads):
        args = [q, k, v]
        num = np.zeros_like(args[which])
        for idx in np.ndindex(num.shape):
            plus = [a.copy() for a in args]
            minus = [a.copy() for a in args]
            plus[which][idx] += eps
            minus[which][idx] -= eps
            num[idx] = (loss(*plus) - loss(*minus)) / (2 * eps)
        np.testing.assert_allclose(g, num, rtol=1e-6, atol=1e-8)


# what an offline compile script puts beside each build's cubin: the wgmma groups whose accumulators the machine
# code never reads (None where nvdisasm is not installed), for check_machine_code
UNREAD = """
from flashnumba.tools import sass
unread = lambda cubin: sass.unread_accumulators(sass.disassemble(cubin)) if sass.nvdisasm_path() else None
"""


def compile_offline(script, *args):
    """Run ``script`` (Python that compiles kernels and prints one JSON line last) with the real numba.cuda and no
    GPU needed; its JSON. Skips where NVVM is not installed."""
    import json
    import subprocess
    import sys

    env = dict(os.environ, FLASHNUMBA_SIMULATOR="0", NUMBA_ENABLE_CUDASIM="0", CUDA_CACHE_DISABLE="1")
    proc = subprocess.run([sys.executable, "-c", script, *args], env=env, capture_output=True, text=True,
                          timeout=1200)
    if proc.returncode != 0 and "NVVM" in proc.stderr and "not found" in proc.stderr.lower():
        pytest.skip("NVVM is not installed (pip install numba-cuda[cu13])")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def check_machine_code(compiled):
    """Every wgmma group's accumulator read before it is overwritten, in the machine code
    (:func:`flashnumba.tools.sass.unread_accumulators`; the assembler once dropped such reads where the PTX was
    right); skipped where nvdisasm is not installed (the test extra has it)."""
    if any(r["unread"] is None for r in compiled.values()):
        pytest.skip("nvdisasm not installed (pip install nvidia-cuda-nvdisasm): the machine code is not checked")
    assert {name: r["unread"] for name, r in compiled.items() if r["unread"]} == {}


def pytest_runtest_logreport(report):
    """With FLASHNUMBA_FAILURE_LOG set, append each failure to that file as it happens (pytest prints its summary
    only at the end, which a run stopped at a time limit never reaches; each xdist worker appends too)."""
    path = os.environ.get("FLASHNUMBA_FAILURE_LOG")
    if path and report.failed:
        with open(path, "a") as f:
            f.write(f"FAILED {report.nodeid} ({report.when})\n{report.longreprtext}\n\n")
