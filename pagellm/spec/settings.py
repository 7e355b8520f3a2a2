"""Reads vLLM's speculative-decoding flags into one checked ``SpecSettings``.

``--speculative-config`` (a JSON object, or the mapping itself from a YAML file or ``LLM(...)``)
is vLLM's current form; the older ``--speculative-model``, ``--num-speculative-tokens``,
``--speculative-max-model-len`` and ``--speculative-disable-by-batch-size`` map onto the same
keys (a key given both ways must agree). Bad settings raise ValueError naming the key.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pagellm.config import SpeculativeConfig, json_object_flag

NGRAM_MODEL_NAMES = ("ngram", "[ngram]")
METHODS = ("ngram", "draft_model")
MAX_SPECULATIVE_TOKENS = 16
DEFAULT_DISABLE_BY_BATCH_SIZE = 8
"""Above this many running sequences a step makes no proposals: measured with n-gram k=4 on
ShareGPT, speculation gave 1.24x at 4 streams and 1.30x at 8, 0.60x at 16 (README)."""

_KEYS = (
    "method", "model", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max",
    "disable_by_batch_size", "max_model_len", "quantization", "draft_tensor_parallel_size",
)  # fmt: skip
_LEGACY = {
    "speculative_model": "model",
    "num_speculative_tokens": "num_speculative_tokens",
    "speculative_max_model_len": "max_model_len",
    "speculative_disable_by_batch_size": "disable_by_batch_size",
}


@dataclass(frozen=True, slots=True)
class SpecSettings:
    """How tokens are proposed: method ``ngram`` (prompt lookup, in the scheduler) or
    ``draft_model`` (``model``, a smaller model with the target's vocabulary, in the runner)."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int
    prompt_lookup_max: int
    disable_by_batch_size: int
    """No proposals in a step with more running sequences than this."""
    max_model_len: int | None = None
    """No proposals that would take a sequence past this length."""
    model: str | None = None
    """draft_model: HF directory or .gguf file of the draft."""
    quantization: str | None = None
    """draft_model: how the draft's weights are kept (as --quantization)."""


def spec_settings(config: SpeculativeConfig) -> SpecSettings | None:
    """The checked settings, or None when speculative decoding is off."""
    raw = _raw_mapping(config.speculative_config)
    for flag, key in _LEGACY.items():
        value = getattr(config, flag)
        if value is None:
            continue
        if key in raw and raw[key] != value:
            raise ValueError(
                f"--{flag.replace('_', '-')}={value!r} disagrees with --speculative-config "
                f"{key}={raw[key]!r}"
            )
        raw[key] = value
    if not raw:
        return None
    return _settings(raw)


def _raw_mapping(value: str | dict | None) -> dict[str, Any]:
    return json_object_flag(value, "--speculative-config", _KEYS)


def _settings(raw: dict[str, Any]) -> SpecSettings:
    method = _method(raw.get("method"), raw.get("model"))
    k = _int(raw, "num_speculative_tokens", None, 1, MAX_SPECULATIVE_TOKENS)
    if k is None:
        raise ValueError("--speculative-config: num_speculative_tokens is required")
    if raw.get("draft_tensor_parallel_size") not in (None, 1):
        raise ValueError("--speculative-config: draft_tensor_parallel_size must be 1")
    lo = _int(raw, "prompt_lookup_min", None, 1, None)
    hi = _int(raw, "prompt_lookup_max", None, 1, None)
    # vLLM's defaults: both 5 when neither is given, else the one given for both
    lo, hi = (lo or hi or 5), (hi or lo or 5)
    if lo > hi:
        raise ValueError(
            f"--speculative-config: prompt_lookup_min ({lo}) > prompt_lookup_max ({hi})"
        )
    quantization = raw.get("quantization")
    if quantization is not None and method != "draft_model":
        raise ValueError("--speculative-config: quantization applies to a draft model only")
    model = raw.get("model")
    if method == "draft_model" and (not isinstance(model, str) or model in NGRAM_MODEL_NAMES):
        raise ValueError("--speculative-config: method draft_model needs model (a path)")
    disable = _int(raw, "disable_by_batch_size", DEFAULT_DISABLE_BY_BATCH_SIZE, 1, None)
    max_len = _int(raw, "max_model_len", None, 2, None)
    draft = method == "draft_model"
    return SpecSettings(method, k, lo, hi, disable, max_len, model if draft else None, quantization)


def _method(method: Any, model: Any) -> str:
    if method is None:
        if model is None:
            raise ValueError("--speculative-config needs a method (ngram) or a model ([ngram])")
        method = "ngram" if model in NGRAM_MODEL_NAMES else "draft_model"
    if method in NGRAM_MODEL_NAMES:
        return "ngram"
    if method == "draft_model":
        return method
    raise ValueError(
        f"--speculative-config: method {method!r} is not supported by pagellm "
        f"(one of {', '.join(METHODS)})"
    )


def _int(raw: dict[str, Any], key: str, default: int | None, lo: int, hi: int | None):
    value = raw.get(key, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"--speculative-config: {key} must be an integer, got {value!r}")
    if value < lo or (hi is not None and value > hi):
        bound = f"between {lo} and {hi}" if hi is not None else f"at least {lo}"
        raise ValueError(f"--speculative-config: {key} must be {bound}, got {value}")
    return value
