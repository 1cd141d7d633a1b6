"""Attention in plain NumPy: the truth every kernel is checked against, and the bridge to the kernels.

Layout, as in flash-attn: q ``(batch, seqlen_q, nheads, d)``, k and v ``(batch, seqlen_k, nheads, d)``,
out like q, lse ``(batch, nheads, seqlen_q)`` (natural log).

* :func:`attention_forward` / :func:`attention_backward`: dense attention. It materialises the
  ``seqlen_q x seqlen_k`` matrices S and P, in float64 by default. This is the truth.
* :func:`attention_forward_blocked`: the same result computed tile by tile with the online softmax, in the
  kernels' own notation (FlashAttention-2, Algorithm 1). Read it before the kernels.
* :func:`flex_attention_forward` / :func:`flex_attention_backward`: attention with a user's ``score_mod`` and
  ``mask_mod`` (FlexAttention's interface: plain Python functions of one entry), and :func:`flex_block_mask`,
  which classifies the (query tile, key tile) pairs of a mask as empty, full or partial.

Causal masking is bottom-right aligned (flash-attn >= 2.1): query i sees key j iff j <= i + seqlen_k - seqlen_q.
A query row that sees no key has out = 0 and lse = -inf.

``dtype`` chooses the precision of the computation: float64 (the truth), float32, float16 (NumPy's own
arithmetic), or ``ml_dtypes.bfloat16``, in which NumPy cannot compute (ml_dtypes multiplies matrices in float32
but sums in bfloat16): there the computation runs in float32 on the bfloat16 inputs and its results are rounded
to bfloat16, what an implementation that accumulates in float32 and stores bfloat16 achieves.
"""

from __future__ import annotations

import functools
import math

import numpy as np


def default_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim) if head_dim > 0 else 1.0


def causal_mask(seqlen_q: int, seqlen_k: int) -> np.ndarray:
    """(seqlen_q, seqlen_k) bool, True where query i may see key j (bottom-right aligned)."""
    return visibility_mask(seqlen_q, seqlen_k, causal=True)


def visibility_mask(seqlen_q, seqlen_k, *, causal=False, window_size=(-1, -1), rows=None, cols=None):
    """(len(rows), len(cols)) bool: query i sees key j iff
    i + seqlen_k - seqlen_q - left <= j <= i + seqlen_k - seqlen_q + right (a bound of -1 is no bound);
    ``causal`` sets right = 0. ``rows``/``cols`` select a tile (default: all)."""
    left, right = window_size
    if causal:
        right = 0
    i = (np.arange(seqlen_q) if rows is None else np.asarray(rows))[:, None]
    j = (np.arange(seqlen_k) if cols is None else np.asarray(cols))[None, :]
    diag = seqlen_k - seqlen_q
    mask = np.ones((i.shape[0], j.shape[1]), bool)
    if left >= 0:
        mask &= j >= i + diag - left
    if right >= 0:
        mask &= j <= i + diag + right
    return mask


def _bfloat16_in_float32(fn=None, *, keep_float32=()):
    """Let ``fn(..., dtype=ml_dtypes.bfloat16)`` compute in float32 and round its results to bfloat16, except
    the results at the positions ``keep_float32`` (the logsumexp, which the kernels return in float32)."""
    if fn is None:
        return functools.partial(_bfloat16_in_float32, keep_float32=keep_float32)

    @functools.wraps(fn)
    def wrapper(*args, dtype=np.float64, **kwargs):
        if np.dtype(dtype).name != "bfloat16":
            return fn(*args, dtype=dtype, **kwargs)
        result = fn(*args, dtype=np.float32, **kwargs)
        if not isinstance(result, tuple):
            return result.astype(dtype)
        return tuple(r if i in keep_float32 else r.astype(dtype) for i, r in enumerate(result))

    return wrapper


def _heads_first(x, dtype):
    # (batch, seqlen, nheads, d) -> (batch, nheads, seqlen, d)
    return np.asarray(x).astype(dtype).transpose(0, 2, 1, 3)


def _slopes(alibi_slopes, batch, nheads, dtype):
    """ALiBi slopes as (batch, nheads, 1, 1), or None."""
    if alibi_slopes is None:
        return None
    a = np.asarray(alibi_slopes, dtype)
    return np.broadcast_to(a.reshape((1, nheads) if a.ndim == 1 else (batch, nheads)), (batch, nheads))[..., None, None]


def _scores(Q, K, rows, cols, seqlen_q, seqlen_k, scale, causal, window_size, softcap, slopes):
    """The score tile S (masked entries -inf) for queries ``rows`` and keys ``cols``, and dS/dS_raw.

    S_raw = scale Q K^T;  S = softcap * tanh(S_raw / softcap) (if softcap > 0);  S -= slope * |i + diag - j|
    (ALiBi);  then the visibility mask. The second result, 1 - tanh^2 (or 1), turns a gradient with respect
    to S into one with respect to S_raw. Q is (..., len(rows), d), K (..., len(cols), d), heads matched.
    """
    dtype = Q.dtype.type
    s = dtype(scale) * (Q @ K.swapaxes(-1, -2))
    dcap = np.ones_like(s)
    if softcap > 0:
        t = np.tanh(s / dtype(softcap))
        s = dtype(softcap) * t
        dcap = 1 - t * t
    if slopes is not None:
        dist = np.abs(np.asarray(rows)[:, None] + (seqlen_k - seqlen_q) - np.asarray(cols)[None, :])
        s = s - slopes * dist.astype(dtype)
    visible = visibility_mask(seqlen_q, seqlen_k, causal=causal, window_size=window_size, rows=rows, cols=cols)
    return np.where(visible, s, -np.inf), dcap


