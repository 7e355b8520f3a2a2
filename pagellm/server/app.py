"""The OpenAI-compatible FastAPI app over an AsyncLLMEngine.

Handlers validate (pydantic + SamplingParams), tokenize with the model's tokenizer off the event
loop, check the context length and the queue limits before anything is queued, then stream or
collect the engine's outputs. Leaving a stream, or a non-streaming client disconnecting, aborts
the request in the engine.

What a client sends is bounded before it costs anything: the API key is checked on every path
but ``/health`` before the body is read, the body is counted as it arrives (413 past
``max_body_bytes``), a request may hold at most ``max_seqs_per_request`` sequences (prompts x n),
and every answer that is not a success is an OpenAI error object, an unexpected fault too.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagellm import __version__
from pagellm.console.routes import RecentLatencies, install_console, is_open_path
from pagellm.engine.async_engine import AsyncLLMEngine, EngineDeadError, RequestFailed
from pagellm.engine.errors import ContextLengthExceeded, RequestRejected
from pagellm.engine.outputs import RequestOutput
from pagellm.engine.sampling_params import ParamError, SamplingParams
from pagellm.server.chat_tools import ChoiceCalls, ToolPlan, plan_tools
from pagellm.server.errors import APIError, body_timeout, error_body, error_response, quoted_name
from pagellm.server.metrics import (
    FillThreadCollector,
    RequestLatencies,
    grammar_compile_histogram,
    grammar_failure_counter,
    make_registry,
)
from pagellm.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    chat_messages,
)
from pagellm.structured.params import (
    CompileAborted,
    CompileQueueFull,
    StructuredOutputError,
    StructuredOutputsParams,
)
from pagellm.structured.tools import messages_for_template, template_renders_tools

_RETRY = {"code": "server_busy", "headers": {"Retry-After": "1"}}
_OPEN_PATHS = ("/health",)
log = logging.getLogger("pagellm.server")


@dataclass(frozen=True, slots=True)
class ServerSettings:
    model_name: str
    max_model_len: int
    api_key: str | None = None
    max_body_bytes: int = 4 << 20
    """Request bodies past this many bytes are answered 413 (counted as they arrive)."""
    max_num_queued_requests: int | None = 4096
    """Sequences (prompts x n) admitted but not yet producing output; over it new requests
    get 503 with Retry-After. None: unbounded."""
    max_num_queued_tokens: int | None = None
    """Prompt tokens of those queued requests; over it new ones get 503."""
    request_timeout: float | None = None
    """Seconds from arrival after which a request is aborted and answered 504."""
    max_seqs_per_request: int = 256
    """Most sequences one request may ask for (a completions request's prompts x n)."""
    metrics_need_key: bool = True
    """With an API key: /metrics needs it too (False opens it for a scraper)."""
    client_body_timeout: float = 60.0
    """Seconds a request body may take to arrive whole; past them, 408."""
    max_pending_compiles: int = 64
    """Grammars queued or compiling; a request with a new constraint past it gets 503 with
    Retry-After (each compile may take up to the compile deadline on one of two workers)."""
    max_overrun_fills: int = 8
    """Threads left behind by grammars whose matching overran its bound, still running: while
    this many run, requests with a constraint get 503 with Retry-After. Each burns CPU at the
    lowest priority until its one fill ends (minutes for the worst grammars), so without a
    bound a client sending such grammars would take the engine's CPU a thread at a time. It is
    checked as a request arrives: constrained requests admitted together before any of them
    overran may each leave one more (a burst; per-key limits at the gateway bound a client's)."""
    disable_ui: bool = False
    """No web console at /ui (``--disable-ui``)."""
    enable_auto_tool_choice: bool = False
    """``tool_choice: auto`` parses the model's tool calls (vLLM's --enable-auto-tool-choice)."""
    tool_call_parser: str | None = None
    """The model's tool-call format for ``auto``: hermes or llama3_json."""


def build_app(front: AsyncLLMEngine, tokenizer: Any, settings: ServerSettings) -> FastAPI:
    app = FastAPI(title="pagellm", version=__version__)
    _install_error_handlers(app)
    _install_guards(app, settings)
    ctx = _Context(front, tokenizer, settings)

    @app.get("/health")
    async def health() -> Response:
        if front.is_healthy:
            return Response(status_code=200)
        return JSONResponse(error_body(503, "engine is not running", None, None), 503)

    registry = make_registry(
        front.engine.stats, settings.model_name, lambda: front.thread_cpu_seconds
    )
    recent = RecentLatencies()
    ctx.latencies = RequestLatencies(registry, settings.model_name, recent)
    if not settings.disable_ui:
        install_console(app, _console_state(front, settings, recent))
    structured = getattr(front.engine, "structured", None)
    if structured is not None:
        structured.compiler.on_compiled = grammar_compile_histogram(registry, settings.model_name)
        structured.compiler.on_failed = grammar_failure_counter(registry, settings.model_name)
        registry.register(FillThreadCollector(structured.fills, settings.model_name))

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/version")
    async def version() -> dict:
        return {"version": __version__}

    @app.get("/v1/models")
    async def models() -> dict:
        card = {
            "id": settings.model_name,
            "object": "model",
            "created": 0,
            "owned_by": "pagellm",
            "max_model_len": settings.max_model_len,
        }
        return {"object": "list", "data": [card]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, raw: Request) -> Response:
        return await ctx.completions(body, raw)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, raw: Request) -> Response:
        return await ctx.chat(body, raw)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict:
        ctx._check_model(body.model)
        if body.messages is not None and body.prompt is not None:
            raise APIError(400, "give 'prompt' or 'messages', not both", param="messages")
        if body.messages is not None:
            ids = await ctx.chat_ids(body.messages, for_generation=False)
        elif body.prompt is not None:
            ids = await asyncio.to_thread(
                tokenizer.encode, body.prompt, add_special_tokens=body.add_special_tokens
            )
        else:
            raise APIError(400, "give 'prompt' or 'messages'", param="prompt")
        return {"tokens": ids, "count": len(ids), "max_model_len": settings.max_model_len}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict:
        ctx._check_model(body.model)
        vocab = front.engine.vocab_size
        if any(not 0 <= t < vocab for t in body.tokens):
            raise APIError(400, f"token ids must be in [0, {vocab})", param="tokens")
        text = await asyncio.to_thread(tokenizer.decode, body.tokens, skip_special_tokens=False)
        return {"prompt": text}

    return app


