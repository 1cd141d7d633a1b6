"""The compiled-kernel cache on disk: a kernel compiled once is loaded, not recompiled, by every later process.

Numba's own ``cache=True`` does not serve these kernels: they are made by factories (closures over tile sizes
and compiled-in options), which Numba's cache cannot key. So flashnumba keeps its own: one file per compiled
kernel, named by the SHA-256 of everything the machine code depends on:

* the source of every module of :mod:`flashnumba.kernels` (a change to any kernel invalidates them all);
* the kernel factory's name and arguments (head dim, tiles, compiled-in options, dtype);
* the argument types the kernel is compiled for (dtypes, ranks, C-contiguous or strided);
* the target compute capability;
* the versions of numba, numba-cuda, NVVM / nvJitLink (cuda-bindings) and of this file format.

Where: ``FLASHNUMBA_CACHE_DIR``, else ``$XDG_CACHE_HOME/flashnumba``, else ``~/.cache/flashnumba``.
``FLASHNUMBA_CACHE_DIR=off`` (or ``0``, ``none``) disables it.

Safety. An entry is written to a temporary file in the same directory and renamed into place (atomic on POSIX
and Windows), so a reader sees a whole entry or none, and two processes compiling the same kernel at once
each write a whole file; the last rename wins and both are equal. Each entry holds its own key and the
SHA-256 of its payload: a truncated, corrupt or foreign file fails the check, is removed and rebuilt, never
loaded. A directory that cannot be written (read-only, full) only costs the recompilation: a warning is given
once and the kernel is used from memory.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import tempfile
import warnings
from functools import lru_cache
from pathlib import Path

FORMAT = 1
MAGIC = b"FLASHNUMBA-KERNEL\n"
_OFF = ("off", "0", "none", "false")
_warned: set = set()


def directory() -> Path | None:
    """The cache directory, or None where the cache is disabled."""
    env = os.environ.get("FLASHNUMBA_CACHE_DIR")
    if env is not None:
        if env.strip().lower() in _OFF or not env.strip():
            return None
        return Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "flashnumba"


@lru_cache(maxsize=None)
def source_hash() -> str:
    """SHA-256 of the source of every module of flashnumba.kernels, in name order."""
    h = hashlib.sha256()
    folder = Path(__file__).resolve().parent / "kernels"
    for path in sorted(folder.glob("*.py")):
        h.update(path.name.encode())
        h.update(path.read_bytes())
    return h.hexdigest()


@lru_cache(maxsize=None)
def toolchain() -> dict:
    """The versions the machine code depends on."""
    from importlib import metadata

    out = {"format": FORMAT, "python": sys.version.split()[0]}
    for pkg in ("numba", "numba-cuda", "cuda-bindings", "nvidia-nvjitlink", "nvidia-nvvm"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            out[pkg] = None
    return out


def key_text(parts: dict) -> str:
    """The full key of an entry (a canonical JSON text), from the caller's parts plus source and toolchain."""
    return json.dumps({"source": source_hash(), "toolchain": toolchain(), **parts}, sort_keys=True, default=str)


def _path(key: str) -> Path | None:
    d = directory()
    return None if d is None else d / f"{hashlib.sha256(key.encode()).hexdigest()[:40]}.fnk"


def load(key: str):
    """(header dict, payload bytes) of the entry for ``key``, or None (absent, disabled, or invalid: an invalid
    entry is removed)."""
    path = _path(key)
    if path is None:
        return None
    try:
        data = path.read_bytes()
    except OSError:
        return None
    try:
        if not data.startswith(MAGIC):
            raise ValueError("bad magic")
        rest = data[len(MAGIC):]
        nl = rest.index(b"\n")
        header = json.loads(rest[:nl])
        payload = rest[nl + 1:]
        if header.get("key") != key:
            raise ValueError("key mismatch")
        if len(payload) != header["size"] or hashlib.sha256(payload).hexdigest() != header["sha256"]:
            raise ValueError("payload does not match its checksum")
    except (ValueError, KeyError, TypeError, UnicodeDecodeError):
        try:
            path.unlink()
        except OSError:
            pass
        return None
    return header, payload


def store(key: str, payload: bytes, **info) -> bool:
    """Write an entry atomically; False (and one warning per directory) where it cannot be written."""
    path = _path(key)
    if path is None:
        return False
    header = dict(info, key=key, size=len(payload), sha256=hashlib.sha256(payload).hexdigest())
    blob = MAGIC + json.dumps(header, sort_keys=True).encode() + b"\n" + payload
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".fnk", dir=path.parent)
        with os.fdopen(fd, "wb") as f:
            f.write(blob)
        os.replace(tmp, path)
        return True
    except OSError as err:
        if tmp is not None:
            try:
                os.unlink(tmp)
            except OSError:
                pass
        if str(path.parent) not in _warned:
            _warned.add(str(path.parent))
            warnings.warn(f"flashnumba: cannot write the kernel cache in {path.parent} ({err}); kernels will be "
                          "compiled in every process. Set FLASHNUMBA_CACHE_DIR to a writable directory, or to "
                          "'off'.", RuntimeWarning, stacklevel=3)
        return False


def info() -> dict:
    """Where the cache is, how many entries and bytes it holds."""
    d = directory()
    if d is None:
        return {"directory": None, "enabled": False, "entries": 0, "bytes": 0}
    files = list(d.glob("*.fnk")) if d.is_dir() else []
    return {"directory": str(d), "enabled": True, "entries": len(files),
            "bytes": sum(f.stat().st_size for f in files if f.exists())}


def clear() -> int:
    """Remove every entry (and stray temporary files); returns how many files were removed."""
    d = directory()
    if d is None or not d.is_dir():
        return 0
    n = 0
    for f in list(d.glob("*.fnk")) + list(d.glob(".tmp-*")):
        try:
            f.unlink()
            n += 1
        except OSError:
            pass
    return n
