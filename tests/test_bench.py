"""The benchmark harness runs end to end on a tiny configuration and writes its JSON (flashnumba.bench)."""

from __future__ import annotations

import json

import numpy as np
import pytest

import flashnumba
from flashnumba.tools import bench


def test_bench_runs_and_writes_json(tmp_path, capsys):
    rc = bench.main(["--seqlens", "16", "--head-dims", "16", "--dtypes", "float32", "--causal", "on",
                     "--tokens", "16", "--width", "16", "--repeat", "1", "--warmup", "0",
                     "--impls", "flashnumba_v1", "flashnumba_v3", "standard_cupy", "--passes", "fwd", "bwd", "fwd+bwd",
                     "--out", str(tmp_path)])
    assert rc == 0
    result = json.loads((tmp_path / "bench.json").read_text())
    assert result["environment"]["backend"] == flashnumba.BACKEND
    rows = result["rows"]
    timed = [r for r in rows if "ms" in r]
    assert {r["impl"] for r in timed} == {"flashnumba_v1", "flashnumba_v3", "standard_cupy"}
    assert {r["pass_"] for r in timed} == {"fwd", "bwd", "fwd+bwd"}
    for r in timed:
        assert r["ms"] > 0 and r["tflops"] > 0
        assert r["batch"] == 1 and r["nheads"] == 1
        # flashnumba's rows name the kernels and tiles that ran (both passes' for fwd+bwd); the peers' none
        kernels = r.get("kernels")
        if r["impl"] == "standard_cupy":
            assert kernels is None
            continue
        assert kernels and all(len(x) == 4 and x[1] > 0 for x in kernels)
        if r["impl"] == "flashnumba_v3":
            want = {"fwd": ["forward v3"], "bwd": ["dQ v2", "dK/dV v2"]}
            want["fwd+bwd"] = want["fwd"] + want["bwd"]
            assert [x[0] for x in kernels] == want[r["pass_"]]
    assert "flashnumba_v3" in capsys.readouterr().out


def test_default_run_compares_the_default_path_and_leaves_out_incompatible_pairs(tmp_path):
    """With no --impls: flashnumba's default path beside standard attention (and torch's backends where
    installed); an implementation is not run on a dtype it does not take (CuPy's standard attention on bfloat16),
    and bfloat16 works (on NumPy arrays of ml_dtypes.bfloat16 in the simulator, torch tensors on a GPU)."""
    rc = bench.main(["--seqlens", "16", "--head-dims", "16", "--dtypes", "bfloat16", "float32", "--causal", "on",
                     "--tokens", "16", "--width", "16", "--repeat", "1", "--warmup", "0", "--out", str(tmp_path)])
    assert rc == 0
    rows = json.loads((tmp_path / "bench.json").read_text())["rows"]
    timed = {(r["impl"], r["dtype"], r["pass_"]) for r in rows if "ms" in r}
    assert {("flashnumba", dt, p) for dt in ("bfloat16", "float32") for p in ("fwd", "bwd")} <= timed
    assert ("standard_cupy", "float32", "fwd") in timed
    assert not [r for r in rows if r["impl"] == "standard_cupy" and r["dtype"] == "bfloat16"]
    assert not [r for r in rows if "error" in r]
    assert {r["impl"] for r in rows} <= set(bench.DEFAULT_IMPLS)


def test_validation_rejects_a_wrong_implementation():
    def wrong(q, k, v, dout, causal):  # ignores the causal mask
        return {bench.FWD: lambda: flashnumba.reference.attention_forward(q, k, v)[0]}

    assert bench.validate(wrong, 8, True, "float32", seqlen=12) is not None
    assert bench.validate(bench._flashnumba("v3"), 8, True, "float32", seqlen=12) is None


def test_flop_count():
    assert bench.flops(2, 3, 128, 64, False, "fwd") == 4 * 2 * 3 * 128 * 128 * 64
    assert bench.flops(2, 3, 128, 64, True, "fwd+bwd") == 3.5 * 4 * 2 * 3 * 128 * 128 * 64 / 2


def test_bench_times_window_and_gqa_workloads(tmp_path):
    rc = bench.main(["--seqlens", "24", "--head-dims", "8", "--dtypes", "float32", "--causal", "off",
                     "--tokens", "24", "--width", "16", "--repeat", "1", "--warmup", "0", "--passes", "fwd",
                     "--window", "4", "0", "--gqa", "2", "--impls", "flashnumba_v3", "standard_cupy",
                     "--out", str(tmp_path)])
    assert rc == 0
    rows = json.loads((tmp_path / "bench.json").read_text())["rows"]
    timed = [r for r in rows if "ms" in r]
    assert [r["impl"] for r in timed] == ["flashnumba_v3"] and timed[0]["nheads_k"] == 1
    assert timed[0]["window_size"] == [4, 0]
    assert any("skipped" in r.get("error", "") for r in rows if r["impl"] == "standard_cupy")
    # 24 rows; row i sees keys max(0, i - 4) .. i: 5 keys each but the first four rows
    assert bench.flops(1, 2, 24, 8, False, "fwd", (4, 0)) == 4 * 2 * 8 * (24 * 5 - (4 + 3 + 2 + 1))


