"""python -m flashnumba sweep: the configurations it would time (without a GPU), and that it needs a GPU."""

from __future__ import annotations

import pytest

from flashnumba import tiling
from flashnumba.tools import sweep


@pytest.mark.parametrize("arch", ["sm_80", "sm_86", "sm_90"])
@pytest.mark.parametrize("family", list(sweep.FAMILIES))
def test_candidates_are_valid_fit_and_include_the_default(family, arch):
    limits = tiling.ARCHS[arch]
    if family.startswith("wgmma"):  # Hopper's kernels: their tables are for compute capability 9.0 alone
        if arch != "sm_90":
            assert not any(c.applies(64, limits) for c in tiling.TABLES[family])
            return
    dims = (64, 128) if family in ("tc", "tc_dq", "tc_dkdv", "tf32", "3xtf32") or family.startswith("wgmma") else \
        (32, 64, 128)
    for d in dims:
        found = sweep.candidates(family, d, limits)
        assert found, (family, d)
        for m, n, nt in found:
            t = tiling.threads_of(family, tiling.Tiles(m, n, nt or max(m, n)))
            tiling.check(family, d, t)
            assert tiling.fits(family, d, t, limits)
        default = tiling.default(family, d, limits).tiles
        assert any((m, n) == (default.block_m, default.block_n) and nt in (None, default.num_threads)
                   for m, n, nt in found), (family, d, default)


def test_the_sweep_needs_a_gpu(capsys):
    from flashnumba import SIMULATOR

    if not SIMULATOR:
        pytest.skip("on a GPU the sweep runs")
    assert sweep.main(["tc"]) == 2
    assert "simulator" in capsys.readouterr().out
