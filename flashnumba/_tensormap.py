"""Tensor maps: how a Hopper kernel's copy engine (TMA) is told where a tensor lies.

A tensor-map copy (``flashnumba.kernels.ptx_hopper.tma_load_4d``) names its source by a 128-byte *tensor map*:
the tensor's base address, its dims (innermost first), byte strides, the box a copy fetches and the swizzle it
writes. The driver encodes one (``cuTensorMapEncodeTiled``); the kernel reads it from global memory. A map is a
function of the array's address and geometry alone, so the maps of a call are kept by those (a call with the same
arrays, or new ones at the same addresses, reuses them) and written to the GPU once, by an asynchronous copy on
the call's stream from pinned memory that is never rewritten: the copy is ordered before the kernel that reads it,
and a CUDA graph that captured it replays the same bytes. A map is copied again where a later call runs on
another stream, so that the copy is ordered before that stream's kernel too. Up to :data:`MAX_KEPT` sets of maps
are kept (on each device); past that they are all dropped, and a CUDA graph captured before then must be captured
again.

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

from ._backend import cuda
from .kernels import ptx_hopper

MAP_BYTES = 128
MAX_KEPT = 4096  # map sets kept (each 128 bytes a map, on the GPU and pinned on the host)

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


class _Maps:
    """One set of maps on the GPU: the device copy, the pinned host bytes it is copied from, the streams that
    copy was ordered on."""

    def __init__(self, n):
        self.host = cuda.pinned_array((n * (ptx_hopper.MAP_WORDS + 8),), np.uint64)  # (room to align on 64 B)
        skip = (-self.host.ctypes.data % 64) // 8
        self.words = self.host[skip:skip + n * ptx_hopper.MAP_WORDS]
        self.device = cuda.device_array((n, ptx_hopper.MAP_WORDS), np.uint64)
        self.address = self.device.device_ctypes_pointer.value
        self.streams = set()


_kept: dict = {}
_lock = threading.Lock()


def _copy(maps: _Maps, stream: int) -> None:
    from ._launch import _check, _driver

    drv = _driver()
    _check(drv.cuMemcpyHtoDAsync(maps.address, maps.words.ctypes.data, maps.words.nbytes, stream),
           "cuMemcpyHtoDAsync (tensor maps)")
    maps.streams.add(stream)


def device_maps(entries, stream: int) -> int:
    """The device address of the maps of ``entries`` ((address, shape, rows, span) each: a C-contiguous 16-bit
    array of that shape at that device address, read in boxes of ``rows`` rows of ``span`` bytes), in that order
    (each 16 uint64), their
    copy ordered on ``stream`` before anything enqueued there after the call."""
    key = (cuda.get_current_device().id,) + tuple((int(a), tuple(s), int(r), int(sp)) for a, s, r, sp in entries)
    with _lock:
        maps = _kept.get(key)
        if maps is None:
            if len(_kept) >= MAX_KEPT:
                _kept.clear()
            maps = _Maps(len(entries))
            for i, (address, shape, rows, span) in enumerate(key[1:]):
                encode(address, *geometry(shape, rows, span), maps.words[16 * i:16 * i + 16])
            _kept[key] = maps
        if stream not in maps.streams:
            _copy(maps, stream)
        return maps.address


def sim_maps(entries):
    """Under the simulator: the stand-in maps of ``entries`` ((array, rows, span) each) as one (n, 16) device
    array."""
    words = np.stack([ptx_hopper.sim_tensor_map(a, *geometry(np.shape(a), rows, span), span=span)
                      for a, rows, span in entries])
    return cuda.to_device(words)


__all__ = ["geometry", "encode", "device_maps", "sim_maps"]
