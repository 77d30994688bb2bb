"""The Llama-shaped families' forward pass, in code the project owns.

mlx-lm loads the weights of a ``llama`` (and ``mistral``, which loads as ``llama``),
``qwen2`` or ``qwen3`` checkpoint; :func:`own_model` then rebuilds the model around those
very weight modules (projections, norms, embedding, RoPE: nothing is copied) in the
classes below, whose parameter tree is mlx-lm's, path for path. What differs is who
calls what, and every call is explicit here:

- attention goes through :func:`veloxquant_mlx.memory.paged_attention.scaled_dot_product_attention`,
  which serves a paged batch's CPU calls itself and hands every other call to mlx-lm's;
- the MLP's ``silu(gate) * up`` goes through :func:`veloxquant_mlx.native_swiglu.swiglu`
  (a C kernel for prompt chunks on the CPU, mlx-lm's function otherwise);
- a block's decode calls on a paged cache run as two compiled halves once
  :func:`veloxquant_mlx.compiled_decode.compile_decode_blocks` has given it them.

Nothing is assigned into an mlx-lm module, and every other family runs mlx-lm's own
modules, unmodified. On a stock cache (mlx-lm's ``KVCache``, the library's
``PoolBackedKVCache``) the logits are bit for bit those of mlx-lm's model
(tests/test_llama_model.py).
"""

from __future__ import annotations

import sys
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import KVCache, RotatingKVCache

from veloxquant_mlx.fused_projections import FusedProjection
from veloxquant_mlx.memory.paged_attention import paged_decode, scaled_dot_product_attention
from veloxquant_mlx.memory.paged_layer_cache import PagedLayerCache
from veloxquant_mlx.native_swiglu import swiglu

# mlx-lm modules whose models this file runs, and whether their attention normalises
# each head's queries and keys (``q_norm``/``k_norm``) before RoPE.
OWNED_MODULES = {"mlx_lm.models.llama": False, "mlx_lm.models.qwen2": False,
                 "mlx_lm.models.qwen3": True}


class Attention(nn.Module):
    """mlx-lm's Llama/Qwen attention over its own projections, norms and RoPE."""

    def __init__(self, stock: Any, head_norms: bool) -> None:
        super().__init__()
        self.q_proj, self.k_proj = stock.q_proj, stock.k_proj
        self.v_proj, self.o_proj = stock.v_proj, stock.o_proj
        if head_norms:
            self.q_norm, self.k_norm = stock.q_norm, stock.k_norm
        self.rope = stock.rope
        self.head_norms = head_norms
        self.n_heads, self.n_kv_heads, self.scale = stock.n_heads, stock.n_kv_heads, stock.scale
        # q/k/v as one matmul in compiled decode calls (see compile_decode_blocks).
        self.qkv: FusedProjection | None = None

    def heads(self, q: mx.array, k: mx.array, v: mx.array, rows: int, columns: int,
              query_columns: int | None = None) -> tuple[mx.array, mx.array, mx.array]:
        """Projections to ``(rows, heads, columns, head_dim)``, head norms applied (not RoPE);
        the queries may cover fewer columns (``query_columns``)."""
        q = q.reshape(rows, query_columns or columns, self.n_heads, -1)
        k = k.reshape(rows, columns, self.n_kv_heads, -1)
        if self.head_norms:
            q, k = self.q_norm(q), self.k_norm(k)
        v = v.reshape(rows, columns, self.n_kv_heads, -1)
        return q.transpose(0, 2, 1, 3), k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)

    def __call__(self, x: mx.array, mask: Any = None, cache: Any = None,
                 last_only: bool = False) -> mx.array:
        """The attention's output, ``(b, n, hidden)``; with ``last_only`` at ``x``'s last
        column alone, ``(b, 1, hidden)``: keys and values of every column (``cache``
        stores them all), the query of the last one only."""
        b, n, _ = x.shape
        m = 1 if last_only else n  # query columns
        q, k, v = self.heads(self.q_proj(x[:, -1:] if last_only else x), self.k_proj(x),
                             self.v_proj(x), b, n, m)
        offset = 0 if cache is None else cache.offset
        q_offset = offset + n - 1 if last_only else offset  # no extra node on the usual path
        q, k = self.rope(q, offset=q_offset), self.rope(k, offset=offset)
        if cache is not None:
            k, v = cache.update_and_fetch(k, v)
        if last_only:
            mask = last_row_mask(mask)
        out = scaled_dot_product_attention(q, k, v, cache, self.scale, mask)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(b, m, -1))


