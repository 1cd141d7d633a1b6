"""flashnumba from PyTorch: flash-attn's functions, differentiable, traceable by ``torch.compile``.

``import flashnumba.torch`` (it needs torch) gives flash-attn 2.8's interface with its signatures, defaults and
return values::

    from flashnumba.torch import flash_attn_func
    out = flash_attn_func(q, k, v, causal=True)     # q (batch, seqlen, nheads, d); k, v (batch, seqlen_k, nheads_k, d)
    out.sum().backward()                            # q.grad, k.grad, v.grad from flashnumba's backward kernels

Three layers, as in flash-attn:

* **custom operators** (``torch.ops.flashnumba.forward``, ``.backward``, ``.varlen_forward``,
  ``.varlen_backward``, ``.probs``; a call with dropout runs ``.forward_dropout`` or ``.varlen_forward_dropout``,
  the same bodies tagged as random operators are), each with a fake implementation that gives the shapes of its results
  without running anything (and runs flashnumba's argument checks on the shapes), so that ``torch.compile(model,
  fullgraph=True)`` traces a model through them with no graph break. They call the core API
  (:func:`flashnumba.flash_attn_forward`, ...) on the tensors as they are: no copy (the core copies only
  an input the tensor-core kernels cannot read in place: strides that are not multiples of 16 bytes, a start not
  on 16 bytes), kernels on torch's current stream.
* **autograd Functions** that save q, k, v, out, lse and the dropout state (with dropout a CPU int64 tensor
  ``[seed, offset]``, without an unread one on the GPU, so that torch.compile's ``mode="reduce-overhead"`` can
  capture the graph in a CUDA graph) and return the gradients of q, k and v (with GQA/MQA, dk and dv summed over
  the query heads that share a key/value head; packed inputs get packed gradients). The backward kernels give
  first derivatives: differentiating the gradients again (``create_graph=True``, then ``loss.backward()`` or
  ``torch.autograd.grad``) raises rather than dropping their dependence on q, k and v.
* **the public functions**, flash-attn's names.

Dropout. With ``dropout_p > 0`` the seed and offset come from torch's CUDA generator and advance it as flash-attn
does (:func:`flashnumba.draw_dropout_seed`), so ``torch.manual_seed`` reproduces a run; the backward regenerates
the forward's mask from the saved state. torch's generator cannot be read while a CUDA graph is captured, so a
call with dropout raises there (capture without dropout, or use the core API with an explicit dropout_seed).

``return_attn_probs=True`` returns ``(out, softmax_lse, probs)``, the varlen functions too. As flash-attn computes its
S_dmask only with dropout, probs without dropout is an empty tensor; with dropout it is flashnumba's float32 P (0
where dropped, scaled by 1 / (1 - dropout_p) where kept), not flash-attn's sign-encoded S_dmask: a debugging path for
small sizes (:func:`flashnumba.attention_probs`), not for varlen. softmax_lse and probs have no backward: they come
marked non-differentiable (``requires_grad`` False, as the indices of ``torch.max``), so gradients flow through out
alone. ``deterministic`` is accepted: flashnumba's backward is always deterministic. ``block_table`` (paged KV) is
not supported by the varlen functions. The varlen functions read ``cu_seqlens`` on the host to check them
(``flashnumba.config.check_device_values``), which a CUDA graph capture cannot do: capture them with it off.
"""

from __future__ import annotations

import functools
import inspect
from typing import Optional

import torch
from torch import Tensor

from . import api
from ._validate import check_dropout_p, check_flag, check_int, check_scale, check_softcap, check_window


def _contiguous_last(x):
    """x, or a copy where its last dimension is not contiguous (an expanded gradient, for example)."""
    return x.contiguous() if x is not None and x.dim() and x.stride(-1) != 1 else x


def _no_rng(q: Tensor) -> Tensor:
    """The dropout state of a call without dropout: never read, on q's device (a CPU tensor in a compiled graph
    would keep torch.compile's mode="reduce-overhead" from capturing it in a CUDA graph)."""
    return torch.empty(2, dtype=torch.int64, device=q.device)


def _rng_state(seed: int, offset: int) -> Tensor:
    """[seed, offset] as a CPU int64 tensor (the seed's 64 bits as a signed int64): the backward reads it on the
    host without a synchronisation."""
    return torch.tensor([seed - 2**64 if seed >= 2**63 else seed, offset], dtype=torch.int64, device="cpu")


def _fake_rng(q: Tensor, dropout_p) -> Tensor:
    """The dropout state's place as the operators give it: the CPU with dropout, q's device without."""
    return torch.empty(2, dtype=torch.int64, device="cpu") if dropout_p else _no_rng(q)


