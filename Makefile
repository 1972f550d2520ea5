# Two commands for a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin

.PHONY: setup demo test clean

# The venv sees the system site-packages so an installed torch (CPU or CUDA) is reused,
# never replaced by a multi-GB download.
$(VENV)/.installed: setup.py
	$(PYTHON) -m venv --system-site-packages $(VENV)
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install torch
	$(BIN)/pip install -e '.[test]'
	touch $@

setup: $(VENV)/.installed

demo: setup
	$(BIN)/fmoe train

test: setup
	$(BIN)/python -m pytest -q tests

clean:
	rm -rf $(VENV) runs
