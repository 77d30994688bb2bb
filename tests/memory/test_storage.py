"""MLXBlockStorage: lazy buffers, in-place reuse, format changes, validation."""

from __future__ import annotations

import mlx.core as mx
import pytest

from veloxquant_mlx.memory import BlockPoolAllocator, MLXBlockStorage, PoolConfig
from veloxquant_mlx.memory.storage import FORMAT_DTYPES, dtype_for

HEAD_DIM = 8
BLOCK = 16


@pytest.fixture()
def pool() -> BlockPoolAllocator:
    return BlockPoolAllocator(PoolConfig(block_size=BLOCK, n_blocks=8))


@pytest.fixture()
def storage(pool: BlockPoolAllocator) -> MLXBlockStorage:
    return MLXBlockStorage(pool, head_dim=HEAD_DIM)


def rows(n: int, start: float = 0.0, dtype=mx.float16) -> mx.array:
    return (mx.arange(n * HEAD_DIM, dtype=mx.float32).reshape(n, HEAD_DIM) + start).astype(dtype)


def test_nothing_is_resident_until_first_write(pool, storage):
    pool.allocate("k", 40, owner=1)
    assert storage.resident_bytes() == 0
    assert storage.n_resident() == 0


def test_write_then_read_returns_exact_rows_and_updates_n_used(pool, storage):
    (block,) = pool.allocate("k", 5, owner=1)
    assert block.n_used == 5
    storage.write(block, 0, rows(5))
    storage.write(block, 5, rows(4, start=100))
    assert block.n_used == 9
    got = storage.read(block)
    assert got.shape == (9, HEAD_DIM)
    assert got.dtype == mx.float16
    assert mx.array_equal(got, mx.concatenate([rows(5), rows(4, start=100)]))
    assert storage.resident_bytes() == BLOCK * HEAD_DIM * 2


def test_write_inside_the_allocated_rows_keeps_n_used(pool, storage):
    (block,) = pool.allocate("k", 12, owner=1)
    storage.write(block, 2, rows(3))
    assert block.n_used == 12


def test_resident_bytes_counts_only_materialised_buffers(pool, storage):
    blocks = pool.allocate("k", 48, owner=1)
    storage.write(blocks[0], 0, rows(1))
    storage.read(blocks[2])  # a read materialises too
    assert storage.n_resident() == 2
    assert storage.resident_bytes() == 2 * BLOCK * HEAD_DIM * 2


def test_recycled_block_reuses_its_buffer_and_shows_only_new_rows(pool, storage):
    (first,) = pool.allocate("k", 10, owner=1)
    storage.write(first, 0, rows(10, start=7))
    pool.free_all(1)
    (again,) = pool.allocate("k", 3, owner=2)
    assert again.block_id == first.block_id  # LIFO: the block just freed
    storage.write(again, 0, rows(3, start=500))
    assert storage.n_resident() == 1
    assert storage.resident_bytes() == BLOCK * HEAD_DIM * 2
    assert mx.array_equal(storage.read(again), rows(3, start=500))


def test_format_change_remakes_the_buffer_with_the_new_dtype(pool, storage):
    (block,) = pool.allocate("k", 4, owner=1, format="fp16")
    storage.write(block, 0, rows(4))
    pool.free_all(1)
    (block,) = pool.allocate("k", 4, owner=2, format="int8")
    codes = mx.full((4, HEAD_DIM), -3, dtype=mx.int8)
    storage.write(block, 0, codes)
    got = storage.read(block)
    assert got.dtype == mx.int8
    assert mx.array_equal(got, codes)
    assert storage.resident_bytes() == BLOCK * HEAD_DIM * 1


def test_write_past_block_size_raises_and_writes_nothing(pool, storage):
    (block,) = pool.allocate("k", 16, owner=1)
    with pytest.raises(ValueError, match="overflows block_size 16"):
        storage.write(block, 14, rows(3))
    with pytest.raises(ValueError, match="overflows"):
        storage.write(block, -1, rows(1))
    assert storage.n_resident() == 0


def test_wrong_shape_raises_naming_expected_shape(pool, storage):
    (block,) = pool.allocate("k", 4, owner=1)
    with pytest.raises(ValueError, match=r"shape \(n, 8\), got \(2, 4\)"):
        storage.write(block, 0, mx.zeros((2, 4), dtype=mx.float16))
    with pytest.raises(ValueError, match=r"shape \(n, 8\)"):
        storage.write(block, 0, mx.zeros((HEAD_DIM,), dtype=mx.float16))


def test_wrong_dtype_raises_naming_expected_dtype(pool, storage):
    (block,) = pool.allocate("k", 4, owner=1, format="fp32")
    with pytest.raises(ValueError, match="format 'fp32', which stores mlx.core.float32"):
        storage.write(block, 0, rows(2, dtype=mx.float16))


def test_non_array_values_raise_type_error(pool, storage):
    (block,) = pool.allocate("k", 4, owner=1)
    with pytest.raises(TypeError, match="mx.array"):
        storage.write(block, 0, [[0.0] * HEAD_DIM])


def test_writing_a_free_block_raises(pool, storage):
    (block,) = pool.allocate("k", 4, owner=1)
    pool.free_all(1)
    with pytest.raises(ValueError, match="is free"):
        storage.write(block, 0, rows(1))


def test_unknown_format_raises_listing_known_ones(pool, storage):
    (block,) = pool.allocate("k", 4, owner=1, format="nf4")
    with pytest.raises(ValueError, match="no storage dtype for block format 'nf4'"):
        storage.write(block, 0, rows(1))


def test_release_drops_a_freed_blocks_buffer(pool, storage):
    a, b = pool.allocate("k", 32, owner=1)
    storage.write(a, 0, rows(1))
    storage.write(b, 0, rows(1))
    pool.free([a])
    storage.release(a)
    assert storage.n_resident() == 1
    assert storage.resident_bytes() == BLOCK * HEAD_DIM * 2
    storage.release(a)  # no buffer: no-op
    assert storage.n_resident() == 1


def test_release_of_an_owned_block_raises(pool, storage):
    (block,) = pool.allocate("k", 4, owner=1)
    storage.write(block, 0, rows(1))
    with pytest.raises(ValueError, match="still owned by 1"):
        storage.release(block)
    assert storage.n_resident() == 1


def test_format_table():
    assert dtype_for("fp32") == mx.float32
    assert dtype_for("fp16") == mx.float16
    assert dtype_for("bf16") == mx.bfloat16
    assert dtype_for("int8") == mx.int8
    assert {dtype_for(f) for f in ("int4", "int2", "int1", "uint8")} == {mx.uint8}
    assert set(FORMAT_DTYPES) == {
        "fp32", "fp16", "bf16", "int8", "uint8", "int4", "int2", "int1", "uint32",
    }


@pytest.mark.parametrize("head_dim", [0, -1, True, 2.0])
def test_bad_head_dim_raises(pool, head_dim):
    with pytest.raises(ValueError, match="head_dim must be a positive int"):
        MLXBlockStorage(pool, head_dim=head_dim)
