"""The engine thread's cost of handing a decode step's token events to the event loop.

One event per running request and step crosses from the engine thread to
the asyncio loop. Sent one by one (``EventChannel.put``) each is a
``call_soon_threadsafe``: the loop's lock and a write to its wake-up pipe.
``EventBatch`` sends a step's events with one call per loop. This times both
on the engine side while a real loop runs in another thread with one reader
per channel (each reader formats its event as an SSE line, as a route does),
for 1, 16 and 64 channels, alternating the two ways so drift hits both.

Usage::

    .venv/bin/python benchmark_scripts/benchmark_event_batch.py [--steps 400]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from server.channel import EventBatch, EventChannel  # noqa: E402
from server.protocol import TokenEvent  # noqa: E402

DEFAULT_OUT = ROOT / "figures" / "server" / "event_batch.json"


async def _read(channel: EventChannel, n: int) -> None:
    for _ in range(n):
        event = await channel.get()
        json.dumps({"choices": [{"text": event.text, "index": 0}]})


def measure(loop: asyncio.AbstractEventLoop, rows: int, steps: int, batched: bool) -> float:
    """Engine-side microseconds per step to hand over ``rows`` events."""
    channels = [EventChannel(loop) for _ in range(rows)]
    readers = [asyncio.run_coroutine_threadsafe(_read(c, steps), loop) for c in channels]
    batch, spent = EventBatch(), 0.0
    for step in range(steps):
        t = time.perf_counter()
        for channel in channels:
            event = TokenEvent(" token", step)
            if batched:
                batch.add(channel, event)
            else:
                channel.put(event)
        batch.send()
        spent += time.perf_counter() - t
        time.sleep(0.0005)  # the model call of the next step, in which the loop catches up
    for reader in readers:
        reader.result(60)
    return spent / steps * 1e6


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = p.parse_args()
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    levels = []
    for rows in args.rows:
        runs: dict[str, list[float]] = {"one_call_per_event": [], "one_call_per_step": []}
        for _ in range(args.rounds):
            for name, batched in (("one_call_per_event", False), ("one_call_per_step", True)):
                runs[name].append(round(measure(loop, rows, args.steps, batched), 1))
        best = {name: min(values) for name, values in runs.items()}
        levels.append({"rows": rows, "us_per_step": best, "all_runs": runs,
                       "ratio": round(best["one_call_per_event"] / best["one_call_per_step"], 2)})
        print(f"{rows} events a step: {best['one_call_per_event']} us one call each, "
              f"{best['one_call_per_step']} us one call a step")
    loop.call_soon_threadsafe(loop.stop)
    thread.join(5)
    result = {"benchmark": "benchmark_scripts/benchmark_event_batch.py",
              "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "machine": {"platform": platform.platform()}, "steps": args.steps,
              "note": "engine-thread time per step, best of the rounds; ratio = per event "
                      "over per step", "levels": levels}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
