"""``ignore_eos``: the model's end tokens are never sampled, so the answer runs to max_tokens.

In the runner, a row's banned tokens get -inf logits on every sampling path
(the prefill's first token, the batch-wide argmax and compiled sampler, rows
sampled alone), and only on that row. Over HTTP the tiny model's end tokens
(ids 1 and 3) are forced with a +100 logit bias: without ``ignore_eos`` the
answer ends at once, with it the answer runs its whole length.
"""

from __future__ import annotations

import httpx
import pytest

from server.engine.runner import ModelRunner
from server.protocol import SamplingParams
from tests.support.servers import LiveServer
from veloxquant_mlx.memory import BlockPoolAllocator, PoolConfig
from veloxquant_mlx.memory.kv_arena import KVArena, probe_kv_layout

ALLOWED = {5, 6, 7}
FORCE_EOS = {"1": 100, "3": 100}
NO_EOS = {"1": -100, "3": -100}


def _generate(model, tokenizer, requests: dict[int, SamplingParams]) -> dict[int, list[int]]:
    """Run ``requests`` (owner -> params) together for their max_tokens each."""
    pool = BlockPoolAllocator(PoolConfig(block_size=16, n_blocks=4096))
    runner = ModelRunner(model, pool, 64, KVArena(pool, probe_kv_layout(model)))
    out: dict[int, list[int]] = {owner: [] for owner in requests}
    for owner, params in requests.items():
        pool.register_owner(owner)
        runner.add(owner, tokenizer.encode(f"data {owner}:"), params)
    live = set(requests)
    for _ in range(200):
        if not live:
            break
        for result in (runner.prefill(4096), runner.decode()):
            assert not result.failed
            done = []
            for s in result.tokens:
                if s.owner in live:
                    out[s.owner].append(s.token)
                    if len(out[s.owner]) >= requests[s.owner].max_tokens:
                        done.append(s.owner)
            runner.remove(done)
            live -= set(done)
    assert not live and pool.stats.blocks_in_use() == 0
    return out


def test_banned_tokens_are_never_sampled_on_any_path_and_only_on_their_row(tiny_model):
    model, tokenizer = tiny_model
    vocab = model.args.vocab_size
    banned = tuple(t for t in range(vocab) if t not in ALLOWED)
    rows = {
        1: SamplingParams(max_tokens=12, banned_tokens=banned),  # greedy argmax
        2: SamplingParams(max_tokens=12, temperature=1.5, banned_tokens=banned),  # shared
        3: SamplingParams(max_tokens=12, temperature=1.5, seed=7, banned_tokens=banned),  # alone
        4: SamplingParams(max_tokens=12, temperature=1.0, logit_bias=((1, 50.0),),
                          banned_tokens=banned),  # a processor row, its bias outvoted
        5: SamplingParams(max_tokens=12),  # free row beside them
    }
    got = _generate(model, tokenizer, rows)
    for owner in (1, 2, 3, 4):
        assert set(got[owner]) <= ALLOWED, (owner, got[owner])
    alone = _generate(model, tokenizer, {5: SamplingParams(max_tokens=12)})
    assert got[5] == alone[5]
    assert not set(got[5]) <= ALLOWED  # the ban did not reach it


def _complete(base: str, **body) -> dict:
    r = httpx.post(f"{base}/v1/completions", timeout=60,
                   json={"prompt": "The pool holds", "max_tokens": 24, "temperature": 0, **body})
    assert r.status_code == 200, r.text
    return r.json()


def test_ignore_eos_runs_to_max_tokens(live_server: LiveServer):
    base = live_server.base_url
    ended = _complete(base, logit_bias=FORCE_EOS)
    assert ended["choices"][0]["finish_reason"] == "stop"
    assert ended["usage"]["completion_tokens"] == 1
    for body in ({"logit_bias": FORCE_EOS}, {"temperature": 1.0, "n": 3}, {"stream": False}):
        full = _complete(base, ignore_eos=True, **body)
        assert {c["finish_reason"] for c in full["choices"]} == {"length"}
        assert full["usage"]["completion_tokens"] == 24 * len(full["choices"])
    # Greedy: the same text as pushing the end tokens far down with a bias.
    assert (_complete(base, ignore_eos=True)["choices"][0]["text"]
            == _complete(base, logit_bias=NO_EOS)["choices"][0]["text"])
    chat = httpx.post(f"{base}/v1/chat/completions", timeout=60, json={
        "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 16,
        "logit_bias": FORCE_EOS, "ignore_eos": True}).json()
    assert chat["choices"][0]["finish_reason"] == "length"
    assert chat["usage"]["completion_tokens"] == 16
    assert live_server.wait_idle()["veloxquant_block_pool_request_blocks_in_use"] == 0


@pytest.mark.parametrize("extra", [
    {"response_format": {"type": "json_object"}},
    {"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
     "tool_choice": "required"},
])
def test_ignore_eos_with_a_grammar_is_refused(live_server: LiveServer, extra):
    r = httpx.post(f"{live_server.base_url}/v1/chat/completions", timeout=60, json={
        "messages": [{"role": "user", "content": "hi"}], "ignore_eos": True, **extra})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "ignore_eos" and error["code"] == "invalid_value"
