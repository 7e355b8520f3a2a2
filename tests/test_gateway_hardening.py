"""The gateway against what clients and replicas may send it: the key is checked before the body
is read and the body is counted as it arrives; metric labels stay bounded; a key's priority and
tenant cannot be spoofed; only a replica that could not take a request is retried (and blamed);
token charges are upper bounds settled after the fact, streams included; what a request holds is
released however it ends; a client that leaves a plain request cancels it upstream; background
loops survive what they did not expect; the overload queue keeps a line per model.

Most tests drive the gateway's ASGI app in-process (``call``) in front of replicas scripted with
httpx.MockTransport (``Upstream``), on a clock that never moves; the last ones run the gateway
and tests/fake_replica.py as processes."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import threading
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
from fakes import FakeClock
from server_helpers import gateway_metric, running_fake, running_gateway, wait_until

from pagellm.gateway.app import Gateway, build_gateway_app
from pagellm.gateway.config import Fleet, GatewaySettings, OverloadSettings
from pagellm.gateway.limits import hash_key

A, B = "http://a", "http://b"
KEY = "secret"
BEARER = [("authorization", f"Bearer {KEY}")]
PATH = "/v1/completions"
PLAIN = {"model": "m", "prompt": "x", "max_tokens": 2}

# ----- an in-process harness ---------------------------------------------------------------------

Script = Callable[[httpx.Request, dict[str, Any]], Awaitable[httpx.Response]]


class Events(httpx.AsyncByteStream):
    """A replica's SSE body: these chunks, then (optionally) an exception, as a cut connection."""

    def __init__(self, chunks: list[bytes], then: Exception | None = None) -> None:
        self.chunks, self.then = chunks, then
        self.closed = False

    async def __aiter__(self):
        for chunk in self.chunks:
            yield chunk
        if self.then is not None:
            raise self.then

    async def aclose(self) -> None:
        self.closed = True


class _Stalled(httpx.AsyncByteStream):
    """An Events body read through another iterator (one that can wait midway)."""

    def __init__(self, events: Events, chunks: Callable[[], Any]) -> None:
        self.events, self.chunks = events, chunks

    def __aiter__(self):
        return self.chunks()

    async def aclose(self) -> None:
        await self.events.aclose()


def _event(payload: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(payload)}\n\n".encode()


async def answer_ok(request: httpx.Request, body: dict[str, Any]) -> httpx.Response:
    """A whole answer or a stream; completion tokens = max_tokens (or 3), prompt tokens 5."""
    n = body.get("max_tokens") or 3
    usage = {"prompt_tokens": 5, "completion_tokens": n, "total_tokens": 5 + n}
    if not body.get("stream"):
        choice = {"index": 0, "text": "x" * n, "finish_reason": "length"}
        return httpx.Response(200, json={"choices": [choice], "usage": usage})
    chunks = [_event({"choices": [{"index": 0, "text": "x"}]}) for _ in range(n)]
    if (body.get("stream_options") or {}).get("include_usage"):
        chunks.append(_event({"choices": [], "usage": usage}))
    chunks.append(b"data: [DONE]\n\n")
    return httpx.Response(200, headers={"content-type": "text/event-stream"}, stream=Events(chunks))


def answer_error(status: int, headers: dict[str, str] | None = None) -> Script:
    async def answer(request: httpx.Request, body: dict[str, Any]) -> httpx.Response:
        error = {"message": f"replica says {status}", "type": "x", "param": None, "code": "c"}
        return httpx.Response(status, json={"error": error}, headers=headers)

    return answer


def answer_raising(exc: Callable[[httpx.Request], Exception]) -> Script:
    async def answer(request: httpx.Request, body: dict[str, Any]) -> httpx.Response:
        raise exc(request)

    return answer


class Upstream:
    """Replicas behind an httpx.MockTransport: each answers completions as its script says and
    records what it received; /health is 200, /v1/models lists its models."""

    def __init__(self, models: dict[str, Any] | None = None) -> None:
        self.models = models or {A: ["m"], B: ["m"]}
        self.script: dict[str, Script] = {}
        self.metrics_text: dict[str, str] = {}
        """A replica's /metrics page (404 for one not given)."""
        self.seen: dict[str, list[dict[str, Any]]] = defaultdict(list)
        self.transport = httpx.MockTransport(self.handle)

    async def handle(self, request: httpx.Request) -> httpx.Response:
        base = f"http://{request.url.host}"
        if request.url.path == "/health":
            return httpx.Response(200)
        if request.url.path == "/v1/models":
            models = self.models.get(base, [])
            if not (isinstance(models, list) and all(isinstance(m, str) for m in models)):
                return httpx.Response(200, json=models)  # a malformed reply, as scripted
            cards = [{"id": m, "object": "model", "max_model_len": 512} for m in models]
            return httpx.Response(200, json={"object": "list", "data": cards})
        if request.url.path == "/metrics":
            text = self.metrics_text.get(base)
            return httpx.Response(404) if text is None else httpx.Response(200, text=text)
        body = json.loads(await request.aread())
        self.seen[base].append({"body": body, "headers": request.headers})
        return await self.script.get(base, answer_ok)(request, body)


