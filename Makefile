# Every target installs what it needs into .venv, so a fresh clone needs only
# python3, pip and gcc.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install serve test lint bench smoke blas model clean

$(STAMP): pyproject.toml setup.py veloxquant_mlx/memory/records.py veloxquant_mlx/memory/block_pool.py
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

# Debian's OpenBLAS makes MLX's CPU matmuls ~15x faster; skipped quietly
# where apt or root is not available.
blas:
	-@bash scripts/install_blas.sh

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
	rm -rf $(VENV) models .pytest_cache .ruff_cache
