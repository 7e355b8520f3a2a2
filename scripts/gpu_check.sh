#!/usr/bin/env bash
# The checks only a CUDA machine can make, as one run (a device lease is minutes long):
#   1. tests/test_gpu.py: greedy on the GPU equals the CPU (fp32; chunked prefill, prefix hits,
#      recompute and swap preemption), the KV cache sized by --gpu-memory-utilization, and with
#      two GPUs or more TP 2 / PP 2 over NCCL equal to one GPU and a killed rank failing the step;
#      --batch-invariant on CUDA (alone == in a batch, bit for bit), and the Triton kernels of
#      tests/test_triton_invariant.py, tests/test_triton_prefill.py and tests/test_triton_quant.py
#      compiled for the card (bf16 too), FP8 through torch._scaled_mm on a Hopper card;
#   2. offline throughput, GPU vs CPU side by side, on a random-weight model of SmolLM2-135M's
#      size (the 98 MB GGUF is over what a device run carries), and on the GPU bf16 against
#      int8 / int4 / FP8 weights kept quantized (the Triton GEMM, FP8 products).
# Here: `make gpu-carry`; there (repo root, carrying .gpu-carry): `bash scripts/gpu_check.sh`.
# Reports land in $OUT (the device tool's folder) or results/gpu.
set -uo pipefail
out=${OUT:-results/gpu}
mkdir -p "$out"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 PAGELLM_TEST_TOKENIZER_DIR=$PWD/.gpu-carry/tokenizer
python3 -c "import gguf" 2>/dev/null || python3 -m pip install -q --no-index --no-deps .gpu-carry/wheels/*.whl
nvidia-smi -L | tee "$out/gpus.txt"
python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py tests/test_triton_invariant.py \
    tests/test_triton_prefill.py tests/test_triton_quant.py 2>&1 | tee "$out/pytest.log"
echo "pytest exit: ${PIPESTATUS[0]}" | tee -a "$out/pytest.log"  # the benchmark runs either way
python3 benchmarks/parallel_step_cost.py --random-even-heads --tokenizer-dir .gpu-carry/tokenizer \
    --num-prompts 256 --variant "GPU=--device cuda" --variant "CPU=--device cpu" \
    --output-dir /tmp/gpu_throughput 2>&1 | tee "$out/throughput.log"
cp /tmp/gpu_throughput/run*.json /tmp/gpu_throughput/summary.txt "$out/"
# quantized weights on the card: 256 sequences, then one at a time (decode-bound)
for streams in 256 1; do
    prompts=$([ "$streams" = 1 ] && echo 4 || echo 256)
    python3 benchmarks/parallel_step_cost.py --random-even-heads --tokenizer-dir .gpu-carry/tokenizer \
        --num-prompts "$prompts" --variant "GPU bf16=--device cuda --max-num-seqs $streams" \
        --variant "GPU int8=--device cuda --max-num-seqs $streams --quantization int8" \
        --variant "GPU int4=--device cuda --max-num-seqs $streams --quantization int4" \
        --variant "GPU fp8=--device cuda --max-num-seqs $streams --quantization fp8" \
        --output-dir "/tmp/gpu_quant_$streams" 2>&1 | tee "$out/quant_$streams.log"
    cp "/tmp/gpu_quant_$streams/summary.txt" "$out/quant_${streams}_summary.txt"
done