def test_bench_times_varlen_workloads(tmp_path):
    rc = bench.main(["--seqlens", "24", "--head-dims", "8", "--dtypes", "float32", "--causal", "on",
                     "--tokens", "48", "--width", "8", "--repeat", "1", "--warmup", "0", "--passes", "fwd", "bwd",
                     "--varlen", "--impls", "flashnumba_v3", "standard_cupy", "--out", str(tmp_path)])
    assert rc == 0
    rows = json.loads((tmp_path / "bench.json").read_text())["rows"]
    timed = [r for r in rows if "ms" in r]
    assert {r["pass_"] for r in timed} == {"fwd", "bwd"} and {r["impl"] for r in timed} == {"flashnumba_v3"}
    lens = timed[0]["varlen_lengths"]
    assert sum(lens) == 48 and all(6 <= n <= 24 for n in lens[:-1]) and 0 < lens[-1] <= 24
    assert timed[0]["tflops"] == bench.varlen_flops(lens, 1, 8, True, "fwd") / timed[0]["ms"] / 1e9
    assert any("no varlen" in r.get("error", "") for r in rows if r["impl"] == "standard_cupy")


def test_varlen_validation_catches_a_wrong_kernel():
    def wrong(q, k, v, dout, cu_q, cu_k, max_q, max_k, causal):  # ignores the sequence boundaries
        def fwd():
            out, lse = flashnumba.flash_attn_forward(q[None], k[None], v[None], causal=causal)
            return out[0], lse
        return {bench.FWD: fwd}

    assert bench.validate_varlen(wrong, 8, False, "float32") is not None
    assert bench.validate_varlen(bench._flashnumba("v3").varlen, 8, False, "float32") is None


def test_tf32_is_validated_against_a_float16_class_baseline():
    """TF32 rounds operands to float16's 10 mantissa bits: an implementation that declares
    ``baseline_dtype = float16`` is checked against NumPy's float16 run. Here a stand-in computes attention on
    inputs rounded to 10 mantissa bits: within the float16-class tolerance, outside the float32 one."""
    assert bench.available_implementations(include_peers=False)["flashnumba_tf32"].baseline_dtype == np.float16

    def tf32_like(q, k, v, dout, causal):
        def to_tf32(x):  # keep 10 of float32's 23 mantissa bits (round to nearest)
            bits = np.asarray(bench._host(x), np.float32).view(np.uint32)  # CuPy arrays on a GPU
            return ((bits + np.uint32(1 << 12)) & np.uint32(0xFFFFE000)).view(np.float32)

        return {bench.FWD: lambda: flashnumba.reference.attention_forward(to_tf32(q), to_tf32(k), to_tf32(v),
                                                                          causal=causal)[0].astype(np.float32)}

    assert bench.validate(tf32_like, 64, True, np.float32, seqlen=40) is not None  # float32's tolerance
    tf32_like.baseline_dtype = np.float16
    assert bench.validate(tf32_like, 64, True, np.float32, seqlen=40) is None


def test_both_timing_modes(tmp_path):
    """--both-modes: each pass timed back to back (--group-ms) and one call per sample, both in the row."""
    rc = bench.main(["--seqlens", "16", "--head-dims", "16", "--dtypes", "float32", "--causal", "off",
                     "--tokens", "16", "--width", "16", "--repeat", "1", "--warmup", "0", "--group-ms", "1",
                     "--both-modes", "--impls", "flashnumba_v3", "--passes", "fwd", "--out", str(tmp_path)])
    assert rc == 0
    (row,) = [r for r in json.loads((tmp_path / "bench.json").read_text())["rows"] if "ms" in r]
    assert row["ms"] > 0 and row["ms_single"] > 0 and row["tflops_single"] > 0


def test_a_measurements_command_names_what_ran(tmp_path, monkeypatch):
    """The command recorded beside a measurement: the package's command, or the script with its arguments."""
    from flashnumba.tools.environment import command

    main = str(tmp_path / "flashnumba" / "__main__.py")
    assert command([main, "bench", "--out", "r"]) == "python -m flashnumba bench --out r"
    monkeypatch.chdir(tmp_path)
    script = str(tmp_path / "scripts" / "flex_bench.py")
    assert command([script, "--backward"]) == "python scripts/flex_bench.py --backward"
    assert command(["/elsewhere/x.py"]) == "python /elsewhere/x.py"
    assert command([script, "--cases", "a b"]) == "python scripts/flex_bench.py --cases 'a b'"
    assert command([]) == command([""]) == "python"


def test_budget_search_reaches_its_limit_and_reports_real_errors():
    """The budget search's own measurement (in the simulator no device memory is counted, so every seqlen fits up
    to the search's limit); an error that is not out of memory is raised, not taken for the end of the search."""
    impls = {"flashnumba": bench.available_implementations(include_peers=False)["flashnumba"]}
    found = bench.longest_seqlen_in_budget(impls, 1.0, head_dim=16, nheads=1, dtype=np.float32, start=16, stop=32)
    assert found == {"flashnumba": 32}

    def broken(q, k, v, dout, causal):
        raise RuntimeError("a bug, not memory")

    with pytest.raises(RuntimeError, match="a bug"):
        bench.longest_seqlen_in_budget({"broken": broken}, 1.0, head_dim=16, nheads=1, start=16, stop=16)


def test_bad_arguments_are_one_line_errors(capsys, tmp_path):
    small = ["--seqlens", "16", "--head-dims", "16", "--tokens", "16", "--width", "16"]
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    for argv, said in ((["--seqlens", "0"], ""), (["--repeat", "0"], ""), (["--gqa", "-1"], ""),
                       (["--from-json", "/no/such.json"], ""), (["--budget-gib", "1", "--budget-max-seqlen", "64"], ""),
                       (small + ["--window", "-5", "3"], "each -1 (unbounded) or >= 0"),
                       (small + ["--out", str(a_file)], "is a file"),
                       (["--dtypes", "float32"] if flashnumba.SIMULATOR else None, "would take hours")):
        if argv is None:  # (on a GPU the default sweep is what it runs)
            continue
        with pytest.raises(SystemExit) as e:
            bench.main(argv)
        err = capsys.readouterr().err
        assert e.value.code == 2 and "error:" in err and said in err
