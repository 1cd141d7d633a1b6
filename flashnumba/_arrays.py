"""Where arrays live: NumPy on the host; CuPy, torch, Numba or any ``__cuda_array_interface__`` object on the GPU.

On a GPU the kernels read only each array's address (:data:`POINTER`; :mod:`flashnumba._launch` passes it with
the shape and strides the plan recorded), and results are allocated in the caller's array type. Under the
simulator they take Numba's simulated device arrays (:func:`to_kernel`, :func:`empty`).

bfloat16 has no NumPy dtype of its own and no Numba type: NumPy arrays of it use the dtype of the optional package
ml_dtypes, torch has torch.bfloat16, and both reach the kernels as uint16 bit patterns of the same memory
(:data:`BITS`), which :mod:`flashnumba.kernels.bf16` converts element by element.
"""

from __future__ import annotations

import functools
import sys

import numpy as np

from . import config
from ._backend import SIMULATOR, cuda

try:  # CuPy is optional: without it, GPU outputs are Numba device arrays
    if SIMULATOR:
        raise ImportError
    import cupy
except Exception:  # noqa: BLE001  (ImportError, or a CuPy that cannot find CUDA)
    cupy = None


BITS = np.dtype(np.uint16)  # what the kernels see of a bfloat16 array: its bit patterns


@functools.lru_cache(maxsize=None)
def bfloat16():
    """NumPy's bfloat16 dtype, from ml_dtypes (imported on first use); None where ml_dtypes is not installed."""
    try:
        import ml_dtypes
    except ImportError:
        return None
    return np.dtype(ml_dtypes.bfloat16)


def is_bfloat16(dtype) -> bool:
    bf16 = bfloat16()
    return bf16 is not None and dtype == bf16


