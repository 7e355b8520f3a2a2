"""Speculative decoding on and off, side by side in one run, at one or more concurrencies.

For each concurrency in ``--concurrency-levels`` and each server variant (default: plain
``pagellm serve`` and the same with ``--speculative-config``), start the server on a free
loopback port, run ``pagellm bench serve`` over the saved workload, stop it. Prints the CPU, then
one table: output tok/s and its ratio to the first variant at the same concurrency, TTFT / ITL /
TPOT medians, and the server's acceptance rate and mean acceptance length. With ``--repeats N``
the variants run in turn N times and the ratios are taken within each round. Reports go under
``--output-dir``.

    python benchmarks/spec_side_by_side.py --dataset edit --num-prompts 8 --repeats 2
    python benchmarks/spec_side_by_side.py --workload saved.json --concurrency-levels 1,32
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
    p.add_argument("--workload", default=None, help="saved workload JSON (bench --save-workload)")
    p.add_argument(
        "--dataset",
        choices=["edit", "sharegpt"],
        default="edit",
        help="without --workload: build this one (ShareGPT), saved under --output-dir",
    )
    p.add_argument("--output-len", type=int, default=None, help="sharegpt: cap every reply")
    p.add_argument("--seed", type=int, default=0)
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
    p.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="rounds of all variants in turn (A B A B ...): this machine's speed drifts, so "
        "ratios are taken within a round and the table shows their mean and range",
    )
    return p.parse_args(argv)


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def render(rows: list[tuple[int, list[dict], list[dict]]]) -> str:
    """One line per (concurrency, variant): means over the rounds; the ratio to the first
    variant is taken within each round, then averaged (its range in brackets)."""
    from pagellm.bench.report import cpu_line, format_table

    table = []
    for concurrency, runs, bases in rows:
        res = [r["results"] for r in runs]
        ratios = [
            r["output_throughput"] / b["results"]["output_throughput"]
            for r, b in zip(res, bases, strict=True)
        ]
        spread = f" [{min(ratios):.2f}-{max(ratios):.2f}]" if len(ratios) > 1 else ""
        server = [r.get("server") or {} for r in runs]
        rate = [s["spec_acceptance_rate"] for s in server if s.get("spec_acceptance_rate")]
        length = [
            s["spec_mean_acceptance_length"] for s in server if s.get("spec_mean_acceptance_length")
        ]
        table.append(
            [
                str(concurrency),
                runs[0]["label"],
                f"{_mean([r['output_throughput'] for r in res]):.1f}",
                f"{_mean(ratios):.2f}{spread}",
                f"{_mean([r['median_ttft_ms'] for r in res]):.0f}",
                f"{_mean([r['median_itl_ms'] for r in res]):.1f}",
                f"{_mean([r['median_tpot_ms'] for r in res]):.1f}",
                f"{_mean(rate):.1%}" if rate else "-",
                f"{_mean(length):.2f}" if length else "-",
            ]
        )
    headers = [
        "streams", "server", "out tok/s", "vs first", "TTFT p50", "ITL p50", "TPOT p50",
        "accepted", "mean acc. len",
    ]  # fmt: skip
    return "\n".join([cpu_line(rows[0][1][0]["environment"]), format_table(headers, table)])


def build_workload(args: argparse.Namespace, out_dir: Path) -> Path:
    """The ``--dataset`` workload of ``--num-prompts`` (default 8) requests, written as JSON."""
    from pagellm.bench.datasets import save_workload
    from pagellm.bench.throughput import WorkloadSpec, build_workload_isolated
    from pagellm.fetch import fetch_sharegpt

    spec = WorkloadSpec(
        args.dataset, args.num_prompts or 8, None, args.output_len, args.seed, None,
        str(fetch_sharegpt()),
    )  # fmt: skip
    path = out_dir / f"{args.dataset}_workload.json"
    save_workload(path, build_workload_isolated(spec))
    return path


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out_dir = Path(args.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if args.workload is None:
        args.workload = str(build_workload(args, out_dir))
    variants = [v.split("=", 1) for v in args.variant] or [
        ["no spec", ""],
        ["ngram", f"--speculative-config {DEFAULT_SPEC}"],
    ]
    rows = []
    for concurrency in [int(c) for c in args.concurrency_levels.split(",")]:
        run_args = argparse.Namespace(**vars(args), concurrency=concurrency)
        rounds = []
        for i in range(args.repeats):
            round_dir = out_dir / f"c{concurrency}" / f"round{i}"
            round_dir.mkdir(parents=True, exist_ok=True)
            rounds.append(
                [
                    run_pagellm(run_args, round_dir, label, f"{args.extra} {flags}")
                    for label, flags in variants
                ]
            )
        bases = [r[0] for r in rounds]
        rows += [(concurrency, [r[v] for r in rounds], bases) for v in range(len(variants))]
    table = render(rows)
    (out_dir / "summary.txt").write_text(table + "\n")
    (out_dir / "summary.json").write_text(
        json.dumps([{"concurrency": c, "runs": r} for c, r, _ in rows], indent=1)
    )
    print(f"\nworkload {args.workload} (ms for latencies)")
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
