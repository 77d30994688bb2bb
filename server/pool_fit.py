"""Whether the configured pool can exist on this machine at all.

The pool is allocated once, at start: its block records (host memory, ~250 bytes
each with the native allocator) when the app is built, its KV arena when the model
has loaded. Unchecked, a pool that cannot fit is discovered by the kernel:
``pool.kv_memory = "1000TiB"`` or ``pool.n_blocks = 10**20`` is accepted and the
process grows until the out-of-memory killer ends it (and everything around it
feels the pressure). These checks refuse such a pool with one line naming the key.
"""

from __future__ import annotations

from typing import Any

from server.model_weights import machine_memory_bytes
from server.settings import Settings
from veloxquant_mlx.mlx_device import device_memory

# Host bytes one block's record takes at least (measured ~250 with the native
# allocator, more in pure Python): a floor, so the check never refuses a pool that fits.
RECORD_BYTES = 200


def _gib(n: int) -> str:
    return f"{n / 2**30:,.1f} GiB"


def records_problem(settings: Settings, memory: int | None = None) -> str | None:
    """Why ``pool.n_blocks``'s block records alone cannot fit this machine, or None.

    Only for a pool sized in blocks: one sized by ``pool.kv_memory`` is checked
    with its arena (:func:`arena_problem`) once the model's KV layout is known.
    """
    memory = machine_memory_bytes() if memory is None else memory
    pool = settings.pool
    if pool.kv_memory_bytes is not None or memory <= 0:
        return None
    largest = max(pool.n_blocks, pool.max_blocks or 0)
    need = largest * RECORD_BYTES
    if need <= memory:
        return None
    key = "pool.max_blocks" if (pool.max_blocks or 0) > pool.n_blocks else "pool.n_blocks"
    return (f"{key} = {largest:,} blocks cannot exist on this machine: their records alone "
            f"take at least {_gib(need)} of its {_gib(memory)} of memory (before any KV); "
            "lower it, or size the pool with pool.kv_memory")


def arena_problem(settings: Settings, n_blocks: int, bytes_per_block: int,
                  device_memory: int, host_memory: int | None = None) -> str | None:
    """Why a pool of ``n_blocks`` blocks of ``bytes_per_block`` KV bytes cannot fit, or None.

    Args:
        settings: The settings (names the key that sized the pool).
        n_blocks: Blocks the pool would have.
        bytes_per_block: KV arena bytes per block for the loaded model.
        device_memory: Bytes where the arena lives (RAM on the CPU, the GPU's own).
        host_memory: Bytes for the block records (default: this machine's RAM).
    """
    host = machine_memory_bytes() if host_memory is None else host_memory
    arena = n_blocks * bytes_per_block
    key = ("pool.kv_memory" if settings.pool.kv_memory_bytes is not None else "pool.n_blocks")
    value = settings.pool.kv_memory if key == "pool.kv_memory" else f"{n_blocks:,}"
    if device_memory > 0 and arena > device_memory:
        return (f"{key} = {value} needs a KV arena of {_gib(arena)} ({n_blocks:,} blocks of "
                f"{bytes_per_block:,} bytes for this model), more than the "
                f"{_gib(device_memory)} of memory it would live in; lower {key}")
    if host > 0 and n_blocks * RECORD_BYTES > host:
        return (f"{key} = {value} makes {n_blocks:,} blocks, whose records alone take at least "
                f"{_gib(n_blocks * RECORD_BYTES)} of this machine's {_gib(host)}; lower {key}")
    return None


def device_memory_bytes(mx: Any) -> int:
    """Memory of MLX's default device: the GPU's own, or this machine's RAM on the CPU."""
    device = mx.default_device()
    if device.type == mx.DeviceType.gpu:
        return device_memory(mx, device) or machine_memory_bytes()
    return machine_memory_bytes()