def last_row_mask(mask: Any) -> Any:
    """A prompt's attention mask for its last query column alone: a causal mask's last row
    sees every key (None); an array mask keeps its last row."""
    return None if mask is None or isinstance(mask, str) else mask[..., -1:, :]


def attend_stacked(queries: mx.array, new: mx.array, cache: PagedLayerCache, scale: float,
                   mask: Any) -> mx.array:
    """A decode block's attention (compiled halves, codes blocks): hand the call's ``new``
    keys over values to ``cache`` and attend over the layer's KV. The stored part is read
    where it lies in the arena when :func:`paged_decode` applies; else it is gathered and
    this module's attention runs (looked up at each call, like the plain block's)."""
    out = paged_decode(queries, new, cache, scale, mask)
    if out is not None:
        return out
    k, v = cache.update_and_fetch_stacked(new)
    return scaled_dot_product_attention(queries, k, v, cache, scale, mask)


class MLP(nn.Module):
    """``down(silu(gate(x)) * up(x))`` over mlx-lm's projections."""

    def __init__(self, stock: Any) -> None:
        super().__init__()
        # In mlx-lm's order, so the parameter tree flattens the same.
        self.gate_proj, self.down_proj, self.up_proj = (stock.gate_proj, stock.down_proj,
                                                        stock.up_proj)
        # gate/up as one matmul in compiled decode calls (see compile_decode_blocks).
        self.gate_up: FusedProjection | None = None

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))

    def fused_call(self, x: mx.array) -> mx.array:
        """The same, gate and up by one matmul where :attr:`gate_up` is set."""
        if self.gate_up is None:
            return self(x)
        return self.down_proj(swiglu(*self.gate_up(x)))


class Block(nn.Module):
    """One transformer block: pre-norm attention and pre-norm MLP, each with its residual."""

    def __init__(self, stock: Any, head_norms: bool) -> None:
        super().__init__()
        self.self_attn = Attention(stock.self_attn, head_norms)
        self.mlp = MLP(stock.mlp)
        self.input_layernorm = stock.input_layernorm
        self.post_attention_layernorm = stock.post_attention_layernorm
        self.use_sliding = bool(getattr(stock, "use_sliding", False))
        # Compiled halves for one-column calls on a paged cache (compiled_decode), or None.
        self.decode: Any = None
        # Native operations for short prompt chunks on a paged cache (codes_decode), or
        # None; they hand back None for a call they do not take.
        self.prompt: Any = None

    def __call__(self, x: mx.array, mask: Any = None, cache: Any = None) -> mx.array:
        if self.decode is not None and x.shape[1] == 1 and isinstance(cache, PagedLayerCache):
            return self.decode(self, x, mask, cache)
        if self.prompt is not None and (out := self.prompt(self, x, mask, cache)) is not None:
            return out
        h = x + self.self_attn(self.input_layernorm(x), mask, cache)
        return h + self.mlp(self.post_attention_layernorm(h))

    def last_column(self, x: mx.array, mask: Any = None, cache: Any = None) -> mx.array:
        """The block's output at ``x``'s last column only, every column's keys and values
        stored: a prompt's last block, whose other columns nothing reads."""
        if self.prompt is not None and (
                out := self.prompt(self, x, mask, cache, last_only=True)) is not None:
            return out
        h = x[:, -1:] + self.self_attn(self.input_layernorm(x), mask, cache, last_only=True)
        return h + self.mlp(self.post_attention_layernorm(h))


