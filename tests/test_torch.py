"""flashnumba.torch: flash-attn's interface as autograd Functions over custom operators.

Without a GPU (torch installed, CPU only) the argument handling, the fake implementations and a
``torch.compile(fullgraph=True)`` trace run on meta tensors. On a GPU: gradients against float64 torch autograd of
a plain attention with derived tolerances (every option, GQA, dropout), varlen and the packed variants, dropout
reproducibility under ``torch.manual_seed``, streams, CUDA graphs, and a compiled transformer block against eager.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, strategies as st

import flashnumba

torch = pytest.importorskip("torch")
ft = pytest.importorskip("flashnumba.torch")

from conftest import assert_close_to_truth, shard, to_numpy  # noqa: E402
from flashnumba.kernels import philox  # noqa: E402

on_gpu = pytest.mark.skipif(flashnumba.SIMULATOR or not torch.cuda.is_available(),
                            reason="needs a CUDA GPU and a CUDA build of torch")
SHARDS = 16  # the property test's examples, spread over the workers (each new option set compiles kernels)
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


def meta(*shape, dtype=torch.float16):
    return torch.empty(shape, dtype=dtype, device="meta", requires_grad=True)


# ---------------------------------------------------------------------------------------------------------------
# without a GPU: shapes, errors, tracing
# ---------------------------------------------------------------------------------------------------------------


def test_fake_shapes_and_gradients_of_every_function():
    q, k, v = meta(2, 16, 4, 64), meta(2, 20, 2, 64), meta(2, 20, 2, 64)
    out = ft.flash_attn_func(q, k, v, causal=True, dropout_p=0.1)
    assert out.shape == q.shape and out.dtype == q.dtype
    out.sum().backward()
    assert (q.grad.shape, k.grad.shape, v.grad.shape) == (q.shape, k.shape, v.shape)
    out, lse, probs = ft.flash_attn_func(q, k, v, dropout_p=0.1, return_attn_probs=True)
    assert lse.shape == (2, 4, 16) and lse.dtype == torch.float32 and probs.shape == (2, 4, 16, 20)
    assert out.requires_grad and not lse.requires_grad and not probs.requires_grad  # (out alone has a backward)
    out, lse, probs = ft.flash_attn_func(q, k, v, return_attn_probs=True)
    assert lse.shape == (2, 4, 16) and probs.shape == (0,) and not probs.requires_grad
    q.grad = None
    (out.sum() + lse.sum()).backward()
    assert q.grad.shape == q.shape

    qkv = meta(2, 16, 3, 4, 64, dtype=torch.bfloat16)
    ft.flash_attn_qkvpacked_func(qkv).sum().backward()
    assert qkv.grad.shape == qkv.shape
    kv = meta(2, 20, 2, 2, 64)
    ft.flash_attn_kvpacked_func(q, kv).sum().backward()
    assert kv.grad.shape == kv.shape

    cu = torch.zeros(3, dtype=torch.int32, device="meta")
    qv, kvv = meta(30, 4, 64), meta(40, 2, 2, 64)
    out = ft.flash_attn_varlen_kvpacked_func(qv, kvv, cu, cu, 16, 20)
    out.sum().backward()
    assert out.shape == qv.shape and kvv.grad.shape == kvv.shape
    kk, vv = meta(40, 2, 64), meta(40, 2, 64)
    ft.flash_attn_varlen_func(qv, kk, vv, cu, cu, 16, 20, window_size=(4, 4)).sum().backward()
    assert kk.grad.shape == kk.shape
    qkvv = meta(30, 3, 4, 32, dtype=torch.float32)
    ft.flash_attn_varlen_qkvpacked_func(qkvv, cu, 16, causal=True).sum().backward()
    assert qkvv.grad.shape == qkvv.shape


def test_compile_fullgraph_traces_forward_and_backward():
    """torch.compile(fullgraph=True) traces through the autograd Function and the custom operators (no graph
    break, or fullgraph raises); aot_eager runs the traced graphs on meta tensors."""
    def f(q, k, v, qkv, cu):
        a = ft.flash_attn_func(q, k, v, causal=True, dropout_p=0.1, window_size=(8, 0)).float().square().sum()
        b = ft.flash_attn_varlen_qkvpacked_func(qkv, cu, 16, softcap=5.0).float().sum()
        return a + b

    q, k, v = meta(2, 16, 4, 64), meta(2, 20, 2, 64), meta(2, 20, 2, 64)
    qkv, cu = meta(30, 3, 4, 64), torch.zeros(3, dtype=torch.int32, device="meta")
    torch._dynamo.reset()
    loss = torch.compile(f, fullgraph=True, backend="aot_eager")(q, k, v, qkv, cu)
    loss.backward()
    assert q.grad.shape == q.shape and qkv.grad.shape == qkv.shape


def test_compile_with_return_attn_probs():
    """softmax_lse and probs beside out in a compiled graph with a backward (they have none: marked so)."""
    def f(q, k, v):
        out, lse, probs = ft.flash_attn_func(q, k, v, causal=True, dropout_p=0.1, return_attn_probs=True)
        return out.float().sum() + lse.sum() + probs.sum()

    torch._dynamo.reset()
    q, k, v = (meta(1, 16, 2, 64) for _ in range(3))
    torch.compile(f, fullgraph=True, backend="aot_eager")(q, k, v).backward()
    assert q.grad.shape == q.shape and v.grad.shape == v.shape


def test_torch_check_messages_read_no_variable():
    """The message functions given to torch._check under torch.compile have no free variable: torch 2.11's tracer
    refuses any other ("Can't extract message from torch._check()"; torch 2.13 takes constants), which broke every
    compiled varlen call on the GPU machine's torch 2.11."""
    import types

    nested = [c for c in ft._state_range.__code__.co_consts if isinstance(c, types.CodeType)]
    assert len(nested) == 3 and all(not c.co_freevars for c in nested)


def test_varlen_with_a_max_seqlen_read_from_the_offsets():
    """max_seqlen computed in the traced code from cu_seqlens (``.item()``, as code that unpads a batch does) is a
    symbolic int with no value: the checks state its range instead of comparing it (they failed to trace: "Could not
    guard on data-dependent expression"), with ALiBi and dropout too; forward and backward graphs traced."""
    from torch._dynamo.backends.common import aot_autograd

    graphs = []

    def record(gm, _):
        graphs.append(gm)
        return gm

    def f(q, k, v, cu, slopes):
        m = (cu[1:] - cu[:-1]).max().item()
        return ft.flash_attn_varlen_func(q, k, v, cu, cu, m, m, causal=True, alibi_slopes=slopes, dropout_p=0.1)

    torch._dynamo.reset()
    q, k, v = (meta(30, 4, 64) for _ in range(3))
    cu = torch.zeros(3, dtype=torch.int32, device="meta")
    with torch._dynamo.config.patch(capture_scalar_outputs=True):
        g = torch.compile(f, fullgraph=True, backend=aot_autograd(fw_compiler=record, bw_compiler=record))
        with pytest.raises(RuntimeError, match="cannot be called on meta tensors"):  # (the graph run: .item())
            g(q, k, v, cu, torch.empty(4, device="meta"))
    assert len(graphs) == 2  # the forward's and the backward's
    # a symbolic max_seqlen out of range is refused by name (it was a tracer's error about a format string)
    g = torch.compile(lambda q, m: ft.flash_attn_varlen_func(q, q, q, cu, cu, m, m), fullgraph=True,
                      backend="aot_eager", dynamic=True)
    g(q, 16)
    with pytest.raises(Exception, match=r"max_seqlen_q must be in \[0, 2\*\*31 - 1\]"):
        g(q, -1)


