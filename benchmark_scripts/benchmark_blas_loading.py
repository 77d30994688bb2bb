"""SmolLM2 decode: the BLAS loaded in place vs another checkout's way, in one run.

Starts ``python -m server`` (the default model, SmolLM2-135M-Instruct) from this checkout,
which loads the optimized BLAS into its own process before MLX
(``veloxquant_mlx.cpu_backend.load_optimized_blas``: the scipy-openblas32 wheel behind the
BLAS forward), and from ``--old-root``, a checkout that does it its own way (e.g. the
revision that re-executed itself with ``LD_PRELOAD``: ``git worktree add /tmp/vq-old HEAD``
with its ``veloxquant_mlx/*.so`` and ``veloxquant_mlx/memory/*.so`` built or copied in).
``--bundled`` adds this checkout on MLX's bundled reference BLAS (``VELOXQUANT_NO_BLAS_PRELOAD
=1``), and ``--attach NAME=URL[,LOG]`` a server started elsewhere (e.g. by another user;
its log file, when given, names its BLAS).

Each round sends every side the same ``--requests`` greedy streaming completions of
``--tokens`` new tokens, one at a time (a single stream) or ``--concurrency`` in flight, in
an order that rotates from round to round; no prompt repeats within a side. A request's
decode rate is its tokens after the first over the time after its first token; with
``--concurrency`` above 1 a round's throughput is all its tokens over its wall time. Each
side's start-up line (which BLAS it runs on) is recorded from its log.

Usage::

    flock /tmp/velox-bench.lock .venv/bin/python benchmark_scripts/benchmark_blas_loading.py \\
        --old-root /tmp/vq-old [--rounds 4] [--requests 3] [--bundled] \\
        [--attach nonroot=http://127.0.0.1:8011,/tmp/vq-nonroot/serve.log]

Writes ``figures/cpu/blas_wheel.json`` (``blas_wheel_c<N>.json`` with ``--concurrency N``:
ratios against the old side, same run) and prints them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchmark_revisions import checkout_revision  # noqa: E402
from benchmark_server import free_port, wait_up  # noqa: E402
from server_load import RequestResult, run_requests, stream_completion  # noqa: E402

from veloxquant_mlx.blas_finder import OPT_OUT_ENV  # noqa: E402
from veloxquant_mlx.cpu_backend import child_env  # noqa: E402
from veloxquant_mlx.offline_model import iter_corpus  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "figures" / "cpu" / "blas_wheel.json"
PROMPT_WORDS = 48


class Side:
    """One server under test: started here (``root``) or attached (``base`` only)."""

    def __init__(self, name: str, base: str | None = None, root: Path | None = None,
                 env: dict[str, str] | None = None, log_path: Path | None = None) -> None:
        self.name, self.base, self.root, self.env = name, base, root, env
        self.proc: subprocess.Popen | None = None
        self.log_path = log_path
        self.results: list[RequestResult] = []
        self.round_tok_s: list[float] = []  # throughput of each concurrent round

    def start(self) -> None:
        """Start ``python -m server`` from ``root`` (nothing to do when attached)."""
        if self.root is None:
            return
        port = free_port()
        self.log_path = Path(tempfile.mkstemp(prefix=f"blas-{self.name}-", suffix=".log")[1])
        with self.log_path.open("w") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "server", "--port", str(port), "--log-level", "info"],
                cwd=self.root, env=dict(self.env or {}, PYTHONPATH=str(self.root)),
                stdout=log, stderr=log)
        self.base = f"http://127.0.0.1:{port}"
        wait_up(self.base, self.proc, timeout=300)

    def startup_line(self) -> str:
        """The server's ``backend:`` start-up line (empty when its log is unknown)."""
        if self.log_path is None:
            return ""
        lines = self.log_path.read_text(errors="replace").splitlines()
        return next((line.split("backend: ", 1)[1] for line in lines if "backend: " in line), "")

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(timeout=60)


