"""flashnumba._tensormap's keeping of tensor maps, with the driver replaced by a recorder (the encoding and the
copies themselves run on the H200: tests/test_ptx_hopper.py and the Hopper forward's GPU tests)."""

from __future__ import annotations

import numpy as np
import pytest

from flashnumba import _driver, _tensormap as tm


class _Driver:
    """Records the copies; ``capturing``: the streams being captured into a CUDA graph."""

    def __init__(self):
        self.copies, self.capturing = [], set()

    def cuMemcpyHtoDAsync(self, dst, src, nbytes, stream):
        self.copies.append((dst, stream))
        return (0,)

    def cuStreamIsCapturing(self, stream):
        return 0, int(stream in self.capturing)


class _Slab(tm._Slab):
    def __init__(self, slots):  # (host memory only; the "device" address a number)
        self.words = np.zeros((slots, tm.SET_MAPS * 16), np.uint64)
        self.address = 1 << 20
        self.slot, self.streams = {}, [set() for _ in range(slots)]


@pytest.fixture
def driver(monkeypatch):
    drv = _Driver()
    monkeypatch.setattr(_driver, "driver", lambda: drv)
    monkeypatch.setattr(tm, "encode", lambda address, dims, strides, box, out: out.fill(address))
    monkeypatch.setattr(tm.cuda, "get_current_device", lambda: type("Device", (), {"id": 0}))
    monkeypatch.setattr(tm.cuda, "synchronize", lambda: drv.copies.append("synchronize"))
    monkeypatch.setattr(tm, "_Slab", _Slab)
    monkeypatch.setattr(tm, "_slabs", {})
    monkeypatch.setattr(tm, "MAX_KEPT", 2)
    return drv


def entries(address):
    return [(address + 4096 * i, (1, 8, 2, 64), 64, 128) for i in range(3)]


def test_a_set_is_copied_once_a_stream_and_again_after_a_capture(driver):
    first = tm.device_maps(entries(4096), 7)
    assert tm.device_maps(entries(4096), 7) == first and driver.copies == [(first, 7)]
    tm.device_maps(entries(4096), 9)  # another stream: its own copy, ordered there
    assert driver.copies[-1] == (first, 9)
    driver.capturing.add(11)  # a capture only records its copy: made again at each call on that stream
    tm.device_maps(entries(4096), 11)
    tm.device_maps(entries(4096), 11)
    assert driver.copies[-2:] == [(first, 11)] * 2
    driver.capturing.clear()
    tm.device_maps(entries(4096), 11)  # (after the capture: copied, then kept)
    tm.device_maps(entries(4096), 11)
    assert driver.copies[-2:] == [(first, 11)] * 2 and len(driver.copies) == 5
    slab = tm._slabs[0]
    assert list(slab.words[0, :48:16]) == [4096, 8192, 12288]  # the maps in the order of the entries


def test_a_full_slab_is_written_afresh_after_the_gpu_is_done(driver):
    a = tm.device_maps(entries(4096), 7)
    b = tm.device_maps(entries(1 << 16), 7)
    assert b == a + tm.SET_MAPS * 128  # the next slot
    driver.capturing.add(7)
    with pytest.raises(RuntimeError, match="being captured"):
        tm.device_maps(entries(1 << 17), 7)
    driver.capturing.clear()
    c = tm.device_maps(entries(1 << 17), 7)
    assert c == a and "synchronize" in driver.copies  # slot 0 again, once what was queued has run
    assert driver.copies[-1] == (a, 7)
    with pytest.raises(ValueError, match="at most"):
        tm.device_maps(entries(0) * 2, 7)
