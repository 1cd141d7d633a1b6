"""A user's score_mod on the Hopper kernels at the tiles of the built-in options (the default where its kernel
spills nothing: flashnumba.api._flex_compiled) against the smaller tiles it would take where they spill, beside the
built-in option it reproduces:

    python scripts/flex_score_mod_tiles.py [64] [128]

Cases (seqlen 8192, float16, batch = 16384 / seqlen, heads = 2048 / head_dim; scripts/flex_score_mods.py's
functions, with a causal block mask of 128 where the built-in is causal): ALiBi written three ways (``alibi_f32``:
the distance of the indices in float32, as docs/usage.md advises; ``alibi``: ``np.float32(abs(i - j))``, Numba's
64-bit integer distance; ``alibi_i32``: the distance narrowed, ``np.int32(i - j)``), the tanh softcap (through
math.tanh, and ``softcap-approx`` through flashnumba.tanh_approx), the relative-bias table. Each row: ms of one call
a pair of CUDA events (median of 20 after warm-up) and, in brackets, calls back to back; the tiles each kernel took
and whether its thread takes local memory there. "smaller": every kernel planned as if it spilled. The outputs and
gradients of the two plans are compared (float16 rounding).
"""
import sys

import cupy as cp
import numpy as np

import flashnumba
import flex_score_mods as fsm  # (scripts/: the functions timed there)
from flashnumba import _launch
from flashnumba.tools.timing import cuda_events_ms, cuda_time_ms


def alibi_i64(x, b, h, i, j, slopes):  # (Numba's 64-bit distance; flex_score_mods.alibi_mod takes it in float32)
    return x - slopes[h] * np.float32(abs(i - j))


def alibi_i32(x, b, h, i, j, slopes):
    return x - slopes[h] * np.float32(abs(np.int32(i - j)))


def timed(fn):
    """(ms of one call a pair of events, ms a call of 20 back to back), after a first call."""
    fn()
    cp.cuda.Device().synchronize()
    return cuda_time_ms(fn, warmup=3, repeat=20)[0], cuda_events_ms(fn, 20)


def largest_difference(a, b):
    return max(float(cp.abs(x.astype(cp.float32) - y.astype(cp.float32)).max()) for x, y in zip(a, b))


def main():
    real, seen = _launch.uses_local_memory, []

    def table_tiles(s, arrays, scalars, device):  # (what the plan does, the answer recorded)
        r = real(s, arrays, scalars, device)
        seen.append(f"{s.name} {tuple(s.tiles)[:2]} local={r}")
        return r

    def smaller(s, arrays, scalars, device):  # (every kernel as if it spilled)
        seen.append(f"{s.name} (as if it spilled)")
        return True

    def row(d, case, what, fn):
        ms, b2b = timed(fn)
        print(f"d={d} {case:14s} {what}{' [' + '; '.join(seen) + ']' if seen else ''}: {ms:.3f} ms "
              f"(back to back {b2b:.3f})", flush=True)
        seen.clear()

    n = 8192
    for d in map(int, sys.argv[1:] or ["64", "128"]):
        q, k, v, dout, slopes, table, bm = fsm.workload(d, n, 16384, 2048, cp)
        cases = {"alibi_f32": (fsm.alibi_mod, fsm.one, (slopes,), bm),
                 "softcap": (fsm.softcap_mod, fsm.softcap_grad, (), None),
                 "softcap-approx": (fsm.softcap_approx_mod, fsm.softcap_approx_grad, (), None),
                 "alibi": (alibi_i64, fsm.one, (slopes,), bm), "alibi_i32": (alibi_i32, fsm.one, (slopes,), bm),
                 "bias": (fsm.bias_mod, fsm.one, (table,), bm)}
        for case, (mod, grad, args, bmask) in cases.items():
            backward = case not in ("alibi", "alibi_i32") or d == 64
            if case != "bias":
                builtin = (dict(softcap=fsm.SOFTCAP) if case.startswith("softcap")
                           else dict(causal=True, alibi_slopes=slopes))
                row(d, case, "forward  built-in", lambda: flashnumba.flash_attn_forward(q, k, v, **builtin))
                if case in ("alibi_f32", "softcap", "softcap-approx"):
                    o, lse = flashnumba.flash_attn_forward(q, k, v, **builtin)
                    row(d, case, "backward built-in",
                        lambda: flashnumba.flash_attn_backward(dout, q, k, v, o, lse, **builtin))
            results = {}
            for label, answer in (("table tiles", table_tiles), ("smaller", smaller)):
                _launch.uses_local_memory = answer
                flashnumba.clear_plan_cache()

                def forward():
                    return flashnumba.flex_attention(q, k, v, mod, block_mask=bmask, score_mod_args=args,
                                                     kernel="wgmma", return_lse=True)

                out, lse = forward()
                row(d, case, f"forward  {label:12s}", forward)

                def backward_call():
                    return flashnumba.flex_attention_backward(dout, q, k, v, out, lse, mod, score_mod_grad=grad,
                                                              block_mask=bmask, score_mod_args=args, kernel="wgmma")

                grads = ()
                if backward:
                    grads = backward_call()
                    row(d, case, f"backward {label:12s}", backward_call)
                results[label] = ((out,), grads)
            _launch.uses_local_memory = real
            flashnumba.clear_plan_cache()
            (out_t, g_t), (out_s, g_s) = results["table tiles"], results["smaller"]
            print(f"d={d} {case}: differences table against smaller tiles: out {largest_difference(out_t, out_s):.2e}"
                  + (f", grads {largest_difference(g_t, g_s):.2e}" if g_s else ""), flush=True)


if __name__ == "__main__":
    main()