def _expand_kv(k, nheads):
    """Repeat the key/value heads (batch, nheads_k, seqlen_k, d) for the query heads that share them (GQA)."""
    return np.repeat(k, nheads // k.shape[1], axis=1)


def _fold_kv(dk, nheads_k):
    """Sum a gradient (batch, nheads, seqlen_k, d) over the query heads that share each key/value head."""
    b, h, n, d = dk.shape
    return dk.reshape(b, nheads_k, h // nheads_k, n, d).sum(axis=2)


def _softmax(s):
    """P = softmax(s) row-wise and lse = logsumexp(s); a row of -inf gives P = 0 and lse = -inf; a row with a NaN
    (or +inf) score gives NaN, as the kernels do, never a quiet 0."""
    m = s.max(axis=-1, keepdims=True) if s.shape[-1] else np.full(s.shape[:-1] + (1,), -np.inf, s.dtype)
    m_safe = np.where(np.isneginf(m), 0.0, m)  # a row that sees no key: avoid -inf - -inf
    e = np.exp(s - m_safe)
    l = e.sum(axis=-1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        p = np.where(l == 0, 0.0, e / l)
        lse = (m_safe + np.log(l))[..., 0]  # log(0) = -inf for rows with no key
    return p, lse


def _dense(q, k, v, softmax_scale, causal, window_size, softcap, alibi_slopes, dtype):
    scale = default_scale(np.shape(q)[-1]) if softmax_scale is None else float(softmax_scale)
    q, k, v = (_heads_first(x, dtype) for x in (q, k, v))
    batch, nheads, seqlen_q, _ = q.shape
    seqlen_k = k.shape[2]
    k, v = _expand_kv(k, nheads), _expand_kv(v, nheads)
    s, dcap = _scores(q, k, np.arange(seqlen_q), np.arange(seqlen_k), seqlen_q, seqlen_k, scale, causal,
                      window_size, softcap, _slopes(alibi_slopes, batch, nheads, dtype))
    p, lse = _softmax(s)
    return q, k, v, p, lse, dcap, scale


@_bfloat16_in_float32(keep_float32=(1,))
def attention_forward(q, k, v, *, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                      alibi_slopes=None, dropout_z=None, dtype=np.float64):
    """Dense attention. Returns (out, lse): out like q, lse (batch, nheads, seqlen_q), both in ``dtype``.

    S = softmax_scale * Q K^T (then softcap, ALiBi and the mask, see :func:`_scores`),  P = softmax(S)
    (row-wise),  O = P V,  L = logsumexp(S) (row-wise). k and v may have fewer heads than q (GQA / MQA):
    query head h reads key/value head h // (nheads // nheads_k). Dropout: ``dropout_z`` (batch, nheads,
    seqlen_q, seqlen_k) = keep / (1 - p) multiplies P before P V (L is unchanged).
    """
    _, _, v, p, lse, _, _ = _dense(q, k, v, softmax_scale, causal, window_size, softcap, alibi_slopes, dtype)
    if dropout_z is not None:
        p = p * np.asarray(dropout_z, dtype)
    return (p @ v).transpose(0, 2, 1, 3), lse


@_bfloat16_in_float32
def attention_probs(q, k, v, *, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                    alibi_slopes=None, dropout_z=None, dtype=np.float64):
    """The attention probabilities P (batch, nheads, seqlen_q, seqlen_k), times Z with dropout: what
    ``flash_attn_func(..., return_attn_probs=True)`` returns."""
    _, _, _, p, _, _, _ = _dense(q, k, v, softmax_scale, causal, window_size, softcap, alibi_slopes, dtype)
    return p if dropout_z is None else p * np.asarray(dropout_z, dtype)


@_bfloat16_in_float32
def attention_backward(dout, q, k, v, *, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                       alibi_slopes=None, dropout_z=None, dtype=np.float64):
    """Analytic gradient of :func:`attention_forward`: returns (dq, dk, dv) in ``dtype``.

    dV = P^T dO,  dP = dO V^T,  dS = P * (dP - D) with D = rowsum(dO * O),  dS_raw = dS * (1 - tanh^2)
    (softcap),  dQ = scale dS_raw K,  dK = scale dS_raw^T Q; dK and dV summed over the query heads that
    share a key/value head. Dropout (``dropout_z`` = Z): O = (P Z) V, so dV = (P Z)^T dO and
    dS = P * (Z dP - D).
    """
    nheads_k = np.shape(k)[2]
    q, k, v, p, _, dcap, scale = _dense(q, k, v, softmax_scale, causal, window_size, softcap, alibi_slopes, dtype)
    z = np.ones((), dtype) if dropout_z is None else np.asarray(dropout_z, dtype)
    return _gradients(_heads_first(dout, dtype), q, k, v, p, z, dcap, scale, nheads_k)


def _gradients(do, q, k, v, p, z, dcap, scale, nheads_k, absolute=False):
    """:func:`attention_backward`'s formulas on heads-first arrays, returned as (batch, seqlen, heads, d); with
    ``absolute`` D is added to Z dP instead of subtracted (the form of :func:`attention_backward_terms`, which
    passes absolute values)."""
    o = (p * z) @ v
    dv = (p * z).transpose(0, 1, 3, 2) @ do
    dp = do @ v.transpose(0, 1, 3, 2)
    d_i = (do * o).sum(axis=-1, keepdims=True)
    ds = p * ((z * dp + d_i) if absolute else (z * dp - d_i)) * dcap
    dq = scale * (ds @ k)
    dk = scale * (ds.transpose(0, 1, 3, 2) @ q)
    dk, dv = _fold_kv(dk, nheads_k), _fold_kv(dv, nheads_k)
    return tuple(x.transpose(0, 2, 1, 3) for x in (dq, dk, dv))


def attention_backward_terms(dout, q, k, v, *, softmax_scale=None, causal=False, window_size=(-1, -1),
                             softcap=0.0, alibi_slopes=None, dropout_z=None):
    """The size of the terms each gradient of :func:`attention_backward` sums: the same formulas on absolute
    values (float64), |dV| <= |P Z|^T |dO|, |dS| <= P (|Z| |dO| |V|^T + rowsum(|dO| * (|P Z| |V|))) |1 - tanh^2|,
    |dQ| <= scale |dS| |K|, |dK| <= scale |dS|^T |Q|.

    The rounding error of a sum of products grows with the sum of the products' absolute values (Higham,
    "Accuracy and Stability of Numerical Algorithms", 2nd ed., section 3.5: |fl(A B) - A B| <= gamma_n |A| |B|),
    not with the result, which can be far smaller: with one key, P = 1 and dP - D cancels to exactly 0 in dQ and
    dK, while each of dP and D holds head_dim products. The checker allows a few float32 ulps of these sizes
    (:func:`flashnumba.check.tolerance`).
    """
    nheads_k = np.shape(k)[2]
    q, k, v, p, _, dcap, scale = _dense(q, k, v, softmax_scale, causal, window_size, softcap, alibi_slopes,
                                        np.float64)
    z = np.ones(()) if dropout_z is None else np.abs(np.asarray(dropout_z, np.float64))
    return _gradients(np.abs(_heads_first(dout, np.float64)), np.abs(q), np.abs(k), np.abs(v), p, z, np.abs(dcap),
                      scale, nheads_k, absolute=True)


def attention_forward_blocked(q, k, v, *, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                              alibi_slopes=None, block_m=16, block_n=16):
    """Attention computed tile by tile with the online softmax (FlashAttention-2, Algorithm 1), in float64.

    For each query tile Q_i (B_r rows) and each key/value tile K_j, V_j (B_c rows)::

        S_ij  = scale * Q_i K_j^T                      (B_r, B_c), masked entries -inf
        m_new = max(m_i, rowmax(S_ij))
        P_ij  = exp(S_ij - m_new)
        l_i   = exp(m_i - m_new) * l_i + rowsum(P_ij)
        O_i   = exp(m_i - m_new) * O_i + P_ij V_j      (un-normalised)
        m_i   = m_new

    and at the end O_i = O_i / l_i and L_i = m_i + log(l_i). Only one (B_r, B_c) tile of S exists at a time.
    The GPU kernels do exactly this, with one thread block per (Q_i, batch, head). (softcap and ALiBi change
    how S_ij is formed, see :func:`_scores`; the recurrence is the same.)
    """
    scale = default_scale(np.shape(q)[-1]) if softmax_scale is None else float(softmax_scale)
    q, k, v = (_heads_first(x, np.float64) for x in (q, k, v))
    batch, nheads, seqlen_q, d = q.shape
    seqlen_k = k.shape[2]
    k, v = _expand_kv(k, nheads), _expand_kv(v, nheads)
    slopes = _slopes(alibi_slopes, batch, nheads, np.float64)
    out = np.zeros_like(q)
    lse = np.full((batch, nheads, seqlen_q), -np.inf)
    for i0 in range(0, seqlen_q, block_m):
        Q_i = q[:, :, i0 : i0 + block_m]  # (b, h, B_r, d)
        rows = np.arange(i0, i0 + Q_i.shape[2])
        m_i = np.full(Q_i.shape[:3], -np.inf)  # running row max
        l_i = np.zeros(Q_i.shape[:3])  # running row sum of exp(S - m_i)
        O_i = np.zeros_like(Q_i)  # running un-normalised output
        for j0 in range(0, seqlen_k, block_n):
            K_j = k[:, :, j0 : j0 + block_n]  # (b, h, B_c, d)
            V_j = v[:, :, j0 : j0 + block_n]  # (b, h, B_c, d)
            cols = np.arange(j0, j0 + K_j.shape[2])
            S_ij, _ = _scores(Q_i, K_j, rows, cols, seqlen_q, seqlen_k, scale, causal, window_size, softcap, slopes)
            m_new = np.maximum(m_i, S_ij.max(axis=-1))
            m_use = np.where(np.isneginf(m_new), 0.0, m_new)  # rows that have seen no key yet
            P_ij = np.exp(S_ij - m_use[..., None])
            alpha = np.exp(m_i - m_use)  # rescales what was accumulated under the old max
            l_i = alpha * l_i + P_ij.sum(axis=-1)
            O_i = alpha[..., None] * O_i + P_ij @ V_j
            m_i = m_new
        seen = l_i != 0  # (a NaN sum is seen: its NaN goes through, as in the kernels)
        out[:, :, i0 : i0 + block_m] = np.where(seen[..., None], O_i / np.where(seen, l_i, 1.0)[..., None], 0.0)
        with np.errstate(divide="ignore"):
            lse[:, :, i0 : i0 + block_m] = np.where(seen, m_i + np.log(np.where(seen, l_i, 1.0)), -np.inf)
    return out.transpose(0, 2, 1, 3), lse


def combine_splits(outs, lses):
    """Exact attention from attentions over parts of the keys (split-KV decoding's second step), in float64.

    ``outs`` (S, batch, seqlen_q, nheads, d): each part's normalised output O_s; ``lses`` (S, batch, nheads,
    seqlen_q): its logsumexp L_s (-inf where the part saw no key). The whole is::

        M = max_s L_s,   L = M + log(sum_s exp(L_s - M)),   O = sum_s exp(L_s - L) O_s

    the online softmax's rescaling done once per part instead of once per tile. Returns (out, lse); a row that
    no part saw gets 0 and -inf.
    """
    outs, lses = np.asarray(outs, np.float64), np.asarray(lses, np.float64)
    m = lses.max(axis=0)
    seen = ~np.isneginf(m)  # (a NaN or +inf lse goes through)
    m_use = np.where(seen, m, 0.0)
    w = np.exp(lses - m_use)  # (S, batch, nheads, seqlen_q); 0 for the parts that saw nothing
    total = w.sum(axis=0)
    with np.errstate(divide="ignore", invalid="ignore"):
        lse = np.where(seen, m_use + np.log(np.where(seen, total, 1.0)), -np.inf)
        weights = np.where(seen, w / np.where(seen, total, 1.0), 0.0)
    out = np.einsum("sbht,sbthd->bthd", weights, outs)
    return out, lse


def attention_forward_split(q, k, v, *, num_splits=2, **opts):
    """Attention as split-KV decoding computes it (:mod:`flashnumba.kernels.mma_decode`), in float64: the keys cut
    into ``num_splits`` contiguous parts, :func:`attention_forward` over each part (keys outside it hidden), then
    :func:`combine_splits`. The same result as :func:`attention_forward` over all the keys."""
    seqlen_q, seqlen_k = np.shape(q)[1], np.shape(k)[1]
    edges = np.linspace(0, seqlen_k, num_splits + 1).astype(int)
    outs, lses = [], []
    for lo, hi in zip(edges[:-1], edges[1:]):
        keep = np.zeros((seqlen_q, seqlen_k), bool)
        keep[:, lo:hi] = True
        o, lse = _masked_forward(q, k, v, keep, opts)
        outs.append(o)
        lses.append(lse)
    return combine_splits(outs, lses)


def _masked_forward(q, k, v, keep, opts):
    """attention_forward with the keys outside ``keep`` (seqlen_q, seqlen_k) hidden as well."""
    scale = default_scale(np.shape(q)[-1]) if opts.get("softmax_scale") is None else float(opts["softmax_scale"])
    Q, K, V = (_heads_first(x, np.float64) for x in (q, k, v))
    batch, nheads, seqlen_q, _ = Q.shape
    seqlen_k = K.shape[2]
    K, V = _expand_kv(K, nheads), _expand_kv(V, nheads)
    s, _ = _scores(Q, K, np.arange(seqlen_q), np.arange(seqlen_k), seqlen_q, seqlen_k, scale,
                   opts.get("causal", False), opts.get("window_size", (-1, -1)), opts.get("softcap", 0.0),
                   _slopes(opts.get("alibi_slopes"), batch, nheads, np.float64))
    s = np.where(keep, s, -np.inf)
    p, lse = _softmax(s)
    return (p @ V).transpose(0, 2, 1, 3), lse


@_bfloat16_in_float32
def attention_backward_blocked(dout, q, k, v, out, lse, *, softmax_scale=None, causal=False, window_size=(-1, -1),
                               softcap=0.0, alibi_slopes=None, dropout_z=None, block_m=16, block_n=16,
                               dtype=np.float64):
    """The gradient recomputed tile by tile from the saved lse (FlashAttention-2, Algorithm 2), in ``dtype``.

    ``out`` and ``lse`` are the forward's. Nothing of size seqlen_q x seqlen_k exists; for each key tile j
    and query tile i::

        D_i   = rowsum(dO_i * O_i)
        P_ij  = exp(scale * Q_i K_j^T - L_i)        masked entries 0
        dV_j += P_ij^T dO_i
        dP_ij = dO_i V_j^T
        dS_ij = P_ij * (dP_ij - D_i)                 (times 1 - tanh^2 with softcap)
        dK_j += scale * dS_ij^T Q_i
        dQ_i += scale * dS_ij K_j

    Run in float32 it is what a plain float32 implementation of this algorithm achieves: the tests use it
    to derive the backward kernels' tolerance.
    """
    scale = default_scale(np.shape(q)[-1]) if softmax_scale is None else float(softmax_scale)
    dtype = np.dtype(dtype).type
    nheads_k = np.shape(k)[2]
    do, q, k, v, o = (_heads_first(x, dtype) for x in (dout, q, k, v, out))
    batch, nheads, seqlen_q, _ = q.shape
    seqlen_k = k.shape[2]
    k, v = _expand_kv(k, nheads), _expand_kv(v, nheads)
    slopes = _slopes(alibi_slopes, batch, nheads, dtype)
    lse = np.asarray(lse).astype(dtype)
    z_all = None if dropout_z is None else np.broadcast_to(np.asarray(dropout_z, dtype),
                                                           (batch, nheads, seqlen_q, seqlen_k))
    D = (do * o).sum(axis=-1)  # (batch, nheads, seqlen_q)
    dq, dk, dv = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
    for j0 in range(0, seqlen_k, block_n):
        K_j, V_j = k[:, :, j0 : j0 + block_n], v[:, :, j0 : j0 + block_n]  # (b, h, B_c, d)
        cols = np.arange(j0, j0 + K_j.shape[2])
        for i0 in range(0, seqlen_q, block_m):
            Q_i, dO_i = q[:, :, i0 : i0 + block_m], do[:, :, i0 : i0 + block_m]  # (b, h, B_r, d)
            L_i, D_i = lse[:, :, i0 : i0 + block_m, None], D[:, :, i0 : i0 + block_m, None]
            rows = np.arange(i0, i0 + Q_i.shape[2])
            S_ij, dcap = _scores(Q_i, K_j, rows, cols, seqlen_q, seqlen_k, scale, causal, window_size, softcap,
                                 slopes)
            visible = np.isfinite(S_ij) & np.isfinite(L_i)  # a row that saw no key has L_i = -inf and P_ij = 0
            with np.errstate(over="ignore", invalid="ignore"):
                P_ij = np.where(visible, np.exp(S_ij - L_i), 0).astype(dtype)
            Z_ij = 1 if z_all is None else z_all[:, :, i0 : i0 + block_m, j0 : j0 + block_n]  # dropout
            dv[:, :, j0 : j0 + block_n] += (P_ij * Z_ij).swapaxes(-1, -2) @ dO_i
            dS_ij = P_ij * (Z_ij * (dO_i @ V_j.swapaxes(-1, -2)) - D_i) * dcap
            dk[:, :, j0 : j0 + block_n] += dtype(scale) * (dS_ij.swapaxes(-1, -2) @ Q_i)
            dq[:, :, i0 : i0 + block_m] += dtype(scale) * (dS_ij @ K_j)
    dk, dv = _fold_kv(dk, nheads_k), _fold_kv(dv, nheads_k)
    return tuple(x.transpose(0, 2, 1, 3) for x in (dq, dk, dv))


def attention_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, *, alibi_slopes=None, **opts):
    """Packed variable-length batches, sequence by sequence with :func:`attention_forward`.

    q (total_q, nheads, d), k and v (total_k, nheads_k, d); returns out (total_q, nheads, d) and lse
    (nheads, total_q). ``opts``: softmax_scale, causal, window_size, softcap, dtype."""
    dtype = opts.get("dtype", np.float64)
    nheads = np.shape(q)[1]
    out = np.zeros(np.shape(q), dtype)
    lse_dtype = np.float32 if np.dtype(dtype).name == "bfloat16" else dtype  # as attention_forward returns it
    lse = np.full((nheads, np.shape(q)[0]), -np.inf, lse_dtype)
    for b, (q0, q1, k0, k1) in enumerate(zip(cu_seqlens_q[:-1], cu_seqlens_q[1:], cu_seqlens_k[:-1], cu_seqlens_k[1:])):
        slopes = _batch_slopes(alibi_slopes, b)
        o, l = attention_forward(q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], alibi_slopes=slopes, **opts)
        out[q0:q1], lse[:, q0:q1] = o[0], l[0]
    return out, lse


def attention_varlen_backward(dout, q, k, v, cu_seqlens_q, cu_seqlens_k, *, alibi_slopes=None, **opts):
    """Gradient of :func:`attention_varlen_forward`: (dq, dk, dv), packed like q, k, v."""
    dtype = opts.get("dtype", np.float64)
    dq, dk, dv = (np.zeros(np.shape(x), dtype) for x in (q, k, v))
    for b, (q0, q1, k0, k1) in enumerate(zip(cu_seqlens_q[:-1], cu_seqlens_q[1:], cu_seqlens_k[:-1], cu_seqlens_k[1:])):
        g = attention_backward(dout[None, q0:q1], q[None, q0:q1], k[None, k0:k1], v[None, k0:k1],
                               alibi_slopes=_batch_slopes(alibi_slopes, b), **opts)
        dq[q0:q1], dk[k0:k1], dv[k0:k1] = (x[0] for x in g)
    return dq, dk, dv


def _batch_slopes(alibi_slopes, b):
    if alibi_slopes is None:
        return None
    a = np.asarray(alibi_slopes)
    return a if a.ndim == 1 else a[b]


def dropout_z(seed, offset, batch, nheads, seqlen_q, seqlen_k, dropout_p):
    """Z = keep / (1 - dropout_p), (batch, nheads, seqlen_q, seqlen_k): the kernels' dropout multiplier, from
    the same Philox stream (:func:`flashnumba.philox.keep_mask`)."""
    from .kernels.philox import keep_mask

    keep = keep_mask(seed, offset, batch, nheads, seqlen_q, seqlen_k, dropout_p)
    return keep / (1.0 - np.float32(dropout_p)).astype(np.float64)


# ---------------------------------------------------------------------------------------------------------------
# your own variant: score_mod and mask_mod, FlexAttention's interface, as plain Python functions
# ---------------------------------------------------------------------------------------------------------------
#
#   score_mod(score, b, h, q_idx, kv_idx, *args) -> the modified score   (score = scale q . k, natural units)
#   mask_mod(b, h, q_idx, kv_idx, *args) -> True where query q_idx may see key kv_idx
#   score_mod_grad(score, b, h, q_idx, kv_idx, *args) -> d score_mod / d score   (for the backward)
#
# b, h: the batch entry and the query head; q_idx, kv_idx: positions in the sequences (no alignment shift: a
# bottom-right causal mask is q_idx + seqlen_k - seqlen_q >= kv_idx, with the lengths passed as args or
# closed over). ``args``: arrays (or numbers) the functions read, such as a bias table or document ids; a
# function that does not take them is called without them. The functions are called one entry at a time, with
# Python numbers, as a kernel calls them per thread.


def _with_args(fn, lead, args):
    """fn with ``args`` bound where it takes them (lead + len(args) parameters), else fn."""
    import inspect

    if not args:
        return fn
    try:
        inspect.signature(fn).bind(*range(lead + len(args)))
    except TypeError:
        return fn
    return lambda *x: fn(*x, *args)


def _entrywise(fn, otype, *grids):
    return np.vectorize(fn, otypes=[otype])(*grids)


def _flex_grids(batch, nheads, seqlen_q, seqlen_k):
    return np.broadcast_arrays(np.arange(batch)[:, None, None, None], np.arange(nheads)[None, :, None, None],
                               np.arange(seqlen_q)[None, None, :, None], np.arange(seqlen_k)[None, None, None, :])


def flex_visible(mask_mod, batch, nheads, seqlen_q, seqlen_k, score_mod_args=()):
    """(batch, nheads, seqlen_q, seqlen_k) bool: ``mask_mod`` at every entry (all True without one)."""
    grids = _flex_grids(batch, nheads, seqlen_q, seqlen_k)
    if mask_mod is None:
        return np.ones(grids[0].shape, bool)
    mask = _with_args(mask_mod, 4, score_mod_args)
    return _entrywise(lambda b, h, i, j: bool(mask(int(b), int(h), int(i), int(j))), bool, *grids)


def _flex_dense(q, k, v, score_mod, mask_mod, scale, score_mod_args, dtype, grad_mod=None):
    """Q, K, V heads first (K, V repeated for GQA), P, lse, the derivative of score_mod at every entry (or None)
    and the scale."""
    scale = default_scale(np.shape(q)[-1]) if scale is None else float(scale)
    q, k, v = (_heads_first(x, dtype) for x in (q, k, v))
    batch, nheads, seqlen_q, _ = q.shape
    k, v = _expand_kv(k, nheads), _expand_kv(v, nheads)
    s = dtype(scale) * (q @ k.swapaxes(-1, -2))
    grids = _flex_grids(batch, nheads, seqlen_q, k.shape[2])
    dmod = None
    if score_mod is not None:
        raw = s
        mod = _with_args(score_mod, 5, score_mod_args)
        s = _entrywise(lambda x, b, h, i, j: mod(dtype(x), int(b), int(h), int(i), int(j)), dtype, raw, *grids)
        if grad_mod is not None:
            grad = _with_args(grad_mod, 5, score_mod_args)
            dmod = _entrywise(lambda x, b, h, i, j: grad(dtype(x), int(b), int(h), int(i), int(j)), dtype, raw,
                              *grids)
    visible = flex_visible(mask_mod, batch, nheads, seqlen_q, k.shape[2], score_mod_args)
    p, lse = _softmax(np.where(visible, s, -np.inf))
    return q, k, v, p, lse, dmod, scale


@_bfloat16_in_float32(keep_float32=(1,))
def flex_attention_forward(q, k, v, *, score_mod=None, mask_mod=None, scale=None, score_mod_args=(),
                           dtype=np.float64):
    """Attention with a user's score_mod and mask_mod (see above), in flash-attn's layout: (out, lse).

    S = score_mod(scale Q K^T) entry by entry, -inf where mask_mod is False; P = softmax(S), O = P V,
    L = logsumexp(S); a row that sees no key has out 0 and lse -inf. GQA as :func:`attention_forward`."""
    _, _, v, p, lse, _, _ = _flex_dense(q, k, v, score_mod, mask_mod, scale, score_mod_args, np.dtype(dtype).type)
    return (p @ v).transpose(0, 2, 1, 3), lse


@_bfloat16_in_float32
def flex_attention_backward(dout, q, k, v, *, score_mod=None, score_mod_grad=None, mask_mod=None, scale=None,
                            score_mod_args=(), dtype=np.float64):
    """Gradient of :func:`flex_attention_forward`: (dq, dk, dv). As :func:`attention_backward`, with the
    derivative of the score_mod, ``score_mod_grad`` (required with a score_mod: without it no gradient can be
    right), in place of the softcap's: dS_raw = P (dP - D) score_mod_grad(S_raw)."""
    if score_mod is not None and score_mod_grad is None:
        raise ValueError("the backward through a score_mod needs its derivative with respect to the score: "
                         "pass score_mod_grad (for an added bias, a function returning 1.0)")
    nheads_k = np.shape(k)[2]
    t = np.dtype(dtype).type
    q, k, v, p, _, dmod, scale = _flex_dense(q, k, v, score_mod, mask_mod, scale, score_mod_args, t,
                                             score_mod_grad)
    do = _heads_first(dout, t)
    o = p @ v
    dv = p.transpose(0, 1, 3, 2) @ do
    dp = do @ v.transpose(0, 1, 3, 2)
    ds = p * (dp - (do * o).sum(axis=-1, keepdims=True))
    if dmod is not None:
        ds = ds * dmod
    dq = scale * (ds @ k)
    dk = scale * (ds.transpose(0, 1, 3, 2) @ q)
    dk, dv = _fold_kv(dk, nheads_k), _fold_kv(dv, nheads_k)
    return tuple(x.transpose(0, 2, 1, 3) for x in (dq, dk, dv))


EMPTY, PARTIAL, FULL = 0, 1, 2  # a (query tile, key tile) of a block mask


def flex_block_mask(mask_mod, batch, nheads, seqlen_q, seqlen_k, block_m, block_n, score_mod_args=()):
    """(batch, nheads, ceil(seqlen_q / block_m), ceil(seqlen_k / block_n)) int8: each (query tile, key tile)
    EMPTY (mask_mod False at every entry within the sequences: the kernels skip it), FULL (True at every one:
    no per-entry mask) or PARTIAL."""
    visible = flex_visible(mask_mod, batch, nheads, seqlen_q, seqlen_k, score_mod_args)
    nq, nk = -(-seqlen_q // block_m), -(-seqlen_k // block_n)
    out = np.empty((batch, nheads, nq, nk), np.int8)
    for a in range(nq):
        for c in range(nk):
            tile = visible[:, :, a * block_m:(a + 1) * block_m, c * block_n:(c + 1) * block_n]
            out[:, :, a, c] = np.where(tile.all(axis=(2, 3)), FULL, np.where(tile.any(axis=(2, 3)), PARTIAL, EMPTY))
    return out


# ---------------------------------------------------------------------------------------------------------------
# decoding against a KV cache (flash-attn's flash_attn_with_kvcache)
# ---------------------------------------------------------------------------------------------------------------


def apply_rotary(x, cos, sin, positions, interleaved=True):
    """Rotary position embedding of x (seqlen, nheads, head_dim) at integer ``positions`` (seqlen,), in float64:
    cos, sin (seqlen_ro, rotary_dim / 2); the first rotary_dim dims of each head are rotated, the rest kept.
    ``interleaved`` (GPT-J): the pairs are dims (0, 1), (2, 3), ...; otherwise (GPT-NeoX) dims (i, i + rotary_dim
    / 2). Each pair (x1, x2) becomes (x1 cos - x2 sin, x1 sin + x2 cos) with the angle of its position and index:
    the complex product (x1 + i x2) e^{i theta}."""
    c = np.asarray(cos, np.float64)[positions][:, None, :]
    s = np.asarray(sin, np.float64)[positions][:, None, :]
    return rotate_pairs(np.asarray(x, np.float64).copy(), c, s, interleaved)


def rotate_pairs(y, c, s, interleaved):
    """y (seqlen, nheads, head_dim) rotated in place and returned: each pair (x1, x2) of its first 2 c.shape[-1]
    dims (interleaved or halves, see :func:`apply_rotary`) becomes (x1 c - x2 s, x1 s + x2 c), c and s (seqlen, 1,
    rotary_dim / 2) the cosines and sines of each row's angles. NumPy or CuPy arrays, in their own dtype."""
    half = c.shape[-1]
    if interleaved:
        x1, x2 = y[..., 0:2 * half:2].copy(), y[..., 1:2 * half:2].copy()
        y[..., 0:2 * half:2], y[..., 1:2 * half:2] = x1 * c - x2 * s, x1 * s + x2 * c
    else:
        x1, x2 = y[..., :half].copy(), y[..., half:2 * half].copy()
        y[..., :half], y[..., half:2 * half] = x1 * c - x2 * s, x1 * s + x2 * c
    return y


def kvcache_attention(q, k_cache, v_cache, k=None, v=None, *, rotary_cos=None, rotary_sin=None, cache_seqlens=None,
                      cache_batch_idx=None, cache_leftpad=None, block_table=None, softmax_scale=None, causal=False,
                      window_size=(-1, -1), softcap=0.0, rotary_interleaved=True, alibi_slopes=None,
                      dtype=np.float64):
    """flash-attn's ``flash_attn_with_kvcache`` in NumPy, nothing modified: (out, lse, k_cache, v_cache), out
    (batch, seqlen_q, nheads, head_dim) and lse (batch, nheads, seqlen_q) in ``dtype`` (the attention computed in
    it, as :func:`attention_forward`), the caches as they are after the call (copies, in their dtype).

    For batch entry b: its cache is k_cache[cache_batch_idx[b]] (b without it), or with ``block_table`` the pages
    block_table[b, p // page_size] (k_cache then (num_pages, page_size, nheads_k, head_dim)), position p at row
    p % page_size. L = cache_seqlens[b] (an int: the same for every entry; None: the whole cache, its capacity)
    positions hold keys; the new k[b], v[b] (seqlen_new rows) are written at positions L .. L + seqlen_new - 1, k
    rotated at those positions first; then q[b] attends to the keys at positions P .. L + seqlen_new - 1, P =
    cache_leftpad[b] (0 without it: positions below P are left padding), causal bottom-right aligned (query t at
    position L + seqlen_new - seqlen_q + t). q is rotated at positions L + t when causal or windowed, else at
    position L for every row (as flash-attn: the queries are then taken to be one token); positions, for the
    rotations and the masks alike, are those of the cache, padding included."""
    q = np.asarray(q)
    batch, seqlen_q, nheads, d = q.shape
    kc, vc = np.array(k_cache, copy=True), np.array(v_cache, copy=True)
    if cache_seqlens is None and k is not None:
        raise ValueError("new keys k need cache_seqlens (where to write them)")
    capacity = kc.shape[1] * (1 if block_table is None else np.shape(block_table)[1])
    lens = np.broadcast_to(np.asarray(capacity if cache_seqlens is None else cache_seqlens, np.int64), (batch,))
    sn = 0 if k is None else np.asarray(k).shape[1]
    pads = np.zeros(batch, np.int64) if cache_leftpad is None else np.asarray(cache_leftpad, np.int64)
    outs, lses = [], []
    for b in range(batch):
        L = int(lens[b])
        if not 0 <= pads[b] <= L:
            raise ValueError(f"cache_leftpad[{b}] = {pads[b]} must lie in [0, cache_seqlens] = [0, {L}]")
        if block_table is None:
            cb = b if cache_batch_idx is None else int(np.asarray(cache_batch_idx)[b])

            def rows(pos, cb=cb):
                return (np.full_like(pos, cb), pos)
        else:
            page = kc.shape[1]

            def rows(pos, b=b, page=page):
                return (np.asarray(block_table)[b, pos // page], pos % page)
        if sn:
            pos = np.arange(L, L + sn)
            knew = np.asarray(k)[b].astype(np.float64)
            if rotary_cos is not None:
                knew = apply_rotary(knew, rotary_cos, rotary_sin, pos, rotary_interleaved)
            kc[rows(pos)] = knew.astype(kc.dtype)
            vc[rows(pos)] = np.asarray(v)[b].astype(vc.dtype)
        seqlen_k = L + sn
        keys = kc[rows(np.arange(pads[b], seqlen_k))]
        values = vc[rows(np.arange(pads[b], seqlen_k))]
        qb = q[b]
        if rotary_cos is not None:
            local = causal or tuple(window_size) != (-1, -1)
            qpos = L + np.arange(seqlen_q) if local else np.full(seqlen_q, L)
            qb = apply_rotary(qb, rotary_cos, rotary_sin, qpos, rotary_interleaved).astype(q.dtype)
        slopes = None if alibi_slopes is None else np.asarray(alibi_slopes)
        if slopes is not None and slopes.ndim == 2:
            slopes = slopes[b]
        o, lse = attention_forward(qb[None], keys[None], values[None], softmax_scale=softmax_scale, causal=causal,
                                   window_size=window_size, softcap=softcap, alibi_slopes=slopes, dtype=dtype)
        outs.append(o[0])
        lses.append(lse[0])
    if not batch:
        return np.zeros(q.shape, dtype), np.zeros((0, nheads, seqlen_q), dtype), kc, vc
    return np.stack(outs), np.stack(lses), kc, vc
