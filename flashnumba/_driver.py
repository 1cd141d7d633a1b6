"""The CUDA driver API (cuda-bindings) as the launch layer and the tensor maps use it: the module, and a check of
its results. Imports nothing of flashnumba, so both layers can use it."""

from __future__ import annotations


def driver():
    from cuda.bindings import driver as drv

    return drv


def stream_capturing(stream: int) -> bool:
    """Whether ``stream`` (a CUstream handle) is being captured into a CUDA graph, where work is only recorded and
    nothing can be copied to the host. A query the driver refuses (the legacy stream while another is capturing)
    counts as capturing."""
    err, status = driver().cuStreamIsCapturing(stream)
    return int(err) != 0 or int(status) != 0


def check(result, what):
    """The value of a driver call's result tuple, or RuntimeError naming ``what`` where it failed."""
    err = result[0] if isinstance(result, tuple) else result
    if int(err) != 0:
        raise RuntimeError(f"CUDA driver error {int(err)} ({err!r}) in {what}")
    return result[1] if isinstance(result, tuple) and len(result) > 1 else None