def _seed_offset(rng_state: Tensor, dropout_p: float) -> dict:
    if not dropout_p:
        return {}
    seed, offset = (int(x) for x in rng_state.tolist())
    return dict(dropout_seed=seed % 2**64, dropout_offset=offset)


def _draw(q: Tensor, heads_of_batch: int, dropout_p: float) -> tuple[dict, Tensor]:
    if not dropout_p:
        return {}, _no_rng(q)
    seed, offset = api.draw_dropout_seed(q, heads_of_batch)
    return dict(dropout_seed=seed, dropout_offset=offset), _rng_state(seed, offset)


def _options(dropout_p, softmax_scale, causal, window_left, window_right, softcap, alibi_slopes):
    return dict(dropout_p=dropout_p, softmax_scale=softmax_scale, causal=causal,
                window_size=(window_left, window_right), softcap=softcap, alibi_slopes=alibi_slopes)


def _checked_options(dropout_p, softmax_scale, causal, window_left, window_right, softcap, alibi_slopes):
    """The options as the fake implementations check them: a softmax_scale of None as 1.0, since its value,
    1/sqrt(head_dim), would turn a symbolic head_dim into a constant while torch.compile traces with dynamic shapes
    (and a region under torch.compiler.nested_compile_region, traced once and stamped out again, then fails)."""
    scale = 1.0 if softmax_scale is None else softmax_scale
    return _options(dropout_p, scale, causal, window_left, window_right, softcap, alibi_slopes)


def _custom_op(name, impl, seeded=False):
    """``torch.library.custom_op``; ``seeded``: the operator draws from torch's generator, tagged
    nondeterministic_seeded as torch's own random operators are, so that graph passes that read the tag take it for
    one (the partitioner runs a call that activation checkpointing recomputes with the generator state it saved).
    The common-subexpression pass reads names, not the tag: :func:`_draw_token` keeps calls apart there.
    (torch before 2.5 takes no tags.)"""
    seeded = seeded and "tags" in inspect.signature(torch.library.custom_op).parameters
    tags = {"tags": (torch.Tag.nondeterministic_seeded,)} if seeded else {}
    return torch.library.custom_op(name, impl, mutates_args=(), **tags)


def _forward_ops(name, impl, fake):
    """Two operators of one body and one fake implementation: ``flashnumba::name`` for calls without dropout and
    ``flashnumba::name_dropout``, seeded (:func:`_custom_op`), for calls with. A call without dropout draws
    nothing, and the tag would cost it: under activation checkpointing the partitioner wraps a tagged operator's
    recomputation in a save and restore of the generator's state, and refuses one whose inputs need no gradient
    ("does not support RNG ops in recompute regions")."""
    ops = _custom_op(f"flashnumba::{name}", impl), _custom_op(f"flashnumba::{name}_dropout", impl, seeded=True)
    for op in ops:
        op.register_fake(fake)
    return ops


def _empty(like: Tensor, shape, dtype=None) -> Tensor:
    return torch.empty(tuple(shape), dtype=like.dtype if dtype is None else dtype, device=like.device)


# ---------------------------------------------------------------------------------------------------------------
# custom operators: what runs, and the shapes torch.compile sees
# ---------------------------------------------------------------------------------------------------------------


def _forward_impl(q: Tensor, k: Tensor, v: Tensor, alibi_slopes: Optional[Tensor], dropout_p: float,
                  softmax_scale: Optional[float], causal: bool, window_left: int, window_right: int,
                  softcap: float, draw: Optional[Tensor]) -> tuple[Tensor, Tensor, Tensor]:
    opts = _options(dropout_p, softmax_scale, causal, window_left, window_right, softcap, alibi_slopes)
    if dropout_p:  # validated before the generator advances: a bad call leaves it where it was
        api.check_forward_args(q, k, v, **opts)
    seeds, rng = _draw(q, q.shape[0] * q.shape[2], dropout_p)
    out, lse = api.flash_attn_forward(q, k, v, **opts, **seeds)
    return out, lse, rng


def _forward_fake(q, k, v, alibi_slopes, dropout_p, softmax_scale, causal, window_left, window_right, softcap, draw):
    api.check_forward_args(q, k, v, **_checked_options(dropout_p, softmax_scale, causal, window_left, window_right,
                                                       softcap, alibi_slopes))
    batch, seqlen_q, nheads, _ = q.shape
    return _empty(q, q.shape), _empty(q, (batch, nheads, seqlen_q), torch.float32), _fake_rng(q, dropout_p)


