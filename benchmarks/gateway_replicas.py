"""One replica vs two behind `pagellm gateway`, same workload and concurrency, in one run: the
single replica gets every core (torch's default thread count), each of the two gets an equal
share (OMP_NUM_THREADS = cores / 2), so both layouts use the same CPU. Runs: one replica through
the gateway, two replicas through the gateway (least-load), one replica again (drift). Prints a
table with the ratios and writes JSON.

    python benchmarks/gateway_replicas.py --workload results/workload_random.json \\
        --num-prompts 96 --concurrency 32 --output-dir results/gateway_replicas
"""

from __future__ import annotations

import argparse
import contextlib
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
    add_gateway_bench_args(p, "results/gateway_replicas")
    p.add_argument("--routing", default="least-load")
    return p.parse_args()


def run_layout(args: argparse.Namespace, out: Path, replicas: int, label: str) -> dict:
    cores = os.cpu_count() or 1
    env = dict(os.environ)
    if replicas > 1:
        env["OMP_NUM_THREADS"] = str(max(1, cores // replicas))
    with contextlib.ExitStack() as stack:
        bases = []
        for i in range(replicas):
            port = free_port()
            log = out / f"{label.split()[0]}_replica{i}.log"
            bases.append(stack.enter_context(server(replica_cmd(args, port), port, env, log)))
        gport = free_port()
        gateway_cmd = [*PAGELLM, "gateway", "--port", str(gport), "--routing", args.routing,
                       "--log-level", "warning"]  # fmt: skip
        for base in bases:
            gateway_cmd += ["--backend", base]
        gateway = stack.enter_context(server(gateway_cmd, gport, dict(os.environ), out / "gw.log"))
        warm = argparse.Namespace(**{**vars(args), "num_prompts": 8})
        bench_serve(gateway, warm, out / "warmup.json", "warm-up (untimed)")
        name = label.replace(" ", "_").replace("(", "").replace(")", "")
        return bench_serve(gateway, args, out / f"{name}.json", label)


def main() -> int:
    args = parse_args()
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    runs = [
        run_layout(args, out, 1, "1 replica"),
        run_layout(args, out, 2, "2 replicas"),
        run_layout(args, out, 1, "1 replica (again)"),
    ]
    one = (runs[0]["results"]["output_throughput"] + runs[2]["results"]["output_throughput"]) / 2
    rows = []
    for r in runs:
        res = r["results"]
        rows.append(
            [
                r["label"],
                f"{res['output_throughput']:.1f}",
                f"{res['output_throughput'] / one:.3f}",
                f"{res['median_ttft_ms']:.1f}",
                f"{res['median_tpot_ms']:.1f}",
                f"{res['p99_e2el_ms']:.0f}",
            ]
        )
    headers = ["behind the gateway", "out tok/s", "vs 1 replica avg", "TTFT p50", "TPOT p50",
               "E2E p99"]  # fmt: skip
    table = format_table(headers, rows)
    write_summary(out, table, "gateway_replicas", {"config": vars(args), "runs": runs})
    return 0


if __name__ == "__main__":
    sys.exit(main())
