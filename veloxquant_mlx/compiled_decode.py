"""Decode calls of the Llama-shaped blocks through two compiled halves.

Why: once the model is small next to the machine, a decode step is mostly
the host building its graph, op by op, through Python modules (on an H200 a
1B bfloat16 model's step spent 1.6 ms building the graph, where reading its
2 GB of weights takes the GPU ~0.5 ms). A block's call is cut where the KV
cache comes in, and each side becomes one ``mx.compile`` call::

    pre   (x, position)   rms_norm, q/k/v projections, heads, RoPE,       compiled
                          keys and values stacked
          the attention (llama_model.attend_stacked)                       as before
    post  (x, attention)  o_proj, residual, rms_norm, MLP, residual       compiled

The blocks are the project's own (:class:`veloxquant_mlx.llama_model.Block`), which
call their halves themselves once :func:`compile_decode_blocks` has given them one.
A compiled call replays its recorded graph in C++ instead of running ~25
Python-level module calls, and fuses the elementwise ops (fewer kernels on a
GPU). With ``fuse_projections`` the halves also run q/k/v as one matmul and
the MLP's gate/up as another (:mod:`~veloxquant_mlx.fused_projections`).
Blocks with the same parameter shapes and settings share one compiled
pair, their weights passed in as inputs: a batch size seen for the first
time costs two traces (a few ms here), not two per layer. ``position`` is the
rows' offsets, or on the CPU the step's RoPE tables, computed once for every
layer (:mod:`~veloxquant_mlx.shared_rope`).

Only one-column calls on a :class:`~veloxquant_mlx.memory.paged_batch.PagedLayerCache`
(the server's decode steps) take this path; prompts, other caches and
un-batched generation run the block's plain call, mlx-lm's ops in mlx-lm's order. The halves
compute the same ops in the same order, so the logits are bit for bit those
of the uncompiled block (tests/test_compiled_decode.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten, tree_unflatten

from veloxquant_mlx import llama_model
from veloxquant_mlx.codes_decode import codes_decode
from veloxquant_mlx.freed_memory import release_freed_memory
from veloxquant_mlx.fused_projections import MEMBERS, FusedProjection, fuse_block, plain_settings
from veloxquant_mlx.llama_model import Block
from veloxquant_mlx.memory.paged_layer_cache import PagedLayerCache
from veloxquant_mlx.shared_rope import shared_rope

_FUSED = "_fused"  # the decode tree's key for the fused projections' parameters


def fused_of(block: Block) -> dict[str, FusedProjection]:
    """The block's fused projections by child name (``self_attn``: q/k/v, ``mlp``: gate/up)."""
    found = {"self_attn": block.self_attn.qkv, "mlp": block.mlp.gate_up}
    return {child: fused for child, fused in found.items() if fused is not None}


def _decode_tree(block: Block) -> dict:
    """The parameters a decode call reads: the block's, fused members by their fused layer."""
    tree = block.parameters()
    for child, fused in fused_of(block).items():
        for name in MEMBERS[child]:
            del tree[child][name]  # views of the fused layer's parameters
        tree.setdefault(_FUSED, {})[child] = fused.module.parameters()
    return tree


