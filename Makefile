# Two commands from a fresh machine: `make demo` and `make test`.
PY      ?= python3.11
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
DB      ?= kvtrace-demo.duckdb

.PHONY: install demo dashboard test bench browser clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV) || python3 -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# The CPU wheel on disk; a bare `torch` would pull a multi-GB CUDA build.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/kvtrace demo --db $(DB)
	@echo "(from this checkout without activating the venv: make dashboard)"

dashboard: $(STAMP)
	$(BIN)/kvtrace dashboard --db $(DB)

# Chromium comes from Debian's packages; playwright drives it with executable_path.
browser:
	@test -x /usr/bin/chromium || (apt-get update -q && apt-get install -y -q chromium)

test: $(STAMP) browser
	$(BIN)/python -m pytest -q

bench: $(STAMP)
	$(BIN)/python bench/run_all.py

clean:
	rm -rf $(VENV) .pytest_cache kvtrace-demo.duckdb test-artifacts
