"""The C++ paged prefill kernel against plain float64 attention over contiguous K/V.

Random shapes: ragged block tables in shuffled block order, prefixes that end mid-block, several
chunks in one call, GQA groups 1/3/8, head_dim 64/128 (and an odd 80), chunk sizes 1/17/256/2048,
both vector widths the kernel is built with (8 lanes: AVX2; 16: AVX-512, which GCC lowers to
pairs of 8-wide operations where the CPU lacks it, so both are checked on any x86 machine).
"""

from __future__ import annotations

import pytest
import torch

from pagellm.attention.kv_cache import kv_cache_format
from pagellm.kernels.paged_attention import load_paged_prefill_kernel


def _reference(q, k_cache, v_cache, tables, query_starts, start_pos, scale):
    """float64: token i of a chunk at position start + i sees keys at positions <= start + i."""
    hkv, _, bs, d = k_cache.shape
    hq = q.shape[1]
    group = hq // hkv
    out = torch.empty(q.shape, dtype=torch.float64)
    for c, start in enumerate(start_pos):
        t0, t1 = query_starts[c], query_starts[c + 1]
        n = t1 - t0
        pos = torch.arange(start + n)
        blocks = torch.tensor(tables[c])[pos // bs]
        keys = k_cache[:, blocks, pos % bs].double()  # [hkv, ctx, d]
        values = v_cache[:, blocks, pos % bs].double()
        qs = q[t0:t1].double().view(n, hkv, group, d)
        scores = torch.einsum("nhgd,hkd->hgnk", qs, keys) * scale
        hidden = pos.view(1, -1) > (start + torch.arange(n)).view(-1, 1)
        probs = scores.masked_fill(hidden, float("-inf")).softmax(-1)
        out[t0:t1] = torch.einsum("hgnk,hkd->nhgd", probs, values).reshape(n, hq, d)
    return out


def _run_case(kernel, dtype, hkv, group, d, block_size, chunks, seed, kv="auto", ramp=0.0):
    """chunks: (tokens cached before, chunk tokens) per sequence; ``kv``: the cache's format
    (FP8 caches hold K / 0.5 and V / 4); ``ramp``: every element of the key at position p gets
    ``ramp * p`` added (a row's scores then climb or fall along the keys by about ``ramp * p``
    times its q's sum, so its running max keeps moving)."""
    gen = torch.Generator().manual_seed(seed)
    needed = [-(-(s + n) // block_size) for s, n in chunks]
    num_blocks = sum(needed) + 3
    k_cache = torch.randn(hkv, num_blocks, block_size, d, generator=gen).to(dtype)
    v_cache = torch.randn(hkv, num_blocks, block_size, d, generator=gen).to(dtype)
    fmt, k_scale, v_scale = kv_cache_format(kv), 0.5, 4.0
    k_ref, v_ref = k_cache, v_cache
    if fmt.fp8 is not None:
        k_cache, v_cache = fmt.quantize(k_cache, k_scale), fmt.quantize(v_cache, v_scale)
        k_ref = fmt.dequantize(k_cache, k_scale, torch.float64)
        v_ref = fmt.dequantize(v_cache, v_scale, torch.float64)
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables, taken = [], 0
    for m in needed:
        tables.append(order[taken : taken + m])
        taken += m
    if ramp:
        assert fmt.fp8 is None
        for (start, n), table in zip(chunks, tables, strict=True):
            for p in range(start + n):
                k_cache[:, table[p // block_size], p % block_size] += ramp * p
        k_ref = k_cache
    table_t = torch.zeros(len(chunks), max(needed) + 2, dtype=torch.int32)  # ragged, padded
    for i, t in enumerate(tables):
        table_t[i, : len(t)] = torch.tensor(t, dtype=torch.int32)
    starts = [0]
    for _, n in chunks:
        starts.append(starts[-1] + n)
    q = torch.randn(starts[-1], hkv * group, d, generator=gen).to(dtype)
    out = torch.full_like(q, float("nan"))
    scale = d**-0.5
    start_pos = [s for s, _ in chunks]
    fp8 = {} if fmt.fp8 is None else {"kv_code": fmt.kernel_code, "v_scale": v_scale}
    kernel(
        q,
        k_cache,
        v_cache,
        table_t,
        torch.tensor(starts, dtype=torch.int32),
        torch.tensor(start_pos, dtype=torch.int32),
        out,
        scale * (k_scale if fp8 else 1.0),
        **fp8,
    )
    expected = _reference(q, k_ref, v_ref, tables, starts, start_pos, scale)
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    if ramp and dtype == torch.float32:  # scores of ~100: fp32's rounding of them is ~1e-5
        tol = 2e-4
    tol *= v_scale if fp8 else 1.0
    torch.testing.assert_close(out.double(), expected, rtol=tol, atol=tol)


@pytest.fixture(
    scope="module",
    params=[(8, True), (16, True), (16, False)],
    ids=["8-lanes", "16-lanes", "16-lanes-no-amx"],
)
def kernel(request):
    """Both vector widths; where the CPU has AMX, bf16 calls take it unless turned off."""
    width, amx = request.param
    built = load_paged_prefill_kernel(vector_width=width, allow_amx=amx)
    assert built is not None, "the C++ kernel must build on this machine (g++ is required)"
    assert built.vector_width == width
    return built


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    ("hkv", "group", "d"),
    [(2, 1, 64), (3, 3, 64), (1, 8, 128), (2, 3, 128), (2, 3, 96), (1, 3, 80)],
)
@pytest.mark.parametrize("block_size", [16, 5])
def test_mixed_chunks(kernel, dtype, hkv, group, d, block_size):
    # a fresh prompt, a decode-like single token, an extend after a prefix ending mid-block,
    # a chunk of 17 after one full block, a 256-token chunk over a long prefix
    chunks = [(0, 33), (41, 1), (37, 17), (block_size, 17), (301, 256)]
    _run_case(kernel, dtype, hkv, group, d, block_size, chunks, seed=hkv * 100 + group + d)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_chunk_of_2048_over_a_prefix(kernel, dtype):
    _run_case(kernel, dtype, 1, 3, 64, 16, [(1000, 2048)], seed=7)


@pytest.mark.parametrize("chunk", [1, 17, 256])
def test_one_chunk_sizes(kernel, chunk):
    _run_case(kernel, torch.float32, 2, 8, 64, 16, [(123, chunk)], seed=chunk)


def test_fp32_matches_sdpa_exactly_where_the_reference_is_fp32(kernel):
    """Same data as torch's SDPA in fp32: agreement to fp32 rounding, not a looser tolerance."""
    gen = torch.Generator().manual_seed(3)
    hkv, group, d, bs, n = 2, 3, 64, 16, 96
    k_cache = torch.randn(hkv, 8, bs, d, generator=gen)
    v_cache = torch.randn(hkv, 8, bs, d, generator=gen)
    q = torch.randn(n, hkv * group, d, generator=gen)
    out = torch.empty_like(q)
    table = torch.tensor([[5, 2, 7, 0, 3, 1]], dtype=torch.int32)
    kernel(
        q,
        k_cache,
        v_cache,
        table,
        torch.tensor([0, n], dtype=torch.int32),
        torch.tensor([0], dtype=torch.int32),
        out,
        d**-0.5,
    )
    keys = k_cache[:, table[0].long()].reshape(hkv, -1, d)[:, :n]
    values = v_cache[:, table[0].long()].reshape(hkv, -1, d)[:, :n]
    expected = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), keys, values, is_causal=True, enable_gqa=True
    ).transpose(0, 1)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize(
    "chunks",
    [[(2100, 1)], [(1600, 5)], [(3000, 2), (1100, 3)], [(1030, 7)]],
    ids=["1-over-2100", "5-over-1600", "two-chunks", "7-over-1030"],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_short_chunks_over_long_prefixes_split_their_keys(kernel, chunks, dtype):
    """Few work items: each is split over its prefix into parts and the parts merged."""
    _run_case(kernel, dtype, 2, 3, 64, 16, chunks, seed=len(chunks) * 17 + chunks[0][0])


@pytest.mark.parametrize("chunks", [[(1500, 10)], [(700, 3), (0, 20)], [(64, 2048)]])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_scores_that_keep_climbing_along_the_keys(kernel, chunks, dtype):
    """Rows whose scores rise by a hundred and more along the keys: the running max moves on many key tiles
    and O must be rescaled each time it does (the AMX products' path moves it lazily, only
    past a margin; never moving it overflows P, never rescaling O weighs early keys wrongly)."""
    _run_case(kernel, dtype, 2, 3, 64, 16, chunks, seed=chunks[0][0] + 1, ramp=0.08)


@pytest.mark.parametrize("kv", ["fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(("hkv", "group", "d"), [(3, 3, 64), (1, 3, 80)])
def test_fp8_cache(kernel, kv, dtype, hkv, group, d):
    """An FP8 cache read through the block table, scales folded in; with a split item."""
    chunks = [(0, 33), (41, 1), (37, 17), (1100, 3)]
    _run_case(kernel, dtype, hkv, group, d, 5, chunks, seed=d + group, kv=kv)


def _cpu_flags() -> set[str]:
    with open("/proc/cpuinfo", encoding="utf-8") as f:
        return set(next((line for line in f if line.startswith("flags")), "").split())


def test_tile_products_are_taken_where_the_cpu_has_them():
    """On a CPU with AMX or AVX-512 BF16 (Zen 4 / Zen 5) a bf16 prefill's products run in
    bf16 pairs (tiles, or dot products in their layout): other bits than the float32 vector
    path, the same answer within bf16 tolerance (both checked against the reference above)."""
    tiles = load_paged_prefill_kernel(allow_amx=True)
    flags = _cpu_flags()
    if "amx_bf16" in flags:
        assert tiles.tile_products == "AMX"
    elif "avx512_bf16" in flags:
        assert tiles.tile_products == "AVX-512 BF16"
    if tiles.tile_products is None:
        pytest.skip("this CPU has neither AMX nor AVX-512 BF16")
    vector = load_paged_prefill_kernel(allow_amx=False)
    outs = []
    for kernel in (tiles, vector):
        captured = {}

        def spy(*args, kernel=kernel, captured=captured, **kw):
            kernel(*args, **kw)
            captured["out"] = args[6].clone()

        _run_case(spy, torch.bfloat16, 3, 3, 64, 16, [(0, 200), (700, 64)], seed=3)
        outs.append(captured["out"])
    assert not torch.equal(outs[0], outs[1])
