"""Unit tests: stop strings across token boundaries, reservations, capacity checks."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from server.engine.capacity import CapacityPlanner
from server.engine.request_state import StopMatcher
from server.http.refusals import describe
from server.refusal import Rejected, Why
from veloxquant_mlx.memory import BlockPoolAllocator, PoolConfig


def run(stops, pieces):
    m = StopMatcher(tuple(stops))
    out = []
    for piece in pieces:
        text, hit = m.feed(piece)
        out.append(text)
        if hit:
            return "".join(out), True
    return "".join(out) + m.flush(), False


def test_stop_split_over_tokens_is_excluded():
    assert run(["END"], ["the E", "N", "D!", "more"]) == ("the ", True)
    assert run(["\n\n"], ["a\n", "\nb"]) == ("a", True)


def test_false_start_is_released():
    assert run(["END"], ["the E", "N", "x"]) == ("the ENx", False)
    assert run(["END"], ["E"]) == ("E", False)  # flushed at the end


def test_earliest_of_several_stops_wins():
    assert run(["xyz", "b"], ["a", "bxyz"]) == ("a", True)


def test_no_stops_passes_through():
    m = StopMatcher(())
    assert m.feed("abc") == ("abc", False)


@given(st.text(alphabet="abE ND", max_size=30), st.lists(st.integers(0, 30), max_size=6),
       st.sampled_from(["END", "aa", "N D"]))
def test_stop_matcher_equals_whole_text_search(text, cuts, stop):
    cuts = sorted({c for c in cuts if c <= len(text)} | {0, len(text)})
    pieces = [text[a:b] for a, b in zip(cuts, cuts[1:], strict=False)]
    idx = text.find(stop)
    expected = (text[:idx], True) if idx >= 0 else (text, False)
    assert run([stop], pieces) == expected


def planner(n_blocks=20, separate=True, **kw):
    pool = BlockPoolAllocator(PoolConfig(block_size=16, n_blocks=n_blocks, separate_kv=separate,
                                         **kw))
    return pool, CapacityPlanner(pool, n_layers=2)


def test_reservation_per_stream():
    _, p = planner()
    assert p.reservation(33).per_stream == {"k": 6, "v": 6}  # 2 layers x ceil(33/16)
    _, p = planner(separate=False)
    assert p.reservation(16).per_stream == {"kv": 4}


def test_never_fits_says_numbers_and_fix():
    _, p = planner(n_blocks=20)  # 10 per stream
    assert p.never_fits(p.reservation(80), 80) is None  # 2 x 5 = 10 blocks: fits exactly
    misfit = p.never_fits(p.reservation(81), 81)
    assert (misfit.blocks, misfit.have, misfit.stream, misfit.n_tokens) == (12, 10, "k", 81)
    why = describe(Rejected(Why.NEVER_FITS_POOL, {"misfit": misfit, "room": 1}, "max_tokens"))
    assert "12 KV blocks" in why and "at most 10" in why and "lower max_tokens" in why
    _, p = planner(n_blocks=20, grow_on_exhaustion=True)
    assert p.never_fits(p.reservation(10_000), 10_000) is None  # unbounded growth
    _, p = planner(n_blocks=20, grow_on_exhaustion=True, max_blocks=24)
    assert p.never_fits(p.reservation(96), 96) is None  # 12 per stream, 4 spare blocks
    assert p.never_fits(p.reservation(200), 200) is not None


def test_fits_now_counts_what_running_requests_may_still_draw():
    pool, p = planner(n_blocks=20)
    need = p.reservation(48)  # 6 per stream
    pool.allocate("k", 16, owner=1)  # owner 1 reserved 6 per stream, holds 1 k block
    outstanding = p.outstanding([(1, need)])
    assert outstanding == {"k": 5, "v": 6}
    assert not p.fits_now(need, outstanding)  # 10 - 1 held - 5 owed = 4 < 6
    assert p.fits_now(p.reservation(32), outstanding)  # 4 per stream fits


@pytest.mark.parametrize("separate", [True, False])
def test_reserved_requests_never_exhaust(separate):
    """Admit by reservation, then let every admitted request grow to its full need."""
    pool, p = planner(n_blocks=40, separate=separate)
    running = []
    owner = 0
    for n_tokens in (70, 20, 33, 90, 16, 50):
        need = p.reservation(n_tokens)
        if p.fits_now(need, p.outstanding(running)):
            owner += 1
            running.append((owner, need))
    for o, need in running:
        for stream, blocks in need.per_stream.items():
            pool.allocate(stream, blocks * 16, owner=o)  # no BlockPoolExhaustedError
    assert pool.stats.n_exhausted == 0
