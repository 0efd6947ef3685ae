# Two commands do all set-up: `make demo` and `make test`. Both are safe to re-run.
SHELL := /bin/bash
VENV := .venv
export DAGSTER_HOME := $(CURDIR)/.dagster_home
export PATH := $(CURDIR)/$(VENV)/bin:$(PATH)

.PHONY: setup demo test unit integration lint proto bench clean

setup:
	@bash scripts/bootstrap.sh

demo: setup
	$(VENV)/bin/siphon-demo

# Two workers, each with its own local stack; a test file stays on one worker (its module fixtures).
test: setup lint
	$(VENV)/bin/python -m pytest -q -p no:cacheprovider -n 2 --dist loadfile

unit: setup
	$(VENV)/bin/python -m pytest -q -p no:cacheprovider tests/unit

integration: setup
	$(VENV)/bin/python -m pytest -q -p no:cacheprovider -n 2 --dist loadfile tests/integration

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/python -m siphon_core.wire.generate --check

proto: setup
	$(VENV)/bin/python -m siphon_core.wire.generate

bench: setup
	$(VENV)/bin/python bench/producer.py
	$(VENV)/bin/python bench/snapshot.py
	$(VENV)/bin/python bench/streaming.py

clean:
	rm -rf $(VENV) .dagster_home .pytest_cache
