"""A pool that cannot exist on this machine is refused at start-up, not found by the OOM killer.

The checks on numbers (server/pool_fit.py), then real ``python -m server``
start-ups: a pool too large in blocks stops before anything is built, one too large
in bytes stops at the model load; both exit 2 with the reason and no traceback, as
does a KV format the model cannot take.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from server.pool_fit import (
    arena_problem,
    device_memory_bytes,
    records_problem,
)
from tests.support.servers import make_settings

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


@pytest.mark.slow
def test_impossible_pools_and_formats_stop_start_up_with_exit_2(tiny_model_path) -> None:
    cases = [({"VELOXQUANT_POOL_N_BLOCKS": str(10**20)}, "bad configuration: pool.n_blocks"),
             ({"VELOXQUANT_POOL_KV_MEMORY": "1000TiB"},
              "model failed to load: ValueError: pool.kv_memory = 1000TiB needs a KV arena"),
             ({"VELOXQUANT_KV_FORMAT": "q4", "VELOXQUANT_KV_GROUP_SIZE": "128"},
              "model failed to load: KVFormatError: KV format q4 with group_size 128"),
             # 4 layers x k and v: 7 blocks hold no request, so the server would come up
             # healthy and refuse everything.
             ({"VELOXQUANT_POOL_N_BLOCKS": "7"},
              "model failed to load: ValueError: the KV pool (7 blocks) holds no request: the "
              "smallest (a 1-token prompt, max_tokens 1) needs 8 blocks")]
    for env, reason in cases:
        proc = _start(tiny_model_path, **env)
        last = proc.stderr.strip().splitlines()[-1]
        assert proc.returncode == 2, proc.stderr[-2000:]
        assert last.startswith(f"veloxquant-serve: {reason}"), last
        assert "Traceback" not in proc.stderr


def test_the_default_pool_grows_to_hold_one_request_of_the_served_context() -> None:
    """A server that states a context should take a prompt that long (the default 16,384
    blocks hold 4,368 of SmolLM2's 8,192 tokens a request)."""
    import mlx.core as mx

    from server.engine.kv_memory import blocks_for_longest_request
    from veloxquant_mlx.memory.kv_arena import KVLayout

    smollm2 = KVLayout(n_layers=30, n_kv_heads=3, head_dim=64, dtype=mx.float32)
    default = make_settings()  # max_prompt_tokens 8192 + max_tokens_cap 4096
    grown = blocks_for_longest_request(default, smollm2, 8192, device_memory=24 * GIB)
    assert grown == 2 * 30 * 8192 // 16 == 30720
    # The limits bound it too, and a pool that already holds the request stays as it is.
    short = make_settings(limits={"max_prompt_tokens": 1024, "max_tokens_cap": 1024})
    assert blocks_for_longest_request(short, smollm2, 8192, device_memory=24 * GIB) is None
    # Never past a quarter of the device's memory (360 MiB here), nor over a size the
    # operator chose.
    assert blocks_for_longest_request(default, smollm2, 8192, device_memory=GIB) is None
    # pool.max_blocks caps it (a cap under 30,720 must not stop start-up).
    capped = make_settings(pool={"max_blocks": 20000})
    assert blocks_for_longest_request(capped, smollm2, 8192, 24 * GIB) == 20000
    below = make_settings(pool={"max_blocks": 16384})
    assert blocks_for_longest_request(below, smollm2, 8192, 24 * GIB) is None
    for sized in ({"n_blocks": 1000}, {"kv_memory": "64MiB"}):
        chosen = make_settings(pool=sized)
        assert blocks_for_longest_request(chosen, smollm2, 8192, 24 * GIB) is None


def test_a_default_pool_serves_its_stated_context_and_a_sized_one_warns(tiny_model_path,
                                                                        caplog):
    """Live: the tiny model (4 layers) with a 40,960-token context needs 20,480 blocks."""
    from prometheus_client.parser import text_string_to_metric_families

    from tests.support.servers import run_server

    limits = {"max_prompt_tokens": 40000, "max_tokens_cap": 960, "max_context_tokens": 40960}
    settings = make_settings(model={"path": str(tiny_model_path)}, limits=limits)
    with run_server(settings) as server:
        import httpx

        assert httpx.get(f"{server.base_url}/v1/models").json()["data"][0][
            "max_model_len"] == 40960
        text = httpx.get(f"{server.base_url}/metrics").text
        totals = [s.value for f in text_string_to_metric_families(text) for s in f.samples
                  if s.name == "veloxquant_block_pool_blocks_total"]
        assert totals and sum(totals) == 2 * 4 * 40960 // 16
    # Sized by the operator, the pool stays as given and the start-up log says what fits.
    sized = make_settings(model={"path": str(tiny_model_path)}, limits=limits,
                          pool={"n_blocks": 16000})
    with caplog.at_level("WARNING"), run_server(sized):
        pass
    assert "the KV pool holds at most 32000 tokens a request (prompt + max_tokens), less " \
           "than the 40960" in caplog.text
