"""Which weights of a checkpoint are kept quantized, and in which form: ``--quantization``.

vLLM's names: ``auto`` (the checkpoint says: a GGUF file's quantized tensors stay quantized, a
float checkpoint stays float), ``none`` (everything dequantized to the model dtype at load),
``gguf`` (a GGUF file, kept quantized), ``int8`` / ``int4`` (a float checkpoint quantized at
load: the decoder's linear layers; embeddings and the LM head stay in the model dtype, as vLLM
and llm-compressor leave them). A checkpoint quantized in a format pagellm does not read
(AWQ, GPTQ, compressed-tensors, ...) is refused at start-up with the format named.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from pagellm.config import QUANTIZATION_METHODS
from pagellm.quant.formats import QuantFormat
from pagellm.quant.gguf_blocks import kept_format
from pagellm.quant.online import int4_format, int8_format

METHODS = QUANTIZATION_METHODS
_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class QuantPlan:
    """The resolved method and the stored form of each checkpoint tensor (None: dense)."""

    method: str = "none"
    gguf_types: dict[str, str] = field(default_factory=dict)
    """GGUF only: HF tensor name -> GGUF type name (``Q4_1``)."""

    @property
    def quantized(self) -> bool:
        return self.method != "none"

    def format_for(self, hf_name: str, in_features: int) -> QuantFormat | None:
        """The form ``hf_name`` (a full checkpoint name) is kept in, given this rank's inputs."""
        if self.method == "gguf":
            type_name = self.gguf_types.get(hf_name)
            return kept_format(type_name) if type_name else None
        if self.method in ("int8", "int4") and _is_decoder_linear(hf_name):
            return _ONLINE[self.method](in_features)
        return None


_ONLINE: dict[str, Callable[[int], QuantFormat]] = {
    "int8": lambda _in: int8_format(),
    "int4": int4_format,
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
    checkpoint_method = _checkpoint_quantization(source)
    if checkpoint_method is not None:
        raise ValueError(
            f"{source} is quantized with {checkpoint_method!r} (its quantization_config): "
            f"pagellm loads GGUF files and float checkpoints (--quantization {method})"
        )
    if method == "gguf":
        raise ValueError(f"--quantization gguf needs a .gguf file; {source} is a directory")
    return QuantPlan("none" if method == "auto" else method)


def _gguf_plan(method: str, source: Path, types: dict[str, str]) -> QuantPlan:
    kept = {name: t for name, t in types.items() if kept_format(t) is not None}
    quantized = sorted({t for t in types.values() if t not in ("F32", "F16", "BF16")})
    if method in ("int8", "int4"):
        if quantized:
            raise ValueError(
                f"--quantization {method} quantizes a float checkpoint; {source.name} is "
                f"already quantized ({', '.join(quantized)}): use --quantization auto or none"
            )
        return QuantPlan(method)
    if method == "none" or not kept:
        return QuantPlan("none")
    return QuantPlan("gguf", kept)


def _checkpoint_quantization(source: Path) -> str | None:
    config_file = source / "config.json"
    if not config_file.is_file():
        return None
    config = json.loads(config_file.read_text())
    qc = config.get("quantization_config")
    if not qc:
        return None
    return str(qc.get("quant_method") or qc.get("format") or "unknown")
