"""Server processes that benchmarks (and tests) start on loopback: a free port, a start that
waits for ``/health`` with a bound, and a stop that cannot hang (SIGTERM, then SIGKILL)."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import time
from collections.abc import Iterator


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop_process(proc: subprocess.Popen, grace: float = 30.0) -> None:
    """SIGTERM (a server drains), then SIGKILL after ``grace`` seconds; no-op once it exited."""
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=grace)


def wait_healthy(proc: subprocess.Popen, base_url: str, timeout: float, log: object) -> None:
    """Poll ``base_url``/health until 200; RuntimeError (naming ``log``) if the process exits
    or ``timeout`` seconds pass."""
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited ({proc.returncode}); see {log}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{base_url}/health", timeout=2.0, trust_env=False).status_code == 200:
                return
        time.sleep(0.5)
    raise RuntimeError(f"the server was not healthy in {timeout:g} s; see {log}")


@contextlib.contextmanager
def running_process(
    cmd: list[str],
    base_url: str,
    log: object,
    timeout: float,
    env: dict[str, str] | None = None,
    grace: float = 30.0,
) -> Iterator[subprocess.Popen]:
    """``cmd`` started (output to the file ``log``) and healthy at ``base_url``; stopped on
    the way out if it is still running."""
    with open(log, "w") as out:  # type: ignore[call-overload]
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        wait_healthy(proc, base_url, timeout, log)
        yield proc
    finally:
        stop_process(proc, grace)
