"""Shared fixtures: tiny random Llama / Qwen2 / Qwen3 checkpoints built with transformers.

The tiny models use the default model's tokenizer (SmolLM2, fetched by ``make test``) so that
text prompts and detokenization work exactly as with a real model.
"""

from __future__ import annotations

from pathlib import Path

import pytest

TINY_VOCAB = 49152


def _tiny_config(arch: str):
    import transformers

    common = dict(
        vocab_size=TINY_VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        initializer_range=0.2,
        tie_word_embeddings=arch != "qwen2",
        bos_token_id=1,
        eos_token_id=2,
    )
    if arch == "llama":
        return transformers.LlamaConfig(**common, architectures=["LlamaForCausalLM"])
    if arch == "llama3":
        scaling = {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        }
        return transformers.LlamaConfig(
            **common, architectures=["LlamaForCausalLM"], rope_scaling=scaling
        )
    if arch == "qwen2":
        return transformers.Qwen2Config(**common, architectures=["Qwen2ForCausalLM"])
    if arch == "qwen3":
        return transformers.Qwen3Config(**common, head_dim=32, architectures=["Qwen3ForCausalLM"])
    raise ValueError(arch)


@pytest.fixture(scope="session")
def default_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default model's tokenizer saved as HF files (or PAGELLM_TEST_TOKENIZER_DIR's, on a
    machine the GGUF cannot travel to: ``make gpu-carry`` writes one)."""
    import os

    from pagellm.fetch import require_default_model
    from pagellm.runner.tokenizer import Tokenizer

    if os.environ.get("PAGELLM_TEST_TOKENIZER_DIR"):
        return Path(os.environ["PAGELLM_TEST_TOKENIZER_DIR"])
    tok = Tokenizer.load(require_default_model(), None)
    out = tmp_path_factory.mktemp("tokenizer")
    tok.hf.save_pretrained(str(out))
    return out


def build_tiny_model(arch: str, root: Path, tokenizer_dir: Path) -> Path:
    import shutil

    import torch
    import transformers

    out = root / arch
    if (out / "config.json").exists():
        return out
    torch.manual_seed(1234)
    config = _tiny_config(arch)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # random biases, so a missing bias would show in the logits
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.normal_(0.0, 0.2)
    model.save_pretrained(str(out), safe_serialization=True)
    for f in tokenizer_dir.iterdir():
        shutil.copy(f, out / f.name)
    return out


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory, default_tokenizer_dir: Path):
    """A function arch -> checkpoint directory (built once per session)."""
    root = tmp_path_factory.mktemp("tiny_models")
    return lambda arch: build_tiny_model(arch, root, default_tokenizer_dir)
