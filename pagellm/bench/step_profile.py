"""``pagellm bench step``: where one decode step's time goes, per batch size.

For each batch size B, B requests with random ``--context-len``-token prompts are prefilled,
then ``--steps`` decode steps of the engine are timed with each part measured where it runs:
scheduling, the runner's input preparation, the forward's layers without attention, attention,
the LM head, sampling, the scheduler's update, and what is left of the step (detokenizing,
stop checks, building outputs), with the sequences each timed step ran and their mean
length (the first requests decode while later ones prefill, so they are longer than the prompt;
none finishes before the timing ends). A captured decode step (``pagellm.runner.captured``) runs its
layers and attention as one list of kernel calls: its attention is inside "layers" (shown
as "-"); ``--enforce-eager`` profiles the eager step. The parts are wall-clock times of the engine thread (the
forward's own threads are inside "layers" and "attention"). Single-process engines only.

Output: a table of ms per step, headed by the CPU, and a JSON report (``--output-json``).
"""

from __future__ import annotations

import argparse
import functools
import time
from collections.abc import Callable
from typing import Any

from pagellm.bench import report as rep

PARTS = ("schedule", "prepare", "layers", "attention", "lm_head", "sampling", "update", "rest")
"""Per-step parts in step order; they add up to the step."""


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    from pagellm.cli import add_engine_args

    p = subparsers.add_parser("step", help="a decode step's time split into its parts")
    p.add_argument("--batch-sizes", default="1,8,32,256", help="comma-separated")
    p.add_argument("--context-len", type=int, default=128, help="prompt tokens per request")
    p.add_argument("--steps", type=int, default=16, help="decode steps timed per batch size")
    p.add_argument("--warmup-steps", type=int, default=3)
    p.add_argument("--output-json", default=None)
    add_engine_args(p)
    p.set_defaults(func=run)
    return p


class StepTimer:
    """Wraps an engine's parts (instance attributes) so that each call adds its wall time."""

    def __init__(self) -> None:
        self.seconds = {name: 0.0 for name in (*PARTS, "step", "execute", "forward")}
        self.active = False

    def wrap(self, obj: Any, method: str, part: str) -> None:
        inner: Callable = getattr(obj, method)

        @functools.wraps(inner)
        def timed(*args: Any, **kwargs: Any) -> Any:
            if not self.active:
                return inner(*args, **kwargs)
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.seconds[part] += time.perf_counter() - start

        setattr(obj, method, timed)

    def instrument(self, engine: Any) -> None:
        runner = engine.executor
        if not hasattr(runner, "model"):
            raise SystemExit("pagellm bench step: profiles a single-process engine (no TP/PP)")
        self.wrap(engine, "step", "step")
        self.wrap(engine.scheduler, "schedule", "schedule")
        self.wrap(engine.scheduler, "update", "update")
        self.wrap(runner, "execute", "execute")
        self.wrap(runner.model, "forward", "forward")
        if runner.captured is not None:  # a captured step's forward: layers and attention
            self.wrap(runner.captured, "forward", "forward")
        self.wrap(runner.backend, "forward", "attention")
        self.wrap(runner.model, "compute_logits", "lm_head")
        self.wrap(runner.sampler, "sample_step", "sampling")

    def per_step_ms(self, steps: int) -> dict[str, float]:
        """The parts of a mean step in ms; nested times are taken out of their parents."""
        s = self.seconds
        parts = {
            "schedule": s["schedule"],
            "prepare": s["execute"] - s["forward"] - s["lm_head"] - s["sampling"],
            "layers": s["forward"] - s["attention"],
            "attention": s["attention"],
            "lm_head": s["lm_head"],
            "sampling": s["sampling"],
            "update": s["update"],
            "rest": s["step"] - s["schedule"] - s["execute"] - s["update"],
        }
        out = {k: 1000.0 * v / steps for k, v in parts.items()}
        out["step"] = 1000.0 * s["step"] / steps
        return out


