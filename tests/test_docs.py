"""The API reference: generated from the docstrings with pdoc, without a warning (a docstring pdoc cannot parse,
a module that does not import, a broken cross-reference all fail here)."""

from __future__ import annotations

import importlib.util
import warnings

import pytest


# What the reference covers: the public functions and what a reader studies (the reference, the plan, the kernels);
# the command-line tools and the private layers (_validate, _launch, ...) are linked from the docstrings, not listed.
MODULES = ("flashnumba", "flashnumba.api", "flashnumba.planner", "flashnumba.kernels", "flashnumba.check")  # (and
# flashnumba's own __all__: reference, tiling, config)


def test_api_reference_builds_without_warnings(tmp_path):
    pdoc = pytest.importorskip("pdoc")
    import pdoc.render

    modules = list(MODULES)
    if importlib.util.find_spec("torch") is not None:
        modules.append("flashnumba.torch")  # needs torch
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pdoc.render.configure(docformat="numpy")
        pdoc.pdoc(*modules, output_directory=tmp_path)
    for page in ("flashnumba.html", "flashnumba/api.html", "flashnumba/reference.html", "flashnumba/kernels.html",
                 "flashnumba/kernels/mma_forward.html", "flashnumba/check.html"):
        assert (tmp_path / page).exists(), page
