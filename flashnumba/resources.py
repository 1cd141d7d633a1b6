"""What a kernel costs the hardware, read from the compiler without running it (and without a GPU).

``kernel_ptx`` compiles a specialised kernel to PTX for a compute capability (sm_90 by default) with
``numba.cuda.compile_ptx``; ``ptx_resources`` assembles that PTX with nvJitLink (shipped with numba-cuda's
CUDA wheels, and always of the same CUDA version as the NVVM that wrote the PTX, unlike a system ``ptxas``
that may be older and reject the PTX's ``.version``) and parses the registers, shared memory, spills and
stack from its verbose log.

These functions need the real ``numba.cuda`` (not the simulator): run them in a process started with
``FLASHNUMBA_SIMULATOR=0``; no GPU is needed.
"""

from __future__ import annotations

import re

from . import forward
from ._backend import SIMULATOR, cuda

_ARRAY = "{}[:, :, :, :]"


def _array(dtype: str) -> str:
    """A 4-D array type of the kernels' signatures; bfloat16 arrays reach the kernels as uint16 bit patterns."""
    return _ARRAY.format("uint16" if dtype == "bfloat16" else dtype)


_OPTS = ("float32, int64, int64, float32[:, :], int32[:], int32[:], float32, float32, uint64, uint64")
# softcap, window left and right, ALiBi slopes, cu_seqlens q and k, dropout p, 1 / (1 - p), seed, offset


def kernel_signature(kernel: str = "v3", dtype: str = "float32") -> str:
    """Signature of the forward kernels: (q, k, v, out, lse, scale[, softcap, left, right, alibi])."""
    a = _array(dtype)
    base = f"{a}, {a}, {a}, {a}, float32[:, :, :], float32"
    return f"void({base})" if kernel == "v1" else f"void({base}, {_OPTS})"


class _OfflineDevice:
    """What numba-cuda asks of the current device when it compiles a device function called by a kernel."""

    def __init__(self, cc):
        self.compute_capability = cc


def _compile_ptx(fn, signature, cc):
    """cuda.compile_ptx, also without a GPU: numba-cuda compiles the device functions a kernel calls (the
    dropout generator) for the *current* device's compute capability, so where there is no device the
    target's is supplied for the duration of the call."""
    from numba.cuda import dispatcher

    if cuda.is_available():
        return cuda.compile_ptx(fn, signature, cc=cc)[0]
    saved = dispatcher.get_current_device
    dispatcher.get_current_device = lambda: _OfflineDevice(cc)
    try:
        return cuda.compile_ptx(fn, signature, cc=cc)[0]
    finally:
        dispatcher.get_current_device = saved


def kernel_ptx(kernel: str, head_dim: int, block_m: int, block_n: int, num_threads: int = 128,
               causal: bool = False, dtype: str = "float32", cc=(9, 0), variant=None) -> str:
    """PTX of one specialised forward kernel (``variant``: a forward.Variant for v2/v3; default from causal;
    ``dtype``: "float32", "float16" or "bfloat16")."""
    if SIMULATOR:
        raise RuntimeError("kernel_ptx needs the real numba.cuda: start Python with FLASHNUMBA_SIMULATOR=0")
    bf16 = dtype == "bfloat16"
    if kernel == "v1":
        fn = forward.make_forward_v1(head_dim, block_m, block_n, causal, bf16=bf16)
    else:
        make = forward.make_forward_v2 if kernel == "v2" else forward.make_forward_v3
        fn = make(head_dim, block_m, block_n, num_threads, variant or forward.Variant(has_right=causal), bf16=bf16)
    return _compile_ptx(fn.py_func, kernel_signature(kernel, dtype), cc)


