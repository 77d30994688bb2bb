"""An independent float64 NumPy forward pass of a GGUF llama/qwen2/qwen3 model.

It reads the file with ``gguf.GGUFReader``, dequantizes with
``gguf.quants.dequantize`` and runs the weights *as stored in the GGUF*, with
RoPE applied the way llama.cpp does: adjacent pairs (2i, 2i+1) for llama
("normal" mode, matching llama.cpp's permuted q/k rows) and halves (i, i+d/2)
for qwen2 and qwen3 ("neox" mode; qwen3 first normalises each head of q and
k). Nothing here shares code with the converter, so a wrong rename, un-permute
or dequantization in the converter shows up as a logits mismatch.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import GGUFReader
from gguf.quants import dequantize


class ReferenceModel:
    """Lazily dequantized GGUF weights plus the forward pass."""

    def __init__(self, path: Path) -> None:
        self.reader = GGUFReader(str(path))
        self.tensors = {t.name: t for t in self.reader.tensors}
        self.arch = self._meta("general.architecture")
        a = self.arch
        self.n_layers = int(self._meta(f"{a}.block_count"))
        self.n_head = int(self._meta(f"{a}.attention.head_count"))
        self.n_kv = int(self._meta(f"{a}.attention.head_count_kv"))
        self.eps = float(self._meta(f"{a}.attention.layer_norm_rms_epsilon"))
        base_field = self.reader.fields.get(f"{a}.rope.freq_base")
        self.rope_base = float(base_field.contents()) if base_field else 10000.0

    def _meta(self, key: str):
        return self.reader.fields[key].contents()

    def w(self, name: str) -> np.ndarray:
        """A tensor dequantized to float64, in NumPy (rows, cols) order."""
        t = self.tensors[name]
        shape = tuple(int(d) for d in reversed(t.shape))
        return dequantize(t.data, t.tensor_type).reshape(shape).astype(np.float64)

    def has(self, name: str) -> bool:
        return name in self.tensors

    def _rms_norm(self, x: np.ndarray, name: str) -> np.ndarray:
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + self.eps) * self.w(name)

    def _head_norm(self, x: np.ndarray, name: str) -> np.ndarray:
        """qwen3: RMSNorm over each head's features (x: (T, heads, d)), if the file has it."""
        return self._rms_norm(x, name) if self.has(name) else x

    def _rope(self, x: np.ndarray) -> np.ndarray:
        """x: (T, heads, d). llama: adjacent pairs; qwen2/qwen3: NeoX halves."""
        n_tok, _, d = x.shape
        freqs = self.rope_base ** (-np.arange(0, d, 2) / d)  # (d/2,)
        angle = np.arange(n_tok)[:, None] * freqs[None, :]
        cos, sin = np.cos(angle)[:, None, :], np.sin(angle)[:, None, :]
        if self.arch in ("qwen2", "qwen3"):
            x0, x1 = x[..., : d // 2], x[..., d // 2 :]
            return np.concatenate([x0 * cos - x1 * sin, x0 * sin + x1 * cos], axis=-1)
        x0, x1 = x[..., 0::2], x[..., 1::2]
        out = np.empty_like(x)
        out[..., 0::2] = x0 * cos - x1 * sin
        out[..., 1::2] = x0 * sin + x1 * cos
        return out

    def _proj(self, h: np.ndarray, name: str) -> np.ndarray:
        out = h @ self.w(f"{name}.weight").T
        if self.has(f"{name}.bias"):
            out = out + self.w(f"{name}.bias")
        return out

    def _attention(self, h: np.ndarray, i: int) -> np.ndarray:
        n_tok = h.shape[0]
        q = self._proj(h, f"blk.{i}.attn_q").reshape(n_tok, self.n_head, -1)
        k = self._proj(h, f"blk.{i}.attn_k").reshape(n_tok, self.n_kv, -1)
        v = self._proj(h, f"blk.{i}.attn_v").reshape(n_tok, self.n_kv, -1)
        q = self._head_norm(q, f"blk.{i}.attn_q_norm.weight")
        k = self._head_norm(k, f"blk.{i}.attn_k_norm.weight")
        q, k = self._rope(q), self._rope(k)
        group = self.n_head // self.n_kv
        k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
        scores = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(q.shape[-1])
        scores = scores + np.triu(np.full((n_tok, n_tok), -np.inf), k=1)
        probs = np.exp(scores - scores.max(axis=-1, keepdims=True))
        probs /= probs.sum(axis=-1, keepdims=True)
        out = np.einsum("hqk,khd->qhd", probs, v).reshape(n_tok, -1)
        return out @ self.w(f"blk.{i}.attn_output.weight").T

    def _mlp(self, h: np.ndarray, i: int) -> np.ndarray:
        gate = h @ self.w(f"blk.{i}.ffn_gate.weight").T
        up = h @ self.w(f"blk.{i}.ffn_up.weight").T
        return (gate / (1.0 + np.exp(-gate)) * up) @ self.w(f"blk.{i}.ffn_down.weight").T

    def logits(self, token_ids: list[int]) -> np.ndarray:
        """(T, vocab) float64 logits of a causal forward over ``token_ids``."""
        embd = self.w("token_embd.weight")
        x = embd[np.asarray(token_ids)]
        for i in range(self.n_layers):
            x = x + self._attention(self._rms_norm(x, f"blk.{i}.attn_norm.weight"), i)
            x = x + self._mlp(self._rms_norm(x, f"blk.{i}.ffn_norm.weight"), i)
        x = self._rms_norm(x, "output_norm.weight")
        head = self.w("output.weight") if self.has("output.weight") else embd
        return x @ head.T
