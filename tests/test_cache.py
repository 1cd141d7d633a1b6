"""The compiled-kernel cache on disk: entries round-trip; a truncated, corrupt or foreign entry is removed and
rebuilt, never loaded; a directory that cannot be written costs only the recompilation; two processes compiling the
same kernel at once both succeed and leave one valid entry; on a GPU, a call still computes the right answer with a
corrupt or unwritable cache."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings

import pytest

from flashnumba import _cache
from conftest import requires_gpu


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    d = tmp_path / "cache"
    monkeypatch.setenv("FLASHNUMBA_CACHE_DIR", str(d))
    return d


def test_round_trip_info_and_clear(cache_dir):
    key = _cache.key_text({"factory": "f", "args": "(1,)"})
    assert _cache.load(key) is None
    assert _cache.store(key, b"\x7fELF cubin", entry="kernel", param_sizes=[8, 4])
    header, payload = _cache.load(key)
    assert payload == b"\x7fELF cubin" and header["entry"] == "kernel" and header["param_sizes"] == [8, 4]
    info = _cache.info()
    assert info["entries"] == 1 and info["directory"] == str(cache_dir)
    assert _cache.clear() == 1 and _cache.load(key) is None


def _path_of(key):
    return _cache._path(key)


@pytest.mark.parametrize("damage", ["truncate", "flip", "foreign", "garbage"])
def test_a_damaged_entry_is_removed_not_loaded(cache_dir, damage):
    key = _cache.key_text({"factory": "f", "args": "(2,)"})
    _cache.store(key, bytes(range(256)) * 4, entry="kernel")
    path = _path_of(key)
    data = path.read_bytes()
    if damage == "truncate":
        path.write_bytes(data[:-100])
    elif damage == "flip":
        path.write_bytes(data[:-10] + bytes([data[-10] ^ 1]) + data[-9:])
    elif damage == "foreign":  # a whole, valid entry of another key at this key's path
        other = _cache.key_text({"factory": "g", "args": "(3,)"})
        _cache.store(other, b"other", entry="other")
        path.write_bytes(_path_of(other).read_bytes())
    else:
        path.write_bytes(b"not a cache entry at all")
    assert _cache.load(key) is None
    assert not path.exists()


def test_an_unwritable_directory_warns_once_and_goes_on(tmp_path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")  # a directory cannot be made under a file, even by root
    monkeypatch.setenv("FLASHNUMBA_CACHE_DIR", str(blocker / "cache"))
    monkeypatch.setattr(_cache, "_warned", set())
    key = _cache.key_text({"factory": "f", "args": "(4,)"})
    with pytest.warns(RuntimeWarning, match="cannot write the kernel cache"):
        assert not _cache.store(key, b"x")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not _cache.store(key, b"y")  # once per directory
    assert _cache.load(key) is None


def test_disabled(monkeypatch):
    monkeypatch.setenv("FLASHNUMBA_CACHE_DIR", "off")
    assert _cache.directory() is None and not _cache.store("k", b"x") and _cache.load("k") is None


def test_the_key_changes_with_the_kernels_source_and_the_specialisation():
    a = _cache.key_text({"factory": "f", "args": "(64,)", "cc": [9, 0]})
    assert a != _cache.key_text({"factory": "f", "args": "(128,)", "cc": [9, 0]})
    assert a != _cache.key_text({"factory": "f", "args": "(64,)", "cc": [8, 0]})
    assert json.loads(a)["source"] == _cache.source_hash() and json.loads(a)["toolchain"]["format"] == _cache.FORMAT


COMPILE = r"""
import json, sys
from flashnumba import _launch
from flashnumba.kernels import simt_backward
spec = _launch.KernelLaunch("D_i preprocess", "preprocess", simt_backward.make_backward_preprocess_warp,
                            (64, 8, False), ("dout", "out", "delta"), (1, 1), (256,), 0)
sig = ("float16[:, :, :, ::1]", "float16[:, :, :, ::1]", "float32[:, :, ::1]")
c = _launch.compile_kernel(spec, sig, (9, 0))
import hashlib
print(json.dumps(dict(cached=c.cached, sha=hashlib.sha256(c.cubin).hexdigest(), entry=c.entry)))
"""


def _compile(env, wait=True):
    proc = subprocess.Popen([sys.executable, "-c", COMPILE], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    return proc if not wait else _result(proc)


def _result(proc):
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


def test_compiled_kernels_cached_rebuilt_and_raced(tmp_path):
    """Offline (no GPU): two processes compile one kernel into an empty cache at once; a third loads it; a
    truncated entry is rebuilt to the same machine code."""
    pytest.importorskip("cuda.bindings.nvjitlink")
    env = dict(os.environ, FLASHNUMBA_SIMULATOR="0", NUMBA_ENABLE_CUDASIM="0", FLASHNUMBA_CACHE_DIR=str(tmp_path))
    racers = [_compile(env, wait=False) for _ in range(2)]
    first = [_result(p) for p in racers]
    assert first[0]["sha"] == first[1]["sha"]
    entries = list(tmp_path.glob("*.fnk"))
    assert len(entries) == 1 and not list(tmp_path.glob(".tmp-*"))
    third = _compile(env)
    assert third["cached"] and third["sha"] == first[0]["sha"]
    entries[0].write_bytes(entries[0].read_bytes()[: len(entries[0].read_bytes()) // 2])
    rebuilt = _compile(env)
    assert not rebuilt["cached"] and rebuilt["sha"] == first[0]["sha"]
    assert _compile(env)["cached"]


CALL = r"""
import numpy as np, cupy, flashnumba
rng = np.random.default_rng(1)
q, k, v = (cupy.asarray(rng.standard_normal((1, 70, 2, 64)).astype(np.float16)) for _ in range(3))
out, lse = flashnumba.flash_attn_forward(q, k, v, causal=True)
np.save(__import__("sys").argv[1], cupy.asnumpy(out))
"""


@requires_gpu
def test_a_call_is_right_with_a_corrupt_or_unwritable_cache(tmp_path):
    cache = tmp_path / "cache"
    env = dict(os.environ, FLASHNUMBA_CACHE_DIR=str(cache))
    outs = []
    for i, damage in enumerate(("fresh", "loaded", "corrupt", "unwritable")):
        if damage == "corrupt":
            for f in cache.glob("*.fnk"):
                f.write_bytes(f.read_bytes()[:-7])
        if damage == "unwritable":
            (tmp_path / "file").write_text("x")
            env["FLASHNUMBA_CACHE_DIR"] = str(tmp_path / "file" / "cache")
        path = str(tmp_path / f"out{i}.npy")
        proc = subprocess.run([sys.executable, "-c", CALL, path], env=env, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        outs.append(__import__("numpy").load(path))
    for o in outs[1:]:
        assert (o == outs[0]).all()