def prompts(n: int) -> list[str]:
    """``n`` distinct English prompts of ``PROMPT_WORDS`` words from the offline corpus."""
    words = " ".join(iter_corpus(200_000)).split()
    stride = max((len(words) - PROMPT_WORDS) // n, 1)
    return [" ".join(words[i * stride: i * stride + PROMPT_WORDS]) for i in range(n)]


async def one_stream(base: str, model: str, texts: list[str], tokens: int) -> list[RequestResult]:
    """``texts`` as greedy streaming completions, one after another."""
    async with httpx.AsyncClient(base_url=base, timeout=600) as client:
        return [await stream_completion(client, model, text, tokens) for text in texts]


def decode_rate(result: RequestResult) -> float | None:
    """Tokens after the first over the seconds after it (None: too short to tell)."""
    if not result.ok or result.ttft_s is None or result.completion_tokens < 2:
        return None
    return (result.completion_tokens - 1) / (result.latency_s - result.ttft_s)


def summary(side: Side) -> dict:
    rates = [r for r in map(decode_rate, side.results) if r is not None]
    ok = [r for r in side.results if r.ok]
    throughput = ({"tok_s_per_round": side.round_tok_s,
                   "tok_s_median": round(statistics.median(side.round_tok_s), 2)}
                  if side.round_tok_s else {})
    return {"startup_line": side.startup_line(), "requests": len(side.results),
            "errors": len(side.results) - len(ok), **throughput,
            "decode_tok_s_median": round(statistics.median(rates), 2) if rates else None,
            "decode_tok_s_per_request": [round(r, 2) for r in rates],
            "ttft_s_median": round(statistics.median(r.ttft_s for r in ok), 3) if ok else None}


def attach_spec(text: str) -> tuple[str, str, Path | None]:
    """``NAME=URL[,LOG]`` of ``--attach``."""
    name, sep, rest = text.partition("=")
    url, _, log = rest.partition(",")
    if not sep or not name or not url.startswith("http"):
        raise argparse.ArgumentTypeError(f"expected NAME=URL[,LOG], got {text!r}")
    return name, url, Path(log) if log else None


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--old-root", type=Path, required=True)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--requests", type=int, default=3, help="per side and round")
    p.add_argument("--tokens", type=int, default=64, help="new tokens a request")
    p.add_argument("--concurrency", type=int, default=1, help="requests in flight")
    p.add_argument("--bundled", action="store_true",
                   help="add this checkout on MLX's bundled reference BLAS")
    p.add_argument("--attach", type=attach_spec, action="append", default=[],
                   help="NAME=URL[,LOG] of a running server to measure too (repeatable)")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    if args.out is None:
        args.out = DEFAULT_OUT if args.concurrency == 1 else \
            DEFAULT_OUT.with_name(f"blas_wheel_c{args.concurrency}.json")
    return args


def make_sides(args: argparse.Namespace) -> list[Side]:
    env = child_env(preload=True)
    sides = [Side("new", root=ROOT, env=env), Side("old", root=args.old_root.resolve(), env=env)]
    if args.bundled:
        sides.append(Side("bundled", root=ROOT, env=dict(env, **{OPT_OUT_ENV: "1"})))
    sides += [Side(name, base=url, log_path=log) for name, url, log in args.attach]
    return sides


def measure(sides: list[Side], args: argparse.Namespace) -> None:
    """Warm every side up, then the rounds, each starting one side further on."""
    texts = prompts(args.rounds * args.requests + 1)
    models = {s.name: httpx.get(s.base + "/v1/models").json()["data"][0]["id"] for s in sides}
    for side in sides:
        asyncio.run(one_stream(side.base, models[side.name], texts[-1:], args.tokens))
    for r in range(args.rounds):
        batch = texts[r * args.requests: (r + 1) * args.requests]
        for side in sides[r % len(sides):] + sides[: r % len(sides)]:
            if args.concurrency > 1:
                concurrent_round(side, models[side.name], batch, args)
                continue
            side.results += asyncio.run(one_stream(side.base, models[side.name], batch,
                                                   args.tokens))
            print(f"round {r + 1} {side.name}: "
                  f"{[round(x or 0, 1) for x in map(decode_rate, side.results[-len(batch):])]}"
                  " tok/s", flush=True)


def concurrent_round(side: Side, model: str, batch: list[str], args: argparse.Namespace) -> None:
    """``batch`` with ``--concurrency`` in flight: the round's tokens over its wall time."""
    results, wall = asyncio.run(run_requests(side.base, model, batch, args.concurrency,
                                             len(batch), args.tokens, time_limit_s=900))
    side.results += results
    tokens = sum(r.completion_tokens for r in results if r.ok)
    side.round_tok_s.append(round(tokens / wall, 2) if wall else 0.0)
    print(f"{side.name}: {side.round_tok_s[-1]} tok/s at c={args.concurrency}", flush=True)


def main() -> int:
    args = parse_args()
    sides = make_sides(args)
    try:
        for side in sides:  # one at a time: start-up is CPU-bound on a small machine
            side.start()
        measure(sides, args)
    finally:
        for side in sides:
            side.stop()
    per_side = {side.name: summary(side) for side in sides}
    key = "tok_s_median" if args.concurrency > 1 else "decode_tok_s_median"
    old = per_side["old"][key]
    result = {
        "benchmark": "benchmark_scripts/benchmark_blas_loading.py",
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "revision": checkout_revision(ROOT), "old_revision": checkout_revision(args.old_root),
        "machine": {"platform": platform.platform(), "processor": platform.processor()},
        "settings": {"model": "smollm2 (default)", "rounds": args.rounds,
                     "requests_per_round": args.requests, "new_tokens": args.tokens,
                     "prompt_words": PROMPT_WORDS, "concurrency": args.concurrency,
                     "temperature": 0.0},
        "sides": per_side,
        ("throughput" if args.concurrency > 1 else "decode") + "_ratio_vs_old": {
            name: round(s[key] / old, 3) for name, s in per_side.items() if old and s[key]},
    }
    print({name: s[key] for name, s in per_side.items()})
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
