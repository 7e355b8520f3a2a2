"""The paged attention backend against naive per-sequence attention over contiguous K/V."""

from __future__ import annotations

import pytest
import torch

from pagellm.attention.backend import SeqLayout
from pagellm.attention.kv_cache import kv_cache_format
from pagellm.attention.torch_backend import TorchAttentionBackend
from pagellm.kernels.paged_attention import load_paged_decode_kernel, load_paged_prefill_kernel

HQ, HKV, BS, NUM_BLOCKS = 6, 2, 4, 512


def _naive(q, k, v):
    """q [n, Hq, D] at the last n positions of k/v [ctx, Hkv, D]; causal."""
    n, ctx, D = q.shape[0], k.shape[0], q.shape[-1]
    hq = q.shape[1]
    k = k.repeat_interleave(hq // k.shape[1], dim=1)
    v = v.repeat_interleave(hq // v.shape[1], dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / D**0.5
    pos_q = torch.arange(ctx - n, ctx).unsqueeze(1)
    scores = scores.masked_fill(torch.arange(ctx).unsqueeze(0) > pos_q, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(n, hq * D)


def _as_cached(x: torch.Tensor, kv: str, dtype: torch.dtype, scale: float) -> torch.Tensor:
    """What a cache of format ``kv`` gives back for x written in ``dtype``, as float32."""
    x = x.to(dtype)
    fmt = kv_cache_format(kv)
    if fmt.fp8 is None:
        return x.float()
    return fmt.dequantize(fmt.quantize(x, scale), scale, torch.float32)


@pytest.mark.parametrize("D", [16, 64, 128])  # 64 and 128 take the kernel's AVX-512 path
@pytest.mark.parametrize("path", ["torch", "cpp-kernel", "cpp-prefill", "fused-sdpa"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kv", ["auto", "fp8_e4m3", "fp8_e5m2"])
def test_mixed_batch_matches_naive_attention(kv, dtype, path, D):
    """Every path against attention over the values the cache holds (an FP8 cache's rounded
    K and V, with scales that are not 1)."""
    gen = torch.Generator().manual_seed(0)
    use_kernel = path in ("cpp-kernel", "cpp-prefill")
    kernel = load_paged_decode_kernel() if use_kernel else None
    prefill = load_paged_prefill_kernel() if path == "cpp-prefill" else None
    if use_kernel:
        assert kernel is not None, "the C++ kernel must build on this machine (g++ is required)"
    backend = TorchAttentionBackend(
        HQ, HKV, D, BS, dtype, decode_kernel=kernel, prefill_kernel=prefill,
        kv_format=kv_cache_format(kv),
    )  # fmt: skip
    assert (backend.decode_kernel is not None) == use_kernel
    assert (backend.prefill_kernel is not None) == (path == "cpp-prefill")
    backend.fused_sdpa = path == "fused-sdpa"  # the path a GPU takes in every dtype
    (cache,) = backend.allocate_cache(1, NUM_BLOCKS)
    if kv != "auto":
        assert cache.k.dtype == torch.uint8
        cache.k_scale, cache.v_scale = 0.25, 3.0
    # (context already cached, new tokens): two decodes, a prefill with a prefix, a fresh prefill
    # decodes, small prefill chunks (row-wise with the kernel), then chunks big enough for GEMMs
    shapes = [(9, 1), (3, 1), (70, 1), (0, 1), (6, 7), (0, 10), (0, 520), (300, 400)]
    free = list(range(NUM_BLOCKS))[::-1]
    seqs, full_k, full_v = [], [], []
    for cached, new in shapes:
        blocks = [free.pop() for _ in range(-(-(cached + new) // BS))]
        k = torch.randn(cached + new, HKV, D, generator=gen)
        v = torch.randn(cached + new, HKV, D, generator=gen)
        if cached:  # write the prefix through the backend itself
            meta = backend.build_metadata([SeqLayout(cached, 0, blocks)], NUM_BLOCKS)
            backend._write(cache, k[:cached].to(dtype), v[:cached].to(dtype), meta.slot_mapping)
        seqs.append(SeqLayout(new, cached, blocks))
        full_k.append(k)
        full_v.append(v)
    q_parts = [torch.randn(new, HQ, D, generator=gen) for _, new in shapes]
    meta = backend.build_metadata(seqs, NUM_BLOCKS)
    assert meta.num_rows == (4 + 7 + 10 if path == "cpp-kernel" else 4)
    assert (meta.kernel_prefills is not None) == (path == "cpp-prefill")
    new_k = torch.cat([k[c:] for k, (c, _) in zip(full_k, shapes, strict=True)])
    new_v = torch.cat([v[c:] for v, (c, _) in zip(full_v, shapes, strict=True)])
    out = backend.forward(
        cache, torch.cat(q_parts).to(dtype), new_k.to(dtype), new_v.to(dtype), meta
    ).float()
    expected = torch.cat(
        [
            _naive(q, _as_cached(k, kv, dtype, 0.25), _as_cached(v, kv, dtype, 3.0))
            for q, k, v in zip([q.to(dtype).float() for q in q_parts], full_k, full_v, strict=True)
        ]
    )
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    tol *= 1 if kv == "auto" else 3  # v_scale 3 makes the outputs 3x larger
    torch.testing.assert_close(out, expected, rtol=tol, atol=tol)


@pytest.mark.parametrize("kv", ["auto", "fp8", "fp8_e5m2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "contexts, heads",
    [([1500], (HQ, HKV)), ([5000], (9, 3)), ([600, 3000, 257], (HQ, HKV))],
    ids=["one-seq", "one-long-seq-3-kv-heads", "three-seqs"],
)
@pytest.mark.parametrize("build", [(), ("-mno-avx512f",)], ids=["native", "no-avx512"])
def test_long_context_decodes_match_naive_attention(dtype, contexts, heads, kv, build):
    """Few sequences with long contexts: the kernel splits each one's keys over the threads
    and merges the parts (the AVX2 path from 512 keys; the AVX-512 path from 2048 keys where the
    kv heads do not share evenly over the threads: 3 on 2); on an AVX-512 machine the native
    build takes the AVX-512 path and ``-mno-avx512f`` the AVX2 one."""
    gen = torch.Generator().manual_seed(len(contexts))
    D, blocks_per_seq = 64, 400
    hq, hkv = heads
    kernel = load_paged_decode_kernel(build)
    assert kernel is not None
    backend = TorchAttentionBackend(
        hq, hkv, D, BS, dtype, decode_kernel=kernel, kv_format=kv_cache_format(kv)
    )
    num_blocks = blocks_per_seq * 4 * len(contexts)
    (cache,) = backend.allocate_cache(1, num_blocks)
    if kv != "auto":
        cache.k_scale, cache.v_scale = 0.25, 3.0
    order = torch.randperm(num_blocks, generator=gen).tolist()
    seqs, ks, vs = [], [], []
    for i, ctx in enumerate(contexts):
        blocks = order[i * blocks_per_seq * 4 : i * blocks_per_seq * 4 + -(-(ctx + 1) // BS)]
        k = torch.randn(ctx + 1, hkv, D, generator=gen)
        v = torch.randn(ctx + 1, hkv, D, generator=gen)
        meta = backend.build_metadata([SeqLayout(ctx, 0, blocks)], num_blocks)
        backend._write(cache, k[:ctx].to(dtype), v[:ctx].to(dtype), meta.slot_mapping)
        seqs.append(SeqLayout(1, ctx, blocks))
        ks.append(k)
        vs.append(v)
    q = torch.randn(len(contexts), hq, D, generator=gen)
    meta = backend.build_metadata(seqs, num_blocks)
    new_k = torch.stack([k[-1] for k in ks]).to(dtype)
    new_v = torch.stack([v[-1] for v in vs]).to(dtype)
    out = backend.forward(cache, q.to(dtype), new_k, new_v, meta).float()
    expected = torch.cat(
        [
            _naive(
                q[i : i + 1].to(dtype).float(),
                _as_cached(k, kv, dtype, 0.25),
                _as_cached(v, kv, dtype, 3.0),
            )
            for i, (k, v) in enumerate(zip(ks, vs, strict=True))
        ]
    )
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    tol *= 1 if kv == "auto" else 3
    torch.testing.assert_close(out, expected, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kv", ["auto", "fp8"])
def test_fused_rotary_and_write_matches_the_eager_rotary_and_write(dtype, kv):
    """``rotate_and_write`` (the C++ rotary + K/V write of eager CPU steps) leaves the same bits
    in q and in the cache as the eager rotary followed by ``forward``'s write; with an FP8 cache
    (quantized as written) it declines and the caller takes the eager path."""
    from pagellm.kernels.decode_ops import load_decode_ops
    from pagellm.layers.rotary import RotaryEmbedding, inverse_frequencies

    D, tokens = 64, 40
    gen = torch.Generator().manual_seed(5)
    backends = [
        TorchAttentionBackend(
            HQ,
            HKV,
            D,
            BS,
            dtype,
            decode_kernel=load_paged_decode_kernel(),
            prefill_kernel=load_paged_prefill_kernel(),
            kv_format=kv_cache_format(kv),
        )  # fmt: skip
        for _ in range(2)
    ]
    fused, eager = backends
    fused.use_rope_ops(load_decode_ops())
    rotary = RotaryEmbedding(D, 4096, inverse_frequencies(D, 10000.0, None, None))
    blocks = torch.randperm(NUM_BLOCKS, generator=gen)[: -(-(100 + tokens) // BS)].tolist()
    seq = SeqLayout(tokens, 100, blocks)  # a chunk after 100 cached positions
    positions = torch.arange(100, 100 + tokens)
    qkv = torch.randn(tokens, (HQ + 2 * HKV) * D, generator=gen).to(dtype)
    (fused_cache,) = fused.allocate_cache(1, NUM_BLOCKS)
    (eager_cache,) = eager.allocate_cache(1, NUM_BLOCKS)
    meta = fused.build_metadata([seq], NUM_BLOCKS)
    q = fused.rotate_and_write(fused_cache, qkv, positions, rotary, meta)
    if kv != "auto":
        assert q is None
        return
    qk = qkv[:, : (HQ + HKV) * D].reshape(tokens, HQ + HKV, D)
    q_ref, k_ref = rotary(positions, qk).split([HQ, HKV], dim=1)
    v_ref = qkv[:, (HQ + HKV) * D :].reshape(tokens, HKV, D)
    eager._write(eager_cache, k_ref, v_ref, meta.slot_mapping)
    assert torch.equal(q, q_ref)
    assert torch.equal(fused_cache.k, eager_cache.k) and torch.equal(fused_cache.v, eager_cache.v)
    out = fused.forward(fused_cache, q, None, None, meta)
    expected = eager.forward(eager_cache, q_ref.contiguous(), k_ref, v_ref, meta)
    assert torch.equal(out, expected)
