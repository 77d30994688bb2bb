#!/usr/bin/env python3
"""Build the project's offline default model (no download needed).

Usage:
    python scripts/make_model.py --preset tiny            # -> <models dir>/tiny
    python scripts/make_model.py --preset small --force   # rebuild <models dir>/small
    python scripts/make_model.py --preset tiny --out /tmp/models

The models dir is $VELOXQUANT_HOME/models, else the user cache
(~/.cache/veloxquant-mlx/models on Linux).

Prints the model folder, which ``mlx_lm.load`` and the server's ``--model`` accept.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from veloxquant_mlx.offline_model import PRESETS, ensure_model  # noqa: E402
from veloxquant_mlx.paths import models_dir  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    """Parse arguments, build (or find) the model, print its folder."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help=f"folder holding the models; the model lands in OUT/PRESET (default {models_dir()})",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    parser.add_argument("--force", action="store_true", help="rebuild even if it exists")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    folder = ensure_model(args.preset, root=args.out, seed=args.seed, force=args.force)
    elapsed = time.perf_counter() - start
    print(f"{folder}  ({elapsed:.1f}s)", file=sys.stderr)
    print(folder)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
