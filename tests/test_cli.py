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
