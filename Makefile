# The only command surface. `make test` and `make demo` set up .venv themselves.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PROTOS := $(wildcard proto/rpcdist/v1/*.proto)

.PHONY: test demo bench lint fmt proto proto-check test-gpu test-fast clean venv docs docs-serve test-torch-suite

# pip's own output goes to $(PIP_LOG); it is shown only when pip fails.
PIP_LOG := $(VENV)/pip-install.log
PIP := $(BIN)/python -m pip install -qq --disable-pip-version-check
QUIET_PIP = >$(PIP_LOG) 2>&1 || { cat $(PIP_LOG); echo "pip failed (log: $(PIP_LOG))"; exit 1; }

$(STAMP): pyproject.toml
	@echo "Setting up $(VENV): rpcdist and its development tools (first run, or pyproject.toml changed)..."
	@test -x $(BIN)/python || $(PY) -m venv $(VENV)
	@$(PIP) --upgrade pip $(QUIET_PIP)
	@$(PIP) -e '.[dev]' $(QUIET_PIP)
	@touch $(STAMP)

venv: $(STAMP)

# The documentation tools (the `docs` extra), installed on first use of `make docs`.
DOCS_STAMP := $(VENV)/.installed-docs

$(DOCS_STAMP): $(STAMP)
	@echo "Installing the documentation tools into $(VENV) (first run only)..."
	@$(PIP) -e '.[dev,docs]' $(QUIET_PIP)
	@touch $(DOCS_STAMP)

# The examples' extras (tqdm, matplotlib, scikit-learn), installed on first use of `make demo`.
EXAMPLES_STAMP := $(VENV)/.installed-examples

$(EXAMPLES_STAMP): $(STAMP)
	@echo "Installing the examples' extras into $(VENV): tqdm, matplotlib, scikit-learn (first run only)..."
	@$(PIP) -e '.[dev,examples]' $(QUIET_PIP)
	@touch $(EXAMPLES_STAMP)

# PyTorch (the CPU build), for the tests that check rpcdist against PyTorch and the
# rpcdist.torch interop tests; installed on first use of `make test` (with expecttest, which
# PyTorch's own RPC tests in tests/torch_suite import). Without it
# (`make test TORCH=`, or no wheel to be had) those tests skip, saying why.
TORCH ?= torch==2.13.0
TORCH_STAMP := $(VENV)/.installed-torch

$(TORCH_STAMP): $(STAMP)
	@echo "Installing $(TORCH) into $(VENV) for the PyTorch comparison tests (first run only)..."
	@if $(PIP) '$(TORCH)' expecttest >$(PIP_LOG) 2>&1; then touch $(TORCH_STAMP); else \
	  echo "could not install $(TORCH) (log: $(PIP_LOG)): the PyTorch tests will skip"; fi

