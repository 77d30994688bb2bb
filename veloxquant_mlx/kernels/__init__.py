"""Native MLX operations the project owns (built against the installed MLX; see build.py)."""