_forward, _forward_dropout = _forward_ops("forward", _forward_impl, _forward_fake)


def _backward_impl(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                   alibi_slopes: Optional[Tensor], rng_state: Tensor, dropout_p: float, softmax_scale: Optional[float],
                   causal: bool, window_left: int, window_right: int, softcap: float) -> tuple[Tensor, Tensor, Tensor]:
    return tuple(api.flash_attn_backward(
        dout, q, k, v, out, lse, **_options(dropout_p, softmax_scale, causal, window_left, window_right, softcap,
                                            alibi_slopes), **_seed_offset(rng_state, dropout_p)))


_backward = _custom_op("flashnumba::backward", _backward_impl)


@_backward.register_fake
def _(dout, q, k, v, out, lse, alibi_slopes, rng_state, dropout_p, softmax_scale, causal, window_left, window_right,
      softcap):
    return _empty(q, q.shape), _empty(k, k.shape), _empty(v, v.shape)


def _probs_impl(q: Tensor, k: Tensor, v: Tensor, lse: Tensor, alibi_slopes: Optional[Tensor], rng_state: Tensor,
                dropout_p: float, softmax_scale: Optional[float], causal: bool, window_left: int, window_right: int,
                softcap: float) -> Tensor:
    return api.attention_probs(q, k, v, lse, **_options(dropout_p, softmax_scale, causal, window_left, window_right,
                                                        softcap, alibi_slopes), **_seed_offset(rng_state, dropout_p))


_probs = _custom_op("flashnumba::probs", _probs_impl)


@_probs.register_fake
def _(q, k, v, lse, alibi_slopes, rng_state, dropout_p, softmax_scale, causal, window_left, window_right, softcap):
    api.check_probs_size(q.shape[0], q.shape[2], q.shape[1], k.shape[1])
    return _empty(q, (q.shape[0], q.shape[2], q.shape[1], k.shape[1]), torch.float32)


def _varlen_forward_impl(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                         max_seqlen_q: int, max_seqlen_k: int, alibi_slopes: Optional[Tensor], dropout_p: float,
                         softmax_scale: Optional[float], causal: bool, window_left: int, window_right: int,
                         softcap: float, draw: Optional[Tensor]) -> tuple[Tensor, Tensor, Tensor]:
    opts = _options(dropout_p, softmax_scale, causal, window_left, window_right, softcap, alibi_slopes)
    if dropout_p:  # validated before the generator advances
        api.check_varlen_args(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, **opts)
    seeds, rng = _draw(q, (cu_seqlens_q.shape[0] - 1) * q.shape[1], dropout_p)
    out, lse = api.flash_attn_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                             **opts, **seeds)
    return out, lse, rng


def _comparable(max_seqlen):
    """A max_seqlen as the fake implementations' checks compare it: an int that the traced code reads from a tensor
    (``.item()``) has no value until the call runs, where the core API checks it; 0 here."""
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    return 0 if isinstance(max_seqlen, torch.SymInt) and free_unbacked_symbols(max_seqlen) else max_seqlen


def _varlen_forward_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, alibi_slopes, dropout_p,
                         softmax_scale, causal, window_left, window_right, softcap, draw):
    api.check_varlen_args(q, k, v, cu_seqlens_q, cu_seqlens_k, _comparable(max_seqlen_q), _comparable(max_seqlen_k),
                          **_checked_options(dropout_p, softmax_scale, causal, window_left, window_right, softcap,
                                             alibi_slopes))
    total_q, nheads, _ = q.shape
    return _empty(q, q.shape), _empty(q, (nheads, total_q), torch.float32), _fake_rng(q, dropout_p)


_varlen_forward, _varlen_forward_dropout = _forward_ops("varlen_forward", _varlen_forward_impl, _varlen_forward_fake)


def _varlen_backward_impl(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                          cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, max_seqlen_q: int, max_seqlen_k: int,
                          alibi_slopes: Optional[Tensor], rng_state: Tensor, dropout_p: float,
                          softmax_scale: Optional[float],
                          causal: bool, window_left: int, window_right: int,
                          softcap: float) -> tuple[Tensor, Tensor, Tensor]:
    return tuple(api.flash_attn_varlen_backward(
        dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
        **_options(dropout_p, softmax_scale, causal, window_left, window_right, softcap, alibi_slopes),
        **_seed_offset(rng_state, dropout_p)))


_varlen_backward = _custom_op("flashnumba::varlen_backward", _varlen_backward_impl)


