"""The gateway's HTTP app: proxy /v1/completions and /v1/chat/completions to a replica chosen by
the router, stream SSE through event by event, and close the upstream request the moment the
client leaves (so the replica aborts it and frees its KV blocks), while the replica works on it
or before it answered at all.

Only a replica that could not take a request (no connection, a connection lost before any
answer, 502, 503 without Retry-After, a stream that ends before its first event) counts against
its circuit breaker, and only then is the request tried on another replica; every other answer
is the replica's own and is relayed as it is. ``cluster_unavailable`` (503) when none can serve.

A request's key is checked before its body is read; the body is counted as it arrives. What an
admitted request holds (a slot at a replica, its key's in-flight count and token charge, the
upstream response) is released exactly once, however the request ends: by the handler, or, once
a stream is handed to the client, by the streaming response.
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
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from pagellm.console.routes import install_console
from pagellm.engine.errors import ContextLengthExceeded
from pagellm.gateway.breaker import BreakerState, CircuitBreaker
from pagellm.gateway.config import ConfigError, Fleet, GatewaySettings, read_fleet
from pagellm.gateway.events import EventSplitter, usage_of
from pagellm.gateway.intake import (
    apply_policy,
    ask_usage,
    charge_for,
    check_fields,
    drop_unread_fields,
    parse,
    read_body,
)
from pagellm.gateway.limits import Denied, KeyPolicy, KeyRing
from pagellm.gateway.metrics import GatewayMetrics
from pagellm.gateway.overload import AdmissionQueue
from pagellm.gateway.precheck import check_fits, prompt_lengths
from pagellm.gateway.routing import Replica, Router
from pagellm.server.errors import APIError, error_body, error_response, quoted_name

STREAM_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
_BREAKER_VALUE = {BreakerState.CLOSED: 0, BreakerState.HALF_OPEN: 1, BreakerState.OPEN: 2}
_LOST = (httpx.NetworkError, httpx.ConnectTimeout, httpx.RemoteProtocolError)
"""Failures of the connection itself (refused, reset, closed without an answer)."""
log = logging.getLogger("pagellm.gateway")


class _Lease:
    """A request's slot at one replica (counted in its ``outstanding``) and the upstream
    response it got there; ``close`` releases both, the slot exactly once."""

    def __init__(self, replica: Replica, on_release: Callable[[], None]) -> None:
        self.replica, self.on_release = replica, on_release
        self.response: httpx.Response | None = None
        self.released = False
        replica.outstanding += 1

    async def close(self) -> None:
        if not self.released:
            self.released = True
            self.replica.outstanding -= 1
            self.on_release()
        response, self.response = self.response, None
        if response is not None:
            await response.aclose()


class _Settlement:
    """Settles a key's in-flight count and token charge exactly once per admitted request (a
    no-op for a request no key admitted)."""

    def __init__(
        self, keys: KeyRing | None = None, policy: KeyPolicy | None = None, charged: int = 0
    ) -> None:
        self.keys, self.policy, self.charged = keys, policy, charged
        self.used: int | None = 0
        """Tokens really used; None: unknown, the charge stands. 0 while no replica has the
        request, unknown from when one has it until its usage is read."""
        self.done = False

    def now(self) -> None:
        if self.done or self.keys is None:
            return
        self.done = True
        self.keys.settle(self.policy, self.charged, self.used)


@dataclass
class _Call:
    """One proxied request as it goes through the gateway."""

    path: str
    raw: Request
    body: dict[str, Any] = field(default_factory=dict)
    content: bytes | None = None
    """The bytes sent upstream; None once ``body`` was changed (re-encoded when sent)."""
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    settle: _Settlement = field(default_factory=_Settlement)
    key_name: str = ""
    authenticated: bool = False
    replica: str = "gateway"
    lease: _Lease | None = None
    events: AsyncGenerator[bytes, None] | None = None
    hide_usage: bool = False
    """The gateway asked the replica for the stream's usage event: the client does not get it."""
    handed_over: bool = False
    """A streaming response owns the release now (it runs after the handler returned)."""

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

    async def drop_lease(self) -> None:
        events, self.events = self.events, None
        if events is not None:
            await events.aclose()
        lease, self.lease = self.lease, None
        if lease is not None:
            await lease.close()

    async def finish(self) -> None:
        """Release everything the request holds (again: nothing)."""
        self.settle.now()
        await self.drop_lease()


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

    # ----- replicas, reloads and background loops ---------------------------------------

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
        keys = KeyRing(list(fleet.keys), self.clock, previous=self.keys)
        known = {r.url: r for r in self.replicas}
        replicas = self._replicas_for(fleet, known)
        await asyncio.gather(*(self.check(r) for r in replicas if r.url not in known))
        for url in set(known) - {r.url for r in replicas}:
            self.metrics.forget_replica(url)
        self.keys, self.fleet, self.replicas = keys, fleet, replicas
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
                cards = _model_cards(models.json())
                replica.models = {card["id"] for card in cards}
                self._note_context_lengths(cards)
            await self._scrape_load(replica, headers)
        except (httpx.HTTPError, ValueError):
            self._breaker_failure(replica)
        else:
            if replica.breaker.state is not BreakerState.OPEN:
                replica.breaker.record_success()

    def _note_context_lengths(self, cards: list[dict[str, Any]]) -> None:
        for card in cards:
            length = card.get("max_model_len")
            if isinstance(length, int) and not isinstance(length, bool) and length > 0:
                known = self.max_model_len.get(card["id"], length)
                self.max_model_len[card["id"]] = min(known, length)

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
        # a replica's NaN or infinity (buggy or hostile) must not steer routing or break the
        # console's JSON: only finite, non-negative figures count, usage at most 1
        values = {k: v for k, v in values.items() if math.isfinite(v) and v >= 0.0}
        replica.scraped_requests = values.get("num_requests_running", 0.0) + values.get(
            "num_requests_waiting", 0.0
        )
        replica.scraped_kv_usage = min(1.0, values.get("kv_cache_usage_perc", 0.0))

    async def check_all(self) -> None:
        await asyncio.gather(*(self.check(r) for r in self.replicas))
        self.queue.notify()  # loads were re-read: waiting requests look again

    async def guarded(self, loop: str, step: Callable[[], Awaitable[None]]) -> None:
        """One step of a background loop: an error it did not expect is logged and counted,
        and the loop goes on."""
        try:
            await step()
        except Exception:
            log.exception("gateway %s loop: unexpected error (it goes on)", loop)
            self.metrics.background_errors.labels(loop).inc()

    async def health_loop(self) -> None:
        while True:
            await self.guarded("reload", self.reload_if_changed)
            await self.guarded("health", self.check_all)
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

    # ----- admission ----------------------------------------------------------------------

    async def proxy(self, path: str, raw: Request) -> Response:
        call = _Call(path, raw)
        try:
            response = await self._handle(call)
        except APIError as err:
            response = error_response(err)
        except Exception:  # the request fails alone, answered in the OpenAI shape
            log.exception("gateway: unexpected error on %s", path)
            response = _error(500, "the gateway failed on this request")
        finally:
            if not call.handed_over:
                await call.finish()
        self.metrics.requests.labels(
            call.key_name, self._model_label(call), call.replica, str(response.status_code)
        ).inc()
        return response

    def _model_label(self, call: _Call) -> str:
        """The model for the metric: one a replica serves, named by a checked client."""
        model = call.model
        served = isinstance(model, str) and any(model in r.models for r in self.replicas)
        return model if served and call.authenticated else "unknown"

    async def _handle(self, call: _Call) -> Response:
        policy = self._identify(call)
        try:
            call.content = await read_body(
                call.raw, self.settings.max_body_bytes, self.settings.client_body_timeout
            )
        except ClientDisconnect:
            return Response(status_code=499)
        call.body = parse(call.content)
        check_fields(call.body)
        if drop_unread_fields(call.body, call.path):
            call.content = None
        lengths = await self._prompt_lengths(call)
        call.headers = self._forwarded_headers(call.raw)
        if policy is not None:
            refused = self._admit_key(call, policy, lengths)
            if refused is not None:
                return refused
        return await self._admit(call)

    def _identify(self, call: _Call) -> KeyPolicy | None:
        """The caller's key, from the Authorization header alone (401 without a good one);
        None when the gateway is open (no keys)."""
        if not self.keys.enabled:
            call.authenticated = True
            return None
        policy = self.keys.identify(call.raw.headers.get("authorization"))
        if policy is None:
            raise APIError(401, "missing or wrong API key")
        call.key_name, call.authenticated = policy.name, True
        return policy

    async def _prompt_lengths(self, call: _Call) -> list[int] | None:
        """The prompts' token counts when the model's tokenizer is known, counted on a worker
        thread; a prompt that cannot fit the model's context is refused here (400)."""
        tokenizer = self.tokenizers.get(call.model)
        if tokenizer is None:
            return None
        try:
            lengths = await asyncio.to_thread(prompt_lengths, tokenizer, call.body)
        except Exception as exc:  # the client's prompt (or chat template input) it cannot take
            raise APIError(400, f"cannot read the prompt: {exc}") from exc
        limit = self.max_model_len.get(call.model)
        if limit is not None:
            try:
                check_fits(lengths, call.body, limit)
            except ContextLengthExceeded as exc:
                raise APIError(400, str(exc), code=exc.code) from exc
        return lengths

    def _forwarded_headers(self, raw: Request) -> list[tuple[bytes, bytes]]:
        """The client's content-type and accept, as the bytes it sent, and the authorization
        the replicas get: the gateway's own key, else (an open gateway) the client's."""
        names = {b"content-type", b"accept"}
        if not self.keys.enabled and not self.backend_headers:
            names.add(b"authorization")
        out = [(k, v) for k, v in raw.scope["headers"] if k.lower() in names]
        return out + [(k.encode(), v.encode()) for k, v in self.backend_headers.items()]

    def _admit_key(
        self, call: _Call, policy: KeyPolicy, lengths: list[int] | None
    ) -> Response | None:
        """The key's limits: its models, concurrency and buckets, charged an upper bound of the
        request's tokens; on success the body carries the key's policy and the call settles."""
        body = apply_policy(call.body, policy)
        charge = charge_for(body, policy, lengths, self.max_model_len.get(call.model))
        denied = self.keys.admit(policy, call.model, charge)
        if denied is not None:
            return _refused(denied)
        if "tokens" in policy.buckets and body.get("stream"):
            call.hide_usage = ask_usage(body)
        call.body, call.content = body, None
        call.settle = _Settlement(self.keys, policy, charge)
        return None

    async def _admit(self, call: _Call) -> Response:
        """The overload steps: cap max_tokens when every primary is busy, wait in the bounded
        queue (in the model's line) when no replica has room (fallbacks included), 503 when the
        queue is full or the wait runs out; then route."""
        rules = self.fleet.overload
        busy = rules.cap_at is not None and self._all_primaries_at(call.model, rules.cap_at)
        if busy and _cap_tokens(call.body, rules.max_tokens_cap):
            call.content = None
            self.metrics.overload.labels("capped").inc()
        if self.queue.waiting(call.model) or not self._has_room(call.model):
            if len(self.queue) >= rules.queue_size:
                return self._overloaded()
            self.metrics.overload.labels("queued").inc()
            self.metrics.queue_depth.inc()
            ready = False
            try:
                with _ClientWatch(call.raw) as watch:
                    ready = await self.queue.wait_turn(
                        lambda: self._has_room(call.model), rules.queue_timeout, call.model
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

    # ----- proxying ---------------------------------------------------------------------

    async def _route(self, call: _Call) -> Response:
        tried: set[str] = set()
        for attempt in range(self.settings.max_attempts):
            if attempt:
                self.metrics.retries.inc()
            replica = self._pick(call.model, call.prompt_key, tried)
            if replica is None:
                break
            call.lease = _Lease(replica, self.queue.notify)
            call.settle.used = None
            answer = None
            with _ClientWatch(call.raw) as watch:  # it leaves: the upstream request is closed
                answer = await self._exchange(call, replica)
            if watch.left:
                return Response(status_code=499)
            if answer is not None:
                call.replica = replica.url
                return answer
            call.settle.used = 0  # the replica could not take it: nothing was used there
            await call.drop_lease()
        return self._unavailable(call.model)

    def _unavailable(self, model: str | None) -> JSONResponse:
        if model is not None and not any(r.serves(model) for r in self.replicas):
            return _error(
                404, f"the model {quoted_name(model)} does not exist", code="model_not_found"
            )
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

    async def _exchange(self, call: _Call, replica: Replica) -> Response | None:
        """One try at one replica: the answer for the client, or None when the replica could
        not take the request (another may)."""
        url = f"{replica.url}{call.path}"
        request = self.client.build_request(
            "POST", url, content=call.encoded(), headers=call.headers
        )
        start = self.clock()
        try:
            resp = await self.client.send(request, stream=True)
        except httpx.HTTPError as exc:
            if isinstance(exc, _LOST):
                self._breaker_failure(replica)
                return None
            # e.g. a read timeout: the replica may be working on it, so it is not sent twice
            return self._upstream_error("did not answer", exc)
        call.lease.response = resp
        self.metrics.upstream_latency.labels(replica.url).observe(self.clock() - start)
        if _not_taken(resp):
            self._breaker_failure(replica)
            return None
        replica.breaker.record_success()
        if call.body.get("stream") and resp.status_code == 200:
            return await self._stream(call, replica, resp)
        return await self._whole(call, replica, resp)

    def _upstream_error(self, what: str, exc: httpx.HTTPError) -> JSONResponse:
        """A replica's failure once it may be working on the request (never retried): 504 when
        it ran past --upstream-timeout, else 502."""
        if isinstance(exc, httpx.TimeoutException):
            limit = self.settings.upstream_timeout
            return _error(504, f"the replica {what} within --upstream-timeout ({limit:g} s)")
        return _error(502, f"the replica {what}: {type(exc).__name__}")

    def _breaker_failure(self, replica: Replica) -> None:
        was_open = replica.breaker.state is BreakerState.OPEN
        replica.breaker.record_failure()
        if not was_open and replica.breaker.state is BreakerState.OPEN:
            self.metrics.breaker_opens.labels(replica.url).inc()

    def refresh_gauges(self) -> None:
        """Breaker states (open turns half-open with time, not with an event), requests in
        flight per replica and per key, as of now."""
        for replica in self.replicas:
            self.metrics.breaker.labels(replica.url).set(_BREAKER_VALUE[replica.breaker.state])
            self.metrics.outstanding.labels(replica.url).set(replica.outstanding)
        self.metrics.key_in_flight.clear()
        for policy in self.keys.keys:
            self.metrics.key_in_flight.labels(policy.name).set(policy.in_flight)

    async def _stream(self, call: _Call, replica: Replica, resp: httpx.Response) -> Response | None:
        """Wait for the stream's first event before answering the client, so that a replica
        failing before then (dying with the request still in its queue) leaves the request free
        to retry elsewhere; then hand the stream to a response that releases the request."""
        call.events = self._events(call, resp)
        try:
            first = await anext(call.events)
        except StopAsyncIteration:
            self._breaker_failure(replica)
            return None
        except httpx.HTTPError as exc:
            if isinstance(exc, _LOST):
                self._breaker_failure(replica)
                return None
            return self._upstream_error("failed before its first event", exc)
        call.handed_over = True
        return _Relayed(self._relay(first, call.events, replica), call)

    async def _events(self, call: _Call, resp: httpx.Response) -> AsyncGenerator[bytes, None]:
        """The replica's SSE events, whole, as the client is to get them: a usage event settles
        the key's charge, and is kept from a client that did not ask for it. Only a key with a
        token bucket needs that; every other stream is relayed chunk by chunk as it comes."""
        policy = call.settle.policy if call.settle is not None else None
        if policy is None or "tokens" not in policy.buckets:
            async for chunk in resp.aiter_raw():
                yield chunk
            return
        splitter = EventSplitter()
        async for chunk in resp.aiter_raw():
            for event in splitter.feed(chunk):
                usage = usage_of(event)
                if usage is not None:
                    call.settle.used = usage[0]
                if usage is None or not (usage[1] and call.hide_usage):
                    yield event
        rest = splitter.rest()
        if rest:
            yield rest

    async def _relay(
        self, first: bytes, rest: AsyncIterator[bytes], replica: Replica
    ) -> AsyncIterator[bytes]:
        """Pass the events on as they come; a replica failing mid-stream ends the stream with an
        error event. Leaving early (the client went away) closes the upstream response through
        _Relayed, which makes the replica abort the request."""
        try:
            yield first
            async for event in rest:
                yield event
        except httpx.HTTPError as exc:
            if isinstance(exc, _LOST):
                self._breaker_failure(replica)
            event = error_body(
                502, f"the replica failed mid-stream: {type(exc).__name__}", None, None
            )
            yield f"data: {json.dumps(event)}\n\ndata: [DONE]\n\n".encode()

    async def _whole(self, call: _Call, replica: Replica, resp: httpx.Response) -> Response:
        """Read a non-streamed answer and relay it as the replica's own (status, body,
        Retry-After); a replica failing meanwhile is answered 502, not retried."""
        try:
            content = await resp.aread()
        except httpx.HTTPError as exc:
            if isinstance(exc, _LOST):
                self._breaker_failure(replica)
            return self._upstream_error("failed while answering", exc)
        call.settle.used = _usage_tokens(resp.status_code, content)
        media = resp.headers.get("content-type", "application/json")
        extra = {k: v for k, v in resp.headers.items() if k.lower() == "retry-after"}
        return Response(content, status_code=resp.status_code, media_type=media, headers=extra)

    async def key_required(self, raw: Request) -> JSONResponse | None:
        """A 401 when the gateway has keys and the request brings none of them (the model
        list; the fleet's views take ``operator_required``), else None."""
        return self._refusal(raw, operator=False)

    async def operator_required(self, raw: Request) -> JSONResponse | None:
        """The fleet's views (the console's state, /metrics when it needs a key): a 401 as
        ``key_required``, and a 403 for a key that is not an operator's once any key is."""
        return self._refusal(raw, operator=True)

    def _refusal(self, raw: Request, operator: bool) -> JSONResponse | None:
        if not self.keys.enabled:
            return None
        policy = self.keys.identify(raw.headers.get("authorization"))
        if policy is None:
            return _error(401, "missing or wrong API key")
        if operator and self.keys.has_operators and not policy.operator:
            return _error(403, "this key may not read the fleet's state (operator keys may)")
        return None

    async def console_state(self) -> dict[str, Any]:
        """The fleet for the console: each replica's health, breaker, load and KV usage."""
        replicas = [
            {
                "url": r.url,
                "healthy": r.breaker.state is not BreakerState.OPEN,
                "breaker": r.breaker.state.value,
                "outstanding": r.outstanding,
                "scraped_requests": r.scraped_requests,
                "kv_usage": r.scraped_kv_usage,
                "models": sorted(r.models),
                "fallback": r.fallback,
            }
            for r in self.replicas
        ]
        total = sum(s.value for m in self.metrics.requests.collect() for s in m.samples
                    if s.name.endswith("_total"))  # fmt: skip
        return {"kind": "gateway", "time": time.monotonic(), "replicas": replicas,
                "requests_total": total}  # fmt: skip

    def models(self) -> dict[str, Any]:
        names = sorted({m for r in self.replicas for m in r.models})
        data = [{"id": n, "object": "model", "created": 0, "owned_by": "pagellm"} for n in names]
        return {"object": "list", "data": data}


class _Relayed(StreamingResponse):
    """A relayed stream that releases what its request holds however the response ends:
    finished, cut by a client that left before or while it ran, or failed."""

    def __init__(self, events: AsyncGenerator[bytes, None], call: _Call) -> None:
        super().__init__(events, media_type="text/event-stream", headers=STREAM_HEADERS)
        self.call = call

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()
            await self.call.finish()


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
        try:
            while not await self.raw.is_disconnected():
                await asyncio.sleep(0.1)
        except Exception:  # a receive channel that fails: stop watching, the request goes on
            log.exception("gateway: cannot watch the client's connection")
            return
        self.left = True
        self.task.cancel()


def _not_taken(resp: httpx.Response) -> bool:
    """A replica's answer that says it could not take the request (a proxy in front of it found
    it gone, or it is unavailable with no hint of when to come back): another replica may."""
    status = resp.status_code
    return status == 502 or (status == 503 and "retry-after" not in resp.headers)


def _model_cards(payload: Any) -> list[dict[str, Any]]:
    """The cards of a /v1/models reply; ValueError unless it is a list of cards with ids."""
    data = payload.get("data") if isinstance(payload, dict) else None
    if not isinstance(data, list) or not all(
        isinstance(card, dict) and isinstance(card.get("id"), str) for card in data
    ):
        raise ValueError("a malformed model list")
    return data


def _refused(denied: Denied) -> JSONResponse:
    wait = denied.retry_after
    retry = None
    if wait is not None and math.isfinite(wait):
        retry = {"Retry-After": str(max(1, math.ceil(wait)))}
    return _error(denied.status, denied.message, code=denied.code, headers=retry)


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


def _mtime(path: str | None) -> int | None:
    if path is None:
        return None
    try:
        return os.stat(path).st_mtime_ns
    except OSError:
        return None


def _usage_tokens(status: int, content: bytes) -> int | None:
    """Tokens a whole answer used: its usage; none for a refusal (4xx); unknown (the charge
    stands) for a replica's failure, which may come after some work, or an answer without it."""
    if 400 <= status < 500:
        return 0
    try:
        usage = json.loads(content)["usage"]
        return int(usage["prompt_tokens"]) + int(usage["completion_tokens"])
    except (ValueError, KeyError, TypeError):
        return None


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
        await gateway.guarded("health", gateway.check_all)
        task = asyncio.create_task(gateway.health_loop())
        try:
            yield
        finally:
            task.cancel()
            await gateway.client.aclose()

    app = FastAPI(
        title="pagellm gateway",
        lifespan=lifespan,
        docs_url=None,  # a proxy: no API pages of its own to show (they needed no key)
        redoc_url=None,
        openapi_url=None,
        redirect_slashes=False,
    )

    @app.exception_handler(StarletteHTTPException)
    async def routing(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        """Routing's own answers (404 unknown path, 405 method) as error objects."""
        return _error(exc.status_code, str(exc.detail), headers=exc.headers)

    @app.exception_handler(Exception)
    async def unexpected(_: Request, exc: Exception) -> JSONResponse:
        log.error("gateway: unexpected error", exc_info=exc)
        return _error(500, "the gateway failed on this request")

    @app.post("/v1/completions")
    async def completions(raw: Request) -> Response:
        return await gateway.proxy("/v1/completions", raw)

    @app.post("/v1/chat/completions")
    async def chat(raw: Request) -> Response:
        return await gateway.proxy("/v1/chat/completions", raw)

    @app.get("/v1/models")
    async def models(raw: Request) -> Response:
        return await gateway.key_required(raw) or JSONResponse(gateway.models())

    @app.get("/health")
    async def health() -> Response:
        if any(r.breaker.state is not BreakerState.OPEN for r in gateway.replicas):
            return Response(status_code=200)
        return _error(503, "no replica is healthy", kind="cluster_unavailable")

    @app.get("/metrics")
    async def metrics(raw: Request) -> Response:
        if gateway.settings.metrics_need_key and (denied := await gateway.operator_required(raw)):
            return denied
        gateway.refresh_gauges()
        return Response(generate_latest(gateway.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    if not gateway.settings.disable_ui:
        install_console(app, gateway.console_state, gateway.operator_required)

    return app
