"""Launch: a plan's kernels, compiled (or loaded from the disk cache) once, launched with little Python per call.

On a GPU, a kernel is compiled the way Numba compiles it (``numba.cuda.compile_ptx`` of the factory's Python
function, for the argument types the plan names) and assembled to machine code (cubin) with nvJitLink (a kernel
that moves registers between its warpgroups through NVVM's LTO-IR instead, as the whole program: :func:`build`);
the cubin is kept in :mod:`flashnumba._cache` and loaded with the CUDA driver. A launch then costs one driver call:
the kernel's parameters are laid out once per plan in one buffer, exactly as Numba passes them (an array is
``meminfo, parent, nitems, itemsize, data, shape..., strides...``; the layout is read from the PTX's own parameter
list), and each call writes only the data pointers (and the dropout seed and offset) into it. Kernels go on the
stream the caller gives, else the caller's current stream: CuPy's for CuPy arrays, torch's for torch tensors, the
legacy default stream otherwise. Nothing waits for the GPU (so a call can be captured in a CUDA graph), except
where NumPy results are copied back.

Under the simulator the same plan launches through Numba's dispatcher (``kernel[grid, block, 0, shared](...)``),
which runs each thread in Python; nothing is compiled.

:func:`compile_kernel` also runs without a GPU, for any compute capability: the offline compile test and
``flashnumba.plan(...).resources()`` use it.
"""

from __future__ import annotations

import ctypes
import re
import sys
import threading
from dataclasses import dataclass

import numpy as np

from . import _arrays, _cache, _tensormap, config
from ._driver import check as _check, driver as _driver
from ._backend import SIMULATOR, cuda
from .kernels import ptx_hopper
from .kernels.common import Mods

STATIC_SHARED_LIMIT = 48 * 1024  # CUDA's limit on static shared memory; more needs an opt-in per kernel
PER_CALL_SCALARS = ("seed", "offset")  # uint64 arguments written at every call, not part of a plan
_NUMBA_NAMES = {np.dtype(np.float32): "float32", np.dtype(np.float16): "float16", np.dtype(np.uint16): "uint16",
                np.dtype(np.int32): "int32", np.dtype(np.int64): "int64", np.dtype(np.uint64): "uint64",
                # (a block mask's states; the arrays a user's score_mod reads)
                np.dtype(np.int8): "int8", np.dtype(np.uint8): "uint8", np.dtype(np.int16): "int16",
                np.dtype(np.uint32): "uint32", np.dtype(np.float64): "float64", np.dtype(np.bool_): "boolean"}


# ---------------------------------------------------------------------------------------------------------------
# what a kernel is compiled for
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ArrayMeta:
    """An array as a kernel sees it: shape, strides in bytes, element dtype (bfloat16 as uint16) and Numba
    layout ("C": C-contiguous, the compiled code computes strides from the shape; "A": any strides)."""

    shape: tuple
    strides: tuple
    dtype: np.dtype
    layout: str

    @property
    def numba_type(self) -> str:
        dims = [":"] * len(self.shape)
        if self.layout == "C" and dims:
            dims[-1] = "::1"
        return f"{_NUMBA_NAMES[self.dtype]}[{', '.join(dims)}]"

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))


def c_strides(shape, itemsize):
    out, acc = [], itemsize
    for n in reversed(shape):
        out.append(acc)
        acc *= max(n, 1)
    return tuple(reversed(out))


def is_c_layout(shape, strides, itemsize) -> bool:
    """Whether (shape, strides) lay the elements out in C order (an axis of length 1 may have any stride)."""
    step = itemsize
    for n, stride in zip(reversed(shape), reversed(strides)):
        if n != 1 and stride != step:
            return False
        step *= n
    return True


def array_meta(shape, strides, dtype, layout=None) -> ArrayMeta:
    dtype = np.dtype(np.uint16) if _arrays.is_bfloat16(dtype) else np.dtype(dtype)
    if layout is None:
        layout = "C" if is_c_layout(shape, strides, dtype.itemsize) else "A"
    return ArrayMeta(tuple(shape), tuple(strides), dtype, layout)


@dataclass(frozen=True)
class KernelLaunch:
    """One kernel of a plan: the factory that makes it and its arguments, the names of its parameters (keys
    of the plan's arrays and scalars, or a per-call scalar), and the launch geometry."""

    name: str
    table: str
    factory: object
    factory_args: tuple
    params: tuple
    grid: tuple
    block: tuple
    shared_bytes: int
    tiles: object = None
    reason: str = ""
    arch_specific: bool = False  # compiled for the architecture-specific target (sm_90a: wgmma, setmaxnreg)
    whole_program: bool = False  # assembled as the whole program (a kernel with setmaxnreg: assemble_whole)
    # (input name, box rows, swizzled row bytes) of each tensor map the kernel's maps parameter (:attr:`maps_param`)
    # holds, in order (flashnumba._tensormap); none: that parameter, where the kernel takes one, is a dummy never read
    tensor_maps: tuple = ()

    @property
    def maps_param(self):
        """The name of the kernel's tensor-map parameter ("maps", or "maps_" and a suffix where a plan's kernels
        each take their own), or None."""
        return next((p for p in self.params if p == "maps" or p.startswith("maps_")), None)

    def signature(self, arrays: dict, scalars: dict) -> tuple:
        sig = []
        for p in self.params:
            if p in arrays:
                sig.append(arrays[p].numba_type)
            elif p in PER_CALL_SCALARS:
                sig.append("uint64")
            else:
                sig.append(_NUMBA_NAMES[np.asarray(scalars[p]).dtype])
        return tuple(sig)


# ---------------------------------------------------------------------------------------------------------------
# compiling, offline or on the GPU
# ---------------------------------------------------------------------------------------------------------------


class _OfflineDevice:
    """What numba-cuda asks of the current device when it compiles a device function called by a kernel."""

    def __init__(self, cc):
        self.compute_capability = cc


