"""The Llama-family decoder: Llama 2/3 (SmolLM2, Mistral), Qwen2 (qkv bias), Qwen3 (q/k norm).

Q/K/V and gate/up projections are fused; ``load_weights`` maps Hugging Face names onto them.
The forward works on a flattened batch: ``input_ids`` and ``positions`` are 1-D over all tokens.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagellm.layers.linear import Linear, pack_linears
from pagellm.layers.norm import RMSNorm
from pagellm.layers.rotary import RotaryEmbedding, inverse_frequencies
from pagellm.models.arch import ModelArch


class Attention(nn.Module):
    def __init__(self, arch: ModelArch, backend: Any, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (
            arch.num_heads,
            arch.num_kv_heads,
            arch.head_dim,
        )
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = Linear(arch.hidden_size, self.q_size + 2 * self.kv_size, arch.qkv_bias)
        self.o_proj = Linear(self.q_size, arch.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.head_dim, arch.rms_norm_eps) if arch.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, arch.rms_norm_eps) if arch.qk_norm else None
        self.rotary = rotary
        self.backend = backend

    def forward(self, x: torch.Tensor, positions: torch.Tensor, cache: Any, meta: Any):
        qkv = self.qkv_proj(x)
        tokens = qkv.shape[0]
        qk, v = qkv.split([self.q_size + self.kv_size, self.kv_size], dim=-1)
        qk = qk.reshape(tokens, self.num_heads + self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
            qk = torch.cat((self.q_norm(q), self.k_norm(k)), dim=1)
        q, k = self.rotary(positions, qk).split([self.num_heads, self.num_kv_heads], dim=1)
        v = v.reshape(tokens, self.num_kv_heads, self.head_dim)
        return self.o_proj(self.backend.forward(cache, q, k, v, meta))


class MLP(nn.Module):
    def __init__(self, arch: ModelArch) -> None:
        super().__init__()
        self.intermediate = arch.intermediate_size
        self.gate_up_proj = Linear(arch.hidden_size, 2 * arch.intermediate_size, bias=False)
        self.down_proj = Linear(arch.intermediate_size, arch.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, arch: ModelArch, backend: Any, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.self_attn = Attention(arch, backend, rotary)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.mlp = MLP(arch)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, cache: Any, meta: Any):
        x = x + self.self_attn(self.input_layernorm(x), positions, cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


# HF parameter name fragment -> (our fused parameter, shard index)
_STACKED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


class LlamaForCausalLM(nn.Module):
    def __init__(self, arch: ModelArch, backend: Any, rope_freq_factors: Any = None) -> None:
        super().__init__()
        self.arch = arch
        self._rope_freq_factors = rope_freq_factors
        rotary = self._make_rotary()
        self.embed_tokens = nn.Embedding(arch.vocab_size, arch.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(arch, backend, rotary) for _ in range(arch.num_layers)
        )
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.lm_head = Linear(arch.hidden_size, arch.vocab_size, bias=False)
        if arch.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def _make_rotary(self) -> RotaryEmbedding:
        """Rotary tables are computed (float32, CPU), never loaded; also under a meta device."""
        a = self.arch
        with torch.device("cpu"):
            inv_freq = inverse_frequencies(
                a.head_dim, a.rope_theta, a.rope_scaling, self._rope_freq_factors
            )
            return RotaryEmbedding(a.head_dim, a.max_position_embeddings, inv_freq)

    def finish_loading(self) -> None:
        """After ``to_empty`` + ``load_weights``: recompute float32 rotary tables, re-tie."""
        rotary = self._make_rotary()
        for layer in self.layers:
            layer.self_attn.rotary = rotary
        if self.arch.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        pack_linears(self)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, caches: list[Any], meta: Any
    ) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        for layer, cache in zip(self.layers, caches, strict=True):
            x = layer(x, positions, cache, meta)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits in the model's dtype; the sampler widens them only where it needs to."""
        return self.lm_head(hidden)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy Hugging Face-named tensors in; raises on unknown or missing parameters."""
        params = dict(self.named_parameters(remove_duplicate=False))
        loaded: set[str] = set()
        for hf_name, tensor in weights:
            name = hf_name.removeprefix("model.")
            if "rotary_emb.inv_freq" in name:
                continue
            if name == "lm_head.weight" and self.arch.tie_word_embeddings:
                continue
            target, shard = _target(name)
            if target not in params:
                raise ValueError(f"checkpoint has an unexpected tensor {hf_name!r}")
            _copy_into(params[target], tensor, shard, self._shard_sizes(target))
            loaded.add(target if shard is None else f"{target}#{shard}")
        self._check_complete(params, loaded)

    def _shard_sizes(self, target: str) -> list[int]:
        a = self.arch
        if "qkv_proj" in target:
            q, kv = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
            return [q, kv, kv]
        return [a.intermediate_size, a.intermediate_size]

    def _check_complete(self, params: dict[str, nn.Parameter], loaded: set[str]) -> None:
        missing = []
        for name in params:
            if name == "lm_head.weight" and self.arch.tie_word_embeddings:
                continue
            fused = "qkv_proj" in name or "gate_up_proj" in name
            shards = range(3 if "qkv_proj" in name else 2) if fused else [None]
            for shard in shards:
                key = name if shard is None else f"{name}#{shard}"
                if key not in loaded:
                    missing.append(key)
        if missing:
            raise ValueError(f"checkpoint is missing tensors: {missing[:5]}")


def _target(name: str) -> tuple[str, int | None]:
    for part, (fused, shard) in _STACKED.items():
        if f".{part}." in name:
            return name.replace(f".{part}.", f".{fused}."), shard
    return name, None


def _copy_into(param: nn.Parameter, tensor: torch.Tensor, shard: int | None, sizes: list[int]):
    dst = param.data
    if shard is not None:
        offset = sum(sizes[:shard])
        dst = dst.narrow(0, offset, sizes[shard])
    if tuple(dst.shape) != tuple(tensor.shape):
        raise ValueError(f"shape mismatch: checkpoint {tuple(tensor.shape)} vs {tuple(dst.shape)}")
    dst.copy_(tensor)


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Qwen2/2.5 and DeepSeek-R1-Distill-Qwen: Llama with a bias on q/k/v."""


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Qwen3: Llama with per-head RMSNorm on q and k before rotary."""
