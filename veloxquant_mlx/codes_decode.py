"""A block's decode call as two native operations, where its weights are codes (the CPU).

:mod:`~veloxquant_mlx.compiled_decode` runs a decode call as two compiled halves around
the attention. Each half is still ~25 graph nodes (norms, reshapes, RoPE's slices and
concatenations, the MLP's split and activation) that the CPU stream runs one at a time at
a few microseconds each: on SmolLM2 (30 layers) ~1,600 nodes a one-row step, about as
long as its products. When every projection of a block computes from codes
(:class:`~veloxquant_mlx.codes_linear.CodesLinear`, q/k/v and gate/up fused) each half is
one operation of the extension (``veloxquant_mlx/kernels/codes_block.cpp``)::

    block_qkv  rms_norm, q/k/v from codes (+ bias), head norms, RoPE     one node, two outputs
               the attention (llama_model.attend_stacked)               as before
    block_mlp  o from codes, residual, rms_norm, gate/up, silu * up,     one node
               down, residual

A short prompt chunk on a paged cache (:meth:`CodesDecode.prompt`) runs through the same
two operations, each of its columns one of their rows: its products were already these
codes products, and the ~25 nodes of norms, RoPE and activation a layer cost it more than
its products (SmolLM2, an 8-token prompt to its first token: ~100 -> ~57 ms).

The products are the same codes products; the norms, RoPE and activation are loops in C
whose float32 results differ from MLX's ops by rounding only (sums in another order).
Logits match the compiled halves' to ~1e-5, except where such a difference puts an int8
activation across a rounding boundary: one int8 step, up to ~1% of a row's logits on a
small random model (tests/test_codes_decode.py). SmolLM2's greedy answers are unchanged.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn

from veloxquant_mlx import llama_model
from veloxquant_mlx.codes_linear import INT8_MAX_ROWS, CodesLinear
from veloxquant_mlx.memory.paged_layer_cache import PagedLayerCache
from veloxquant_mlx.shared_rope import SharedRope

# Prompt chunks of at most this many positions (rows x columns) take the two operations:
# those whose products are int8 too (INT8_MAX_ROWS), cheap next to the ~25 nodes a layer
# saved. Above, the float32 products dominate, and the block's own ops run silu * up on
# both cores with a vectorised exp (its C kernel) where block_mlp's loop runs on one:
# served 1B Q4_1, 64-token prompts reached their first tokens 1.03-1.11x later through
# them; in process 1,531 against 1,455 ms, medians of 4 rounds
# (figures/cpu/codes_prompt_ops_128_positions_llama1b_64.json).
PROMPT_MAX_POSITIONS = INT8_MAX_ROWS


def _weight(layer: Any) -> tuple | None:
    """A plain codes layer's ``(codes, scales, biases, bits, group)``, or None."""
    if type(layer) is not CodesLinear or layer.precise:
        return None
    return (layer.weight, layer.scales, layer.biases, layer.bits, layer.group)


