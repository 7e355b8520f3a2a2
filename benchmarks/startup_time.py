"""Seconds from starting a server to its first healthy answer, side by side in one run.

Starts, one after the other, ``pagellm serve`` (captured decode steps, the default),
``pagellm serve --enforce-eager`` and vLLM's CPU server (``benchmarks/vllm_cli.py`` in
``--vllm-python``'s venv, with ``VLLM_CPU_NUM_OF_RESERVED_CPU=0``), each ``--repeats`` times,
and times each from launch to ``GET /health`` answering 200 (servers bind 127.0.0.1 on free
ports and are stopped after). Prints a table headed by the CPU and writes JSON.

    python benchmarks/startup_time.py --output-json results/step14/startup.json
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from pagellm.bench import report as rep
from pagellm.bench.processes import free_port, running_process

HERE = Path(__file__).resolve().parent
PAGELLM = [sys.executable, "-m", "pagellm.cli", "serve", "--log-level", "warning"]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--vllm-python", default="/tmp/vllm-venv/bin/python")
    p.add_argument("--vllm-model", default="/tmp/smol-bf16-hf")
    p.add_argument("--skip-vllm", action="store_true")
    p.add_argument("--kv-cache-gib", type=int, default=2, help="vLLM's VLLM_CPU_KVCACHE_SPACE")
    p.add_argument("--timeout", type=float, default=900.0)
    p.add_argument("--output-json", default=None)
    return p.parse_args(argv)


def time_to_healthy(cmd: list[str], env: dict[str, str], port: int, timeout: float) -> float:
    with tempfile.NamedTemporaryFile(suffix=".log", delete=False) as log:
        log_path = log.name
    start = time.perf_counter()
    with running_process(cmd, f"http://127.0.0.1:{port}", log_path, timeout, env=env):
        elapsed = time.perf_counter() - start
    os.unlink(log_path)
    return elapsed


def systems(args: argparse.Namespace) -> list[tuple[str, list[str], dict[str, str]]]:
    common = ["--dtype", args.dtype, "--max-model-len", str(args.max_model_len)]
    env = dict(os.environ)
    out = [
        ("pagellm serve (captured)", [*PAGELLM, *common], env),
        ("pagellm serve --enforce-eager", [*PAGELLM, *common, "--enforce-eager"], env),
    ]
    if not args.skip_vllm:
        vllm = [args.vllm_python, str(HERE / "vllm_cli.py"), "serve", args.vllm_model, *common,
                "--host", "127.0.0.1"]  # fmt: skip
        vllm_env = dict(env, VLLM_CPU_NUM_OF_RESERVED_CPU="0",
                        VLLM_CPU_KVCACHE_SPACE=str(args.kv_cache_gib))  # fmt: skip
        out.append(("vllm serve", vllm, vllm_env))
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    runs: dict[str, list[float]] = {}
    for _ in range(args.repeats):
        for label, cmd, env in systems(args):
            port = free_port()
            runs.setdefault(label, []).append(
                time_to_healthy([*cmd, "--port", str(port)], env, port, args.timeout)
            )
    report = {
        "benchmark": "startup_time",
        "results": [
            {"system": k, "seconds": v, "median_s": statistics.median(v)} for k, v in runs.items()
        ],  # fmt: skip
        "environment": rep.environment(),
    }
    if args.output_json:
        rep.write_report(args.output_json, report)
    rows = [[r["system"], f"{r['median_s']:.1f}", " ".join(f"{s:.1f}" for s in r["seconds"])]
            for r in report["results"]]  # fmt: skip
    print(rep.cpu_line(report["environment"]))
    print(rep.format_table(["system", "median s to healthy", "runs"], rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
