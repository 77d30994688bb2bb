"""Which MLX build this process will load and which device it computes on.

:func:`mlx_build` and :func:`gpu_expected` import no MLX: the OpenBLAS loader
(:mod:`veloxquant_mlx.cpu_backend`) asks them before anything loads ``libmlx.so``.
:func:`describe_device` is given ``mlx.core`` by its caller and only reads what MLX reports,
tolerating MLX versions or backends that report less (it cannot be tested on CUDA in CI).

MLX's Linux wheels share one file::

    mlx          (Python package, mlx/core*.so with RUNPATH $ORIGIN/lib)
    mlx-cpu      mlx/lib/libmlx.so   21 MB   reference BLAS in mlx_cpu.libs/
    mlx-cuda-13  mlx/lib/libmlx.so  146 MB   NEEDED libcuda.so.1, libcublasLt.so.13, ...

(sizes for 0.32.4). ``pip install '.[cuda]'`` installs both backend wheels, and the one
written last owns the file (mlx-cpu, in a fresh install with pip 23 and 26), so installed
distributions do not say which build loads. The library's own ELF header does: only a CUDA
build links the CUDA driver. That holds for source builds and stripped copies too, where a
check against the wheels' RECORD sizes or hashes would not.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import struct
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# The wheels holding MLX's CUDA build: mlx's extras "cuda" and "cuda12" install mlx-cuda-12,
# "cuda13" mlx-cuda-13 (mlx 0.32.4's METADATA).
CUDA_DISTRIBUTIONS = ("mlx-cuda-13", "mlx-cuda-12")
# DT_NEEDED prefixes that only a CUDA build of libmlx.so has (the driver API first).
CUDA_LIBRARIES = ("libcuda.so", "libcudart.so", "libcublas")
_PT_LOAD, _PT_DYNAMIC, _DT_NULL, _DT_NEEDED, _DT_STRTAB = 1, 2, 0, 1, 5


@dataclass(frozen=True, slots=True)
class MlxBuild:
    """Which of MLX's Linux builds ``import mlx.core`` will load.

    Attributes:
        cuda: The ``libmlx.so`` that loads links CUDA (MLX's default device is then the GPU:
            the CUDA build's ``gpu::is_available()`` is hard-wired true).
        cuda_wheel: An installed CUDA distribution (``mlx-cuda-13``...), or None.
    """

    cuda: bool
    cuda_wheel: str | None = None

    @property
    def shadowed(self) -> str | None:
        """The CUDA wheel whose ``libmlx.so`` another wheel (mlx-cpu) overwrote, if any."""
        return self.cuda_wheel if self.cuda_wheel and not self.cuda else None


def _libmlx_path() -> Path | None:
    """The ``libmlx.so`` that ``import mlx.core`` loads, located without importing MLX.

    ``mlx`` is a namespace package (no ``__init__``), so ``find_spec`` runs no MLX code;
    ``mlx/core*.so`` finds the library through its RUNPATH ``$ORIGIN/lib``.
    """
    try:
        spec = importlib.util.find_spec("mlx")
    except (ImportError, ValueError):
        return None
    for location in (spec.submodule_search_locations or []) if spec else []:
        path = Path(location) / "lib" / "libmlx.so"
        if path.is_file():
            return path
    return None


def elf_needed(path: Path) -> list[str] | None:
    """The DT_NEEDED names of a 64-bit little-endian ELF object, without loading it.

    The same list as ``readelf -d``'s "Shared library" lines, read from the dynamic segment.

    Returns:
        The names, or None when the file is not such an ELF object or cannot be read.
    """
    try:
        with open(path, "rb") as f:
            head = f.read(64)
            if len(head) < 64 or head[:4] != b"\x7fELF" or head[4:6] != b"\x02\x01":
                return None
            (phoff,) = struct.unpack_from("<Q", head, 32)
            phentsize, phnum = struct.unpack_from("<HH", head, 54)
            f.seek(phoff)
            table = f.read(phentsize * phnum)
            loads, dynamic = [], None
            for i in range(phnum):
                kind, _, offset, vaddr, _, size = struct.unpack_from("<IIQQQQ", table,
                                                                     i * phentsize)
                if kind == _PT_LOAD:
                    loads.append((vaddr, offset, size))
                elif kind == _PT_DYNAMIC:
                    dynamic = (offset, size)
            if dynamic is None:
                return None
            f.seek(dynamic[0])
            raw = f.read(dynamic[1] // 16 * 16)
            needed, strtab = [], None
            for tag, value in struct.iter_unpack("<qQ", raw):
                if tag == _DT_NULL:
                    break
                if tag == _DT_NEEDED:
                    needed.append(value)
                elif tag == _DT_STRTAB:
                    strtab = value
            if strtab is None:
                return None
            # DT_STRTAB is an address; the PT_LOAD segment holding it maps it to the file.
            base = next(off - va for va, off, size in loads if va <= strtab < va + size)
            names = []
            for name_offset in needed:
                f.seek(base + strtab + name_offset)
                names.append(f.read(256).split(b"\0", 1)[0].decode(errors="replace"))
            return names
    except (OSError, struct.error, StopIteration):
        return None


def _installed(name: str) -> bool:
    try:
        importlib.metadata.distribution(name)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def mlx_build() -> MlxBuild:
    """Tell MLX's CUDA build from its CPU build on Linux, without importing MLX.

    Returns:
        The build; ``cuda`` False on non-Linux systems, on the CPU build, and where
        ``libmlx.so`` is missing or unreadable.
    """
    if sys.platform != "linux":
        return MlxBuild(cuda=False)
    lib = _libmlx_path()
    needed = (elf_needed(lib) if lib is not None else None) or []
    cuda = any(name.startswith(CUDA_LIBRARIES) for name in needed)
    return MlxBuild(cuda=cuda, cuda_wheel=next(filter(_installed, CUDA_DISTRIBUTIONS), None))


def gpu_expected() -> bool:
    """Whether MLX's default device will be a GPU (Metal on macOS, or the CUDA build)."""
    return sys.platform == "darwin" or mlx_build().cuda


def describe_device(mx: Any, device: Any) -> str:
    """Name a device and what MLX reports of it, for the start-up line.

    For example ``"gpu (CUDA: NVIDIA H200, 140 GiB)"``, ``"gpu (Metal: Apple M2 Max,
    64 GiB)"`` or ``"cpu (AMD EPYC)"``; a bare ``"gpu"``/``"cpu"`` when MLX reports nothing.

    Args:
        mx: The ``mlx.core`` module (passed in, so this module never imports MLX itself).
        device: The device to describe, e.g. ``mx.default_device()``.
    """
    info = _device_info(mx, device)
    name = info.get("device_name") or info.get("architecture")
    if device.type != mx.DeviceType.gpu:
        return f"cpu ({name})" if name else "cpu"
    api = next((label for label, module in (("CUDA", "cuda"), ("Metal", "metal"))
                if _backend_available(mx, module)), None)
    memory = _memory_of(info)
    details = [f"{api}: {name}" if api and name else api or name or "",
               f"{memory / 2**30:.0f} GiB" if memory else ""]
    details = [d for d in details if d]
    return f"gpu ({', '.join(details)})" if details else "gpu"


def device_memory(mx: Any, device: Any) -> int:
    """Bytes of memory MLX reports for ``device`` (the GPU's own, or unified), 0 if none."""
    return _memory_of(_device_info(mx, device))


def _memory_of(info: dict[str, Any]) -> int:
    memory = info.get("total_memory") or info.get("memory_size")
    if isinstance(memory, str) and memory.isdigit():  # some builds report it as text
        memory = int(memory)
    return memory if isinstance(memory, int) and memory > 0 else 0


def _backend_available(mx: Any, module: str) -> bool:
    """``mx.cuda.is_available()`` / ``mx.metal.is_available()``, False where absent."""
    try:
        return bool(getattr(mx, module).is_available())
    except Exception:  # an older MLX without the module, or a backend that fails to answer
        return False


def _device_info(mx: Any, device: Any) -> dict[str, Any]:
    """MLX's device properties, or {} where this MLX has no such API or it fails.

    ``mx.device_info(device)`` (MLX 0.32 has it) covers every backend; older versions had
    only ``mx.metal.device_info()``, which 0.32 deprecates with a warning.
    """
    try:
        if hasattr(mx, "device_info"):
            info = mx.device_info(device)
        elif device.type == mx.DeviceType.gpu and _backend_available(mx, "metal"):
            info = mx.metal.device_info()
        else:
            return {}
    except Exception:  # a device MLX cannot query must not stop start-up
        return {}
    return dict(info) if isinstance(info, dict) else {}
