"""The sections of the server settings: one frozen, strict model per TOML section.

:mod:`server.settings` assembles them into :class:`~server.settings.Settings`
and loads them from the file, the environment and the CLI; this module holds
what each key means, its default and its checks.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from veloxquant_mlx.memory.pool_config import pool_format_problem

LogLevel = Literal["critical", "error", "warning", "info", "debug"]
ModelDtype = Literal["auto", "native", "float32", "float16", "bfloat16"]
ModelPreset = Literal["smollm2", "tiny", "small"]
LOG_LEVELS: tuple[str, ...] = get_args(LogLevel)
MODEL_DTYPES: tuple[str, ...] = get_args(ModelDtype)
MODEL_PRESETS: tuple[str, ...] = get_args(ModelPreset)


class ConfigError(ValueError):
    """The configuration is invalid; the message names the key and the fix."""


class _FieldProblem(ValueError):
    """A check spanning several fields failed; ``field`` is the one to fix."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


class _Section(BaseModel):
    # strict: a TOML `1` is not a bool and `"8"` is not an int (env strings are
    # parsed by the env source before validation); ints still pass as floats.
    # No inf/nan: an infinite timeout or limit would switch its bound off unnoticed.
    model_config = ConfigDict(frozen=True, extra="forbid", strict=True, allow_inf_nan=False)


_ORIGIN = re.compile(r"[a-zA-Z][a-zA-Z0-9+.-]*://[^/\s?#]+")


class ServerSection(_Section):
    """Where the HTTP server listens and how it logs."""

    host: str = Field(default="127.0.0.1", min_length=1)
    port: int = Field(default=8000, ge=0, le=65535)
    log_level: LogLevel = "info"
    request_log: bool = True
    metrics_require_key: bool = False
    shutdown_grace_s: float = Field(default=30.0, ge=0)
    docs: bool = True
    header_timeout_s: float = Field(default=10.0, gt=0)
    keep_alive_timeout_s: float = Field(default=5.0, gt=0)
    max_connections: int = Field(default=1000, ge=1)
    # HTTP/1.1 parser: httptools (C) when installed, else h11 (server/http/connections.py).
    http_parser: Literal["auto", "httptools", "h11"] = "auto"
    # Browser origins allowed to call the API (CORS); empty = no CORS headers at all, so a
    # page on another origin cannot read answers from a loopback server.
    cors_allow_origins: list[str] = Field(default_factory=list)
    # The syntax of tool calls a model chooses to make: "auto" reads the one its chat
    # template teaches (server.http.routes.tool_formats); naming one overrides it.
    tool_call_parser: Literal["auto", "hermes", "llama3_json", "mistral", "pythonic"] = "auto"
    # A top-level request field no endpoint knows: ignored (logged once per name, counted),
    # as llama-server and vLLM do, or a 400 naming it (server/http/unknown_fields.py).
    unknown_fields: Literal["ignore", "reject"] = "ignore"
    # "auto": a model with think tags answers its thinking as reasoning_content, apart from
    # content (server/http/routes/reasoning.py); "none": the text as the model wrote it.
    reasoning_parser: Literal["auto", "none"] = "auto"

    @field_validator("cors_allow_origins")
    @classmethod
    def _check_origins(cls, origins: list[str]) -> list[str]:
        # Browsers send the Origin as scheme://host[:port] with no path: anything else
        # (a trailing slash, a path) would never match and CORS would silently stay off.
        for origin in origins:
            if origin != "*" and not _ORIGIN.fullmatch(origin):
                raise ValueError(f"{origin!r} is not an origin: write \"*\" or "
                                 "scheme://host[:port], e.g. \"https://app.example.com\", "
                                 "with no path or trailing slash")
        return origins


