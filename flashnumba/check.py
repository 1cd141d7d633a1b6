"""A numerics checker for any attention implementation: ``check_attention(fn, ...) -> Report``.

Point it at a function that computes attention in flash-attn's layout and it runs a battery of properties, each
reported on its own with the error, the tolerance and, where one fails, the smallest failing example Hypothesis
found::

    from flashnumba.check import check_attention, Implementation
    report = check_attention(Implementation("mine", my_attention, supports={"causal"}))
    print(report)   # "mine: passed (N properties hold, M fail, K not applicable)", then per property:
                    # pass / FAIL / n/a, error / tolerance, and a failure's smallest example

The implementation. ``forward(q, k, v, **options) -> out`` or ``(out, lse)``, on arrays of its own library in the
layout (batch, seqlen, nheads, head_dim), lse (batch, nheads, seqlen_q) in natural log; ``backward(dout, q, k, v,
**options) -> (dq, dk, dv)`` where it has one. ``array`` says which arrays it takes ("numpy", "cupy", "torch"):
the checker draws NumPy inputs and converts them. ``supports`` declares the options it takes, and only those
are tested: ``causal``, ``window`` (window_size=(left, right)), ``softcap``, ``alibi`` (alibi_slopes, (nheads,)
float32), ``gqa`` (k, v with fewer heads), ``dropout`` (dropout_p, with ``seed``), ``scale`` (softmax_scale).
:func:`adapter` builds implementations for torch's SDPA backends, flash-attn, and flashnumba itself.
An implementation that does not take a drawn problem (a head dim or an option it has no kernel for) raises
:class:`Unsupported`: that problem is set aside, and the report counts the problems set aside and says why; the
properties of a fixed problem take the first head dim it accepts. A report passes when no property fails and at
least one holds. The implementation gets copies of the checker's arrays (what it writes into them cannot change
the truth it is compared with); out must be like q (shape and dtype), the gradients like q, k and v.

The battery (:data:`PROPERTIES`):

* ``forward``, ``lse``, ``backward``: against the float64 reference (:mod:`flashnumba.reference`) on drawn shapes
  (awkward seqlens such as 1, 17, 65; seqlen_q != seqlen_k; head dims such as 40 and 59) and options, with
  flash-attn's derived tolerance: the error may be ``FACTOR`` times that of the same attention computed plainly
  in the input's dtype, plus a floor of a few ulps at the output's magnitude; the ratio error / tolerance is
  reported;
* ``causal-convention``: which causal alignment the implementation follows (bottom-right as flash-attn >= 2.1,
  or top-left as torch SDPA's ``is_causal``), detected on seqlen_q != seqlen_k and named; bottom-right passes;
* ``empty-rows``: a row that sees no key gives 0 (flash-attn's convention), not NaN;
* ``large-logits``: scores of several hundred do not overflow, in every dtype;
* ``nan-containment``: a NaN in one query row stays in that row (and inputs without one give none);
* ``varlen`` (where a ``varlen`` function is given): packed sequences of random lengths, empty ones included, each
  against the reference of that sequence alone;
* ``dropout``: reproducible under a seed, the keep rate within binomial bounds, unbiased (the mean over seeds
  approaches the output without dropout: a dropout that forgets its 1 / (1 - p) rescale fails), and the
  backward consistent with the forward's mask (a directional derivative against central differences);
* ``determinism``: two runs give the same bits, forward and backward;
* ``immutability``: no input is written, in each dtype, and in the first with each declared option.

``seed``: the search's; one seed draws the same problems at each run, another others, None a fresh search.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from . import reference

FACTOR = 3.0  # the error may be this many times that of the plain computation in the input's dtype
FLOOR_ULPS = 4
OPTIONS = ("causal", "window", "softcap", "alibi", "gqa", "dropout", "scale")
AWKWARD_SEQLENS = (1, 2, 17, 63, 64, 65, 97)
AWKWARD_HEAD_DIMS = (16, 40, 59, 64, 96, 128)


# ---------------------------------------------------------------------------------------------------------------
# what is checked, and what a check says
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class Implementation:
    """An attention function to check (see the module docstring)."""

    name: str
    forward: Callable
    backward: Callable | None = None
    supports: frozenset = frozenset()
    varlen: Callable | None = None  # varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, **o)
    array: str = "numpy"
    dtypes: tuple = ("float32", "float16")
    head_dims: tuple = AWKWARD_HEAD_DIMS

    def __post_init__(self):
        self.supports = frozenset(self.supports)
        unknown = self.supports - set(OPTIONS)
        if unknown:
            raise ValueError(f"unknown options {sorted(unknown)}; the checker knows {OPTIONS}")
        if self.array not in ("numpy", "cupy", "torch"):
            raise ValueError(f"array must be 'numpy', 'cupy' or 'torch', got {self.array!r}")

    def side(self, dtype) -> str:
        """The arrays a call in ``dtype`` takes: ``array``, but NumPy for bfloat16 where that is CuPy (which has no
        bfloat16; NumPy's is ml_dtypes')."""
        return "numpy" if self.array == "cupy" and str(dtype) == "bfloat16" else self.array


@dataclass
class Result:
    """One property: passed or not, the largest error / tolerance seen (ratio <= 1 passes), a note (what was
    found: a convention, a behaviour), and the smallest failing example."""

    name: str
    passed: bool | None  # None: not applicable (an option not declared, no backward)
    ratio: float = 0.0
    error: float = 0.0
    tolerance: float = 0.0
    note: str = ""
    example: dict = field(default_factory=dict)

    def line(self) -> str:
        status = {True: "pass", False: "FAIL", None: "n/a"}[self.passed]
        nums = f" error {self.error:.3g} / tolerance {self.tolerance:.3g} = {self.ratio:.2f}" if self.tolerance else ""
        ex = f"  [example: {_describe(self.example)}]" if self.example and self.passed is False else ""
        return f"  {status:4}  {self.name:18}{nums}{'  ' + self.note if self.note else ''}{ex}"


@dataclass
class Report:
    implementation: str
    results: list

    @property
    def passed(self) -> bool:
        """No property fails and at least one holds (a report of nothing but n/a checked nothing)."""
        return all(r.passed is not False for r in self.results) and any(r.passed for r in self.results)

    def __getitem__(self, name) -> Result:
        return next(r for r in self.results if r.name == name)

    def __str__(self) -> str:
        counts = {v: sum(r.passed is v for r in self.results) for v in (True, False, None)}
        holds = "property holds" if counts[True] == 1 else "properties hold"
        verdict = "FAILED" if counts[False] else "passed" if counts[True] else "NOTHING CHECKED"
        head = (f"{self.implementation}: {verdict} ({counts[True]} {holds}, "
                f"{counts[False]} fail, {counts[None]} not applicable)")
        return "\n".join([head] + [r.line() for r in self.results])

    def to_dict(self) -> dict:
        return {"implementation": self.implementation, "passed": self.passed,
                "results": [dict(r.__dict__, example=_jsonable(r.example)) for r in self.results]}


class Unsupported(Exception):
    """Raised by an implementation for a problem outside what it supports (a head dim, an option): the problem is
    set aside, not failed; the report counts those set aside and gives the reasons."""


class _Failure(Exception):
    """Raised inside a Hypothesis search when an example breaks a property (carries what to report)."""

    def __init__(self, ratio, error, tolerance, note=""):
        super().__init__(note)
        self.ratio, self.error, self.tolerance, self.note = ratio, error, tolerance, note


def _describe(example) -> str:
    return ", ".join(f"{k}={v}" for k, v in example.items())


def _jsonable(example):
    return {k: (list(v) if isinstance(v, tuple) else v) for k, v in example.items()}


# ---------------------------------------------------------------------------------------------------------------
# tolerances
# ---------------------------------------------------------------------------------------------------------------


def _eps(dtype) -> float:
    dtype = np.dtype(dtype)
    if dtype.name == "bfloat16":
        return 2.0**-7
    return float(np.finfo(dtype).eps)


def max_error(a, b) -> float:
    """max |a - b| over the finite elements; inf where one has a NaN or an infinity the other does not."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if a.shape != b.shape:
        return math.inf
    if a.size == 0:
        return 0.0
    if np.isnan(a).any() or np.isnan(b).any():
        return math.inf
    same_inf = np.isinf(a) & np.isinf(b) & (np.sign(a) == np.sign(b))
    if (np.isinf(a) ^ np.isinf(b)).any():
        return math.inf
    return float(np.abs(np.where(same_inf, 0.0, a - np.where(same_inf, 0.0, b))).max())


