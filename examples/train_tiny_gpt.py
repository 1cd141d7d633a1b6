"""Train a small GPT with flashnumba's attention and with torch's, on the same data from the same seed.

    python examples/train_tiny_gpt.py --out results/      # needs a CUDA GPU, torch and matplotlib

The model: 6 layers, 6 heads of head_dim 64 (width 384), context 1024, a byte-level vocabulary (256). The corpus
is this repository's own text (the package's source and the Markdown documents), so nothing is downloaded. Each
configuration trains from the same initial weights on the same batches:

* ``flashnumba``: :func:`flashnumba.torch.flash_attn_qkvpacked_func` (causal);
* ``sdpa``: ``torch.nn.functional.scaled_dot_product_attention`` with torch's choice of backend;
* ``sdpa-math``: the same, forced to its plain ("math") backend: a second correct implementation.

in float32, and in bfloat16 under ``torch.autocast``. The runs differ only in rounding, which training amplifies
(the trajectory is chaotic), so the loss curves cannot agree exactly; how far two *correct* runs drift apart on this
model and data is measured, not assumed. The reference ensemble: ``sdpa-math``, and ``--perturbed`` runs of
``sdpa`` whose initial weights are multiplied by 1 + 2^-23 (one float32 rounding) with random signs. Losses are
averaged over windows of ``--window`` steps (the batch-to-batch noise is common to all runs, since the batches
are the same); the tolerance for flashnumba is twice the largest windowed gap between ``sdpa`` and any member of
the ensemble (the factor 2 as flash-attn's tests allow twice a reference's error), and flashnumba's largest
windowed gap to ``sdpa`` must stay within it. The script writes ``train_tiny_gpt.json`` (losses, tokens/s, the
verdict) and ``train_tiny_gpt.png`` (the curves, and each run's windowed gap to ``sdpa``) to ``--out``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

import flashnumba
import flashnumba.torch as fnt

ROOT = Path(__file__).resolve().parents[1]
KINDS = ("flashnumba", "sdpa", "sdpa-math")


def corpus() -> np.ndarray:
    """The bytes of the repository's Python sources and Markdown documents, in a fixed order."""
    files = sorted(ROOT.glob("flashnumba/**/*.py")) + sorted(ROOT.glob("*.md")) + sorted(ROOT.glob("docs/*.md"))
    return np.frombuffer(b"\n".join(p.read_bytes() for p in files), dtype=np.uint8)


class Attention(torch.nn.Module):
    def __init__(self, width, heads, kind):
        super().__init__()
        self.heads, self.kind = heads, kind
        self.qkv = torch.nn.Linear(width, 3 * width)
        self.proj = torch.nn.Linear(width, width)

    def forward(self, x):
        b, t, c = x.shape
        qkv = self.qkv(x).view(b, t, 3, self.heads, c // self.heads)
        if self.kind == "flashnumba":
            y = fnt.flash_attn_qkvpacked_func(qkv, causal=True)  # (b, t, heads, d)
        else:
            q, k, v = (z.transpose(1, 2) for z in qkv.unbind(2))  # SDPA's (b, heads, t, d)
            with (torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH) if self.kind == "sdpa-math"
                  else contextlib.nullcontext()):
                y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)
        return self.proj(y.reshape(b, t, c))


class GPT(torch.nn.Module):
    def __init__(self, kind, layers=6, heads=6, width=384, context=1024, vocab=256):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, width)
        self.pos = torch.nn.Embedding(context, width)
        self.blocks = torch.nn.ModuleList()
        for _ in range(layers):
            self.blocks.append(torch.nn.ModuleDict(dict(
                norm1=torch.nn.LayerNorm(width), attn=Attention(width, heads, kind), norm2=torch.nn.LayerNorm(width),
                mlp=torch.nn.Sequential(torch.nn.Linear(width, 4 * width), torch.nn.GELU(),
                                        torch.nn.Linear(4 * width, width)))))
        self.norm = torch.nn.LayerNorm(width)
        self.head = torch.nn.Linear(width, vocab, bias=False)

    def forward(self, tokens):
        x = self.embed(tokens) + self.pos(torch.arange(tokens.shape[1], device=tokens.device))
        for blk in self.blocks:
            x = x + blk["attn"](blk["norm1"](x))
            x = x + blk["mlp"](blk["norm2"](x))
        return self.head(self.norm(x))


def batches(data, steps, batch, context, seed):
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        starts = rng.integers(0, len(data) - context - 1, batch)
        chunk = np.stack([data[s:s + context + 1] for s in starts]).astype(np.int64)
        x, y = np.ascontiguousarray(chunk[:, :-1]), np.ascontiguousarray(chunk[:, 1:])
        yield torch.from_numpy(x), torch.from_numpy(y)


