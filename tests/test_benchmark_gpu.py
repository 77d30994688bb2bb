"""The GPU benchmark's bookkeeping: its one run on a GPU machine cannot be repeated to fix a slip.

Ratios, targets and the time budget are checked on hand-made results; the whole
flow runs with ``benchmark_scripts/benchmark_gpu.py --smoke`` (not in CI: it
starts both servers).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmark_scripts"))
import benchmark_gpu  # noqa: E402
from gpu_phases import Budget  # noqa: E402


def _level(c: int, tok_s: float, ttft_p99: float, errors: int = 0) -> dict:
    return {"concurrency": c, "tok_per_s": tok_s, "ttft_p50_s": ttft_p99 / 2,
            "ttft_p99_s": ttft_p99, "errors": errors, "requests_planned": 8}


def _result(ours: list[dict], peer: list[dict], exit_code: int | None = 0) -> dict:
    result = {"servers": {benchmark_gpu.OURS: {"levels": ours},
                          benchmark_gpu.PEER: {"levels": peer}},
              "sigterm": {"exit_code": exit_code}}
    result["ratios_ours_over_peer"] = benchmark_gpu.ratios(result, [1, 16, 64])
    return result


def test_targets_met_from_the_measurements():
    result = _result([_level(1, 300, 0.1), _level(16, 2000, 0.5), _level(64, 6000, 1.0)],
                     [_level(1, 200, 0.2), _level(16, 1000, 1.0), _level(64, 2500, 3.0)])
    assert result["ratios_ours_over_peer"]["c64"] == {"tok_per_s": 2.4, "ttft_p50": 0.333,
                                                      "ttft_p99": 0.333}
    assert all(t["met"] for t in benchmark_gpu.targets(result).values())


def test_targets_missed_or_unmeasured():
    # c64 missing on the peer, an error on ours, a non-zero exit.
    result = _result([_level(1, 250, 0.1, errors=2), _level(64, 4000, 1.0)],
                     [_level(1, 200, 0.2), {"concurrency": 64, "skipped": "time budget spent"}],
                     exit_code=-6)
    t = benchmark_gpu.targets(result)
    assert t["c64_tok_per_s_ratio_min"]["met"] is None
    assert t["c64_tok_per_s_min"] == {"target": 5000.0, "measured": 4000, "met": False}
    assert t["c1_tok_per_s_ratio_min"]["met"] is False  # 1.25 < 1.3
    assert t["errors_max"]["measured"] == 2 and t["errors_max"]["met"] is False
    assert t["sigterm_exit_code"]["met"] is False


def test_an_undrained_level_counts_its_requests_as_errors():
    hung = {"concurrency": 64, "error": "not drained", "requests_planned": 192}
    result = _result([_level(1, 300, 0.1), hung], [_level(1, 200, 0.2)])
    assert benchmark_gpu.targets(result)["errors_max"]["measured"] == 192


def test_budget_shares_what_is_left_and_stops_when_spent():
    assert Budget(300, 60).level_limit(cap=120, levels_left=6) == 40.0
    assert Budget(300, 60).level_limit(cap=30, levels_left=2) == 30
    assert Budget(62, 60).level_limit(cap=120, levels_left=1) is None


def test_smoke_defaults_are_small_and_full_defaults_match_the_issue():
    smoke = benchmark_gpu.parse_args(["--smoke"])
    assert (smoke.preset, smoke.requests, smoke.max_tokens) == ("tiny", [2, 4, 8], 16)
    full = benchmark_gpu.parse_args([])
    assert (full.preset, full.concurrency, full.requests) == ("1b", [1, 16, 64], [8, 48, 192])
    assert (full.prompt_tokens, full.max_tokens) == (128, 128)


def test_ab_flags_reach_only_our_server(tmp_path):
    """--kv-write-back 1, --uncompiled-decode, --unfused-projections (A/B runs): ours only."""
    args = benchmark_gpu.parse_args(["--smoke", "--kv-write-back", "1", "--uncompiled-decode",
                                     "--unfused-projections", "--log-dir", str(tmp_path)])
    ctx = benchmark_gpu.server_context(args, tmp_path, [], False, Budget(60, 10))
    assert ctx["env"]["VELOXQUANT_BATCH_KV_WRITE_BACK"] == "1"
    assert ctx["env"]["VELOXQUANT_BATCH_COMPILE_DECODE"] == "false"
    assert ctx["env"]["VELOXQUANT_BATCH_FUSE_PROJECTIONS"] == "false"
    assert not any("write" in a or "compile" in a or "fuse" in a
                   for a in ctx["extra"][benchmark_gpu.PEER])
    default = benchmark_gpu.server_context(
        benchmark_gpu.parse_args(["--smoke", "--log-dir", str(tmp_path)]), tmp_path, [], False,
        Budget(60, 10))
    assert "VELOXQUANT_BATCH_KV_WRITE_BACK" not in default["env"]
    assert "VELOXQUANT_BATCH_COMPILE_DECODE" not in default["env"]
    assert "VELOXQUANT_BATCH_FUSE_PROJECTIONS" not in default["env"]


def test_ours_only_leaves_no_levels_for_a_peer(tmp_path):
    args = benchmark_gpu.parse_args(["--smoke", "--ours-only", "--log-dir", str(tmp_path)])
    ctx = benchmark_gpu.server_context(args, tmp_path, [], False, Budget(60, 10))
    assert ctx["levels_after"][benchmark_gpu.OURS] == 0
    # Without the peer every ratio is None, so no ratio target can read as met.
    result = {"servers": {benchmark_gpu.OURS: {"levels": [{"concurrency": 1,
                                                           "tok_per_s": 100.0}]}}}
    assert benchmark_gpu.ratios(result, [1]) == {"c1": {"tok_per_s": None, "ttft_p50": None,
                                                        "ttft_p99": None}}


def test_mlx_env_settings_reach_the_servers_and_bad_ones_are_refused(tmp_path, capsys):
    args = benchmark_gpu.parse_args(["--smoke", "--log-dir", str(tmp_path), "--mlx-env",
                                     "MLX_MAX_OPS_PER_BUFFER=120", "--mlx-env",
                                     "MLX_USE_CUDA_GRAPHS=0"])
    env = benchmark_gpu.server_context(args, tmp_path, [], False, Budget(60, 10))["env"]
    assert (env["MLX_MAX_OPS_PER_BUFFER"], env["MLX_USE_CUDA_GRAPHS"]) == ("120", "0")
    for bad in ("MLX_MAX_OPS_PER_BUFFER", "VELOXQUANT_X=1"):
        with pytest.raises(SystemExit):
            benchmark_gpu.parse_args(["--mlx-env", bad])
        assert "--mlx-env takes MLX_NAME=VALUE" in capsys.readouterr().err
