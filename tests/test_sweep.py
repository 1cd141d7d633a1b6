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
    assert "simulator" in capsys.readouterr().err


def test_the_hopper_forward_sweep_takes_each_key_tile_that_fits():
    """At head_dim 256 on sm_90 tiles of 32 and 48 keys fit beside Q_i of two warpgroups (three stages: 160 and
    208 KB), those of 64 do not (256 KB); at 64 without a producer every warp copies in passes of 32 rows, so 48
    is refused there."""
    found = sweep.candidates("wgmma", 256, tiling.ARCHS["sm_90"])
    assert (128, 32, 384) in found and (128, 48, 384) in found and (128, 48, 416) not in found
    assert not [c for c in found if c[:2] == (128, 64)]
    found = sweep.candidates("wgmma", 64, tiling.ARCHS["sm_90"])
    assert (128, 48, 384) in found and (128, 48, 256) not in found and (128, 128, 384) in found
