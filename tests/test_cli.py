"""The command line: every subcommand has --help; the demo runs (in the simulator on a machine without a GPU)."""

from __future__ import annotations

import pytest

from flashnumba.__main__ import main


@pytest.mark.parametrize("command", ["info", "demo", "bench", "sweep", "check", "cache"])
def test_every_subcommand_has_help(command, capsys):
    with pytest.raises(SystemExit) as exit_:
        main([command, "--help"])
    assert exit_.value.code == 0
    assert "usage:" in capsys.readouterr().out


def test_demo_shows_the_default_path_of_each_dtype(capsys):
    assert main(["demo"]) == 0
    out = capsys.readouterr().out
    for dtype in ("float16", "float32"):
        assert f"\n{dtype}: kernel " in out
    assert "max |out - float64 reference|" in out


def test_bad_arguments_are_one_line_errors(capsys, monkeypatch, tmp_path):
    """An architecture that is not one, sizes below 1, a disabled cache, the GPU's demo in the simulator: a line
    saying so, not a traceback."""
    import flashnumba

    assert main(["info", "--arch", "sm_70"]) == 2
    assert "unknown architecture 'sm_70'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:
        main(["info", "--heads", "0"])
    assert exit_.value.code == 2
    assert main(["info", "--head-dims", "512", "--seqlen", "16", "--batch", "1", "--heads", "1"]) == 0
    assert "head_dim 512: head_dim must be in [1, 256]" in capsys.readouterr().out
    monkeypatch.setenv("FLASHNUMBA_CACHE_DIR", "off")
    assert main(["cache", "clear"]) == 0
    assert "disabled" in capsys.readouterr().out
    if flashnumba.SIMULATOR:
        assert main(["demo", "--size", "large"]) == 2
        assert "would take hours" in capsys.readouterr().err