@_varlen_backward.register_fake
def _(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, alibi_slopes, rng_state,
      dropout_p, softmax_scale, causal, window_left, window_right, softcap):
    return _empty(q, q.shape), _empty(k, k.shape), _empty(v, v.shape)


# ---------------------------------------------------------------------------------------------------------------
# autograd: what the forward saves, what the backward returns
# ---------------------------------------------------------------------------------------------------------------


def _op(op, impl, *tensors):
    """The custom operator while torch.compile traces (or for tensor subclasses such as fake tensors); its body,
    called directly, for plain CUDA tensors in eager mode: the same results without the dispatcher's tens of
    microseconds per call."""
    if not torch.compiler.is_compiling() and all(type(t) is Tensor and t.is_cuda for t in tensors):
        return impl
    return op


def _inputs(alibi_slopes, deterministic, return_attn_probs, max_seqlens=(), **tensors) -> list:
    """The tensors of a public call, checked (torch tensors, alibi_slopes None or one; the flags bools; the
    maxima ints), a tensor given twice (q as k and v, one cu_seqlens for both sides) the second time as a view of
    itself: torch.compile traces no autograd Function given one tensor in two places. The core API's own checks
    follow."""
    for name, x in dict(tensors, alibi_slopes=alibi_slopes).items():
        if not (isinstance(x, Tensor) or x is None and name == "alibi_slopes"):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__module__}.{type(x).__name__} "
                            f"(flashnumba.flash_attn_func takes CuPy and NumPy arrays)")
    check_flag("deterministic", deterministic)
    check_flag("return_attn_probs", return_attn_probs)
    for name, n in zip(("max_seqlen_q", "max_seqlen_k") if len(max_seqlens) == 2 else ("max_seqlen",), max_seqlens):
        if torch.compiler.is_compiling() and isinstance(n, int):
            _state_range(name, n)
        check_int(name, n, 0, 2**31 - 1)
    given = []
    for x in tensors.values():
        given.append(x.view_as(x) if any(x is y for y in given) else x)
    return given


def _state_range(name, n):
    """While torch.compile traces, an int that the traced code read from a tensor (``.item()``: a max_seqlen from
    cu_seqlens) has no value to compare; its range is stated instead (checked when the graph runs), after which the
    comparisons of :func:`flashnumba._validate.check_int` hold by that range. Each message is a function with no
    free variable: torch 2.11's tracer takes no other (one that reads ``name`` failed to trace)."""
    if name == "max_seqlen_q":
        def message():
            return "max_seqlen_q must be in [0, 2**31 - 1]"
    elif name == "max_seqlen_k":
        def message():
            return "max_seqlen_k must be in [0, 2**31 - 1]"
    else:
        def message():
            return "max_seqlen must be in [0, 2**31 - 1]"
    torch._check(0 <= n, message)
    torch._check(n <= 2**31 - 1, message)


def _fresh(*scalars):
    """The public call's numbers as they go to its autograd Function. While torch.compile traces with dynamic
    shapes, a float the compiled function takes (an argument, a global) is a symbolic float, read from a graph input
    where it is first used; dynamo's tracer of an autograd Function fails ("lift_tracked_freevar_to_input should not
    be called on root SubgraphTracer") on one that an earlier Function used first. Each call gets its own node of
    it (``x * 1.0``) in the graph being traced. (The defaults of dropout_p and softcap are the int 0, a constant
    to dynamo: a float default is such a symbolic float too, and inside ``torch.utils.checkpoint`` no copy made
    there helps, the graph being traced being the checkpoint's own.)"""
    if not torch.compiler.is_compiling():
        return scalars
    return tuple(x * 1.0 if isinstance(x, torch.SymFloat) else x for x in scalars)


def _scalars(q, dropout_p, softmax_scale, causal, window_size, softcap):
    """The operators' scalar arguments, checked as the core API checks them (before any conversion: a string is no
    bool): softmax_scale None or a float, window_size split. While torch.compile traces, the numbers may be
    symbolic: the operators' fake implementations check them."""
    left, right = check_window(window_size)
    causal = check_flag("causal", causal)
    if torch.compiler.is_compiling():
        return dropout_p, softmax_scale, causal, left, right, softcap
    scale = None if softmax_scale is None else check_scale(softmax_scale, 1)
    return check_dropout_p(dropout_p), scale, causal, left, right, check_softcap(softcap)


