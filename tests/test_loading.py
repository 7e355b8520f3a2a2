"""Loading errors are clear: unknown architecture, missing files, corrupt checkpoints."""

from __future__ import annotations

import json
import shutil

import pytest

from pagellm import LLM


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_unknown_architecture(tiny_models, tmp_path):
    path = _copy(tiny_models("llama"), tmp_path / "m")
    cfg = json.loads((path / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="unsupported model architecture 'GPT2LMHeadModel'"):
        LLM(str(path), dtype="float32", kv_cache_memory=0.01, max_model_len=256)


def test_missing_model_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        LLM(str(tmp_path / "nope"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="config.json"):
        LLM(str(tmp_path / "empty"))


def test_corrupt_safetensors(tiny_models, tmp_path):
    path = _copy(tiny_models("llama"), tmp_path / "m")
    weights = next(path.glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(ValueError, match="corrupt checkpoint"):
        LLM(str(path), dtype="float32", kv_cache_memory=0.01, max_model_len=256)


def test_missing_tensor(tiny_models, tmp_path):
    from safetensors.torch import load_file, save_file

    path = _copy(tiny_models("qwen2"), tmp_path / "m")
    weights = next(path.glob("*.safetensors"))
    tensors = load_file(str(weights))
    del tensors["model.layers.1.self_attn.k_proj.bias"]
    save_file(tensors, str(weights))
    with pytest.raises(ValueError, match="missing tensors"):
        LLM(str(path), dtype="float32", kv_cache_memory=0.01, max_model_len=256)


def test_corrupt_gguf(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\x00" * 64)
    with pytest.raises(ValueError, match="damaged or cut-short GGUF file .68 bytes"):
        LLM(str(bad))
    bad.write_bytes(b"<html>not a model</html>")
    with pytest.raises(ValueError, match="not a GGUF file"):
        LLM(str(bad))


def test_a_model_folder_without_a_tokenizer_names_it(tiny_models, tmp_path):
    from pagellm.runner.tokenizer import TOKENIZER_FILES

    path = _copy(tiny_models("llama"), tmp_path / "m")
    for name in TOKENIZER_FILES:
        (path / name).unlink(missing_ok=True)
    with pytest.raises(ValueError, match=f"{path} holds no tokenizer.*--tokenizer"):
        LLM(str(path), dtype="float32", kv_cache_memory=0.01, max_model_len=256)


def test_sharded_safetensors_load(tiny_models, tmp_path):
    from safetensors.torch import load_file, save_file

    path = _copy(tiny_models("llama"), tmp_path / "m")
    weights = next(path.glob("*.safetensors"))
    tensors = load_file(str(weights))
    names = sorted(tensors)
    weights.unlink()
    save_file({n: tensors[n] for n in names[::2]}, str(path / "model-00001-of-00002.safetensors"))
    save_file({n: tensors[n] for n in names[1::2]}, str(path / "model-00002-of-00002.safetensors"))
    llm = LLM(str(path), dtype="float32", kv_cache_memory=0.01, max_model_len=256)
    assert llm.generate([[5, 6, 7]], use_tqdm=False)[0].outputs[0].token_ids