def tolerance(truth, baseline, dtype, reduction, terms=None) -> float:
    """FACTOR x the baseline's error against the truth, plus FLOOR_ULPS ulps of ``dtype`` at the truth's magnitude
    (the result's rounding) and FLOOR_ULPS float32 ulps at the larger of sqrt(n) x the truth's magnitude (n: the
    longest sum accumulated; the statistical rounding of n additions, as flash-attn's tests allow) and the size of
    the terms summed (``terms``, as :func:`flashnumba.reference.attention_backward_terms` gives them, for results
    that cancel far below their terms: Higham's bound gamma_n |A| |B| with a constant in place of n)."""
    def magnitude(x):
        finite = np.asarray(x)[np.isfinite(x)]
        return max(1.0, float(np.abs(finite).max())) if finite.size else 1.0

    result = magnitude(truth)
    summed = max(math.sqrt(reduction) * result, 0.0 if terms is None else magnitude(terms))
    floor = FLOOR_ULPS * (result * _eps(dtype) + summed * _eps(np.float32))
    return FACTOR * max_error(baseline, truth) + floor


def _compare(got, truth, baseline, dtype, reduction, what, terms=None):
    err, tol = max_error(got, truth), tolerance(truth, baseline, dtype, reduction, terms)
    if not err <= tol:
        raise _Failure(err / tol if tol else math.inf, err, tol, f"{what} error {err:.3g} > {tol:.3g}")
    return err, tol


# ---------------------------------------------------------------------------------------------------------------
# arrays: NumPy in, the implementation's library through it, NumPy out
# ---------------------------------------------------------------------------------------------------------------


def _to(x, array):
    """x (NumPy) as the implementation takes it: always a fresh array (a NumPy copy too), so that one that writes
    into its inputs cannot change the arrays the truth is computed from (``immutability`` reports it)."""
    if x is None:
        return x
    if array == "numpy":
        return np.array(x, copy=True)
    if array == "cupy":
        import cupy

        return cupy.asarray(x)
    import torch

    if x.dtype.name == "bfloat16":
        return torch.from_numpy(np.ascontiguousarray(x).view(np.int16)).cuda().view(torch.bfloat16)
    return torch.from_numpy(np.ascontiguousarray(x)).cuda()


def _back(x):
    if isinstance(x, np.ndarray):
        return x
    if hasattr(x, "get"):
        return x.get()
    if hasattr(x, "detach"):
        x = x.detach()
        import torch

        if x.dtype == torch.bfloat16:
            from ._arrays import bfloat16

            return x.view(torch.int16).cpu().numpy().view(bfloat16())
        return x.cpu().numpy()
    return np.asarray(x)


def _np_dtype(name):
    if name == "bfloat16":
        from ._arrays import bfloat16

        return bfloat16()
    return np.dtype(name)


# ---------------------------------------------------------------------------------------------------------------
# a problem: shapes, options, inputs; and running the implementation on it
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class Problem:
    dtype: str
    batch: int
    seqlen_q: int
    seqlen_k: int
    nheads: int
    nheads_k: int
    head_dim: int
    options: dict
    seed: int

    def example(self) -> dict:
        return dict(dtype=self.dtype, shape_q=(self.batch, self.seqlen_q, self.nheads, self.head_dim),
                    seqlen_k=self.seqlen_k, nheads_k=self.nheads_k, **self.options)

    def inputs(self, scale=1.0):
        rng = np.random.default_rng(self.seed)
        dt = _np_dtype(self.dtype)
        q = (scale * rng.standard_normal((self.batch, self.seqlen_q, self.nheads, self.head_dim))).astype(dt)
        k = (scale * rng.standard_normal((self.batch, self.seqlen_k, self.nheads_k, self.head_dim))).astype(dt)
        v = rng.standard_normal((self.batch, self.seqlen_k, self.nheads_k, self.head_dim)).astype(dt)
        dout = rng.standard_normal((self.batch, self.seqlen_q, self.nheads, self.head_dim)).astype(dt)
        return q, k, v, dout

    def reference_options(self) -> dict:
        o = dict(self.options)
        if "alibi_slopes" in o:
            o["alibi_slopes"] = np.asarray(o["alibi_slopes"], np.float32)
        return o


