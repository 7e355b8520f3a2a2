"""Benchmark figures: one timed phase's rates, the JSON report and its plain-text table."""

from __future__ import annotations

import datetime
import json
import resource
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass(slots=True)
class PhaseResult:
    """One timed run over a set of requests; ``extra`` holds phase-specific figures."""

    num_requests: int
    prompt_tokens: int
    output_tokens: int
    elapsed_s: float
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        elapsed = self.elapsed_s if self.elapsed_s > 0 else float("nan")
        return {
            "num_requests": self.num_requests,
            "prompt_tokens": self.prompt_tokens,
            "output_tokens": self.output_tokens,
            "elapsed_s": self.elapsed_s,
            "requests_per_s": self.num_requests / elapsed,
            "output_tokens_per_s": self.output_tokens / elapsed,
            "total_tokens_per_s": (self.prompt_tokens + self.output_tokens) / elapsed,
            **self.extra,
        }


def peak_rss_mib() -> float:
    """Max resident set size of this process so far (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def current_rss_mib() -> float | None:
    """Resident set size now (Linux only), to tell a load-time peak from the steady state."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def git_sha() -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            cwd=Path(__file__).resolve().parent,
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_int8")
"""The /proc/cpuinfo flags that decide which kernels run (printed with every table)."""


def cpu_info() -> dict[str, Any]:
    """The CPU model and its relevant instruction sets (Linux; unknown elsewhere)."""
    model, flags = "unknown", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and model == "unknown":
                model = value.strip()
            elif key.strip() == "flags" and not flags:
                flags = set(value.split())
    except OSError:
        pass
    return {"cpu_model": model, "cpu_isa": [f for f in ISA_FLAGS if f in flags]}


def cpu_line(env: dict[str, Any]) -> str:
    """One line naming the CPU, for the top of a printed table."""
    isa = ", ".join(env.get("cpu_isa") or []) or "no AVX2"
    return f"CPU: {env.get('cpu_model', 'unknown')} ({isa}), {env.get('num_threads')} threads"


def environment() -> dict[str, Any]:
    import platform

    import torch

    return {
        "torch_version": torch.__version__,
        "num_threads": torch.get_num_threads(),
        "python_version": platform.python_version(),
        "machine": platform.machine(),
        **cpu_info(),
    }


def _ratio(engine: dict[str, Any], base: dict[str, Any] | None) -> float | None:
    if not base or not base.get("output_tokens_per_s"):
        return None
    return engine["output_tokens_per_s"] / base["output_tokens_per_s"]


