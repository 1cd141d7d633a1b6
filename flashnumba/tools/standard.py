"""Standard attention, materialised (the seed's baseline): S = scale Q K^T, P = softmax(S), O = P V, each a
separate array-library call that writes its (batch, nheads, seqlen_q, seqlen_k) result to device memory.

Works on CuPy arrays (on the GPU) and NumPy arrays alike, in the input's dtype. Used by the demo and the
benchmark as the thing FlashAttention is measured against.
"""

from __future__ import annotations

import math

import numpy as np


def _xp(x):
    try:
        import cupy

        return cupy.get_array_module(x)
    except ImportError:
        return np


def standard_attention(q, k, v, *, softmax_scale=None, causal=False):
    """(out, lse) by materialised attention; q (batch, seqlen_q, nheads, d), k and v (batch, seqlen_k, nheads, d)."""
    xp = _xp(q)
    scale = 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else softmax_scale
    qh, kh, vh = (x.transpose(0, 2, 1, 3) for x in (q, k, v))
    s = xp.matmul(qh, kh.transpose(0, 1, 3, 2)) * q.dtype.type(scale)  # (b, h, sq, sk): the N^2 matrix
    if causal:
        sq, sk = q.shape[1], k.shape[1]
        mask = xp.arange(sk)[None, :] <= xp.arange(sq)[:, None] + (sk - sq)
        s = xp.where(mask, s, s.dtype.type(-np.inf))
    m = s.max(axis=-1, keepdims=True)
    m = xp.where(xp.isneginf(m), 0, m)
    p = xp.exp(s - m)
    del s
    l = p.sum(axis=-1, keepdims=True)
    p /= xp.where(l > 0, l, 1)
    out = xp.matmul(p, vh).transpose(0, 2, 1, 3)
    with np.errstate(divide="ignore"):
        lse = (m + xp.log(l))[..., 0].astype(np.float32)
    return out, lse
