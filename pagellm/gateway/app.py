"""The gateway's HTTP app: proxy /v1/completions and /v1/chat/completions to a replica chosen by
the router, stream SSE through unbuffered, close the upstream request the moment the client
leaves (so the replica aborts it and frees its KV blocks), retry on another replica when a
replica fails before the first byte, and answer 503 ``cluster_unavailable`` when none can serve.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import math
import os
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from pagellm.engine.errors import ContextLengthExceeded
from pagellm.gateway.breaker import BreakerState, CircuitBreaker
from pagellm.gateway.config import ConfigError, Fleet, GatewaySettings, read_fleet
from pagellm.gateway.limits import KeyPolicy, KeyRing
from pagellm.gateway.overload import AdmissionQueue
from pagellm.gateway.precheck import check_fits
from pagellm.gateway.routing import Replica, Router
from pagellm.server.errors import error_body

STREAM_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
_FORWARDED = ("authorization", "content-type", "accept")
_BREAKER_VALUE = {BreakerState.CLOSED: 0, BreakerState.HALF_OPEN: 1, BreakerState.OPEN: 2}
log = logging.getLogger("pagellm.gateway")


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.requests = Counter(
            "pagellm_gateway:requests",
            "Requests by API key name, model, replica ('gateway' when answered here) and status.",
            ["key", "model", "replica", "status"],
            registry=self.registry,
        )
        self.retries = Counter(
            "pagellm_gateway:retries",
            "Requests retried on another replica.",
            registry=self.registry,
        )
        self.upstream_latency = Histogram(
            "pagellm_gateway:upstream_response_seconds",
            "Time from sending upstream to the replica's response headers.",
            ["replica"],
            registry=self.registry,
        )
        self.breaker = Gauge(
            "pagellm_gateway:breaker_state",
            "Circuit breaker per replica: 0 closed, 1 half-open, 2 open.",
            ["replica"],
            registry=self.registry,
        )
        self.breaker_opens = Counter(
            "pagellm_gateway:breaker_opens",
            "Times a replica's circuit breaker opened (or re-opened after a failed probe).",
            ["replica"],
            registry=self.registry,
        )
        self.overload = Counter(
            "pagellm_gateway:overload_actions",
            "Overload steps taken: capped (max_tokens), fallback, queued, rejected (503).",
            ["action"],
            registry=self.registry,
        )
        self.queue_depth = Gauge(
            "pagellm_gateway:queue_depth",
            "Requests waiting at the gateway for a replica with room.",
            registry=self.registry,
        )
        self.reloads = Counter(
            "pagellm_gateway:config_reloads",
            "Reloads of the config file, by result (ok, error).",
            ["result"],
            registry=self.registry,
        )


@dataclass
class _Call:
    """One proxied request as it goes through the gateway."""

    path: str
    raw: Request
    body: dict[str, Any] = field(default_factory=dict)
    content: bytes | None = None
    """The bytes sent upstream; None once ``body`` was changed (re-encoded when sent)."""
    headers: dict[str, str] = field(default_factory=dict)
    settle: _Settlement | None = None
    key_name: str = ""
    replica: str = "gateway"

    @property
    def model(self) -> str | None:
        return self.body.get("model")

    @functools.cached_property
    def prompt_key(self) -> str:
        """What prefix-affinity hashes: the prompt or the messages, as sent."""
        return json.dumps(self.body.get("messages") or self.body.get("prompt") or "")

    def encoded(self) -> bytes:
        if self.content is None:
            self.content = json.dumps(self.body).encode()
        return self.content


class Gateway:
    def __init__(
        self,
        settings: GatewaySettings,
        clock: Callable[[], float] = time.monotonic,
        transport: httpx.AsyncBaseTransport | None = None,
        tokenizers: dict[str, Any] | None = None,
    ) -> None:
        self.settings = settings
        self.clock = clock
        self.router = Router(settings.routing)
        self.fleet = settings.fleet
        self.replicas = self._replicas_for(settings.fleet, {})
        limits = httpx.Limits(max_connections=1024, max_keepalive_connections=256)
        self.client = httpx.AsyncClient(
            timeout=httpx.Timeout(settings.upstream_timeout, connect=5.0),
            limits=limits,
            transport=transport,
            trust_env=False,
        )
        self.metrics = GatewayMetrics()
        self.keys = KeyRing(list(settings.fleet.keys), clock)
        self.queue = AdmissionQueue(clock)
        self.tokenizers = tokenizers or {}
        """Served model -> its tokenizer, for the prompt-length pre-check."""
        self.max_model_len: dict[str, int] = {}
        """Served model -> the smallest context length its replicas report."""
        key = settings.backend_api_key
        self.backend_headers = {"authorization": f"Bearer {key}"} if key else {}
        self._config_mtime = _mtime(settings.config_path)

    # ----- replicas and reloads ---------------------------------------------------------

    def _replicas_for(self, fleet: Fleet, known: dict[str, Replica]) -> list[Replica]:
        out = []
        for url in dict.fromkeys((*fleet.backends, *fleet.fallbacks)):
            replica = known.get(url) or Replica(
                url,
                CircuitBreaker(
                    self.clock, self.settings.breaker_failures, self.settings.breaker_reset
                ),
            )
            replica.fallback = url not in fleet.backends
            out.append(replica)
        return out

    async def apply(self, fleet: Fleet) -> None:
        """Use a new fleet: replicas that stay keep their state (load, breaker, models), new
        ones are health-checked before they take traffic, removed ones finish what they have in
        flight; keys that stay keep their in-flight count and bucket levels."""
        known = {r.url: r for r in self.replicas}
        replicas = self._replicas_for(fleet, known)
        await asyncio.gather(*(self.check(r) for r in replicas if r.url not in known))
        for url in set(known) - {r.url for r in replicas}:
            for family in (self.metrics.breaker, self.metrics.breaker_opens):
                with contextlib.suppress(KeyError):
                    family.remove(url)
        self.keys = KeyRing(list(fleet.keys), self.clock, previous=self.keys)
        self.fleet, self.replicas = fleet, replicas
        self.queue.notify()

    async def reload_if_changed(self) -> None:
        """Re-read the config file when it changed; a file that fails its checks is logged
        and counted, and the running fleet stays."""
        path = self.settings.config_path
        mtime = _mtime(path)
        if path is None or mtime is None or mtime == self._config_mtime:
            return
        self._config_mtime = mtime
        try:
            fleet = read_fleet(path, self.settings.flag_backends)
        except ConfigError as exc:
            log.error("config not reloaded: %s", exc)
            self.metrics.reloads.labels("error").inc()
            return
        await self.apply(fleet)
        self.metrics.reloads.labels("ok").inc()

    async def check(self, replica: Replica) -> None:
        """Health check (and model list) of one replica, fed to its breaker."""
        try:
            headers = self.backend_headers
            health = await self.client.get(f"{replica.url}/health", timeout=5.0, headers=headers)
            if health.status_code != 200:
                raise httpx.HTTPStatusError("unhealthy", request=health.request, response=health)
            if not replica.models:
                models = await self.client.get(
                    f"{replica.url}/v1/models", timeout=5.0, headers=headers
                )
                models.raise_for_status()
                cards = models.json().get("data", [])
                replica.models = {m["id"] for m in cards}
                for card in cards:
                    if isinstance(card.get("max_model_len"), int):
                        known = self.max_model_len.get(card["id"], card["max_model_len"])
                        self.max_model_len[card["id"]] = min(known, card["max_model_len"])
            await self._scrape_load(replica, headers)
        except (httpx.HTTPError, ValueError, KeyError):
            self._breaker_failure(replica)
        else:
            if replica.breaker.state is not BreakerState.OPEN:
                replica.breaker.record_success()

    async def _scrape_load(self, replica: Replica, headers: dict[str, str]) -> None:
        """Running/waiting requests and KV usage from the replica's /metrics (pagellm's or
        vLLM's names); a replica without them keeps the gateway's own count only."""
        from prometheus_client.parser import text_string_to_metric_families

        values: dict[str, float] = {}
        try:  # load figures are a hint: failing to read them says nothing about health
            resp = await self.client.get(f"{replica.url}/metrics", timeout=5.0, headers=headers)
            if resp.status_code != 200:
                return
            for family in text_string_to_metric_families(resp.text):
                name = family.name.split(":", 1)[-1]
                if name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
                    values[name] = sum(sample.value for sample in family.samples)
        except (httpx.HTTPError, ValueError):
            return
        replica.scraped_requests = values.get("num_requests_running", 0.0) + values.get(
            "num_requests_waiting", 0.0
        )
        replica.scraped_kv_usage = values.get("kv_cache_usage_perc", 0.0)

    async def check_all(self) -> None:
        await asyncio.gather(*(self.check(r) for r in self.replicas))
        self.queue.notify()  # loads were re-read: waiting requests look again

    async def health_loop(self) -> None:
        while True:
            await self.reload_if_changed()
            await self.check_all()
            await asyncio.sleep(self.settings.health_interval)

    def _saturated(self, replica: Replica) -> bool:
        most = self.fleet.overload.max_load
        return most is not None and replica.load >= most

    def candidates(self, model: str | None, tried: set[str]) -> list[Replica]:
        """Replicas that may take a new request now: the untried primaries with room, else the
        untried fallbacks with room (a fallback also serves when every primary is down)."""
        up = [
            r
            for r in self.replicas
            if r.url not in tried and r.serves(model) and r.breaker.state is not BreakerState.OPEN
        ]
        for group in ([r for r in up if not r.fallback], [r for r in up if r.fallback]):
            free = [r for r in group if not self._saturated(r)]
            if free:
                return free
        return []

    def _has_room(self, model: str | None) -> bool:
        """A replica can take the request now, or none is up at all (routing then answers)."""
        up = any(
            r.serves(model) and r.breaker.state is not BreakerState.OPEN for r in self.replicas
        )
        return not up or bool(self.candidates(model, set()))

    def _all_primaries_at(self, model: str | None, load: float) -> bool:
        primaries = [r for r in self.replicas if not r.fallback and r.serves(model)]
        return bool(primaries) and all(r.load >= load for r in primaries)

    # ----- proxying ---------------------------------------------------------------------

    async def proxy(self, path: str, raw: Request) -> Response:
        call = _Call(path, raw)
        response = await self._handle(call)
        self.metrics.requests.labels(
            call.key_name, call.model or "", call.replica, str(response.status_code)
        ).inc()
        return response

    async def _handle(self, call: _Call) -> Response:
        call.content = await call.raw.body()
        try:
            body = json.loads(call.content)
        except ValueError:
            return _error(400, "the request body is not valid JSON")
        if not isinstance(body, dict):
            return _error(400, "the request body must be a JSON object")
        call.body = body
        call.headers = {k: v for k, v in call.raw.headers.items() if k.lower() in _FORWARDED}
        tokenizer, limit = self.tokenizers.get(call.model), self.max_model_len.get(call.model)
        if tokenizer is not None and limit is not None:
            try:
                check_fits(tokenizer, body, limit)
            except ContextLengthExceeded as exc:
                return _error(400, str(exc), code=exc.code)
            except (ValueError, TypeError, AttributeError) as exc:
                return _error(400, f"cannot read the prompt: {exc}")
        call.settle = _Settlement(None, None, 0)
        if self.keys.enabled:
            keys = self.keys
            policy = keys.identify(call.raw.headers.get("authorization"))
            if policy is None:
                return _error(401, "missing or wrong API key", kind="authentication_error")
            call.key_name = policy.name
            charge = estimate_tokens(body)
            denied = keys.admit(policy, call.model, charge)
            if denied is not None:
                wait = denied.retry_after
                retry = None
                if wait is not None and math.isfinite(wait):
                    retry = {"Retry-After": str(max(1, math.ceil(wait)))}
                return _error(denied.status, denied.message, code=denied.code, headers=retry)
            call.body, call.content = _with_policy(body, policy), None
            call.headers.pop("authorization", None)  # the client's key is the gateway's
            call.settle = _Settlement(keys, policy, charge)
        call.headers.update(self.backend_headers)
        try:
            return await self._admit(call)
        finally:
            call.settle.unless_handed_over()

    async def _admit(self, call: _Call) -> Response:
        """The overload steps: cap max_tokens when every primary is busy, wait in the bounded
        queue when no replica has room (fallbacks included), 503 when the queue is full or the
        wait runs out; then route."""
        rules = self.fleet.overload
        busy = rules.cap_at is not None and self._all_primaries_at(call.model, rules.cap_at)
        if busy and _cap_tokens(call.body, rules.max_tokens_cap):
            call.content = None
            self.metrics.overload.labels("capped").inc()
        if len(self.queue) or not self._has_room(call.model):
            if len(self.queue) >= rules.queue_size:
                return self._overloaded()
            self.metrics.overload.labels("queued").inc()
            self.metrics.queue_depth.inc()
            ready = False
            try:
                with _ClientWatch(call.raw) as watch:
                    ready = await self.queue.wait_turn(
                        lambda: self._has_room(call.model), rules.queue_timeout
                    )
            finally:
                self.metrics.queue_depth.dec()
            if watch.left:
                return Response(status_code=499)  # the client left while queued
            if not ready:
                return self._overloaded()
        return await self._route(call)

    def _overloaded(self) -> JSONResponse:
        self.metrics.overload.labels("rejected").inc()
        return _error(
            503,
            "every replica is saturated; try again shortly",
            code="overloaded",
            kind="cluster_unavailable",
            headers={"Retry-After": "1"},
        )

    async def _route(self, call: _Call) -> Response:
        tried: set[str] = set()
        for attempt in range(self.settings.max_attempts):
            if attempt:
                self.metrics.retries.inc()
            replica = self._pick(call.model, call.prompt_key, tried)
            if replica is None:
                break
            resp = await self._send(replica, call)
            if resp is None:
                continue
            if call.body.get("stream") and resp.status_code == 200:
                first = await self._first_chunk(resp, replica, call.raw)
                if first is None:
                    continue  # failed before a byte reached the client: try another replica
                if isinstance(first, Response):
                    return first  # the client left meanwhile
                call.replica = replica.url
                call.settle.hand_over()  # the stream settles when it ends
                return StreamingResponse(
                    self._relay(*first, resp, replica, call.settle),
                    media_type="text/event-stream",
                    headers=STREAM_HEADERS,
                )
            call.replica = replica.url
            answer = await self._whole(resp, replica, call.raw)
            call.settle.used = _usage_tokens(answer)
            return answer
        model = call.model
        if model is not None and not any(r.serves(model) for r in self.replicas):
            return _error(404, f"the model {model!r} does not exist", code="model_not_found")
        return _error(
            503,
            "no replica can serve the request now",
            kind="cluster_unavailable",
            headers={"Retry-After": "2"},
        )

    def _pick(self, model: str | None, prompt_key: str, tried: set[str]) -> Replica | None:
        while True:
            candidates = self.candidates(model, tried)
            if not candidates:
                return None
            replica = self.router.choose(candidates, prompt_key)
            tried.add(replica.url)
            if replica.breaker.allows():
                if replica.fallback:
                    self.metrics.overload.labels("fallback").inc()
                return replica

    async def _send(self, replica: Replica, call: _Call) -> httpx.Response | None:
        """The upstream response (headers read, body not), or None when the replica failed
        before answering (connection refused or reset, timeout, or a 5xx)."""
        replica.outstanding += 1
        start = self.clock()
        try:
            request = self.client.build_request(
                "POST", f"{replica.url}{call.path}", content=call.encoded(), headers=call.headers
            )
            resp = await self.client.send(request, stream=True)
        except httpx.HTTPError:
            self._failed(replica)
            return None
        self.metrics.upstream_latency.labels(replica.url).observe(self.clock() - start)
        if resp.status_code >= 500:
            await resp.aclose()
            self._failed(replica)
            return None
        replica.breaker.record_success()
        return resp

    def _release(self, replica: Replica) -> None:
        replica.outstanding -= 1
        self.queue.notify()

    def _failed(self, replica: Replica) -> None:
        self._release(replica)
        self._breaker_failure(replica)

    def _breaker_failure(self, replica: Replica) -> None:
        was_open = replica.breaker.state is BreakerState.OPEN
        replica.breaker.record_failure()
        if not was_open and replica.breaker.state is BreakerState.OPEN:
            self.metrics.breaker_opens.labels(replica.url).inc()

    def refresh_breaker_gauges(self) -> None:
        """Breaker states as of now (open turns half-open with time, not with an event)."""
        for replica in self.replicas:
            self.metrics.breaker.labels(replica.url).set(_BREAKER_VALUE[replica.breaker.state])

    async def _first_chunk(
        self, resp: httpx.Response, replica: Replica, raw: Request
    ) -> tuple[bytes, AsyncIterator[bytes]] | Response | None:
        """Wait for the stream's first bytes before answering the client, so that a replica
        failing before then (dying with the request still in its queue) leaves the request
        free to retry elsewhere. None: it failed; a Response: the client left meanwhile."""
        chunks = resp.aiter_raw()
        try:
            with _ClientWatch(raw) as watch:
                first = await anext(chunks)
        except (httpx.HTTPError, StopAsyncIteration):
            await resp.aclose()
            self._failed(replica)
            return None
        if watch.left:
            await resp.aclose()
            self._release(replica)
            return Response(status_code=499)
        return first, chunks

    async def _relay(
        self,
        first: bytes,
        rest: AsyncIterator[bytes],
        resp: httpx.Response,
        replica: Replica,
        settle: _Settlement,
    ) -> AsyncIterator[bytes]:
        """Pass the replica's SSE bytes through as they come. Leaving early (the client went
        away) closes the upstream response, which makes the replica abort the request."""
        try:
            yield first
            async for chunk in rest:
                if b'"prompt_tokens"' in chunk:  # the usage event (include_usage): settle on it
                    settle.used = _stream_usage(chunk)
                yield chunk
        except httpx.HTTPError as exc:
            self._breaker_failure(replica)
            event = error_body(
                502, f"the replica failed mid-stream: {type(exc).__name__}", None, None
            )
            yield f"data: {json.dumps(event)}\n\ndata: [DONE]\n\n".encode()
        finally:
            await resp.aclose()
            self._release(replica)
            settle.now()

    async def _whole(self, resp: httpx.Response, replica: Replica, raw: Request) -> Response:
        """Read a non-streamed answer; a client that leaves meanwhile closes the upstream."""
        try:
            with _ClientWatch(raw) as watch:
                content = await resp.aread()
        except httpx.HTTPError as exc:
            self._breaker_failure(replica)
            return _error(502, f"the replica failed: {type(exc).__name__}")
        finally:
            await resp.aclose()
            self._release(replica)
        if watch.left:
            return Response(status_code=499)
        media = resp.headers.get("content-type", "application/json")
        extra = {k: v for k, v in resp.headers.items() if k.lower() == "retry-after"}
        return Response(content, status_code=resp.status_code, media_type=media, headers=extra)

    def models(self) -> dict[str, Any]:
        names = sorted({m for r in self.replicas for m in r.models})
        data = [{"id": n, "object": "model", "created": 0, "owned_by": "pagellm"} for n in names]
        return {"object": "list", "data": data}


class _Settlement:
    """Settles a key's in-flight count and token charge exactly once per admitted request."""

    def __init__(self, keys: KeyRing | None, policy: KeyPolicy | None, charged: int) -> None:
        self.keys, self.policy, self.charged = keys, policy, charged
        self.used: int | None = 0
        """Tokens really used (None: unknown, keep the charge); 0 until a replica answers."""
        self.handed_over = False
        self.done = False

    def hand_over(self) -> None:
        self.handed_over = True
        self.used = None  # a stream's usage is not parsed: the estimate stands

    def unless_handed_over(self) -> None:
        if not self.handed_over:
            self.now()

    def now(self) -> None:
        if self.done or self.keys is None:
            return
        self.done = True
        self.keys.settle(self.policy, self.charged, self.used)