def gateway(
    upstream: Upstream,
    keys: list[dict[str, Any]] = (),
    overload: OverloadSettings | None = None,
    tokenizers: dict[str, Any] | None = None,
    backends: tuple[str, ...] = (A, B),
    **settings: Any,
) -> Gateway:
    fleet = Fleet(backends=backends, keys=tuple(keys), overload=overload or OverloadSettings())
    settings = {"routing": "round-robin", "breaker_failures": 1, **settings}
    return Gateway(
        GatewaySettings(fleet=fleet, **settings),
        clock=FakeClock(step=0.0),
        transport=upstream.transport,
        tokenizers=tokenizers,
    )


@dataclass
class Reply:
    status: int = 0
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b""
    read: int = 0
    """Request body chunks the app took."""
    raised: BaseException | None = None

    def json(self) -> Any:
        return json.loads(self.body)

    @property
    def error(self) -> dict[str, Any]:
        error = self.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}, error  # the OpenAI shape
        return error

    def events(self) -> list[str]:
        lines = self.body.decode().splitlines()
        return [ln.removeprefix("data: ") for ln in lines if ln.startswith("data: ")]


async def call(
    app: Any,
    payload: dict[str, Any] | None = None,
    path: str = PATH,
    chunks: list[bytes] | None = None,
    headers: list[tuple[str, Any]] = (),
    leave: asyncio.Event | None = None,
    leave_on_start: bool = False,
    method: str = "POST",
    body_unfinished: bool = False,
) -> Reply:
    """One HTTP request through the ASGI app: the body in ``chunks`` (or ``payload`` as JSON;
    ``body_unfinished``: more is announced and never comes), a disconnect once ``leave`` is set
    (or once the response starts)."""
    chunks = chunks if chunks is not None else [json.dumps(payload).encode()]
    reply, finished, leave = Reply(), asyncio.Event(), leave or asyncio.Event()

    async def receive() -> dict[str, Any]:
        if reply.read < len(chunks):
            reply.read += 1
            more = reply.read < len(chunks) or body_unfinished
            return {"type": "http.request", "body": chunks[reply.read - 1], "more_body": more}
        ends = [asyncio.ensure_future(e.wait()) for e in (finished, leave)]
        try:
            await asyncio.wait(ends, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for end in ends:
                end.cancel()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            reply.status = message["status"]
            reply.headers = {k.decode().lower(): v.decode() for k, v in message["headers"]}
            if leave_on_start:
                leave.set()
        elif message["type"] == "http.response.body":
            reply.body += message.get("body", b"")
            if not message.get("more_body"):
                finished.set()
        await asyncio.sleep(0)

    raw = [(b"content-type", b"application/json")]
    raw += [(k.lower().encode(), v if isinstance(v, bytes) else v.encode()) for k, v in headers]
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method,
             "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
             "root_path": "", "headers": raw, "client": ("127.0.0.1", 1234),
             "server": ("gateway", 80)}  # fmt: skip
    try:
        await app(scope, receive, send)
    except Exception as exc:  # noqa: BLE001 - what the server would log; the test looks at it
        reply.raised = exc
    return reply


def run(scenario: Awaitable[Any]) -> Any:
    return asyncio.run(asyncio.wait_for(scenario, 30))


async def until(condition: Callable[[], bool], what: str, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)


def samples(gw: Gateway, family: Any) -> list[Any]:
    return [s for metric in family.collect() for s in metric.samples]


# ----- 1. bodies: the key first, then the body counted as it arrives, tokenized off the loop -----


def test_a_request_without_a_valid_key_is_refused_before_its_body_is_read():
    async def scenario() -> None:
        app = build_gateway_app(gateway(Upstream(), keys=[{"name": "a", "key": KEY}]))
        parts = [b'{"model": "m", ', b'"prompt": "x"}']
        for headers in ([], [("authorization", "Bearer wrong")]):
            reply = await call(app, chunks=parts, headers=headers)
            assert reply.status == 401 and reply.error["type"] == "authentication_error"
            assert reply.read == 0

    run(scenario())


def test_a_body_over_the_limit_is_refused_as_it_arrives():
    megabyte = b" " * (1 << 20)

    async def scenario() -> None:
        up = Upstream()
        app = build_gateway_app(gateway(up))  # the default limit: 4 MiB
        reply = await call(app, chunks=[megabyte] * 64)  # no Content-Length: counted
        assert reply.status == 413 and reply.error["type"] == "invalid_request_error"
        assert reply.read <= 5
        declared = [("content-length", str(64 << 20))]
        reply = await call(app, chunks=[megabyte] * 64, headers=declared)
        assert reply.status == 413 and reply.read == 0
        assert not up.seen

    run(scenario())


