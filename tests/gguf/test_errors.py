"""Bad input fails with one clear GGUFError and leaves the cache root empty."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tests.gguf import synth
from veloxquant_mlx.exceptions import VeloxQuantError
from veloxquant_mlx.gguf import GGUFError, convert_gguf

SUPPORTED = "supported: F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K, Q3_K, Q2_K"


def _f32(rows: int, cols: int) -> np.ndarray:
    return np.zeros((rows, cols), dtype=np.float32)


def _with_tokens(path: Path, arch: str, tensors: dict, **kv) -> Path:
    """A file with a valid gpt2 vocabulary but otherwise only ``tensors``."""
    import gguf

    tokens, types, merges = synth.vocabulary()
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    for key, value in kv.items():
        writer.add_uint32(key, value)
    for name, (data, type_name) in tensors.items():
        raw = None if type_name == "F32" else synth.Q[type_name]
        writer.add_tensor(name, data, raw_dtype=raw)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _truncated(tmp: Path, keep: int | None) -> Path:
    """The Q8_0 model cut to ``keep`` bytes (negative: that many bytes short)."""
    data = synth.write_model(tmp / "full.gguf", synth.Spec("Q8_0")).read_bytes()
    path = tmp / "truncated.gguf"
    path.write_bytes(data[:keep])
    return path


def _case(name: str, tmp: Path) -> tuple[Path, str]:
    """Build the bad file of case ``name``; return it and the expected message part."""
    norm = {"output_norm.weight": (np.ones(64, np.float32), "F32")}
    embd = {"token_embd.weight": (_f32(280, 64), "F32"), **norm}
    if name == "not-gguf":
        (tmp / "notes.gguf").write_text("this is plain text, not a model\n")
        return tmp / "notes.gguf", "not a GGUF file"
    if name == "empty":
        (tmp / "empty.gguf").write_bytes(b"")
        return tmp / "empty.gguf", "not a GGUF file (the file is empty)"
    if name == "missing":
        return tmp / "nowhere.gguf", "does not exist"
    if name == "truncated-data":
        return _truncated(tmp, -100), "file is truncated at byte"
    if name == "truncated-header":
        return _truncated(tmp, 300), "file is truncated at byte 300 of at least"
    if name in ("gpt2", "bert"):
        path = _with_tokens(tmp / f"{name}.gguf", name, embd)
        return path, f"architecture '{name}' is not supported (supported: llama, qwen2, qwen3)"
    if name in ("IQ4_XS", "IQ4_NL"):  # importance-matrix types: no decoder
        data = np.zeros((64, 136 if name == "IQ4_XS" else 144), np.uint8)
        tensors = {**embd, "blk.0.ffn_down.weight": (data, name)}
        path = _with_tokens(tmp / f"{name}.gguf", "llama", tensors)
        return path, f"tensor 'blk.0.ffn_down.weight' has type {name}; {SUPPORTED}"
    if name == "q-norm-in-llama":  # a qwen3 tensor in a file that says llama
        tensors = {**embd, "blk.0.attn_q_norm.weight": (np.ones(16, np.float32), "F32")}
        path = _with_tokens(tmp / "qnorm.gguf", "llama", tensors)
        return path, "'blk.0.attn_q_norm.weight' is a head norm that mlx-lm llama has no place"
    if name == "unknown-tensor":
        extra = {**embd, "rope_freqs.weight": (_f32(1, 32), "F32")}
        path = _with_tokens(tmp / "extra.gguf", "llama", extra)
        return path, "tensor 'rope_freqs.weight' has no mlx-lm counterpart"
    if name == "sentencepiece-without-scores":
        path = synth.write_model(tmp / "spm.gguf", synth.Spec("Q8_0", tokenizer_model="llama"))
        return path, "SentencePiece tokenizer has no tokenizer.ggml.scores"
    if name == "fails-mid-build":  # passes the header checks, fails building config.json
        block = {f"blk.0.{part}.weight": (_f32(64, 64), "F32") for part in (
            "attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")}
        block |= {f"blk.0.{n}.weight": (np.ones(64, np.float32), "F32")
                  for n in ("attn_norm", "ffn_norm")}
        path = _with_tokens(tmp / "nohparams.gguf", "llama", {**embd, **block},
                            **{"llama.block_count": 1})
        return path, "required metadata key 'llama.embedding_length' is missing"
    if name == "missing-block-tensor":
        path = synth.write_model(tmp / "full.gguf", synth.Spec("Q8_0"))
        return _without(path, tmp / "noup.gguf", "blk.1.ffn_up.weight"), \
            "required tensor 'blk.1.ffn_up.weight' is missing"
    if name == "qwen3-without-head-norms":
        path = synth.write_model(tmp / "q3.gguf", synth.Spec("Q8_0", arch="qwen3"))
        return _without(path, tmp / "q3-nonorm.gguf", "blk.0.attn_k_norm.weight"), \
            "required tensor 'blk.0.attn_k_norm.weight' is missing"
    if name == "wrong-head-norm-size":  # passes the header checks; mlx-lm's model refuses it
        path = synth.write_model(tmp / "q3.gguf", synth.Spec("Q8_0", arch="qwen3"))
        return _with_wrong_norm(path, tmp / "q3-badnorm.gguf"), \
            "ValueError: Expected shape (16,) but received shape (7,) for parameter " \
            "model.layers.0.self_attn.q_norm.weight"
    raise AssertionError(name)


def _rewrite(src: Path, dst: Path, change) -> Path:
    """``src`` written again to ``dst`` with ``change(name, array) -> array | None`` applied
    to every tensor (None drops it); metadata copied as it is."""
    import gguf

    reader = gguf.GGUFReader(str(src))
    writer = gguf.GGUFWriter(str(dst), reader.fields["general.architecture"].contents())
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        value = field.contents()
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, value, kind, sub_type=sub)
    for tensor in reader.tensors:
        data = change(tensor.name, tensor.data)
        if data is not None:
            f32 = tensor.tensor_type == gguf.GGMLQuantizationType.F32
            raw = None if f32 else tensor.tensor_type
            writer.add_tensor(tensor.name, data, raw_dtype=raw)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


def _without(src: Path, dst: Path, name: str) -> Path:
    return _rewrite(src, dst, lambda n, data: None if n == name else data)


def _with_wrong_norm(src: Path, dst: Path) -> Path:
    norm = "blk.0.attn_q_norm.weight"
    return _rewrite(src, dst, lambda n, data: np.ones(7, np.float32) if n == norm else data)


CASES = [
    "not-gguf", "empty", "missing", "truncated-data", "truncated-header", "gpt2", "bert",
    "IQ4_XS", "IQ4_NL", "q-norm-in-llama", "unknown-tensor", "sentencepiece-without-scores",
    "fails-mid-build", "missing-block-tensor", "qwen3-without-head-norms", "wrong-head-norm-size",
]  # fmt: skip


@pytest.mark.parametrize("case", CASES)
def test_bad_file_raises_clear_error_and_leaves_nothing(case, tmp_path):
    path, expected = _case(case, tmp_path)
    cache_root = tmp_path / "cache"
    cache_root.mkdir()
    with pytest.raises(GGUFError) as info:
        convert_gguf(path, cache_root)
    message = str(info.value)
    assert isinstance(info.value, VeloxQuantError)
    assert path.name in message and expected in message, message
    assert "\n" not in message
    assert list(cache_root.iterdir()) == []


def test_truncated_message_gives_sizes(tmp_path):
    path = _truncated(tmp_path, -100)
    size = path.stat().st_size
    with pytest.raises(GGUFError, match=rf"truncated at byte {size} of at least {size + 100}"):
        convert_gguf(path, tmp_path / "cache")
    assert not (tmp_path / "cache").exists()  # not even the cache root is created
