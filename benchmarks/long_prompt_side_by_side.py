"""pagellm serve and vLLM's CPU server under ``pagellm bench long-prompt``, in one run.

For each system: start it on a free loopback port (same model weights, dtype and
``--max-model-len``), run ``pagellm bench long-prompt`` with ``--server-pid`` (peak RSS of the
server's process tree), optionally the fairness scenario too, stop it; then print one table with
both systems per prompt length and the ratios. Reports go under ``--output-dir``.

    python benchmarks/long_prompt_side_by_side.py --output-dir results/long_prompt \
        --vllm-model /tmp/smol-float32-hf --dtype float32 --fairness
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from pagellm.bench.processes import free_port, running_process

HERE = Path(__file__).resolve().parent
PAGELLM = [sys.executable, "-m", "pagellm.cli"]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--input-lens", default="1024,4096,8000")
    p.add_argument("--num-prompts", type=int, default=3)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--max-model-len", type=int, default=8192)
    p.add_argument("--output-dir", default="results/long_prompt")
    p.add_argument("--pagellm-extra", default="", help="extra flags for pagellm serve")
    p.add_argument("--vllm-python", default="/tmp/vllm-venv/bin/python")
    p.add_argument("--vllm-model", default="/tmp/smol-float32-hf", help="'' skips vLLM")
    p.add_argument("--vllm-extra", default="", help="extra flags for vllm serve")
    p.add_argument("--skip-pagellm", action="store_true")
    p.add_argument("--fairness", action="store_true", help="also run the fairness scenario")
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--baseline-s", type=float, default=10.0)
    p.add_argument("--kv-cache-gib", type=int, default=4)
    p.add_argument("--start-timeout", type=float, default=900.0)
    return p.parse_args(argv)


def bench(base: str, pid: int, args: argparse.Namespace, out: Path, label: str, fair: bool):
    cmd = [
        *PAGELLM, "bench", "long-prompt", "--base-url", base, "--server-pid", str(pid),
        "--label", label, "--output-json", str(out), "--output-len", str(args.output_len),
    ]  # fmt: skip
    if fair:
        cmd += ["--fairness", "--streams", str(args.streams), "--baseline-s", str(args.baseline_s)]
    else:
        cmd += ["--input-lens", args.input_lens, "--num-prompts", str(args.num_prompts)]
    subprocess.run(cmd, check=False)
    return json.loads(out.read_text())


def run_system(args, out_dir: Path, name: str, cmd: list[str], env: dict[str, str]) -> dict:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    cmd = [*cmd, "--port", str(port)]
    result = {}
    with running_process(cmd, base, out_dir / f"{name}_server.log", args.start_timeout, env) as p:
        result["lengths"] = bench(base, p.pid, args, out_dir / f"{name}.json", name, False)
        if args.fairness:
            path = out_dir / f"{name}_fairness.json"
            result["fairness"] = bench(base, p.pid, args, path, name, True)
    return result


def pagellm_cmd(args) -> list[str]:
    return [
        *PAGELLM, "serve", "--dtype", args.dtype, "--max-model-len", str(args.max_model_len),
        "--kv-cache-memory", str(args.kv_cache_gib), "--log-level", "warning",
        *args.pagellm_extra.split(),
    ]  # fmt: skip


def vllm_cmd(args) -> list[str]:
    return [
        args.vllm_python, str(HERE / "vllm_cli.py"), "serve", args.vllm_model,
        "--dtype", args.dtype, "--max-model-len", str(args.max_model_len), "--host", "127.0.0.1",
        *args.vllm_extra.split(),
    ]  # fmt: skip


def render(runs: dict[str, dict]) -> str:
    from pagellm.bench.report import cpu_line, format_table

    first = next(iter(runs.values()))["lengths"]
    lines = [cpu_line(first["environment"])]
    names = list(runs)
    rows = []
    for i, row in enumerate(first["lengths"]):
        cells = [str(row["input_len"])]
        for name in names:
            r = runs[name]["lengths"]["lengths"][i]
            cells += [_f(r["ttft_p50_ms"], 0), _f(r["itl_p50_ms"]), _f(r["peak_rss_mib"], 0)]
        if len(names) == 2:
            a, b = (runs[n]["lengths"]["lengths"][i] for n in names)
            cells += [
                _ratio(a["ttft_p50_ms"], b["ttft_p50_ms"]),
                _ratio(a["itl_p50_ms"], b["itl_p50_ms"]),
            ]
        rows.append(cells)
    headers = ["prompt tokens"]
    for name in names:
        headers += [f"{name} TTFT p50", f"{name} ITL p50", f"{name} peak RSS MiB"]
    if len(names) == 2:
        headers += ["TTFT ratio", "ITL ratio"]
    lines.append(format_table(headers, rows))
    fair = {n: r["fairness"]["fairness"] for n, r in runs.items() if "fairness" in r}
    if fair:
        frows = [
            [n, _f(f["itl_before_p99_ms"]), _f(f["itl_during_p99_ms"]), _f(f["p99_ratio"], 2),
             _f(f.get("itl_after_p99_ms")), _f(f.get("p99_ratio_after"), 2),
             _f(f["long_ttft_ms"], 0)]
            for n, f in fair.items()
        ]  # fmt: skip
        lines.append(
            format_table(
                [
                    "fairness",
                    "ITL p99 before",
                    "ITL p99 during",
                    "ratio",
                    "ITL p99 after",
                    "during / after",
                    "long prompt TTFT",
                ],
                frows,
            )
        )
    return "\n".join(lines)


def _f(v, digits: int = 1) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def _ratio(a, b) -> str:
    return "-" if not a or not b else f"{a / b:.2f}"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out_dir = Path(args.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    runs: dict[str, dict] = {}
    if not args.skip_pagellm:
        runs["pagellm"] = run_system(args, out_dir, "pagellm", pagellm_cmd(args), dict(os.environ))
    if args.vllm_model:
        env = dict(
            os.environ,
            VLLM_CPU_KVCACHE_SPACE=str(args.kv_cache_gib),
            VLLM_CPU_NUM_OF_RESERVED_CPU="0",
        )
        runs["vllm"] = run_system(args, out_dir, "vllm", vllm_cmd(args), env)
    table = render(runs)
    (out_dir / "summary.txt").write_text(table + "\n")
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
