"""The paged batch: KV in the pool's arena, exact blocks per owner, bounded transients.

Tiny model (4 layers, 2 KV heads of 32, float32), tiny pools. Checks that a
request decodes to the very logits of mlx-lm's stock cache, alone or in a
batch of unequal rows; that after every step of random joins and leaves each
owner holds exactly ``ceil(tokens / block_size)`` blocks per layer and
stream with exact ``n_used``; and that MLX memory above the idle figure
(weights + arena) never exceeds the blocks in use plus the fixed workspace.
"""

from __future__ import annotations

import gc
import random
import weakref

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache

from veloxquant_mlx.memory import (
    BlockPoolAllocator,
    BlockPoolExhaustedError,
    PoolConfig,
    paged_attention,
)
from veloxquant_mlx.memory.kv_arena import KVArena, probe_kv_layout, workspace_bytes
from veloxquant_mlx.memory.request_blocks import make_batch_caches

BS = 16


@pytest.fixture
def model(served_model):
    """The paged batch serves the project's model (its attention reads the parts)."""
    return served_model


def _arena(model, n_blocks=2048, kv_format=None, **config):
    pool = BlockPoolAllocator(PoolConfig(block_size=BS, n_blocks=n_blocks, **config))
    layout = probe_kv_layout(model) if kv_format is None else probe_kv_layout(model, kv_format)
    return KVArena(pool, layout)


def _prompt(seed: int, n: int) -> list[int]:
    return [5 + (seed * 31 + 7 * j) % 250 for j in range(n)]


def _stock(model, prompt, steps):
    cache = make_prompt_cache(model)
    logits = model(mx.array([prompt]), cache=cache)[:, -1]
    out = []
    for _ in range(steps):
        out.append(logits)
        logits = model(mx.argmax(logits, -1)[:, None], cache=cache)[:, -1]
    return out


def _paged(model, arena, prompts, steps, owner0=1, fast=False):
    width = max(map(len, prompts))
    pads = [width - len(p) for p in prompts]
    batch = make_batch_caches(model, arena, list(range(owner0, owner0 + len(prompts))), pads,
                             fast_attention=fast)
    logits = model(mx.array([[0] * q + p for q, p in zip(pads, prompts, strict=True)]),
                   cache=batch.caches)[:, -1]
    out = [[] for _ in prompts]
    for _ in range(steps):
        for i, rows in enumerate(out):
            rows.append(logits[i: i + 1])
        logits = model(mx.argmax(logits, -1)[:, None], cache=batch.caches)[:, -1]
    return batch, out