def train(kind, dtype, data, args, perturb=None):
    torch.manual_seed(args.seed)
    model = GPT(kind, context=args.context).to(args.device)
    if perturb is not None:  # one float32 rounding of every weight, up or down at random
        g = torch.Generator(device=args.device).manual_seed(perturb)
        with torch.no_grad():
            for p in model.parameters():
                sign = torch.randint(0, 2, p.shape, generator=g, device=args.device) * 2 - 1
                p.mul_(1 + sign * 2.0**-23)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    autocast = (torch.autocast(args.device, dtype=torch.bfloat16) if dtype == "bfloat16"
                else contextlib.nullcontext())
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    losses, start, timed_tokens = [], None, 0
    for step, (x, y) in enumerate(batches(data, args.steps, args.batch, args.context, args.seed)):
        if step == args.warmup:
            sync()
            start = time.perf_counter()
        x, y = x.to(args.device, non_blocking=True), y.to(args.device, non_blocking=True)
        with autocast:
            loss = F.cross_entropy(model(x).float().view(-1, 256), y.view(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.detach())
        if start is not None:
            timed_tokens += x.numel()
    sync()
    seconds = time.perf_counter() - start
    return [float(v) for v in torch.stack(losses).cpu()], timed_tokens / seconds


def windowed(losses, window):
    a = np.asarray(losses)
    n = len(a) // window
    return a[: n * window].reshape(n, window).mean(axis=1)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup", type=int, default=10, help="steps not timed (compilation, allocator warm-up)")
    p.add_argument("--window", type=int, default=20, help="steps per loss average in the comparison")
    p.add_argument("--perturbed", type=int, default=4, help="perturbed sdpa runs in the reference ensemble")
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    p.add_argument("--kinds", nargs="+", default=list(KINDS), choices=KINDS,
                   help="the attentions to train with (the comparison needs all three)")
    p.add_argument("--device", default="cuda", help="torch device (flashnumba needs cuda)")
    p.add_argument("--out", type=Path, default=Path("."))
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    data = corpus()
    device = torch.cuda.get_device_name() if args.device == "cuda" else args.device
    report = dict(date=time.strftime("%Y-%m-%d"), device=device, torch=torch.__version__,
                  flashnumba=flashnumba.__version__, corpus_bytes=int(len(data)), args={
                      k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}, runs={}, verdict={})
    for dtype in args.dtypes:
        runs = {}
        jobs = [(kind, None) for kind in args.kinds]
        if "sdpa" in args.kinds:
            jobs += [(f"sdpa~{i}", i) for i in range(1, args.perturbed + 1)]
        for name, perturb in jobs:
            losses, tps = train(name.split("~")[0], dtype, data, args, perturb)
            runs[name] = dict(losses=losses, tokens_per_s=tps)
            print(f"{dtype:9s} {name:11s} first loss {losses[0]:.4f} last {losses[-1]:.4f}  {tps:,.0f} tokens/s",
                  flush=True)
        report["runs"][dtype] = runs
        if not set(KINDS) <= set(runs):
            continue
        w = {k: windowed(r["losses"], args.window) for k, r in runs.items()}
        gaps = {k: float(np.abs(w[k] - w["sdpa"]).max()) for k in runs if k not in ("sdpa", "flashnumba")}
        tol = 2 * max(gaps.values())
        ours = float(np.abs(w["flashnumba"] - w["sdpa"]).max())
        report["verdict"][dtype] = dict(max_gap_flashnumba_sdpa=ours, reference_gaps=gaps, tolerance=tol,
                                        agree=bool(ours <= tol))
        print(f"{dtype}: largest windowed loss gap to sdpa: flashnumba {ours:.4f}; references "
              + ", ".join(f"{k} {g:.4f}" for k, g in gaps.items())
              + f"; tolerance {tol:.4f}: {'agree' if ours <= tol else 'DISAGREE'}", flush=True)
    (args.out / "train_tiny_gpt.json").write_text(json.dumps(report, indent=1))
    plot(report, args.out / "train_tiny_gpt.png")
    return 0 if all(v["agree"] for v in report["verdict"].values()) else 1


def plot(report, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dtypes = list(report["runs"])
    window = report["args"]["window"]
    fig, axes = plt.subplots(2, len(dtypes), figsize=(6 * len(dtypes), 7), squeeze=False)
    for col, dtype in enumerate(dtypes):
        runs = report["runs"][dtype]
        ax = axes[0, col]
        for kind in KINDS:
            if kind in runs:
                ax.plot(runs[kind]["losses"], lw=0.8,
                        label=f"{kind} ({runs[kind]['tokens_per_s'] / 1e3:,.0f}k tokens/s)")
        ax.set_title(f"{dtype}: training loss")
        ax.set_xlabel("step")
        ax.set_ylabel("loss (nats/byte)")
        ax.set_ylim(top=min(6.0, ax.get_ylim()[1]))
        ax.legend()
        ax = axes[1, col]
        v = report["verdict"].get(dtype)
        if "sdpa" in runs:
            base = windowed(runs["sdpa"]["losses"], window)
            steps = window * (np.arange(len(base)) + 0.5)
            for kind, run in runs.items():
                if kind == "sdpa":
                    continue
                ref = kind != "flashnumba"
                ax.plot(steps, windowed(run["losses"], window) - base, color="0.6" if ref else "C0",
                        lw=0.8 if ref else 1.8, label=("references (sdpa-math, perturbed sdpa)" if kind == "sdpa-math"
                                                       else None if ref else "flashnumba"))
            if v is not None:
                for sign in (1, -1):
                    ax.axhline(sign * v["tolerance"], color="C3", ls="--", lw=0.8,
                               label="tolerance" if sign == 1 else None)
        ax.set_title(f"{dtype}: loss minus sdpa's, {window}-step means"
                     + ("" if v is None else f" ({'agree' if v['agree'] else 'DISAGREE'})"))
        ax.set_xlabel("step")
        ax.legend(fontsize=8)
    fig.suptitle(f"tiny GPT (6 layers, 6 heads x 64, context 1024), {report['device']}, torch {report['torch']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    raise SystemExit(main())