class _current_device_for:
    """numba-cuda compiles the device functions a kernel calls (the dropout generator) for the *current* device's
    compute capability; where there is no device, the target's is supplied for the duration of the block."""

    def __init__(self, cc):
        self.cc = cc

    def __enter__(self):
        from numba.cuda import dispatcher

        self.saved = None
        if not cuda.is_available():
            self.saved = dispatcher.get_current_device
            dispatcher.get_current_device = lambda: _OfflineDevice(self.cc)

    def __exit__(self, *exc):
        from numba.cuda import dispatcher

        if self.saved is not None:
            dispatcher.get_current_device = self.saved


def _need_real_cuda():
    if SIMULATOR:
        raise RuntimeError("compiling needs the real numba.cuda: start Python with FLASHNUMBA_SIMULATOR=0 "
                           "(no GPU is needed)")


def compile_ptx(pyfunc, signature: str, cc, launch_bounds=None) -> str:
    """``numba.cuda.compile_ptx``, also without a GPU (:class:`_current_device_for`). ``launch_bounds``: the
    block's threads, or (threads, blocks an SM), where the assembler must keep the registers a thread within what
    that many threads may have (``.maxntid``; with blocks, ``.minnctapersm``)."""
    _need_real_cuda()
    kw = {} if launch_bounds is None else {"launch_bounds": launch_bounds}
    with _current_device_for(cc):
        return cuda.compile_ptx(pyfunc, signature, cc=cc, **kw)[0]


def compile_ltoir(pyfunc, signature: str, cc, launch_bounds=None) -> bytes:
    """The kernel as NVVM's link-time-optimisation IR (LTO-IR) instead of PTX; otherwise as :func:`compile_ptx`."""
    _need_real_cuda()
    kw = {} if launch_bounds is None else {"launch_bounds": launch_bounds}
    with _current_device_for(cc):
        return bytes(cuda.compile(pyfunc, signature, device=False, cc=cc, abi="numba", output="ltoir", **kw)[0])


def _arch(cc) -> str:
    return f"sm_{cc[0]}{cc[1]}{cc[2] if len(cc) > 2 else ''}"  # (9, 0, "a"): sm_90a, Hopper's own instructions


def _jit_link(kind, data: bytes, options: list, what: str):
    """One nvJitLink run over one input: (its output, cubin or PTX, as bytes; the info log). Where CUDA's compute
    cache (``~/.nv/ComputeCache``) serves a whole-program link it has seen, no assembler runs and the log states no
    registers or spills (:func:`resources_from_log` reads them as None). ``CUDA_CACHE_DISABLE`` keeps the links
    out of the cache where the process sets it before it imports numba (the tests' conftest; seen to work on a
    GPU), not where it is set around a link after others (seen not to); the sweep command sets it at its start,
    after flashnumba's import (a None in its rows: the log stated nothing)."""
    from cuda.bindings import nvjitlink

    handle = nvjitlink.create(len(options), options)
    try:
        nvjitlink.add_data(handle, kind, data, len(data), "kernel")
        try:
            nvjitlink.complete(handle)
        except Exception as err:  # noqa: BLE001  (nvJitLinkError: show the assembler's own words)
            log = bytearray(nvjitlink.get_error_log_size(handle))
            nvjitlink.get_error_log(handle, log)
            raise RuntimeError(f"nvJitLink could not {what}: {log.decode(errors='replace')}") from err
        log = bytearray(nvjitlink.get_info_log_size(handle))
        nvjitlink.get_info_log(handle, log)
        if "-ptx" in options:
            out = bytearray(nvjitlink.get_linked_ptx_size(handle))
            nvjitlink.get_linked_ptx(handle, out)
        else:
            out = bytearray(nvjitlink.get_linked_cubin_size(handle))
            nvjitlink.get_linked_cubin(handle, out)
    finally:
        nvjitlink.destroy(handle)
    return bytes(out), log.decode(errors="replace")


def assemble(ptx: str, cc) -> tuple[bytes, str]:
    """PTX -> (cubin, the assembler's verbose log) with nvJitLink, which ships with numba-cuda's CUDA wheels and
    is of the same CUDA version as the NVVM that wrote the PTX. nvJitLink assembles PTX as one unit of a program
    that may be linked with others (relocatable device code): see :func:`assemble_whole` for what that forbids."""
    from cuda.bindings import nvjitlink

    arch = _arch(cc)
    return _jit_link(nvjitlink.InputType.PTX, ptx.encode(), [f"-arch={arch}", "-verbose"],
                     f"assemble the kernel for {arch}")


def assemble_whole(ltoir: bytes, cc) -> tuple[bytes, str, str]:
    """LTO-IR -> (cubin, the assembler's verbose log, the PTX it assembled) with nvJitLink's link-time
    optimisation, in which the assembler sees the kernel as the whole program. Only then does it honour
    ``setmaxnreg`` (a warpgroup's register budget, changed at run time): assembling PTX as one unit of a program
    it ignores it, "to maintain compatibility across compilation units" (its log's C7504), and keeps every thread
    at the block's even share. The PTX comes from a second run (nvJitLink gives one output a run) and names the
    entry and its parameters."""
    from cuda.bindings import nvjitlink

    arch = _arch(cc)
    what = f"link the kernel for {arch}"
    cubin, log = _jit_link(nvjitlink.InputType.LTOIR, ltoir, [f"-arch={arch}", "-lto", "-verbose"], what)
    ptx, _ = _jit_link(nvjitlink.InputType.LTOIR, ltoir, [f"-arch={arch}", "-lto", "-ptx"], what)
    return cubin, log, ptx.decode()


