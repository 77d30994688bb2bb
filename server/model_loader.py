"""Resolve and load the served model (called on the engine thread only).

MLX streams and arrays belong to the thread that makes them, so the engine
thread loads the model itself; this module only decides *what* to load and in
which compute dtype.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from server.settings import ModelSection

log = logging.getLogger("veloxquant.server")

# A Hugging Face repo id, e.g. mlx-community/Llama-3.2-1B-Instruct-4bit.
REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


class ModelNotFoundError(RuntimeError):
    """``--model`` names neither a local folder nor a Hugging Face repo we can get."""


@dataclass(slots=True)
class LoadedModel:
    """The model, its tokenizer and facts the engine needs about them."""

    model: Any
    tokenizer: Any
    name: str
    path: Path
    n_layers: int
    dtype: str
    quantized: bool


def resolve_model_path(section: ModelSection) -> Path:
    """Return the local folder to load, building the offline default if needed.

    ``path`` may be a local folder or a Hugging Face repo id (``org/name``): an
    id is served from the local Hugging Face cache when it is there, and
    downloaded (as ``mlx_lm.load`` would) when the hub is reachable.

    Args:
        section: The ``[model]`` settings.

    Raises:
        ModelNotFoundError: ``path`` is neither a model folder nor a repo id
            that is cached or downloadable from here.
    """
    if not section.path:
        from veloxquant_mlx.offline_model import ensure_model

        return Path(ensure_model(section.preset))
    path = Path(section.path).expanduser()
    if path.is_dir() and (path / "config.json").is_file():
        return path.resolve()
    if path.exists():
        raise ModelNotFoundError(
            f"model path {str(path)!r} exists but has no config.json; point --model at an "
            "mlx-lm model folder (config.json, *.safetensors, tokenizer files)"
        )
    if REPO_ID.fullmatch(section.path):
        return _hub_snapshot(section.path)
    raise ModelNotFoundError(
        f"model {section.path!r} is neither a local folder nor a Hugging Face repo id "
        "(org/name); point --model at an mlx-lm model folder, or leave it unset for the "
        "built-in offline default model"
    )


def _hub_snapshot(repo_id: str) -> Path:
    """The local snapshot of ``repo_id``: from the cache, else downloaded."""
    from huggingface_hub import snapshot_download
    from mlx_lm.utils import DEFAULT_ALLOW_PATTERNS

    try:
        # Online this fetches what mlx_lm.load would; offline it falls back
        # to a complete cached snapshot, and fails at once without one.
        return Path(snapshot_download(repo_id, allow_patterns=DEFAULT_ALLOW_PATTERNS))
    except Exception as exc:  # network, missing repo, incomplete cache: one answer
        raise ModelNotFoundError(
            f"model {repo_id!r} is not a local folder, not in the local Hugging Face cache, "
            f"and could not be downloaded from here ({type(exc).__name__}). Only local paths "
            "load offline: download the model elsewhere (e.g. `huggingface-cli download ID "
            "--local-dir DIR`) and pass --model DIR, or leave --model unset for the built-in "
            "offline default model"
        ) from None


def _is_quantized(path: Path) -> bool:
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return bool(config.get("quantization") or config.get("quantization_config"))


def _compute_dtype(requested: str, on_gpu: bool) -> str | None:
    """The dtype to cast the weights to, or None to keep them as stored."""
    if requested == "native":
        return None
    if requested == "auto":
        # MLX's CPU backend only has a fast (BLAS) path for float32 matmuls.
        # For quantized models set_dtype casts only the float parameters
        # (scales, biases, norms), never the packed weights: a 4-bit model with
        # bfloat16 scales decoded at ~2 tok/s here, ~24 tok/s with float32 ones
        # (figures/cpu_backend/results.json).
        return None if on_gpu else "float32"
    return requested


def load_model(section: ModelSection) -> LoadedModel:
    """Load the model with ``mlx_lm.load`` and apply the compute dtype.

    Args:
        section: The ``[model]`` settings.

    Returns:
        The loaded model, ready to generate.
    """
    import mlx.core as mx
    import mlx_lm

    path = resolve_model_path(section)
    model, tokenizer = mlx_lm.load(str(path))
    quantized = _is_quantized(path)
    on_gpu = mx.default_device().type == mx.DeviceType.gpu
    target = _compute_dtype(section.dtype, on_gpu)
    if target is not None:
        model.set_dtype(getattr(mx, target))
        mx.eval(model.parameters())
    dtype = _weight_dtype(model)
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        name=section.served_name or path.name,
        path=path,
        n_layers=len(model.layers),
        dtype=dtype,
        quantized=quantized,
    )


def _weight_dtype(model: Any) -> str:
    """Name the dtype of the model's first floating weight (for logs and metrics)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    for _, value in tree_flatten(model.parameters()):
        if mx.issubdtype(value.dtype, mx.floating):
            return str(value.dtype).removeprefix("mlx.core.")
    return "unknown"
