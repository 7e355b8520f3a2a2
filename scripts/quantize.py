"""Make a quantized checkpoint of a float HF model with llm-compressor, in the layout vLLM and
pagellm serve (compressed-tensors).

Runs in its own virtualenv (``make quantize-SCHEME`` makes ``.venv-quantize``): llm-compressor
pins transformers and compressed-tensors to versions the project's venv does not use. The
calibrated schemes calibrate on ShareGPT prompts (the first ``--num-samples`` conversations, each
as its chat-templated first exchange); ``pagellm bench quantization`` scores held-out ones.

    fp8-dynamic   FP8 E4M3 weights per channel, dynamic activations (no data needed)
    fp8-kv        fp8-dynamic plus an FP8 KV cache scheme: calibrated k_scale / v_scale
    w8a8          SmoothQuant + GPTQ, int8 weights per channel, dynamic int8 activations
    w4a16         GPTQ int4 weights in groups of 64 (SmolLM2's 576 inputs hold no group of 128)
    awq           AWQ int4 asymmetric weights in groups of 64
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

SCHEMES = ("fp8-dynamic", "fp8-kv", "w8a8", "w4a16", "awq")
CALIBRATED = ("fp8-kv", "w8a8", "w4a16", "awq")


def _int4_groups(symmetric: bool) -> dict:
    return {
        "group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 4, "type": "int", "symmetric": symmetric,
                        "strategy": "group", "group_size": 64},
        }
    }  # fmt: skip


def recipe(scheme: str) -> list:
    from llmcompressor.modifiers.quantization import GPTQModifier, QuantizationModifier

    if scheme == "fp8-dynamic":
        return [QuantizationModifier(targets="Linear", scheme="FP8_DYNAMIC", ignore=["lm_head"])]
    if scheme == "fp8-kv":
        kv = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False,
              "symmetric": True}  # fmt: skip
        return [
            QuantizationModifier(
                targets="Linear", scheme="FP8_DYNAMIC", ignore=["lm_head"], kv_cache_scheme=kv
            )
        ]
    if scheme == "w8a8":
        from llmcompressor.modifiers.smoothquant import SmoothQuantModifier

        return [
            SmoothQuantModifier(smoothing_strength=0.8),
            GPTQModifier(targets="Linear", scheme="W8A8", ignore=["lm_head"]),
        ]
    if scheme == "w4a16":
        return [GPTQModifier(config_groups=_int4_groups(True), ignore=["lm_head"])]
    if scheme == "awq":
        from llmcompressor.modifiers.awq import AWQModifier

        return [AWQModifier(config_groups=_int4_groups(False), ignore=["lm_head"])]
    raise SystemExit(f"unknown scheme {scheme!r}; one of {', '.join(SCHEMES)}")


def calibration_set(tokenizer, sharegpt: Path, num_samples: int, max_tokens: int):
    """The first ``num_samples`` ShareGPT exchanges (human turn, gpt reply), chat-templated and
    tokenized (a cut-off file: its complete conversations)."""
    from datasets import Dataset

    decoder = json.JSONDecoder()
    text = sharegpt.read_text(encoding="utf-8")
    pos, rows = text.index("[") + 1, []
    while len(rows) < num_samples:
        while text[pos] in " \n\r\t,":
            pos += 1
        entry, pos = decoder.raw_decode(text, pos)
        turns = entry.get("conversations") or []
        if len(turns) >= 2 and turns[0]["from"] == "human" and turns[1]["from"] == "gpt":
            messages = [{"role": "user", "content": turns[0]["value"]},
                        {"role": "assistant", "content": turns[1]["value"]}]  # fmt: skip
            chat = tokenizer.apply_chat_template(messages, tokenize=False)
            ids = tokenizer(chat, add_special_tokens=False)["input_ids"][:max_tokens]
            rows.append({"input_ids": ids, "attention_mask": [1] * len(ids)})
    return Dataset.from_list(rows)


def _no_pin_memory() -> None:
    """AWQ pins host buffers, which needs a GPU: on a CPU-only machine pinning is a no-op."""
    import torch

    if not torch.cuda.is_available():
        torch.Tensor.pin_memory = lambda self, *a, **k: self


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="float HF folder")
    parser.add_argument("--scheme", required=True, choices=SCHEMES)
    parser.add_argument("--output", required=True)
    parser.add_argument("--sharegpt", default=None, help="ShareGPT JSON (calibrated schemes)")
    parser.add_argument("--num-samples", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=256)
    args = parser.parse_args()

    import torch
    from llmcompressor import oneshot
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    kwargs = {}
    if args.scheme in CALIBRATED:
        if args.sharegpt is None:
            raise SystemExit(f"--scheme {args.scheme} calibrates: give --sharegpt")
        data = calibration_set(tokenizer, Path(args.sharegpt), args.num_samples, args.max_tokens)
        kwargs = {"dataset": data, "num_calibration_samples": len(data),
                  "max_seq_length": args.max_tokens}  # fmt: skip
    if args.scheme == "awq":
        _no_pin_memory()
    oneshot(model=model, recipe=recipe(args.scheme), **kwargs)
    model.save_pretrained(args.output, save_compressed=True)
    tokenizer.save_pretrained(args.output)
    print(args.output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
