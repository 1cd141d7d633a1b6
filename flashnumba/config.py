"""Process-wide switches.

``poison_outputs``: fill every output buffer with NaN before a kernel writes it, so that an element a kernel
forgets to write cannot pass a test. The test suite turns it on; it costs one memset per output.

``warn_slow_path``: warn once (:class:`flashnumba.planner.SlowPathWarning`) when ``kernel=None`` runs a float16 or
bfloat16 call on the SIMT kernels because the tensor-core ones do not apply (the plan's ``fallback`` says why).

``check_device_values``: copy a varlen call's ``cu_seqlens`` to the host and check them at every call (one
synchronisation). Unchecked offsets that break the rules (start at 0, non-decreasing, end at the number of rows,
no sequence longer than max_seqlen) make the kernels read and write outside the arrays.

``check_cache_values``: copy ``flash_attn_with_kvcache``'s device ``cache_seqlens``, ``cache_batch_idx`` and
``block_table`` to the host and check them at every call (ValueError before anything is written), at the cost of
one synchronisation a call, which also keeps the call out of a CUDA graph. Off (the default, as in flash-attn,
which checks none of them), the kernels keep such values inside the arrays: a new key whose position falls
outside the cache, on a page outside the pool or in a cache entry outside the cache is not written; a sequence's
keys are clipped to the cache's capacity, a page outside the pool reads as zeros, an entry outside the cache gives
the sequence no keys (out 0, lse -inf); a rotation past the rotary tables takes their last row. Values given as
ints or NumPy arrays are always checked (no synchronisation).

``hopper_tma``: the Hopper forward's producer copies its tiles with the copy engine (tensor maps) where it
applies (``flashnumba.kernels.wgmma_forward.takes_tma``); False keeps its per-thread copies, to compare the two
(a call's kept plan is that of the setting at the call).

``hopper_exchange``: above head_dim 128 the Hopper backward's dK/dV kernel runs two warpgroups on 64 keys, each
holding half of the head dims of dK_j and dV_j; they multiply half of the head dims each into S^T and dP^T and
exchange the partial sums through shared memory (four products a tile). False has each warpgroup compute S^T and
dP^T whole instead (six products a tile, no exchange), to compare the two (kept plans as for ``hopper_tma``).

``hopper_persistent``: the Hopper forward, where it copies with tensor maps, runs one block an SM that takes the
query tiles one after another, the next tile's copies under the last one's end
(:mod:`flashnumba.kernels.wgmma_forward`, "persistent blocks"); False (the default) launches a block a query tile,
which the GPU schedules wherever a block ends. The persistent blocks take pairs of query tiles in turn, whose causal
rows see about as many keys as any other pair's, and copy the next tile's Q_i under the last one's end; measured,
they gained nothing over the per-tile blocks (docs/benchmarks.md, "Persistent blocks"). Kept plans as for
``hopper_tma``.

``hopper_overlap``: the Hopper forward with tensor-map copies and two warpgroups (the default for sequences of equal
length below head_dim 256) ends each tile's softmax (the wait for the running O += P V, O's rescaling, P packed) at
the top of the next iteration, behind the wait for the next tile's copies, so that the softmax runs beside the
product in flight, as the module docstring's pipeline draws it; False (the default) ends it where the softmax does,
where the assembler takes the wait above the exponentials
(:func:`flashnumba.kernels.wgmma_forward.make_forward_wgmma`, ``finish_tile``). Measured on an H100, it gained
nothing without causality and lost up to 14% with it (docs/benchmarks.md, "The softmax beside the product"). Kept
plans as for ``hopper_tma``.

``hopper_3xtf32``: None (the default) runs the 3xTF32 forward and backward (``precision="3xtf32"``) on ``mma.sync``
everywhere; "chained" or "per_step" runs them, on compute capability 9.0, on Hopper's wgmma
(:mod:`flashnumba.kernels.wgmma_tf32`, :mod:`flashnumba.kernels.wgmma_tf32_backward`) with that accumulation.
"per_step" is float32-class; "chained" errs several times float32's. Opt-in: neither is faster than the
``mma.sync`` kernels at every head dim (docs/benchmarks.md, "What do the profiles say?", has the figures).

``temporarily(name, value)``: a context manager that sets one of these within a ``with`` block and restores what
it was after (the benchmarks' and the tests' way to compare a setting with its default).
"""

import contextlib


poison_outputs = False
warn_slow_path = True
check_device_values = True
check_cache_values = False
hopper_tma = True
hopper_exchange = True
hopper_persistent = False
hopper_overlap = False
hopper_3xtf32 = None


@contextlib.contextmanager
def temporarily(name, value):
    """``flashnumba.config.<name>`` set to ``value`` within the block, what it was restored after."""
    if name not in ("poison_outputs", "warn_slow_path", "check_device_values", "check_cache_values", "hopper_tma",
                    "hopper_exchange", "hopper_persistent", "hopper_overlap", "hopper_3xtf32"):
        raise ValueError(f"flashnumba.config has no setting {name!r}")
    module = globals()
    saved = module[name]
    module[name] = value
    try:
        yield
    finally:
        module[name] = saved
