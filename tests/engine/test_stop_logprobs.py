"""Log-probabilities stay in step with the text when stop strings hold it back or cut it.

A token's record goes out with the text that completes it; a token whose text lies
wholly in the matched stop string (or after it) is never reported, so the reported
tokens are exactly those of the same generation without the stop string that start
inside the returned text. Checked on the tiny model (seeded, so both runs draw the
same tokens), completions and chat, JSON and streamed, and on the matcher alone.
"""

from __future__ import annotations

import json

import httpx
import pytest

from server.engine.request_state import StopMatcher
from server.protocol import TokenLogprob
from tests.support.servers import LiveServer


def _record(token: str) -> TokenLogprob:
    return TokenLogprob(token, -1.0, 0, ())


def test_records_wait_for_their_text_and_the_stop_drops_its_own():
    stop = StopMatcher(("END",))
    the_e, n, d = _record("the E"), _record("N"), _record("D!")
    assert stop.feed_token("the E", the_e) == ("the ", False, ())  # "E" may start "END"
    assert stop.feed_token("N", n) == ("", False, ())
    # "the E" started before the cut, so it is reported; "N" and "D!" are the stop's.
    assert stop.feed_token("D!", d) == ("", True, (the_e,))
    free = StopMatcher(("END",))
    assert free.feed_token("the E", the_e) == ("the ", False, ())
    assert free.feed_token("lse", n) == ("Else", False, (the_e, n))  # released together
    held = StopMatcher(("END",))
    held.feed_token("EN", the_e)
    assert held.held_records() == (the_e,) and held.held_records() == ()
    assert StopMatcher(()).feed_token("x", n) == ("x", False, (n,))


def _tokens(body: dict, chat: bool) -> list[str]:
    lp = body["choices"][0]["logprobs"]
    return [e["token"] for e in lp["content"]] if chat else lp["tokens"]


def _text(body: dict, chat: bool) -> str:
    choice = body["choices"][0]
    return choice["message"]["content"] if chat else choice["text"]


def _streamed(server: LiveServer, path: str, body: dict, chat: bool) -> tuple[str, list[str]]:
    resp = httpx.post(server.base_url + path, json={**body, "stream": True}, timeout=60)
    text, tokens = "", []
    for line in resp.text.splitlines():
        if not line.startswith("data: {"):
            continue
        choice = json.loads(line[6:])["choices"][0]
        text += (choice["delta"].get("content") or "") if chat else choice["text"]
        lp = choice.get("logprobs")
        if lp:
            tokens += [e["token"] for e in lp["content"]] if chat else lp["tokens"]
    return text, tokens


@pytest.mark.parametrize("chat", [False, True])
def test_a_stop_string_cuts_the_logprobs_with_the_text(live_server: LiveServer, chat):
    path = "/v1/chat/completions" if chat else "/v1/completions"
    base = {"max_tokens": 24, "temperature": 1.0, "seed": 7, "logprobs": True}
    base |= {"messages": [{"role": "user", "content": "Go on"}], "top_logprobs": 1} if chat \
        else {"prompt": "Once upon a time", "logprobs": 1}
    free = httpx.post(live_server.base_url + path, json=base, timeout=60).json()
    tokens, text = _tokens(free, chat), _text(free, chat)
    assert "".join(tokens) == text
    # A stop string spanning the boundary between tokens 5 and 6 (cut inside token 5).
    start = len("".join(tokens[:5]))
    cut = start + len(tokens[5]) - 1 if len(tokens[5]) > 1 else start
    stop = text[cut: len("".join(tokens[:7]))]
    assert stop and text.find(stop) == cut
    body = {**base, "stop": [stop]}
    stopped = httpx.post(live_server.base_url + path, json=body, timeout=60).json()
    want = [t for k, t in enumerate(tokens) if len("".join(tokens[:k])) < cut]
    assert _text(stopped, chat) == text[:cut]
    assert _tokens(stopped, chat) == want
    # usage counts the stop string's tokens too (generated, then cut): 7 here (README).
    assert stopped["usage"]["completion_tokens"] == 7 > len(want)
    assert _streamed(live_server, path, body, chat) == (text[:cut], want)


PICK = {"type": "function", "function": {
    "name": "pick", "parameters": {"type": "object",
                                   "properties": {"op": {"enum": ["add", "sub"]}},
                                   "required": ["op"], "additionalProperties": False}}}


def test_a_streamed_tool_call_keeps_its_logprobs(live_server: LiveServer):
    """Text held back as a possible call sends its entries when it is released or at the end."""
    body = {"messages": [{"role": "user", "content": "Pick"}], "tools": [PICK],
            "tool_choice": "required", "logprobs": True, "max_tokens": 40, "seed": 3}
    path = "/v1/chat/completions"
    whole = httpx.post(live_server.base_url + path, json=body, timeout=60).json()
    assert whole["choices"][0]["message"]["tool_calls"]
    tokens = _tokens(whole, chat=True)
    assert tokens and _streamed(live_server, path, body, chat=True)[1] == tokens
