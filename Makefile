# Two commands for a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin

.PHONY: setup check-setup demo test docs test-8-ranks test-gpu-check-dry test-faults test-deepspeed test-compat test-gpu-stack test-modes aot test-megatron19 test-megatron-parallel test-fastmoe test-torchtitan clean

# One pip install, so torch is installed at most once. The venv sees the system site-packages: an installed
# torch (CPU or CUDA) is pinned as it is, never replaced, and triton follows it. Where there is none, TORCH (the
# release .ci/run installs and CI tests) is resolved together with everything else: PyPI's Linux wheel is a
# CUDA build (with its CUDA libraries, several GB); TORCH_INDEX=https://download.pytorch.org/whl/cpu takes the
# CPU build (under 200 MB). fmoe/tools/setup_constraints.py settles torch and triton in constraints.txt.
TORCH       ?= 2.13.0
TORCH_INDEX ?=

$(VENV)/.installed: setup.py constraints.txt fmoe/tools/setup_constraints.py
	$(PYTHON) -m venv --system-site-packages $(VENV)
	$(BIN)/python fmoe/tools/setup_constraints.py constraints.txt --torch $(TORCH) > $(VENV)/constraints.txt
	$(BIN)/pip install -e '.[test,docs]' -c $(VENV)/constraints.txt $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX))
	touch $@

setup: $(VENV)/.installed

# What a machine without torch would install (pip's dry run in a venv of its own, no system packages): torch
# once, at TORCH, resolved together with constraints.txt. CI runs it.
check-setup:
	rm -rf .venv-check-setup
	$(PYTHON) -m venv .venv-check-setup
	.venv-check-setup/bin/python fmoe/tools/setup_constraints.py constraints.txt --torch $(TORCH) > .venv-check-setup/constraints.txt
	.venv-check-setup/bin/pip install --quiet --dry-run --report .venv-check-setup/report.json '.[test,docs]' -c .venv-check-setup/constraints.txt
	.venv-check-setup/bin/python fmoe/tools/setup_constraints.py --torch $(TORCH) --check-report .venv-check-setup/report.json
	@echo "check-setup: a machine without torch installs torch $(TORCH) once"

demo: setup
	$(BIN)/fmoe train

test: setup
	$(BIN)/python -m pytest -q tests
	$(MKDOCS_BUILD)

# The documentation (docs/, mkdocs.yml) into site/; --strict: a broken link or anchor, a page left out of the
# nav, an API entry that does not resolve or any other warning fails it. The API reference is read from this
# checkout's source (mkdocs.yml: paths). Material's notice about MkDocs 2.0 is not a warning of this build.
MKDOCS_BUILD := NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

docs: setup
	$(MKDOCS_BUILD)

# The declared floors and the newest releases, each in a venv of its own, on the tests that read a moving
# API: import, every recompute mode, compile with fullgraph=True, autocast, the HF families and routers,
# the Triton kernels under the CPU interpreter (one thread: the tensors are tiny). Oldest: torch 2.4.1
# (its triton 3.0.0), numpy 1.26.4, transformers 5.0.0, pytest 8.0.0, without the system's packages.
# PyPI's Linux torch wheels are CUDA builds (they import without a GPU): 2.4.1 with its CUDA libraries
# is about 2.7 GB, under a minute to download and two to install here. Newest: the newest
# triton, numpy, transformers and pytest over the system's torch (CI's 2.13.0 CPU); torch 2.14.1, a
# CUDA build, installs as 5.8 GB in about 11 minutes here, beyond this target's 15.
COMPAT_OLDEST := torch==2.4.1 numpy==1.26.4 transformers==5.0.0 pytest==8.0.0 pytest-timeout
COMPAT_NEWEST := --upgrade triton numpy transformers pytest pytest-timeout
COMPAT_TESTS  := tests/test_versions.py tests/test_memory.py tests/test_compile.py tests/test_autocast.py \
                 tests/test_router.py tests/test_hf.py tests/test_triton_kernels.py
COMPAT_SKIP   := not benchmark and not gradcheck and not expert_parallel and not two_ranks

.venv-compat-oldest/.installed: setup.py
	rm -rf .venv-compat-oldest
	$(PYTHON) -m venv .venv-compat-oldest
	.venv-compat-oldest/bin/pip install --quiet -e . $(COMPAT_OLDEST)
	touch $@

.venv-compat-newest/.installed: setup.py
	rm -rf .venv-compat-newest
	$(PYTHON) -m venv --system-site-packages .venv-compat-newest
	.venv-compat-newest/bin/python -c "import torch" 2>/dev/null || .venv-compat-newest/bin/pip install torch
	.venv-compat-newest/bin/pip install --quiet -e . $(COMPAT_NEWEST)
	touch $@

test-compat: .venv-compat-oldest/.installed .venv-compat-newest/.installed
	for v in oldest newest; do \
	  .venv-compat-$$v/bin/python -c 'import torch, triton, numpy, transformers, pytest; print("'$$v':", *(f"{m.__name__} {m.__version__}" for m in (torch, triton, numpy, transformers, pytest)))' && \
	  OMP_NUM_THREADS=1 .venv-compat-$$v/bin/python -m pytest -q -p no:cacheprovider $(COMPAT_TESTS) -k '$(COMPAT_SKIP)' || exit 1; \
	done

