"""The engine thread's cost of recording a decode step's token metrics.

Every generated token adds to ``veloxquant_generation_tokens`` and one of the
two latency histograms (time to first token, inter-token latency). Recorded
per token with prometheus-client's ``Counter.inc`` and ``Histogram.observe``
(the way before), each takes its locks and walks the buckets in Python;
``ServerMetrics.tokens`` records a step's tokens with one ``inc`` and one
``StepHistogram.observe_many`` per histogram. This times both for 1, 16 and
64 rows a step, alternating the two ways so drift hits both, and checks that
they counted the same.

Usage::

    .venv/bin/python benchmark_scripts/benchmark_token_metrics.py [--steps 3000]
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, Histogram

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmark_scripts"))
from benchmark_write_back import save_figures  # noqa: E402

from server.metrics import ITL_BUCKETS, LATENCY_BUCKETS, ServerMetrics  # noqa: E402

DEFAULT_OUT = ROOT / "figures" / "server" / "token_metrics.json"


class _State:
    """The RequestState fields the token metrics read."""

    def __init__(self, i: int) -> None:
        self.generated, self.submitted_at = 2 + i, 100.0
        self.first_token_at, self.prev_token_at = 100.2, 101.0 + i * 1e-4
        self.last_token_at = self.prev_token_at + 0.004 + i * 1e-4


class _PerToken:
    """The way before: prometheus-client's own metrics, one call per token."""

    def __init__(self) -> None:
        r = CollectorRegistry()
        self.generation_tokens = Counter("tokens", "t", registry=r)
        self.ttft = Histogram("ttft_seconds", "t", buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("itl_seconds", "t", buckets=ITL_BUCKETS, registry=r)

    def tokens(self, states: list[_State]) -> None:
        for state in states:
            self.generation_tokens.inc()
            if state.generated == 1:
                self.ttft.observe(state.first_token_at - state.submitted_at)
            else:
                self.itl.observe(state.last_token_at - state.prev_token_at)


def _time_steps(recorder, states: list[_State], steps: int) -> float:
    start = time.perf_counter()
    for _ in range(steps):
        recorder.tokens(states)
    return (time.perf_counter() - start) / steps * 1e6


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = p.parse_args()
    rows_out = {}
    for rows in (1, 16, 64):
        states = [_State(i) for i in range(rows)]
        per_token, per_step = _PerToken(), ServerMetrics()
        times = {"per_token": [], "per_step": []}
        for r in range(args.rounds):
            order = [("per_token", per_token), ("per_step", per_step)]
            for name, recorder in (order if r % 2 == 0 else order[::-1]):
                times[name].append(_time_steps(recorder, states, args.steps))
        counted = per_step.itl.collect().__next__().samples
        count = next(s.value for s in counted if s.name.endswith("_count"))
        reference = per_token.itl.collect()[0].samples
        assert count == next(s.value for s in reference if s.name.endswith("_count"))
        best = {k: min(v) for k, v in times.items()}
        rows_out[rows] = {"us_per_step": {k: round(v, 2) for k, v in best.items()},
                          "speedup": round(best["per_token"] / best["per_step"], 2)}
        print(f"{rows:3d} rows: per token {best['per_token']:8.1f} us/step, "
              f"per step {best['per_step']:7.1f} us/step ({rows_out[rows]['speedup']}x)")
    save_figures(args.out, "benchmark_token_metrics.py",
                 {"python": platform.python_version(), "steps": args.steps,
                  "rounds": args.rounds, "best_of_rounds": rows_out})
    return 0


if __name__ == "__main__":
    sys.exit(main())
