"""Small random-weight models of the mlx-lm families the server is checked against.

Each family's config is about the smallest that keeps what sets the family
apart: gemma's scaled embeddings, extra norms and soft-capping, phi3's fused
q/k/v and gate/up, qwen2's projection biases, qwen3's per-head norms, the MoE
families' routed experts, and the sliding windows the real checkpoints state
(16 tokens here, so a 40-token prompt runs past them). The vocabulary is the
offline tiny model's 4096 tokens, whose tokenizer every folder gets a copy
of. The weights are mlx-lm's own initialisation under a seed, saved with
mlx-lm's save utilities, so :func:`mlx_lm.load` reads a folder like any
checkpoint of its family.
"""

from __future__ import annotations

import importlib
import shutil
from pathlib import Path
from typing import Any

VOCAB = 4096
WINDOW = 16  # the sliding window of every family that states one

# What every family's config shares: 4 layers of width 64, 4 query heads, 2 KV heads.
_SHAPE = {
    "hidden_size": 64,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "intermediate_size": 128,
    "vocab_size": VOCAB,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "max_position_embeddings": 512,
    "tie_word_embeddings": True,
    "torch_dtype": "float32",
}
_MOE = {"num_experts_per_tok": 2, "moe_intermediate_size": 64}

# Family -> what its config adds to (or changes in) _SHAPE.
FAMILIES: dict[str, dict[str, Any]] = {
    "llama": {"model_type": "llama"},
    # Real Qwen2 configs state a window and switch it off.
    "qwen2": {"model_type": "qwen2", "sliding_window": WINDOW, "use_sliding_window": False},
    "qwen3": {"model_type": "qwen3"},
    # Mistral-7B-v0.1's shape: a window for every layer, no layer_types.
    "mistral": {"model_type": "mistral", "sliding_window": WINDOW,
                "tie_word_embeddings": False},
    # Newer Mistral-style configs name the sliding layers: mlx-lm applies the window there.
    "mistral_layer_types": {"model_type": "mistral", "sliding_window": WINDOW,
                            "tie_word_embeddings": False,
                            "layer_types": ["sliding_attention", "full_attention"] * 2},
    "gemma2": {"model_type": "gemma2", "sliding_window": WINDOW,
               "query_pre_attn_scalar": 16, "attn_logit_softcapping": 50.0,
               "final_logit_softcapping": 30.0},
    # Five of six layers slide in real Gemma 3; two of three here.
    "gemma3_text": {"model_type": "gemma3_text", "num_hidden_layers": 6,
                    "sliding_window": WINDOW, "sliding_window_pattern": 3,
                    "query_pre_attn_scalar": 16},
    # Phi-3-mini-4k states a window (2047) too.
    "phi3": {"model_type": "phi3", "sliding_window": WINDOW, "tie_word_embeddings": False},
    "qwen3_moe": {"model_type": "qwen3_moe", "num_experts": 4, "decoder_sparse_step": 1,
                  "mlp_only_layers": [], "norm_topk_prob": True, **_MOE},
    "mixtral": {"model_type": "mixtral", "num_local_experts": 4,
                "tie_word_embeddings": False, **_MOE},
}

# The offline tiny model's files that make a folder's tokenizer.
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
# Its special token ids, which the copied tokenizer keeps.
_SPECIAL_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")


def family_config(family: str) -> dict[str, Any]:
    """The ``config.json`` of ``family``'s small model.

    Raises:
        ValueError: For a family not in :data:`FAMILIES`.
    """
    try:
        extra = FAMILIES[family]
    except KeyError:
        raise ValueError(f"unknown family {family!r}; choose one of {sorted(FAMILIES)}") from None
    return {**_SHAPE, **extra}


def _model_module(model_type: str) -> Any:
    """mlx-lm's module for ``model_type`` (``mistral`` is its ``llama``)."""
    from mlx_lm.utils import MODEL_REMAPPING

    return importlib.import_module(f"mlx_lm.models.{MODEL_REMAPPING.get(model_type, model_type)}")


def build_family_model(family: str, out_dir: Path, seed: int = 0) -> Path:
    """Write ``family``'s small random-weight model into ``out_dir`` (created if missing).

    Returns:
        ``out_dir``, a folder :func:`mlx_lm.load` and the server's ``--model`` accept.
    """
    import mlx.core as mx
    from mlx_lm.utils import save_config, save_model

    from veloxquant_mlx.offline_model import ensure_model

    config = family_config(family)
    tiny = Path(ensure_model("tiny"))
    config.update(_special_ids(tiny))
    module = _model_module(config["model_type"])
    mx.random.seed(seed)
    model = module.Model(module.ModelArgs.from_dict(config))
    mx.eval(model.parameters())
    out_dir = Path(out_dir)
    save_model(out_dir, model)
    save_config(config, out_dir / "config.json")
    for name in _TOKENIZER_FILES:
        shutil.copyfile(tiny / name, out_dir / name)
    return out_dir


def _special_ids(tiny: Path) -> dict[str, Any]:
    """The tiny model's bos/eos/pad ids, for a config that shares its tokenizer."""
    import json

    config = json.loads((tiny / "config.json").read_text(encoding="utf-8"))
    return {key: config[key] for key in _SPECIAL_IDS if key in config}