class _CountingTokenizer:
    """One token per word; notes the thread that counted."""

    def __init__(self) -> None:
        self.threads: list[int] = []

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self.threads.append(threading.get_ident())
        return [1] * len(text.split())

    def chat_token_ids(self, messages: list[dict[str, Any]]) -> list[int]:
        return self.encode(" ".join(m["content"] for m in messages))


def test_the_prompt_is_counted_off_the_event_loop():
    async def scenario() -> None:
        tokenizer = _CountingTokenizer()
        gw = gateway(Upstream(), tokenizers={"m": tokenizer})
        gw.max_model_len["m"] = 512
        app = build_gateway_app(gw)
        assert (await call(app, {**PLAIN, "prompt": "a b c"})).status == 200
        too_long = await call(app, {**PLAIN, "prompt": "w " * 600})
        assert too_long.status == 400 and too_long.error["code"] == "context_length_exceeded"
        assert len(tokenizer.threads) == 2
        assert threading.get_ident() not in tokenizer.threads  # never on the loop's thread

    run(scenario())


def test_a_prompt_the_tokenizer_cannot_take_is_a_400_not_a_500():
    class Failing(_CountingTokenizer):
        def chat_token_ids(self, messages: list[dict[str, Any]]) -> list[int]:
            raise RuntimeError("the chat template raised")  # e.g. a jinja error

    async def scenario() -> None:
        up = Upstream()
        app = build_gateway_app(gateway(up, tokenizers={"m": Failing()}))
        chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
        reply = await call(app, chat, "/v1/chat/completions")
        assert reply.status == 400 and "template" in reply.error["message"]
        assert not up.seen

    run(scenario())


# ----- 2. metric labels ---------------------------------------------------------------------------


def test_metric_labels_take_only_served_models_and_only_after_authentication():
    async def scenario() -> None:
        gw = gateway(Upstream(), keys=[{"name": "team", "key": KEY}])
        await gw.check_all()  # the replicas serve "m"
        app = build_gateway_app(gw)
        for i in range(200):  # no key, invented model names
            assert (await call(app, {"model": f"made-up-{i}", "prompt": "x"})).status == 401
        assert (await call(app, PLAIN)).status == 401  # a served model, still no key
        assert (await call(app, {**PLAIN, "model": "other"}, headers=BEARER)).status == 404
        assert (await call(app, PLAIN, headers=BEARER)).status == 200
        counted = {
            (s.labels["key"], s.labels["model"], s.labels["status"]): s.value
            for s in samples(gw, gw.metrics.requests)
            if s.name.endswith("_total")
        }
        assert counted == {("", "unknown", "401"): 201, ("team", "unknown", "404"): 1,
                           ("team", "m", "200"): 1}  # fmt: skip

    run(scenario())


# ----- 3. priority and user -------------------------------------------------------------------


def test_priority_and_user_come_from_the_key_unless_it_lets_the_client_choose():
    keys = [
        {"name": "fixed", "key": "k-fixed", "priority": 5, "tenant": "team"},
        {"name": "plain", "key": "k-plain"},
        {"name": "free", "key": "k-free", "priority": 1, "tenant": "t",
         "allow_client_priority": True, "allow_client_user": True},
    ]  # fmt: skip
    chosen = {**PLAIN, "priority": 99, "user": "someone-else"}

    async def sent(app: Any, up: Upstream, body: dict[str, Any], key: str | None) -> tuple:
        headers = [("authorization", f"Bearer {key}")] if key else []
        assert (await call(app, body, headers=headers)).status == 200
        forwarded = [s["body"] for seen in up.seen.values() for s in seen][-1]
        return forwarded.get("priority"), forwarded.get("user")

    async def scenario() -> None:
        up = Upstream()
        app = build_gateway_app(gateway(up, keys=keys, backends=(A,)))
        assert await sent(app, up, chosen, "k-fixed") == (5, "team")
        assert await sent(app, up, chosen, "k-plain") == (None, None)
        assert await sent(app, up, chosen, "k-free") == (99, "someone-else")
        assert await sent(app, up, PLAIN, "k-free") == (1, "t")  # the key's, when none is given
        up = Upstream()
        open_gateway = build_gateway_app(gateway(up))  # no keys: the client's own
        assert await sent(open_gateway, up, chosen, None) == (99, "someone-else")

    run(scenario())