class ModelSection(_Section):
    """Which model to load and in which compute dtype.

    ``path`` empty means the default model named by ``preset``: ``smollm2``
    (the real SmolLM2-135M-Instruct) or the offline random test models
    ``tiny`` and ``small``. ``dtype = "auto"`` computes in float32 on CPU; on a
    GPU it keeps bfloat16/float16 and quantized weights as stored and casts a
    float32 checkpoint to bfloat16 (server/model_weights.py). ``"native"`` keeps
    every weight as stored. On CPU with ``auto``, quantized layers compute
    from their 4/8-bit codes with int8 activations (veloxquant_mlx/codes_linear.py);
    ``max_dequantized_bytes`` > 0 opts in to exact float32 weights when the float32
    copy fits in that many bytes.
    """

    path: str = ""
    # The names the API answers to, the first one primary (the ``model`` of answers);
    # empty: the default name (server.model_loader.served_names).
    served_name: list[str] = Field(default_factory=list)
    dtype: ModelDtype = "auto"
    max_dequantized_bytes: int = Field(default=0, ge=0)
    preset: ModelPreset = "smollm2"
    # /v1/embeddings: the mean of every prompt position's final hidden state, or the
    # last position's (decoder embedding models such as e5-mistral read the last).
    embedding_pooling: Literal["mean", "last"] = "mean"
    # The chat template that renders messages, replacing the tokenizer's own: a file, or
    # the Jinja text itself; empty: the tokenizer's (read_chat_template).
    chat_template: str = ""

    @field_validator("served_name", mode="before")
    @classmethod
    def _one_or_many(cls, names: object) -> object:
        # One name may be written as a string; "" is none.
        if isinstance(names, str):
            return [names] if names else []
        return names

    @field_validator("served_name")
    @classmethod
    def _check_names(cls, names: list[str]) -> list[str]:
        if any(not name.strip() or name != name.strip() for name in names):
            raise ValueError(f"{names!r}: a served name is not blank and has no surrounding "
                             "spaces")
        if len(set(names)) != len(names):
            raise ValueError(f"{names!r} names a model twice")
        return names

    @field_validator("chat_template")
    @classmethod
    def _check_template(cls, template: str) -> str:
        # Read now, so a missing or unreadable file stops start-up before the model loads.
        read_chat_template(template)
        return template


def read_chat_template(template: str) -> str:
    """The Jinja text of ``model.chat_template``: the file it names, else the text itself.

    As vLLM's ``--chat-template`` reads it: a path to a file is read; a value that is no
    file but has template characters (``{``, ``}``, a newline) is the template; anything
    else is a file that is not there.

    Raises:
        ValueError: A missing, unreadable or empty file.
    """
    if not template:
        return ""
    path = Path(template).expanduser()
    if not _is_file(path):
        if any(char in template for char in "{}\n"):
            return template
        raise ValueError("no such file, and no Jinja template either (one has {{ }} or "
                         "{% %}): give the path of a template file or the template's text")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"chat template file {template!r} cannot be read: "
                         f"{getattr(exc, 'strerror', None) or exc}") from None
    if not text.strip():
        raise ValueError(f"chat template file {template!r} is empty")
    return text


def _is_file(path: Path) -> bool:
    """Whether ``path`` is a file; False for text no file can be named (too long, a NUL)."""
    try:
        return path.is_file()
    except (OSError, ValueError):
        return False


DEFAULT_N_BLOCKS = 16384
_BYTE_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1 << 10, "m": 1000**2,
               "mb": 1000**2, "mib": 1 << 20, "g": 1000**3, "gb": 1000**3, "gib": 1 << 30,
               "t": 1000**4, "tb": 1000**4, "tib": 1 << 40}


def parse_bytes(value: str | int) -> int:
    """``"4GiB"``, ``"512 MiB"``, ``"1.5GB"`` or ``4096`` as a positive byte count.

    Raises:
        ValueError: Not a size, an unknown unit, or not positive.
    """
    if isinstance(value, bool):
        raise ValueError(f"{value!r} is not a size")
    text = str(value).strip().lower().replace(" ", "")
    number = text.rstrip("kmgtib")
    unit = text[len(number):]
    try:
        size = int(float(number) * _BYTE_UNITS[unit])
    except (KeyError, ValueError):
        raise ValueError(f"{value!r} is not a size (examples: \"4GiB\", \"512MiB\", "
                         "1073741824)") from None
    if size < 1:
        raise ValueError(f"{value!r} must be more than 0 bytes")
    return size


