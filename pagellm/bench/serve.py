"""``pagellm bench serve``: online benchmark of any OpenAI-compatible server.

Streams ``/v1/completions`` requests (prompt as token ids, greedy, EOS ignored, exact output
lengths) at a Poisson request rate and/or a concurrency cap, times every streamed chunk, and
reports request and token throughput with TTFT, TPOT, ITL and end-to-end latency statistics. When
the server exposes pagellm's engine counters at ``/metrics`` the report adds the server side:
engine busy time, time inside the model executor, and process CPU seconds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pagellm.bench import report as rep
from pagellm.bench.datasets import BenchRequest, load_workload, save_workload, workload_summary

SERVER_COUNTERS = {
    "pagellm:engine_steps": "engine_steps",
    "pagellm:engine_busy_seconds": "engine_busy_seconds",
    "pagellm:engine_execute_seconds": "engine_execute_seconds",
    "pagellm:generation_tokens": "generation_tokens",
    "pagellm:prefix_cache_queries": "prefix_cache_queries",
    "pagellm:prefix_cache_hits": "prefix_cache_hits",
    "pagellm:engine_thread_cpu_seconds": "engine_thread_cpu_seconds",
    "pagellm:api_thread_cpu_seconds": "api_thread_cpu_seconds",
    "process_cpu_seconds": "process_cpu_seconds",
    "pagellm:spec_decode_num_drafts": "spec_num_drafts",
    "pagellm:spec_decode_num_draft_tokens": "spec_num_draft_tokens",
    "pagellm:spec_decode_num_accepted_tokens": "spec_num_accepted_tokens",
}
"""Counters read from /metrics before and after the run (family name -> report key)."""


@dataclass(slots=True)
class RequestResult:
    """What one streamed request measured (times in seconds from its own start)."""

    ok: bool
    prompt_len: int
    output_tokens: int = 0
    ttft: float | None = None
    e2e: float = 0.0
    chunk_gaps: list[float] = field(default_factory=list)
    """Gaps between successive token events after the first (inter-token latencies)."""
    error: str | None = None

    @property
    def tpot(self) -> float | None:
        if not self.ok or self.ttft is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``serve`` under ``pagellm bench``."""
    p = subparsers.add_parser("serve", help="online benchmark of an OpenAI-compatible server")
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--endpoint", default="/v1/completions")
    p.add_argument("--model", default=None, help="model name sent (default: the server's first)")
    p.add_argument(
        "--tokenizer", default=None, help="tokenizer for the dataset (default: the default model)"
    )
    from pagellm.bench.throughput import add_dataset_args

    add_dataset_args(p, default="sharegpt")
    p.add_argument("--num-prompts", type=int, default=200)
    p.add_argument("--workload", default=None, help="load a saved workload instead of building")
    p.add_argument("--save-workload", default=None, help="write the workload JSON here")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--request-rate",
        type=float,
        default=math.inf,
        help="requests per second, Poisson arrivals (default: all at once)",
    )
    p.add_argument("--max-concurrency", type=int, default=None, help="requests in flight at most")
    p.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"))
    p.add_argument("--user", default=None, help="the 'user' field of every request (a tenant)")
    p.add_argument("--request-timeout", type=float, default=600.0)
    p.add_argument("--label", default=None, help="name of this run in the report")
    p.add_argument("--output-json", default=None, help="write the report JSON here")
    p.set_defaults(func=run)
    return p


# ----- one request -----------------------------------------------------------------------


async def stream_request(
    client: Any, url: str, body: dict[str, Any], headers: dict[str, str], prompt_len: int
) -> RequestResult:
    """POST one streaming request and time its chunks; never raises for a failed request."""
    result = RequestResult(ok=False, prompt_len=prompt_len)
    start = time.perf_counter()
    last = start
    chunks = 0
    usage_tokens = None
    try:
        async with client.stream("POST", url, json=body, headers=headers) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")
                result.error = f"HTTP {resp.status_code}: {text[:200]}"
                return result
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                event = json.loads(data)
                if "error" in event:
                    result.error = str(event["error"].get("message", event["error"]))
                    return result
                if event.get("usage"):
                    usage_tokens = event["usage"].get("completion_tokens")
                if not is_token_event(event):
                    continue
                now = time.perf_counter()
                if result.ttft is None:
                    result.ttft = now - start
                else:
                    result.chunk_gaps.append(now - last)
                last = now
                chunks += 1
    except Exception as exc:  # noqa: BLE001 - a failed request is a result, not a crash
        result.error = f"{type(exc).__name__}: {exc}"
        return result
    result.e2e = time.perf_counter() - start
    result.output_tokens = usage_tokens if usage_tokens is not None else chunks
    result.ok = result.ttft is not None
    if not result.ok:
        result.error = "the stream carried no token"
    return result


def is_token_event(event: dict[str, Any]) -> bool:
    """Whether a streamed event brings tokens: any with a choice but a chat stream's opening
    role chunk (usage-only events have none). Its text may be "" (held back: half of a UTF-8
    character, a possible stop string); vLLM's ``bench serve`` counts such events too."""
    choices = event.get("choices") or []
    return bool(choices) and not all("role" in (c.get("delta") or {}) for c in choices)


