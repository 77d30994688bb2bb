#!/usr/bin/env bash
# Bench-only: a side virtualenv with vLLM's real v1 BlockPool importable on a
# CPU-only Linux machine, for benchmark_block_pool.py's side-by-side figures.
# vLLM is installed without its dependency pins (it pins a CUDA torch); only
# the modules that `vllm.v1.core.block_pool` imports are needed.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${VLLM_PEER_VENV:-.bench/vllm-venv}
python3 -m venv "$venv"
pip="$venv/bin/python -m pip install --quiet"
# torch: on these machines pip resolves this to a local CPU build.
$pip "torch==2.13.0" || $pip torch
$pip --no-deps "vllm==0.33.0"
$pip cbor2 transformers msgspec pyzmq psutil regex numpy pydantic sympy aiohttp requests \
    openai-harmony openai pillow pybase64 cachetools cloudpickle uvloop py-cpuinfo networkx \
    prometheus-client xgrammar fastapi partial-json-parser llguidance typing-extensions \
    packaging urllib3 pyyaml
"$venv/bin/python" -c "from vllm.v1.core.block_pool import BlockPool; print('vLLM BlockPool importable')"
echo "use: --vllm-python $venv/bin/python"
