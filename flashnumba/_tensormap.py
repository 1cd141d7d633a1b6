"""Tensor maps: how a Hopper kernel's copy engine (TMA) is told where a tensor lies.

A tensor-map copy (``flashnumba.kernels.ptx_hopper.tma_load_4d``) names its source by a 128-byte *tensor map*:
the tensor's base address, its dims (innermost first), byte strides, the box a copy fetches and the swizzle it
writes. The driver encodes one (``cuTensorMapEncodeTiled``); the kernel reads it from global memory. A map is a
function of the array's address and geometry alone, so the maps of a call are kept by those (a call with the same
arrays, or new ones at the same addresses, reuses them), in slots of memory allocated once a device, and written
to the GPU once, by an asynchronous copy on the call's stream from pinned memory that is not rewritten while the
slot is in use: the copy is ordered before the kernel that reads it, and a CUDA graph that captured it replays the
same bytes. A set is copied again where a later call runs on another stream, so that the copy is ordered before
that stream's kernel too, and where its copy was only recorded by a capture. A call first made inside a capture
allocates nothing (the slots exist from the first call with maps). Up to :data:`MAX_KEPT` sets are kept a device;
past that, the slots are written afresh once the GPU has run what was queued (:func:`reset`; inside a capture that
is an error), and a CUDA graph captured before then must be captured again.

The layout the Hopper forward reads: a C-contiguous (batch, seqlen, nheads, head_dim) array of 16-bit elements as
the 4-D tensor (head_dim, nheads, seqlen, batch), innermost first, boxes of (E, 1, rows, 1): ``rows`` rows of E
head dims of one head, where a row of the swizzle holds E (64 for the 128-byte swizzle, 32 for the 64-byte one).
Rows past seqlen read as zeros.

Under the simulator a map is :func:`flashnumba.kernels.ptx_hopper.sim_tensor_map`'s stand-in, made at every call.
"""

from __future__ import annotations

import ctypes
import threading

import numpy as np

from . import _driver
from ._backend import cuda
from .kernels import ptx_hopper

MAX_KEPT = 4096  # sets of maps kept a device (SET_MAPS maps of 128 bytes each, on the GPU and pinned on the host)

# cuda.h's enums (CUtensorMapDataType, ...Interleave, ...Swizzle, ...L2promotion, ...FloatOOBfill)
_UINT16, _INTERLEAVE_NONE, _L2_PROMOTION_256B, _OOB_FILL_ZERO = 1, 0, 3, 0
_SWIZZLE = {32: 1, 64: 2, 128: 3}  # CU_TENSOR_MAP_SWIZZLE_32B, _64B, _128B by the bytes of a row