def test_return_attn_probs_as_flash_attn_gives_it():
    """return_attn_probs: flash-attn's third value (S_dmask) exists only with dropout; without, it is an empty tensor
    and lse comes at any size (the probabilities, above the debugging path's limit, failed the call); with dropout
    the probabilities, too many of them refused before the forward runs; varlen: (out, lse (nheads, total_q),
    empty), compiled too. The autograd Functions take flash-attn 2.8's arguments to ``apply``."""
    big = meta(1, 4096, 16, 64)
    out, lse, probs = ft.flash_attn_func(big, big, big, causal=True, return_attn_probs=True)
    assert lse.shape == (1, 16, 4096) and probs.shape == (0,) and probs.dtype == big.dtype
    with pytest.raises(ValueError, match="more than the 67108864 allowed"):
        ft.flash_attn_func(big, big, big, dropout_p=0.1, return_attn_probs=True)
    cu = torch.zeros(3, dtype=torch.int32, device="meta")
    qv, kv = meta(30, 4, 64), meta(40, 2, 2, 64)
    for call in (lambda: ft.flash_attn_varlen_func(qv, kv[:, 0], kv[:, 1], cu, cu, 16, 20, return_attn_probs=True),
                 lambda: ft.flash_attn_varlen_kvpacked_func(qv, kv, cu, cu, 16, 20, return_attn_probs=True)):
        out, lse, probs = call()
        assert out.shape == qv.shape and lse.shape == (4, 30) and probs.shape == (0,)
        assert not lse.requires_grad and not probs.requires_grad
        out.float().sum().backward()
    assert qv.grad.shape == qv.shape and kv.grad.shape == kv.shape
    qkv = meta(30, 3, 4, 64)
    out, lse, probs = ft.flash_attn_varlen_qkvpacked_func(qkv, cu, 16, causal=True, return_attn_probs=True)
    (out.float().sum() + lse.sum()).backward()
    assert qkv.grad.shape == qkv.shape and lse.shape == (4, 30)

    def f(q, k, v):
        out, lse, probs = ft.flash_attn_varlen_func(q, k, v, cu, cu, 16, 20, return_attn_probs=True)
        return out.float().sum() + lse.sum() + probs.float().sum()

    torch._dynamo.reset()
    kk, vv = meta(40, 2, 64), meta(40, 2, 64)
    torch.compile(f, fullgraph=True, backend="aot_eager", dynamic=True)(qv, kk, vv).backward()
    assert kk.grad.shape == kk.shape
    # flash-attn 2.8's Functions take is_grad_enabled last (and the varlen one block_table before it)
    q = meta(2, 16, 4, 64)
    opts = (0.0, None, True, (-1, -1), 0.0, None, False, False)
    ft.FlashAttnFunc.apply(q, q, q, *opts, torch.is_grad_enabled()).float().sum().backward()
    ft.FlashAttnVarlenFunc.apply(qv, kk, vv, cu, cu, 16, 20, *opts, None, True).float().sum().backward()
    ft.FlashAttnQKVPackedFunc.apply(meta(2, 16, 3, 4, 64), *opts, True).float().sum().backward()
    ft.FlashAttnKVPackedFunc.apply(q, meta(2, 16, 2, 4, 64), *opts, True).float().sum().backward()
    ft.FlashAttnVarlenQKVPackedFunc.apply(qkv, cu, 16, *opts, True).float().sum().backward()
    ft.FlashAttnVarlenKVPackedFunc.apply(qv, kv, cu, cu, 16, 20, *opts, True).float().sum().backward()
    assert q.grad.shape == q.shape
    with pytest.raises(ValueError, match="block_table"):
        ft.FlashAttnVarlenFunc.apply(qv, kk, vv, cu, cu, 16, 20, *opts, cu, True)


def test_compile_with_a_window_that_changes_between_calls():
    """A window size given to the compiled function is traced as a symbolic int when it changes (and with
    dynamic=True from the start): the functions take it."""
    def f(q, k, v, left):
        return ft.flash_attn_func(q, k, v, window_size=(left, 0)).float().sum()

    for dynamic in (None, True):
        torch._dynamo.reset()
        g = torch.compile(f, fullgraph=True, backend="aot_eager", dynamic=dynamic)
        for left in (4, 8, 12):
            q, k, v = (meta(1, 16, 2, 64) for _ in range(3))
            g(q, k, v, left).backward()
            assert q.grad.shape == q.shape


def test_compile_with_one_tensor_in_two_places():
    """Self-attention on one tensor, one cu_seqlens for both sides: fullgraph=True traces them (torch.compile traces
    no autograd Function given one tensor twice; the functions pass the second as a view)."""
    def dense(x):
        return ft.flash_attn_func(x, x, x, causal=True).float().sum()

    def varlen(q, k, v, cu):
        return ft.flash_attn_varlen_func(q, k, v, cu, cu, 16, 16).float().sum()

    torch._dynamo.reset()
    x = meta(1, 16, 2, 64)
    torch.compile(dense, fullgraph=True, backend="aot_eager")(x).backward()
    assert x.grad.shape == x.shape
    q, k, v = (meta(30, 2, 64) for _ in range(3))
    cu = torch.zeros(3, dtype=torch.int32, device="meta")
    torch.compile(varlen, fullgraph=True, backend="aot_eager")(q, k, v, cu).backward()
    assert k.grad.shape == k.shape


def test_a_gradient_penalty_through_a_loss_linear_in_out_is_refused():
    """create_graph=True with a loss linear in out (dout then needs no grad): differentiating the gradients again
    raises, where they would otherwise come back as constants and the penalty's dependence on q, k, v be lost."""
    q, k, v = (meta(1, 16, 2, 64) for _ in range(3))
    out = ft.flash_attn_func(q, k, v, causal=True)
    dq, = torch.autograd.grad(out.float().sum(), q, create_graph=True)
    assert dq.requires_grad
    with pytest.raises(RuntimeError, match="first derivatives only"):
        (dq.float().square().sum() + out.float().sum()).backward()
    out = ft.flash_attn_func(q, k, v, causal=True)
    dq, = torch.autograd.grad(out.float().sum(), q)  # (without create_graph: plain gradients)
    assert not dq.requires_grad


def test_a_gradient_penalty_differentiated_by_autograd_grad_is_refused():
    """torch.autograd.grad(loss, inputs) with a penalty on the gradients raises too (it reaches q only through the
    gradients' dependence, which these kernels do not differentiate: the penalty's term was dropped silently while
    loss.backward() raised), for the dense and the packed functions."""
    q, k, v = (meta(1, 16, 2, 64) for _ in range(3))
    out = ft.flash_attn_func(q, k, v, causal=True)
    dq, = torch.autograd.grad(out.float().sum(), q, create_graph=True)
    with pytest.raises(RuntimeError, match="first derivatives only"):
        torch.autograd.grad(out.float().sum() + dq.float().square().sum(), q)
    with pytest.raises(RuntimeError, match="first derivatives only"):
        torch.autograd.grad(dq.float().sum(), k)
    qkv = meta(1, 16, 3, 2, 64)
    out = ft.flash_attn_qkvpacked_func(qkv)
    dqkv, = torch.autograd.grad(out.float().square().sum(), qkv, create_graph=True)
    with pytest.raises(RuntimeError, match="first derivatives only"):
        torch.autograd.grad(dqkv.float().square().sum(), qkv)


def test_compile_with_a_max_seqlen_that_changes_between_calls():
    """With dynamic shapes an int argument that changes (max_seqlen from batch to batch) is traced as a symbolic
    int: the varlen functions take it."""
    def f(qkv, cu, max_seqlen):
        return ft.flash_attn_varlen_qkvpacked_func(qkv, cu, max_seqlen).float().sum()

    torch._dynamo.reset()
    g = torch.compile(f, fullgraph=True, backend="aot_eager", dynamic=True)
    for total, max_seqlen in ((30, 16), (34, 20)):
        qkv, cu = meta(total, 3, 4, 64), torch.zeros(3, dtype=torch.int32, device="meta")
        g(qkv, cu, max_seqlen).backward()
        assert qkv.grad.shape == qkv.shape


def test_compile_two_calls_given_the_same_symbolic_numbers():
    """With dynamic shapes the floats a compiled function takes (dropout_p, softmax_scale, softcap) are symbolic, as
    are the ints (a window's bounds, max_seqlen); two calls given the same ones, each through its own autograd
    Function, trace (the second failed inside dynamo before), dense, packed and varlen, forward and backward."""
    def f(q, k, v, cu, p, scale, cap, left, max_seqlen):
        opts = dict(dropout_p=p, softmax_scale=scale, softcap=cap, window_size=(left, 0))
        outs = [ft.flash_attn_func(q, k, v, **opts), ft.flash_attn_func(q, k, v, **opts),
                ft.flash_attn_qkvpacked_func(torch.stack((q, k, v), 2), **opts),
                ft.flash_attn_kvpacked_func(q, torch.stack((k, v), 2), **opts)]
        q, k, v = (x.flatten(0, 1) for x in (q, k, v))
        outs += [ft.flash_attn_varlen_func(q, k, v, cu, cu, max_seqlen, max_seqlen, **opts),
                 ft.flash_attn_varlen_qkvpacked_func(torch.stack((q, k, v), 1), cu, max_seqlen, **opts),
                 ft.flash_attn_varlen_kvpacked_func(q, torch.stack((k, v), 1), cu, cu, max_seqlen, max_seqlen,
                                                    **opts)]
        return sum(o.float().sum() for o in outs)

    torch._dynamo.reset()
    g = torch.compile(f, fullgraph=True, backend="aot_eager", dynamic=True)
    for seqlen, numbers in ((16, (0.5, 0.125, 30.0, 3)), (20, (0.25, 0.1, 20.0, 5))):
        q, k, v = (meta(1, seqlen, 2, 64) for _ in range(3))
        cu = torch.zeros(2, dtype=torch.int32, device="meta")
        g(q, k, v, cu, *numbers, seqlen).backward()
        assert q.grad.shape == q.shape


