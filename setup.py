"""Optional native builds: the allocator's hot path, and the single-row sgemm forward.

The block pool's bookkeeping (records.py, free_stacks.py, block_pool.py) is plain, fully
typed Python. When mypyc and a C compiler are available at install time it is
compiled to a C extension, which roughly halves the per-call cost; if either
is missing or the build fails, the pure-Python modules are used unchanged.
Set VELOXQUANT_PURE_PYTHON=1 to skip the native build.

On Linux, ``veloxquant_mlx/sgemv_forward.c`` becomes a shared object that the
CPU backend loads in front of OpenBLAS, as MLX's ``cblas_sgemm`` (never imported
by Python; see its header and ``veloxquant_mlx/cpu_backend.py``). Without a
compiler it is simply not there: the scipy-openblas32 wheel, whose names only
the forward translates, then goes unused, and only a distribution's OpenBLAS
can serve MLX.
"""

import hashlib
import os
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

NATIVE_MODULES = ["veloxquant_mlx/memory/records.py", "veloxquant_mlx/memory/free_stacks.py",
                  "veloxquant_mlx/memory/block_pool.py"]
# Beside each compiled module: the SHA-256 of the source it was built from, so an
# import can tell a stale build from a fresh one (pip does not keep a wheel's file
# times, so comparing mtimes would call every wheel install stale).
SOURCE_STAMP = ".source-sha256"


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
            return
        source = native_source(ext)
        if source is not None:
            write_stamp(Path(self.get_ext_fullpath(ext.name)).parent, source)

    def copy_extensions_to_source(self) -> None:
        """An editable install copies the modules into the source tree: the stamps too."""
        super().copy_extensions_to_source()
        for ext in self.extensions:
            source = native_source(ext)
            if source is not None and Path(self.get_ext_fullpath(ext.name)).is_file():
                write_stamp(Path(source).parent, source)


def native_source(ext) -> str | None:
    """The source file of a mypyc-compiled allocator module, None for other extensions."""
    source = ext.name.replace(".", "/") + ".py"
    return source if source in NATIVE_MODULES else None


def write_stamp(folder: Path, source: str) -> None:
    """Record, in ``folder``, which text of ``source`` its compiled module was built from."""
    stamp = folder / (Path(source).stem + SOURCE_STAMP)
    stamp.write_text(hashlib.sha256(Path(source).read_bytes()).hexdigest() + "\n")


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


def sgemv_forward() -> list:
    if not sys.platform.startswith("linux"):
        return []
    return [Extension("veloxquant_mlx._sgemv_forward",
                      ["veloxquant_mlx/sgemv_forward.c", "veloxquant_mlx/prefill_attention.c",
                       "veloxquant_mlx/swiglu.c"],
                      depends=["veloxquant_mlx/forward.h", "veloxquant_mlx/kernels/vq_exp.h"],
                      extra_compile_args=["-O2", "-pthread"], libraries=["dl", "pthread"])]


setup(ext_modules=native_extensions() + sgemv_forward(),
      cmdclass={"build_ext": OptionalBuildExt})
