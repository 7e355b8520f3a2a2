"""Two tenants, one flooding: the quiet tenant's TTFT under each scheduling policy, in one run.

For each ``--policies`` entry a ``pagellm serve --scheduling-policy P --max-num-seqs S`` starts on
a free loopback port. The flooding tenant (``user: flood``) sends ``--flood-requests`` long
requests all at once; ``--quiet-delay`` seconds later the quiet tenant (``user: quiet``) sends
``--quiet-requests`` short ones at ``--quiet-rate`` per second (Poisson). Both stream through
``pagellm bench serve``'s client. Prints, per policy, each tenant's TTFT p50/p99 and throughput.

    python benchmarks/fairness.py --output-json results/fairness.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from pathlib import Path

from serve_side_by_side import PAGELLM, free_port, server

from pagellm.bench.datasets import random_workload
from pagellm.bench.report import format_table
from pagellm.bench.serve import resolve_model, run_requests, summarize


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--policies", default="fcfs,fair")
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument("--flood-requests", type=int, default=48)
    p.add_argument("--flood-input-len", type=int, default=512)
    p.add_argument("--flood-output-len", type=int, default=64)
    p.add_argument("--quiet-requests", type=int, default=12)
    p.add_argument("--quiet-input-len", type=int, default=32)
    p.add_argument("--quiet-output-len", type=int, default=16)
    p.add_argument("--quiet-rate", type=float, default=0.5)
    p.add_argument("--quiet-delay", type=float, default=3.0)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--output-dir", default="results/fairness")
    return p.parse_args()


async def two_tenants(base: str, model: str, args: argparse.Namespace) -> dict:
    vocab = 49152
    flood = random_workload(
        args.flood_requests, args.flood_input_len, args.flood_output_len, vocab, seed=1
    )
    quiet = random_workload(
        args.quiet_requests, args.quiet_input_len, args.quiet_output_len, vocab, seed=2
    )

    async def quiet_later():
        await asyncio.sleep(args.quiet_delay)
        return await run_requests(
            base, "/v1/completions", model, quiet, rate=args.quiet_rate, seed=3,
            extra_body={"user": "quiet"},
        )  # fmt: skip

    flood_run = run_requests(base, "/v1/completions", model, flood, extra_body={"user": "flood"})
    (flood_res, flood_s), (quiet_res, quiet_s) = await asyncio.gather(flood_run, quiet_later())
    return {"flood": summarize(flood_res, flood_s), "quiet": summarize(quiet_res, quiet_s)}


def main() -> int:
    args = parse_args()
    out_dir = Path(args.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    results = {}
    for policy in args.policies.split(","):
        port = free_port()
        cmd = [
            *PAGELLM, "serve", "--port", str(port), "--dtype", args.dtype, "--max-model-len",
            "2048", "--max-num-seqs", str(args.max_num_seqs), "--scheduling-policy", policy,
            "--log-level", "warning",
        ]  # fmt: skip
        with server(cmd, port, dict(os.environ), out_dir / f"server_{policy}.log") as base:
            model = resolve_model(base, None)
            results[policy] = asyncio.run(two_tenants(base, model, args))
    rows = []
    for policy, by_tenant in results.items():
        for tenant, r in by_tenant.items():
            rows.append(
                [
                    f"{policy} / {tenant}",
                    f"{r['completed']}/{r['completed'] + r['failed']}",
                    f"{r['median_ttft_ms']:.0f}",
                    f"{r['p99_ttft_ms']:.0f}",
                    f"{r['output_throughput']:.1f}",
                ]
            )
    table = format_table(["policy / tenant", "done", "TTFT p50", "TTFT p99", "out tok/s"], rows)
    print(table)
    report = {"config": vars(args), "results": results}
    (out_dir / "fairness.json").write_text(json.dumps(report, indent=2))
    (out_dir / "summary.txt").write_text(table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
