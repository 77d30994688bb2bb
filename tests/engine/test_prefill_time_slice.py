"""While requests decode, a long prompt's prefill yields to them every ``max_prefill_s_per_step``.

On a CPU a 512-token chunk of SmolLM2 takes seconds, and one step could prefill
2,048 prompt tokens before the running streams got their next token. Here the
fault hook (run before each model call of a row) makes each chunk of the long
prompt take 0.15 s, with a 0.1 s slice: every chunk after the first must have
a decode call of the running stream before it. With the slice off (0), the
chunks of one step run back to back.
"""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from server.engine.engine import Engine
from server.metrics import ServerMetrics
from tests.support.servers import make_settings, run_server

CHUNK = 16
CHUNKS = 6
NO_EOS = {"1": -100, "3": -100}  # the tiny model's end tokens


def _serve(tiny_model_path, slice_s: float):
    calls: list[str] = []

    def record(state) -> None:  # before each model call of a row, on the engine thread
        text = str(state.request.prompt)
        if text.startswith("LONG"):
            calls.append("long")
            time.sleep(0.15)  # a slow chunk
        elif text.startswith("STREAM"):
            calls.append("decode")

    settings = make_settings(model={"path": str(tiny_model_path)}, pool={"n_blocks": 2048},
                             batch={"prefill_chunk_size": CHUNK,
                                    "max_prefill_s_per_step": slice_s},
                             cache={"prefix_caching": False})
    return run_server(settings, Engine(settings, ServerMetrics(), fault_hook=record)), calls


def _drain(lines, done: threading.Event) -> None:
    """Read the stream until told to stop (its connection closing ends it too)."""
    try:
        for _ in lines:
            if done.is_set():
                return
    except httpx.HTTPError:
        pass


def _long_prompt_beside_a_stream(server) -> int:
    """Prefill a long prompt while a stream decodes; the prompt's prefill chunks."""
    base = server.base_url
    prompt = "LONG" + " seven" * (CHUNK * CHUNKS)
    n_tokens = len(httpx.post(base + "/tokenize", json={"prompt": prompt},
                              timeout=30).json()["tokens"])
    body = {"prompt": "STREAM", "max_tokens": 3000, "stream": True, "logit_bias": NO_EOS}
    done = threading.Event()
    with httpx.Client(base_url=base, timeout=60) as c, \
            c.stream("POST", "/v1/completions", json=body) as stream:
        lines = stream.iter_lines()
        next(line for line in lines if line.startswith("data: {"))  # decoding now
        reader = threading.Thread(target=_drain, args=(lines, done))
        reader.start()
        answer = c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1})
        done.set()
    reader.join(timeout=30)
    assert answer.status_code == 200, answer.text
    return -(-n_tokens // CHUNK)


@pytest.mark.parametrize("slice_s", [0.1, 0.0])
@pytest.mark.slow
def test_a_long_prefill_yields_to_decoding_requests(tiny_model_path, slice_s):
    serving, calls = _serve(tiny_model_path, slice_s)
    with serving as server:
        chunks = _long_prompt_beside_a_stream(server)
        server.wait_idle()
    assert chunks > CHUNKS
    # The long row's calls: its prefill chunks first, then its decode call(s).
    at = [i for i, call in enumerate(calls) if call == "long"][:chunks]
    during = calls[at[0]:at[-1] + 1]
    # Chunks after which a decode ran before the next chunk.
    yielded = sum(1 for a, b in zip(during, during[1:], strict=False)
                  if a == "long" and b == "decode")
    if slice_s:
        assert yielded == during.count("long") - 1, during  # after every chunk but the last
    else:
        assert yielded == 0, during  # one step, back to back


def test_sliced_chunks_fit_the_slice_at_the_measured_rate(tiny_model_path):
    """Chunks are cut only while rows wait on a time-sliced prefill, to what ran in the
    time left before (per row of the group), never under 64 columns nor over the
    configured chunk."""
    from server.engine.prefill import MIN_SLICED_CHUNK
    from server.engine.runner import ModelRunner
    from server.model_loader import load_model
    from server.protocol import SamplingParams
    from server.settings import ModelSection
    from veloxquant_mlx.memory import BlockPoolAllocator, PoolConfig
    from veloxquant_mlx.memory.kv_arena import KVArena, probe_kv_layout

    model = load_model(ModelSection(path=str(tiny_model_path))).model
    pool = BlockPoolAllocator(PoolConfig(block_size=16, n_blocks=512))
    runner = ModelRunner(model, pool, 512, KVArena(pool, probe_kv_layout(model)))
    for owner in (1, 2):
        runner.add(owner, list(range(5, 45)), SamplingParams(max_tokens=8, temperature=0.0))
    runner.prefill(1 << 20, seconds=0.5)  # one group of two rows, nobody decoding yet
    assert runner.prefill_rate is None  # a one-chunk prompt: its last chunk is not timed
    runner.decode()
    assert len(runner.rows) == 2  # now they decode
    runner.add(3, list(range(5, 605)), SamplingParams(max_tokens=8, temperature=0.0))
    runner.prefill(1, seconds=0.5)  # forms the group, runs one column
    group = runner.group
    assert group is not None and runner.prefill_rate is not None
    runner.prefill_rate = None  # nothing timed yet: a small chunk measures the rate
    assert runner._chunk_for(group, 0.5) == MIN_SLICED_CHUNK
    runner.prefill_rate = 400.0  # prompt tokens a second
    assert runner._chunk_for(group, 0.5) == 192  # 200 columns, in whole 16s
    assert runner._chunk_for(group, None) == 512
    runner.prefill_rate = 10.0
    assert runner._chunk_for(group, 0.5) == MIN_SLICED_CHUNK
    runner.prefill_rate = 1e9
    assert runner._chunk_for(group, 0.5) == 512
    runner.chunk = 16  # the configured chunk bounds a sliced one too, under the floor
    assert runner._chunk_for(group, 0.5) == 16
    runner.chunk = 512
    runner._measure(group, 100, 0.5)  # 200 tokens/s, averaged with what was measured
    assert runner.prefill_rate == (1e9 + 200) / 2
    assert group.rate is None  # only a scoring group keeps a rate of its own
    runner.remove([1, 2])  # nobody waits: the whole chunk again
    runner.prefill_rate = 10.0
    assert runner._chunk_for(group, 0.5) == 512
    runner.remove([3])
    assert pool.stats.blocks_in_use() == 0
