"""The checker checks itself: each deliberately wrong attention (one classic bug each) is caught by the property
that should catch it, and the correct implementations pass every property (flashnumba.check)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

import flashnumba
from flashnumba import check, reference
from flashnumba.check import Implementation, Unsupported, adapter, check_attention, reference_implementation


def plain_attention(q, k, v, *, causal=False, softmax_scale=None, dropout_p=0.0, seed=None, bug=None):
    """Attention written plainly in NumPy (float32 arithmetic, flash-attn's layout), returning (out, lse); ``bug``
    plants one classic mistake."""
    if bug == "writes-input":
        q *= 1.0 + 2.0**-8  # an in-place "scale" of the caller's array
    dtype = q.dtype
    qf, kf, vf = (np.asarray(x, np.float32) for x in (q, k, v))
    b, sq, h, d = qf.shape
    sk, hk = kf.shape[1], kf.shape[2]
    heads = np.arange(h) % hk if bug == "gqa-modulo" else np.arange(h) // (h // hk)
    kf, vf = kf[:, :, heads], vf[:, :, heads]
    scale = 1.0 / math.sqrt(d) if softmax_scale is None else softmax_scale
    scale = {"no-scale": 1.0, "double-scale": 2 * scale, "scale-1pct": 1.01 * scale}.get(bug, scale)
    if bug == "nondeterministic":  # the keys summed in a different order at each call
        order = np.random.default_rng().permutation(sk)
        kf, vf = kf[:, order], vf[:, order]
    else:
        order = np.arange(sk)
    s = np.einsum("bqhd,bkhd->bhqk", qf, kf) * np.float32(scale)
    if causal:
        i, j = np.arange(sq)[:, None], order[None, :]
        visible = j <= i if bug == "top-left" else j <= i + sk - sq + (bug == "causal-off-by-one")
        s = np.where(visible, s, -np.inf)
    if bug == "drop-last-key" and sk > 1:
        s[..., -1] = -np.inf
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        if bug == "no-max":
            e = np.exp(s)
            lse = np.log(e.sum(axis=-1))
        else:
            m = s.max(axis=-1, keepdims=True)
            m = np.where(np.isfinite(m), m, 0)
            e = np.exp(s - m)
            lse = np.log(e.sum(axis=-1)) + m[..., 0]
        z = e.sum(axis=-1, keepdims=True)
        p = np.divide(e, z, out=np.zeros_like(e), where=z > 0)
    if dropout_p:
        keep = np.random.default_rng(seed).random(p.shape) >= dropout_p
        p = p * keep if bug == "dropout-no-rescale" else p * keep / np.float32(1 - dropout_p)
    if bug == "lse-log2":
        lse = lse / np.log(2)
    out = np.einsum("bhqk,bkhd->bqhd", p, vf)
    if bug == "writes-input-when-causal" and causal:
        q[...] = 0  # the caller's array used as scratch once the result is computed
    if bug == "nan-out":
        out[0, 0, 0, 0] = np.nan
    if bug == "transposed-out":
        out = out.transpose(0, 2, 1, 3)
    return out.astype(np.float64 if bug == "float64-out" else dtype), lse.astype(np.float32)


def plain_varlen(q, k, v, cu_q, cu_k, max_q, max_k, bug=None, **options):
    """Packed sequences one by one through :func:`plain_attention`; ``bug="varlen-one-sequence"`` attends across
    the sequence boundaries (the packed batch taken as one sequence)."""
    if bug == "varlen-one-sequence":
        return plain_attention(q[None], k[None], v[None], **options)[0][0]
    out = np.zeros_like(q)
    for b in range(len(cu_q) - 1):
        rq, rk = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        if rq.stop > rq.start and rk.stop > rk.start:  # (no keys: the rows see nothing, out 0)
            out[rq] = plain_attention(q[None, rq], k[None, rk], v[None, rk], **options)[0][0]
    return out


def implementation(bug=None):
    def forward(q, k, v, **options):
        return plain_attention(q, k, v, bug=bug, **options)

    def varlen(*args, **options):
        return plain_varlen(*args, bug=bug, **options)

    def backward(dout, q, k, v, dropout_p=0.0, seed=None, **options):
        """The reference gradient, with the forward's dropout mask regenerated from the seed (the mutant: from
        another seed)."""
        z = None
        if dropout_p:
            b, sq, h, _ = q.shape
            rng = np.random.default_rng(seed + 1 if bug == "dropout-backward-mask" else seed)
            z = (rng.random((b, h, sq, k.shape[1])) >= dropout_p) / (1 - dropout_p)
        return reference.attention_backward(dout, q, k, v, dropout_z=z, dtype=np.dtype(q.dtype), **options)

    has_backward = bug in (None, "dropout-backward-mask")
    return Implementation(f"plain-{bug or 'correct'}", forward, backward if has_backward else None,
                          supports={"causal", "gqa", "scale", "dropout"}, varlen=varlen)


# each mutant, and the property that must catch it
MUTANTS = {
    "top-left": "causal-convention",
    "no-max": "large-logits",
    "no-scale": "forward",
    "double-scale": "forward",
    "dropout-no-rescale": "dropout",
    "lse-log2": "lse",
    "gqa-modulo": "forward",
    "nondeterministic": "determinism",
    "writes-input": "immutability",
    "varlen-one-sequence": "varlen",
    "dropout-backward-mask": "dropout",
}


@pytest.mark.parametrize("bug", list(MUTANTS))
def test_every_mutant_is_caught(bug):
    report = check_attention(implementation(bug), examples=30, max_seqlen=40, head_dims=(16, 40))
    assert not report.passed, str(report)
    result = report[MUTANTS[bug]]
    assert result.passed is False, str(report)
    if MUTANTS[bug] in ("forward", "lse"):  # an accuracy failure comes with its (shrunk) example and ratio
        assert result.example and result.ratio > 1


# near misses, each to be caught in float32 and in float16 alone: a tolerance some ten times looser lets them pass
NEAR_MISSES = {"scale-1pct": "forward", "drop-last-key": "forward", "causal-off-by-one": "forward",
               "no-max": "large-logits"}


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("bug", list(NEAR_MISSES))
def test_near_misses_are_caught_in_each_dtype(bug, dtype):
    report = check_attention(implementation(bug), dtypes=(dtype,), examples=30, max_seqlen=40, head_dims=(16, 40),
                             properties=(NEAR_MISSES[bug],))
    assert report[NEAR_MISSES[bug]].passed is False, str(report)


# broken contracts: the property that names each, and what it says
CONTRACTS = {"writes-input-when-causal": ("immutability", "q was written"),
             "float64-out": ("forward", "out is float64 of shape"),
             "transposed-out": ("forward", "expected float32 of shape"),
             "nan-out": ("nan-containment", "NaN in the output of inputs without a NaN")}


@pytest.mark.parametrize("bug", list(CONTRACTS))
def test_broken_contracts_are_named(bug):
    """A function that writes its inputs on one path only, returns another dtype or shape than q's, or makes a NaN
    of its own: named as such (the wrong shape was an error of inf with no word of the shape; the input written on
    the causal path alone passed immutability and corrupted the forward's truth instead)."""
    name, said = CONTRACTS[bug]
    report = check_attention(implementation(bug), dtypes=("float32",), examples=30, max_seqlen=40, head_dims=(16,))
    assert report[name].passed is False and said in report[name].note, str(report)
    if bug == "writes-input-when-causal":  # (the truth comes from the checker's own arrays)
        assert report["forward"].passed and report["causal-convention"].passed, str(report)


def test_a_varlen_output_of_another_dtype_is_named():
    def varlen(*args, **options):
        return plain_varlen(*args, **options).astype(np.float64)

    report = check_attention(Implementation("v", plain_attention, varlen=varlen), dtypes=("float32",), examples=5,
                             max_seqlen=20, head_dims=(16,), properties=("varlen",))
    assert report["varlen"].passed is False and "varlen out is float64" in report["varlen"].note, str(report)


def test_a_kernel_for_some_head_dims_is_checked_at_those():
    """The fixed problems move on to a head dim the implementation takes: a kernel refusing the first one drawn
    (16) is still checked, and fails where it is wrong; one refusing every problem checked nothing, and the report
    does not pass."""
    def picky(q, k, v, **o):
        if q.shape[-1] == 16:
            raise Unsupported("head_dim 16")
        return plain_attention(q, k, v, bug="no-max", **o)

    report = check_attention(Implementation("picky", picky, supports={"causal"}), dtypes=("float16",),
                             examples=10, max_seqlen=40, head_dims=(16, 40))
    assert report["large-logits"].passed is False and report["lse"].passed is not None, str(report)
    assert report["immutability"].passed and report["causal-convention"].passed, str(report)

    def never(q, k, v, **o):
        raise Unsupported("nothing")

    report = check_attention(Implementation("never", never, supports={"causal"}), examples=5)
    assert not report.passed and "NOTHING CHECKED" in str(report)


def test_the_seed_chooses_the_examples():
    """One seed draws the same problems at each run, another seed others (the seed was not used)."""
    def shapes(seed):
        seen = []

        def record(q, k, v, **o):
            seen.append((q.shape, k.shape[1]))
            return plain_attention(q, k, v, **o)

        check_attention(Implementation("r", record), examples=10, properties=("forward",), seed=seed)
        return seen

    assert shapes(1) == shapes(1) and shapes(1) != shapes(2)


@pytest.mark.parametrize("impl", [implementation(None), reference_implementation()], ids=["plain", "reference"])
def test_correct_implementations_pass(impl):
    report = check_attention(impl, examples=30, max_seqlen=40, head_dims=(16, 40))
    assert report.passed, str(report)
    assert report["causal-convention"].note.startswith("bottom-right")
    json.dumps(report.to_dict())  # the CLI writes it


def test_flashnumba_passes():
    """flashnumba's own kernels (in the simulator on a machine without a GPU: one small example a property, the
    adapter's path through each; the checker's own logic is tested on NumPy implementations above)."""
    small = flashnumba.SIMULATOR
    # (determinism on a GPU only: what it catches, results that change with the order the hardware schedules work
    # in, the simulator does not reproduce; and its fixed shape is the slowest property to simulate)
    report = check_attention(adapter("flashnumba"), examples=1 if small else 60, max_seqlen=20 if small else 200,
                             head_dims=(16,) if small else (40, 64, 128), dtypes=("float32",) if small else None,
                             properties=("forward", "lse", "backward", "causal-convention", "empty-rows",
                                         "large-logits", "nan-containment", "varlen", "immutability")
                             + (() if small else ("determinism",)))
    assert report.passed, str(report)


def test_unsupported_problems_are_set_aside_and_errors_are_failures():
    """A problem the implementation declares unsupported is set aside and counted; one on which it raises
    anything else is a failure, shrunk to a small example."""

    def picky(q, k, v, **o):
        if q.shape[-1] % 8:
            raise Unsupported("head_dim not a multiple of 8")
        return plain_attention(q, k, v, **o)

    report = check_attention(Implementation("picky", picky, supports={"causal"}), examples=20,
                             properties=("forward",))
    assert report.passed and "set aside as unsupported: head_dim not a multiple of 8" in report["forward"].note

    def crashes(q, k, v, **o):
        if q.shape[1] > 60:
            raise RuntimeError("out of shared memory")
        return plain_attention(q, k, v, **o)

    report = check_attention(Implementation("crashes", crashes, supports={"causal"}), examples=40,
                             properties=("forward",))
    r = report["forward"]
    assert r.passed is False and "raised RuntimeError: out of shared memory" in r.note
    assert 60 < r.example["shape_q"][1] <= 65  # shrunk to a small failing seqlen

    def never(q, k, v, **o):
        raise Unsupported("nothing")

    report = check_attention(Implementation("never", never, supports={"causal"}), examples=5,
                             properties=("forward", "determinism"))
    assert [r.passed for r in report.results] == [None, None] and "not applicable" in str(report)


def test_the_callers_own_mistakes_are_errors_not_findings():
    """A misspelt property, a bare string, or no examples: refused before anything runs, not reported as the
    implementation's failure."""
    impl = reference_implementation()
    with pytest.raises(ValueError, match="unknown properties \\['forwrd'\\]"):
        check_attention(impl, properties=("forwrd",))
    with pytest.raises(TypeError, match="list or tuple of names"):
        check_attention(impl, properties="forward")
    with pytest.raises(ValueError, match="examples must be an int >= 1"):
        check_attention(impl, examples=0)


def test_the_command_line(tmp_path, capsys, monkeypatch):
    from flashnumba.__main__ import main

    out = tmp_path / "report.json"
    assert main(["check", "numpy-reference", "--examples", "10", "--json", str(out)]) == 0
    assert "numpy-reference: passed (10 properties hold, 0 fail, 1 not applicable)" in capsys.readouterr().out
    assert json.loads(out.read_text())["passed"] is True
    # module:function: a plain NumPy function (declared to take causal), here with the top-left convention
    (tmp_path / "my_attention.py").write_text(
        "import numpy as np\n"
        "def attention(q, k, v, causal=False):\n"
        "    s = np.einsum('bqhd,bkhd->bhqk', q.astype(np.float64), k) / np.sqrt(q.shape[-1])\n"
        "    if causal:\n"
        "        s = np.where(np.tril(np.ones(s.shape[-2:], bool)), s, -np.inf)\n"
        "    p = np.exp(s - s.max(-1, keepdims=True))\n"
        "    return np.einsum('bhqk,bkhd->bqhd', p / p.sum(-1, keepdims=True), v).astype(q.dtype)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert main(["check", "my_attention:attention", "--examples", "5"]) == 1
    assert "top-left" in capsys.readouterr().out
    # the caller's mistakes: one line, exit 2, before anything runs
    for argv, said in ((["numpy-reference", "numpy-reference", "--json", str(out)], "--json writes one report"),
                       (["numpy-reference", "--json", str(tmp_path / "no" / "x.json")], "folder does not exist"),
                       (["numpy-reference", "--out", str(out)], "--out"),
                       (["numpy-reference", "--json", str(tmp_path)], "is a folder"),
                       (["os:sep"], "os:sep is a str, not a function or an Implementation"),
                       (["flashnumba", "--dtypes", "bfloat16"] if flashnumba.SIMULATOR else [], "nothing to run")):
        if argv:
            assert main(["check", *argv, "--examples", "2"]) == 2
            assert said in capsys.readouterr().err
    for bad in (["--max-seqlen", "0"], ["--head-dims", "-8"], ["--jobs", "0"]):
        with pytest.raises(SystemExit):
            main(["check", "numpy-reference", *bad])


def test_reports_in_worker_processes(tmp_path):
    """--jobs: the reports of each dtype run in worker processes, printed and written in the order asked for; run
    as a user runs it (python -m flashnumba: the workers find the report's function by its module, which __main__
    is not)."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "flashnumba", "check", "numpy-reference", "--per-dtype",
                           "--examples", "5", "--jobs", "2", "--properties", "forward", "determinism", "--out",
                           str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout
    assert out.index("[float32] numpy-reference: passed") < out.index("[float16] numpy-reference: passed")
    data = json.loads((tmp_path / "check-numpy-reference-float16.json").read_text())
    assert data["dtypes"] == ["float16"] and data["passed"] and "environment" in data


def test_gradient_tolerance_allows_cancellation_and_catches_small_errors():
    """With one key dq = 0 exactly (P = 1, dP = D), and a float32 computation is left with the rounding of dP - D,
    sums of head_dim products of size ~sqrt(head_dim): the gradient's tolerance allows that (a few ulps of the
    terms summed, reference.attention_backward_terms) while an error of 0.1% of an ordinary gradient fails."""
    rng = np.random.default_rng(3)
    for seqlen_k in (1, 64):
        q, dout = (rng.standard_normal((1, 64, 2, 128)).astype(np.float32) for _ in range(2))
        k, v = (rng.standard_normal((1, seqlen_k, 2, 128)).astype(np.float32) for _ in range(2))
        truth = reference.attention_backward(dout, q, k, v, softmax_scale=0.5)[0]
        base = reference.attention_backward(dout, q, k, v, softmax_scale=0.5, dtype=np.float32)[0]
        terms = reference.attention_backward_terms(dout, q, k, v, softmax_scale=0.5)[0]
        tol = check.tolerance(truth, base, np.float32, 128, terms)
        if seqlen_k == 1:  # dP by a pairwise sum, D by a running one (as a separate pass over dO * O adds them)
            dp = (dout * v[:, :1]).sum(axis=-1, dtype=np.float32)
            d_i = np.cumsum(dout * v[:, :1], axis=-1, dtype=np.float32)[..., -1]
            dq = np.float32(0.5) * (dp - d_i)[..., None] * k[:, :1]
            assert np.abs(truth).max() < 1e-12 and 0 < check.max_error(dq, truth) <= tol
        else:
            assert check.max_error(truth * (1 + 1e-3), truth) > tol
