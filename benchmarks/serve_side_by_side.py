"""Offline engine vs pagellm's server vs vLLM's server on one saved workload, in one run.

1. ``pagellm bench throughput`` over the workload with ``--max-num-seqs C`` (offline, same
   concurrency); 2. ``pagellm serve`` + ``pagellm bench serve --max-concurrency C``;
3. ``vllm serve`` (vLLM's CPU build, run through ``benchmarks/vllm_cli.py``) + the same
   ``pagellm bench serve`` command, once per ``--vllm-reserved-cpus`` value. Every report is
written under ``--output-dir`` and a table of the figures and ratios is printed at the end.
Servers bind 127.0.0.1 on free ports and are stopped afterwards.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

from pagellm.bench.processes import free_port, running_process

HERE = Path(__file__).resolve().parent
PAGELLM = [sys.executable, "-m", "pagellm.cli"]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--workload", required=True, help="saved workload JSON (bench --save-workload)")
    p.add_argument("--num-prompts", type=int, default=None, help="use the first N (default all)")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--output-dir", default="results/serve")
    p.add_argument("--skip-offline", action="store_true")
    p.add_argument("--skip-pagellm", action="store_true")
    p.add_argument("--pagellm-extra", default="", help="extra flags for pagellm serve")
    p.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="LABEL=FLAGS",
        help="a pagellm server to run (repeatable), e.g. 'no cache=--no-enable-prefix-caching'; "
        "default: one, 'pagellm serve' with --pagellm-extra",
    )
    p.add_argument("--request-rate", default=None, help="passed to bench serve (Poisson)")
    p.add_argument("--vllm-python", default="/tmp/vllm-venv/bin/python")
    p.add_argument("--vllm-model", default="/tmp/smol-bf16-hf", help="HF folder (bench throughput)")
    p.add_argument(
        "--vllm-reserved-cpus",
        default="default,0",
        help="VLLM_CPU_NUM_OF_RESERVED_CPU per vLLM run ('default' leaves it unset; '' skips vLLM)",
    )
    p.add_argument("--kv-cache-gib", type=int, default=2)
    return p.parse_args(argv)


@contextlib.contextmanager
def server(cmd: list[str], port: int, env: dict[str, str], log: Path) -> Iterator[str]:
    base = f"http://127.0.0.1:{port}"
    with running_process(cmd, base, log, timeout=600, env=env, grace=60):
        yield base


def add_gateway_bench_args(p: argparse.ArgumentParser, output_dir: str) -> None:
    """The flags the gateway benchmarks share (workload, load, the replicas' settings)."""
    p.add_argument("--workload", required=True)
    p.add_argument("--num-prompts", type=int, default=96)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--output-dir", default=output_dir)
    p.add_argument("--request-rate", default=None)


def write_summary(out: Path, table: str, name: str, payload: dict) -> None:
    """Print the table and keep it (summary.txt) beside the runs' JSON (NAME.json)."""
    print(table)
    (out / "summary.txt").write_text(table + "\n")
    (out / f"{name}.json").write_text(json.dumps(payload))


def replica_cmd(args: argparse.Namespace, port: int) -> list[str]:
    """`pagellm serve` for a gateway benchmark's replica: without prefix caching, because the
    runs repeat one workload and no run may reuse another's KV."""
    return [
        *PAGELLM, "serve", "--port", str(port), "--dtype", args.dtype,
        "--max-model-len", str(args.max_model_len), "--log-level", "warning",
        "--no-enable-prefix-caching",
    ]  # fmt: skip


def bench_serve(base: str, args: argparse.Namespace, out: Path, label: str) -> dict:
    cmd = [
        *PAGELLM, "bench", "serve", "--base-url", base, "--workload", args.workload,
        "--num-prompts", str(args.num_prompts or 10**9), "--max-concurrency",
        str(args.concurrency), "--label", label, "--output-json", str(out),
    ]  # fmt: skip
    if args.request_rate:
        cmd += ["--request-rate", str(args.request_rate)]
    subprocess.run(cmd, check=True)
    return json.loads(out.read_text())


def run_offline(args: argparse.Namespace, out_dir: Path) -> dict:
    out = out_dir / "offline.json"
    workload = args.workload
    if args.num_prompts:
        workload = str(out_dir / "workload.json")
        reqs = json.loads(Path(args.workload).read_text())[: args.num_prompts]
        Path(workload).write_text(json.dumps(reqs))
    cmd = [
        *PAGELLM, "bench", "throughput", "--workload", workload, "--dtype", args.dtype,
        "--max-num-seqs", str(args.concurrency), "--max-model-len", str(args.max_model_len),
        "--no-progress", "--output-json", str(out),
    ]  # fmt: skip
    subprocess.run(cmd, check=True)
    return json.loads(out.read_text())


def run_pagellm(args: argparse.Namespace, out_dir: Path, label: str, flags: str) -> dict:
    port = free_port()
    cmd = [
        *PAGELLM, "serve", "--port", str(port), "--dtype", args.dtype,
        "--max-model-len", str(args.max_model_len), "--log-level", "warning", *flags.split(),
    ]  # fmt: skip
    name = "pagellm" if label == "pagellm serve" else "pagellm_" + "_".join(label.split())
    with server(cmd, port, dict(os.environ), out_dir / f"{name}_server.log") as base:
        return bench_serve(base, args, out_dir / f"{name}.json", label)


def run_vllm(args: argparse.Namespace, out_dir: Path, reserved: str) -> dict:
    port = free_port()
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=str(args.kv_cache_gib))
    if reserved != "default":
        env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = reserved
    cmd = [
        args.vllm_python, str(HERE / "vllm_cli.py"), "serve", args.vllm_model,
        "--dtype", args.dtype, "--max-model-len", str(args.max_model_len),
        "--port", str(port), "--host", "127.0.0.1",
    ]  # fmt: skip
    label = f"vllm serve (reserved cpus {reserved})"
    with server(cmd, port, env, out_dir / f"vllm_{reserved}_server.log") as base:
        return bench_serve(base, args, out_dir / f"vllm_reserved_{reserved}.json", label)


