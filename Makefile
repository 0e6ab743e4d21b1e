# kvpool: `make run` and `make test` work on a fresh clone; everything else is optional.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
REQS := requirements/client.txt requirements/server.txt requirements/gpu.txt requirements/loadgen.txt requirements/dev.txt

.PHONY: help setup test run bench bench-service experiments proto lint-proto docker-up docker-down clean

help:
	@echo "make run     start a server (GPU if present, else host memory) and run the 100-completion simulation"
	@echo "make test    run the whole test suite (no GPU needed)"
	@echo "make bench   in-process core benchmark; make bench-service: gRPC benchmark"

$(STAMP): $(REQS) common/pyproject.toml client/pyproject.toml server/pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements/dev.txt
	$(PY) -m pip install -q --no-deps --force-reinstall -e common -e client -e server
	touch $(STAMP)

setup: $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q tests

run: $(STAMP)
	$(PY) scripts/run_demo.py

bench: $(STAMP)
	$(PY) benchmarks/bench_core.py

# Pinned (server on CPU 0, clients on CPU 1) where there are two CPUs: steadier figures (docs/service-bench.md).
bench-service: $(STAMP)
	$(PY) benchmarks/bench_service.py $(shell [ $$(nproc) -ge 2 ] && echo --pin)

experiments: $(STAMP)
	$(PY) benchmarks/experiments.py capacity --requests 2000 --pool-blocks 4096 --json out/exp/capacity.json
	$(PY) benchmarks/experiments.py sharing --completions 400 --json out/exp/sharing.json

lint-proto: $(STAMP)
	cd protos && ../$(VENV)/bin/buf lint

proto: $(STAMP)
	$(PY) -m grpc_tools.protoc -I protos --python_out=common --pyi_out=common --grpc_python_out=common protos/kvpool/v1/kvpool.proto

docker-up:
	docker compose -f docker/compose.yaml up --build -d

docker-down:
	docker compose -f docker/compose.yaml down -v

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
