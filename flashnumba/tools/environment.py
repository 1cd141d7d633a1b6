"""Where and with what a measurement was made: date, device, backend, package versions and the command."""

from __future__ import annotations

import datetime
import json
import os
import sys

from .. import _backend


def environment():
    env = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               device=_backend.device_name(), backend=_backend.BACKEND, versions=_backend.versions(),
               command="python -m flashnumba " + " ".join(sys.argv[1:]))
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