def build(pyfunc, signature: str, cc, launch_bounds=None, whole_program=False) -> tuple[bytes, str, str]:
    """A kernel's (cubin, assembler log, PTX) for compute capability ``cc``: compiled to PTX and assembled, or,
    ``whole_program``, through LTO-IR (:func:`assemble_whole`). The one way the launches, the disk cache and the
    offline compile tests make machine code."""
    if whole_program:
        return assemble_whole(compile_ltoir(pyfunc, signature, cc, launch_bounds), cc)
    ptx = compile_ptx(pyfunc, signature, cc, launch_bounds)
    cubin, log = assemble(ptx, cc)
    return cubin, log, ptx


# what the assembler's verbose log states of a kernel, each figure's pattern
_RESOURCES = {"registers": r"[Uu]sed (\d+) registers", "static_shared_bytes": r"(\d+) bytes smem",
              "spill_stores": r"(\d+) bytes spill stores", "spill_loads": r"(\d+) bytes spill loads",
              "stack_bytes": r"(\d+) bytes stack frame"}


def resources_from_log(log: str) -> dict:
    """Registers, static shared memory, spills and stack of a kernel, from the assembler's verbose log (a figure it
    leaves out is 0); each None where the log states no registers (the assembler did not run: CUDA's compute cache
    served the link), never a 0 that was not measured (once loaded on a GPU, :func:`loaded_resources` fills in what
    the driver states)."""
    if not re.search(_RESOURCES["registers"], log):
        return dict.fromkeys(_RESOURCES)
    found = {name: re.search(pattern, log) for name, pattern in _RESOURCES.items()}
    return {name: int(m.group(1)) if m else 0 for name, m in found.items()}


_PARAM_SIZES = {"u64": 8, "b64": 8, "s64": 8, "f64": 8, "u32": 4, "b32": 4, "s32": 4, "f32": 4,
                "u16": 2, "b16": 2, "s16": 2, "f16": 2, "u8": 1, "b8": 1, "s8": 1}


def entry_and_params(ptx: str) -> tuple[str, list]:
    """The kernel's entry name and the byte size of each of its parameters, from its PTX."""
    found = re.search(r"\.entry\s+([\w$.]+)\s*\(([^)]*)\)", ptx)
    if found is None:
        raise RuntimeError("no .entry in the kernel's PTX")
    sizes = [_PARAM_SIZES[t] for t in re.findall(r"\.param\s+\.(\w+)", found.group(2))]
    return found.group(1), sizes


@dataclass
class Compiled:
    """A kernel compiled for one compute capability: its cubin, entry name, parameter sizes, resources."""

    cubin: bytes
    entry: str
    param_sizes: list
    resources: dict
    cached: bool = False  # loaded from the disk cache
    seconds: float = 0.0  # compile time (0 when loaded)


def bounds(threads: int, whole_program: bool = False):
    """The launch bounds a kernel of ``threads`` threads a block is compiled with. Above 256 threads, the threads
    (``.maxntid``): at up to 255 registers a thread, more threads than that would not fit the 64K registers of an
    SM, and the launch would fail; None for the others. A kernel with ``setmaxnreg`` (``whole_program``) adds one
    block an SM (``.minnctapersm``): the assembler then knows each thread's registers at the kernel's entry,
    without which it ignores ``setmaxnreg`` (its log's C7508)."""
    if threads <= 256:
        return None
    return (threads, 1) if whole_program else threads


def launch_bounds(spec: KernelLaunch):
    """:func:`bounds` of a plan's kernel."""
    return bounds(int(np.prod(spec.block)), spec.whole_program)


def _cache_key(spec: KernelLaunch, sig: tuple, cc) -> str:
    f = spec.factory
    name = f"{getattr(f, '__module__', '?')}.{getattr(f, '__qualname__', repr(f))}"
    key = {"factory": name, "args": repr(spec.factory_args), "signature": list(sig), "cc": list(cc)}
    bound = launch_bounds(spec)
    if bound is not None:
        key["launch_bounds"] = bound
    if spec.whole_program:
        key["whole_program"] = True
    return _cache.key_text(key)


_compiled: dict = {}
_compile_lock = threading.Lock()


def compile_kernel(spec: KernelLaunch, sig: tuple, cc) -> Compiled:
    """The kernel of ``spec`` for argument types ``sig`` and compute capability ``cc``: from memory, from the
    disk cache, or compiled (and then stored in the cache)."""
    import time

    cc = tuple(cc)[:2] + (("a",) if spec.arch_specific else ())
    key = _cache_key(spec, sig, cc)
    hit = _compiled.get(key)
    if hit is not None:
        return hit
    with _compile_lock:
        hit = _compiled.get(key)
        if hit is not None:
            return hit
        # a user's functions are named by their identity in this process: their kernels stay out of the disk cache
        disk = not any(isinstance(a, Mods) for a in spec.factory_args)
        entry = _cache.load(key) if disk else None
        if entry is not None:
            header, cubin = entry
            result = Compiled(cubin, header["entry"], header["param_sizes"], header["resources"], cached=True)
        else:
            t0 = time.perf_counter()
            fn = spec.factory(*spec.factory_args)
            cubin, log, ptx = build(fn.py_func, f"void({', '.join(sig)})", cc, launch_bounds(spec),
                                    whole_program=spec.whole_program)
            name, sizes = entry_and_params(ptx)
            result = Compiled(cubin, name, sizes, resources_from_log(log), seconds=time.perf_counter() - t0)
            if disk:
                _cache.store(key, cubin, entry=name, param_sizes=sizes, resources=result.resources,
                             kernel=spec.name, compile_seconds=round(result.seconds, 3))
        _compiled[key] = result
        return result


# ---------------------------------------------------------------------------------------------------------------
# the GPU launch: one parameter buffer per kernel of a plan, pointers written per call
# ---------------------------------------------------------------------------------------------------------------


_functions: dict = {}


