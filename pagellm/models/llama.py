"""The Llama-family decoder: Llama 2/3 (SmolLM2, Mistral), Qwen2 (qkv bias), Qwen3 (q/k norm).

Q/K/V and gate/up projections are fused; ``load_weights`` maps Hugging Face names onto them.
The forward works on a flattened batch: ``input_ids`` and ``positions`` are 1-D over all tokens.

Under tensor parallelism each rank builds only its shard (``Collectives.layout`` says which):
Q/K/V and gate/up are split by columns (heads, MLP columns), o_proj and down_proj by rows with
an all-reduce after them, the embedding and LM head by vocabulary rows. Under pipeline
parallelism a rank builds only its stage's layers (plus the embedding on the first stage, the
final norm and LM head on the last). ``load_weights`` takes the full Hugging Face tensors and
keeps this rank's part.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagellm.layers.linear import Linear, pack_linears
from pagellm.layers.norm import RMSNorm
from pagellm.layers.quant_linear import QuantEmbedding, QuantLinear, QuantPart
from pagellm.layers.rotary import RotaryEmbedding, inverse_frequencies
from pagellm.models.arch import ModelArch
from pagellm.parallel.comm import Collectives
from pagellm.parallel.layout import Span
from pagellm.quant.plan import QuantPlan


class VocabParallelEmbedding(nn.Module):
    """An embedding holding this rank's vocabulary rows; tokens outside them give zeros, and
    the all-reduce over the TP group fills in every token."""

    def __init__(self, vocab_size: int, hidden_size: int, comm: Collectives) -> None:
        super().__init__()
        rows = comm.layout.vocab(vocab_size)
        self.start, self.count, self.comm = rows.start, rows.count, comm
        self.weight = nn.Parameter(torch.empty(rows.count, hidden_size))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.comm.tp is None:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.count)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.comm.all_reduce(out.masked_fill_(outside.unsqueeze(-1), 0))


def make_linear(
    in_features: int,
    shards: list[tuple[str, int]],
    bias: bool,
    quant: QuantPlan | None,
    full_in: int | None = None,
) -> nn.Module:
    """A plain ``Linear`` over the fused checkpoint tensors ``shards`` ((HF name, local rows)),
    or a ``QuantLinear`` where ``quant`` keeps any of them quantized. ``full_in``: the
    checkpoint's inputs when this rank holds a share of them (the form is the whole tensor's)."""
    sizes = [rows for _, rows in shards]
    whole = full_in or in_features
    formats = [quant.format_for(name, whole) if quant else None for name, _ in shards]
    if all(f is None for f in formats):
        return Linear(in_features, sum(sizes), bias)
    return QuantLinear(in_features, sizes, formats, bias)


class Attention(nn.Module):
    def __init__(
        self,
        arch: ModelArch,
        backend: Any,
        rotary: RotaryEmbedding,
        comm: Collectives,
        prefix: str = "model.layers.0.self_attn",
        quant: QuantPlan | None = None,
    ) -> None:
        super().__init__()
        self.comm = comm
        self.num_heads = comm.layout.split(arch.num_heads, "the number of attention heads").count
        self.num_kv_heads = comm.layout.kv_heads(arch.num_kv_heads).count
        self.head_dim = arch.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        qkv = [(f"{prefix}.{n}_proj.weight", size) for n, size in
               (("q", self.q_size), ("k", self.kv_size), ("v", self.kv_size))]  # fmt: skip
        self.qkv_proj = make_linear(arch.hidden_size, qkv, arch.qkv_bias, quant)
        o_name = f"{prefix}.o_proj.weight"
        full = arch.num_heads * arch.head_dim
        self.o_proj = make_linear(self.q_size, [(o_name, arch.hidden_size)], False, quant, full)
        self.q_norm = RMSNorm(self.head_dim, arch.rms_norm_eps) if arch.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, arch.rms_norm_eps) if arch.qk_norm else None
        self.rotary = rotary
        self.backend = backend
        self.kv_scales: tuple[float, float] | None = None
        """The checkpoint's (k_scale, v_scale) for an FP8 KV cache, when it has them."""

    def set_kv_scale(self, which: str, value: float) -> None:
        k_scale, v_scale = self.kv_scales or (1.0, 1.0)
        self.kv_scales = (value, v_scale) if which == "k" else (k_scale, value)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, cache: Any, meta: Any):
        qkv = self.qkv_proj(x)
        tokens = qkv.shape[0]
        fused = getattr(self.backend, "rotate_and_write", None)
        if fused is not None and self.q_norm is None:
            q = fused(cache, qkv, positions, self.rotary, meta)
            if q is not None:  # rotated, with k and v in the cache already
                out = self.backend.forward(cache, q, None, None, meta)
                return self.comm.all_reduce(self.o_proj(out))
        qk, v = qkv.split([self.q_size + self.kv_size, self.kv_size], dim=-1)
        qk = qk.reshape(tokens, self.num_heads + self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
            qk = torch.cat((self.q_norm(q), self.k_norm(k)), dim=1)
        q, k = self.rotary(positions, qk).split([self.num_heads, self.num_kv_heads], dim=1)
        v = v.reshape(tokens, self.num_kv_heads, self.head_dim)
        return self.comm.all_reduce(self.o_proj(self.backend.forward(cache, q, k, v, meta)))


class MLP(nn.Module):
    def __init__(
        self,
        arch: ModelArch,
        comm: Collectives,
        prefix: str = "model.layers.0.mlp",
        quant: QuantPlan | None = None,
    ) -> None:
        super().__init__()
        self.comm = comm
        self.intermediate = comm.layout.split(arch.intermediate_size, "intermediate_size").count
        gate_up = [(f"{prefix}.{n}_proj.weight", self.intermediate) for n in ("gate", "up")]
        self.gate_up_proj = make_linear(arch.hidden_size, gate_up, False, quant)
        down = [(f"{prefix}.down_proj.weight", arch.hidden_size)]
        full = arch.intermediate_size
        self.down_proj = make_linear(self.intermediate, down, False, quant, full)
        self.row_ops: Any = None
        """SiLU-and-multiply by a fused op (``pagellm.layers.row_ops``; on a CPU, and in
        batch-invariant mode)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.row_ops is not None:
            act = self.row_ops.silu_mul(gate_up, self.intermediate)
        else:
            gate, up = gate_up.split(self.intermediate, dim=-1)
            act = F.silu(gate) * up
        return self.comm.all_reduce(self.down_proj(act))


class DecoderLayer(nn.Module):
    def __init__(
        self,
        arch: ModelArch,
        backend: Any,
        rotary: RotaryEmbedding,
        comm: Collectives,
        index: int = 0,
        quant: QuantPlan | None = None,
    ) -> None:
        super().__init__()
        prefix = f"model.layers.{index}"
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.self_attn = Attention(arch, backend, rotary, comm, f"{prefix}.self_attn", quant)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.mlp = MLP(arch, comm, f"{prefix}.mlp", quant)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, cache: Any, meta: Any):
        x = x + self.self_attn(self.input_layernorm(x), positions, cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


_VOCAB_PARAMS = ("embed_tokens.weight", "lm_head.weight")

# HF parameter name fragment -> (our fused parameter, shard index)
_STACKED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


class LlamaForCausalLM(nn.Module):
    def __init__(
        self,
        arch: ModelArch,
        backend: Any,
        rope_freq_factors: Any = None,
        comm: Collectives | None = None,
        quant: QuantPlan | None = None,
    ) -> None:
        super().__init__()
        self.arch = arch
        self.quant = quant
        self.comm = comm or Collectives.single()
        layout = self.comm.layout
        self._rope_freq_factors = rope_freq_factors
        rotary = self._make_rotary()
        self.first_layer = layout.layers(arch.num_layers).start
        tied_here = arch.tie_word_embeddings and layout.is_last_stage
        self.embed_tokens = self._make_embedding() if layout.is_first_stage or tied_here else None
        self.layers = nn.ModuleList(
            DecoderLayer(arch, backend, rotary, self.comm, self.first_layer + i, quant)
            for i in range(layout.layers(arch.num_layers).count)
        )
        self.norm = self.lm_head = None
        if layout.is_last_stage:
            self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
            rows = layout.vocab(arch.vocab_size).count
            if not arch.tie_word_embeddings:
                head = [("lm_head.weight", rows)]
                self.lm_head = make_linear(arch.hidden_size, head, False, quant)
            elif isinstance(self.embed_tokens, QuantEmbedding):
                self.lm_head = QuantLinear.over(self.embed_tokens.part)
            else:
                self.lm_head = Linear(arch.hidden_size, rows, bias=False)
                self.lm_head.weight = self.embed_tokens.weight

    def _make_embedding(self) -> nn.Module:
        a, comm = self.arch, self.comm
        fmt = (
            self.quant.format_for("model.embed_tokens.weight", a.hidden_size)
            if self.quant
            else None
        )
        if fmt is None:
            return VocabParallelEmbedding(a.vocab_size, a.hidden_size, comm)
        rows = comm.layout.vocab(a.vocab_size)
        return QuantEmbedding(rows.count, a.hidden_size, fmt, rows.start, comm)

    def _make_rotary(self) -> RotaryEmbedding:
        """Rotary tables are computed (float32, CPU), never loaded; also under a meta device."""
        a = self.arch
        with torch.device("cpu"):
            inv_freq = inverse_frequencies(
                a.head_dim, a.rope_theta, a.rope_scaling, self._rope_freq_factors
            )
            return RotaryEmbedding(a.head_dim, a.max_position_embeddings, inv_freq)

    def finish_loading(self) -> None:
        """After ``to_empty`` + ``load_weights``: recompute float32 rotary tables, re-tie,
        zero the padding rows of a vocabulary split that does not divide evenly."""
        first = next(self.parameters())
        rotary = self._make_rotary().to(first.device)
        for layer in self.layers:
            layer.self_attn.rotary = rotary
        if isinstance(self.embed_tokens, QuantEmbedding):
            self.embed_tokens.out_dtype = first.dtype
        elif self.arch.tie_word_embeddings and self.lm_head is not None:
            self.lm_head.weight = self.embed_tokens.weight
        real = self._real_vocab_rows()
        for module in (self.embed_tokens, self.lm_head):
            if module is not None:
                _zero_rows_from(module, real)
        pack_linears(self)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        caches: list[Any],
        meta: Any,
        hidden: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """This stage's layers over the batch: from the token ids on the first stage, from the
        previous stage's ``hidden`` on the others; normed on the last stage."""
        x = self.embed_tokens(input_ids) if hidden is None else hidden
        for layer, cache in zip(self.layers, caches, strict=True):
            x = layer(x, positions, cache, meta)
        return self.norm(x) if self.norm is not None else x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits in the model's dtype over the whole vocabulary (the TP ranks' rows gathered);
        the sampler widens them only where it needs to."""
        logits = self.comm.all_gather(self.lm_head(hidden))
        return (
            logits
            if logits.shape[-1] == self.arch.vocab_size
            else logits[..., : self.arch.vocab_size]
        )

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy Hugging Face-named tensors in (this rank's part of each); raises on unknown or
        missing parameters."""
        params = self._load_targets()
        loaded: set[str] = set()
        for hf_name, tensor in weights:
            name = self._local_name(hf_name.removeprefix("model."))
            if name is None or self._load_kv_scale(name, tensor):
                continue
            target, shard = _target(name)
            if target not in params:
                raise ValueError(f"checkpoint has an unexpected tensor {hf_name!r}")
            if isinstance(params[target], QuantLinear) and isinstance(tensor, torch.Tensor):
                tensor = params[target].quantize_shard(shard, tensor)
            part = self._rank_part(target, shard, tensor)
            rows = self._real_vocab_rows() if target in _VOCAB_PARAMS else None
            _copy_into(params[target], part, shard, self._shard_sizes(target), rows)
            loaded.add(target if shard is None else f"{target}#{shard}")
        self._check_complete(params, loaded)

    def _load_kv_scale(self, name: str, tensor: Any) -> bool:
        """Whether ``name`` is an attention layer's KV-cache scale (kept for an FP8 cache; a
        per-head vector gives its largest value) or its query / probability scale (not used:
        queries and probabilities stay in the compute dtype)."""
        for suffix, which in _ATTENTION_SCALES.items():
            if name.endswith(suffix):
                if which is not None:
                    index = int(name.split(".")[1])
                    self.layers[index].self_attn.set_kv_scale(which, float(tensor.float().max()))
                return True
        return False

    def _load_targets(self) -> dict[str, Any]:
        """Checkpoint-named targets: parameters, and the quantized layers (``x.weight`` names
        the layer, which loads its own parts)."""
        quant = {
            n: m for n, m in self.named_modules() if isinstance(m, QuantLinear | QuantEmbedding)
        }
        targets: dict[str, Any] = {}
        for name, param in self.named_parameters(remove_duplicate=False):
            owner = next((n for n in quant if name.startswith(f"{n}.")), None)
            if owner is None or name == f"{owner}.bias":
                targets[name] = param
        for name, module in quant.items():
            targets[f"{name}.weight"] = module
        return targets

    def _local_name(self, name: str) -> str | None:
        """The parameter name on this rank, or None for a tensor this rank does not hold."""
        if "rotary_emb.inv_freq" in name:
            return None
        if name == "lm_head.weight" and self.arch.tie_word_embeddings:
            return None
        if name.startswith("layers."):
            index, rest = name[len("layers.") :].split(".", 1)
            local = int(index) - self.first_layer
            return f"layers.{local}.{rest}" if 0 <= local < len(self.layers) else None
        if name.startswith("embed_tokens.") and self.embed_tokens is None:
            return None
        if name.startswith(("norm.", "lm_head.")) and self.norm is None:
            return None
        return name

    def _rank_part(self, target: str, shard: int | None, tensor: torch.Tensor) -> torch.Tensor:
        """This TP rank's slice of a full checkpoint tensor."""
        layout, a = self.comm.layout, self.arch
        if layout.tp_size == 1:
            return tensor
        heads, cols = self._heads(), layout.split(a.intermediate_size, "intermediate_size")
        if "qkv_proj" in target:
            span = heads if shard == 0 else layout.kv_heads(a.num_kv_heads)
            return tensor.narrow(0, span.start * a.head_dim, span.count * a.head_dim)
        if "gate_up_proj" in target:
            return tensor.narrow(0, cols.start, cols.count)
        if target.endswith("o_proj.weight"):
            return tensor.narrow(1, heads.start * a.head_dim, heads.count * a.head_dim)
        if target.endswith("down_proj.weight"):
            return tensor.narrow(1, cols.start, cols.count)
        if target in _VOCAB_PARAMS:
            return tensor.narrow(0, layout.vocab(a.vocab_size).start, self._real_vocab_rows())
        return tensor

    def _real_vocab_rows(self) -> int:
        """Rows of this rank's vocabulary shard that are real tokens (the rest is padding)."""
        rows = self.comm.layout.vocab(self.arch.vocab_size)
        return max(0, min(rows.stop, self.arch.vocab_size) - rows.start)

    def _heads(self) -> Span:
        return self.comm.layout.split(self.arch.num_heads, "the number of attention heads")

    def _shard_sizes(self, target: str) -> list[int]:
        a, layout = self.arch, self.comm.layout
        if "qkv_proj" in target:
            q = self._heads().count * a.head_dim
            kv = layout.kv_heads(a.num_kv_heads).count * a.head_dim
            return [q, kv, kv]
        inter = layout.split(a.intermediate_size, "intermediate_size").count
        return [inter, inter]

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


