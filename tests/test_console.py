"""The web console in a real browser (Debian's headless Chromium driven by Playwright): a server
with traffic shows KV blocks in use while requests run and none after, its queue counts match
/metrics, the playground streams a reply; the gateway's fleet view shows a killed replica down
with its breaker open. Screenshots go to ``$PAGELLM_TEST_ARTIFACTS`` (default ``test-artifacts``).
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

import httpx
import pytest
from server_helpers import (
    API_KEY,
    AUTH,
    MODEL_NAME,
    metrics,
    running_gateway,
    running_server,
    stop_server,
    wait_until,
)

from pagellm.bench.console import CHROMIUM, CHROMIUM_ARGS

pytestmark = [
    pytest.mark.timeout(600),
    pytest.mark.skipif(not Path(CHROMIUM).exists(), reason="Debian's chromium is not installed"),
]


def artifacts() -> Path:
    out = Path(os.environ.get("PAGELLM_TEST_ARTIFACTS", "test-artifacts"))
    out.mkdir(parents=True, exist_ok=True)
    return out


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield b
        b.close()


def open_console(browser, base: str, bypass_csp: bool = True):
    """The console in a new page; ``bypass_csp``: Playwright's own string predicates
    (``wait_for_function``) are evals, which the console's policy refuses."""
    page = browser.new_page(viewport={"width": 1280, "height": 1000}, bypass_csp=bypass_csp)
    page.goto(f"{base}/ui")
    page.fill("#api-key", API_KEY)
    page.dispatch_event("#api-key", "change")
    return page


def dom_int(page, selector: str, attribute: str | None = None) -> int:
    text = page.get_attribute(selector, attribute) if attribute else page.inner_text(selector)
    return int(text)


def test_server_console_live_state_and_playground(browser, tiny_models):
    # two seats: the other requests wait, so running/waiting stay put long enough to compare
    with running_server(tiny_models("llama"), "--max-num-seqs", "2", "--enforce-eager") as (
        _,
        base,
    ):
        strict = open_console(browser, base, bypass_csp=False)  # the page under its own CSP
        refused = []
        strict.on("console", lambda m: refused.append(m.text) if "Policy" in m.text else None)
        strict.wait_for_selector("#status[data-state='ok']", timeout=60_000)
        strict.close()
        assert not refused, refused
        page = open_console(browser, base)
        page.wait_for_function("document.getElementById('status').dataset.state === 'ok'")
        assert dom_int(page, "#kv-in-use", "data-in-use") == 0

        def one_client(i: int) -> None:
            body = {"model": MODEL_NAME, "prompt": f"client {i} " * 8, "max_tokens": 460,
                    "ignore_eos": True}  # fmt: skip
            httpx.post(f"{base}/v1/completions", json=body, headers=AUTH, timeout=300)

        clients = [threading.Thread(target=one_client, args=(i,)) for i in range(6)]
        for c in clients:
            c.start()
        page.wait_for_function(
            "Number(document.getElementById('kv-in-use').dataset.inUse) > 0", timeout=60_000
        )
        running = f'pagellm:num_requests_running{{model_name="{MODEL_NAME}"}}'
        waiting = f'pagellm:num_requests_waiting{{model_name="{MODEL_NAME}"}}'

        def dom_matches_metrics() -> bool:
            m = metrics(base)
            return (
                dom_int(page, "#q-running") == m[running] == 2
                and dom_int(page, "#q-waiting") == m[waiting] > 0
            )

        wait_until(dom_matches_metrics, timeout=30, what="the console's queues to match /metrics")
        assert page.locator("#requests tbody tr[data-queue=running]").count() == 2
        page.screenshot(path=str(artifacts() / "console-server-busy.png"), full_page=True)
        for c in clients:
            c.join(300)
        page.wait_for_function(
            "Number(document.getElementById('kv-in-use').dataset.inUse) === 0"
            " && document.getElementById('q-running').textContent === '0'",
            timeout=30_000,
        )
        page.fill("#prompt", "Say hello")
        page.click("#send")
        page.wait_for_function(
            "document.getElementById('chat-state').dataset.state === 'done'", timeout=60_000
        )
        reply = page.locator(".msg.assistant span").last.inner_text()
        assert reply.strip()
        page.screenshot(path=str(artifacts() / "console-server-idle.png"), full_page=True)


def test_console_needs_the_key_and_can_be_disabled(tiny_models):
    with running_server(tiny_models("llama"), "--disable-ui") as (_, base):
        assert httpx.get(f"{base}/ui", headers=AUTH).status_code == 404
    with running_server(tiny_models("llama")) as (_, base):
        assert httpx.get(f"{base}/ui").status_code == 200  # the page itself holds no data
        assert httpx.get(f"{base}/ui/api/state").status_code == 401
        state = httpx.get(f"{base}/ui/api/state", headers=AUTH).json()
        assert state["kind"] == "server" and state["blocks"]["num"] > 0


def test_gateway_console_shows_a_killed_replica_down(browser, tiny_models):
    model = tiny_models("llama")
    with running_server(model) as (p1, b1), running_server(model) as (p2, b2):  # noqa: SIM117
        with running_gateway(b1, b2) as gw:  # the gateway needs both replicas' addresses
            page = open_console(browser, gw)
            page.wait_for_function(
                "document.querySelectorAll('#replicas tbody tr[data-healthy=true]').length === 2",
                timeout=30_000,
            )
            stop_server(p2)
            page.wait_for_function(
                f"(() => {{ const r = document.querySelector('#replicas tbody tr[data-url=\"{b2}\"]');"
                " return r && r.dataset.healthy === 'false' && r.dataset.breaker === 'open'; })()",
                timeout=30_000,
            )
            row = page.locator(f'#replicas tbody tr[data-url="{b1}"]')
            assert row.get_attribute("data-healthy") == "true"
            page.screenshot(path=str(artifacts() / "console-gateway.png"), full_page=True)
            assert httpx.get(f"{gw}/ui/api/state").status_code == 200  # an open gateway


def test_a_state_that_does_not_come_is_503_and_frees_the_next_viewer(monkeypatch):
    """A stopped or stuck engine never answered the snapshot call: every later viewer waited on
    the state's lock for ever."""
    import asyncio

    from fastapi import FastAPI
    from starlette.testclient import TestClient

    from pagellm.console import routes

    monkeypatch.setattr(routes, "STATE_TIMEOUT", 0.2)
    stuck = {"on": True}

    async def state() -> dict:
        if stuck["on"]:
            await asyncio.sleep(3600)
        return {"kind": "server"}

    app = FastAPI()
    routes.install_console(app, state)
    with TestClient(app) as client:  # its own loop (the browser fixture may hold this one)
        first = client.get("/ui/api/state")
        assert first.status_code == 503 and first.json()["error"]["message"]
        stuck["on"] = False
        second = client.get("/ui/api/state")
        assert second.status_code == 200 and second.json() == {"kind": "server"}
        assert second.headers["cache-control"] == "no-store"
        page = client.get("/ui")
        assert page.headers["x-frame-options"] == "DENY"
        assert "script-src 'self'" in page.headers["content-security-policy"]
