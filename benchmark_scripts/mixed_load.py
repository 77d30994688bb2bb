"""The mixed-length workload: one long prompt among short ones, and peak memory.

Each round sends 16 streaming requests at once: one of ``long_tokens``
prompt tokens (2000 by default) among 15 of ``short_tokens`` (64), all with
``max_tokens`` new tokens (64). A server that pads every row of its batch to
the longest row pays the long row's length 16 times; one that keeps each
row's KV in its own blocks pays it once.

Peak memory is read the same way for both servers: the process's peak
resident set (``VmHWM``, reset through ``/proc/PID/clear_refs`` before each
round) minus its resident set just before the round. For our server the
preallocated KV arena is part of that "before" figure, so its KV memory is
``kv_bytes{kind="capacity"}`` plus the growth.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from server_load import run_requests, summarize

N_SHORT = 15


def rss_kib(pid: int, field: str) -> int:
    """``VmRSS`` or ``VmHWM`` of a live process, in KiB (Linux)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not found for pid {pid}")


def reset_peak_rss(pid: int) -> None:
    """Make ``VmHWM`` start again from the current resident set (Linux ``clear_refs`` 5)."""
    Path(f"/proc/{pid}/clear_refs").write_text("5")


def mixed_rounds(make_prompts, model: Path, rounds: int, long_tokens: int,
                 short_tokens: int) -> list[list[str]]:
    """``rounds`` lists of 16 distinct prompts: the long one in the middle of the shorts."""
    longs = make_prompts(model, rounds, long_tokens)
    shorts = make_prompts(model, rounds * N_SHORT + 7, short_tokens)[7:]  # apart from longs
    out = []
    for r in range(rounds):
        batch = shorts[r * N_SHORT: (r + 1) * N_SHORT]
        out.append(batch[:N_SHORT // 2] + [longs[r]] + batch[N_SHORT // 2:])
    return out


def run_mixed(servers, rounds: list[list[str]], max_tokens: int, time_limit: float) -> dict:
    """Every round on every server (alternating who goes first); tok/s, TTFT, peak memory."""
    out = {}
    got = {s.name: [] for s in servers}
    wall = dict.fromkeys(got, 0.0)
    peak = dict.fromkeys(got, 0)
    for i, prompts in enumerate(rounds):
        for s in (servers if i % 2 == 0 else servers[::-1]):
            reset_peak_rss(s.proc.pid)
            time.sleep(0.2)
            before = rss_kib(s.proc.pid, "VmRSS")
            results, seconds = asyncio.run(run_requests(
                s.base, s.model_id, prompts, len(prompts), len(prompts), max_tokens,
                time_limit))
            peak[s.name] = max(peak[s.name], rss_kib(s.proc.pid, "VmHWM") - before)
            got[s.name] += results
            wall[s.name] += seconds
    for s in servers:
        level = summarize(len(rounds[0]), got[s.name], wall[s.name]).as_dict()
        level["peak_rss_growth_mib"] = round(peak[s.name] / 1024, 1)
        out[s.name] = level
        print(f"  {s.name:14s} mixed {level['tok_per_s']:8.1f} tok/s ttft p50 "
              f"{level['ttft_p50_s']}s p99 {level['ttft_p99_s']}s peak growth "
              f"{level['peak_rss_growth_mib']} MiB errors {level['errors']}", flush=True)
    return out
