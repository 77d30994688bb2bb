"""``python -m veloxquant_mlx.kernels``: build the native operations now (make install does)."""

import sys

from veloxquant_mlx.kernels.build import KernelBuildError, build

try:
    print(build(quiet=False))
except KernelBuildError as exc:
    print(f"veloxquant: native kernels not built: {exc}", file=sys.stderr)
    sys.exit(1)
