# musebench: two commands on a fresh machine: `make install`, then `make test`.
PYTHON ?= python3
PIP := $(PYTHON) -m pip
# The CPU build on machines without a GPU; a machine that already has torch keeps its own.
TORCH_CPU ?= torch==2.13.0

.PHONY: install test test-gpu parity lint clean

install:
	@$(PYTHON) -c "import torch" 2>/dev/null || $(PIP) install -q "$(TORCH_CPU)"
	$(PIP) install -q -e ".[dev]"

test:
	$(PYTHON) -m pytest -n auto -q

test-gpu:
	$(PYTHON) -m pytest -m gpu -q

parity:
	$(PYTHON) -m musebench parity scenarios/parity.toml --json records/parity-latest.json --junit records/parity-latest.xml

clean:
	rm -rf .pytest_cache build *.egg-info