def profile_batch(llm: Any, batch: int, args: argparse.Namespace) -> dict[str, Any]:
    """Prefill ``batch`` requests, warm up, then time ``args.steps`` decode steps."""
    import random

    from pagellm import SamplingParams

    engine = llm.engine
    rng = random.Random(batch)
    vocab = engine.vocab_size
    # The first requests decode while the later ones prefill (chunked): their budget must outlast
    # that, or the timed steps would run fewer than ``batch`` sequences. They are aborted after.
    total = max(args.warmup_steps + args.steps + 2, engine.max_model_len - args.context_len)
    params = SamplingParams(temperature=0, max_tokens=total, ignore_eos=True)
    ids = [f"step-{batch}-{i}" for i in range(batch)]
    for rid in ids:
        prompt = [rng.randrange(100, vocab) for _ in range(args.context_len)]
        engine.add_request(rid, prompt, params)
    timer = StepTimer()
    timer.instrument(engine)
    while any(
        r.num_output_tokens == 0 for r in engine.scheduler.running + engine.scheduler.waiting
    ):
        engine.step()  # prefill (chunked): every request has its first token
    for _ in range(args.warmup_steps):
        engine.step()
    captured = engine.executor.captured
    before = captured.num_steps if captured is not None else 0
    timer.active = True
    seqs = context = 0
    for _ in range(args.steps):
        running = engine.scheduler.running
        seqs += len(running)
        context += sum(r.num_tokens for r in running)
        engine.step()
    timer.active = False
    ran_captured = captured is not None and captured.num_steps - before == args.steps
    engine.abort_requests(ids)
    parts = timer.per_step_ms(args.steps)
    if ran_captured:
        parts["attention"] = None  # inside the captured step's kernel list, not timed apart
    mean_seqs = seqs / args.steps
    return {
        "batch_size": batch,
        "mean_sequences": mean_seqs,
        "mean_context": context / max(seqs, 1),
        "captured": ran_captured,
        "ms_per_step": parts,
        "tokens_per_s": 1000.0 * mean_seqs / parts["step"],
    }


def run(args: argparse.Namespace) -> int:
    from pagellm.cli import engine_kwargs
    from pagellm.llm import LLM

    sizes = [int(b) for b in args.batch_sizes.split(",")]
    if min(sizes) < 1 or args.steps < 1 or args.context_len < 1:
        raise SystemExit("pagellm bench step: batch sizes, --steps and --context-len must be >= 1")
    kwargs = engine_kwargs(args)
    kwargs["max_num_seqs"] = max(kwargs.get("max_num_seqs") or 0, max(sizes))
    llm = LLM(**kwargs)
    try:
        rows = [profile_batch(llm, b, args) for b in sizes]
        dtype = str(llm.engine.executor.dtype).removeprefix("torch.")
    finally:
        llm.shutdown()
    report = {
        "benchmark": "step",
        "config": {
            "context_len": args.context_len,
            "steps": args.steps,
            "dtype": dtype,
            "model": args.model,
        },  # fmt: skip
        "results": rows,
        "environment": rep.environment(),
    }
    if args.output_json:
        rep.write_report(args.output_json, report)
    print(render(report))
    return 0


def render(report: dict[str, Any]) -> str:
    cfg = report["config"]
    rows = [
        [str(r["batch_size"]), f"{r['mean_sequences']:.1f}", f"{r['mean_context']:.0f}",
         f"{r['ms_per_step']['step']:.1f}",
         *(_ms(r["ms_per_step"][p]) for p in PARTS), f"{r['tokens_per_s']:.1f}",
         "yes" if r["captured"] else "no"]
        for r in report["results"]
    ]  # fmt: skip
    return "\n".join(
        [
            rep.cpu_line(report["environment"]),
            f"pagellm bench step: ms per decode step after {cfg['context_len']}-token prompts, "
            f"dtype={cfg['dtype']}, mean of {cfg['steps']} steps (seqs, context: the mean "
            "sequences a step ran and their mean length)",
            rep.format_table(
                ["batch", "seqs", "context", "step", *PARTS, "tok/s", "captured"], rows
            ),
        ]
    )


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"
