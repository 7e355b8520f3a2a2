"""What a request must be before the gateway forwards it: a body read within a byte limit, counted
as it arrives; a JSON object whose fields the gateway reads are bounded (model, max_tokens,
max_completion_tokens, n); a key's policy on priority and user; and the tokens to charge the key
up front, an upper bound of what the request may use (its completion capped when it gives none).
Failures raise APIError, answered in the OpenAI error shape."""

from __future__ import annotations

import asyncio
import json
import math
from typing import Any

from starlette.requests import Request

from pagellm.engine.sampling_params import MAX_N
from pagellm.gateway.limits import KeyPolicy
from pagellm.server.errors import APIError, body_timeout

PROMPT_MARGIN = 64
"""Tokens a chat template may add beyond the prompt's own bytes (role headers, BOS, a default
system line): an uncounted prompt has at most its UTF-8 bytes plus this many tokens."""


async def read_body(raw: Request, limit: int, timeout: float) -> bytes:
    """The request body, refused (413) as soon as it is known to be over ``limit`` bytes: by its
    Content-Length before reading, else while reading; 408 when it has not all come within
    ``timeout`` seconds (a client trickling it would hold a connection for ever). A client
    that leaves raises starlette's ClientDisconnect."""
    declared = raw.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise _too_large(limit)
    parts, size = [], 0
    try:
        async with asyncio.timeout(timeout):
            async for part in raw.stream():
                size += len(part)
                if size > limit:
                    raise _too_large(limit)
                parts.append(part)
    except TimeoutError:
        raise body_timeout(timeout) from None
    return b"".join(parts)


def _too_large(limit: int) -> APIError:
    return APIError(413, f"the request body is over {limit} bytes")


def parse(content: bytes) -> dict[str, Any]:
    try:
        body = json.loads(content)
    except (ValueError, RecursionError) as exc:
        raise APIError(400, "the request body is not valid JSON") from exc
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    return body


def check_fields(body: dict[str, Any]) -> None:
    """The fields the gateway itself reads: a string model, integer max_tokens and
    max_completion_tokens of at least 1, an integer n from 1 to MAX_N (each may be absent)."""
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise APIError(400, "'model' must be a string", param="model")
    _check_count(body, "max_tokens", None)
    _check_count(body, "max_completion_tokens", None)
    _check_count(body, "n", MAX_N)


def drop_unread_fields(body: dict[str, Any], path: str) -> bool:
    """Drop max_completion_tokens from a /v1/completions body: a chat field, which the
    completions endpoint (pagellm's and vLLM's) does not read, so that the key's charge, the
    pre-check and the overload cap read max_tokens, as the replica will (a key charged for
    max_completion_tokens 1 was served max_tokens 400). True if the body changed."""
    if path != "/v1/completions" or "max_completion_tokens" not in body:
        return False
    del body["max_completion_tokens"]
    return True


def _check_count(body: dict[str, Any], name: str, most: int | None) -> None:
    value = body.get(name)
    if value is None:
        return
    wrong = isinstance(value, bool) or not isinstance(value, int) or value < 1
    if wrong or (most is not None and value > most):
        span = f"from 1 to {most}" if most is not None else "of at least 1"
        raise APIError(400, f"'{name}' must be an integer {span}", param=name)


def apply_policy(body: dict[str, Any], policy: KeyPolicy) -> dict[str, Any]:
    """The body to forward for this key: the client's priority and user only where the key
    allows them, else the key's own (or none)."""
    out = dict(body)
    for name, allowed, own in (
        ("priority", policy.allow_client_priority, policy.priority),
        ("user", policy.allow_client_user, policy.tenant),
    ):
        if not (allowed and out.get(name) is not None):
            out.pop(name, None)
            if own is not None and own != "":
                out[name] = own
    return out


def prompts(body: dict[str, Any]) -> list[Any]:
    """The request's prompts: the messages of a chat, the prompt (or each of a list of
    prompts) of a completion."""
    if "messages" in body:
        return [body["messages"]]
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        return prompt
    return [prompt]


def prompt_bound(prompt: Any) -> int:
    """At most this many tokens, for any byte-level tokenizer and chat template: token ids as
    given, or the prompt's UTF-8 bytes (as JSON) plus PROMPT_MARGIN."""
    if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        return len(prompt)
    # surrogatepass: a lone surrogate (JSON escapes allow one) still has a length; the replica
    # refuses such text with a 400
    text = json.dumps(prompt, ensure_ascii=False)
    return len(text.encode("utf-8", "surrogatepass")) + PROMPT_MARGIN


def completion_cap(default: int, longest_prompt: int, max_model_len: int | None) -> int | None:
    """max_tokens for a request that gives none: ``default``, lowered to the room the context
    leaves after the longest prompt; None when not even one token surely fits."""
    if max_model_len is None:
        return default
    room = max_model_len - longest_prompt
    return min(default, room) if room >= 1 else None


def estimate_tokens(body: dict[str, Any], most: int, lengths: list[int] | None = None) -> int:
    """Prompt tokens (``lengths`` when counted, else ~4 characters a token) plus ``most`` for
    each sequence the request asks for (n per prompt)."""
    if lengths is not None:
        prompt = sum(lengths)
    else:
        prompt = math.ceil(len(json.dumps(body.get("messages") or body.get("prompt") or "")) / 4)
    return prompt + most * len(prompts(body)) * (body.get("n") or 1)


def charge_for(
    body: dict[str, Any],
    policy: KeyPolicy,
    lengths: list[int] | None,
    max_model_len: int | None,
) -> int:
    """Tokens to charge ``policy`` for ``body`` before it runs (0 without a tokens-per-minute
    limit). A request that gives no max_tokens gets one set in ``body`` (see
    KeyPolicy.max_tokens_default), so that the charge bounds what it may generate."""
    if "tokens" not in policy.buckets:
        return 0
    most = body.get("max_completion_tokens") or body.get("max_tokens")
    if most is None:
        bounds = lengths if lengths is not None else [prompt_bound(p) for p in prompts(body)]
        most = completion_cap(policy.max_tokens_default, max(bounds, default=0), max_model_len)
        if most is not None:
            body["max_tokens"] = most
        else:  # the replica bounds each sequence, prompt included, by its context
            most = max_model_len
    return estimate_tokens(body, most, lengths)


def ask_usage(body: dict[str, Any]) -> bool:
    """Have a stream end with its usage event (stream_options.include_usage) so that its tokens
    can be settled; True when the client had not asked for it (the event is then kept from it)."""
    options = body.get("stream_options")
    options = {} if options is None else options
    if not isinstance(options, dict) or options.get("include_usage"):
        return False
    body["stream_options"] = {**options, "include_usage": True}
    return True
