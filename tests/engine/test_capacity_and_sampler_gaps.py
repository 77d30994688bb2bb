"""Admission arithmetic and the min-p filter, tested directly (paths no other test pins).

``CapacityPlanner.never_fits`` must refuse a request whose streams each fit
alone but whose total passes the shared growth head room, and one that no
longer fits a stream shrunk alone; its "fit N tokens" hint must count k and v
on a shared-KV pool; ``fits_now`` with unbounded growth must answer at once.
"""

from __future__ import annotations

import mlx.core as mx
import pytest

from server.engine.capacity import CapacityPlanner, Reservation
from server.engine.sampling import build_sampler
from server.http.refusals import describe
from server.protocol import SamplingParams
from server.refusal import Rejected, Why
from veloxquant_mlx.memory import BlockPoolAllocator, PoolConfig


def planner(n_layers: int = 1, **config) -> CapacityPlanner:
    return CapacityPlanner(BlockPoolAllocator(PoolConfig(block_size=16, **config)), n_layers)


def words(misfit) -> str:
    """How a client reads the pool's arithmetic (server.http.refusals words the record)."""
    return describe(Rejected(Why.NEVER_FITS_POOL, {"misfit": misfit, "room": 1}, "max_tokens"))


def test_streams_that_fit_alone_but_not_together_within_the_growth_head_room():
    # 4 + 4 blocks, growth to 10 in total: 2 blocks of head room, shared by both streams.
    plan = planner(n_blocks=8, grow_on_exhaustion=True, max_blocks=10)
    assert plan.never_fits(Reservation({"k": 5, "v": 5}), 80) is None  # 10 <= 8 + 2
    misfit = plan.never_fits(Reservation({"k": 6, "v": 6}), 96)  # 6 <= 4 + 2 each; 12 > 10
    assert (misfit.stream, misfit.have, misfit.blocks) == ("all", 10, 12)
    why = words(misfit)
    assert "stream 'all'" in why and "at most 10" in why
    assert not plan.fits_now(Reservation({"k": 6, "v": 6}), {})


def test_a_stream_shrunk_alone_refuses_what_no_longer_fits_it():
    plan = planner(n_blocks=16)
    plan.pool.shrink("k", 4)  # k manages 4 blocks now, v still 8
    need = Reservation({"k": 6, "v": 6})  # 12 <= 12 in total, but k is short
    why = words(plan.never_fits(need, 96))
    assert "stream 'k'" in why and "at most 4" in why
    assert plan.never_fits(Reservation({"k": 4, "v": 8}), 64) is None
    plan.pool.shrink("k", 0)  # nothing left on k: no request fits, and the message says so
    misfit = plan.never_fits(Reservation({"k": 1, "v": 1}), 1)
    assert misfit.most_tokens == 0
    why = words(misfit)
    assert "holds no request now" in why and "tokens in total" not in why


def test_the_fit_hint_on_a_shared_kv_pool_counts_k_and_v():
    plan = planner(n_layers=2, n_blocks=64, separate_kv=False)
    need = plan.reservation(1000)  # 2 layers x 2 (k, v) x ceil(1000/16) = 252 blocks
    assert need.per_stream == {"kv": 252}
    why = words(plan.never_fits(need, 1000))
    # 64 blocks / (2 layers x 2) = 16 blocks per layer and stream = 256 tokens.
    assert "x 2 (k and v)" in why and "to fit 256 tokens in total" in why


def test_fits_now_with_unbounded_growth_answers_at_once():
    plan = planner(n_blocks=4, grow_on_exhaustion=True)  # max_blocks None: no cap
    huge = Reservation({"k": 10**9, "v": 10**9})
    assert plan.fits_now(huge, {"k": 10**9, "v": 0}) is True
    assert plan.never_fits(huge, 10**10) is None


@pytest.mark.parametrize("n_layers,config,shrink_k", [
    (2, {"n_blocks": 64, "separate_kv": False}, 0),
    (3, {"n_blocks": 64}, 0),
    (3, {"n_blocks": 64}, 20),  # k shrunk alone: k bounds it
    (2, {"n_blocks": 40, "grow_on_exhaustion": True, "max_blocks": 70}, 0),
    (2, {"n_blocks": 40, "grow_on_exhaustion": True, "max_blocks": 70,
         "separate_kv": False}, 0),
])
def test_max_request_tokens_is_the_largest_request_never_fits_accepts(n_layers, config,
                                                                      shrink_k):
    plan = planner(n_layers=n_layers, **config)
    if shrink_k:
        plan.pool.shrink("k", shrink_k)
    most = plan.max_request_tokens()
    assert most > 0 and most % 16 == 0
    assert plan.never_fits(plan.reservation(most), most) is None
    assert plan.never_fits(plan.reservation(most + 1), most + 1) is not None
    assert plan.never_fits(plan.reservation(10**4), 10**4).most_tokens == most
    assert f"to fit {most} tokens in total" in words(plan.never_fits(plan.reservation(10**4),
                                                                     10**4))


def test_max_request_tokens_is_none_when_the_pool_grows_without_bound():
    assert planner(n_blocks=4, grow_on_exhaustion=True).max_request_tokens() is None


@pytest.mark.parametrize("min_p,allowed", [(0.5, {0}), (0.1, {0, 1, 2, 3, 4})])
def test_min_p_removes_low_probability_tokens(min_p, allowed):
    logprobs = mx.log(mx.array([[0.6, 0.1, 0.1, 0.1, 0.1]]))
    sample = build_sampler(SamplingParams(max_tokens=1, temperature=1.0, min_p=min_p,
                                          seed=7))
    drawn = {int(sample(logprobs).item()) for _ in range(200)}
    # min_p 0.5 keeps tokens with p >= 0.3: only token 0. Without the filter each of the
    # others (p = 0.1) would appear in 200 draws with probability 1 - 0.9**200.
    assert drawn == allowed
