"""A/B of tensor-core forward kernels, kernel only (docs/results/h200-2026-11-29-f5435d9-ab-tc-forward.txt).

Compares flashnumba.forward_tc with copies of other versions of it, made before the run, e.g.

    git show 5fa6144:flashnumba/forward_tc.py > flashnumba/_ab_main_forward_tc.py   # "main" (6-argument kernel)
    cp flashnumba/forward_tc.py flashnumba/_ab_v4.py   # then edit the copy (v4: hk = h)

and run (-P: this directory's profile.py would shadow the standard library's):

    python -P scripts/ab_tc_forward.py
"""
import importlib
import numpy as np, cupy, flashnumba
from numba import cuda
from flashnumba import api, forward, forward_tc as B, _ab_main_forward_tc as A
from flashnumba.timing import cuda_events_ms as per_launch_ms

mods = {n: importlib.import_module(f"flashnumba._ab_{n}") for n in ("v4",)}
for D, causal in ((64, True), (64, False), (128, True)):
    N = 4096; batch = 16384 // N; H = 2048 // D
    q, k, v = (cupy.asarray(np.random.default_rng(i).standard_normal((batch, N, H, D)).astype(np.float16))
               for i in range(3))
    cap = {}
    orig = api.launch
    def spy(fn, grid, block, smem, args):
        cap["b"] = (fn, grid, block, smem, args)
        return orig(fn, grid, block, smem, args)
    api.launch = spy
    ref = flashnumba.flash_attn_forward(q, k, v, causal=causal, kernel="tc")
    api.launch = orig
    fnb, grid, block, smem, args = cap["b"]
    out = cupy.full_like(q, np.nan); lse = cupy.empty((batch, H, N), np.float32)
    argsa = (*args[:3], cuda.as_cuda_array(out), cuda.as_cuda_array(lse), np.float32(D ** -0.5 * forward.LOG2E))
    kern = {"main": (A.make_forward_tc(D, causal), argsa), "final": (fnb, args)}
    variant = forward.Variant(has_right=causal)
    for n, mod in mods.items():
        o2 = cupy.full_like(q, np.nan)
        kern[n] = (mod.make_forward_tc(D, variant), (*args[:3], cuda.as_cuda_array(o2), *args[4:]))
        kern[n + "_out"] = o2
    runs = {n: (lambda f=f, a=a: orig(f, grid, block, smem, a))
            for n, x in kern.items() if not n.endswith("_out") for f, a in [x]}
    for f in runs.values():
        f()
    cupy.cuda.Device().synchronize()
    same = {n: bool((kern[n + "_out"] == ref[0]).all()) for n in mods}
    same["main"] = bool((out == ref[0]).all())
    t = {n: [] for n in runs}
    api_t = []
    for rep in range(7):
        for n, f in runs.items():
            t[n].append(per_launch_ms(f, 10))
        api_t.append(per_launch_ms(lambda: flashnumba.flash_attn_forward(q, k, v, causal=causal, kernel="tc"), 10))
    flops = 4 * batch * H * N * N * D / (2 if causal else 1)
    print(f"D={D} causal={causal} same bits={same}")
    for n, x in t.items():
        m = np.median(x)
        print(f"   {n:8} {m:.3f} ms ({flops / m / 1e9:.1f} TFLOP/s)")
    m = np.median(api_t)
    print(f"   {'api':8} {m:.3f} ms ({flops / m / 1e9:.1f} TFLOP/s)")

# where the API's host time goes: 200 calls under cProfile (kernels queued, not waited for)
import cProfile, pstats, io  # (run with python -P: scripts/profile.py would shadow the stdlib module)
q, k, v = (cupy.asarray(np.random.default_rng(i).standard_normal((4, 4096, 16, 128)).astype(np.float16))
           for i in range(3))
flashnumba.flash_attn_forward(q, k, v, causal=True)
cupy.cuda.Device().synchronize()
import time
ht = []
for _ in range(200):
    cupy.cuda.Device().synchronize()
    t1 = time.perf_counter()
    flashnumba.flash_attn_forward(q, k, v, causal=True)
    ht.append(time.perf_counter() - t1)
print(f"host time of one flash_attn_forward call (tc, d=128): median {1e3 * np.median(ht):.3f} ms")
pr = cProfile.Profile(); pr.enable()
for _ in range(200):
    flashnumba.flash_attn_forward(q, k, v, causal=True)
    cupy.cuda.Device().synchronize()
pr.disable()
s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(25); print(s.getvalue()[:6000])
