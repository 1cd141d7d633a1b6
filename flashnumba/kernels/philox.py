"""Philox-4x32-10, the counter-based random number generator of the dropout mask.

A counter-based generator maps (key, counter) to random bits with no state: the kernels draw element (i, j)
of head (b, h) from counter (j, i, b * nheads + h, offset) under key (seed), so the backward regenerates
exactly the forward's mask without storing it, and any run with the same seed gives the same mask.

One function serves three uses: it is called on NumPy arrays (the reference mask), on NumPy scalars (the
kernels under the simulator), and compiled by Numba as a device function (the kernels on the GPU). All values
are uint64 holding 32-bit words.

Philox round (Salmon et al., 2011):  hi0, lo0 = M0 * c0;  hi1, lo1 = M1 * c2;
c = (hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0);  k = (k0 + W0, k1 + W1).
"""

from __future__ import annotations

import numpy as np

M0 = np.uint64(0xD2511F53)
M1 = np.uint64(0xCD9E8D57)
W0 = np.uint64(0x9E3779B9)
W1 = np.uint64(0xBB67AE85)
MASK32 = np.uint64(0xFFFFFFFF)
SHIFT32 = np.uint64(32)
SHIFT8 = np.uint64(8)
TWO_M24 = np.float32(2.0**-24)


def philox4x32_10(c0, c1, c2, c3, k0, k1):
    """First output word of Philox-4x32-10 for counter (c0, c1, c2, c3) and key (k0, k1)."""
    for _ in range(10):
        p0 = M0 * c0
        p1 = M1 * c2
        n0 = ((p1 >> SHIFT32) ^ c1 ^ k0) & MASK32
        n2 = ((p0 >> SHIFT32) ^ c3 ^ k1) & MASK32
        c1 = p1 & MASK32
        c3 = p0 & MASK32
        c0 = n0
        c2 = n2
        k0 = (k0 + W0) & MASK32
        k1 = (k1 + W1) & MASK32
    return c0


def make_uniform(rounds):
    """uniform(seed, offset, bh, i, j): a float32 in [0, 1) for element (i, j) of head bh (= b * nheads + h),
    from 24 random bits of ``rounds`` (:func:`philox4x32_10`, or its compiled device version)."""

    def uniform(seed, offset, bh, i, j):
        x = rounds(np.uint64(j), np.uint64(i), np.uint64(bh), offset & MASK32, seed & MASK32, seed >> SHIFT32)
        return np.float32(x >> SHIFT8) * TWO_M24

    return uniform


uniform = make_uniform(philox4x32_10)


def keep_mask(seed, offset, batch, nheads, seqlen_q, seqlen_k, dropout_p):
    """(batch, nheads, seqlen_q, seqlen_k) bool: True where the kernels keep P_ij (probability 1 - dropout_p)."""
    bh = np.arange(batch * nheads, dtype=np.uint64).reshape(batch, nheads, 1, 1)
    i = np.arange(seqlen_q, dtype=np.uint64).reshape(1, 1, -1, 1)
    j = np.arange(seqlen_k, dtype=np.uint64).reshape(1, 1, 1, -1)
    seed, offset = np.uint64(seed), np.uint64(offset)
    x = philox4x32_10(j, i, bh, offset & MASK32, seed & MASK32, seed >> SHIFT32)
    return (x >> SHIFT8).astype(np.float32) * TWO_M24 >= np.float32(dropout_p)
