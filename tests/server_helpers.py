"""Start and stop ``pagellm serve`` processes for the server tests (loopback, free ports)."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx

MODEL_NAME = "tiny-llama"
API_KEY = "test-key"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(model_dir, port: int, *extra: str, launcher: tuple[str, ...] | None = None):
    launcher = launcher or ("-m", "pagellm.cli")
    cmd = [
        sys.executable, *launcher, "serve", "--model", str(model_dir),
        "--dtype", "float32", "--kv-cache-memory", "0.02", "--max-model-len", "512",
        "--served-model-name", MODEL_NAME, "--api-key", API_KEY, "--port", str(port),
        "--max-body-bytes", "20000", "--log-level", "warning", *extra,
    ]  # fmt: skip
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


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
    model_dir, *extra: str, launcher: tuple[str, ...] | None = None
) -> Iterator[tuple[subprocess.Popen, str]]:
    """A healthy server process on a free loopback port; always stopped afterwards."""
    port = free_port()
    proc = _start(model_dir, port, *extra, launcher=launcher)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, base)
        yield proc, base
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()


AUTH = {"Authorization": f"Bearer {API_KEY}"}


def metrics(server: str) -> dict[str, float]:
    """The server's ``pagellm:`` samples, keyed by name with labels."""
    values = {}
    for line in httpx.get(f"{server}/metrics").text.splitlines():
        if line.startswith("pagellm:"):
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    return values


def aborted(server: str) -> float:
    """Sequences the server finished by abort so far."""
    return sum(v for k, v in metrics(server).items() if 'finished_reason="abort"' in k)
