"""``convert_gguf``: a GGUF file in, an mlx-lm model folder out."""

from __future__ import annotations

import json
from pathlib import Path

from .cache import build_atomically, file_sha256
from .config import build_config
from .errors import GGUFError
from .header import GGUFHeader
from .tokenizer import write_tokenizer_files
from .validate import arch_spec, inspect_gguf, tensor_type_counts
from .weights import load_gguf_tensors, save_weights, to_mlx_lm

# Bumped when the folder layout changes; part of the cache key, so a newer converter
# never trusts an older one's folder.
# 2: K-quant decoders, llama.cpp's pre-tokenizer table; 3: codes of 16-value types kept.
CONVERTER_VERSION = 3


def _write_folder(header: GGUFHeader, sha256: str, folder: Path) -> None:
    """Fill ``folder`` with config, tokenizer files and weights."""
    spec = arch_spec(header)
    config = build_config(header, spec)
    generation = write_tokenizer_files(header, folder)
    config.update(generation)  # eos/bos ids, also read by mlx-lm from config.json
    tensors, group16 = load_gguf_tensors(header)
    weights = to_mlx_lm(tensors, header, spec, config)
    save_weights(weights, folder, to_mlx_lm(group16, header, spec, config))
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    source = {
        "source": str(header.path),
        "sha256": sha256,
        "architecture": header.architecture,
        "tensor_types": tensor_type_counts(header),
        "converter_version": CONVERTER_VERSION,
    }
    (folder / "gguf_source.json").write_text(json.dumps(source, indent=2) + "\n")


def _check_loads(folder: Path) -> None:
    """mlx-lm builds its model from the folder: every weight there, named and shaped right.

    Lazily (no weight is read), before the folder is moved into the cache, so a
    file whose tensors do not make the model (a wrong-sized head norm, a tensor
    missing that the up-front checks do not know of) is never cached.
    """
    from mlx_lm.utils import load_model

    load_model(folder, lazy=True)


def convert_gguf(gguf_path: str | Path, cache_root: str | Path) -> Path:
    """Convert a GGUF model to an mlx-lm folder, cached by file content.

    The folder is ``cache_root/gguf/<sha256[:16]>-v<converter version>``;
    when it exists it is returned at once. Quantized weights stay quantized where
    MLX's affine layout holds them exactly (Q8_0, Q4_0/Q4_1/Q4_K, Q5_0/Q5_1/Q5_K;
    group size 32) and become float32 otherwise (Q6_K, Q3_K, Q2_K), their codes
    kept beside in ``codes16.safetensors`` for the CPU's decode kernel: see
    :mod:`.blocks`. ``mlx_lm.load(str(folder))`` loads the result.

    Args:
        gguf_path: The ``.gguf`` file.
        cache_root: Root of the cache; created if needed.

    Returns:
        The model folder.

    Raises:
        GGUFError: The file cannot be read or converted. Nothing is left
            under ``cache_root`` in that case.
    """
    path = Path(gguf_path)
    if not path.is_file():
        raise GGUFError(path, "does not exist or is not a file")
    try:
        sha256 = file_sha256(path)
    except OSError as exc:
        raise GGUFError(path, f"cannot be read ({exc.strerror or exc})") from exc
    target = Path(cache_root) / "gguf" / f"{sha256[:16]}-v{CONVERTER_VERSION}"
    if target.is_dir():
        return target
    header = inspect_gguf(path)  # every check that needs no tensor data, before any write

    def build(folder: Path) -> None:
        try:
            _write_folder(header, sha256, folder)
            _check_loads(folder)
        except GGUFError:
            raise
        except Exception as exc:  # one error type for callers, whatever failed below
            detail = " ".join(str(exc).split())  # one line (mlx-lm lists names line by line)
            raise GGUFError(path, f"conversion failed: {type(exc).__name__}: {detail}") from exc

    return build_atomically(target, build)
