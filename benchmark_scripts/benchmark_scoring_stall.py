"""A running stream's worst gap while 20 long prompts are scored, two checkouts in one run.

Scoring (completions ``echo`` with ``logprobs``, ``max_tokens: 0``) is what
lm-evaluation-harness sends. Each side serves the same offline model; a greedy
stream runs, then 20 clients each send a 4,000-token prompt to score, and for
``--window`` seconds the script records the stream's gaps between tokens and
the engine's running / waiting counts (/health). Then the 20 clients hang up
and the time until the stream's next token is taken (a scoring request a
client left must stop). A stream that got no token for the rest of the window
counts that wait as its last gap.

Usage::

    git worktree add /tmp/vq-before HEAD~1
    cp veloxquant_mlx/memory/*.so veloxquant_mlx/memory/*.source-sha256 \\
        /tmp/vq-before/veloxquant_mlx/memory/
    .venv/bin/python benchmark_scripts/benchmark_scoring_stall.py --old-root /tmp/vq-before \\
        [--out figures/server/scoring_stall.json]
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchmark_revisions import checkout_revision, start  # noqa: E402

from veloxquant_mlx.offline_model import ensure_model  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
NO_EOS = {"1": -100, "3": -100}  # the tiny model's end tokens


def scoring_body(i: int, n_tokens: int) -> bytes:
    ids = [10 + (i * 131 + 7 * j) % 4000 for j in range(n_tokens)]
    return json.dumps({"prompt": ids, "max_tokens": 0, "echo": True, "logprobs": 5}).encode()


def post_and_stay(base: str, payload: bytes) -> socket.socket:
    """A POST on a raw socket left open: closing it is the client hanging up."""
    host, port = base.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=30)
    sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: "
                 f"application/json\r\nContent-Length: {len(payload)}\r\n\r\n".encode()
                 + payload)
    return sock


def stream_times(base: str, stop: threading.Event, times: list[float]) -> None:
    body = {"prompt": "STREAM", "max_tokens": 4000, "stream": True, "temperature": 0,
            "logit_bias": NO_EOS}
    with httpx.Client(base_url=base, timeout=600) as client, \
            client.stream("POST", "/v1/completions", json=body) as stream:
        for line in stream.iter_lines():
            if line.startswith("data: {"):
                times.append(time.monotonic())
            if stop.is_set():
                return


def depths(base: str) -> tuple[int, int]:
    health = httpx.get(base + "/health", timeout=10).json()
    return int(health.get("running", 0)), int(health.get("waiting", 0))


def scenario(base: str, clients: int, n_tokens: int, window: float) -> dict:
    stop, times = threading.Event(), []
    streamer = threading.Thread(target=stream_times, args=(base, stop, times), daemon=True)
    streamer.start()
    deadline = time.monotonic() + 60
    while len(times) < 5 and time.monotonic() < deadline:
        time.sleep(0.05)
    sockets = [post_and_stay(base, scoring_body(i, n_tokens)) for i in range(clients)]
    began = time.monotonic()
    most = (0, 0)
    while time.monotonic() - began < window:
        running, waiting = depths(base)
        most = max(most, (running, waiting))
        time.sleep(0.25)
    ended = time.monotonic()
    inside = [t for t in times if began <= t <= ended]
    marks = [began, *inside, ended]
    gaps = [b - a for a, b in zip(marks, marks[1:], strict=False)]
    for sock in sockets:
        sock.close()
    left = time.monotonic()
    while not any(t > left for t in times) and time.monotonic() - left < 300:
        time.sleep(0.05)  # the stream's next token: scoring a client left has stopped
    resumed = [t for t in times if t > left]
    stop.set()
    return {"worst_gap_s": round(max(gaps), 3), "tokens_in_window": len(inside),
            "most_running_waiting": list(most),
            "next_token_after_hangup_s": round(resumed[0] - left, 2) if resumed else None}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--old-root", type=Path, required=True)
    p.add_argument("--model", default="tiny", help="offline preset")
    p.add_argument("--clients", type=int, default=20)
    p.add_argument("--tokens", type=int, default=4000, help="prompt tokens per scoring request")
    p.add_argument("--window", type=float, default=20.0, help="seconds measured")
    p.add_argument("--out", type=Path, default=ROOT / "figures/server/scoring_stall.json")
    args = p.parse_args()
    model = ensure_model(args.model)
    out = {"model": args.model, "clients": args.clients, "prompt_tokens": args.tokens,
           "window_s": args.window}
    for side, root in (("before", args.old_root.resolve()), ("after", ROOT)):
        proc, base = start(root, model)
        try:
            out[side] = {"revision": checkout_revision(root),
                         **scenario(base, args.clients, args.tokens, args.window)}
        finally:
            proc.terminate()
            proc.wait(60)
        print(side, json.dumps(out[side]), flush=True)
    out["worst_gap_ratio_before_over_after"] = round(
        out["before"]["worst_gap_s"] / max(out["after"]["worst_gap_s"], 1e-3), 1)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
