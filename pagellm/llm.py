"""Offline batch inference: ``LLM(model=...).generate(prompts, params)`` and ``.chat``."""

from __future__ import annotations

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
        self._compile_grammars(params_list)
        ids = []
        for i, (prompt, p) in enumerate(zip(prompt_list, params_list, strict=True)):
            rid = str(self._counter)
            self._counter += 1
            self.engine.add_request(rid, prompt, p, priority=priority[i] if priority else 0)
            ids.append(rid)
        return self._run(ids, use_tqdm)

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Render each conversation with the model's chat template and generate a reply."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
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


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    if prompts and isinstance(prompts[0], int):
        return [list(prompts)]  # a single prompt given as token ids
    return list(prompts)


def _as_params_list(
    params: SamplingParams | Sequence[SamplingParams] | None, count: int
) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams() for _ in range(count)]
    if isinstance(params, SamplingParams):
        return [params] * count
    if len(params) != count:
        raise ValueError(f"got {len(params)} sampling params for {count} prompts")
    return list(params)


def _progress(total: int) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, desc="Generating", unit="req", dynamic_ncols=True)