def _call_options(problem, impl):
    o = dict(problem.options)
    if "alibi_slopes" in o:
        o["alibi_slopes"] = _to(np.asarray(o["alibi_slopes"], np.float32), impl.side(problem.dtype))
    return o


def _forward(impl, problem, q, k, v, **extra):
    side = impl.side(problem.dtype)
    result = impl.forward(_to(q, side), _to(k, side), _to(v, side), **_call_options(problem, impl), **extra)
    out, lse = (_back(result[0]), _back(result[1])) if isinstance(result, tuple) else (_back(result), None)
    _like("out", out, q)
    lse_shape = (q.shape[0], q.shape[2], q.shape[1])
    if lse is not None and np.shape(lse) != lse_shape:
        raise _Failure(math.inf, math.inf, 0.0, f"lse has shape {np.shape(lse)}, expected (batch, nheads, seqlen_q) "
                                                f"= {lse_shape}")
    return out, lse


def _like(name, got, x):
    """A _Failure unless ``got`` has x's shape and dtype (out like q, the gradients like their inputs)."""
    shape, dtype = np.shape(got), getattr(got, "dtype", None)
    if shape != x.shape or dtype != x.dtype:
        raise _Failure(math.inf, math.inf, 0.0, f"{name} is {dtype} of shape {shape}, expected {x.dtype} of shape "
                                                f"{x.shape}")


def _grads_like(grads, q, k, v):
    """The backward's results as NumPy arrays, each a _Failure unless (dq, dk, dv) like (q, k, v)."""
    grads = tuple(_back(g) for g in grads)
    if len(grads) != 3:
        raise _Failure(math.inf, math.inf, 0.0, f"the backward returned {len(grads)} arrays, expected (dq, dk, dv)")
    for name, g, x in zip(("dq", "dk", "dv"), grads, (q, k, v)):
        _like(name, g, x)
    return grads


def _backward(impl, problem, dout, q, k, v):
    side = impl.side(problem.dtype)
    return _grads_like(impl.backward(*(_to(x, side) for x in (dout, q, k, v)), **_call_options(problem, impl)),
                       q, k, v)


def _problems(impl, dtypes, head_dims, max_seqlen, options=None):
    """The Hypothesis strategy of problems within what ``impl`` declares."""
    from hypothesis import strategies as st

    s = impl.supports if options is None else impl.supports & set(options)

    @st.composite
    def draw(data):
        dtype = data(st.sampled_from(dtypes))
        d = data(st.sampled_from(head_dims))
        nheads_k = data(st.sampled_from([1, 2]))
        nheads = nheads_k * (data(st.sampled_from([1, 2, 3])) if "gqa" in s else 1)
        seqlens = st.one_of(st.sampled_from([n for n in AWKWARD_SEQLENS if n <= max_seqlen]),
                            st.integers(1, max_seqlen))
        sq, sk = data(seqlens), data(st.one_of(st.just(-1), seqlens))
        sk = sq if sk == -1 else sk
        opts = {}
        if "causal" in s and data(st.booleans()):
            opts["causal"] = True
        if "window" in s and data(st.booleans()):
            opts["window_size"] = (data(st.integers(-1, 24)), data(st.integers(-1, 24)))
        if "softcap" in s and data(st.booleans()):
            opts["softcap"] = data(st.sampled_from([5.0, 30.0]))
        if "alibi" in s and data(st.booleans()):
            opts["alibi_slopes"] = tuple(round(2.0 ** -(i + 1), 6) for i in range(nheads))
        if "scale" in s and data(st.booleans()):
            opts["softmax_scale"] = data(st.sampled_from([0.05, 0.5]))
        return Problem(dtype, data(st.integers(1, 2)), sq, sk, nheads, nheads_k, d, opts,
                       data(st.integers(0, 2**16)))

    return draw()


# ---------------------------------------------------------------------------------------------------------------
# the properties
# ---------------------------------------------------------------------------------------------------------------


def _search(name, strategy, body, examples, seed):
    """Run ``body(problem)`` (which returns (error, tolerance) or raises _Failure) over ``examples`` drawn problems;
    on a failure, Hypothesis shrinks it and the smallest failing example is reported."""
    from hypothesis import HealthCheck, given, settings, seed as hypothesis_seed

    from hypothesis import reject
    from hypothesis.errors import Unsatisfiable

    worst = {"ratio": 0.0, "error": 0.0, "tolerance": 0.0}
    failing = {}
    unsupported = {}

    @settings(max_examples=examples, deadline=None, database=None, suppress_health_check=list(HealthCheck),
              print_blob=False, report_multiple_bugs=False)
    @given(problem=strategy)
    def run(problem):
        try:
            err, tol = body(problem)
        except _Failure:
            failing["problem"] = problem
            raise
        except Unsupported as why:
            unsupported[str(why)] = unsupported.get(str(why), 0) + 1
            reject()
        except Exception as err:  # noqa: BLE001  (the implementation raised on this problem: that is the finding)
            failing["problem"] = problem
            raise _Failure(math.inf, math.inf, 0.0, _raised(err)) from err
        if tol and err / tol > worst["ratio"]:
            worst.update(ratio=err / tol, error=err, tolerance=tol)

    if seed is not None:  # (the same examples each run of one seed, others for another; None: a fresh search)
        run = hypothesis_seed(seed)(run)
    aside = ""
    try:
        run()
    except _Failure as f:
        p = failing["problem"]
        example = p.example() if isinstance(p, Problem) else dict(p[0].example(), lengths=p[1])
        return Result(name, False, f.ratio, f.error, f.tolerance, f.note, example)
    except Unsatisfiable:
        return Result(name, None, note="no drawn problem is supported: " + _reasons(unsupported))
    if unsupported:
        aside = f"{sum(unsupported.values())} problems set aside as unsupported: {_reasons(unsupported)}"
    return Result(name, True, worst["ratio"], worst["error"], worst["tolerance"], aside)


