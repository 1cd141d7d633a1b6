"""Where arrays live, and moving them: NumPy on the host, CuPy / Numba / any ``__cuda_array_interface__`` object on
the GPU. The kernels always receive Numba device arrays (real or simulated); results come back in the caller's
array type."""

from __future__ import annotations

import numpy as np

from . import config
from ._backend import SIMULATOR, cuda

try:  # CuPy is optional: without it, GPU outputs are Numba device arrays
    if SIMULATOR:
        raise ImportError
    import cupy
except Exception:  # noqa: BLE001  (ImportError, or a CuPy that cannot find CUDA)
    cupy = None


def kind(x) -> str:
    """'numpy', 'cupy', 'numba' or 'cai' (another __cuda_array_interface__ object); TypeError otherwise."""
    if isinstance(x, np.ndarray):
        return "numpy"
    if cupy is not None and isinstance(x, cupy.ndarray):
        return "cupy"
    if not SIMULATOR and cuda.is_cuda_array(x) and cuda.devicearray.is_cuda_ndarray(x):
        return "numba"
    if hasattr(x, "__cuda_array_interface__"):
        return "cai"
    if SIMULATOR and hasattr(x, "copy_to_host"):  # a simulator device array
        return "numba"
    raise TypeError(
        f"expected a NumPy array or a CUDA array (CuPy, Numba, or any __cuda_array_interface__ object), "
        f"got {type(x).__module__}.{type(x).__name__}"
    )


def on_device(k: str) -> bool:
    return k in ("cupy", "numba", "cai")


def shape_strides_dtype(x):
    """(shape, strides in bytes, numpy dtype) of any supported array, without touching its data."""
    if hasattr(x, "__cuda_array_interface__") and not isinstance(x, np.ndarray):
        cai = x.__cuda_array_interface__
        dtype = np.dtype(cai["typestr"])
        shape = tuple(cai["shape"])
        strides = cai.get("strides")
        if strides is None:  # C-contiguous
            strides, acc = [], dtype.itemsize
            for n in reversed(shape):
                strides.append(acc)
                acc *= n
            strides = tuple(reversed(strides))
        return shape, tuple(strides), dtype
    return tuple(x.shape), tuple(x.strides), np.dtype(x.dtype)


def to_kernel(x, k: str):
    """A Numba (device or simulated) array viewing x; NumPy arrays are copied to the device."""
    if k == "numpy":  # the copy to the device is needed anyway; make it one contiguous transfer
        return cuda.to_device(np.ascontiguousarray(x))
    if k == "cupy" and SIMULATOR:  # pragma: no cover (CuPy is not imported under the simulator)
        return cuda.to_device(cupy.asnumpy(x))
    if SIMULATOR and k == "numba":
        return x
    return cuda.as_cuda_array(x)


class _LeadingAxis:
    """A (1, *shape) view of a CUDA array, through the __cuda_array_interface__ (no copy)."""

    def __init__(self, x):
        shape, strides, dtype = shape_strides_dtype(x)
        cai = dict(x.__cuda_array_interface__)
        cai.update(shape=(1, *shape), strides=(0, *strides), version=cai.get("version", 2))
        self.__cuda_array_interface__ = cai
        self.base = x  # keep the owner alive


def with_leading_axis(x, kind):
    """x viewed with a leading axis of length 1, in its own array type where it has one."""
    if kind in ("numpy", "cupy"):
        return x[None]
    if SIMULATOR:  # a simulator device array: a host copy with the axis added
        return cuda.to_device(np.ascontiguousarray(x.copy_to_host()[None]))
    return _LeadingAxis(x)


def to_host(x):
    """A NumPy copy of any supported array."""
    if isinstance(x, np.ndarray):
        return x
    if cupy is not None and isinstance(x, cupy.ndarray):
        return cupy.asnumpy(x)
    if hasattr(x, "copy_to_host"):
        return x.copy_to_host()
    return cuda.as_cuda_array(x).copy_to_host()


def empty(shape, dtype, like: str):
    """A new kernel-side output buffer; NaN-filled when ``config.poison_outputs`` is set (tests)."""
    if like in ("cupy", "cai") and cupy is not None:
        arr = cupy.empty(shape, dtype)
        if config.poison_outputs:
            arr.fill(np.nan)
        return arr, cuda.as_cuda_array(arr)
    if config.poison_outputs:
        host = np.full(shape, np.nan, dtype)
        dev = cuda.to_device(host)
    else:
        dev = cuda.device_array(shape, dtype)
    return dev, dev


def to_caller(user_side, kernel_side, like: str):
    """Return a result in the caller's array type."""
    if like == "numpy":
        return kernel_side.copy_to_host()
    return user_side