class PoolSection(_Section):
    """Sizing of the one shared block pool (see ``veloxquant_mlx.memory.PoolConfig``).

    ``max_blocks = 0`` means no cap on growth (only used with
    ``grow_on_exhaustion``); TOML has no null, so 0 stands in for None.
    ``kv_memory`` sizes the pool in bytes instead of blocks (``"4GiB"``,
    ``"512MiB"`` or a byte count; empty = use ``n_blocks``): the engine turns
    it into ``n_blocks`` once the model's layout is known. Give one of the
    two: a ``kv_memory`` beside an ``n_blocks`` other than its default is refused.
    """

    block_size: int = Field(default=16, ge=1)
    n_blocks: int = DEFAULT_N_BLOCKS
    kv_memory: str | int = ""
    separate_kv: bool = True
    grow_on_exhaustion: bool = False
    max_blocks: int = Field(default=0, ge=0)

    @property
    def kv_memory_bytes(self) -> int | None:
        """``kv_memory`` in bytes, or None when the pool is sized by ``n_blocks``."""
        return parse_bytes(self.kv_memory) if self.kv_memory not in ("", 0) else None

    @model_validator(mode="after")
    def _check_kv_memory(self) -> PoolSection:
        try:
            kv = self.kv_memory_bytes
        except ValueError as exc:
            raise _FieldProblem("kv_memory", str(exc)) from None
        if kv is not None and self.n_blocks != DEFAULT_N_BLOCKS:
            raise _FieldProblem("kv_memory", f"{self.kv_memory!r} and pool.n_blocks = "
                                f"{self.n_blocks} both size the pool; set only one")
        return self

    @model_validator(mode="after")
    def _check_sizes(self) -> PoolSection:
        if self.n_blocks < (2 if self.separate_kv else 1):
            raise _FieldProblem("n_blocks", f"{self.n_blocks} is too small "
                                "(needs >= 2 with separate_kv, else >= 1)")
        if self.max_blocks and self.max_blocks < self.n_blocks:
            raise _FieldProblem("max_blocks", f"{self.max_blocks} must be 0 (no cap) or "
                                f">= pool.n_blocks ({self.n_blocks})")
        return self


class LimitsSection(_Section):
    """Per-request limits and the admission queue's bounds."""

    default_max_tokens: int = 256
    max_tokens_cap: int = Field(default=4096, ge=1)
    max_prompt_tokens: int = Field(default=8192, ge=1)
    # Positions one request may reach, prompt plus generated tokens; 0: the model's
    # own max_position_embeddings (no bound if its config states none).
    max_context_tokens: int = Field(default=0, ge=0)
    max_queue: int = Field(default=64, ge=0)
    queue_timeout_s: float = Field(default=30.0, gt=0)
    retry_after_s: int = Field(default=1, ge=1)
    max_stop_sequences: int = Field(default=8, ge=0)
    max_stop_length: int = Field(default=256, ge=1)
    max_body_bytes: int = Field(default=1048576, ge=1024)
    stream_stall_timeout_s: float = Field(default=30.0, gt=0)
    engine_stall_timeout_s: float = Field(default=120.0, gt=0)
    max_concurrent_per_client: int = Field(default=0, ge=0)  # 0 = no cap
    max_choices: int = Field(default=16, ge=1)  # n x prompts of one request
    # The most of the pool one request (a choice group: all its n) may reserve while
    # others wait; a larger one waits until nobody else does. 1: no cap.
    max_pool_share: float = Field(default=0.5, gt=0.0, le=1.0)
    # Compiled structured-output grammars kept, by their estimated bytes ("256MiB" or a
    # byte count); past it the least recently used go (server.text.schemas.GrammarCache).
    grammar_cache_bytes: str | int = "256MiB"

    @field_validator("grammar_cache_bytes")
    @classmethod
    def _check_grammar_cache(cls, size: str | int) -> str | int:
        parse_bytes(size)  # a ValueError says what a size looks like
        return size

    @model_validator(mode="after")
    def _check_default_fits_cap(self) -> LimitsSection:
        if not 1 <= self.default_max_tokens <= self.max_tokens_cap:
            raise _FieldProblem("default_max_tokens", f"{self.default_max_tokens} must be in "
                                f"1..limits.max_tokens_cap ({self.max_tokens_cap})")
        return self