def _console_state(front: AsyncLLMEngine, settings: ServerSettings, recent: RecentLatencies):
    """The console's live state: an engine snapshot, the server's facts, recent latencies."""
    from pagellm.console.snapshot import engine_snapshot

    async def state() -> dict[str, Any]:
        snap = await front.call(engine_snapshot)
        now = time.monotonic()
        snap.update(
            time=now,
            model=settings.model_name,
            max_model_len=settings.max_model_len,
            healthy=front.is_healthy,
            auto_tools=settings.enable_auto_tool_choice,
            latencies=recent.series(now),
        )
        return snap

    return state


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api(_: Request, exc: APIError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        message = str(first.get("msg", "invalid request")).removeprefix("Value error, ")
        if first.get("type") == "json_invalid":  # its loc is a character offset, not a field
            return error_response(APIError(400, "the request body is not valid JSON"))
        return error_response(APIError(400, message, param=_param_path(first.get("loc", ()))))

    @app.exception_handler(ParamError)
    async def _param(_: Request, exc: ParamError) -> JSONResponse:
        return error_response(APIError(400, str(exc), param=exc.param))

    @app.exception_handler(StructuredOutputError)
    async def _grammar(_: Request, exc: StructuredOutputError) -> JSONResponse:
        return error_response(APIError(400, str(exc), param=exc.param))

    @app.exception_handler(RequestRejected)
    async def _rejected(request: Request, exc: RequestRejected) -> JSONResponse:
        return error_response(
            APIError(400, str(exc), param=_prompt_param(request, exc.param), code=exc.code)
        )

    @app.exception_handler(EngineDeadError)
    async def _dead(_: Request, exc: EngineDeadError) -> JSONResponse:
        return error_response(APIError(503, str(exc), headers={"Retry-After": "5"}))

    @app.exception_handler(RequestFailed)
    async def _failed(_: Request, exc: RequestFailed) -> JSONResponse:
        return error_response(APIError(500, f"the request failed: {exc}", code="request_failed"))

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        """Routing's own answers (404 unknown path, 405 method, a body FastAPI cannot read)."""
        return error_response(APIError(exc.status_code, str(exc.detail), headers=exc.headers))

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unexpected error in a handler")
        return error_response(APIError(500, f"internal error: {type(exc).__name__}"))


def _prompt_param(request: Request, param: str | None) -> str | None:
    """The engine names the prompt ``messages``, as OpenAI's chat errors do; the completions
    endpoint's prompt is ``prompt``."""
    if param == "messages" and request.url.path.endswith("/v1/completions"):
        return "prompt"
    return param


def _param_path(loc) -> str | None:
    """The field a validation error is about (``messages.0.content``), without pydantic's
    union branch tags (``str``, ``list[int]``, ``function-after[...]``)."""
    parts = []
    for part in loc:
        if part == "body":
            continue
        if isinstance(part, str) and not part.isidentifier():
            break  # a branch tag: what follows belongs to one guess at the type
        if part in ("str", "int", "float", "bool", "list", "dict"):
            break
        parts.append(str(part))
    return ".".join(parts) or None


def _install_guards(app: FastAPI, settings: ServerSettings) -> None:
    app.add_middleware(_Guards, settings=settings)


class _Guards:
    """API key (401) and body size (413) checks as plain ASGI middleware, in that order: a
    request without the key costs no body read. The body is read here, counting bytes as they
    arrive (a chunked body has no Content-Length to trust), then replayed to the app.

    Plain ASGI (not Starlette's BaseHTTPMiddleware) so that handlers still see the client's
    disconnect through ``Request.is_disconnected``.
    """

    def __init__(self, app, settings: ServerSettings) -> None:
        self.app = app
        self.settings = settings
        key = settings.api_key
        self.expected = f"Bearer {key}".encode() if key else None
        self.open_paths = _OPEN_PATHS + (() if settings.metrics_need_key else ("/metrics",))

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        err = self._check_key(scope) or self._check_length(scope)
        if err is None and scope["method"] not in ("GET", "HEAD"):
            body, err = await self._read_body(receive)
            if body is None and err is None:
                return  # the client left while sending
            receive = _replay(body or b"", receive)
        if err is not None:
            await error_response(err)(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def _check_key(self, scope) -> APIError | None:
        path = scope["path"]
        if self.expected is None or path in self.open_paths:
            return None
        if not self.settings.disable_ui and is_open_path(path):
            return None
        given = next((v for k, v in scope["headers"] if k.lower() == b"authorization"), b"")
        if not hmac.compare_digest(given, self.expected):
            return APIError(401, "missing or wrong API key")
        return None

    def _check_length(self, scope) -> APIError | None:
        length = next((v for k, v in scope["headers"] if k.lower() == b"content-length"), b"")
        if length.isdigit() and int(length) > self.settings.max_body_bytes:
            return self._too_large()
        return None

    def _too_large(self) -> APIError:
        return APIError(413, f"request body over {self.settings.max_body_bytes} bytes")

    async def _read_body(self, receive) -> tuple[bytes | None, APIError | None]:
        """The whole body, or why not (None, None: the client left); a body still arriving
        after ``client_body_timeout`` seconds is a 408 (a client trickling it would hold a
        connection for ever)."""
        timeout = self.settings.client_body_timeout
        try:
            async with asyncio.timeout(timeout):
                return await self._receive_body(receive)
        except TimeoutError:
            return None, body_timeout(timeout)

    async def _receive_body(self, receive) -> tuple[bytes | None, APIError | None]:
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None, None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.settings.max_body_bytes:
                return None, self._too_large()
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks), None


def _replay(body: bytes, receive):
    """An ASGI receive that gives ``body`` first, then whatever the client sends next (its
    disconnect)."""
    given = False

    async def replayed():
        nonlocal given
        if not given:
            given = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replayed


class _Context:
    def __init__(self, front: AsyncLLMEngine, tokenizer: Any, settings: ServerSettings) -> None:
        self.front = front
        self.tokenizer = tokenizer
        self.settings = settings
        self.latencies: RequestLatencies | None = None

    def _chunker(self, rid: str, obj: str, created: int):
        """A builder of this response's bodies (stream events, or the whole answer): choices
        plus optional extra fields."""

        def chunk(choices: list[dict], **extra: Any) -> dict:
            return {
                "id": rid,
                "object": obj,
                "created": created,
                "model": self.settings.model_name,
                "choices": choices,
                **extra,
            }

        return chunk

    def _generate(self, rid: str, prompt: tuple[str | None, list[int]], params, body):
        """Submit one prompt now (it counts as queued from here) and wrap its stream."""
        tenant = body.user or "default"
        text, ids = prompt
        gen = self.front.submit(rid, ids, params, body.priority, tenant, text)
        if self.latencies is not None:
            gen = self.latencies.observe(gen, time.monotonic)
        if self.settings.request_timeout is not None:
            gen = _with_deadline(gen, self.settings.request_timeout)
        return gen

    def _namer(self, body):
        return _token_namer(self.tokenizer, body.return_tokens_as_token_ids)

    def _completion_namers(self, body):
        """How completions logprobs name a token, and its text (for ``text_offset``): one
        function when they are the same, so each token is decoded once."""
        text_of = _token_namer(self.tokenizer, False)
        return (self._namer(body) if body.return_tokens_as_token_ids else text_of), text_of

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.settings.model_name:
            raise APIError(
                404,
                f"the model {quoted_name(model)} does not exist",
                param="model",
                code="model_not_found",
            )

    def _check_seqs(self, num_prompts: int, n: int) -> None:
        most = self.settings.max_seqs_per_request
        if num_prompts * n > most:
            raise APIError(
                400,
                f"the request asks for {num_prompts} prompts x n={n} = {num_prompts * n} "
                f"sequences; at most {most} are allowed per request",
                param="prompt" if num_prompts > 1 else "n",
            )

    async def _prepare(self, prompts: list[str | list[int]]) -> list[tuple[str | None, list[int]]]:
        """Tokenize and check the prompts in a worker thread (a long prompt must not stall
        the event loop)."""
        prepare = self.front.engine.prepare_prompt
        return await asyncio.to_thread(lambda: [prepare(p) for p in prompts])

    async def chat_ids(
        self, messages, tools: list[dict] | None = None, for_generation: bool = True
    ) -> list[int]:
        """The chat rendered by the model's template and tokenized, in a worker thread; a
        template that rejects the messages (``raise_exception``) or is missing is a 400.
        ``tools`` are shown to the model (``pagellm.structured.tools``). ``for_generation``:
        messages whose text cannot fit the context are refused before rendering (/tokenize
        counts any length, as vLLM's)."""
        import jinja2

        if for_generation:
            self.front.engine.check_prompt_chars(sum(len(m.text()) for m in messages))
        turns, extra = chat_messages(messages), {}
        if tools:
            renders = template_renders_tools(getattr(self.tokenizer.hf, "chat_template", None))
            turns, extra = messages_for_template(turns, tools, renders)
        try:
            return await asyncio.to_thread(self.tokenizer.chat_token_ids, turns, **extra)
        except (jinja2.TemplateError, ValueError, TypeError, KeyError) as exc:
            raise APIError(400, f"the chat template cannot render the messages: {exc}",
                           param="messages") from exc  # fmt: skip
        except RecursionError:  # e.g. a tool call's arguments nested hundreds deep
            raise APIError(400, "the chat template cannot render the messages: they are "
                           "nested too deeply", param="messages") from None  # fmt: skip

    def _admit(self, num_seqs: int, prompt_tokens: int) -> None:
        """503 with Retry-After when the waiting queue is full (checked before queueing)."""
        s, front = self.settings, self.front
        if s.max_num_queued_requests is not None and (
            front.num_queued_requests + num_seqs > s.max_num_queued_requests
        ):
            raise APIError(503, "the server is busy: too many queued requests", **_RETRY)
        if s.max_num_queued_tokens is not None and (
            front.num_queued_tokens + prompt_tokens > s.max_num_queued_tokens
        ):
            raise APIError(503, "the server is busy: too many queued prompt tokens", **_RETRY)

    async def _compiled(self, constraint: StructuredOutputsParams | None, param: str) -> None:
        """Compile the request's grammar off the event loop before queueing it (cached: the
        engine then finds it ready); one that does not compile is a 400 naming ``param``."""
        if constraint is None:
            return
        structured = getattr(self.front.engine, "structured", None)
        if structured is None:
            raise APIError(400, "structured outputs are not available on this server", param=param)
        if (left := structured.fills.left_running()) >= self.settings.max_overrun_fills:
            log.warning("refusing a constraint: %d grammar matches that overran still run", left)
            raise APIError(503, f"the server is busy: {left} grammar matches that overran "
                           "their bound are still running", **_RETRY)  # fmt: skip
        limit = self.settings.max_pending_compiles
        try:
            future = structured.compiler.compile(constraint, max_pending=limit)
        except CompileQueueFull:
            raise APIError(503, "the server is busy: too many grammars waiting to compile",
                           **_RETRY) from None  # fmt: skip
        try:  # shielded: a client that goes away must not cancel a compile others may share
            await asyncio.shield(asyncio.wrap_future(future))
        except CompileAborted as exc:  # the server's trouble, not the constraint's
            raise APIError(503, str(exc), **_RETRY) from None
        except StructuredOutputError as exc:
            raise StructuredOutputError(str(exc), param) from None

    def _params(
        self,
        body,
        prompt_lens: list[int],
        max_tokens: int | None,
        logprobs,
        constraint: StructuredOutputsParams | None = None,
    ) -> SamplingParams:
        """One validated SamplingParams for all of a request's prompts (built and checked once:
        its lists may be as long as the vocabulary), after every prompt's length check."""
        limit = self.settings.max_model_len
        if max_tokens is None:
            max_tokens = limit - max(prompt_lens)
        for prompt_len in prompt_lens:
            if prompt_len + max_tokens > limit:
                raise ContextLengthExceeded(prompt_len, max_tokens, limit)
        self.front.engine.check_priority(body.priority)
        params = body.sampling_params(max_tokens, logprobs, constraint)
        self.front.engine.check_params(params)
        return params

    # ----- /v1/completions --------------------------------------------------------------

    async def completions(self, body: CompletionRequest, raw: Request) -> Response:
        self._check_model(body.model)
        _refuse_unsupported(body)
        prompts = _prompt_list(body.prompt)
        self._check_seqs(len(prompts), body.n)
        constraint, source = body.output_constraint()
        prepared = await self._prepare(prompts)
        max_tokens = body.max_tokens if body.max_tokens is not None else 16
        lengths = [len(ids) for _, ids in prepared]
        params = self._params(body, lengths, max_tokens, body.logprobs, constraint)
        await self._compiled(constraint, source)
        self._admit(len(prompts) * body.n, sum(lengths))
        rid = f"cmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        gens = [
            self._generate(f"{rid}-{i}", prompt, params, body) for i, prompt in enumerate(prepared)
        ]
        if body.stream:
            return _sse(self._completion_events(gens, rid, created, body))
        finals = await _until_disconnect(raw, _all_finals(gens))
        choices, usage = [], _Usage()
        name, text_of = self._completion_namers(body)
        for i, out in enumerate(finals):
            usage.add(out)
            for comp in out.outputs:
                choices.append(
                    {
                        "index": i * body.n + comp.index,
                        "text": comp.text,
                        "logprobs": _completion_logprobs(comp.logprobs, name, text_of)[0],
                        "finish_reason": comp.finish_reason,
                        "stop_reason": comp.stop_reason,
                    }
                )
        body = self._chunker(rid, "text_completion", created)(choices, usage=usage.as_dict())
        return JSONResponse(body)

    async def _completion_events(self, gens, rid, created, body) -> AsyncIterator[dict]:
        """One stream over all prompts: prompt i's copy j is choice ``i * n + j``."""
        chunk = self._chunker(rid, "text_completion", created)
        usage = _Usage()
        deltas = [_text_deltas(g, body.n) for g in gens]
        name, text_of = self._completion_namers(body)
        offsets: dict[int, int] = {}  # choice -> text offset after its tokens so far
        async for prompt_index, item in _merged(deltas):
            if isinstance(item, _Usage):
                usage.merge(item)
                continue
            index = prompt_index * body.n + item.index
            logprobs, offsets[index] = _completion_logprobs(
                item.logprobs, name, text_of, offsets.get(index, 0)
            )
            choice = {
                "index": index,
                "text": item.text,
                "logprobs": logprobs,
                "finish_reason": item.finish_reason,
            }
            if item.finish_reason is not None:
                choice["stop_reason"] = item.stop_reason
            yield chunk([choice])
        if _want_usage(body):
            yield chunk([], usage=usage.as_dict())

    # ----- /v1/chat/completions ---------------------------------------------------------

    async def chat(self, body: ChatCompletionRequest, raw: Request) -> Response:
        self._check_model(body.model)
        _refuse_unsupported(body)
        s = self.settings
        plan = plan_tools(body, s.enable_auto_tool_choice, s.tool_call_parser)
        constraint, source = body.output_constraint()
        if plan.constraint is not None:
            if constraint is not None:
                raise APIError(
                    400,
                    f"tool_choice {plan.mode!r} constrains the output already: give no "
                    "response_format or structured_outputs with it",
                    param="tool_choice",
                )
            constraint, source = plan.constraint, "tools"
        ids = await self.chat_ids(body.messages, plan.tools)
        ids = self.front.engine.prepare_prompt(ids)[1]
        max_tokens = body.max_completion_tokens or body.max_tokens
        top = (body.top_logprobs or 0) if body.logprobs else None
        params = self._params(body, [len(ids)], max_tokens, top, constraint)
        await self._compiled(constraint, source)
        self._admit(body.n, len(ids))
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        gen = self._generate(rid, (None, ids), params, body)
        if body.stream:
            return _sse(self._chat_events(gen, rid, created, body, plan))
        out = await _until_disconnect(raw, _last(gen))
        usage = _Usage()
        usage.add(out)
        choices = [_chat_choice(comp, plan, self._namer(body)) for comp in out.outputs]
        body = self._chunker(rid, "chat.completion", created)(choices, usage=usage.as_dict())
        return JSONResponse(body)

    async def _chat_events(self, gen, rid, created, body, plan: ToolPlan) -> AsyncIterator[dict]:
        chunk = self._chunker(rid, "chat.completion.chunk", created)
        calls: dict[int, ChoiceCalls] = {}

        yield chunk(
            [
                {"index": i, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
                for i in range(body.n)
            ]
        )
        async for item in _text_deltas(gen, body.n):
            if isinstance(item, _Usage):
                if _want_usage(body):
                    yield chunk([], usage=item.as_dict())
                continue
            delta, finish_reason = _chat_delta(item, plan, calls)
            if not delta and item.finish_reason is None and item.logprobs is None:
                continue  # text held back by the tool-call parser (as vLLM, no chunk)
            choice = {
                "index": item.index,
                "delta": delta,
                "logprobs": _chat_logprobs(item.logprobs, self._namer(body)),
                "finish_reason": finish_reason,
            }
            if item.finish_reason is not None:
                choice["stop_reason"] = item.stop_reason
            yield chunk([choice])


def _chat_choice(comp, plan: ToolPlan, namer) -> dict:
    """One choice of a whole chat answer: its text, or its tool calls."""
    message: dict[str, Any] = {"role": "assistant", "content": comp.text}
    finish_reason = comp.finish_reason
    parser = plan.new_parser()
    if parser is not None:
        calls = ChoiceCalls(parser)
        calls.feed(comp.text)
        calls.finish()
        # the parser's content, as streamed: none where the output must be calls (required,
        # named) even if it was cut short before the first call's name
        message = calls.message() if calls.names else {**message, "content": calls.content}
        finish_reason = plan.finish_reason(finish_reason, len(calls.names), comp.stop_reason)
    return {
        "index": comp.index,
        "message": message,
        "logprobs": _chat_logprobs(comp.logprobs, namer),
        "finish_reason": finish_reason,
        "stop_reason": comp.stop_reason,
    }


def _chat_delta(item: _Delta, plan: ToolPlan, calls: dict[int, ChoiceCalls]):
    """A stream event's delta (content and/or tool-call deltas) and finish reason."""
    parser = calls.get(item.index)
    if parser is None and plan.mode != "none":
        parser = calls[item.index] = ChoiceCalls(plan.new_parser())
    if parser is None:  # vLLM's shape: tokens whose text is held back go out as content ""
        return {"content": item.text}, item.finish_reason
    content, tool_deltas = parser.feed(item.text)
    if item.finish_reason is not None:
        more_content, more_deltas = parser.finish()
        content, tool_deltas = content + more_content, tool_deltas + more_deltas
    delta: dict[str, Any] = {}
    if content:
        delta["content"] = content
    if tool_deltas:
        delta["tool_calls"] = tool_deltas
    finish_reason = item.finish_reason
    if finish_reason is not None:
        finish_reason = plan.finish_reason(finish_reason, len(parser.names), item.stop_reason)
    return delta, finish_reason


def _want_usage(body) -> bool:
    return bool(body.stream_options and body.stream_options.include_usage)


@dataclass(frozen=True, slots=True)
class _Delta:
    """What changed in one of a request's n completions since the last event."""

    index: int
    text: str
    logprobs: list | None
    """Logprobs of the tokens that arrived with this change (None when not asked for)."""
    finish_reason: str | None
    stop_reason: str | int | None


async def _text_deltas(gen, n: int) -> AsyncIterator:
    """A ``_Delta`` per change of any of the n completions, then the request's ``_Usage``.

    Text and logprobs are cumulative in the outputs; only what is new goes out."""
    sent_text = [0] * n
    sent_tokens = [0] * n
    done: set[int] = set()
    last: RequestOutput | None = None
    async for out in gen:
        last = out
        for comp in out.outputs:
            if comp.index in done:
                continue  # finished copies reappear while the others run on
            i = comp.index
            text = comp.text[sent_text[i] :]
            if not text and comp.finish_reason is None and len(comp.token_ids) == sent_tokens[i]:
                continue  # nothing new (vLLM's shape: new tokens whose text is held back, a
                # partial UTF-8 character or a possible stop string, go out with text "")
            logprobs = None if comp.logprobs is None else comp.logprobs[sent_tokens[i] :]
            sent_text[i] = len(comp.text)
            sent_tokens[i] = len(comp.token_ids)
            if comp.finish_reason is not None:
                done.add(i)
            yield _Delta(i, text, logprobs, comp.finish_reason, comp.stop_reason)
    if last is not None:
        usage = _Usage()
        usage.add(last)
        yield usage


_END = object()


async def _merged(streams: list[AsyncIterator]) -> AsyncIterator[tuple[int, Any]]:
    """(stream index, item) from all streams as items arrive. The first error ends the whole
    merge; leaving early cancels the pumps, which aborts their requests in the engine."""
    inbox: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream: AsyncIterator) -> None:
        try:
            async for item in stream:
                await inbox.put((i, item))
            await inbox.put((i, _END))
        except Exception as exc:  # noqa: BLE001 - handed to the consumer
            await inbox.put((i, exc))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await inbox.get()
            if item is _END:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _refuse_unsupported(body: CompletionRequest | ChatCompletionRequest) -> None:
    """A 400 naming a vLLM / OpenAI field the request sets that pagellm does not implement
    (served as if absent, it would answer something else than asked)."""
    name = body.unsupported_field()
    if name is not None:
        raise APIError(400, f"{name} is not supported", param=name)


