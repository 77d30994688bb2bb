"""MLX allocator readings for the engine's memory gauge (engine thread only).

The model itself is driven by :mod:`server.prefill` (prompts, in groups) and
:mod:`server.batch` (one batched decode call per step).
"""

from __future__ import annotations

import mlx.core as mx


def memory_snapshot() -> dict[str, int]:
    """MLX allocator counters in bytes (active, cache, peak)."""
    return {
        "active": int(mx.get_active_memory()),
        "cache": int(mx.get_cache_memory()),
        "peak": int(mx.get_peak_memory()),
    }