def render(offline: dict | None, runs: list[dict]) -> str:
    from pagellm.bench.report import format_table

    base = offline["engine"]["output_tokens_per_s"] if offline else None
    rows = []
    if offline:
        rows.append(["pagellm offline", f"{base:.1f}", "1.00", "-", "-", "-", "-", "-"])
    for r in runs:
        res = r["results"]
        ratio = f"{res['output_throughput'] / base:.2f}" if base else "-"
        rows.append(
            [
                r["label"],
                f"{res['output_throughput']:.1f}",
                ratio,
                f"{res['median_ttft_ms']:.0f}",
                f"{res['p99_ttft_ms']:.0f}",
                f"{res['median_tpot_ms']:.1f}",
                f"{res['median_itl_ms']:.1f}",
                _hit_rate(r.get("server") or {}),
            ]
        )
    headers = [
        "system", "out tok/s", "vs offline", "TTFT p50", "TTFT p99", "TPOT p50", "ITL p50",
        "cache hits",
    ]  # fmt: skip
    return format_table(headers, rows)


def _hit_rate(server: dict) -> str:
    rate = server.get("prefix_cache_hit_rate")
    return "-" if rate is None else f"{rate:.1%}"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out_dir = Path(args.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    offline = None if args.skip_offline else run_offline(args, out_dir)
    variants = [v.split("=", 1) for v in args.variant] or [["pagellm serve", args.pagellm_extra]]
    runs = [] if args.skip_pagellm else [run_pagellm(args, out_dir, *v) for v in variants]
    for reserved in filter(None, args.vllm_reserved_cpus.split(",")):
        runs.append(run_vllm(args, out_dir, reserved))
    table = render(offline, runs)
    (out_dir / "summary.txt").write_text(table + "\n")
    print(f"\nconcurrency {args.concurrency}, workload {args.workload} (ms for latencies)")
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
