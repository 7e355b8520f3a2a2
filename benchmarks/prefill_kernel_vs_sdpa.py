"""pagellm's paged prefill kernel against torch's CPU flash SDPA over the same paged data.

For each (cached prefix, chunk) shape and dtype: K/V in a block-paged cache with shuffled block
tables, the chunk's queries; pagellm's kernel reads through the block table, SDPA gets the prefix
gathered (``index_select``, counted in its time) and a causal mask (``is_causal`` for a fresh
prompt, a boolean mask after a prefix). Prints a table headed by the CPU and writes JSON; this is
how the default prefill path was chosen on a CPU kind (keep what is faster).

    python benchmarks/prefill_kernel_vs_sdpa.py --output-json results/prefill_vs_sdpa.json
    python benchmarks/prefill_kernel_vs_sdpa.py --no-amx   # the float32 vector path
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch
import torch.nn.functional as F

from pagellm.bench.report import cpu_line, environment, format_table
from pagellm.kernels.paged_attention import load_paged_prefill_kernel

SHAPES = [(0, 1024), (3072, 1024), (0, 2048), (6144, 2048)]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--group", type=int, default=3, help="query heads per kv head")
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument(
        "--no-amx",
        action="store_true",
        help="keep pagellm's bf16 calls on its float32 vector path (no AMX or AVX-512 BF16 tiles)",
    )
    p.add_argument("--output-json", default=None)
    return p.parse_args(argv)


def timed(fn, repeats: int) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats


def one_shape(kernel, args, dtype: torch.dtype, start: int, n: int) -> dict:
    hkv, d, bs = args.kv_heads, args.head_dim, args.block_size
    ctx = start + n
    nb = ctx // bs + 8
    gen = torch.Generator().manual_seed(start + n)
    k_cache = torch.randn(hkv, nb, bs, d, generator=gen).to(dtype)
    v_cache = torch.randn(hkv, nb, bs, d, generator=gen).to(dtype)
    table = torch.randperm(nb, generator=gen)[: -(-ctx // bs)].to(torch.int32).view(1, -1)
    q = torch.randn(n, hkv * args.group, d, generator=gen).to(dtype)
    out = torch.empty_like(q)
    starts = torch.tensor([0, n], dtype=torch.int32)
    pos = torch.tensor([start], dtype=torch.int32)
    rows = (torch.arange(hkv).view(-1, 1) * nb + table.long().view(1, -1)).reshape(-1)

    def ours() -> None:
        kernel(q, k_cache, v_cache, table, starts, pos, out, d**-0.5)

    def sdpa() -> torch.Tensor:
        keys = k_cache.view(hkv * nb, bs * d).index_select(0, rows).view(hkv, -1, d)[:, :ctx]
        values = v_cache.view(hkv * nb, bs * d).index_select(0, rows).view(hkv, -1, d)[:, :ctx]
        mask = None
        if start:
            mask = torch.arange(ctx).unsqueeze(0) <= torch.arange(start, ctx).unsqueeze(1)
        return F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0), keys.unsqueeze(0), values.unsqueeze(0),
            attn_mask=mask, is_causal=mask is None, enable_gqa=True,
        )  # fmt: skip

    t_ours, t_sdpa = timed(ours, args.repeats), timed(sdpa, args.repeats)
    flops = 4 * (n * start + n * (n + 1) / 2) * hkv * args.group * d
    return {
        "dtype": str(dtype).removeprefix("torch."),
        "prefix": start,
        "chunk": n,
        "pagellm_ms": t_ours * 1000,
        "sdpa_ms": t_sdpa * 1000,
        "pagellm_gflops": flops / t_ours / 1e9,
        "sdpa_gflops": flops / t_sdpa / 1e9,
        "speedup": t_sdpa / t_ours,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    kernel = load_paged_prefill_kernel(allow_amx=not args.no_amx)
    if kernel is None:
        print("the C++ kernel did not build (is g++ installed?)", file=sys.stderr)
        return 1
    rows = [
        one_shape(kernel, args, getattr(torch, dt), start, n)
        for dt in args.dtypes.split(",")
        for start, n in SHAPES
    ]
    tiles = kernel.tile_products if kernel.allow_amx else None
    env = {**environment(), "pagellm_bf16_path": f"{tiles} tiles" if tiles else "vector"}
    table = format_table(
        ["dtype", "prefix", "chunk", "pagellm ms", "SDPA ms", "pagellm GF/s", "SDPA GF/s", "x"],
        [
            [r["dtype"], str(r["prefix"]), str(r["chunk"]), f"{r['pagellm_ms']:.1f}",
             f"{r['sdpa_ms']:.1f}", f"{r['pagellm_gflops']:.0f}", f"{r['sdpa_gflops']:.0f}",
             f"{r['speedup']:.2f}"]
            for r in rows
        ],
    )  # fmt: skip
    print(cpu_line(env) + f"; pagellm's bf16 path: {env['pagellm_bf16_path']}")
    print(table)
    if args.output_json:
        with open(args.output_json, "w", encoding="utf-8") as f:
            json.dump({"environment": env, "shapes": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
