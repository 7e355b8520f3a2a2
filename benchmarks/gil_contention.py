"""What does the GIL cost the engine thread when the HTTP side is busy? Thread vs process.

The server runs the engine in a background thread next to the HTTP event loop. Whatever that
loop does (parse requests, tokenize, build and send SSE events) costs the engine twice over in
that layout: CPU (a core the engine's OpenMP team wanted) and the GIL (the engine thread waits
to dispatch its next op while the loop runs Python). A separate engine process, as vLLM v1 runs
it, removes only the second. This measures both on the real engine: decode steps of a batch of
``--batch`` sequences, timed

- alone;
- with a load in a *thread* of the same process (pure-Python work: holds the GIL), and
- with the same load in a *separate process* (competes for cores only),

at each ``--fractions`` of one core (what ``pagellm bench serve`` reports as the HTTP thread's
CPU). thread - process is the GIL's own share. Rounds alternate the conditions so the machine's
drift hits them alike; each condition starts from fresh requests (same prompts, same context).

    python benchmarks/gil_contention.py --fractions 0.1,0.25 --output-json results/gil.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import random
import statistics
import threading
import time
from pathlib import Path

PERIOD_S = 0.01
"""The load works ``fraction * PERIOD_S`` then sleeps the rest of each period."""


def python_load(fraction: float, stop) -> None:
    """Busy pure-Python work for ``fraction`` of each period (it holds the GIL while busy)."""
    while not stop.is_set():
        start = time.perf_counter()
        busy_until = start + fraction * PERIOD_S
        count = 0
        while time.perf_counter() < busy_until:
            count += 1
        time.sleep(max(0.0, start + PERIOD_S - time.perf_counter()))


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=100)
    p.add_argument("--steps", type=int, default=40, help="timed decode steps per condition")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--fractions", default="0.1,0.25", help="load, as fractions of one core")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--output-json", default=None)
    return p.parse_args()


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        from pagellm import LLM, SamplingParams

        self.args = args
        self.llm = LLM(dtype=args.dtype, max_model_len=2048)
        rng = random.Random(0)
        self.prompts = [
            [rng.randrange(100, 40000) for _ in range(args.prompt_len)] for _ in range(args.batch)
        ]
        self.params = SamplingParams(temperature=0, max_tokens=args.steps + 8, ignore_eos=True)
        self.runs = 0

    def decode_step_ms(self, start_load, stop_load) -> float:
        """Fresh requests, prefill untimed, then the mean time of ``steps`` decode steps."""
        engine = self.llm.engine
        self.runs += 1
        ids = [f"r{self.runs}-{i}" for i in range(len(self.prompts))]
        for rid, prompt in zip(ids, self.prompts, strict=True):
            engine.add_request(rid, prompt, self.params)
        while engine.scheduler.waiting or any(
            r.num_computed_tokens < len(r.prompt_token_ids) for r in engine.scheduler.running
        ):
            engine.step()
        engine.step()
        start_load()
        start = time.perf_counter()
        for _ in range(self.args.steps):
            engine.step()
        elapsed = time.perf_counter() - start
        stop_load()
        for rid in ids:
            engine.abort(rid)
        return 1000.0 * elapsed / self.args.steps


def in_thread(fraction: float):
    stop = threading.Event()
    worker = threading.Thread(target=python_load, args=(fraction, stop), daemon=True)
    return worker.start, lambda: (stop.set(), worker.join())


def in_process(fraction: float):
    ctx = multiprocessing.get_context("spawn")
    stop = ctx.Event()
    worker = ctx.Process(target=python_load, args=(fraction, stop), daemon=True)
    worker.start()  # before the prefill: a spawned interpreter takes a while to come up
    time.sleep(1.0)

    def stop_load() -> None:
        stop.set()
        worker.join()

    return (lambda: None), stop_load


def main() -> int:
    args = parse_args()
    fractions = [float(f) for f in args.fractions.split(",")]
    bench = Bench(args)
    bench.decode_step_ms(lambda: None, lambda: None)  # warm-up
    results: dict[str, list[float]] = {"alone": []}
    for _ in range(args.rounds):
        results["alone"].append(bench.decode_step_ms(lambda: None, lambda: None))
        for f in fractions:
            for layout, make in (("thread", in_thread), ("process", in_process)):
                start, stop = make(f)
                results.setdefault(f"{layout} {f:g}", []).append(bench.decode_step_ms(start, stop))
    alone = statistics.median(results["alone"])
    rows = []
    for name, values in results.items():
        med = statistics.median(values)
        rows.append({"condition": name, "median_step_ms": med, "vs_alone": med / alone})
    for f in fractions:
        thread = statistics.median(results[f"thread {f:g}"])
        process = statistics.median(results[f"process {f:g}"])
        rows.append(
            {"condition": f"GIL share at {f:g} core", "median_step_ms": thread - process,
             "vs_alone": (thread - process) / alone}
        )  # fmt: skip
    print(f"batch {args.batch}, {args.steps} decode steps per run, {args.rounds} rounds")
    print(f"{'condition':28s} {'step ms':>9s} {'vs alone':>9s}")
    for row in rows:
        print(f"{row['condition']:28s} {row['median_step_ms']:9.1f} {row['vs_alone']:9.3f}")
    if args.output_json:
        out = {"config": vars(args), "runs_ms": results, "summary": rows}
        Path(args.output_json).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
