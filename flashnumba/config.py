"""Process-wide switches.

``poison_outputs``: fill every output buffer with NaN before a kernel writes it, so that an element a kernel
forgets to write cannot pass a test. The test suite turns it on; it costs one memset per output.

``warn_slow_path``: warn once (:class:`flashnumba.planner.SlowPathWarning`) when ``kernel=None`` runs a float16 or
bfloat16 call on the SIMT kernels because the tensor-core ones do not apply (the plan's ``fallback`` says why).

``check_device_values``: copy a varlen call's ``cu_seqlens`` to the host and check them at every call (one
synchronisation). Unchecked offsets that break the rules (start at 0, non-decreasing, end at the number of rows,
no sequence longer than max_seqlen) make the kernels read and write outside the arrays. The same for
``flash_attn_with_kvcache``'s device ``cache_seqlens``, ``cache_batch_idx`` and ``block_table``; there unchecked
values cannot take the split-KV kernel outside the arrays (lengths are clipped to the cache, a page outside the
pool reads as zeros, a batch index outside the cache gives no keys), and a decoding step then makes no host
round trip (flash-attn checks none of them). The append of new keys and values, though, writes where such values
point (CuPy wraps indices outside an array): into other rows of the cache.
"""

poison_outputs = False
warn_slow_path = True
check_device_values = True