def _raised(err) -> str:
    return f"raised {type(err).__name__}: {(str(err).splitlines() or [''])[0][:160]}"


def _reasons(unsupported: dict) -> str:
    return "; ".join(f"{why} ({n})" for why, n in sorted(unsupported.items(), key=lambda kv: -kv[1])[:3])


def _forward_accuracy(name, index, impl, examples, dtypes, head_dims, max_seqlen, seed):
    """The forward's result ``index`` (0: out, 1: lse) against the float64 reference, over drawn problems."""

    def body(p):
        q, k, v, _ = p.inputs()
        got = _forward(impl, p, q, k, v)[index]
        ro = p.reference_options()
        truth = reference.attention_forward(q, k, v, **ro)[index]
        base = reference.attention_forward(q, k, v, dtype=np.dtype(q.dtype), **ro)[index]
        return _compare(got, truth, base, q.dtype, max(p.head_dim, p.seqlen_k), ("out", "lse")[index])

    return _search(name, _problems(impl, dtypes, head_dims, max_seqlen), body, examples, seed)


def _first_taken(head_dims, attempt):
    """``attempt(d)`` at the first head dim the implementation takes: the fixed problems of the properties below
    move on to the next head dim where it raises Unsupported (a kernel for some head dims only is still checked);
    Unsupported where it takes none."""
    why = None
    for d in head_dims:
        try:
            return attempt(d)
        except Unsupported as err:
            why = err
    raise why


def check_forward(impl, examples, dtypes, head_dims, max_seqlen, seed):
    return _forward_accuracy("forward", 0, impl, examples, dtypes, head_dims, max_seqlen, seed)


def check_lse(impl, examples, dtypes, head_dims, max_seqlen, seed):
    def probe(d):
        p = Problem(dtypes[0], 1, 3, 5, 1, 1, d, {}, 0)
        return _forward(impl, p, *p.inputs()[:3])[1]

    if _first_taken(head_dims, probe) is None:
        return Result("lse", None, note="the implementation returns no lse")
    return _forward_accuracy("lse", 1, impl, examples, dtypes, head_dims, max_seqlen, seed)


def check_backward(impl, examples, dtypes, head_dims, max_seqlen, seed):
    if impl.backward is None:
        return Result("backward", None, note="no backward given")

    def body(p):
        q, k, v, dout = p.inputs()
        grads = _backward(impl, p, dout, q, k, v)
        ro = p.reference_options()
        truth = reference.attention_backward(dout, q, k, v, **ro)
        base = reference.attention_backward(dout, q, k, v, dtype=np.dtype(q.dtype), **ro)
        terms = reference.attention_backward_terms(dout, q, k, v, **ro)
        worst = (0.0, 1.0)
        for name, g, t, b, a in zip(("dq", "dk", "dv"), grads, truth, base, terms):
            err, tol = _compare(g, t, b, q.dtype, max(p.head_dim, p.seqlen_q, p.seqlen_k), name, a)
            worst = max(worst, (err, tol), key=lambda et: et[0] / et[1] if et[1] else 0)
        return worst

    return _search("backward", _problems(impl, dtypes, head_dims, max_seqlen), body, examples, seed)


def check_causal_convention(impl, dtypes, head_dims):
    """Which causal alignment: compared on seqlen_q = 4, seqlen_k = 9 and the reverse with both conventions."""
    if "causal" not in impl.supports:
        return Result("causal-convention", None, note="causal not declared")
    return _first_taken(head_dims, lambda d: _causal_convention(impl, dtypes, d))


def _causal_convention(impl, dtypes, d):
    found = set()
    errors = []
    off = None  # the first shape that is not bottom-right
    for sq, sk in ((4, 9), (9, 4)):
        p = Problem("float32" if "float32" in dtypes else dtypes[0], 1, sq, sk, 1, 1, d, {"causal": True}, 7)
        q, k, v, _ = p.inputs()
        out, _ = _forward(impl, p, q, k, v)
        i, j = np.arange(sq)[:, None], np.arange(sk)[None, :]
        bottom = _masked_attention(q, k, v, j <= i + (sk - sq))
        top = _masked_attention(q, k, v, j <= i)
        base = _masked_attention(q, k, v, j <= i + (sk - sq), np.dtype(q.dtype))
        tol = tolerance(bottom, base, q.dtype, sk)
        bottom_err, top_err = max_error(out, bottom), max_error(out, top)
        errors.append((bottom_err, tol))
        found.add("bottom-right" if bottom_err <= tol else "top-left" if top_err <= tol else "neither")
        if bottom_err > tol and off is None:
            off = dict(seqlen_q=sq, seqlen_k=sk, causal=True)
    if found == {"bottom-right"}:
        return Result("causal-convention", True, note="bottom-right (flash-attn >= 2.1)")
    note = "top-left (torch SDPA's is_causal)" if found == {"top-left"} else \
        f"neither convention ({', '.join(sorted(found))} by shape)"
    err, tol = max(errors, key=lambda et: et[0] / et[1])
    return Result("causal-convention", False, err / tol, err, tol, note, off)


def _masked_attention(q, k, v, mask, dtype=np.float64):
    """Dense attention of (batch, seqlen, 1, d) arrays under a (seqlen_q, seqlen_k) visibility mask, in ``dtype``;
    a row that sees no key gives 0."""
    qd, kd, vd = (np.asarray(x, np.float64 if np.dtype(dtype).name == "bfloat16" else dtype) for x in (q, k, v))
    s = np.einsum("bqhd,bkhd->bhqk", qd, kd) / math.sqrt(q.shape[-1])
    s = np.where(mask, s, -np.inf)
    m = s.max(axis=-1, keepdims=True)
    e = np.where(mask, np.exp(s - np.where(np.isfinite(m), m, 0)), 0)
    z = e.sum(axis=-1, keepdims=True)
    p = np.divide(e, z, out=np.zeros_like(e), where=z > 0)
    return np.einsum("bhqk,bkhd->bqhd", p, vd)