def build_report(
    config: dict[str, Any],
    engine: dict[str, Any],
    baseline: dict[str, dict[str, Any] | None] | None = None,
    workload: dict[str, Any] | None = None,
    env: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The JSON document: engine figures, HF baselines (or nulls), ratios and provenance."""
    base = {"hf_single": None, "hf_static": None, **(baseline or {})}
    return {
        "benchmark": "throughput",
        "timestamp": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "git_sha": git_sha(),
        **(env if env is not None else environment()),
        "config": config,
        "workload": workload,
        "engine": engine,
        "baseline": base,
        "ratios": {
            "vs_hf_single": _ratio(engine, base["hf_single"]),
            "vs_hf_static": _ratio(engine, base["hf_static"]),
        },
    }


def write_report(path: str | Path, report: dict[str, Any]) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(report, f, indent=2)
        f.write("\n")


def format_table(headers: list[str], rows: list[list[str]]) -> str:
    """Aligned plain-text columns: first column left-aligned, the rest right-aligned."""
    widths = [max(len(str(r[i])) for r in [headers, *rows]) for i in range(len(headers))]

    def line(cells: list[str]) -> str:
        parts = [
            str(c).ljust(w) if i == 0 else str(c).rjust(w)
            for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        ]
        return "  ".join(parts).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(headers), rule, *(line(r) for r in rows)])


_HEADERS = ["system", "requests", "out tokens", "elapsed s", "req/s", "out tok/s", "total tok/s"]


def _row(name: str, phase: dict[str, Any]) -> list[str]:
    return [
        name,
        str(phase["num_requests"]),
        str(phase["output_tokens"]),
        f"{phase['elapsed_s']:.2f}",
        f"{phase['requests_per_s']:.2f}",
        f"{phase['output_tokens_per_s']:.1f}",
        f"{phase['total_tokens_per_s']:.1f}",
    ]


def render(report: dict[str, Any]) -> str:
    """The human-readable summary printed after a run."""
    cfg, engine, base = report["config"], report["engine"], report["baseline"]
    rows = [_row("pagellm", engine)]
    if base["hf_single"]:
        rows.append(_row("hf single", base["hf_single"]))
    if base["hf_static"]:
        rows.append(_row(f"hf static (bs {base['hf_static']['batch_size']})", base["hf_static"]))
    source = (
        f"workload={cfg['workload']}" if cfg.get("workload") else f"dataset={cfg.get('dataset')}"
    )
    lines = [
        cpu_line(report),
        f"pagellm bench throughput: {source} dtype={cfg.get('resolved_dtype', cfg.get('dtype'))} "
        f"device={cfg.get('resolved_device', 'cpu')} threads={report.get('num_threads')} torch={report.get('torch_version')}",
        format_table(_HEADERS, rows),
        f"pagellm: peak memory {engine['peak_memory_mib']:.0f} MiB{_rss_after(engine)}, "
        f"peak KV usage {100 * engine['peak_kv_usage_frac']:.1f}%, "
        f"KV waste at peak {100 * engine['kv_waste_frac']:.1f}%, "
        f"preemptions {engine['num_preemptions']}, steps {engine['num_steps']}",
    ]
    if engine.get("spec_num_drafts"):
        lines.append(spec_line(engine))
    lines += _ratio_lines(report)
    return "\n".join(lines)


def spec_counters(drafts: float, draft_tokens: float, accepted: float) -> dict[str, float | None]:
    """vLLM's speculative-decoding summary: acceptance rate (accepted / proposed tokens) and
    mean acceptance length (tokens a verify step gives a sequence: 1 + accepted / drafts)."""
    return {
        "spec_num_drafts": drafts,
        "spec_num_draft_tokens": draft_tokens,
        "spec_num_accepted_tokens": accepted,
        "spec_acceptance_rate": accepted / draft_tokens if draft_tokens else None,
        "spec_mean_acceptance_length": 1 + accepted / drafts if drafts else None,
    }


def spec_line(figures: dict[str, Any]) -> str:
    return (
        f"speculative decoding: {figures['spec_num_drafts']:.0f} drafts, "
        f"{figures['spec_num_draft_tokens']:.0f} proposed tokens, "
        f"{figures['spec_num_accepted_tokens']:.0f} accepted: acceptance rate "
        f"{figures['spec_acceptance_rate']:.1%}, mean acceptance length "
        f"{figures['spec_mean_acceptance_length']:.2f}"
    )


def _rss_after(engine: dict[str, Any]) -> str:
    rss = engine.get("rss_after_run_mib")
    return f" ({rss:.0f} MiB after the run)" if rss is not None else ""


def _ratio_lines(report: dict[str, Any]) -> list[str]:
    ratios, base = report["ratios"], report["baseline"]
    parts = [f"{v:.2f}x vs {k[3:].replace('_', ' ')}" for k, v in ratios.items() if v is not None]
    if not parts:
        return []
    subsets = [f"{name}: first {b['num_requests']}" for name, b in base.items() if b]
    total = report["engine"]["num_requests"]
    return [
        "output tok/s speed-up: " + ", ".join(parts),
        f"note: baselines ran on prompt subsets ({', '.join(subsets)} of {total} prompts)",
    ]
