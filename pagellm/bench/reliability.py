"""``pagellm bench reliability``: how a running server, or the gateway in front of it, holds up.

Phases, in order, each reporting its streams' outcomes and its duration:

1. ``concurrent``: many streams at once; each must end with ``[DONE]`` and a finish_reason on
   every choice.
2. ``disconnect_storm``: streams the client closes after 1-6 events (seeded); then the engine's
   /metrics is polled until nothing runs or waits and KV usage is back to its idle value, and the
   tokens generated between the last close and idle are counted.
3. ``slow_readers``: n=16 streams whose client reads one event, stops reading for a while, then
   reads the rest; the server's RSS is sampled meanwhile.
4. ``sigterm`` (only with ``--launch`` or ``--sigterm-pid``): streams in flight when the server
   gets SIGTERM; how many finish whole, and how the process exits.

Owns the stream client and its outcome categories, the engine-metrics probe and the launched
server; report writing, tables and percentiles come from ``report`` and ``serve``. Every wait is
bounded and only loopback addresses are used.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import ipaddress
import json
import os
import platform
import random
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pagellm.bench import report as rep
from pagellm.bench.processes import free_port, running_process
from pagellm.bench.serve import latency_stats, resolve_model

OK = "ok"
"""``[DONE]`` arrived, every choice had a finish_reason, no error event."""
CLOSED = "closed"
"""The client closed the stream on purpose (the disconnect storm)."""
ERROR_EVENT = "error_event"
CUT = "cut"
"""The stream ended without ``[DONE]``."""
NO_FINISH = "no_finish_reason"
TRANSPORT = "transport_error"
TIMEOUT = "timeout"
BAD_EVENT = "bad_event"
"""An SSE data line that is not JSON."""

ENGINE_METRICS = {
    "pagellm:num_requests_running": "running",
    "pagellm:num_requests_waiting": "waiting",
    "pagellm:kv_cache_usage_perc": "kv_usage",
    "pagellm:generation_tokens": "generation_tokens",
    "process_resident_memory_bytes": "rss_bytes",
}
"""Families read from the engine's /metrics (summed over labels) -> key."""
FINISHED_FAMILY = "pagellm:request_success"

Reader = Callable[[int], Awaitable[bool]]
"""Called after each event with the count so far; False makes the client close the stream."""


# ----- one stream -------------------------------------------------------------------------


@dataclass(slots=True)
class StreamResult:
    outcome: str = CUT
    events: int = 0
    ttft_s: float | None = None
    elapsed_s: float = 0.0
    detail: str | None = None
    error: str | None = None
    finished: set[int] = field(default_factory=set)
    """Choice indexes that carried a finish_reason."""


async def stream_one(
    client: Any,
    url: str,
    body: dict[str, Any],
    headers: dict[str, str],
    timeout: float,
    reader: Reader | None = None,
) -> StreamResult:
    """POST one streaming request and classify how it ended; never raises."""
    import httpx

    result = StreamResult()
    start = time.perf_counter()
    try:
        async with asyncio.timeout(timeout):
            await _consume(client, url, body, headers, reader, result, start)
    except TimeoutError:
        result.outcome, result.detail = TIMEOUT, f"over {timeout:g} s"
    except ValueError as exc:
        result.outcome, result.detail = BAD_EVENT, str(exc)[:200]
    except (httpx.HTTPError, OSError) as exc:
        result.outcome, result.detail = TRANSPORT, f"{type(exc).__name__}: {exc}"[:200]
    result.elapsed_s = time.perf_counter() - start
    return result


async def _consume(
    client: Any,
    url: str,
    body: dict[str, Any],
    headers: dict[str, str],
    reader: Reader | None,
    result: StreamResult,
    start: float,
) -> None:
    async with client.stream("POST", url, json=body, headers=headers) as resp:
        if resp.status_code != 200:
            text = (await resp.aread()).decode(errors="replace")
            result.outcome, result.detail = f"http_{resp.status_code}", text[:200]
            return
        async for line in resp.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                result.outcome = _outcome_at_done(result, body.get("n") or 1)
                return
            _take_event(result, json.loads(data))
            result.events += 1
            if result.ttft_s is None:
                result.ttft_s = time.perf_counter() - start
            if reader is not None and not await reader(result.events):
                result.outcome = CLOSED
                return
        result.detail = result.error


