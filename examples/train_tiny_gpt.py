"""Train a small GPT with flashnumba's attention and with torch's, on the same data from the same seed.

    python examples/train_tiny_gpt.py --out results/      # needs a CUDA GPU, torch and matplotlib

The model: 6 layers, 6 heads of head_dim 64 (width 384), context 1024, a byte-level vocabulary (256). The corpus
is this repository's own text (the package's source and the Markdown documents), so nothing is downloaded. Each
configuration trains from the same initial weights on the same batches:

* ``flashnumba``: :func:`flashnumba.torch.flash_attn_qkvpacked_func` (causal);
* ``sdpa``: ``torch.nn.functional.scaled_dot_product_attention`` with torch's choice of backend;
* ``sdpa-math``: the same, forced to its plain ("math") backend: a second correct implementation.

in float32, and in bfloat16 under ``torch.autocast``. The runs differ only in rounding, which training amplifies,
so the loss curves cannot agree exactly; how far two *correct* attentions drift apart is measured, not assumed:
the tolerance for flashnumba against ``sdpa`` is twice the largest gap between ``sdpa-math`` and ``sdpa`` (losses
averaged over windows of ``--window`` steps, which removes the batch-to-batch noise that all runs share), plus a
floor of 0.1% of the initial loss for the case where the two references happen to agree closely. The script writes
``train_tiny_gpt.json`` (losses, tokens/s, the verdict) and ``train_tiny_gpt.png`` to ``--out``.
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


def train(kind, dtype, data, args):
    torch.manual_seed(args.seed)
    model = GPT(kind, context=args.context).to(args.device)
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
        for kind in args.kinds:
            losses, tps = train(kind, dtype, data, args)
            runs[kind] = dict(losses=losses, tokens_per_s=tps)
            print(f"{dtype:9s} {kind:11s} first loss {losses[0]:.4f} last {losses[-1]:.4f}  {tps:,.0f} tokens/s",
                  flush=True)
        report["runs"][dtype] = runs
        if set(runs) != set(KINDS):
            continue
        w = {k: windowed(r["losses"], args.window) for k, r in runs.items()}
        ours = float(np.abs(w["flashnumba"] - w["sdpa"]).max())
        reference_gap = float(np.abs(w["sdpa-math"] - w["sdpa"]).max())
        tol = 2 * reference_gap + 1e-3 * runs["sdpa"]["losses"][0]
        report["verdict"][dtype] = dict(max_gap_flashnumba_sdpa=ours, max_gap_sdpa_math_sdpa=reference_gap,
                                        tolerance=tol, agree=bool(ours <= tol))
        print(f"{dtype}: windowed loss gap flashnumba-sdpa {ours:.4f}, sdpa-math-sdpa {reference_gap:.4f}, "
              f"tolerance {tol:.4f}: {'agree' if ours <= tol else 'DISAGREE'}", flush=True)
    (args.out / "train_tiny_gpt.json").write_text(json.dumps(report, indent=1))
    plot(report, args.out / "train_tiny_gpt.png")
    return 0 if all(v["agree"] for v in report["verdict"].values()) else 1


def plot(report, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dtypes = list(report["runs"])
    fig, axes = plt.subplots(1, len(dtypes), figsize=(6 * len(dtypes), 4), squeeze=False)
    for ax, dtype in zip(axes[0], dtypes):
        for kind, run in report["runs"][dtype].items():
            ax.plot(run["losses"], lw=0.8, label=f"{kind} ({run['tokens_per_s'] / 1e3:,.0f}k tokens/s)")
        v = report["verdict"].get(dtype)
        ax.set_title(dtype if v is None else
                     f"{dtype}: gap {v['max_gap_flashnumba_sdpa']:.3f}, tolerance {v['tolerance']:.3f}")
        ax.set_xlabel("step")
        ax.set_ylabel("training loss (nats/byte)")
        ax.set_ylim(top=min(6.0, ax.get_ylim()[1]))
        ax.legend()
    fig.suptitle(f"tiny GPT, {report['device']}, torch {report['torch']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    raise SystemExit(main())