def _draw_token(q, scalars) -> Optional[Tensor]:
    """The forward operators' last argument: None, or while torch.compile traces a call with dropout an empty
    tensor of its own (``torch.empty``, which that pass never merges). Two calls with the same inputs are then two
    nodes with different arguments, which the partitioner's common-subexpression pass (it spares torch's own
    random operators by name, not by their nondeterministic_seeded tag) cannot merge into one dropout mask. The
    operators never read it."""
    return torch.empty(0, device=q.device) if scalars[0] and torch.compiler.is_compiling() else None


def _attention(ctx, q, k, v, alibi_slopes, scalars, return_softmax):
    """The forward of the dense functions: (out, lse, probs or None), with what the backward needs saved. Inputs
    whose last dimension is strided are copied first, as flash-attn's functions do. probs (``return_softmax``) as
    flash-attn's S_dmask is there: with dropout the probabilities (:func:`_probs_impl`, too many of them refused
    before the forward runs), without an empty tensor."""
    if return_softmax and scalars[0] and not torch.compiler.is_compiling() and q.dim() == 4 == k.dim():
        api.check_probs_size(q.shape[0], q.shape[2], q.shape[1], k.shape[1])  # (other ranks: refused next)
    q, k, v = (_contiguous_last(x) for x in (q, k, v))
    forward = _op(_forward_dropout if scalars[0] else _forward, _forward_impl, q, k, v)
    out, lse, rng = forward(q, k, v, alibi_slopes, *scalars, _draw_token(q, scalars))
    ctx.save_for_backward(q, k, v, out, lse, rng, alibi_slopes)
    ctx.scalars = scalars
    probs = None
    if return_softmax:  # lse and probs have no backward
        probs = _op(_probs, _probs_impl, q)(q, k, v, lse, alibi_slopes, rng, *scalars) if scalars[0] else \
            _no_probs(q)
        ctx.mark_non_differentiable(lse, probs)
    return out, lse, probs


def _no_probs(q: Tensor) -> Tensor:
    """The third value of ``return_attn_probs`` without dropout: empty, as flash-attn's (it computes S_dmask only
    with dropout, where it carries the mask)."""
    return torch.empty(0, dtype=q.dtype, device=q.device)


def _attention_grads(ctx, dout, *rest):
    """(dq, dk, dv) for the gradient of out (``rest``: the zero gradients of the non-differentiable softmax_lse and
    probs of ``return_attn_probs``)."""
    q, k, v, out, lse, rng, alibi_slopes = ctx.saved_tensors
    backward = _op(_backward, _backward_impl, dout, q)
    return backward(_contiguous_last(dout), q, k, v, out, lse, alibi_slopes, rng, *ctx.scalars)


def _varlen_attention(ctx, q, k, v, cu_q, cu_k, max_q, max_k, alibi_slopes, scalars, return_softmax):
    """As :func:`_attention` for packed sequences: (out, lse, probs or None); probs empty (no dropout: as
    flash-attn's), with dropout not implemented."""
    if return_softmax and scalars[0]:
        raise ValueError("return_attn_probs=True with dropout is not implemented for variable-length batches "
                         "(without dropout the third value is empty, as flash-attn's)")
    q, k, v = (_contiguous_last(x) for x in (q, k, v))
    forward = _op(_varlen_forward_dropout if scalars[0] else _varlen_forward, _varlen_forward_impl, q, k, v)
    out, lse, rng = forward(q, k, v, cu_q, cu_k, max_q, max_k, alibi_slopes, *scalars, _draw_token(q, scalars))
    ctx.save_for_backward(q, k, v, out, lse, rng, cu_q, cu_k, alibi_slopes)
    ctx.scalars, ctx.max_seqlens = scalars, (max_q, max_k)
    probs = None
    if return_softmax:
        probs = _no_probs(q)
        ctx.mark_non_differentiable(lse, probs)
    return out, lse, probs


def _varlen_grads(ctx, dout, *rest):
    """(dq, dk, dv) for the gradient of out (``rest``: those of softmax_lse and probs, none)."""
    q, k, v, out, lse, rng, cu_q, cu_k, alibi_slopes = ctx.saved_tensors
    backward = _op(_varlen_backward, _varlen_backward_impl, dout, q)
    return backward(_contiguous_last(dout), q, k, v, out, lse, cu_q, cu_k, *ctx.max_seqlens, alibi_slopes, rng,
                    *ctx.scalars)


def _result(out, lse, probs, return_softmax):
    return (out, lse, probs) if return_softmax else out


