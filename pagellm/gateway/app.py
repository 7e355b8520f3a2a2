"""The gateway's HTTP app: proxy /v1/completions and /v1/chat/completions to a replica chosen by
the router, stream SSE through unbuffered, close the upstream request the moment the client
leaves (so the replica aborts it and frees its KV blocks), retry on another replica when a
replica fails before the first byte, and answer 503 ``cluster_unavailable`` when none can serve.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
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
from pagellm.gateway.limits import KeyPolicy, KeyRing
from pagellm.gateway.precheck import check_fits
from pagellm.gateway.routing import Replica, Router
from pagellm.server.errors import error_body

STREAM_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
_FORWARDED = ("authorization", "content-type", "accept")
_BREAKER_VALUE = {BreakerState.CLOSED: 0, BreakerState.HALF_OPEN: 1, BreakerState.OPEN: 2}


@dataclass(frozen=True, slots=True)
class GatewaySettings:
    backends: tuple[str, ...]
    routing: str = "least-load"
    max_attempts: int = 2
    """Replicas tried for one request when they fail before the first byte."""
    health_interval: float = 2.0
    breaker_failures: int = 3
    breaker_reset: float = 5.0
    upstream_timeout: float = 600.0
    keys: tuple[dict[str, Any], ...] = ()
    """API keys (name, key_sha256, models, requests_per_minute, tokens_per_minute,
    max_concurrent, priority, tenant); none means no auth at the gateway."""
    backend_api_key: str | None = None
    """Sent to the replicas (health checks, model lists, and proxied requests in place of the
    client's Authorization); without it the client's header is passed through."""


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.requests = Counter(
            "pagellm_gateway:requests",
            "Proxied requests by model, replica and status.",
            ["model", "replica", "status"],
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
        self.replicas = [
            Replica(
                url.rstrip("/"),
                CircuitBreaker(clock, settings.breaker_failures, settings.breaker_reset),
            )
            for url in settings.backends
        ]
        limits = httpx.Limits(max_connections=1024, max_keepalive_connections=256)
        self.client = httpx.AsyncClient(
            timeout=httpx.Timeout(settings.upstream_timeout, connect=5.0),
            limits=limits,
            transport=transport,
            trust_env=False,
        )
        self.metrics = GatewayMetrics()
        self.keys = KeyRing(list(settings.keys), clock)
        self.tokenizers = tokenizers or {}
        """Served model -> its tokenizer, for the prompt-length pre-check."""
        self.max_model_len: dict[str, int] = {}
        """Served model -> the smallest context length its replicas report."""
        key = settings.backend_api_key
        self.backend_headers = {"authorization": f"Bearer {key}"} if key else {}

    # ----- replicas ---------------------------------------------------------------------

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
            replica.breaker.record_failure()
        else:
            if replica.breaker.state is not BreakerState.OPEN:
                replica.breaker.record_success()
        self.metrics.breaker.labels(replica.url).set(_BREAKER_VALUE[replica.breaker.state])

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

    async def health_loop(self) -> None:
        while True:
            await self.check_all()
            await asyncio.sleep(self.settings.health_interval)

    def candidates(self, model: str | None, tried: set[int]) -> list[Replica]:
        return [
            r
            for i, r in enumerate(self.replicas)
            if i not in tried and r.serves(model) and r.breaker.state is not BreakerState.OPEN
        ]

    # ----- proxying ---------------------------------------------------------------------

    async def proxy(self, path: str, raw: Request) -> Response:
        content = await raw.body()
        try:
            body = json.loads(content)
        except ValueError:
            return _error(400, "the request body is not valid JSON")
        if not isinstance(body, dict):
            return _error(400, "the request body must be a JSON object")
        model = body.get("model")
        key = json.dumps(body.get("messages") or body.get("prompt") or "")
        headers = {k: v for k, v in raw.headers.items() if k.lower() in _FORWARDED}
        tokenizer, limit = self.tokenizers.get(model), self.max_model_len.get(model)
        if tokenizer is not None and limit is not None:
            try:
                check_fits(tokenizer, body, limit)
            except ContextLengthExceeded as exc:
                return _error(400, str(exc), code=exc.code)
            except (ValueError, TypeError, AttributeError) as exc:
                return _error(400, f"cannot read the prompt: {exc}")
        policy = None
        if self.keys.enabled:
            policy = self.keys.identify(raw.headers.get("authorization"))
            if policy is None:
                return _error(401, "missing or wrong API key", kind="authentication_error")
            charge = estimate_tokens(body)
            denied = self.keys.admit(policy, model, charge)
            if denied is not None:
                wait = denied.retry_after
                retry = None
                if wait is not None and math.isfinite(wait):
                    retry = {"Retry-After": str(max(1, math.ceil(wait)))}
                return _error(denied.status, denied.message, code=denied.code, headers=retry)
            content = json.dumps(_with_policy(body, policy)).encode()
            headers.pop("authorization", None)  # the client's key is the gateway's, not theirs
            settle = _Settlement(self.keys, policy, charge)
        else:
            settle = _Settlement(None, None, 0)
        headers.update(self.backend_headers)
        try:
            return await self._route(path, raw, body, content, headers, model, key, settle)
        finally:
            settle.unless_handed_over()

    async def _route(self, path, raw, body, content, headers, model, key, settle) -> Response:
        tried: set[int] = set()
        for attempt in range(self.settings.max_attempts):
            if attempt:
                self.metrics.retries.inc()
            replica = self._pick(model, key, tried)
            if replica is None:
                break
            resp = await self._send(replica, path, content, headers)
            if resp is None:
                continue
            self.metrics.requests.labels(model or "", replica.url, str(resp.status_code)).inc()
            if body.get("stream") and resp.status_code == 200:
                settle.hand_over()  # the stream settles when it ends
                return StreamingResponse(
                    self._relay(resp, replica, settle),
                    media_type="text/event-stream",
                    headers=STREAM_HEADERS,
                )
            answer = await self._whole(resp, replica, raw)
            settle.used = _usage_tokens(answer)
            return answer
        if model is not None and not any(r.serves(model) for r in self.replicas):
            return _error(404, f"the model {model!r} does not exist", code="model_not_found")
        return _error(
            503,
            "no replica can serve the request now",
            kind="cluster_unavailable",
            headers={"Retry-After": "2"},
        )

    def _pick(self, model: str | None, key: str, tried: set[int]) -> Replica | None:
        while True:
            candidates = self.candidates(model, tried)
            if not candidates:
                return None
            replica = self.router.choose(candidates, key)
            tried.add(self.replicas.index(replica))
            if replica.breaker.allows():
                return replica

    async def _send(
        self, replica: Replica, path: str, content: bytes, headers: dict[str, str]
    ) -> httpx.Response | None:
        """The upstream response (headers read, body not), or None when the replica failed
        before answering (connection refused or reset, timeout, or a 5xx)."""
        replica.outstanding += 1
        start = self.clock()
        try:
            request = self.client.build_request(
                "POST", f"{replica.url}{path}", content=content, headers=headers
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

    def _failed(self, replica: Replica) -> None:
        replica.outstanding -= 1
        replica.breaker.record_failure()
        self.metrics.breaker.labels(replica.url).set(_BREAKER_VALUE[replica.breaker.state])

    async def _relay(
        self, resp: httpx.Response, replica: Replica, settle: _Settlement
    ) -> AsyncIterator[bytes]:
        """Pass the replica's SSE bytes through as they come. Leaving early (the client went
        away) closes the upstream response, which makes the replica abort the request."""
        try:
            async for chunk in resp.aiter_raw():
                yield chunk
        except httpx.HTTPError as exc:
            replica.breaker.record_failure()
            event = error_body(
                502, f"the replica failed mid-stream: {type(exc).__name__}", None, None
            )
            yield f"data: {json.dumps(event)}\n\ndata: [DONE]\n\n".encode()
        finally:
            await resp.aclose()
            replica.outstanding -= 1
            settle.now()

    async def _whole(self, resp: httpx.Response, replica: Replica, raw: Request) -> Response:
        """Read a non-streamed answer; a client that leaves meanwhile closes the upstream."""
        reader = asyncio.ensure_future(resp.aread())
        try:
            while True:
                done, _ = await asyncio.wait({reader}, timeout=0.1)
                if done:
                    break
                if await raw.is_disconnected():
                    reader.cancel()
                    return Response(status_code=499)
            content = reader.result()
        except httpx.HTTPError as exc:
            replica.breaker.record_failure()
            return _error(502, f"the replica failed: {type(exc).__name__}")
        finally:
            await resp.aclose()
            replica.outstanding -= 1
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
        return Response(generate_latest(gateway.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app