def test_the_new_key_fields_are_read_and_checked(tmp_path):
    from pagellm.gateway.config import ConfigError, read_fleet

    cfg = tmp_path / "g.yaml"
    cfg.write_text(
        "backends: [http://a]\nkeys:\n  - {key: k, allow_client_priority: true, "
        "allow_client_user: false, max_tokens_default: 64, tokens_per_minute: 1000}\n"
    )
    (entry,) = read_fleet(cfg).keys
    assert entry["allow_client_priority"] is True and entry["max_tokens_default"] == 64
    for text, named in (
        ("{key: k, allow_client_user: maybe}", "allow_client_user"),
        ("{key: k, max_tokens_default: 0}", "max_tokens_default"),
        ("{key: k, max_tokens_default: true}", "max_tokens_default"),
        ("{key: k, priority: true}", "priority"),
        ("{key: k, models: [[1]]}", "models"),
        ("{key: k, tokens_per_minute: -5}", "tokens_per_minute"),
    ):
        cfg.write_text(f"backends: [http://a]\nkeys:\n  - {text}\n")
        with pytest.raises(ConfigError, match=named):
            read_fleet(cfg)


# ----- 4. failure accounting ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("status", "headers", "stream"),
    [(500, {}, False), (504, {}, False), (503, {"Retry-After": "3"}, False), (400, {}, False),
     (429, {"Retry-After": "1"}, False), (500, {}, True)],
)  # fmt: skip
def test_a_replicas_error_answer_is_relayed_not_retried_nor_held_against_it(
    status, headers, stream
):
    async def scenario() -> None:
        up = Upstream()
        up.script[A] = answer_error(status, headers)
        gw = gateway(up)
        reply = await call(build_gateway_app(gw), {**PLAIN, "stream": stream})
        assert reply.status == status
        assert reply.error["message"] == f"replica says {status}"  # the replica's own body
        assert reply.headers.get("retry-after") == headers.get("Retry-After")
        assert len(up.seen[A]) == 1 and not up.seen[B]
        assert gw.replicas[0].breaker.failures == 0 and gw.replicas[0].outstanding == 0

    run(scenario())


def _connect_error(request: httpx.Request) -> Exception:
    return httpx.ConnectError("refused", request=request)


def _disconnected(request: httpx.Request) -> Exception:
    return httpx.RemoteProtocolError("Server disconnected without a response", request=request)


@pytest.mark.parametrize(
    "script",
    [answer_error(502), answer_error(503), answer_raising(_connect_error),
     answer_raising(_disconnected)],
)  # fmt: skip
def test_a_replica_that_could_not_take_the_request_is_retried_and_counted(script):
    async def scenario() -> None:
        up = Upstream()
        up.script[A] = script
        gw = gateway(up)
        assert (await call(build_gateway_app(gw), PLAIN)).status == 200
        assert len(up.seen[B]) == 1  # retried on the other
        assert gw.replicas[0].breaker.failures == 1
        assert [r.outstanding for r in gw.replicas] == [0, 0]

    run(scenario())


async def _answer_then_break(request: httpx.Request, body: dict[str, Any]) -> httpx.Response:
    cut = httpx.ReadError("connection reset", request=request)
    return httpx.Response(200, headers={"content-type": "application/json"},
                          stream=Events([b'{"choices": ['], then=cut))  # fmt: skip


def _read_timeout(request: httpx.Request) -> Exception:
    return httpx.ReadTimeout("no answer in time", request=request)


@pytest.mark.parametrize(
    ("script", "status", "kind"),
    [
        (answer_raising(_read_timeout), 504, "timeout_error"),
        (_answer_then_break, 502, "bad_gateway"),
    ],
)
def test_a_replica_that_took_the_request_is_never_retried(script, status, kind):
    async def scenario() -> None:
        up = Upstream()
        up.script[A] = script
        gw = gateway(up)
        reply = await call(build_gateway_app(gw), PLAIN)
        assert reply.status == status and reply.error["type"] == kind
        assert len(up.seen[A]) == 1 and not up.seen[B]  # the work is not done twice
        assert [r.outstanding for r in gw.replicas] == [0, 0]

    run(scenario())


def test_a_stream_that_fails_before_its_first_event_is_still_retried():
    async def cut_early(request: httpx.Request, body: dict[str, Any]) -> httpx.Response:
        return httpx.Response(200, stream=Events([], then=_disconnected(request)))

    async def scenario() -> None:
        up = Upstream()
        up.script[A] = cut_early
        gw = gateway(up)
        reply = await call(build_gateway_app(gw), {**PLAIN, "stream": True})
        assert reply.status == 200 and reply.events()[-1] == "[DONE]"
        assert len(up.seen[B]) == 1 and gw.replicas[0].breaker.failures == 1

    run(scenario())


# ----- 5. token charges -----------------------------------------------------------------------


def test_max_tokens_and_n_must_be_positive_integers():
    bad = [("max_tokens", -1000000000), ("max_tokens", 0), ("max_tokens", 1.5),
           ("max_tokens", "8"), ("max_tokens", True), ("max_completion_tokens", -5),
           ("n", 0), ("n", 129), ("n", 2.0), ("model", ["m"])]  # fmt: skip

    async def scenario() -> None:
        up = Upstream()
        app = build_gateway_app(gateway(up))
        for name, value in bad:
            reply = await call(app, {**PLAIN, name: value})
            assert reply.status == 400, (name, value)
            assert reply.error["param"] == name
        assert not up.seen
        assert (await call(app, {**PLAIN, "n": 128, "max_tokens": None})).status == 200

    run(scenario())


