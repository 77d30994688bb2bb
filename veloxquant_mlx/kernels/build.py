"""Build (once) and load the native MLX operations in this folder.

An MLX extension must be compiled against the very MLX it runs with (its Primitive
subclasses MLX's C++ class), so it is built here, against the installed ``mlx``, with
CMake, nanobind and the headers and CMake config MLX's wheel ships, rather than in pip's
isolated build environment, which may hold another MLX. The result is cached by MLX
version, Python version and the sources' hash; ``python -m veloxquant_mlx.kernels`` builds
it ahead of time (``make install`` does), and a later process only imports it.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path
from types import ModuleType

HERE = Path(__file__).resolve().parent
SOURCES = ["codes_matmul.cpp", "codes_block.cpp", "decode_attention.cpp", "codes_kernel.c",
           "codes_portable.c", "codes_avx2.c", "codes_gemm.c",
           "exact_top.c", "codes_kernel.h", "codes_rows.h",
           "cpu_primitive.h", "extension.h", "strided.h", "vq_exp.h"]
MODULE = "_codes_matmul"
CACHE_ENV = "VELOXQUANT_KERNEL_CACHE"


class KernelBuildError(RuntimeError):
    """The native operations could not be built here (the message says why)."""


def cache_root() -> Path:
    """Where built kernels live: ``$VELOXQUANT_KERNEL_CACHE``, else the user's cache."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    from platformdirs import user_cache_dir

    return Path(user_cache_dir("veloxquant")) / "kernels"


def build_tag() -> str:
    """What a build depends on: MLX's version, the Python ABI, and the sources."""
    import mlx.core as mx

    digest = hashlib.sha256()
    for name in SOURCES:
        digest.update((HERE / name).read_bytes())
    abi = sysconfig.get_config_var("SOABI") or sys.implementation.cache_tag
    return f"mlx{mx.__version__}-{abi}-{digest.hexdigest()[:16]}"


def mlx_package() -> Path:
    """The installed mlx package folder (the one with MLX's CMake config and libmlx)."""
    import mlx

    for entry in mlx.__path__:  # a namespace package: other folders named mlx may join it
        if (Path(entry) / "share" / "cmake" / "MLX" / "MLXConfig.cmake").is_file():
            return Path(entry)
    raise KernelBuildError("this MLX install ships no CMake config (share/cmake/MLX)")


def _cmake_lists(out_dir: Path) -> str:
    mlx_dir = mlx_package()
    mlx_root = mlx_dir / "share" / "cmake" / "MLX"
    sources = " ".join(f'"{HERE / n}"' for n in SOURCES if not n.endswith(".h"))
    return f"""cmake_minimum_required(VERSION 3.24)
project(veloxquant_kernels LANGUAGES C CXX)
set(CMAKE_CXX_STANDARD 20)
set(CMAKE_CXX_STANDARD_REQUIRED ON)
set(CMAKE_POSITION_INDEPENDENT_CODE ON)
find_package(Python 3.10 COMPONENTS Interpreter Development.Module REQUIRED)
find_package(nanobind CONFIG REQUIRED)
find_package(MLX CONFIG REQUIRED PATHS "{mlx_root}" NO_DEFAULT_PATH)
nanobind_add_module({MODULE} NB_STATIC NB_DOMAIN mlx {sources})
target_link_libraries({MODULE} PRIVATE mlx)
target_include_directories({MODULE} PRIVATE "{HERE}")
set_target_properties({MODULE} PROPERTIES LIBRARY_OUTPUT_DIRECTORY "{out_dir}"
  BUILD_WITH_INSTALL_RPATH TRUE INSTALL_RPATH "{mlx_dir / 'lib'}")
"""


def _run(command: list[str], cwd: Path) -> None:
    done = subprocess.run(command, cwd=cwd, capture_output=True, text=True)
    if done.returncode != 0:
        tail = (done.stdout + done.stderr).strip().splitlines()[-15:]
        raise KernelBuildError(f"{' '.join(command[:2])} failed:\n" + "\n".join(tail))


def build(quiet: bool = True) -> Path:
    """Build the extension unless a build for this MLX and these sources exists.

    Returns:
        The folder holding the built module.

    Raises:
        KernelBuildError: cmake or a C++ compiler is missing, or the build failed.
    """
    out_dir = cache_root() / build_tag()
    if _built(out_dir):
        return out_dir
    if shutil.which("cmake") is None:
        raise KernelBuildError("cmake is not installed (apt install cmake, or pip install cmake)")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    with open(out_dir.parent / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be building the same tag
        if _built(out_dir):
            return out_dir
        build_dir = out_dir.with_name(out_dir.name + ".build")
        shutil.rmtree(build_dir, ignore_errors=True)
        build_dir.mkdir(parents=True)
        (build_dir / "CMakeLists.txt").write_text(_cmake_lists(out_dir))
        import nanobind

        if not quiet:
            print(f"veloxquant: building native kernels in {out_dir}", file=sys.stderr)
        _run(["cmake", "-S", ".", "-B", "out", "-DCMAKE_BUILD_TYPE=Release",
              f"-Dnanobind_DIR={nanobind.cmake_dir()}",
              f"-DPython_EXECUTABLE={sys.executable}"], build_dir)
        _run(["cmake", "--build", "out", "-j", str(os.cpu_count() or 1)], build_dir)
        shutil.rmtree(build_dir, ignore_errors=True)
    if not _built(out_dir):
        raise KernelBuildError(f"the build left no {MODULE} module in {out_dir}")
    return out_dir


def _built(out_dir: Path) -> bool:
    return out_dir.is_dir() and any(out_dir.glob(f"{MODULE}*.so"))


def load() -> ModuleType:
    """Import the extension, building it first if needed (raises KernelBuildError)."""
    name = f"{__package__}.{MODULE}"
    if name in sys.modules:
        return sys.modules[name]
    out_dir = build()
    path = next(out_dir.glob(f"{MODULE}*.so"))
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    _check_works(module)
    sys.modules[name] = module
    return module


def _check_works(module: ModuleType) -> None:
    """One tiny product: MLX's arrays cross into the extension only when both were built
    with the same nanobind ABI, which a version check alone would not show."""
    import mlx.core as mx

    if module.mlx_version != mx.__version__:
        raise KernelBuildError(f"built against MLX {module.mlx_version}, running "
                               f"{mx.__version__}")
    x = mx.ones((1, 32))
    codes = mx.full((1, 16), 0x11, dtype=mx.uint8)  # every 4-bit code is 1
    ones = mx.ones((1, 1))
    try:
        y = module.codes_matmul(x, codes, ones, ones, bits=4, group=32)
        value = y.item()
    except TypeError as exc:
        raise KernelBuildError(f"MLX's arrays do not reach the extension ({exc})") from None
    if abs(value - 64.0) > 1e-3:  # 32 columns of (1 * 1 + 1) times 1
        raise KernelBuildError(f"a check product gave {value}, not 64")
