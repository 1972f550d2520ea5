# Two commands for a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin

.PHONY: setup demo test test-modes aot test-megatron19 test-megatron-parallel clean

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

# Every gate and preset x train / eval x capacity x grad, compiled with Inductor against eager; router
# replay compiled for every gate and preset, and at 4 ranks.
test-modes: setup
	FMOE_TEST_ALL_MODES=1 $(BIN)/python -m pytest -q tests/test_modes.py tests/test_replay.py

# fmoe in Megatron-Core at 4 and 8 gloo ranks (pipeline, virtual pipeline, tensor + sequence, expert
# parallel) against one process and Megatron's own MoE, with checkpoint resharding; `make test` runs the 2-rank subset.
test-megatron-parallel: setup
	FMOE_TEST_MEGATRON_PARALLEL=1 $(BIN)/python -m pytest -q tests/test_megatron_parallel.py

# Every Triton kernel compiled for sm_80 and sm_90 (no GPU needed): registers, spills, shared memory.
aot: setup
	env -u TRITON_INTERPRET $(BIN)/python -m fmoe.kernels.aot --jobs 2

# megatron-core >= 0.17 declares Python >= 3.12 and ships cp312 wheels only, yet its Python code runs on 3.11
# (its one compiled module serves Megatron's datasets, which fmoe does not use). So the wheel is unpacked into
# a venv of its own, which sees the test venv's packages (fmoe, pytest) and the system's (torch) behind it;
# `make test` keeps 0.16.1.
MEGATRON19 ?= 0.19.2
VENV19     := .venv-megatron19

$(VENV19)/.installed: $(VENV)/.installed
	rm -rf $(VENV19)
	$(BIN)/python -m venv --system-site-packages $(VENV19)
	$(BIN)/pip download 'megatron-core==$(MEGATRON19)' --no-deps --only-binary=:all: --python-version 3.12 -d $(VENV19)/wheels
	site=$$($(VENV19)/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])') && \
	  $(BIN)/python -m zipfile -e $(VENV19)/wheels/megatron_core-$(MEGATRON19)-*.whl $$site && \
	  echo "import site; site.addsitedir('$$($(BIN)/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')')" \
	    > $$site/zz-fmoe-test-venv.pth
	$(VENV19)/bin/python -c "import megatron.core as m; assert m.__version__.split('+')[0] == '$(MEGATRON19)', m.__version__"
	touch $@

test-megatron19: $(VENV19)/.installed
	$(VENV19)/bin/python -m pytest -q tests/test_megatron*.py

clean:
	rm -rf $(VENV) $(VENV19) runs