def test_compile_two_checkpointed_calls_with_the_default_options():
    """Two layers under torch.utils.checkpoint, compiled with dynamic shapes, with flash-attn's defaults: a float
    default (dropout_p=0.0) was a symbolic float that the second layer's autograd Function failed on inside dynamo;
    the defaults are the int 0."""
    from torch.utils.checkpoint import checkpoint

    def f(q, k, v):
        return sum(checkpoint(ft.flash_attn_func, q, k, v, use_reentrant=False).float().sum() for _ in range(2))

    torch._dynamo.reset()
    q, k, v = (meta(1, 16, 2, 64) for _ in range(3))
    torch.compile(f, fullgraph=True, backend="eager", dynamic=True)(q, k, v).backward()  # (dynamo's part)
    assert q.grad.shape == q.shape


def test_a_nested_compile_region_traced_once_and_stamped_out_again():
    """A layer under torch.compiler.nested_compile_region, called twice, with dynamic shapes: the region's second
    call reuses the first one's trace, which must keep the symbolic sizes symbolic (the default softmax_scale,
    1/sqrt(head_dim), made head_dim a constant in the fake implementations' checks, and the second call failed
    inside dynamo with a KeyError); every public function, dense, packed and varlen, with the default scale."""
    region = getattr(torch.compiler, "nested_compile_region", None)
    if region is None:
        pytest.skip("torch.compiler.nested_compile_region needs a newer torch")

    @region
    def layer(q, k, v, cu, max_seqlen):
        outs = [ft.flash_attn_func(q, k, v), ft.flash_attn_func(q, k, v, causal=True, dropout_p=0.1),
                ft.flash_attn_qkvpacked_func(torch.stack((q, k, v), 2), softcap=5.0),
                ft.flash_attn_kvpacked_func(q, torch.stack((k, v), 2), window_size=(3, 0))]
        q, k, v = (x.flatten(0, 1) for x in (q, k, v))
        outs += [ft.flash_attn_varlen_func(q, k, v, cu, cu, max_seqlen, max_seqlen),
                 ft.flash_attn_varlen_qkvpacked_func(torch.stack((q, k, v), 1), cu, max_seqlen, causal=True),
                 ft.flash_attn_varlen_kvpacked_func(q, torch.stack((k, v), 1), cu, cu, max_seqlen, max_seqlen)]
        return sum(o.float().sum() for o in outs)

    torch._dynamo.reset()
    g = torch.compile(lambda *a: layer(*a) + layer(*a), fullgraph=True, backend="aot_eager", dynamic=True)
    for seqlen, d in ((16, 64), (20, 64), (20, 32)):
        q, k, v = (meta(1, seqlen, 2, d) for _ in range(3))
        g(q, k, v, torch.zeros(2, dtype=torch.int32, device="meta"), seqlen).backward()
        assert q.grad.shape == q.shape and k.grad.shape == k.shape


def test_a_checkpointed_call_without_dropout_is_no_random_operator():
    """Only a call with dropout runs an operator tagged as random: under activation checkpointing the partitioner
    refuses a tagged operator whose inputs need no gradient (a frozen model run with grad mode on), and wraps one
    whose inputs do in a save and restore of the generator's state (which failed on meta tensors: no generator)."""
    from torch.utils.checkpoint import checkpoint

    seeded = torch.Tag.nondeterministic_seeded
    for name in ("forward", "varlen_forward"):
        assert seeded not in getattr(torch.ops.flashnumba, name).default.tags
        assert seeded in getattr(torch.ops.flashnumba, name + "_dropout").default.tags

    def f(q, k, v, cu):
        dense = checkpoint(ft.flash_attn_func, q, k, v, causal=True, use_reentrant=False).float().sum()
        q, k, v = (x.flatten(0, 1) for x in (q, k, v))
        return dense + checkpoint(ft.flash_attn_varlen_func, q, k, v, cu, cu, 16, 16, use_reentrant=False).sum()

    for grad in (False, True):
        torch._dynamo.reset()
        q, k, v = (torch.empty(1, 16, 2, 64, dtype=torch.float16, device="meta", requires_grad=grad)
                   for _ in range(3))
        loss = torch.compile(f, fullgraph=True, backend="aot_eager")(q, k, v, torch.zeros(2, dtype=torch.int32,
                                                                                        device="meta"))
        if grad:
            loss.backward()
            assert q.grad.shape == q.shape


