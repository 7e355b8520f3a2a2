"""``pagellm bench quantization``: each weight format of one model, side by side in one run.

Quality (``--what quality``): perplexity of held-out ShareGPT replies (teacher-forced through
the engine's own model and kernels, the reply's tokens scored after its chat-templated prompt),
and greedy agreement with the float32 model over ``--agree-tokens`` tokens of each chat
(the share of chats whose first N tokens are identical, and the mean length of the common
start), the chats decoded ``--agree-batch-size`` at a time (default: all at once; 1 measures
the decode steps of a single stream, which take other kernels than a batch of 64: e.g. a few
bf16 rows against 4-bit weights are multiplied with x in int8). Speed (``--what speed``): decode ms/step at each batch size (random prompts, greedy, EOS
ignored; only steps that decode every sequence are timed) and output tok/s, plus weight bytes.

Formats are ``fp32`` / ``bf16`` (dense), ``int8`` / ``int4`` / ``fp8`` (quantized at load from
the float checkpoint; fp8 is per-channel E4M3 weights with fp32 activations) and ``gguf`` (the
GGUF file kept quantized, fp32 activations). A GGUF model is written out once as a float32 HF
folder for the dense and online formats. A format may add ``+kv_fp8`` (or ``+kv_fp8_e5m2``):
the same weights over an FP8 KV cache (scales 1.0, vLLM's default), so its perplexity and
agreement measure the cache's rounding.

Memory: weight bytes, the KV blocks ``--kv-cache-memory`` buys, and the ShareGPT sequences that
fit at once in ``--kv-budget-gib`` without preemption (the held-out chats' prompt + reply
tokens, taken in order and again from the start, each rounded up to whole blocks).
"""

from __future__ import annotations

import argparse
import gc
import math
import random
import time
from pathlib import Path
from typing import Any

from pagellm.bench import report as rep

FORMATS = {
    "fp32": ("float32", "none"),
    "bf16": ("bfloat16", "none"),
    "int8": ("float32", "int8"),
    "int4": ("float32", "int4"),
    "fp8": ("float32", "fp8"),
    "gguf": ("float32", "auto"),
    "int8-bf16": ("bfloat16", "int8"),
    "int4-bf16": ("bfloat16", "int4"),
    "fp8-bf16": ("bfloat16", "fp8"),
    "gguf-bf16": ("bfloat16", "auto"),
}
"""name -> (activation dtype, --quantization); the -bf16 ones compute in bf16 (what --dtype auto
picks on a CPU with native bf16)."""


KV_SUFFIX = "+kv_"


