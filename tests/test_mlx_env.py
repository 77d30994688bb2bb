"""MLX's environment defaults (veloxquant_mlx/mlx_env.py) and why the server sets them.

On the CPU: what the defaults set and keep, and that the entry point sets them before
anything can import MLX. On MLX's CUDA backend (the device run's pytest list): the real
engine, prefilling prompts of many lengths under caches of one or two entries, in a child
process each (MLX reads the settings when it makes a stream). With MLX's check on, its
lifetime miss counter soon throws and requests fail; with the server's defaults every
request is served.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import server.__main__ as entry
from veloxquant_mlx.mlx_env import MLX_ENV_DEFAULTS, apply_mlx_env_defaults

REPO = Path(__file__).resolve().parents[1]
CHECK = "MLX_ENABLE_CACHE_THRASHING_CHECK"


def test_defaults_fill_what_is_missing_and_say_what_they_set() -> None:
    environ: dict[str, str] = {"PATH": "/bin"}
    assert apply_mlx_env_defaults(environ) == {CHECK: "0"}
    assert environ == {"PATH": "/bin", CHECK: "0"}
    assert apply_mlx_env_defaults(environ) == {}  # a second call changes nothing


def test_an_operators_value_is_kept() -> None:
    environ = {CHECK: "1"}
    assert apply_mlx_env_defaults(environ) == {}
    assert environ == {CHECK: "1"}


@pytest.mark.slow
def test_the_module_imports_no_mlx() -> None:
    code = ("import sys; import veloxquant_mlx.mlx_env, server.__main__; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'mlx'))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                         text=True, timeout=60, check=True).stdout
    assert out.strip() == "[]"


def _main_until_the_blas(monkeypatch: pytest.MonkeyPatch) -> dict[str, str | None]:
    """Run the entry point's main, recording MLX's settings when the BLAS is loaded."""
    seen: dict[str, str | None] = {}

    def record(enabled: bool) -> None:
        seen.update({name: os.environ.get(name) for name in MLX_ENV_DEFAULTS})

    monkeypatch.setattr(entry, "load_optimized_blas", record)
    monkeypatch.setattr(entry, "_serve", lambda settings: 0)
    assert entry.main(["--model", "tiny"]) == 0
    return seen


def test_the_entry_point_sets_them_before_the_blas_loads(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(CHECK, "unset by the test")  # so that monkeypatch restores "absent"
    monkeypatch.delenv(CHECK)
    assert _main_until_the_blas(monkeypatch) == MLX_ENV_DEFAULTS
    monkeypatch.setenv(CHECK, "1")
    assert _main_until_the_blas(monkeypatch) == {CHECK: "1"}


# A child process: the real engine (model loaded as the server loads it, bfloat16 on a GPU)
# prefills prompts of 24 lengths one after another, each followed by two decode steps. On
# CUDA each length is a new cuDNN attention plan and new step graphs.
_ENGINE_UNDER_SMALL_CACHES = r"""
import json, sys
from veloxquant_mlx.mlx_env import apply_mlx_env_defaults
if sys.argv[2] == "server-defaults":
    apply_mlx_env_defaults()
import mlx.core as mx
from server.protocol import SamplingParams
from server.engine.runner import ModelRunner
from server.model_loader import load_model
from server.settings import load_settings
from veloxquant_mlx.memory import BlockPoolAllocator, PoolConfig
from veloxquant_mlx.memory.kv_arena import KVArena, probe_kv_layout

settings = load_settings(None, overrides={"model": {"path": sys.argv[1]}}, env={})
model = load_model(settings.model).model
pool = BlockPoolAllocator(PoolConfig(block_size=16, n_blocks=4096))
runner = ModelRunner(model, pool, 512, KVArena(pool, probe_kv_layout(model)))
served, errors = 0, []
for owner, length in enumerate(range(8, 8 + 24 * 5, 5), 1):
    runner.add(owner, [5 + (owner * 7 + j) % 200 for j in range(length)],
               SamplingParams(max_tokens=3, temperature=0.0))
    failed = []
    while runner.prompts_pending:
        failed += runner.prefill(1 << 20).failed
    for _ in range(2):
        failed += runner.decode().failed
    runner.remove([owner])
    if failed:
        errors.append(f"{type(failed[0].error).__name__}: {failed[0].error}")
    else:
        served += 1
print(json.dumps({"served": served, "errors": errors, "device": str(mx.default_device())}))
"""


def _engine_under_small_caches(model: Path, mode: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLX_")}
    env.update(MLX_CUDA_GRAPH_CACHE_SIZE="2", MLX_CUDA_SDPA_CACHE_SIZE="1",
               PYTHONPATH=str(REPO))
    if mode == "mlx-default":
        env[CHECK] = "1"  # what MLX does when nobody sets it
    done = subprocess.run([sys.executable, "-c", _ENGINE_UNDER_SMALL_CACHES, str(model), mode],
                          env=env, cwd=REPO, capture_output=True, text=True, timeout=300)
    if done.returncode != 0:  # MLX's throw can end the process too (from a worker thread)
        return {"served": None, "device": None,
                "errors": [f"exit {done.returncode}: {done.stderr[-2000:]}"]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def _cuda() -> bool:
    import mlx.core as mx

    return bool(getattr(mx, "cuda", None) and mx.cuda.is_available())


@pytest.mark.skipif(not _cuda(), reason="MLX's CUDA backend only (run in the device check)")
@pytest.mark.slow
def test_on_cuda_the_server_defaults_serve_what_mlx_defaults_fail(tiny_model_path: Path) -> None:
    ours = _engine_under_small_caches(tiny_model_path, "server-defaults")
    assert ours["device"].startswith("Device(gpu")
    assert ours == {**ours, "served": 24, "errors": []}
    stock = _engine_under_small_caches(tiny_model_path, "mlx-default")
    if not stock["errors"]:
        pytest.skip("this MLX no longer throws on a cache's lifetime misses: "
                    f"{CHECK}=0 may be dropped from MLX_ENV_DEFAULTS")
    assert any("Cache thrashing" in e for e in stock["errors"]), stock["errors"]
