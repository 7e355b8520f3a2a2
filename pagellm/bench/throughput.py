"""``pagellm bench throughput``: offline throughput of the engine, optionally against HF.

All prompts go to one ``LLM.generate`` call (greedy, EOS ignored, exact output lengths), after
an untimed warm-up. The workload is built in a spawned child process so that parsing a large
dataset (ShareGPT is ~650 MB of JSON) does not count toward this process's peak RSS.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import multiprocessing
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from typing import Any

from pagellm.bench import report as rep
from pagellm.bench.datasets import (
    BenchRequest,
    edit_workload,
    load_workload,
    prefix_workload,
    random_workload,
    save_workload,
    sharegpt_workload,
    workload_summary,
)

DEFAULT_LEN = 128
"""Random prompts' input and output length when not given."""
DEFAULT_PREFIX_SUFFIX_LEN = 32
"""Prefix workload: each request's own prompt tokens and output length when not given."""


def add_dataset_args(p: argparse.ArgumentParser, default: str) -> None:
    """The workload flags both benchmarks share."""
    p.add_argument(
        "--dataset",
        choices=["random", "sharegpt", "prefix", "edit"],
        default=default,
        help="edit: ShareGPT replies to rewrite with one change (the answer repeats the prompt)",
    )
    p.add_argument("--dataset-path", default=None, help="ShareGPT JSON (default: fetched copy)")
    p.add_argument(
        "--input-len",
        type=int,
        default=None,
        help="random: prompt length (128); prefix: each request's own tokens (32)",
    )
    p.add_argument(
        "--output-len",
        type=int,
        default=None,
        help="random: 128; prefix: 32; sharegpt: each reply's own length unless given",
    )
    p.add_argument("--prefix-len", type=int, default=1000, help="prefix: shared prompt tokens")
    p.add_argument("--num-prefixes", type=int, default=1, help="prefix: distinct shared prompts")
    p.add_argument("--num-turns", type=int, default=1, help="prefix: turns per conversation")


