"""Sibling projections of a block as one matmul, their weights in one buffer.

Why: a decode step of a small model on a GPU is bound by the host's cost per
op (building the graph and launching each kernel), not by the GPU: on an
H200 a 1B model's step spent ~3.6 ms submitting ~330 kernels whose weights
the GPU reads in ~0.5 ms. A Llama-shaped block reads its normalised input
three times for q/k/v and twice for the MLP's gate/up; one matmul against
the stacked weights does the same work in one kernel each, 3 fewer matmuls
per block. The outputs are then views of one array (no copy: MLX reshapes a
column slice by strides).

Stacking must not double the weights: :func:`fuse_group` concatenates the
members' parameters once and then makes each member's own parameters views
of that buffer, so mlx-lm's modules (prompts, stock caches, saving) keep
working on the same memory. Every parameter stacks along its first axis
(the output rows): ``weight``, ``bias`` and a quantized layer's ``scales``
and ``biases`` alike.
"""

from __future__ import annotations

import copy
import itertools
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from veloxquant_mlx.codes_linear import CodesLinear

# Per block: the child module holding each group, and the group's members in output order.
GROUPS = (("self_attn", ("q_proj", "k_proj", "v_proj")), ("mlp", ("gate_proj", "up_proj")))
MEMBERS = dict(GROUPS)
# Layer classes whose call is a plain (quantized) matmul of their parameters.
_PLAIN_LAYERS = (nn.Linear, nn.QuantizedLinear, CodesLinear)
_PLAIN = (bool, int, float, str, type(None))


class FusedProjection:
    """One module computing several projections of the same input; see :func:`fuse_group`.

    Attributes:
        module: A layer of the members' class whose parameters are theirs stacked.
        sizes: Each member's output features, in order.
    """

    def __init__(self, module: nn.Module, sizes: list[int]) -> None:
        self.module = module
        self.sizes = sizes
        self._cuts = list(itertools.accumulate(sizes[:-1]))  # where each member's columns start

    def __call__(self, x: mx.array) -> list[mx.array]:
        """Each member's output for ``x`` (views of one matmul's result)."""
        return mx.split(self.module(x), self._cuts, axis=-1)


def plain_settings(module: nn.Module) -> tuple:
    """A module's plain attributes (bits, group_size, eps, ...), sorted: what its call depends
    on besides its parameters."""
    return tuple(sorted((k, v) for k, v in vars(module).items() if isinstance(v, _PLAIN)))


def fusable(layers: list[Any]) -> bool:
    """Whether ``layers`` can be stacked: one plain layer class, settings and input width."""
    first = layers[0]
    if type(first) not in _PLAIN_LAYERS:
        return False
    keys = sorted(first.keys())
    return all(type(m) is type(first) and sorted(m.keys()) == keys
               and plain_settings(m) == plain_settings(first)
               and all(m[k].shape[1:] == first[k].shape[1:] and m[k].dtype == first[k].dtype
                       for k in keys)
               for m in layers[1:])


def fuse_group(layers: list[nn.Module]) -> FusedProjection:
    """Stack ``layers``' parameters into one layer; each member keeps views of it.

    Raises:
        ValueError: The layers cannot be stacked (see :func:`fusable`).
    """
    if not fusable(layers):
        raise ValueError("only layers of one plain Linear/QuantizedLinear class with equal "
                         "settings and input widths can be fused")
    fused = copy.copy(layers[0])  # its class and settings; parameters replaced below
    sizes = [m.weight.shape[0] for m in layers]
    stacked = {k: mx.concatenate([m[k] for m in layers]) for k in layers[0].keys()}
    mx.eval(stacked)
    fused.update(stacked)
    views = []
    for i, member in enumerate(layers):
        start = sum(sizes[:i])
        own = {k: v[start: start + sizes[i]] for k, v in stacked.items()}
        member.update(own)
        views.extend(own.values())
    mx.eval(views)  # the old separate buffers go once nothing else holds them
    return FusedProjection(fused, sizes)


def fuse_block(block: Any) -> dict[str, FusedProjection]:
    """Fuse each group of :data:`GROUPS` that ``block`` has and can stack.

    Returns:
        The fused projection per child name (``"self_attn"``, ``"mlp"``); a
        group that is missing or cannot be stacked is left out (and unchanged).
    """
    out = {}
    for child, names in GROUPS:
        parent = getattr(block, child, None)
        layers = [getattr(parent, n, None) for n in names]
        if parent is not None and None not in layers and fusable(layers):
            out[child] = fuse_group(layers)
    return out