def _take_event(result: StreamResult, event: Any) -> None:
    """Read one event; one that is not an OpenAI chunk object raises ValueError (bad_event)."""
    choices = event.get("choices") if isinstance(event, dict) else None
    if not isinstance(event, dict) or not all(isinstance(c, dict) for c in choices or []):
        raise ValueError(f"not a chunk object: {str(event)[:100]}")
    if "error" in event:
        err = event["error"]
        result.error = str(err.get("message", err) if isinstance(err, dict) else err)[:200]
    for choice in choices or []:
        if choice.get("finish_reason") is not None:
            result.finished.add(int(choice.get("index", 0)))


def _outcome_at_done(result: StreamResult, n: int) -> str:
    if result.error is not None:
        result.detail = result.error
        return ERROR_EVENT
    return OK if len(result.finished) >= n else NO_FINISH


def close_after(k: int) -> Reader:
    async def reader(events: int) -> bool:
        return events < k

    return reader


def pause_after_first(seconds: float) -> Reader:
    async def reader(events: int) -> bool:
        if events == 1:
            await asyncio.sleep(seconds)
        return True

    return reader


def signal_first(started: asyncio.Event) -> Reader:
    async def reader(events: int) -> bool:
        started.set()
        return True

    return reader


def phase_summary(name: str, results: list[StreamResult], duration: float) -> dict[str, Any]:
    """Outcome counts, a few distinct failure details, and TTFT / E2E of the whole streams."""
    done = [r for r in results if r.outcome == OK]
    details = {f"{r.outcome}: {r.detail}" for r in results if r.detail and r.outcome != OK}
    return {
        "phase": name,
        "streams": len(results),
        "outcomes": dict(sorted(Counter(r.outcome for r in results).items())),
        "duration_s": duration,
        "details": sorted(details)[:5],
        **latency_stats("ttft", [r.ttft_s for r in results if r.ttft_s is not None]),
        **latency_stats("e2e", [r.elapsed_s for r in done]),
    }


# ----- the server's side ------------------------------------------------------------------


def parse_engine_metrics(text: str) -> dict[str, float]:
    """The engine figures in a /metrics page; without ``running`` the page is not an engine's."""
    from prometheus_client.parser import text_string_to_metric_families

    values: dict[str, float] = {}
    aborted = 0.0
    for family in text_string_to_metric_families(text):
        samples = [s for s in family.samples if not s.name.endswith("_created")]
        key = ENGINE_METRICS.get(family.name)
        if key is not None:
            values[key] = sum(s.value for s in samples)
        elif family.name == FINISHED_FAMILY:
            aborted = sum(s.value for s in samples if s.labels.get("finished_reason") == "abort")
    if "running" in values:
        values["aborted"] = aborted
    return values


