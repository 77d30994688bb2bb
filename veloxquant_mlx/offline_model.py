"""The project's own default model, built offline.

No machine the project runs on reaches a model hub, so the server, the tests
and the benchmarks use a model built here from nothing but the Python
standard library's text:

* a byte-level BPE tokenizer trained with the ``tokenizers`` library on the
  docstrings of the standard library's top-level modules (a sorted, fixed
  file list, so one Python version always yields the same tokenizer);
* an mlx-lm ``llama`` model with seeded random weights, stored in float32
  (``bfloat16`` for the ``1b`` preset, the dtype a GPU serves it in);
* a normal Hugging Face-style folder (``config.json``, ``model.safetensors``,
  ``tokenizer.json``, ``tokenizer_config.json`` with a chat template) that the
  real :func:`mlx_lm.load` reads.

Random weights produce nonsense text; the folder exists so the whole serving
stack (tokenizer, chat template, KV caches, stop tokens) runs for real without
a download. Point the server at any mlx-community model for real text.

Presets:

======  ======  ======  =====  ========  ============  =====  ========  ==============
preset  hidden  layers  heads  kv heads  intermediate  vocab  dtype     parameters
======  ======  ======  =====  ========  ============  =====  ========  ==============
tiny    128     4       4      2         256           4096   float32   ~1.1 M (4 MB)
small   768     8       12     4         2048          8192   float32   ~57 M (230 MB)
1b      2048    16      32     8         8192          16384  bfloat16  ~1.0 B (2.0 GB)
======  ======  ======  =====  ========  ============  =====  ========  ==============

``1b`` is shaped like Llama-3.2-1B (head_dim 64, GQA 32/8) except for the
vocabulary: the stdlib corpus yields at most ~17 k BPE tokens, so its output
layer is smaller than Llama's 128 k. It is for GPU benchmarks
(``benchmark_scripts/benchmark_gpu.py``); no test builds it.
"""

from __future__ import annotations

import ast
import fcntl
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

from veloxquant_mlx.paths import models_dir

BOS_TOKEN = "<|bos|>"
EOS_TOKEN = "<|eos|>"
TURN_START = "<|im_start|>"
TURN_END = "<|im_end|>"
PAD_TOKEN = "<|pad|>"
# Order fixes the ids: 0..4, ahead of every learned token.
SPECIAL_TOKENS = (BOS_TOKEN, EOS_TOKEN, TURN_START, TURN_END, PAD_TOKEN)

# ChatML-style turns. The tokenizer's eos is the end-of-turn marker, so an
# assistant turn that ends stops generation in mlx-lm.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# Bumped whenever the recipe below changes, so stale folders get rebuilt.
RECIPE_VERSION = 1
BUILD_INFO = "veloxquant_build.json"


@dataclass(frozen=True, slots=True)
class ModelPreset:
    """Shape of one offline model.

    Attributes:
        name: Preset name, also the folder name under the models root.
        hidden_size: Width of the residual stream.
        num_layers: Number of transformer blocks.
        num_heads: Query heads per layer.
        num_kv_heads: Key/value heads per layer (fewer than ``num_heads``: GQA).
        intermediate_size: Width of the SwiGLU MLP.
        vocab_size: Target BPE vocabulary size, special tokens included.
        max_position_embeddings: Advertised context length.
        corpus_chars: Cap on training text for the tokenizer, in characters.
        dtype: Stored dtype of the weights, one of :data:`WEIGHT_DTYPES`.
    """

    name: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int = 4096
    corpus_chars: int = 2_000_000
    dtype: str = "float32"

    def __post_init__(self) -> None:
        if self.dtype not in WEIGHT_DTYPES:
            raise ValueError(f"preset {self.name!r}: dtype {self.dtype!r} is not one of "
                             f"{WEIGHT_DTYPES}")


# Stored weight dtypes: float32 for CPU tests and benchmarks, bfloat16 for GPUs
# (half the bytes to read per decode step, the dtype real checkpoints ship in).
WEIGHT_DTYPES = ("float32", "bfloat16")

PRESETS: dict[str, ModelPreset] = {
    "tiny": ModelPreset("tiny", 128, 4, 4, 2, 256, 4096),
    "small": ModelPreset("small", 768, 8, 12, 4, 2048, 8192),
    "1b": ModelPreset("1b", 2048, 16, 32, 8, 8192, 16384, dtype="bfloat16"),
}


