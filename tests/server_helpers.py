"""Start and stop ``pagellm serve`` processes for the server tests (loopback, free ports)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

from pagellm.bench.processes import free_port, stop_process

MODEL_NAME = "tiny-llama"
API_KEY = "test-key"


def start_server(
    model_dir,
    port: int,
    *extra: str,
    launcher: tuple[str, ...] | None = None,
    key_args: tuple[str, ...] = ("--api-key", API_KEY),
    env: dict[str, str] | None = None,
) -> subprocess.Popen:
    """Start ``pagellm serve`` (tiny-model settings) on ``port``; wait with wait_healthy."""
    launcher = launcher or ("-m", "pagellm.cli")
    cmd = [
        sys.executable, *launcher, "serve", "--model", str(model_dir),
        "--dtype", "float32", "--kv-cache-memory", "0.02", "--max-model-len", "512",
        "--served-model-name", MODEL_NAME, *key_args, "--port", str(port),
        "--max-body-bytes", "20000", "--log-level", "warning", *extra,
    ]  # fmt: skip
    return subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )


def wait_healthy(proc: subprocess.Popen, base: str) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.stdout.read()
        try:
            if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise AssertionError("server did not become healthy in 120 s")


@contextlib.contextmanager
def running_server(
    model_dir, *extra: str, launcher: tuple[str, ...] | None = None, **options
) -> Iterator[tuple[subprocess.Popen, str]]:
    """A healthy server process on a free loopback port; always stopped afterwards."""
    port = free_port()
    proc = start_server(model_dir, port, *extra, launcher=launcher, **options)
    with _serving(proc, port) as base:
        yield proc, base


@contextlib.contextmanager
def _serving(proc: subprocess.Popen, port: int) -> Iterator[str]:
    """Wait for ``proc`` to answer /health on ``port``; stop it however the block ends."""
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, base)
        yield base
    finally:
        stop_server(proc)


AUTH = {"Authorization": f"Bearer {API_KEY}"}


def metrics(server: str) -> dict[str, float]:
    """The server's ``pagellm:`` samples, keyed by name with labels."""
    values = {}
    for line in httpx.get(f"{server}/metrics", headers=AUTH).text.splitlines():
        if line.startswith("pagellm:"):
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    return values


def aborted(server: str) -> float:
    """Sequences the server finished by abort so far."""
    return sum(v for k, v in metrics(server).items() if 'finished_reason="abort"' in k)


@contextlib.contextmanager
def running_gateway(
    *backends: str,
    routing: str = "round-robin",
    extra: tuple[str, ...] = (),
    health_interval: float = 0.3,
) -> Iterator[str]:
    """A healthy `pagellm gateway` on a free loopback port (quick health checks, a breaker that
    opens on one failure and probes after a second); always stopped afterwards."""
    port = free_port()
    cmd = [sys.executable, "-m", "pagellm.cli", "gateway", "--port", str(port)]
    for b in backends:
        cmd += ["--backend", b]
    cmd += ["--routing", routing, "--backend-api-key", API_KEY,
            "--health-interval", str(health_interval), "--breaker-failures", "1",
            "--breaker-reset", "1", "--log-level", "warning", *extra]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    with _serving(proc, port) as base:
        yield base


@contextlib.contextmanager
def running_fake(model: str = "fake") -> Iterator[tuple[subprocess.Popen, str]]:
    """A scripted replica (tests/fake_replica.py) on a free loopback port."""
    port = free_port()
    script = Path(__file__).with_name("fake_replica.py")
    cmd = [sys.executable, str(script), "--port", str(port), "--model", model]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    with _serving(proc, port) as base:
        yield proc, base


def stop_server(proc: subprocess.Popen) -> None:
    stop_process(proc, grace=20)


def wait_until(condition, timeout: float = 10.0, what: str = "condition") -> None:
    """Poll ``condition()`` every 50 ms until it is true; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def gateway_metric(base: str, prefix: str, headers: dict[str, str] | None = None) -> float:
    """Sum of the gateway's samples whose line starts with ``prefix`` (name{labels...);
    ``headers``: the key of a gateway that has keys."""
    response = httpx.get(f"{base}/metrics", headers=headers)
    response.raise_for_status()  # a refused scrape must not read as zeros
    total = 0.0
    for line in response.text.splitlines():
        if line.startswith(prefix):
            total += float(line.rsplit(" ", 1)[1])
    return total


def stream_outcome(gw: str, body: dict) -> str:
    """'done' (every event and [DONE], no error event), 'error' (a clean error event or an
    OpenAI-style error status), or what else happened (a test failure)."""
    with httpx.stream("POST", f"{gw}/v1/completions", json=body, headers=AUTH, timeout=30) as r:
        if r.status_code != 200:
            return "error" if "error" in r.read().decode() else f"status {r.status_code}"
        events = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
    if not events or events[-1] != "data: [DONE]":
        return "silent cut"
    return "error" if any('"error"' in e for e in events) else "done"


def leave_stream_after(url: str, body: dict, events: int = 3) -> None:
    """Stream ``body`` to ``url`` and disconnect after ``events`` SSE events."""
    with httpx.stream("POST", url, json={**body, "stream": True}, headers=AUTH) as r:
        seen = 0
        for line in r.iter_lines():
            seen += line.startswith("data:")
            if seen >= events:
                break


def wait_idle(server: str, aborted_before: float, within: float = 5.0) -> dict[str, float]:
    """Wait until the server runs nothing, holds no KV and has aborted a request since
    ``aborted_before``; its metrics then."""
    deadline = time.monotonic() + within
    while True:
        m = metrics(server)
        running = m[f'pagellm:num_requests_running{{model_name="{MODEL_NAME}"}}']
        kv = m[f'pagellm:kv_cache_usage_perc{{model_name="{MODEL_NAME}"}}']
        if running == 0 and kv == 0 and aborted(server) > aborted_before:
            return m
        if time.monotonic() > deadline:
            raise AssertionError(f"not idle with an abort within {within} s: {m}")
        time.sleep(0.05)


def pid_alive(pid: int) -> bool:
    """Whether a process with this id exists (a zombie counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