def test_a_negative_max_tokens_cannot_refill_the_token_bucket():
    keys = [{"name": "a", "key": KEY, "tokens_per_minute": 3000}]
    request = {**PLAIN, "max_tokens": 300}  # uses 305 tokens (prompt 5)

    async def admitted(app: Any) -> int:
        for n in range(30):
            reply = await call(app, request, headers=BEARER)
            if reply.status == 429:
                return n
            assert reply.status == 200
        return 30

    async def scenario() -> None:
        before = await admitted(build_gateway_app(gateway(Upstream(), keys=keys)))
        assert 5 <= before <= 10
        app = build_gateway_app(gateway(Upstream(), keys=keys))
        negative = await call(app, {**PLAIN, "max_tokens": -1000000000}, headers=BEARER)
        assert negative.status == 400
        assert await admitted(app) == before

    run(scenario())


def test_a_request_without_max_tokens_is_capped_and_charged_for_the_cap():
    keys = [
        {"name": "small", "key": "k-small", "tokens_per_minute": 100, "max_tokens_default": 64},
        {"name": "large", "key": "k-large", "tokens_per_minute": 100, "max_tokens_default": 200},
        {"name": "default", "key": "k-default", "tokens_per_minute": 100000},
        {"name": "free", "key": "k-free"},
    ]
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}

    async def forwarded(app: Any, up: Upstream, key: str) -> dict[str, Any]:
        reply = await call(app, chat, "/v1/chat/completions", headers=[("authorization", key)])
        assert reply.status == 200, reply.body
        return up.seen[A][-1]["body"]

    async def scenario() -> None:
        up = Upstream()
        gw = gateway(up, keys=keys, backends=(A,))
        await gw.check_all()  # the model's context: 512
        app = build_gateway_app(gw)
        assert (await forwarded(app, up, "Bearer k-small"))["max_tokens"] == 64
        never = await call(
            app, chat, "/v1/chat/completions", headers=[("authorization", "Bearer k-large")]
        )
        assert never.status == 429 and "exceeds" in never.error["message"]  # 200 > 100 a minute
        prompt_bound = len(json.dumps(chat["messages"]).encode()) + 64
        assert (await forwarded(app, up, "Bearer k-default"))["max_tokens"] == min(
            1024, 512 - prompt_bound
        )
        assert "max_tokens" not in await forwarded(app, up, "Bearer k-free")  # no token limit

    run(scenario())


def test_usage_over_the_charge_is_taken_after_the_fact():
    from pagellm.gateway.limits import KeyRing

    clock = FakeClock(step=0.0)
    ring = KeyRing([{"name": "a", "key": KEY, "tokens_per_minute": 1000}], clock)
    key = ring.identify(f"Bearer {KEY}")
    assert ring.admit(key, None, 100) is None
    ring.settle(key, 100, 700)  # it used 700: the 600 over its charge are taken too
    assert key.buckets["tokens"].level == pytest.approx(300)
    assert ring.admit(key, None, 300) is None
    ring.settle(key, 300, 900)
    assert key.buckets["tokens"].level == pytest.approx(-600)  # in debt
    denied = ring.admit(key, None, 1)
    assert denied.status == 429 and denied.retry_after == pytest.approx(601 * 60 / 1000)


def test_a_stream_is_settled_from_a_usage_event_the_client_did_not_ask_for():
    keys = [{"name": "a", "key": KEY, "tokens_per_minute": 100000}]

    async def scenario() -> None:
        up = Upstream()
        gw = gateway(up, keys=keys, backends=(A,))
        app = build_gateway_app(gw)
        reply = await call(app, {**PLAIN, "max_tokens": 3, "stream": True}, headers=BEARER)
        assert reply.status == 200
        assert up.seen[A][-1]["body"]["stream_options"] == {"include_usage": True}
        events = reply.events()
        assert len(events) == 4 and events[-1] == "[DONE]"  # three tokens, no usage event
        assert not any("usage" in e for e in events)
        (key,) = gw.keys.keys
        assert key.buckets["tokens"].level == pytest.approx(100000 - 8) and key.in_flight == 0
        asked = {**PLAIN, "max_tokens": 3, "stream": True,
                 "stream_options": {"include_usage": True}}  # fmt: skip
        events = (await call(app, asked, headers=BEARER)).events()
        assert json.loads(events[-2])["usage"]["completion_tokens"] == 3  # asked: it stays
        assert key.buckets["tokens"].level == pytest.approx(100000 - 16)

    run(scenario())


# ----- 6. what a request holds is released however it ends -------------------------------------


