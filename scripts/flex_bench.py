"""flex_attention on the GPU beside the built-in kernels and PyTorch's FlexAttention, on the same masks.

    python scripts/flex_bench.py [--out DIR] [--seqlen 8192] [--head-dims 64 128] [--backward] [--skip TEXT ...]

Workload: float16, batch = 16384 / seqlen, heads = 2048 / head_dim, forward. Rows (milliseconds, one call per
pair of CUDA events after warm-up, and TFLOP/s of the work the mask leaves):

* dense: flash_attn_forward with no mask (the reference point of the document-masking target), and torch's
  scaled_dot_product_attention with its default backend (cuDNN on an H100/H200);
* causal built-in vs causal as a mask_mod with a block mask (the same result: the cost of the mechanism);
* 8 documents per sequence as a mask_mod, with and without a block mask;
* torch.nn.attention.flex_attention (torch.compile) with its own block mask, on the same masks;
* on compute capability 9.0, the causal and documents mask_mods with their block masks on the Hopper kernels
  (``kernel="wgmma"``), forward and backward, rows named "(Hopper)"; the other mask_mod rows there run the
  ``mma.sync`` kernels (``kernel="tc"``), and the built-in rows ``kernel=None``'s (the Hopper kernels).

With ``--backward``, also the backward pass (TFLOP/s counted as 2.5 forwards): the built-in kernels' dense and
causal backward, ``flex_attention_backward`` with the causal and the documents mask_mod on the tensor cores (the
default) with and without the block mask, and FlexAttention's backward (autograd through the compiled function,
the forward's graph kept) on the same masks; each flashnumba gradient compared with FlexAttention's.

Each flashnumba output is compared with FlexAttention's: the largest difference, beside FlexAttention's own
difference from a float32 computation, is reported. Writes flex-bench.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import cupy
import numpy as np

import flashnumba
from flashnumba.tools.environment import environment
from flashnumba.tools.timing import cuda_time_ms


def causal_mod(b, h, i, j):
    return j <= i


def doc_mod(b, h, i, j, docs):
    return docs[i] == docs[j]


def flops(batch, heads, seqlen, d, density):
    return 4.0 * batch * heads * seqlen * seqlen * d * density


HOPPER = False  # whether the GPU is of compute capability 9.0 (the Hopper kernels' rows): set in main


def main():
    global HOPPER
    HOPPER = cupy.cuda.Device().compute_capability == "90"
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--seqlen", type=int, default=8192)
    ap.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--docs", type=int, default=8)
    ap.add_argument("--backward", action="store_true", help="time the backward pass too")
    ap.add_argument("--skip", nargs="*", default=[], metavar="TEXT",
                    help="leave out the rows whose name holds TEXT (e.g. 'no block mask': the slowest to compile)")
    args = ap.parse_args()
    import torch
    from torch.nn.attention import flex_attention as tflex

    n = args.seqlen
    # each head dim, dtype (the float32 comparisons) and gradient mode is its own specialisation: past dynamo's
    # default limit of 8 the compiled function falls back to the unfused flex_attention, with no error
    torch._dynamo.config.recompile_limit = 64
    compiled = torch.compile(tflex.flex_attention, dynamic=False)
    rows = []
    for d in args.head_dims:
        batch, heads = 16384 // n, 2048 // d
        rng = np.random.default_rng(d)
        q, k, v = (cupy.asarray(rng.standard_normal((batch, n, heads, d)).astype(np.float16)) for _ in range(3))
        tq, tk, tv = (torch.as_tensor(x, device="cuda").transpose(1, 2) for x in (q, k, v))
        docs_np = np.repeat(np.arange(args.docs), n // args.docs).astype(np.int32)
        docs = cupy.asarray(docs_np)
        tdocs = torch.as_tensor(docs, device="cuda")

        def tdoc(b, h, i, j):
            return tdocs[i] == tdocs[j]

        def tcausal(b, h, i, j):
            return j <= i

        t0 = time.perf_counter()
        bm_doc = flashnumba.create_block_mask(doc_mod, 1, 1, n, n, score_mod_args=(docs,), BLOCK_SIZE=128)
        bm_causal = flashnumba.create_block_mask(causal_mod, 1, 1, n, n, like=q, BLOCK_SIZE=128)
        cupy.cuda.Device().synchronize()
        make_s = time.perf_counter() - t0
        tbm_doc = tflex.create_block_mask(tdoc, 1, 1, n, n, device="cuda")
        tbm_causal = tflex.create_block_mask(tcausal, 1, 1, n, n, device="cuda")
        density_doc = 1.0 / args.docs
        tc = dict(kernel="tc") if HOPPER else {}  # (kernel=None takes the Hopper kernels for a mask_mod there)
        cases = [  # (name, density of visible entries, fn)
            ("dense built-in", 1.0, lambda: flashnumba.flash_attn_forward(q, k, v)[0]),
            ("torch SDPA default backend, dense", 1.0,
             lambda: torch.nn.functional.scaled_dot_product_attention(tq, tk, tv)),
            ("causal built-in", 0.5, lambda: flashnumba.flash_attn_forward(q, k, v, causal=True)[0]),
            ("causal mask_mod + block mask", 0.5,
             lambda: flashnumba.flex_attention(q, k, v, block_mask=bm_causal, **tc)),
            ("causal mask_mod, no block mask", 0.5,
             lambda: flashnumba.flex_attention(q, k, v, mask_mod=causal_mod, **tc)),
            ("torch flex causal", 0.5, lambda: compiled(tq, tk, tv, block_mask=tbm_causal)),
            ("documents mask_mod + block mask", density_doc,
             lambda: flashnumba.flex_attention(q, k, v, block_mask=bm_doc, score_mod_args=(docs,), **tc)),
            ("documents mask_mod, no block mask", density_doc,
             lambda: flashnumba.flex_attention(q, k, v, mask_mod=doc_mod, score_mod_args=(docs,), **tc)),
            ("torch flex documents", density_doc, lambda: compiled(tq, tk, tv, block_mask=tbm_doc)),
        ]
        if HOPPER:
            cases += [
                ("causal mask_mod + block mask (Hopper)", 0.5,
                 lambda: flashnumba.flex_attention(q, k, v, block_mask=bm_causal, kernel="wgmma")),
                ("documents mask_mod + block mask (Hopper)", density_doc,
                 lambda: flashnumba.flex_attention(q, k, v, block_mask=bm_doc, score_mod_args=(docs,),
                                                   kernel="wgmma")),
            ]
        cases = [c for c in cases if not any(x in c[0] for x in args.skip)]
        outs = {}
        for name, dens, fn in cases:
            out = fn()
            cupy.cuda.Device().synchronize()
            ms, _ = cuda_time_ms(fn, warmup=3, repeat=10)
            outs[name] = out
            rows.append(dict(head_dim=d, seqlen=n, batch=batch, heads=heads, case=name, ms=ms,
                             tflops=flops(batch, heads, n, d, dens) / ms / 1e9))
            print(f"d={d} {name:36s} {ms:8.3f} ms {rows[-1]['tflops']:7.1f} TFLOP/s", flush=True)

        def as_np(x):
            if isinstance(x, torch.Tensor):
                return x.transpose(1, 2).float().cpu().numpy()
            return cupy.asnumpy(x).astype(np.float32)

        # differences from FlexAttention, and FlexAttention's own from a float32 computation of the same mask
        tq32, tk32, tv32 = (x.float() for x in (tq, tk, tv))
        for mask_name, tbm, pairs in (("causal", tbm_causal, ["causal built-in", "causal mask_mod + block mask",
                                                              "causal mask_mod, no block mask"]),
                                      ("documents", tbm_doc, ["documents mask_mod + block mask",
                                                              "documents mask_mod, no block mask"])):
            if f"torch flex {mask_name}" not in outs:
                continue
            want = as_np(compiled(tq32, tk32, tv32, block_mask=tbm))
            theirs = np.abs(as_np(outs[f"torch flex {mask_name}"]) - want).max()
            for name in pairs + ([f"{mask_name} mask_mod + block mask (Hopper)"] if HOPPER else []):
                if name not in outs:
                    continue
                ours = np.abs(as_np(outs[name]) - want).max()
                rows.append(dict(head_dim=d, case=f"max |out - float32 flex| {name}", value=float(ours),
                                 torch_flex_value=float(theirs)))
                print(f"d={d} {name}: max diff from float32 {ours:.2e} (torch flex fp16: {theirs:.2e})")
        if args.backward:
            rows += backward_rows(d, n, batch, heads, q, k, v, tq, tk, tv, docs, (bm_causal, tbm_causal),
                                  (bm_doc, tbm_doc), compiled, density_doc, args.skip)
        rows.append(dict(head_dim=d, case="create_block_mask seconds (both masks, first call)", value=make_s))
        rows.append(dict(head_dim=d, case="block mask density documents", value=bm_doc.density()))
    result = dict(date=time.strftime("%Y-%m-%d"), command="python scripts/flex_bench.py " + " ".join(sys.argv[1:]),
                  environment=environment(), rows=rows)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "flex-bench.json"), "w") as f:
        json.dump(result, f, indent=1)


def backward_rows(d, n, batch, heads, q, k, v, tq, tk, tv, docs, causal_masks, doc_masks, compiled, density_doc,
                  skip=()):
    """The backward cases (see the module's docstring): rows of ms and TFLOP/s, then the largest difference of
    each flashnumba gradient from FlexAttention's. ``causal_masks``, ``doc_masks``: (flashnumba's block mask,
    FlexAttention's) of each mask; ``skip``: the rows whose name holds any of these left out."""
    import torch

    (bm_causal, tbm_causal), (bm_doc, tbm_doc) = causal_masks, doc_masks

    rng = np.random.default_rng(d + 1)
    dout = cupy.asarray(rng.standard_normal(q.shape).astype(np.float16))
    tdout = torch.as_tensor(dout, device="cuda").transpose(1, 2)
    out_d, lse_d = flashnumba.flash_attn_forward(q, k, v)
    out_c, lse_c = flashnumba.flash_attn_forward(q, k, v, causal=True)
    out_m, lse_m = flashnumba.flex_attention(q, k, v, mask_mod=doc_mod, score_mod_args=(docs,), return_lse=True)

    def torch_backward(tbm):
        """A closure running FlexAttention's backward on a kept forward graph, and its gradients' holders."""
        leaves = [x.detach().clone().requires_grad_(True) for x in (tq, tk, tv)]
        out = compiled(*leaves, block_mask=tbm)

        def run():
            for x in leaves:
                x.grad = None
            out.backward(tdout, retain_graph=True)
            return [x.grad for x in leaves]

        return run

    tc = dict(kernel="tc") if HOPPER else {}  # (kernel=None takes the Hopper kernels for a mask_mod there)
    cases = [  # (name, density, fn returning (dq, dk, dv))
        ("backward dense built-in", 1.0, lambda: flashnumba.flash_attn_backward(dout, q, k, v, out_d, lse_d)),
        ("backward causal built-in", 0.5,
         lambda: flashnumba.flash_attn_backward(dout, q, k, v, out_c, lse_c, causal=True)),
        ("backward causal mask_mod + block mask", 0.5, lambda: flashnumba.flex_attention_backward(
            dout, q, k, v, out_c, lse_c, block_mask=bm_causal, **tc)),
        ("backward causal mask_mod, no block mask", 0.5, lambda: flashnumba.flex_attention_backward(
            dout, q, k, v, out_c, lse_c, mask_mod=causal_mod, **tc)),
        ("backward torch flex causal", 0.5, torch_backward(tbm_causal)),
        ("backward documents mask_mod + block mask", density_doc, lambda: flashnumba.flex_attention_backward(
            dout, q, k, v, out_m, lse_m, block_mask=bm_doc, score_mod_args=(docs,), **tc)),
        ("backward documents mask_mod, no block mask", density_doc, lambda: flashnumba.flex_attention_backward(
            dout, q, k, v, out_m, lse_m, mask_mod=doc_mod, score_mod_args=(docs,), **tc)),
        ("backward torch flex documents", density_doc, torch_backward(tbm_doc)),
    ]
    if HOPPER:
        cases += [
            ("backward causal mask_mod + block mask (Hopper)", 0.5, lambda: flashnumba.flex_attention_backward(
                dout, q, k, v, out_c, lse_c, block_mask=bm_causal, kernel="wgmma")),
            ("backward documents mask_mod + block mask (Hopper)", density_doc,
             lambda: flashnumba.flex_attention_backward(dout, q, k, v, out_m, lse_m, block_mask=bm_doc,
                                                        score_mod_args=(docs,), kernel="wgmma")),
        ]
    cases = [c for c in cases if not any(x in c[0] for x in skip)]
    rows, grads = [], {}
    for name, dens, fn in cases:
        grads[name] = fn()
        cupy.cuda.Device().synchronize()
        ms, _ = cuda_time_ms(fn, warmup=2, repeat=10)
        rows.append(dict(head_dim=d, seqlen=n, batch=batch, heads=heads, case=name, ms=ms,
                         tflops=2.5 * flops(batch, heads, n, d, dens) / ms / 1e9))
        print(f"d={d} {name:44s} {ms:8.3f} ms {rows[-1]['tflops']:7.1f} TFLOP/s", flush=True)

    def as_np(x):
        if isinstance(x, torch.Tensor):
            return x.transpose(1, 2).float().cpu().numpy()
        return cupy.asnumpy(x).astype(np.float32)

    for mask_name, names in (("causal", ["backward causal built-in", "backward causal mask_mod + block mask",
                                         "backward causal mask_mod, no block mask"]),
                             ("documents", ["backward documents mask_mod + block mask",
                                            "backward documents mask_mod, no block mask"])):
        if f"backward torch flex {mask_name}" not in grads:
            continue
        theirs = [as_np(g) for g in grads[f"backward torch flex {mask_name}"]]
        for name in names + ([f"backward {mask_name} mask_mod + block mask (Hopper)"] if HOPPER else []):
            if name not in grads:
                continue
            diff = max(float(np.abs(as_np(g) - t).max()) for g, t in zip(grads[name], theirs))
            rows.append(dict(head_dim=d, case=f"max |grad - torch flex grad| {name}", value=diff))
            print(f"d={d} {name}: largest difference of dq, dk, dv from FlexAttention's {diff:.2e}")
    return rows


if __name__ == "__main__":
    main()