class _Halves:
    """One compiled pre/post pair, for every block with ``template``'s signature.

    The traced functions run ``template``'s own module code with the
    parameters handed in swapped in (and put back after), so a trace records
    the block's ops with its weights as inputs.
    """

    def __init__(self, template: Block) -> None:
        self.template = template
        self.names = [name for name, _ in tree_flatten(_decode_tree(template))]
        self.fused = fused_of(template)
        # RoPE's tables once per step where mx.fast.rope is plain ops (the CPU): see shared_rope.
        self.rope = shared_rope(template.self_attn.rope)
        self.pre = mx.compile(self._pre)
        self.post = mx.compile(self._post)

    def _swap_in(self, weights: tuple[mx.array, ...]) -> tuple[dict, dict]:
        """Put ``weights`` into the template (and its fused projections); returns its own."""
        own = self.template.parameters()
        own_fused = {c: p.module.parameters() for c, p in self.fused.items()}
        tree = tree_unflatten(list(zip(self.names, weights, strict=True)))
        for child, params in tree.pop(_FUSED, {}).items():
            self.fused[child].module.update(params)
        self.template.update(tree)
        return own, own_fused

    def _put_back(self, own: tuple[dict, dict]) -> None:
        self.template.update(own[0])
        for child, params in own[1].items():
            self.fused[child].module.update(params)

    def _rotate(self, t: mx.array, position: Any) -> mx.array:
        if self.rope is None:  # position: the rows' offsets
            return self.template.self_attn.rope(t, offset=position)
        return self.rope.rotate(t, *position)  # position: the step's (cos, sin)

    def _pre(self, x: mx.array, position: Any, *weights: mx.array):
        own = self._swap_in(weights)
        try:
            block = self.template
            attn = block.self_attn
            b, n, _ = x.shape
            # Rows flat (2-D): a 3-D matmul adds a flatten and an unflatten node each.
            h = block.input_layernorm(x.reshape(b * n, -1))
            qkv = attn.qkv(h) if attn.qkv else (attn.q_proj(h), attn.k_proj(h), attn.v_proj(h))
            q, k, v = attn.heads(*qkv, b, n)
            # Keys and values stacked (keys' rows, then values'), as the paged cache keeps them.
            return (self._rotate(q, position),
                    mx.concatenate([self._rotate(k, position), v]))
        finally:
            self._put_back(own)

    def _post(self, x: mx.array, attended: mx.array, *weights: mx.array) -> mx.array:
        own = self._swap_in(weights)
        try:
            block = self.template
            b, _, n, _ = attended.shape
            flat = attended.transpose(0, 2, 1, 3).reshape(b * n, -1)
            h = x.reshape(b * n, -1) + block.self_attn.o_proj(flat)
            return (h + block.mlp.fused_call(block.post_attention_layernorm(h))).reshape(b, n, -1)
        finally:
            self._put_back(own)

    def __call__(self, block: Block, weights: tuple[mx.array, ...], x: mx.array, mask: Any,
                 cache: PagedLayerCache) -> mx.array:
        position = (cache.offset if self.rope is None
                    else self.rope.tables(cache.offset, x.shape[1]))
        q, new = self.pre(x, position, *weights)
        out = llama_model.attend_stacked(q, new, cache, block.self_attn.scale, mask)
        return self.post(x, out, *weights)


@dataclass(frozen=True, slots=True)
class DecodeHalves:
    """What a block's decode call runs: the shared halves and this block's weights."""

    halves: _Halves
    weights: tuple[mx.array, ...]

    def __call__(self, block: Block, x: mx.array, mask: Any, cache: PagedLayerCache) -> mx.array:
        return self.halves(block, self.weights, x, mask, cache)


def _signature(block: Block) -> tuple:
    """What a shared trace depends on: parameter shapes and every plain setting."""
    shapes = tuple((name, tuple(w.shape), w.dtype) for name, w in
                   tree_flatten(block.parameters()))
    settings = tuple((path, type(m).__name__, plain_settings(m))
                     for path, m in block.named_modules())
    return shapes, settings


def compile_decode_blocks(model: Any, fuse_projections: bool = True,
                          codes_blocks: bool = True) -> int:
    """Give ``model``'s blocks compiled halves for their decode calls on paged caches.

    Call it once the weights are final (after loading, sharding): each block
    keeps the arrays it had then. Calling it again takes the current weights.

    Args:
        model: A model of :mod:`veloxquant_mlx.llama_model` (any other has no
            block this applies to).
        fuse_projections: Run q/k/v and gate/up as one matmul each
            (:mod:`~veloxquant_mlx.fused_projections`; the projections'
            weights become views of one buffer per group).
        codes_blocks: Where a fused block computes from codes, run each half as one
            native operation instead, and its prompt chunks on a paged cache through
            the same two (:mod:`~veloxquant_mlx.codes_decode`).

    Returns:
        Blocks now compiled (0 for a model without the project's blocks: those
        keep running as mlx-lm wrote them).
    """
    blocks = [b for b in getattr(model, "layers", []) if isinstance(b, Block)]
    shared: dict[tuple, _Halves] = {}
    for block in blocks:
        fused = fuse_block(block) if fuse_projections else {}
        block.self_attn.qkv, block.mlp.gate_up = fused.get("self_attn"), fused.get("mlp")
        key = (_signature(block), tuple(sorted(fused)))
        halves = shared.get(key) or shared.setdefault(key, _Halves(block))
        decode = DecodeHalves(halves, tuple(w for _, w in tree_flatten(_decode_tree(block))))
        native = codes_decode(block, halves.rope, decode) if codes_blocks else None
        block.decode = native or decode
        block.prompt = native.prompt if native else None
    if fuse_projections and blocks:  # the members' old buffers: ~270 MiB of a 1B model
        release_freed_memory()
    return len(blocks)