# The site, built with warnings as errors (mkdocs.yml sets strict), into build/site.
docs: $(DOCS_STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet
	@echo "docs: open build/site/index.html (or run: make docs-serve)"

# The site on http://127.0.0.1:8000, rebuilt on every change.
docs-serve: $(DOCS_STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs serve --strict

# The suite runs on the default (plain-socket) transport; the RPC, RRef and security
# tests run once more on the gRPC-stream transport.
GRPC_SUITE := tests/test_rpc.py tests/test_multiprocess.py tests/rref tests/test_security.py
# Same-host workers use Unix sockets by default; this pass keeps loopback TCP
# (the path between hosts) under test too.
TCP_SUITE := tests/test_rpc.py tests/test_multiprocess.py tests/test_tcp_transport.py \
	tests/test_sync_calls.py tests/collectives/test_coll_inprocess.py
# rpc_sync drives a connection of its own from the calling thread where it can;
# this pass keeps its other path (through the agent loop) under test as well.
LOOP_SYNC_SUITE := tests/test_rpc.py tests/test_multiprocess.py tests/rref/test_rref_basic.py

# Byte-compile the sources the way an installed package is (pip compiles wheels'
# files on install): every worker process a test, a benchmark or the demo starts
# then reads .pyc files instead of compiling ~100 modules afresh, which also keeps
# PYTHONDONTWRITEBYTECODE environments from timing rpcdist's compiler. Files
# already compiled and unchanged are skipped.
PYC = $(BIN)/python -m compileall -q -j 0 rpcdist tests benchmarks examples

test: $(STAMP) $(if $(TORCH),$(TORCH_STAMP))
	@$(PYC)
	$(BIN)/python -m pytest -q --durations=15
	RPCDIST_TRANSPORT=grpc $(BIN)/python -m pytest -q $(GRPC_SUITE)
	RPCDIST_LOCAL_SOCKETS=0 $(BIN)/python -m pytest -q $(TCP_SUITE)
	RPCDIST_SYNC_CHANNELS=0 $(BIN)/python -m pytest -q $(LOOP_SYNC_SUITE)

test-fast: $(STAMP)
	@$(PYC)
	$(BIN)/python -m pytest -q -m "not multiprocess and not slow"

test-gpu: $(STAMP)
	@$(PYC)
	$(BIN)/python -m pytest -q -m gpu

# Parameter-server training with distributed autograd on the digits (examples/demo.py).
demo: $(EXAMPLES_STAMP)
	@$(PYC)
	@$(BIN)/python examples/demo.py

bench: $(STAMP)
	-$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q torch==2.13.0 || echo "torch not installable: baselines skipped"
	@$(PYC)
	$(BIN)/python benchmarks/run_all.py

lint: $(STAMP)
	$(BIN)/ruff check rpcdist tests examples benchmarks
	$(BIN)/ruff format --check rpcdist tests examples benchmarks
	$(BIN)/mypy
	$(BIN)/python -m pytest -q -p no:cacheprovider tests/test_layers.py

fmt: $(STAMP)
	$(BIN)/ruff format rpcdist tests examples benchmarks
	$(BIN)/ruff check --fix rpcdist tests examples benchmarks

proto: $(STAMP)
	rm -rf build/proto_gen && mkdir -p build/proto_gen
	$(BIN)/python -m grpc_tools.protoc -Iproto --python_out=build/proto_gen --pyi_out=build/proto_gen $(PROTOS)
	cp build/proto_gen/rpcdist/v1/*_pb2.py build/proto_gen/rpcdist/v1/*_pb2.pyi rpcdist/_proto/

proto-check: $(STAMP)
	rm -rf build/proto_check && mkdir -p build/proto_check
	$(BIN)/python -m grpc_tools.protoc -Iproto --python_out=build/proto_check --pyi_out=build/proto_check $(PROTOS)
	for f in build/proto_check/rpcdist/v1/*_pb2.py build/proto_check/rpcdist/v1/*_pb2.pyi; do \
	  diff -u rpcdist/_proto/$$(basename $$f) $$f || { echo "proto drift: run make proto"; exit 1; }; done
	@echo "generated protobuf code is up to date"

clean:
	rm -rf build .pytest_cache .mypy_cache .ruff_cache .hypothesis

# PyTorch's own RPC test suite (the nine classes of tests/torch_suite) run unchanged
# against rpcdist.torch and against PyTorch, one test at a time with a hard timeout,
# each forked from a parent that imported torch once (--start spawn: as PyTorch's own
# driver, ~18 s a test); records in tests/torch_suite/results, from which it rewrites
# docs/compatibility.md. Tens of minutes on a small machine; JOBS=4 where cores allow.
JOBS ?= 1
test-torch-suite: $(STAMP) $(TORCH_STAMP)
	@$(BIN)/python -c "import expecttest" 2>/dev/null || $(PIP) expecttest $(QUIET_PIP)
	@$(PYC)
	$(BIN)/python tests/torch_suite/run_suite.py --flavor both --jobs $(JOBS) --write
