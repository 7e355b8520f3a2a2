"""Offline batch inference: ``LLM(model=...).generate(prompts, params)`` and ``.chat``."""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from typing import Any

from pagellm.config import EngineConfig
from pagellm.engine.outputs import EngineStats, RequestOutput
from pagellm.engine.sampling_params import SamplingParams
from pagellm.engine_factory import build_engine

Prompt = str | list[int]


class LLM:
    """Runs many prompts through the engine at once; keyword arguments are engine settings."""

    def __init__(self, model: str | None = None, **settings: Any) -> None:
        self.config = EngineConfig.from_flat(model=model, **settings)
        self.engine, self.tokenizer = build_engine(self.config)
        self._counter = 0

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Outputs in the order of ``prompts``; one params for all, or one per prompt."""
        prompt_list = _as_prompt_list(prompts)
        params_list = _as_params_list(params, len(prompt_list))
        if priority is not None and len(priority) != len(prompt_list):
            raise ValueError(f"got {len(priority)} priorities for {len(prompt_list)} prompts")
        for p in {id(p): p for p in params_list}.values():
            p.validate()  # again: its fields may have changed since it was made
        self._compile_grammars(params_list)
        ids: list[str] = []
        try:
            for i, (prompt, p) in enumerate(zip(prompt_list, params_list, strict=True)):
                rid = str(self._counter)
                self._counter += 1
                self.engine.add_request(rid, prompt, p, priority=priority[i] if priority else 0)
                ids.append(rid)
        except Exception:
            self.engine.abort_requests(ids)  # all or nothing: those queued before it go too
            raise
        return self._run(ids, use_tqdm)

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Render each conversation with the model's chat template and generate a reply."""
        if not isinstance(messages, list) or not messages:
            raise TypeError("messages must be a non-empty list of messages (or of conversations)")
        conversations = [messages] if isinstance(messages[0], dict) else messages
        for conv in conversations:
            _check_messages(conv)
        prompts = [self.tokenizer.chat_token_ids(conv) for conv in conversations]
        return self.generate(prompts, params, use_tqdm)

    def _compile_grammars(self, params_list: list[SamplingParams]) -> None:
        """Compile every structured-output constraint first (each once): one that does not
        compile raises StructuredOutputError before any request is queued."""
        structured = self.engine.structured
        constraints = {p.structured_outputs.key: p.structured_outputs for p in params_list
                       if p.structured_outputs is not None}  # fmt: skip
        if constraints and structured is None:
            raise ValueError("structured outputs are not available on this engine")
        for constraint in constraints.values():
            structured.compiler.compile_now(constraint)

    def get_stats(self) -> EngineStats:
        return self.engine.stats

    def shutdown(self) -> None:
        """Stop the worker processes of a tensor/pipeline-parallel engine (no-op otherwise)."""
        self.engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *_: object) -> None:
        self.shutdown()

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        done: dict[str, RequestOutput] = {}
        bar = _progress(len(ids)) if use_tqdm and len(ids) > 1 else None
        wanted = set(ids)
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if out.finished and out.request_id in wanted:
                    done[out.request_id] = out
                    if bar is not None:
                        bar.update(1)
        if bar is not None:
            bar.close()
        return [done[rid] for rid in ids]


def _check_messages(conversation: Any) -> None:
    """A conversation as the chat template expects it: a list of messages, each with a string
    role and string (or content-part list) content."""
    if not isinstance(conversation, list) or not conversation:
        raise TypeError("a conversation must be a non-empty list of messages")
    for i, message in enumerate(conversation):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise TypeError(f"message {i} must be a mapping with a string 'role'")
        content = message.get("content")
        if content is not None and not isinstance(content, str | list):
            raise TypeError(f"message {i}: 'content' must be a string or a list of parts")
        if content is None and not message.get("tool_calls"):
            raise ValueError(f"message {i} has no 'content'")


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    if not isinstance(prompts, list | tuple):
        raise TypeError(
            f"prompts must be a string, a list of token ids or a list of those, "
            f"got {type(prompts).__name__}"
        )
    if prompts and _is_token_id(prompts[0]):
        prompts = [list(prompts)]  # a single prompt given as token ids
    for prompt in prompts:
        if isinstance(prompt, str):
            continue
        if not isinstance(prompt, list | tuple) or not all(map(_is_token_id, prompt)):
            raise TypeError("each prompt must be a string or a list of integer token ids")
    return [p if isinstance(p, str) else [int(t) for t in p] for p in prompts]


def _is_token_id(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _as_params_list(
    params: SamplingParams | Sequence[SamplingParams] | None, count: int
) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams() for _ in range(count)]
    if isinstance(params, SamplingParams):
        return [params] * count
    if not isinstance(params, list | tuple) or not all(
        isinstance(p, SamplingParams) for p in params
    ):
        raise TypeError("params must be a SamplingParams or a list of them")
    if len(params) != count:
        raise ValueError(f"got {len(params)} sampling params for {count} prompts")
    return list(params)


def _progress(total: int) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, desc="Generating", unit="req", dynamic_ncols=True)