def test_an_unexpected_error_answers_500_in_the_openai_shape_and_releases_everything():
    keys = [{"name": "a", "key": KEY, "max_concurrent": 1}]

    async def scenario() -> None:
        up = Upstream()
        up.script[A] = answer_raising(lambda request: RuntimeError("boom"))
        gw = gateway(up, keys=keys, backends=(A,))
        app = build_gateway_app(gw)
        for _ in range(2):  # the second is not refused: the first let its key slot go
            reply = await call(app, PLAIN, headers=BEARER)
            assert reply.raised is None and reply.status == 500
            assert reply.error["type"] == "internal_server_error"
        assert gw.replicas[0].outstanding == 0 and gw.keys.keys[0].in_flight == 0

        def broken() -> dict:
            raise RuntimeError("boom")

        gw.models = broken  # any other route: the app's handler answers in the same shape
        reply = await call(app, path="/v1/models", chunks=[b""], method="GET", headers=BEARER)
        assert reply.status == 500 and reply.error["type"] == "internal_server_error"

    run(scenario())


def test_a_stream_whose_client_left_as_it_started_releases_at_once():
    keys = [{"name": "a", "key": KEY}]

    gate = asyncio.Event()  # the replica's stream stalls after its first event until set
    stream = Events([_event({"choices": [{"index": 0, "text": "x"}]}), b"data: [DONE]\n\n"])

    async def stalled() -> Any:
        yield stream.chunks[0]
        await gate.wait()
        yield stream.chunks[1]

    async def stalling(request: httpx.Request, body: dict[str, Any]) -> httpx.Response:
        headers = {"content-type": "text/event-stream"}
        return httpx.Response(200, headers=headers, stream=_Stalled(stream, stalled))

    async def scenario() -> None:
        up = Upstream()
        up.script[A] = stalling
        gw = gateway(up, keys=keys, backends=(A,))
        reply = await call(build_gateway_app(gw), {**PLAIN, "max_tokens": 50, "stream": True},
                           headers=BEARER, leave_on_start=True)  # fmt: skip
        # the replica's stream never ended: only the client's leaving can have released it
        assert not gate.is_set() and stream.closed
        assert reply.raised is None
        assert gw.replicas[0].outstanding == 0 and gw.keys.keys[0].in_flight == 0

    run(scenario())


# ----- 8. background loops ----------------------------------------------------------------------


def test_the_health_loop_survives_an_unexpected_error():
    async def scenario() -> None:
        gw = gateway(Upstream(), health_interval=0.01)
        calls = []

        async def flaky() -> None:
            calls.append(1)
            if len(calls) <= 2:
                raise RuntimeError("boom")

        gw.check_all = flaky
        loop = asyncio.create_task(gw.health_loop())
        await until(lambda: len(calls) >= 3 or loop.done(), "three health checks")
        assert not loop.done()
        loop.cancel()
        errors = {s.labels["loop"]: s.value for s in samples(gw, gw.metrics.background_errors)
                  if s.name.endswith("_total")}  # fmt: skip
        assert errors == {"health": 2}

    run(scenario())


@pytest.mark.parametrize("malformed", [{"data": [1]}, {"data": "x"}, [1], {"data": [{"no": 1}]}])
def test_a_malformed_model_list_fails_that_replicas_check_only(malformed):
    async def scenario() -> None:
        up = Upstream({A: ["m"], B: malformed})
        gw = gateway(up)
        await gw.check_all()
        assert gw.replicas[0].models == {"m"} and gw.replicas[1].breaker.failures == 1
        up.models[B] = ["n"]
        await gw.check_all()
        assert gw.replicas[1].models == {"n"}

    run(scenario())


# ----- 9. the overload queue: a line per model --------------------------------------------------


def test_a_saturated_model_does_not_hold_back_another_models_requests():
    async def scenario() -> None:
        up = Upstream({A: ["ma"], B: ["mb"]})
        gate = asyncio.Event()

        async def held(request: httpx.Request, body: dict[str, Any]) -> httpx.Response:
            await gate.wait()
            return await answer_ok(request, body)

        up.script[A] = held
        rules = OverloadSettings(max_load=1, queue_size=4, queue_timeout=30)
        gw = gateway(up, overload=rules)
        await gw.check_all()
        app = build_gateway_app(gw)
        first = asyncio.create_task(call(app, {**PLAIN, "model": "ma"}))
        await until(lambda: gw.replicas[0].outstanding == 1, "ma's replica busy")
        second = asyncio.create_task(call(app, {**PLAIN, "model": "ma"}))
        await until(lambda: len(gw.queue) == 1, "a queued ma request")
        other = await asyncio.wait_for(call(app, {**PLAIN, "model": "mb"}), 5)
        assert other.status == 200 and len(up.seen[B]) == 1  # mb's replica had room
        gate.set()
        assert [(await t).status for t in (first, second)] == [200, 200]

    run(scenario())


# ----- against processes: the fake replica and the gateway's command line -----------------------