def _function(compiled: Compiled, device_id: int, shared_bytes: int):
    """The CUfunction of a compiled kernel in the current context, with its dynamic shared memory opt-in."""
    key = (id(compiled), device_id)
    fn = _functions.get(key)
    if fn is None:
        drv = _driver()
        cuda.current_context()  # the primary context of Numba's current device, current on this thread
        image = ctypes.create_string_buffer(compiled.cubin, len(compiled.cubin))
        module = _check(drv.cuModuleLoadData(ctypes.addressof(image)), "cuModuleLoadData")
        fn = _check(drv.cuModuleGetFunction(module, compiled.entry.encode()), "cuModuleGetFunction")
        if compiled.resources.get("registers") is None:
            compiled.resources.update(loaded_resources(drv, fn))
        fn = [fn, module, 0]  # (function, module kept alive, opted-in shared bytes)
        _functions[key] = fn
    if shared_bytes > STATIC_SHARED_LIMIT and shared_bytes > fn[2]:
        drv = _driver()
        attr = drv.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
        _check(drv.cuFuncSetAttribute(fn[0], attr, shared_bytes), "cuFuncSetAttribute")
        fn[2] = shared_bytes
    return fn[0]


def loaded_resources(drv, function) -> dict:
    """Registers, static shared memory and local memory (``stack_bytes``) a thread of a loaded kernel takes, as the
    driver states them: for a kernel whose assembler's log stated none (CUDA's compute cache served its link, or
    the disk cache kept None). Spills stay None: the driver tells a thread's local memory, not what fills it."""
    attr = drv.CUfunction_attribute
    return {name: int(_check(drv.cuFuncGetAttribute(getattr(attr, which), function), "cuFuncGetAttribute"))
            for name, which in (("registers", "CU_FUNC_ATTRIBUTE_NUM_REGS"),
                                ("static_shared_bytes", "CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES"),
                                ("stack_bytes", "CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES"))}


def uses_local_memory(spec: KernelLaunch, arrays: dict, scalars: dict, device) -> bool:
    """Whether a thread of the kernel of ``spec`` (compiled for ``device``, a GPU's) takes local memory: spills or
    a stack (the driver tells local memory alone, not what fills it), from the assembler's log, else from the
    kernel loaded on the current device."""
    compiled = compile_kernel(spec, spec.signature(arrays, scalars), device.cc)
    r = compiled.resources
    if r.get("registers") is None:
        _function(compiled, cuda.get_current_device().id, spec.shared_bytes)  # (fills in the driver's figures)
    return bool(r["stack_bytes"] or r.get("spill_stores") or r.get("spill_loads"))


def _launcher():
    """The fastest driver entry point at hand, as ``launch(function, gx, gy, gz, bx, by, bz, shared, stream,
    params, extra)``: CuPy's launchKernel (a Cython wrapper taking plain integers), else cuda-bindings'
    cuLaunchKernel (errors checked here). Returns (name, launch)."""
    launch = getattr(getattr(getattr(_arrays.cupy, "cuda", None), "driver", None), "launchKernel", None)
    if launch is not None:
        return "cupy.cuda.driver.launchKernel", launch
    drv = _driver()

    def run(fn, gx, gy, gz, bx, by, bz, smem, stream, params, extra):
        err = drv.cuLaunchKernel(fn, gx, gy, gz, bx, by, bz, smem, stream, params, extra)[0]
        if int(err) != 0:
            raise RuntimeError(f"cuLaunchKernel failed: {err!r}")

    return "cuda.bindings.driver.cuLaunchKernel", run