def estimate_tokens(body: dict[str, Any]) -> int:
    """What a request may cost before it runs: ~4 characters per prompt token plus the most
    it may generate (refunded to the real usage when a whole answer comes back)."""
    prompt = json.dumps(body.get("messages") or body.get("prompt") or "")
    most = body.get("max_completion_tokens") or body.get("max_tokens") or 256
    return math.ceil(len(prompt) / 4) + int(most) * max(1, int(body.get("n") or 1))


def _with_policy(body: dict[str, Any], policy: KeyPolicy) -> dict[str, Any]:
    out = dict(body)
    if policy.priority is not None:
        out["priority"] = policy.priority
    if policy.tenant:
        out["user"] = policy.tenant
    return out


class _ClientWatch:
    """While the block runs, a client that disconnects cancels the awaiting task; the
    cancellation ends the block and is swallowed, and ``left`` says it happened. Entering and
    leaving never await, so a block that ends normally lets its caller act before anything
    else runs (the overload queue relies on it)."""

    def __init__(self, raw: Request) -> None:
        self.raw = raw
        self.left = False

    def __enter__(self) -> _ClientWatch:
        self.task = asyncio.current_task()
        self.watcher = asyncio.create_task(self._watch())
        return self

    def __exit__(self, kind: type[BaseException] | None, *_: object) -> bool:
        self.watcher.cancel()
        if kind is asyncio.CancelledError and self.left:
            self.task.uncancel()
            return True
        return False

    async def _watch(self) -> None:
        while not await self.raw.is_disconnected():
            await asyncio.sleep(0.1)
        self.left = True
        self.task.cancel()