@dataclasses.dataclass(frozen=True, slots=True)
class WorkloadSpec:
    """What ``build_workload`` needs; plain values so it pickles into the child process."""

    dataset: str
    num_prompts: int
    input_len: int | None
    output_len: int | None
    seed: int
    tokenizer_source: str | None
    dataset_path: str | None = None
    prefix_len: int = 1000
    num_prefixes: int = 1
    num_turns: int = 1


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``throughput`` under ``pagellm bench``."""
    from pagellm.cli import add_engine_args

    p = subparsers.add_parser("throughput", help="offline throughput (one generate over N prompts)")
    add_dataset_args(p, default="random")
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--workload", default=None, help="load a saved workload instead of building")
    p.add_argument("--save-workload", default=None, help="write the workload JSON here")
    p.add_argument("--baseline", choices=["none", "hf"], default="none")
    p.add_argument("--baseline-single-prompts", type=int, default=8)
    p.add_argument("--baseline-static-prompts", type=int, default=64)
    p.add_argument("--hf-batch-size", type=int, default=16)
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument(
        "--num-threads", type=int, default=None, help="torch intra-op threads (default: torch's)"
    )
    p.add_argument("--output-json", default=None, help="write the report JSON here")
    add_engine_args(p)  # brings --model, --dtype, --seed (also seeds the dataset), ...
    p.set_defaults(func=run)
    return p


def build_workload(spec: WorkloadSpec) -> list[dict[str, Any]]:
    """Runs in the child: load the tokenizer, build the requests, return them as JSON dicts."""
    from pagellm.runner.loader import resolve_source
    from pagellm.runner.tokenizer import Tokenizer

    tokenizer = Tokenizer.load(resolve_source(spec.tokenizer_source), None)
    if spec.dataset == "random":
        in_len = spec.input_len or DEFAULT_LEN
        out_len = spec.output_len or DEFAULT_LEN
        reqs = random_workload(spec.num_prompts, in_len, out_len, tokenizer.vocab_size, spec.seed)
    elif spec.dataset == "prefix":
        reqs = prefix_workload(
            spec.num_prompts,
            spec.prefix_len,
            spec.input_len or DEFAULT_PREFIX_SUFFIX_LEN,
            spec.output_len or DEFAULT_PREFIX_SUFFIX_LEN,
            tokenizer.vocab_size,
            spec.seed,
            spec.num_prefixes,
            spec.num_turns,
        )
    elif spec.dataset == "edit":
        reqs = edit_workload(spec.dataset_path, tokenizer, spec.num_prompts, spec.seed)
    else:
        reqs = sharegpt_workload(
            spec.dataset_path, tokenizer, spec.num_prompts, spec.seed, spec.output_len
        )
    return [r.to_json() for r in reqs]


def build_workload_isolated(spec: WorkloadSpec) -> list[BenchRequest]:
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=1, mp_context=ctx) as pool:
        objs = pool.submit(build_workload, spec).result()
    return [BenchRequest.from_json(o) for o in objs]


def spec_from_args(args: argparse.Namespace, tokenizer_source: str | None) -> WorkloadSpec:
    """The workload the dataset flags describe (fetching ShareGPT when no path is given)."""
    path = args.dataset_path
    if args.dataset in ("sharegpt", "edit") and path is None:
        from pagellm.fetch import fetch_sharegpt

        path = str(fetch_sharegpt())
    return WorkloadSpec(
        dataset=args.dataset,
        num_prompts=args.num_prompts,
        input_len=args.input_len,
        output_len=args.output_len,
        seed=args.seed,
        tokenizer_source=tokenizer_source,
        dataset_path=path,
        prefix_len=args.prefix_len,
        num_prefixes=args.num_prefixes,
        num_turns=args.num_turns,
    )


def run_engine(llm: Any, requests: list[BenchRequest], progress: bool = True) -> dict[str, Any]:
    """Warm up, then time one ``generate`` over all requests; engine figures as a dict."""
    from pagellm import SamplingParams

    warm = [r.prompt_token_ids[:16] for r in requests[:2]]
    llm.generate(
        warm, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False
    )
    before = _reset_peaks(llm.get_stats())
    params = [
        SamplingParams(temperature=0.0, max_tokens=r.output_len, ignore_eos=True) for r in requests
    ]
    start = time.perf_counter()
    outs = llm.generate([r.prompt_token_ids for r in requests], params, use_tqdm=progress)
    elapsed = time.perf_counter() - start
    stats = llm.get_stats()
    extra = {
        "peak_memory_mib": rep.peak_rss_mib(),
        "rss_after_run_mib": rep.current_rss_mib(),
        "peak_kv_usage_frac": stats.peak_kv_usage,
        "kv_waste_frac": stats.kv_waste_at_peak,
        "num_preemptions": stats.num_preemptions - before.num_preemptions,
        "num_steps": stats.num_steps - before.num_steps,
        "engine_busy_s": stats.busy_seconds - before.busy_seconds,
        "engine_execute_s": stats.execute_seconds - before.execute_seconds,
        "expected_output_tokens": sum(r.output_len for r in requests),
        **rep.spec_counters(
            stats.spec_num_drafts - before.spec_num_drafts,
            stats.spec_num_draft_tokens - before.spec_num_draft_tokens,
            stats.spec_num_accepted_tokens - before.spec_num_accepted_tokens,
        ),
    }
    prompt = sum(len(o.prompt_token_ids) for o in outs)
    output = sum(len(o.outputs[0].token_ids) for o in outs)
    return rep.PhaseResult(len(outs), prompt, output, elapsed, extra).to_dict()


def _reset_peaks(stats: Any) -> Any:
    """Snapshot the counters, then clear the peak figures so the warm-up cannot set them.

    ``get_stats()`` returns the engine's live object, which has no reset of its own.
    """
    snapshot = dataclasses.replace(stats)
    stats.peak_kv_usage = 0.0
    stats.kv_waste_at_peak = 0.0
    return snapshot


def _check_args(args: argparse.Namespace) -> None:
    positive = [
        "num_prompts", "input_len", "output_len", "hf_batch_size", "num_threads",
        "prefix_len", "num_prefixes", "num_turns",
    ]  # fmt: skip
    bad = [name for name in positive if getattr(args, name) is not None and getattr(args, name) < 1]
    if bad:
        raise SystemExit(f"pagellm bench throughput: must be >= 1: {', '.join(bad)}")


def run(args: argparse.Namespace) -> int:
    """The ``pagellm bench throughput`` command."""
    from pagellm.cli import engine_kwargs
    from pagellm.llm import LLM

    _check_args(args)
    if args.num_threads:
        import torch

        torch.set_num_threads(args.num_threads)
    requests = _load_requests(args)
    llm = LLM(**engine_kwargs(args))
    try:
        resolved = _resolved(llm)
        engine = run_engine(llm, requests, args.progress)
    finally:
        llm.shutdown()  # worker ranks, if any
    del llm
    gc.collect()
    baseline = None
    if args.baseline == "hf":
        baseline = _run_baseline(args, requests)
    config = _config(args, resolved)
    report = rep.build_report(config, engine, baseline, workload_summary(requests))
    if args.output_json:
        rep.write_report(args.output_json, report)
    print(rep.render(report))
    if args.output_json:
        print(f"wrote {args.output_json}")
    _warn_short_outputs(engine)
    return 0


def _load_requests(args: argparse.Namespace) -> list[BenchRequest]:
    if args.workload:
        requests = load_workload(args.workload)
    else:
        requests = build_workload_isolated(spec_from_args(args, args.tokenizer or args.model))
    if not requests:
        raise SystemExit("pagellm bench throughput: the workload is empty")
    if args.save_workload:
        save_workload(args.save_workload, requests)
    return requests


def _run_baseline(args: argparse.Namespace, requests: list[BenchRequest]) -> dict[str, Any]:
    from pagellm.bench.hf_baseline import run_hf_baseline
    from pagellm.runner.loader import resolve_dtype, resolve_source

    print(
        f"HF baseline: single on the first {min(args.baseline_single_prompts, len(requests))}, "
        f"static (batch {args.hf_batch_size}) on the first "
        f"{min(args.baseline_static_prompts, len(requests))} of {len(requests)} prompts",
        file=sys.stderr,
    )
    return run_hf_baseline(
        resolve_source(args.model),
        resolve_dtype(args.dtype),
        requests,
        args.baseline_single_prompts,
        args.baseline_static_prompts,
        args.hf_batch_size,
    )


def _resolved(llm: Any) -> dict[str, str]:
    """The dtype and device ``auto`` came to (rank 0's, under parallelism)."""
    runner = getattr(llm.engine.executor, "runner", llm.engine.executor)
    return {
        "resolved_dtype": str(runner.dtype).removeprefix("torch."),
        "resolved_device": str(runner.device),
    }


def _config(args: argparse.Namespace, resolved: dict[str, str]) -> dict[str, Any]:
    config = {k: v for k, v in vars(args).items() if k != "func"}
    config.update(resolved)
    return config


def _warn_short_outputs(engine: dict[str, Any]) -> None:
    if engine["output_tokens"] != engine["expected_output_tokens"]:
        print(
            f"warning: the engine made {engine['output_tokens']} output tokens, "
            f"{engine['expected_output_tokens']} were asked",
            file=sys.stderr,
        )
