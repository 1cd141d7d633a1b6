"""``python -m flashnumba bench --decode``: decoding against a KV cache, as bytes of K and V read per second.

Workloads (float16, head_dim 128, 32 query heads on 8 key/value heads, one query token per sequence):

* batch 32 and batch 1, cache lengths 8192 and 32768, contiguous caches, and batch 32 from a paged cache;
* 128 sequences of mixed lengths (uniform in 1 .. 8192) from a paged cache (flashnumba only: the peers take no
  per-sequence lengths).

Each is timed with CUDA events after warm-up, both back to back (calls in samples of about ``group_ms``) and one
call per pair of events, beside torch's scaled_dot_product_attention with its flash, cuDNN and memory-efficient
backends on the same keys (``enable_gqa``; a backend that refuses it is recorded as such). The figure is the bytes
of K and V the attention must read (each sequence's keys once) divided by the time, and its fraction of the
device-to-device copy bandwidth measured in the same run (a copy reads and writes: its rate counts both).
flashnumba is timed as called by default (device cache_seqlens not read back: no host round trip, as flash-attn's
call) and with ``flashnumba.config.check_cache_values`` on (read back and checked at each call); at batch 32 also
a decoding step with one new key and value appended (rotated, with the query, by rotary tables).
"""

from __future__ import annotations

import time

import numpy as np

from .environment import environment, write_json
from .timing import cuda_time_calls_ms

NHEADS, NHEADS_K, HEAD_DIM = 32, 8, 128
# one call a pair: the median of this many samples (each call's host time before its first kernel is on the clock
# and varies by microseconds with the host's scheduling; a sample takes at most a millisecond or two)
SINGLE_SAMPLES = 50


