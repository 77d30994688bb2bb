"""VeloxQuant-MLX: block-pool KV-cache memory and KV compression for MLX."""

__version__ = "0.1.0"
