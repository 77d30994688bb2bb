"""The HTTP side: FastAPI app, routes, schemas, guards, auth, errors, serving.

It talks to the engine only through :mod:`server.protocol` records and
the engine's thread-safe methods; it never touches MLX.
"""
