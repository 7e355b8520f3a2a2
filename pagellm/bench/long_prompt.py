"""``pagellm bench long-prompt``: time to first token, prefill rate and ITL per prompt length.

Against any OpenAI-compatible server (pagellm, vLLM), one request at a time: for each length in
``--input-lens`` it streams ``--num-prompts`` completions whose prompts are random token ids of
exactly that length (a fresh seeded draw per request, so nothing is served from a prefix cache),
greedy, EOS ignored, ``--output-len`` tokens out. With ``--server-pid`` it samples the resident
memory of that process and its children while each request runs (peak RSS per length).

``--fairness`` measures what a long prompt does to streams already decoding: ``--streams``
requests decode for ``--baseline-s`` seconds, then one ``--fairness-input-len``-token prompt
arrives; the report compares the streams' inter-token latencies before it with those while it is
being prefilled (from its arrival to its first token), and with those of the ``--after-s`` seconds
after its first token: the streams decode through the prefill, so their context, and with it a
decode step's attention, grows; the window after shows that growth without the prefill.

Output: a JSON report (``--output-json``) and a table headed by the CPU model.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from pagellm.bench import report as rep


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser("long-prompt", help="TTFT, prefill tok/s and ITL per prompt length")
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--model", default=None, help="model name sent (default: the server's first)")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"))
    p.add_argument("--input-lens", default="1024,4096,8000", help="prompt lengths, comma-separated")
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--num-prompts", type=int, default=3, help="requests per length")
    p.add_argument("--vocab-low", type=int, default=1000, help="random ids are drawn from here...")
    p.add_argument("--vocab-high", type=int, default=30000, help="...to here (exclusive)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--server-pid", type=int, default=None, help="sample this process tree's RSS")
    p.add_argument("--fairness", action="store_true", help="run the fairness scenario instead")
    p.add_argument("--streams", type=int, default=8, help="fairness: streams decoding")
    p.add_argument("--stream-input-len", type=int, default=128)
    p.add_argument("--stream-max-tokens", type=int, default=4000)
    p.add_argument("--fairness-input-len", type=int, default=8000)
    p.add_argument("--baseline-s", type=float, default=10.0, help="fairness: ITL window before")
    p.add_argument(
        "--after-s", type=float, default=10.0,
        help="fairness: ITL window after the long prompt's first token (0: none)",
    )  # fmt: skip
    p.add_argument("--request-timeout", type=float, default=1800.0)
    p.add_argument("--label", default=None)
    p.add_argument("--output-json", default=None)
    p.set_defaults(func=run)
    return p


# ----- streaming --------------------------------------------------------------------------


@dataclass(slots=True)
class Stream:
    """One streamed completion: when it was sent and when each event with a choice arrived
    (vLLM's ``bench serve`` counts its inter-token latencies between those: servers that stream
    a chunk per step, vLLM and pagellm, send one with text "" for tokens whose text is held
    back, half of a UTF-8 character, so that a stream of two-token characters does not read
    as one token every other step)."""

    sent: float
    chunk_times: list[float] = field(default_factory=list)
    error: str | None = None

    @property
    def first_event(self) -> float | None:
        return self.chunk_times[0] if self.chunk_times else None

    @property
    def ttft(self) -> float | None:
        first = self.first_event
        return None if first is None else first - self.sent

    def gaps(
        self, after: float = float("-inf"), until: float = float("inf"), whole: bool = False
    ) -> list[float]:
        """Inter-chunk gaps whose later chunk arrived in (after, until] (``whole``: and whose
        earlier chunk arrived at ``after`` or later)."""
        t = self.chunk_times
        return [
            b - a
            for a, b in zip(t, t[1:], strict=False)
            if after < b <= until and (not whole or a >= after)
        ]


async def stream_completion(
    client: Any, url: str, body: dict[str, Any], headers: dict[str, str], stream: Stream
) -> None:
    """Fill ``stream`` as chunks arrive; records an error instead of raising."""
    from pagellm.bench.serve import is_token_event

    try:
        async with client.stream("POST", url, json=body, headers=headers) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")
                stream.error = f"HTTP {resp.status_code}: {text[:200]}"
                return
            async for line in resp.aiter_lines():
                data = line[5:].strip() if line.startswith("data:") else None
                if data is None:
                    continue
                if data == "[DONE]":
                    return
                event = json.loads(data)
                if "error" in event:
                    stream.error = str(event["error"])
                    return
                if is_token_event(event):
                    stream.chunk_times.append(time.perf_counter())
    except Exception as exc:  # noqa: BLE001 - a failed request is a result
        stream.error = f"{type(exc).__name__}: {exc}"


def random_prompt(rng: random.Random, length: int, low: int, high: int) -> list[int]:
    return [rng.randrange(low, high) for _ in range(length)]


def completion_body(model: str, prompt: list[int], max_tokens: int) -> dict[str, Any]:
    return {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
    }


# ----- memory -----------------------------------------------------------------------------


def tree_rss_mib(pid: int) -> float:
    """Resident memory of ``pid`` and all its descendants (Linux), MiB; 0 once it is gone."""
    total = 0
    for p in [pid, *_descendants(pid)]:
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
        except (OSError, ValueError):
            continue
    return total / 1024


def _descendants(pid: int) -> list[int]:
    found, frontier = [], [pid]
    while frontier:
        parent = frontier.pop()
        try:
            children = Path(f"/proc/{parent}/task/{parent}/children").read_text().split()
        except OSError:
            continue
        kids = [int(c) for c in children]
        found += kids
        frontier += kids
    return found


class RssSampler:
    """Peak of ``tree_rss_mib(pid)`` sampled every ``interval`` seconds on a thread."""

    def __init__(self, pid: int | None, interval: float = 0.05) -> None:
        self.pid, self.interval, self.peak = pid, interval, 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, tree_rss_mib(self.pid))
            self._stop.wait(self.interval)

    def __enter__(self) -> RssSampler:
        if self.pid is not None:
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.pid is not None:
            self._stop.set()
            self._thread.join(timeout=5.0)


# ----- the two scenarios ------------------------------------------------------------------


def _ms(values: list[float], q: float) -> float | None:
    return float(np.percentile(np.asarray(values) * 1000.0, q)) if values else None


async def run_lengths(args: argparse.Namespace, model: str, headers: dict[str, str]) -> list[dict]:
    import httpx

    rng = random.Random(args.seed)
    url = f"{args.base_url}/v1/completions"
    rows = []
    timeout = httpx.Timeout(args.request_timeout, connect=30.0)
    async with httpx.AsyncClient(timeout=timeout, trust_env=False) as client:
        for length in [int(x) for x in args.input_lens.split(",") if x.strip()]:
            streams = []
            with RssSampler(args.server_pid) as rss:
                for _ in range(args.num_prompts):
                    prompt = random_prompt(rng, length, args.vocab_low, args.vocab_high)
                    s = Stream(sent=time.perf_counter())
                    body = completion_body(model, prompt, args.output_len)
                    await stream_completion(client, url, body, headers, s)
                    streams.append(s)
            rows.append(length_row(length, streams, rss.peak if args.server_pid else None))
    return rows


def length_row(length: int, streams: list[Stream], peak_rss: float | None) -> dict[str, Any]:
    ok = [s for s in streams if s.error is None and s.chunk_times]
    ttfts = [s.ttft for s in ok if s.ttft is not None]
    gaps = [g for s in ok for g in s.gaps()]
    ttft_p50 = _ms(ttfts, 50)
    return {
        "input_len": length,
        "completed": len(ok),
        "failed": len(streams) - len(ok),
        "errors": sorted({s.error for s in streams if s.error})[:5],
        "ttft_p50_ms": ttft_p50,
        "ttft_mean_ms": float(np.mean(ttfts) * 1000.0) if ttfts else None,
        "prefill_tokens_per_s": length / (ttft_p50 / 1000.0) if ttft_p50 else None,
        "itl_p50_ms": _ms(gaps, 50),
        "itl_p99_ms": _ms(gaps, 99),
        "peak_rss_mib": peak_rss,
    }


async def run_fairness(args: argparse.Namespace, model: str, headers: dict[str, str]) -> dict:
    import httpx

    rng = random.Random(args.seed)
    url = f"{args.base_url}/v1/completions"
    timeout = httpx.Timeout(args.request_timeout, connect=30.0)
    limits = httpx.Limits(max_connections=args.streams + 4)
    async with httpx.AsyncClient(timeout=timeout, limits=limits, trust_env=False) as client:
        streams = [Stream(sent=time.perf_counter()) for _ in range(args.streams)]
        tasks = [
            asyncio.create_task(
                stream_completion(
                    client,
                    url,
                    completion_body(
                        model,
                        random_prompt(rng, args.stream_input_len, args.vocab_low, args.vocab_high),
                        args.stream_max_tokens,
                    ),
                    headers,
                    s,
                )
            )
            for s in streams
        ]
        deadline = time.perf_counter() + args.request_timeout
        while not all(len(s.chunk_times) >= 3 or s.error for s in streams):  # all decoding
            if time.perf_counter() > deadline or all(t.done() for t in tasks):
                break
            await asyncio.sleep(0.05)
        window_start = time.perf_counter()
        await asyncio.sleep(args.baseline_s)
        long_stream = Stream(sent=time.perf_counter())
        long_prompt = random_prompt(rng, args.fairness_input_len, args.vocab_low, args.vocab_high)
        with RssSampler(args.server_pid) as rss:
            await stream_completion(
                client, url, completion_body(model, long_prompt, 1), headers, long_stream
            )
        first_token = long_stream.first_event or time.perf_counter()
        await asyncio.sleep(max(0.0, first_token + args.after_s - time.perf_counter()))
        after_end = time.perf_counter()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    before = [g for s in streams for g in s.gaps(window_start, long_stream.sent)]
    during = [g for s in streams for g in s.gaps(long_stream.sent, first_token)]
    after = (
        [g for s in streams for g in s.gaps(first_token, after_end, whole=True)]
        if args.after_s > 0
        else []
    )
    p99_before, p99_during, p99_after = _ms(before, 99), _ms(during, 99), _ms(after, 99)
    return {
        "streams": args.streams,
        "long_input_len": args.fairness_input_len,
        "long_ttft_ms": long_stream.ttft * 1000.0 if long_stream.ttft is not None else None,
        "long_error": long_stream.error,
        "stream_errors": sorted({s.error for s in streams if s.error})[:5],
        "itl_before_p50_ms": _ms(before, 50),
        "itl_before_p99_ms": p99_before,
        "itl_during_p50_ms": _ms(during, 50),
        "itl_during_p99_ms": p99_during,
        "itl_during_max_ms": max(during) * 1000.0 if during else None,
        "itl_after_p50_ms": _ms(after, 50),
        "itl_after_p99_ms": p99_after,
        "gaps_before": len(before),
        "gaps_during": len(during),
        "gaps_after": len(after),
        "p99_ratio": p99_during / p99_before if p99_before and p99_during else None,
        "p99_ratio_after": p99_during / p99_after if p99_after and p99_during else None,
        "peak_rss_mib": rss.peak if args.server_pid else None,
    }


# ----- command ----------------------------------------------------------------------------


def run(args: argparse.Namespace) -> int:
    from pagellm.bench.serve import resolve_model

    args.base_url = args.base_url.rstrip("/")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    model = args.model or resolve_model(args.base_url, args.api_key)
    report: dict[str, Any] = {
        "benchmark": "long-prompt",
        "label": args.label or args.base_url,
        "base_url": args.base_url,
        "model": model,
        "output_len": args.output_len,
        "git_sha": rep.git_sha(),
        "environment": rep.environment(),
    }
    if args.fairness:
        report["fairness"] = asyncio.run(run_fairness(args, model, headers))
    else:
        report["lengths"] = asyncio.run(run_lengths(args, model, headers))
    if args.output_json:
        rep.write_report(args.output_json, report)
    print(render(report))
    failed = report.get("fairness", {}).get("long_error") or any(
        row["failed"] for row in report.get("lengths", [])
    )
    return 1 if failed else 0


def render(report: dict[str, Any]) -> str:
    lines = [rep.cpu_line(report["environment"]), f"long-prompt benchmark: {report['label']}"]
    if "fairness" in report:
        f = report["fairness"]
        lines.append(
            f"{f['streams']} streams decoding, then one {f['long_input_len']}-token prompt "
            f"(its TTFT {_fmt(f['long_ttft_ms'], 0)} ms)"
        )
        rows = [
            ["before it", str(f["gaps_before"]), _fmt(f["itl_before_p50_ms"]),
             _fmt(f["itl_before_p99_ms"])],
            ["during its prefill", str(f["gaps_during"]), _fmt(f["itl_during_p50_ms"]),
             _fmt(f["itl_during_p99_ms"])],
            ["after its first token", str(f.get("gaps_after", 0)),
             _fmt(f.get("itl_after_p50_ms")), _fmt(f.get("itl_after_p99_ms"))],
        ]  # fmt: skip
        lines.append(rep.format_table(["streams' ITL", "gaps", "p50 ms", "p99 ms"], rows))
        lines.append(
            f"p99 during / before: {_fmt(f['p99_ratio'], 2)}x; during / after: "
            f"{_fmt(f.get('p99_ratio_after'), 2)}x (after: the streams' grown context alone)"
        )
        return "\n".join(lines)
    rows = [
        [
            str(r["input_len"]),
            f"{r['completed']}/{r['completed'] + r['failed']}",
            _fmt(r["ttft_p50_ms"], 0),
            _fmt(r["prefill_tokens_per_s"], 0),
            _fmt(r["itl_p50_ms"]),
            _fmt(r["itl_p99_ms"]),
            _fmt(r["peak_rss_mib"], 0),
        ]
        for r in report["lengths"]
    ]
    headers = ["prompt tokens", "ok", "TTFT p50 ms", "prefill tok/s", "ITL p50 ms", "ITL p99 ms",
               "peak RSS MiB"]  # fmt: skip
    lines.append(rep.format_table(headers, rows))
    return "\n".join(lines)


def _fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"
