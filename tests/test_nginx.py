"""deploy/nginx.conf in front of a real server (Debian's nginx, started here on loopback): tokens
stream through it as they are generated, and a client that leaves through nginx has its request
aborted and its KV blocks freed at the replica."""

from __future__ import annotations

import contextlib
import subprocess
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from server_helpers import AUTH, MODEL_NAME, aborted, leave_stream_after, running_server, wait_idle

from pagellm.bench.processes import free_port, stop_process

NGINX = "/usr/sbin/nginx"
CONF = Path(__file__).resolve().parent.parent / "deploy" / "nginx.conf"

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(not Path(NGINX).exists(), reason="Debian's nginx is not installed"),
]


@contextlib.contextmanager
def nginx_in_front(upstream: str, root: Path) -> Iterator[str]:
    """deploy/nginx.conf with its upstream and listen address set for this test."""
    port = free_port()
    conf = CONF.read_text()
    conf = conf.replace("server 127.0.0.1:8080", f"server {upstream.removeprefix('http://')}")
    conf = conf.replace("listen 127.0.0.1:8088", f"listen 127.0.0.1:{port}")
    (root / "tmp").mkdir(parents=True, exist_ok=True)
    (root / "nginx.conf").write_text(conf)
    proc = subprocess.Popen(
        [NGINX, "-p", str(root), "-c", str(root / "nginx.conf"), "-g", "daemon off;"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            assert proc.poll() is None, proc.stdout.read()
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                    break
            assert time.monotonic() < deadline, "nginx did not answer in 30 s"
            time.sleep(0.1)
        yield base
    finally:
        stop_process(proc, grace=10)


def chunk_times(base: str, max_tokens: int) -> list[float]:
    """Arrival times (from sending) of a streamed completion's SSE events."""
    body = {"model": MODEL_NAME, "prompt": "tick", "max_tokens": max_tokens, "ignore_eos": True,
            "stream": True}  # fmt: skip
    start, times = time.monotonic(), []
    with httpx.stream("POST", f"{base}/v1/completions", json=body, headers=AUTH, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data:") and line != "data: [DONE]":
                times.append(time.monotonic() - start)
    return times


@pytest.fixture(scope="module")
def server(tiny_models):
    # eager steps: slow enough that the tokens of a stream are spread in time
    with running_server(tiny_models("llama"), "--enforce-eager") as (_, base):
        yield base


def test_tokens_stream_through_nginx_as_generated(server, tmp_path):
    """The same stream at once directly and through nginx: the two requests share the
    replica's steps, so however busy the machine is, each proxied event arrives close to its
    direct twin; buffered, they would come in a few bursts, late."""
    with nginx_in_front(server, tmp_path) as front, ThreadPoolExecutor(2) as pool:
        direct_run, proxied_run = (pool.submit(chunk_times, b, 300) for b in (server, front))
        direct, proxied = direct_run.result(), proxied_run.result()
    # an event per token, but for the few whose text is held back (partial UTF-8; the two
    # streams sample their own tokens, so they hold back different numbers)
    assert len(direct) > 250 and len(proxied) > 250, (len(proxied), len(direct))
    distinct = len({round(t, 3) for t in proxied})
    assert distinct > 100, distinct  # many separate arrivals, not one dump
    spread = direct[-1] - direct[0]
    lags = sorted(p - d for p, d in zip(proxied, direct, strict=False))
    assert lags[len(lags) * 9 // 10] < 0.25 * spread, (lags[-1], spread)


def test_a_client_leaving_through_nginx_frees_the_replica(server, tmp_path):
    with nginx_in_front(server, tmp_path) as front:
        before = aborted(server)
        body = {"model": MODEL_NAME, "prompt": "go", "max_tokens": 480, "ignore_eos": True}
        leave_stream_after(f"{front}/v1/completions", body)
        wait_idle(server, before, within=10.0)
        assert aborted(server) == before + 1