def _prompt_list(prompt: Any) -> list[str | list[int]]:
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise APIError(400, "the prompt is empty", param="prompt")
    if isinstance(prompt[0], int):
        return [list(prompt)]
    return list(prompt)


async def _last(gen: AsyncIterator[RequestOutput]) -> RequestOutput:
    last = None
    async for out in gen:
        last = out
    assert last is not None
    return last


async def _all_finals(gens: list[AsyncIterator[RequestOutput]]) -> list[RequestOutput]:
    """Every request's final output; if one fails the others are cancelled (and aborted)."""
    tasks = [asyncio.ensure_future(_last(g)) for g in gens]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()


async def _until_disconnect(raw: Request, awaitable) -> Any:
    """Await while the client is connected; on disconnect cancel (which aborts in the engine)."""
    task = asyncio.ensure_future(awaitable)
    while True:
        done, _ = await asyncio.wait({task}, timeout=0.1)
        if done:
            return task.result()
        if await raw.is_disconnected():
            task.cancel()
            raise APIError(400, "client disconnected")


async def _with_deadline(gen: AsyncIterator[RequestOutput], seconds: float) -> AsyncIterator:
    """Pass ``gen`` through until ``seconds`` from now; then abort it (closing ``gen`` aborts
    the request in the engine) and raise a 504."""
    deadline = asyncio.get_running_loop().time() + seconds
    try:
        while True:
            try:
                async with asyncio.timeout_at(deadline):
                    out = await anext(gen)
            except StopAsyncIteration:
                return
            except TimeoutError:
                raise APIError(
                    504, f"the request timed out after {seconds:g} s", code="request_timeout"
                ) from None
            yield out
    finally:
        await gen.aclose()


