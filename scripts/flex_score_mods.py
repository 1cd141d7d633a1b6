"""A user's score_mod on the GPU beside the built-in option it reproduces and PyTorch's FlexAttention with the same
function: the score_mod examples of notebook 04 (ALiBi with a causal block mask, tanh softcap through math.tanh and
through flashnumba.tanh_approx, a learned relative-position bias table with a causal block mask).

    python scripts/flex_score_mods.py [--out DIR] [--seqlen 8192] [--head-dims 64 128] [--backward]
        [--cases alibi softcap softcap-approx bias] [--tokens 16384] [--width 2048]

Workload: float16, batch = 16384 / seqlen, heads = 2048 / head_dim. Rows: milliseconds of one call per pair of CUDA
events after warm-up, and TFLOP/s of the entries the mask leaves (a backward counted as 2.5 forwards):

* "built-in": the option itself where flashnumba has it (``alibi_slopes`` with ``causal``; ``softcap``), on
  ``kernel=None``'s kernels;
* "score_mod (mma.sync)": ``flex_attention(..., kernel="tc")``; on compute capability 9.0 also "score_mod
  (Hopper)": ``kernel="wgmma"``;
* "torch flex": ``torch.nn.attention.flex_attention`` under ``torch.compile`` with the same function and block mask.

With ``--backward``, the same rows for the backward (``flex_attention_backward`` with the score_mod's derivative;
FlexAttention's backward through autograd on a kept forward graph). Each flashnumba output is compared with
FlexAttention's computed in float32 (beside FlexAttention's own float16 difference from it), each gradient with
FlexAttention's float16 gradients. Without torch only flashnumba's rows run (a smoke test in the simulator:
``--seqlen 64 --head-dims 32 --tokens 64 --width 64``). Writes flex-score-mods.json.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import numpy as np

import flashnumba
from flashnumba.tools.environment import environment
from flashnumba.tools.timing import cuda_time_ms

SOFTCAP = 20.0


# the user's functions (plain Python, compiled into the kernels) and their derivatives in the score


def alibi_mod(x, b, h, i, j, slopes):  # (the distance in float32: Numba's integer arithmetic is 64-bit)
    return x - slopes[h] * abs(np.float32(i) - np.float32(j))


def bias_mod(x, b, h, i, j, table):
    return x + table[h, i - j + table.shape[1] // 2]


def softcap_mod(x, b, h, i, j):  # (times the reciprocal: x / SOFTCAP is IEEE-rounded, a branch a score)
    return SOFTCAP * math.tanh(x * (1.0 / SOFTCAP))


def softcap_approx_mod(x, b, h, i, j):  # (the built-in softcap's tanh: ex2.approx and rcp.approx)
    return SOFTCAP * flashnumba.tanh_approx(x * (1.0 / SOFTCAP))


def one(x, b, h, i, j, arg):
    return 1.0


def softcap_grad(x, b, h, i, j):
    t = math.tanh(x * (1.0 / SOFTCAP))
    return 1.0 - t * t


def softcap_approx_grad(x, b, h, i, j):
    t = flashnumba.tanh_approx(x * (1.0 / SOFTCAP))
    return 1.0 - t * t


def causal_mod(b, h, i, j):
    return j <= i


def flops(batch, heads, seqlen, d, density):
    return 4.0 * batch * heads * seqlen * seqlen * d * density


def workload(d, n, tokens, width, xp):
    """One head dim's arrays, the same in each script that times these functions: q, k, v, dout (float16, (batch,
    n, heads, d), batch = tokens / n, heads = width / d), ALiBi's slopes (heads,), the relative-bias table (heads,
    2 n + 1) and the causal block mask of 128, drawn from a generator seeded with d."""
    batch, heads = max(1, tokens // n), max(1, width // d)
    rng = np.random.default_rng(d)
    q, k, v, dout = (xp.asarray(rng.standard_normal((batch, n, heads, d)).astype(np.float16)) for _ in range(4))
    slopes = xp.asarray((2.0 ** (-8.0 * (np.arange(heads) + 1) / heads)).astype(np.float32))
    table = xp.asarray((0.5 * rng.standard_normal((heads, 2 * n + 1))).astype(np.float32))
    bm = flashnumba.create_block_mask(causal_mod, 1, 1, n, n, like=q, BLOCK_SIZE=128)
    return q, k, v, dout, slopes, table, bm


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--seqlen", type=int, default=8192)
    ap.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    every = ["alibi", "softcap", "softcap-approx", "bias"]
    ap.add_argument("--cases", nargs="+", default=every, choices=every)
    ap.add_argument("--backward", action="store_true", help="time the backward pass too")
    ap.add_argument("--tokens", type=int, default=16384, help="batch * seqlen")
    ap.add_argument("--width", type=int, default=2048, help="heads * head_dim")
    args = ap.parse_args()
    try:
        import torch
        from torch.nn.attention import flex_attention as tflex
    except ImportError:
        torch = None
    xp = np if flashnumba.SIMULATOR else __import__("cupy")
    hopper = not flashnumba.SIMULATOR and xp.cuda.Device().compute_capability == "90"

    def sync():
        if not flashnumba.SIMULATOR:
            xp.cuda.Device().synchronize()

    def timed(fn):
        if flashnumba.SIMULATOR:  # (the simulator: one call, wall time)
            t0 = time.perf_counter()
            fn()
            return (time.perf_counter() - t0) * 1e3
        return cuda_time_ms(fn, warmup=3, repeat=10)[0]

    def to_np(x):
        if torch is not None and isinstance(x, torch.Tensor):
            return x.transpose(1, 2).float().cpu().numpy()
        return np.asarray(x if flashnumba.SIMULATOR else xp.asnumpy(x)).astype(np.float32)

    n = args.seqlen
    rows = []
    if torch is not None:
        torch._dynamo.config.recompile_limit = 64  # (each head dim, dtype and function its own specialisation)
        compiled = torch.compile(tflex.flex_attention, dynamic=False)
    for d in args.head_dims:
        q, k, v, dout, slopes, table, bm_causal = workload(d, n, args.tokens, args.width, xp)
        batch, _, heads, _ = q.shape
        if torch is not None:
            tq, tk, tv, tdout = (torch.as_tensor(x, device="cuda").transpose(1, 2) for x in (q, k, v, dout))
            tslopes, ttable = torch.as_tensor(slopes, device="cuda"), torch.as_tensor(table, device="cuda")
            tbm_causal = tflex.create_block_mask(lambda b, h, i, j: j <= i, 1, 1, n, n, device="cuda")

            def t_alibi(score, b, h, i, j):
                return score - tslopes[h] * (i - j).abs()

            def t_softcap(score, b, h, i, j):
                return SOFTCAP * torch.tanh(score / SOFTCAP)

            def t_bias(score, b, h, i, j):
                return score + ttable[h, i - j + n]

            tfns = {"t_alibi": t_alibi, "t_softcap": t_softcap, "t_bias": t_bias}

        # name: (density, built-in options or None, score_mod, its derivative, args, block mask, torch's function,
        # torch's block mask)
        cases = {
            "alibi": (0.5, dict(causal=True, alibi_slopes=slopes), alibi_mod, one, (slopes,), bm_causal,
                      "t_alibi", "causal"),
            "softcap": (1.0, dict(softcap=SOFTCAP), softcap_mod, softcap_grad, (), None, "t_softcap", None),
            "bias": (0.5, None, bias_mod, one, (table,), bm_causal, "t_bias", "causal"),
            "softcap-approx": (1.0, dict(softcap=SOFTCAP), softcap_approx_mod, softcap_approx_grad, (), None,
                               "t_softcap", None),
        }
        for case in args.cases:
            dens, builtin, mod, grad, mod_args, bm, tname, tmask = cases[case]
            kernels = ["tc"] + (["wgmma"] if hopper else [])
            fwd = {}
            if builtin is not None:
                fwd["built-in"] = lambda builtin=builtin: flashnumba.flash_attn_forward(q, k, v, **builtin)
            for kern in kernels:
                fwd[f"score_mod ({'Hopper' if kern == 'wgmma' else 'mma.sync'})"] = (
                    lambda kern=kern: flashnumba.flex_attention(q, k, v, mod, block_mask=bm, score_mod_args=mod_args,
                                                                kernel=kern, return_lse=True))
            if torch is not None:
                tfn, tbm = tfns[tname], (tbm_causal if tmask else None)
                fwd["torch flex"] = lambda tfn=tfn, tbm=tbm: compiled(tq, tk, tv, score_mod=tfn, block_mask=tbm)
            outs = {}
            for name, fn in fwd.items():
                try:
                    outs[name] = fn()
                except Exception as err:  # noqa: BLE001  (a peer that cannot compile this case: say so, go on)
                    if name != "torch flex":
                        raise
                    rows.append(dict(head_dim=d, seqlen=n, case=f"{case} {name}", failed=next((line for line in str(err).splitlines() if "Error" in line),
                                                             str(err).splitlines()[-1])))
                    print(f"d={d} {case:14s} {name:24s} failed: {rows[-1]['failed'][:200]}", flush=True)
                    continue
                sync()
                ms = timed(fn)
                rows.append(dict(head_dim=d, seqlen=n, batch=batch, heads=heads, case=f"{case} {name}", ms=ms,
                                 tflops=flops(batch, heads, n, d, dens) / ms / 1e9))
                print(f"d={d} {case:14s} {name:24s} {ms:9.3f} ms {rows[-1]['tflops']:7.1f} TFLOP/s", flush=True)
            if "torch flex" in outs:  # differences from FlexAttention in float32
                want = to_np(compiled(*(x.float() for x in (tq, tk, tv)), score_mod=tfn, block_mask=tbm))
                theirs = float(np.abs(to_np(outs["torch flex"]) - want).max())
                for name, out in outs.items():
                    if name != "torch flex":
                        ours = float(np.abs(to_np(out[0]) - want).max())
                        rows.append(dict(head_dim=d, case=f"max |out - float32 flex| {case} {name}", value=ours,
                                         torch_flex_value=theirs))
                        print(f"d={d} {case} {name}: max diff from float32 {ours:.2e} (torch flex fp16: {theirs:.2e})")
            if not args.backward:
                write(args.out, rows)
                continue
            bwd = {}
            if builtin is not None:
                out_b, lse_b = outs["built-in"]
                bwd["built-in"] = lambda builtin=builtin, o=out_b, lse=lse_b: flashnumba.flash_attn_backward(
                    dout, q, k, v, o, lse, **builtin)
            for kern in kernels:
                name = f"score_mod ({'Hopper' if kern == 'wgmma' else 'mma.sync'})"
                o, lse = outs[name]
                bwd[name] = lambda kern=kern, o=o, lse=lse: flashnumba.flex_attention_backward(
                    dout, q, k, v, o, lse, mod, score_mod_grad=grad, block_mask=bm, score_mod_args=mod_args,
                    kernel=kern)
            if "torch flex" in outs:
                leaves = [x.detach().clone().requires_grad_(True) for x in (tq, tk, tv)]
                tout = compiled(*leaves, score_mod=tfn, block_mask=tbm)

                def torch_backward(leaves=leaves, tout=tout):
                    for x in leaves:
                        x.grad = None
                    tout.backward(tdout, retain_graph=True)
                    return [x.grad for x in leaves]

                bwd["torch flex"] = torch_backward
            grads = {}
            for name, fn in bwd.items():
                grads[name] = fn()
                sync()
                ms = timed(fn)
                rows.append(dict(head_dim=d, seqlen=n, batch=batch, heads=heads, case=f"backward {case} {name}",
                                 ms=ms, tflops=2.5 * flops(batch, heads, n, d, dens) / ms / 1e9))
                print(f"d={d} backward {case:14s} {name:24s} {ms:9.3f} ms {rows[-1]['tflops']:7.1f} TFLOP/s",
                      flush=True)
            if "torch flex" in grads:
                theirs = [to_np(g) for g in grads["torch flex"]]
                for name, gs in grads.items():
                    if name != "torch flex":
                        diff = max(float(np.abs(to_np(g) - t).max()) for g, t in zip(gs, theirs))
                        rows.append(dict(head_dim=d, case=f"max |grad - torch flex grad| {case} {name}", value=diff))
                        print(f"d={d} backward {case} {name}: largest difference of dq, dk, dv from FlexAttention's "
                              f"{diff:.2e}")
            write(args.out, rows)  # (after each case: a run cut by a time limit keeps what it measured)


def write(out, rows):
    result = dict(date=time.strftime("%Y-%m-%d"), command="python scripts/flex_score_mods.py " + " ".join(sys.argv[1:]),
                  environment=environment(), rows=rows)
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "flex-score-mods.json"), "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