def test_two_dropout_calls_stay_two_operators_in_the_traced_graph():
    """The forward graph torch.compile hands its compiler with autograd holds both forward calls (the same inputs,
    two dropout draws) after the partitioner that inductor uses (its common-subexpression pass merged them once)."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    counts = []
    ops = torch.ops.flashnumba.forward_dropout.default, torch.ops.flashnumba.varlen_forward_dropout.default

    def count(gm, _):
        counts.append([sum(n.target is op for n in gm.graph.nodes) for op in ops])
        return gm

    def f(q, k, v, cu):
        dense = [ft.flash_attn_func(q, k, v, dropout_p=0.5) for _ in range(2)]
        q, k, v = (x.view(-1, 2, 64) for x in (q, k, v))
        return dense + [ft.flash_attn_varlen_func(q, k, v, cu, cu, 64, 64, dropout_p=0.5) for _ in range(2)]

    backend = aot_autograd(fw_compiler=count, partition_fn=min_cut_rematerialization_partition)
    torch._dynamo.reset()
    cu = torch.tensor([0, 64], dtype=torch.int32, device="meta")
    torch.compile(f, fullgraph=True, backend=backend)(*(meta(1, 64, 2, 64) for _ in range(3)), cu)
    assert counts == [[2, 2]]


BAD = [  # (description, q, k, v shapes and dtypes, options)
    ("head dims differ", ((1, 8, 2, 64), (1, 8, 2, 32), (1, 8, 2, 32)), "float16", {}),
    ("heads not a multiple", ((1, 8, 3, 64), (1, 8, 2, 64), (1, 8, 2, 64)), "float16", {}),
    ("rank", ((8, 2, 64), (8, 2, 64), (8, 2, 64)), "float16", {}),
    ("window", ((1, 8, 2, 64),) * 3, "float16", {"window_size": (-2, 0)}),
    ("softcap", ((1, 8, 2, 64),) * 3, "float16", {"softcap": -1.0}),
    ("dropout", ((1, 8, 2, 64),) * 3, "float16", {"dropout_p": 1.0}),
    ("dtype", ((1, 8, 2, 64),) * 3, "float64", {}),
    ("batch", ((2, 8, 2, 64), (1, 8, 2, 64), (1, 8, 2, 64)), "float32", {}),
    ("causal not a bool", ((1, 8, 2, 64),) * 3, "float16", {"causal": "yes"}),  # (was read as True)
    ("softcap None", ((1, 8, 2, 64),) * 3, "float16", {"softcap": None}),
    ("head dim 0", ((1, 8, 2, 0),) * 3, "float16", {}),  # (was a ZeroDivisionError)
    ("scale a string", ((1, 8, 2, 64),) * 3, "float16", {"softmax_scale": "0.1"}),
]


def _message(fn):
    try:
        fn()
    except (TypeError, ValueError) as err:
        return type(err), str(err)
    raise AssertionError("no error raised")


@pytest.mark.parametrize("what,shapes,dtype,opts", BAD, ids=[b[0] for b in BAD])
def test_bad_input_is_rejected_with_the_core_apis_message(what, shapes, dtype, opts):
    tensors = [meta(*s, dtype=getattr(torch, dtype)) for s in shapes]
    arrays = [np.zeros(s, dtype) for s in shapes]
    theirs = _message(lambda: flashnumba.flash_attn_func(*arrays, dropout_seed=1, **opts))
    ours = _message(lambda: ft.flash_attn_func(*tensors, **opts))
    assert ours == theirs


def test_foreign_arrays_cpu_tensors_and_paged_kv_are_refused():
    q = meta(1, 8, 2, 64)
    with pytest.raises(ValueError, match="q is a meta tensor"):
        flashnumba.flash_attn_forward(q, q, q)
    with pytest.raises(TypeError, match="q must be a torch.Tensor, got numpy.ndarray"):
        ft.flash_attn_func(np.zeros((1, 8, 2, 64), np.float16), q, q)
    cpu = torch.zeros(1, 8, 2, 64, dtype=torch.float16)
    with pytest.raises(TypeError, match="expected a CUDA tensor, got a torch tensor on cpu"):
        ft.flash_attn_func(cpu, cpu, cpu)
    cu = torch.zeros(2, dtype=torch.int32, device="meta")
    qv = meta(8, 2, 64)
    with pytest.raises(ValueError, match="block_table"):
        ft.flash_attn_varlen_func(qv, qv, qv, cu, cu, 8, 8, block_table=cu)
    with pytest.raises(ValueError, match="with dropout is not implemented for variable-length"):
        ft.flash_attn_varlen_func(qv, qv, qv, cu, cu, 8, 8, dropout_p=0.1, return_attn_probs=True)
    with pytest.raises(ValueError, match=r"qkv must have shape \(batch, seqlen, 3, nheads, d\)"):
        ft.flash_attn_qkvpacked_func(meta(1, 8, 2, 2, 64))
    with pytest.raises(TypeError, match="alibi_slopes: expected a CUDA tensor, got a torch tensor on cpu"):
        ft.flash_attn_func(q, q, q, alibi_slopes=torch.zeros(2))
    with pytest.raises(TypeError, match="k must be a torch.Tensor, got builtins.NoneType"):
        ft.flash_attn_func(q, None, q)
    with pytest.raises(TypeError, match="return_attn_probs must be a bool"):
        ft.flash_attn_func(q, q, q, return_attn_probs="no")
    with pytest.raises(TypeError, match="deterministic must be a bool"):
        ft.flash_attn_qkvpacked_func(meta(1, 8, 3, 2, 64), deterministic=None)
    with pytest.raises(TypeError, match="max_seqlen_k must be an int"):
        ft.flash_attn_varlen_func(qv, qv, qv, cu, cu, 8, 8.0)
    with pytest.raises(TypeError, match="max_seqlen must be an int"):
        ft.flash_attn_varlen_qkvpacked_func(meta(8, 3, 2, 64), cu, torch.tensor(8))
    with pytest.raises(TypeError, match="q must be a torch.Tensor, got numpy.ndarray"):
        ft.flash_attn_with_kvcache(np.zeros((1, 1, 2, 64), np.float16), cpu, cpu)
    with pytest.raises(TypeError, match="q: expected a CUDA tensor, got a torch tensor on meta"):
        ft.flash_attn_with_kvcache(q, cpu, cpu)


# ---------------------------------------------------------------------------------------------------------------
# on a GPU: the numbers
# ---------------------------------------------------------------------------------------------------------------


def plain_attention(q, k, v, *, scale, causal=False, window=(-1, -1), softcap=0.0, alibi=None, keep=None,
                    dropout_p=0.0):
    """Attention written plainly in torch (flash-attn's layout and conventions), differentiable by autograd;
    computes in the inputs' dtype."""
    b, sq, h, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    k, v = k.repeat_interleave(h // hk, dim=2), v.repeat_interleave(h // hk, dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    i = torch.arange(sq, device=q.device)[:, None]
    j = torch.arange(sk, device=q.device)[None, :]
    diag = sk - sq
    if alibi is not None:
        slopes = alibi.to(q.dtype).reshape(-1 if alibi.dim() == 1 else b, h)[..., None, None]
        s = s - slopes * (i + diag - j).abs().to(q.dtype)
    left, right = window
    right = 0 if causal else right
    visible = torch.ones(sq, sk, dtype=torch.bool, device=q.device)
    if left >= 0:
        visible &= j >= i + diag - left
    if right >= 0:
        visible &= j <= i + diag + right
    s = s.masked_fill(~visible, -math.inf)
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)  # a row that sees no key: P = 0, out = 0
    if keep is not None:
        p = p * keep.to(q.dtype) / (1 - dropout_p)
    return torch.einsum("bhqk,bkhd->bqhd", p, v)


def close(name, got, truth, baseline, reduction):
    """conftest's derived tolerance, for torch tensors."""
    got, truth, baseline = (to_numpy(x.detach()) for x in (got, truth, baseline))
    assert_close_to_truth(name, got, truth, baseline, reduction=reduction)


def kernel_seed(gen):
    """The (seed, offset) flashnumba's kernels get from a torch CUDA generator's current state."""
    seed, offset = gen.initial_seed() % 2**64, gen.get_offset()
    return seed ^ ((offset >> 32) << 32), offset & (2**32 - 1)


@st.composite
def problems(draw):
    dtype = draw(st.sampled_from(list(DTYPES)))
    d = draw(st.sampled_from([32, 64, 128]))
    nheads_k = draw(st.sampled_from([1, 2]))
    nheads = nheads_k * draw(st.sampled_from([1, 2]))
    sq = draw(st.one_of(st.sampled_from([1, 17, 64, 65]), st.integers(1, 200)))
    sk = draw(st.one_of(st.just(sq), st.integers(1, 200)))
    opts = dict(causal=draw(st.booleans()))
    if draw(st.booleans()):
        opts["window_size"] = (draw(st.integers(-1, 40)), draw(st.integers(-1, 40)))
    if draw(st.booleans()):
        opts["softcap"] = draw(st.sampled_from([2.0, 10.0]))
    alibi = draw(st.sampled_from([None, "heads", "batch"]))
    dropout = draw(st.sampled_from([0.0, 0.0, 0.17]))
    return dtype, draw(st.integers(1, 2)), sq, sk, nheads, nheads_k, d, opts, alibi, dropout


@on_gpu
@pytest.mark.parametrize("part", range(SHARDS))
@shard(SHARDS)
@given(problem=problems(), seed=st.integers(0, 2**16))
def test_gradients_match_float64_autograd(part, problem, seed):
    dtype, batch, sq, sk, nheads, nheads_k, d, opts, alibi_kind, dropout_p = problem
    tdt = DTYPES[dtype]
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(batch, sq, nheads, d, generator=g, device="cuda").to(tdt).requires_grad_()
    k = torch.randn(batch, sk, nheads_k, d, generator=g, device="cuda").to(tdt).requires_grad_()
    v = torch.randn(batch, sk, nheads_k, d, generator=g, device="cuda").to(tdt).requires_grad_()
    dout = torch.randn(batch, sq, nheads, d, generator=g, device="cuda").to(tdt)
    alibi = None
    if alibi_kind is not None:
        shape = (nheads,) if alibi_kind == "heads" else (batch, nheads)
        alibi = torch.rand(shape, generator=g, device="cuda", dtype=torch.float32)
    gen = torch.cuda.default_generators[q.device.index]
    before = gen.get_offset()
    keep = None
    if dropout_p:
        keep = torch.from_numpy(philox.keep_mask(*kernel_seed(gen), batch, nheads, sq, sk, dropout_p)).cuda()
    q0, k0, v0 = (x.detach().clone() for x in (q, k, v))

    out = ft.flash_attn_func(q, k, v, dropout_p=dropout_p, alibi_slopes=alibi, **opts)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    assert gen.get_offset() == before + (32 * batch * nheads if dropout_p else 0)
    for x, x0 in zip((q, k, v), (q0, k0, v0)):
        assert torch.equal(x.detach(), x0), "an input was modified"

    scale = d ** -0.5
    kw = dict(scale=scale, causal=opts.get("causal", False), window=opts.get("window_size", (-1, -1)),
              softcap=opts.get("softcap", 0.0), alibi=alibi, keep=keep, dropout_p=dropout_p)
    results = {}
    for name, prec in (("truth", torch.float64), ("baseline", tdt)):
        xs = [x.detach().to(prec).requires_grad_() for x in (q, k, v)]
        o = plain_attention(*xs, **kw)
        results[name] = (o, *torch.autograd.grad(o, xs, dout.to(prec)))
    n = max(d, sq, sk)
    for i, (name, got) in enumerate(zip(("out", "dq", "dk", "dv"), (out, dq, dk, dv))):
        assert got.dtype == tdt and got.shape == results["truth"][i].shape
        close(name, got, results["truth"][i], results["baseline"][i], n)


@on_gpu
def test_a_second_derivative_is_refused_not_silently_wrong():
    """The backward kernels compute first derivatives: differentiating their result (create_graph=True, a
    gradient penalty) raises, where the gradients would otherwise come back without their dependence on q, k, v."""
    q, k, v = (torch.randn(1, 16, 2, 32, device="cuda", dtype=torch.float16, requires_grad=True) for _ in range(3))
    out = ft.flash_attn_func(q, k, v, causal=True)
    dq, = torch.autograd.grad(out.float().square().sum(), q, create_graph=True)
    with pytest.raises(RuntimeError, match="first derivatives only"):
        dq.float().square().sum().backward()


@on_gpu
def test_a_padded_head_dim_through_autograd():
    """Head_dim 80 at 4096 keys: on compute capability 9.0 kernel=None runs the Hopper kernels on copies padded to
    96 (elsewhere mma.sync at 80); a k whose sequence axis has the smallest stride (copied to a contiguous last
    dimension first, as flash-attn does); the gradients against float64 autograd, the inputs untouched, the outputs
    C-contiguous."""
    g = torch.Generator(device="cuda").manual_seed(80)
    q, v = (torch.randn(1, 4096, 2, 80, generator=g, device="cuda", dtype=torch.float16).requires_grad_()
            for _ in range(2))
    k = torch.randn(1, 2, 80, 4096, generator=g, device="cuda", dtype=torch.float16).permute(0, 3, 1, 2)
    k = k.detach().requires_grad_()
    dout = torch.randn(1, 4096, 2, 80, generator=g, device="cuda", dtype=torch.float16)
    if torch.cuda.get_device_capability() == (9, 0):
        assert "run as 96" in flashnumba.plan(q.detach(), k.detach().contiguous(), v.detach(),
                                              causal=True).launches[0].reason
    before = [x.detach().clone() for x in (q, k, v)]
    out = ft.flash_attn_func(q, k, v, causal=True)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    assert out.is_contiguous() and all(torch.equal(x.detach(), y) for x, y in zip((q, k, v), before))
    results = {}
    for name, prec in (("truth", torch.float64), ("baseline", torch.float16)):
        xs = [x.detach().to(prec).requires_grad_() for x in (q, k, v)]
        o = plain_attention(*xs, scale=80 ** -0.5, causal=True, window=(-1, -1), softcap=0.0, alibi=None,
                            keep=None, dropout_p=0.0)
        results[name] = (o, *torch.autograd.grad(o, xs, dout.to(prec)))
    for i, (name, got) in enumerate(zip(("out", "dq", "dk", "dv"), (out, dq, dk, dv))):
        close(name, got, results["truth"][i], results["baseline"][i], 4096)


def _unpacked_reference(fn, *args, **kw):
    """(out, grads) of ``fn`` with leaf tensors, for comparing packed against unpacked calls."""
    leaves = [a.detach().clone().requires_grad_() if isinstance(a, torch.Tensor) and a.is_floating_point() else a
              for a in args]
    out = fn(*leaves, **kw)
    return out, leaves


@on_gpu
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_packed_variants_equal_unpacked_bitwise(dtype, d):
    """A packed qkv (or kv) gives the bits of the same values unpacked, forward and backward: the default kernel
    does not depend on the layout (on compute capability 9.0 the Hopper kernels copy the strided views)."""
    tdt = DTYPES[dtype]
    torch.manual_seed(3)
    b, s, h, hk = 2, 77, 4, 2
    qkv = torch.randn(b, s, 3, h, d, device="cuda").to(tdt).requires_grad_()
    dout = torch.randn(b, s, h, d, device="cuda").to(tdt)
    out = ft.flash_attn_qkvpacked_func(qkv, causal=True, softcap=8.0)
    (dqkv,) = torch.autograd.grad(out, qkv, dout)
    q, k, v = (qkv.detach()[:, :, i].contiguous().requires_grad_() for i in range(3))
    ref = ft.flash_attn_func(q, k, v, causal=True, softcap=8.0)
    grads = torch.autograd.grad(ref, (q, k, v), dout)
    assert torch.equal(out, ref) and torch.equal(dqkv, torch.stack(grads, dim=2))

    q = torch.randn(b, s, h, d, device="cuda").to(tdt).requires_grad_()
    kv = torch.randn(b, s + 5, 2, hk, d, device="cuda").to(tdt).requires_grad_()
    out = ft.flash_attn_kvpacked_func(q, kv, window_size=(9, 3))
    dq, dkv = torch.autograd.grad(out, (q, kv), dout)
    k, v = (kv.detach()[:, :, i].contiguous().requires_grad_() for i in range(2))
    q2 = q.detach().clone().requires_grad_()
    ref = ft.flash_attn_func(q2, k, v, window_size=(9, 3))
    grads = torch.autograd.grad(ref, (q2, k, v), dout)
    assert torch.equal(out, ref) and torch.equal(dq, grads[0]) and torch.equal(dkv, torch.stack(grads[1:], dim=2))


@on_gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_varlen_gradients_per_sequence(dtype):
    """Each packed sequence's out and gradients against float64 autograd of that sequence alone; the packed
    variants of varlen equal the unpacked one bitwise."""
    tdt = DTYPES[dtype]
    torch.manual_seed(5)
    lens_q, lens_k = [5, 0, 130, 64], [9, 3, 130, 1]
    h, hk, d = 4, 2, 64
    cu_q = torch.tensor(np.concatenate([[0], np.cumsum(lens_q)]), dtype=torch.int32, device="cuda")
    cu_k = torch.tensor(np.concatenate([[0], np.cumsum(lens_k)]), dtype=torch.int32, device="cuda")
    q = torch.randn(sum(lens_q), h, d, device="cuda").to(tdt).requires_grad_()
    k = torch.randn(sum(lens_k), hk, d, device="cuda").to(tdt).requires_grad_()
    v = torch.randn(sum(lens_k), hk, d, device="cuda").to(tdt).requires_grad_()
    dout = torch.randn(sum(lens_q), h, d, device="cuda").to(tdt)
    opts = dict(causal=True, window_size=(40, -1))
    out = ft.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), **opts)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    for bi in range(len(lens_q)):
        rq = slice(int(cu_q[bi]), int(cu_q[bi + 1]))
        rk = slice(int(cu_k[bi]), int(cu_k[bi + 1]))
        if lens_q[bi] == 0:
            continue
        results = {}
        for name, prec in (("truth", torch.float64), ("baseline", tdt)):
            xs = [x.detach()[r].to(prec)[None].requires_grad_() for x, r in ((q, rq), (k, rk), (v, rk))]
            o = plain_attention(*xs, scale=d ** -0.5, causal=True, window=(40, -1))
            g = torch.autograd.grad(o, xs, dout[rq].to(prec)[None])
            results[name] = [o[0], *(x[0] for x in g)]
        for i, (name, got) in enumerate(zip(("out", "dq", "dk", "dv"), (out[rq], dq[rq], dk[rk], dv[rk]))):
            close(f"{name} of sequence {bi}", got, results["truth"][i], results["baseline"][i],
                  max(d, lens_q[bi], lens_k[bi]))

    if lens_q == lens_k:
        return
    kv = torch.stack((k.detach(), v.detach()), dim=1).requires_grad_()
    q2 = q.detach().clone().requires_grad_()
    out2 = ft.flash_attn_varlen_kvpacked_func(q2, kv, cu_q, cu_k, max(lens_q), max(lens_k), **opts)
    dq2, dkv = torch.autograd.grad(out2, (q2, kv), dout)
    assert torch.equal(out2, out) and torch.equal(dq2, dq) and torch.equal(dkv, torch.stack((dk, dv), dim=1))

    qkv = torch.randn(sum(lens_q), 3, h, d, device="cuda").to(tdt).requires_grad_()
    out3 = ft.flash_attn_varlen_qkvpacked_func(qkv, cu_q, max(lens_q), causal=True)
    (dqkv,) = torch.autograd.grad(out3, qkv, dout)
    parts = [qkv.detach()[:, i].contiguous().requires_grad_() for i in range(3)]
    ref = ft.flash_attn_varlen_func(*parts, cu_q, cu_q, max(lens_q), max(lens_q), causal=True)
    grads = torch.autograd.grad(ref, parts, dout)
    assert torch.equal(out3, ref) and torch.equal(dqkv, torch.stack(grads, dim=1))


