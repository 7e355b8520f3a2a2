"""``pagellm bench batch-invariant``: what ``--batch-invariant`` costs, side by side in one run.

For each mode (off, then on; ``--rounds`` repeats the pair): offline throughput of random
prompts (``--offline-prompts`` x ``--input-len`` / ``--output-len``, ``pagellm bench
throughput`` in its own process), then a ``pagellm serve`` process streaming the same kind of
requests at each of ``--concurrency`` (``--requests-per-stream`` requests per stream, greedy,
EOS ignored). Reports out tok/s and ITL / TTFT p50 per point and mode, and on/off ratios, as
JSON (``--output-json``) and a table headed by the CPU model.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from pagellm.bench import report as rep

MODES = {"off": (), "on": ("--batch-invariant",)}


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "batch-invariant", help="throughput and latency with --batch-invariant on vs off"
    )
    p.add_argument("--model", default=None, help="default: the embedded default model")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument(
        "--quantization",
        default="none",
        help="both modes (the mode computes with dense weights: none compares like with like)",
    )
    p.add_argument("--kv-cache-memory", type=float, default=2.0)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--offline-prompts", type=int, default=256, help="0 skips the offline run")
    p.add_argument("--concurrency", default="1,8,32", help="streams per online point ('' none)")
    p.add_argument("--requests-per-stream", type=int, default=4)
    p.add_argument("--rounds", type=int, default=1, help="off/on pairs")
    p.add_argument("--extra-args", default="", help="more engine flags for both modes")
    p.add_argument("--output-json", default=None)
    p.set_defaults(func=run)
    return p


def _engine_flags(args: argparse.Namespace, mode: str) -> list[str]:
    flags = ["--dtype", args.dtype, "--kv-cache-memory", str(args.kv_cache_memory),
             "--quantization", args.quantization]  # fmt: skip
    if args.model:
        flags += ["--model", args.model]
    return flags + args.extra_args.split() + list(MODES[mode])


def offline(args: argparse.Namespace, mode: str, workdir: Path) -> dict[str, Any]:
    """One ``pagellm bench throughput`` process; its engine figures."""
    out = workdir / f"offline-{mode}.json"
    cmd = [sys.executable, "-m", "pagellm.cli", "bench", "throughput", "--dataset", "random",
           "--input-len", str(args.input_len), "--output-len", str(args.output_len),
           "--num-prompts", str(args.offline_prompts), "--no-progress", "--output-json",
           str(out), *_engine_flags(args, mode)]  # fmt: skip
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    engine = json.loads(out.read_text())["engine"]
    return {"output_tokens_per_s": engine["output_tokens_per_s"], "elapsed_s": engine["elapsed_s"]}


def online(args: argparse.Namespace, mode: str, workdir: Path) -> dict[str, dict[str, Any]]:
    """A server in ``mode``; each concurrency's out tok/s, ITL and TTFT."""
    from pagellm.bench.datasets import random_workload
    from pagellm.bench.processes import free_port, running_process
    from pagellm.bench.serve import resolve_model, run_requests, summarize

    port = free_port()
    base = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "pagellm.cli", "serve", "--port", str(port),
           "--log-level", "warning", *_engine_flags(args, mode)]  # fmt: skip
    points: dict[str, dict[str, Any]] = {}
    with running_process(cmd, base, workdir / f"serve-{mode}.log", timeout=600):
        model = resolve_model(base, None)
        warm = random_workload(4, 16, 8, 30000, seed=99)
        asyncio.run(run_requests(base, "/v1/completions", model, warm, max_concurrency=4))
        for c in _concurrencies(args):
            reqs = random_workload(
                c * args.requests_per_stream, args.input_len, args.output_len, 30000, seed=c
            )
            results, duration = asyncio.run(
                run_requests(base, "/v1/completions", model, reqs, max_concurrency=c)
            )
            s = summarize(results, duration)
            if s["failed"]:
                raise RuntimeError(f"{mode} at {c} streams: {s['failed']} failed: {s['errors']}")
            points[f"{c} streams"] = {
                "output_tokens_per_s": s["output_throughput"],
                "itl_p50_ms": s["median_itl_ms"],
                "ttft_p50_ms": s["median_ttft_ms"],
            }
    return points


def _concurrencies(args: argparse.Namespace) -> list[int]:
    return [int(c) for c in args.concurrency.split(",") if c.strip()]


def run(args: argparse.Namespace) -> int:
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="pagellm-bi-") as tmp:
        for r in range(args.rounds):
            for mode in MODES:
                points = {}
                if args.offline_prompts:
                    label = f"offline {args.offline_prompts} x {args.input_len}/{args.output_len}"
                    points[label] = offline(args, mode, Path(tmp))
                if _concurrencies(args):
                    points.update(online(args, mode, Path(tmp)))
                runs.append({"round": r, "mode": mode, "points": points})
    report = {
        "benchmark": "batch-invariant",
        "config": {k: v for k, v in vars(args).items() if k != "func"},
        "environment": rep.environment(),
        "git_sha": rep.git_sha(),
        "runs": runs,
        "summary": summarize_runs(runs),
    }
    if args.output_json:
        rep.write_report(args.output_json, report)
    print(render(report))
    return 0


def summarize_runs(runs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per point: the median of each figure per mode over the rounds, and on/off ratios."""
    summary: dict[str, dict[str, Any]] = {}
    for point in runs[0]["points"]:
        row: dict[str, Any] = {}
        for mode in MODES:
            figures = [r["points"][point] for r in runs if r["mode"] == mode]
            for key in figures[0]:
                values = [f[key] for f in figures if f[key] is not None]
                row[f"{mode}_{key}"] = statistics.median(values) if values else None
        off, on = row["off_output_tokens_per_s"], row["on_output_tokens_per_s"]
        row["throughput_ratio"] = on / off if off else None
        if row.get("off_itl_p50_ms"):
            row["itl_ratio"] = row["on_itl_p50_ms"] / row["off_itl_p50_ms"]
        summary[point] = row
    return summary


def render(report: dict[str, Any]) -> str:
    headers = ["point", "off tok/s", "on tok/s", "on/off", "off ITL p50", "on ITL p50",
               "off TTFT p50", "on TTFT p50"]  # fmt: skip
    rows = []
    for point, s in report["summary"].items():
        rows.append([
            point, f"{s['off_output_tokens_per_s']:.1f}", f"{s['on_output_tokens_per_s']:.1f}",
            f"{s['throughput_ratio']:.3f}", _ms(s.get("off_itl_p50_ms")),
            _ms(s.get("on_itl_p50_ms")), _ms(s.get("off_ttft_p50_ms")),
            _ms(s.get("on_ttft_p50_ms")),
        ])  # fmt: skip
    cfg = report["config"]
    title = (
        f"--batch-invariant off vs on ({cfg['dtype']}, {cfg['rounds']} round(s), medians)\n"
        + rep.cpu_line(report["environment"])
    )
    return title + "\n" + rep.format_table(headers, rows)


def _ms(value: float | None) -> str:
    return f"{value:.1f} ms" if value is not None else "-"
