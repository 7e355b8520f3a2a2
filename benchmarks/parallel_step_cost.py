"""The cost of tensor/pipeline parallelism on this machine: `pagellm bench throughput` with
each --variant's flags on the same workload, one after another, reporting throughput and the
mean engine step (execute) time side by side. On a CPU the ranks share the cores (each gets
cores / N torch threads), so this measures what the collectives and the extra processes cost
(and, for pipelines, what micro-batching wins back), not a speed-up.

SmolLM2-135M has 9 heads and 3 KV heads: TP 3 is its only split. --random-even-heads builds a
random-weight model of the same size with 8 heads and 4 KV heads (head_dim 72) so that TP 2 can
be measured too. --tokenizer-dir gives that model a saved HF tokenizer instead of the default
model's (on a machine the GGUF cannot travel to: scripts/gpu_check.sh).

    python benchmarks/parallel_step_cost.py --variant "TP 1=" \
        --variant "TP 3=--tensor-parallel-size 3" --output-dir results/tp_default
    python benchmarks/parallel_step_cost.py --random-even-heads --variant "TP 1=" \
        --variant "TP 2=--tensor-parallel-size 2" --output-dir results/tp_even
    python benchmarks/parallel_step_cost.py --variant "PP 1=" \
        --variant "PP 2, 1 micro-batch=--pipeline-parallel-size 2 --pipeline-microbatches 1" \
        --variant "PP 2, 2 micro-batches=--pipeline-parallel-size 2 --pipeline-microbatches 2" \
        --output-dir results/pp_default
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
from pathlib import Path

from pagellm.bench.report import format_table

PAGELLM = [sys.executable, "-m", "pagellm.cli"]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M")
    p.add_argument("--random-even-heads", action="store_true")
    p.add_argument("--tokenizer-dir", default=None, help="for --random-even-heads")
    p.add_argument("--variant", action="append", default=[], metavar="LABEL=FLAGS",
                   help="a run: its label and its engine flags (repeat; the first is the base)")  # fmt: skip
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--output-dir", default="results/parallel_step_cost")
    return p.parse_args()


def build_even_heads_model(out: Path, tokenizer_dir: str | None = None) -> Path:
    """SmolLM2-135M's shape (576 hidden, 30 layers, 1536 MLP) with 8 heads / 4 KV heads."""
    import torch
    import transformers

    from pagellm.fetch import require_default_model
    from pagellm.runner.tokenizer import Tokenizer

    if (out / "config.json").exists():
        return out
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
        num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=2048,
        rms_norm_eps=1e-5, tie_word_embeddings=True, architectures=["LlamaForCausalLM"],
        bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(str(out), safe_serialization=True)
    if tokenizer_dir:
        transformers.AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(str(out))
    else:
        Tokenizer.load(require_default_model(), None).hf.save_pretrained(str(out))
    return out


def main() -> int:
    args = parse_args()
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    model = args.model
    if args.random_even_heads:
        model = str(build_even_heads_model(out / "random-even-heads", args.tokenizer_dir))
    workload = out / "workload.json"
    runs = []
    variants = args.variant or ["TP 1=", "TP 3=--tensor-parallel-size 3"]
    for i, variant in enumerate(variants):
        label, _, flags = variant.partition("=")
        report = out / f"run{i}.json"
        cmd = [*PAGELLM, "bench", "throughput", "--dataset", "random", "--num-prompts",
               str(args.num_prompts), "--input-len", str(args.input_len), "--output-len",
               str(args.output_len), "--dtype", args.dtype, *shlex.split(flags),
               "--output-json", str(report), "--no-progress"]  # fmt: skip
        cmd += (
            ["--workload", str(workload)]
            if workload.exists()
            else ["--save-workload", str(workload)]
        )
        if model:
            cmd += ["--model", model]
        subprocess.run(cmd, check=True)
        runs.append((label, json.loads(report.read_text())))
    base = runs[0][1]["engine"]
    rows = []
    for label, r in runs:
        e = r["engine"]
        step_ms = 1000 * e["engine_execute_s"] / max(1, e["num_steps"])
        base_step = 1000 * base["engine_execute_s"] / max(1, base["num_steps"])
        rows.append([
            label, f"{e['output_tokens_per_s']:.1f}",
            f"{e['output_tokens_per_s'] / base['output_tokens_per_s']:.3f}",
            str(e["num_steps"]), f"{step_ms:.1f}", f"{step_ms / base_step:.2f}",
        ])  # fmt: skip
    headers = ["run", "out tok/s", "vs first", "steps", "ms/step", "vs first"]
    table = format_table(headers, rows)
    print(table)
    (out / "summary.txt").write_text(table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