class SamplingSection(_Section):
    """Sampling defaults for requests that leave a field out (0 disables top_k)."""

    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0)
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)


class BatchSection(_Section):
    """Continuous batching: how many requests decode together and how prompts are fed in."""

    max_batch_size: int = Field(default=32, ge=1)
    prefill_chunk_size: int = Field(default=512, ge=1)
    max_prefill_tokens_per_step: int = Field(default=2048, ge=1)
    max_prefill_s_per_step: float = Field(default=1.0, ge=0.0)
    kv_write_back: int = Field(default=32, ge=1)
    compile_decode: bool = True
    fuse_projections: bool = True
    events_at_submit: Literal["auto"] | bool = "auto"


KVFormatName = Literal["native", "q8", "q4", "turboquant_mse", "polar"]
KV_FORMAT_NAMES: tuple[str, ...] = get_args(KVFormatName)


class KVSection(_Section):
    """How the pool stores keys and values (``veloxquant_mlx.memory.kv_format``).

    ``native`` keeps the model's compute dtype; ``q8``/``q4`` store affine
    8/4-bit codes, per ``group_size`` values of a head (it must divide the
    model's head_dim) a float16 scale and a zero point (q8, one byte) or a
    float16 bias (q4). The same ``pool.kv_memory`` then holds ~1.9x / ~3.6x
    the tokens of float16 KV at group_size 64. ``turboquant_mse`` and ``polar``
    are the library's compression methods that code each vector alone (a
    rotation, then 4-bit Lloyd-Max codes and a norm; or PolarQuant's angle
    codes): ~3.8x / ~4.1x at head_dim 64, decoded with a matmul per gathered
    vector. The other methods (kivi, qjl, spectral, turboquant_prod) run per
    request, not in the batched pool: naming one here stops start-up with its
    reason.
    """

    format: KVFormatName = "native"
    group_size: int = 64

    @field_validator("format", mode="before")
    @classmethod
    def _check_format(cls, name: object) -> object:
        # A compression method's name gets why it is not served, not a bare list of choices.
        problem = pool_format_problem(name) if isinstance(name, str) else None
        if problem is not None:
            raise ValueError(problem)
        return name

    @field_validator("group_size")
    @classmethod
    def _check_group(cls, group: int) -> int:
        # The group sizes mx.quantize accepts (veloxquant_mlx.memory.kv_format.GROUP_SIZES).
        if group not in (32, 64, 128):
            raise ValueError(f"{group} is not a supported group size; choose 32, 64 or 128")
        return group


class CacheSection(_Section):
    """Prefix caching (server.engine.kv_memory): full prompt blocks stay in the pool,
    shared by later requests with the same prefix; unreferenced ones are evicted
    least recently used first when admission needs the room."""

    prefix_caching: bool = True
    # Whose prompts may share cached blocks: everyone's ("none"), or only those sent
    # with the same API key ("api_key"); a request's cache_salt narrows it further.
    isolation: Literal["none", "api_key"] = "none"


class MetricsSection(_Section):
    """What ``/metrics`` exports besides the ``veloxquant_*`` families.

    ``vllm_names`` adds vLLM's names (``vllm:num_requests_running``, ...) for the values
    the server measures, labelled ``model_name``, so dashboards, autoscaling rules and
    gateways written for vLLM read this server unchanged (server.metrics.VllmNames).
    """

    vllm_names: bool = False


class DistributedSection(_Section):
    """One model over several processes (server.distributed): tensor parallel
    over mx.distributed's ring backend; rank 0 serves HTTP, owns admission and the pool
    figures, the other ranks follow each step. 1 = one process (off)."""

    ranks: int = Field(default=1, ge=1, le=64)


class CpuSection(_Section):
    """CPU backend knobs (Linux): load OpenBLAS under MLX at start-up."""

    optimized_blas: bool = True
