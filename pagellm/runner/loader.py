"""Open a model (HF directory or GGUF file) and load its weights in the requested dtype."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from pagellm.fetch import require_default_model
from pagellm.models.arch import ModelArch
from pagellm.models.registry import resolve_model_class
from pagellm.quant.plan import QuantPlan, resolve_plan


def resolve_source(model: str | None) -> Path:
    path = require_default_model() if model is None else Path(model).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"model path {path} does not exist")
    return path


def resolve_dtype(dtype: str, device: torch.device | str = "cpu") -> torch.dtype:
    if dtype == "auto":
        if torch.device(device).type == "cuda":
            native = torch.cuda.is_bf16_supported(including_emulation=False)
            return torch.bfloat16 if native else torch.float16
        return torch.bfloat16 if _cpu_has_bf16() else torch.float32
    table = {
        "float32": torch.float32,
        "fp32": torch.float32,
        "bfloat16": torch.bfloat16,
        "bf16": torch.bfloat16,
        "float16": torch.float16,
        "fp16": torch.float16,
        "float": torch.float32,  # vLLM's aliases
        "half": torch.float16,
    }
    if dtype not in table:
        raise ValueError(f"unsupported dtype {dtype!r}; use auto, float32, bfloat16 or float16")
    return table[dtype]


def _cpu_has_bf16() -> bool:
    from pagellm.kernels.cpu_build import cpu_has_native_bf16

    return cpu_has_native_bf16()


@dataclass(frozen=True)
class ModelFiles:
    """A model's location, shape, its GGUF file opened once (None for an HF directory), and
    which weights stay quantized (``--quantization`` resolved against the checkpoint)."""

    path: Path
    arch: ModelArch
    gguf: Any = None
    quant: QuantPlan = QuantPlan()


def open_model(source: Path, quantization: str | None = None) -> ModelFiles:
    """Read the model's metadata (config.json or the GGUF header); weights are read later.
    Raises ValueError when ``quantization`` does not fit the checkpoint."""
    if source.is_file():
        from pagellm.runner.gguf_loader import GGUFModel

        gguf_model = GGUFModel(source)
        plan = resolve_plan(quantization, source, gguf_model.tensor_types())
        return ModelFiles(source, ModelArch.from_hf_config(gguf_model.config), gguf_model, plan)
    config_file = source / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"{source} has no config.json (expected an HF model directory)")
    try:
        hf_config = json.loads(config_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{config_file} is not valid JSON: {exc}") from exc
    arch = ModelArch.from_hf_config(hf_config)
    return ModelFiles(source, arch, None, resolve_plan(quantization, source, None))


def load_model(
    files: ModelFiles,
    dtype: torch.dtype,
    backend: Any,
    comm: Any = None,
    device: torch.device | str = "cpu",
) -> nn.Module:
    """The model (this rank's part of it under ``comm``) on ``device``, weights loaded (read on
    the host, copied in one tensor at a time), in eval mode."""
    arch, gguf_model, source = files.arch, files.gguf, files.path
    cls = resolve_model_class(arch.architecture)
    freq_factors = gguf_model.rope_freq_factors() if gguf_model is not None else None
    plan = files.quant if files.quant.quantized else None
    with torch.device("meta"):
        model = cls(arch, backend, freq_factors, comm, plan).to(dtype)
    model = model.to_empty(device=device)
    if gguf_model is not None:
        weights = gguf_model.tensors(frozenset(files.quant.gguf_types))
    elif files.quant.checkpoint is not None:
        from pagellm.quant.checkpoints import assemble

        weights = assemble(_safetensors(source), files.quant.checkpoint)
    else:
        weights = _safetensors(source)
    model.load_weights(weights)  # copy_ casts to the model's dtype
    model.finish_loading()
    return model.eval()


def _safetensors(source: Path):
    from safetensors import SafetensorError
    from safetensors.torch import safe_open

    files = sorted(source.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{source} has no *.safetensors files")
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                    yield name, f.get_tensor(name)
        except SafetensorError as exc:
            raise ValueError(f"corrupt checkpoint file {file}: {exc}") from exc