def request_body(model: str, req: BenchRequest, ignore_eos: bool) -> dict[str, Any]:
    return {
        "model": model,
        "prompt": req.prompt_token_ids,
        "max_tokens": req.output_len,
        "temperature": 0.0,
        "ignore_eos": ignore_eos,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


# ----- the run ----------------------------------------------------------------------------


def arrival_offsets(n: int, rate: float, seed: int) -> list[float]:
    """Send times (seconds from the start): Poisson arrivals at ``rate``, or all at zero."""
    if math.isinf(rate):
        return [0.0] * n
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, size=n)
    return np.cumsum(gaps).tolist()


async def run_requests(
    base_url: str,
    endpoint: str,
    model: str,
    requests: list[BenchRequest],
    *,
    rate: float = math.inf,
    max_concurrency: int | None = None,
    ignore_eos: bool = True,
    api_key: str | None = None,
    seed: int = 0,
    timeout: float = 600.0,
    extra_body: dict[str, Any] | None = None,
) -> tuple[list[RequestResult], float]:
    """Send every request on schedule; returns the results (in workload order) and duration."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limit = max_concurrency or len(requests)
    gate = asyncio.Semaphore(limit)
    offsets = arrival_offsets(len(requests), rate, seed)
    limits = httpx.Limits(max_connections=limit, max_keepalive_connections=limit)
    async with httpx.AsyncClient(
        base_url=base_url, timeout=timeout, limits=limits, trust_env=False
    ) as client:
        start = time.perf_counter()

        async def one(req: BenchRequest, offset: float) -> RequestResult:
            await asyncio.sleep(max(0.0, start + offset - time.perf_counter()))
            async with gate:
                body = {**request_body(model, req, ignore_eos), **(extra_body or {})}
                return await stream_request(
                    client, endpoint, body, headers, len(req.prompt_token_ids)
                )

        results = await asyncio.gather(
            *(one(r, off) for r, off in zip(requests, offsets, strict=True))
        )
        duration = time.perf_counter() - start
    return list(results), duration


def summarize(results: list[RequestResult], duration: float) -> dict[str, Any]:
    """Throughput and latency statistics (milliseconds) over the completed requests."""
    done = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in done)
    prompt_tokens = sum(r.prompt_len for r in done)
    summary: dict[str, Any] = {
        "completed": len(done),
        "failed": len(results) - len(done),
        "duration_s": duration,
        "total_input_tokens": prompt_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput": len(done) / duration if duration else 0.0,
        "output_throughput": out_tokens / duration if duration else 0.0,
        "total_token_throughput": (prompt_tokens + out_tokens) / duration if duration else 0.0,
    }
    series = {
        "ttft": [r.ttft for r in done if r.ttft is not None],
        "tpot": [t for r in done if (t := r.tpot) is not None],
        "itl": [g for r in done for g in r.chunk_gaps],
        "e2el": [r.e2e for r in done],
    }
    for name, values in series.items():
        summary.update(latency_stats(name, values))
    errors = [r.error for r in results if not r.ok]
    summary["errors"] = sorted(set(e for e in errors if e))[:10]
    return summary


def latency_stats(name: str, seconds: list[float]) -> dict[str, float | None]:
    keys = ("mean", "median", "p90", "p99")
    if not seconds:
        return {f"{k}_{name}_ms": None for k in keys}
    ms = np.asarray(seconds) * 1000.0
    values = (ms.mean(), np.median(ms), np.percentile(ms, 90), np.percentile(ms, 99))
    return {f"{k}_{name}_ms": float(v) for k, v in zip(keys, values, strict=True)}


# ----- server-side counters ---------------------------------------------------------------


def scrape_counters(base_url: str, api_key: str | None) -> dict[str, float]:
    """The known counters from the server's /metrics (summed over labels); {} when absent."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        resp = httpx.get(f"{base_url}/metrics", headers=headers, timeout=10.0, trust_env=False)
    except httpx.HTTPError:
        return {}
    if resp.status_code != 200:
        return {}
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(resp.text):
        key = SERVER_COUNTERS.get(family.name)
        if key is None:
            continue
        values[key] = sum(s.value for s in family.samples if s.name.endswith("_total"))
    return values


def server_side(before: dict[str, float], after: dict[str, float], duration: float) -> dict:
    """Deltas of the server's counters over the run, with the derived shares."""
    delta = {k: after[k] - before[k] for k in after if k in before}
    busy = delta.get("engine_busy_seconds")
    if busy:
        delta["engine_busy_frac"] = busy / duration
        delta["engine_host_frac_of_step"] = 1.0 - delta["engine_execute_seconds"] / busy
        steps = delta.get("engine_steps") or 0
        delta["mean_step_ms"] = 1000.0 * busy / steps if steps else None
    if delta.get("prefix_cache_queries"):
        delta["prefix_cache_hit_rate"] = delta["prefix_cache_hits"] / delta["prefix_cache_queries"]
    if delta.get("spec_num_drafts"):
        delta.update(
            rep.spec_counters(
                delta["spec_num_drafts"],
                delta["spec_num_draft_tokens"],
                delta["spec_num_accepted_tokens"],
            )
        )
    for key in ("process_cpu_seconds", "engine_thread_cpu_seconds", "api_thread_cpu_seconds"):
        if delta.get(key) is not None:
            delta[key.replace("_seconds", "_cores")] = delta[key] / duration
    return delta


