"""Data: the batch at step s is a pure function of (seed, s), the same whatever the layout; files are windows."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from shardkit.data.source import TokenSource
from shardkit.errors import ShardkitError
from shardkit.mesh import build_mesh
from shardkit.recipe import DataSection, MeshSection


def _sharding(**mesh):
    built = build_mesh(MeshSection(**mesh))
    return NamedSharding(built, PartitionSpec(("data", "fsdp"), None))


def test_batches_are_pure_functions_of_seed_and_step():
    source = TokenSource(DataSection(), vocab=256, seq_len=16, seed=3)
    again = TokenSource(DataSection(), vocab=256, seq_len=16, seed=3)
    np.testing.assert_array_equal(source.rows(5, 0, 8), again.rows(5, 0, 8))
    assert not np.array_equal(source.rows(5, 0, 8), source.rows(6, 0, 8))
    assert not np.array_equal(source.rows(5, 0, 8), TokenSource(DataSection(), 256, 16, seed=4).rows(5, 0, 8))


def test_global_batch_is_the_same_under_every_layout():
    source = TokenSource(DataSection(), vocab=256, seq_len=16, seed=0)
    reference = source.rows(2, 0, 16)
    for mesh in ({"data": 8}, {"fsdp": 4, "tensor": 2}, {"data": 2, "fsdp": 2, "tensor": 2}):
        batch = source.global_batch(2, 16, _sharding(**mesh))
        np.testing.assert_array_equal(np.asarray(jax.device_get(batch)), reference)


def test_each_device_makes_only_its_own_rows():
    """Under data parallelism over 8 devices each of the 16 rows is made exactly once: no process builds the whole
    batch and slices it."""
    source = TokenSource(DataSection(), vocab=256, seq_len=8, seed=0)
    made = []
    original = source.row
    source.row = lambda step, index: made.append(index) or original(step, index)
    source.global_batch(0, 16, _sharding(data=8))
    assert sorted(made) == list(range(16))


def test_synthetic_data_is_learnable_structure():
    """Most next tokens follow the hidden permutation: the structure the models learn."""
    source = TokenSource(DataSection(), vocab=256, seq_len=256, seed=0)
    row = source.row(0, 0)
    follows = np.mean(source.permutation[row[:-1]] == row[1:])
    assert 0.85 < follows < 0.95


def test_text_file_is_read_as_bytes(tmp_path):
    text = "shardkit reads text as bytes, one token per byte. " * 20
    path = tmp_path / "corpus.txt"
    path.write_text(text)
    source = TokenSource(DataSection(source="text", path=str(path)), vocab=256, seq_len=32, seed=0)
    row = source.row(0, 1)
    assert row.shape == (33,)
    assert bytes(row.astype(np.uint8).tolist()).decode() in text


def test_bin_tokens_are_memory_mapped_windows(tmp_path):
    tokens = np.arange(1000, dtype=np.uint16) % 300
    path = tmp_path / "tokens.bin"
    tokens.tofile(path)
    source = TokenSource(DataSection(source="bin", path=str(path), dtype="uint16"), vocab=300, seq_len=16, seed=1)
    row = source.row(4, 2)
    start = int(np.flatnonzero(tokens == row[0])[0])
    np.testing.assert_array_equal(row, (np.arange(start, start + 17) % 300))


def test_bin_token_outside_vocab_is_named(tmp_path):
    path = tmp_path / "tokens.bin"
    np.full(100, 999, dtype=np.uint32).tofile(path)
    source = TokenSource(DataSection(source="bin", path=str(path), dtype="uint32"), vocab=256, seq_len=8, seed=0)
    with pytest.raises(ShardkitError, match="token id 999 is outside the model's vocab 256"):
        source.row(0, 0)


def test_bin_file_of_partial_tokens_is_refused(tmp_path):
    path = tmp_path / "tokens.bin"
    path.write_bytes(b"\x00" * 101)
    with pytest.raises(ShardkitError, match="data.dtype"):
        TokenSource(DataSection(source="bin", path=str(path), dtype="uint16"), vocab=256, seq_len=8, seed=0)


def test_text_needs_a_byte_vocab(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text("abc" * 100)
    with pytest.raises(ShardkitError, match="vocab >= 256"):
        TokenSource(DataSection(source="text", path=str(path)), vocab=128, seq_len=8, seed=0)