def backward_ptx(kernel: str, head_dim: int, block_m: int, block_n: int, num_threads: int = 128,
                 causal: bool = False, dtype: str = "float32", cc=(9, 0), variant=None) -> dict:
    """PTX of the backward kernels of one configuration: {"dq": ptx, "dkdv": ptx}."""
    from . import backward

    if SIMULATOR:
        raise RuntimeError("backward_ptx needs the real numba.cuda: start Python with FLASHNUMBA_SIMULATOR=0")
    a = _array(dtype)
    l3 = "float32[:, :, :]"
    bf16 = dtype == "bfloat16"
    if kernel == "v1":
        dq = backward.make_backward_dq_v1(head_dim, block_m, block_n, causal, bf16=bf16)
        dkdv = backward.make_backward_dkdv_v1(head_dim, block_m, block_n, causal, bf16=bf16)
    else:
        variant = variant or forward.Variant(has_right=causal)
        dq = backward.make_backward_dq_v2(head_dim, block_m, block_n, num_threads, variant, bf16=bf16)
        dkdv = backward.make_backward_dkdv_v2(head_dim, block_m, block_n, num_threads, variant, bf16=bf16)
    opts = "" if kernel == "v1" else f", {_OPTS}"
    sig_dq = f"void({a}, {a}, {a}, {a}, {l3}, {l3}, {a}, float32{opts})"
    sig_dkdv = f"void({a}, {a}, {a}, {a}, {l3}, {l3}, {a}, {a}, float32{opts})"
    return {"dq": _compile_ptx(dq.py_func, sig_dq, cc), "dkdv": _compile_ptx(dkdv.py_func, sig_dkdv, cc)}


def ptx_resources(ptx: str, cc=(9, 0)) -> dict:
    """Assemble PTX with nvJitLink; return registers, static shared bytes, spill bytes and stack bytes."""
    from cuda.bindings import nvjitlink

    data = ptx.encode()
    handle = nvjitlink.create(2, [f"-arch=sm_{cc[0]}{cc[1]}", "-verbose"])
    try:
        nvjitlink.add_data(handle, nvjitlink.InputType.PTX, data, len(data), "kernel")
        nvjitlink.complete(handle)
        log = bytearray(nvjitlink.get_info_log_size(handle))
        nvjitlink.get_info_log(handle, log)
    finally:
        nvjitlink.destroy(handle)
    text = log.decode(errors="replace")

    def grab(pattern):
        found = re.search(pattern, text)
        return int(found.group(1)) if found else 0

    return {
        "registers": grab(r"[Uu]sed (\d+) registers"),
        "shared_bytes": grab(r"(\d+) bytes smem"),
        "spill_stores": grab(r"(\d+) bytes spill stores"),
        "spill_loads": grab(r"(\d+) bytes spill loads"),
        "stack_bytes": grab(r"(\d+) bytes stack frame"),
        "log": text,
    }


# Per-SM limits of compute capability 9.0 (H100, H200), from the CUDA occupancy calculator's tables.
SM90 = dict(registers=65536, shared_bytes=233472, reserved_shared_per_block=1024, threads=2048, blocks=32,
            warps=64, register_granularity=256)


def occupancy(registers, shared_bytes, threads, limits=SM90):
    """Theoretical occupancy of a kernel on one SM: returns (blocks per SM, active warps, fraction, limiter).

    ``shared_bytes`` is the block's static plus dynamic shared memory, without the 1 KB the hardware reserves
    per block (added here). Registers are allocated per warp in units of 256. Where two resources allow the
    same number of blocks, the first of registers, shared memory, threads, blocks is named the limiter.
    """
    warps = -(-threads // 32)
    regs_per_warp = -(-registers * 32 // limits["register_granularity"]) * limits["register_granularity"]
    by = {
        "registers": limits["registers"] // max(regs_per_warp * warps, 1),
        "shared memory": limits["shared_bytes"] // (shared_bytes + limits["reserved_shared_per_block"]),
        "threads": limits["threads"] // threads,
        "blocks": limits["blocks"],
    }
    limiter = min(by, key=by.get)
    blocks = by[limiter]
    return blocks, blocks * warps, blocks * warps / limits["warps"], limiter
