"""The prefix cache shared across clients, and the ways to fence it.

A shared prefix cache answers a probe: another client who knows a prompt's
wording learns whether it was sent, from ``cached_tokens`` (or timing). A
vault code guessed digit string by digit string came out in 472 probes. A
request's ``cache_salt`` (vLLM's field) starts its blocks' hash chain from a
root of its own, so only requests with the same salt match them; with
``cache.isolation = "api_key"`` every bearer token is a namespace of its own.
"""

from __future__ import annotations

import httpx

from tests.support.servers import make_settings, run_server

SECRET = ("Note for the night shift, keep it to yourself: the vault code is 4 7 1, and "
          "the alarm panel is behind the second door on the left of the loading bay.")


def _cached(base: str, prompt: str, headers: dict | None = None, **extra) -> int:
    answer = httpx.post(base + "/v1/completions", headers=headers or {}, timeout=60,
                        json={"prompt": prompt, "max_tokens": 1, **extra})
    assert answer.status_code == 200, answer.text
    return answer.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_a_salted_prompt_is_invisible_to_clients_without_its_salt(live_server):
    base = live_server.base_url
    _cached(base, SECRET, cache_salt="client-a")  # client A's prompt, in its namespace
    assert _cached(base, SECRET, cache_salt="client-b") == 0  # B's probe finds nothing
    assert _cached(base, SECRET + " ") == 0  # nor does a probe with no salt
    assert _cached(base, SECRET, cache_salt="client-a") >= 16  # A itself still reuses it


def test_a_salt_is_a_namespace_on_chat_and_responses_too(live_server):
    base = live_server.base_url
    messages = [{"role": "user", "content": SECRET + " (chat)"}]
    chat = {"messages": messages, "max_tokens": 1}

    def cached(path: str, body: dict) -> int:
        answer = httpx.post(base + path, json=body, timeout=60)
        assert answer.status_code == 200, answer.text
        usage = answer.json()["usage"]
        details = usage.get("prompt_tokens_details") or usage.get("input_tokens_details")
        return details["cached_tokens"]

    cached("/v1/chat/completions", {**chat, "cache_salt": "a"})
    assert cached("/v1/chat/completions", {**chat, "cache_salt": "b"}) == 0
    assert cached("/v1/chat/completions", {**chat, "cache_salt": "a"}) >= 16
    responses = {"input": SECRET + " (responses)", "max_output_tokens": 16}
    # Salts of their own: the chat turn above left its rendered prefix under "a" and "b".
    cached("/v1/responses", {**responses, "cache_salt": "c"})
    assert cached("/v1/responses", {**responses, "cache_salt": "d"}) == 0
    assert cached("/v1/responses", {**responses, "cache_salt": "c"}) >= 16


def test_an_empty_salt_is_refused(live_server):
    answer = httpx.post(live_server.base_url + "/v1/completions", timeout=30,
                        json={"prompt": "hi", "max_tokens": 1, "cache_salt": ""})
    assert answer.status_code == 400
    assert answer.json()["error"]["param"] == "cache_salt"


def test_api_key_isolation_gives_every_key_its_own_namespace(tiny_model_path):
    settings = make_settings(model={"path": str(tiny_model_path)}, pool={"n_blocks": 2048},
                             cache={"isolation": "api_key"})
    alice = {"Authorization": "Bearer alice-key"}
    mallory = {"Authorization": "Bearer mallory-key"}
    with run_server(settings) as server:
        base = server.base_url
        _cached(base, SECRET, alice)
        assert _cached(base, SECRET, mallory) == 0
        assert _cached(base, SECRET) == 0  # no key is a namespace of its own too
        assert _cached(base, SECRET, alice) >= 16
        # Within a key, a salt still narrows the namespace.
        assert _cached(base, SECRET, alice, cache_salt="x") == 0
