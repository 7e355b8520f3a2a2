#!/usr/bin/env bash
# The checks only a CUDA machine can make, as one run (a device lease is minutes long):
#   1. tests/test_gpu.py: greedy on the GPU equals the CPU (fp32; chunked prefill, prefix hits,
#      recompute and swap preemption), the KV cache sized by --gpu-memory-utilization, and with
#      two GPUs or more TP 2 / PP 2 over NCCL equal to one GPU and a killed rank failing the step;
#      --batch-invariant on CUDA (alone == in a batch, bit for bit), and the Triton kernels of
#      tests/test_triton_invariant.py and tests/test_triton_prefill.py compiled for the card;
#   2. offline throughput, GPU vs CPU side by side, on a random-weight model of SmolLM2-135M's
#      size (the 98 MB GGUF is over what a device run carries).
# Here: `make gpu-carry`; there (repo root, carrying .gpu-carry): `bash scripts/gpu_check.sh`.
# Reports land in $OUT (the device tool's folder) or results/gpu.
set -uo pipefail
out=${OUT:-results/gpu}
mkdir -p "$out"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 PAGELLM_TEST_TOKENIZER_DIR=$PWD/.gpu-carry/tokenizer
python3 -c "import gguf" 2>/dev/null || python3 -m pip install -q --no-index --no-deps .gpu-carry/wheels/*.whl
nvidia-smi -L | tee "$out/gpus.txt"
python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py tests/test_triton_invariant.py \
    tests/test_triton_prefill.py 2>&1 | tee "$out/pytest.log"
echo "pytest exit: ${PIPESTATUS[0]}" | tee -a "$out/pytest.log"  # the benchmark runs either way
python3 benchmarks/parallel_step_cost.py --random-even-heads --tokenizer-dir .gpu-carry/tokenizer \
    --num-prompts 256 --variant "GPU=--device cuda" --variant "CPU=--device cpu" \
    --output-dir /tmp/gpu_throughput 2>&1 | tee "$out/throughput.log"
cp /tmp/gpu_throughput/run*.json /tmp/gpu_throughput/summary.txt "$out/"