def copy_bandwidth(nbytes=2 << 30):
    """Device-to-device copy rate (bytes read + written per second) of a ``nbytes`` buffer."""
    import cupy

    a = cupy.empty(nbytes // 2, np.float16)
    b = cupy.empty_like(a)
    ms, _, _ = cuda_time_calls_ms(lambda: b.__setitem__(Ellipsis, a), warmup=3, repeat=10)
    return 2 * a.nbytes / (ms * 1e-3)


def _time(fn, group_ms):
    back, _, calls = cuda_time_calls_ms(fn, warmup=3, repeat=10, group_ms=group_ms)
    single, _, _ = cuda_time_calls_ms(fn, warmup=3, repeat=SINGLE_SAMPLES)
    return back, single, calls


def _torch_peers(q, k_cache, v_cache, lens):
    """{name: fn} of torch SDPA backends on the same keys (each sequence's first lens[b] keys; equal lengths)."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    n = int(lens[0])
    tq = torch.as_tensor(q, device="cuda").transpose(1, 2)
    tk = torch.as_tensor(k_cache, device="cuda")[:, :n].transpose(1, 2)
    tv = torch.as_tensor(v_cache, device="cuda")[:, :n].transpose(1, 2)
    peers = {}
    for name, backend in (("torch_sdpa_flash", SDPBackend.FLASH_ATTENTION), ("torch_sdpa_cudnn",
                          SDPBackend.CUDNN_ATTENTION), ("torch_sdpa_efficient", SDPBackend.EFFICIENT_ATTENTION)):
        def fn(backend=backend):
            with sdpa_kernel(backend):
                return torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, enable_gqa=True)
        try:
            fn()
            torch.cuda.synchronize()
            peers[name] = fn
        except RuntimeError as err:
            peers[name] = str(err).splitlines()[0][:200]
    return peers


def run(out_dir, seqlens=(8192, 32768), group_ms=20.0, splits=(0,), pages=(256,)):
    import cupy

    import flashnumba

    rng = np.random.default_rng(0)
    copy_bps = copy_bandwidth()
    rows = []

    def emit(**row):
        rows.append(row)
        rate = row.get("tb_s")
        print(f"{row['workload']:44s} {row['impl']:24s} " + (f"{row['ms']:8.3f} ms {rate:6.2f} TB/s "
              f"({row['ms_single']:.3f} ms, {row['tb_s_single']:.2f} TB/s one call a pair)" if rate else
              row.get("error", "")), flush=True)

    def measure(workload, impl, fn, kv_bytes, **extra):
        fn()
        cupy.cuda.Device().synchronize()
        back, single, calls = _time(fn, group_ms)
        emit(workload=workload, impl=impl, ms=back, ms_single=single, calls_per_sample=calls, kv_bytes=kv_bytes,
             tb_s=kv_bytes / (back * 1e-3) / 1e12, tb_s_single=kv_bytes / (single * 1e-3) / 1e12,
             copy_fraction=kv_bytes / (back * 1e-3) / copy_bps, **extra)

    def both(workload, fn, kv_bytes, **extra):
        """The default call, then again with config.check_cache_values on (the lengths and pages read back and
        checked at each call)."""
        measure(workload, "flashnumba (num_splits=0)", fn, kv_bytes, num_splits=0, **extra)
        with flashnumba.config.temporarily("check_cache_values", True):
            measure(workload, "flashnumba (device values checked)", fn, kv_bytes, num_splits=0, **extra)

    def cache(batch, n):
        return [cupy.asarray(rng.standard_normal((batch, n, NHEADS_K, HEAD_DIM), np.float32).astype(np.float16))
                for _ in range(2)]

    for batch in (32, 1):
        for n in seqlens:
            q = cupy.asarray(rng.standard_normal((batch, 1, NHEADS, HEAD_DIM), np.float32).astype(np.float16))
            kc, vc = cache(batch, n)
            lens = cupy.full(batch, n, np.int32)
            kv = 2 * batch * n * NHEADS_K * HEAD_DIM * 2
            name = f"batch {batch}, seqlen_k {n}"
            both(name, lambda: flashnumba.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens), kv)
            for s in splits:
                if s:
                    measure(name, f"flashnumba (num_splits={s})", lambda s=s: flashnumba.flash_attn_with_kvcache(
                        q, kc, vc, cache_seqlens=lens, num_splits=s), kv, num_splits=s)
            for peer, fn in _torch_peers(q, kc, vc, np.full(batch, n)).items():
                if callable(fn):
                    measure(name, peer, fn, kv)
                else:
                    emit(workload=name, impl=peer, error=fn)
            if batch == 32:
                # a whole decoding step: the new token's key and value written at position n - 1 (the same each
                # call), rotated with the query (rotary_dim = head_dim), then the attention over the n keys
                knew, vnew = (cupy.asarray(rng.standard_normal((batch, 1, NHEADS_K, HEAD_DIM), np.float32)
                                           .astype(np.float16)) for _ in range(2))
                angle = np.arange(n)[:, None] * (10000.0 ** (-np.arange(HEAD_DIM // 2) / (HEAD_DIM // 2)))[None]
                cos, sin = (cupy.asarray(f(angle).astype(np.float16)) for f in (np.cos, np.sin))
                before = cupy.full(batch, n - 1, np.int32)
                measure(name, "flashnumba (append + rotary)", lambda: flashnumba.flash_attn_with_kvcache(
                    q, kc, vc, knew, vnew, rotary_cos=cos, rotary_sin=sin, cache_seqlens=before), kv, num_splits=0)
                for page in pages:
                    per = n // page
                    order = cupy.asarray(rng.permutation(batch * per).astype(np.int32))
                    table = order.reshape(batch, per)
                    # the same keys, laid out in pages in a shuffled order
                    kp, vp = (cupy.empty((batch * per, page, NHEADS_K, HEAD_DIM), np.float16) for _ in range(2))
                    kp[order] = kc.reshape(batch * per, page, NHEADS_K, HEAD_DIM)
                    vp[order] = vc.reshape(batch * per, page, NHEADS_K, HEAD_DIM)
                    both(f"{name}, paged ({page} a page)", lambda kp=kp, vp=vp, table=table:
                         flashnumba.flash_attn_with_kvcache(q, kp, vp, cache_seqlens=lens, block_table=table), kv,
                         page=page)
            del kc, vc
    # 128 sequences of mixed lengths from a paged cache
    batch, page, longest = 128, 256, 8192
    lens_h = rng.integers(1, longest + 1, batch).astype(np.int32)
    per = longest // page
    q = cupy.asarray(rng.standard_normal((batch, 1, NHEADS, HEAD_DIM), np.float32).astype(np.float16))
    kp, vp = (cupy.asarray(rng.standard_normal((batch * per, page, NHEADS_K, HEAD_DIM), np.float32)
                           .astype(np.float16)) for _ in range(2))
    table = cupy.asarray(rng.permutation(batch * per).astype(np.int32).reshape(batch, per))
    kv = int(2 * lens_h.sum() * NHEADS_K * HEAD_DIM * 2)
    lens_d = cupy.asarray(lens_h)
    both(f"128 sequences, lengths 1..{longest}, paged ({page} a page)",
         lambda: flashnumba.flash_attn_with_kvcache(q, kp, vp, cache_seqlens=lens_d, block_table=table), kv)
    result = dict(date=time.strftime("%Y-%m-%d"), environment=environment(), copy_bandwidth_tb_s=copy_bps / 1e12,
                  workload=dict(nheads=NHEADS, nheads_k=NHEADS_K, head_dim=HEAD_DIM, dtype="float16", seqlen_q=1),
                  group_ms=group_ms, single_samples=SINGLE_SAMPLES, rows=rows)
    path = write_json(result, out_dir, "bench-decode.json")
    print(f"copy bandwidth {copy_bps / 1e12:.2f} TB/s (read + write); wrote {path}")
    return result

