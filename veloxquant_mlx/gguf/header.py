"""A small pure-Python reader for the GGUF header (metadata and tensor infos).

``mx.load`` reads GGUF too, but when a file is damaged it either crashes with
an opaque message or, worse, reads garbage, and it knows few block types.
Parsing the header ourselves first lets every problem be reported as a
:class:`GGUFError` that says what is wrong and where. Only the header is read
here; :mod:`.weights` and :mod:`.blocks` read the tensor data.

Layout (GGUF v2/v3, little-endian): magic ``GGUF``, uint32 version, uint64
tensor count, uint64 metadata count, the metadata key/values, the tensor infos
(name, dims, ggml type, offset), padding to the alignment, then the data.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .errors import GGUFError
from .ggml_types import GGML_TYPES, GGMLType

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32

# Metadata value type id -> struct format of the scalar (strings and arrays
# are handled apart).
_SCALAR_FORMATS = {
    0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i",
    6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d",
}  # fmt: skip
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lives in the file and what it holds.

    Attributes:
        name: The GGUF tensor name (``"blk.0.attn_q.weight"``).
        shape: NumPy-order shape (GGUF stores dims innermost first).
        ggml_type: The tensor's ggml type.
        offset: Absolute byte offset of the data in the file.
        nbytes: Size of the data in bytes.
    """

    name: str
    shape: tuple[int, ...]
    ggml_type: GGMLType
    offset: int
    nbytes: int


@dataclass
class GGUFHeader:
    """The parsed header of a GGUF file.

    Attributes:
        path: The file.
        version: The GGUF version (2 or 3).
        metadata: Metadata key -> Python value (numeric arrays as lists).
        tensors: Tensor infos in file order.
        alignment: Data alignment in bytes.
        data_offset: Absolute offset of the tensor data section.
        file_size: Size of the file in bytes.
    """

    path: Path
    version: int
    metadata: dict[str, Any] = field(default_factory=dict)
    tensors: list[TensorInfo] = field(default_factory=list)
    alignment: int = DEFAULT_ALIGNMENT
    data_offset: int = 0
    file_size: int = 0

    @property
    def architecture(self) -> str | None:
        """The ``general.architecture`` value, if any."""
        return self.metadata.get("general.architecture")


class _Cursor:
    """Sequential little-endian reads that fail with a truncation error."""

    def __init__(self, buf: mmap.mmap | bytes, path: Path) -> None:
        self.buf = buf
        self.path = path
        self.pos = 0
        self.size = len(buf)

    def take(self, n: int, what: str) -> bytes:
        # Checking before slicing turns "ran off the end" into a precise message
        # instead of a struct.error deep inside the parse.
        if n < 0 or self.pos + n > self.size:
            raise GGUFError(
                self.path,
                f"file is truncated at byte {self.size} of at least {self.pos + n} "
                f"(cut while reading {what})",
            )
        # A bytes copy, not a memoryview: a view still alive in a traceback
        # would stop the mmap from closing and mask the real error.
        chunk = self.buf[self.pos : self.pos + n]
        self.pos += n
        return chunk

    def unpack(self, fmt: str, what: str) -> Any:
        return struct.unpack(fmt, self.take(struct.calcsize(fmt), what))[0]

    def string(self, what: str) -> str:
        length = self.unpack("<Q", what)
        raw = self.take(length, what)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise GGUFError(self.path, f"{what} is not valid UTF-8") from exc


def _read_value(cur: _Cursor, vtype: int, key: str) -> Any:
    """Read one metadata value of type ``vtype``."""
    if vtype in _SCALAR_FORMATS:
        return cur.unpack(_SCALAR_FORMATS[vtype], f"metadata value {key!r}")
    if vtype == _STRING:
        return cur.string(f"metadata value {key!r}")
    if vtype == _ARRAY:
        return _read_array(cur, key)
    raise GGUFError(cur.path, f"metadata key {key!r} has unknown value type {vtype}")


def _read_array(cur: _Cursor, key: str) -> list[Any]:
    """Read an array value; numeric arrays go through NumPy in one step."""
    item_type = cur.unpack("<I", f"array type of {key!r}")
    count = cur.unpack("<Q", f"array length of {key!r}")
    if item_type in _SCALAR_FORMATS:
        # Token-type and score arrays hold 100k+ items: one frombuffer call
        # instead of a Python loop keeps the header parse fast.
        dtype = np.dtype(_SCALAR_FORMATS[item_type])
        raw = cur.take(count * dtype.itemsize, f"array {key!r}")
        return np.frombuffer(raw, dtype=dtype).tolist()
    return [_read_value(cur, item_type, key) for _ in range(count)]


