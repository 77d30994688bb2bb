"""mlx_device: telling MLX's CUDA build from its CPU build without importing MLX, and naming
the device MLX computes on.

The build checks run on real ELF objects that gcc links here: a stand-in ``libmlx.so`` that
does (or does not) need ``libcuda.so.1``, laid out as pip installs MLX's wheels, in a child
Python whose path sees that layout first.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest

from veloxquant_mlx import mlx_device as md

requires_gcc = pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc to link ELFs")
linux_only = pytest.mark.skipif(sys.platform != "linux", reason="ELF and MLX's Linux wheels")

# Asked in a child, so that its sys.path (PYTHONPATH first) decides which mlx/ it finds.
PROBE = textwrap.dedent(
    """
    import json, sys
    from veloxquant_mlx.mlx_device import gpu_expected, mlx_build
    build = mlx_build()
    print(json.dumps({"cuda": build.cuda, "wheel": build.cuda_wheel,
                      "shadowed": build.shadowed, "gpu": gpu_expected(),
                      "imported": sorted(m for m in sys.modules if m.split(".")[0] == "mlx")}))
    """
)


def _link(tmp: Path, name: str, soname: str, *libs: Path) -> Path:
    """Build a shared object ``name`` that has a DT_NEEDED entry for each of ``libs``."""
    src = tmp / f"{name}.c"
    src.write_text("int veloxquant_probe(void) { return 1; }\n")
    out = tmp / name
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(out), str(src),
                    f"-Wl,-soname,{soname}", "-Wl,--no-as-needed", *map(str, libs)],
                   check=True, capture_output=True)
    return out


def _site(tmp: Path, libmlx: Path, wheels: tuple[str, ...]) -> Path:
    """A site-packages holding ``mlx/lib/libmlx.so`` and empty dist-infos for ``wheels``."""
    site = tmp / "site"
    (site / "mlx" / "lib").mkdir(parents=True)
    shutil.copy(libmlx, site / "mlx" / "lib" / "libmlx.so")
    for wheel in wheels:
        info = site / f"{wheel.replace('-', '_')}-0.32.4.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {wheel}\nVersion: 0.32.4\n")
    return site


def _probe(site: Path) -> dict:
    repo = Path(__file__).resolve().parents[1]
    env = {"PYTHONPATH": f"{site}:{repo}", "PATH": "/usr/bin:/bin"}
    done = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True,
                          text=True, timeout=60, check=True)
    return json.loads(done.stdout)


@pytest.fixture
def fake_libs(tmp_path: Path) -> SimpleNamespace:
    """A stand-in CUDA driver, a libmlx.so linking it, and one that does not."""
    cuda = _link(tmp_path, "libcuda.so.1", "libcuda.so.1")
    return SimpleNamespace(
        cuda_build=_link(tmp_path, "libmlx_cuda.so", "libmlx.so", cuda),
        cpu_build=_link(tmp_path, "libmlx_cpu.so", "libmlx.so"),
    )


@requires_gcc
@linux_only
@pytest.mark.slow
def test_elf_needed_reads_what_the_linker_wrote(fake_libs: SimpleNamespace) -> None:
    assert "libcuda.so.1" in md.elf_needed(fake_libs.cuda_build)
    assert "libcuda.so.1" not in md.elf_needed(fake_libs.cpu_build)
    assert "libc.so.6" in md.elf_needed(fake_libs.cpu_build)


@linux_only
def test_elf_needed_refuses_what_is_not_a_64_bit_elf(tmp_path: Path) -> None:
    text = tmp_path / "notes.txt"
    text.write_text("not a library\n" * 10)
    truncated = tmp_path / "truncated.so"
    truncated.write_bytes(b"\x7fELF\x02\x01" + bytes(20))
    assert md.elf_needed(text) is None
    assert md.elf_needed(truncated) is None
    assert md.elf_needed(tmp_path / "missing.so") is None


@requires_gcc
@linux_only
@pytest.mark.slow
def test_cuda_build_is_recognised_without_importing_mlx(tmp_path: Path,
                                                        fake_libs: SimpleNamespace) -> None:
    # mlx-cuda-13 wrote libmlx.so last (e.g. installed on top of a CPU install).
    site = _site(tmp_path, fake_libs.cuda_build, ("mlx-cpu", "mlx-cuda-13"))
    out = _probe(site)
    assert out == {"cuda": True, "wheel": "mlx-cuda-13", "shadowed": None, "gpu": True,
                   "imported": []}


@requires_gcc
@linux_only
@pytest.mark.slow
def test_cpu_library_over_an_installed_cuda_wheel_is_reported(tmp_path: Path,
                                                               fake_libs: SimpleNamespace) -> None:
    # A fresh `pip install '.[cuda]'`: mlx-cpu's copy of the shared file was written last.
    site = _site(tmp_path, fake_libs.cpu_build, ("mlx-cpu", "mlx-cuda-13"))
    out = _probe(site)
    assert out == {"cuda": False, "wheel": "mlx-cuda-13", "shadowed": "mlx-cuda-13",
                   "gpu": False, "imported": []}


@linux_only
def test_this_environment_cpu_build_is_not_taken_for_cuda() -> None:
    lib = md._libmlx_path()
    assert lib is not None and lib.name == "libmlx.so"
    needed = md.elf_needed(lib)
    assert needed, "the installed libmlx.so has no readable DT_NEEDED list"
    if any(name.startswith(md.CUDA_LIBRARIES) for name in needed):
        pytest.skip("this environment has MLX's CUDA build")
    assert md.mlx_build().cuda is False and md.gpu_expected() is False


def test_macos_means_metal(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(md.sys, "platform", "darwin")
    assert md.gpu_expected() is True
    assert md.mlx_build().cuda is False


# -- naming the device, against stand-ins for the parts of mlx.core it reads -------------------

GPU, CPU = SimpleNamespace(type="gpu"), SimpleNamespace(type="cpu")


def _fake_mx(cuda: bool = False, metal: bool = False, info=None,
             metal_info=None) -> SimpleNamespace:
    """An ``mlx.core`` stand-in; ``info`` None means this MLX has no ``device_info``."""
    mx = SimpleNamespace(DeviceType=SimpleNamespace(gpu="gpu", cpu="cpu"),
                         cuda=SimpleNamespace(is_available=lambda: cuda),
                         metal=SimpleNamespace(is_available=lambda: metal,
                                               device_info=lambda: metal_info or {}))
    if info is not None:
        mx.device_info = info
    return mx


def test_cuda_device_is_named_with_its_memory() -> None:
    h200 = {"device_name": "NVIDIA H200", "architecture": "sm_90",
            "total_memory": 143771 * 2**20, "free_memory": 1}
    mx = _fake_mx(cuda=True, info=lambda device: h200)
    assert md.describe_device(mx, GPU) == "gpu (CUDA: NVIDIA H200, 140 GiB)"


def test_metal_device_on_an_mlx_with_only_the_metal_api() -> None:
    mx = _fake_mx(metal=True, metal_info={"architecture": "applegpu_g14s",
                                          "memory_size": 64 * 2**30})
    assert md.describe_device(mx, GPU) == "gpu (Metal: applegpu_g14s, 64 GiB)"


def test_device_info_that_fails_or_says_nothing_falls_back() -> None:
    def broken(device):
        raise RuntimeError("no device")

    assert md.describe_device(_fake_mx(cuda=True, info=broken), GPU) == "gpu (CUDA)"
    assert md.describe_device(_fake_mx(info=lambda d: {}), GPU) == "gpu"
    no_backends = SimpleNamespace(DeviceType=SimpleNamespace(gpu="gpu", cpu="cpu"))
    assert md.describe_device(no_backends, GPU) == "gpu"
    assert md.describe_device(no_backends, CPU) == "cpu"


def test_cpu_is_named_by_what_mlx_reports() -> None:
    mx = _fake_mx(info=lambda d: {"device_name": "AMD EPYC", "architecture": "x86_64"})
    assert md.describe_device(mx, CPU) == "cpu (AMD EPYC)"


def test_real_mlx_names_this_cpu() -> None:
    import mlx.core as mx

    if mx.default_device().type == mx.DeviceType.gpu:
        pytest.skip("the default device here is a GPU")
    text = md.describe_device(mx, mx.default_device())
    name = mx.device_info(mx.cpu).get("device_name") if hasattr(mx, "device_info") else None
    assert text == (f"cpu ({name})" if name else "cpu")
