"""Validated sampling parameters of one request (what to generate and when to stop)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class SamplingParams:
    """How to sample the next tokens of one request; ``validate`` raises ValueError on bad values.

    temperature == 0 means greedy. ``n`` independent completions share the prompt's KV blocks.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.validate()

    def validate(self) -> None:
        _check(self.n >= 1, "n", "must be at least 1")
        _check(self.temperature >= 0.0, "temperature", "must be non-negative")
        _check(0.0 < self.top_p <= 1.0, "top_p", "must be in (0, 1]")
        _check(self.top_k >= 0 or self.top_k == -1, "top_k", "must be 0/-1 (off) or positive")
        _check(0.0 <= self.min_p <= 1.0, "min_p", "must be in [0, 1]")
        _check(-2.0 <= self.presence_penalty <= 2.0, "presence_penalty", "must be in [-2, 2]")
        _check(-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty", "must be in [-2, 2]")
        _check(self.repetition_penalty > 0.0, "repetition_penalty", "must be positive")
        _check(self.max_tokens is None or self.max_tokens >= 1, "max_tokens", "must be at least 1")
        _check(self.min_tokens >= 0, "min_tokens", "must be non-negative")
        _check(
            self.max_tokens is None or self.min_tokens <= self.max_tokens,
            "min_tokens",
            "must not exceed max_tokens",
        )
        _check(self.logprobs is None or self.logprobs >= 0, "logprobs", "must be non-negative")
        _check(all(s for s in self.stop), "stop", "must not contain empty strings")
        _check(all(t >= 0 for t in self.stop_token_ids), "stop_token_ids", "must be >= 0")

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    @property
    def needs_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )


class ParamError(ValueError):
    """A sampling parameter is out of range; ``param`` names it (used for OpenAI errors)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param} {message}")
        self.param = param


def _check(ok: bool, param: str, message: str) -> None:
    if not ok:
        raise ParamError(param, message)