def _sse(events: AsyncIterator[dict]) -> StreamingResponse:
    import json

    def error_event(status: int, message: str, code: str | None = None) -> bytes:
        return f"data: {json.dumps(error_body(status, message, None, code))}\n\n".encode()

    async def body() -> AsyncIterator[bytes]:
        try:
            async for event in events:
                yield f"data: {json.dumps(event)}\n\n".encode()
        except APIError as exc:
            yield error_event(exc.status, exc.message, exc.code)
        except (RequestRejected, EngineDeadError, ValueError) as exc:
            yield error_event(503 if isinstance(exc, EngineDeadError) else 400, str(exc))
        except RequestFailed as exc:
            yield error_event(500, f"the request failed: {exc}", "request_failed")
        except Exception as exc:  # noqa: BLE001 - the stream must end with an error event
            log.exception("unexpected error in a stream")
            yield error_event(500, f"internal error: {type(exc).__name__}")
        yield b"data: [DONE]\n\n"

    return StreamingResponse(body(), media_type="text/event-stream")


class _Usage:
    def __init__(self) -> None:
        self.prompt = 0
        self.completion = 0

    def add(self, out: RequestOutput) -> None:
        self.prompt += len(out.prompt_token_ids)
        self.completion += sum(len(c.token_ids) for c in out.outputs)

    def merge(self, other: _Usage) -> None:
        self.prompt += other.prompt
        self.completion += other.completion

    def as_dict(self) -> dict[str, int]:
        total = self.prompt + self.completion
        return {
            "prompt_tokens": self.prompt,
            "completion_tokens": self.completion,
            "total_tokens": total,
        }


