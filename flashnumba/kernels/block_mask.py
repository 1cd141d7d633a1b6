"""A mask_mod's block classification, on the device: which (query block, key block) pairs are empty, partial or
full, so that the kernels skip the empty ones and run the full ones without evaluating the mask.

One block of threads per (query block, key block, batch x head): each thread evaluates the user's mask_mod at its
share of the block's entries within the sequences, and ``syncthreads_or`` / ``syncthreads_and`` combine whether
any and whether all are visible (:func:`flashnumba.reference.flex_block_mask` is the same in NumPy).

The ``mma.sync`` kernels that read a block mask walk its lists with :func:`make_block_tiles` (the Hopper kernels
with :func:`flashnumba.kernels.wgmma_forward.make_key_walk` and the dK/dV kernel's own ``tile_of``): the forward
and the dQ kernel the key blocks of their query block, the dK/dV kernel the query blocks of its key block.
"""

from __future__ import annotations

import functools

from .._backend import cuda
from .common import make_user_mods
from .scalars import int64, uint64

EMPTY, PARTIAL, FULL = 0, 1, 2
THREADS = 128


@functools.lru_cache(maxsize=None)
def make_block_tiles(on, block, tile):
    """tile_start(n, start, idx, bb, hb, outer) -> the first row of the n-th tile (``tile`` rows) a kernel
    visits. ``on``: the tiles of the blocks (``block`` rows, a multiple of ``tile``) that idx[bb, hb, outer]
    lists, in order, block // tile tiles each; otherwise the tiles from row ``start`` on, one after the other
    (idx unread)."""
    SUB = uint64(block // tile)

    @cuda.jit(device=True, inline=True)
    def tile_start(n, start, idx, bb, hb, outer):
        if on:  # (unsigned indices, all >= 0: no wraparound of negative ones, no signed division's rounding term)
            u = uint64(n)
            return idx[uint64(bb), uint64(hb), uint64(outer), u // SUB] * block + int64(u % SUB) * tile
        return start + n * tile

    return tile_start


@functools.lru_cache(maxsize=None)
def make_block_full(on, block):
    """block_full(state, bb, hb, outer, j) -> whether the block of row ``j`` (``block`` rows a block) in
    state[bb, hb, outer] is a full one (False where ``on`` is not: no block mask); the kernels evaluate the
    mask_mod in the blocks that are not. The forward reads it a tile ahead of its use, so that its latency hides
    behind a tile's products."""
    UBLOCK = uint64(block)

    @cuda.jit(device=True, inline=True)
    def block_full(state, bb, hb, outer, j):
        if on:  # (unsigned indices, as tile_start's)
            return state[uint64(bb), uint64(hb), uint64(outer), uint64(j) // UBLOCK] == FULL
        return False

    return block_full


@functools.lru_cache(maxsize=None)
def make_classify(mods, QB, KB):
    """classify(state, seqlen_q, seqlen_k, a0, a1, a2, a3): state (batch, nheads, ceil(seqlen_q / QB),
    ceil(seqlen_k / KB)) int8 set to EMPTY, PARTIAL or FULL for ``mods``' mask_mod. Launch: grid (query blocks,
    key blocks, batch * nheads), block (THREADS,)."""
    _, user_mask = make_user_mods(mods)

    @cuda.jit
    def classify(state, seqlen_q, seqlen_k, a0, a1, a2, a3):
        qb = cuda.blockIdx.x
        kb = cuda.blockIdx.y
        b = cuda.blockIdx.z // state.shape[1]
        h = cuda.blockIdx.z % state.shape[1]
        seen = 0  # any entry visible
        every = 1  # every entry within the sequences visible
        for e in range(cuda.threadIdx.x, QB * KB, THREADS):
            i = qb * QB + e // KB
            j = kb * KB + e % KB
            if i < seqlen_q and j < seqlen_k:
                if user_mask(b, h, i, j, a0, a1, a2, a3):
                    seen = 1
                else:
                    every = 0
        seen = cuda.syncthreads_or(seen)
        every = cuda.syncthreads_and(every)
        if cuda.threadIdx.x == 0:
            state[b, h, qb, kb] = FULL if seen and every else PARTIAL if seen else EMPTY

    return classify