class Bound:
    """One kernel of a plan, ready to launch: constant parameters written once, pointers per call."""

    def __init__(self, spec: KernelLaunch, arrays: dict, scalars: dict, cc, device_id: int):
        self.spec = spec
        sig = spec.signature(arrays, scalars)
        self.compiled = compile_kernel(spec, sig, cc)
        self.fn = _function(self.compiled, device_id, spec.shared_bytes)
        self.fn_int = int(self.fn)
        values, patches = [], []  # (ctype, value); (index into values, name)
        intp = ctypes.c_int64
        for p in spec.params:
            if p in arrays:
                m = arrays[p]
                patches.append((len(values) + 4, p))
                values += [(ctypes.c_uint64, 0), (ctypes.c_uint64, 0), (intp, m.size), (intp, m.dtype.itemsize),
                           (ctypes.c_uint64, 0)]
                values += [(intp, n) for n in m.shape] + [(intp, s) for s in m.strides]
            elif p in PER_CALL_SCALARS:
                patches.append((len(values), p))
                values.append((ctypes.c_uint64, 0))
            else:
                v = np.asarray(scalars[p])
                values.append((np.ctypeslib.as_ctypes_type(v.dtype), v.item()))
        sizes = self.compiled.param_sizes
        if [ctypes.sizeof(t) for t, _ in values] != list(sizes):
            raise RuntimeError(f"kernel {spec.name}: the parameters laid out ({[ctypes.sizeof(t) for t, _ in values]}) "
                               f"differ from the compiled kernel's ({sizes})")
        offsets, off = [], 0
        for size in sizes:
            off = -(-off // size) * size
            offsets.append(off)
            off += size
        self.buffer = (ctypes.c_uint8 * max(8, -(-off // 8) * 8))()
        base = ctypes.addressof(self.buffer)
        for (ctype, value), o in zip(values, offsets):
            ctype.from_address(base + o).value = value
        self.pointers = (ctypes.c_void_p * len(offsets))(*[base + o for o in offsets])
        self.params_address = ctypes.addressof(self.pointers)
        # 8-byte slots: pointers, seed and offset are 8-aligned
        self.words = memoryview(self.buffer).cast("B").cast("Q")
        self.patches = [(offsets[i] // 8, name) for i, name in patches]
        grid = tuple(spec.grid) + (1,) * (3 - len(spec.grid))
        block = tuple(spec.block) + (1,) * (3 - len(spec.block))
        self.launcher, self.launch = _launcher()
        fn = self.fn_int if self.launcher.startswith("cupy") else self.fn
        self.prefix = (fn, *grid, *block, spec.shared_bytes)
        self.lock = threading.Lock()

    def fix(self, constants: dict):
        """Write the addresses that are the same at every call (``constants``: name -> address; the dummies of
        absent inputs, the sink of discarded outputs) once; a call then writes only its own arrays'."""
        with self.lock:
            for slot, name in self.patches:
                if name in constants:
                    self.words[slot] = constants[name]
            self.patches = [(slot, name) for slot, name in self.patches if name not in constants]

    def __call__(self, values: dict, stream: int):
        with self.lock:  # the buffer is shared; the driver copies it at launch
            words = self.words
            for slot, name in self.patches:
                words[slot] = values[name]
            self.launch(*self.prefix, stream, self.params_address, 0)


SIM_SWITCH_INTERVAL_S = 0.0005  # the interpreter's thread switch interval while a simulated kernel runs


def _install_yielding_block_manager():
    """Give Numba's simulator a block manager whose poll hands over the interpreter (flashnumba does this on
    import, under the simulator; it changes how fast simulated kernels run, not what they compute).

    The simulator runs each CUDA thread of a block as a Python thread and releases them from ``syncthreads``
    once a loop in the launching thread has seen every live one blocked there. That loop never blocks, so each
    time a simulated thread waits (at a barrier, or at a warp's or warpgroup's rendezvous of :mod:`.kernels.ptx`)
    the interpreter may pass to the loop, which keeps it for a whole switch interval: a rendezvous of 32 threads
    cost some 32 intervals. This manager's loop sleeps for zero seconds on every round, which lets a waiting
    thread run at once; what it checks, and when it releases a barrier, are unchanged: every live thread blocked
    in ``syncthreads``; an exception in any thread aborts the block."""
    import time

    from numba.cuda.simulator import kernel as simkernel

    class YieldingBlockManager(simkernel.BlockManager):
        def run(self, grid_point, *args):
            def target():
                self._f(*args)

            threads = [simkernel.BlockThread(target, self, grid_point, p, self._debug)
                       for p in np.ndindex(*self._block_dim)]
            for t in threads:
                t.start()
            live = threads
            while live:
                time.sleep(0)  # (releases the interpreter: a thread that can run now runs)
                failed = next((t for t in live if t.exception), None)
                if failed is not None:
                    for t in threads:  # the others stop at their next syncthreads
                        t.abort, t.syncthreads_blocked = True, False
                        t.syncthreads_event.set()
                    raise failed.exception[0].with_traceback(failed.exception[1])
                live = [t for t in live if t.is_alive()]
                if live and all(t.syncthreads_blocked for t in live):
                    for t in live:
                        t.syncthreads_blocked = False
                        t.syncthreads_event.set()
            for t in threads:
                if t.exception:
                    raise t.exception[0].with_traceback(t.exception[1])

    simkernel.BlockManager = YieldingBlockManager


def _install_direct_device_calls():
    """Let a simulated thread call the device functions of flashnumba's kernel modules without a lock (flashnumba
    does this on import, under the simulator; like :func:`_install_yielding_block_manager`, it changes how fast
    simulated kernels run, not what they compute).

    Inside a simulated kernel, ``cuda`` must name the simulator's kernel context in the globals of every function
    that runs. Numba's simulator swaps it in on each call of a device function: two locks a call, and a scan of
    the module's globals whenever no other thread is inside one of its functions. With a block's hundreds of
    threads calling small device functions, the threads queue on those locks. Here a launch swaps the context
    into the kernel's module and into every module of :mod:`flashnumba.kernels` once, for the whole launch, with
    the simulator's own function (so its count keeps the swap for as long as any holder needs it); a device
    function of those modules then runs as it is. Any other (a user's score_mod, say) takes the simulator's path."""
    import contextlib
    import types

    from numba.cuda.simulator import kernel as simkernel

    swap = simkernel.swapped_cuda_module
    held = {}  # id(module globals) -> launches holding them swapped
    held_lock = threading.Lock()

    @contextlib.contextmanager
    def swapped_cuda_module(fn, fake_cuda_module):
        if isinstance(threading.current_thread(), simkernel.BlockThread):  # a device function in a running kernel
            if id(fn.__globals__) in held:
                yield
            else:
                with swap(fn, fake_cuda_module):
                    yield
            return
        # a launch: the kernel's module and the kernel modules, swapped until every block has run
        spaces = {id(fn.__globals__): fn.__globals__}
        spaces.update((id(vars(m)), vars(m)) for name, m in list(sys.modules.items())
                      if name.startswith(__package__ + ".kernels") and m is not None)
        with contextlib.ExitStack() as stack:
            for g in spaces.values():
                stack.enter_context(swap(types.SimpleNamespace(__globals__=g), fake_cuda_module))
            with held_lock:
                for gid in spaces:
                    held[gid] = held.get(gid, 0) + 1
            try:
                yield
            finally:
                with held_lock:
                    for gid in spaces:
                        held[gid] -= 1
                        if not held[gid]:
                            del held[gid]

    simkernel.swapped_cuda_module = swapped_cuda_module


def _install_shared_arrays_made_once():
    """Make each static shared array of a simulated launch once, whichever thread reaches it first (flashnumba
    does this on import, under the simulator).

    Numba's simulator keys a launch's static shared arrays by the line that declares them: the first thread to
    reach the line makes the array and stores it, the others look it up. Looking up and storing are two steps, so
    two threads of a block's first touch can each find nothing, each make an array, and the one stored last
    wins: the other thread then writes to an array the block never reads, and the block reads uninitialised
    memory where its writes should be (seen as a rare wrong gradient, once in about a hundred runs of a test).
    Here the store is one atomic ``dict.setdefault``, so every thread gets the array stored first. The caller's
    line comes from its frame rather than from a walk of the whole stack, as the simulator's did."""
    from numba.cuda.simulator import kernelapi
    kernelapi_types, numpy_support = kernelapi.types, kernelapi.numpy_support  # (as the simulator imports them)

    simulators_array, getframe = kernelapi.FakeCUDAShared.array, sys._getframe

    def array(self, shape, dtype, alignment=None):
        if shape == 0 or alignment is not None:  # dynamic shared memory (one buffer), or the simulator's refusal
            return simulators_array(self, shape, dtype, alignment)
        frame = getframe(1)
        caller = (frame.f_code.co_filename, frame.f_lineno)
        made = self._allocations.get(caller)
        if made is None:
            if isinstance(dtype, kernelapi_types.Type):
                dtype = numpy_support.as_dtype(dtype)
            made = self._allocations.setdefault(caller, np.empty(shape, dtype))
        return made

    kernelapi.FakeCUDAShared.array = array


if SIMULATOR:
    _install_yielding_block_manager()
    _install_direct_device_calls()
    _install_shared_arrays_made_once()


class SimBound:
    """One kernel of a plan under the simulator: Numba's dispatcher, arrays and NumPy scalars as they are.

    The simulator runs each CUDA thread of a block as a Python thread, and its block manager polls them from the
    launching thread (:func:`_install_yielding_block_manager`). The launch runs with a tenth of Python's default
    thread switch interval (:data:`SIM_SWITCH_INTERVAL_S`), so that a thread a barrier released soon runs, and
    puts the caller's back after."""

    def __init__(self, spec: KernelLaunch, arrays: dict, scalars: dict):
        self.spec = spec
        self.kernel = spec.factory(*spec.factory_args)
        self.scalars = scalars

    def __call__(self, values: dict, stream: int = 0):
        s = self.spec
        args = [values[p] if p in values else self.scalars[p] for p in s.params]
        saved = sys.getswitchinterval()
        sys.setswitchinterval(min(saved, SIM_SWITCH_INTERVAL_S))
        try:
            self.kernel[s.grid, s.block, 0, s.shared_bytes](*args)
        finally:
            sys.setswitchinterval(saved)


def bind(spec: KernelLaunch, arrays: dict, scalars: dict, device):
    """A callable ``(values, stream)`` launching ``spec``: values maps the array parameters to device pointers
    (GPU) or to device arrays (simulator), and holds the per-call scalars."""
    if SIMULATOR:
        return SimBound(spec, arrays, scalars)
    return Bound(spec, arrays, scalars, device.cc, cuda.get_current_device().id)


# ---------------------------------------------------------------------------------------------------------------
# a whole call: the plan's inputs in, its kernels launched, its outputs out
# ---------------------------------------------------------------------------------------------------------------

_dummies: dict = {}
SCRATCH_ALIGN = 256  # bytes: where each temporary starts in a call's scratch (an allocator's own alignment)


def dummy(name, shape, dtype):
    """Small arrays the kernels take but, without the option, never read (one per process)."""
    key = (name, shape, np.dtype(dtype).str)
    if key not in _dummies:
        host = np.zeros(shape, dtype)
        if SIMULATOR or _arrays.cupy is None:
            _dummies[key] = cuda.to_device(host)
        else:
            _dummies[key] = _arrays.cupy.asarray(host)
    return _dummies[key]


_sinks: dict = {}  # (device id, library) -> [(array, bytes, address)], the last the largest
_sinks_lock = threading.Lock()


def sink(nbytes: int, torch_side: bool = False) -> int:
    """The address of at least ``nbytes`` of device memory on the current device that kernels write and nothing
    reads (outputs a plan discards): one buffer a process and library, shared by every call and stream. A larger
    one replaces it when needed; the smaller ones are kept, never freed, as a kernel still queued may write them.
    torch's calls take torch's memory (its caching allocator works while a CUDA graph is being captured), the
    others CuPy's or Numba's."""
    dev = cuda.get_current_device().id
    with _sinks_lock:
        bufs = _sinks.setdefault((dev, "torch" if torch_side else "other"), [])
        if not bufs or bufs[-1][1] < nbytes:
            nbytes = max(nbytes, 2 * bufs[-1][1] if bufs else 0, 4096)
            if torch_side:
                arr = sys.modules["torch"].empty(nbytes, dtype=sys.modules["torch"].uint8, device=f"cuda:{dev}")
                bufs.append((arr, nbytes, arr.data_ptr()))
            elif _arrays.cupy is None:
                arr = cuda.device_array(nbytes, np.uint8)
                bufs.append((arr, nbytes, arr.device_ctypes_pointer.value))
            else:
                with _arrays.cupy.cuda.Device(dev):
                    arr = _arrays.cupy.empty(nbytes, np.uint8)
                bufs.append((arr, nbytes, arr.data.ptr))
        return bufs[-1][2]


def _poison(dtype):
    """The NaN-poisoning fill value of an output of kernel dtype ``dtype`` (see :meth:`Call._alloc`)."""
    dtype = np.dtype(dtype)
    return 0x7FC0 if dtype == np.uint16 else 0xFF if dtype == np.uint8 else -1 if dtype.kind == "i" else np.nan


def _torch_stream(index: int) -> int:
    """torch's current CUDA stream on device ``index``, as a handle: the raw getter torch's own compiled code uses
    (a fraction of a microsecond), else the public ``torch.cuda.current_stream`` (several)."""
    torch = sys.modules["torch"]
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    return raw(index) if raw is not None else torch.cuda.current_stream(index).cuda_stream


class Call:
    """A plan made runnable: its kernels bound, its inputs and outputs known.

    ``plan`` is a :class:`flashnumba.planner.Plan`; ``run(arrays, seed, offset)`` takes the user's arrays in the order
    of ``plan.inputs`` (None where an optional one is absent) and returns the outputs marked as returned, in the
    caller's array type.
    """

    def __init__(self, plan):
        self.plan = plan
        self.like = plan.like
        self.bound = [bind(s, plan.arrays, plan.scalars, plan.device) for s in plan.launches]
        self.inputs = plan.inputs
        self.outputs = plan.outputs
        self.torch = self.like == "torch"
        if not SIMULATOR:
            self._prepare()

    # -- on a GPU --------------------------------------------------------------------------------------------

    def _prepare(self):
        """What every call does the same way, decided once: the dummies' addresses, how each input's address is
        read, how each output is allocated, which stream the kernels go on."""
        self.base = {}
        # (position in the call's arrays, name, copied first, address getter, copied back, padded copy's width)
        self.reads = []
        for i, spec in enumerate(self.inputs):
            if spec.kind == "none":
                d = dummy(spec.name, spec.dummy_shape, spec.dummy_dtype)
                self.base[spec.name] = _arrays.POINTER[_arrays.kind(d)](d)
            else:
                moved = spec.to_device or spec.copy or spec.pad
                kind = (("cupy" if _arrays.cupy is not None else "numba") if spec.to_device or (
                    spec.pad and spec.kind != "torch") else spec.kind)
                self.reads.append((i, spec.name, moved and spec.kind, _arrays.POINTER[kind], moved and spec.written,
                                   spec.pad))
        self._byte = sys.modules["torch"].uint8 if self.torch else np.dtype(np.uint8)
        self.allocs = []  # (name, shape, kernel dtype) of the returned outputs
        self.crops = []  # (position among the returned outputs, the caller's width) of those computed wider
        self.scratch = []  # (name, byte offset) of the temporaries, which share one allocation of scratch_bytes
        self.scratch_bytes = 0
        self.zeroed = []  # (byte offset, bytes) of the temporaries that start as zeros (accumulators)
        discarded = []  # (name, bytes) of the outputs written and never read: in the process's sink
        for spec in self.outputs:
            kdtype = np.dtype(np.uint16) if _arrays.is_bfloat16(spec.dtype) else np.dtype(spec.dtype)
            if spec.returned:
                if spec.width:
                    self.crops.append((len(self.allocs), spec.shape[-1]))
                self.allocs.append((spec.name, spec.shape[:-1] + (spec.width,) if spec.width else spec.shape,
                                    _arrays.torch_dtype(spec.dtype) if self.torch else kdtype))
            elif spec.discarded:
                discarded.append((spec.name, int(np.prod(self.plan.arrays[spec.name].shape)) * kdtype.itemsize))
            else:
                self.scratch.append((spec.name, self.scratch_bytes))
                nbytes = int(np.prod(self.plan.arrays[spec.name].shape)) * kdtype.itemsize
                if spec.zeroed:
                    self.zeroed.append((self.scratch_bytes, nbytes))
                self.scratch_bytes += -(-nbytes // SCRATCH_ALIGN) * SCRATCH_ALIGN
        if discarded:  # (each on its own SCRATCH_ALIGN bytes, as in the scratch)
            at = sink(sum(-(-n // SCRATCH_ALIGN) * SCRATCH_ALIGN for _, n in discarded), self.torch)
            for name, n in discarded:
                self.base[name] = at
                at += -(-n // SCRATCH_ALIGN) * SCRATCH_ALIGN
        # (maps parameter, entries) of each kernel with tensor maps; the others' maps parameters get a dummy
        self.maps = [(b.spec.maps_param, b.spec.tensor_maps) for b in self.bound if b.spec.tensor_maps]
        for b in self.bound:
            if b.spec.maps_param is not None and not b.spec.tensor_maps:
                d = dummy("maps", (1, ptx_hopper.MAP_WORDS), np.uint64)
                self.base[b.spec.maps_param] = _arrays.POINTER[_arrays.kind(d)](d)
        for b in self.bound:  # (the base's addresses written into the launches' parameters once)
            b.fix(self.base)
        self.host_results = [s.dtype for s in self.outputs if s.returned] if self.like == "numpy" else None
        if self.torch:
            self.empty = None
        elif _arrays.cupy is not None and self.like != "numba":
            self.empty = _arrays.cupy.ndarray  # (cupy.empty without its Python frame: the same array)
        else:
            self.empty = cuda.device_array

    def _stream(self, ref):
        """The caller's current stream: torch's (for ref's device) for torch tensors, CuPy's for CuPy arrays (and
        for NumPy inputs, which are copied with CuPy), else the legacy default stream."""
        if self.torch:
            return _torch_stream(ref.device.index)
        if _arrays.cupy is not None and self.like != "numba":
            return _arrays.cupy.cuda.get_current_stream().ptr
        return 0

    def _on(self, stream: int):
        """A context in which torch's or CuPy's allocations and copies go on ``stream``."""
        if self.torch:
            torch = sys.modules["torch"]
            return torch.cuda.stream(torch.cuda.ExternalStream(stream))
        if _arrays.cupy is not None:
            return _arrays.cupy.cuda.ExternalStream(stream)
        import contextlib

        return contextlib.nullcontext()

    def _alloc(self, shape, dtype, ref):
        """(array, address) of a new output; NaN-filled when ``config.poison_outputs`` is set (bfloat16 bits:
        0x7FC0; the bytes of the temporaries' scratch: 0xFF, a NaN in every float type; integers: -1)."""
        if self.torch:
            torch = sys.modules["torch"]
            arr = torch.empty(shape, dtype=dtype, device=ref.device)
            if config.poison_outputs:
                arr.fill_(255 if dtype == self._byte else -1 if dtype == torch.int32 else float("nan"))
            return arr, arr.data_ptr()
        if self.empty is not cuda.device_array:
            arr = self.empty(shape, dtype)
            if config.poison_outputs:
                arr.fill(_poison(dtype))
            return arr, arr.data.ptr
        if config.poison_outputs:
            host = np.full(shape, _poison(dtype), dtype)
            arr = cuda.to_device(host)
        else:
            arr = cuda.device_array(shape, dtype)
        return arr, arr.device_ctypes_pointer.value

    def prepare(self, arrays, seed=0, offset=0):
        """(values, outputs, temporaries) of a call on a GPU: the address of every array the kernels take, the
        outputs allocated (those returned, in order), and the copies that must live until the kernels ran."""
        values = {}  # (the base's addresses are in the launches' parameters already: Bound.fix)
        values["seed"] = int(seed)
        values["offset"] = int(offset)
        keep = []
        for i, name, copy_from, address, back, pad in self.reads:
            x = arrays[i]
            if pad:
                x = _arrays.padded_copy(x, copy_from, pad)
                keep.append(x)
            elif copy_from:
                x = _arrays.device_copy(x, copy_from)
                keep.append((arrays[i], x) if back else x)  # (a written input: the user's array and its copy)
            values[name] = address(x)
        ref = arrays[0]
        outs = []
        for name, shape, dtype in self.allocs:
            arr, values[name] = self._alloc(shape, dtype, ref)
            outs.append(arr)
        if self.scratch:
            arr, base = self._alloc((self.scratch_bytes,), self._byte, ref)
            keep.append(arr)
            for name, off in self.scratch:
                values[name] = base + off
            for off, nbytes in self.zeroed:  # on the call's stream (torch's zero_, CuPy's memset; Numba: a copy)
                part = arr[off:off + nbytes]
                if self.torch:
                    part.zero_()
                elif self.empty is cuda.device_array:
                    part.copy_to_device(np.zeros(nbytes, np.uint8))
                else:
                    part.fill(0)
        return values, outs, keep

    def run(self, arrays, seed=0, offset=0, stream=None):
        """Launch the plan's kernels on ``stream`` (a CUstream handle; None: the arrays' own current stream,
        see :meth:`_stream`) and return the outputs."""
        if SIMULATOR:
            return self._run_sim(arrays, seed, offset)
        if stream is None:
            values, outs, keep = self.prepare(arrays, seed, offset)
            stream = self._stream(arrays[0])
        else:  # outputs, temporaries and copies on the given stream too: ordered with the kernels, and returned
            with self._on(stream):  # to the allocator's pool of that stream
                values, outs, keep = self.prepare(arrays, seed, offset)
        for param, entries in self.maps:
            values[param] = _tensormap.device_maps(
                [(values[name], self.plan.arrays[name].shape, rows, span) for name, rows, span in entries], stream)
        for b in self.bound:
            b(values, stream)
        for x in keep:  # what the kernels wrote into the copy of an input, into the input itself
            if isinstance(x, tuple):
                _arrays.copy_back(*x)
        if self.host_results is not None:
            outs = [_arrays.to_host_as(o, dt) for o, dt in zip(outs, self.host_results)]
        if self.crops:  # (a device array's on the kernels' stream; a NumPy caller's on the host, copied once)
            with self._on(stream):
                for n, width in self.crops:
                    outs[n] = _arrays.crop(outs[n], width)
        return outs

    # -- in the simulator ------------------------------------------------------------------------------------

    def _run_sim(self, arrays, seed, offset):
        values = {"seed": np.uint64(seed), "offset": np.uint64(offset)}
        back = []
        arrays = tuple(arrays) + (None,) * (len(self.inputs) - len(arrays))  # the trailing optional ones absent
        for spec, given in zip(self.inputs, arrays):
            x = given
            if x is None:
                values[spec.name] = dummy(spec.name, spec.dummy_shape, spec.dummy_dtype)
                continue
            if spec.broadcast is not None:  # ALiBi slopes (nheads,) -> (batch, nheads), a contiguous copy
                host = _arrays.to_host(x)
                x = np.ascontiguousarray(np.broadcast_to(host.reshape(-1, spec.broadcast[1]), spec.broadcast))
                values[spec.name] = cuda.to_device(x)
                continue
            kind = spec.kind
            if spec.pad:
                x, kind = _arrays.padded_copy(_arrays.to_host(x), "numpy", spec.pad), "numba"
            if spec.lead:
                x = _arrays.with_leading_axis(x, kind)
            # (an array the kernels write in place is handed over itself: the simulator copies it back; a strided
            # NumPy one, which the simulator cannot copy, as a contiguous copy copied back after the kernels)
            if spec.written and isinstance(x, np.ndarray) and not x.flags.c_contiguous:
                x = np.ascontiguousarray(x)
                back.append((given, x))
            values[spec.name] = _arrays.bits(x) if spec.written else _arrays.to_kernel(x, kind)
        outs = []
        for spec in self.outputs:
            user, dev = _arrays.empty(self.plan.arrays[spec.name].shape, spec.dtype, self.like)
            if spec.zeroed:
                dev.copy_to_device(np.zeros(dev.shape, dev.dtype))
            values[spec.name] = dev
            if spec.returned:
                outs.append((user, dev, spec))
        for b in self.bound:
            if b.spec.maps_param is not None:
                entries = [(values[n], rows, span) for n, rows, span in b.spec.tensor_maps]
                values[b.spec.maps_param] = (_tensormap.sim_maps(entries) if entries
                                             else dummy("maps", (1, ptx_hopper.MAP_WORDS), np.uint64))
        for b in self.bound:
            b(values)
        for user, copy in back:
            _arrays.copy_back(user, copy)
        result = []
        for user, dev, spec in outs:
            r = _arrays.to_caller(user, dev, self.like)
            r = r[0] if len(spec.shape) < len(self.plan.arrays[spec.name].shape) else r
            result.append(_arrays.crop(r, spec.shape[-1]) if spec.width else r)
        return result
