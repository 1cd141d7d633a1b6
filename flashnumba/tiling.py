"""Tile sizes: one table per kernel family, each choice with its reason, resolved against a device's limits.

Every tile configuration is written the same way, :class:`Tiles` ``(block_m, block_n, num_threads)``: B_r query
rows, B_c key rows and the threads of one block. A family's table is an ordered list of candidates for a range
of head dims; :func:`resolve` takes the first whose shared memory fits the device (and whose threads the family
accepts), so that a GPU with less shared memory than the one a table's first choice was measured on gets the next
choice rather than an error. Each choice says why it was made: a sweep on the H200 (the measurements in
docs/benchmarks.md), or, for the tensor-core rows beyond head dim 128 not yet swept, an offline compile without
register spills.

The families (the ``kernel=`` names of the API; the tensor-core backward has two kernels with tables of their
own):

=============  ===================================================  ============================================
family         kernel module                                        threads
=============  ===================================================  ============================================
``v1``         :mod:`flashnumba.kernels.simt_forward` (thread/row)  B_r (static shared memory, <= 48 KB)
``v2``, ``v3`` :mod:`flashnumba.kernels.simt_forward`               given; a multiple of 32
``bwd_v1``     :mod:`flashnumba.kernels.simt_backward`              B_r (dQ), B_c (dK/dV); static shared memory
``bwd_v2``     :mod:`flashnumba.kernels.simt_backward`              given; a multiple of 32
``tc``         :mod:`flashnumba.kernels.mma_forward`                32 per 16 or 32 query rows (given; else 16)
``tc_dq``      :mod:`flashnumba.kernels.mma_backward`               32 per 16 query rows
``tc_dkdv``    :mod:`flashnumba.kernels.mma_backward`               32 per 16 key rows (d > 160: twice)
``tf32``,      :mod:`flashnumba.kernels.mma_tf32`                   32 per 16 query rows
``3xtf32``
``tf32_dq``    :mod:`flashnumba.kernels.mma_tf32_backward`          32 per 16 query rows
``tf32_dkdv``  :mod:`flashnumba.kernels.mma_tf32_backward`          32 per 16 key rows
``wgmma``      :mod:`flashnumba.kernels.wgmma_forward` (Hopper)     128 per 64 query rows (a warpgroup), + 32
                                                                   per producer warp (0, 1 or 4: the table's
                                                                   tiles have a producer warpgroup, kept for a
                                                                   caller's block_m or block_n unless
                                                                   num_threads says otherwise)
``wgmma_dq``   :mod:`flashnumba.kernels.wgmma_backward` (Hopper)    128 per 64 query rows, + 128 (a producer
                                                                   warpgroup) where it copies with tensor maps
``wgmma_dkdv`` :mod:`flashnumba.kernels.wgmma_backward` (Hopper)    128 per 64 key rows (d > 128: 256), + 128
                                                                   where it copies with tensor maps
=============  ===================================================  ============================================

``tc_dkdv_atomic`` is the table of the dK/dV kernel when it also adds dQ with atomics (``deterministic=False``).

Device limits (:class:`DeviceLimits`) come from the GPU (:func:`flashnumba.planner.current_device`), or from
:data:`ARCHS` to plan for a GPU one does not have. ``FLASHNUMBA_MAX_SHARED_BYTES`` caps the shared memory a block
may use (to try, on a large GPU, the plans of a smaller one).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import NamedTuple

from ._launch import STATIC_SHARED_LIMIT
from .kernels import (mma_backward, mma_forward, mma_tf32, mma_tf32_backward, simt_backward, simt_forward,
                      wgmma_backward, wgmma_forward)

MAX_REGISTERS_PER_THREAD = 255
MMA_HEAD_DIMS = mma_forward.HEAD_DIMS  # the head dims the tensor-core forward is built for (kernel="tc")
MMA_BACKWARD_HEAD_DIMS = mma_backward.BACKWARD_HEAD_DIMS  # and the backward
# kernel=None takes the tensor cores at every head dim they are built for, each run on the H200 by
# tests/test_tc.py::test_tc_every_head_dim_gpu (the multiples of 8 that are not of 16 padded in shared memory)
MMA_DEFAULT_HEAD_DIMS = MMA_HEAD_DIMS
# On compute capability 9.0, kernel=None takes the Hopper kernels (kernel="wgmma") at the head dims where they are
# the faster (docs/benchmarks.md, "How fast is the Hopper forward?" and "... backward?"): every multiple of 32 up to
# 256, both passes
WGMMA_DEFAULT_HEAD_DIMS = {"forward": (32, 64, 96, 128, 160, 192, 224, 256),
                           "backward": (32, 64, 96, 128, 160, 192, 224, 256)}
# With a user's mask_mod and block mask, or a score_mod (flex_attention), the head dims where kernel=None takes the
# Hopper kernels: those where they ran faster than the mma.sync kernels beside FlexAttention (docs/benchmarks.md,
# "How fast is your own attention variant?"); elsewhere the mma.sync kernels
WGMMA_MODS_DEFAULT_HEAD_DIMS = {"forward": (64, 128), "backward": (64, 128)}
# The head dims, multiples of 8 that are not of 32, where kernel=None takes the Hopper kernels with q, k, v copied
# with zero columns appended up to the next multiple of 32 (planner.padded_head_dim) rather than the mma.sync kernels
# at the head dim itself (docs/benchmarks.md, "How fast are the head dims that are not multiples of 32?"): measured
# at 40, 72, 80, 104, 136 and 200 on an H100, both passes, 0.97-3.1x the mma.sync kernels (below 1.0 only the
# forward at 40, causal, seqlen 4096); taken from 40 on, where the padding adds at most the columns it adds at 40
# (60%); below 32 (8, 16, 24) the padding would double the work or more
WGMMA_PADDED_DEFAULT_HEAD_DIMS = {p: tuple(d for d in range(40, 256, 8) if d % 32) for p in ("forward", "backward")}
# ... for calls of at least this many keys (sequences of equal length): the copies cost in proportion to the keys
# and the attention to their square, and the measurements were at 4096 (where the causal forward broke even at 40
# and 80) and 16384; shorter calls and packed sequences keep mma.sync
WGMMA_PADDED_MIN_SEQLEN_K = 4096
# the head dims where the Hopper forward is the faster only with its tensor-map copies (the per-thread copies of
# three 32-column blocks a row ran at 0.70x the mma.sync kernel there): kernel=None keeps mma.sync where a call's
# plan would not take them (packed sequences, more than two options compiled in, config.hopper_tma off)
WGMMA_FORWARD_NEEDS_TMA = (96,)


# ---------------------------------------------------------------------------------------------------------------
# devices
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DeviceLimits:
    """What a plan needs to know of a GPU. ``max_shared_per_block``: the dynamic shared memory a block may opt
    in to; ``shared_per_sm``, ``registers_per_sm``, ``threads_per_sm``, ``blocks_per_sm``: occupancy limits."""

    name: str
    cc: tuple
    max_shared_per_block: int
    shared_per_sm: int
    registers_per_sm: int = 65536
    threads_per_sm: int = 2048
    blocks_per_sm: int = 32
    sm_count: int | None = None

    @property
    def arch(self) -> str:
        return f"sm_{self.cc[0]}{self.cc[1]}"


# The architectures flashnumba plans for, with the limits of the CUDA programming guide's table of compute
# capabilities (shared memory per block with opt-in, per SM, threads and blocks per SM).
ARCHS = {
    "sm_75": DeviceLimits("sm_75 (T4, RTX 20)", (7, 5), 64 * 1024, 64 * 1024, threads_per_sm=1024, blocks_per_sm=16),
    "sm_80": DeviceLimits("sm_80 (A100, A30)", (8, 0), 163 * 1024, 164 * 1024),
    "sm_86": DeviceLimits("sm_86 (RTX 30, A10, A40)", (8, 6), 99 * 1024, 100 * 1024, threads_per_sm=1536,
                          blocks_per_sm=16),
    "sm_89": DeviceLimits("sm_89 (RTX 40, L4, L40)", (8, 9), 99 * 1024, 100 * 1024, threads_per_sm=1536,
                          blocks_per_sm=24),
    "sm_90": DeviceLimits("sm_90 (H100, H200)", (9, 0), 227 * 1024, 228 * 1024),
}
MMA_MIN_CC = (8, 0)  # mma.sync m16n8k16 for float16 / bfloat16 / tf32 and cp.async


def shared_cap() -> int | None:
    """``FLASHNUMBA_MAX_SHARED_BYTES`` as an int, or None where it is not set."""
    raw = os.environ.get("FLASHNUMBA_MAX_SHARED_BYTES", "").strip()
    if not raw:
        return None
    try:
        cap = int(raw)
    except ValueError:
        raise ValueError(f"FLASHNUMBA_MAX_SHARED_BYTES must be a number of bytes, got {raw!r}") from None
    if cap < STATIC_SHARED_LIMIT:
        raise ValueError(f"FLASHNUMBA_MAX_SHARED_BYTES must be at least {STATIC_SHARED_LIMIT}, got {cap}")
    return cap


def capped(limits: DeviceLimits) -> DeviceLimits:
    """``limits`` with the shared memory per block capped by ``FLASHNUMBA_MAX_SHARED_BYTES`` where it is set."""
    cap = shared_cap()
    if cap is None or cap >= limits.max_shared_per_block:
        return limits
    return replace(limits, name=f"{limits.name}, shared memory capped at {cap} bytes", max_shared_per_block=cap)


def device_limits(arch) -> DeviceLimits:
    """A :class:`DeviceLimits` from an arch name ("sm_80"), a compute capability ((8, 0)) or itself."""
    if isinstance(arch, DeviceLimits):
        return arch
    if isinstance(arch, tuple):
        arch = f"sm_{arch[0]}{arch[1]}"
    try:
        return ARCHS[arch]
    except KeyError:
        raise ValueError(f"unknown architecture {arch!r}; known: {', '.join(ARCHS)}") from None


# ---------------------------------------------------------------------------------------------------------------
# tiles and the tables
# ---------------------------------------------------------------------------------------------------------------


class Tiles(NamedTuple):
    """B_r query rows, B_c key rows, threads per block."""

    block_m: int
    block_n: int
    num_threads: int


@dataclass(frozen=True)
class Candidate:
    """A table row: the tiles, the head dims it is for (``max_head_dim``: up to and including; above
    ``min_head_dim``), why, and the oldest compute capability it is chosen on (``min_cc``: tiles measured fastest on
    one generation only)."""

    max_head_dim: int
    tiles: Tiles
    reason: str
    min_cc: tuple = (0, 0)
    min_head_dim: int = 0

    def applies(self, D: int, limits: DeviceLimits) -> bool:
        """Whether the row is for head dim D on the device's generation (its shared memory aside)."""
        return self.min_head_dim < D <= self.max_head_dim and tuple(limits.cc) >= self.min_cc


