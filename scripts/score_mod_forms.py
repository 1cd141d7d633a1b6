"""The built-in options' score modification in the SIMT and mma.sync kernels as it is (ALiBi's distance in float32
in the forwards and dQ kernels, in 64-bit integers in the dK/dV kernels), against the Hopper kernels' form of it
(``common.make_score_mod`` with ``no_calls``): ALiBi's distance |i + diag - j| as the float32 difference of the
32-bit indices instead of the 64-bit integer Numba computes, and the softcap's tanh(x / cap) as
``tanh_approx(x * rcp.approx(cap))`` (``ex2.approx``, ``rcp.approx``) instead of a division and libdevice's tanhf.

    FLASHNUMBA_SIMULATOR=0 python scripts/score_mod_forms.py [--option alibi|softcap] [--head-dims 64] [--no-calls]
    python scripts/score_mod_forms.py --time [--option alibi|softcap] [--head-dims 64 128] [--no-calls]   (a GPU)

Without ``--time`` (no GPU needed; nvdisasm from the test extra): the planner's sm_80 kernels for causal attention
with the option compiled, and for the float32 SIMT kernels (v3 forward, v2 dQ and dK/dV) and the float16
tensor-core kernels (forward, dQ, dK/dV) the machine instructions of each kernel, the length of its longest loop
(the tile loop), registers and spilled bytes. With ``--time``: the same calls on the GPU (float32 at the SIMT
kernels, float16 at ``kernel="tc"``; seqlen 4096, batch 4, heads 2048 / head_dim, causal), forward and backward, ms
of one call per pair of CUDA events and of 20 calls back to back. ``--no-calls``: every kernel takes the Hopper
kernels' form; run once without and once with it, each in its own process.
"""

import argparse

import numpy as np

from flashnumba import _validate, planner
from flashnumba.api import check_forward_args
from flashnumba.kernels import common, mma_backward, mma_forward, simt_backward, simt_forward
from flex_sass_counts import compiled, instructions, loop_bodies  # (scripts/: machine code, its instructions, loops)


def loops(sass):
    """(instructions, [length of each loop]) of the machine code (a loop: from a backward branch's target to it)."""
    found, labels = instructions(sass)
    return len(found), [len(body) for body in loop_bodies(found, labels)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--head-dims", type=int, nargs="+", default=[64])
    ap.add_argument("--option", choices=["alibi", "softcap"], default="alibi")
    ap.add_argument("--no-calls", action="store_true", help="every kernel takes the Hopper kernels' form")
    ap.add_argument("--time", action="store_true", help="time the calls on the GPU instead of counting instructions")
    args = ap.parse_args()
    if args.no_calls:
        make = common.make_score_mod

        def hopper_form(softcap_on, alibi_on, no_calls=False, float32_distance=False):
            return make(softcap_on, alibi_on, True)

        for module in (simt_forward, simt_backward, mma_forward, mma_backward):
            module.make_score_mod = hopper_form
    what = f"{args.option} {'Hopper form' if args.no_calls else 'as it is'}"
    if args.time:
        return timed(args.head_dims, args.option, what)
    n = 1024
    for d in args.head_dims:
        for dtype, kernel in ((np.float32, "v3"), (np.float16, "tc")):
            q = np.zeros((1, n, 2, d), dtype)
            (tq, tk, tv), opts = check_forward_args(q, q, q, causal=True, **option(args.option, np.ones(2, np.float32)))
            lse = np.zeros((1, 2, n), np.float32)
            tdo, to, tl = (_validate.inspect(name, x, nd) for name, x, nd in (("dout", q, 4), ("out", q, 4),
                                                                            ("lse", lse, 3)))
            fp = planner.forward_plan(tq, tk, tv, opts, kernel=kernel, device="sm_80")
            bp = planner.backward_plan(tdo, tq, tk, tv, to, tl, opts, kernel=None, device="sm_80")
            for p, s in [(fp, fp.launches[0])] + [(bp, x) for x in bp.launches[1:]]:
                sass, r = compiled(p, s, (8, 0))
                total, lengths = loops(sass)
                print(f"{what} {np.dtype(dtype).name} d={d} {s.name:12s} tiles={tuple(s.tiles)}: {total} instructions, "
                      f"longest loop {max(lengths, default=0)}; {r['registers']} registers, {r['spill_stores']} bytes "
                      f"spilled", flush=True)


def option(name, slopes):
    """The built-in option's arguments: ALiBi's slopes, or a softcap of 20."""
    return dict(alibi_slopes=slopes) if name == "alibi" else dict(softcap=20.0)


def timed(head_dims, name, what):
    import cupy as cp

    import flashnumba
    from flashnumba.tools.timing import cuda_events_ms, cuda_time_ms

    n = 4096
    for d in head_dims:
        batch, heads = 16384 // n, 2048 // d
        rng = np.random.default_rng(d)
        slopes = cp.asarray((2.0 ** (-8.0 * (np.arange(heads) + 1) / heads)).astype(np.float32))
        for dtype, kernel in ((np.float32, None), (np.float16, "tc")):
            q, k, v, dout = (cp.asarray(rng.standard_normal((batch, n, heads, d)).astype(dtype)) for _ in range(4))
            opts = dict(causal=True, kernel=kernel, **option(name, slopes))
            out, lse = flashnumba.flash_attn_forward(q, k, v, **opts)
            calls = {"forward": lambda: flashnumba.flash_attn_forward(q, k, v, **opts),
                     "backward": lambda: flashnumba.flash_attn_backward(dout, q, k, v, out, lse, **opts)}
            for which, fn in calls.items():
                fn()
                ms, _ = cuda_time_ms(fn, warmup=3, repeat=20)
                print(f"{what} {np.dtype(dtype).name} kernel={kernel} d={d} {which:8s} {ms:8.3f} ms "
                      f"(back to back {cuda_events_ms(fn, 20):.3f})", flush=True)


if __name__ == "__main__":
    main()
