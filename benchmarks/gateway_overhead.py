"""The gateway's cost: `pagellm bench serve` straight to one replica vs through `pagellm gateway`
in front of it, same workload and concurrency, in one run (after a short warm-up through the
gateway: direct, gateway, direct again, so the machine's drift shows). The replica runs without
prefix caching so no run reuses another's KV. Prints a table with the ratios and added TTFT.

    python benchmarks/gateway_overhead.py --workload results/workload_random.json \\
        --num-prompts 96 --concurrency 32 --output-dir results/gateway
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from serve_side_by_side import (
    PAGELLM,
    add_gateway_bench_args,
    bench_serve,
    free_port,
    replica_cmd,
    server,
    write_summary,
)

from pagellm.bench.report import format_table


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_gateway_bench_args(p, "results/gateway")
    return p.parse_args()


def main() -> int:
    args = parse_args()
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    rport, gport = free_port(), free_port()
    runs = []
    with server(replica_cmd(args, rport), rport, env, out / "replica.log") as replica:
        gateway_cmd = [
            *PAGELLM, "gateway", "--port", str(gport), "--backend", replica,
            "--log-level", "warning",
        ]  # fmt: skip
        with server(gateway_cmd, gport, env, out / "gateway.log") as gateway:
            warm = argparse.Namespace(**{**vars(args), "num_prompts": 8})
            bench_serve(gateway, warm, out / "warmup.json", "warm-up (untimed)")
            for label, base in (
                ("direct", replica),
                ("through the gateway", gateway),
                ("direct (again)", replica),
            ):
                name = label.split()[0] + ("_2" if "again" in label else "")
                runs.append(bench_serve(base, args, out / f"{name}.json", label))
    base_tps = (
        runs[0]["results"]["output_throughput"] + runs[2]["results"]["output_throughput"]
    ) / 2
    base_ttft = (runs[0]["results"]["median_ttft_ms"] + runs[2]["results"]["median_ttft_ms"]) / 2
    rows = []
    for r in runs:
        res = r["results"]
        rows.append(
            [
                r["label"],
                f"{res['output_throughput']:.1f}",
                f"{res['output_throughput'] / base_tps:.3f}",
                f"{res['median_ttft_ms']:.1f}",
                f"{res['median_ttft_ms'] - base_ttft:+.1f}",
                f"{res['p99_ttft_ms']:.1f}",
            ]
        )
    headers = ["run", "out tok/s", "vs direct avg", "TTFT p50", "vs direct avg", "TTFT p99"]
    table = format_table(headers, rows)
    write_summary(out, table, "gateway_overhead", {"config": vars(args), "runs": runs})
    return 0


if __name__ == "__main__":
    sys.exit(main())