def _split(name: str) -> tuple[str, str]:
    """``bf16+kv_fp8`` -> (``bf16``, ``fp8``); a plain format's cache is ``auto``."""
    base, _, kv = name.partition(KV_SUFFIX)
    return base, kv or "auto"


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser("quantization", help="quality and speed of each weight format")
    p.add_argument("--model", default=None, help="GGUF file or HF folder (default: embedded)")
    p.add_argument("--formats", default="fp32,bf16,int8,int4,fp8,gguf")
    p.add_argument("--what", default="quality,speed")
    p.add_argument("--num-chats", type=int, default=64)
    p.add_argument("--skip-chats", type=int, default=1000, help="held out: chats from here on")
    p.add_argument("--max-reply-tokens", type=int, default=256)
    p.add_argument("--max-prompt-tokens", type=int, default=512, help="a prompt's last N tokens")
    p.add_argument("--agree-tokens", type=int, default=48)
    p.add_argument("--agree-batch-size", type=int, default=0,
                   help="chats decoded at a time for the agreement (0: all at once)")  # fmt: skip
    p.add_argument("--batch-sizes", default="1,8,32,256")
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--rounds", type=int, default=1,
                   help="speed: run every format this many times, in turn (A B C A B C ...); "
                        "the table gives each figure's median")  # fmt: skip
    p.add_argument("--dataset-path", default=None)
    p.add_argument("--kv-cache-memory", type=float, default=2.0, help="GiB of KV cache")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--kv-budget-gib", type=float, default=0.25,
                   help="budget for the ShareGPT sequences-at-once figure")  # fmt: skip
    p.add_argument("--checkpoints", default="",
                   help="more formats: NAME=DIR,... quantized checkpoints (e.g. from make "
                        "quantize-w4a16), loaded as their quantization_config says")  # fmt: skip
    p.add_argument("--checkpoints-dtype", default="float32", choices=["float32", "bfloat16"],
                   help="activations of the --checkpoints formats")  # fmt: skip
    p.add_argument("--output-json", default=None)
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    from pagellm.fetch import require_default_model

    source = Path(args.model).expanduser() if args.model else require_default_model()
    float_dir = float_folder(source)
    checkpoints = dict(c.split("=", 1) for c in args.checkpoints.split(",") if c.strip())
    formats = [f.strip() for f in args.formats.split(",") if f.strip()]
    formats += [name for name in checkpoints if name not in formats]
    known = {**FORMATS, **checkpoints}
    unknown = [f for f in formats if _split(f)[0] not in known or _split(f)[1] not in _KV]
    if unknown:
        raise SystemExit(f"unknown formats {unknown}; choose from {', '.join(FORMATS)}")
    if args.agree_batch_size < 0:
        raise SystemExit("--agree-batch-size must be >= 0 (0: all chats at once)")
    what = {w.strip() for w in args.what.split(",")}
    env = rep.environment()
    results: dict[str, Any] = {
        "environment": env,
        "model": str(source),
        "agree_tokens": args.agree_tokens,
        "agree_batch_size": args.agree_batch_size or args.num_chats,
        "formats": {},
    }
    chats = _held_out_chats(args) if "quality" in what else []
    reference_tokens: list[list[int]] | None = None
    for name in ["fp32", *[f for f in formats if f != "fp32"]] if "quality" in what else formats:
        if _split(name)[0].startswith("gguf") and source.suffix != ".gguf":
            continue
        model = _model_of(name, source, float_dir, checkpoints)
        entry: dict[str, Any] = {}
        llm = _open(model, name, args)
        memory = llm.engine.executor.memory_bytes()
        entry["weight_bytes"] = memory["weights"]
        entry["kv_blocks"] = llm.engine.executor.num_blocks
        block_bytes = memory["kv_cache"] / entry["kv_blocks"]
        if "quality" in what:
            entry.update(_quality(llm, chats, args, reference_tokens))
            lengths = entry.pop("_lengths")
            budget_blocks = int(args.kv_budget_gib * 2**30 // block_bytes)
            entry["sharegpt_seqs_at_once"] = _seqs_at_once(lengths, budget_blocks, llm)
            if name == "fp32":
                reference_tokens = entry.pop("_tokens")
            else:
                entry.pop("_tokens", None)
        if "speed" in what and name in formats:
            entry["speed_rounds"] = [_speed(llm, args)]
        llm.shutdown()
        del llm
        gc.collect()
        if name in formats:
            results["formats"][name] = entry
        print(f"{name}: done", flush=True)
    if "speed" in what:
        for round_no in range(2, args.rounds + 1):
            for name in results["formats"]:
                llm = _open(_model_of(name, source, float_dir, checkpoints), name, args)
                results["formats"][name]["speed_rounds"].append(_speed(llm, args))
                llm.shutdown()
                del llm
                gc.collect()
                print(f"{name}: round {round_no} done", flush=True)
        for entry in results["formats"].values():
            entry["speed"] = _median_speed(entry["speed_rounds"])
    print(render(results))
    if args.output_json:
        rep.write_report(args.output_json, results)
    return 0


_KV = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")


def _model_of(name: str, source: Path, float_dir: Path, checkpoints: dict[str, str]) -> str:
    """What a format loads: its checkpoint, the GGUF itself, or the float folder."""
    base = _split(name)[0]
    if base in checkpoints:
        return str(Path(checkpoints[base]).expanduser())
    return str(source) if base.startswith("gguf") else str(float_dir)


def _median_speed(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Each batch size's figures as the median over the rounds (the upper one of an even
    count)."""
    out: dict[str, Any] = {}
    for batch in rounds[0]:
        out[batch] = {}
        for key in rounds[0][batch]:
            values = sorted(r[batch][key] for r in rounds if r[batch][key] is not None)
            out[batch][key] = values[len(values) // 2] if values else None
    return out


def _open(model: str, name: str, args: argparse.Namespace):
    from pagellm import LLM

    base, kv = _split(name)
    # a checkpoint: quantized as it says, activations in --checkpoints-dtype
    dtype, quantization = FORMATS.get(base, (args.checkpoints_dtype, "auto"))
    return LLM(model, dtype=dtype, quantization=quantization, max_model_len=args.max_model_len,
               kv_cache_memory=args.kv_cache_memory, max_num_seqs=256,
               kv_cache_dtype=kv)  # fmt: skip


def _seqs_at_once(lengths: list[int], blocks: int, llm) -> int:
    """How many sequences of these token lengths (in order, cycling) fit in ``blocks``."""
    size = llm.engine.executor.block_size
    count, used = 0, 0
    while lengths:
        need = -(-lengths[count % len(lengths)] // size)
        if used + need > blocks:
            return count
        used, count = used + need, count + 1
    return 0


def float_folder(source: Path) -> Path:
    """The float32 HF folder of ``source`` (written once into the cache for a GGUF file)."""
    if source.suffix != ".gguf":
        return source
    from pagellm.fetch import cache_dir

    out = cache_dir() / "float32-hf" / source.stem
    if (out / "config.json").is_file():
        return out
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs = {"gguf_file": source.name}
    model = AutoModelForCausalLM.from_pretrained(str(source.parent), dtype=torch.float32, **kwargs)
    tokenizer = AutoTokenizer.from_pretrained(str(source.parent), **kwargs)
    model.hf_quantizer = None  # dense now; transformers would refuse to save a "GGUF" model
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    return out


def _held_out_chats(args: argparse.Namespace) -> list[tuple[str, str]]:
    from pagellm.bench.datasets import sharegpt_pairs
    from pagellm.fetch import fetch_sharegpt

    path = args.dataset_path or fetch_sharegpt()
    pairs = [p for p in sharegpt_pairs(path)[args.skip_chats :] if p[0].strip() and p[1].strip()]
    random.Random(0).shuffle(pairs)
    return pairs[: args.num_chats]


# ----- quality ----------------------------------------------------------------------------


def _quality(llm, chats, args, reference_tokens) -> dict[str, Any]:
    from pagellm import SamplingParams

    nll, count = 0.0, 0
    prompts, lengths = [], []
    for user, reply in chats:
        prompt = llm.tokenizer.apply_chat_template([{"role": "user", "content": user}])
        prompt_ids = llm.tokenizer.encode(prompt)[-args.max_prompt_tokens :]
        reply_ids = llm.tokenizer.encode(reply)[: args.max_reply_tokens]
        prompts.append(prompt_ids)
        lengths.append(len(prompt_ids) + len(reply_ids))
        n, s = _reply_nll(llm, prompt_ids, reply_ids)
        nll, count = nll + s, count + n
    params = SamplingParams(temperature=0, max_tokens=args.agree_tokens, ignore_eos=True)
    at_once = args.agree_batch_size or len(prompts)
    tokens = [
        list(o.outputs[0].token_ids)
        for i in range(0, len(prompts), at_once)
        for o in llm.generate(prompts[i : i + at_once], params, use_tqdm=False)
    ]
    result: dict[str, Any] = {"perplexity": math.exp(nll / count), "scored_tokens": count}
    result["_tokens"] = tokens
    result["_lengths"] = lengths
    if reference_tokens is not None:
        common = [_common_prefix(a, b) for a, b in zip(tokens, reference_tokens, strict=True)]
        result["identical_chats"] = sum(c == args.agree_tokens for c in common) / len(common)
        result["mean_common_tokens"] = sum(common) / len(common)
    return result


def _reply_nll(llm, prompt_ids: list[int], reply_ids: list[int]) -> tuple[int, float]:
    """Tokens scored and their summed negative log-likelihood (nats), one forward of the
    engine's model over prompt + reply in its KV cache (no request is running)."""
    import torch

    from pagellm.attention.backend import SeqLayout

    runner = llm.engine.executor
    ids = prompt_ids + reply_ids
    blocks = list(range(-(-len(ids) // runner.block_size)))
    meta = runner.backend.build_metadata([SeqLayout(len(ids), 0, blocks)], runner.num_blocks)
    with torch.inference_mode():
        hidden = runner.model(torch.tensor(ids), torch.arange(len(ids)), runner.kv_caches, meta)
        logits = runner.model.compute_logits(hidden[len(prompt_ids) - 1 : -1]).float()
    logp = torch.log_softmax(logits, dim=-1)
    picked = logp.gather(1, torch.tensor(reply_ids).unsqueeze(1))
    return len(reply_ids), float(-picked.sum())


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


# ----- speed ------------------------------------------------------------------------------


class _StepTimer:
    """Wraps the executor: times the steps in which every scheduled sequence decodes."""

    def __init__(self, llm) -> None:
        self.inner = llm.engine.executor
        self.decode_s: list[float] = []
        llm.engine.executor = self

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def execute(self, sched):
        start = time.perf_counter()
        out = self.inner.execute(sched)
        if sched.scheduled and all(s.num_tokens == 1 for s in sched.scheduled):
            self.decode_s.append(time.perf_counter() - start)
        return out


def _speed(llm, args) -> dict[str, Any]:
    from pagellm import SamplingParams

    rng = random.Random(0)
    timer = _StepTimer(llm)
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    out: dict[str, Any] = {}
    try:
        for batch in (int(b) for b in args.batch_sizes.split(",")):
            prompts = [
                [rng.randrange(1000, 30000) for _ in range(args.input_len)] for _ in range(batch)
            ]
            llm.generate(prompts[:1], params, use_tqdm=False)  # warm-up
            timer.decode_s.clear()
            start = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            elapsed = time.perf_counter() - start
            steps = sorted(timer.decode_s)
            out[str(batch)] = {
                "decode_ms_per_step": 1000 * steps[len(steps) // 2] if steps else None,
                "output_tok_per_s": batch * args.output_len / elapsed,
            }
    finally:
        llm.engine.executor = timer.inner
    return out


# ----- report -----------------------------------------------------------------------------


def render(results: dict[str, Any]) -> str:
    lines = [rep.cpu_line(results["environment"]), f"model: {results['model']}"]
    formats = results["formats"]
    base = formats.get("bf16") or formats.get("fp32") or {}
    if any("perplexity" in f for f in formats.values()):
        rows = []
        for name, f in formats.items():
            ppl = f.get("perplexity")
            rows.append([
                name,
                f"{ppl:.3f}" if ppl else "-",
                _pct(ppl, base.get("perplexity")),
                _num(f.get("identical_chats"), "{:.0%}"),
                _num(f.get("mean_common_tokens"), "{:.1f}"),
                f"{f['weight_bytes'] / 2**20:.0f}",
                str(f.get("kv_blocks", "-")),
                str(f.get("sharegpt_seqs_at_once", "-")),
            ])  # fmt: skip
        agree = results.get("agree_tokens", 48)
        headers = ["format", "perplexity", "vs bf16", f"identical {agree}", "common toks", "MiB",
                   "KV blocks", "ShareGPT seqs at once"]  # fmt: skip
        at_once = results.get("agree_batch_size")
        lines += ["", rep.format_table(headers, rows)]
        if at_once:
            lines.append(f"(greedy agreement: chats decoded {at_once} at a time)")
    if any("speed" in f for f in formats.values()):
        sizes = next(iter(f["speed"] for f in formats.values() if "speed" in f)).keys()
        headers = ["format", *[f"ms/step @{b}" for b in sizes], *[f"tok/s @{b}" for b in sizes]]
        rows = []
        for name, f in formats.items():
            sp = f.get("speed", {})
            ms = [_ratio_cell(sp, base.get("speed", {}), b, "decode_ms_per_step") for b in sizes]
            tps = [_ratio_cell(sp, base.get("speed", {}), b, "output_tok_per_s") for b in sizes]
            rows.append([name, *ms, *tps])
        lines += ["", rep.format_table(headers, rows), "(ratios against bf16)"]
    return "\n".join(lines)


def _ratio_cell(speed: dict, base: dict, batch: str, key: str) -> str:
    value = speed.get(batch, {}).get(key)
    ref = base.get(batch, {}).get(key)
    if value is None:
        return "-"
    text = f"{value:.1f}"
    return f"{text} ({value / ref:.2f}x)" if ref else text


def _pct(value: float | None, ref: float | None) -> str:
    if value is None or not ref:
        return "-"
    return f"{(value / ref - 1) * 100:+.1f}%"


def _num(value: float | None, fmt: str) -> str:
    return "-" if value is None else fmt.format(value)
