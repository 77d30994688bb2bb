"""Optional native build of the allocator's hot path.

The block pool's bookkeeping (records.py, block_pool.py) is plain, fully
typed Python. When mypyc and a C compiler are available at install time it is
compiled to a C extension, which roughly halves the per-call cost; if either
is missing or the build fails, the pure-Python modules are used unchanged.
Set VELOXQUANT_PURE_PYTHON=1 to skip the native build.
"""

import os
import sys

from setuptools import setup
from setuptools.command.build_ext import build_ext

NATIVE_MODULES = ["veloxquant_mlx/memory/records.py", "veloxquant_mlx/memory/block_pool.py"]


class OptionalBuildExt(build_ext):
    """Build the native modules if possible; fall back to pure Python otherwise."""

    def run(self) -> None:
        try:
            super().run()
        except Exception as exc:  # a missing compiler must not break the install
            print(f"veloxquant: native allocator not built ({exc}); using pure Python",
                  file=sys.stderr)

    def build_extension(self, ext) -> None:
        try:
            super().build_extension(ext)
        except Exception as exc:
            print(f"veloxquant: skipping native {ext.name} ({exc})", file=sys.stderr)


def native_extensions() -> list:
    if os.environ.get("VELOXQUANT_PURE_PYTHON"):
        return []
    try:
        from mypyc.build import mypycify

        # Other modules are only followed for types, never compiled.
        return mypycify(["--follow-imports=silent", *NATIVE_MODULES], opt_level="3")
    except (SystemExit, Exception) as exc:  # mypy reports type errors by exiting
        print(f"veloxquant: native allocator disabled ({exc!r})", file=sys.stderr)
        return []


setup(ext_modules=native_extensions(), cmdclass={"build_ext": OptionalBuildExt})