class Backbone(nn.Module):
    """Embedding, blocks, final norm: mlx-lm's ``model.model``."""

    def __init__(self, stock: Any, head_norms: bool) -> None:
        super().__init__()
        self.embed_tokens = stock.embed_tokens
        self.layers = [Block(block, head_norms) for block in stock.layers]
        self.norm = stock.norm
        self.sliding_window = getattr(stock, "sliding_window", None)

    def __call__(self, inputs: mx.array, cache: Any = None,
                 input_embeddings: mx.array | None = None,
                 last_column: bool = False) -> mx.array:
        """The final norm's output, ``(rows, columns, hidden)``; with ``last_column``, of
        the last column only, ``(rows, 1, hidden)``: the last block then computes its
        queries, attention output and MLP for that column alone (a prompt's first token
        needs nothing else; ~6% of a 16-layer model's prompt work saved)."""
        h = self.embed_tokens(inputs) if input_embeddings is None else input_embeddings
        if cache is None:
            cache = [None] * len(self.layers)
        masks: dict[bool, Any] = {}  # one per kind of layer, from its first layer's cache
        last = len(self.layers) - 1 if last_column and h.shape[1] > 1 else -1
        for i, (layer, layer_cache) in enumerate(zip(self.layers, cache, strict=True)):
            if layer.use_sliding not in masks:
                window = self.sliding_window if layer.use_sliding else None
                masks[layer.use_sliding] = create_attention_mask(h, layer_cache, window)
            run = layer.last_column if i == last else layer
            h = run(h, masks[layer.use_sliding], layer_cache)
        return self.norm(h[:, -1:] if last_column else h)


class Model(nn.Module):
    """A Llama-shaped mlx-lm model's weights under the project's own calls.

    Attributes:
        reads_paged_parts: Its attention takes a paged batch's stored and new parts
            (:meth:`PagedLayerCache.stacked_parts`), so a batch may offer them.
    """

    reads_paged_parts = True

    def __init__(self, stock: Any, head_norms: bool) -> None:
        super().__init__()
        self.args = stock.args
        self.model_type = getattr(stock, "model_type", stock.args.model_type)
        self.model = Backbone(stock.model, head_norms)
        if "lm_head" in stock:
            self.lm_head = stock.lm_head
        self._stock_class = type(stock)

    def __call__(self, inputs: mx.array, cache: Any = None,
                 input_embeddings: mx.array | None = None) -> mx.array:
        out = self.model(inputs, cache, input_embeddings)
        if "lm_head" in self:
            return self.lm_head(out)
        return self.model.embed_tokens.as_linear(out)

    @property
    def layers(self) -> list[Block]:
        return self.model.layers

    def make_cache(self) -> list[Any]:
        """mlx-lm's caches for this model: a rotating one for each sliding layer."""
        return [RotatingKVCache(max_size=self.model.sliding_window) if layer.use_sliding
                else KVCache() for layer in self.layers]

    def shard(self, group: Any = None) -> None:
        """Split tensor-parallel with mlx-lm's own ``shard`` (it only reassigns children
        and head counts, which this tree names as mlx-lm's does)."""
        self._stock_class.shard(self, group)


def owns(stock: Any) -> bool:
    """Whether :func:`own_model` runs ``stock``: mlx-lm's own classes of an owned family."""
    if type(stock).__module__ not in OWNED_MODULES:
        return False
    module = sys.modules[type(stock).__module__]  # imported: it defines stock's class
    blocks = getattr(getattr(stock, "model", None), "layers", None)
    return (type(stock) is getattr(module, "Model", None) and bool(blocks)
            and all(type(b) is getattr(module, "TransformerBlock", None)
                    and type(b.self_attn) is getattr(module, "Attention", None)
                    and type(b.mlp) is getattr(module, "MLP", None) for b in blocks))


def own_model(stock: Any) -> Any:
    """``stock`` run by this file's classes (same weight modules), or ``stock`` itself
    for a family this file does not run."""
    if not owns(stock):
        return stock
    return Model(stock, OWNED_MODULES[type(stock).__module__])
