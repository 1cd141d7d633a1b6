"""Tensor maps: how a Hopper kernel's copy engine (TMA) is told where a tensor lies.

A tensor-map copy (``flashnumba.kernels.ptx_hopper.tma_load_4d``) names its source by a 128-byte *tensor map*:
the tensor's base address, its dims (innermost first), byte strides, the box a copy fetches and the swizzle it
writes. The driver encodes one (``cuTensorMapEncodeTiled``); the kernel reads it from global memory. A map is a
function of the array's address and geometry alone, so the maps of a call are kept by those (a call with the same
arrays, or new ones at the same addresses, reuses them) and written to the GPU once, by an asynchronous copy on
the call's stream from pinned memory that is never rewritten: the copy is ordered before the kernel that reads it,
and a CUDA graph that captured it replays the same bytes. A map is copied again where a later call runs on
another stream, so that the copy is ordered before that stream's kernel too.

The layout the Hopper forward reads: a C-contiguous (batch, seqlen, nheads, head_dim) array of 16-bit elements as
the 4-D tensor (head_dim, nheads, seqlen, batch), innermost first, boxes of (64, 1, rows, 1): ``rows`` rows of 64
head dims (128 bytes, the 128-byte swizzle's span) of one head. Rows past seqlen read as zeros.

Under the simulator a map is :func:`flashnumba.kernels.ptx_hopper.sim_tensor_map`'s stand-in, made at every call.
"""

from __future__ import annotations

import ctypes
import threading

import numpy as np

from ._backend import cuda
from .kernels import ptx_hopper

MAP_BYTES = 128
SWIZZLE_BYTES = ptx_hopper.SWIZZLE_SPAN  # the 128-byte swizzle
BOX_INNER = SWIZZLE_BYTES // 2  # 16-bit elements of a box's row
MAX_KEPT = 4096  # map sets kept (each 128 bytes a map, on the GPU and pinned on the host)

# cuda.h's enums (CUtensorMapDataType, ...Interleave, ...Swizzle, ...L2promotion, ...FloatOOBfill)
_UINT16, _INTERLEAVE_NONE, _SWIZZLE_128B, _L2_PROMOTION_256B, _OOB_FILL_ZERO = 1, 0, 3, 3, 0


def geometry(shape, rows):
    """(dims, byte strides, box) of a C-contiguous (batch, seqlen, nheads, head_dim) 16-bit array read in boxes of
    ``rows`` rows of 64 head dims (module docstring)."""
    b, s, h, d = (int(n) for n in shape)
    if d % BOX_INNER:
        raise ValueError(f"a tensor map of this layout takes head_dim a multiple of {BOX_INNER}, got {d}")
    return (d, h, s, b), (2 * d, 2 * d * h, 2 * d * h * s), (BOX_INNER, 1, int(rows), 1)


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
    the first) and ``box``, 128-byte swizzle, zeros out of bounds, into ``out`` (16 uint64, 64-byte aligned)."""
    rank = len(dims)
    u64, u32 = ctypes.c_uint64 * rank, ctypes.c_uint32 * rank
    err = _encoder()(out.ctypes.data, _UINT16, rank, ctypes.c_void_p(address), u64(*dims),
                     (ctypes.c_uint64 * (rank - 1))(*strides), u32(*box), u32(*([1] * rank)), _INTERLEAVE_NONE,
                     _SWIZZLE_128B, _L2_PROMOTION_256B, _OOB_FILL_ZERO)
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
    """The device address of the maps of ``entries`` ((address, shape, rows) each: a C-contiguous 16-bit array of
    that shape at that device address, read in boxes of ``rows`` rows), in that order (each 16 uint64), their
    copy ordered on ``stream`` before anything enqueued there after the call."""
    key = tuple((int(a), tuple(s), int(r)) for a, s, r in entries)
    with _lock:
        maps = _kept.get(key)
        if maps is None:
            if len(_kept) >= MAX_KEPT:
                _kept.clear()
            maps = _Maps(len(key))
            for i, (address, shape, rows) in enumerate(key):
                encode(address, *geometry(shape, rows), maps.words[16 * i:16 * i + 16])
            _kept[key] = maps
        if stream not in maps.streams:
            _copy(maps, stream)
        return maps.address


def sim_maps(entries):
    """Under the simulator: the stand-in maps of ``entries`` ((array, rows) each) as one (n, 16) device array."""
    words = np.stack([ptx_hopper.sim_tensor_map(a, *geometry(np.shape(a), rows), swizzle=SWIZZLE_BYTES)
                      for a, rows in entries])
    return cuda.to_device(words)


__all__ = ["geometry", "encode", "device_maps", "sim_maps"]