_ATTENTION_SCALES = {
    ".self_attn.k_scale": "k",
    ".self_attn.v_scale": "v",
    ".self_attn.k_proj.output_scale": "k",
    ".self_attn.v_proj.output_scale": "v",
    ".self_attn.q_scale": None,
    ".self_attn.prob_scale": None,
}
"""Checkpoint scales of an attention layer: llm-compressor's ``kv_cache_scheme`` writes
``self_attn.k_scale`` / ``v_scale`` (older versions ``k_proj.output_scale``)."""


def _target(name: str) -> tuple[str, int | None]:
    for part, (fused, shard) in _STACKED.items():
        if f".{part}." in name:
            return name.replace(f".{part}.", f".{fused}."), shard
    return name, None


def _zero_rows_from(module: nn.Module, start: int) -> None:
    """Rows of a vocabulary shard from ``start`` (padding) give zeros."""
    part = module.part if isinstance(module, QuantEmbedding) else module
    if isinstance(part, QuantLinear):
        part = part.parts[0]
    with torch.no_grad():
        if isinstance(part, QuantPart):
            part.zero_rows(start)
        elif start < part.weight.shape[0]:
            part.weight[start:].zero_()


def _copy_into(
    param: Any,
    tensor: Any,
    shard: int | None,
    sizes: list[int],
    rows: int | None = None,
):
    if isinstance(param, QuantLinear):
        param.load_shard(shard, tensor)
        return
    if isinstance(param, QuantEmbedding):
        param.part.load(0, tensor)
        return
    if not isinstance(tensor, torch.Tensor):  # a quantized tensor meeting a dense layer
        tensor = tensor.dequantize()
    dst = param.data
    if shard is not None:
        offset = sum(sizes[:shard])
        dst = dst.narrow(0, offset, sizes[shard])
    elif rows is not None:
        dst = dst.narrow(0, 0, rows)  # a vocabulary shard: padding rows (if any) after these
    if tuple(dst.shape) != tuple(tensor.shape):
        raise ValueError(f"shape mismatch: checkpoint {tuple(tensor.shape)} vs {tuple(dst.shape)}")
    dst.copy_(tensor)


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Qwen2/2.5 and DeepSeek-R1-Distill-Qwen: Llama with a bias on q/k/v."""


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Qwen3: Llama with per-head RMSNorm on q and k before rotary."""