class CodesDecode:
    """A block's decode call through ``block_qkv`` and ``block_mlp``; see the module docstring.

    Args:
        block: A :class:`~veloxquant_mlx.llama_model.Block` that :func:`codes_decode` accepted.
        rope: Its RoPE, tables shared by every layer of a step.
        fallback: What runs a call these operations cannot (an input not float32).
    """

    def __init__(self, block: Any, rope: SharedRope, fallback: Any) -> None:
        attn, mlp = block.self_attn, block.mlp
        qkv = attn.qkv.module
        self.qkv, self.o = _weight(qkv), _weight(attn.o_proj)
        self.gate_up, self.down = _weight(mlp.gate_up.module), _weight(mlp.down_proj)
        # Everything a call passes, looked up once: a step makes these calls for every
        # layer, and each attribute of an MLX module is a dictionary lookup in Python.
        # (The weights are bound here like the codes above: a model's weights do not
        # change once its blocks are compiled.)
        pre, post = block.input_layernorm, block.post_attention_layernorm
        self.pre_norm, self.post_norm = pre.weight, post.weight
        self.qkv_options = {"eps": pre.eps, "rope_dims": rope.dims,
                            "traditional": rope.traditional,
                            "bias": qkv.bias if "bias" in qkv else None,
                            "float32_above": INT8_MAX_ROWS, "heads": attn.n_heads,
                            "kv_heads": attn.n_kv_heads,
                            "head_dim": qkv.weight.shape[0] // (attn.n_heads
                                                                + 2 * attn.n_kv_heads)}
        if attn.head_norms:
            self.qkv_options.update(q_norm=attn.q_norm.weight, k_norm=attn.k_norm.weight,
                                    head_eps=attn.q_norm.eps)
        self.mlp_options = {"eps": post.eps, "float32_above": INT8_MAX_ROWS}
        self.scale = attn.scale
        self.rope = rope
        self.fallback = fallback
        from veloxquant_mlx.kernels.build import load  # built by codes_linear already

        ops = load()
        self._block_qkv, self._block_mlp = ops.block_qkv, ops.block_mlp

    def __call__(self, block: Any, x: mx.array, mask: Any, cache: PagedLayerCache) -> mx.array:
        if x.dtype != mx.float32:
            return self.fallback(block, x, mask, cache)
        cos, sin = self.rope.tables(cache.offset, 1)
        q, new = self._block_qkv(x, self.pre_norm, self.qkv, cos, sin, **self.qkv_options)
        out = llama_model.attend_stacked(q, new, cache, self.scale, mask)
        return self._block_mlp(x, out, self.o, self.post_norm, self.gate_up, self.down,
                               **self.mlp_options)

    def prompt(self, block: Any, x: mx.array, mask: Any, cache: Any,
               last_only: bool = False) -> mx.array | None:
        """A prompt chunk's call, ``x`` ``(rows, n, hidden)``: every column one row of the
        two operations, with its own RoPE position; the attention between them is the
        block's own (causal, over the stored columns too). With ``last_only`` the output
        is the last column's alone, ``(rows, 1, hidden)``
        (:meth:`~veloxquant_mlx.llama_model.Block.last_column`). None (the block runs
        its own ops) unless ``cache`` is paged and ``x`` float32 of at most
        PROMPT_MAX_POSITIONS."""
        b, n, hidden = x.shape
        if (not isinstance(cache, PagedLayerCache) or x.dtype != mx.float32
                or b * n > PROMPT_MAX_POSITIONS):
            return None
        cos, sin = (mx.broadcast_to(t.reshape(-1, n, t.shape[-1]), (b, n, t.shape[-1]))
                    .reshape(b * n, -1) for t in self.rope.tables(cache.offset, n))
        flat = x.reshape(b * n, hidden)
        q, new = self._block_qkv(flat, self.pre_norm, self.qkv, cos, sin, **self.qkv_options)
        heads, d = q.shape[1], q.shape[3]
        q = q.reshape(b, n, heads, d).transpose(0, 2, 1, 3)
        # keys of every column, then values: (2 rows, kv heads, n, d) as the cache stacks them
        new = new.reshape(2 * b, n, new.shape[1], d).transpose(0, 2, 1, 3)
        k, v = cache.update_and_fetch_stacked(new)
        m = n
        if last_only:
            q, x, m, mask = q[:, :, -1:], x[:, -1:], 1, llama_model.last_row_mask(mask)
        out = llama_model.scaled_dot_product_attention(q, k, v, cache, self.scale, mask)
        out = out.transpose(0, 2, 1, 3).reshape(b * m, heads * d)
        y = self._block_mlp(x.reshape(b * m, hidden), out, self.o, self.post_norm,
                            self.gate_up, self.down, **self.mlp_options)
        return y.reshape(b, m, hidden)


def codes_decode(block: Any, rope: SharedRope | None, fallback: Any) -> CodesDecode | None:
    """``block``'s decode call as :class:`CodesDecode`, or None where it cannot be.

    It can when q/k/v and gate/up are fused (:mod:`~veloxquant_mlx.fused_projections`),
    every projection is a plain :class:`CodesLinear` (q/k/v alone may have a bias), the
    norms are ``nn.RMSNorm`` and RoPE shares its tables (``rope``, on the CPU).
    """
    attn, mlp = block.self_attn, block.mlp
    if rope is None or attn.qkv is None or mlp.gate_up is None:
        return None
    layers = [attn.qkv.module, attn.o_proj, mlp.gate_up.module, mlp.down_proj]
    if any(_weight(layer) is None for layer in layers) or any("bias" in layer
                                                              for layer in layers[1:]):
        return None
    norms = [block.input_layernorm, block.post_attention_layernorm]
    if attn.head_norms:
        norms += [attn.q_norm, attn.k_norm]
    if not all(type(n) is nn.RMSNorm for n in norms):
        return None
    return CodesDecode(block, rope, fallback)
