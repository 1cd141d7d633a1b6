"""One call each of Hopper forward configurations (and of the mma.sync forward) between profiler start and stop,
for Nsight Compute (--profile-from-start off): d 128, seqlen 4096, batch 4, 16 heads, float16.
Arguments: block_m:block_n:num_threads of the wgmma configurations (default: the planner's), e.g. 128:64:288;
or ``backward`` (then the Hopper backward's kernels at the planner's tiles, and the mma.sync backward's, on the
same shape; ``backward 64`` for head_dim 64 with 32 heads); ``--peers``: torch's cuDNN and FlashAttention-2
SDPA backends on the same shape and pass too (their backward alone in ``backward`` mode); ``--head-dim=D``
(2048 / D heads) and ``--causal`` for the forward, e.g.

    ncu --profile-from-start off --set full -o wgb python scripts/wgmma_ncu.py backward --peers
    ncu --profile-from-start off --section WarpStateStats -o wgc python scripts/wgmma_ncu.py --head-dim=64 --causal \
        128:128:384 192:128:512 --peers
"""
import sys

import cupy
import numpy as np

import flashnumba

args = [a for a in sys.argv[1:] if not a.startswith("--")]
flags = [a for a in sys.argv[1:] if a.startswith("--")]
peers, causal = "--peers" in flags, "--causal" in flags
rng = np.random.default_rng(0)
backward = args[:1] == ["backward"]
D = int(args[1]) if backward and len(args) > 1 else 128
D = next((int(a.split("=")[1]) for a in flags if a.startswith("--head-dim=")), D)
q, k, v, dout = (cupy.asarray(rng.standard_normal((4, 4096, 2048 // D, D), np.float32).astype(np.float16))
                 for _ in range(4))
if backward:
    out, lse = flashnumba.flash_attn_forward(q, k, v)
    configs = [dict(kernel="wgmma"), dict(kernel="tc")]

    def run(c):
        flashnumba.flash_attn_backward(dout, q, k, v, out, lse, **c)
else:
    configs = [dict(kernel="wgmma", **dict(zip(("block_m", "block_n", "num_threads"), map(int, a.split(":")))))
               for a in args] or [dict(kernel="wgmma")]
    configs.append(dict(kernel="tc"))

    def run(c):
        flashnumba.flash_attn_forward(q, k, v, causal=causal, **c)
if peers:  # torch SDPA's backends, (batch, heads, seqlen, d) views of the same values
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    tq, tk, tv, tdo = (torch.as_tensor(x, device="cuda").transpose(1, 2) for x in (q, k, v, dout))
    flash_run = run

    def run(c):
        if "backend" not in c:
            return flash_run(c)
        with sdpa_kernel(c["backend"]):
            if not backward:
                return sdpa(tq, tk, tv, is_causal=causal)
            if "o" not in c:  # the forward once, before the profiled range (the warm-up call makes it)
                c["xs"] = [x.detach().requires_grad_() for x in (tq, tk, tv)]
                c["o"] = sdpa(*c["xs"])
            torch.autograd.grad(c["o"], c["xs"], tdo, retain_graph=True)
    configs += [dict(backend=SDPBackend.CUDNN_ATTENTION), dict(backend=SDPBackend.FLASH_ATTENTION)]
for c in configs:
    run(c)
cupy.cuda.Device().synchronize()
cupy.cuda.profiler.start()
for c in configs:
    run(c)
cupy.cuda.Device().synchronize()
cupy.cuda.profiler.stop()