def proc_rss_mib(pid: int) -> float | None:
    """VmRSS of a process from /proc (Linux); None when it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except (OSError, ValueError):
        pass
    return None


@dataclass(slots=True)
class Probe:
    """Reads the engine's /metrics and the server's RSS (from /proc when its pid is known)."""

    client: Any
    metrics_url: str
    headers: dict[str, str]
    pid: int | None = None

    async def engine(self) -> dict[str, float] | None:
        import httpx

        try:
            resp = await self.client.get(self.metrics_url, headers=self.headers, timeout=10.0)
        except httpx.HTTPError:
            return None
        if resp.status_code != 200:
            return None
        values = parse_engine_metrics(resp.text)
        return values if "running" in values else None

    @property
    def rss_source(self) -> str:
        return f"/proc/{self.pid}/status" if self.pid else f"{self.metrics_url} (process RSS)"

    async def rss_mib(self) -> float | None:
        if self.pid:
            return proc_rss_mib(self.pid)
        values = await self.engine()
        rss = (values or {}).get("rss_bytes")
        return rss / 2**20 if rss is not None else None

    async def wait_idle(
        self, kv_idle: float, timeout: float
    ) -> tuple[float | None, dict[str, float] | None]:
        """Seconds until nothing runs or waits and KV usage is back to ``kv_idle`` (None when
        ``timeout`` passed first), with the last figures read."""
        start = time.perf_counter()
        last = None
        while time.perf_counter() - start < timeout:
            last = await self.engine() or last
            if last is not None and _is_idle(last, kv_idle):
                return time.perf_counter() - start, last
            await asyncio.sleep(0.1)
        return None, last


def _is_idle(values: dict[str, float], kv_idle: float) -> bool:
    busy = values["running"] + values.get("waiting", 0.0)
    return busy == 0 and values.get("kv_usage", 0.0) <= kv_idle + 1e-9


async def sample_rss(probe: Probe, into: list[float], interval: float = 0.25) -> None:
    """Append the server's RSS every ``interval`` seconds until cancelled."""
    while True:
        rss = await probe.rss_mib()
        if rss is not None:
            into.append(rss)
        await asyncio.sleep(interval)


# ----- the phases -------------------------------------------------------------------------


@dataclass(slots=True)
class Bench:
    """What every phase needs: the client, where to send, and the run's settings."""

    client: Any
    args: argparse.Namespace
    url: str
    headers: dict[str, str]
    model: str
    probe: Probe

    def body(self, i: int, max_tokens: int, n: int = 1) -> dict[str, Any]:
        prompt = f"Reliability probe {i}: write a short story about a lighthouse keeper."
        body: dict[str, Any] = {
            "model": self.model,
            "max_tokens": max_tokens,
            "n": n,
            "temperature": 0.0 if n == 1 else 1.0,
            "ignore_eos": self.args.ignore_eos,
            "stream": True,
        }
        if self.args.endpoint.endswith("/chat/completions"):
            body["messages"] = [{"role": "user", "content": prompt}]
        else:
            body["prompt"] = prompt
        return body

    async def stream(
        self, i: int, max_tokens: int, n: int = 1, reader: Reader | None = None
    ) -> StreamResult:
        body = self.body(i, max_tokens, n)
        return await stream_one(
            self.client, self.url, body, self.headers, self.args.request_timeout, reader
        )


async def phase_concurrent(bench: Bench) -> dict[str, Any]:
    start = time.perf_counter()
    streams = (bench.stream(i, bench.args.max_tokens) for i in range(bench.args.streams))
    results = await asyncio.gather(*streams)
    return phase_summary("concurrent", list(results), time.perf_counter() - start)


async def phase_storm(bench: Bench, kv_idle: float) -> dict[str, Any]:
    args = bench.args
    rng = random.Random(args.seed)
    stops = [rng.randint(1, 6) for _ in range(args.storm)]
    before = await bench.probe.engine()
    start = time.perf_counter()
    streams = (
        bench.stream(i, args.storm_max_tokens, reader=close_after(k)) for i, k in enumerate(stops)
    )
    results = await asyncio.gather(*streams)
    closed = await bench.probe.engine()
    idle_s, idle = await bench.probe.wait_idle(kv_idle, args.idle_timeout)
    summary = phase_summary("disconnect_storm", list(results), time.perf_counter() - start)
    summary.update(storm_figures(before, closed, idle, idle_s))
    return summary


def storm_figures(
    before: dict[str, float] | None,
    closed: dict[str, float] | None,
    idle: dict[str, float] | None,
    idle_s: float | None,
) -> dict[str, Any]:
    """Time to idle after the last close, and what the engine did in between."""
    if before is None or closed is None or idle is None:
        return {"engine_metrics": False, "idle_reached": False}
    return {
        "engine_metrics": True,
        "idle_reached": idle_s is not None,
        "idle_after_s": idle_s,
        "busy_at_last_close": closed["running"] + closed.get("waiting", 0.0),
        "kv_usage_at_last_close": closed.get("kv_usage"),
        "kv_usage_after": idle.get("kv_usage"),
        "tokens_generated_after_aborts": idle["generation_tokens"] - closed["generation_tokens"],
        "aborted_requests": idle["aborted"] - before["aborted"],
    }


