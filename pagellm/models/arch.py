"""A model's shape, read once from a Hugging Face ``config.json`` dict."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class ModelArch:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    bos_token_id: int | None
    eos_token_id: int | None

    def attention_crossover(self) -> float:
        """The context length at which one token's attention (QK and PV over every head) costs
        as many FLOPs as its linear layers: the scheduler's exchange rate for prefill chunks."""
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        linear = self.hidden_size * (2 * q + 2 * kv) + 3 * self.hidden_size * self.intermediate_size
        return linear / (2 * q)

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> ModelArch:
        archs = cfg.get("architectures") or []
        if not archs:
            raise ValueError("config.json names no architecture ('architectures' is missing)")
        arch = archs[0]
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        eos = cfg.get("eos_token_id")
        rope_params = cfg.get("rope_parameters") or {}
        return cls(
            architecture=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(cfg.get("rope_theta", rope_params.get("rope_theta", 10000.0))),
            rope_scaling=cfg.get("rope_scaling") or _scaling_from_params(rope_params),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=bool(cfg.get("attention_bias", arch == "Qwen2ForCausalLM")),
            qk_norm=arch == "Qwen3ForCausalLM",
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_id=eos[0] if isinstance(eos, list) else eos,
        )


def _scaling_from_params(params: dict[str, Any]) -> dict[str, Any] | None:
    kind = params.get("rope_type")
    return params if kind not in (None, "default") else None