def _first_order(backward):
    """The backward of an autograd Function whose kernels give first derivatives. With ``create_graph=True`` (a
    gradient penalty, a Hessian-vector product) the gradients depend on q, k, v and dout in ways these kernels do
    not differentiate: they come back marked so that differentiating them raises, whether or not dout requires
    grad (``torch.autograd.function.once_differentiable`` marks them only where it does, so a loss linear in out
    would lose the penalty's dependence silently)."""
    @functools.wraps(backward)
    def wrapper(ctx, *grads):
        with torch.no_grad():
            outputs = backward(ctx, *grads)
        if not torch.is_grad_enabled():
            return outputs
        given = [g for g in outputs if g is not None]
        # what the gradients depend on: the saved q, k, v (out, ...) and dout, where they require grad; and the
        # gradients themselves, so that a loss reached by no such path still refuses
        sources = [t for t in (*ctx.saved_tensors, *grads) if isinstance(t, Tensor) and t.requires_grad]
        marked = iter(_FirstOrderOnly.apply(len(given), *(g.detach().requires_grad_() for g in given), *sources))
        return tuple(None if g is None else next(marked) for g in outputs)
    return wrapper


class _FirstOrderOnly(torch.autograd.Function):
    """The first ``n`` tensors as they are, in an autograd node that also takes the rest (what they depend on) and
    raises when differentiated: every path from a gradient back to q, k, v or dout runs through it, so that
    ``torch.autograd.grad(loss, q)`` raises as ``loss.backward()`` does (a node on the gradients alone is on no path
    to q: the penalty's term was dropped silently)."""

    @staticmethod
    def forward(ctx, n, *tensors):
        return tuple(t.view_as(t) for t in tensors[:n])

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError("flashnumba.torch: the attention's backward kernels give first derivatives only; its "
                           "gradients cannot be differentiated again")


class FlashAttnFunc(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                return_softmax, is_grad_enabled=True):
        scalars = _scalars(q, dropout_p, softmax_scale, causal, window_size, softcap)
        return _result(*_attention(ctx, q, k, v, alibi_slopes, scalars, return_softmax), return_softmax)

    @staticmethod
    @_first_order
    def backward(ctx, dout, *rest):
        dq, dk, dv = _attention_grads(ctx, dout, *rest)
        return (dq, dk, dv) + (None,) * 9


class FlashAttnQKVPackedFunc(torch.autograd.Function):
    @staticmethod
    def forward(ctx, qkv, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                return_softmax, is_grad_enabled=True):
        q, k, v = qkv.detach().unbind(2)  # views: (batch, seqlen, nheads, d) with a contiguous last dimension
        scalars = _scalars(q, dropout_p, softmax_scale, causal, window_size, softcap)
        return _result(*_attention(ctx, q, k, v, alibi_slopes, scalars, return_softmax), return_softmax)

    @staticmethod
    @_first_order
    def backward(ctx, dout, *rest):
        grads = _attention_grads(ctx, dout, *rest)
        return (torch.stack(grads, dim=2),) + (None,) * 9


class FlashAttnKVPackedFunc(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, kv, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                return_softmax, is_grad_enabled=True):
        k, v = kv.detach().unbind(2)
        scalars = _scalars(q, dropout_p, softmax_scale, causal, window_size, softcap)
        return _result(*_attention(ctx, q, k, v, alibi_slopes, scalars, return_softmax), return_softmax)

    @staticmethod
    @_first_order
    def backward(ctx, dout, *rest):
        dq, dk, dv = _attention_grads(ctx, dout, *rest)
        return (dq, torch.stack((dk, dv), dim=2)) + (None,) * 9


class FlashAttnVarlenFunc(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale,
                causal, window_size, softcap, alibi_slopes, deterministic, return_softmax, block_table=None,
                is_grad_enabled=True):
        _no_block_table(block_table)
        scalars = _scalars(q, dropout_p, softmax_scale, causal, window_size, softcap)
        return _result(*_varlen_attention(ctx, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                          alibi_slopes, scalars, return_softmax), return_softmax)

    @staticmethod
    @_first_order
    def backward(ctx, dout, *rest):
        dq, dk, dv = _varlen_grads(ctx, dout, *rest)
        return (dq, dk, dv) + (None,) * 14


class FlashAttnVarlenQKVPackedFunc(torch.autograd.Function):
    @staticmethod
    def forward(ctx, qkv, cu_seqlens, max_seqlen, dropout_p, softmax_scale, causal, window_size, softcap,
                alibi_slopes, deterministic, return_softmax, is_grad_enabled=True):
        q, k, v = qkv.detach().unbind(1)  # (total, nheads, d) views
        scalars = _scalars(q, dropout_p, softmax_scale, causal, window_size, softcap)
        return _result(*_varlen_attention(ctx, q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen,
                                          alibi_slopes, scalars, return_softmax), return_softmax)

    @staticmethod
    @_first_order
    def backward(ctx, dout, *rest):
        return (torch.stack(_varlen_grads(ctx, dout, *rest), dim=1),) + (None,) * 11