def _tc_threads(rows):
    return 32 * (rows // mma_forward.WARP_ROWS)


TABLES = {
    "v1": [
        Candidate(128, Tiles(64, 32, 64), "a thread per query row, K_j and V_j of 32 rows in static shared memory"),
        Candidate(256, Tiles(64, 16, 64), "B_c 16 keeps K_j and V_j within the 48 KB of static shared memory"),
        Candidate(256, Tiles(32, 8, 32), "the smallest tiles: B_c 8 rows of K_j and V_j"),
    ],
    "v2": [  # v2 and v3 share their tiles: v3 changes only the index arithmetic
        Candidate(64, Tiles(128, 64, 128), "the fastest of the H200 sweep at d <= 64 (notebook 02)"),
        Candidate(128, Tiles(64, 32, 128), "the fastest of the H200 sweep at 64 < d <= 128 (notebook 02)"),
        Candidate(128, Tiles(64, 16, 128), "B_c 16: fits 64 KB at d <= 128"),
        Candidate(256, Tiles(32, 32, 128), "the fastest of the H200 sweep at 128 < d <= 256 (notebook 02)"),
        Candidate(256, Tiles(32, 16, 64), "fits 99 KB at d <= 256"),
        Candidate(256, Tiles(16, 16, 64), "fits 64 KB at d <= 256"),
    ],
    "bwd_v1": [
        Candidate(64, Tiles(64, 64, 64), "a thread per row; Q_i, dO_i of 64 rows in static shared memory"),
        Candidate(128, Tiles(32, 32, 32), "32 rows keep Q_i and dO_i within 48 KB of static shared memory"),
        Candidate(256, Tiles(16, 16, 16), "16 rows keep Q_i and dO_i within 48 KB of static shared memory"),
    ],
    "bwd_v2": [
        Candidate(64, Tiles(64, 128, 256), "the fastest of the H200 sweep at d <= 64 (notebook 02)"),
        Candidate(128, Tiles(64, 64, 256), "the fastest of the H200 sweep at 64 < d <= 128 (notebook 02)"),
        Candidate(128, Tiles(32, 64, 256), "half the query rows: fits 163 KB at d <= 128, 99 KB at d <= 64"),
        Candidate(128, Tiles(16, 32, 128), "fits 99 KB at d <= 128, 64 KB at d <= 64"),
        Candidate(128, Tiles(16, 16, 128), "fits 64 KB at d <= 128"),
        Candidate(256, Tiles(16, 32, 128), "the fastest of the H200 sweep at 128 < d <= 256 (notebook 02)"),
        Candidate(256, Tiles(8, 16, 64), "fits 99 KB at d <= 256"),
        Candidate(256, Tiles(8, 8, 64), "fits 64 KB at d <= 256"),
    ],
    "tc": [
        Candidate(64, Tiles(128, 64, 128), "fastest of the H200 sweep at d = 64: 4 warps of 32 rows, B_c 64 (with "
                                           "window, softcap, ALiBi or dropout: 8 warps of 16, plain_rows_per_warp)"),
        Candidate(64, Tiles(128, 32, _tc_threads(128)), "8 warps, B_c 32: fits 64 KB"),
        Candidate(96, Tiles(128, 32, _tc_threads(64)), "fastest of the H200 sweep at d = 96: 4 warps of 32 rows, "
                  "B_c 32 (1.4x (128, 128); with window, softcap, ALiBi or dropout: 8 warps of 16, "
                  "plain_rows_per_warp)"),
        Candidate(128, Tiles(128, 128, _tc_threads(128)), "fastest of the H200 sweep at d = 128: 8 warps, B_c 128 "
                  "(K_j and V_j of 128 keys: 170 KB of shared memory, Hopper's; with per-score options B_c 64, "
                  "plain_rows_per_warp)", min_cc=(9, 0)),
        Candidate(128, Tiles(128, 64, _tc_threads(128)), "8 warps, B_c 64: fits 163 KB at d = 128 (A100)"),
        Candidate(128, Tiles(128, 32, _tc_threads(128)), "B_c 32: fits 99 KB at d = 128 (RTX 30/40, A10, L4)"),
        Candidate(128, Tiles(64, 32, _tc_threads(64)), "4 warps: fits 64 KB"),
        Candidate(192, Tiles(128, 64, _tc_threads(128)), "8 warps, B_c 64: S and O within 255 registers at d <= 192"),
        Candidate(192, Tiles(64, 32, _tc_threads(64)), "4 warps, B_c 32: fits 99 KB at d <= 192"),
        Candidate(192, Tiles(32, 32, _tc_threads(32)), "2 warps: fits 64 KB at d <= 192"),
        Candidate(256, Tiles(64, 32, _tc_threads(64)), "4 warps, B_c 32: O of d = 256 leaves registers for 32 keys"),
        Candidate(256, Tiles(64, 16, _tc_threads(64)), "B_c 16: fits 99 KB at d = 256"),
        Candidate(256, Tiles(32, 16, _tc_threads(32)), "2 warps, B_c 16: fits 64 KB at d = 256"),
    ],
    "tc_dq": [
        Candidate(64, Tiles(64, 64, _tc_threads(64)), "fastest of the H200 sweep at d = 64"),
        Candidate(128, Tiles(64, 32, _tc_threads(64)),
                  "fastest of the H200 sweep at d = 128: 4 warps on 32-row K_j, V_j tiles (2.5x (32, 64))"),
        Candidate(128, Tiles(32, 32, _tc_threads(32)), "2 warps: fits 64 KB"),
        Candidate(160, Tiles(64, 32, _tc_threads(64)), "4 warps on 32-row K_j, V_j tiles: fits 99 KB at d <= 160"),
        Candidate(160, Tiles(32, 16, _tc_threads(32)), "2 warps, 16-row K_j, V_j tiles: fits 64 KB"),
        Candidate(256, Tiles(64, 16, _tc_threads(64)), "fastest of the H200 sweep at d = 256: 4 warps on 16-row K_j, "
                  "V_j tiles (A fragments per k-step; 1.4x (64, 32)); fits 99 KB"),
        Candidate(256, Tiles(16, 16, _tc_threads(16)), "1 warp: fits 64 KB at d <= 256"),
    ],
    "tc_dkdv": [
        Candidate(64, Tiles(32, 64, _tc_threads(64)), "fastest of the H200 sweep at d = 64"),
        Candidate(128, Tiles(64, 128, _tc_threads(128)),
                  "fastest of the H200 sweep at d = 128: 8 warps on 128 key rows, 64-row Q_i tiles"),
        Candidate(128, Tiles(32, 64, _tc_threads(64)), "4 warps, 32-row Q_i tiles: fits 99 KB at d = 128"),
        Candidate(128, Tiles(32, 32, _tc_threads(32)), "2 warps: fits 64 KB"),
        Candidate(160, Tiles(16, 64, _tc_threads(64)), "16-row Q_i tiles: dK_j, dV_j of d = 160 within 255 registers"),
        Candidate(160, Tiles(16, 32, _tc_threads(32)), "2 warps: fits 64 KB at d <= 160"),
        Candidate(256, Tiles(32, 64, _tc_threads(64)), "64 key rows, two warps a 16 of them (each half of dK_j, "
                  "dV_j's columns), 32-row Q_i tiles"),
        Candidate(256, Tiles(16, 64, _tc_threads(64)), "16-row Q_i tiles: fits 99 KB at d <= 256"),
        Candidate(256, Tiles(16, 16, _tc_threads(16)), "16 key rows: fits 64 KB at d <= 256"),
    ],
    # the dK/dV kernel that also adds dQ with atomics (deterministic=False): dS^T in shared memory besides, and
    # dK_j, dV_j still in registers during the dQ product: 32-row Q_i tiles keep d = 128 within 255 registers
    "tc_dkdv_atomic": [
        Candidate(64, Tiles(64, 128, _tc_threads(128)), "fastest of the H200 sweep at d = 64: 8 warps on 128 key "
                  "rows, 64-row Q_i tiles (fewer atomic adds a key than 64-key blocks)"),
        Candidate(128, Tiles(32, 128, _tc_threads(128)), "fastest of the H200 sweep at d = 128: 8 warps on 128 key "
                  "rows, 32-row Q_i tiles (dK_j, dV_j and dQ's part within 255 registers; 64-row tiles spill)"),
        Candidate(128, Tiles(32, 64, _tc_threads(64)), "4 warps, 32-row Q_i tiles: fits 99 KB at d = 128"),
        Candidate(128, Tiles(32, 32, _tc_threads(32)), "2 warps: fits 64 KB"),
        Candidate(160, Tiles(16, 64, _tc_threads(64)), "16-row Q_i tiles: dK_j, dV_j of d = 160 within 255 registers"),
        Candidate(160, Tiles(16, 32, _tc_threads(32)), "2 warps: fits 64 KB at d <= 160"),
        Candidate(256, Tiles(16, 64, _tc_threads(64)), "64 key rows, two warps a 16 of them, 16-row Q_i tiles"),
        Candidate(256, Tiles(16, 16, _tc_threads(16)), "16 key rows: fits 64 KB at d <= 256"),
    ],
    "tf32": [
        Candidate(64, Tiles(64, 64, _tc_threads(64)), "4 warps, B_c 64 at d = 64"),
        Candidate(128, Tiles(128, 16, _tc_threads(128)), "fastest of the H200 sweep at d = 128: 8 warps, B_c 16"),
        Candidate(128, Tiles(64, 16, _tc_threads(64)), "4 warps: fits 99 KB at d = 128, 64 KB at d = 64"),
        Candidate(128, Tiles(32, 16, _tc_threads(32)), "2 warps: fits 64 KB at d = 128"),
    ],
    "3xtf32": [
        Candidate(64, Tiles(64, 64, _tc_threads(64)), "4 warps, B_c 64 at d = 64"),
        Candidate(128, Tiles(128, 32, _tc_threads(128)), "fastest of the H200 sweep at d = 128: 8 warps, B_c 32"),
        Candidate(128, Tiles(64, 16, _tc_threads(64)), "4 warps: fits 99 KB at d = 128, 64 KB at d = 64"),
        Candidate(128, Tiles(32, 16, _tc_threads(32)), "2 warps: fits 64 KB at d = 128"),
    ],
    # the TF32 and 3xTF32 backward (block_m query rows, block_n keys): dQ's and dK/dV's, each float32 rows of
    # D + 4 for Q_i, dO_i and two K_j, V_j buffers (dQ), or K_j, V_j and two Q_i, dO_i buffers (dK/dV)
    "tf32_dq": [
        Candidate(128, Tiles(64, 32, _tc_threads(64)), "4 warps of 16 query rows, 32-key tiles: 135 KB at d = 128"),
        Candidate(128, Tiles(32, 16, _tc_threads(32)), "2 warps, 16-key tiles: fits 99 KB at d = 128"),
        Candidate(128, Tiles(16, 16, _tc_threads(16)), "1 warp: fits 64 KB at d = 128"),
    ],
    "tf32_dkdv": [
        Candidate(128, Tiles(32, 64, _tc_threads(64)), "4 warps of 16 keys, 32-query tiles: 135 KB at d = 128"),
        Candidate(128, Tiles(16, 32, _tc_threads(32)), "2 warps, 16-query tiles: fits 99 KB at d = 128"),
        Candidate(128, Tiles(16, 16, _tc_threads(16)), "1 warp: fits 64 KB at d = 128"),
    ],
    # Hopper's warpgroup MMA (sm_90a only)
    "wgmma": [
        Candidate(64, Tiles(128, 128, 384), "fastest of the H200 tile runs at d = 64: two warpgroups of 64 query "
                  "rows sharing each K_j, V_j of 128 keys, copied by a producer warpgroup whose registers the two take "
                  "(1.08-1.11x B_c 64)", min_cc=(9, 0)),
        Candidate(128, Tiles(128, 128, 384), "two warpgroups of 64 query rows sharing each K_j, V_j of 128 keys, "
                  f"copied by a producer warpgroup whose registers the two take (setmaxnreg: "
                  f"{wgmma_forward.CONSUMER_REGISTERS} a thread)",
                  min_cc=(9, 0)),
        Candidate(128, Tiles(128, 64, 384), "B_c 64 with the producer warpgroup (1.2x the same tiles without it)",
                  min_cc=(9, 0)),
        Candidate(128, Tiles(128, 64, 256), "two warpgroups, B_c 64, no producer: every warp copies",
                  min_cc=(9, 0)),
        Candidate(128, Tiles(128, 128, 256), "two warpgroups, B_c 128", min_cc=(9, 0)),
        Candidate(128, Tiles(64, 64, 128), "one warpgroup, B_c 64", min_cc=(9, 0)),
        Candidate(224, Tiles(128, 64, 384), "two warpgroups sharing each K_j, V_j of 64 keys (three stages beside "
                  "Q_i: 225 KB at d = 224, within the 227 KB a block may use), copied by a producer warpgroup; "
                  "S of 64 keys beside O within the "
                  f"{wgmma_forward.CONSUMER_REGISTERS} registers a thread", min_cc=(9, 0), min_head_dim=128),
        Candidate(256, Tiles(128, 48, 384), "two warpgroups sharing each K_j, V_j of 48 keys (three stages of 64 "
                  "keys beside Q_i would take 256 KB at d = 256; of 48, 208 KB), copied by a producer warpgroup "
                  "(1.4x key tiles of 32)", min_cc=(9, 0), min_head_dim=128),
        Candidate(256, Tiles(128, 32, 384), "two warpgroups sharing each K_j, V_j of 32 keys, copied by a producer "
                  "warpgroup", min_cc=(9, 0), min_head_dim=128),
        Candidate(256, Tiles(64, 32, 128), "one warpgroup, B_c 32", min_cc=(9, 0), min_head_dim=128),
    ],
    # the Hopper backward (block_m query rows, block_n keys): dQ with a warpgroup per 64 query rows, dK/dV with one
    # per 64 keys
    "wgmma_dq": [
        Candidate(128, Tiles(128, 64, 256), "two warpgroups of 64 query rows sharing each K_j, V_j of 64 keys "
                  "(S, dP and dQ_i within 201 registers at d = 128, no spills)", min_cc=(9, 0)),
        Candidate(128, Tiles(64, 64, 128), "one warpgroup", min_cc=(9, 0)),
        Candidate(160, Tiles(128, 64, 256), "two warpgroups sharing each K_j, V_j of 64 keys (three stages beside "
                  "Q_i, dO_i: 200 KB at d = 160)", min_cc=(9, 0), min_head_dim=128),
        Candidate(256, Tiles(128, 48, 256), "two warpgroups sharing each K_j, V_j of 48 keys in two buffers "
                  "(three would take 272 KB at d = 256), copied by the producer's tensor maps (1.10-1.12x key "
                  "tiles of 32)", min_cc=(9, 0), min_head_dim=224),
        Candidate(256, Tiles(128, 32, 256), "two warpgroups sharing each K_j, V_j of 32 keys (three stages of 64 "
                  "keys beside Q_i, dO_i would take 240 KB at d = 192; dQ_i of d = 256 is 128 registers a thread)",
                  min_cc=(9, 0), min_head_dim=128),
        Candidate(256, Tiles(64, 32, 128), "one warpgroup, key tiles of 32", min_cc=(9, 0), min_head_dim=128),
    ],
    "wgmma_dkdv": [
        Candidate(128, Tiles(64, 128, 256), "two warpgroups of 64 keys sharing each Q_i, dO_i of 64 queries "
                  "(dK_j, dV_j, S^T and dP^T within 255 registers at d = 128, no spills)", min_cc=(9, 0)),
        Candidate(128, Tiles(64, 64, 128), "one warpgroup", min_cc=(9, 0)),
        Candidate(256, Tiles(32, 64, 256), "two warpgroups on 64 keys, each holding half of dK_j's and dV_j's head "
                  "dims (all of them would not fit a thread's registers beside S^T and dP^T), query tiles of 32",
                  min_cc=(9, 0), min_head_dim=128),
    ],
}
TABLES["v3"] = TABLES["v2"]

# The default tiles of the SIMT families when the simulator runs the kernels (the planner's ``simulated``): each
# simulated thread is a Python thread that works through its whole share of a tile, padding included, so the GPU's
# tiles (up to 128 x 64 with 128 or 256 threads) cost the small shapes the simulator runs 8 to 30 times the
# simulated work of one warp on 16 x 16. The kernels take any valid tiles; tests that name the GPU's tiles run them
# in the simulator too.
SIMULATED = {"v2": Tiles(16, 16, 32), "v3": Tiles(16, 16, 32), "bwd_v2": Tiles(16, 16, 32), "v1": Tiles(16, 16, 16),
             "bwd_v1": Tiles(16, 16, 16)}

FORWARD_FAMILIES = ("v1", "v2", "v3", "tc", "tf32", "3xtf32", "wgmma")
BACKWARD_FAMILIES = ("v1", "v2", "tc", "tf32", "3xtf32", "wgmma")
BACKWARD_TABLES = {"v1": ("bwd_v1",), "v2": ("bwd_v2",), "tc": ("tc_dq", "tc_dkdv"),
                   "tf32": ("tf32_dq", "tf32_dkdv"), "3xtf32": ("tf32_dq", "tf32_dkdv"),
                   "wgmma": ("wgmma_dq", "wgmma_dkdv")}


# ---------------------------------------------------------------------------------------------------------------
# what a configuration costs: shared memory, and the family's own rules
# ---------------------------------------------------------------------------------------------------------------


def wgmma_rebalances(t: Tiles) -> bool:
    """Whether the Hopper forward at tiles ``t`` moves its producer's registers to the warpgroups that compute
    (:func:`flashnumba.kernels.wgmma_forward.rebalances`), and so is assembled as the whole program."""
    return wgmma_forward.rebalances(t.block_m // 64, wgmma_forward.producer_warps(t.block_m, t.num_threads) or 0)


def wgmma_for_variant(t: Tiles, variant, given=(), D=None) -> tuple[Tiles, str]:
    """The Hopper forward's default tiles for ``variant``, and why they differ from ``t`` ("" where not);
    ``given``: the names among "block_n" and "num_threads" that the caller chose (kept as they are).

    A block of 384 threads (the producer's warpgroup and the two that compute: three warps on each of the SM's
    four schedulers, which share its 64K registers) starts a thread at 168 registers; the producer gives most of
    its own to the two warpgroups (``wgmma_forward.rebalances``: 224 each). With more than two of the variant's
    options (the window's left and right bounds counted apart, softcap, ALiBi, varlen, dropout) some variants
    still spill (both window bounds with dropout; all six): those run without a producer, at B_c 64 (without a
    producer the faster). With at most two, every variant but varlen with dropout (B_c 64) fits 128 keys' scores
    beside O at d = 64, 96 and 128, and every variant 64 keys' beside O at d = 160 to 224 and 48 keys' at 256 (the
    table's tiles there; ``scripts/wgmma_spills.py``), where packed sequences with dropout, more than two options
    and the options' per-score work without the rebalancing take 32 keys. Without the rebalancing (a caller's 256 or 288
    threads), a tile of 128 keys fits only with no softcap or ALiBi and at most one of a window bound and dropout;
    other variants take B_c 64 there. Three warpgroups (block_m 192): :func:`_wgmma_three_for_variant` (``D``: the
    head dim)."""
    has_left, has_right, softcap, alibi, varlen, dropout = variant
    if t.block_m == 192:
        return _wgmma_three_for_variant(t, variant, given, D)
    many = sum(bool(x) for x in variant) > 2
    per_score = softcap or alibi or int(has_left) + int(has_right) + int(dropout) > 1
    new = t
    if "num_threads" not in given and many:
        new = new._replace(num_threads=2 * t.block_m)
    rebalanced = wgmma_rebalances(new)
    heavy = (varlen and dropout) if rebalanced else per_score
    if "block_n" not in given and (t.block_n > 64 or t.block_n == 48) and (many or heavy):
        new = new._replace(block_n=64 if t.block_n > 64 else 32)
    why = []
    if new.num_threads != t.num_threads:
        why.append("without the producer: more than two options compiled in")
    if new.block_n != t.block_n:
        keys = "128 keys'" if t.block_n > 64 else "48 keys' (beside O of d = 256)"
        why.append(f"B_c {new.block_n}: " + ("more than two options compiled in" if many else
                                             f"packed sequences with dropout need the registers of {keys} scores"
                                             if rebalanced else
                                             f"the options' per-score work needs the registers of {keys} scores"))
    return new, "; ".join(why)


def _wgmma_three_for_variant(t: Tiles, variant, given, D) -> tuple[Tiles, str]:
    """:func:`wgmma_for_variant` for three warpgroups (block_m 192, always with the producer warpgroup: 160
    registers a thread that computes): 128 keys' scores fit beside O at head_dim 64 and below with no per-score
    option, a window's bounds aside; softcap, ALiBi or dropout (76-196 bytes spilled compiled for sm_90a) and larger
    head dims (144 at 96) take B_c 64; more than two options (the window's bounds counted apart; packed sequences
    are refused at these tiles) B_c 32: every option but varlen, and a right bound with softcap and dropout, beside
    64 keys' scores spilled 8 bytes with the masked tiles' column bounds (some others of three or four options did
    not: the rule is the safe side)."""
    _, _, softcap, alibi, _, dropout = variant
    if "block_n" in given:
        return t, ""
    if sum(bool(x) for k, x in enumerate(variant) if k != 4) > 2 and t.block_n > 32:  # (4: varlen)
        return t._replace(block_n=32), ("B_c 32: with three warpgroups, more than two options' per-score work beside "
                                        "64 keys' scores needs more than their 160 registers")
    if t.block_n <= 64 or not (softcap or alibi or dropout or (D or 0) > 64):
        return t, ""
    return t._replace(block_n=64), ("B_c 64: with three warpgroups, " + (
        "the options' per-score work" if softcap or alibi or dropout else f"O of {D} head dims")
        + " beside 128 keys' scores needs more than their 160 registers")


def wgmma_for_mods(t: Tiles, D, blocks, score_mod=False, given=(), keep=False) -> tuple[Tiles, str]:
    """The Hopper forward's tiles with a user's functions (``score_mod``: whether there is a score_mod) and a block
    mask of ``blocks`` (query block, key block; None: none), and why they differ from ``t`` ("" where not);
    ``given``: the names the caller chose (kept); ``keep``: the table's key tiles beside the score_mod (a light
    function fits them: tried first on a GPU, :func:`flashnumba.api._flex_compiled`). A tile never straddles two
    blocks: one warpgroup (block_m 64, every thread computing) where the query blocks are a multiple of 64 but not
    of the table's rows, and key tiles that divide the key blocks (the largest of the table's tile and the smaller
    ones that does). A score_mod's per-score work takes key tiles of 64 (compiled for sm_90a, the relative-bias
    example beside 128 keys' scores spilled 180 bytes; at 64, none), and of 32 above head_dim 128 (that example with
    documents and a block mask at d = 192 spilled 240 bytes beside 64 keys' scores). A mask_mod alone keeps the
    table's tiles: the kernel evaluates it before S_ij is issued, into one bit a score
    (``wgmma_forward.make_forward_wgmma``'s ``mask_tile``; the causal, window, prefix-LM and documents masks with a
    block mask spill nothing at d = 128 with 128 keys a tile, nor at d = 160 to 224 with 64)."""
    new, why = t, []
    if (blocks is not None and blocks[0] % t.block_m and blocks[0] % 64 == 0
            and not {"block_m", "num_threads"} & set(given)):
        new = new._replace(block_m=64, num_threads=wgmma_forward.threads(1))
        why.append(f"one warpgroup (block_m 64): to divide the block mask's query blocks of {blocks[0]}")
    if "block_n" not in given and score_mod and new.block_n > (32 if D > 128 else 64):
        if keep:
            why.append(f"B_c {new.block_n} beside a user's score_mod (tried first: where its kernel spills, planned "
                       "again with the smaller tiles)")
        else:
            new = new._replace(block_n=32 if D > 128 else 64)
            why.append(f"B_c {new.block_n}: a user's score_mod beside "
                       + ("O above head_dim 128 spills" if D > 128 else "128 keys' scores spills"))
    if "block_n" not in given and blocks is not None and blocks[1] % new.block_n:
        fits = [n for n in wgmma_forward.BLOCK_NS if n < new.block_n and blocks[1] % n == 0]
        if fits:
            new = new._replace(block_n=max(fits))
            why.append(f"B_c {new.block_n}: to divide the block mask's key blocks of {blocks[1]}")
    return new, "; ".join(why)


def _per_entry_options(variant) -> int:
    """The options of a variant that add work at every entry: the window's two bounds counted apart, softcap,
    ALiBi, dropout (varlen adds none)."""
    has_left, has_right, softcap, alibi, _, dropout = variant
    return sum(bool(x) for x in (has_left, has_right, softcap, alibi, dropout))


def wgmma_dkdv_for_variant(t: Tiles, variant, D, given=(), tma=False) -> tuple[Tiles, str]:
    """The Hopper dK/dV kernel's tiles for ``variant`` at head dim D, and why they differ from ``t`` ("" where not);
    ``given``: the names the caller chose (kept); ``tma``: whether query tiles of 32 let a producer warpgroup copy
    with tensor maps where ``t``'s tiles do not (``wgmma_backward.takes_tma``). A thread holds dK_j and dV_j of its
    keys (two D / 2 float32) beside S^T and dP^T of 64 queries: above d = 64, ALiBi's or dropout's per-entry work
    then spills (compiled for sm_90a), and so do more than two per-entry options at any head dim; those variants
    take query tiles of 32.
    Above d = 96 a producer warpgroup leaves the two that compute too few registers for query tiles of 64
    (``wgmma_backward.CONSUMER_REGISTERS``): where the tensor maps can copy, query tiles of 32 with the producer are
    faster than tiles of 64 with every thread copying (docs/benchmarks.md, "How fast is the Hopper backward?")."""
    _, _, _, alibi, _, dropout = variant
    heavy = (D > 64 and (alibi or dropout)) or _per_entry_options(variant) > 2
    if "block_m" in given or not (heavy or tma) or t.block_m <= 32:
        return t, ""
    return t._replace(block_m=32), ("query tiles of 32: " + ("more than two per-entry options"
                                                              if _per_entry_options(variant) > 2 else
                                                              "ALiBi's or dropout's per-entry work beside dK_j, dV_j "
                                                              "of d > 64" if heavy else
                                                              "room for the producer warpgroup's tensor-map copies "
                                                              "beside dK_j, dV_j"))


def wgmma_dq_for_variant(t: Tiles, variant, given=(), D=None, tma=False, block_masked=False) -> tuple[Tiles, str]:
    """The Hopper dQ kernel's tiles for ``variant``: with more than two per-entry options the loop over a tile's
    64 keys is too long for the compiler to unroll, S and dP then go to local memory and the assembler serialises
    the wgmma (compiled for sm_90a); those variants take key tiles of 32. At head dim D = 64 with the tensor-map
    copies (``tma``) and a causal-like right bound alone, tiles of 128 keys halve the tiles of the rows' short
    loops (S, dP, dQ_i and dS packed within the producer's rebalanced registers; without the producer, in 255
    registers a thread, they spill). So does a user's mask_mod with a block mask and no other per-entry work
    (``block_masked``: the mask evaluated in the partial blocks only, as the right bound in the diagonal's tiles;
    1.13x key tiles of 64 for the causal mask_mod, docs/benchmarks.md). The tiles of 48 keys of head dim 256 fit
    the shared memory only in the two buffers of the tensor-map copies and were measured (and compiled without
    spills) with window bounds alone: the others take 32."""
    if "block_n" in given:
        return t, ""
    _, _, softcap, alibi, _, dropout = variant
    if t.block_n == 48 and (not tma or softcap or alibi or dropout):
        return t._replace(block_n=32), ("key tiles of 32: tiles of 48 take the copy engine's two buffers and "
                                        "window bounds alone")
    if _per_entry_options(variant) > 2 and t.block_n > 32:
        return t._replace(block_n=32), "key tiles of 32: more than two per-entry options"
    has_right = variant[1]
    if tma and D == 64 and t.block_n < 128 and (
            (has_right and _per_entry_options(variant) == 1) or (block_masked and not _per_entry_options(variant))):
        alone = "a block-masked mask_mod alone" if block_masked else "a right bound alone"
        return t._replace(block_n=128), f"key tiles of 128: {alone} at d = 64 (fewer, longer tiles)"
    return t, ""


def wgmma_backward_for_mods(tq: Tiles, tk: Tiles, score_mod, given=(), keep=()) -> tuple[Tiles, Tiles, str, str]:
    """The Hopper backward's tiles (dQ, dK/dV) with a user's score_mod (``score_mod``: whether there is one), and
    why each differs ("" where not); ``given``: the names the caller chose (kept); ``keep``: the tables of the
    kernels ("wgmma_dq", "wgmma_dkdv") that keep their tiles beside the score_mod (tried first on a GPU). The
    score_mod's work at each entry beside S and dP of 64 (compiled for sm_90a, the relative-bias example spilled
    40-68 bytes) takes tiles of 32 for the loop of each kernel: the dQ kernel's keys, the dK/dV kernel's queries."""
    out = []
    for table, t, name, loop in (("wgmma_dq", tq, "block_n", "key"), ("wgmma_dkdv", tk, "block_m", "query")):
        if not score_mod or name in given or getattr(t, name) <= 32:
            out.append((t, ""))
        elif table in keep:
            out.append((t, f"{loop} tiles of {getattr(t, name)} beside a user's score_mod (tried first: where the "
                           "kernel spills, planned again with tiles of 32)"))
        else:
            out.append((t._replace(**{name: 32}), f"{loop} tiles of 32: a user's score_mod beside S and dP of 64 "
                                                   "spills"))
    (nq, why_q), (nk, why_k) = out
    return nq, nk, why_q, why_k


def _powers_of_two(sizes):
    """The powers of two among tile sizes: a block mask's tiles are chosen among them (tiles of 48, for head_dim
    256's pipeline of two buffers, are taken only when asked for)."""
    return tuple(x for x in sizes if x & (x - 1) == 0)


def wgmma_backward_for_block_mask(tq: Tiles, tk: Tiles, blocks, D, given=()) -> tuple[Tiles, Tiles, str]:
    """The Hopper backward's tiles (dQ, dK/dV) at head dim D with a block mask of ``blocks`` (query block, key
    block; None: none), and why they differ ("" where not); ``given``: the names the caller chose (kept, and then
    checked by the kernels). A tile never straddles two blocks: each kernel's rows (a warpgroup per 64: the dQ
    kernel's queries, the dK/dV kernel's keys, above head_dim 128 two warpgroups on 64) and its loop's tiles (the dQ
    kernel's keys, the dK/dV kernel's queries) take the largest of their sizes not above the table's that divide the
    blocks."""
    if blocks is None:
        return tq, tk, ""
    qb, kb = blocks

    def fit(x, sizes, block):
        return max((s for s in sizes if s <= x and block % s == 0), default=x)

    rows = tuple(64 * w for w in wgmma_backward.WARPGROUPS)
    nq, nk = tq, tk
    if "block_m" not in given:
        m = fit(tq.block_m, rows, qb)
        nq = nq._replace(block_m=m, num_threads=wgmma_backward.threads(m // 64))
        nk = nk._replace(block_m=fit(tk.block_m, _powers_of_two(wgmma_backward.DKDV_BLOCK_MS), qb))
    if "block_n" not in given:
        n = fit(tk.block_n, rows, kb)
        nk = nk._replace(block_n=n, num_threads=wgmma_backward.threads(wgmma_backward.dkdv_warpgroups(D, n)))
        nq = nq._replace(block_n=fit(tq.block_n, _powers_of_two(wgmma_backward.DQ_BLOCK_NS), kb))
    if (nq, nk) == (tq, tk):
        return tq, tk, ""
    return nq, nk, f"tiles that divide the block mask's blocks ({qb}, {kb})"


def plain_rows_per_warp(t: Tiles, variant, user_every_score=False) -> Tiles:
    """The tensor-core forward's tiles for a variant: warps of two blocks of 16 rows (wm = 2) hold twice the
    accumulators, which leaves no registers for the window's, softcap's, ALiBi's or dropout's per-score work
    (compiled for sm_90 the kernel then keeps S and O in local memory); with any of those options, or a user's
    function at every score (``user_every_score``: a score_mod, or a mask_mod without a block mask), the same tile
    runs as warps of 16 rows (twice the threads). The same per-score work takes B_c to at most 64: its values need
    the registers that the scores of a 128-key tile hold (every option with GQA, or a user's score_mod, spill there
    at d = 128). A mask_mod with a block mask keeps the tiles: the kernel evaluates it in the partial blocks only,
    before S_ij exists, in the registers S_ij will take, into one bit a score (without a block mask, in every
    tile, the 16-row warps ran it faster: docs/benchmarks.md)."""
    has_left, _, softcap, alibi, _, dropout = variant
    per_score = has_left or softcap or alibi or dropout or user_every_score
    if per_score and t.block_n > 64:
        t = t._replace(block_n=64)
    if t.block_m == 16 * (t.num_threads // 32) or not per_score:
        return t
    return t._replace(num_threads=_tc_threads(t.block_m))


def shared_bytes(table: str, D: int, t: Tiles) -> tuple[int, bool]:
    """(shared bytes per block, whether they are static) of a family's kernel at tiles t and head dim D."""
    m, n = t.block_m, t.block_n
    if table == "v1":
        return simt_forward.shared_bytes_v1(D, m, n), True
    if table in ("v2", "v3"):
        return simt_forward.shared_bytes_v2(D, m, n), False
    if table == "bwd_v1_dq":
        return simt_backward.shared_bytes_dq_v1(D, m, n), True
    if table in ("bwd_v1", "bwd_v1_dkdv"):
        return simt_backward.shared_bytes_dkdv_v1(D, m, n), True
    if table == "bwd_v2_dq":
        return simt_backward.shared_bytes_dq_v2(D, m, n), False
    if table in ("bwd_v2", "bwd_v2_dkdv"):
        return simt_backward.shared_bytes_dkdv_v2(D, m, n), False
    if table == "tc":
        return mma_forward.shared_bytes(D, n, m), False
    if table == "tc_dq":
        return mma_backward.shared_bytes_dq(D, m, n), False
    if table in ("tc_dkdv", "tc_dkdv_atomic"):
        return mma_backward.shared_bytes_dkdv(D, m, n, table == "tc_dkdv_atomic"), False
    if table in ("tf32", "3xtf32"):
        return mma_tf32.shared_bytes(D, n, m // mma_tf32.WARP_ROWS), False
    if table == "tf32_dq":
        return mma_tf32_backward.shared_bytes_dq(D, m, n), False
    if table == "tf32_dkdv":
        return mma_tf32_backward.shared_bytes_dkdv(D, m, n), False
    if table == "wgmma":  # (with the room the tensor-map copies' alignment takes, whether they apply or not)
        return wgmma_forward.shared_bytes(D, n, m, tma=True), False
    if table in ("wgmma_dq", "wgmma_dkdv"):  # (as the forward's, with the tensor-map copies, and so the pipeline of
        # two buffers where three would not fit)
        return wgmma_backward.pipeline(table[len("wgmma_"):], D, m, n, True,
                                       ARCHS["sm_90"].max_shared_per_block)[1], False
    raise ValueError(f"unknown tile table {table!r}")


KERNEL_NAMES = {"bwd_v1_dq": "the backward dQ kernel v1", "bwd_v1_dkdv": "the backward dK/dV kernel v1",
                "bwd_v2_dq": "the backward dQ kernel v2", "bwd_v2_dkdv": "the backward dK/dV kernel v2",
                "tc_dq": "the tensor-core dQ kernel", "tc_dkdv": "the tensor-core dK/dV kernel",
                "tc_dkdv_atomic": "the tensor-core dK/dV kernel with the atomic dQ",
                "tc": "the tensor-core forward kernel", "v1": "the forward kernel v1", "v2": "the forward kernel v2",
                "v3": "the forward kernel v3", "tf32": "the TF32 forward kernel", "3xtf32": "the 3xTF32 forward kernel",
                "tf32_dq": "the TF32 dQ kernel", "tf32_dkdv": "the TF32 dK/dV kernel",
                "wgmma": "the Hopper (wgmma) forward kernel", "wgmma_dq": "the Hopper (wgmma) dQ kernel",
                "wgmma_dkdv": "the Hopper (wgmma) dK/dV kernel"}


def _parts(table):
    """The kernels a table's tiles are for: the v1 and v2 backward run a dQ and a dK/dV kernel on one tile."""
    return (f"{table}_dkdv", f"{table}_dq") if table in ("bwd_v1", "bwd_v2") else (table,)


def check(table: str, D: int, t: Tiles):
    """ValueError unless tiles t suit the family (divisibility, warps, head dims); shared memory is not
    checked here (see :func:`fits`)."""
    m, n, nt = t.block_m, t.block_n, t.num_threads
    if min(m, n, nt) < 1:
        raise ValueError(f"block_m, block_n and num_threads must be positive, got {m}, {n}, {nt}")
    if table in ("v2", "v3"):
        simt_forward.tiling_v2(D, m, n, nt)
    elif table == "bwd_v2":
        simt_backward.check_blocks_v2(D, m, n, nt)
    elif table in ("v1", "bwd_v1"):
        if nt > 1024 or max(m, n) > 1024:
            raise ValueError(f"kernel v1 runs a thread per row: at most 1024 rows a tile, got {m}, {n}")
    elif table == "tc":
        if D not in mma_forward.HEAD_DIMS:
            raise ValueError(f"the tensor-core forward supports head_dim a multiple of 8 up to 256, got {D}")
        warps, rows = nt // 32, m // max(nt // 32, 1)
        if nt % 32 or warps not in (1, 2, 4, 8) or rows not in mma_forward.ROWS_PER_WARP or rows * warps != m:
            raise ValueError(f"kernel 'tc' takes 1, 2, 4 or 8 warps (num_threads 32 each) of 16 or 32 query rows "
                             f"each: block_m 16 to 256, got block_m {m} with {nt} threads")
        if n <= 0 or n % 16:
            raise ValueError(f"kernel 'tc' takes block_n a positive multiple of 16, got {n}")
    elif table in ("tc_dq", "tc_dkdv", "tc_dkdv_atomic"):
        if D not in mma_backward.BACKWARD_HEAD_DIMS:
            raise ValueError(f"the tensor-core backward supports head_dim a multiple of 8 up to 256, got {D}")
        for name, value in (("block_m", m), ("block_n", n)):
            if value not in mma_backward.TILES:
                raise ValueError(f"the tensor-core backward takes {name} in {mma_backward.TILES}, got {value}")
    elif table in ("tf32_dq", "tf32_dkdv"):
        if D not in mma_tf32.HEAD_DIMS:
            raise ValueError(f"the TF32 backward supports head_dim in {mma_tf32.HEAD_DIMS}, got {D}")
        warp_tile, loop_tile = (m, n) if table == "tf32_dq" else (n, m)
        if warp_tile not in (16, 32, 64, 128) or loop_tile <= 0 or loop_tile % 8:
            raise ValueError(f"the TF32 backward takes 16, 32, 64 or 128 {'query' if table == 'tf32_dq' else 'key'} "
                             f"rows a block (16 a warp) and tiles of a positive multiple of 8 rows, got block_m {m}, "
                             f"block_n {n}")
    elif table == "wgmma":
        wgmma_forward.check(D, m, n, nt)
    elif table in ("wgmma_dq", "wgmma_dkdv"):
        wgmma_backward.check(D, m, n, table[6:])
    elif table in ("tf32", "3xtf32"):
        if D not in mma_tf32.HEAD_DIMS:
            raise ValueError(f"the TF32 kernel supports head_dim in {mma_tf32.HEAD_DIMS}, got {D}")
        if m not in (16, 32, 64, 128):
            raise ValueError(f"the TF32 kernel takes block_m in (16, 32, 64, 128) (16 query rows per warp), got {m}")
        if n <= 0 or n % 8:
            raise ValueError(f"the TF32 kernel takes block_n a positive multiple of 8, got {n}")


def fits(table: str, D: int, t: Tiles, limits: DeviceLimits) -> bool:
    """Whether every kernel of the family fits the device's shared memory per block at tiles t."""
    for part in _parts(table):
        nbytes, static = shared_bytes(part, D, t)
        if nbytes > (STATIC_SHARED_LIMIT if static else limits.max_shared_per_block):
            return False
    return True


def threads_of(table: str, t: Tiles, D: int = 0) -> Tiles:
    """t with the threads the family derives from its tiles filled in: v1 a thread per row; the ``mma.sync`` dQ
    and TF32 kernels a warp per 16 rows, tc_dkdv at head dim D a warp per 16 key rows and column part; ``tc`` as
    given; the Hopper kernels 128 per warpgroup, and the forward's producer warps where the threads given say so."""
    if table == "v1":
        return t._replace(num_threads=t.block_m)
    if table in ("tc_dq", "tf32", "3xtf32", "tf32_dq"):
        return t._replace(num_threads=_tc_threads(t.block_m))
    if table == "tf32_dkdv":
        return t._replace(num_threads=_tc_threads(t.block_n))
    if table == "wgmma":  # (the producer's warps where the threads given say so)
        return t._replace(num_threads=2 * t.block_m + 32 * (wgmma_forward.producer_warps(t.block_m, t.num_threads)
                                                            or 0))
    if table in ("tc_dkdv", "tc_dkdv_atomic"):
        return t._replace(num_threads=mma_backward.dkdv_threads(D, t.block_n))
    if table == "wgmma_dq":
        return t._replace(num_threads=2 * t.block_m)
    if table == "wgmma_dkdv":
        return t._replace(num_threads=128 * wgmma_backward.dkdv_warpgroups(D, t.block_n))
    return t


def default(table: str, D: int, limits: DeviceLimits) -> Candidate:
    """The first candidate of the family's table for head dim D that is valid and fits the device; where an
    earlier one did not fit, the reason says so."""
    passed = None
    for c in TABLES[table]:
        if not c.applies(D, limits):
            continue
        try:
            check(table, D, c.tiles)
        except ValueError:
            continue
        if fits(table, D, c.tiles, limits):
            if passed is None:
                return c
            t = passed.tiles
            need = max(shared_bytes(p, D, t)[0] for p in _parts(table))
            return replace(c, reason=f"{c.reason}; the first choice (B_r {t.block_m}, B_c {t.block_n}) needs {need} "
                                     f"bytes of shared memory, more than the {limits.max_shared_per_block} here")
        passed = passed or c
    raise ValueError(f"no tile configuration of kernel family {table!r} fits head_dim {D} on {limits.name} "
                     f"({limits.max_shared_per_block} bytes of shared memory per block)")


def largest_fitting(table: str, D: int, limits: DeviceLimits) -> str:
    """The table's candidates that fit the device at head dim D, for error messages."""
    ok = [c.tiles for c in TABLES[table] if c.applies(D, limits) and fits(table, D, c.tiles, limits)]
    return ", ".join(f"(block_m {t.block_m}, block_n {t.block_n})" for t in ok[:3]) or "none"


def resolve(table: str, D: int, limits: DeviceLimits, block_m=None, block_n=None, num_threads=None,
            simulated=False):
    """(Tiles, reason) for a family: the table's default where the caller gives nothing, else the caller's
    values (what is not given taken from the default) checked against the family's rules and the device.
    ``simulated``: the call runs in the simulator, whose default tiles for the SIMT families are
    :data:`SIMULATED` where they fit."""
    if block_m is None and block_n is None and num_threads is None:
        if simulated and table in SIMULATED and fits(table, D, SIMULATED[table], limits):
            t = SIMULATED[table]
            return t, f"the simulator's tiles: B_r {t.block_m}, B_c {t.block_n}, one warp (each simulated thread " \
                      f"is a Python thread)"
        c = default(table, D, limits)
        return threads_of(table, c.tiles, D), c.reason
    try:
        base = default(table, D, limits).tiles
    except ValueError:
        base = TABLES[table][0].tiles
    t = Tiles(base.block_m if block_m is None else block_m, base.block_n if block_n is None else block_n,
              base.num_threads if num_threads is None else num_threads)
    if table in ("tc_dq", "tc_dkdv", "tc_dkdv_atomic", "tf32", "3xtf32", "tf32_dq", "tf32_dkdv", "wgmma_dq",
                 "wgmma_dkdv") and num_threads is not None:
        raise ValueError(f"kernel {table.split('_')[0]!r} takes no num_threads: its threads follow from its tiles "
                         f"({'128 per 64' if table.startswith('wgmma') else '32 per 16'} rows)")
    if table == "wgmma":  # the default's producer warps, or those the caller gives (32 threads each)
        if num_threads is None:
            t = t._replace(num_threads=2 * t.block_m + 32 * wgmma_forward.producer_warps(base.block_m,
                                                                                         base.num_threads))
        else:
            check(table, D, t)
    if table == "tc" and num_threads is None:  # a warp per 16 rows unless the caller says otherwise
        t = t._replace(num_threads=_tc_threads(t.block_m))
    t = threads_of(table, t, D)
    check(table, D, t)
    reason = "given by the caller"
    if block_n is None and not fits(table, D, t, limits):  # the caller's rows with fewer keys a tile, where they fit
        smaller = _fewer_keys(table, D, t, limits)
        if smaller is not None:
            reason += f"; B_c {smaller.block_n}: the table's {t.block_n} keys beside {t.block_m} rows need more " \
                      f"shared memory than the {limits.max_shared_per_block} bytes {limits.name} allows"
            t = smaller
    for part in _parts(table):
        nbytes, static = shared_bytes(part, D, t)
        limit = STATIC_SHARED_LIMIT if static else limits.max_shared_per_block
        if nbytes > limit:
            kind = "static: CUDA's 48 KB limit" if static else "dynamic, per block"
            raise ValueError(
                f"block_m={t.block_m}, block_n={t.block_n} with head_dim={D} need {nbytes} bytes of shared memory "
                f"in {KERNEL_NAMES.get(part, 'kernel ' + part)} ({kind}), more than the {limit} bytes {limits.name} "
                f"allows; tiles that fit: {largest_fitting(table, D, limits)}")
    return t, reason


def _fewer_keys(table: str, D: int, t: Tiles, limits: DeviceLimits):
    """t with the largest key tile below its own (a multiple of 16, down to 16) that the family accepts and the
    device's shared memory holds; None where none does."""
    for n in range((t.block_n - 1) // 16 * 16, 15, -16):
        smaller = threads_of(table, t._replace(block_n=n), D)
        try:
            check(table, D, smaller)
        except ValueError:
            continue
        if fits(table, D, smaller, limits):
            return smaller
    return None