def _cap_tokens(body: dict[str, Any], cap: int) -> bool:
    """Lower the request's max_tokens / max_completion_tokens to ``cap`` (setting max_tokens
    when it gives neither); True if the body changed."""
    changed = False
    for name in ("max_tokens", "max_completion_tokens"):
        asked = body.get(name)
        if isinstance(asked, int) and asked > cap:
            body[name] = cap
            changed = True
    if body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
        body["max_tokens"] = cap
        changed = True
    return changed


def _stream_usage(chunk: bytes) -> int | None:
    """prompt + completion tokens from a chunk holding a stream's usage event, if it parses."""
    for line in chunk.split(b"\n"):
        if line.startswith(b"data: {") and b'"prompt_tokens"' in line:
            try:
                usage = json.loads(line[len(b"data: ") :])["usage"]
                return int(usage["prompt_tokens"]) + int(usage["completion_tokens"])
            except (ValueError, KeyError, TypeError):
                return None
    return None


def _mtime(path: str | None) -> int | None:
    if path is None:
        return None
    try:
        return os.stat(path).st_mtime_ns
    except OSError:
        return None


def _usage_tokens(answer: Response) -> int | None:
    try:
        usage = json.loads(answer.body)["usage"]
        return int(usage["prompt_tokens"]) + int(usage["completion_tokens"])
    except (ValueError, KeyError, TypeError):
        return None if answer.status_code == 200 else 0


