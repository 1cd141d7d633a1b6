"""Which part of the 3xTF32 backward on wgmma goes wrong per step at head_dim 64 on the GPU (right in the
simulator, chained, and at head_dim 128): the backward run with its products' forms swapped one at a time, each
gradient's largest error against the float64 reference printed.

    python scripts/wgmma_tf32_backward_variants.py VARIANT     (one variant a process: the kernels are cached)

VARIANT: ``as-is`` (per step, the dQ and dK/dV products' k-steps in turns at head_dim 64); ``no-turns`` (those
k-steps one after another, each waited for); ``smem-chained`` (S and dP chained in their accumulators, the register
products as they are); ``register-chained`` (the dQ, dK and dV products chained); ``resources`` (the kernels at head
dim 64 compiled for sm_90a here: registers, spills, the assembler's warnings). The planner's rule that sends
per-step calls at head_dim 64 to the ``mma.sync`` kernels on a GPU (``planner._hopper_3x_backward``) is lifted
here. Needs a GPU of compute capability 9.0 (or the simulator, where every variant is right).
"""

import re
import sys

import numpy as np

import flashnumba
from flashnumba import _launch, planner
from flashnumba.kernels import wgmma_tf32, wgmma_tf32_backward as wb

variant = sys.argv[1] if len(sys.argv) > 1 else "as-is"
register_products, smem_products = wgmma_tf32.make_register_products, wgmma_tf32.make_smem_products
if variant == "no-turns":
    wb.make_register_products = lambda N, steps, chained, in_turns: register_products(N, steps, chained, False)
elif variant == "smem-chained":
    wb.make_smem_products = lambda N, steps, chained: smem_products(N, steps, True)
elif variant == "register-chained":
    wb.make_register_products = lambda N, steps, chained, in_turns: register_products(N, steps, True, False)
elif variant == "resources":
    a, r = "float32[:, :, :, ::1]", "float32[:, :, ::1]"
    for name, make, sig in (("dQ", wb.make_backward_dq_3xtf32_wgmma, f"void({a}, {a}, {a}, {a}, {r}, {r}, {a}, "
                                                                       "float32, float32)"),
                            ("dK/dV", wb.make_backward_dkdv_3xtf32_wgmma, f"void({a}, {a}, {a}, {a}, {r}, {r}, {a}, "
                                                                          f"{a}, float32, float32)")):
        for chained in (False, True):
            _, log, _ = _launch.build(make(64, True, 16, chained).py_func, sig, (9, 0, "a"), None, False)
            print(f"{name} chained={chained}: {_launch.resources_from_log(log)}")
            print("\n".join(line for line in log.splitlines() if re.search(r"warning|\bC7\d{3}\b", line)))
    sys.exit()
elif variant != "as-is":
    sys.exit(f"unknown variant {variant!r}: as-is, no-turns, smem-chained, register-chained or resources")
planner._hopper_3x_backward = lambda D: True  # (the wgmma kernels at every head dim)

rng = np.random.default_rng(0)
for sq, sk, d, causal, loop in ((77, 91, 64, True, 16), (150, 70, 64, False, 32), (64, 16, 64, False, 16),
                                (65, 140, 128, True, 16)):
    q, k, v, dout = (rng.standard_normal((1, n, 2, d)).astype(np.float32) for n in (sq, sk, sk, sq))
    out, lse = flashnumba.flash_attn_forward(q, k, v, causal=causal)
    with flashnumba.config.temporarily("hopper_3xtf32", "per_step"):
        grads = flashnumba.flash_attn_backward(dout, q, k, v, out, lse, causal=causal, precision="3xtf32",
                                               block_m=loop, block_n=loop)
    truth = flashnumba.reference.attention_backward(dout, q, k, v, causal=causal)
    print(f"{variant}: sq={sq} sk={sk} d={d} causal={causal} loop tiles {loop}: max error of dq, dk, dv "
          + ", ".join(f"{float(np.abs(np.asarray(g) - t).max()):.2e}" for g, t in zip(grads, truth)), flush=True)
