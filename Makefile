# Two Quickstart commands, each doing its own set-up in a virtual environment inside the checkout:
#   make demo   prepare tiny Shakespeare, train the CPU recipe, print a sample
#   make test   run the test suite (offline) and the linter
#   make bench  the benchmarks of docs/benchmarks.md (several minutes on 2 cores)
# The environment reuses an installed torch when there is one (e.g. a CUDA build on a GPU machine);
# otherwise it installs torch==2.13.0 first, so pip never pulls a multi-GB CUDA build on a CPU machine. The set-up
# also builds the native decoding step for this CPU (~15 s on 2 cores; without a C++ compiler it says so and decoding
# uses the other backends).

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python

.PHONY: demo test test-fast setup-test lint bench clean-venv FORCE

# Python's bytecode caches on, even where the environment turns them off: the suite's hundreds of processes would each
# compile the package (and pytest its rewritten test modules) again.
unexport PYTHONDONTWRITEBYTECODE

# --no-compile: Python compiles a module's bytecode when it is first imported, so pip need not compile every file of
# every package (torch's thousands) at install. A new venv gets today's pip first: the one Python bundles (3.11's:
# 23.2) takes about twice as long over the packages below. Only a saving, so it gives up at once where the index is
# out of reach (an offline machine whose packages are all installed already).
$(VENV)/.torch:
	test -x $(PY) || { $(PYTHON) -m venv --system-site-packages $(VENV) \
	  && { $(PY) -m pip install --quiet --upgrade --retries 0 --timeout 20 pip \
	       || echo "note: could not upgrade pip; the venv's own installs"; }; }
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install --quiet --no-compile torch==2.13.0
	touch $@

$(VENV)/.deps: $(VENV)/.torch requirements.txt
	$(PY) -m pip install --quiet --no-compile -r requirements.txt
	touch $@

$(VENV)/.runtime: $(VENV)/.deps pyproject.toml
	$(PY) -m pip install --quiet --no-compile --no-deps -e .
	touch $@

# The native step's build of this checkout's C++ files and flags (gptkit/infer/native/build.py holds them); other
# checkouts' builds lie in directories of their own, so switching between checkouts rebuilds nothing. It runs from the
# checkout (python -m), so it starts without waiting for the package's own install. The build lies outside the
# checkout, under torch's extensions directory: the stamp holds its library's path ("none": no compiler here), and a
# stamp whose library is gone (a cleared cache) is made again.
NATIVE_LIBRARY := $(shell cat $(VENV)/.native 2>/dev/null)
NATIVE_GONE := $(if $(filter none,$(NATIVE_LIBRARY)),,$(if $(wildcard $(NATIVE_LIBRARY)),,FORCE))
$(VENV)/.native: $(VENV)/.deps $(wildcard gptkit/infer/native/csrc/*) gptkit/infer/native/build.py $(NATIVE_GONE)
	$(PY) -m gptkit.infer.native --build --record=$@

FORCE:

# The playground test drives a real headless browser: Debian's chromium and chromium-driver, installed here when
# missing and we are root with apt-get (elsewhere the test skips, saying what it needs).
$(VENV)/.test: $(VENV)/.runtime requirements-test.txt
	$(PY) -m pip install --quiet --no-compile -r requirements-test.txt
	@if command -v chromedriver >/dev/null 2>&1 && { command -v chromium || command -v chromium-browser; } >/dev/null 2>&1; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	  echo "installing chromium and chromium-driver for the playground test"; \
	  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >/dev/null; } \
	    || echo "note: could not install chromium; the playground browser test will be skipped"; \
	else echo "note: no chromium/chromedriver; the playground browser test will be skipped (apt-get install chromium chromium-driver)"; fi
	touch $@

# torch's bytecode, compiled while pip installs the rest (found, not imported, so pip's work cannot disturb it): else
# the suite's first processes, started together, each compile the torch modules they import. Without it (or where
# torch's folder is read-only) every import still works; the cache only saves time.
$(VENV)/.torch-bytecode: $(VENV)/.torch
	$(PY) -c "import compileall, importlib.util, os; compileall.compile_dir(os.path.dirname(importlib.util.find_spec('torch').origin), quiet=2)"
	touch $@

# Two jobs at a time: torch's bytecode beside the runtime's install, then the native step's build (the longest step,
# so named first: it takes the first free job) beside the package's install and the test dependencies.
setup-test:
	$(MAKE) --no-print-directory -j2 $(VENV)/.native $(VENV)/.test $(VENV)/.torch-bytecode

demo: $(VENV)/.runtime $(VENV)/.native
	$(PY) prepare_data/shakespeare_char.py
	$(PY) train.py config/train_shakespeare_char_cpu.py --overwrite=True
	$(PY) sample.py --out_dir=out-shakespeare-char-cpu --num_samples=1 --max_new_tokens=500 --seed=1337

# Two test processes (pytest-xdist): in-process tests use one torch thread each (tests/conftest.py). loadgroup
# keeps the tests that share a module's fixture (a trained run, a server) in one process (tests/conftest.py).
test: setup-test
	$(PY) -m ruff check .
	$(PY) -m pytest -q -n 2 --dist=loadgroup

# The daily tier, under a minute on 2 cores: each test function once (a parametrized one, its first case), in-process,
# in two processes; a test that starts a process, a server or a torch.compile skips itself (tests/conftest.py) and the
# `heavy` ones are left out. CI runs the whole suite (make test).
test-fast: setup-test
	$(PY) -m ruff check .
	GPTKIT_FAST_TESTS=1 $(PY) -m pytest -q -n 2 --dist=loadgroup -m "not heavy"

lint: $(VENV)/.test
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

bench: setup-test
	$(PY) prepare_data/shakespeare_char.py
	$(PY) benchmarks/bench.py sample
	$(PY) benchmarks/bench.py quality --config=config/train_shakespeare_char_cpu.py --config=config/train_shakespeare_char_cpu_best.py
	$(PY) benchmarks/bench_prepare.py --json_out=bench_results/prepare.json
	$(PY) benchmarks/bench_serve.py --json_out=bench_results/serve.json
	$(PY) benchmarks/bench_serve.py --chat=True --json_out=bench_results/serve_chat.json
	$(PY) benchmarks/bench_chat.py --json_out=bench_results/chat.json

clean-venv:
	rm -rf $(VENV)