def _control(base: str, **script: Any) -> None:
    httpx.post(f"{base}/control", json=script).raise_for_status()


def _fake_log(base: str) -> dict[str, Any]:
    return httpx.get(f"{base}/control/log").json()


LEAK_YAML = """
overload: {{max_load: 16}}
keys:
  - {{name: team, key_sha256: {digest}, max_concurrent: 16}}
"""


def test_odd_headers_and_clients_that_leave_leak_no_slot(tmp_path):
    cfg = tmp_path / "gateway.yaml"
    cfg.write_text(LEAK_YAML.format(digest=hash_key(KEY)))
    auth = {"Authorization": f"Bearer {KEY}"}
    odd = {**auth, "Accept": b"\xe9t\xe9"}  # not ASCII
    extra = ("--config", str(cfg), "--max-body-bytes", "20000")
    with running_fake() as (_, fake), running_gateway(fake, extra=extra) as gw:
        url = f"{gw}/v1/completions"
        body = {"model": "fake", "prompt": "x", "max_tokens": 2}
        for i in range(40):
            r = httpx.post(url, json={**body, "stream": bool(i % 2)}, headers=odd, timeout=30)
            assert r.status_code == 200, r.text
        _control(fake, hold=True)

        def leave(stream: bool) -> None:
            held = {**body, "stream": stream}
            with (  # held at the replica; the client gives up
                pytest.raises(httpx.ReadTimeout),
                httpx.stream("POST", url, json=held, headers=auth, timeout=0.5) as r,
            ):
                r.read()

        with concurrent.futures.ThreadPoolExecutor(10) as pool:
            list(pool.map(leave, [False, True] * 5))
        _control(fake, hold=False)
        httpx.post(f"{fake}/control/release").raise_for_status()
        outstanding = f'pagellm_gateway:outstanding{{replica="{fake}"}}'
        wait_until(lambda: gateway_metric(gw, outstanding, auth) == 0, what="slots back")
        wait_until(lambda: _fake_log(fake)["in_flight"] == 0, what="the fake idle")
        for _ in range(20):
            assert httpx.post(url, json=body, headers=auth, timeout=30).status_code == 200
        text = httpx.get(f"{gw}/metrics", headers=auth).text
        assert f"{outstanding} 0.0" in text
        assert 'pagellm_gateway:key_in_flight{key="team"} 0.0' in text
        big = httpx.post(url, content=b" " * 30000, headers=auth, timeout=30)
        assert big.status_code == 413 and big.json()["error"]["type"] == "invalid_request_error"


def test_a_malformed_model_list_leaves_the_health_loop_running(tmp_path):
    cfg = tmp_path / "gateway.yaml"
    with running_fake("fake-a") as (_, a), running_fake("fake-b") as (_, b):
        _control(b, models_reply={"data": [1]})
        cfg.write_text(f"backends: [{a}]\n")
        with running_gateway(extra=("--config", str(cfg))) as gw:

            def models() -> list[str]:
                return [m["id"] for m in httpx.get(f"{gw}/v1/models").json()["data"]]

            assert models() == ["fake-a"]
            written = cfg.stat().st_mtime_ns
            cfg.write_text(f"backends: [{a}, {b}]\n")  # b's model list is malformed
            os.utime(cfg, ns=(written + 10**9, written + 10**9))  # surely a new time
            breaker = f'pagellm_gateway:breaker_state{{replica="{b}"}}'
            wait_until(lambda: gateway_metric(gw, breaker) == 2, what="b's failed check")
            _control(b, models_reply=None)  # b answers well from now on
            wait_until(lambda: models() == ["fake-a", "fake-b"], what="b's model")
            wait_until(lambda: gateway_metric(gw, breaker) == 0, what="b's breaker to close")
            r = httpx.post(f"{gw}/v1/completions", json={"model": "fake-b", "prompt": "x"},
                           headers={"Authorization": "Bearer test-key"}, timeout=30)  # fmt: skip
            assert r.status_code == 200


# ----- found by a fuzz of the gateway (2026-12-07) -----------------------------------------------


def test_max_completion_tokens_on_completions_is_dropped_and_max_tokens_charged():
    """The completions endpoint reads max_tokens only: a key was charged for
    max_completion_tokens 1 and served max_tokens 400."""
    keys = [{"name": "a", "key": KEY, "tokens_per_minute": 300}]

    async def scenario() -> None:
        up = Upstream()
        app = build_gateway_app(gateway(up, keys=keys, backends=(A,)))
        trick = {**PLAIN, "max_completion_tokens": 1, "max_tokens": 400}
        assert (await call(app, trick, headers=BEARER)).status == 429  # 400 > 300
        fits = {**PLAIN, "max_completion_tokens": 1, "max_tokens": 20}
        assert (await call(app, fits, headers=BEARER)).status == 200
        assert "max_completion_tokens" not in up.seen[A][-1]["body"]
        chat = {"model": "m", "messages": [{"role": "user", "content": "x"}],
                "max_completion_tokens": 5}  # fmt: skip
        assert (await call(app, chat, path="/v1/chat/completions", headers=BEARER)).status == 200
        assert up.seen[A][-1]["body"]["max_completion_tokens"] == 5  # chat's own field

    run(scenario())


