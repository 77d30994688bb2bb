"""Conversations that cannot fit ``limits.max_prompt_tokens`` are refused before their
chat template runs, so a burst of them does not stall the streams being served.

Rendering and tokenizing 30,000 messages takes seconds of CPU, most of it
holding the GIL; a burst of such bodies (each under the 1 MiB body limit)
starved the engine thread and the event loop, and a running stream went
seconds without a token. Every message takes at least one token of the
template's framing, and one token covers at most a known number of
characters, so a conversation over either bound is refused from its message
count and character count alone. Real uvicorn servers with the tiny model;
httpx for raw bodies and the stream, the ``openai`` client for a served chat.
"""

from __future__ import annotations

import json
import threading
import time

import httpx
import openai
import pytest

from server.engine.engine import Engine
from server.http.routes.truncation import drop_units, without_oldest
from server.http.schemas.chat import ChatMessage
from server.metrics import ServerMetrics
from server.settings import LimitsSection
from server.text.bounds import frames_every_message, max_bytes_per_token
from tests.support.servers import LiveServer, make_settings, run_server

N_MESSAGES = 30_000  # one-letter messages a body: about 900 KB
BURST = 8  # such bodies at once
MAX_GAP_S = 1.0  # the longest a running stream may go without a token meanwhile
STEP_S = 0.02  # each decode step of the stream, paced so it outlasts the burst
NO_EOS = {"1": -100, "3": -100}  # the tiny model's end tokens never win
LIMITS = LimitsSection()  # the defaults the server runs with here


def _pace(state) -> None:  # before each model call of a row, on the engine thread
    if str(state.request.prompt).startswith("STREAM"):
        time.sleep(STEP_S)


@pytest.fixture(scope="module")
def server(tiny_model_path):
    settings = make_settings(model={"path": str(tiny_model_path)}, pool={"n_blocks": 2048})
    with run_server(settings, Engine(settings, ServerMetrics(), fault_hook=_pace)) as live:
        assert live.engine.wait_ready(120), live.engine.load_error
        yield live


@pytest.fixture(scope="module")
def chars_per_token(tiny_model) -> int:
    """The most characters one of the tiny model's tokens covers."""
    per_token = max_bytes_per_token(tiny_model[1])
    assert per_token is not None  # a byte-level BPE: the bound exists
    return per_token


def _one_letter_messages(n: int) -> list[dict[str, str]]:
    return [{"role": "user", "content": "a"}] * n


def _raw(body: dict) -> bytes:
    raw = json.dumps(body, separators=(",", ":")).encode()
    assert len(raw) < LIMITS.max_body_bytes  # admitted by size: the body limit is no help
    return raw


# (path, body of one long conversation, the param a refusal names)
LONG = {
    "chat": ("/v1/chat/completions",
             {"messages": _one_letter_messages(N_MESSAGES), "max_tokens": 1}, "messages"),
    "responses": ("/v1/responses", {"input": _one_letter_messages(N_MESSAGES)}, "input"),
    "tokenize": ("/tokenize", {"messages": _one_letter_messages(N_MESSAGES)}, "messages"),
}