def _held_exactly(pool, batch, n_layers):
    for i, row in enumerate(batch.rows):
        tokens = batch.real_tokens(i)
        per_stream = -(-tokens // BS)
        blocks = pool.blocks_for(row.owner)
        assert len(blocks) == 2 * n_layers * per_stream
        assert sum(b.n_used for b in blocks) == 2 * n_layers * tokens
        assert all(b.n_used == BS for stream in row.blocks for b in stream[:-1])


def test_probe_reads_the_layout(model):
    layout = probe_kv_layout(model)
    assert (layout.n_layers, layout.n_kv_heads, layout.head_dim) == (4, 2, 32)
    assert layout.dtype == mx.float32 and layout.bytes_per_block(BS) == 16 * 2 * 32 * 4


def test_alone_and_in_a_batch_give_the_stock_logits(model):
    arena = _arena(model)
    prompts = [_prompt(i, n) for i, n in enumerate((7, 33, 16, 50))]
    stock = [_stock(model, p, 12) for p in prompts]
    batch, together = _paged(model, arena, prompts, 12)
    _held_exactly(arena.pool, batch, 4)
    batch.release()
    for want, got in zip(stock, together, strict=True):
        for a, b in zip(want, got, strict=True):
            assert mx.array_equal(a, b)  # bit-identical, padding and all
    assert arena.pool.stats.blocks_in_use() == 0


@pytest.mark.parametrize("min_scores", [0, paged_attention.FAST_MIN_SCORES])
def test_fast_attention_tracks_the_stock_logits_alone_and_in_a_batch(model, monkeypatch,
                                                                    min_scores):
    """The CPU attention of paged_attention: same greedy tokens, logits within 1e-5.

    With ``min_scores`` 0 every call takes it, decode included; by default the
    small decode calls stay on mlx-lm's attention and the prompts take it.
    """
    monkeypatch.setattr(paged_attention, "FAST_MIN_SCORES", min_scores)
    arena = _arena(model)
    prompts = [_prompt(i, n) for i, n in enumerate((7, 33, 16, 50))]
    stock = [_stock(model, p, 12) for p in prompts]
    batch, together = _paged(model, arena, prompts, 12, fast=True)
    batch.release()
    alone = []
    for i, p in enumerate(prompts):
        one, rows = _paged(model, arena, [p], 12, owner0=10 + i, fast=True)
        one.release()
        alone.append(rows[0])
    worst = 0.0
    for want, got, solo in zip(stock, together, alone, strict=True):
        for a, b, c in zip(want, got, solo, strict=True):
            assert mx.argmax(a, -1).item() == mx.argmax(b, -1).item() == mx.argmax(c, -1).item()
            worst = max(worst, mx.abs(a - b).max().item(), mx.abs(a - c).max().item())
    assert 0.0 < worst < 1e-5  # really another computation, and a close one
    assert arena.pool.stats.blocks_in_use() == 0


def _decode_step_nodes(model, arena) -> dict[str, int]:
    """Graph nodes, by primitive, of one decode call of two rows (over 20 and 9 prompt
    tokens) on ``arena``'s paged batch, fast attention on."""
    from benchmark_scripts.benchmark_write_back import count_nodes

    batch, out = _paged(model, arena, [_prompt(1, 20), _prompt(2, 9)], 1, fast=True)
    mx.eval(out, arena.data)
    logits = model(mx.argmax(mx.concatenate(out[0] + out[1]), -1)[:, None], cache=batch.caches)
    nodes = count_nodes([logits])
    batch.release()
    return nodes


def _same_runs(want_run, got_run, same) -> int:
    """Check two :func:`_joins_and_leaves` runs step by step: the same rows (or none)
    every step and ``same(got_logits, want_logits)``. Returns the steps with rows."""
    steps = 0
    for want, got in zip(want_run, got_run, strict=True):
        assert (want is None) == (got is None)
        if want is not None:
            steps += 1
            assert want[0] == got[0]
            assert same(got[1], want[1])
    return steps


def _joins_and_leaves(model, arena, rng, steps, join_p, leave_p=0.0, fast=False,
                      write_back=1):
    """Decode ``steps`` times while groups of random prompts join (and rows leave).

    After every step each owner holds exactly its tokens' blocks and MLX
    memory above idle stays within the blocks in use plus the workspace
    bound; at the end every block is back in the pool. The decode batch holds
    ``write_back`` columns (see veloxquant_mlx/memory/write_back.py).

    Returns:
        Per step: the decode rows' owners and logits (a NumPy copy), or None
        when every row had just left.
    """
    pool, layout = arena.pool, arena.layout
    mx.eval(arena.data)
    idle = mx.get_active_memory()
    per_block = layout.bytes_per_block(BS)
    bound = workspace_bytes(layout, BS, max_rows=6, max_tokens=140 + 30, write_back=write_back)
    decode, inputs, owner, trace = None, None, 100, []
    for _ in range(steps):
        if decode is None or (len(decode.rows) < 5 and rng.random() < join_p):
            lengths = [rng.randint(1, 140) for _ in range(rng.randint(1, 2))]
            group, _ = _paged(model, arena, [_prompt(owner + k, n)
                                             for k, n in enumerate(lengths)], 0, owner, fast)
            owner += len(lengths)
            first = mx.zeros((len(lengths),), mx.uint32) + 9
            if decode is None:
                decode, inputs = group, first
                decode.write_back = write_back
            else:
                decode.extend(group)
                group.close()  # emptied by extend; closed as the server's runner does
                inputs = mx.concatenate([inputs, first])
        if leave_p and decode.rows and rng.random() < leave_p:
            keep = sorted(rng.sample(range(len(decode.rows)), rng.randint(0, len(decode.rows))))
            decode.filter(keep)
            inputs = inputs[mx.array(keep, dtype=mx.int32)] if keep else None
            if not keep:
                decode = None
                trace.append(None)
                continue
        logits = model(inputs[:, None], cache=decode.caches)[:, -1]
        inputs = mx.argmax(logits, -1).astype(mx.uint32)
        mx.eval(inputs)
        trace.append((decode.owners, np.array(logits)))  # a copy: not counted as MLX memory
        _held_exactly(pool, decode, layout.n_layers)
        # On a GPU a finished step's buffers are let go by the stream's completion handler,
        # which may run after eval returns (an H200 probe: up to an arena copy in flight).
        mx.synchronize()
        assert mx.get_active_memory() - idle <= pool.stats.blocks_in_use() * per_block + bound
    if decode is not None:
        decode.release()
    assert pool.stats.blocks_in_use() == 0
    return trace


@pytest.mark.parametrize("fast", [False, True])
@pytest.mark.slow
def test_joins_and_leaves_keep_every_owner_exact_and_memory_bounded(model, fast):
    _joins_and_leaves(model, _arena(model, n_blocks=4096), random.Random(7), 40,
                      join_p=0.4, leave_p=0.3, fast=fast)


def test_running_out_changes_nothing(model):
    arena = _arena(model, n_blocks=2 * 4 * 3)  # 3 blocks per layer and stream
    batch, _ = _paged(model, arena, [_prompt(1, 40)], 0)
    held = arena.pool.stats.blocks_in_use()
    with pytest.raises(BlockPoolExhaustedError):
        model(mx.array([_prompt(2, 20)]), cache=batch.caches)
    assert arena.pool.stats.blocks_in_use() == held and batch.real_tokens(0) == 40
    batch.release()


def test_the_arena_grows_with_the_pool(model):
    arena = _arena(model, n_blocks=16, grow_on_exhaustion=True)
    before = arena.n_ids
    prompt = _prompt(3, 90)
    batch, got = _paged(model, arena, [prompt], 6)
    assert arena.n_ids > before and arena.trash == arena.n_ids
    for a, b in zip(_stock(model, prompt, 6), got[0], strict=True):
        assert mx.array_equal(a, b)
    batch.release()


def test_small_calls_stay_on_mlx_lms_attention(model, monkeypatch):
    """Under FAST_MIN_SCORES scores a layer the router hands the call back to mlx-lm."""
    fast_calls = []
    real = paged_attention.attention_parts

    def counted(queries, *args, **kwargs):
        fast_calls.append(queries.shape)
        return real(queries, *args, **kwargs)

    monkeypatch.setattr(paged_attention, "attention_parts", counted)
    arena = _arena(model)
    prompt = _prompt(0, 40)
    batch, _ = _paged(model, arena, [prompt], 3, fast=True)
    layers = len(model.layers)
    heads = fast_calls[0][1]
    assert heads * 40 * 40 >= paged_attention.FAST_MIN_SCORES  # the prompt: fast
    assert len(fast_calls) == layers  # one prompt call per layer, none of the decodes
    batch.release()
    assert arena.pool.stats.blocks_in_use() == 0



def _batch_after_steps(model, arena, close: bool):
    """A weak reference to a two-call batch that was dropped, closed first or not."""
    batch, _ = _paged(model, arena, [_prompt(1, 40), _prompt(2, 23)], steps=3)
    mx.eval(arena.data)
    assert arena.pool.blocks_for(1)  # the rows hold blocks until released
    if close:
        batch.close()
        assert all(c.batch is None and c.parts is None for c in batch.caches)
    else:
        batch.release()
    assert not arena.pool.blocks_for(1) and not arena.pool.blocks_for(2)
    return weakref.ref(batch)  # the batch's last reference goes with this frame


@pytest.mark.parametrize("close", [True, False])
def test_close_frees_the_batch_without_the_cycle_collector(model, close: bool):
    # Why close() exists: a batch and its layer caches reference each other, so an
    # unclosed one (and its arrays: gathered KV, held columns) waits for a collection.
    arena = _arena(model)
    gc.disable()
    try:
        ref = _batch_after_steps(model, arena, close)
        freed_at_once = ref() is None
    finally:
        gc.enable()
    assert freed_at_once is close
    gc.collect()
    assert ref() is None  # either way gone after a collection
