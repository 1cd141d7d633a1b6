"""``python -m flashnumba bench``: flashnumba against standard attention and the attention kernels of torch and
flash-attn, in speed and memory.

Workloads as in the FlashAttention-2 paper: batch = tokens / seqlen (tokens = 16384), nheads = 2048 / head_dim,
so every q, k, v tensor holds 16384 x 2048 elements (128 MiB in float32, twice the H200's 60 MB L2: no input is
served from cache between runs). FLOPs: 4 * batch * nheads * seqlen^2 * head_dim per forward, halved when
causal; the backward counts 2.5x the forward, forward + backward 3.5x.

Every implementation is validated against the float64 NumPy reference on a small problem (same head_dim,
causal, dtype) before it is timed; one that fails is reported and not timed. Timing: CUDA events, after
warm-up, median of ``--repeat`` samples, each a group of calls back to back lasting about ``--group-ms`` (20 ms:
the time per call of repeated calls, host work overlapping the previous call's kernels, as in a training loop;
``--group-ms 0`` times one call per sample, its host time then on the clock). Memory: peak device memory a call
adds on top of its inputs (CuPy's pool for CuPy-based implementations, torch's allocator statistics for
torch-based ones).

Outputs: a table on stdout, ``bench.json`` and PNG plots (TFLOP/s vs seqlen; peak memory vs seqlen) in
``--out``. ``--budget-gib`` instead finds the longest seqlen each implementation runs in that much memory.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

import numpy as np

from .. import _backend, config, reference
from .arguments import at_least
from ..api import (attention_with_grad, flash_attn_backward, flash_attn_forward, flash_attn_varlen_backward,
                  flash_attn_varlen_forward, plan, plan_backward)
from .standard import _xp as array_module
from .standard import standard_attention
from .environment import environment
from .timing import cuda_time_calls_ms, peak_device_bytes

FWD, BWD, FWDBWD = "fwd", "bwd", "fwd+bwd"
PLANS = "plans"  # an implementation's optional entry: {pass: [flashnumba Plan, ...]}, recorded in its rows
PASS_FACTOR = {FWD: 1.0, BWD: 2.5, FWDBWD: 3.5}


def flops(batch, nheads, seqlen, head_dim, causal, pass_, window_size=None):
    """The paper's count: 4 * batch * nheads * seqlen^2 * head_dim per forward, halved when causal. With a
    sliding window, 4 * batch * nheads * head_dim per visible (query, key) pair, counted exactly."""
    if window_size is not None:
        mask = reference.visibility_mask(seqlen, seqlen, causal=causal, window_size=window_size)
        return 4 * batch * nheads * int(mask.sum()) * head_dim * PASS_FACTOR[pass_]
    f = 4 * batch * nheads * seqlen * seqlen * head_dim * PASS_FACTOR[pass_]
    return f / 2 if causal else f


def _plans(q, k, v, dout, out, lse, fwd, bwd=None):
    """The :data:`PLANS` entry of a flashnumba implementation: the plans its forward (options ``fwd``) and
    backward (``bwd``; None: no backward) run, which its rows record (kernels and tiles)."""
    plans = {FWD: [plan(q, k, v, **fwd)]}
    if bwd is not None:
        plans[BWD] = [plan_backward(dout, q, k, v, out, lse, **bwd)]
        plans[FWDBWD] = plans[FWD] + plans[BWD]
    return plans


def plan_summary(plans) -> list:
    """[[kernel name, block_m, block_n, num_threads], ...] of the launches of ``plans`` that have tiles."""
    return [[x.name, *map(int, x.tiles)] for p in plans for x in p.launches if x.tiles is not None]


# ---------------------------------------------------------------------------------------------------------------
# implementations: each is make(q, k, v, dout, causal) -> {pass: callable}, on arrays of its own library, and
# for flashnumba's, a PLANS entry
# ---------------------------------------------------------------------------------------------------------------


def _flashnumba(kernel):
    """Forward kernel ``kernel``; backward v1 with forward v1 (the simple pair), else backward v2."""
    bkernel = "v1" if kernel == "v1" else "v2"

    def make(q, k, v, dout, causal, window_size=(-1, -1)):
        opts = dict(causal=causal, window_size=window_size)
        out, lse = flash_attn_forward(q, k, v, kernel=kernel, **opts)
        return {
            FWD: lambda: flash_attn_forward(q, k, v, kernel=kernel, **opts),
            BWD: lambda: flash_attn_backward(dout, q, k, v, out, lse, kernel=bkernel, **opts),
            FWDBWD: lambda: attention_with_grad(q, k, v, dout, kernel=kernel, backward_kernel=bkernel, **opts),
            PLANS: _plans(q, k, v, dout, out, lse, dict(opts, kernel=kernel), dict(opts, kernel=bkernel)),
        }

    make.features = True  # takes window_size and GQA-shaped k, v

    def make_varlen(q, k, v, dout, cu_q, cu_k, max_q, max_k, causal, window_size=(-1, -1)):
        """The same kernels on a packed batch (q: (total_q, nheads, d), k, v: (total_k, nheads_k, d))."""
        opts = dict(causal=causal, window_size=window_size, kernel=kernel)
        out, lse = flash_attn_varlen_forward(q, k, v, cu_q, cu_k, max_q, max_k, **opts)
        bopts = dict(opts, kernel=bkernel)
        return {
            FWD: lambda: flash_attn_varlen_forward(q, k, v, cu_q, cu_k, max_q, max_k, **opts),
            BWD: lambda: flash_attn_varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, **bopts),
        }

    if kernel != "v1":
        make.varlen = make_varlen
    make.dtypes = ALL_DTYPES
    return make


ALL_DTYPES = ("float32", "float16", "bfloat16")


def _flashnumba_default(q, k, v, dout, causal, window_size=(-1, -1)):
    """What a user gets: the plan's choice (``kernel=None``), forward and backward (the tensor cores for float16
    and bfloat16 where they apply, else the SIMT kernels)."""
    opts = dict(causal=causal, window_size=window_size)
    out, lse = flash_attn_forward(q, k, v, **opts)
    return {
        FWD: lambda: flash_attn_forward(q, k, v, **opts),
        BWD: lambda: flash_attn_backward(dout, q, k, v, out, lse, **opts),
        FWDBWD: lambda: attention_with_grad(q, k, v, dout, **opts),
        PLANS: _plans(q, k, v, dout, out, lse, opts, opts),
    }


_flashnumba_default.features = True
_flashnumba_default.dtypes = ALL_DTYPES


def _flashnumba_default_varlen(q, k, v, dout, cu_q, cu_k, max_q, max_k, causal, window_size=(-1, -1)):
    opts = dict(causal=causal, window_size=window_size)
    out, lse = flash_attn_varlen_forward(q, k, v, cu_q, cu_k, max_q, max_k, **opts)
    return {
        FWD: lambda: flash_attn_varlen_forward(q, k, v, cu_q, cu_k, max_q, max_k, **opts),
        BWD: lambda: flash_attn_varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, **opts),
    }


_flashnumba_default.varlen = _flashnumba_default_varlen


def _flashnumba_atomic(q, k, v, dout, causal, window_size=(-1, -1)):
    """The plan's choice forward, and the backward with ``deterministic=False``: on the tensor cores, dQ added
    with atomics by the dK/dV kernel (FlashAttention-2's backward); elsewhere the same as the default."""
    opts = dict(causal=causal, window_size=window_size)
    out, lse = flash_attn_forward(q, k, v, **opts)
    return {
        FWD: lambda: flash_attn_forward(q, k, v, **opts),
        BWD: lambda: flash_attn_backward(dout, q, k, v, out, lse, deterministic=False, **opts),
        FWDBWD: lambda: attention_with_grad(q, k, v, dout, deterministic=False, **opts),
        PLANS: _plans(q, k, v, dout, out, lse, opts, dict(opts, deterministic=False)),
    }


_flashnumba_atomic.features = True
_flashnumba_atomic.dtypes = ALL_DTYPES


def _flashnumba_tc(q, k, v, dout, causal):
    """The tensor-core kernels (``kernel="tc"``: float16 or bfloat16, head_dim a multiple of 8 up to 256), forward
    and backward."""
    opts = dict(causal=causal, kernel="tc")
    out, lse = flash_attn_forward(q, k, v, **opts)  # unsupported dtypes and head dims raise here, before timing
    return {
        FWD: lambda: flash_attn_forward(q, k, v, **opts),
        BWD: lambda: flash_attn_backward(dout, q, k, v, out, lse, **opts),
        FWDBWD: lambda: attention_with_grad(q, k, v, dout, causal=causal, kernel="tc", backward_kernel="tc"),
        PLANS: _plans(q, k, v, dout, out, lse, opts, opts),
    }


_flashnumba_tc.dtypes = ("float16", "bfloat16")


def _flashnumba_wgmma(q, k, v, dout, causal, window_size=(-1, -1)):
    """The Hopper kernels (``kernel="wgmma"``: compute capability 9.0, float16 or bfloat16, head_dim a multiple of
    32 up to 256, the other multiples of 8 padded to the next multiple of 32), forward and backward."""
    opts = dict(causal=causal, window_size=window_size, kernel="wgmma")
    out, lse = flash_attn_forward(q, k, v, **opts)  # unsupported GPUs, dtypes and head dims raise here
    return {
        FWD: lambda: flash_attn_forward(q, k, v, **opts),
        BWD: lambda: flash_attn_backward(dout, q, k, v, out, lse, **opts),
        FWDBWD: lambda: attention_with_grad(q, k, v, dout, causal=causal, window_size=window_size, kernel="wgmma",
                                            backward_kernel="wgmma"),
        PLANS: _plans(q, k, v, dout, out, lse, opts, opts),
    }


_flashnumba_wgmma.features = True
_flashnumba_wgmma.dtypes = ("float16", "bfloat16")


def _flashnumba_wgmma_setting(name, value):
    """The Hopper forward with ``config.<name> = value`` around each call, beside ``flashnumba_wgmma``:
    ``hopper_tma`` False (``flashnumba_wgmma_cp_async``: the producer's per-thread copies, what the copy engine's
    tensor-map copies buy), ``hopper_persistent`` True (``flashnumba_wgmma_persistent``: one block an SM taking the
    query tiles in turn) or ``hopper_overlap`` True (``flashnumba_wgmma_overlap``: each tile's softmax beside the
    product in flight)."""

    def make(q, k, v, dout, causal, window_size=(-1, -1)):
        opts = dict(causal=causal, window_size=window_size, kernel="wgmma")

        def forward():
            with config.temporarily(name, value):
                return flash_attn_forward(q, k, v, **opts)

        forward()  # unsupported GPUs, dtypes and head dims raise here
        return {FWD: forward}

    make.dtypes = ("float16", "bfloat16")
    return make


def _flashnumba_wgmma_three(q, k, v, dout, causal, window_size=(-1, -1)):
    """The Hopper forward with three warpgroups of 64 query rows and the producer warpgroup (block_m 192,
    num_threads 512; B_c as the plan fits it to the head dim and the shared memory), beside ``flashnumba_wgmma``'s
    two."""
    opts = dict(causal=causal, window_size=window_size, kernel="wgmma", block_m=192, num_threads=512)
    flash_attn_forward(q, k, v, **opts)  # unsupported GPUs, dtypes, head dims and tiles raise here
    return {FWD: lambda: flash_attn_forward(q, k, v, **opts)}


_flashnumba_wgmma_three.dtypes = ("float16", "bfloat16")


def _flashnumba_tf32(precision):
    """The float32 forward and backward on tensor cores (``kernel="tf32"`` or ``"3xtf32"``, head_dim 64 or 128)."""

    def make(q, k, v, dout, causal):
        opts = dict(causal=causal, kernel=precision)
        out, lse = flash_attn_forward(q, k, v, **opts)  # unsupported dtypes and head dims raise here, before timing
        return {FWD: lambda: flash_attn_forward(q, k, v, **opts),
                BWD: lambda: flash_attn_backward(dout, q, k, v, out, lse, **opts),
                PLANS: _plans(q, k, v, dout, out, lse, opts, opts)}

    if precision == "tf32":  # operands rounded to 10 mantissa bits: float16's precision, float32's range
        make.baseline_dtype = np.float16
    make.dtypes = ("float32",)
    return make


def _flashnumba_3xtf32_wgmma(accumulation):
    """The 3xTF32 forward and backward on Hopper's wgmma (``config.hopper_3xtf32 = accumulation`` around each call:
    "chained" or "per_step"; compute capability 9.0, head_dim 64 or 128)."""

    def make(q, k, v, dout, causal):
        def forward():
            with config.temporarily("hopper_3xtf32", accumulation):
                return flash_attn_forward(q, k, v, causal=causal, precision="3xtf32")

        with config.temporarily("hopper_3xtf32", accumulation):
            if plan(q, k, v, causal=causal, precision="3xtf32").launches[0].name != "forward 3xtf32 wgmma":
                raise ValueError("the 3xTF32 wgmma forward runs on compute capability 9.0 only")
        out, lse = forward()  # unsupported dtypes and head dims raise here

        def backward():
            with config.temporarily("hopper_3xtf32", accumulation):
                return flash_attn_backward(dout, q, k, v, out, lse, causal=causal, precision="3xtf32")

        return {FWD: forward, BWD: backward}

    make.dtypes = ("float32",)
    return make


def varlen_lengths(tokens, max_seqlen, rng):
    """Sequence lengths for a packed batch: uniform in [max_seqlen / 4, max_seqlen], summing to ``tokens`` (the
    last one shortened), so that a varlen run moves as many tokens as the dense one at that max_seqlen."""
    lens = []
    while sum(lens) < tokens:
        lens.append(int(rng.integers(max(1, max_seqlen // 4), max_seqlen + 1)))
    lens[-1] -= sum(lens) - tokens
    return [n for n in lens if n > 0]


def varlen_flops(lens, nheads, head_dim, causal, pass_, window_size=None):
    """4 * nheads * len^2 * head_dim per sequence (halved when causal; with a window, per visible pair), as
    :func:`flops` counts the dense workload."""
    return sum(flops(1, nheads, n, head_dim, causal, pass_, window_size) for n in lens)


def standard_attention_backward(dout, q, k, v, p, *, softmax_scale=None):
    """Backward of materialised attention from the saved P (batch, nheads, sq, sk): (dq, dk, dv), like q."""
    xp = array_module(q)
    scale = 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else softmax_scale
    qh, kh, vh, doh = (x.transpose(0, 2, 1, 3) for x in (q, k, v, dout))
    dv = xp.matmul(p.transpose(0, 1, 3, 2), doh)
    dp = xp.matmul(doh, vh.transpose(0, 1, 3, 2))
    ds = p * (dp - (dp * p).sum(axis=-1, keepdims=True))
    del dp
    dq = xp.matmul(ds, kh) * q.dtype.type(scale)
    dk = xp.matmul(ds.transpose(0, 1, 3, 2), qh) * q.dtype.type(scale)
    return tuple(x.transpose(0, 2, 1, 3) for x in (dq, dk, dv))


def _standard_probs(q, k, causal):
    xp = array_module(q)

    scale = 1.0 / math.sqrt(q.shape[-1])
    s = xp.matmul(q.transpose(0, 2, 1, 3), k.transpose(0, 2, 3, 1)) * q.dtype.type(scale)
    if causal:
        sq, sk = q.shape[1], k.shape[1]
        s = xp.where(xp.arange(sk)[None, :] <= xp.arange(sq)[:, None] + (sk - sq), s, s.dtype.type(-np.inf))
    s -= s.max(axis=-1, keepdims=True)
    p = xp.exp(s)
    p /= p.sum(axis=-1, keepdims=True)
    return p


def _standard(q, k, v, dout, causal):
    p = _standard_probs(q, k, causal)

    def fwdbwd():
        p2 = _standard_probs(q, k, causal)
        out = array_module(q).matmul(p2, v.transpose(0, 2, 1, 3))
        return out, standard_attention_backward(dout, q, k, v, p2)

    return {
        FWD: lambda: standard_attention(q, k, v, causal=causal),
        BWD: lambda: standard_attention_backward(dout, q, k, v, p),
        FWDBWD: fwdbwd,
    }


_standard.dtypes = ("float32", "float16")  # CuPy has no bfloat16


def _torch_sdpa(backend_name):
    def make(q, k, v, dout, causal):
        import torch
        from torch.nn.attention import SDPBackend, sdpa_kernel

        backend = getattr(SDPBackend, backend_name)
        # (batch, seqlen, nheads, d) -> torch's (batch, nheads, seqlen, d) view, no copy
        tq, tk, tv, tdo = (torch.as_tensor(x, device="cuda").transpose(1, 2) for x in (q, k, v, dout))
        leaves = [t.detach().requires_grad_() for t in (tq, tk, tv)]

        def fwd():  # the output back in (batch, seqlen, nheads, d), a view
            with sdpa_kernel(backend), torch.no_grad():
                return torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=causal).transpose(1, 2)

        def fwdbwd():
            with sdpa_kernel(backend):
                o = torch.nn.functional.scaled_dot_product_attention(*leaves, is_causal=causal)
            o.backward(tdo)
            return o

        with sdpa_kernel(backend):
            saved = torch.nn.functional.scaled_dot_product_attention(*leaves, is_causal=causal)

        def bwd():
            saved.backward(tdo, retain_graph=True)

        return {FWD: fwd, BWD: bwd, FWDBWD: fwdbwd}

    make.dtypes = ("float16", "bfloat16") if backend_name in ("FLASH_ATTENTION", "CUDNN_ATTENTION") else ALL_DTYPES
    return make


# What `bench` runs when no --impls are given: the library's default path beside standard attention and the peers.
# The teaching kernels (flashnumba_v1, _v2, _v3), the explicit tensor-core and TF32 ones and torch's math backend
# run on request.
DEFAULT_IMPLS = ("flashnumba", "standard_cupy", "torch_sdpa_flash", "torch_sdpa_cudnn", "torch_sdpa_efficient")


def available_implementations(include_peers=True):
    impls = {"flashnumba": _flashnumba_default}
    impls.update({f"flashnumba_{k}": _flashnumba(k) for k in ("v1", "v2", "v3")})
    impls["flashnumba_tc"] = _flashnumba_tc
    impls["flashnumba_atomic"] = _flashnumba_atomic
    impls["flashnumba_wgmma"] = _flashnumba_wgmma
    impls["flashnumba_wgmma_cp_async"] = _flashnumba_wgmma_setting("hopper_tma", False)
    impls["flashnumba_wgmma_persistent"] = _flashnumba_wgmma_setting("hopper_persistent", True)
    impls["flashnumba_wgmma_overlap"] = _flashnumba_wgmma_setting("hopper_overlap", True)
    impls["flashnumba_wgmma_three"] = _flashnumba_wgmma_three
    impls["flashnumba_tf32"] = _flashnumba_tf32("tf32")
    impls["flashnumba_3xtf32"] = _flashnumba_tf32("3xtf32")
    impls["flashnumba_3xtf32_wgmma"] = _flashnumba_3xtf32_wgmma("chained")
    impls["flashnumba_3xtf32_wgmma_per_step"] = _flashnumba_3xtf32_wgmma("per_step")
    impls["standard_cupy"] = _standard
    if include_peers and not _backend.SIMULATOR:
        try:
            import torch  # noqa: F401
            from torch.nn.attention import SDPBackend  # noqa: F401

            if torch.cuda.is_available():
                for name, backend in (("math", "MATH"), ("efficient", "EFFICIENT_ATTENTION"),
                                      ("flash", "FLASH_ATTENTION"), ("cudnn", "CUDNN_ATTENTION")):
                    impls[f"torch_sdpa_{name}"] = _torch_sdpa(backend)
        except ImportError:
            pass
    return impls


# ---------------------------------------------------------------------------------------------------------------
# measurement
# ---------------------------------------------------------------------------------------------------------------


def _xp():
    if _backend.SIMULATOR:
        return np
    import cupy

    return cupy


def dtype_of(name):
    """The NumPy dtype of a dtype name (bfloat16: ml_dtypes')."""
    if name == "bfloat16":
        from .._arrays import bfloat16

        if bfloat16() is None:
            raise SystemExit("bfloat16 needs the ml_dtypes package: pip install ml_dtypes")
        return bfloat16()
    return np.dtype(name)


def _to_device(x, like=None):
    """A host array on the device the benchmark runs on: CuPy (NumPy under the simulator); bfloat16, which CuPy
    lacks, as a torch.bfloat16 CUDA tensor, and then (``like`` a torch tensor) the other arrays of the call too."""
    if _backend.SIMULATOR:
        return x
    if like is not None and type(like).__module__.startswith("torch"):
        import torch

        return torch.from_numpy(np.ascontiguousarray(x)).cuda()
    if x.dtype.name == "bfloat16":
        try:
            import torch
        except ImportError:
            raise SystemExit("bfloat16 on a GPU runs on torch tensors (CuPy has no bfloat16): install torch") from None
        return torch.from_numpy(np.ascontiguousarray(x).view(np.int16)).cuda().view(torch.bfloat16)
    import cupy

    return cupy.asarray(x)


def _host(x):
    if hasattr(x, "detach"):  # torch, in flashnumba's layout (batch, seqlen, nheads, d)
        return x.detach().float().cpu().numpy()
    return x.get() if hasattr(x, "get") else np.asarray(x)


def validate(make, head_dim, causal, dtype, seqlen=None, window_size=None, gqa=1):
    """Run the implementation on a small problem (``seqlen`` 96, 40 under the simulator, where every thread runs
    in Python) and compare out with the float64 reference.

    Returns None when it agrees, else a string saying what failed. Tolerance: 10x the error of the same
    computation in NumPy at the input's dtype, or at the precision an implementation declares in its
    ``baseline_dtype`` attribute (TF32: float16), plus 1e-5: loose enough for any correct kernel, tight enough
    to catch wrong masking or indexing.
    """
    rng = np.random.default_rng(0)
    seqlen = seqlen or (40 if _backend.SIMULATOR else 96)
    shape = (1, seqlen, 2 * gqa, head_dim)
    kv_shape = (1, seqlen, 2, head_dim)
    hq, hdo = (rng.standard_normal(shape).astype(dtype) for _ in range(2))
    hk, hv = (rng.standard_normal(kv_shape).astype(dtype) for _ in range(2))
    q, k, v, dout = (_to_device(x) for x in (hq, hk, hv, hdo))
    opts = {} if window_size is None else dict(window_size=window_size)
    try:
        fns = make(q, k, v, dout, causal, **opts)
        out = fns[FWD]()
        out = out[0] if isinstance(out, tuple) else out
    except Exception as err:  # noqa: BLE001  (a peer that does not support this configuration)
        return f"{type(err).__name__}: {str(err).splitlines()[0][:120]}"
    truth, _ = reference.attention_forward(hq, hk, hv, causal=causal, **opts)
    # the baseline: NumPy at the input's dtype, or at the precision the implementation declares (TF32: float16)
    base_dtype = getattr(make, "baseline_dtype", dtype)
    base, _ = reference.attention_forward(hq, hk, hv, causal=causal, dtype=base_dtype, **opts)
    return _forward_error(out, truth, base, "forward")


def _forward_error(out, truth, base, what):
    """None where out's error against the float64 truth is at most 10x the NumPy baseline's plus 1e-5, else
    a message saying by how much it is not."""
    err = float(np.abs(_host(out).astype(np.float64) - truth).max())
    tol = 10 * float(np.abs(base - truth).max()) + 1e-5
    return None if err <= tol else f"{what} error {err:.2e} > {tol:.2e}"


def validate_varlen(make_varlen, head_dim, causal, dtype, window_size=None, gqa=1):
    """validate() for a packed batch of three sequences, one of them empty (out against the reference); shorter
    sequences under the simulator."""
    rng = np.random.default_rng(0)
    lens_q, lens_k = ([13, 0, 29], [17, 0, 33]) if _backend.SIMULATOR else ([37, 0, 70], [50, 0, 81])
    cu_q, cu_k = (np.concatenate([[0], np.cumsum(x)]).astype(np.int32) for x in (lens_q, lens_k))
    hq, hdo = (rng.standard_normal((cu_q[-1], 2 * gqa, head_dim)).astype(dtype) for _ in range(2))
    hk, hv = (rng.standard_normal((cu_k[-1], 2, head_dim)).astype(dtype) for _ in range(2))
    opts = {} if window_size is None else dict(window_size=tuple(window_size))
    try:
        q = _to_device(hq)
        fns = make_varlen(q, *(_to_device(x, like=q) for x in (hk, hv, hdo, cu_q, cu_k)), max(lens_q), max(lens_k),
                          causal, **opts)
        out = fns[FWD]()[0]
    except Exception as err:  # noqa: BLE001
        return f"{type(err).__name__}: {str(err).splitlines()[0][:120]}"
    truth, _ = reference.attention_varlen_forward(hq, hk, hv, cu_q, cu_k, causal=causal, **opts)
    base, _ = reference.attention_varlen_forward(hq, hk, hv, cu_q, cu_k, causal=causal, dtype=dtype, **opts)
    return _forward_error(out, truth, base, "varlen forward")


def _peak_and_time(fn, lib, warmup, repeat, group_ms=0.0):
    """(median ms, all ms, peak extra bytes, calls per sample) of fn()."""
    if _backend.SIMULATOR:
        peak = 0  # no device memory to measure
    else:
        _, peak = peak_device_bytes(fn, lib)
    ms, times, calls = cuda_time_calls_ms(fn, warmup=warmup, repeat=repeat, group_ms=group_ms)
    return ms, times, int(peak), calls


def _progress(total):
    try:
        from tqdm import tqdm

        return tqdm(total=total, file=sys.stderr, dynamic_ncols=True)
    except ImportError:
        class _Bar:
            n = 0

            def update(self, k=1):
                self.n += k
                print(f"  [{self.n}/{total}]", file=sys.stderr, end="\r")

            def set_description(self, s):
                pass

            def close(self):
                print(file=sys.stderr)

        return _Bar()


def run_sweep(*, seqlens, head_dims, causals, dtypes, passes, impls, tokens=16384, width=2048, warmup=2,
              repeat=10, skip_standard_above_gib=60.0, max_call_ms=5000.0, on_row=None, window_size=None, gqa=1,
              varlen=False, group_ms=0.0, explicit=True, single_too=False):
    """Measure every (head_dim, causal, dtype, seqlen) x implementation x pass; returns the rows.

    ``on_row(row)`` is called as each row is measured (the CLI prints it and saves the JSON, so that a run cut
    short keeps what it measured). An implementation whose call took longer than ``max_call_ms`` at one
    seqlen is not run at the longer ones (recorded as skipped). ``window_size`` (a sliding window) and ``gqa``
    (query heads per key/value head) time only the implementations that take them (flashnumba's). ``varlen``
    packs each batch as sequences of random lengths up to seqlen (``varlen_lengths``) and times the varlen entry
    points, again flashnumba's only. A pair of an implementation and a dtype it does not take (its ``dtypes``) is
    recorded as skipped when ``explicit`` (the implementations were asked for by name), else left out.
    ``single_too``: where ``group_ms`` > 0 (calls back to back), each pass is also timed one call per sample
    (``ms_single``, ``tflops_single``: the host's work before the first kernel on the clock)."""
    rows, invalid, too_slow = [], {}, set()

    def emit(row):
        rows.append(row)
        if on_row is not None:
            on_row(row)

    configs = [(d, c, dt, n) for d in head_dims for c in causals for dt in dtypes for n in seqlens]
    bar = _progress(len(configs) * len(impls))
    for d, causal, dtype, n in configs:
        batch, nheads = max(1, tokens // n), max(1, width // d)
        rng = np.random.default_rng(n)
        shape, kv_shape = (batch, n, nheads, d), (batch, n, max(1, nheads // gqa), d)
        lens = None
        if varlen:  # one packed batch of about the same number of tokens
            lens = varlen_lengths(batch * n, n, rng)
            cu_host = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
            shape, kv_shape = (sum(lens), nheads, d), (sum(lens), kv_shape[2], d)
        q, dout = (_to_device(rng.standard_normal(shape, dtype=np.float32).astype(dtype)) for _ in range(2))
        k, v = (_to_device(rng.standard_normal(kv_shape, dtype=np.float32).astype(dtype)) for _ in range(2))
        if varlen:
            cu = _to_device(cu_host, like=q)
        opts = {} if window_size is None else dict(window_size=tuple(window_size))
        for name, make in impls.items():
            bar.set_description(f"{name} d={d} N={n} causal={causal} {np.dtype(dtype).name}")
            bar.update()
            key = (name, d, causal, np.dtype(dtype).name)
            base = dict(impl=name, head_dim=d, seqlen=n, batch=batch, nheads=nheads, causal=causal,
                        dtype=np.dtype(dtype).name, nheads_k=kv_shape[-2],
                        window_size=None if window_size is None else list(window_size))
            if np.dtype(dtype).name not in getattr(make, "dtypes", ALL_DTYPES):
                if explicit:
                    emit(dict(base, error=f"skipped: takes {', '.join(make.dtypes)}"))
                continue
            if varlen:
                base.update(batch=len(lens), varlen_lengths=lens)
                if not hasattr(make, "varlen"):
                    emit(dict(base, error="skipped: this implementation has no varlen entry point here"))
                    continue
            if (window_size is not None or gqa > 1) and not getattr(make, "features", False):
                emit(dict(base, error="skipped: this implementation takes no window / GQA here"))
                continue
            if key not in invalid:
                check = (lambda: validate_varlen(make.varlen, d, causal, dtype, opts.get("window_size"), gqa)) \
                    if varlen else (lambda: validate(make, d, causal, dtype, window_size=opts.get("window_size"),
                                                     gqa=gqa))
                invalid[key] = check()
            if invalid[key]:
                emit(dict(base, error=invalid[key]))
                continue
            if key in too_slow:
                emit(dict(base, error=f"skipped: slower than {max_call_ms:.0f} ms per call at a shorter seqlen"))
                continue
            n2_gib = batch * nheads * n * n * np.dtype(dtype).itemsize / 2**30
            if name.startswith(("standard", "torch_sdpa_math")) and 2 * n2_gib > skip_standard_above_gib:
                emit(dict(base, error=f"skipped: needs > {2 * n2_gib:.0f} GiB"))
                continue
            lib = "torch" if name.startswith("torch") or np.dtype(dtype).name == "bfloat16" else "cupy"
            try:
                if varlen:
                    fns = make.varlen(q, k, v, dout, cu, cu, max(lens), max(lens), causal, **opts)
                else:
                    fns = make(q, k, v, dout, causal, **opts)
                plans = fns.pop(PLANS, {})
                for p in passes:
                    if p not in fns:
                        emit(dict(base, error=f"skipped: no {p} pass here"))
                        continue
                    ms, times, peak, calls = _peak_and_time(fns[p], lib, warmup, repeat, group_ms)
                    f = varlen_flops(lens, nheads, d, causal, p, opts.get("window_size")) if varlen else \
                        flops(batch, nheads, n, d, causal, p, opts.get("window_size"))
                    row = dict(base, pass_=p, ms=ms, times_ms=times, tflops=f / ms / 1e9, peak_bytes=peak,
                               calls_per_sample=calls)
                    if p in plans:  # the kernels and tiles that ran (flashnumba's)
                        row["kernels"] = plan_summary(plans[p])
                    if single_too and group_ms:
                        single, _, _ = cuda_time_calls_ms(fns[p], warmup=0, repeat=repeat, group_ms=0.0)
                        row.update(ms_single=single, tflops_single=f / single / 1e9)
                    emit(row)
                    if ms > max_call_ms:
                        too_slow.add(key)
                del fns
            except Exception as err:  # noqa: BLE001  (out of memory, unsupported shape in a peer)
                emit(dict(base, error=f"{type(err).__name__}: {str(err).splitlines()[0][:120]}"))
            _free()
        del q, k, v, dout
        _free()
    bar.close()
    return rows


def _free():
    if _backend.SIMULATOR:
        return
    import cupy

    cupy.get_default_memory_pool().free_all_blocks()
    try:
        import torch

        torch.cuda.empty_cache()
    except ImportError:
        pass


def _out_of_memory(err) -> bool:
    """Whether ``err`` is a device allocation that failed (CuPy's OutOfMemoryError, torch's, the driver's
    CUDA_ERROR_OUT_OF_MEMORY), the end of a budget search, rather than an error to report."""
    text = str(err).lower().replace("_", " ")  # (the driver's CUDA_ERROR_OUT_OF_MEMORY, cuBLAS's ..._ALLOC_FAILED)
    return "OutOfMemory" in type(err).__name__ or "out of memory" in text or "alloc failed" in text


BUDGET_START = 1024  # the budget search's first seqlen


def longest_seqlen_in_budget(impls, budget_gib, head_dim=64, nheads=16, dtype=np.float16, start=BUDGET_START,
                             stop=2**16):
    """For each implementation: the longest power-of-two seqlen whose forward+backward (batch 1) fits in budget.

    The memory counted is the inputs (q, k, v, dout) plus the peak extra memory of the call. The search stops at
    ``stop`` (the cost of one call grows as seqlen^2): an implementation that still fits there is reported as
    ``stop`` with ``at_cap`` in the result, meaning "at least this long"."""
    xp = _xp()
    out = {}
    for name, make in impls.items():
        best, n = None, start
        lib = "torch" if name.startswith("torch") else "cupy"
        while n <= stop:
            inputs = 4 * n * nheads * head_dim * np.dtype(dtype).itemsize
            est_n2 = nheads * n * n * np.dtype(dtype).itemsize
            if name.startswith(("standard", "torch_sdpa_math")) and inputs + est_n2 > budget_gib * 2**30:
                break  # S alone would not fit: do not ask the card for it
            try:
                shape = (1, n, nheads, head_dim)
                q, k, v, dout = (xp.ones(shape, dtype) for _ in range(4))
                _, _, peak, _ = _peak_and_time(make(q, k, v, dout, False)[FWDBWD], lib, 0, 1)
                del q, k, v, dout
            except Exception as err:  # noqa: BLE001  (out of memory ends the search; anything else is a bug)
                _free()
                if not _out_of_memory(err):
                    raise
                break
            _free()
            if inputs + peak > budget_gib * 2**30:
                break
            best = n
            n *= 2
        out[name] = best
    return out


# ---------------------------------------------------------------------------------------------------------------
# reporting
# ---------------------------------------------------------------------------------------------------------------


HEADER = (f"{'impl':22} {'dtype':8} {'d':>4} {'seqlen':>6} {'causal':>6} {'pass':>8} | {'ms':>9} "
          f"{'TFLOP/s':>8} {'x standard':>10} {'peak MiB':>9}")


def format_row(r, standard_ms=None):
    head = f"{r['impl']:22} {r['dtype']:8} {r['head_dim']:4} {r['seqlen']:6} {str(r['causal']):>6}"
    if "error" in r:
        return f"{head} {'':>8} | {r['error']}"
    x = f"{standard_ms / r['ms']:.2f}" if standard_ms else "-"
    single = f"  (one call per sample: {r['ms_single']:.3f} ms, {r['tflops_single']:.2f})" if "ms_single" in r else ""
    return (f"{head} {r['pass_']:>8} | {r['ms']:9.3f} {r['tflops']:8.2f} {x:>10} "
            f"{r['peak_bytes'] / 2**20:9.1f}{single}")


def _standard_ms(rows):
    return {(r["head_dim"], r["seqlen"], r["causal"], r["dtype"], r["pass_"]): r["ms"]
            for r in rows if r["impl"] == "standard_cupy" and "ms" in r}


def table(rows):
    std = _standard_ms(rows)
    lines = [HEADER]
    for r in rows:
        key = (r["head_dim"], r["seqlen"], r["causal"], r["dtype"], r.get("pass_"))
        lines.append(format_row(r, std.get(key)))
    return "\n".join(lines)


def plots(rows, out_dir, prefix="bench-"):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    paths = []
    ok = [r for r in rows if "ms" in r]
    groups = sorted({(r["dtype"], r["head_dim"], r["causal"], r["pass_"]) for r in ok})
    impls = sorted({r["impl"] for r in ok})
    colors = {impl: f"C{n % 10}" for n, impl in enumerate(impls)}  # one colour per implementation everywhere
    for metric, ylabel, fname in (("tflops", "TFLOP/s", "tflops"), ("peak_bytes", "peak extra memory (GiB)",
                                                                        "memory")):
        if not groups:
            break
        if metric == "peak_bytes" and not any(r[metric] for r in ok):  # (the simulator measures no memory)
            continue
        cols = 4
        nrows = -(-len(groups) // cols)
        fig, axes = plt.subplots(nrows, cols, figsize=(4.2 * cols, 3.2 * nrows), squeeze=False)
        for ax, (dt, d, c, p) in zip(axes.flat, groups):
            for impl in impls:
                pts = sorted((r["seqlen"], r[metric] / (2**30 if metric == "peak_bytes" else 1)) for r in ok
                             if (r["impl"], r["dtype"], r["head_dim"], r["causal"], r["pass_"]) == (impl, dt, d, c, p))
                if pts:
                    ax.plot(*zip(*pts), marker="o", label=impl, color=colors[impl])
            ax.set_xscale("log", base=2)
            if metric == "peak_bytes":
                ax.set_yscale("log")
            ax.set_title(f"{dt} d={d} {'causal' if c else 'non-causal'} {p}", fontsize=9)
            ax.set_xlabel("seqlen")
            ax.set_ylabel(ylabel)
        for ax in list(axes.flat)[len(groups):]:
            ax.axis("off")
        handles = [plt.Line2D([], [], color=colors[i], marker="o", label=i) for i in impls]
        fig.legend(handles=handles, loc="lower center", ncol=min(len(impls), 4), fontsize=8)
        fig.subplots_adjust(bottom=0.12)
        fig.tight_layout(rect=(0, 0.06, 1, 1))
        path = os.path.join(out_dir, f"{prefix}{fname}.png")
        fig.savefig(path, dpi=80)
        plt.close(fig)
        paths.append(path)
    return paths


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m flashnumba bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seqlens", type=at_least(1), nargs="+", default=[1024, 4096])
    p.add_argument("--head-dims", type=at_least(1), nargs="+", default=[64, 128])
    p.add_argument("--causal", choices=["both", "on", "off"], default="both")
    p.add_argument("--dtypes", nargs="+", default=["float16", "float32"], choices=list(ALL_DTYPES))
    p.add_argument("--passes", nargs="+", default=[FWD, BWD], choices=[FWD, BWD, FWDBWD])
    others = [n for n in available_implementations(include_peers=False) if n not in DEFAULT_IMPLS]
    p.add_argument("--impls", nargs="+", default=None,
                   help=f"names to run (default: {', '.join(DEFAULT_IMPLS)}, those available; also "
                        f"{', '.join(others)} and torch_sdpa_math)")
    p.add_argument("--tokens", type=at_least(1), default=16384, help="batch * seqlen")
    p.add_argument("--width", type=at_least(1), default=2048, help="nheads * head_dim")
    p.add_argument("--repeat", type=at_least(1), default=10)
    p.add_argument("--warmup", type=at_least(0), default=2)
    p.add_argument("--group-ms", type=at_least(0.0), default=20.0,
                   help="time calls back to back in samples of about this many ms (0: one call per sample, the "
                        "host's work before each call's first kernel then on the clock)")
    p.add_argument("--both-modes", action="store_true",
                   help="time each pass both ways: back to back (--group-ms) and one call per sample")
    p.add_argument("--max-call-ms", type=at_least(0.0), default=5000.0,
                   help="do not run an implementation at longer seqlens once one call took longer than this")
    p.add_argument("--out", default="bench-out")
    p.add_argument("--budget-gib", type=at_least(1e-9), default=None,
                   help="find the longest seqlen each implementation runs within this memory")
    p.add_argument("--window", type=int, nargs=2, default=None, metavar=("LEFT", "RIGHT"),
                   help="sliding window (flashnumba only); TFLOP/s then count the visible pairs exactly")
    p.add_argument("--gqa", type=at_least(1), default=1, help="query heads per key/value head (flashnumba only)")
    p.add_argument("--varlen", action="store_true",
                   help="packed batches of random lengths up to each seqlen (flashnumba's varlen entry points)")
    p.add_argument("--budget-max-seqlen", type=at_least(BUDGET_START), default=2**16,
                   help="longest seqlen the budget search tries (one call's cost grows as seqlen^2)")
    p.add_argument("--from-json", default=None, help="re-print the table and re-draw the plots of a saved run")
    p.add_argument("--latency", action="store_true",
                   help="host time per call of a small attention, and the first call in a new process with a cold "
                        "and a warm kernel cache (flashnumba.tools.latency)")
    p.add_argument("--shared-caps", type=at_least(1), nargs="+", default=None, metavar="BYTES",
                   help="time the default plans with the shared memory per block capped at each of these sizes "
                        "(flashnumba.tools.caps)")
    p.add_argument("--decode", action="store_true",
                   help="decoding against a KV cache: TB/s of K and V read, beside torch's backends "
                        "(flashnumba.tools.decode)")
    p.add_argument("--decode-splits", type=at_least(0), nargs="+", default=[0],
                   help="with --decode: num_splits values to time beside the plan's choice")
    a = p.parse_args(argv)
    # the modes that measure something else take none of the sweep's choices: said, rather than ignored
    mode = next((m for m, on in (("--decode", a.decode), ("--shared-caps", a.shared_caps), ("--latency", a.latency),
                                 ("--from-json", a.from_json), ("--budget-gib", a.budget_gib is not None)) if on), None)
    sweep_only = ("dtypes", "head_dims", "causal", "passes", "window", "gqa", "varlen", "both_modes")
    given = [f"--{n.replace('_', '-')}" for n in sweep_only + (() if mode == "--budget-gib" else ("impls",))
             if getattr(a, n) != p.get_default(n)]
    if mode and given:
        p.error(f"{mode} takes none of {', '.join(given)} (its own workload: see --help)")
    if a.decode_splits != p.get_default("decode_splits") and not a.decode:
        p.error("--decode-splits goes with --decode")
    for d in a.head_dims if not mode else ():
        heads = a.width // d
        if heads < 1:
            p.error(f"--width {a.width} (heads x head_dim) is less than head_dim {d}")
        if heads % a.gqa:
            p.error(f"--gqa {a.gqa} must divide the {heads} query heads of head_dim {d} (--width {a.width} / {d})")
    if _backend.SIMULATOR and mode not in (None, "--from-json"):
        p.error("--decode, --shared-caps, --latency and --budget-gib measure a GPU (CuPy and a CUDA device): "
                "this is the simulator")
    work = a.tokens * max(a.seqlens) * a.width
    if _backend.SIMULATOR and mode is None and work > SIMULATOR_MAX_WORK:
        p.error(f"this is the simulator (a Python thread per CUDA thread), where a sweep of --tokens x the longest "
                f"--seqlens x --width = {work} would take hours: ask for at most {SIMULATOR_MAX_WORK}, e.g. "
                f"--seqlens 32 --head-dims 16 --tokens 32 --width 32")
    if a.window is not None and min(a.window) < -1:
        p.error(f"--window LEFT RIGHT: each -1 (unbounded) or >= 0, got {a.window[0]} {a.window[1]}")
    if os.path.exists(a.out) and not os.path.isdir(a.out):
        p.error(f"--out {a.out} is a file: name a folder")
    if a.decode:
        from .decode import run as decode_run

        seqlens = a.seqlens if a.seqlens != p.get_default("seqlens") else (8192, 32768)
        decode_run(a.out, seqlens=seqlens, group_ms=a.group_ms, splits=a.decode_splits)
        return 0
    if a.shared_caps:
        from .caps import main as caps_main

        caps_main(a.shared_caps, a.out, seqlen=a.seqlens[0] if a.seqlens != p.get_default("seqlens") else 4096)
        return 0
    if a.latency:
        from .latency import main as latency_main

        latency_main(a.out)
        return 0
    if a.from_json:
        try:
            with open(a.from_json) as f:
                saved = json.load(f)
        except (OSError, ValueError) as err:
            p.error(f"--from-json {a.from_json}: {err}")
        if "rows" not in saved:
            p.error(f"--from-json {a.from_json}: no rows of a timed run (a budget search's JSON has none)")
        os.makedirs(a.out, exist_ok=True)
        print(table(saved["rows"]))
        stem = os.path.splitext(os.path.basename(a.from_json))[0]
        for path in plots(saved["rows"], a.out, prefix=f"{stem}-"):
            print(f"wrote {path}")
        return 0
    impls = available_implementations()
    if a.impls:
        unknown = set(a.impls) - set(impls)
        if unknown:
            p.error(f"unknown or unavailable implementations {sorted(unknown)}; available: {sorted(impls)}")
        impls = {n: impls[n] for n in a.impls}
    else:
        impls = {n: impls[n] for n in DEFAULT_IMPLS if n in impls}
    os.makedirs(a.out, exist_ok=True)
    result = dict(environment=environment())
    if a.budget_gib is not None:
        result["budget_gib"] = a.budget_gib
        result["longest_seqlen"] = longest_seqlen_in_budget(impls, a.budget_gib, stop=a.budget_max_seqlen)
        result["budget_max_seqlen"] = a.budget_max_seqlen
        print(f"longest seqlen (power of two) for forward+backward within {a.budget_gib} GiB "
              f"(batch 1, 16 heads, head_dim 64, float16; the search stops at {a.budget_max_seqlen}):")
        for name, n in result["longest_seqlen"].items():
            at_cap = " (the search's limit: at least this)" if n == a.budget_max_seqlen else ""
            print(f"  {name:22} {n}{at_cap}")
    else:
        causals = {"both": [False, True], "on": [True], "off": [False]}[a.causal]
        result["rows"] = []
        path = os.path.join(a.out, "bench.json")
        if _backend.SIMULATOR:
            print("(the simulator: ms is its wall time, thousands of times a GPU's, and no memory is measured)")
        print(HEADER, flush=True)

        def on_row(row):  # print and save as we go: a run cut short keeps what it measured
            result["rows"].append(row)
            print(format_row(row), flush=True)
            _save(result, path)

        rows = run_sweep(seqlens=a.seqlens, head_dims=a.head_dims, causals=causals,
                         dtypes=[dtype_of(d) for d in a.dtypes], passes=a.passes, impls=impls, tokens=a.tokens,
                         width=a.width, warmup=a.warmup, repeat=a.repeat, max_call_ms=a.max_call_ms,
                         on_row=on_row, window_size=a.window, gqa=a.gqa, varlen=a.varlen, group_ms=a.group_ms,
                         explicit=bool(a.impls), single_too=a.both_modes)
        result["group_ms"] = a.group_ms
        print()
        print(table(rows))
        result["plots"] = [os.path.basename(x) for x in plots(rows, a.out)]
    path = os.path.join(a.out, "bench.json" if a.budget_gib is None else "budget.json")
    _save(result, path)
    print(f"wrote {path}")
    return 0


SIMULATOR_MAX_WORK = 2**20  # tokens x seqlen x width of the largest sweep the simulator is asked for (minutes)


def _save(result, path):
    with open(path + ".tmp", "w") as f:
        json.dump(result, f, indent=1)
    os.replace(path + ".tmp", path)
