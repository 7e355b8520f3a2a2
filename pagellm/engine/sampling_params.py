"""Validated sampling parameters of one request (what to generate and when to stop).

Everything a client can set is bounded here (ranges, finiteness, list sizes), so a value that
passes never makes sampling raise; what depends on the model (the vocabulary) is checked by the
engine (``LLMEngine.check_params``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from pagellm.structured.params import StructuredOutputsParams

SEED_MIN, SEED_MAX = -(1 << 63), (1 << 63) - 1
"""Seeds are 64-bit signed integers, as vLLM takes them."""
MAX_N = 128
MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 32
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 1024
LOGIT_BIAS_RANGE = 100.0
"""OpenAI's range for a logit bias value."""


@dataclass(slots=True)
class SamplingParams:
    """How to sample the next tokens of one request; ``validate`` raises ParamError on bad values.

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
    logit_bias: dict[int, float] | None = None
    """Token id -> value added to its logit before sampling (OpenAI's ``logit_bias``)."""
    allowed_token_ids: list[int] | None = None
    """When given, only these tokens may be sampled (vLLM's extension)."""
    structured_outputs: StructuredOutputsParams | None = None
    """Constrain the output to a JSON schema, regex, choice or grammar (vLLM's field)."""

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.validate()

    def validate(self) -> None:
        _check_int(self.n, "n", 1, MAX_N)
        _check_finite(self, ("temperature", "top_p", "min_p", "repetition_penalty"))
        _check_finite(self, ("presence_penalty", "frequency_penalty"))
        _check(self.temperature >= 0.0, "temperature", "must be non-negative")
        _check(0.0 < self.top_p <= 1.0, "top_p", "must be in (0, 1]")
        _check_int(self.top_k, "top_k", -1, SEED_MAX)
        _check(self.top_k >= 0 or self.top_k == -1, "top_k", "must be 0/-1 (off) or positive")
        _check(0.0 <= self.min_p <= 1.0, "min_p", "must be in [0, 1]")
        _check(-2.0 <= self.presence_penalty <= 2.0, "presence_penalty", "must be in [-2, 2]")
        _check(-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty", "must be in [-2, 2]")
        _check(self.repetition_penalty > 0.0, "repetition_penalty", "must be positive")
        if self.seed is not None:
            _check_int(self.seed, "seed", SEED_MIN, SEED_MAX)
        if self.max_tokens is not None:
            _check_int(self.max_tokens, "max_tokens", 1, SEED_MAX)
        _check_int(self.min_tokens, "min_tokens", 0, SEED_MAX)
        _check(
            self.max_tokens is None or self.min_tokens <= self.max_tokens,
            "min_tokens",
            "must not exceed max_tokens",
        )
        if self.logprobs is not None:
            _check_int(self.logprobs, "logprobs", 0, MAX_LOGPROBS)
        _check(
            self.structured_outputs is None
            or isinstance(self.structured_outputs, StructuredOutputsParams),
            "structured_outputs",
            "must be a StructuredOutputsParams",
        )
        self._validate_stops()
        self._validate_token_choice()

    def _validate_stops(self) -> None:
        _check(len(self.stop) <= MAX_STOP_STRINGS, "stop", f"takes at most {MAX_STOP_STRINGS}")
        _check(all(isinstance(s, str) and s for s in self.stop), "stop", "must be non-empty text")
        longest = max((len(s) for s in self.stop), default=0)
        _check(
            longest <= MAX_STOP_STRING_CHARS,
            "stop",
            f"strings must be at most {MAX_STOP_STRING_CHARS} characters",
        )
        _check(
            len(self.stop_token_ids) <= MAX_STOP_TOKEN_IDS,
            "stop_token_ids",
            f"takes at most {MAX_STOP_TOKEN_IDS} ids",
        )
        _check_ids(self.stop_token_ids, "stop_token_ids")

    def _validate_token_choice(self) -> None:
        bias = self.logit_bias or {}
        _check_ids(list(bias), "logit_bias")
        _check(
            all(
                _is_number(b) and -LOGIT_BIAS_RANGE <= b <= LOGIT_BIAS_RANGE for b in bias.values()
            ),
            "logit_bias",
            f"values must be finite numbers in [-{LOGIT_BIAS_RANGE:g}, {LOGIT_BIAS_RANGE:g}]",
        )
        if self.allowed_token_ids is not None:
            _check(bool(self.allowed_token_ids), "allowed_token_ids", "must not be empty")
            _check_ids(self.allowed_token_ids, "allowed_token_ids")

    def check_vocab(self, vocab_size: int) -> None:
        """Token ids and top_k against the model's vocabulary; raises ParamError. Linear in
        the lists with builtins only: it runs for every request, in the engine thread too."""
        _check(self.top_k <= vocab_size, "top_k", f"must be at most the vocabulary ({vocab_size})")
        _check(
            len(self.allowed_token_ids or ()) <= vocab_size,
            "allowed_token_ids",
            "must not be longer than the vocabulary",
        )
        for name, ids in (
            ("stop_token_ids", self.stop_token_ids),
            ("logit_bias", self.logit_bias or ()),
            ("allowed_token_ids", self.allowed_token_ids or ()),
        ):
            _check(
                max(ids, default=-1) < vocab_size, name, f"token ids must be in [0, {vocab_size})"
            )

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

    @property
    def shapes_logits(self) -> bool:
        """Whether the logits are changed before choosing (bias, allowed tokens, a grammar)."""
        return (
            bool(self.logit_bias)
            or self.allowed_token_ids is not None
            or self.structured_outputs is not None
        )


class ParamError(ValueError):
    """A sampling parameter is out of range; ``param`` names it (used for OpenAI errors)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param} {message}")
        self.param = param


def _check(ok: bool, param: str, message: str) -> None:
    if not ok:
        raise ParamError(param, message)


def _check_int(value: object, param: str, low: int, high: int) -> None:
    _check(isinstance(value, int) and not isinstance(value, bool), param, "must be an integer")
    _check(low <= value <= high, param, f"must be in [{low}, {high}]")


def _is_number(value: object) -> bool:
    return type(value) in (int, float) and math.isfinite(value)


def _check_ids(ids: list, param: str) -> None:
    """Token ids: integers (not bools) in [0, 2**63), checked with builtins (lists can be as
    long as the vocabulary)."""
    _check(all(type(t) is int for t in ids), param, "must be integers")
    _check(not ids or (min(ids) >= 0 and max(ids) <= SEED_MAX), param, "must be in [0, 2**63)")


def _check_finite(params: SamplingParams, names: tuple[str, ...]) -> None:
    for name in names:
        value = getattr(params, name)
        _check(isinstance(value, int | float), name, "must be a number")
        _check(math.isfinite(value), name, "must be a finite number")
