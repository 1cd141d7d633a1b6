"""Plans: which kernels a call runs, with which tiles, threads, shared memory and grid, and why.

A :class:`Plan` is made from validated inputs and options (:mod:`flashnumba._validate`) and a device's limits
(:mod:`flashnumba.tiling`), and is all :mod:`flashnumba._launch` needs to run the call. It is also what a user can
ask for without running anything::

    >>> p = flashnumba.plan(q, k, v, causal=True)        # the forward of this call on this GPU
    >>> print(p)                                         # family, tiles, threads, shared bytes, grid, why
    >>> flashnumba.plan_backward(dout, q, k, v, out, lse, causal=True, device="sm_86")   # on another GPU

How ``kernel=None`` chooses:

* float16 / bfloat16: the tensor-core kernels (``tc``) where they apply: a GPU of compute capability >= 8.0
  (``mma.sync`` m16n8k16 and ``cp.async``), head_dim a multiple of 8 up to 256, forward and backward
  (:data:`flashnumba.tiling.MMA_DEFAULT_HEAD_DIMS`; those not a multiple of 16, 8, 24, 40, ..., padded to 16 in
  shared memory with zero columns), and no tile arguments given
  (those are the SIMT kernels'); strided inputs are read in place (copied where their strides or start do not suit the
  16-byte row copies). On compute capability 9.0 the Hopper kernels (``wgmma``) instead, at the head dims where
  they are the faster (:data:`flashnumba.tiling.WGMMA_DEFAULT_HEAD_DIMS`: the forward at every multiple of 32 up
  to 256, both passes; the forward at 96 only where it copies with tensor maps,
  :data:`~flashnumba.tiling.WGMMA_FORWARD_NEEDS_TMA`; the other multiples of 8 from 40,
  :data:`~flashnumba.tiling.WGMMA_PADDED_DEFAULT_HEAD_DIMS`, run padded to the next multiple of 32 in calls of
  :data:`~flashnumba.tiling.WGMMA_PADDED_MIN_SEQLEN_K` keys or more: :func:`padded_head_dim`),
  unless a block mask or ``deterministic=False`` (the atomic dQ) keeps ``tc``
  (:func:`_hopper_blocker`; the plan's ``why`` says so); a user's mask_mod with a block mask takes them at the head
  dims of :data:`flashnumba.tiling.WGMMA_MODS_DEFAULT_HEAD_DIMS`. The choice does not depend on the inputs' strides (the
  Hopper kernels copy strided inputs to C-contiguous rows), so a packed qkv gives the bits of the same values
  unpacked; only without CuPy, which makes those copies, do strided inputs keep ``tc``.
  Elsewhere the SIMT kernels (``v3`` forward, ``v2`` backward), about ten times slower: the plan says why in
  ``fallback`` and a one-time :class:`SlowPathWarning` says so (``flashnumba.config.warn_slow_path = False``
  silences it). Under the simulator the SIMT kernels are chosen without a warning, with one warp on 16 x 16
  tiles unless tiles are given (:data:`flashnumba.tiling.SIMULATED`).
* float32: the SIMT kernels (``v3`` / ``v2``), exact float32 arithmetic; the TF32 kernels are opt-in
  (``kernel="tf32"`` or ``"3xtf32"``), since they round the operands.

Each family's tiles come from its table in :mod:`flashnumba.tiling`: the first candidate that fits the device.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field, replace

import numpy as np

from . import _arrays, _validate, config, tiling
from ._backend import SIMULATOR, cuda
from ._launch import ArrayMeta, KernelLaunch, array_meta, c_strides, compile_kernel, is_c_layout
from .kernels import (mma_backward, mma_decode, mma_forward, mma_tf32, mma_tf32_backward, simt_backward,
                      simt_forward, wgmma_backward, wgmma_forward, wgmma_tf32, wgmma_tf32_backward)
from .kernels.mma_tiles import WARP_ROWS
from .kernels.ptx_hopper import MAP_WORDS
from .kernels.common import MOD_ARGS
from .kernels.simt_forward import LOG2E

PREPROCESS_ROWS = 8  # query rows per block of the backward's D_i kernel on a GPU (a warp each)


class SlowPathWarning(UserWarning):
    """kernel=None chose a kernel family slower than the inputs' dtype allows elsewhere (see the plan's
    ``fallback``), or a user's score_mod / mask_mod computes in float64 (:func:`warn_float64_mods`)."""


@dataclass(frozen=True)
class InputSpec:
    """A user array a call reads: its name, kind, whether it is copied to the device (NumPy) or to a C-contiguous copy
    (an input of a tensor-core kernel that is strided in a way its row copies cannot read, or does not start on 16
    bytes: the start's alignment is part of a call's key), a leading axis added (varlen), a broadcast (ALiBi slopes
    (nheads,) -> (batch, nheads)), the dummy that stands in when it is absent, whether the kernels write it, and
    ``pad``: where nonzero, the head dim of a copy with zero columns appended that the kernels read instead (a head
    dim the kernels are not built for, run as the next one they are)."""

    name: str
    kind: str
    to_device: bool = False
    copy: bool = False
    lead: bool = False
    broadcast: tuple | None = None
    dummy_shape: tuple = (1,)
    dummy_dtype: str = "float32"
    written: bool = False  # the kernels write it in place (a KV cache): a NumPy array's copy is copied back
    pad: int = 0


@dataclass(frozen=True)
class OutputSpec:
    """An array a call allocates: the user's shape and dtype, whether it is returned (D_i is not), whether it
    starts as zeros (an accumulator the kernels add into; never NaN-poisoned), and whether it is discarded: written
    by a kernel and read by none (a decoding call's lse where the caller did not ask for it, the split partials
    where the keys are not split), so that one buffer, kept with the call's plan, serves every call: concurrent
    calls may write it at once, as nothing reads it. ``width``: where nonzero, the last axis the kernels write (a
    padded head dim, :class:`InputSpec`), of which the caller gets the first ``shape[-1]`` columns."""

    name: str
    shape: tuple
    dtype: np.dtype
    returned: bool = True
    zeroed: bool = False
    discarded: bool = False
    width: int = 0


@dataclass
class Plan:
    """What one call runs. ``kernel``: the family (the API's ``kernel=`` name); ``why``: why this family;
    ``fallback``: set when kernel=None chose a family slower than the dtype allows on a capable GPU, saying why;
    ``launches``: each kernel with its tiles, threads, shared bytes and grid; ``device``: the limits planned
    for. ``arrays``, ``scalars``, ``inputs``, ``outputs`` and ``like`` are what the launch layer needs."""

    pass_: str
    kernel: str
    dtype: str
    head_dim: int
    options: str
    device: tiling.DeviceLimits
    why: str
    fallback: str | None
    launches: tuple
    arrays: dict = field(repr=False, default_factory=dict)
    scalars: dict = field(repr=False, default_factory=dict)
    inputs: tuple = field(repr=False, default=())
    outputs: tuple = field(repr=False, default=())
    like: str = field(repr=False, default="numpy")

    def resources(self) -> list:
        """Registers, spills and static shared memory of each kernel, compiled for the plan's device (also
        without a GPU; the compiled code is kept in the disk cache), as the assembler's log states them (None where
        it states none: :func:`flashnumba._launch.resources_from_log`); once a kernel whose log stated none is
        loaded on a GPU, its registers, static shared memory and local memory (``stack_bytes``) are the driver's
        (:func:`flashnumba._launch.loaded_resources`) and its spills stay None."""
        rows = []
        for s in self.launches:
            c = compile_kernel(s, s.signature(self.arrays, self.scalars), self.device.cc)
            rows.append(dict(kernel=s.name, **c.resources))
        return rows

    def to_dict(self) -> dict:
        return {
            "pass": self.pass_, "kernel": self.kernel, "dtype": self.dtype, "head_dim": self.head_dim,
            "options": self.options, "device": self.device.name, "arch": self.device.arch,
            "max_shared_per_block": self.device.max_shared_per_block, "why": self.why, "fallback": self.fallback,
            "launches": [dict(name=s.name, table=s.table, block_m=getattr(s.tiles, "block_m", None),
                              block_n=getattr(s.tiles, "block_n", None), threads=int(np.prod(s.block)),
                              shared_bytes=s.shared_bytes, grid=list(s.grid), reason=s.reason)
                         for s in self.launches],
        }

    def __str__(self) -> str:
        lines = [f"{self.pass_} on {self.device.name} ({self.device.max_shared_per_block} bytes of shared memory "
                 f"per block): kernel {self.kernel!r}, {self.dtype}, head_dim {self.head_dim}, {self.options}",
                 f"  why: {self.why}"]
        if self.fallback:
            lines.append(f"  slower path: {self.fallback}")
        for s in self.launches:
            t = s.tiles
            tiles = f"B_r {t.block_m}, B_c {t.block_n}, " if t is not None else ""
            lines.append(f"  {s.name:16} {tiles}{int(np.prod(s.block))} threads, {s.shared_bytes} B dynamic shared, "
                         f"grid {tuple(s.grid)}" + (f"  ({s.reason})" if s.reason else ""))
        return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------------------
# the device
# ---------------------------------------------------------------------------------------------------------------

_current: dict = {}


def current_device() -> tiling.DeviceLimits:
    """The limits of Numba's current GPU (under the simulator, or without a GPU: sm_90's), capped by
    ``FLASHNUMBA_MAX_SHARED_BYTES``."""
    if SIMULATOR or not cuda.is_available():
        sm90 = tiling.ARCHS["sm_90"]  # (in the simulator named so, so that a printed plan says where it runs)
        return tiling.capped(replace(sm90, name=f"the simulator ({sm90.arch}'s limits)") if SIMULATOR else sm90)
    dev = cuda.get_current_device()
    lim = _current.get(dev.id)
    if lim is None:
        name = dev.name.decode() if isinstance(dev.name, bytes) else dev.name
        cc = tuple(dev.compute_capability)
        lim = tiling.DeviceLimits(
            f"{name} (sm_{cc[0]}{cc[1]})", cc, int(dev.MAX_SHARED_MEMORY_PER_BLOCK_OPTIN),
            int(dev.MAX_SHARED_MEMORY_PER_MULTIPROCESSOR), int(dev.MAX_REGISTERS_PER_MULTIPROCESSOR),
            int(dev.MAX_THREADS_PER_MULTIPROCESSOR), int(dev.MAX_BLOCKS_PER_MULTIPROCESSOR),
            sm_count=int(dev.MULTIPROCESSOR_COUNT))
        _current[dev.id] = lim
    return tiling.capped(lim)


