"""``python -m server`` / ``veloxquant-serve``: parse flags, load settings, serve.

The flags (one for every setting, and the names vLLM and llama.cpp use) are
:mod:`server.cli`'s.

Order matters: settings first (cheap, no MLX), then MLX's environment defaults
(:mod:`veloxquant_mlx.mlx_env`) and the optimized BLAS, loaded into this process (both
must happen before anything imports MLX), then the app.

Both entry points call :func:`run`, which ends the process with ``os._exit`` once
:func:`main` has returned (see :func:`run` for why); :func:`main` itself returns the
exit code, so tests call it in-process.
"""

from __future__ import annotations

import logging
import os
import sys
import traceback
from pathlib import Path
from typing import NoReturn

from server.cli import (
    parse_args,
    render_config,
    settings_from_args,
    warn_secret_flags,
)
from server.pool_fit import (
    records_problem,  # imports no MLX
)
from server.settings import ConfigError, Settings
from veloxquant_mlx.cpu_backend import load_optimized_blas  # imports no MLX
from veloxquant_mlx.mlx_env import MLX_ENV_DEFAULTS, apply_mlx_env_defaults  # no MLX

log = logging.getLogger("veloxquant.server")


def main(argv: list[str] | None = None) -> int:
    """Run the server until interrupted; returns the process exit code."""
    args = parse_args(argv)
    try:
        settings = settings_from_args(args)
    except ConfigError as exc:
        print(f"veloxquant-serve: bad configuration: {exc}", file=sys.stderr)
        return 2
    if args.print_config:
        print(render_config(args, settings))
        return 0
    problem = records_problem(settings)
    if problem is not None:  # before the app builds the pool's records
        print(f"veloxquant-serve: bad configuration: {problem}", file=sys.stderr)
        return 2
    # MLX reads these when it makes a stream: before any MLX import.
    apply_mlx_env_defaults()
    logging.basicConfig(level=settings.server.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    warn_secret_flags(args)
    # MLX binds its BLAS when it loads: the optimized one must be in the process first.
    load_optimized_blas(settings.cpu.optimized_blas)
    if settings.distributed.ranks > 1:
        return _serve_distributed(settings)
    return _serve(settings)


def _serve(settings: Settings) -> int:
    """Serve HTTP in this process until stopped (rank 0 when the model is split)."""
    from server.file_limit import import_mlx_lm

    import_mlx_lm()  # first import of mlx_lm: keeps it from lowering the open-file limit
    from server.http.serve import bind_problem
    from server.model_loader import ModelSourceError, resolve_model_path

    problem = bind_problem(settings.server.host, settings.server.port)
    if problem is not None:  # before a model load that can take minutes
        print(f"veloxquant-serve: {problem}", file=sys.stderr)
        return 2
    # Find (build or convert) the model before serving, so a bad source stops
    # start-up with one line and exit code 2 instead of a server that is never ready.
    try:
        resolve_model_path(settings.model)
    except ModelSourceError as exc:
        print(f"veloxquant-serve: {exc}", file=sys.stderr)
        return 2
    # After the model check (a bad source still stops with one line); the values in effect,
    # ours or the operator's.
    log.info("MLX settings: %s",
             " ".join(f"{name}={os.environ.get(name)}" for name in MLX_ENV_DEFAULTS))
    from server.http import request_log
    from server.http.app import create_app
    from server.http.serve import ModelLoadFailed, serve

    request_log.configure(settings.server.request_log)
    log.info("settings: %r", settings)  # secrets are excluded from the repr
    # SIGTERM drains (server/http/serve.py); a non-loopback bind without an API key warns.
    try:
        serve(create_app(settings), settings)
    except ModelLoadFailed as exc:
        print(f"veloxquant-serve: model failed to load: {exc}", file=sys.stderr)
        return 2
    return 0


def _serve_distributed(settings: Settings) -> int:
    """Rank 0 serves (and starts ranks 1.. here unless ``mlx.launch`` did); the others follow."""
    import subprocess

    from server import distributed
    from server.engine import startup
    from server.file_limit import import_mlx_lm

    import_mlx_lm()
    from server.model_loader import ModelSourceError, resolve_model_path

    try:  # before the copies start: building or converting the model happens once
        distributed.check_split(resolve_model_path(settings.model), settings.distributed.ranks)
    except (ModelSourceError, distributed.DistributedError) as exc:
        print(f"veloxquant-serve: {exc}", file=sys.stderr)
        return 2
    followers = distributed.spawn_local_ranks(settings.distributed.ranks,
                                              [sys.executable, *sys.orig_argv[1:]])
    rank = int(os.environ.get(distributed.RANK_ENV, "0"))
    try:
        if rank != 0:
            return startup.serve_follower(settings)
        return _serve(settings)
    except distributed.DistributedError as exc:
        print(f"veloxquant-serve: rank {rank}: {exc}", file=sys.stderr)
        return 2
    finally:
        for proc in followers:  # they exit when rank 0's engine says stop
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
        if followers:  # the ring's hostfile is ours (spawn_local_ranks wrote it)
            Path(os.environ[distributed.HOSTFILE_ENV]).unlink(missing_ok=True)


def run() -> NoReturn:
    """Run :func:`main`, flush every log and stream, then end the process at once.

    MLX's C++ singletons (device, scheduler, the CUDA backend's worker threads) are
    destroyed by static destructors at normal process exit. When MLX work ran on a thread
    other than the main one -- all of ours runs on the engine thread -- they can still be
    referenced then, and the process aborts after a clean drain (``terminate called without
    an active exception`` on an H200 with MLX's CUDA backend; ml-explore/mlx issue #3126;
    MLX 0.32's thread-local compile caches can crash at teardown too). By the time
    :func:`main` returns, the app's lifespan has stopped the engine thread and it has
    synchronized its MLX work, so nothing is left for those destructors to do: ``os._exit``
    skips them, and atexit handlers (this project registers none).
    """
    try:
        code = main()
    except KeyboardInterrupt:  # SIGINT: uvicorn stops gracefully, then re-raises it
        code = 130
    except SystemExit as exc:  # argparse (--help, bad flag) and uvicorn's start-up failure
        code = _exit_code(exc)
    except BaseException:  # reported as the interpreter would, then exit 1
        traceback.print_exc()
        code = 1
    logging.shutdown()  # flushes and closes every handler (the request log included)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed or broken pipe: nothing more to save
            pass
    os._exit(code)


def _exit_code(exc: SystemExit) -> int:
    """The status ``sys.exit(arg)`` would give: None is 0, an int itself, else 1."""
    if exc.code is None or isinstance(exc.code, int):
        return exc.code or 0
    print(exc.code, file=sys.stderr)
    return 1


if __name__ == "__main__":
    run()
