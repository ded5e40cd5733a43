# The two commands a new user needs: `make serve` and `make test`. Both install whatever is missing
# first (the vLLM environment is cached outside the clone, keyed by requirements/lock.txt).
SHELL := /bin/bash
.DEFAULT_GOAL := help

VENV    := .venv
PY      := $(VENV)/bin/python
PROTOS  := $(wildcard proto/vllm_bridge/v1/*.proto)
STUBS   := $(patsubst proto/%.proto,%_pb2.py,$(PROTOS))
LISTEN  ?= 127.0.0.1:50051
PYTEST_ARGS ?=

# vLLM on these machines: no hub, no telemetry, a small KV cache (see README, "Environment").
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export VLLM_NO_USAGE_STATS := 1
export DO_NOT_TRACK := 1
export VLLM_CPU_KVCACHE_SPACE ?= 1

.PHONY: help env proto test serve bench typecheck clean

help:
	@echo "make serve      install what is missing, then serve the default pool on $(LISTEN)"
	@echo "make test       install what is missing, then run the test suite"
	@echo "make bench      run the benchmarks in bench/"
	@echo "make typecheck  mypy over bridge_server/ and adapters/"

env: $(VENV)/.bridge-stamp

$(VENV)/.bridge-stamp: requirements/lock.txt scripts/ensure-env.sh
	@bash scripts/ensure-env.sh

# Stubs are generated from the .proto by the build and never committed or edited.
proto: $(STUBS)

$(STUBS): $(PROTOS) | env
	@mkdir -p vllm_bridge/v1
	$(PY) -m grpc_tools.protoc -Iproto --python_out=. --pyi_out=. --grpc_python_out=. $(PROTOS)
	@touch vllm_bridge/__init__.py vllm_bridge/v1/__init__.py $(STUBS)

test: proto
	$(PY) -m pytest $(PYTEST_ARGS)

serve: proto
	$(VENV)/bin/vllm-bridge serve --listen $(LISTEN)

bench: proto
	$(PY) -m bench

typecheck: proto
	$(PY) -m mypy

clean:
	rm -rf $(VENV) vllm_bridge .pytest_cache .mypy_cache .hypothesis