def _preset(name: str | ModelPreset) -> ModelPreset:
    if isinstance(name, ModelPreset):
        return name
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(
            f"unknown model preset {name!r}; choose one of {sorted(PRESETS)}"
        ) from None


def corpus_files() -> list[Path]:
    """The standard-library files whose docstrings train the tokenizer.

    Returns:
        The top-level ``*.py`` files of the running Python's standard library,
        sorted by name so the list (and the tokenizer) is deterministic.
    """
    return sorted(Path(os.__file__).resolve().parent.glob("*.py"))


def iter_corpus(max_chars: int) -> Iterator[str]:
    """Yield docstrings of the standard library, in a fixed order.

    Args:
        max_chars: Stop once this many characters have been yielded.

    Yields:
        One docstring (module, class or function) at a time.
    """
    total = 0
    for path in corpus_files():
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, OSError):
            continue  # a stray unparsable file must not stop the build
        for node in ast.walk(tree):
            if not isinstance(
                node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef
            ):
                continue
            doc = ast.get_docstring(node)
            if not doc:
                continue
            yield doc
            total += len(doc)
            if total >= max_chars:
                return


def train_tokenizer(texts: Iterator[str], vocab_size: int):
    """Train a byte-level BPE tokenizer.

    Args:
        texts: Training text.
        vocab_size: Target vocabulary size, special tokens included.

    Returns:
        A ``tokenizers.Tokenizer`` whose first ids are :data:`SPECIAL_TOKENS`.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return tokenizer


def model_config(preset: ModelPreset, vocab_size: int) -> dict:
    """The ``config.json`` contents for a preset.

    Args:
        preset: Model shape.
        vocab_size: The trained tokenizer's actual vocabulary size.

    Returns:
        An mlx-lm / Hugging Face ``llama`` config.
    """
    return {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": preset.hidden_size,
        "num_hidden_layers": preset.num_layers,
        "num_attention_heads": preset.num_heads,
        "num_key_value_heads": preset.num_kv_heads,
        "head_dim": preset.hidden_size // preset.num_heads,
        "intermediate_size": preset.intermediate_size,
        "vocab_size": vocab_size,
        "max_position_embeddings": preset.max_position_embeddings,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": True,
        "torch_dtype": preset.dtype,
        "bos_token_id": SPECIAL_TOKENS.index(BOS_TOKEN),
        # Both ids stop generation: end of turn (chat) and end of text (raw).
        "eos_token_id": [SPECIAL_TOKENS.index(TURN_END), SPECIAL_TOKENS.index(EOS_TOKEN)],
        "pad_token_id": SPECIAL_TOKENS.index(PAD_TOKEN),
    }


def tokenizer_config(preset: ModelPreset) -> dict:
    """The ``tokenizer_config.json`` contents (special tokens, chat template)."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": TURN_END,
        "pad_token": PAD_TOKEN,
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": preset.max_position_embeddings,
        "chat_template": CHAT_TEMPLATE,
    }


def write_weights(config: dict, path: Path, seed: int) -> int:
    """Create seeded random llama weights and save them as safetensors.

    The model's own initialisers draw each tensor whole with ``mx.random``
    (lazily, so a 1 B model costs seconds on a GPU); the draw is in float32
    and is then cast to the stored dtype, ``config["torch_dtype"]``.

    Args:
        config: The model's ``config.json`` contents.
        path: Target ``model.safetensors`` file.
        seed: Seed for MLX's random generator.

    Returns:
        Number of parameters written.
    """
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.models import llama

    dtype = getattr(mx, config.get("torch_dtype", "float32"))
    mx.random.seed(seed)
    model = llama.Model(llama.ModelArgs.from_dict(config))
    weights = dict(tree_flatten(model.parameters()))
    # Dropping the model leaves the cast as the only holder of each float32 draw,
    # so evaluation frees the float32 copy instead of keeping both (1b: 4 GB + 2 GB).
    del model
    weights = {name: w.astype(dtype) for name, w in weights.items()}
    mx.eval(weights)
    mx.save_safetensors(str(path), weights, metadata={"format": "mlx"})
    return sum(w.size for w in weights.values())


