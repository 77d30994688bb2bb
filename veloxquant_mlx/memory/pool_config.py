"""PoolConfig: the validated, frozen sizing of a block pool.

Kept in its own pure-Python module (never compiled, see setup.py) so that
validation sees arguments exactly as given: a compiled ``int`` field would
turn ``True`` into 1 before the check could reject it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from veloxquant_mlx.exceptions import PoolArgumentError, PoolArgumentTypeError

HISTORY_LEN: Final = 256

POOL_KV_FORMATS: Final = ("native", "q8", "q4", "turboquant_mse", "polar")
"""How the shared pool can store keys and values (``kv_format.KVFormat``)."""

POOL_CODED_METHODS: Final = ("turboquant_mse", "polar")
"""The compression methods of ``veloxquant_mlx.cache`` that are also pool formats:
they code each vector alone, so a block's bytes are final once written."""

PER_REQUEST_METHODS: Final = {
    "kivi": "quantizes keys per channel over a window of recent tokens, so a block's keys "
            "change after they are written, and blocks read by a batch must hold final bytes",
    "turboquant_prod": "scores keys with an estimator on the query's random projection "
                       "(QJL), not by attention over decoded keys",
    "qjl": "scores keys with an estimator on the query's random projection, not by "
           "attention over decoded keys",
    "spectral": "stores coefficients in a basis fitted to the request's own first tokens, "
                "which a block shared by a batch does not carry",
}
"""The KV compression methods of ``veloxquant_mlx.cache`` that run only per request
(``PooledKVCache``), and why each is not a format of the batched pool."""


def pool_format_problem(name: str) -> str | None:
    """Why ``name`` is not a KV format the pool stores, or None when it is."""
    if name in POOL_KV_FORMATS:
        return None
    why = PER_REQUEST_METHODS.get(name)
    if why is None:
        return f"unknown KV format {name!r}; choose one of {', '.join(POOL_KV_FORMATS)}"
    return (f"{name!r} is a KV compression method that runs per request (veloxquant_mlx."
            f"cache, through PooledKVCache), not a format of the batched pool: it {why}; "
            f"the pool stores {', '.join(POOL_KV_FORMATS)}")
SPLIT_STREAMS: Final = ("k", "v")
SHARED_STREAM: Final = "kv"


def check_count(name: str, value: object, minimum: int) -> int:
    """Validate an integer argument (bools are rejected: True is not a count)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise PoolArgumentTypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise PoolArgumentError(f"{name} must be >= {minimum}, got {value}")
    return value


@dataclass(frozen=True)
class PoolConfig:
    """Sizing and behaviour of a pool.

    Attributes:
        block_size: Token slots per block.
        n_blocks: Total blocks created up front (split between "k" and "v"
            when ``separate_kv``; "k" takes the odd one).
        separate_kv: Keys and values draw from independent free stacks.
        grow_on_exhaustion: Grow a stream just enough instead of raising.
        max_blocks: Cap on the total once grown (None: unbounded). Only used
            with ``grow_on_exhaustion``.
    """

    block_size: int = 16
    n_blocks: int = 1024
    separate_kv: bool = True
    grow_on_exhaustion: bool = False
    max_blocks: int | None = None

    def __post_init__(self) -> None:
        check_count("block_size", self.block_size, 1)
        check_count("n_blocks", self.n_blocks, 1)
        if self.max_blocks is not None:
            check_count("max_blocks", self.max_blocks, 1)
            if self.max_blocks < self.n_blocks:
                raise PoolArgumentError(
                    f"max_blocks ({self.max_blocks}) must be >= n_blocks ({self.n_blocks})"
                )
        for flag in ("separate_kv", "grow_on_exhaustion"):
            if not isinstance(getattr(self, flag), bool):
                raise PoolArgumentTypeError(f"{flag} must be a bool")

    @property
    def streams(self) -> tuple[str, ...]:
        """The stream names this configuration allocates from."""
        return SPLIT_STREAMS if self.separate_kv else (SHARED_STREAM,)
