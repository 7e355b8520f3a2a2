"""The prompt-length pre-check: a request whose prompt plus ``max_tokens`` cannot fit the served
model's context is answered 400 at the gateway and never reaches a replica. Prompts are counted
with the model's own tokenizer and chat template (``--tokenizer MODEL=PATH``; the gateway counts
on a worker thread, off its event loop); the context length comes from the replicas'
``/v1/models`` cards (``max_model_len``, as pagellm and vLLM give it)."""

from __future__ import annotations

from typing import Any

from pagellm.engine.errors import ContextLengthExceeded


def load_tokenizers(specs: list[str]) -> dict[str, Any]:
    """``MODEL=PATH`` pairs -> tokenizers (HF directory or GGUF file, as ``--model`` takes)."""
    from pagellm.runner.loader import resolve_source
    from pagellm.runner.tokenizer import Tokenizer

    out = {}
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--tokenizer takes MODEL=PATH, got {spec!r}")
        out[name] = Tokenizer.load(resolve_source(path), None)
    return out


def prompt_lengths(tokenizer: Any, body: dict[str, Any]) -> list[int]:
    """Token counts of the request's prompts (one per prompt of a completions request)."""
    if "messages" in body:
        messages = [
            {"role": m.get("role"), "content": _text(m.get("content"))}
            for m in body["messages"]
            if isinstance(m, dict)
        ]
        return [len(tokenizer.chat_token_ids(messages))]
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return [len(tokenizer.encode(prompt))]
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
        return [len(prompt)]
    if isinstance(prompt, list):
        return [len(p) if isinstance(p, list) else len(tokenizer.encode(str(p))) for p in prompt]
    return []


def check_fits(lengths: list[int], body: dict[str, Any], max_model_len: int) -> None:
    """Raises ContextLengthExceeded (its message gives the counts) when a prompt of these
    ``lengths`` (``prompt_lengths``) cannot fit with the request's max_tokens."""
    wanted = body.get("max_completion_tokens") or body.get("max_tokens")
    wanted = int(wanted) if isinstance(wanted, int) else None
    for n in lengths:
        if n + (wanted or 0) > max_model_len or n >= max_model_len:
            raise ContextLengthExceeded(n, wanted, max_model_len)


def _text(content: Any) -> str:
    if isinstance(content, list):  # OpenAI content parts: the text ones
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return content or ""