def check_empty_rows(impl, dtypes, head_dims):
    """seqlen_q > seqlen_k, causal (bottom-right): the first rows see no key; flash-attn returns 0 there."""
    if "causal" not in impl.supports:
        return Result("empty-rows", None, note="causal not declared")

    def run(d):
        p = Problem(dtypes[0], 1, 6, 3, 1, 1, d, {"causal": True}, 3)
        return p, _forward(impl, p, *p.inputs()[:3])[0]

    p, out = _first_taken(head_dims, run)
    empty = out[:, :3].astype(np.float64)
    if np.isnan(empty).any():
        return Result("empty-rows", False, note="NaN in rows that see no key (flash-attn gives 0)",
                      example=p.example())
    if np.abs(empty).max() > 0:
        return Result("empty-rows", False, note="non-zero output in rows that see no key (or top-left causal)",
                      example=p.example())
    return Result("empty-rows", True, note="0")


LARGE_LOGITS_INPUT_SCALE = 10.0  # q and k of standard deviation 10: scores of standard deviation 100


def check_large_logits(impl, dtypes, head_dims):
    """Scores of several hundred (in every dtype: in float16 too, whose values reach about 40 here, far below its
    largest; a softmax computed in float32 without its row maximum overflows at 89): exp overflows unless the row
    maximum is subtracted first."""
    results = []
    for dtype in dtypes:
        def run(d):
            p = Problem(dtype, 1, 17, 33, 2, 2, d, {}, 5)
            q, k, v, _ = p.inputs(scale=LARGE_LOGITS_INPUT_SCALE)
            return p, q, k, v, _forward(impl, p, q, k, v)[0]

        p, q, k, v, out = _first_taken(head_dims, run)
        truth, _ = reference.attention_forward(q, k, v)
        base, _ = reference.attention_forward(q, k, v, dtype=np.dtype(q.dtype))
        err, tol = max_error(out, truth), tolerance(truth, base, q.dtype, p.seqlen_k)
        results.append((err, tol, p))
    err, tol, p = max(results, key=lambda r: r[0] / r[1])
    if not err <= tol:
        note = "overflow (NaN or inf)" if not math.isfinite(err) else "inaccurate"
        return Result("large-logits", False, err / tol if tol else math.inf, err, tol, note, p.example())
    return Result("large-logits", True, err / tol, err, tol)


def check_nan_containment(impl, dtypes, head_dims):
    """A NaN in one query row (b 0, row 2, head 0) may make that row NaN, no other (and without it, none)."""
    def run(d):
        p = Problem(dtypes[0], 1, 5, 7, 2, 2, d, {}, 9)
        q, k, v, _ = p.inputs()
        return p, q, k, v, _forward(impl, p, q, k, v)[0]

    p, q, k, v, clean = _first_taken(head_dims, run)
    if np.isnan(clean.astype(np.float64)).any():
        return Result("nan-containment", False, note="NaN in the output of inputs without a NaN", example=p.example())
    q = q.copy()
    q[0, 2, 0, 0] = np.nan
    out, _ = _forward(impl, p, q, k, v)
    others = np.ones(out.shape, bool)
    others[0, 2, 0] = False
    if np.isnan(out[others].astype(np.float64)).any():
        return Result("nan-containment", False, note="a NaN in one query row spread to other rows",
                      example=dict(p.example(), nan_at="q[0, 2, 0, 0]"))
    return Result("nan-containment", True)


def check_varlen(impl, examples, dtypes, head_dims, max_seqlen, seed):
    """Packed batches (flash-attn's varlen layout: q (total_q, nheads, d), cu_seqlens int32): 1 to 4 sequences of
    random lengths, 0 included, with the declared options; each sequence against the reference of it alone."""
    if impl.varlen is None:
        return Result("varlen", None, note="no varlen function given")
    from hypothesis import strategies as st

    @st.composite
    def packed(draw):
        p = draw(_problems(impl, dtypes, head_dims, max_seqlen, options={"causal", "window", "softcap", "gqa",
                                                                          "scale"}))
        n = draw(st.integers(1, 4))
        lens = [(draw(st.integers(0, max_seqlen)), draw(st.integers(0, max_seqlen))) for _ in range(n)]
        return p, lens

    def body(problem):
        p, lens = problem
        rng = np.random.default_rng(p.seed)
        dt = _np_dtype(p.dtype)
        tq, tk = sum(a for a, _ in lens), sum(b for _, b in lens)
        q = rng.standard_normal((tq, p.nheads, p.head_dim)).astype(dt)
        k, v = (rng.standard_normal((tk, p.nheads_k, p.head_dim)).astype(dt) for _ in range(2))
        cu_q, cu_k = (np.concatenate([[0], np.cumsum(x)]).astype(np.int32) for x in zip(*lens))
        args = [_to(x, impl.side(p.dtype)) for x in (q, k, v, cu_q, cu_k)]
        out = impl.varlen(*args, max(a for a, _ in lens), max(b for _, b in lens), **_call_options(p, impl))
        out = _back(out[0] if isinstance(out, tuple) else out)
        _like("varlen out", out, q)
        ro = p.reference_options()
        truth, _ = reference.attention_varlen_forward(q, k, v, cu_q, cu_k, **ro)
        base, _ = reference.attention_varlen_forward(q, k, v, cu_q, cu_k, dtype=np.dtype(q.dtype), **ro)
        return _compare(out, truth, base, q.dtype, max(p.head_dim, max_seqlen), "varlen out")

    result = _search("varlen", packed(), body, examples, seed)
    return result