class TokenClock:
    """Reads a running stream on a thread and notes when each token arrives."""

    def __init__(self, base: str) -> None:
        self.times: list[float] = []
        self.status: int | None = None
        self._stop = threading.Event()
        self._started = threading.Event()
        self._client = httpx.Client(base_url=base, timeout=60)
        self._thread = threading.Thread(target=self._read, daemon=True)

    def __enter__(self) -> TokenClock:
        self._thread.start()
        assert self._started.wait(60), f"the stream did not start (status {self.status})"
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(30)
        self._client.close()

    def _read(self) -> None:
        body = {"prompt": "STREAM", "max_tokens": 2000, "stream": True, "logit_bias": NO_EOS}
        try:
            with self._client.stream("POST", "/v1/completions", json=body) as stream:
                self.status = stream.status_code
                for line in stream.iter_lines():
                    if line.startswith("data: {"):
                        self.times.append(time.monotonic())
                        self._started.set()
                    if self._stop.is_set():
                        return
        except httpx.HTTPError:
            pass  # closed by __exit__

    def wait_for_token_after(self, moment: float, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while not (self.times and self.times[-1] > moment) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert self.times[-1] > moment, "the stream ended before the burst did"

    def largest_gap_since(self, moment: float) -> float:
        """The longest wait between two tokens, counting from the last one before ``moment``."""
        times = list(self.times)
        first = max(0, next(i for i, t in enumerate(times) if t > moment) - 1)
        window = times[first:]
        return max(b - a for a, b in zip(window, window[1:], strict=False))


def _burst(base: str, path: str, raw: bytes) -> list[httpx.Response]:
    """``BURST`` copies of one body at once; their answers."""
    answers: list[httpx.Response | None] = [None] * BURST

    def send(i: int) -> None:
        answers[i] = httpx.post(base + path, content=raw, timeout=120,
                                headers={"content-type": "application/json"})

    threads = [threading.Thread(target=send, args=(i,)) for i in range(BURST)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(150)
    assert all(answer is not None for answer in answers), "a request did not finish"
    return answers


def _refusal(answer: httpx.Response, param: str) -> str:
    """The message of a 400 ``context_length_exceeded`` naming ``param``, in OpenAI's shape."""
    assert answer.status_code == 400, answer.text[:300]
    error = answer.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"
    assert error["code"] == "context_length_exceeded"
    assert error["param"] == param
    return error["message"]


@pytest.mark.parametrize("endpoint", list(LONG))
def test_a_burst_of_long_conversations_is_refused_without_stalling_a_stream(
        server: LiveServer, endpoint: str):
    path, body, param = LONG[endpoint]
    raw = _raw(body)
    with TokenClock(server.base_url) as clock:
        start = time.monotonic()
        answers = _burst(server.base_url, path, raw)
        end = time.monotonic()
        clock.wait_for_token_after(end)
        gap = clock.largest_gap_since(start)
    assert gap <= MAX_GAP_S, f"a stream waited {gap:.2f} s for a token (burst {end - start:.1f} s)"
    for answer in answers:
        message = _refusal(answer, param)
        assert f"{N_MESSAGES} messages" in message
        assert f"limits.max_prompt_tokens={LIMITS.max_prompt_tokens}" in message
    assert server.wait_idle()["veloxquant_block_pool_request_blocks_in_use"] == 0


def test_messages_up_to_the_count_bound_are_rendered_and_one_more_is_refused_at_once(
        server: LiveServer):
    base, limit = server.base_url, LIMITS.max_prompt_tokens
    at_bound = httpx.post(base + "/tokenize", timeout=120,
                          json={"messages": _one_letter_messages(limit)})
    # Rendered and counted: each one-letter turn takes several tokens, more than the limit.
    assert at_bound.status_code == 200, at_bound.text[:300]
    assert at_bound.json()["count"] > limit
    over = httpx.post(base + "/v1/chat/completions", timeout=120,
                      json={"messages": _one_letter_messages(limit + 1), "max_tokens": 1})
    message = _refusal(over, "messages")
    assert f"{limit + 1} messages" in message and "shorten the messages" in message


def test_text_up_to_the_character_bound_is_tokenized_and_one_more_is_refused_at_once(
        server: LiveServer, chars_per_token: int):
    base, limit = server.base_url, LIMITS.max_prompt_tokens
    most = limit * chars_per_token
    # Content parts count, and whitespace a template may trim does not.
    parts = [{"type": "text", "text": "  " + "x" * (most - 1)}, {"type": "text", "text": "y "}]
    at_bound = httpx.post(base + "/tokenize", timeout=120,
                          json={"messages": [{"role": "user", "content": parts}]})
    assert at_bound.status_code == 200, at_bound.text[:300]
    parts[1]["text"] = "yz"
    over = httpx.post(base + "/v1/responses", timeout=120,
                      json={"input": [{"role": "user", "content": [
                          {"type": "input_text", "text": part["text"]} for part in parts]}]})
    message = _refusal(over, "input")
    assert f"{most + 1} characters" in message and "shorten the input" in message
    # An assistant's text is not counted: a template may drop earlier reasoning from it.
    replayed = httpx.post(base + "/tokenize", timeout=120, json={"messages": [
        {"role": "assistant", "content": "x" * (most + 1)}, {"role": "user", "content": "hi"}]})
    assert replayed.status_code == 200, replayed.text[:300]


@pytest.mark.slow
def test_a_long_conversation_within_the_bounds_is_served(server: LiveServer):
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", timeout=120,
                           max_retries=0)
    turns = [{"role": "user" if i % 2 == 0 else "assistant", "content": "a"}
             for i in range(401)]
    answer = client.chat.completions.create(model=server.engine.model_name, messages=turns,
                                            max_tokens=2)
    assert answer.choices[0].finish_reason in ("stop", "length")
    assert answer.usage.prompt_tokens > len(turns)  # every turn took its framing tokens


@pytest.mark.slow
def test_truncation_auto_keeps_the_newest_items_that_fit_in_few_renders(server: LiveServer):
    """30,000 items with ``truncation: "auto"``: served from the longest suffix that fits,
    found without rendering the conversation once per dropped item (hours, that way)."""
    base, answer_tokens = server.base_url, 2
    room = server.engine.context_length - answer_tokens

    def count(n: int) -> int:
        reply = httpx.post(base + "/tokenize", json={"messages": _one_letter_messages(n)},
                           timeout=120)
        return reply.json()["count"]

    per_item = count(2) - count(1)
    start = time.monotonic()
    out = httpx.post(base + "/v1/responses", timeout=120, json={
        "input": _one_letter_messages(N_MESSAGES), "truncation": "auto",
        "max_output_tokens": answer_tokens})
    assert out.status_code == 200, out.text[:300]
    kept = out.json()["usage"]["input_tokens"]
    assert room - per_item < kept <= room  # one item more would not have fit
    assert time.monotonic() - start < 90


def test_truncation_auto_refuses_what_never_fits_before_rendering(
        server: LiveServer, chars_per_token: int):
    instructions = "x" * (LIMITS.max_prompt_tokens * chars_per_token + 1)  # never dropped
    out = httpx.post(server.base_url + "/v1/responses", timeout=120, json={
        "input": _one_letter_messages(10), "instructions": instructions,
        "truncation": "auto"})
    assert "characters of message text" in _refusal(out, "input")


def test_truncation_drops_the_oldest_units_with_their_tool_results():
    def message(role: str, text: str = "t") -> ChatMessage:
        extra = {"tool_call_id": "c"} if role == "tool" else {}
        return ChatMessage(role=role, content=text, **extra)

    chat = [message("system"), message("user", "u1"), message("assistant", "call"),
            message("tool", "r1"), message("tool", "r2"), message("developer"),
            message("tool", "orphan"), message("user", "u2"), message("user", "last")]
    assert [list(unit) for unit in drop_units(chat)] == [[1], [2, 3, 4], [6], [7]]
    two = without_oldest(chat, 2)
    assert [m.content for m in two] == ["t", "t", "orphan", "u2", "last"]
    assert [m.content for m in without_oldest(two)] == ["t", "t", "u2", "last"]
    assert without_oldest(chat, 5) is None


def test_the_test_templates_frame_every_message(tiny_model_path):
    """The premise of the count bound, on the tiny model's template and SmolLM2's."""
    from mlx_lm.tokenizer_utils import load

    from veloxquant_mlx.gguf import smollm2_gguf_path
    from veloxquant_mlx.gguf.header import read_header

    tokenizer = load(tiny_model_path)  # its own copy: the template is swapped below
    assert frames_every_message(tokenizer)
    tokenizer.chat_template = read_header(smollm2_gguf_path()).metadata[
        "tokenizer.chat_template"]
    assert frames_every_message(tokenizer)
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    assert not frames_every_message(tokenizer)  # bare text: no count bound
