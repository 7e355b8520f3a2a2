"""Speculative decoding on and off, side by side in one run, at one or more concurrencies.

For each concurrency in ``--concurrency-levels`` and each server variant (default: plain
``pagellm serve`` and the same with ``--speculative-config``), start the server on a free
loopback port, run ``pagellm bench serve`` over the saved workload, stop it. Prints the CPU, then
one table: output tok/s and its ratio to the first variant at the same concurrency, TTFT / ITL /
TPOT medians, and the server's acceptance rate and mean acceptance length. Reports go under
``--output-dir``.

    pagellm bench serve --dataset edit --num-prompts 8 --save-workload edit.json ...
    python benchmarks/spec_side_by_side.py --workload edit.json --concurrency-levels 1
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from serve_side_by_side import run_pagellm  # noqa: E402

DEFAULT_SPEC = (
    '{"method":"ngram","num_speculative_tokens":4,"prompt_lookup_min":2,"prompt_lookup_max":5}'
)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--workload", required=True, help="saved workload JSON (bench --save-workload)")
    p.add_argument("--num-prompts", type=int, default=None, help="use the first N (default all)")
    p.add_argument("--concurrency-levels", default="1", help="comma-separated, e.g. 1,32")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--output-dir", default="results/spec")
    p.add_argument("--extra", default="", help="flags for every server (no spaces in values)")
    p.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="LABEL=FLAGS",
        help="a server to run (repeatable; the first is the baseline); default: 'no spec' and "
        f"'ngram' (--speculative-config {DEFAULT_SPEC})",
    )
    p.add_argument("--request-rate", default=None, help="passed to bench serve (Poisson)")
    return p.parse_args(argv)


def render(rows: list[tuple[int, dict, dict]]) -> str:
    from pagellm.bench.report import cpu_line, format_table

    table = []
    for concurrency, run, base in rows:
        res, server = run["results"], run.get("server") or {}
        rate = server.get("spec_acceptance_rate")
        length = server.get("spec_mean_acceptance_length")
        ratio = res["output_throughput"] / base["results"]["output_throughput"]
        table.append(
            [
                str(concurrency),
                run["label"],
                f"{res['output_throughput']:.1f}",
                f"{ratio:.2f}",
                f"{res['median_ttft_ms']:.0f}",
                f"{res['median_itl_ms']:.1f}",
                f"{res['median_tpot_ms']:.1f}",
                "-" if rate is None else f"{rate:.1%}",
                "-" if length is None else f"{length:.2f}",
            ]
        )
    headers = [
        "streams", "server", "out tok/s", "vs first", "TTFT p50", "ITL p50", "TPOT p50",
        "accepted", "mean acc. len",
    ]  # fmt: skip
    return "\n".join([cpu_line(rows[0][1]["environment"]), format_table(headers, table)])


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out_dir = Path(args.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    variants = [v.split("=", 1) for v in args.variant] or [
        ["no spec", ""],
        ["ngram", f"--speculative-config {DEFAULT_SPEC}"],
    ]
    rows = []
    for concurrency in [int(c) for c in args.concurrency_levels.split(",")]:
        run_args = argparse.Namespace(**vars(args), concurrency=concurrency)
        level_dir = out_dir / f"c{concurrency}"
        level_dir.mkdir(exist_ok=True)
        runs = [
            run_pagellm(run_args, level_dir, label, f"{args.extra} {flags}")
            for label, flags in variants
        ]
        rows += [(concurrency, run, runs[0]) for run in runs]
    table = render(rows)
    (out_dir / "summary.txt").write_text(table + "\n")
    (out_dir / "summary.json").write_text(
        json.dumps([{"concurrency": c, "run": r} for c, r, _ in rows], indent=1)
    )
    print(f"\nworkload {args.workload} (ms for latencies)")
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
