"""GGUF loading: a tiny Llama written as GGUF with F32/F16/Q8_0/Q4_0/Q4_1 tensors (Q/K rows
permuted as llama.cpp stores them) gives the same logits as transformers' own GGUF loader."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from pagellm import LLM
from pagellm.fetch import require_default_model

Q = gguf.GGMLQuantizationType
TENSOR_TYPES = {
    "token_embd": Q.Q8_0,
    "attn_q": Q.Q4_0,
    "attn_k": Q.Q4_1,
    "attn_v": Q.Q8_0,
    "attn_output": Q.F16,
    "ffn_gate": Q.Q4_1,
    "ffn_up": Q.Q4_0,
    "ffn_down": Q.Q8_0,
}
HF_TO_GGUF = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's layout of Q/K rows (the inverse of what our loader undoes)."""
    return (
        w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


def _copy_tokenizer(writer: gguf.GGUFWriter) -> None:
    src = gguf.GGUFReader(str(require_default_model()))
    value = lambda key: src.fields[key].contents()  # noqa: E731
    writer.add_tokenizer_model(value("tokenizer.ggml.model"))
    writer.add_tokenizer_pre(value("tokenizer.ggml.pre"))
    writer.add_token_list(value("tokenizer.ggml.tokens"))
    writer.add_token_types(value("tokenizer.ggml.token_type"))
    writer.add_token_merges(value("tokenizer.ggml.merges"))
    writer.add_bos_token_id(value("tokenizer.ggml.bos_token_id"))
    writer.add_eos_token_id(value("tokenizer.ggml.eos_token_id"))
    writer.add_chat_template(value("tokenizer.chat_template"))


def write_gguf(hf_dir, out_path) -> None:
    import json

    from safetensors.torch import load_file

    cfg = json.loads((hf_dir / "config.json").read_text())
    tensors = load_file(str(next(hf_dir.glob("*.safetensors"))))
    writer = gguf.GGUFWriter(str(out_path), "llama")
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(cfg["num_attention_heads"])
    writer.add_head_count_kv(cfg["num_key_value_heads"])
    writer.add_rope_freq_base(cfg.get("rope_theta") or cfg["rope_parameters"]["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_rope_dimension_count(cfg["hidden_size"] // cfg["num_attention_heads"])
    _copy_tokenizer(writer)
    for name, tensor in tensors.items():
        data = tensor.float().numpy()
        if name == "model.embed_tokens.weight":
            gname, kind = "token_embd.weight", "token_embd"
        elif name == "model.norm.weight":
            gname, kind = "output_norm.weight", None
        else:
            layer, rest = name.removeprefix("model.layers.").split(".", 1)
            module, suffix = rest.rsplit(".", 1)
            kind = HF_TO_GGUF[module]
            gname = f"blk.{layer}.{kind}.{suffix}"
            if kind == "attn_q":
                data = _permute(data, cfg["num_attention_heads"])
            elif kind == "attn_k":
                data = _permute(data, cfg["num_key_value_heads"])
        qtype = TENSOR_TYPES.get(kind, Q.F32)
        if qtype == Q.F32:
            writer.add_tensor(gname, data)
        elif qtype == Q.F16:
            writer.add_tensor(gname, data.astype(np.float16))
        else:
            writer.add_tensor(gname, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def tiny_gguf(tiny_models, tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "tiny-llama.gguf"
    write_gguf(tiny_models("llama"), path)
    return path


def test_quantized_gguf_matches_transformers_loader(tiny_gguf):
    import transformers
    from test_model_correctness import _our_logits

    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(tiny_gguf.parent), gguf_file=tiny_gguf.name, dtype=torch.float32
    ).eval()
    llm = LLM(str(tiny_gguf), dtype="float32", kv_cache_memory=0.01, max_model_len=512)
    ids = list(range(1000, 1100))
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(_our_logits(llm, ids), ref, rtol=1e-4, atol=1e-4)
    assert llm.tokenizer.eos_token_id == 2
    assert "<|im_start|>" in llm.tokenizer.apply_chat_template([{"role": "user", "content": "x"}])


def test_unsupported_gguf_architecture(tmp_path):
    path = tmp_path / "falcon.gguf"
    writer = gguf.GGUFWriter(str(path), "falcon")
    writer.add_block_count(1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="unsupported GGUF architecture 'falcon'"):
        LLM(str(path))
