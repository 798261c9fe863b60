"""The `.bin` token shard format shared with the upstream FineWeb shards, and its reader and writer.

A shard is a 256-int32 little-endian header (magic, version, token count, zeros) followed by the
tokens as uint16 GPT-2 ids. Every document starts with the end-of-text token 50256, which the loader
therefore treats as BOS. The FineWeb shards of `kjj0/fineweb10B-gpt2` hold 100M tokens each.

    from data.shards import read_shard, write_shard
    tokens = read_shard("data/fineweb10B/fineweb_val_000000.bin")  # np.memmap, uint16

Every bad file raises a `ShardError` subclass whose message names the file and what was expected.
"""
from __future__ import annotations

import os
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

# The upstream shard format (record #89's train_gpt.py, record #360's track_1_short/data.py): magic,
# version, 256-int32 header.
SHARD_MAGIC = 20240520
SHARD_VERSION = 1
HEADER_INTS = 256
HEADER_BYTES = HEADER_INTS * 4
BOS_ID = 50256  # GPT-2 <|endoftext|>, written before every document (record #89's train_gpt.py)
VOCAB_SIZE = 50257  # GPT-2's vocabulary (record #360: track_1_short/model/gpt.py); every token id is below it
# Parallel preads per shard read: one thread's readinto leaves disk/page-cache bandwidth unused
# (record #360's track_1_short/data.py reads with 4).
READ_THREADS = 4


class ShardError(ValueError):
    """A shard file that does not follow the format. The message names the file."""


class ShardMagicError(ShardError):
    pass


class ShardVersionError(ShardError):
    pass


class ShardSizeError(ShardError):
    """The file is shorter (truncated) or longer (oversized) than its header says."""


class ShardTokenError(ShardError):
    """A token id is outside the GPT-2 vocabulary."""


def _read_header(path: Path) -> int:
    """Validate the header and the file size of `path`; return its token count."""
    size = path.stat().st_size
    if size < HEADER_BYTES:
        raise ShardSizeError(f"{path}: truncated header: the file has {size} bytes, a shard header has {HEADER_BYTES}")
    header = np.fromfile(path, dtype="<i4", count=HEADER_INTS)
    if header[0] != SHARD_MAGIC:
        raise ShardMagicError(f"{path}: wrong magic number {header[0]}, expected {SHARD_MAGIC} (not a token shard)")
    if header[1] != SHARD_VERSION:
        raise ShardVersionError(f"{path}: unsupported shard version {header[1]}, expected {SHARD_VERSION}")
    num_tokens = int(header[2])
    expected = HEADER_BYTES + 2 * num_tokens
    if num_tokens < 0 or size != expected:
        kind = "truncated" if size < expected else "oversized"
        raise ShardSizeError(
            f"{path}: {kind}: the header says {num_tokens} tokens ({expected} bytes), the file has {size} bytes")
    return num_tokens


def shard_num_tokens(path: str | os.PathLike) -> int:
    """The token count of a shard, after checking its header and size (cheap: reads 1 KiB)."""
    return _read_header(Path(path))


def check_token_ids(path: str | os.PathLike, tokens: np.ndarray, offset: int = 0) -> None:
    """Raise ShardTokenError if a token of `tokens` (read from `path` at token `offset`) is outside
    the vocabulary."""
    if tokens.size and int(tokens.max()) >= VOCAB_SIZE:
        bad = int(np.argmax(tokens >= VOCAB_SIZE))
        raise ShardTokenError(f"{path}: token id {int(tokens[bad])} at position {offset + bad} is outside the "
                              f"GPT-2 vocabulary (< {VOCAB_SIZE})")


def read_shard(path: str | os.PathLike, check_tokens: bool = True) -> np.ndarray:
    """Memory-map a shard's tokens: a read-only uint16 array of the header's token count.

    check_tokens scans every token for ids outside the vocabulary (about 20 ms per 100M tokens).
    """
    path = Path(path)
    num_tokens = _read_header(path)
    if num_tokens == 0:
        return np.zeros(0, dtype=np.uint16)
    tokens = np.memmap(path, dtype="<u2", mode="r", offset=HEADER_BYTES, shape=(num_tokens,))
    if check_tokens:
        check_token_ids(path, tokens)
    return tokens


def load_shard(path: str | os.PathLike, pin_memory: bool = False, check_tokens: bool = True) -> torch.Tensor:
    """Read a whole shard into memory: a uint16 tensor, in pinned (page-locked) memory if asked,
    so host-to-GPU copies from it can run asynchronously. Reads with READ_THREADS parallel preads."""
    import torch  # here, not at the top: the download and tokenize scripts start without torch

    path = Path(path)
    num_tokens = _read_header(path)
    tokens = torch.empty(num_tokens, dtype=torch.uint16, pin_memory=pin_memory)
    view = memoryview(tokens.numpy()).cast("B")  # (2N,) bytes, written in place
    nbytes = 2 * num_tokens

    def read_range(lo: int, hi: int) -> int:
        start = lo
        while lo < hi:
            n = os.preadv(fd, [view[lo:hi]], HEADER_BYTES + lo)
            if n == 0:  # the file shrank under us
                break
            lo += n
        return lo - start

    fd = os.open(path, os.O_RDONLY)
    try:
        edges = [nbytes * i // READ_THREADS for i in range(READ_THREADS + 1)]
        with ThreadPoolExecutor(READ_THREADS) as pool:
            got = sum(pool.map(read_range, edges[:-1], edges[1:]))
    finally:
        os.close(fd)
    if got != nbytes:
        raise ShardSizeError(f"{path}: read {got} bytes of tokens, the header says {nbytes}")
    if check_tokens:
        check_token_ids(path, tokens.numpy())
    return tokens


def write_shard(path: str | os.PathLike, tokens) -> None:
    """Write tokens (any integer array-like, ids in [0, VOCAB_SIZE)) as a shard, atomically: a temp
    file in the same directory, then os.replace, so a reader never sees a half-written shard."""
    path = Path(path)
    array = np.asarray(tokens)
    if array.ndim != 1 or (array.size and not np.issubdtype(array.dtype, np.integer)):
        raise ValueError(f"{path}: tokens must be a 1-D integer array, got shape {array.shape} dtype {array.dtype}")
    if array.size and (int(array.min()) < 0 or int(array.max()) >= VOCAB_SIZE):
        raise ShardTokenError(f"{path}: token ids must lie in [0, {VOCAB_SIZE}), got [{array.min()}, {array.max()}]")
    header = np.zeros(HEADER_INTS, dtype="<i4")
    header[:3] = SHARD_MAGIC, SHARD_VERSION, array.size
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.{uuid.uuid4().hex[:8]}.tmp"
    try:
        with open(tmp, "xb") as f:
            f.write(header.tobytes())
            f.write(array.astype("<u2", copy=False).tobytes())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
