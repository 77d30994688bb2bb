"""``echo`` (prompt text and prompt log-probabilities), batch prompts and ``n`` choices,
on a live server with the tiny model.

Scoring is checked against the model itself: the log-probabilities the server gives an
echoed prompt are the ones a plain forward pass gives, across chunk boundaries, and the
ones generation reported for the same tokens.
"""

from __future__ import annotations

import json
import math

import httpx
import openai
import pytest

from tests.support.openai_shapes import (
    CHAT,
    COMPLETIONS,
    MESSAGES,
    PROMPT,
    chat,
    chat_stream,
    completion,
    completion_stream,
    error_of,
    sse_chunks,
)
from tests.support.servers import LiveServer

NO_EOS = {"1": -100, "3": -100}  # the tiny model's end tokens never come


@pytest.fixture(scope="module")
def client(live_server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=live_server.base_url + "/v1", api_key="unused", max_retries=0)


def post(live_server: LiveServer, path: str, body: dict, timeout: float = 60) -> httpx.Response:
    return httpx.post(live_server.base_url + path, json=body, timeout=timeout)


# -- 7. echo ----------------------------------------------------------------------------------

def test_echo_scores_the_prompt_with_max_tokens_zero(client):
    """What lm-evaluation-harness sends to score a continuation."""
    out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=0, echo=True,
                                    logprobs=2)
    choice = out.choices[0]
    assert choice.text == PROMPT and choice.finish_reason == "length"
    lp = choice.logprobs
    assert "".join(lp.tokens) == PROMPT and len(lp.tokens) == out.usage.prompt_tokens
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v <= 0 for v in lp.token_logprobs[1:])
    assert all(len(top) == 2 for top in lp.top_logprobs[1:])
    assert lp.text_offset[0] == 0 and lp.text_offset[-1] == len(PROMPT) - len(lp.tokens[-1])
    assert out.usage.completion_tokens == 0
    bare = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=0, echo=True)
    assert bare.choices[0].text == PROMPT and bare.choices[0].logprobs is None


def test_echo_prepends_the_prompt_to_the_generation(client, live_server):
    plain = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=5, temperature=0,
                                      logprobs=1)
    body = {"prompt": PROMPT, "max_tokens": 5, "temperature": 0, "logprobs": 1, "echo": True}
    resp = post(live_server, COMPLETIONS, body)
    echoed = completion(resp).choices[0]
    assert echoed.text == PROMPT + plain.choices[0].text
    raw = resp.json()["choices"][0]["logprobs"]  # with the unscored first token
    assert "".join(raw["tokens"]) == echoed.text
    n_prompt = len(raw["tokens"]) - 5
    assert raw["token_logprobs"][n_prompt:] == plain.choices[0].logprobs.token_logprobs
    assert raw["text_offset"][n_prompt] == len(PROMPT)


def test_echo_of_token_ids_and_scores_match_generation(client, live_server):
    """Score prompt + greedy continuation: the continuation's scores are generation's."""
    ids = [5, 17, 300, 41, 9]
    gen = client.completions.create(model="tiny", prompt=ids, max_tokens=6, temperature=0,
                                    logprobs=3, logit_bias=NO_EOS)
    lp = gen.choices[0].logprobs
    # Each generated token's id: its top alternative (greedy picks the likeliest).
    out_ids = [live_server.engine.loaded.tokenizer.encode(t, add_special_tokens=False)
               for t in lp.tokens]
    assert all(len(t) == 1 for t in out_ids)
    scored = client.completions.create(model="tiny", prompt=ids + [t[0] for t in out_ids],
                                       max_tokens=0, echo=True, logprobs=3)
    slp = scored.choices[0].logprobs
    assert scored.choices[0].text == live_server.engine.loaded.tokenizer.decode(ids) + \
        gen.choices[0].text
    for mine, theirs in zip(slp.token_logprobs[len(ids):], lp.token_logprobs, strict=True):
        assert math.isclose(mine, theirs, abs_tol=2e-3), (mine, theirs)
    assert list(slp.top_logprobs[len(ids)]) == list(lp.top_logprobs[0])


@pytest.mark.slow
def test_long_prompt_scores_across_chunks_as_one_forward_pass(client, live_server):
    """600 tokens: two chunks of batch.prefill_chunk_size=512; the seam must not show."""
    import mlx.core as mx

    ids = [(7 * i) % 4000 + 10 for i in range(600)]
    out = client.completions.create(model="tiny", prompt=ids, max_tokens=0, echo=True,
                                    logprobs=0)
    got = out.choices[0].logprobs.token_logprobs[1:]
    model = live_server.engine.loaded.model

    def reference() -> list[float]:
        logits = model(mx.array(ids)[None])[0, :-1].astype(mx.float32)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        return mx.take_along_axis(logprobs, mx.array(ids[1:])[:, None], axis=-1)[:, 0].tolist()

    want = live_server.engine.run_on_engine(reference).result(timeout=60)
    assert len(got) == 599
    assert max(abs(a - b) for a, b in zip(got, want, strict=True)) < 2e-3