def _error(
    status: int,
    message: str,
    code: str | None = None,
    kind: str | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    body = error_body(status, message, None, code)
    if kind is not None:
        body["error"]["type"] = kind
    return JSONResponse(body, status_code=status, headers=headers)


def build_gateway_app(gateway: Gateway) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        await gateway.check_all()
        task = asyncio.create_task(gateway.health_loop())
        try:
            yield
        finally:
            task.cancel()
            await gateway.client.aclose()

    app = FastAPI(title="pagellm gateway", lifespan=lifespan)

    @app.post("/v1/completions")
    async def completions(raw: Request) -> Response:
        return await gateway.proxy("/v1/completions", raw)

    @app.post("/v1/chat/completions")
    async def chat(raw: Request) -> Response:
        return await gateway.proxy("/v1/chat/completions", raw)

    @app.get("/v1/models")
    async def models() -> dict:
        return gateway.models()

    @app.get("/health")
    async def health() -> Response:
        if any(r.breaker.state is not BreakerState.OPEN for r in gateway.replicas):
            return Response(status_code=200)
        return _error(503, "no replica is healthy", kind="cluster_unavailable")

    @app.get("/metrics")
    async def metrics() -> Response:
        gateway.refresh_breaker_gauges()
        return Response(generate_latest(gateway.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app