def build_info(preset: ModelPreset, seed: int) -> dict:
    """What a built folder was made from; a mismatch means rebuild."""
    shape = asdict(preset)
    # float32 stays out of the info, so folders whose info names no dtype (same bytes)
    # stay current.
    if shape["dtype"] == "float32":
        del shape["dtype"]
    return {
        "recipe_version": RECIPE_VERSION,
        "preset": shape,
        "seed": seed,
        "corpus": "stdlib docstrings of " + str(Path(os.__file__).resolve().parent),
    }


def build_model(preset: str | ModelPreset, out_dir: Path, seed: int = 0) -> Path:
    """Build a model folder from scratch (no locking, no caching).

    Args:
        preset: A name in :data:`PRESETS` or a :class:`ModelPreset` (a custom shape).
        out_dir: Folder to write into; created if missing.
        seed: Seed for the random weights.

    Returns:
        ``out_dir``.

    Raises:
        ValueError: For an unknown preset.
    """
    spec = _preset(preset)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer(iter_corpus(spec.corpus_chars), spec.vocab_size)
    tokenizer.save(str(out_dir / "tokenizer.json"))
    config = model_config(spec, tokenizer.get_vocab_size())
    n_params = write_weights(config, out_dir / "model.safetensors", seed)
    _write_json(out_dir / "config.json", config)
    _write_json(out_dir / "tokenizer_config.json", tokenizer_config(spec))
    _write_json(out_dir / "special_tokens_map.json", _special_tokens_map())
    _write_json(out_dir / BUILD_INFO, {**build_info(spec, seed), "n_params": n_params})
    return out_dir


def _special_tokens_map() -> dict:
    return {"bos_token": BOS_TOKEN, "eos_token": TURN_END, "pad_token": PAD_TOKEN}


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def _is_current(folder: Path, preset: ModelPreset, seed: int) -> bool:
    try:
        info = json.loads((folder / BUILD_INFO).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    info.pop("n_params", None)
    return info == build_info(preset, seed)


def ensure_model(
    preset: str = "tiny", root: Path | None = None, seed: int = 0, *, force: bool = False
) -> Path:
    """Return the folder of an offline model, building it first if needed.

    Safe to call from several processes at once (a test run and a server, say):
    a file lock serialises builders, each build goes to a temporary folder
    that is renamed into place only when complete, and a folder built from an
    older recipe or another seed is rebuilt.

    Args:
        preset: ``"tiny"`` (a few MB, for tests), ``"small"`` (~57 M
            parameters, for CPU benchmarks) or ``"1b"`` (bfloat16, for GPUs).
        root: Folder holding the models; defaults to
            :func:`veloxquant_mlx.paths.models_dir` (``VELOXQUANT_HOME`` or the
            user cache), never the installed package.
        seed: Seed for the random weights.
        force: Rebuild even when a current folder exists.

    Returns:
        ``root / preset``, a folder :func:`mlx_lm.load` reads.

    Raises:
        ValueError: For an unknown preset.
    """
    spec = _preset(preset)
    root = Path(root) if root is not None else models_dir()
    target = root / spec.name
    if not force and _is_current(target, spec, seed):
        return target
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f".{spec.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        # Another process may have finished the build while we waited.
        if not force and _is_current(target, spec, seed):
            return target
        staging = Path(tempfile.mkdtemp(prefix=f".{spec.name}.build-", dir=root))
        staging.chmod(0o755)  # mkdtemp makes it private; the model is not a secret
        try:
            build_model(spec.name, staging, seed)
            _swap_into_place(staging, target)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return target


def _swap_into_place(staging: Path, target: Path) -> None:
    """Rename ``staging`` to ``target``; an old ``target`` is moved aside first.

    A reader never sees a half-written folder: ``target`` either is the old
    complete build, is briefly absent, or is the new complete build.
    """
    if target.exists():
        trash = target.with_name(f".{target.name}.old-{os.getpid()}")
        os.rename(target, trash)
        shutil.rmtree(trash, ignore_errors=True)
    os.rename(staging, target)


def fingerprint(folder: Path) -> str:
    """SHA-256 over a model folder's weight and tokenizer files (for tests/logs)."""
    digest = hashlib.sha256()
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        digest.update((Path(folder) / name).read_bytes())
    return digest.hexdigest()