def test_echo_streams_the_prompt_first(live_server):
    body = {"prompt": PROMPT, "max_tokens": 3, "echo": True, "logprobs": 1, "stream": True,
            "stream_options": {"include_usage": True}, "logit_bias": NO_EOS}
    chunks = completion_stream(post(live_server, COMPLETIONS, body))
    assert chunks[0].choices[0].text == PROMPT
    assert "".join(c.choices[0].text for c in chunks if c.choices).startswith(PROMPT)
    raw = [c["choices"][0] for c in sse_chunks(post(live_server, COMPLETIONS, body))
           if c["choices"]]
    assert raw[0]["logprobs"]["token_logprobs"][0] is None  # as sent, before validation
    tokens = [t for c in raw if c["logprobs"] for t in c["logprobs"]["tokens"]]
    assert "".join(tokens) == "".join(c["text"] for c in raw)
    zero = completion_stream(post(live_server, COMPLETIONS, {**body, "max_tokens": 0}))
    assert [c.choices[0].text for c in zero[:-1]] == [PROMPT, ""]
    assert zero[1].choices[0].finish_reason == "length"
    n_prompt = raw[0]["logprobs"]["text_offset"].__len__()
    assert zero[-1].usage.completion_tokens == 0 and zero[-1].usage.prompt_tokens == n_prompt


def test_echo_refusals(live_server):
    err = error_of(post(live_server, COMPLETIONS, {"prompt": [10**6], "echo": True,
                                                   "max_tokens": 0}))
    assert err["param"] == "prompt"
    err = error_of(post(live_server, COMPLETIONS, {"prompt": "x", "max_tokens": 0}))
    assert err["param"] == "max_tokens" and "echo" in err["message"]


def test_scoring_requests_write_their_request_log_line(live_server, caplog):
    """An echo with max_tokens 0 is a scoring request of the engine's: it writes its own
    line, with the owner its KV was held under."""
    caplog.set_level("INFO", logger="veloxquant.requests")
    ok = post(live_server, COMPLETIONS, {"prompt": PROMPT, "echo": True, "max_tokens": 0,
                                         "logprobs": 1})
    refused = post(live_server, COMPLETIONS, {"prompt": [10**6], "echo": True, "max_tokens": 0})
    assert (ok.status_code, refused.status_code) == (200, 400)
    lines = [json.loads(r.getMessage()) for r in caplog.records
             if r.name == "veloxquant.requests"]
    assert [(line["request_id"], line["status"], line["finish_reason"]) for line in lines] == [
        (ok.json()["id"], 200, "length"), (lines[1]["request_id"], 400, "rejected")]
    assert lines[0]["prompt_tokens"] == ok.json()["usage"]["prompt_tokens"]
    assert lines[1]["code"] == "invalid_prompt" and lines[0]["owner"] >= 1
    assert lines[0]["blocks_peak"] > 0


# -- 8. batch prompts and n --------------------------------------------------------------------

def test_batch_prompts_give_one_choice_per_prompt_in_order(client):
    prompts = ["The river", "A small dog", "In the year"]
    singles = [client.completions.create(model="tiny", prompt=p, max_tokens=4, temperature=0)
               for p in prompts]
    out = client.completions.create(model="tiny", prompt=prompts, max_tokens=4, temperature=0)
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert [c.text for c in out.choices] == [s.choices[0].text for s in singles]
    assert out.usage.prompt_tokens == sum(s.usage.prompt_tokens for s in singles)
    assert out.usage.completion_tokens == sum(s.usage.completion_tokens for s in singles)
    ids = client.completions.create(model="tiny", prompt=[[5, 6, 7], [8, 9]], max_tokens=2)
    assert [c.index for c in ids.choices] == [0, 1] and ids.usage.prompt_tokens == 5
    # A prompt of the batch the model cannot take is named by its place.
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model="tiny", prompt=["ok", "word " * 5000], max_tokens=2)
    assert refused.value.body["param"] == "prompt[1]"
    assert refused.value.body["message"].startswith("prompt[1]: ")


@pytest.mark.parametrize("prompt", [[], ["a", [5]], [[5], "a"], ["a", ""], [[]]])
def test_mixed_or_empty_batches_are_400(live_server, prompt):
    err = error_of(post(live_server, COMPLETIONS, {"prompt": prompt}))
    assert err["param"].startswith("prompt")


def test_n_choices_with_a_seed_differ_and_repeat(client):
    def run():
        return client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, n=3,
                                         temperature=1.0, seed=42, logit_bias=NO_EOS)
    first, again = run(), run()
    texts = [c.text for c in first.choices]
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert texts == [c.text for c in again.choices] and len(set(texts)) > 1
    single = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8,
                                       temperature=1.0, seed=43, logit_bias=NO_EOS)
    assert single.choices[0].text == texts[1]  # choice i draws with seed + i
    assert first.usage.prompt_tokens == single.usage.prompt_tokens  # counted once
    assert first.usage.completion_tokens == 24


