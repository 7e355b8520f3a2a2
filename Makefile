# Set-up and everyday commands. `make run` and `make test` work on a fresh machine.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.installed
TORCH_SPEC ?= torch==2.13.0

.PHONY: run test lint format fetch-model system-deps bench gpu-carry clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# Pin torch first: a loose requirement could pull a multi-GB CUDA build.
	$(PIP) install -q "$(TORCH_SPEC)"
	$(PIP) install -q -e ".[test,cluster]"
	touch $(STAMP)

fetch-model: $(STAMP)
	$(PY) -m pagellm.fetch

run: fetch-model
	$(VENV)/bin/pagellm serve --host 127.0.0.1 --port 8000

# Debian's chromium (the console's browser tests) and nginx (deploy/nginx.conf's tests).
system-deps:
	@if ! command -v chromium >/dev/null || ! test -x /usr/sbin/nginx; then \
		SUDO=$$([ "$$(id -u)" = 0 ] || echo sudo); \
		$$SUDO apt-get update -qq && $$SUDO env DEBIAN_FRONTEND=noninteractive RUNLEVEL=1 apt-get install -y -qq \
			--no-install-recommends chromium nginx; \
	fi

test: fetch-model system-deps
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(PY) -m pytest -q -x

lint: $(STAMP)
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .

format: $(STAMP)
	$(VENV)/bin/ruff format . && $(VENV)/bin/ruff check --fix .

bench: fetch-model
	$(VENV)/bin/pagellm bench throughput --dataset random --input-len 128 --output-len 128 \
		--num-prompts 256 --baseline hf --output-json results/throughput_random.json

# What scripts/gpu_check.sh needs on a CUDA machine that cannot fetch (run there with the
# device tool, carrying .gpu-carry): the default model's tokenizer as HF files, the gguf wheel.
gpu-carry: fetch-model
	rm -rf .gpu-carry && mkdir -p .gpu-carry/wheels
	$(PY) -c "from pagellm.fetch import require_default_model as m; from pagellm.runner.tokenizer import Tokenizer as T; T.load(m(), None).hf.save_pretrained('.gpu-carry/tokenizer')"
	$(PIP) download -q --no-deps -d .gpu-carry/wheels gguf

# Quantized checkpoints of the default model with llm-compressor (scripts/quantize.py), written to
# ~/.cache/pagellm/quantized/smollm2-SCHEME. llm-compressor pins transformers and
# compressed-tensors to other versions than ours, so it lives in a venv of its own.
QVENV := .venv-quantize
QSTAMP := $(QVENV)/.installed
QUANTIZED := $(HOME)/.cache/pagellm/quantized
QUANT_SAMPLES ?= 32
QUANT_TOKENS ?= 256

$(QSTAMP):
	test -x $(QVENV)/bin/python || $(PYTHON) -m venv $(QVENV)
	$(QVENV)/bin/pip install -q --upgrade pip
	$(QVENV)/bin/pip install -q "$(TORCH_SPEC)"
	$(QVENV)/bin/pip install -q llmcompressor==0.14.0.1
	touch $(QSTAMP)

QUANT_SCHEMES := fp8-dynamic fp8-kv w8a8 w4a16 awq
.PHONY: $(addprefix quantize-,$(QUANT_SCHEMES))
$(addprefix quantize-,$(QUANT_SCHEMES)): quantize-%: fetch-model $(QSTAMP)
	$(PY) -m pagellm.fetch sharegpt
	$(QVENV)/bin/python scripts/quantize.py --scheme $* --output $(QUANTIZED)/smollm2-$* \
		--model "$$($(PY) -c 'from pagellm.bench.quantization import float_folder as f; from pagellm.fetch import require_default_model as m; print(f(m()))')" \
		--sharegpt "$$($(PY) -m pagellm.fetch sharegpt | tail -1)" \
		--num-samples $(QUANT_SAMPLES) --max-tokens $(QUANT_TOKENS)

clean:
	rm -rf $(VENV) build *.egg-info
