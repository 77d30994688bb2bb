"""The bounded pieces ``benchmark_gpu.py`` runs: model build, server start/stop, one level, profile.

Each piece has a hard bound in time, because the GPU run must end inside one
10-minute command whatever a server does: a level stops launching requests at
its limit and is abandoned if it does not drain, a stop waits a fixed time and
then kills, the step profile runs under a timeout.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
from benchmark_server import OURS, Running, free_port, process_cpu_s, server_command, wait_up
from replica_set import default_signals
from server_load import run_requests

ROOT = Path(__file__).resolve().parents[1]
# Signs of an unclean exit in a server's stderr (C++ abort, Python crash, signal).
BAD_EXIT_MARKERS = ("terminate called", "Aborted", "Traceback", "Segmentation")

# Run in a child so the parent never initialises the GPU: its MLX allocator
# would otherwise keep the 1b build's buffers cached while the servers run.
_BUILD_AND_FACTS = """
import json, sys, time, mlx.core as mx, mlx_lm
from veloxquant_mlx.offline_model import BUILD_INFO, ensure_model
t = time.perf_counter()
folder = ensure_model(sys.argv[1], seed=int(sys.argv[2]))
build_s = time.perf_counter() - t
try:
    info = {k: str(v) for k, v in mx.device_info().items()}
except Exception as exc:
    info = {"error": repr(exc)}
print(json.dumps({"folder": str(folder), "build_s": round(build_s, 2),
    "n_params": json.loads((folder / BUILD_INFO).read_text())["n_params"],
    "config": json.loads((folder / "config.json").read_text()),
    "device": str(mx.default_device()),
    "on_gpu": mx.default_device().type == mx.DeviceType.gpu,
    "cuda": bool(getattr(mx, "cuda", None) and mx.cuda.is_available()),
    "device_info": info, "mlx": mx.__version__, "mlx_lm": mlx_lm.__version__}))
"""


def build_and_describe(preset: str, seed: int, env: dict[str, str]) -> dict:
    """Build (or find) the offline model in a child; its folder, config and the machine's MLX.

    Raises:
        RuntimeError: The child failed; the message carries its stderr tail.
    """
    done = subprocess.run([sys.executable, "-c", _BUILD_AND_FACTS, preset, str(seed)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        raise RuntimeError(f"model build failed (exit {done.returncode}): "
                           f"{done.stderr[-1500:]}")
    return json.loads(done.stdout)


class Budget:
    """The run's wall-clock budget, shared out among the levels still to run."""

    def __init__(self, seconds: float, reserve_s: float) -> None:
        self.deadline = time.monotonic() + seconds
        self.reserve_s = reserve_s  # kept back for stops, the peer's start, the profile

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def level_limit(self, cap: float, levels_left: int) -> float | None:
        """Seconds this level may launch requests for; None when the budget is spent."""
        spare = self.left() - self.reserve_s
        if spare < 5:
            return None
        return round(min(cap, spare / max(levels_left, 1)), 1)


def start(name: str, model: Path, env: dict[str, str], log_dir: Path,
          extra: list[str]) -> Running:
    """Start one server with its stderr in ``log_dir/<name>.log`` (a file: a pipe could fill)."""
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    log_path = log_dir / f"{name}.log"
    log_file = log_path.open("w")
    proc = subprocess.Popen(server_command(name, model, port) + extra, cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=log_file, text=True,
                            preexec_fn=default_signals)  # the peer is stopped with SIGINT
    server = Running(name, proc, base, str(model), log_path, log_file)
    try:
        wait_up(base, proc)
    except RuntimeError:
        stop(server, signal.SIGKILL, 10)
        raise
    if name == OURS:  # the peer selects its loaded model by its path (set above)
        server.model_id = httpx.get(base + "/v1/models").json()["data"][0]["id"]
    return server


