"""benchmark_join_latency.py's scenario against a live server: newcomers timed while streams
decode, and nothing left running or held after it."""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmark_scripts"))
import benchmark_join_latency as bench  # noqa: E402


def test_newcomers_are_timed_while_the_streams_decode_and_everything_ends(live_server):
    args = argparse.Namespace(stream_tokens=300, gap_s=0.05, time_limit=60.0)
    got = asyncio.run(bench.scenario(live_server.base_url, live_server.engine.model_name,
                                     ["stream one", "stream two"],
                                     ["newcomer one", "newcomer two", "newcomer three"], args))
    assert len(got["ttft_s"]) == 3 and all(0 < t < 60 for t in got["ttft_s"])
    assert got["stream_gap_median_s"] > 0  # the streams went on while the newcomers came
    summary = bench.summarize([got, got])
    assert summary["newcomers"] == 6
    assert summary["ttft_max_s"] == max(got["ttft_s"])
    # the cancelled streams' requests ended and gave their blocks back
    idle = live_server.wait_idle()
    assert idle["veloxquant_block_pool_request_blocks_in_use"] == 0
    assert idle["veloxquant_requests_running"] == 0
