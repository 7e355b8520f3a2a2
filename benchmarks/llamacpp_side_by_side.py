"""pagellm vs llama.cpp (llama-cpp-python) on one GGUF, one request at a time, in one run.

The same random prompts (token ids, ``--input-len`` each) go to pagellm's offline engine (the GGUF
kept quantized, in each ``--dtypes``) and to llama.cpp through llama-cpp-python, which runs in
its own virtualenv (``--llamacpp-python``; it compiles llama.cpp from source, so it lives outside
the project's venv):

    python3 -m venv /tmp/llamacpp-venv && /tmp/llamacpp-venv/bin/pip install llama-cpp-python

Both decode ``--output-len`` tokens greedily with EOS ignored, on every core. Per request: the
time to the first token (the prompt's prefill) and the decode rate after it; the table is headed
by the CPU and gives pagellm's figures as ratios of llama.cpp's. JSON to ``--output-json``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
from pathlib import Path

LLAMACPP_RUNNER = r"""
import json, sys, time
from llama_cpp import Llama

cfg = json.loads(sys.argv[1])
llm = Llama(model_path=cfg["model"], n_ctx=cfg["n_ctx"], n_threads=cfg["threads"],
            n_threads_batch=cfg["threads"], n_batch=512, verbose=False)
results = []
for i, prompt in enumerate([cfg["prompts"][0]] + cfg["prompts"]):  # the first is a warm-up
    llm.reset()
    start = time.perf_counter()
    first = None
    n = 0
    for _ in llm.generate(prompt, top_k=1, temp=0.0, reset=True):
        n += 1
        if first is None:
            first = time.perf_counter()
        if n == cfg["output_len"]:
            break
    end = time.perf_counter()
    if i:
        results.append({"ttft_s": first - start, "decode_s": end - first, "tokens": n})
print(json.dumps(results))
"""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="GGUF file (default: the embedded SmolLM2)")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--num-prompts", type=int, default=5)
    p.add_argument("--dtypes", default="float32,bfloat16", help="pagellm's activation dtypes")
    p.add_argument("--llamacpp-python", default="/tmp/llamacpp-venv/bin/python")
    p.add_argument("--output-json", default=None)
    return p.parse_args(argv)


def prompts(n: int, length: int) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(1000, 30000) for _ in range(length)] for _ in range(n)]


def run_pagellm(model: str, dtype: str, work: list[list[int]], output_len: int) -> list[dict]:
    from pagellm import LLM, SamplingParams

    llm = LLM(model, dtype=dtype, max_model_len=1024, kv_cache_memory=0.5)
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    llm.generate(work[:1], params, use_tqdm=False)  # warm-up: kernels built and loaded
    results = []
    for prompt in work:
        out = llm.generate([prompt], params, use_tqdm=False)[0]
        m = out.metrics  # the engine's own clock: arrival, first token, finish
        ttft = m.first_token_time - m.arrival_time
        decode = m.finish_time - m.first_token_time
        results.append(
            {"ttft_s": ttft, "decode_s": decode, "tokens": len(out.outputs[0].token_ids)}
        )
    llm.shutdown()
    return results


def run_llamacpp(python: str, model: str, work: list[list[int]], output_len: int) -> list[dict]:
    cfg = {"model": model, "prompts": work, "output_len": output_len, "threads": os.cpu_count(),
           "n_ctx": 1024}  # fmt: skip
    proc = subprocess.run([python, "-c", LLAMACPP_RUNNER, json.dumps(cfg)], capture_output=True,
                          text=True, timeout=3600)  # fmt: skip
    if proc.returncode != 0:
        raise SystemExit(f"llama.cpp run failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def summary(results: list[dict]) -> dict:
    return {
        "ttft_ms_p50": 1000 * statistics.median(r["ttft_s"] for r in results),
        "decode_tok_per_s_p50": statistics.median(
            (r["tokens"] - 1) / r["decode_s"] for r in results
        ),
        "request_tok_per_s_p50": statistics.median(
            r["tokens"] / (r["ttft_s"] + r["decode_s"]) for r in results
        ),
    }


def main(argv: list[str] | None = None) -> int:
    from pagellm.bench import report as rep
    from pagellm.fetch import require_default_model

    args = parse_args(argv)
    model = str(Path(args.model).expanduser() if args.model else require_default_model())
    work = prompts(args.num_prompts, args.input_len)
    env = rep.environment()
    runs: dict[str, dict] = {}
    runs["llama.cpp"] = summary(run_llamacpp(args.llamacpp_python, model, work, args.output_len))
    for dtype in (d.strip() for d in args.dtypes.split(",") if d.strip()):
        runs[f"pagellm {dtype}"] = summary(run_pagellm(model, dtype, work, args.output_len))
    base = runs["llama.cpp"]
    rows = []
    for name, r in runs.items():
        rows.append([
            name,
            f"{r['ttft_ms_p50']:.1f} ({r['ttft_ms_p50'] / base['ttft_ms_p50']:.2f}x)",
            f"{r['decode_tok_per_s_p50']:.1f} "
            f"({r['decode_tok_per_s_p50'] / base['decode_tok_per_s_p50']:.2f}x)",
            f"{r['request_tok_per_s_p50']:.1f} "
            f"({r['request_tok_per_s_p50'] / base['request_tok_per_s_p50']:.2f}x)",
        ])  # fmt: skip
    print(rep.cpu_line(env))
    print(f"model: {model}; {args.num_prompts} requests one at a time, "
          f"{args.input_len} in / {args.output_len} out, greedy")  # fmt: skip
    headers = ["engine", "TTFT ms p50", "decode tok/s p50", "out tok/s per request p50"]
    print(rep.format_table(headers, rows))
    print("(ratios against llama.cpp)")
    if args.output_json:
        rep.write_report(args.output_json, {"environment": env, "model": model,
                                            "args": vars(args), "runs": runs})  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