def test_once_a_key_is_an_operator_only_operators_read_the_fleet():
    """The console's state and /metrics name every replica's URL and every key: a tenant's
    key gets a 403 there once an operator key is configured, and still serves the API."""
    tenant = [("authorization", "Bearer tenant-key")]
    keys = [{"name": "ops", "key": KEY, "operator": True}, {"name": "t", "key": "tenant-key"}]

    async def scenario() -> None:
        app = build_gateway_app(gateway(Upstream(), keys=keys, metrics_need_key=True))

        async def get(path: str, headers=()) -> Reply:
            return await call(app, path=path, chunks=[b""], method="GET", headers=headers)

        for path in ("/ui/api/state", "/metrics"):
            assert (await get(path)).status == 401
            denied = await get(path, tenant)
            assert denied.status == 403 and denied.error["type"] == "permission_error", path
            assert (await get(path, BEARER)).status == 200
        assert (await get("/v1/models", tenant)).status == 200
        assert (await call(app, PLAIN, headers=tenant)).status == 200

    run(scenario())


@pytest.mark.parametrize("metrics_need_key", [True, False])
def test_with_keys_every_path_but_health_needs_one(metrics_need_key):
    keys = [{"name": "a", "key": KEY}]

    async def scenario() -> None:
        gw = gateway(Upstream(), keys=keys, metrics_need_key=metrics_need_key)
        app = build_gateway_app(gw)

        async def get(path: str, headers=()) -> Reply:
            return await call(app, path=path, chunks=[b""], method="GET", headers=headers)

        assert (await get("/v1/models")).status == 401
        assert (await get("/v1/models", BEARER)).status == 200
        assert (await get("/metrics")).status == (401 if metrics_need_key else 200)
        assert (await get("/metrics", BEARER)).status == 200
        assert (await get("/health")).status == 200
        for path in ("/docs", "/openapi.json", "/v1//completions", "/v1/completions/"):
            reply = await get(path, BEARER)  # no API pages, no redirects: error objects
            assert reply.status == 404 and reply.error["type"] == "not_found_error", path
        wrong_method = await get(PATH, BEARER)
        assert wrong_method.status == 405 and wrong_method.error["message"]

    run(scenario())


def test_a_body_that_does_not_arrive_in_time_is_408_and_releases_everything():
    keys = [{"name": "a", "key": KEY, "max_concurrent": 1}]

    async def scenario() -> None:
        up = Upstream()
        gw = gateway(up, keys=keys, backends=(A,), client_body_timeout=0.2)
        app = build_gateway_app(gw)
        reply = await call(app, chunks=[b'{"prompt": '], headers=BEARER, body_unfinished=True)
        assert reply.status == 408 and reply.error["type"] == "timeout_error"
        assert not up.seen[A] and gw.keys.keys[0].in_flight == 0
        assert (await call(app, PLAIN, headers=BEARER)).status == 200

    run(scenario())


def test_a_key_limited_to_some_models_must_name_one():
    from pagellm.gateway.limits import KeyRing

    ring = KeyRing([{"name": "a", "key": KEY, "models": ["m"]}], FakeClock(step=0.0))
    key = ring.identify(f"Bearer {KEY}")
    unnamed = ring.admit(key, None, 1)
    assert unnamed.status == 400 and "model" in unnamed.message  # was "the model None ..."
    assert ring.admit(key, "other", 1).status == 404
    assert ring.admit(key, "m", 1) is None


def test_a_replicas_nan_or_infinite_load_is_ignored_and_the_console_still_answers():
    """A NaN usage broke every /ui/api/state of the gateway (JSON has no NaN): a 500."""

    async def scenario() -> None:
        up = Upstream()
        up.metrics_text[A] = (
            "vllm:kv_cache_usage_perc NaN\nvllm:num_requests_running +Inf\n"
            "vllm:num_requests_waiting 2\n"
        )
        up.metrics_text[B] = "vllm:kv_cache_usage_perc 7.5\n"  # over 1: clamped
        gw = gateway(up)
        await gw.check_all()
        a, b = gw.replicas
        assert (a.scraped_kv_usage, a.scraped_requests) == (0.0, 2.0)
        assert b.scraped_kv_usage == 1.0
        reply = await call(build_gateway_app(gw), path="/ui/api/state", chunks=[b""], method="GET")
        assert reply.status == 200 and json.loads(reply.body)["kind"] == "gateway"
        assert reply.headers["cache-control"] == "no-store"
        assert "frame-ancestors 'none'" in reply.headers["content-security-policy"]

    run(scenario())