# ----- command ----------------------------------------------------------------------------


def resolve_model(base_url: str, api_key: str | None) -> str:
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    resp = httpx.get(f"{base_url}/v1/models", headers=headers, timeout=30.0, trust_env=False)
    resp.raise_for_status()
    return resp.json()["data"][0]["id"]


def _load_requests(args: argparse.Namespace) -> list[BenchRequest]:
    if args.workload:
        return load_workload(args.workload)[: args.num_prompts]
    from pagellm.bench.throughput import build_workload_isolated, spec_from_args

    spec = spec_from_args(args, args.tokenizer)
    return build_workload_isolated(spec)


def run(args: argparse.Namespace) -> int:
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise SystemExit("--max-concurrency must be >= 1")
    if args.request_rate <= 0:
        raise SystemExit("--request-rate must be > 0")
    base_url = args.base_url.rstrip("/")
    requests = _load_requests(args)
    if args.save_workload:
        save_workload(args.save_workload, requests)
    model = args.model or resolve_model(base_url, args.api_key)
    before = scrape_counters(base_url, args.api_key)
    client_cpu = time.process_time()
    results, duration = asyncio.run(
        run_requests(
            base_url,
            args.endpoint,
            model,
            requests,
            rate=args.request_rate,
            max_concurrency=args.max_concurrency,
            ignore_eos=args.ignore_eos,
            api_key=args.api_key,
            seed=args.seed,
            timeout=args.request_timeout,
            extra_body={"user": args.user} if args.user else None,
        )
    )
    client_cpu = time.process_time() - client_cpu
    after = scrape_counters(base_url, args.api_key)
    summary = summarize(results, duration)
    summary["client_cpu_cores"] = client_cpu / duration if duration else None
    report = {
        "benchmark": "serve",
        "label": args.label or base_url,
        "base_url": base_url,
        "model": model,
        "request_rate": None if math.isinf(args.request_rate) else args.request_rate,
        "max_concurrency": args.max_concurrency,
        "workload": workload_summary(requests),
        "results": summary,
        "server": server_side(before, after, duration),
        "environment": rep.environment(),
    }
    if args.output_json:
        rep.write_report(args.output_json, report)
    print(render(report))
    return 0 if report["results"]["failed"] == 0 else 1


def render(report: dict[str, Any]) -> str:
    r = report["results"]
    lines = [
        rep.cpu_line(report["environment"]),
        f"serve benchmark: {report['label']}  model={report['model']}  "
        f"rate={report['request_rate'] or 'inf'}  concurrency={report['max_concurrency'] or '-'}",
        rep.format_table(
            ["completed", "failed", "duration s", "req/s", "output tok/s", "total tok/s"],
            [
                [
                    str(r["completed"]),
                    str(r["failed"]),
                    f"{r['duration_s']:.1f}",
                    f"{r['request_throughput']:.2f}",
                    f"{r['output_throughput']:.1f}",
                    f"{r['total_token_throughput']:.1f}",
                ]
            ],
        ),
        rep.format_table(
            ["latency (ms)", "mean", "median", "p90", "p99"],
            [
                [name, *(_ms(r[f"{k}_{key}_ms"]) for k in ("mean", "median", "p90", "p99"))]
                for name, key in (
                    ("TTFT", "ttft"),
                    ("TPOT", "tpot"),
                    ("ITL", "itl"),
                    ("E2E", "e2el"),
                )
            ],
        ),
    ]
    server = report.get("server") or {}
    if "engine_busy_frac" in server:
        lines.append(
            f"server: engine busy {server['engine_busy_frac']:.0%} of the run, "
            f"host share of a step {server['engine_host_frac_of_step']:.1%}, "
            f"mean step {server['mean_step_ms']:.1f} ms, "
            f"CPU cores: process {server.get('process_cpu_cores', float('nan')):.2f}, "
            f"engine thread {server.get('engine_thread_cpu_cores', float('nan')):.2f}, "
            f"HTTP thread {server.get('api_thread_cpu_cores', float('nan')):.2f}, "
            f"this client {r['client_cpu_cores']:.2f}"
        )
    if "prefix_cache_hit_rate" in server:
        lines.append(
            f"server prefix cache: {server['prefix_cache_hits']:.0f} of "
            f"{server['prefix_cache_queries']:.0f} prompt tokens hit "
            f"({server['prefix_cache_hit_rate']:.1%})"
        )
    if server.get("spec_num_drafts"):
        lines.append("server " + rep.spec_line(server))
    if r["errors"]:
        lines.append("errors: " + "; ".join(r["errors"]))
    return "\n".join(lines)


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"
