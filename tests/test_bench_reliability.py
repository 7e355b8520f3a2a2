"""``pagellm bench reliability``: stream outcomes on scripted responses, the engine-metrics
reading, and a whole run with ``--launch`` against a tiny model ending in SIGTERM."""

from __future__ import annotations

import asyncio
import json
import shlex
import sys

import httpx
import pytest

from pagellm.bench import reliability as rb
from pagellm.cli import main


def _sse(*events: str) -> bytes:
    return "".join(f"data: {e}\n\n" for e in events).encode()


FINISHED = json.dumps({"choices": [{"index": 0, "text": "b", "finish_reason": "length"}]})
TOKEN = json.dumps({"choices": [{"index": 0, "text": "a", "finish_reason": None}]})
ERROR = json.dumps({"error": {"message": "boom", "code": 400}})


def _outcome(status: int, content: bytes, reader: rb.Reader | None = None, n: int = 1):
    async def go() -> rb.StreamResult:
        transport = httpx.MockTransport(lambda _: httpx.Response(status, content=content))
        async with httpx.AsyncClient(transport=transport) as client:
            body = {"n": n}
            return await rb.stream_one(client, "http://127.0.0.1/x", body, {}, 5.0, reader)

    return asyncio.run(go())


@pytest.mark.parametrize(
    ("status", "content", "n", "expected"),
    [
        (200, _sse(TOKEN, FINISHED, "[DONE]"), 1, rb.OK),
        (200, _sse(TOKEN, FINISHED, "[DONE]"), 2, rb.NO_FINISH),
        (200, _sse(TOKEN, TOKEN), 1, rb.CUT),
        (200, _sse(TOKEN, ERROR, "[DONE]"), 1, rb.ERROR_EVENT),
        (200, _sse("{not json"), 1, rb.BAD_EVENT),
        (200, _sse("[1]", "[DONE]"), 1, rb.BAD_EVENT),
        (200, _sse('{"choices": [1]}', "[DONE]"), 1, rb.BAD_EVENT),
        (503, b'{"error": {"message": "busy"}}', 1, "http_503"),
    ],
)
def test_stream_outcomes(status: int, content: bytes, n: int, expected: str) -> None:
    assert _outcome(status, content, n=n).outcome == expected


def test_the_client_closes_after_k_events() -> None:
    result = _outcome(200, _sse(TOKEN, TOKEN, TOKEN, FINISHED, "[DONE]"), rb.close_after(2))
    assert (result.outcome, result.events) == (rb.CLOSED, 2)


def test_phase_summary_counts_outcomes() -> None:
    results = [rb.StreamResult(rb.OK, ttft_s=0.1), rb.StreamResult("http_503", detail="busy")]
    s = rb.phase_summary("p", results, 1.0)
    assert s["outcomes"] == {"http_503": 1, "ok": 1} and s["details"] == ["http_503: busy"]
    assert s["median_ttft_ms"] == pytest.approx(100.0)


def test_engine_metrics_are_read_from_the_servers_page() -> None:
    from prometheus_client import generate_latest

    from pagellm.engine.outputs import EngineStats
    from pagellm.server.metrics import make_registry

    stats = EngineStats(num_running=2, num_waiting=1, kv_usage=0.25, generation_tokens=40)
    stats.finished = {"abort": 3, "length": 5}
    values = rb.parse_engine_metrics(generate_latest(make_registry(stats, "m")).decode())
    assert values.pop("rss_bytes") > 0
    assert values == {
        "running": 2.0,
        "waiting": 1.0,
        "kv_usage": 0.25,
        "generation_tokens": 40.0,
        "aborted": 3.0,
    }
    assert rb.parse_engine_metrics("pagellm_gateway_requests_total 3.0") == {}  # a gateway's


def test_only_loopback_and_the_launch_port_wins() -> None:
    assert rb.require_loopback("http://127.0.0.1:8000/") == "http://127.0.0.1:8000"
    assert rb.require_loopback("http://localhost:8000") == "http://localhost:8000"
    with pytest.raises(SystemExit):
        rb.require_loopback("http://10.1.2.3:8000")
    argv = rb.launch_argv("pagellm serve --port 1 --model 'a b'", 4242)
    assert argv[:3] == [sys.executable, "-m", "pagellm.cli"]
    assert argv[3:] == ["serve", "--port", "1", "--model", "a b", "--host", "127.0.0.1"] + [
        "--port",
        "4242",
    ]


def test_reliability_run_with_launch_ends_with_sigterm(tiny_models, tmp_path, capsys) -> None:
    model = tiny_models("llama")
    out = tmp_path / "reliability.json"
    server = [
        sys.executable, "-m", "pagellm.cli", "serve", "--model", str(model),
        "--dtype", "float32", "--kv-cache-memory", "0.02", "--max-model-len", "512",
        "--served-model-name", "tiny", "--api-key", "k", "--log-level", "warning",
    ]  # fmt: skip
    rc = main(
        [
            "bench", "reliability", "--launch", shlex.join(server), "--api-key", "k",
            "--streams", "16", "--storm", "8", "--storm-max-tokens", "64",
            "--slow-readers", "1", "--slow-n", "4", "--slow-max-tokens", "16",
            "--slow-pause", "1", "--sigterm-streams", "4", "--max-tokens", "8",
            "--request-timeout", "120", "--idle-timeout", "30", "--launch-timeout", "180",
            "--launch-log", str(tmp_path / "server.log"), "--output-json", str(out),
        ]
    )  # fmt: skip
    report = json.loads(out.read_text())
    assert rc == 0, report["problems"]
    phases = report["phases"]
    assert list(phases) == ["concurrent", "disconnect_storm", "slow_readers", "sigterm"]
    assert phases["concurrent"]["outcomes"] == {"ok": 16}
    storm = phases["disconnect_storm"]
    assert storm["outcomes"] == {"closed": 8}
    assert storm["idle_reached"] and storm["kv_usage_after"] == report["server"]["kv_usage_idle"]
    assert storm["tokens_generated_after_aborts"] is not None
    assert phases["slow_readers"]["outcomes"] == {"ok": 1}
    sigterm = phases["sigterm"]
    assert (sigterm["exited"], sigterm["exit_code"]) == (True, 0)
    assert sigterm["finished_whole"] == 4
    assert report["server"]["rss_before_mib"] > 0 and report["git_sha"]
    table = capsys.readouterr().out
    assert "disconnect_storm" in table and report["cpu_model"] in table