def check_dropout(impl, dtypes, head_dims, samples=400, p_drop=0.3):
    """Dropout, four ways: reproducible under a seed; the keep rate within 5 binomial standard deviations of
    1 - p (V the identity, so that out = P Z shows each kept and dropped probability); unbiased (the mean over
    ``samples`` seeds approaches the output without dropout, within 5 standard errors: a dropout that forgets its
    1 / (1 - p) rescale fails); and, with a backward, the gradient consistent with the forward's mask (the
    directional derivative of sum(out * dout) along a random direction, by central differences in float64)."""
    if "dropout" not in impl.supports:
        return Result("dropout", None, note="dropout not declared")
    order = sorted(head_dims, key=lambda h: (h < 16, -h))  # (the largest of at least 16 first: V = I needs d >= sk)
    return _first_taken(order, lambda d: _dropout(impl, dtypes, d, samples, p_drop))


def _dropout(impl, dtypes, d, samples, p_drop):
    dtype = "float32" if "float32" in dtypes else dtypes[0]
    sk = min(d, 24)
    p = Problem(dtype, 1, 8, sk, 1, 1, d, {}, 11)
    q, k, v, dout = p.inputs()
    a, _ = _forward(impl, p, q, k, v, dropout_p=p_drop, seed=1)
    b, _ = _forward(impl, p, q, k, v, dropout_p=p_drop, seed=1)
    if not np.array_equal(a, b, equal_nan=True):
        return Result("dropout", False, note="not reproducible: two calls with the same seed differ",
                      example=p.example())
    # the keep rate: with V = I (keys as one-hot rows), out[i, j] = P_ij Z_ij
    eye = np.zeros_like(v)
    eye[0, np.arange(sk), 0, np.arange(sk)] = 1
    kept, total = 0, 0
    for s_ in range(2, 2 + 20):
        z, _ = _forward(impl, p, q, k, eye, dropout_p=p_drop, seed=s_)
        kept += int(np.count_nonzero(z[0, :, 0, :sk]))
        total += z.shape[1] * sk
    rate, sd = kept / total, math.sqrt(p_drop * (1 - p_drop) / total)
    if abs(rate - (1 - p_drop)) > 5 * sd:
        return Result("dropout", False, abs(rate - (1 - p_drop)) / (5 * sd), abs(rate - (1 - p_drop)), 5 * sd,
                      f"keep rate {rate:.4f}, expected {1 - p_drop:.2f}", dict(p.example(), dropout_p=p_drop))
    outs = np.stack([_forward(impl, p, q, k, v, dropout_p=p_drop, seed=s_)[0].astype(np.float64)
                     for s_ in range(2, 2 + samples)])
    clean, _ = reference.attention_forward(q, k, v)
    mean, sem = outs.mean(axis=0), outs.std(axis=0) / math.sqrt(samples)
    z = float(np.max(np.abs(mean - clean) / np.maximum(sem, 1e-12)))
    if z > 5:
        return Result("dropout", False, z / 5, float(np.abs(mean - clean).max()), float((5 * sem).max()),
                      "biased: the mean over seeds is not the output without dropout (1 / (1 - p) rescale?)",
                      dict(p.example(), dropout_p=p_drop, samples=samples))
    note = f"reproducible, keep rate {rate:.3f}, unbiased"
    if impl.backward is not None:
        bad = _dropout_gradient_mismatch(impl, p, q, k, v, dout, p_drop)
        if bad:
            return Result("dropout", False, note=bad, example=dict(p.example(), dropout_p=p_drop))
        note += ", backward consistent with the forward's mask"
    return Result("dropout", True, z / 5, note=note)


def _dropout_gradient_mismatch(impl, p, q, k, v, dout, p_drop, seed=5):
    """None where <(dq, dk, dv), u> matches the central difference of sum(out * dout) along u (step 1e-3 in
    float32, 2^-4 in a 16-bit dtype, whose rounding would swamp a smaller step), else what differs."""
    grads = _grads_like(impl.backward(*(_to(x, impl.side(p.dtype)) for x in (dout, q, k, v)), dropout_p=p_drop,
                                      seed=seed), q, k, v)
    grads = [np.asarray(g, np.float64) for g in grads]
    rng = np.random.default_rng(1)
    f32 = [np.asarray(x, np.float32) for x in (q, k, v)]
    us = [rng.standard_normal(x.shape).astype(np.float32) for x in f32]
    h = np.float32(1e-3 if np.dtype(q.dtype) == np.float32 else 2.0**-4)

    def loss(sign):
        xs = [(x + sign * h * u).astype(q.dtype) for x, u in zip(f32, us)]
        out, _ = _forward(impl, p, *xs, dropout_p=p_drop, seed=seed)
        return float(np.sum(np.asarray(out, np.float64) * np.asarray(dout, np.float64)))

    numeric = (loss(1) - loss(-1)) / (2 * float(h))
    analytic = float(sum(np.sum(g * u) for g, u in zip(grads, us)))
    scale = max(1.0, abs(analytic), abs(numeric))
    if abs(numeric - analytic) > 0.05 * scale:
        return (f"the backward with dropout does not match the forward's mask: directional derivative "
                f"{analytic:.4g}, central difference {numeric:.4g}")
    return None


def check_determinism(impl, dtypes, head_dims):
    return _first_taken(head_dims, lambda d: _determinism(impl, Problem(dtypes[0], 2, 33, 47, 2, 2, d, {}, 13)))


def _determinism(impl, p):
    q, k, v, dout = p.inputs()
    a, b = _forward(impl, p, q, k, v)[0], _forward(impl, p, q, k, v)[0]
    if not _bitwise_equal(a, b):
        return Result("determinism", False, note="two forward runs differ in their bits", example=p.example())
    if impl.backward is not None:
        g1, g2 = _backward(impl, p, dout, q, k, v), _backward(impl, p, dout, q, k, v)
        for name, x, y in zip(("dq", "dk", "dv"), g1, g2):
            if not _bitwise_equal(x, y):
                return Result("determinism", False, note=f"two backward runs differ in {name}", example=p.example())
    return Result("determinism", True, note="bitwise equal reruns" + (", forward and backward" if impl.backward
                                                                      else ""))


