"""VeloxQuant-MLX inference server (OpenAI-compatible, FastAPI)."""
