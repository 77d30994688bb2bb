"""The pure-Python header parser agrees with llama.cpp's own gguf reader."""

from __future__ import annotations

import gguf
import pytest

from veloxquant_mlx.gguf import inspect_gguf, read_header
from veloxquant_mlx.gguf.ggml_types import GGML_TYPES


def test_type_table_matches_gguf_package():
    for qtype, (block, size) in gguf.GGML_QUANT_SIZES.items():
        if qtype.value in GGML_TYPES:
            ours = GGML_TYPES[qtype.value]
            assert (ours.name, ours.block_size, ours.type_size) == (qtype.name, block, size)


@pytest.mark.parametrize("which", ["smollm2", "mixed"])
@pytest.mark.slow
def test_header_matches_gguf_reader(which, smollm2_path, synthetic_files):
    path = smollm2_path if which == "smollm2" else synthetic_files[which]
    ours = read_header(path)
    theirs = gguf.GGUFReader(str(path))
    assert [(t.name, t.offset, t.nbytes, t.ggml_type.name, t.shape) for t in ours.tensors] == [
        (t.name, int(t.data_offset), int(t.n_bytes), t.tensor_type.name,
         tuple(int(d) for d in reversed(t.shape)))
        for t in theirs.tensors
    ]  # fmt: skip
    for key, field in theirs.fields.items():
        if key.startswith("GGUF."):
            continue
        want = field.contents()
        assert ours.metadata[key] == (pytest.approx(want) if isinstance(want, float) else want)


def test_smollm2_contents(smollm2_path):
    header = inspect_gguf(smollm2_path)
    assert header.architecture == "llama" and header.version == 3
    counts = {}
    for info in header.tensors:
        counts[info.ggml_type.name] = counts.get(info.ggml_type.name, 0) + 1
    # Q4_1 matrices, a Q8_0 (tied) embedding, F32 norms; no output.weight.
    assert counts == {"Q4_1": 210, "Q8_0": 1, "F32": 61}
    assert "output.weight" not in {t.name for t in header.tensors}
