"""What a smaller GPU's shared memory costs: the default plans timed with the shared memory per block capped
(``FLASHNUMBA_MAX_SHARED_BYTES``), as on an RTX 30/40, A10 or L4 (99 KB) or a T4 (64 KB), on the GPU at hand:
``python -m flashnumba bench --shared-caps 101376 65536``.

Each cap runs in its own process (the cap is read when a plan is made). The workload is the FlashAttention-2
paper's (batch = 16384 / seqlen, heads = 2048 / head_dim); TFLOP/s count 4 * batch * heads * seqlen^2 * head_dim for
the forward and 2.5 times that for the backward; times are the median of calls back to back between CUDA events.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

ONE = r"""
import json, sys
import numpy as np, cupy
import flashnumba
from flashnumba.tools.timing import cuda_time_calls_ms
seqlen = int(sys.argv[1])
rows = []
for dtype in ("float16", "float32"):
    for d in (64, 128):
        batch, heads = 16384 // seqlen, 2048 // d
        rng = np.random.default_rng(0)
        q, k, v, do = (cupy.asarray(rng.standard_normal((batch, seqlen, heads, d)).astype(dtype)) for _ in range(4))
        out, lse = flashnumba.flash_attn_forward(q, k, v)
        flops = 4 * batch * heads * seqlen * seqlen * d
        for name, fn, plan, f in (
                ("fwd", lambda: flashnumba.flash_attn_forward(q, k, v), flashnumba.plan(q, k, v), flops),
                ("bwd", lambda: flashnumba.flash_attn_backward(do, q, k, v, out, lse),
                 flashnumba.plan_backward(do, q, k, v, out, lse), 2.5 * flops)):
            ms = cuda_time_calls_ms(fn, warmup=2, repeat=10, group_ms=20)[0]
            tiles = "; ".join(f"{s.name} ({s.tiles.block_m}, {s.tiles.block_n})" for s in plan.launches
                              if s.tiles is not None)
            rows.append(dict(dtype=dtype, head_dim=d, pass_=name, kernel=plan.kernel, tiles=tiles,
                             max_shared=plan.device.max_shared_per_block, ms=round(ms, 4),
                             tflops=round(f / ms / 1e9, 2)))
print(json.dumps(rows))
"""


def main(caps, out_dir=None, seqlen=4096):
    rows = []
    for cap in [None, *caps]:
        env = dict(os.environ)
        env.pop("FLASHNUMBA_MAX_SHARED_BYTES", None)
        if cap is not None:
            env["FLASHNUMBA_MAX_SHARED_BYTES"] = str(cap)
        proc = subprocess.run([sys.executable, "-c", ONE, str(seqlen)], env=env, capture_output=True, text=True,
                              timeout=900)
        if proc.returncode:
            raise RuntimeError(proc.stderr[-3000:])
        for r in json.loads(proc.stdout.strip().splitlines()[-1]):
            rows.append(dict(cap=cap, **r))
    base = {(r["dtype"], r["head_dim"], r["pass_"]): r["tflops"] for r in rows if r["cap"] is None}
    print(f"seqlen {seqlen}: TFLOP/s of the default plans under each shared-memory cap (vs no cap)")
    print(f"{'cap':>8} {'dtype':8} {'d':>4} {'pass':4} {'kernel':6} {'TFLOP/s':>8} {'vs':>6}  tiles")
    for r in rows:
        rel = r["tflops"] / base[(r["dtype"], r["head_dim"], r["pass_"])]
        print(f"{r['cap'] or 'none':>8} {r['dtype']:8} {r['head_dim']:4} {r['pass_']:4} {r['kernel']:6} "
              f"{r['tflops']:8.1f} {rel:6.2f}  {r['tiles']}")
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, "caps.json"), "w") as f:
            from .environment import environment

            json.dump({"environment": environment(), "seqlen": seqlen, "rows": rows}, f, indent=1)
    return rows
