# Two commands do all the set-up on a fresh machine: `make run` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: run test unit integration lint schemas broker bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $(STAMP)

run: $(STAMP)
	$(BIN)/mmcache serve

broker: $(STAMP)
	$(BIN)/mmcache broker

test: $(STAMP)
	$(BIN)/python -m pytest -q

unit: $(STAMP)
	$(BIN)/python -m pytest -q tests/unit

integration: $(STAMP)
	$(BIN)/python -m pytest -q tests/integration

lint: $(STAMP)
	$(BIN)/ruff check stream tests

schemas: $(STAMP)
	$(BIN)/python -m stream.schemas_gen

clean:
	rm -rf $(VENV) .mmcache .pytest_cache

bench: $(STAMP)
	$(BIN)/mmcache bench $(if $(QUICK),--quick)
