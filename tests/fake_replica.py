"""A scripted OpenAI-compatible replica for the gateway's fault tests: its behaviour is set over
HTTP while it runs (POST /control), so a test can make it fail, hang, hold requests, cut streams
mid-way, report itself unhealthy or answer a malformed model list, and read back what it
received (GET /control/log).

    python tests/fake_replica.py --port 8123 --model fake
"""

from __future__ import annotations

import argparse
import asyncio
import json
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse


class Script:
    def __init__(self) -> None:
        self.healthy = True
        self.fail_status: int | None = None
        """Answer completions with this status (and an OpenAI-style error) at once."""
        self.hold = False
        """Hold new completions until POST /control/release: a plain one before any byte, a
        stream after its headers, before its first event."""
        self.cut_after: int | None = None
        """Streams send this many events, then the connection is dropped."""
        self.events = 3
        self.models_reply: Any = None
        """Answer GET /v1/models with this JSON instead of the model's card (a malformed list)."""
        self.released = asyncio.Event()
        self.received: list[dict[str, Any]] = []
        self.in_flight = 0
        self.left_early = 0
        """Streams the client (the gateway) closed before the end."""


def build(model: str) -> FastAPI:
    app = FastAPI()
    script = Script()

    @app.post("/control")
    async def control(request: Request) -> dict:
        for name, value in (await request.json()).items():
            if not hasattr(script, name) or name in ("released", "received"):
                return JSONResponse({"error": f"unknown {name}"}, status_code=400)
            setattr(script, name, value)
        return {"ok": True}

    @app.post("/control/release")
    async def release() -> dict:
        script.hold = False
        script.released.set()
        script.released = asyncio.Event()
        return {"ok": True}

    @app.get("/control/log")
    async def log() -> dict:
        return {
            "requests": script.received,
            "in_flight": script.in_flight,
            "left_early": script.left_early,
        }

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if script.healthy else 503)

    @app.get("/v1/models")
    async def models() -> Any:
        if script.models_reply is not None:
            return JSONResponse(script.models_reply)
        return {"object": "list", "data": [{"id": model, "object": "model", "max_model_len": 512}]}

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        label = f'{{model_name="{model}"}}'
        return PlainTextResponse(
            f"pagellm:num_requests_running{label} {script.in_flight}\n"
            f"pagellm:num_requests_waiting{label} 0\n"
            f"pagellm:kv_cache_usage_perc{label} 0\n"
        )

    async def complete(request: Request, chat: bool) -> Response:
        body = await request.json()
        script.received.append(
            {"body": body, "authorization": request.headers.get("authorization")}
        )
        if script.fail_status is not None:
            error = {"message": "scripted failure", "type": "server_error", "code": None}
            return JSONResponse({"error": error}, status_code=script.fail_status)
        script.in_flight += 1
        if body.get("stream"):  # held, if so, after the headers went out
            return StreamingResponse(
                _stream(script, model, chat, body), media_type="text/event-stream"
            )
        try:
            if script.hold:
                await script.released.wait()
        finally:
            script.in_flight -= 1
        return JSONResponse(_answer(model, chat, script.events))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await complete(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await complete(request, chat=True)

    return app


def _choice(chat: bool, text: str, finish: str | None) -> dict[str, Any]:
    if chat:
        return {"index": 0, "delta": {"content": text}, "finish_reason": finish}
    return {"index": 0, "text": text, "finish_reason": finish}


def _answer(model: str, chat: bool, n: int) -> dict[str, Any]:
    text = "x" * n
    choice = {"index": 0, "finish_reason": "length"}
    choice.update({"message": {"role": "assistant", "content": text}} if chat else {"text": text})
    return {
        "id": "fake-1",
        "object": "chat.completion" if chat else "text_completion",
        "created": 0,
        "model": model,
        "choices": [choice],
        "usage": {"prompt_tokens": 5, "completion_tokens": n, "total_tokens": 5 + n},
    }


async def _stream(script: Script, model: str, chat: bool, body: dict[str, Any]):
    kind = "chat.completion.chunk" if chat else "text_completion"
    finished = False
    try:
        if script.hold:
            await script.released.wait()
        for i in range(script.events):
            if script.cut_after is not None and i >= script.cut_after:
                raise ConnectionAbortedError("scripted cut")  # uvicorn drops the connection
            last = i == script.events - 1
            chunk = {"id": "fake-1", "object": kind, "created": 0, "model": model,
                     "choices": [_choice(chat, "x", "length" if last else None)]}  # fmt: skip
            yield f"data: {json.dumps(chunk)}\n\n"
            await asyncio.sleep(0.01)
        if (body.get("stream_options") or {}).get("include_usage"):
            n = script.events
            usage = {"prompt_tokens": 5, "completion_tokens": n, "total_tokens": 5 + n}
            chunk = {"id": "fake-1", "object": kind, "created": 0, "model": model,
                     "choices": [], "usage": usage}  # fmt: skip
            yield f"data: {json.dumps(chunk)}\n\n"
        yield "data: [DONE]\n\n"
        finished = True
    finally:
        script.in_flight -= 1
        if not finished:
            script.left_early += 1


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--model", default="fake")
    args = parser.parse_args()
    uvicorn.run(build(args.model), host="127.0.0.1", port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
