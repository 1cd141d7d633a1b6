"""Where and with what a measurement was made: date, device, backend, package versions and the command."""

from __future__ import annotations

import datetime
import json
import os
import shlex
import sys

from .. import _backend


def command(argv=None) -> str:
    """The command line that is running: ``python -m flashnumba ...`` for the package's command, ``python
    scripts/x.py ...`` for a script (its path relative to the working directory where it lies below it)."""
    argv = sys.argv if argv is None else argv
    script = argv[0] if argv else ""
    if not script:  # (an interactive interpreter)
        return "python"
    if os.path.basename(script) == "__main__.py":
        run = ["-m", os.path.basename(os.path.dirname(os.path.abspath(script)))]
    else:
        rel = os.path.relpath(os.path.abspath(script))
        run = [script if rel.startswith("..") else rel]
    return shlex.join(["python", *run, *argv[1:]])


def environment():
    env = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               device=_backend.device_name(), backend=_backend.BACKEND, versions=_backend.versions(),
               command=command())
    try:
        import torch

        env["versions"]["torch"] = torch.__version__
    except ImportError:
        pass
    return env


def write_json(result, out_dir, name):
    """``result`` as out_dir/name (indented JSON), the folder made where missing; returns the path."""
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, name)
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    return path
