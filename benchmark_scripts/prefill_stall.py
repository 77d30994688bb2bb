"""How long running streams freeze while a long prompt is prefilled: time slice on and off.

Four greedy streams decode on the default model (SmolLM2, served by ``python -m
server``); once they are going, one request with a ~1,800-token prompt arrives.
Every stream's token arrival times are kept, and for each setting the figures
are: the longest gap between two tokens of any stream while the long prompt is
in (the freeze a user sees), the streams' median gap before it arrived, and the
long prompt's latency to its one token. The settings are
``batch.max_prefill_s_per_step = 0.5`` and ``1.0``, and ``0`` (the token bound
alone: up to 2,048 prompt tokens a step); rounds alternate the order, each on a
fresh server. Writes ``figures/server/prefill_stall.json``.

Usage::

    .venv/bin/python benchmark_scripts/prefill_stall.py [--rounds 2]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmark_scripts")]
DEFAULT_OUT = ROOT / "figures" / "server" / "prefill_stall.json"
SETTINGS = {"time slice 0.5 s": "0.5", "time slice 1.0 s": "1.0", "token bound alone": "0"}
STREAMS = 4
NO_END = {"0": -100, "2": -100}  # SmolLM2's end tokens: every stream runs to max_tokens
LONG_PROMPT = "Summarise the following notes. " + " ".join(
    f"Note {i}: the lighthouse keeper logged the weather, the ships and the lamp."
    for i in range(120))


async def _stream(client, prompt: str, arrivals: list[float], max_tokens: int) -> None:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "logit_bias": NO_END}
    async with client.stream("POST", "/v1/completions", json=body) as response:
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                arrivals.append(time.monotonic())


async def _scenario(base_url: str, max_tokens: int) -> dict:
    import httpx

    async with httpx.AsyncClient(base_url=base_url, timeout=300) as client:
        await client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 4})  # warm
        arrivals: list[list[float]] = [[] for _ in range(STREAMS)]
        streams = [asyncio.create_task(_stream(client, f"Story {i}: the lighthouse",
                                               arrivals[i], max_tokens))
                   for i in range(STREAMS)]
        while min(len(a) for a in arrivals) < 8:  # all four decoding
            await asyncio.sleep(0.05)
        await asyncio.sleep(1.0)
        sent = time.monotonic()
        long = await client.post("/v1/completions", json={
            "prompt": LONG_PROMPT, "max_tokens": 1, "temperature": 0})
        answered = time.monotonic()
        await asyncio.wait_for(asyncio.gather(*streams), timeout=600)
    long.raise_for_status()
    gaps_in, gaps_before = [], []
    for times in arrivals:
        for a, b in zip(times, times[1:], strict=False):
            if b > sent and a < answered:
                gaps_in.append(b - a)
            elif b <= sent:
                gaps_before.append(b - a)
    return {"long_prompt_tokens": long.json()["usage"]["prompt_tokens"],
            "long_prompt_latency_s": round(answered - sent, 3),
            "max_stream_gap_during_s": round(max(gaps_in), 3),
            "stream_gaps_during": len(gaps_in),
            "median_stream_gap_before_s": round(statistics.median(gaps_before), 4)}


def run(setting: str, work: Path, max_tokens: int) -> dict:
    from server_process import ServerProcess

    env = {"VELOXQUANT_BATCH_MAX_PREFILL_S_PER_STEP": SETTINGS[setting]}
    name = setting.replace(" ", "_").replace(".", "")
    with ServerProcess(work / f"{name}.log", [], env, startup_timeout_s=300) as server:
        return asyncio.run(_scenario(server.base_url, max_tokens))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=160)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = p.parse_args()
    from benchmark_revisions import checkout_revision

    work = Path(tempfile.mkdtemp(prefix="prefill-stall-"))
    runs: dict[str, list[dict]] = {name: [] for name in SETTINGS}
    for r in range(args.rounds):
        order = list(SETTINGS) if r % 2 == 0 else list(SETTINGS)[::-1]
        for setting in order:
            runs[setting].append(run(setting, work, args.max_tokens))
            print(f"round {r} {setting}: {runs[setting][-1]}", flush=True)
    summary = {name: {"max_stream_gap_during_s": min(x["max_stream_gap_during_s"] for x in rs),
                      "long_prompt_latency_s": min(x["long_prompt_latency_s"] for x in rs)}
               for name, rs in runs.items()}
    off = summary["token bound alone"]
    ratios = {name: {"freeze_off_over_this": round(off["max_stream_gap_during_s"]
                                                   / row["max_stream_gap_during_s"], 2),
                     "long_prompt_latency_this_over_off": round(
                         row["long_prompt_latency_s"] / off["long_prompt_latency_s"], 3)}
              for name, row in summary.items() if row is not off}
    out = {"benchmark": "benchmark_scripts/prefill_stall.py",
           "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "revision": checkout_revision(ROOT), "streams": STREAMS,
           "note": "best round of each (noise only adds time)", "summary": summary,
           "ratios_vs_token_bound_alone": ratios,
           "runs": runs}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(summary), f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