class FlashAttnVarlenKVPackedFunc(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal,
                window_size, softcap, alibi_slopes, deterministic, return_softmax, is_grad_enabled=True):
        k, v = kv.detach().unbind(1)
        scalars = _scalars(q, dropout_p, softmax_scale, causal, window_size, softcap)
        return _result(*_varlen_attention(ctx, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                          alibi_slopes, scalars, return_softmax), return_softmax)

    @staticmethod
    @_first_order
    def backward(ctx, dout, *rest):
        dq, dk, dv = _varlen_grads(ctx, dout, *rest)
        return (dq, torch.stack((dk, dv), dim=1)) + (None,) * 13


# ---------------------------------------------------------------------------------------------------------------
# flash-attn's public functions
# ---------------------------------------------------------------------------------------------------------------


def flash_attn_func(q, k, v, dropout_p=0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0,
                    alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """Attention of q (batch, seqlen_q, nheads, d) over k, v (batch, seqlen_k, nheads_k, d), differentiable in q, k
    and v: flash-attn's ``flash_attn_func`` (options as :func:`flashnumba.flash_attn_forward`). Returns out, or
    (out, softmax_lse, probs) with ``return_attn_probs`` (probs empty without dropout: the module's docstring)."""
    q, k, v = _inputs(alibi_slopes, deterministic, return_attn_probs, q=q, k=k, v=v)
    dropout_p, softmax_scale, softcap = _fresh(dropout_p, softmax_scale, softcap)
    return FlashAttnFunc.apply(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                               deterministic, return_attn_probs)


def flash_attn_qkvpacked_func(qkv, dropout_p=0, softmax_scale=None, causal=False, window_size=(-1, -1),
                              softcap=0, alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """:func:`flash_attn_func` of qkv (batch, seqlen, 3, nheads, d), read in place; the gradient is packed too."""
    _inputs(alibi_slopes, deterministic, return_attn_probs, qkv=qkv)
    _check_packed("qkv", qkv, 5, 2, 3)
    dropout_p, softmax_scale, softcap = _fresh(dropout_p, softmax_scale, softcap)
    return FlashAttnQKVPackedFunc.apply(qkv, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                                        deterministic, return_attn_probs)


def flash_attn_kvpacked_func(q, kv, dropout_p=0, softmax_scale=None, causal=False, window_size=(-1, -1),
                             softcap=0, alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """:func:`flash_attn_func` of q and kv (batch, seqlen_k, 2, nheads_k, d), read in place."""
    q, kv = _inputs(alibi_slopes, deterministic, return_attn_probs, q=q, kv=kv)
    _check_packed("kv", kv, 5, 2, 2)
    dropout_p, softmax_scale, softcap = _fresh(dropout_p, softmax_scale, softcap)
    return FlashAttnKVPackedFunc.apply(q, kv, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                                       deterministic, return_attn_probs)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False, block_table=None):
    """Attention over packed sequences of different lengths: q (total_q, nheads, d), k, v (total_k, nheads_k, d),
    cu_seqlens_* int32 (batch + 1,) offsets (see :func:`flashnumba.flash_attn_varlen_forward`). Returns out, or
    (out, softmax_lse (nheads, total_q), an empty tensor) with ``return_attn_probs`` (with dropout: refused)."""
    q, k, v, cu_seqlens_q, cu_seqlens_k = _inputs(alibi_slopes, deterministic, return_attn_probs,
                                                  (max_seqlen_q, max_seqlen_k), q=q, k=k, v=v,
                                                  cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k)
    _no_block_table(block_table)
    dropout_p, softmax_scale, softcap = _fresh(dropout_p, softmax_scale, softcap)
    return FlashAttnVarlenFunc.apply(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                                     softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                                     return_attn_probs)


def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0, softmax_scale=None, causal=False,
                                     window_size=(-1, -1), softcap=0, alibi_slopes=None, deterministic=False,
                                     return_attn_probs=False):
    """:func:`flash_attn_varlen_func` of qkv (total, 3, nheads, d), read in place."""
    _inputs(alibi_slopes, deterministic, return_attn_probs, (max_seqlen,), qkv=qkv, cu_seqlens=cu_seqlens)
    _check_packed("qkv", qkv, 4, 1, 3)
    dropout_p, softmax_scale, softcap = _fresh(dropout_p, softmax_scale, softcap)
    return FlashAttnVarlenQKVPackedFunc.apply(qkv, cu_seqlens, max_seqlen, dropout_p, softmax_scale, causal,
                                              window_size, softcap, alibi_slopes, deterministic, return_attn_probs)


def flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0,
                                    softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0,
                                    alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """:func:`flash_attn_varlen_func` of q and kv (total_k, 2, nheads_k, d), read in place."""
    q, kv, cu_seqlens_q, cu_seqlens_k = _inputs(alibi_slopes, deterministic, return_attn_probs,
                                                (max_seqlen_q, max_seqlen_k), q=q, kv=kv, cu_seqlens_q=cu_seqlens_q,
                                                cu_seqlens_k=cu_seqlens_k)
    _check_packed("kv", kv, 4, 1, 2)
    dropout_p, softmax_scale, softcap = _fresh(dropout_p, softmax_scale, softcap)
    return FlashAttnVarlenKVPackedFunc.apply(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                                             softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                                             return_attn_probs)


def _check_packed(name, x, rank, axis, n):
    if x.dim() != rank or x.shape[axis] != n:
        layout = {(5, 3): "(batch, seqlen, 3, nheads, d)", (5, 2): "(batch, seqlen_k, 2, nheads_k, d)",
                  (4, 3): "(total, 3, nheads, d)", (4, 2): "(total_k, 2, nheads_k, d)"}[rank, n]
        raise ValueError(f"{name} must have shape {layout}, got {tuple(x.shape)}")


def _no_block_table(block_table):
    if block_table is not None:
        raise ValueError("block_table (a paged KV cache) is not supported by flash_attn_varlen_func; pass k and v "
                         "as packed (total_k, nheads_k, d) tensors")


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
                            cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, block_table=None,
                            softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                            rotary_interleaved=True, alibi_slopes=None, num_splits=0, return_softmax_lse=False):
    """flash-attn's ``flash_attn_with_kvcache`` on torch CUDA tensors: forward only (as flash-attn's), no autograd.

    The arguments and semantics of :func:`flashnumba.flash_attn_with_kvcache` (k_cache and v_cache updated in
    place when k and v are given), on float16, bfloat16 or float32 tensors, on torch's current stream. On the
    split-KV kernel (float16 / bfloat16, head_dim a multiple of 8, C-contiguous caches, compute capability 8.0 or
    newer) a step makes no host round trip, so it can be captured in a CUDA graph (cache_seqlens then as a
    tensor). float32 takes the gather path, which needs CuPy (ImportError without it) and copies the integer
    arguments to the host at every call (not capturable); bfloat16 there is refused (TypeError, see
    :func:`flashnumba.flash_attn_with_kvcache`'s ``kernel``).
    """
    from .decode import flash_attn_with_kvcache as core

    tensors = dict(q=q, k_cache=k_cache, v_cache=v_cache, k=k, v=v, rotary_cos=rotary_cos, rotary_sin=rotary_sin,
                   cache_seqlens=cache_seqlens, cache_batch_idx=cache_batch_idx, cache_leftpad=cache_leftpad,
                   block_table=block_table, alibi_slopes=alibi_slopes)
    for name, x in tensors.items():
        if name in ("q", "k_cache", "v_cache") or isinstance(x, Tensor):
            if not isinstance(x, Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__module__}.{type(x).__name__} "
                                f"(flashnumba.flash_attn_with_kvcache takes CuPy and NumPy arrays)")
            if not x.is_cuda:
                raise TypeError(f"{name}: expected a CUDA tensor, got a torch tensor on {x.device}")
    views = {n: x.detach() if isinstance(x, Tensor) else x for n, x in tensors.items()}
    return core(views.pop("q"), views.pop("k_cache"), views.pop("v_cache"), **views, softmax_scale=softmax_scale,
                causal=causal, window_size=window_size, softcap=softcap, rotary_interleaved=rotary_interleaved,
                num_splits=num_splits, return_softmax_lse=return_softmax_lse)


__all__ = ["flash_attn_func", "flash_attn_qkvpacked_func", "flash_attn_kvpacked_func", "flash_attn_varlen_func",
           "flash_attn_varlen_qkvpacked_func", "flash_attn_varlen_kvpacked_func", "FlashAttnFunc",
           "FlashAttnQKVPackedFunc", "FlashAttnKVPackedFunc", "FlashAttnVarlenFunc", "FlashAttnVarlenQKVPackedFunc",
           "FlashAttnVarlenKVPackedFunc", "flash_attn_with_kvcache"]
