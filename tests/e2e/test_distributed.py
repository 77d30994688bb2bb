"""One model over two processes (``--distributed 2``): same answers, both ranks' pools, clean stop.

The tiny model (4 heads, 2 KV heads) is split tensor-parallel over two ranks
on loopback (mx.distributed's ring backend); rank 0 serves. Its greedy
output must be the one-process server's, text for text: the split only
changes the order of the sums inside two matmuls per layer (logits move by
float32 rounding, ~1e-6 on this model), far from any greedy choice here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from server.distributed import (
    DistributedError,
    check_split,
    shard_model,
)
from server.settings import load_settings

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmark_scripts"))
from server_process import ServerProcess  # noqa: E402

ADMIN = "admin-token-ranks"
PROMPTS = ["The pool holds", "Blocks go back when", "Rank zero serves while"]
NO_EOS = {"1": -100, "3": -100}  # the tiny model's end tokens never win: a long answer


def _greedy(base: str, prompt: str, max_tokens: int = 16) -> str:
    r = httpx.post(base + "/v1/completions", timeout=120,
                   json={"prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                         "logit_bias": NO_EOS})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def _ranks(base: str) -> list[dict]:
    r = httpx.get(base + "/admin/pool", headers={"Authorization": f"Bearer {ADMIN}"},
                  timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["ranks"]


@pytest.mark.slow
def test_two_ranks_answer_as_one_and_report_both_pools(tiny_model_path, live_server, tmp_path):
    want = [_greedy(live_server.base_url, p) for p in PROMPTS]
    server = ServerProcess(tmp_path / "ranks.log",
                           ["--model", str(tiny_model_path), "--distributed", "2"],
                           {"VELOXQUANT_ADMIN_TOKEN": ADMIN}, startup_timeout_s=180)
    with server:
        base = server.base_url
        assert [_greedy(base, p) for p in PROMPTS] == want

        # A long answer in flight: both ranks hold its blocks (each its share of the heads).
        seen: list[list[dict]] = []
        done = threading.Event()

        def long_answer() -> None:
            try:
                _greedy(base, PROMPTS[0], max_tokens=300)
            finally:
                done.set()

        thread = threading.Thread(target=long_answer)
        thread.start()
        deadline = time.monotonic() + 60
        while not done.is_set() and time.monotonic() < deadline:
            ranks = _ranks(base)
            if all(r["blocks_in_use"] > 0 for r in ranks):
                seen.append(ranks)
            time.sleep(0.05)
        thread.join(60)
        assert seen, "no /admin/pool read caught the request on both ranks"
        for ranks in seen:
            assert [r["rank"] for r in ranks] == [0, 1]
            assert ranks[0]["blocks_in_use"] == ranks[1]["blocks_in_use"]
            assert ranks[0]["n_blocks"] == ranks[1]["n_blocks"]
        idle = _ranks(base)
        assert [r["blocks_in_use"] for r in idle] == [0, 0]
        assert all(r["blocks_free"] == r["n_blocks"] for r in idle)

        # An idle follower waits for rank 0 in the kernel: MLX's ring would spin a core.
        follower = _follower_pid(server.pid)
        time.sleep(0.5)
        busy = _cpu_seconds(follower)
        time.sleep(3)
        assert _cpu_seconds(follower) - busy < 0.3, "an idle follower is using the CPU"

        # Prompt scoring would be a model call on rank 0 alone: refused, as a client error.
        echo = httpx.post(base + "/v1/completions", timeout=60,
                          json={"prompt": "x", "max_tokens": 1, "echo": True, "logprobs": 1})
        assert echo.status_code == 400 and "ranks" in echo.json()["error"]["message"]

        server.terminate()
        assert server.wait(60) == 0
    log = server.log()
    assert "rank 1 of 2: following rank 0" in log
    assert "rank 1: rank 0 stopped; exiting" in log


def test_distributed_turns_prefix_caching_off():
    import server.__main__ as entry

    settings = entry.settings_from_args(entry.parse_args(["--distributed", "2"]))
    assert settings.distributed.ranks == 2 and not settings.cache.prefix_caching
    assert load_settings(None, env={}).distributed.ranks == 1


class _Group:
    def __init__(self, size: int) -> None:
        self._size = size

    def size(self) -> int:
        return self._size


def test_heads_that_do_not_divide_are_refused(tiny_model):
    model = tiny_model[0]
    with pytest.raises(DistributedError, match="do not divide among 3 ranks"):
        shard_model(model, _Group(3))
    with pytest.raises(DistributedError, match="no tensor-parallel split"):
        shard_model(object(), _Group(2))


@pytest.mark.slow
def test_a_split_that_cannot_be_made_stops_start_up_with_exit_2(tiny_model_path, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"num_attention_heads": 9,
                                                      "num_key_value_heads": 3}))
    with pytest.raises(DistributedError, match="9 attention heads and 3 KV heads"):
        check_split(tmp_path, 2)
    check_split(tmp_path, 3)
    done = subprocess.run([sys.executable, "-m", "server", "--model", str(tiny_model_path),
                           "--distributed", "3", "--port", "1"],
                          capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == 2
    assert "4 attention heads and 2 KV heads do not divide among 3 ranks" in done.stderr


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (children of any of its threads, recursively)."""
    found = []
    for children in Path(f"/proc/{pid}/task").glob("*/children"):
        try:
            for child in map(int, children.read_text().split()):
                found += [child, *_descendants(child)]
        except (ProcessLookupError, FileNotFoundError):
            continue  # a thread or child that has exited since
    return found