async def phase_slow_readers(bench: Bench) -> dict[str, Any]:
    args = bench.args
    rss_before = await bench.probe.rss_mib()
    samples: list[float] = []
    sampler = asyncio.create_task(sample_rss(bench.probe, samples))
    start = time.perf_counter()
    streams = (
        bench.stream(i, args.slow_max_tokens, args.slow_n, pause_after_first(args.slow_pause))
        for i in range(args.slow_readers)
    )
    try:
        results = await asyncio.gather(*streams)
    finally:
        sampler.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await sampler
    summary = phase_summary("slow_readers", list(results), time.perf_counter() - start)
    summary.update(
        rss_before_mib=rss_before,
        rss_peak_mib=max(samples, default=None),
        rss_samples=len(samples),
        n=args.slow_n,
        pause_s=args.slow_pause,
    )
    return summary


async def phase_sigterm(bench: Bench, pid: int, proc: subprocess.Popen | None) -> dict[str, Any]:
    """SIGTERM once every stream had its first event (or ended); then how streams and the
    process ended."""
    args = bench.args
    started = [asyncio.Event() for _ in range(args.sigterm_streams)]
    tasks = []
    for i, ev in enumerate(started):
        task = asyncio.create_task(bench.stream(i, args.max_tokens, reader=signal_first(ev)))
        task.add_done_callback(lambda _, ev=ev: ev.set())
        tasks.append(task)
    start = time.perf_counter()
    all_started = await _wait_all(started, args.request_timeout)
    os.kill(pid, signal.SIGTERM)
    signalled = time.perf_counter()
    results = await asyncio.gather(*tasks)
    exited, code, exit_s = await wait_exit(pid, proc, args.exit_timeout)
    summary = phase_summary("sigterm", list(results), time.perf_counter() - start)
    summary.update(
        pid=pid,
        all_started_before_signal=all_started,
        finished_whole=summary["outcomes"].get(OK, 0),
        cut=len(results) - summary["outcomes"].get(OK, 0),
        exited=exited,
        exit_code=code,
        exit_after_signal_s=exit_s - signalled if exit_s is not None else None,
    )
    return summary


async def _wait_all(events: list[asyncio.Event], timeout: float) -> bool:
    try:
        async with asyncio.timeout(timeout):
            await asyncio.gather(*(e.wait() for e in events))
    except TimeoutError:
        return False
    return True


async def wait_exit(
    pid: int, proc: subprocess.Popen | None, timeout: float
) -> tuple[bool, int | None, float | None]:
    """(exited, exit code when it is our child, when it was seen gone) within ``timeout``."""
    deadline = time.perf_counter() + timeout
    while time.perf_counter() < deadline:
        if proc is not None and proc.poll() is not None:
            return True, proc.returncode, time.perf_counter()
        if proc is None and not _alive(pid):
            return True, None, time.perf_counter()
        await asyncio.sleep(0.1)
    return False, None, None


def _alive(pid: int) -> bool:
    try:
        state = [
            ln for ln in Path(f"/proc/{pid}/status").read_text().splitlines() if "State:" in ln
        ]
    except OSError:
        return False
    return not state or "Z" not in state[0].split()[1]


# ----- the run ----------------------------------------------------------------------------


async def run_phases(
    args: argparse.Namespace, base_url: str, metrics_url: str, proc: subprocess.Popen | None
) -> dict[str, Any]:
    import httpx

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    pid = proc.pid if proc is not None else (args.server_pid or args.sigterm_pid)
    timeout = httpx.Timeout(args.request_timeout, connect=10.0)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    async with httpx.AsyncClient(timeout=timeout, limits=limits, trust_env=False) as client:
        probe = Probe(client, f"{metrics_url}/metrics", headers, pid)
        model = args.model or await asyncio.to_thread(resolve_model, base_url, args.api_key)
        bench = Bench(client, args, f"{base_url}{args.endpoint}", headers, model, probe)
        return await _phases(bench, proc)