def resolve_device(device, tensors=()) -> tiling.DeviceLimits:
    """The limits to plan for: the current GPU's (its arrays must be on it), or an architecture's."""
    if device is not None:
        return tiling.capped(tiling.device_limits(device))
    for t in tensors:
        if t.kind == "torch" and getattr(t.array, "is_meta", False):
            raise ValueError(f"{t.name} is a meta tensor (a shape without data): nothing can run on it")
    if not SIMULATOR and tensors:
        here = cuda.get_current_device().id
        for t in tensors:
            where = t.array.device.index if t.kind == "torch" else t.array.device.id if t.kind == "cupy" else here
            if where != here:
                raise ValueError(f"{t.name} is on GPU {where}, but the kernels run on GPU {here} (Numba's current "
                                 f"device); move the arrays there or select that device with "
                                 f"numba.cuda.select_device({where})")
    return current_device()


# ---------------------------------------------------------------------------------------------------------------
# choosing the family
# ---------------------------------------------------------------------------------------------------------------


def _dtype_name(dtype) -> str:
    return "bfloat16" if _arrays.is_bfloat16(dtype) else np.dtype(dtype).name


def _mma_blocker(tq, tensors, limits, tiles_given, pass_, simulated) -> str | None:
    """Why the tensor-core kernels do not apply to a float16/bfloat16 call, or None where they do. ``simulated``:
    the call runs in the simulator (not a plan for a named architecture, which is the plan that GPU would run)."""
    if simulated:
        return "the simulator runs the SIMT kernels by default (ask for kernel='tc' to simulate the tensor cores)"
    if tiles_given:
        return "tile arguments were given without kernel=: they are the SIMT kernels' (pass kernel='tc' to tile " \
               "the tensor-core kernels)"
    if tuple(limits.cc) < tiling.MMA_MIN_CC:
        return (f"compute capability {limits.cc[0]}.{limits.cc[1]} has no mma.sync m16n8k16 / cp.async "
                f"(the tensor-core kernels need 8.0 or newer)")
    D = tq.shape[-1]
    built = tiling.MMA_HEAD_DIMS if pass_ == "forward" else tiling.MMA_BACKWARD_HEAD_DIMS
    if D not in built:
        return (f"the tensor-core {pass_} is built for head_dim a multiple of 8 up to {built[-1]}, not {D}")
    if _arrays.cupy is None and any(t.kind in ("numba", "cai") and (
            not _arrays.starts_aligned(t.array) or (not _c_layout(t) and not _rows_in_place(t))) for t in tensors):
        return "strided or unaligned inputs would need a C-contiguous copy, which needs CuPy"
    return None


def _hopper_blocker(pass_, tq, tensors, opts, limits, deterministic, mods=False) -> str | None:
    """Where the tensor-core kernels apply on a GPU of compute capability 9.0, whether ``kernel=None`` takes the
    Hopper kernels (``wgmma``) instead: None where it does, else the reason (as "; ..." to append to the plan's
    why; "" on other GPUs). The head dims are :data:`flashnumba.tiling.WGMMA_DEFAULT_HEAD_DIMS`, those where the
    Hopper kernel is the faster; its tiles must fit the shared memory (a cap, ``FLASHNUMBA_MAX_SHARED_BYTES``,
    may leave only the ``mma.sync`` kernels' room); block masks and ``deterministic=False`` (the atomic dQ) are
    the ``mma.sync`` kernels'. Strided inputs do not change the choice (the Hopper kernels copy them to C-contiguous
    rows, where the ``mma.sync`` kernels read them in place): a call gives the same bits whatever its inputs'
    layout (packed qkv or not), at the cost of the copies; only without CuPy, which makes them, do they keep
    the ``mma.sync`` kernels.

    ``mods``: a call with a user's mask_mod or block mask (``flex_attention``), where the head dims are
    :data:`flashnumba.tiling.WGMMA_MODS_DEFAULT_HEAD_DIMS`, a mask_mod without a block mask keeps ``tc`` (not
    measured there; a score_mod, with a block mask or without a mask_mod, ran faster on the Hopper kernels), and a
    block mask is taken where its blocks are multiples of 128 (every tile of the Hopper kernels divides them) and,
    in the backward with fewer key/value heads than query heads, made for every head."""
    if tuple(limits.cc) != (9, 0):
        return ""
    D = tq.shape[-1]
    head_dims = (tiling.WGMMA_MODS_DEFAULT_HEAD_DIMS if mods else tiling.WGMMA_DEFAULT_HEAD_DIMS)[pass_]
    padded = () if mods else tiling.WGMMA_PADDED_DEFAULT_HEAD_DIMS[pass_]
    if D not in head_dims and D not in padded:
        return f"; not wgmma: the Hopper {pass_} is the faster{' with a mask_mod' if mods else ''} at head_dim " \
               f"{', '.join(map(str, sorted(head_dims + padded)))}"
    if D in padded:  # (multiples of 8 that are not of 32: none of head_dims)
        nk = [t.shape[-3] for t in tensors if t.name == "k"]
        varlen = opts.variant[4]
        if varlen or not nk or nk[0] < tiling.WGMMA_PADDED_MIN_SEQLEN_K:
            return (f"; not wgmma: head_dim {D} runs there padded to the next multiple of 32, on copies that pay "
                    f"from {tiling.WGMMA_PADDED_MIN_SEQLEN_K} keys (sequences of equal length)")
        if _arrays.cupy is None and any(t.kind in ("numba", "cai") for t in tensors):
            return f"; not wgmma: head_dim {D} runs there padded with zero columns, copies that need CuPy"
    D = padded_head_dim("wgmma", D)  # (the tiles and copies below: those of the head dim the kernels run)
    if mods and opts.block_mask is None and opts.mods is not None and opts.mods.mask_mod is not None:
        return "; not wgmma: a mask_mod without a block mask (the Hopper kernels take one when asked for)"
    for table in ("wgmma",) if pass_ == "forward" else ("wgmma_dq", "wgmma_dkdv"):
        try:
            tiling.default(table, D, limits)
        except ValueError:
            return (f"; not wgmma: its tiles need more than the {limits.max_shared_per_block} bytes of shared memory "
                    f"a block may use here")
    if opts.block_mask is not None and not mods:
        return "; not wgmma: a block mask"
    if opts.block_mask is not None and (opts.block_mask[0] % 128 or opts.block_mask[1] % 128):
        return "; not wgmma: a block mask whose blocks are not multiples of 128"
    if (opts.block_mask is not None and pass_ == "backward" and opts.block_mask[2].shape[1] > 1
            and any(t.name == "k" and t.shape[-2] != tq.shape[-2] for t in tensors)):
        return "; not wgmma: a block mask made per head, with fewer key/value heads than query heads"
    if not deterministic:
        return "; not wgmma: deterministic=False (the atomic dQ)"
    if _arrays.cupy is None and any(t.name in ("q", "k", "v", "dout") and t.kind != "numpy" and not _c_layout(t)
                                    for t in tensors):
        return "; not wgmma: strided inputs (read in place here; the Hopper kernels' copies need CuPy)"
    if pass_ == "forward" and D in tiling.WGMMA_FORWARD_NEEDS_TMA:
        t, _ = tiling.wgmma_for_variant(tiling.default("wgmma", D, limits).tiles, opts.variant)
        if not _takes_tma(D, opts, t, tensors):
            return (f"; not wgmma: at head_dim {D} the Hopper forward is the faster only with its tensor-map copies, "
                    f"which this call does not take (packed sequences, more than two options, tiles without the "
                    f"producer warpgroup, no keys, or config.hopper_tma off)")
    return None


def persistent_blocks(limits) -> int:
    """Blocks of a persistent Hopper forward: one an SM (132 where the limits do not say: an H100's or H200's)."""
    return limits.sm_count or 132