def stop(server: Running, sig: signal.Signals, wait_s: float) -> dict:
    """Send ``sig``, wait up to ``wait_s`` (then SIGKILL); how the process ended."""
    t0 = time.monotonic()
    server.proc.send_signal(sig)
    killed = False
    try:
        server.proc.wait(timeout=wait_s)
    except subprocess.TimeoutExpired:
        killed = True
        server.proc.kill()
        server.proc.wait()
    server.log_file.close()
    err = server.log_path.read_text(errors="replace")
    bad = [m for m in BAD_EXIT_MARKERS if m in err]
    code = None if killed else server.proc.returncode
    return {"signal": sig.name, "exit_code": code, "killed_after_wait": killed,
            "stop_s": round(time.monotonic() - t0, 2), "bad_markers": bad,
            "stderr_tail": err[-1500:], "clean": code == 0 and not bad}


def drive_bounded(s: Running, batch: list[str], c: int, n: int, max_tokens: int,
                  limit_s: float, drain_s: float) -> tuple[list, float, float, float]:
    """One level: results, wall s, server CPU s, its main thread's CPU s.

    Raises:
        TimeoutError: The level will not drain.
    """
    pid = s.proc.pid
    cpu0, main0 = process_cpu_s(pid), process_cpu_s(pid, pid)
    # run_requests only stops launching at limit_s; wait_for bounds a server that hangs.
    load = run_requests(s.base, s.model_id, batch, c, n, max_tokens, limit_s, True)
    results, wall = asyncio.run(asyncio.wait_for(load, limit_s + drain_s))
    return results, wall, process_cpu_s(pid) - cpu0, process_cpu_s(pid, pid) - main0


def warm_up(s: Running, prompts: list[str], max_tokens: int, drain_s: float) -> float:
    """Two unmeasured requests, one at a time (compiles kernels, fills caches); seconds."""
    t = time.monotonic()
    asyncio.run(asyncio.wait_for(run_requests(s.base, s.model_id, prompts, 1, 2, max_tokens,
                                              60), 60 + drain_s))
    return round(time.monotonic() - t, 2)


def nvidia_smi(query: str) -> str | None:
    """``nvidia-smi --query-gpu=QUERY`` for GPU 0 as CSV without header, or None without one."""
    if not shutil.which("nvidia-smi"):
        return None
    try:
        out = subprocess.run(["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader",
                              "--id=0"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def engine_clock(base: str) -> dict[str, float]:
    """Our server's step clock from ``/metrics``: seconds per phase, decode steps, batch rows.

    (``veloxquant_engine_phase_seconds``, ``veloxquant_engine_decode_steps``,
    the ``veloxquant_batch_size`` histogram's sum and ``veloxquant_kv_arena_writes``;
    see server/engine/run_output.py.)
    """
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(base + "/metrics", timeout=10).text
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "veloxquant_engine_phase_seconds_total":
                out[sample.labels["phase"]] = sample.value
            elif sample.name == "veloxquant_engine_decode_steps_total":
                out["steps"] = sample.value
            elif sample.name == "veloxquant_batch_size_sum":
                out["rows"] = sample.value
            elif sample.name == "veloxquant_kv_arena_writes_total":
                out["arena_writes"] = sample.value
    return out


def step_profile(before: dict[str, float], after: dict[str, float]) -> dict:
    """Milliseconds per decode step by phase between two :func:`engine_clock` reads."""
    steps = after.get("steps", 0.0) - before.get("steps", 0.0)
    if steps <= 0:
        return {"error": "no decode steps between the two reads"}
    phases = {k: round(1000 * (after[k] - before.get(k, 0.0)) / steps, 3)
              for k in after if k not in ("steps", "rows", "arena_writes")}
    writes = after.get("arena_writes", 0.0) - before.get("arena_writes", 0.0)
    return {"decode_steps": int(steps),
            "mean_rows": round((after.get("rows", 0.0) - before.get("rows", 0.0)) / steps, 2),
            "ms_per_step": phases, "ms_per_step_total": round(sum(phases.values()), 3),
            # each one copies the whole arena on a GPU: prefill calls, write-back flushes
            "arena_writes_per_step": round(writes / steps, 3)}