def test_n_choices_share_one_prefill_through_the_prefix_cache(client, live_server):
    # 70 ids seen nowhere else: the first choice computes them, the other three start on
    # its 4 full blocks ((70 - 1) // 16; the last prompt token is always computed).
    prompt = [(97 * k + 31) % 251 + 5 for k in range(70)]
    hits = "veloxquant_prefix_cache_hit_tokens_total"
    before = live_server.metrics().get(hits, 0.0)
    out = client.completions.create(model="tiny", prompt=prompt, n=4, max_tokens=6,
                                    temperature=0, logit_bias=NO_EOS)
    assert live_server.metrics()[hits] - before == 3 * 64
    assert out.usage.prompt_tokens == 70 and out.usage.prompt_tokens_details.cached_tokens == 64
    alone = client.completions.create(model="tiny", prompt=prompt, max_tokens=6,
                                      temperature=0, logit_bias=NO_EOS)
    assert [c.text for c in out.choices] == [alone.choices[0].text] * 4  # same greedy tokens


def test_chat_n_choices(client, live_server):
    out = client.chat.completions.create(model="tiny", messages=MESSAGES, n=2, max_tokens=4,
                                         temperature=1.0, seed=7, logprobs=True)
    assert [c.index for c in out.choices] == [0, 1]
    for c in out.choices:
        assert "".join(e.token for e in c.logprobs.content) == c.message.content
    single = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=4,
                                            temperature=1.0, seed=7)
    assert out.usage.prompt_tokens == single.usage.prompt_tokens
    assert out.choices[0].message.content == single.choices[0].message.content
    body = {"messages": MESSAGES, "n": 2, "max_tokens": 3, "best_of": None}
    assert len(chat(post(live_server, CHAT, body)).choices) == 2


def test_best_of_must_equal_n(client):
    out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=2, n=2, best_of=2)
    assert len(out.choices) == 2
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="tiny", prompt=PROMPT, max_tokens=2, n=2, best_of=3)
    assert info.value.body["param"] == "best_of"


def test_choices_beyond_the_limit_are_400(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="tiny", prompt=["a"] * 6, n=3, max_tokens=2)
    assert info.value.body["param"] == "n" and "limits.max_choices" in info.value.body["message"]
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="tiny", messages=MESSAGES, n=17)


def test_streams_interleave_choices_and_end_once(live_server):
    body = {"prompt": ["The river", "A small dog"], "n": 2, "max_tokens": 5, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}, "logit_bias": NO_EOS}
    chunks = completion_stream(post(live_server, COMPLETIONS, body))
    whole = completion(post(live_server, COMPLETIONS, {**body, "stream": False,
                                                       "stream_options": None}))
    for j in range(4):
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == j]
        assert "".join(c.text for c in mine) == whole.choices[j].text
        assert [c.finish_reason for c in mine].count("length") == 1
    assert chunks[-1].usage.total_tokens == whole.usage.total_tokens
    chat_body = {"messages": MESSAGES, "n": 3, "max_tokens": 3, "stream": True}
    chat_chunks = chat_stream(post(live_server, CHAT, chat_body))
    roles = [c.choices[0].index for c in chat_chunks if c.choices[0].delta.role]
    assert sorted(roles) == [0, 1, 2]
    assert sorted(c.choices[0].index for c in chat_chunks if c.choices[0].finish_reason) == \
        [0, 1, 2]


def test_leaving_a_fanned_out_request_cancels_every_choice(live_server):
    def cancelled() -> float:  # running or still waiting when the client left
        m = live_server.metrics()
        return (m.get("veloxquant_request_finished_total{reason=cancelled}", 0.0)
                + m.get("veloxquant_request_rejected_total{reason=cancelled_waiting}", 0.0))

    before = cancelled()
    # 1000 tokens: the six choices fit the session pool together (each choice is admitted
    # on its own; the answer starts once all are).
    long = {"prompt": ["The river", "A dog"], "n": 3, "max_tokens": 1000,
            "logit_bias": NO_EOS, "temperature": 1.0}
    with httpx.Client(base_url=live_server.base_url, timeout=60) as c:
        with c.stream("POST", COMPLETIONS, json={**long, "stream": True}) as resp:
            seen = 0
            for line in resp.iter_lines():
                seen += line.startswith("data: ")
                if seen > 12:
                    break  # the client leaves mid-stream
    with pytest.raises(httpx.TimeoutException):  # non-streaming: the client gives up waiting
        post(live_server, CHAT, {"messages": MESSAGES, "n": 4, "max_tokens": 1000,
                                 "logit_bias": NO_EOS}, timeout=0.5)
    m = live_server.wait_idle(timeout=20)
    assert m["veloxquant_block_pool_request_blocks_in_use"] == 0
    assert m["veloxquant_orphaned_blocks"] == 0
    assert m["veloxquant_requests_running"] == 0
    assert cancelled() - before == 6 + 4  # every fanned-out request, none ran to its end