@on_gpu
def test_dropout_is_reproducible_under_manual_seed_and_advances_the_generator():
    q = torch.randn(2, 100, 4, 64, device="cuda", dtype=torch.float16).requires_grad_()
    dout = torch.randn_like(q)

    def run(seed):
        torch.manual_seed(seed)
        out = ft.flash_attn_func(q, q, q, dropout_p=0.3)
        (dq,) = torch.autograd.grad(out, q, dout)
        return out, dq, torch.rand(4, device="cuda")

    a, b, c = run(0), run(0), run(1)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert not torch.equal(a[0], c[0])
    torch.manual_seed(0)  # the draw after the call is the one after flash-attn's advance (batch * nheads * 32)
    gen = torch.cuda.default_generators[0]
    gen.set_offset(gen.get_offset() + 2 * 4 * 32)
    assert torch.equal(torch.rand(4, device="cuda"), a[2])
    # the core API's flash_attn_func draws from the same generator and says what it drew
    torch.manual_seed(0)
    expected = kernel_seed(gen)
    out = flashnumba.flash_attn_func(q.detach(), q.detach(), q.detach(), dropout_p=0.3)
    assert flashnumba.last_dropout_seed() == expected and torch.equal(out, a[0])


@on_gpu
def test_return_attn_probs_on_the_gpu():
    """Eagerly on CUDA tensors (the operators' bodies called directly): without dropout out and lse as the core API
    gives them and an empty third value; with dropout the probabilities of the forward's own mask; too many of them
    refused before anything runs (torch's generator where it was); varlen (out, lse (nheads, total_q), empty)."""
    q, k, v = (torch.randn(2, 40, 4, 64, device="cuda", dtype=torch.float16, requires_grad=True) for _ in range(3))
    plain = [x.detach() for x in (q, k, v)]
    out, lse, probs = ft.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    want_out, want_lse = flashnumba.flash_attn_forward(*plain, causal=True)
    assert probs.shape == (0,) and probs.dtype == q.dtype and torch.equal(out, want_out) and torch.equal(lse, want_lse)
    gen = torch.cuda.default_generators[q.device.index]
    torch.manual_seed(3)
    seed, offset = kernel_seed(gen)
    out, lse, probs = ft.flash_attn_func(q, k, v, dropout_p=0.2, causal=True, return_attn_probs=True)
    want = flashnumba.attention_probs(*plain, lse, causal=True, dropout_p=0.2, dropout_seed=seed, dropout_offset=offset)
    assert probs.shape == (2, 4, 40, 40) and torch.equal(probs, want)
    out.float().sum().backward()
    big = torch.zeros(1, 4096, 16, 64, device="cuda", dtype=torch.float16)
    before = gen.get_offset()
    with pytest.raises(ValueError, match="more than the 67108864 allowed"):
        ft.flash_attn_func(big, big, big, dropout_p=0.1, return_attn_probs=True)
    assert gen.get_offset() == before
    cu = torch.tensor([0, 30, 80], dtype=torch.int32, device="cuda")
    qv = torch.randn(80, 4, 64, device="cuda", dtype=torch.float16, requires_grad=True)
    out, lse, probs = ft.flash_attn_varlen_func(qv, qv, qv, cu, cu, 50, 50, causal=True, return_attn_probs=True)
    want_out, want_lse = flashnumba.flash_attn_varlen_forward(qv.detach(), qv.detach(), qv.detach(), cu, cu, 50, 50,
                                                              causal=True)
    assert torch.equal(out, want_out) and torch.equal(lse, want_lse) and lse.shape == (4, 80)
    assert probs.shape == (0,)
    out.float().sum().backward()
    assert qv.grad.shape == qv.shape