def _torch_tensor(x) -> bool:
    """Whether x is a torch CUDA tensor, or a meta tensor (shapes only: :mod:`flashnumba.torch` checks them while
    torch.compile traces; they never reach a launch). torch is never imported here: a caller that has a tensor
    has imported it."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor) and (x.is_cuda or x.is_meta)


def _torch_bfloat16(x) -> bool:
    return _torch_tensor(x) and x.dtype == sys.modules["torch"].bfloat16


def kind(x) -> str:
    """'numpy', 'cupy', 'numba', 'torch' (a torch CUDA tensor) or 'cai' (another __cuda_array_interface__
    object); TypeError otherwise."""
    if isinstance(x, np.ndarray):
        return "numpy"
    if cupy is not None and isinstance(x, cupy.ndarray):
        return "cupy"
    if _torch_tensor(x):
        return "torch"
    if not SIMULATOR and cuda.is_cuda_array(x) and cuda.devicearray.is_cuda_ndarray(x):
        return "numba"
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(x, torch.Tensor):
        raise TypeError(f"expected a CUDA tensor, got a torch tensor on {x.device}: move it to the GPU (x.cuda()), "
                        f"or pass x.numpy() to run on NumPy arrays")
    if hasattr(x, "__cuda_array_interface__"):
        return "cai"
    if SIMULATOR and hasattr(x, "copy_to_host"):  # a simulator device array
        return "numba"
    raise TypeError(
        f"expected a NumPy array or a CUDA array (CuPy, torch, Numba, or any __cuda_array_interface__ object), "
        f"got {type(x).__module__}.{type(x).__name__}"
    )


def on_device(k: str) -> bool:
    return k in ("cupy", "numba", "cai", "torch")


def torch_dtype(dtype):
    """The torch dtype of a NumPy dtype (bfloat16: ml_dtypes')."""
    torch = sys.modules["torch"]
    if is_bfloat16(np.dtype(dtype)):
        return torch.bfloat16
    return {np.dtype(np.float32): torch.float32, np.dtype(np.float16): torch.float16,
            np.dtype(np.int32): torch.int32, np.dtype(np.float64): torch.float64}[np.dtype(dtype)]


def _numpy_dtype_of_torch(t):
    torch = sys.modules["torch"]
    if t == torch.bfloat16:
        if bfloat16() is None:
            raise ImportError("torch.bfloat16 tensors need the ml_dtypes package (NumPy's bfloat16 dtype): "
                              "pip install ml_dtypes")
        return bfloat16()
    table = {torch.float32: np.float32, torch.float16: np.float16, torch.float64: np.float64, torch.int32: np.int32,
             torch.int64: np.int64, torch.uint8: np.uint8, torch.int16: np.int16, torch.bool: np.bool_}
    if t not in table:
        raise TypeError(f"torch tensors of dtype {t} are not supported")
    return np.dtype(table[t])


def shape_strides_dtype(x):
    """(shape, strides in bytes, numpy dtype) of any supported array, without touching its data."""
    if _torch_tensor(x):
        dtype = _numpy_dtype_of_torch(x.dtype)
        return tuple(x.shape), tuple(dtype.itemsize * s for s in x.stride()), dtype
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


def _meta_cupy(x):  # (the last item: whether the data starts on 16 bytes, as the tensor cores' copies need)
    return (x.shape, x.strides, x.dtype.char, x.data.device_id, x.data.ptr % 16 == 0)


def _meta_torch(x):
    return (tuple(x.shape), x.stride(), x.dtype, x.device.index, x.data_ptr() % 16 == 0)


def _meta_numpy(x):  # (copied to the current device, for which the call is planned)
    return (x.shape, x.strides, x.dtype.str, current_device())


def current_device() -> int:
    """The id of the current CUDA device, on which a call launches (0 in the simulator): part of the key of a call
    whose arrays do not say their device (NumPy arrays, which are copied there, and ``__cuda_array_interface__``
    objects), so that a plan made for one GPU is not reused on another."""
    return 0 if SIMULATOR else cuda.get_current_device().id


def meta_key(x):
    """A hashable summary of an array's type, shape, strides, dtype and device (the current one for arrays that do
    not carry theirs): the part of a call's plan key that an array gives. Cheap: a few attribute reads."""
    t = type(x)
    f = _META.get(t)
    if f is None:
        if isinstance(x, np.ndarray):
            f = _meta_numpy
        elif cupy is not None and isinstance(x, cupy.ndarray):
            f = _meta_cupy
        elif _torch_tensor(x):
            f = _meta_torch
        else:
            shape, strides, dtype = shape_strides_dtype(x)
            return (t, shape, strides, dtype.str, starts_aligned(x), current_device())
        _META[t] = f
    return (t, f(x))


_META: dict = {}


POINTER = {  # the device address of a device array's first element, by kind
    "cupy": lambda x: x.data.ptr,
    "torch": lambda x: x.data_ptr(),
    "numba": lambda x: x.device_ctypes_pointer.value or 0,
    "cai": lambda x: x.__cuda_array_interface__["data"][0],
}


def starts_aligned(x) -> bool:
    """Whether a device array's data starts on a 16-byte boundary (True for NumPy arrays, which are copied, and
    under the simulator)."""
    if SIMULATOR or isinstance(x, np.ndarray):
        return True
    try:
        return POINTER[kind(x)](x) % 16 == 0
    except (TypeError, AttributeError, KeyError):
        return True


def device_copy(x, k: str):
    """A C-contiguous device copy of x in a new allocation (so its start is aligned), a NumPy array copied to the
    GPU (bfloat16 as its uint16 bits)."""
    if k == "numpy":
        host = np.ascontiguousarray(x)
        if is_bfloat16(host.dtype):
            host = host.view(BITS)
        return cupy.asarray(host) if cupy is not None else cuda.to_device(host)
    if k == "torch":
        torch = sys.modules["torch"]
        return x.detach().clone(memory_format=torch.contiguous_format)
    if cupy is None:
        raise ValueError("a strided or unaligned CUDA array must be copied for the tensor-core kernels, which "
                         "needs CuPy; pass a C-contiguous array that starts on a 16-byte boundary")
    return cupy.array(cupy.asarray(x), copy=True, order="C")


def padded_copy(x, k: str, width: int):
    """A C-contiguous device copy of x with its last axis widened to ``width`` by zero columns (a head dim that a
    kernel is not built for, run as the next it is: the zero columns add nothing to q.k and give zero output
    columns, which are cropped off: :func:`crop`). A NumPy array is padded on the host and copied to the GPU."""
    if k == "numpy":
        host = np.ascontiguousarray(x)
        if is_bfloat16(host.dtype):
            host = host.view(BITS)
        host = np.pad(host, [(0, 0)] * (host.ndim - 1) + [(0, width - host.shape[-1])])
        return cupy.asarray(host) if cupy is not None else cuda.to_device(host)
    if k == "torch":  # (C-contiguous whatever x's strides: torch's pad would keep a channels-last layout)
        out = sys.modules["torch"].zeros(x.shape[:-1] + (width,), dtype=x.dtype, device=x.device)
        out[..., :x.shape[-1]].copy_(x.detach())
        return out
    if cupy is None:  # (refused by the planner first)
        raise ValueError("a padded head dim needs CuPy to copy a CUDA array that is not a torch tensor")
    x = cupy.asarray(x)
    out = cupy.zeros(x.shape[:-1] + (width,), x.dtype)
    out[..., :x.shape[-1]] = x
    return out


def crop(x, width: int):
    """The first ``width`` columns of the last axis of a result (computed wider, :func:`padded_copy`), as a
    C-contiguous array of the same type."""
    if isinstance(x, np.ndarray):
        return np.ascontiguousarray(x[..., :width])
    if _torch_tensor(x):
        return x[..., :width].contiguous()
    if cupy is not None and isinstance(x, cupy.ndarray):
        return cupy.ascontiguousarray(x[..., :width])
    if SIMULATOR:  # (a simulated device array)
        return cuda.to_device(np.ascontiguousarray(x.copy_to_host()[..., :width]))
    # a Numba device array (on a GPU a padded head dim needs CuPy: the planner refuses it without), on CuPy's
    # current stream (the call's)
    return cuda.as_cuda_array(cupy.ascontiguousarray(cupy.asarray(x)[..., :width]))


def to_host_as(x, dtype):
    """A NumPy copy of a device result, viewed as ``dtype`` (bfloat16 results are uint16 bits on the device)."""
    host = to_host(x)
    return host.view(bfloat16()) if is_bfloat16(np.dtype(dtype)) else host


# ---------------------------------------------------------------------------------------------------------------
# the simulator's side: Numba's simulated device arrays (a GPU call only reads addresses, see flashnumba._launch)
# ---------------------------------------------------------------------------------------------------------------


def to_kernel(x, k: str):
    """A simulated device array of x (simulator only): NumPy arrays are copied, bfloat16 as uint16 bit patterns
    (:data:`BITS`); simulated device arrays are used as they are."""
    if k == "numpy":
        x = np.ascontiguousarray(x)
        return cuda.to_device(x.view(BITS) if is_bfloat16(x.dtype) else x)
    return x


def bits(x):
    """x as a kernel reads it: a bfloat16 NumPy array as a view of its uint16 bit patterns (the same memory)."""
    return x.view(BITS) if isinstance(x, np.ndarray) and is_bfloat16(x.dtype) else x


def copy_back(host, dev):
    """The device copy ``dev`` of the NumPy array ``host`` copied back into it, in place (after kernels wrote
    the copy)."""
    bits(host)[...] = to_host(dev).reshape(host.shape).view(bits(host).dtype)


def with_leading_axis(x, k: str):
    """x with a leading axis of length 1 (simulator only): a view of a NumPy array, a copy of a simulated one.
    The new axis gets a real stride, the span of the array (x[None] gives it stride 0, which Numba takes for a
    broadcast axis and so for an array that is not contiguous)."""
    if k == "numpy":
        lead = max(x.shape[0] * abs(x.strides[0]) if x.shape else x.itemsize, x.itemsize)
        return np.lib.stride_tricks.as_strided(x, (1, *x.shape), (lead, *x.strides))
    return cuda.to_device(np.ascontiguousarray(x.copy_to_host()[None]))


def capturing(x) -> bool:
    """Whether the current stream of x's library is being captured into a CUDA graph (torch tensors, CuPy arrays),
    where no copy to the host can run."""
    if _torch_tensor(x) and x.is_cuda:
        return bool(sys.modules["torch"].cuda.is_current_stream_capturing())
    if cupy is not None and isinstance(x, cupy.ndarray):
        from ._driver import stream_capturing

        return stream_capturing(cupy.cuda.get_current_stream().ptr)
    return False


def to_host(x):
    """A NumPy copy of any supported array."""
    if isinstance(x, np.ndarray):
        return x
    if cupy is not None and isinstance(x, cupy.ndarray):
        return cupy.asnumpy(x)
    if hasattr(x, "copy_to_host"):
        return x.copy_to_host()
    if _torch_tensor(x):
        x = x.detach()
        if _torch_bfloat16(x):
            return x.view(sys.modules["torch"].int16).cpu().numpy().view(bfloat16())
        return x.cpu().numpy()
    return cuda.as_cuda_array(x).copy_to_host()


def empty(shape, dtype, like: str):
    """A new output buffer (simulator only): (what the caller gets, what the kernel writes); NaN-filled when
    ``config.poison_outputs`` is set (tests; integers -1). A bfloat16 buffer's kernel side is uint16 (NaN: 0x7FC0)."""
    bits = is_bfloat16(np.dtype(dtype))
    if config.poison_outputs:
        # (integers: all bits set, as the GPU's poisoned scratch)
        host = np.full(shape, -1 if np.dtype(dtype).kind == "i" else np.nan, dtype)
        dev = cuda.to_device(host.view(BITS) if bits else host)
    else:
        dev = cuda.device_array(shape, BITS if bits else dtype)
    return dev, dev


def to_caller(user_side, kernel_side, like: str):
    """Return a result in the caller's array type (uint16 kernel arrays hold bfloat16: NumPy gets bfloat16)."""
    if like == "numpy":
        host = kernel_side.copy_to_host()
        return host.view(bfloat16()) if host.dtype == BITS else host
    return user_side
