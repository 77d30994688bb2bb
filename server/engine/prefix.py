"""The engine's side of prefix caching: what a prompt can reuse, and what it leaves.

The bookkeeping (hash chain, references, LRU) is the pool's own
(``pool.prefix_cache``, :class:`~veloxquant_mlx.memory.prefix_cache.PrefixCache`),
and the pool evicts unreferenced blocks when an allocation needs them; this
module decides what a prompt looks up and publishes (engine thread only)::

    admission   lookup(prompt): full-block keys, the longest cached run
                (at most (P - min_tail) // block_size blocks: the last prompt token
                is always computed, its logits give the first token) -> acquire
    prefill     the row's table starts on the shared blocks; only the rest is fed
    prefilled   publish: the row's own full prompt blocks join the cache
    finished    publish_output: full blocks of prompt + generated tokens join too
    request end release: its references go; unreferenced blocks are evictable

Keys hash the model's identity and the KV format (:func:`cache_root`), so a
block computed by another model or stored in another format never matches.
With caching off (``cache.prefix_caching = false``) a lookup finds nothing and
nothing is published, so the pool's cache stays empty.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from veloxquant_mlx.memory.block_pool import Block
from veloxquant_mlx.memory.kv_arena import KVArena
from veloxquant_mlx.memory.prefix_cache import (
    CachedBlock,
    PrefixCache,
    chain_hashes,
    prefix_root,
)


def kv_format_tag(arena: KVArena) -> str:
    """The tag of how ``arena`` stores KV (``"fp32"``, ``"q8g64"``...): part of every key."""
    layout = arena.layout
    tag = getattr(layout, "format_tag", None)  # a layout without one stores the native dtype
    return tag if isinstance(tag, str) else f"native-{layout.dtype}"


def cache_root(model_name: str, arena: KVArena) -> bytes:
    """Root of every key: the model, the dtype it computes in, the KV format, the block size."""
    layout = arena.layout
    model = f"{model_name}|{layout.dtype}|{layout.n_layers}x{layout.n_kv_heads}x{layout.head_dim}"
    return prefix_root(model, kv_format_tag(arena), arena.block_size)


def salted_root(root: bytes, salt: str) -> bytes:
    """The chain root of a cache namespace (any string, lone surrogates included)."""
    return hashlib.sha256(root + b"\0salt\0" + salt.encode("utf-8", "surrogatepass")).digest()


@dataclass(slots=True)
class PrefixHit:
    """What one prompt reuses.

    Attributes:
        keys: Keys of every full block of the prompt (to publish later).
        entries: The cached run it starts on (position order).
        root: The root its keys chain from (salted or not; empty: caching off),
            which the blocks past the prompt's chain from too, when it has none.
    """

    keys: list[bytes] = field(default_factory=list)
    entries: list[CachedBlock] = field(default_factory=list)
    root: bytes = b""

    def per_stream(self) -> dict[str, int]:
        """Pool blocks the shared run covers, per stream."""
        out: dict[str, int] = {}
        for entry in self.entries:
            for stream, n in entry.per_stream.items():
                out[stream] = out.get(stream, 0) + n
        return out

    def pinned(self) -> dict[str, int]:
        """Of those, blocks that are evictable now (acquiring them takes them off the LRU)."""
        out: dict[str, int] = {}
        for entry in self.entries:
            if entry.refs == 0:
                for stream, n in entry.per_stream.items():
                    out[stream] = out.get(stream, 0) + n
        return out

    def blocks(self) -> list[list[Block]]:
        """The shared blocks, position by position (each in table stream order)."""
        return [entry.blocks for entry in self.entries]


class PromptPrefixes:
    """Prefix caching for one engine.

    Args:
        cache: The pool's prefix cache.
        root: :func:`cache_root` of the served model and arena.
        block_size: Tokens per block.
        min_tail: Prompt tokens a hit always leaves to compute. 1 (the last token's
            logits give the first generated one), or more where the number of rows
            picks the arithmetic: with the CPU's products from quantized codes (calls
            of at most ``model.quantized_matmul_rows`` rows), a tail of that many
            rows or fewer would run with int8 activations where the cold prompt ran
            in float32, and a near-tie first token (SmolLM2 asked the capital of
            France: "The" 0.10 above "L") flipped on the second asking. One row more
            keeps the tail on the cold prompt's float32 path.
        enabled: False: every lookup misses and nothing is published.
    """

    def __init__(self, cache: PrefixCache, root: bytes, block_size: int,
                 min_tail: int = 1, enabled: bool = True) -> None:
        self.cache = cache
        self.root = root
        self.block_size = block_size
        self.min_tail = max(min_tail, 1)
        self.enabled = enabled

    def lookup(self, prompt_ids: Sequence[int], salt: str | None = None,
               whole_prompt: bool = False) -> PrefixHit:
        """Keys of the prompt and the cached run it may start on (nothing acquired).

        A whole-prompt task (scoring, embedding) computes every position: it finds
        nothing and publishes nothing.

        ``salt`` (a request's ``cache_salt``) starts the chain from a root of its
        own, so its blocks match only prompts sent under the same salt: what one
        client's prompts leave in the cache is invisible to clients without it.
        """
        if not self.enabled or whole_prompt:
            return PrefixHit()
        root = self.root if salt is None else salted_root(self.root, salt)
        keys = chain_hashes(prompt_ids, self.block_size, root)
        usable = max(len(prompt_ids) - self.min_tail, 0) // self.block_size
        return PrefixHit(keys, self.cache.match(keys[:usable]), root)

    def acquire(self, owner: int, hit: PrefixHit, prompt_tokens: int) -> int:
        """``owner`` references ``hit``'s blocks; returns the prompt tokens they cover."""
        if not self.enabled:
            return 0
        self.cache.acquire(owner, hit.entries)
        tokens = len(hit.entries) * self.block_size
        self.cache.record_query(prompt_tokens, tokens)
        return tokens

    def publish(self, owner: int, keys: Sequence[bytes], shared: int,
                table: Sequence[Sequence[Block]]) -> int:
        """Take ``owner``'s computed full prompt blocks (positions ``shared`` on) into the cache.

        Args:
            owner: The request.
            keys: Its prompt's full-block keys.
            shared: Positions it started on (already cached).
            table: Its blocks, ``table[stream][position]``.

        Returns:
            Positions published.
        """
        published = 0
        if not self.enabled:
            return published
        for j in range(shared, len(keys)):
            published += self.cache.publish(owner, keys[j], [stream[j] for stream in table])
        return published

    def publish_output(self, owner: int, prompt_keys: Sequence[bytes], root: bytes,
                       tokens: Sequence[int], stored: int,
                       table: Sequence[Sequence[Block]]) -> int:
        """Publish the full blocks past the prompt's: prompt tail and generated tokens.

        Args:
            owner: The request (it is ending: nothing writes its blocks any more).
            prompt_keys: Keys of its prompt's full blocks (published at prefill).
            root: The root they chain from (its ``cache_salt``'s, if it sent one).
            tokens: Prompt plus the generated tokens it fed to the model.
            stored: Tokens its block table holds (must equal ``len(tokens)``).
            table: Its blocks, ``table[stream][position]``.

        Returns:
            Positions published (0 when ``stored`` disagrees with ``tokens``).
        """
        if stored != len(tokens) or not root:
            return 0
        start = len(prompt_keys)
        parent = prompt_keys[-1] if prompt_keys else root
        keys = chain_hashes(tokens[start * self.block_size:], self.block_size, parent)
        return self.publish(owner, [*prompt_keys, *keys], start, table)

    def publish_rows(self, rows: Sequence[Any], paged: Sequence[Any]) -> int:
        """Publish each prefilled row's full prompt blocks (``rows[i]``, a prefill Row,
        stored as ``paged[i]``, its batch row); returns positions published."""
        return sum(self.publish(row.owner, row.prefix_keys, len(row.cached_blocks), kv.blocks)
                   for row, kv in zip(rows, paged, strict=True))

    def publish_ending(self, rows: Sequence[Any], batch: Any, owners: set[int]) -> int:
        """Publish the full blocks (prompt and output) of decode ``rows`` whose owner is in
        ``owners``: requests finishing now, so no call writes their blocks any more.

        ``batch`` is the decode batch (``batch.rows[i]`` stores ``rows[i]``). Its held
        columns (``kv_write_back``) are written first, so a step in which requests end
        with prefix caching on writes them early. A row whose stored tokens do not match
        prompt plus fed tokens publishes nothing. Returns positions published.
        """
        ending = [(row, kv) for row, kv in zip(rows, batch.rows, strict=True)
                  if row.owner in owners and row.fed]
        if ending:  # their newest tokens may be held out of the arena: write them first
            batch.flush()
        return sum(self.publish_output(row.owner, row.prefix_keys, row.prefix_root,
                                       row.prompt_ids + row.fed, kv.tokens, kv.blocks)
                   for row, kv in ending)

    def release(self, owner: int) -> None:
        """Drop ``owner``'s references (the request ended)."""
        self.cache.release(owner)

    def reset(self) -> int:
        """Drop every unreferenced block; returns blocks freed."""
        return self.cache.reset()
