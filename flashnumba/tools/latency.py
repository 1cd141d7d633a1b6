"""Host cost of a call, and of the first call in a new process: ``python -m flashnumba bench --latency``.

Per call. A small attention (batch 1, seqlen 256, 16 heads, head_dim 64, float16, CuPy arrays by default) runs in
microseconds on a large GPU, so what a model with many layers pays is the Python between kernels. Reported for the
forward and for the backward, flashnumba beside torch's ``scaled_dot_product_attention`` where torch is installed
(and flashnumba called from torch, through :mod:`flashnumba.torch`'s autograd Function and custom operators):

* ``back_to_back_us``: N calls between two CUDA events, divided by N (the host never waits for the GPU; what
  a training loop sees);
* ``single_us``: one call between two events after a synchronisation (the host's work before the first kernel on
  the clock);
* ``host_us``: the host's wall time per call of N calls without synchronising (the Python cost alone);
* ``kernels_us``: the same N calls' kernels alone, launched straight from their bound launchers (flashnumba only).

First call. A new process computes the same forward and backward twice, once with an empty kernel cache (compile)
and once with the cache the first left (load): wall time of the first forward and the first backward, and the
compile time of each kernel as the cache records it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

SHAPE = (1, 256, 16, 64)  # batch, seqlen, nheads, head_dim


def _events(fn, calls):
    import cupy

    start, stop = cupy.cuda.Event(), cupy.cuda.Event()
    cupy.cuda.Device().synchronize()
    start.record()
    for _ in range(calls):
        fn()
    stop.record()
    stop.synchronize()
    return 1e3 * cupy.cuda.get_elapsed_time(start, stop) / calls


def _host(fn, calls):
    import cupy

    cupy.cuda.Device().synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t = time.perf_counter() - t0
    cupy.cuda.Device().synchronize()
    return 1e6 * t / calls


def _measure(fn, calls=200, warmup=20):
    for _ in range(warmup):
        fn()
    single = sorted(_events(fn, 1) for _ in range(50))[25]
    b2b = sorted(_events(fn, calls) for _ in range(7))[3]
    host = sorted(_host(fn, calls) for _ in range(7))[3]
    return {"back_to_back_us": round(b2b, 2), "single_us": round(single, 2), "host_us": round(host, 2)}


def per_call(shape=SHAPE, dtype="float16", causal=False, calls=200):
    """Rows of per-call figures: flashnumba forward and backward, and torch SDPA's where torch is installed."""
    import cupy

    import flashnumba
    from flashnumba import _launch

    rng = np.random.default_rng(0)
    q, k, v, dout = (cupy.asarray(rng.standard_normal(shape).astype(dtype)) for _ in range(4))
    out, lse = flashnumba.flash_attn_forward(q, k, v, causal=causal)
    rows = []
    fwd = lambda: flashnumba.flash_attn_forward(q, k, v, causal=causal)  # noqa: E731
    bwd = lambda: flashnumba.flash_attn_backward(dout, q, k, v, out, lse, causal=causal)  # noqa: E731
    for name, fn, plan in (("forward", fwd, flashnumba.plan(q, k, v, causal=causal)),
                           ("backward", bwd, flashnumba.plan_backward(dout, q, k, v, out, lse, causal=causal))):
        row = dict(impl="flashnumba", pass_=name, kernel=plan.kernel, **_measure(fn, calls))
        call = _launch.Call(plan)
        arrays = (q, k, v, None, None, None) if name == "forward" else (dout, q, k, v, out, lse, None, None, None)
        values, outs, keep = call.prepare(arrays)  # outs and keep: alive while the kernels write them
        stream = cupy.cuda.get_current_stream().ptr
        row["kernels_us"] = round(sorted(_events(lambda: [b(values, stream) for b in call.bound], calls)
                                         for _ in range(7))[3], 2)
        rows.append(row)
    try:
        import torch
    except ImportError:
        return rows
    tq, tk, tv, tdo = (torch.as_tensor(x, device="cuda").transpose(1, 2).contiguous() for x in (q, k, v, dout))
    tq.requires_grad_(), tk.requires_grad_(), tv.requires_grad_()
    sdpa = torch.nn.functional.scaled_dot_product_attention
    tfwd = lambda: sdpa(tq, tk, tv, is_causal=causal)  # noqa: E731
    tout = sdpa(tq, tk, tv, is_causal=causal)
    tbwd = lambda: torch.autograd.grad(tout, (tq, tk, tv), tdo, retain_graph=True)  # noqa: E731
    rows.append(dict(impl="torch_sdpa", pass_="forward", kernel="auto", **_measure(tfwd, calls)))
    rows.append(dict(impl="torch_sdpa", pass_="backward", kernel="auto", **_measure(tbwd, calls)))
    # flashnumba from torch: the autograd Function and custom operators of flashnumba.torch, flash-attn's layout
    import flashnumba.torch as fnt

    fq, fk, fv, fdo = (torch.as_tensor(x, device="cuda").clone() for x in (q, k, v, dout))
    fq.requires_grad_(), fk.requires_grad_(), fv.requires_grad_()
    ffwd = lambda: fnt.flash_attn_func(fq, fk, fv, causal=causal)  # noqa: E731
    fout = ffwd()
    fbwd = lambda: torch.autograd.grad(fout, (fq, fk, fv), fdo, retain_graph=True)  # noqa: E731
    rows.append(dict(impl="flashnumba.torch", pass_="forward", kernel=rows[0]["kernel"], **_measure(ffwd, calls)))
    rows.append(dict(impl="flashnumba.torch", pass_="backward", kernel=rows[1]["kernel"], **_measure(fbwd, calls)))
    return rows