def _follower_pid(rank0: int) -> int:
    """The rank-1 process below the server's process (MLX_RANK=1 in its environment)."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        for pid in _descendants(rank0):
            try:
                environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            except (ProcessLookupError, FileNotFoundError):
                continue
            if b"MLX_RANK=1" in environ:
                return pid
        time.sleep(0.1)
    raise AssertionError(f"no rank-1 process below {rank0}")


def _cpu_seconds(pid: int) -> float:
    """User plus system CPU time of process ``pid`` so far (all its threads)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@pytest.mark.slow
def test_a_lost_rank_fails_requests_with_503_and_health_goes_503(tiny_model_path, tmp_path):
    import signal

    server = ServerProcess(tmp_path / "lost.log",
                           ["--model", str(tiny_model_path), "--distributed", "2"],
                           {"VELOXQUANT_ADMIN_TOKEN": ADMIN}, startup_timeout_s=180)
    with server:
        base = server.base_url
        assert _greedy(base, PROMPTS[0], max_tokens=4)
        os.kill(_follower_pid(server.pid), signal.SIGKILL)
        for _ in range(2):  # the one that meets the broken ring, then one after it
            r = httpx.post(base + "/v1/completions", timeout=60,
                           json={"prompt": "x", "max_tokens": 4, "temperature": 0})
            assert r.status_code == 503, r.text
            assert r.json()["error"]["code"] in ("shutting_down", "unavailable")
            # The cause, not "shutting down" (a planned drain) or "not loaded yet".
            message = r.json()["error"]["message"]
            assert "lost the other ranks" in message and "restart the server" in message
        health = httpx.get(base + "/health", timeout=10)
        assert health.status_code == 503 and "lost the other ranks" in health.text
        pool = httpx.get(base + "/admin/pool", timeout=30,
                         headers={"Authorization": f"Bearer {ADMIN}"})
        assert pool.status_code == 503 and "ranks did not answer" in pool.text
        server.terminate()
        assert server.wait(60) == 0
    assert "lost the other ranks" in server.log()


@pytest.mark.slow
def test_a_rank_lost_mid_generation_is_seen_within_the_stall_timeout(tiny_model_path, tmp_path):
    """The peer dies under running steps. Where rank 0's all-sums raise, the engine ends
    (the next exchange would wait for the dead peer forever); where rank 0 stays blocked
    inside a collective (MLX cannot interrupt it), the stall timeout shows it. Either
    way ``/health`` and new requests answer 503 within seconds, and SIGTERM exits 0."""
    import signal

    server = ServerProcess(tmp_path / "lost-mid.log",
                           ["--model", str(tiny_model_path), "--distributed", "2"],
                           {"VELOXQUANT_ADMIN_TOKEN": ADMIN,
                            "VELOXQUANT_LIMITS_ENGINE_STALL_TIMEOUT_S": "2"},
                           startup_timeout_s=180)
    with server:
        base = server.base_url
        body = {"prompt": "x", "max_tokens": 1500, "temperature": 0, "stream": True,
                "logit_bias": NO_EOS}
        frames = []
        try:
            with httpx.stream("POST", base + "/v1/completions", json=body,
                              timeout=10) as stream:
                for line in stream.iter_lines():
                    if not line.startswith("data: "):
                        continue  # the blank lines between events
                    frames.append(line)
                    if len(frames) == 3:  # generating: kill the peer under the running steps
                        os.kill(_follower_pid(server.pid), signal.SIGKILL)
        except httpx.ReadTimeout:
            pass  # rank 0 blocked inside a collective: this stream gets no end frame
        else:
            error = json.loads(frames[-2].removeprefix("data: "))  # last frame is [DONE]
            assert error["error"]["code"] in ("shutting_down", "unavailable"), frames[-2]
        deadline = time.monotonic() + 15
        while httpx.get(base + "/health", timeout=10).status_code != 503:
            assert time.monotonic() < deadline, "/health still 200 after the peer died"
            time.sleep(0.5)
        start = time.monotonic()
        r = httpx.post(base + "/v1/completions", timeout=30,
                       json={"prompt": "x", "max_tokens": 4})
        assert r.status_code == 503 and time.monotonic() - start < 5, r.text
        server.terminate()
        assert server.wait(60) == 0