# Fault injection (kills, signals, full disks, stopped and missing ranks) with real processes; in CI.
test-faults: setup
	FMOE_TEST_FAULTS=1 $(BIN)/python -m pytest -q tests/test_fault_train.py tests/test_fault_dist.py

# DeepSpeed's engine, ZeRO stages and launcher around fmoe's layer; in CI.
test-deepspeed: setup
	FMOE_TEST_DEEPSPEED=1 $(BIN)/python -m pytest -q tests/test_deepspeed.py

# benchmarks/gpu_check.sh's CPU dry run (its steps at tiny shapes, so it cannot rot before a GPU runs it); in CI.
test-gpu-check-dry: setup
	FMOE_TEST_GPU_CHECK_DRY=1 $(BIN)/python -m pytest -q tests/test_gpu_check.py -k dry_run

# The exchanges at 8 gloo ranks (two and four nodes) against one process; CI runs it after `make test`.
test-8-ranks: setup
	FMOE_TEST_8_RANKS=1 $(BIN)/python -m pytest -q tests/test_exchange.py -k "8-"

# The GPU machine's releases (torch 2.11, Triton 3.6, whose interpreter needs numpy < 2.4, the newest
# transformers), on the CPU: the compat tests plus what a GPU run first leans on (fullgraph compile, the
# launch counts, the HF "fmoe" experts, the Hopper kernel under the interpreter). torch 2.11's PyPI wheel
# is a CUDA build, about 5 GB with its libraries; not run by CI for that reason.
GPU_STACK       := torch==2.11.0 triton==3.6.0 'numpy<2.4' transformers pytest pytest-timeout
GPU_STACK_TESTS := $(COMPAT_TESTS) tests/test_launches.py tests/test_hf_convert.py tests/test_triton_tma.py \
                   tests/test_layer_path.py tests/test_stats.py tests/test_replay.py tests/test_triton_tuning.py

.venv-gpu-stack/.installed: setup.py
	rm -rf .venv-gpu-stack
	$(PYTHON) -m venv .venv-gpu-stack
	.venv-gpu-stack/bin/pip install --quiet -e . $(GPU_STACK)
	touch $@

test-gpu-stack: .venv-gpu-stack/.installed
	.venv-gpu-stack/bin/python -c 'import torch, triton, numpy, transformers; print(*(f"{m.__name__} {m.__version__}" for m in (torch, triton, numpy, transformers)))'
	OMP_NUM_THREADS=1 .venv-gpu-stack/bin/python -m pytest -q -p no:cacheprovider $(GPU_STACK_TESTS) -k '$(COMPAT_SKIP)'

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
	env -u TRITON_INTERPRET $(BIN)/python -m fmoe.tools.aot --jobs 2

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

# fmoe inside torchtitan (tests/test_torchtitan*.py). torchtitan's requirements (datasets pins fsspec below the test
# venv's) conflict with constraints.txt, so it gets a venv of its own over the test venv's packages (fmoe, pytest,
# transformers) and the system's torch, with fmoe's `torchtitan` extra (torchtitan, flash-linear-attention) on top.
VENVTT := .venv-torchtitan

$(VENVTT)/.installed: $(VENV)/.installed setup.py
	rm -rf $(VENVTT)
	$(BIN)/python -m venv --system-site-packages $(VENVTT)
	site=$$($(VENVTT)/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])') && \
	  echo "import site; site.addsitedir('$$($(BIN)/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')')" \
	    > $$site/zz-fmoe-test-venv.pth
	$(VENVTT)/bin/pip install --quiet -e '.[torchtitan]' 'torch==$(TORCH)'
	$(VENVTT)/bin/python -c "import torchtitan.models.qwen3_5, fmoe.integrations.torchtitan"
	touch $@

test-torchtitan: $(VENVTT)/.installed
	$(VENVTT)/bin/python -m pytest -q tests/test_torchtitan*.py

# FastMoE's own single-process tests (a checkout of github.com/laekov/fastmoe: FASTMOE=path), unchanged, against
# fmoe on the CPU: .cuda() is the identity there (tests/fastmoe_cpu_shim.py). Its multi-GPU tests skip themselves.
FASTMOE ?= ../fastmoe
FASTMOE_TESTS := test_mimo.py test_numerical.py test_dp.py test_gates.py test_zero.py test_swipe.py test_faster_gate.py
test-fastmoe: setup
	cd $(FASTMOE)/tests && PYTHONPATH=$(CURDIR) TRITON_INTERPRET=1 $(CURDIR)/$(BIN)/python -m pytest -q -p no:cacheprovider \
	  -p tests.fastmoe_cpu_shim $(FASTMOE_TESTS)

clean:
	rm -rf $(VENV) $(VENV19) $(VENVTT) .venv-compat-oldest .venv-compat-newest .venv-gpu-stack runs site
