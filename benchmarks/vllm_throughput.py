"""vLLM's offline throughput on a workload saved by ``pagellm bench throughput --save-workload``.

Standalone: it imports vllm (and transformers), never pagellm, so it runs in vLLM's own venv.
It writes the same ``engine.*`` figures as pagellm's report, so the two JSON files compare
directly. vLLM loads GGUF only on GPUs (and through a plugin), so by default a ``.gguf`` model is
first dequantized by transformers into an HF safetensors folder, in the benchmark dtype: the same
dense weights pagellm and the HF baseline compute with. See benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import resource
import time
from pathlib import Path
from typing import Any


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", required=True, help="a .gguf file or an HF model folder")
    p.add_argument(
        "--tokenizer", default=None, help="HF tokenizer folder (needed by --gguf-direct)"
    )
    p.add_argument("--workload", required=True, help="JSON from pagellm's --save-workload")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--output-json", required=True)
    p.add_argument("--hf-dir", default=None, help="where a .gguf is dequantized (default: /tmp)")
    p.add_argument("--gguf-direct", action="store_true", help="hand the .gguf to vLLM as it is")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--kv-cache-gib", type=int, default=None, help="sets VLLM_CPU_KVCACHE_SPACE")
    p.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="off by default, as in pagellm",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=0.5,
        help="on vLLM's CPU backend: the fraction of the NUMA node's memory it reserves",
    )
    return p.parse_args(argv)


def load_workload(path: str) -> list[dict[str, Any]]:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def dequantize_gguf(gguf: Path, out_dir: Path, dtype: str) -> Path:
    """Write an HF folder (config, safetensors, tokenizer) for ``gguf``; reused when present."""
    if (out_dir / "config.json").is_file():
        return out_dir
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs = {"gguf_file": gguf.name}
    model = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), dtype=getattr(torch, dtype), **kwargs
    )
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), **kwargs)
    # The weights are dense now; transformers still tags the model as GGUF-quantized and
    # refuses to save it, so drop the tag.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(str(out_dir))
    tokenizer.save_pretrained(str(out_dir))
    return out_dir


def resolve_model(args: argparse.Namespace) -> str:
    model = Path(args.model).expanduser()
    if model.suffix != ".gguf" or args.gguf_direct:
        return str(model)
    out_dir = Path(args.hf_dir) if args.hf_dir else Path("/tmp") / f"{model.stem}-{args.dtype}-hf"
    return str(dequantize_gguf(model, out_dir, args.dtype))


def peak_memory_mib() -> float:
    """Peak RSS of this process plus the peaks of its live children (vLLM's engine core)."""
    total_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    for pid in _descendants(os.getpid()):
        total_kib += _vm_hwm_kib(pid)
    return total_kib / 1024


def _descendants(pid: int) -> list[int]:
    try:
        import psutil
    except ImportError:
        return []
    return [c.pid for c in psutil.Process(pid).children(recursive=True)]


def _vm_hwm_kib(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.kv_cache_gib is not None:
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(args.kv_cache_gib)
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    workload = load_workload(args.workload)
    llm = LLM(
        model=resolve_model(args),
        tokenizer=args.tokenizer,
        dtype=args.dtype,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        enable_prefix_caching=args.enable_prefix_caching,
        seed=args.seed,
        gpu_memory_utilization=args.gpu_memory_utilization,
    )
    prompts = [TokensPrompt(prompt_token_ids=r["prompt_token_ids"]) for r in workload]
    params = [
        SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=r["output_len"])
        for r in workload
    ]
    warm = [TokensPrompt(prompt_token_ids=r["prompt_token_ids"][:16]) for r in workload[:2]]
    llm.generate(
        warm, SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=4), use_tqdm=False
    )
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=True)
    elapsed = time.perf_counter() - start
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    output_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {
        "num_requests": len(outputs),
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "elapsed_s": elapsed,
        "requests_per_s": len(outputs) / elapsed,
        "output_tokens_per_s": output_tokens / elapsed,
        "total_tokens_per_s": (prompt_tokens + output_tokens) / elapsed,
        "peak_memory_mib": peak_memory_mib(),
        "peak_kv_usage_frac": None,  # vLLM's offline API does not expose these
        "kv_waste_frac": None,
        "num_preemptions": None,
        "expected_output_tokens": sum(r["output_len"] for r in workload),
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    engine = run(args)
    import torch
    import vllm

    report = {
        "benchmark": "throughput",
        "system": "vllm",
        "timestamp": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "vllm_version": vllm.__version__,
        "torch_version": torch.__version__,
        "num_threads": torch.get_num_threads(),
        "python_version": platform.python_version(),
        "env": {k: v for k, v in os.environ.items() if k.startswith("VLLM_CPU")},
        "config": vars(args),
        "engine": engine,
    }
    Path(args.output_json).parent.mkdir(parents=True, exist_ok=True)
    with open(args.output_json, "w", encoding="utf-8") as f:
        json.dump(report, f, indent=2)
        f.write("\n")
    print(
        f"vllm: {engine['num_requests']} requests, {engine['output_tokens']} output tokens in "
        f"{engine['elapsed_s']:.2f} s: {engine['requests_per_s']:.2f} req/s, "
        f"{engine['output_tokens_per_s']:.1f} output tok/s, "
        f"{engine['total_tokens_per_s']:.1f} total tok/s, "
        f"peak memory {engine['peak_memory_mib']:.0f} MiB; wrote {args.output_json}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
