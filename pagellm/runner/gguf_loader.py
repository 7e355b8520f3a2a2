"""Read a GGUF file into a Hugging Face-style config dict and HF-named tensors.

Tensors the quantization plan keeps quantized (Q8_0, Q4_0, Q4_1) come out as
``QuantizedWeight``; the others are dequantized at load with the ``gguf`` package.
llama.cpp stores Q/K projections of llama models with rows permuted for its rotary layout; they
are permuted back so that the weights match the Hugging Face checkpoint they came from.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pagellm.quant.formats import QuantizedWeight
from pagellm.quant.gguf_blocks import from_blocks

_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}

_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


class GGUFModel:
    """An opened GGUF file: ``config`` (HF-style dict) and ``tensors()`` in HF naming."""

    def __init__(self, path: str | Path) -> None:
        import gguf

        self.path = Path(path)
        try:
            with open(self.path, "rb") as f:
                magic = f.read(4)
        except OSError as exc:
            raise ValueError(f"{self.path} cannot be read: {exc.strerror}") from exc
        if magic != b"GGUF":
            raise ValueError(f"{self.path} is not a GGUF file (it does not begin with 'GGUF')")
        try:
            self.reader = gguf.GGUFReader(str(self.path))
        except Exception as exc:  # the gguf package raises several types on bad files
            raise ValueError(
                f"{self.path} is a damaged or cut-short GGUF file "
                f"({self.path.stat().st_size} bytes; the gguf reader: {exc})"
            ) from exc
        self.arch = self._field("general.architecture")
        if self.arch not in _ARCHITECTURES:
            raise ValueError(f"unsupported GGUF architecture {self.arch!r} in {self.path}")
        self.config = self._hf_config()

    def _field(self, key: str, default: Any = None) -> Any:
        field = self.reader.fields.get(key)
        if field is None:
            return default
        return field.contents()

    def _hf_config(self) -> dict[str, Any]:
        a = self.arch
        names = {t.name for t in self.reader.tensors}
        heads = int(self._field(f"{a}.attention.head_count"))
        hidden = int(self._field(f"{a}.embedding_length"))
        tokens = self._field("tokenizer.ggml.tokens")
        vocab = self._field(f"{a}.vocab_size") or (len(tokens) if tokens else None)
        head_dim = self._field(f"{a}.attention.key_length") or hidden // heads
        return {
            "architectures": [_ARCHITECTURES[a]],
            "vocab_size": int(vocab),
            "hidden_size": hidden,
            "intermediate_size": int(self._field(f"{a}.feed_forward_length")),
            "num_hidden_layers": int(self._field(f"{a}.block_count")),
            "num_attention_heads": heads,
            "num_key_value_heads": int(self._field(f"{a}.attention.head_count_kv", heads)),
            "head_dim": int(head_dim),
            "rms_norm_eps": float(self._field(f"{a}.attention.layer_norm_rms_epsilon", 1e-6)),
            "rope_theta": float(self._field(f"{a}.rope.freq_base", 10000.0)),
            "max_position_embeddings": int(self._field(f"{a}.context_length", 4096)),
            "tie_word_embeddings": "output.weight" not in names,
            "attention_bias": "blk.0.attn_q.bias" in names,
            "bos_token_id": self._field("tokenizer.ggml.bos_token_id"),
            "eos_token_id": self._field("tokenizer.ggml.eos_token_id"),
        }

    def rope_freq_factors(self) -> torch.Tensor | None:
        for t in self.reader.tensors:
            if t.name == "rope_freqs.weight":
                return torch.from_numpy(np.array(t.data, dtype=np.float32).reshape(-1))
        return None

    def tensor_types(self) -> dict[str, str]:
        """HF tensor name -> GGUF type name (``Q4_1``, ``F32``, ...)."""
        return {
            name: t.tensor_type.name
            for t in self.reader.tensors
            if (name := _hf_name(t.name)) is not None
        }

    def tensors(
        self, kept: set[str] | frozenset[str] = frozenset()
    ) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
        """Every tensor in HF naming: those named in ``kept`` as stored, the rest in float32."""
        import gguf

        heads = self.config["num_attention_heads"]
        kv_heads = self.config["num_key_value_heads"]
        for t in self.reader.tensors:
            if t.name == "rope_freqs.weight":
                continue
            hf_name = _hf_name(t.name)
            if hf_name is None:
                raise ValueError(f"unexpected tensor {t.name!r} in {self.path}")
            shape = tuple(int(d) for d in reversed(t.shape))
            if hf_name in kept:
                tensor = from_blocks(t.data, t.tensor_type.name, shape[0], shape[1])
            else:
                data = gguf.quants.dequantize(t.data, t.tensor_type)
                tensor = torch.from_numpy(np.array(data, dtype=np.float32)).reshape(shape)
            if self.arch == "llama" and t.name.endswith("attn_q.weight"):
                tensor = _unpermute_rows(tensor, heads)
            elif self.arch == "llama" and t.name.endswith("attn_k.weight"):
                tensor = _unpermute_rows(tensor, kv_heads)
            yield hf_name, tensor


def _hf_name(name: str) -> str | None:
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    parts = name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{parts[3]}"
    return None


def _unpermute_rows(
    weight: torch.Tensor | QuantizedWeight, n_heads: int
) -> torch.Tensor | QuantizedWeight:
    """``_unpermute`` on a float tensor, or on every per-row tensor of a quantized one."""
    if isinstance(weight, torch.Tensor):
        return _unpermute(weight, n_heads)
    parts = (None if t is None else _unpermute(t, n_heads).contiguous() for t in weight._tensors())
    return QuantizedWeight(weight.fmt, *parts)


def _unpermute(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's interleaving of each head's rotary halves (rows of Q/K)."""
    rows = weight.shape[0]
    rest = weight.shape[1:]
    return (
        weight.reshape(n_heads, rows // n_heads // 2, 2, *rest)
        .transpose(1, 2)
        .reshape(weight.shape)
    )