def _takes_tma(D, opts, t, tensors) -> bool:
    """Whether the Hopper forward at tiles ``t`` copies with tensor maps (``wgmma_forward.takes_tma``, and keys to
    copy: a map's dims are not zero)."""
    nk = [x.shape[-3] for x in tensors if x.name == "k"]
    return (config.hopper_tma and (not nk or nk[0] > 0) and wgmma_forward.takes_tma(
        D, opts.variant, t.block_m // 64, wgmma_forward.producer_warps(t.block_m, t.num_threads) or 0))


def _takes_tma_backward(D, opts, which, t, n) -> bool:
    """Whether the Hopper backward kernel ``which`` ("dq", "dkdv") at tiles ``t`` copies with tensor maps
    (``wgmma_backward.takes_tma``, config.hopper_tma, and ``n`` > 0 queries and keys: a map's dims are not
    zero)."""
    return config.hopper_tma and n > 0 and wgmma_backward.takes_tma(D, opts.variant, _wgmma_warpgroups(which, D, t),
                                                                     which, t.block_m)


def _wgmma_warpgroups(which, D, t) -> int:
    """The warpgroups that compute in the Hopper backward kernel ``which`` ("dq", "dkdv") at tiles ``t``: one a 64
    query rows (dQ), or :func:`flashnumba.kernels.wgmma_backward.dkdv_warpgroups` (dK/dV)."""
    return t.block_m // 64 if which == "dq" else wgmma_backward.dkdv_warpgroups(D, t.block_n)


def _c_layout(t) -> bool:
    return is_c_layout(t.shape, t.strides, t.dtype.itemsize)


def _rows_in_place(t) -> bool:
    """Whether the 16-byte copies of the tensor-core kernels can read a strided device array in place: the last
    dimension contiguous, every other stride a non-negative multiple of 16 bytes (the array's start is checked at
    each call, :class:`flashnumba._launch.Call`)."""
    if t.kind == "numpy" or (t.shape[-1] > 1 and t.strides[-1] != t.dtype.itemsize):
        return False
    return all(s >= 0 and s % 16 == 0 for n, s in zip(t.shape[:-1], t.strides[:-1]) if n > 1)


def _strided(arrays, names) -> bool:
    """Whether a tensor-core kernel reads any of these arrays in place with strides (layout "A")."""
    return any(arrays[n].layout == "A" for n in names)


def _warn_slow(pass_, reason):
    if config.warn_slow_path and reason not in _warned:
        _warned.add(reason)
        warnings.warn(f"flashnumba: the {pass_} runs on the SIMT kernels, about 10x slower than the tensor-core "
                      f"ones: {reason}. (flashnumba.config.warn_slow_path = False silences this.)",
                      SlowPathWarning, stacklevel=4)


_warned: set = set()


def compile_mods(p, mods):
    """Compiles plan ``p``'s kernels now (on a GPU); a user's function that Numba cannot compile into them, or that
    returns something other than one number, raises a TypeError naming it and the problem
    (:func:`flashnumba.kernels.common.refuse_broken`) before anything is launched."""
    from .kernels.common import refuse_broken

    refuse_broken(mods, "flex_attention", p.resources)  # (any error of the compile: Numba's typing and lowering)


def warn_float64_mods(mods):
    """Once per function: a one-time :class:`SlowPathWarning` naming what a user's score_mod, score_mod_grad or
    mask_mod computes in float64, once its kernels are compiled (:func:`flashnumba.kernels.common.float64_use`)."""
    from .kernels.common import float64_use, named_functions

    for role, fn in named_functions(mods):
        if not config.warn_slow_path or (role, fn) in _warned:
            continue
        found = float64_use(fn)
        if found:
            _warned.add((role, fn))
            name = getattr(fn, "__name__", fn)
            warnings.warn(f"flashnumba: {role} {name!r} computes in float64 ({', '.join(found)}), several"
                          f" times slower on a GPU than float32: Numba types an integer and a float32 "
                          f"together as float64, as NumPy does; write np.float32(...) around the integers, for example "
                          f"abs(np.float32(q_idx) - np.float32(kv_idx)) (Numba's integer arithmetic is 64-bit: the "
                          f"difference of the float32 indices is the cheaper). (flashnumba.config.warn_slow_path = "
                          f"False silences this.)",
                          SlowPathWarning, stacklevel=6)


def choose(pass_, kernel, tq, tensors, opts, limits, tiles_given, deterministic, simulated):
    """(family, why, fallback) of a forward or backward call; ``simulated``: the call runs in the simulator, whose
    default is the SIMT kernels (False for a plan made for a named architecture: the choice that GPU would make)."""
    families = tiling.FORWARD_FAMILIES if pass_ == "forward" else tiling.BACKWARD_FAMILIES
    simt = "v3" if pass_ == "forward" else "v2"
    if opts.mods is not None:  # a user's score_mod / mask_mod: the tensor-core forward or the register-tiled SIMT
        # (the Hopper kernels too, asked for)
        takes = (None, "v2", "v3", "tc", "wgmma") if pass_ == "forward" else (None, "v2", "tc", "wgmma")
        if kernel not in takes:
            raise ValueError(f"a score_mod or mask_mod runs on the {pass_} kernels "
                             f"{', '.join(repr(x) for x in takes[1:])} (or None), not {kernel!r}")
        if kernel in ("tc", "wgmma"):
            _check_family(kernel, tq, opts, limits, pass_, simulated)
            return kernel, f"a user's score_mod / mask_mod on the tensor cores{'' if kernel == 'tc' else ' (Hopper)'}" \
                           f": asked for by kernel=", None
        if (kernel is None and (tq.dtype == np.float16 or _arrays.is_bfloat16(tq.dtype))
                and _mma_blocker(tq, tensors, limits, tiles_given, pass_, simulated) is None):
            hopper = _hopper_blocker(pass_, tq, tensors, opts, limits, deterministic, mods=True)
            if hopper is None:
                return "wgmma", "a user's score_mod / mask_mod on Hopper's warpgroup MMA (wgmma)", None
            return "tc", f"a user's score_mod / mask_mod on the tensor cores{hopper}", None
        return kernel or simt, "a user's score_mod / mask_mod: the register-tiled SIMT kernels", None
    if kernel is not None:
        if kernel not in families:
            raise ValueError(f"kernel must be one of {families} for the {pass_} (or None), got {kernel!r}")
        _check_family(kernel, tq, opts, limits, pass_, simulated)
        return kernel, "asked for by kernel=", None
    if tq.dtype == np.float16 or _arrays.is_bfloat16(tq.dtype):
        blocker = _mma_blocker(tq, tensors, limits, tiles_given, pass_, simulated)
        if blocker is None:
            hopper = _hopper_blocker(pass_, tq, tensors, opts, limits, deterministic)
            if hopper is None:
                return "wgmma", f"{_dtype_name(tq.dtype)} on Hopper's warpgroup MMA (wgmma)", None
            return "tc", f"{_dtype_name(tq.dtype)} on tensor cores (mma.sync, cp.async, ldmatrix){hopper}", None
        return simt, "the register-tiled SIMT kernels", (None if simulated else blocker)
    return simt, "float32: the register-tiled SIMT kernels, exact float32 arithmetic (TF32 is opt-in)", None


def padded_head_dim(family, D) -> int | None:
    """The head dim ``family``'s kernels run a call of head dim ``D`` at: D itself where they are built for it; for
    the Hopper kernels (built for multiples of 32), the next multiple of 32 for the other multiples of 8 up to 256,
    q, k, v (and dout, out) copied with zero columns appended and the outputs cropped (zero columns add nothing to
    q.k, and the output's and gradients' extra columns are zeros that no caller sees); None where it cannot run."""
    if family != "wgmma":
        return D
    if D in wgmma_forward.HEAD_DIMS:
        return D
    if D % 8 == 0 and 0 < D < wgmma_forward.HEAD_DIMS[-1]:
        return next(x for x in wgmma_forward.HEAD_DIMS if x > D)
    return None


def _padding(D_user, D, tensors) -> str:
    """The plan's words for a padded head dim (:func:`padded_head_dim`); ValueError where the copies cannot be made
    (CUDA arrays other than torch tensors, without CuPy)."""
    if not SIMULATOR and _arrays.cupy is None and any(t.kind in ("numba", "cai") for t in tensors):
        raise ValueError(f"head_dim {D_user} runs on the Hopper kernels at {D}, on copies of the inputs with zero "
                         f"columns appended, which for CUDA arrays other than torch tensors needs CuPy; install "
                         f"CuPy or use kernel='tc'")
    return f"head_dim {D_user} run as {D}: the inputs copied with {D - D_user} zero columns, the outputs cropped"


def _check_family(kernel, tq, opts, limits, pass_, simulated):
    if kernel == "v1" and not opts.plain:
        raise ValueError(f"{pass_} kernel v1 supports causal masking only (no window, softcap, ALiBi, GQA, varlen "
                         f"or dropout); use the default kernel")
    if kernel == "tc":
        if tq.dtype != np.float16 and not _arrays.is_bfloat16(tq.dtype):
            raise TypeError(f"the tensor-core kernels take float16 or bfloat16; q has dtype {tq.dtype}")
        built = tiling.MMA_HEAD_DIMS if pass_ == "forward" else tiling.MMA_BACKWARD_HEAD_DIMS
        if tq.shape[-1] not in built:
            raise ValueError(f"the tensor-core {pass_} supports head_dim a multiple of 8 up to {built[-1]}, got "
                             f"{tq.shape[-1]}")
    if kernel == "wgmma":
        if tq.dtype != np.float16 and not _arrays.is_bfloat16(tq.dtype):
            raise TypeError(f"the wgmma kernel takes float16 or bfloat16; q has dtype {tq.dtype}")
        if padded_head_dim("wgmma", tq.shape[-1]) is None:
            raise ValueError(f"the wgmma {pass_} supports head_dim a multiple of 8 up to 256 (built for "
                             f"{wgmma_forward.HEAD_DIMS}, the others run padded with zero columns), got "
                             f"{tq.shape[-1]}")
        if not simulated and tuple(limits.cc) != (9, 0):
            raise ValueError(f"kernel 'wgmma' runs on compute capability 9.0 only (Hopper's wgmma, compiled for "
                             f"sm_90a); this is {limits.name}")
    if kernel in mma_tf32.PRECISIONS:
        if tq.dtype != np.float32:
            raise TypeError(f"the TF32 kernel takes float32; q has dtype {tq.dtype}")
        if not opts.plain:
            raise ValueError(f"kernel {kernel!r} supports causal masking only (no window, softcap, ALiBi, GQA, "
                             f"varlen or dropout)")
        if tq.shape[-1] not in mma_tf32.HEAD_DIMS:
            raise ValueError(f"the TF32 kernel supports head_dim in {mma_tf32.HEAD_DIMS}, got {tq.shape[-1]}")
    if kernel in ("tc",) + mma_tf32.PRECISIONS and not simulated and tuple(limits.cc) < tiling.MMA_MIN_CC:
        raise ValueError(f"kernel {kernel!r} needs compute capability 8.0 or newer (mma.sync m16n8k16, cp.async); "
                         f"this is {limits.name}")


# ---------------------------------------------------------------------------------------------------------------
# the call's arrays, as the kernels see them
# ---------------------------------------------------------------------------------------------------------------


def _kernel_meta(t: _validate.Tensor, lead: bool, contiguous: bool, pad: int = 0) -> ArrayMeta:
    """The kernel's view of an input: a NumPy array or a copied one is C-contiguous on the device, a padded copy
    ``pad`` wide in its last axis; a varlen array gets a leading axis of length 1."""
    shape, strides = (t.shape[:-1] + (pad,) if pad else t.shape), t.strides
    if contiguous or pad or t.kind == "numpy":
        strides = c_strides(shape, t.dtype.itemsize)
    if lead:
        span = max(shape[0] * abs(strides[0]), t.dtype.itemsize) if shape else t.dtype.itemsize
        shape, strides = (1, *shape), (span, *strides)
    return array_meta(shape, strides, t.dtype)


def _alibi_input(a, batch, nheads):
    """(InputSpec, kernel ArrayMeta) of the ALiBi slopes: a dummy without them; (nheads,) slopes read as (batch,
    nheads) with a batch stride of 0."""
    if a is None:
        return (InputSpec("alibi", "none", dummy_shape=(1, 1), dummy_dtype="float32"),
                array_meta((1, 1), (4, 4), np.float32, "A"))
    s = c_strides(a.shape, 4) if a.kind == "numpy" else a.strides
    strides = (0, s[0]) if len(a.shape) == 1 else s
    return (InputSpec("alibi", a.kind, to_device=a.kind == "numpy", broadcast=(batch, nheads)),
            array_meta((batch, nheads), strides, np.float32, "A"))


def _inputs(tensors, family, lead, opts, batch, cu, block_params=3, pad=0):
    """InputSpecs and kernel ArrayMetas of the call's arrays (q, k, v, ... then alibi, cu_q, cu_k, then the
    arrays a user's score_mod / mask_mod read, a0 .. a3, then the first ``block_params`` of a block mask's,
    :data:`BLOCK_MASK_PARAMS`); ``pad``: the head dim the kernels take, where it is wider than the tensors'
    (:func:`padded_head_dim`)."""
    specs, metas = [], {}
    mma = family in ("tc", "wgmma") + mma_tf32.PRECISIONS
    for t in tensors:
        copy = mma and t.kind != "numpy" and (not _arrays.starts_aligned(t.array) or (
            not _c_layout(t) and not (family == "tc" and _rows_in_place(t))))
        specs.append(InputSpec(t.name, t.kind, to_device=t.kind == "numpy" and not pad, copy=copy and not pad,
                               lead=lead, pad=pad))
        metas[t.name] = _kernel_meta(t, lead, copy, pad)
    spec, metas["alibi"] = _alibi_input(opts.alibi, batch, tensors[0].shape[-2])
    specs.append(spec)
    for name, tc in (("cu_q", cu[0] if cu else None), ("cu_k", cu[1] if cu else None)):
        if tc is None:
            specs.append(InputSpec(name, "none", dummy_shape=(1,), dummy_dtype="int32"))
            metas[name] = array_meta((1,), (4,), np.int32, "A")
        else:
            stride = 4 if tc.kind == "numpy" else tc.strides[0]
            specs.append(InputSpec(name, tc.kind, to_device=tc.kind == "numpy"))
            metas[name] = array_meta(tc.shape, (stride,), np.int32, "A")
    for n in range(MOD_ARGS):
        t = opts.mod_args[n] if n < len(opts.mod_args) else None
        spec, metas[f"a{n}"] = _optional_input(f"a{n}", t, (1,), "float32")
        specs.append(spec)
    for n, (name, dtype, ndim) in enumerate(zip(BLOCK_MASK_PARAMS[:block_params], ("int32", "int32", "int8", "int32",
                                                                                   "int32"), (3, 4, 4, 3, 4))):
        t = None if opts.block_mask is None else opts.block_mask[2 + n]
        spec, metas[name] = _optional_input(name, t, (1,) * ndim, dtype)
        specs.append(spec)
    return specs, metas


def _optional_input(name, t, dummy_shape, dummy_dtype):
    """(InputSpec, kernel ArrayMeta) of an optional array argument read as it is: the Tensor ``t``, or where it is
    None a dummy of ``dummy_shape`` and ``dummy_dtype``."""
    if t is None:
        dt = np.dtype(dummy_dtype)
        return (InputSpec(name, "none", dummy_shape=dummy_shape, dummy_dtype=dummy_dtype),
                array_meta(dummy_shape, (dt.itemsize,) * len(dummy_shape), dt, "A"))
    return InputSpec(name, t.kind, to_device=t.kind == "numpy"), _kernel_meta(t, False, False)


def _output(name, user_shape, dtype, lead, returned=True, discarded=False, width=0):
    """(OutputSpec, kernel ArrayMeta) of an output; ``width``: the last axis the kernels write, where wider than
    the caller's (a padded head dim)."""
    shape = (1, *user_shape) if lead else tuple(user_shape)
    if width:
        shape = shape[:-1] + (width,)
    kdtype = np.dtype(np.uint16) if _arrays.is_bfloat16(dtype) else np.dtype(dtype)
    spec = OutputSpec(name, tuple(user_shape), dtype, returned, discarded=discarded and not returned, width=width)
    return spec, array_meta(shape, c_strides(shape, kdtype.itemsize), dtype)


def _option_scalars(opts):
    return {"softcap": np.float32(opts.softcap), "left": np.int64(opts.left), "right": np.int64(opts.right),
            "p_drop": np.float32(opts.dropout_p), "rp_keep": np.float32(1.0 / (1.0 - opts.dropout_p)),
            "scale": np.float32(opts.scale), "scale_log2": np.float32(opts.scale * LOG2E),
            # with softcap, ALiBi or a user's score_mod the register-tiled and tensor-core kernels form
            # scale * q.k in natural units
            "scale_q": np.float32(opts.scale) if (opts.softcap > 0 or opts.alibi is not None or (
                opts.mods is not None and opts.mods.score_mod is not None)) else np.float32(opts.scale * LOG2E)}


OPTION_PARAMS = ("softcap", "left", "right", "alibi", "cu_q", "cu_k", "p_drop", "rp_keep", "seed", "offset")
MOD_PARAMS = tuple(f"a{n}" for n in range(MOD_ARGS))  # the register-tiled SIMT kernels' last parameters
# and the tensor-core kernels', after them: a block mask's key-block lists and states (the forward's, the dQ
# kernel's), then its query-block lists (the dK/dV kernel's, with the states)
BLOCK_MASK_PARAMS = ("bm_num", "bm_idx", "bm_state", "bm_qnum", "bm_qidx")


def _check_block_mask_tiles(opts, t):
    """ValueError unless a kernel's tiles (block_m queries, block_n keys) divide the block mask's blocks (a tile
    never straddles two blocks)."""
    if opts.block_mask is not None and (opts.block_mask[0] % t.block_m or opts.block_mask[1] % t.block_n):
        raise ValueError(f"the block mask's blocks ({opts.block_mask[0]}, {opts.block_mask[1]}) must be multiples of "
                         f"the kernel's tiles (block_m {t.block_m}, block_n {t.block_n}): make it with BLOCK_SIZE a "
                         f"multiple of those, or give block_m and block_n")


def _cdiv(a, b):
    return -(-a // b)


# ---------------------------------------------------------------------------------------------------------------
# forward
# ---------------------------------------------------------------------------------------------------------------


def _hopper_3x(family, limits, simulated):
    """Whether a 3xTF32 call runs on Hopper's wgmma: ``config.hopper_3xtf32`` set (checked), compute capability 9.0
    (or the simulator, where no architecture was named)."""
    if family != "3xtf32" or config.hopper_3xtf32 is None:
        return False
    if config.hopper_3xtf32 not in ("chained", "per_step"):
        raise ValueError(f"config.hopper_3xtf32 must be None, 'chained' or 'per_step', got {config.hopper_3xtf32!r}")
    return simulated or tuple(limits.cc) == (9, 0)


def _hopper_3x_reason(block_m, block_n):
    """The plan's reason for a 3xTF32 kernel on wgmma: its accumulation, and whose tiles."""
    given = "given by the caller" if (block_m, block_n) != (None, None) else "the default tiles"
    return f"on Hopper's wgmma, {config.hopper_3xtf32.replace('_', ' ')} accumulation (config.hopper_3xtf32); {given}"


def _hopper_3xtf32_tiles(D, limits, block_m, block_n, num_threads):
    """(Tiles, reason) of the 3xTF32 forward on wgmma (:func:`_hopper_3x`): the caller's block_m and block_n or
    :mod:`flashnumba.kernels.wgmma_tf32`'s defaults, checked against its tiles and the device's shared memory."""
    m, n = block_m or wgmma_tf32.DEFAULT_BLOCK_M, block_n or wgmma_tf32.DEFAULT_BLOCK_N
    ns = wgmma_tf32.BLOCK_NS.get(D, ())
    if n not in ns or m not in wgmma_tf32.BLOCK_MS or num_threads is not None:
        raise ValueError(f"the 3xTF32 forward on wgmma at head_dim {D} takes block_m in {wgmma_tf32.BLOCK_MS} and "
                         f"block_n in {ns} (its threads follow: 128 per 64 rows; no num_threads)")
    smem = wgmma_tf32.shared_bytes(D, n, m)
    if smem > limits.max_shared_per_block:
        raise ValueError(f"the 3xTF32 forward on wgmma at tiles ({m}, {n}), head_dim {D} needs {smem} bytes of "
                         f"shared memory, more than the {limits.max_shared_per_block} a block may use here")
    return tiling.Tiles(m, n, 2 * m), _hopper_3x_reason(block_m, block_n)


def forward_plan(tq, tk, tv, opts, *, kernel=None, block_m=None, block_n=None, num_threads=None, device=None,
                 batch=None, max_seqlen_q=None, cu=None) -> Plan:
    """The plan of a forward call (tq, tk, tv validated 4-D Tensors, or 3-D packed ones with ``cu`` given)."""
    limits = resolve_device(device, (tq, tk, tv))
    simulated = SIMULATOR and device is None  # (a plan for a named architecture is that GPU's)
    lead = cu is not None
    tiles_given = (block_m, block_n, num_threads) != (None, None, None)
    family, why, fallback = choose("forward", kernel, tq, (tq, tk, tv), opts, limits, tiles_given, True, simulated)
    bsz = tq.shape[0] if batch is None else batch
    shape4 = (1, *tq.shape) if lead else tq.shape
    total_q, nheads, D_user = shape4[1], shape4[2], shape4[3]
    D = padded_head_dim(family, D_user)  # the head dim the kernels run (wider: q, k, v copied with zero columns)
    pad = D if D != D_user else 0
    max_q = total_q if max_seqlen_q is None else max_seqlen_q
    dt, bf16 = tq.dtype, _arrays.is_bfloat16(tq.dtype)
    inputs, arrays = _inputs((tq, tk, tv), family, lead, opts, bsz, cu, pad=pad)
    out_spec, arrays["out"] = _output("out", tq.shape, dt, lead, width=pad)
    lse_user = (nheads, total_q) if lead else (shape4[0], nheads, total_q)
    lse_spec, arrays["lse"] = _output("lse", lse_user, np.dtype(np.float32), lead)
    scalars = _option_scalars(opts)
    table = family
    hopper_3x = _hopper_3x(family, limits, simulated)
    if hopper_3x:  # (its own tiles and shared memory: _hopper_3xtf32_tiles)
        t, reason = _hopper_3xtf32_tiles(D, limits, block_m, block_n, num_threads)
    else:
        t, reason = tiling.resolve(table, D, limits, block_m, block_n, num_threads,
                                   simulated=simulated)
    if pad:
        reason = f"{reason}; {_padding(D_user, D, (tq, tk, tv))}"
    nk = tk.shape[-2]
    grid = (_cdiv(max_q, t.block_m), bsz * nheads)
    io = ("q", "k", "v", "out", "lse")
    if family == "v1":
        launch = KernelLaunch("forward v1", table, simt_forward.make_forward_v1, (D, t.block_m, t.block_n,
                              opts.right == 0, bf16), io + ("scale_log2",), grid, (t.block_m,), 0, t, reason)
    elif family in ("v2", "v3"):
        make = simt_forward.make_forward_v2 if family == "v2" else simt_forward.make_forward_v3
        smem, _ = tiling.shared_bytes(table, D, t)
        launch = KernelLaunch(f"forward {family}", table, make, (D, t.block_m, t.block_n, t.num_threads,
                              opts.variant, bf16, opts.mods), io + ("scale_q",) + OPTION_PARAMS + MOD_PARAMS, grid,
                              (t.num_threads,), smem, t, reason)
    elif family == "tc":
        if reason != "given by the caller":
            t = tiling.plain_rows_per_warp(t, opts.variant, opts.mods is not None and (
                opts.mods.score_mod is not None or opts.block_mask is None))
        wm = t.block_m // (t.num_threads // 2)  # blocks of 16 rows a warp
        if opts.mods is not None and opts.mods.mask_mod is not None and not mma_forward.mask_bits_fit(t.block_n, wm):
            raise ValueError(f"with a mask_mod the tensor-core forward takes at most 128 keys a tile with warps of 16 "
                             f"rows and 64 with warps of 32 (a lane's mask bits: one 64-bit word), got block_n "
                             f"{t.block_n} with {16 * wm}-row warps")
        _check_block_mask_tiles(opts, t)
        smem, _ = tiling.shared_bytes(table, D, t)
        launch = KernelLaunch("forward tc", table, mma_forward.make_forward_tc,
                              (D, opts.variant, t.block_n, t.num_threads // 32, _dtype_name(dt), nk != nheads,
                               _strided(arrays, ("q", "k", "v")), opts.scale > 0,
                               wm, opts.mods,
                               None if opts.block_mask is None else opts.block_mask[:2]),
                              io + ("scale_q",) + OPTION_PARAMS + MOD_PARAMS + BLOCK_MASK_PARAMS[:3], grid,
                              (t.num_threads,), smem, t, reason)
    elif family == "wgmma":
        # what the caller left to the table, fitted to the options
        given = [name for name, x in (("block_m", block_m), ("block_n", block_n), ("num_threads", num_threads))
                 if x is not None]
        t_own, why_own = tiling.wgmma_for_variant(t, opts.variant, given, D)
        if why_own:
            t, reason = t_own, f"{reason}; {why_own}"
        t_own, why_own = tiling.wgmma_for_mods(t, D, None if opts.block_mask is None else opts.block_mask[:2],
                                               opts.mods is not None and opts.mods.score_mod is not None, given,
                                               "wgmma" in opts.mods_table_tiles)
        if why_own:
            t, reason = t_own, f"{reason}; {why_own}"
        grid = (_cdiv(max_q, t.block_m), bsz * nheads)  # (block_m fitted to a block mask's query blocks)
        producer = wgmma_forward.producer_warps(t.block_m, t.num_threads)
        tma = _takes_tma(D, opts, t, (tk,))
        if t.block_m == 192 and (opts.variant[4] or not config.hopper_tma):  # (with no keys: nothing to copy)
            raise ValueError("the wgmma forward's three warpgroups (block_m 192) copy with tensor maps, which packed "
                             "sequences and config.hopper_tma = False do not take (the producer's per-thread copies "
                             "spill in its 32 registers): block_m 64 or 128")
        persistent = tma and config.hopper_persistent and wgmma_forward.takes_persistent(D, opts.variant, t.block_n,
                                                                                         t.block_m // 64)
        if persistent:  # one block an SM (its registers allow no more), each taking pairs of query tiles in turn
            grid = (max(1, min((grid[0] + 1) // 2 * grid[1], persistent_blocks(limits))),)
        smem = wgmma_forward.shared_bytes(D, t.block_n, t.block_m, tma)
        arrays["maps"] = array_meta((3 if tma else 1, MAP_WORDS), (8 * MAP_WORDS, 8), np.uint64, "C")
        _check_block_mask_tiles(opts, t)
        launch = KernelLaunch("forward wgmma", table, wgmma_forward.make_forward_wgmma,
                              (D, opts.variant, t.block_n, t.block_m // 64, _dtype_name(dt), nk != nheads,
                               opts.scale > 0, producer, tma, opts.mods,
                               None if opts.block_mask is None else opts.block_mask[:2], persistent,
                               config.hopper_overlap),
                              io + ("scale_q",) + OPTION_PARAMS + ("maps",) + MOD_PARAMS + BLOCK_MASK_PARAMS[:3],
                              grid, (t.num_threads,), smem, t,
                              (f"{reason}; tiles copied by the copy engine (tensor maps)"
                               + ("; persistent blocks" if persistent else "")) if tma else reason,
                              arch_specific=True, whole_program=tiling.wgmma_rebalances(t),
                              tensor_maps=tuple((name, rows, wgmma_forward.swizzle_span(D)) for name, rows in (
                                  ("q", t.block_m), ("k", t.block_n), ("v", t.block_n))) if tma else ())
    elif hopper_3x:
        launch = KernelLaunch("forward 3xtf32 wgmma", table, wgmma_tf32.make_forward_3xtf32_wgmma,
                              (D, opts.right == 0, t.block_n, config.hopper_3xtf32 == "chained", t.block_m),
                              io + ("scale_log2",), grid, (t.num_threads,),
                              wgmma_tf32.shared_bytes(D, t.block_n, t.block_m), t, reason, arch_specific=True)
    else:  # tf32, 3xtf32
        smem, _ = tiling.shared_bytes(table, D, t)
        launch = KernelLaunch(f"forward {family}", table, mma_tf32.make_forward_tf32,
                              (D, opts.right == 0, family, t.block_n, t.block_m // 16), io + ("scale_log2",), grid,
                              (t.num_threads,), smem, t, reason)
    empty = bsz * nheads * max_q == 0 or total_q == 0
    return Plan("forward", family, _dtype_name(dt), D_user, opts.describe(), limits, why, fallback,
                () if empty else (launch,), arrays, scalars, tuple(inputs), (out_spec, lse_spec), tq.kind)


# ---------------------------------------------------------------------------------------------------------------
# decoding against a KV cache (split-KV)
# ---------------------------------------------------------------------------------------------------------------

# warps of a decoding block the plan weighs, each KW keys of every tile (:func:`decode_warps`): 4 (tiles of 64 keys)
# where the work fills the SMs with blocks, 8 (tiles of 128 keys, one block an SM) where the sequences are few
DECODE_WARPS = (4, 8)
DECODE_KW = 16  # keys a warp takes of each tile: tiles of 64 keys, two K, V buffers of 70 KB at head_dim 128
MAX_SPLITS = mma_decode.MAX_SPLITS
# registers a thread of the decoding kernel is taken to hold when the plan counts blocks an SM: the most it may use
# (its own count, known only once compiled, depends on the options and the head dim)
DECODE_REGISTERS = 255
# a decoding block's fixed time, in tiles' worth, when the plan weighs split counts: the pipeline's first tile
# and the warps' combine at the end
DECODE_FIXED_TILES = 1


def decode_splits(blocks: int, n_tiles: int, limits: tiling.DeviceLimits, per_sm: int) -> int:
    """``num_splits=0``: how many parts to cut each sequence's keys into. ``blocks`` blocks without a split, each
    reading ``n_tiles`` tiles, on ``limits.sm_count`` SMs of ``per_sm`` resident blocks each. A call's time is
    taken as its waves of blocks (a wave is one block on every slot) times a block's time, ceil(n_tiles / n) tiles
    plus :data:`DECODE_FIXED_TILES` for starting the pipeline and combining the warps: the count with the least,
    the fewest of those (each split costs the combine a read). So a split count that leaves some blocks a tile
    more than the rest (29 splits of 128 tiles: 5 for some, 4 for others) loses to one that divides them evenly
    (32: 4 each), and a second wave is taken only where it more than halves a block's tiles."""
    if n_tiles <= 1 or blocks <= 0:
        return 1
    slots = max(1, (limits.sm_count or 108) * per_sm)

    def cost(n):
        return _cdiv(blocks * n, slots) * (_cdiv(n_tiles, n) + DECODE_FIXED_TILES)

    return min(range(1, min(n_tiles, MAX_SPLITS) + 1), key=lambda n: (cost(n), n))


@dataclass(frozen=True)
class DecodeStep:
    """What a decoding call does before its attention (:func:`flashnumba.kernels.mma_decode.make_append`): the new
    keys and values (Tensors, or None), the rotary tables (Tensors, or None), GPT-J pairs (``interleaved``) or
    halves, and whether the queries sit at their own positions (``local``: causal or windowed) or all at the
    cache's length."""

    k_new: _validate.Tensor | None = None
    v_new: _validate.Tensor | None = None
    rotary_cos: _validate.Tensor | None = None
    rotary_sin: _validate.Tensor | None = None
    interleaved: bool = True
    local: bool = False

    @property
    def runs(self) -> bool:
        return self.k_new is not None or self.rotary_cos is not None


def _decode_inputs(tq, tk, tv, opts, seqlens, batch_idx, block_table, step, *, copy_q=False, leftpad=None):
    """InputSpecs and kernel ArrayMetas of a decoding call's arrays, in the order the call takes them: q, k_cache,
    v_cache (written in place where new keys come), seqlens_k, batch_idx, block_table, alibi, k_new, v_new,
    rotary_cos, rotary_sin, leftpad (dummies where absent)."""
    inputs, arrays = [], {}
    batch, _, nheads, _ = tq.shape
    written = step.k_new is not None
    for t in (tq, tk, tv):
        copy = copy_q and t is tq and t.kind != "numpy"
        inputs.append(InputSpec(t.name, t.kind, to_device=t.kind == "numpy", copy=copy,
                                written=written and t is not tq))
        arrays[t.name] = _kernel_meta(t, False, copy)
    for name, t, shape in (("seqlens_k", seqlens, (batch,)), ("batch_idx", batch_idx, (1,)),
                           ("block_table", block_table, (1, 1))):
        spec, arrays[name] = _optional_input(name, t, shape, "int32")
        inputs.append(spec)
    spec, arrays["alibi"] = _alibi_input(opts.alibi, batch, nheads)
    inputs.append(spec)
    bits = "uint16" if _arrays.is_bfloat16(tq.dtype) else np.dtype(tq.dtype).name
    for name, t, shape, dt in (("k_new", step.k_new, (1, 1, 1, 1), bits), ("v_new", step.v_new, (1, 1, 1, 1), bits),
                               ("rotary_cos", step.rotary_cos, (1, 1), "float32"),
                               ("rotary_sin", step.rotary_sin, (1, 1), "float32")):
        spec, arrays[name] = _optional_input(name, t, shape, dt)
        inputs.append(spec)
    spec, arrays["leftpad"] = _optional_input("leftpad", leftpad, (1,), "int32")
    inputs.append(spec)
    return inputs, arrays


def _append_launch(tq, step, paged, indexed, arrays):
    """The append kernel's launch (:func:`flashnumba.kernels.mma_decode.make_append`), its outputs, seqlens_out
    (the key counts after the step) and q_rot (q rotated, where rotary tables come), and the InputSpec of q_rot's
    dummy where none come."""
    batch, seqlen_q, _, _ = tq.shape
    rotary = step.rotary_cos is not None
    outs, extra = [], []
    spec, arrays["seqlens_out"] = _output("seqlens_out", (batch,), np.dtype(np.int32), False, returned=False)
    outs.append(spec)
    if rotary:
        spec, arrays["q_rot"] = _output("q_rot", tq.shape, tq.dtype, False, returned=False)
        outs.append(spec)
    else:  # (a dummy, after the call's own arrays)
        kd = np.dtype(np.uint16) if tq.bf16 else tq.dtype
        extra.append(InputSpec("q_rot", "none", dummy_shape=(1, 1, 1, 1), dummy_dtype=kd.name))
        arrays["q_rot"] = array_meta((1, 1, 1, 1), c_strides((1, 1, 1, 1), kd.itemsize), kd, "A")
    seqlen_new = step.k_new.shape[1] if step.k_new is not None else 0
    cos_dt = _dtype_name(step.rotary_cos.dtype) if rotary else "float32"
    launch = KernelLaunch("decode append", "decode", mma_decode.make_append,
                          (_dtype_name(tq.dtype), step.k_new is not None, rotary, step.interleaved, step.local, paged,
                           indexed, cos_dt),
                          ("q", "k_new", "v_new", "rotary_cos", "rotary_sin", "k_cache", "v_cache", "q_rot",
                           "seqlens_k", "seqlens_out", "batch_idx", "block_table"),
                          (max(seqlen_new, seqlen_q if rotary else 0, 1), batch),
                          (32 if SIMULATOR else mma_decode.APPEND_THREADS,), 0, None,
                          "the new keys and values into the cache, the rotations")
    return launch, outs, extra


def append_plan(tq, tk, tv, opts, *, seqlens, batch_idx, block_table, step: DecodeStep, device=None) -> Plan:
    """The plan of a decoding call's first step alone (:class:`DecodeStep`), for the gather path: the call
    returns seqlens_out, and q_rot (q rotated) where rotary tables come."""
    limits = resolve_device(device, (tq, tk, tv))
    inputs, arrays = _decode_inputs(tq, tk, tv, opts, seqlens, batch_idx, block_table, step)
    launch, outs, extra = _append_launch(tq, step, block_table is not None, batch_idx is not None, arrays)
    outs = [replace(o, returned=True) for o in outs]
    return Plan("decode", "append", _dtype_name(tq.dtype), tq.shape[3], opts.describe(), limits,
                "the append and rotation kernel", None, (launch,) if tq.shape[0] else (), arrays, {},
                tuple(inputs + extra), tuple(outs), tq.kind)


def decode_warps(D, blocks, max_seqlen_k, limits, num_splits=0, stages=None, page=0, simulated=False) -> tuple:
    """(warps, shared bytes, blocks an SM, splits) of the decoding kernel: of :data:`DECODE_WARPS` (fewer where
    a GPU's shared memory holds none of them), the one whose call streams the fewest keys an SM, taken as the
    waves of blocks times the tiles a block reads (plus :data:`DECODE_FIXED_TILES`) times the keys an SM's blocks
    read a tile; on a tie the larger tile (fewer blocks, fewer splits to combine). So at batch 1 (eight key/value
    heads) 8 warps in 16 splits and 4 warps in 32 stream alike and 8 are taken; at batch 32 one wave of 4-warp
    blocks beats two of 8-warp ones. A paged cache (``page`` keys a page) takes only tiles that its pages hold
    whole where there are such (one block-table read a tile instead of one a row)."""
    S = stages or mma_decode.STAGES
    # (``simulated``, a plan the simulator runs, takes the fewest: each simulated thread is a Python thread, and
    # 8-warp blocks run the same code at twice the cost; tests/test_kvcache.py runs 8-warp blocks by asking)
    candidates = (min(DECODE_WARPS),) if simulated else DECODE_WARPS
    options = [w for w in candidates if mma_decode.shared_bytes(D, w, DECODE_KW, S) <= limits.max_shared_per_block]
    w = min(DECODE_WARPS)
    while not options and w > 1:  # (large head dims on GPUs of 99 or 64 KB a block)
        w //= 2
        if mma_decode.shared_bytes(D, w, DECODE_KW, S) <= limits.max_shared_per_block:
            options.append(w)
    if not options:
        raise ValueError(f"the split-KV kernel at head_dim {D} needs {mma_decode.shared_bytes(D, 1, DECODE_KW, S)} "
                         f"bytes of shared memory, more than this GPU's {limits.max_shared_per_block}; pass "
                         f"kernel='gather'")
    whole = [w for w in options if page % (w * DECODE_KW) == 0]
    if page and whole:
        options = whole
    best = None
    for W in options:
        smem = mma_decode.shared_bytes(D, W, DECODE_KW, S)
        per_sm = max(1, min(limits.blocks_per_sm, limits.shared_per_sm // smem, limits.threads_per_sm // (32 * W),
                            limits.registers_per_sm // (DECODE_REGISTERS * 32 * W)))
        n_tiles = _cdiv(max_seqlen_k, W * DECODE_KW)
        splits = min(num_splits, MAX_SPLITS) or decode_splits(blocks, n_tiles, limits, per_sm)
        waves = _cdiv(blocks * splits, max(1, (limits.sm_count or 108) * per_sm))
        keys = waves * (_cdiv(n_tiles, splits) + DECODE_FIXED_TILES) * W * per_sm
        if best is None or (keys, -W) < best[0]:
            best = ((keys, -W), (W, smem, per_sm, splits))
    return best[1]


def decode_plan(tq, tk, tv, opts, *, seqlens, batch_idx, block_table, max_seqlen_k, num_splits=0, return_lse=True,
                stages=None, device=None, step: DecodeStep | None = None, leftpad=None) -> Plan:
    """The plan of a decoding call (:func:`flashnumba.flash_attn_with_kvcache` on the split-KV kernel): tq (batch,
    seqlen_q, nheads, D) the queries, tk, tv the cache (C-contiguous), seqlens the (batch,) int32 keys per
    sequence before the step, batch_idx or block_table (int32 Tensors, or None: sequence b reads cache entry b),
    leftpad (an int32 Tensor (batch,), not with block_table, or None: where each sequence's keys start),
    ``max_seqlen_k`` a bound on the keys after the step (the cache's capacity: the lengths themselves may live on
    the device, unread), ``step`` what runs first (new keys, rotations; :class:`DecodeStep`). ``num_splits`` above
    :data:`MAX_SPLITS` counts as MAX_SPLITS (as in flash-attn). The call takes the arrays in the order of
    :func:`_decode_inputs` and returns out, and lse with ``return_lse`` (else the kernels write it to the call's
    scratch). ``stages``: the kernel's K, V buffers (None: its default,
    :data:`flashnumba.kernels.mma_decode.STAGES`)."""
    limits = resolve_device(device, (tq, tk, tv))
    step = step or DecodeStep()
    batch, seqlen_q, nheads, D = tq.shape
    nheads_k = tk.shape[2]
    paged = block_table is not None
    indexed = batch_idx is not None
    dt = tq.dtype
    KW, S = DECODE_KW, stages or mma_decode.STAGES
    zrows = _cdiv(seqlen_q * (nheads // nheads_k), mma_decode.ROWS)
    W, smem, per_sm, splits = decode_warps(D, batch * nheads_k * zrows, max_seqlen_k, limits, num_splits, S,
                                           tk.shape[1] if paged else 0, simulated=SIMULATOR and device is None)
    split = splits > 1
    rotary = step.rotary_cos is not None
    # the kernel's cp.async copies read q as C-contiguous rows from a 16-byte start (a rotated q is the call's own)
    copy_q = not rotary and (not _c_layout(tq) or not _arrays.starts_aligned(tq.array))
    inputs, arrays = _decode_inputs(tq, tk, tv, opts, seqlens, batch_idx, block_table, step, copy_q=copy_q,
                                    leftpad=leftpad)
    launches, pre_outs = [], []
    if step.runs:
        launch, pre_outs, extra = _append_launch(tq, step, paged, indexed, arrays)
        launches.append(launch)
        inputs += extra
    out_spec, arrays["out"] = _output("out", tq.shape, dt, False)
    # (without splits the attention kernel writes lse, and nothing reads it unless it is returned; the partials
    # are then stand-ins the kernel never touches)
    lse_spec, arrays["lse"] = _output("lse", (batch, nheads, seqlen_q), np.dtype(np.float32), False,
                                      returned=return_lse, discarded=not split)
    f32 = np.dtype(np.float32)
    part = (splits, batch, seqlen_q, nheads, D) if split else (1, 1, 1, 1, 1)
    lpart = (splits, batch, nheads, seqlen_q) if split else (1, 1, 1, 1)
    opart_spec, arrays["o_part"] = _output("o_part", part, f32, False, returned=False, discarded=not split)
    lpart_spec, arrays["lse_part"] = _output("lse_part", lpart, f32, False, returned=False, discarded=not split)
    scalars = _option_scalars(opts)
    has_left, has_right, softcap, alibi, _, _ = opts.variant
    dname = _dtype_name(dt)
    why = (f"the split-KV kernel: the {nheads // nheads_k} query heads of a key/value head as rows of one tile, "
           f"the keys in {splits} part{'s' if split else ''} (num_splits={num_splits})")
    launches.append(KernelLaunch("decode split-KV", "decode", mma_decode.make_decode_tc,
                                 (D, W, KW, dname, has_left, has_right, softcap, alibi, paged, split, S, indexed,
                                  leftpad is not None),
                                 ("q_rot" if rotary else "q", "k_cache", "v_cache", "out", "lse", "o_part", "lse_part",
                                  "seqlens_out" if step.runs else "seqlens_k", "batch_idx", "block_table", "alibi",
                                  "leftpad", "scale_q", "softcap", "left", "right"),
                                 (splits, batch * nheads_k, zrows), (32 * W,), smem, None,
                                 f"{W} warps of {KW} keys a tile, {S} buffers; {per_sm} blocks an SM by shared "
                                 f"memory, threads and registers"))
    if split:
        launches.append(KernelLaunch("decode combine", "decode", mma_decode.make_combine, (dname,),
                                     ("o_part", "lse_part", "out", "lse"), (seqlen_q, batch * nheads),
                                     (min(256, 32 * _cdiv(D, 32)),), 0, None, "the splits' exact combination"))
    if batch * seqlen_q * nheads == 0:  # (nothing to attend; new keys of an empty query batch: none either)
        launches = [x for x in launches if x.name == "decode append" and batch]
    return Plan("decode", "splitkv", dname, D, opts.describe(), limits, why, None, tuple(launches), arrays, scalars,
                tuple(inputs), (out_spec, lse_spec, opart_spec, lpart_spec, *pre_outs), tq.kind)


# ---------------------------------------------------------------------------------------------------------------
# backward
# ---------------------------------------------------------------------------------------------------------------


def _fit_block_mask(table, D, block_mask, t, reason):
    """(Tiles, reason) of a tensor-core backward kernel that reads a block mask: block_m and block_n the largest
    of the kernel's (:data:`flashnumba.kernels.mma_backward.TILES`) not above t's that divide the mask's query and
    key blocks (a tile never straddles two blocks); t itself without a block mask or where it divides them."""
    if block_mask is None:
        return t, reason
    qb, kb = block_mask[:2]
    m = max(x for x in mma_backward.TILES if x <= t.block_m and qb % x == 0)
    n = max(x for x in mma_backward.TILES if x <= t.block_n and kb % x == 0)
    if (m, n) == (t.block_m, t.block_n):
        return t, reason
    return (tiling.threads_of(table, tiling.Tiles(m, n, 0), D),
            f"{reason}; (block_m {m}, block_n {n}) to divide the block mask's blocks ({qb}, {kb})")


def _hopper_3xtf32_backward_tiles(D, limits, block_m, block_n, num_threads):
    """(dQ's Tiles, dK/dV's Tiles, reason) of the 3xTF32 backward on wgmma (:func:`_hopper_3x`): each kernel's own
    rows a block are 64 (one warpgroup), its loop tiles the caller's (block_n: the dQ kernel's keys a tile, block_m:
    the dK/dV kernel's query rows a tile) or :mod:`flashnumba.kernels.wgmma_tf32_backward`'s default, checked
    against its tiles and the device's shared memory."""
    own, loop = wgmma_tf32_backward.ROWS, wgmma_tf32_backward.LOOP_ROWS.get(D, ())
    n, m = block_n or wgmma_tf32_backward.DEFAULT_LOOP_ROWS, block_m or wgmma_tf32_backward.DEFAULT_LOOP_ROWS
    if n not in loop or m not in loop or num_threads is not None:
        raise ValueError(f"the 3xTF32 backward on wgmma at head_dim {D} takes block_m (the dK/dV kernel's query "
                         f"rows a tile) and block_n (the dQ kernel's keys a tile) in {loop}; its blocks are {own} "
                         f"rows of 128 threads (no num_threads)")
    for what, smem in (("dQ", wgmma_tf32_backward.shared_bytes_dq(D, n)),
                       ("dK/dV", wgmma_tf32_backward.shared_bytes_dkdv(D, m))):
        if smem > limits.max_shared_per_block:
            raise ValueError(f"the 3xTF32 {what} kernel on wgmma at head_dim {D} needs {smem} bytes of shared "
                             f"memory, more than the {limits.max_shared_per_block} a block may use here")
    return tiling.Tiles(own, n, 128), tiling.Tiles(m, own, 128), _hopper_3x_reason(block_m, block_n)


def backward_plan(tdo, tq, tk, tv, to, tl, opts, *, kernel=None, block_m=None, block_n=None, num_threads=None,
                  device=None, batch=None, max_seqlen_q=None, max_seqlen_k=None, cu=None,
                  deterministic=True) -> Plan:
    """The plan of a backward call: the D_i preprocess, then the dQ and the dK/dV kernels; on the tensor cores
    with ``deterministic=False``, the dK/dV kernel adding dQ into a float32 accumulator with atomics, then its
    conversion (:func:`flashnumba.kernels.mma_backward.make_backward_dkdv_tc`)."""
    limits = resolve_device(device, (tdo, tq, tk, tv, to, tl))
    simulated = SIMULATOR and device is None  # (a plan for a named architecture is that GPU's)
    lead = cu is not None
    tiles_given = (block_m, block_n, num_threads) != (None, None, None)
    family, why, fallback = choose("backward", kernel, tq, (tq, tk, tv, tdo, to), opts, limits, tiles_given,
                                   deterministic, simulated)
    bsz = tq.shape[0] if batch is None else batch
    shape4 = (1, *tq.shape) if lead else tq.shape
    lead_n, total_q, nheads, D_user = shape4
    D = padded_head_dim(family, D_user)  # the head dim the kernels run (wider: the inputs copied with zero columns)
    pad = D if D != D_user else 0
    total_k = tk.shape[-3]
    max_q = total_q if max_seqlen_q is None else max_seqlen_q
    max_k = total_k if max_seqlen_k is None else max_seqlen_k
    nk = tk.shape[-2]
    dt, bf16 = tq.dtype, _arrays.is_bfloat16(tq.dtype)
    # dout, q, k, v go to the dQ / dK/dV kernels (copied where a tensor-core kernel needs C-contiguous rows);
    # out and lse only to the preprocess and as read
    inputs, arrays = _inputs((tdo, tq, tk, tv), family, lead, opts, bsz, cu, len(BLOCK_MASK_PARAMS), pad)
    for t in (to, tl):  # after dout, q, k, v; before alibi, cu_q, cu_k and the score_mod arrays
        p = pad if t is to else 0
        inputs.insert(next(n for n, s in enumerate(inputs) if s.name == "alibi"),
                      InputSpec(t.name, t.kind, to_device=t.kind == "numpy" and not p, lead=lead, pad=p))
        arrays[t.name] = _kernel_meta(t, lead, False, p)
    outs = []
    for name, like_t in (("dq", tq), ("dk", tk), ("dv", tv)):
        spec, arrays[name] = _output(name, like_t.shape, dt, lead, width=pad)
        outs.append(spec)
    delta_user = (nheads, total_q) if lead else (lead_n, nheads, total_q)
    spec, arrays["delta"] = _output("delta", delta_user, np.dtype(np.float32), lead, returned=False)
    outs.append(spec)
    scalars = _option_scalars(opts)
    launches = []
    if SIMULATOR:  # a thread per row (32x fewer simulated threads)
        pre = KernelLaunch("D_i preprocess", "preprocess", simt_backward.make_backward_preprocess, (D, 64, bf16),
                           ("dout", "out", "delta"), (_cdiv(total_q, 64), lead_n * nheads), (64,), 0)
    else:  # a warp per row: coalesced loads
        r = PREPROCESS_ROWS
        pre = KernelLaunch("D_i preprocess", "preprocess", simt_backward.make_backward_preprocess_warp, (D, r, bf16),
                           ("dout", "out", "delta"), (_cdiv(total_q, r), lead_n * nheads), (32 * r,), 0)
    io_dq = ("dout", "q", "k", "v", "lse", "delta", "dq")
    io_kv = ("dout", "q", "k", "v", "lse", "delta", "dk", "dv")
    atomic = False  # dQ added by the dK/dV kernel (tensor cores, deterministic=False)
    if family == "tc":
        # the atomic dQ: on sm_90 and newer a lane's two columns in one vector reduction
        atomic = False if deterministic else "v2" if tuple(limits.cc) >= (9, 0) else True
        kv_table = "tc_dkdv_atomic" if atomic else "tc_dkdv"
        tk_t, rk = _fit_block_mask(kv_table, D, opts.block_mask, *tiling.resolve(kv_table, D, limits, block_m,
                                                                                   block_n, num_threads))
        tail = ("scale_log2", "scale") + OPTION_PARAMS
        blocks = None if opts.block_mask is None else opts.block_mask[:2]
        name, gqa, strided = _dtype_name(dt), nk != nheads, _strided(arrays, ("dout", "q", "k", "v"))
        if atomic:  # dQ accumulated in float32 by the dK/dV kernel, zero at the start, then converted
            spec, arrays["dq_acc"] = _output("dq_acc", tq.shape, np.dtype(np.float32), lead, returned=False)
            outs.append(replace(spec, zeroed=True))
            rows, threads = (1, 32) if SIMULATOR else (4, 256)
            dq = KernelLaunch("dQ convert", "convert", mma_backward.make_dq_convert, (D, name, rows, threads),
                              ("dq_acc", "dq", "scale"), (_cdiv(total_q, rows), lead_n), (threads,), 0)
        else:  # the dQ kernel; the dK/dV kernel's dq_acc parameter a dummy, never read
            spec, arrays["dq_acc"] = _optional_input("dq_acc", None, (1, 1, 1, 1), "float32")
            inputs.append(spec)
            tq_t, rq = _fit_block_mask("tc_dq", D, opts.block_mask, *tiling.resolve("tc_dq", D, limits, block_m,
                                                                                    block_n, num_threads))
            dq = KernelLaunch("dQ tc", "tc_dq", mma_backward.make_backward_dq_tc,
                              (D, opts.variant, tq_t.block_m, tq_t.block_n, name, gqa, strided, opts.mods, blocks),
                              io_dq + tail + MOD_PARAMS + BLOCK_MASK_PARAMS[:3],
                              (_cdiv(max_q, tq_t.block_m), bsz * nheads), (tq_t.num_threads,),
                              tiling.shared_bytes("tc_dq", D, tq_t)[0], tq_t, rq)
        kv = KernelLaunch("dK/dV tc" + (" + dQ" if atomic else ""), kv_table, mma_backward.make_backward_dkdv_tc,
                          (D, opts.variant, tk_t.block_m, tk_t.block_n, name, gqa, strided, opts.mods, atomic,
                           blocks),
                          io_kv + ("dq_acc",) + tail + MOD_PARAMS + BLOCK_MASK_PARAMS[3:] + BLOCK_MASK_PARAMS[2:3],
                          (_cdiv(max_k, tk_t.block_n), bsz * nk), (tk_t.num_threads,),
                          tiling.shared_bytes(kv_table, D, tk_t)[0], tk_t, rk)
    elif family == "wgmma":  # (deterministic either way: no atomics)
        tq_t, rq = tiling.resolve("wgmma_dq", D, limits, block_m, block_n, num_threads)
        tk_t, rk = tiling.resolve("wgmma_dkdv", D, limits, block_m, block_n, num_threads)
        n = min(total_q, total_k)
        tk_own, why_own = tiling.wgmma_dkdv_for_variant(
            tk_t, opts.variant, D, ["block_m"] if block_m else [],
            tma=(_takes_tma_backward(D, opts, "dkdv", tk_t._replace(block_m=32), n)
                 and not _takes_tma_backward(D, opts, "dkdv", tk_t, n)))
        if why_own:
            tk_t, rk = tk_own, f"{rk}; {why_own}"
        tq_own, why_own = tiling.wgmma_dq_for_variant(
            tq_t, opts.variant, ["block_n"] if block_n else [], D, tma=_takes_tma_backward(D, opts, "dq", tq_t, n),
            block_masked=(opts.block_mask is not None and opts.mods is not None and opts.mods.score_mod is None))
        if why_own:
            tq_t, rq = tq_own, f"{rq}; {why_own}"
        given = [name for name, x in (("block_m", block_m), ("block_n", block_n)) if x]
        tq_t, tk_t, why_q, why_k = tiling.wgmma_backward_for_mods(
            tq_t, tk_t, opts.mods is not None and opts.mods.score_mod is not None, given, opts.mods_table_tiles)
        rq, rk = (f"{r}; {why}" if why else r for r, why in ((rq, why_q), (rk, why_k)))
        tail = ("scale_log2", "scale") + OPTION_PARAMS
        name, gqa = _dtype_name(dt), nk != nheads
        span = wgmma_forward.swizzle_span(D)
        blocks = None if opts.block_mask is None else opts.block_mask[:2]
        tq_own, tk_own, why_own = tiling.wgmma_backward_for_block_mask(tq_t, tk_t, blocks, D, given)
        if why_own:
            tq_t, tk_t = tq_own, tk_own
            rq, rk = f"{rq}; {why_own}", f"{rk}; {why_own}"
        if blocks is not None:
            for t in (tq_t, tk_t):  # (tiles the caller gave may not divide them)
                _check_block_mask_tiles(opts, t)
            if gqa and opts.block_mask[2].shape[1] > 1:
                raise ValueError("the wgmma backward takes, with fewer key/value heads than query heads, a block "
                                 "mask made for every head (H = 1); one per head: kernel='tc'")
        launched = []
        for which, t, reason, rows, loop, maps in (("dq", tq_t, rq, tq_t.block_m, tq_t.block_n,
                                                    wgmma_backward.DQ_MAPS),
                                                   ("dkdv", tk_t, rk, tk_t.block_n, tk_t.block_m,
                                                    wgmma_backward.DKDV_MAPS)):
            # a producer warpgroup copies with tensor maps where the kernel takes them (rows: the tiles loaded
            # once, loop: those of the pipeline)
            tma = _takes_tma_backward(D, opts, which, t, n)
            param = f"maps_{which}"
            arrays[param] = array_meta((len(maps) if tma else 1, MAP_WORDS), (8 * MAP_WORDS, 8), np.uint64, "C")
            wg = _wgmma_warpgroups(which, D, t)
            if tma:
                t = t._replace(num_threads=wgmma_backward.threads(wg, True))
                reason = f"{reason}; a producer warpgroup copies the tiles with the copy engine (tensor maps)"
            rows_of = dict(zip(maps, (rows, rows, loop, loop)))
            kv = which == "dkdv"
            exchange = kv and wgmma_backward.exchanges(D, config.hopper_exchange)
            if exchange:
                reason = (f"{reason}; its two warpgroups multiply half of the head dims each into S^T and dP^T and "
                          "exchange the partial sums")
            stages, smem = wgmma_backward.pipeline(which, D, t.block_m, t.block_n, tma, limits.max_shared_per_block,
                                                   exchange)
            if stages != wgmma_backward.STAGES:
                reason = f"{reason}; {stages} buffers in the pipeline (the shared memory's room)"
            if smem > limits.max_shared_per_block:  # (three buffers without the producer's tensor-map copies)
                raise ValueError(f"the wgmma {'dQ' if which == 'dq' else 'dK/dV'} kernel at tiles {tuple(t)[:2]} "
                                 f"needs {smem} bytes of shared memory without the tensor-map copies (this call does "
                                 f"not take them), more than the {limits.max_shared_per_block} a block may use here; "
                                 f"the plan's own tiles fit (leave block_m and block_n out)")
            grid = ((_cdiv(max_q, t.block_m), bsz * nheads) if which == "dq" else (_cdiv(max_k, t.block_n), bsz * nk))
            launched.append(KernelLaunch(
                "dQ wgmma" if which == "dq" else "dK/dV wgmma", f"wgmma_{which}",
                wgmma_backward.make_backward_dq_wgmma if which == "dq" else wgmma_backward.make_backward_dkdv_wgmma,
                (D, opts.variant, loop, wg, name, gqa, tma, opts.mods, blocks) + ((exchange,) if kv else ())
                + (stages,),
                (io_dq if which == "dq" else io_kv) + tail + (param,) + MOD_PARAMS
                + (BLOCK_MASK_PARAMS[:3] if which == "dq" else BLOCK_MASK_PARAMS[3:] + BLOCK_MASK_PARAMS[2:3]),
                grid, (t.num_threads,), smem, t, reason, arch_specific=True, whole_program=tma,
                tensor_maps=tuple((m, rows_of[m], span) for m in maps) if tma else ()))
        dq, kv = launched
    elif _hopper_3x(family, limits, simulated):
        tq_t, tk_t, reason = _hopper_3xtf32_backward_tiles(D, limits, block_m, block_n, num_threads)
        tail = ("scale_log2", "scale")
        chained = config.hopper_3xtf32 == "chained"
        dq = KernelLaunch("dQ 3xtf32 wgmma", "3xtf32_wgmma_dq", wgmma_tf32_backward.make_backward_dq_3xtf32_wgmma,
                          (D, opts.right == 0, tq_t.block_n, chained), io_dq + tail,
                          (_cdiv(max_q, tq_t.block_m), bsz * nheads), (tq_t.num_threads,),
                          wgmma_tf32_backward.shared_bytes_dq(D, tq_t.block_n), tq_t, reason, arch_specific=True)
        kv = KernelLaunch("dK/dV 3xtf32 wgmma", "3xtf32_wgmma_dkdv",
                          wgmma_tf32_backward.make_backward_dkdv_3xtf32_wgmma, (D, opts.right == 0, tk_t.block_m,
                                                                                chained), io_kv + tail,
                          (_cdiv(max_k, tk_t.block_n), bsz * nk), (tk_t.num_threads,),
                          wgmma_tf32_backward.shared_bytes_dkdv(D, tk_t.block_m), tk_t, reason, arch_specific=True)
    elif family in mma_tf32.PRECISIONS:
        tq_t, rq = tiling.resolve("tf32_dq", D, limits, block_m, block_n, num_threads)
        tk_t, rk = tiling.resolve("tf32_dkdv", D, limits, block_m, block_n, num_threads)
        tail = ("scale_log2", "scale")
        dq = KernelLaunch(f"dQ {family}", "tf32_dq", mma_tf32_backward.make_backward_dq_tf32,
                          (D, opts.right == 0, family, tq_t.block_n, tq_t.block_m // WARP_ROWS), io_dq + tail,
                          (_cdiv(max_q, tq_t.block_m), bsz * nheads), (tq_t.num_threads,),
                          tiling.shared_bytes("tf32_dq", D, tq_t)[0], tq_t, rq)
        kv = KernelLaunch(f"dK/dV {family}", "tf32_dkdv", mma_tf32_backward.make_backward_dkdv_tf32,
                          (D, opts.right == 0, family, tk_t.block_m, tk_t.block_n // WARP_ROWS), io_kv + tail,
                          (_cdiv(max_k, tk_t.block_n), bsz * nk), (tk_t.num_threads,),
                          tiling.shared_bytes("tf32_dkdv", D, tk_t)[0], tk_t, rk)
    elif family == "v1":
        t, reason = tiling.resolve("bwd_v1", D, limits, block_m, block_n, num_threads,
                                   simulated=simulated)
        dq = KernelLaunch("dQ v1", "bwd_v1", simt_backward.make_backward_dq_v1,
                          (D, t.block_m, t.block_n, opts.right == 0, bf16), io_dq + ("scale",),
                          (_cdiv(max_q, t.block_m), bsz * nheads), (t.block_m,), 0, t, reason)
        kv = KernelLaunch("dK/dV v1", "bwd_v1", simt_backward.make_backward_dkdv_v1,
                          (D, t.block_m, t.block_n, opts.right == 0, bf16), io_kv + ("scale",),
                          (_cdiv(max_k, t.block_n), bsz * nk), (t.block_n,), 0, t, reason)
    else:
        t, reason = tiling.resolve("bwd_v2", D, limits, block_m, block_n, num_threads,
                                   simulated=simulated)
        args = (D, t.block_m, t.block_n, t.num_threads, opts.variant, bf16, opts.mods)
        dq = KernelLaunch("dQ v2", "bwd_v2", simt_backward.make_backward_dq_v2, args,
                          io_dq + ("scale",) + OPTION_PARAMS + MOD_PARAMS, (_cdiv(max_q, t.block_m), bsz * nheads),
                          (t.num_threads,), tiling.shared_bytes("bwd_v2_dq", D, t)[0], t, reason)
        kv = KernelLaunch("dK/dV v2", "bwd_v2", simt_backward.make_backward_dkdv_v2, args,
                          io_kv + ("scale",) + OPTION_PARAMS + MOD_PARAMS, (_cdiv(max_k, t.block_n), bsz * nk),
                          (t.num_threads,), tiling.shared_bytes("bwd_v2_dkdv", D, t)[0], t, reason)
    if bsz * nheads and (total_q or total_k):
        if total_q:
            launches.append(pre)
        if atomic:  # dQ by the dK/dV kernel, then converted
            if max_k:
                launches.append(kv)
            if total_q:
                launches.append(dq)
        else:
            if max_q:
                launches.append(dq)
            if max_k:
                launches.append(kv)
    if pad:
        words = _padding(D_user, D, (tdo, tq, tk, tv, to))
        launches = [replace(x, reason=f"{x.reason}; {words}") if x.tiles is not None else x for x in launches]
    return Plan("backward", family, _dtype_name(dt), D_user, opts.describe(), limits, why, fallback, tuple(launches),
                arrays, scalars, tuple(inputs), tuple(outs), tq.kind)


# ---------------------------------------------------------------------------------------------------------------
# the probabilities (return_attn_probs)
# ---------------------------------------------------------------------------------------------------------------


def probs_plan(tq, tk, tl, opts, device=None) -> Plan:
    limits = resolve_device(device, (tq, tk, tl))
    batch, seqlen_q, nheads, D = tq.shape
    seqlen_k = tk.shape[1]
    inputs, arrays = _inputs((tq, tk), "v3", False, opts, batch, None)
    inputs.insert(2, InputSpec("lse", tl.kind, to_device=tl.kind == "numpy"))
    arrays["lse"] = _kernel_meta(tl, False, False)
    spec, arrays["probs"] = _output("probs", (batch, nheads, seqlen_q, seqlen_k), np.dtype(np.float32), False)
    launch = KernelLaunch("probs", "probs", simt_forward.make_probs_kernel,
                          (D, opts.variant, _arrays.is_bfloat16(tq.dtype)),
                          ("q", "k", "lse", "probs", "scale", "softcap", "left", "right", "alibi", "p_drop",
                           "rp_keep", "seed", "offset"), (seqlen_q, batch * nheads), (min(128, max(32, seqlen_k)),),
                          0)
    empty = batch * nheads * seqlen_q * seqlen_k == 0
    return Plan("probs", "probs", _dtype_name(tq.dtype), D, opts.describe(), limits, "the debugging path", None,
                () if empty else (launch,), arrays, _option_scalars(opts), tuple(inputs), (spec,), tq.kind)