def _read_tensor_info(cur: _Cursor, index: int) -> tuple[str, tuple[int, ...], int, int]:
    """Read one tensor info: (name, numpy shape, ggml type id, relative offset)."""
    name = cur.string(f"name of tensor #{index}")
    n_dims = cur.unpack("<I", f"dims of tensor {name!r}")
    if n_dims > 8:
        raise GGUFError(cur.path, f"tensor {name!r} claims {n_dims} dimensions")
    dims = [cur.unpack("<Q", f"dims of tensor {name!r}") for _ in range(n_dims)]
    type_id = cur.unpack("<I", f"type of tensor {name!r}")
    offset = cur.unpack("<Q", f"offset of tensor {name!r}")
    return name, tuple(reversed(dims)), type_id, offset


def _resolve_tensor(
    path: Path, name: str, shape: tuple[int, ...], type_id: int, rel_offset: int, header: GGUFHeader
) -> TensorInfo:
    """Check one tensor's type, block geometry and extent against the file."""
    ggml_type = GGML_TYPES.get(type_id)
    if ggml_type is None:
        raise GGUFError(path, f"tensor {name!r} has unknown ggml type id {type_id}")
    n_elements = int(np.prod(shape, dtype=np.int64)) if shape else 1
    if shape and shape[-1] % ggml_type.block_size:
        raise GGUFError(
            path,
            f"tensor {name!r} ({ggml_type.name}) has a row of {shape[-1]} values, "
            f"not a multiple of the block size {ggml_type.block_size}",
        )
    if rel_offset % header.alignment:
        raise GGUFError(path, f"tensor {name!r} data offset is not {header.alignment}-aligned")
    start = header.data_offset + rel_offset
    nbytes = ggml_type.nbytes(n_elements)
    if start + nbytes > header.file_size:
        raise GGUFError(
            path,
            f"file is truncated at byte {header.file_size} of at least {start + nbytes} "
            f"(data of tensor {name!r} is cut off)",
        )
    return TensorInfo(name, shape, ggml_type, start, nbytes)


def _parse(buf: mmap.mmap | bytes, path: Path) -> GGUFHeader:
    """Parse a whole header from ``buf``."""
    cur = _Cursor(buf, path)
    if cur.take(4, "the magic number") != GGUF_MAGIC:
        raise GGUFError(path, "not a GGUF file (the first 4 bytes are not 'GGUF')")
    version = cur.unpack("<I", "the version")
    if version not in SUPPORTED_VERSIONS:
        raise GGUFError(path, f"GGUF version {version} is not supported (supported: 2, 3)")
    header = GGUFHeader(path=path, version=version, file_size=cur.size)
    n_tensors = cur.unpack("<Q", "the tensor count")
    n_kv = cur.unpack("<Q", "the metadata count")
    for _ in range(n_kv):
        key = cur.string("a metadata key")
        vtype = cur.unpack("<I", f"type of metadata {key!r}")
        header.metadata[key] = _read_value(cur, vtype, key)
    header.alignment = int(header.metadata.get("general.alignment", DEFAULT_ALIGNMENT))
    if header.alignment <= 0 or header.alignment & (header.alignment - 1):
        raise GGUFError(path, f"general.alignment {header.alignment} is not a power of two")
    raw_infos = [_read_tensor_info(cur, i) for i in range(n_tensors)]
    header.data_offset = -(-cur.pos // header.alignment) * header.alignment
    header.tensors = [_resolve_tensor(path, *info, header) for info in raw_infos]
    return header


def read_header(path: str | Path) -> GGUFHeader:
    """Parse and validate the header of a GGUF file.

    Args:
        path: The GGUF file.

    Returns:
        The parsed header. Every tensor's data is known to lie inside the file.

    Raises:
        GGUFError: The file is missing, empty, not GGUF, of an unsupported
            version, truncated, or has a malformed header.
    """
    path = Path(path)
    try:
        with open(path, "rb") as fh:
            size = fh.seek(0, 2)
            if size == 0:
                raise GGUFError(path, "not a GGUF file (the file is empty)")
            # mmap keeps memory flat even when the header holds 150k token strings
            # and the file is many GB: only the pages we touch are read.
            with mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as buf:
                return _parse(buf, path)
    except OSError as exc:
        raise GGUFError(path, f"cannot be read ({exc.strerror or exc})") from exc