def geometry(shape, rows, span):
    """(dims, byte strides, box) of a C-contiguous (batch, seqlen, nheads, head_dim) 16-bit array read in boxes of
    ``rows`` rows of ``span`` bytes (span / 2 head dims; module docstring)."""
    b, s, h, d = (int(n) for n in shape)
    if span not in _SWIZZLE or d % (span // 2):
        raise ValueError(f"a tensor map of this layout takes rows of 32, 64 or 128 bytes dividing head_dim, got "
                         f"{span} bytes, head_dim {d}")
    return (d, h, s, b), (2 * d, 2 * d * h, 2 * d * h * s), (span // 2, 1, int(rows), 1)


_encode_fn = None


def _encoder():
    global _encode_fn
    if _encode_fn is None:
        lib = ctypes.CDLL("libcuda.so.1")
        fn = lib.cuTensorMapEncodeTiled
        fn.restype = ctypes.c_int
        u32p, u64p = ctypes.POINTER(ctypes.c_uint32), ctypes.POINTER(ctypes.c_uint64)
        fn.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32, ctypes.c_void_p, u64p, u64p, u32p, u32p,
                       ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int]
        _encode_fn = fn
    return _encode_fn


def encode(address: int, dims, strides, box, out: np.ndarray) -> None:
    """Encode the map of 16-bit elements at device ``address`` with ``dims``, byte ``strides`` (of the dims after
    the first) and ``box``, swizzled in rows of the box's inner dim (32, 64 or 128 bytes), zeros out of bounds,
    into ``out`` (16 uint64, 64-byte aligned)."""
    rank = len(dims)
    u64, u32 = ctypes.c_uint64 * rank, ctypes.c_uint32 * rank
    err = _encoder()(out.ctypes.data, _UINT16, rank, ctypes.c_void_p(address), u64(*dims),
                     (ctypes.c_uint64 * (rank - 1))(*strides), u32(*box), u32(*([1] * rank)), _INTERLEAVE_NONE,
                     _SWIZZLE[2 * box[0]], _L2_PROMOTION_256B, _OOB_FILL_ZERO)
    if err != 0:
        raise RuntimeError(f"cuTensorMapEncodeTiled failed with CUDA error {err} (address {address:#x}, dims {dims}, "
                           f"strides {strides}, box {box})")


SET_MAPS = 4  # maps a set holds at most (the forward's: q, k, v)


class _Slab:
    """The sets of maps of one device, in slots of :data:`SET_MAPS` maps: the device memory the kernels read, the
    pinned host memory each slot is copied from (never rewritten while its slot is in use), the slot of each key
    and, of each slot, the streams its copy was ordered on (none while only a capture recorded it). Allocated once,
    at the first call that needs maps, so that a call first made inside a CUDA graph capture allocates nothing."""

    def __init__(self, slots):
        words = SET_MAPS * ptx_hopper.MAP_WORDS
        self.host = cuda.pinned_array((slots * words + 8,), np.uint64)  # (room to start on 64 bytes)
        skip = (-self.host.ctypes.data % 64) // 8
        self.words = self.host[skip:skip + slots * words].reshape(slots, words)
        self.device = cuda.device_array((slots, words), np.uint64)
        self.address = self.device.device_ctypes_pointer.value
        self.slot = {}  # key -> slot
        self.streams = [set() for _ in range(slots)]


_slabs: dict = {}  # device id -> _Slab
_lock = threading.Lock()


def _copy(slab: _Slab, slot: int, stream: int) -> None:
    """The copy of a slot's maps to the GPU, ordered on ``stream``; remembered for that stream unless it is being
    captured (then the copy runs only when the graph does)."""
    words = slab.words[slot]
    _driver.check(_driver.driver().cuMemcpyHtoDAsync(slab.address + slot * words.nbytes, words.ctypes.data,
                                                     words.nbytes, stream), "cuMemcpyHtoDAsync (tensor maps)")
    if not _driver.stream_capturing(stream):
        slab.streams[slot].add(stream)


def device_maps(entries, stream: int) -> int:
    """The device address of the maps of ``entries`` ((address, shape, rows, span) each: a C-contiguous 16-bit
    array of that shape at that device address, read in boxes of ``rows`` rows of ``span`` bytes), in that order
    (each 16 uint64), their copy ordered on ``stream`` before anything enqueued there after the call."""
    if len(entries) > SET_MAPS:
        raise ValueError(f"a set holds at most {SET_MAPS} tensor maps, got {len(entries)}")
    device = cuda.get_current_device().id
    key = tuple((int(a), tuple(s), int(r), int(sp)) for a, s, r, sp in entries)
    with _lock:
        slab = _slabs.get(device)
        if slab is None:
            slab = _slabs[device] = _Slab(MAX_KEPT)
        slot = slab.slot.get(key)
        if slot is None:
            slot = len(slab.slot)
            if slot == MAX_KEPT:  # every slot taken: start over once every kernel that reads one has run
                if _driver.stream_capturing(stream):
                    raise RuntimeError(f"the {MAX_KEPT} sets of tensor maps are taken and a CUDA graph is being "
                                       f"captured: capture after fewer distinct input arrays, or call "
                                       f"flashnumba._tensormap.reset() outside the capture")
                _forget(slab)
                slot = 0
            for i, (address, shape, rows, span) in enumerate(key):
                encode(address, *geometry(shape, rows, span), slab.words[slot, 16 * i:16 * i + 16])
            slab.slot[key] = slot
            slab.streams[slot].clear()
        if stream not in slab.streams[slot]:
            _copy(slab, slot, stream)
        return slab.address + slot * slab.words[slot].nbytes


def _forget(slab: _Slab) -> None:
    cuda.synchronize()  # (no kernel queued may still read a slot about to be written afresh)
    slab.slot.clear()
    for streams in slab.streams:
        streams.clear()


def reset() -> None:
    """Forget every set of maps of the current device once the GPU has finished what was queued (the slots are
    then written afresh); a CUDA graph captured before must be captured again."""
    with _lock:
        slab = _slabs.get(cuda.get_current_device().id)
        if slab is not None:
            _forget(slab)


def sim_maps(entries):
    """Under the simulator: the stand-in maps of ``entries`` ((array, rows, span) each) as one (n, 16) device
    array."""
    words = np.stack([ptx_hopper.sim_tensor_map(a, *geometry(np.shape(a), rows, span), span=span)
                      for a, rows, span in entries])
    return cuda.to_device(words)


__all__ = ["geometry", "encode", "device_maps", "reset", "sim_maps"]