async def _phases(bench: Bench, proc: subprocess.Popen | None) -> dict[str, Any]:
    probe = bench.probe
    idle = await probe.engine()
    kv_idle = idle["kv_usage"] if idle is not None else 0.0
    server: dict[str, Any] = {"pid": probe.pid, "rss_source": probe.rss_source}
    server["engine_metrics"] = idle is not None
    server["kv_usage_idle"] = idle["kv_usage"] if idle is not None else None
    server["rss_before_mib"] = await probe.rss_mib()
    phases = {"concurrent": await phase_concurrent(bench)}
    await probe.wait_idle(kv_idle, bench.args.idle_timeout)
    phases["disconnect_storm"] = await phase_storm(bench, kv_idle)
    phases["slow_readers"] = await phase_slow_readers(bench)
    _, after = await probe.wait_idle(kv_idle, bench.args.idle_timeout)
    server["kv_usage_after"] = after["kv_usage"] if after is not None else None
    server["rss_after_mib"] = await probe.rss_mib()
    sigterm_pid = proc.pid if proc is not None else bench.args.sigterm_pid
    if sigterm_pid:
        phases["sigterm"] = await phase_sigterm(bench, sigterm_pid, proc)
    return {"model": bench.model, "server": server, "phases": phases}


def problems(report: dict[str, Any]) -> list[str]:
    """What the run found wrong, in words (an empty list: nothing)."""
    found = []
    phases, server = report["phases"], report["server"]
    con = phases["concurrent"]
    if con["outcomes"].get(OK, 0) != con["streams"]:
        found.append(f"concurrent: {con['streams'] - con['outcomes'].get(OK, 0)} streams not whole")
    storm = phases["disconnect_storm"]
    if not server["engine_metrics"]:
        found.append(f"no engine metrics at {report['replica_metrics_url']}/metrics")
    elif not storm["idle_reached"]:
        found.append("disconnect_storm: the engine did not get back to idle in time")
    slow = phases["slow_readers"]
    unclean = slow["streams"] - sum(slow["outcomes"].get(k, 0) for k in (OK, ERROR_EVENT))
    if unclean:
        found.append(f"slow_readers: {unclean} streams neither whole nor ended by an error event")
    found += _sigterm_problems(phases.get("sigterm"))
    return found


def _sigterm_problems(phase: dict[str, Any] | None) -> list[str]:
    if phase is None:
        return []
    found = []
    if phase["cut"]:
        found.append(f"sigterm: {phase['cut']} of {phase['streams']} streams not whole")
    if not phase["exited"]:
        found.append("sigterm: the process did not exit in time")
    elif phase["exit_code"] not in (0, None):
        found.append(f"sigterm: exit code {phase['exit_code']}")
    return found


# ----- the launched server ----------------------------------------------------------------


def launch_argv(command: str, port: int) -> list[str]:
    """The command split like a shell would, bound to 127.0.0.1:``port`` (given last, so these
    win); a leading ``pagellm`` runs as this interpreter's ``-m pagellm.cli``."""
    argv = shlex.split(command)
    if argv and argv[0] == "pagellm":
        argv = [sys.executable, "-m", "pagellm.cli", *argv[1:]]
    return [*argv, "--host", "127.0.0.1", "--port", str(port)]


@contextlib.contextmanager
def launched(command: str, timeout: float, log_path: str) -> Iterator[tuple[subprocess.Popen, str]]:
    """The server command started on a free loopback port and healthy; stopped on the way out
    when it is still running (SIGTERM, then SIGKILL after 30 s)."""
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    with contextlib.ExitStack() as stack:
        try:
            proc = stack.enter_context(
                running_process(launch_argv(command, port), base_url, log_path, timeout)
            )
        except RuntimeError as exc:  # it did not start: a clear exit, no traceback
            raise SystemExit(f"the launched server: {exc}") from exc
        yield proc, base_url