@on_gpu
@pytest.mark.parametrize("grad", [False, True])
def test_two_dropout_calls_in_one_compiled_graph_draw_two_masks(grad):
    """Two calls with the same inputs in one compiled graph are two draws, with or without autograd, and differ as
    two eager calls differ."""
    q, k, v = (torch.randn(1, 64, 2, 64, device="cuda", dtype=torch.float16).requires_grad_(grad) for _ in range(3))

    def f(q, k, v):
        return ft.flash_attn_func(q, k, v, dropout_p=0.5), ft.flash_attn_func(q, k, v, dropout_p=0.5)

    torch._dynamo.reset()
    for fn in (f, torch.compile(f, fullgraph=True)):
        a, b = fn(q, k, v)
        assert not torch.equal(a, b)


@on_gpu
@pytest.mark.parametrize("compiled", [False, True])
def test_activation_checkpointing_recomputes_the_same_dropout_mask(compiled):
    """Under torch.utils.checkpoint the forward runs again in the backward and must draw the forward's mask. The
    check: out = P~ V is linear in v, so with the loss sum(w * out) the gradient dv = P~^T w gives sum(dv * v) =
    loss when the backward's mask P~ is the forward's (up to rounding: the gap of the same call without
    checkpointing is the yardstick), and misses it by far more than rounding where the masks differ. Eager,
    checkpoint restores the generator's state, so out and the gradients are also those of the call without
    checkpointing from the same seed, bit for bit. Compiled, the partitioner runs the operator (tagged
    nondeterministic_seeded) with a generator state it keeps. Each call draws a new mask."""
    from torch.utils.checkpoint import checkpoint

    def attention(q, k, v):
        return ft.flash_attn_func(q, k, v, dropout_p=0.3, causal=True)

    def checkpointed(q, k, v):
        return checkpoint(attention, q, k, v, use_reentrant=False)

    torch._dynamo.reset()
    fn = torch.compile(checkpointed, fullgraph=True) if compiled else checkpointed
    q, k, v, w = (torch.randn(2, 96, 4, 64, device="cuda") for _ in range(4))
    results, gaps = [], []
    for f in (attention, fn):
        x = [t.clone().requires_grad_() for t in (q, k, v)]
        torch.manual_seed(11)
        out = f(*x)
        loss = (w * out).double().sum()
        loss.backward()
        results.append([out.detach()] + [t.grad for t in x])
        gaps.append(float(abs(loss - (x[2].grad.double() * v.double()).sum())))
    spread = float((w * results[0][0]).double().abs().sum())
    assert gaps[1] <= 4 * gaps[0] + 1e-7 * spread, (gaps, spread)
    if not compiled:
        for name, a, b in zip(("out", "dq", "dk", "dv"), *results):
            assert torch.equal(a, b), name
    assert not torch.equal(fn(q, k, v), fn(q, k, v))


@on_gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_core_api_takes_and_returns_torch_tensors(dtype):
    tdt = DTYPES[dtype]
    q = torch.randn(1, 33, 2, 64, device="cuda").to(tdt).requires_grad_()
    out, lse = flashnumba.flash_attn_forward(q, q, q, causal=True)
    assert isinstance(out, torch.Tensor) and out.dtype == tdt and out.device == q.device
    assert isinstance(lse, torch.Tensor) and lse.dtype == torch.float32 and not out.requires_grad
    dq, dk, dv = flashnumba.flash_attn_backward(torch.ones_like(out), q, q, q, out, lse, causal=True)
    assert all(isinstance(g, torch.Tensor) and g.dtype == tdt for g in (dq, dk, dv))


def _slow_write(stream, dst, src):
    """On ``stream``: spin for a while, then copy src into dst (a producer the consumer must wait for)."""
    with torch.cuda.stream(stream):
        torch.cuda._sleep(200_000_000)
        dst.copy_(src)


@on_gpu
def test_kernels_run_on_the_callers_stream():
    torch.manual_seed(7)
    src = torch.randn(1, 256, 4, 64, device="cuda", dtype=torch.float16)
    want = ft.flash_attn_func(src, src, src)
    side = torch.cuda.Stream()
    q = torch.zeros_like(src)
    torch.cuda.synchronize()
    _slow_write(side, q, src)
    with torch.cuda.stream(side):  # torch's current stream
        got = ft.flash_attn_func(q, q, q)
    side.synchronize()
    assert torch.equal(got, want)

    q2 = torch.zeros_like(src)
    torch.cuda.synchronize()
    _slow_write(side, q2, src)
    got, _ = flashnumba.flash_attn_forward(q2, q2, q2, stream=side)  # an explicit stream
    side.synchronize()
    assert torch.equal(got, want)


