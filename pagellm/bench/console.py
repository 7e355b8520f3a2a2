"""``pagellm bench console``: does an open console slow the engine? Against a running server,
the same load (``--concurrency`` streams of random prompts, ``--output-len`` tokens each, EOS
ignored) runs with the console closed and open, alternating (``--rounds``). "Open" is the real
page in headless Chromium when it is installed (``--browser``), polling once a second like a
person's browser; otherwise the same ``/ui/api/state`` requests at 1 Hz.

Output: out tok/s of every run, the open/closed ratio, JSON (``--output-json``) and a table
headed by the CPU model.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import statistics
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from pagellm.bench import report as rep

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                 "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]  # fmt: skip


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser("console", help="throughput with the web console open vs closed")
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"))
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--requests", type=int, default=64, help="requests per run")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3, help="closed/open pairs")
    p.add_argument("--browser", choices=["auto", "chromium", "http"], default="auto")
    p.add_argument("--output-json", default=None)
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    model = httpx.get(f"{args.base_url}/v1/models", headers=headers).json()["data"][0]["id"]
    use_browser = args.browser == "chromium" or (args.browser == "auto" and Path(CHROMIUM).exists())
    asyncio.run(_load(args, headers, model, 8))  # warm up
    runs = []
    for _ in range(args.rounds):
        for console in (False, True):
            with _console_open(args, headers, use_browser) if console else contextlib.nullcontext():
                tps = asyncio.run(_load(args, headers, model, args.requests))
            runs.append({"console": console, "output_tokens_per_s": tps})
    closed = [r["output_tokens_per_s"] for r in runs if not r["console"]]
    opened = [r["output_tokens_per_s"] for r in runs if r["console"]]
    report = {
        "benchmark": "console",
        "git_sha": rep.git_sha(),
        **rep.environment(),
        "config": {k: v for k, v in vars(args).items() if k not in ("func", "api_key")},
        "console_client": "chromium" if use_browser else "http",
        "runs": runs,
        "open_over_closed": statistics.mean(opened) / statistics.mean(closed),
    }
    print(render(report))
    if args.output_json:
        rep.write_report(args.output_json, report)
    return 0


async def _load(args, headers: dict, model: str, requests: int) -> float:
    """Output tokens per second of ``requests`` streamed completions, ``concurrency`` at once."""
    rng = random.Random(0)
    prompts = [[rng.randrange(1000, 30000) for _ in range(args.input_len)] for _ in range(requests)]
    queue: asyncio.Queue = asyncio.Queue()
    for p in prompts:
        queue.put_nowait(p)
    tokens = 0

    async def worker(client: httpx.AsyncClient) -> None:
        nonlocal tokens
        while not queue.empty():
            prompt = queue.get_nowait()
            body = {"model": model, "prompt": prompt, "max_tokens": args.output_len,
                    "ignore_eos": True, "temperature": 0, "stream": True}  # fmt: skip
            async with client.stream("POST", f"{args.base_url}/v1/completions", json=body,
                                     headers=headers) as resp:  # fmt: skip
                async for line in resp.aiter_lines():
                    tokens += line.startswith("data: {")

    start = time.perf_counter()
    async with httpx.AsyncClient(timeout=600) as client:
        await asyncio.gather(*(worker(client) for _ in range(args.concurrency)))
    return tokens / (time.perf_counter() - start)


@contextlib.contextmanager
def _console_open(args, headers: dict, use_browser: bool):
    """The console open for the duration: the page in Chromium, or its polls over HTTP."""
    stop = threading.Event()
    target = _browser_console if use_browser else _http_console
    thread = threading.Thread(target=target, args=(args, headers, stop), daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(30)


def _browser_console(args, headers: dict, stop: threading.Event) -> None:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1280, "height": 1000})
        page.goto(f"{args.base_url}/ui")
        if args.api_key:
            page.fill("#api-key", args.api_key)
            page.dispatch_event("#api-key", "change")
        while not stop.wait(0.5):
            page.wait_for_timeout(10)  # let the page's timers run
        browser.close()


def _http_console(args, headers: dict, stop: threading.Event) -> None:
    with httpx.Client(timeout=30) as client:
        while not stop.wait(1.0):
            client.get(f"{args.base_url}/ui/api/state", headers=headers)


def render(report: dict[str, Any]) -> str:
    rows = [[f"run {i + 1}", "open" if r["console"] else "closed", f"{r['output_tokens_per_s']:.1f}"]
            for i, r in enumerate(report["runs"])]  # fmt: skip
    cfg = report["config"]
    return "\n".join([
        rep.cpu_line(report),
        f"pagellm bench console: {cfg['base_url']} concurrency={cfg['concurrency']} "
        f"requests={cfg['requests']} {cfg['input_len']}/{cfg['output_len']} tokens, console via "
        f"{report['console_client']}",
        rep.format_table(["run", "console", "out tok/s"], rows),
        f"open / closed: {report['open_over_closed']:.3f}",
    ])  # fmt: skip
