"""When the runner reads a row's first and last tokens, and the model calls that saves.

A decode reads the tokens of the call before it while its own call runs. With no
row decoding there is nothing to hide the read behind, so a prefill that ends
hands its rows' first tokens back itself; and a step whose every row reads its
``max_tokens``-th token makes no model call (its next token would be dropped).
"""

from __future__ import annotations

import pytest

from server.engine.run_output import RunOutput
from server.harness import RunnerHarness
from server.protocol import Finished, SamplingParams, TokenEvent
from tests.engine.test_event_timing import SteppedEngine
from tests.engine.test_harness import _prompts, _stock_greedy


def _tokens(out: RunOutput) -> dict[int, int]:
    assert not out.failed
    return {s.owner: s.token for s in out.tokens}


def test_a_prefill_with_nothing_decoding_hands_back_the_first_tokens(tiny_model):
    model, _ = tiny_model
    prompts = _prompts(2, 20)
    with RunnerHarness.for_model(model, n_blocks=256) as harness:
        harness.start(prompts, SamplingParams(max_tokens=8, temperature=0.0))
        first = _tokens(harness.prefill())
        assert first == {o: _stock_greedy(model, p, 1)[0] for o, p in prompts.items()}
        # The first decode feeds those tokens; it reads them, but they were handed back.
        assert harness.decode().tokens == []
        second = _tokens(harness.decode())
        assert second == {o: _stock_greedy(model, p, 2)[1] for o, p in prompts.items()}


def test_a_row_that_joins_a_decoding_batch_gets_its_first_token_from_the_decode(tiny_model):
    model, _ = tiny_model
    prompts = _prompts(2, 20)
    params = SamplingParams(max_tokens=8, temperature=0.0)
    with RunnerHarness.for_model(model, n_blocks=256) as harness:
        harness.start({1: prompts[1]}, params)
        assert _tokens(harness.prefill()).keys() == {1}
        harness.decode()
        harness.start({2: prompts[2]}, params)
        assert harness.prefill().tokens == []  # row 1 decodes: its read waits for a call
        out = harness.decode()
        assert out.calls_ran == 1
        assert _tokens(out)[2] == _stock_greedy(model, prompts[2], 1)[0]


def test_a_runner_that_reads_first_tokens_at_once_hands_them_back_from_the_prefill(
        tiny_model):
    """As the server runs on a CPU: a row that joins a decoding batch gets its first
    token from its prefill, one decode earlier, and every later token is unchanged."""
    model, _ = tiny_model
    prompts = _prompts(2, 20)
    params = SamplingParams(max_tokens=8, temperature=0.0)
    with RunnerHarness.for_model(model, n_blocks=256, first_tokens_at_once=True) as harness:
        harness.start({1: prompts[1]}, params)
        got = {1: list(_tokens(harness.prefill()).values())}
        got[1] += _tokens(harness.decode()).values()
        harness.start({2: prompts[2]}, params)
        got[2] = list(_tokens(harness.prefill()).values())  # row 1 decodes meanwhile
        assert len(got[2]) == 1
        for _ in range(4):
            out = harness.decode()
            assert out.calls_ran == 1
            for owner, token in _tokens(out).items():
                got[owner].append(token)
        # the first decode after the prefill feeds row 2's first token and reads
        # nothing new for it (not twice); each later one reads the call before it
        assert got[2] == _stock_greedy(model, prompts[2], 4)
        assert got[1] == _stock_greedy(model, prompts[1], 5)
        harness.finish(prompts)
        assert harness.pool.stats.blocks_in_use() == 0


def test_on_the_cpu_a_joining_requests_first_token_is_sent_before_the_next_decode_call(
        tiny_model_path):
    """In the engine: the client has its first token before the decode call of the
    step that prefilled it runs (on a GPU that read waits for that decode)."""
    from server.engine.startup import on_gpu

    stepped = SteppedEngine(tiny_model_path, events_at_submit=False)
    runner = stepped.engine.runner
    seen_at_decode: list[int] = []
    decode = runner.decode

    def watched_decode(*args, **kwargs):
        stepped.step_events()
        seen_at_decode.append(sum(isinstance(e, TokenEvent) for e in stepped.received["b"]))
        return decode(*args, **kwargs)

    try:
        stepped.submit("a", 8)
        stepped.step()
        stepped.step()  # "a" decodes
        stepped.submit("b", 8)
        runner.decode = watched_decode
        stepped.step()
        assert seen_at_decode == [0 if on_gpu() else 1]
        assert sum(isinstance(e, TokenEvent) for e in stepped.received["b"]) >= 1
    finally:
        runner.decode = decode
        stepped.close()


def test_n_tokens_cost_a_prefill_and_n_minus_1_model_calls(tiny_model):
    model, _ = tiny_model
    prompts = _prompts(2, 20)
    n = 5
    with RunnerHarness.for_model(model, n_blocks=256) as harness:
        harness.start(prompts, SamplingParams(max_tokens=n, temperature=0.0))
        got = {o: [t] for o, t in _tokens(harness.prefill()).items()}
        calls, steps = 0, 0
        while any(len(tokens) < n for tokens in got.values()) and steps < 2 * n:
            out = harness.decode()
            calls, steps = calls + out.calls_ran, steps + 1
            for owner, token in _tokens(out).items():
                got[owner].append(token)
        assert got == {o: _stock_greedy(model, p, n) for o, p in prompts.items()}
        assert calls == n - 1  # tokens 2..n; the step reading token n called nothing
        assert steps == n
        assert out.rows == 0  # that read was no batched decode step
        harness.finish(prompts)
        assert harness.pool.stats.blocks_in_use() == 0


@pytest.mark.parametrize("max_tokens", [1, 2, 6])
def test_a_lone_request_of_n_tokens_takes_n_steps_and_n_minus_1_decode_calls(
        tiny_model_path, max_tokens):
    """In the engine: the first step prefills and hands the first token over; a
    one-token request ends there, before any decode call."""
    stepped = SteppedEngine(tiny_model_path, events_at_submit=False)
    try:
        stepped.submit("a", max_tokens)
        steps = 0
        while not any(isinstance(e, Finished) for e in stepped.received["a"]) and steps < 20:
            stepped.step()
            steps += 1
            if steps == 1:  # the first token went out with the prefill's step
                assert any(isinstance(e, TokenEvent) for e in stepped.received["a"])
        assert steps == max_tokens
        assert stepped.engine.clock.steps == max_tokens - 1
        assert stepped.received["a"][-1].usage.completion_tokens == max_tokens
    finally:
        stepped.close()


def test_a_row_past_its_last_token_still_decodes_what_it_was_handed(tiny_model):
    """Skipping the call is safe even when a row goes on (its token is fed next step)."""
    model, _ = tiny_model
    prompts = _prompts(1, 20)
    with RunnerHarness.for_model(model, n_blocks=256) as harness:
        harness.start(prompts, SamplingParams(max_tokens=2, temperature=0.0))
        got = [_tokens(harness.prefill())[1]]
        for _ in range(6):  # nobody ends the row: it keeps generating, tokens unchanged
            got += _tokens(harness.decode()).values()
        assert got[:4] == _stock_greedy(model, prompts[1], 4)