# ----- command ----------------------------------------------------------------------------


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``reliability`` under ``pagellm bench``."""
    p = subparsers.add_parser(
        "reliability", help="concurrency, disconnects, slow readers and SIGTERM against a server"
    )
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="server or gateway")
    p.add_argument(
        "--replica-metrics-url",
        default=None,
        help="where the engine's /metrics is (default --base-url; a gateway's has none)",
    )
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"))
    p.add_argument("--model", default=None, help="model name sent (default: the server's first)")
    p.add_argument(
        "--endpoint", choices=["/v1/completions", "/v1/chat/completions"], default="/v1/completions"
    )
    p.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--seed", type=int, default=0, help="the disconnect storm's close points")
    _add_phase_args(p)
    _add_process_args(p)
    p.add_argument("--output-json", default=None, help="write the report JSON here")
    p.set_defaults(func=run)
    return p


def _add_phase_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--streams", type=int, default=256, help="concurrent: streams at once")
    p.add_argument("--max-tokens", type=int, default=32, help="concurrent and sigterm streams")
    p.add_argument("--storm", type=int, default=64, help="disconnect_storm: streams")
    p.add_argument("--storm-max-tokens", type=int, default=128)
    p.add_argument("--slow-readers", type=int, default=4, help="slow_readers: streams")
    p.add_argument("--slow-n", type=int, default=16, help="slow_readers: choices per stream")
    p.add_argument("--slow-max-tokens", type=int, default=128)
    p.add_argument("--slow-pause", type=float, default=5.0, help="seconds not reading")
    p.add_argument("--sigterm-streams", type=int, default=16)
    p.add_argument("--request-timeout", type=float, default=300.0, help="bound of one stream")
    p.add_argument(
        "--idle-timeout", type=float, default=60.0, help="bound of each wait for an idle engine"
    )


def _add_process_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--launch",
        default=None,
        metavar="COMMAND",
        help="start this server command (e.g. 'pagellm serve --model M') on a free loopback "
        "port, run every phase against it and SIGTERM it last",
    )
    p.add_argument("--launch-timeout", type=float, default=300.0, help="bound of the /health wait")
    p.add_argument(
        "--launch-log", default=None, help="the launched server's output (default: temp)"
    )
    p.add_argument("--server-pid", type=int, default=None, help="read the server's RSS from /proc")
    p.add_argument(
        "--sigterm-pid",
        type=int,
        default=None,
        help="run the sigterm phase against this process (it ends the server)",
    )
    p.add_argument("--exit-timeout", type=float, default=60.0, help="bound of the wait for exit")


def require_loopback(url: str) -> str:
    import httpx

    host = httpx.URL(url).host
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback:
        raise SystemExit(f"{url}: only loopback addresses are allowed")
    return url.rstrip("/")


def run(args: argparse.Namespace) -> int:
    for name in ("streams", "storm", "slow_readers", "sigterm_streams", "max_tokens", "slow_n"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1")
    if args.launch:
        log = args.launch_log or tempfile.mkstemp(prefix="pagellm-reliability-", suffix=".log")[1]
        with launched(args.launch, args.launch_timeout, log) as (proc, base_url):
            return finish(args, base_url, proc, log)
    return finish(args, require_loopback(args.base_url), None, None)


def finish(
    args: argparse.Namespace, base_url: str, proc: subprocess.Popen | None, log: str | None
) -> int:
    metrics_url = require_loopback(args.replica_metrics_url or base_url)
    found = asyncio.run(run_phases(args, base_url, metrics_url, proc))
    report = {
        "benchmark": "reliability",
        "timestamp": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "git_sha": rep.git_sha(),
        "cpu_model": cpu_model(),
        **rep.environment(),
        "config": {k: v for k, v in vars(args).items() if k != "func"},
        "base_url": base_url,
        "replica_metrics_url": metrics_url,
        "launch_log": log,
        **found,
    }
    report["tokens_generated_after_aborts"] = report["phases"]["disconnect_storm"].get(
        "tokens_generated_after_aborts"
    )
    report["problems"] = problems(report)
    if args.output_json:
        rep.write_report(args.output_json, report)
    print(render(report))
    return 0 if not report["problems"] else 1


def cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


# ----- the table --------------------------------------------------------------------------


_HEADERS = ["phase", "streams", "ok", "closed", "error event", "http", "transport", "cut"]
_HEADERS += ["no finish", "p50 TTFT ms", "duration s"]


def _row(phase: dict[str, Any]) -> list[str]:
    out = phase["outcomes"]
    http = [f"{k[5:]}x{v}" for k, v in out.items() if k.startswith("http_")]
    transport = sum(out.get(k, 0) for k in (TRANSPORT, TIMEOUT, BAD_EVENT))
    ttft = phase.get("median_ttft_ms")
    return [
        phase["phase"],
        str(phase["streams"]),
        *(str(out.get(k, 0)) for k in (OK, CLOSED, ERROR_EVENT)),
        " ".join(http) or "0",
        str(transport),
        str(out.get(CUT, 0)),
        str(out.get(NO_FINISH, 0)),
        "-" if ttft is None else f"{ttft:.0f}",
        f"{phase['duration_s']:.1f}",
    ]


def render(report: dict[str, Any]) -> str:
    phases, server = report["phases"], report["server"]
    sha = (report.get("git_sha") or "unknown")[:10]
    lines = [
        f"pagellm bench reliability: {report['base_url']}  model={report['model']}  "
        f"endpoint={report['config']['endpoint']}",
        f"cpu: {report['cpu_model']}  threads={report.get('num_threads')}  "
        f"torch={report.get('torch_version')}  git={sha}",
        rep.format_table(_HEADERS, [_row(p) for p in phases.values()]),
        f"server RSS: before {_mib(server['rss_before_mib'])}, "
        f"after {_mib(server['rss_after_mib'])} (from {server['rss_source']})",
        f"KV usage: idle {_pct(server['kv_usage_idle'])}, after the phases "
        f"{_pct(server.get('kv_usage_after'))}",
        _storm_line(phases["disconnect_storm"]),
        _slow_line(phases["slow_readers"]),
    ]
    if "sigterm" in phases:
        lines.append(_sigterm_line(phases["sigterm"]))
    for phase in phases.values():
        lines += [f"  {phase['phase']}: {d}" for d in phase["details"]]
    lines.append("problems: " + ("; ".join(report["problems"]) or "none"))
    return "\n".join(lines)


def _storm_line(storm: dict[str, Any]) -> str:
    if not storm["engine_metrics"]:
        return "disconnect_storm: no engine metrics (pass --replica-metrics-url)"
    idle = storm["idle_after_s"]
    when = f"idle {idle:.2f} s after the last close" if idle is not None else "never idle"
    return (
        f"disconnect_storm: {when} (KV {_pct(storm['kv_usage_at_last_close'])} then "
        f"{_pct(storm['kv_usage_after'])}), tokens generated after aborts "
        f"{storm['tokens_generated_after_aborts']:.0f}, aborted {storm['aborted_requests']:.0f}"
    )


def _slow_line(slow: dict[str, Any]) -> str:
    return (
        f"slow_readers: n={slow['n']}, {slow['pause_s']:g} s pause; server RSS "
        f"{_mib(slow['rss_before_mib'])} before, peak {_mib(slow['rss_peak_mib'])} meanwhile"
    )


def _sigterm_line(phase: dict[str, Any]) -> str:
    if phase["exited"]:
        code = "?" if phase["exit_code"] is None else phase["exit_code"]
        exit_text = f"exited with {code} {phase['exit_after_signal_s']:.1f} s after the signal"
    else:
        exit_text = "did not exit in time"
    return (
        f"sigterm: {phase['finished_whole']} of {phase['streams']} whole, {phase['cut']} not; "
        f"pid {phase['pid']} {exit_text}"
    )


def _mib(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f} MiB"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"