def _bitwise_equal(a, b) -> bool:
    a, b = np.ascontiguousarray(a), np.ascontiguousarray(b)  # a view of another dtype needs a contiguous last axis
    return a.shape == b.shape and np.array_equal(a.view(np.uint8), b.view(np.uint8))


# the options of the immutability property's calls, each where declared (a path of its own may write)
_IMMUTABILITY_OPTIONS = {"causal": {"causal": True}, "window": {"window_size": (3, 2)}, "softcap": {"softcap": 5.0},
                         "alibi": {"alibi_slopes": (0.5, 0.25)}, "scale": {"softmax_scale": 0.5}}


def check_immutability(impl, dtypes, head_dims):
    """No input is written, forward or backward: in each dtype without options, and in the first with each declared
    option (each a kernel of its own to compile, on a GPU)."""
    declared = [o for name, o in _IMMUTABILITY_OPTIONS.items() if name in impl.supports]
    calls = 0
    for dtype, options in [(dt, {}) for dt in dtypes] + [(dtypes[0], o) for o in declared]:
        def attempt(d):
            return _writes(impl, Problem(dtype, 1, 9, 11, 2, 2, d, options, 17))

        try:
            written = _first_taken(head_dims, attempt)
        except Unsupported:
            continue
        calls += 1
        if written:
            return Result("immutability", False, note=f"{written[0]} was written", example=written[1])
    if not calls:
        raise Unsupported("no fixed problem of this property is supported")
    return Result("immutability", True, note=f"{calls} calls: each dtype, and in the first each declared option")


def _writes(impl, p):
    """(the name of an input the calls on problem ``p`` wrote, p's example), or None."""
    arrays = [_to(x, impl.side(p.dtype)) for x in p.inputs()]
    before = [np.array(_back(x), copy=True) for x in arrays]
    impl.forward(*arrays[:3], **_call_options(p, impl))
    if impl.backward is not None:
        impl.backward(arrays[3], *arrays[:3], **_call_options(p, impl))
    for name, x, b in zip(("q", "k", "v", "dout"), arrays, before):
        if not _bitwise_equal(_back(x), b):
            return name, p.example()
    return None


PROPERTIES = ("forward", "lse", "backward", "causal-convention", "empty-rows", "large-logits", "nan-containment",
              "varlen", "dropout", "determinism", "immutability")


def check_attention(impl: Implementation, *, dtypes=None, head_dims=None, examples=50, max_seqlen=80, seed=0,
                    properties=PROPERTIES) -> Report:
    """Run the battery on ``impl`` (an :class:`Implementation`, or an :func:`adapter` name) and return a
    :class:`Report`. ``dtypes``, ``head_dims``: those drawn (default: the implementation's); ``examples``: drawn
    problems per accuracy property; ``max_seqlen``: the longest seqlen drawn; ``seed``: None for a fresh search
    each run, else a reproducible one."""
    if isinstance(impl, str):
        impl = adapter(impl)
    dtypes = tuple(dtypes or impl.dtypes)
    head_dims = tuple(head_dims or impl.head_dims)
    runs = {
        "forward": lambda: check_forward(impl, examples, dtypes, head_dims, max_seqlen, seed),
        "lse": lambda: check_lse(impl, examples, dtypes, head_dims, max_seqlen, seed),
        "backward": lambda: check_backward(impl, examples, dtypes, head_dims, max_seqlen, seed),
        "causal-convention": lambda: check_causal_convention(impl, dtypes, head_dims),
        "empty-rows": lambda: check_empty_rows(impl, dtypes, head_dims),
        "large-logits": lambda: check_large_logits(impl, dtypes, head_dims),
        "nan-containment": lambda: check_nan_containment(impl, dtypes, head_dims),
        "varlen": lambda: check_varlen(impl, examples, dtypes, head_dims, max_seqlen, seed),
        "dropout": lambda: check_dropout(impl, dtypes, head_dims),
        "determinism": lambda: check_determinism(impl, dtypes, head_dims),
        "immutability": lambda: check_immutability(impl, dtypes, head_dims),
    }
    # (the caller's own arguments checked before anything runs: a misspelt property or no examples is not the
    # implementation's failure)
    if isinstance(properties, str):
        raise TypeError(f"properties must be a list or tuple of names, got the string {properties!r}")
    unknown = [name for name in properties if name not in runs]
    if unknown:
        raise ValueError(f"unknown properties {unknown}: choose from {', '.join(runs)} (a list or tuple of names)")
    for name, n in [("examples", examples), ("max_seqlen", max_seqlen)] + [("head_dims", d) for d in head_dims]:
        what = f"{name} must be ints >= 1" if name == "head_dims" else f"{name} must be an int >= 1"
        if isinstance(n, (bool, np.bool_)) or not isinstance(n, (int, np.integer)):
            raise TypeError(f"{what}, got {type(n).__name__} {n!r}")
        if n < 1:
            raise ValueError(f"{what}, got {n!r}")
    results = []
    for name in properties:
        try:
            results.append(runs[name]())
        except _Failure as f:
            results.append(Result(name, False, f.ratio, f.error, f.tolerance, f.note))
        except Unsupported as why:
            results.append(Result(name, None, note=f"its fixed problem is unsupported: {why}"))
        except Exception as err:  # noqa: BLE001  (the implementation raised: that is the finding)
            results.append(Result(name, False, note=_raised(err)))
    return Report(impl.name, results)


# ---------------------------------------------------------------------------------------------------------------
# adapters: the layouts people have
# ---------------------------------------------------------------------------------------------------------------


def reference_implementation(dtype_of_inputs=True) -> Implementation:
    """:func:`flashnumba.reference.attention_forward` computing in the inputs' dtype: a correct NumPy attention."""

    def forward(q, k, v, **o):
        return reference.attention_forward(q, k, v, dtype=np.dtype(q.dtype), **o)

    def backward(dout, q, k, v, **o):
        return reference.attention_backward(dout, q, k, v, dtype=np.dtype(q.dtype), **o)

    def varlen(q, k, v, cu_q, cu_k, max_q, max_k, **o):
        return reference.attention_varlen_forward(q, k, v, cu_q, cu_k, dtype=np.dtype(q.dtype), **o)

    return Implementation("numpy-reference", forward, backward,
                          supports={"causal", "window", "softcap", "alibi", "gqa", "scale"}, varlen=varlen)


