"""A pool that cannot exist on this machine is refused at start-up, not found by the OOM killer.

The checks on numbers (server/engine/pool_fit.py), then real ``python -m server``
start-ups: a pool too large in blocks stops before anything is built, one too large
in bytes stops at the model load; both exit 2 with the reason and no traceback, as
does a KV format the model cannot take.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

from server.engine.pool_fit import arena_problem, device_memory_bytes, records_problem
from tests.server.conftest import make_settings

REPO = Path(__file__).resolve().parents[2]
GIB = 2**30


def test_block_records_are_judged_against_the_machine() -> None:
    assert records_problem(make_settings(pool={"n_blocks": 16384}), memory=GIB) is None
    why = records_problem(make_settings(pool={"n_blocks": 10**20}), memory=24 * GIB)
    assert why is not None and why.startswith("pool.n_blocks = 100,000,000,000,000,000,000")
    grown = make_settings(pool={"n_blocks": 1024, "grow_on_exhaustion": True,
                                "max_blocks": 10**12})
    assert records_problem(grown, memory=24 * GIB).startswith("pool.max_blocks")
    # Sized in bytes: judged with its arena once the model's layout is known.
    assert records_problem(make_settings(pool={"kv_memory": "1000TiB"}), memory=GIB) is None


def test_the_arena_is_judged_against_the_memory_it_lives_in() -> None:
    sized = make_settings(pool={"kv_memory": "8GiB"})
    assert arena_problem(sized, 2**21, 4096, device_memory=16 * GIB, host_memory=GIB) is None
    why = arena_problem(sized, 2**21, 4096, device_memory=4 * GIB, host_memory=GIB)
    assert why.startswith("pool.kv_memory = 8GiB needs a KV arena of 8.0 GiB")
    many = arena_problem(make_settings(), 10**9, 64, device_memory=10**12, host_memory=GIB)
    assert many.startswith("pool.n_blocks = 1,000,000,000 makes")


def test_a_gpus_own_memory_counts_even_as_mlx_reports_it_in_text() -> None:
    gpu = SimpleNamespace(type="gpu")
    mx = SimpleNamespace(DeviceType=SimpleNamespace(gpu="gpu"), default_device=lambda: gpu,
                         device_info=lambda d: {"total_memory": "150754820096"})
    assert device_memory_bytes(mx) == 150754820096


def _start(tiny: Path, **env: str) -> subprocess.CompletedProcess:
    full = {"PATH": "/usr/bin:/bin", "VELOXQUANT_NO_BLAS_PRELOAD": "1", **env}
    return subprocess.run([sys.executable, "-m", "server", "--model", str(tiny), "--port", "0"],
                          cwd=REPO, env=full, capture_output=True, text=True, timeout=120)


def test_impossible_pools_and_formats_stop_start_up_with_exit_2(tiny_model_path) -> None:
    cases = [({"VELOXQUANT_POOL_N_BLOCKS": str(10**20)}, "bad configuration: pool.n_blocks"),
             ({"VELOXQUANT_POOL_KV_MEMORY": "1000TiB"},
              "model failed to load: ValueError: pool.kv_memory = 1000TiB needs a KV arena"),
             ({"VELOXQUANT_KV_FORMAT": "q4", "VELOXQUANT_KV_GROUP_SIZE": "128"},
              "model failed to load: KVFormatError: KV format q4 with group_size 128"),
             # 4 layers x k and v: 7 blocks hold no request, so the server would come up
             # healthy and refuse everything (QA pass 29).
             ({"VELOXQUANT_POOL_N_BLOCKS": "7"},
              "model failed to load: ValueError: the KV pool (7 blocks) holds no request: the "
              "smallest (a 1-token prompt, max_tokens 1) needs 8 blocks")]
    for env, reason in cases:
        proc = _start(tiny_model_path, **env)
        last = proc.stderr.strip().splitlines()[-1]
        assert proc.returncode == 2, proc.stderr[-2000:]
        assert last.startswith(f"veloxquant-serve: {reason}"), last
        assert "Traceback" not in proc.stderr
