"""Configuration, registry and fluent builder for the compressed KV caches.

``KVCacheConfig`` is frozen and validated on construction; ``KVCacheFactory``
maps method names to :class:`~veloxquant_mlx.cache.base.KVCache` subclasses;
``KVCacheBuilder`` is the fluent front door used in the docs::

    cache = KVCacheBuilder().with_method("kivi").with_head_dim(128).with_bits(2).build()
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import ClassVar

from veloxquant_mlx.cache.base import KVCache


def _whole(value: object) -> bool:
    """An int and not a bool (``bits=True`` is not a bit count)."""
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class KVCacheConfig:
    """Everything needed to build one head's compressed cache.

    Attributes:
        method: Registered method name; see ``KVCacheFactory.available_methods()``.
        head_dim: Dimension of each key/value vector.
        bits: Bits per quantized number; ``None`` picks the method's default.
            Filled in during construction, so ``config.bits`` is always an int.
        group_size: Numbers sharing one scale/zero point (kivi, qjl values).
        residual_length: Recent tokens kivi keeps in float16 (a multiple of
            ``group_size``).
        seed: Seed of every random rotation/projection; same seed, same codes.
        rank: Spectral basis rank; ``None`` chooses it from ``energy``.
        energy: Fraction of calibration energy the spectral basis keeps.
        calibration_tokens: Tokens the spectral method buffers before fitting
            its basis.
        outlier_channels: Key channels per token group that qjl sketches
            apart from the rest (0 disables the split).

    Raises:
        ValueError: On an unknown method, bits outside the method's range, a
            head_dim the method cannot handle, or an out-of-range knob.
    """

    method: str = "turboquant_mse"
    head_dim: int = 128
    bits: int | None = None
    group_size: int = 32
    residual_length: int = 128
    seed: int = 0
    rank: int | None = None
    energy: float = 0.95
    calibration_tokens: int = 128
    outlier_channels: int = 8

    def __post_init__(self) -> None:
        cls = KVCacheFactory.method_class(self.method)
        if not _whole(self.head_dim) or self.head_dim < 4:
            raise ValueError(f"head_dim must be an int >= 4, got {self.head_dim!r}")
        lo, hi = cls.bits_range
        if self.bits is None:
            object.__setattr__(self, "bits", cls.default_bits)
        elif not _whole(self.bits) or not lo <= self.bits <= hi:
            raise ValueError(
                f"bits={self.bits!r} is out of range for method {self.method!r}; "
                f"valid choices: {list(range(lo, hi + 1))}"
            )
        self._check_knobs()
        problem = cls.head_dim_error(self)
        if problem:
            raise ValueError(
                f"head_dim={self.head_dim} is not supported by {self.method!r}: {problem}"
            )
        problem = cls.knob_error(self)
        if problem:
            raise ValueError(f"method {self.method!r} cannot run with this config: {problem}")

    def _check_knobs(self) -> None:
        # Counts first: a float group_size would only fail later, inside MLX.
        for name in ("group_size", "residual_length", "calibration_tokens", "outlier_channels"):
            if not _whole(getattr(self, name)):
                raise ValueError(f"{name} must be an int, got {getattr(self, name)!r}")
        # The seed feeds numpy's generator, whose own errors would not name it.
        if not _whole(self.seed) or self.seed < 0:
            raise ValueError(f"seed must be an int >= 0, got {self.seed!r}")
        if self.rank is not None and not _whole(self.rank):
            raise ValueError(f"rank must be an int or None, got {self.rank!r}")
        if self.group_size < 1:
            raise ValueError(f"group_size must be >= 1, got {self.group_size}")
        if self.residual_length < 0:
            raise ValueError(f"residual_length must be >= 0, got {self.residual_length}")
        if self.rank is not None and self.rank < 1:
            raise ValueError(f"rank must be >= 1 or None (choose by energy), got {self.rank}")
        if not 0.0 < self.energy <= 1.0:
            raise ValueError(f"energy must be in (0, 1], got {self.energy}")
        if self.calibration_tokens < 2:
            raise ValueError(f"calibration_tokens must be >= 2, got {self.calibration_tokens}")
        if self.outlier_channels < 0:
            raise ValueError(f"outlier_channels must be >= 0, got {self.outlier_channels}")


class KVCacheFactory:
    """Registry of cache methods: ``register``, ``create``, ``available_methods``."""

    _registry: ClassVar[dict[str, type[KVCache]]] = {}

    @classmethod
    def register(cls, name: str, cache_cls: type[KVCache]) -> None:
        """Register ``cache_cls`` under ``name`` (re-registering replaces it).

        Raises:
            TypeError: If ``cache_cls`` is not a ``KVCache`` subclass.
        """
        if not (isinstance(cache_cls, type) and issubclass(cache_cls, KVCache)):
            raise TypeError(f"{cache_cls!r} is not a KVCache subclass; subclass cache.base.KVCache")
        cls._registry[name] = cache_cls

    @classmethod
    def available_methods(cls) -> list[str]:
        """Registered method names, sorted."""
        return sorted(cls._registry)

    @classmethod
    def method_class(cls, name: str) -> type[KVCache]:
        """The class registered under ``name``.

        Raises:
            ValueError: Naming the valid methods, if ``name`` is unknown.
        """
        try:
            return cls._registry[name]
        except KeyError:
            raise ValueError(
                f"unknown KV-cache method {name!r}; valid choices: {cls.available_methods()}"
            ) from None

    @classmethod
    def create(cls, config: KVCacheConfig) -> KVCache:
        """Build a cache for ``config``."""
        return cls.method_class(config.method)(config)


class KVCacheBuilder:
    """Fluent builder over :class:`KVCacheConfig`; each ``with_*`` returns ``self``."""

    def __init__(self) -> None:
        self._fields: dict[str, object] = {}

    def _set(self, name: str, value: object) -> KVCacheBuilder:
        self._fields[name] = value
        return self

    def with_method(self, method: str) -> KVCacheBuilder:
        """Choose the compression method."""
        return self._set("method", method)

    def with_head_dim(self, head_dim: int) -> KVCacheBuilder:
        """Set the per-head vector dimension."""
        return self._set("head_dim", head_dim)

    def with_bits(self, bits: int) -> KVCacheBuilder:
        """Set bits per quantized number."""
        return self._set("bits", bits)

    def with_group_size(self, group_size: int) -> KVCacheBuilder:
        """Set the quantization group size."""
        return self._set("group_size", group_size)

    def with_residual_length(self, residual_length: int) -> KVCacheBuilder:
        """Set kivi's full-precision window of recent tokens."""
        return self._set("residual_length", residual_length)

    def with_seed(self, seed: int) -> KVCacheBuilder:
        """Seed the random rotations/projections."""
        return self._set("seed", seed)

    def with_rank(self, rank: int) -> KVCacheBuilder:
        """Fix the spectral rank."""
        return self._set("rank", rank)

    def with_energy(self, energy: float) -> KVCacheBuilder:
        """Set the spectral energy fraction (used when no rank is fixed)."""
        return self._set("energy", energy)

    def with_calibration_tokens(self, n: int) -> KVCacheBuilder:
        """Set the spectral calibration window."""
        return self._set("calibration_tokens", n)

    def with_outlier_channels(self, n: int) -> KVCacheBuilder:
        """Set how many key channels per group qjl sketches separately."""
        return self._set("outlier_channels", n)

    def with_config(self, config: KVCacheConfig) -> KVCacheBuilder:
        """Start from an existing config's values."""
        self._fields.update({f.name: getattr(config, f.name) for f in fields(config)})
        return self

    def config(self) -> KVCacheConfig:
        """The validated config built so far (raises ``ValueError`` if invalid)."""
        return KVCacheConfig(**self._fields)  # type: ignore[arg-type]

    def build(self) -> KVCache:
        """Validate the config and create the cache."""
        return KVCacheFactory.create(self.config())


def _register_builtins() -> None:
    # Imported here, not at the top: the method modules import base only, and
    # registration must not depend on import order elsewhere.
    from veloxquant_mlx.cache.kivi import KIVICache
    from veloxquant_mlx.cache.polar import PolarQuantCache
    from veloxquant_mlx.cache.qjl import QJLCache
    from veloxquant_mlx.cache.spectral import SpectralCache
    from veloxquant_mlx.cache.turboquant import TurboQuantMSECache, TurboQuantProdCache

    for cache_cls in (
        KIVICache,
        TurboQuantMSECache,
        TurboQuantProdCache,
        QJLCache,
        PolarQuantCache,
        SpectralCache,
    ):
        KVCacheFactory.register(cache_cls.method, cache_cls)


_register_builtins()
