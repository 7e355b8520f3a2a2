"""`pagellm bench serve` through the gateway of a `pagellm cluster` (Ray, started here on
loopback) with one replica and then with two, same workload and concurrency. The machine's CPUs
are split evenly: one replica reserves all of them, each of two reserves half (Ray sets a
replica's torch threads to its CPU reservation). Prints a table with the ratio.

    python benchmarks/cluster_replicas.py --workload results/workload_random.json \\
        --num-prompts 96 --concurrency 32 --output-dir results/cluster_replicas
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from serve_side_by_side import add_gateway_bench_args, bench_serve, free_port, write_summary

from pagellm.bench.report import format_table


def cluster_config(args: argparse.Namespace, replicas: int, port: int) -> dict:
    cpus = os.cpu_count() or 1
    return {
        "engine_args": {"dtype": args.dtype, "max_model_len": args.max_model_len,
                        "enable_prefix_caching": False},  # runs repeat one workload
        "ray_config": {"name": f"bench-{replicas}", "num_replicas": replicas,
                       "resources_per_replica": {"CPU": cpus / replicas}},
        "gateway": {"port": port},
    }  # fmt: skip


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_gateway_bench_args(p, "results/cluster_replicas")
    args = p.parse_args()
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    from pagellm.cluster import api

    runs = []
    for replicas in (1, 2):
        config = cluster_config(args, replicas, free_port())
        gateway = api.up(config)
        try:
            warm = argparse.Namespace(**{**vars(args), "num_prompts": 8})
            bench_serve(gateway, warm, out / f"warmup{replicas}.json", "warm-up (untimed)")
            label = f"{replicas} replica{'s' if replicas > 1 else ''} on Ray"
            runs.append(bench_serve(gateway, args, out / f"replicas{replicas}.json", label))
        finally:
            api.down(config)
    base = runs[0]["results"]["output_throughput"]
    rows = [
        [r["label"], f"{r['results']['output_throughput']:.1f}",
         f"{r['results']['output_throughput'] / base:.3f}",
         f"{r['results']['median_ttft_ms']:.1f}", f"{r['results']['median_tpot_ms']:.1f}"]
        for r in runs
    ]  # fmt: skip
    table = format_table(["behind the gateway", "out tok/s", "vs 1", "TTFT p50", "TPOT p50"], rows)
    write_summary(out, table, "cluster_replicas", {"config": vars(args), "runs": runs})
    return 0


if __name__ == "__main__":
    sys.exit(main())