@on_gpu
def test_cupy_arrays_run_on_cupys_current_stream():
    cupy = pytest.importorskip("cupy")
    spin = cupy.RawKernel(r'''
    extern "C" __global__ void spin(long long cycles) {
        long long start = clock64();
        while (clock64() - start < cycles) { }
    }''', "spin")
    rng = np.random.default_rng(0)
    src = cupy.asarray(rng.standard_normal((1, 256, 4, 64)).astype(np.float16))
    want, _ = flashnumba.flash_attn_forward(src, src, src)
    s = cupy.cuda.Stream(non_blocking=True)
    q = cupy.zeros_like(src)
    cupy.cuda.Device().synchronize()
    with s:
        spin((1,), (1,), (np.int64(200_000_000),))
        q[...] = src
        got, _ = flashnumba.flash_attn_forward(q, q, q)
    s.synchronize()
    assert bool((got == want).all())


@on_gpu
def test_cuda_graph_replays_forward_and_backward_bitwise():
    torch.manual_seed(11)
    shape = (2, 128, 4, 64)
    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16).requires_grad_() for _ in range(3))
    dout = torch.randn(shape, device="cuda", dtype=torch.bfloat16)

    def step():
        out = ft.flash_attn_func(q, k, v, causal=True, softcap=20.0)
        out.backward(dout)
        return out

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up (plans, kernels) off the capture
        for _ in range(2):
            for x in (q, k, v):
                x.grad = None
            step()
    torch.cuda.current_stream().wait_stream(side)
    for x in (q, k, v):
        x.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = step()
    fresh = [torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
    with torch.no_grad():
        for x, f in zip((q, k, v), fresh):
            x.copy_(f)
    graph.replay()
    torch.cuda.synchronize()
    replayed = [static_out.clone()] + [x.grad.clone() for x in (q, k, v)]
    leaves = [f.clone().requires_grad_() for f in fresh]
    eager = ft.flash_attn_func(*leaves, causal=True, softcap=20.0)
    grads = torch.autograd.grad(eager, leaves, dout)
    for name, a, b in zip(("out", "dq", "dk", "dv"), replayed, [eager, *grads]):
        assert torch.equal(a, b), name


class Block(torch.nn.Module):
    """A pre-norm transformer block whose attention is flashnumba's (or, with ``plain``, :func:`plain_attention`,
    which also runs in float64)."""

    def __init__(self, width=256, heads=4):
        super().__init__()
        self.heads, self.plain = heads, False
        self.norm1, self.norm2 = torch.nn.LayerNorm(width), torch.nn.LayerNorm(width)
        self.qkv, self.proj = torch.nn.Linear(width, 3 * width), torch.nn.Linear(width, width)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(width, 4 * width), torch.nn.GELU(),
                                       torch.nn.Linear(4 * width, width))

    def forward(self, x):
        b, t, c = x.shape
        qkv = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, c // self.heads)
        if self.plain:
            a = plain_attention(*qkv.unbind(2), scale=(c // self.heads) ** -0.5, causal=True)
        else:
            a = ft.flash_attn_qkvpacked_func(qkv, causal=True)
        x = x + self.proj(a.reshape(b, t, c))
        return x + self.mlp(self.norm2(x))


@on_gpu
def test_compiled_transformer_block_matches_eager():
    """torch.compile(fullgraph=True) with inductor: the compiled block's output and parameter gradients against a
    float64 eager block (plain attention), with the float32 eager block's error as the baseline."""
    torch.manual_seed(0)
    block = Block().cuda()
    x = torch.randn(2, 200, 256, device="cuda")
    torch._dynamo.reset()
    compiled = torch.compile(block, fullgraph=True)

    def run(module, dtype):
        module.zero_grad()
        out = module(x.to(dtype))
        out.square().mean().backward()
        return [out.detach().clone()] + [p.grad.detach().clone() for p in block.parameters()]

    got = run(compiled, torch.float32)
    base = run(block, torch.float32)
    block.double().plain = True
    truth = run(block, torch.float64)
    names = ["out"] + [n for n, _ in block.named_parameters()]
    for name, g, b, t in zip(names, got, base, truth):
        close(name, g, t, b, 256)


@on_gpu
def test_reduce_overhead_mode_replays_a_cuda_graph():
    """torch.compile(mode="reduce-overhead"): a block without dropout is captured in a CUDA graph (nothing in it on
    the CPU) and its replays give the eager block's output, forward and backward."""
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    block = Block().cuda()
    x = torch.randn(2, 200, 256, device="cuda")
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(block, mode="reduce-overhead", fullgraph=True)
    for _ in range(3):  # (recorded on a later call than the first, then replayed)
        block.zero_grad()
        out = compiled(x)
        out.square().mean().backward()
        got = [out.detach().clone()] + [p.grad.detach().clone() for p in block.parameters()]
    assert not counters["inductor"]["cudagraph_skips"], dict(counters["inductor"])
    block.zero_grad()
    base = block(x)
    base.square().mean().backward()
    base = [base.detach()] + [p.grad.detach().clone() for p in block.parameters()]
    block.double().plain = True
    block.zero_grad()
    truth = block(x.double())
    truth.square().mean().backward()
    truth = [truth.detach()] + [p.grad.detach() for p in block.parameters()]
    for name, g, b, t in zip(["out"] + [n for n, _ in block.named_parameters()], got, base, truth):
        close(name, g, t, b, 256)


@on_gpu
def test_flash_attn_with_kvcache_on_tensors_appends_in_place():
    """flash_attn_with_kvcache on torch tensors: the cache tensors updated in place, the result as the reference's,
    on torch's current stream (a side stream here)."""
    pytest.importorskip("cupy")
    from flashnumba import reference as ref

    rng = np.random.default_rng(4)
    b, h, hk, d, page, per = 2, 8, 2, 64, 64, 3
    q = rng.standard_normal((b, 1, h, d)).astype(np.float16)
    kn, vn = (rng.standard_normal((b, 1, hk, d)).astype(np.float16) for _ in range(2))
    kc, vc = (rng.standard_normal((b * per, page, hk, d)).astype(np.float16) for _ in range(2))
    table = rng.permutation(b * per).reshape(b, per).astype(np.int32)
    lens = np.array([100, 7], np.int32)
    truth_o, truth_l, truth_kc, truth_vc = ref.kvcache_attention(q, kc, vc, kn, vn, cache_seqlens=lens,
                                                                 block_table=table, causal=True)
    base_o, base_l, _, _ = ref.kvcache_attention(q, kc, vc, kn, vn, cache_seqlens=lens, block_table=table,
                                                 causal=True, dtype=np.float16)
    t = {n: torch.as_tensor(x, device="cuda") for n, x in dict(q=q, k=kn, v=vn, kc=kc, vc=vc, table=table,
                                                                 lens=lens).items()}
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        out, lse = ft.flash_attn_with_kvcache(t["q"], t["kc"], t["vc"], t["k"], t["v"], cache_seqlens=t["lens"],
                                             block_table=t["table"], causal=True, return_softmax_lse=True)
    side.synchronize()
    assert isinstance(out, torch.Tensor) and out.shape == q.shape and lse.shape == (b, h, 1)
    assert_close_to_truth("out", out.cpu().numpy(), truth_o, base_o.astype(np.float16), reduction=page * per)
    assert_close_to_truth("lse", lse.cpu().numpy(), truth_l, base_l.astype(np.float32), reduction=page * per)
    np.testing.assert_array_equal(t["kc"].cpu().numpy(), truth_kc)
    np.testing.assert_array_equal(t["vc"].cpu().numpy(), truth_vc)
    with pytest.raises(ValueError, match="cache_leftpad cannot be combined with block_table"):
        ft.flash_attn_with_kvcache(t["q"], t["kc"], t["vc"], cache_seqlens=t["lens"], block_table=t["table"],
                                   cache_leftpad=torch.zeros_like(t["lens"]))


@on_gpu
def test_flash_attn_with_kvcache_left_padding_on_tensors():
    """cache_leftpad (flash-attn's tenth argument) on a contiguous cache of torch tensors: the padding (NaN
    here) never attended to, the result as the reference's."""
    from flashnumba import reference as ref

    rng = np.random.default_rng(6)
    b, h, hk, d, cap = 3, 4, 2, 64, 200
    q = rng.standard_normal((b, 1, h, d)).astype(np.float16)
    kn, vn = (rng.standard_normal((b, 1, hk, d)).astype(np.float16) for _ in range(2))
    kc, vc = (rng.standard_normal((b, cap, hk, d)).astype(np.float16) for _ in range(2))
    lens, pad = np.array([150, 9, 64], np.int32), np.array([100, 0, 64], np.int32)
    for i, p in enumerate(pad):
        kc[i, :p] = vc[i, :p] = np.nan
    kw = dict(cache_seqlens=lens, cache_leftpad=pad, causal=True)
    truth_o, _, truth_kc, truth_vc = ref.kvcache_attention(q, kc, vc, kn, vn, **kw)
    base_o, _, _, _ = ref.kvcache_attention(q, kc, vc, kn, vn, dtype=np.float16, **kw)
    t = {n: torch.as_tensor(x, device="cuda") for n, x in dict(q=q, k=kn, v=vn, kc=kc, vc=vc, lens=lens,
                                                                 pad=pad).items()}
    out = ft.flash_attn_with_kvcache(t["q"], t["kc"], t["vc"], t["k"], t["v"], None, None, t["lens"], None,
                                     t["pad"], causal=True)
    assert_close_to_truth("out", out.cpu().numpy(), truth_o, base_o.astype(np.float16), reduction=cap)
    np.testing.assert_array_equal(t["vc"].cpu().numpy(), truth_vc)


@on_gpu
def test_flash_attn_with_kvcache_bfloat16_steps_replayed_from_a_cuda_graph():
    """A decoding step on bfloat16 tensors (new keys appended, rotary, GQA, a paged cache) makes no host round trip:
    it is captured once in a CUDA graph, and each replay, with new tokens and lengths copied into the captured
    tensors, gives what the reference gives for that step (out, lse, the cache)."""
    pytest.importorskip("ml_dtypes")
    from flashnumba import reference as ref

    gen = torch.Generator(device="cuda").manual_seed(7)
    b, h, hk, d, page, per, rd = 3, 8, 2, 128, 32, 4, 64

    def rand(*shape):
        return torch.randn(*shape, device="cuda", generator=gen).to(torch.bfloat16)

    q, kn, vn = rand(b, 1, h, d), rand(b, 1, hk, d), rand(b, 1, hk, d)
    kc, vc = rand(b * per, page, hk, d), rand(b * per, page, hk, d)
    table = torch.randperm(b * per, device="cuda", generator=gen).reshape(b, per).to(torch.int32)
    theta = torch.outer(torch.arange(page * per + 1.0), 1.0 / 10000 ** (torch.arange(rd // 2) / (rd // 2)))
    cos, sin = theta.cos().cuda(), theta.sin().cuda()
    lens = torch.tensor([5, 0, 100], dtype=torch.int32, device="cuda")

    def step():
        return ft.flash_attn_with_kvcache(q, kc, vc, kn, vn, rotary_cos=cos, rotary_sin=sin, cache_seqlens=lens,
                                          block_table=table, causal=True, rotary_interleaved=False,
                                          return_softmax_lse=True)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # (compiled and planned before the capture)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = step()
    for new_lens in ([6, 1, 101], [60, 127, 0]):
        for x in (q, kn, vn):
            x.copy_(rand(*x.shape))
        lens.copy_(torch.tensor(new_lens, dtype=torch.int32))
        args = [to_numpy(x) for x in (q, kc, vc, kn, vn)]
        kw = dict(rotary_cos=to_numpy(cos), rotary_sin=to_numpy(sin), cache_seqlens=np.array(new_lens, np.int32),
                  block_table=to_numpy(table), causal=True, rotary_interleaved=False)
        truth_o, truth_l, truth_kc, truth_vc = ref.kvcache_attention(*args, **kw)
        base_o, base_l, _, _ = ref.kvcache_attention(*args, dtype=args[0].dtype, **kw)
        graph.replay()
        torch.cuda.synchronize()
        assert_close_to_truth("out", to_numpy(out), truth_o, base_o.astype(args[0].dtype), reduction=page * per)
        assert_close_to_truth("lse", to_numpy(lse), truth_l, base_l.astype(np.float32), reduction=page * per)
        np.testing.assert_array_equal(to_numpy(vc), truth_vc)
        ulp = 2.0 ** -7  # (keys rotated in float32, the reference in float64: a unit in the last place apart)
        np.testing.assert_allclose(to_numpy(kc).astype(np.float64), truth_kc.astype(np.float64), rtol=2 * ulp,
                                   atol=2 * ulp)


@on_gpu
def test_flash_attn_with_kvcache_float32_tensors_take_the_gather_path():
    """float32 tensors decode on the gather path (CuPy views of the tensors, the varlen forward): new keys appended
    in place, ALiBi slopes given as a tensor, the result as the reference's and returned as tensors."""
    pytest.importorskip("cupy")
    from flashnumba import reference as ref

    rng = np.random.default_rng(5)
    b, h, hk, d, cap = 3, 4, 2, 64, 48
    q = rng.standard_normal((b, 2, h, d)).astype(np.float32)
    kn, vn = (rng.standard_normal((b, 2, hk, d)).astype(np.float32) for _ in range(2))
    kc, vc = (rng.standard_normal((b, cap, hk, d)).astype(np.float32) for _ in range(2))
    lens = np.array([10, 0, 46], np.int32)
    slopes = (0.5 ** np.arange(1, h + 1)).astype(np.float32)
    kw = dict(cache_seqlens=lens, causal=True, alibi_slopes=slopes)
    truth_o, truth_l, truth_kc, truth_vc = ref.kvcache_attention(q, kc, vc, kn, vn, **kw)
    base_o, base_l, _, _ = ref.kvcache_attention(q, kc, vc, kn, vn, dtype=np.float32, **kw)
    t = {n: torch.as_tensor(x, device="cuda") for n, x in dict(q=q, k=kn, v=vn, kc=kc, vc=vc, lens=lens,
                                                                 slopes=slopes).items()}
    out, lse = ft.flash_attn_with_kvcache(t["q"], t["kc"], t["vc"], t["k"], t["v"], cache_seqlens=t["lens"],
                                         causal=True, alibi_slopes=t["slopes"], return_softmax_lse=True)
    torch.cuda.synchronize()
    assert isinstance(out, torch.Tensor) and isinstance(lse, torch.Tensor) and out.dtype == torch.float32
    assert_close_to_truth("out", out.cpu().numpy(), truth_o, base_o, reduction=cap)
    assert_close_to_truth("lse", lse.cpu().numpy(), truth_l, base_l.astype(np.float32), reduction=cap)
    np.testing.assert_array_equal(t["kc"].cpu().numpy(), truth_kc)
    np.testing.assert_array_equal(t["vc"].cpu().numpy(), truth_vc)


@on_gpu
def test_flash_attn_with_kvcache_bfloat16_on_the_gather_path_is_refused_before_any_write():
    """bfloat16 tensors cannot take the gather path (it runs on CuPy views, and CuPy has no bfloat16): the call is
    refused before the new keys are written, so the cache is unchanged."""
    pytest.importorskip("cupy")
    b, h, d, cap = 2, 2, 64, 32
    q = torch.randn(b, 1, h, d, device="cuda").to(torch.bfloat16)
    kn, vn = (torch.randn(b, 1, h, d, device="cuda").to(torch.bfloat16) for _ in range(2))
    kc, vc = (torch.randn(b, cap, h, d, device="cuda").to(torch.bfloat16) for _ in range(2))
    before = kc.clone(), vc.clone()
    lens = torch.tensor([3, 9], dtype=torch.int32, device="cuda")
    with pytest.raises(TypeError, match="bfloat16"):
        flashnumba.flash_attn_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=lens, kernel="gather")
    # (caches that are views of a longer buffer are not C-contiguous: the split-KV kernel does not apply)
    kbig, vbig = (torch.cat([x, x], dim=1) for x in (kc, vc))
    with pytest.raises(TypeError, match="bfloat16"):
        ft.flash_attn_with_kvcache(q, kbig[:, :cap], vbig[:, :cap], kn, vn, cache_seqlens=lens)
    torch.cuda.synchronize()
    assert torch.equal(kc, before[0]) and torch.equal(vc, before[1])
    assert torch.equal(kbig[:, :cap], before[0]) and torch.equal(vbig[:, :cap], before[1])
