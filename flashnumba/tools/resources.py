"""What a kernel costs the hardware, read from the compiler without running it (and without a GPU).

``kernel_ptx`` / ``backward_ptx`` compile one specialised SIMT kernel to PTX for a compute capability (sm_90 by
default), ``ptx_resources`` assembles PTX with nvJitLink and reports registers, shared memory, spills and stack,
and ``occupancy`` turns those into blocks per SM. For the kernels a call would run, ``flashnumba.plan(...)
.resources()`` does the same from the plan.

These functions need the real ``numba.cuda`` (not the simulator): run them in a process started with
``FLASHNUMBA_SIMULATOR=0``; no GPU is needed.
"""

from __future__ import annotations

from .. import _launch, tiling
from ..kernels import simt_backward, simt_forward

_ARRAY = "{}[:, :, :, :]"
_OPTS = "float32, int64, int64, float32[:, :], int32[:], int32[:], float32, float32, uint64, uint64"
# softcap, window left and right, ALiBi slopes, cu_seqlens q and k, dropout p, 1 / (1 - p), seed, offset
_MODS = "float32[:], float32[:], float32[:], float32[:]"
# the tensor-core kernels' block mask (dummies): lists (counts, indices) and states, in the forward's and dQ's order
# and, as its types fall, the dK/dV kernel's (query-block counts, indices, states)
_BLOCK_MASK = "int32[:, :, :], int32[:, :, :, :], int8[:, :, :, :]"
# the register-tiled SIMT kernels' last: the arrays a user's score_mod / mask_mod read (dummies without them)


def _array(dtype: str) -> str:
    """A 4-D array type of the kernels' signatures; bfloat16 arrays reach the kernels as uint16 bit patterns."""
    return _ARRAY.format("uint16" if dtype == "bfloat16" else dtype)


def kernel_signature(kernel: str = "v3", dtype: str = "float32") -> str:
    """Signature of the SIMT forward kernels: (q, k, v, out, lse, scale[, softcap, left, right, alibi, ...])."""
    a = _array(dtype)
    base = f"{a}, {a}, {a}, {a}, float32[:, :, :], float32"
    return f"void({base})" if kernel == "v1" else f"void({base}, {_OPTS}, {_MODS})"


def kernel_ptx(kernel: str, head_dim: int, block_m: int, block_n: int, num_threads: int = 128,
               causal: bool = False, dtype: str = "float32", cc=(9, 0), variant=None) -> str:
    """PTX of one specialised SIMT forward kernel (``variant``: a Variant for v2/v3; default from causal)."""
    bf16 = dtype == "bfloat16"
    if kernel == "v1":
        fn = simt_forward.make_forward_v1(head_dim, block_m, block_n, causal, bf16=bf16)
    else:
        make = simt_forward.make_forward_v2 if kernel == "v2" else simt_forward.make_forward_v3
        fn = make(head_dim, block_m, block_n, num_threads, variant or simt_forward.Variant(has_right=causal),
                  bf16=bf16)
    return _launch.compile_ptx(fn.py_func, kernel_signature(kernel, dtype), cc)


def backward_ptx(kernel: str, head_dim: int, block_m: int, block_n: int, num_threads: int = 128,
                 causal: bool = False, dtype: str = "float32", cc=(9, 0), variant=None) -> dict:
    """PTX of the SIMT backward kernels of one configuration: {"dq": ptx, "dkdv": ptx}."""
    a = _array(dtype)
    l3 = "float32[:, :, :]"
    bf16 = dtype == "bfloat16"
    if kernel == "v1":
        dq = simt_backward.make_backward_dq_v1(head_dim, block_m, block_n, causal, bf16=bf16)
        dkdv = simt_backward.make_backward_dkdv_v1(head_dim, block_m, block_n, causal, bf16=bf16)
    else:
        variant = variant or simt_forward.Variant(has_right=causal)
        dq = simt_backward.make_backward_dq_v2(head_dim, block_m, block_n, num_threads, variant, bf16=bf16)
        dkdv = simt_backward.make_backward_dkdv_v2(head_dim, block_m, block_n, num_threads, variant, bf16=bf16)
    opts = "" if kernel == "v1" else f", {_OPTS}, {_MODS}"
    sig_dq = f"void({a}, {a}, {a}, {a}, {l3}, {l3}, {a}, float32{opts})"
    sig_dkdv = f"void({a}, {a}, {a}, {a}, {l3}, {l3}, {a}, {a}, float32{opts})"
    return {"dq": _launch.compile_ptx(dq.py_func, sig_dq, cc), "dkdv": _launch.compile_ptx(dkdv.py_func, sig_dkdv, cc)}


def ptx_resources(ptx: str, cc=(9, 0)) -> dict:
    """Assemble PTX with nvJitLink; return registers, static shared bytes, spill bytes, stack bytes and the log."""
    _, log = _launch.assemble(ptx, cc)
    r = _launch.resources_from_log(log)
    return {"registers": r["registers"], "shared_bytes": r["static_shared_bytes"], "spill_stores": r["spill_stores"],
            "spill_loads": r["spill_loads"], "stack_bytes": r["stack_bytes"], "log": log}


def occupancy(registers, shared_bytes, threads, limits=None):
    """Theoretical occupancy of a kernel on one SM: returns (blocks per SM, active warps, fraction, limiter).

    ``limits``: a :class:`flashnumba.tiling.DeviceLimits` (default sm_90's). ``shared_bytes`` is the block's static
    plus dynamic shared memory, without the 1 KB the hardware reserves per block (added here). Registers are
    allocated per warp in units of 256. Where two resources allow the same number of blocks, the first of
    registers, shared memory, threads, blocks is named the limiter.
    """
    lim = limits or tiling.ARCHS["sm_90"]
    warps = -(-threads // 32)
    regs_per_warp = -(-registers * 32 // 256) * 256
    by = {
        "registers": lim.registers_per_sm // max(regs_per_warp * warps, 1),
        "shared memory": lim.shared_per_sm // (shared_bytes + 1024),
        "threads": lim.threads_per_sm // threads,
        "blocks": lim.blocks_per_sm,
    }
    limiter = min(by, key=by.get)
    blocks = by[limiter]
    return blocks, blocks * warps, blocks * warps / (lim.threads_per_sm // 32), limiter