def _flashnumba() -> Implementation:
    from . import api

    def forward(q, k, v, dropout_p=0.0, seed=None, **o):
        if dropout_p:
            o.update(dropout_p=dropout_p, dropout_seed=seed)
        return api.flash_attn_forward(q, k, v, **o)

    def backward(dout, q, k, v, dropout_p=0.0, seed=None, **o):
        if dropout_p:
            o.update(dropout_p=dropout_p, dropout_seed=seed)
        out, lse = api.flash_attn_forward(q, k, v, **o)
        return api.flash_attn_backward(dout, q, k, v, out, lse, **o)

    def varlen(q, k, v, cu_q, cu_k, max_q, max_k, **o):
        return api.flash_attn_varlen_forward(q, k, v, cu_q, cu_k, max_q, max_k, **o)

    from ._backend import SIMULATOR

    array = "numpy" if SIMULATOR else "cupy"
    dtypes = ("float32", "float16") if SIMULATOR else ("float32", "float16", "bfloat16")  # no bfloat16 simulated
    return Implementation("flashnumba", forward, backward, supports=set(OPTIONS), array=array, varlen=varlen,
                          dtypes=dtypes)


def _torch_sdpa(backend):
    """torch's scaled_dot_product_attention under one backend, called as a flash-attn user would: causal
    bottom-right (torch.nn.attention.bias.causal_lower_right where seqlen_q != seqlen_k; ``is_causal`` is
    top-left), K and V heads repeated for GQA (so that every backend takes it; autograd sums dK and dV back).
    "No available kernel" (a head dim or layout the backend refuses) is :class:`Unsupported`, with torch's
    first warning as the reason."""
    import warnings

    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right

    _needs_cuda_torch(torch, f"torch-sdpa-{backend}")

    b = getattr(SDPBackend, {"flash": "FLASH_ATTENTION", "cudnn": "CUDNN_ATTENTION", "efficient":
                             "EFFICIENT_ATTENTION", "math": "MATH"}[backend])

    def run(q, k, v, causal=False, softmax_scale=None):
        q, k, v = (x.transpose(1, 2) for x in (q, k, v))  # torch's (batch, nheads, seqlen, d)
        if k.shape[1] != q.shape[1]:
            k, v = (x.repeat_interleave(q.shape[1] // x.shape[1], dim=1) for x in (k, v))
        sq, sk = q.shape[2], k.shape[2]
        with sdpa_kernel(b), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            mask = causal_lower_right(sq, sk) if causal and sq != sk else None
            try:
                out = torch.nn.functional.scaled_dot_product_attention(
                    q, k, v, attn_mask=mask, is_causal=causal and mask is None, scale=softmax_scale)
            except RuntimeError as err:
                if "No available kernel" not in str(err) and "No viable backend" not in str(err):
                    raise
                why = [str(w.message).splitlines()[0] for w in caught if "causal bias" not in str(w.message)]
                raise Unsupported(f"torch SDPA {backend}: {'; '.join(why[-2:]) or str(err)}"[:200]) from None
        return out.transpose(1, 2)

    def backward(dout, q, k, v, **o):
        leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
        out = run(*leaves, **o)
        return torch.autograd.grad(out, leaves, dout)

    dtypes = ("float16", "bfloat16") if backend in ("flash", "cudnn") else ("float32", "float16", "bfloat16")
    return Implementation(f"torch-sdpa-{backend}", run, backward, supports={"causal", "gqa", "scale"},
                          array="torch", dtypes=dtypes, head_dims=(16, 40, 64, 96, 128))


def _needs_cuda_torch(torch, name):
    """ImportError (said in one line by the command line) where torch sees no CUDA device: the torch adapters run on
    CUDA tensors, and without one every property would be reported as the implementation raising."""
    if not torch.cuda.is_available():
        raise ImportError(f"{name} runs on CUDA tensors, and torch {torch.__version__} sees no CUDA device")


def _flash_attn():
    from flash_attn import flash_attn_func
    import torch

    _needs_cuda_torch(torch, "flash-attn")

    def forward(q, k, v, dropout_p=0.0, seed=None, **o):
        return flash_attn_func(q, k, v, dropout_p=dropout_p, **o)

    def backward(dout, q, k, v, **o):
        import torch

        leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
        return torch.autograd.grad(flash_attn_func(*leaves, **o), leaves, dout)

    return Implementation("flash-attn", forward, backward,
                          supports={"causal", "window", "softcap", "alibi", "gqa", "scale"}, array="torch",
                          dtypes=("float16", "bfloat16"), head_dims=(16, 40, 64, 96, 128))


ADAPTERS = {
    "numpy-reference": reference_implementation, "flashnumba": _flashnumba, "flash-attn": _flash_attn,
    **{f"torch-sdpa-{b}": (lambda b=b: _torch_sdpa(b)) for b in ("flash", "cudnn", "efficient", "math")},
}


def adapter(name: str) -> Implementation:
    """A built-in implementation by name (:data:`ADAPTERS`), or ``module:function`` (a NumPy function
    ``fn(q, k, v, causal=...)`` in flash-attn's layout, declared to support causal)."""
    if name in ADAPTERS:
        return ADAPTERS[name]()
    if ":" in name:
        import importlib

        module, _, attr = name.partition(":")
        fn = getattr(importlib.import_module(module), attr)
        if isinstance(fn, Implementation):
            return fn
        if not callable(fn):
            raise TypeError(f"{name} is a {type(fn).__name__}, not a function or an Implementation")
        return Implementation(name, fn, supports={"causal"})
    raise ValueError(f"unknown implementation {name!r}; built in: {', '.join(ADAPTERS)}, or module:function")


__all__ = ["Implementation", "Report", "Result", "Unsupported", "check_attention", "adapter", "ADAPTERS", "PROPERTIES",
           "tolerance", "max_error", "reference_implementation"]
