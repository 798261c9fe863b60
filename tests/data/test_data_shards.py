"""The shard format: round trip against a hand-built header, and one named error per bad file."""
import struct

import numpy as np
import pytest

from data.shards import (BOS_ID, HEADER_INTS, SHARD_MAGIC, SHARD_VERSION, ShardError, ShardMagicError,
                         ShardSizeError, ShardTokenError, ShardVersionError, load_shard, read_shard,
                         shard_num_tokens, write_shard)


def raw_shard(path, header_values, body: bytes):
    """A shard written by hand: header ints (padded with zeros to 256), then raw body bytes."""
    header = list(header_values) + [0] * (256 - len(header_values))
    path.write_bytes(struct.pack("<256i", *header) + body)
    return path


def test_constants_match_the_upstream_format():
    assert (SHARD_MAGIC, SHARD_VERSION, HEADER_INTS, BOS_ID) == (20240520, 1, 256, 50256)


def test_round_trip_and_byte_layout(tmp_path):
    tokens = np.array([BOS_ID, 0, 1, 50255, 31373, BOS_ID, 7], dtype=np.int64)
    path = tmp_path / "x_train_000001.bin"
    write_shard(path, tokens)
    data = path.read_bytes()
    assert len(data) == 1024 + 2 * len(tokens)
    assert struct.unpack("<3i", data[:12]) == (20240520, 1, len(tokens))
    assert data[12:1024] == bytes(1012)
    assert list(struct.unpack(f"<{len(tokens)}H", data[1024:])) == tokens.tolist()
    mapped = read_shard(path)
    assert mapped.dtype == np.uint16 and mapped.tolist() == tokens.tolist()
    loaded = load_shard(path)
    assert str(loaded.dtype) == "torch.uint16" and loaded.numpy().tolist() == tokens.tolist()
    assert shard_num_tokens(path) == len(tokens)
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temp file left behind


def test_parallel_read_of_a_larger_shard(tmp_path):
    tokens = np.random.default_rng(0).integers(0, 50257, 100_003)  # odd size: uneven read ranges
    write_shard(tmp_path / "big.bin", tokens)
    assert np.array_equal(load_shard(tmp_path / "big.bin").numpy(), tokens)


def test_empty_shard(tmp_path):
    write_shard(tmp_path / "empty.bin", [])
    assert read_shard(tmp_path / "empty.bin").size == 0


@pytest.mark.parametrize("case, error, words", [
    ("magic", ShardMagicError, "magic"),
    ("version", ShardVersionError, "version"),
    ("truncated", ShardSizeError, "truncated"),
    ("oversized", ShardSizeError, "oversized"),
    ("short header", ShardSizeError, "truncated header"),
    ("token", ShardTokenError, "vocabulary"),
])
@pytest.mark.parametrize("reader", [read_shard, load_shard])
def test_bad_files_raise_named_errors(tmp_path, case, error, words, reader):
    body = struct.pack("<4H", BOS_ID, 1, 2, 3)
    path = tmp_path / f"bad_{case.replace(' ', '_')}.bin"
    if case == "magic":
        raw_shard(path, [20240521, 1, 4], body)
    elif case == "version":
        raw_shard(path, [SHARD_MAGIC, 2, 4], body)
    elif case == "truncated":
        raw_shard(path, [SHARD_MAGIC, 1, 5], body)
    elif case == "oversized":
        raw_shard(path, [SHARD_MAGIC, 1, 3], body)
    elif case == "short header":
        path.write_bytes(struct.pack("<3i", SHARD_MAGIC, 1, 0))
    else:
        raw_shard(path, [SHARD_MAGIC, 1, 4], struct.pack("<4H", BOS_ID, 1, 50257, 3))
    with pytest.raises(error, match=words) as info:
        reader(path)
    assert isinstance(info.value, ShardError) and isinstance(info.value, ValueError)
    assert str(path) in str(info.value)
    if case == "token":
        assert "position 2" in str(info.value)


def test_writer_rejects_tokens_outside_the_vocabulary(tmp_path):
    with pytest.raises(ShardTokenError, match="out.bin"):
        write_shard(tmp_path / "out.bin", [1, 50257])
    with pytest.raises(ShardTokenError):
        write_shard(tmp_path / "out.bin", [-1, 2])
    with pytest.raises(ValueError, match="1-D integer"):
        write_shard(tmp_path / "out.bin", np.zeros((2, 2), dtype=np.int32))
    assert not list(tmp_path.iterdir())


def test_rewrite_replaces_the_file_atomically(tmp_path):
    path = tmp_path / "s.bin"
    write_shard(path, [1, 2, 3])
    write_shard(path, [4, 5])
    assert read_shard(path).tolist() == [4, 5]
    assert [p.name for p in tmp_path.iterdir()] == ["s.bin"]
