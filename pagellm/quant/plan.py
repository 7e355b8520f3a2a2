"""Which weights of a checkpoint are kept quantized, and in which form: ``--quantization``.

vLLM's names: ``auto`` (the checkpoint says: a GGUF file's quantized tensors stay quantized, an
AWQ / GPTQ / compressed-tensors checkpoint is read as its ``quantization_config`` says, a float
checkpoint stays float), ``none`` (a GGUF dequantized to the model dtype at load), ``gguf``,
``awq``, ``gptq``, ``compressed-tensors`` (the checkpoint must be so), ``int8`` / ``int4`` /
``fp8`` (a float checkpoint quantized at load: the decoder's linear layers; embeddings and the LM
head stay in the model dtype, as vLLM and llm-compressor leave them). A setting that contradicts
the checkpoint, or a scheme pagellm does not read, is refused at start-up with both named.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from pagellm.config import QUANTIZATION_METHODS
from pagellm.quant.checkpoints import CheckpointQuant, checkpoint_plan
from pagellm.quant.formats import QuantFormat
from pagellm.quant.gguf_blocks import kept_format
from pagellm.quant.online import fp8_format, int4_format, int8_format

log = logging.getLogger(__name__)
METHODS = QUANTIZATION_METHODS
_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class QuantPlan:
    """The resolved method and the stored form of each checkpoint tensor (None: dense)."""

    method: str = "none"
    gguf_types: dict[str, str] = field(default_factory=dict)
    """GGUF only: HF tensor name -> GGUF type name (``Q4_1``)."""
    checkpoint: CheckpointQuant | None = None
    """A quantized HF checkpoint's settings (AWQ, GPTQ, compressed-tensors)."""

    @property
    def quantized(self) -> bool:
        return self.method != "none"

    def format_for(self, hf_name: str, in_features: int) -> QuantFormat | None:
        """The form ``hf_name`` (a full checkpoint name) is kept in, given this rank's inputs."""
        if self.method == "gguf":
            type_name = self.gguf_types.get(hf_name)
            return kept_format(type_name) if type_name else None
        if self.method in _ONLINE and _is_decoder_linear(hf_name):
            return _ONLINE[self.method](in_features)
        if self.checkpoint is not None and self.checkpoint.quantizes(hf_name):
            return self.checkpoint.fmt
        return None


_ONLINE: dict[str, Callable[[int], QuantFormat]] = {
    "int8": lambda _in: int8_format(),
    "int4": int4_format,
    "fp8": lambda _in: fp8_format(),
}


def _is_decoder_linear(hf_name: str) -> bool:
    return hf_name.startswith("model.layers.") and any(f".{m}." in hf_name for m in _LINEARS)


def resolve_plan(
    requested: str | None, source: Path, gguf_types: dict[str, str] | None
) -> QuantPlan:
    """Check ``--quantization`` against the checkpoint; raise ValueError naming the setting."""
    method = requested or "auto"
    if method not in METHODS:
        raise ValueError(
            f"--quantization {method!r} is not supported; choose one of {', '.join(METHODS)}"
        )
    if gguf_types is not None:
        return _gguf_plan(method, source, gguf_types)
    qc = _quantization_config(source)
    if qc is not None:
        checkpoint_method = str(qc.get("quant_method", "unknown")).lower()
        if method not in ("auto", checkpoint_method):
            raise ValueError(
                f"--quantization {method} contradicts {source}'s quantization_config "
                f"({checkpoint_method!r}): use --quantization auto or {checkpoint_method}"
            )
        try:
            checkpoint = checkpoint_plan(qc)
        except ValueError as exc:
            raise ValueError(f"{source} is quantized with {checkpoint_method!r}: {exc}") from exc
        if checkpoint.weight_only_note:
            log.info("%s: %s", source.name, checkpoint.weight_only_note)
        return QuantPlan(checkpoint.method, checkpoint=checkpoint)
    if method in _CHECKPOINT_METHODS:
        raise ValueError(
            f"--quantization {method} needs a checkpoint quantized so; {source} has no "
            "quantization_config"
        )
    if method == "gguf":
        raise ValueError(f"--quantization gguf needs a .gguf file; {source} is a directory")
    return QuantPlan("none" if method == "auto" else method)


def _gguf_plan(method: str, source: Path, types: dict[str, str]) -> QuantPlan:
    kept = {name: t for name, t in types.items() if kept_format(t) is not None}
    quantized = sorted({t for t in types.values() if t not in ("F32", "F16", "BF16")})
    if method in _CHECKPOINT_METHODS:
        raise ValueError(f"--quantization {method} needs a {method} checkpoint, not a GGUF file")
    if method in _ONLINE:
        if quantized:
            raise ValueError(
                f"--quantization {method} quantizes a float checkpoint; {source.name} is "
                f"already quantized ({', '.join(quantized)}): use --quantization auto or none"
            )
        return QuantPlan(method)
    if method == "none" or not kept:
        return QuantPlan("none")
    return QuantPlan("gguf", kept)


_CHECKPOINT_METHODS = ("awq", "gptq", "compressed-tensors")


def _quantization_config(source: Path) -> dict | None:
    config_file = source / "config.json"
    if not config_file.is_file():
        return None
    return json.loads(config_file.read_text()).get("quantization_config") or None