def _token_namer(tokenizer: Any, as_ids: bool):
    """How logprobs name a token: its text, or "token_id:{id}" when the client asked."""
    if as_ids:
        return lambda token_id: f"token_id:{token_id}"
    return lambda token_id: tokenizer.decode([token_id], skip_special_tokens=False)


def _completion_logprobs(
    logprobs: list | None, name, text_of, offset: int = 0
) -> tuple[dict | None, int]:
    """The legacy completions logprobs object, and the text offset after its tokens:
    ``text_offset`` counts each token's own text from ``offset`` (vLLM's rule), so a stream
    passes on where the choice's previous chunk ended."""
    if logprobs is None:
        return None, offset
    texts = [text_of(lp.token_id) for lp in logprobs]
    offsets = []
    for text in texts:
        offsets.append(offset)
        offset += len(text)
    body = {
        "text_offset": offsets,
        "tokens": texts if name is text_of else [name(lp.token_id) for lp in logprobs],
        "token_logprobs": [lp.logprob for lp in logprobs],
        "top_logprobs": [{name(t): v for t, v in lp.top} for lp in logprobs],
    }
    return body, offset


def _chat_logprobs(logprobs: list | None, name) -> dict | None:
    if logprobs is None:
        return None

    def entry(token_id: int, logprob: float) -> dict:
        text = name(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    return {
        "content": [
            {**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]}
            for lp in logprobs
        ]
    }
