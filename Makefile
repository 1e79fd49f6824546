# Two commands: `make demo` (the main job) and `make test` (the tests). Each installs what it needs.
PY        ?= python3
VENV      ?= .venv
BIN       := $(VENV)/bin
STAMP     := $(VENV)/.lockstep-installed
CONFIG    ?= configs/arith-tiny.yaml
ARGS      ?=
# pytest workers: much of the suite waits on subprocesses and servers, so two workers fit two cores
TEST_WORKERS ?= 2
# A CPU build of torch unless a GPU is present: torch==2.13.0 is the CPU wheel on local disk here;
# an unpinned torch would pull a multi-GB CUDA build.
TORCH_SPEC ?= $(shell if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then echo "torch"; else echo "torch==2.13.0"; fi)

export PREFECT_SERVER_ANALYTICS_ENABLED := false
export DO_NOT_TRACK := 1
export PREFECT_HOME ?= $(CURDIR)/.prefect
export PREFECT_LOGGING_LEVEL ?= WARNING
# a loaded 2-core machine can take longer than the 20 s default to start the ephemeral API (seen in tests)
export PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS ?= 90
export TOKENIZERS_PARALLELISM := false
export PYTHONUNBUFFERED := 1

.PHONY: install demo test lint clean services services-stop

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q -e ".[dev]"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/lockstep train $(CONFIG) $(ARGS)

test: $(STAMP)
	$(BIN)/python -m pytest -q -ra -n $(TEST_WORKERS) --dist worksteal --durations=15 tests

lint: $(STAMP)
	$(BIN)/ruff check . && $(BIN)/ruff format --check .

services: $(STAMP)
	infra/services.sh start

services-stop:
	infra/services.sh stop

clean:
	rm -rf lake mlflow.db .prefect