FIRST_CALL = r"""
import json, sys, time
t0 = time.perf_counter()
import numpy as np, cupy
import flashnumba
t_import = time.perf_counter() - t0
shape = tuple(json.loads(sys.argv[1]))
rng = np.random.default_rng(0)
q, k, v, dout = (cupy.asarray(rng.standard_normal(shape).astype(np.float16)) for _ in range(4))
cupy.cuda.Device().synchronize()
t0 = time.perf_counter()
out, lse = flashnumba.flash_attn_forward(q, k, v, causal=True)
cupy.cuda.Device().synchronize()
t_fwd = time.perf_counter() - t0
t0 = time.perf_counter()
flashnumba.flash_attn_backward(dout, q, k, v, out, lse, causal=True)
cupy.cuda.Device().synchronize()
t_bwd = time.perf_counter() - t0
from flashnumba import _launch
compiled = [dict(cached=c.cached, seconds=round(c.seconds, 3), entry=c.entry[:60]) for c in _launch._compiled.values()]
print(json.dumps(dict(import_s=round(t_import, 3), first_forward_s=round(t_fwd, 3), first_backward_s=round(t_bwd, 3),
                      kernels=compiled)))
"""


def first_call(shape=SHAPE):
    """The first forward and backward in a new process, cold (empty cache) and warm (the cache of the first)."""
    rows = []
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, FLASHNUMBA_CACHE_DIR=cache)
        for label in ("cold cache", "warm cache"):
            proc = subprocess.run([sys.executable, "-c", FIRST_CALL, json.dumps(list(shape))], env=env,
                                  capture_output=True, text=True, timeout=600)
            if proc.returncode:
                raise RuntimeError(proc.stderr[-2000:])
            rows.append(dict(cache=label, **json.loads(proc.stdout.strip().splitlines()[-1])))
    return rows


def main(out_dir=None):
    from .environment import environment, write_json

    result = {"environment": environment(), "shape": list(SHAPE), "dtype": "float16", "per_call": per_call(),
              "first_call": first_call()}
    print(f"per call, shape {SHAPE} float16 (us): back to back | single | host | kernels")
    for r in result["per_call"]:
        print(f"  {r['impl']:16} {r['pass_']:8} {r['kernel']:5} {r['back_to_back_us']:9.1f} {r['single_us']:9.1f} "
              f"{r['host_us']:9.1f} {r.get('kernels_us', float('nan')):9.1f}")
    print("first call in a new process (s): import | forward | backward")
    for r in result["first_call"]:
        print(f"  {r['cache']:10} {r['import_s']:7.2f} {r['first_forward_s']:8.2f} {r['first_backward_s']:8.2f}  "
              f"compiled {sum(not k['cached'] for k in r['kernels'])} kernels in "
              f"{sum(k['seconds'] for k in r['kernels']):.1f} s, loaded {sum(k['cached'] for k in r['kernels'])}")
    if out_dir:
        print(f"wrote {write_json(result, out_dir, 'latency.json')}")
    return result
