"""Per-rank token batches: BOS-aligned training batches and the unaligned validation stream.

Training (record #360: track_1_short/data.py): every step, all ranks split the same shared stream of
documents the same way. Rank 0 takes documents from the next BOS on, each cut at the stage's doc
cap, until it holds tokens_per_rank + 1 tokens (its last document is cut to fit, and its remainder
is dropped); rank 1 continues at the following BOS, and so on. Inputs are the first T tokens, targets
the last T. Attention segments are the documents, further cut every `virtual_seq_cap` tokens (the
run's schedule.virtual_seq_cap; masking only: the tokens are untouched). cu_seqlens has a fixed
length per batch size (static shapes for compile and CUDA graphs). The n-gram row ids and sign rows
are hashed here, on the host (from each token's normalization class with `token_map`,
features.token_norm_hashes); a run without the n-gram table (features.ngram off) passes
`**NO_NGRAM`: nothing is hashed and its batches' n-gram fields are None.

    from data.loader import TrainLoader, val_batches
    loader = TrainLoader("data/fineweb10B/fineweb_train_*.bin", rank, world_size)
    batch = loader.next_batch(tokens_per_rank=49152, doc_cap=3072)    # geometry from the schedule
    for batch in val_batches("data/fineweb10B/fineweb_val_*.bin", rank, world_size, 262144, 10485760):
        ...

One process can play several ranks of a larger world (gradient accumulation): TrainLoader(files,
[0, 1, 2, 3], world_size=8).next_batches(...) returns ranks 0..3's batches of one step, the same
tokens 8 processes would see (process p of 2 with 4 accumulation steps plays ranks 4p..4p+3).
The next step's batch is assembled in a background thread while the caller trains (when the
geometry stays the same), and the next shard is read and BOS-indexed before it is needed.
"""
from __future__ import annotations

import glob
import threading
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, fields, replace
from pathlib import Path

import numpy as np
import torch

from config import ScheduleConfig
from data.ngram import NGRAM_HALF_ROWS, NGRAM_SIGN_POOL_ROWS, ngram_row_ids, ngram_sign_rows
from data.shards import BOS_ID, check_token_ids, load_shard, read_shard, shard_num_tokens

# ours: the loader's n-gram sizes for a model without the n-gram table (config.FeatureConfig.ngram
# off): half_rows 0 means no hashing; the batches' ngram_ids and ngram_sign_rows are None.
NO_NGRAM = {"ngram_half_rows": 0, "sign_pool_rows": 0, "token_map": None}

# Attention segments are cut every schedule.virtual_seq_cap tokens inside a document (record #360: 2560,
# track_1_short/config.py; config.py holds the value, a run passes its own); only reached when the doc
# cap (3072 from stage 2) exceeds it. Batches report min(doc cap, cap) as max_seq_len.
VIRTUAL_SEQ_CAP = ScheduleConfig.virtual_seq_cap
# cu_seqlens rows per tokens-per-rank (record #360: track_1_short/data.py): fixed shapes per batch size.
CU_SEQLENS_ROWS = {16384: 64, 32768: 96, 40960: 128, 49152: 128}


def cu_seqlens_rows(tokens_per_rank: int) -> int:
    """The fixed cu_seqlens length for a batch size: the recipe table, else the next multiple of 128
    of T // 300 (validation: 262144 // 300 = 873 -> 896), at least 128 (our floor for small T)."""
    if tokens_per_rank in CU_SEQLENS_ROWS:
        return CU_SEQLENS_ROWS[tokens_per_rank]
    return max(128, -(-(tokens_per_rank // 300) // 128) * 128)


@dataclass(frozen=True)
class Batch:
    inputs: torch.Tensor           # (T,) int32 token ids
    targets: torch.Tensor          # (T,) int64, inputs shifted by one
    cu_seqlens: torch.Tensor       # (R,) int32: 0, the segment ends, then T up to the fixed length R
    ngram_ids: torch.Tensor | None        # (2T,) int32 n-gram table rows: bigram rows, then trigram rows (None: no table)
    ngram_sign_rows: torch.Tensor | None  # (2T,) int32 sign-pool rows: bigram, then trigram (None: no table)
    max_seq_len: int               # upper bound on a segment's length (static, for the attention kernel)

    def to(self, device, non_blocking: bool = False) -> Batch:
        """The same batch with every tensor on `device` (non_blocking needs pinned host tensors)."""
        moved = {f.name: getattr(self, f.name).to(device, non_blocking=non_blocking)
                 for f in fields(self) if isinstance(getattr(self, f.name), torch.Tensor)}
        return replace(self, **moved)


class EndOfData(RuntimeError):
    """The shards ran out: the message says what was consumed from which files."""


def attention_segment_ends(piece_lengths: Sequence[int], cap: int) -> list[int]:
    """Cumulative segment ends of documents laid end to end, with an extra boundary every `cap`
    tokens inside each document (start + cap, start + 2 cap, ... < stop, then stop)."""
    ends, start = [], 0
    for length in piece_lengths:
        stop = start + length
        ends.extend(range(start + cap, stop, cap))
        ends.append(stop)
        start = stop
    return ends


def padded_cu_seqlens(segment_ends: Sequence[int], tokens: int, rows: int, what: str) -> torch.Tensor:
    """[0, *segment_ends, tokens, tokens, ...] of length `rows`, int32 (trailing empty segments)."""
    if len(segment_ends) > rows - 1:
        raise ValueError(
            f"{what}: {len(segment_ends)} attention segments overflow the {rows}-row cu_seqlens table of a "
            f"{tokens}-token batch: the documents are shorter (about {tokens // max(len(segment_ends), 1)} tokens) "
            f"than the table allows (about {tokens // (rows - 1)}); use longer documents or a smaller batch")
    cu = np.full(rows, tokens, dtype=np.int32)
    cu[0] = 0
    cu[1:len(segment_ends) + 1] = segment_ends
    return torch.from_numpy(cu)


def _make_batch(buf: np.ndarray, segment_ends: Sequence[int], max_seq_len: int, half_rows: int,
                pool_rows: int, token_map: np.ndarray | None, pin_memory: bool, what: str) -> Batch:
    """buf: (T+1,) token ids -> the Batch (host tensors). token_map: the hashes read token_map[x]
    instead of x (features.token_norm_hashes, PR #375: model/token_norm.py); the batch keeps raw ids."""
    inputs = buf[:-1].astype(np.int32)  # (T,)
    tokens = inputs.size
    hashed = half_rows > 0  # NO_NGRAM: a model without the n-gram table reads no hashes
    keys = token_map[inputs] if hashed and token_map is not None else inputs  # (T,) int32: what the hashes read
    batch = Batch(
        inputs=torch.from_numpy(inputs),
        targets=torch.from_numpy(buf[1:].astype(np.int64)),
        cu_seqlens=padded_cu_seqlens(segment_ends, tokens, cu_seqlens_rows(tokens), what),
        ngram_ids=ngram_row_ids(keys, half_rows) if hashed else None,
        ngram_sign_rows=ngram_sign_rows(keys, pool_rows) if hashed else None,
        max_seq_len=max_seq_len,
    )
    if pin_memory:  # page-locked, so the caller's .to(device, non_blocking=True) is asynchronous
        batch = replace(batch, **{f.name: getattr(batch, f.name).pin_memory()
                                  for f in fields(batch) if isinstance(getattr(batch, f.name), torch.Tensor)})
    return batch


def _resolve_files(files: str | Sequence[str | Path], what: str) -> list[Path]:
    if isinstance(files, (str, Path)):
        paths = sorted(Path(p) for p in glob.glob(str(files)))
        if not paths:
            raise FileNotFoundError(f"{what}: no shard files match {files!r}")
        return paths
    paths = [Path(p) for p in files]
    if not paths:
        raise FileNotFoundError(f"{what}: the file list is empty")
    return paths


# ------------------------------------------------------------------------------------------------
# Training batches


@dataclass(frozen=True)
class _TrainShard:
    path: Path
    tokens: np.ndarray  # (N,) uint16
    bos: list[int]      # positions of every BOS, ascending (Python ints: the span walk is a Python loop)


@dataclass(frozen=True)
class _Cursor:
    shard: int            # index into the file list
    next_bos: int         # index into that shard's BOS list: the next document to hand out
    steps: int = 0        # steps handed out so far
    tokens: int = 0       # input tokens handed out so far, all ranks of the world


def document_spans(bos: Sequence[int], num_tokens: int, next_bos: int, world_size: int, tokens_per_rank: int,
                   doc_cap: int) -> tuple[list[list[tuple[int, int]]], int] | None:
    """Split the documents from BOS index `next_bos` on among `world_size` ranks: per rank the
    [start, end) token spans (T + 1 tokens in all) and the BOS index after the step, or None when
    the shard runs out of documents first."""
    spans, i, count = [], next_bos, len(bos)
    for _ in range(world_size):
        rank_spans, collected = [], 0
        while collected <= tokens_per_rank:
            if i >= count:
                return None
            start = bos[i]
            i += 1
            doc_end = bos[i] if i < count else num_tokens
            end = min(doc_end, start + doc_cap, start + tokens_per_rank + 1 - collected)
            rank_spans.append((start, end))
            collected += end - start
        spans.append(rank_spans)
    return spans, i


class TrainLoader:
    """BOS-aligned training batches of one or several ranks of a `world_size`-rank world.

    next_batch(tokens_per_rank, doc_cap) / next_batches(...) hand out one step; the geometry may
    change between steps as the schedule says. Files are read once, in sorted order (no cycling);
    when a shard runs out mid-step, the step is rebuilt from the next shard's first document.
    """

    def __init__(self, files: str | Sequence[str | Path], rank: int | Sequence[int], world_size: int, *,
                 virtual_seq_cap: int = VIRTUAL_SEQ_CAP, ngram_half_rows: int = NGRAM_HALF_ROWS,
                 sign_pool_rows: int = NGRAM_SIGN_POOL_ROWS, token_map: np.ndarray | None = None,
                 prefetch: bool = True, pin_memory: bool = False):
        self.files = _resolve_files(files, "training data")
        self.ranks = [rank] if isinstance(rank, int) else list(rank)
        if world_size < 1 or not self.ranks or any(not 0 <= r < world_size for r in self.ranks):
            raise ValueError(f"ranks {self.ranks} must be in [0, world_size={world_size})")
        self.world_size = world_size
        self.virtual_seq_cap = virtual_seq_cap
        self.ngram_half_rows = ngram_half_rows
        self.sign_pool_rows = sign_pool_rows
        self.token_map = token_map
        self.pin_memory = pin_memory
        self._cursor = _Cursor(shard=0, next_bos=0)
        self._shards: dict[int, Future] = {}
        self._shards_lock = threading.Lock()
        self._shard_reader = ThreadPoolExecutor(1, thread_name_prefix="shard-reader")
        self._assembler = ThreadPoolExecutor(1, thread_name_prefix="batch-prefetch") if prefetch else None
        self._ahead: tuple[tuple[int, int], _Cursor, Future] | None = None  # (geometry, from cursor, future)
        self._shard(0)  # read the first shard now; the second is read behind it

    # -- shards --

    def _read_shard(self, index: int) -> _TrainShard:
        path = self.files[index]
        tokens = load_shard(path).numpy()  # whole shard in memory, read with parallel preads
        bos = np.flatnonzero(tokens == BOS_ID).tolist()
        return _TrainShard(path, tokens, bos)

    def _shard(self, index: int) -> _TrainShard:
        """Shard `index` (waiting for its read), with the next one's read started behind it."""
        with self._shards_lock:
            for i in (index, index + 1):
                if i < len(self.files) and i not in self._shards:
                    self._shards[i] = self._shard_reader.submit(self._read_shard, i)
            for i in [i for i in self._shards if i < self._cursor.shard]:
                del self._shards[i]  # passed for good: free the memory
            future = self._shards[index]
        return future.result()

    # -- assembly (a pure function of the cursor and the geometry, so it can run ahead) --

    def _assemble(self, cursor: _Cursor, tokens_per_rank: int, doc_cap: int) -> tuple[list[Batch], _Cursor]:
        shard_index, next_bos = cursor.shard, cursor.next_bos
        while True:
            if shard_index >= len(self.files):
                raise EndOfData(self._end_of_data_message(cursor, tokens_per_rank))
            shard = self._shard(shard_index)
            split = document_spans(shard.bos, shard.tokens.size, next_bos, self.world_size, tokens_per_rank, doc_cap)
            if split is not None:
                break
            shard_index, next_bos = shard_index + 1, 0  # the rest of this shard cannot fill a step: drop it
        spans, next_bos = split
        max_seq_len = min(doc_cap, self.virtual_seq_cap)
        batches = []
        for rank in self.ranks:
            buf = np.concatenate([shard.tokens[s:e] for s, e in spans[rank]])  # (T+1,)
            lengths = [e - s for s, e in spans[rank]]
            lengths[-1] -= 1  # the last token only serves as the final target
            ends = attention_segment_ends(lengths, self.virtual_seq_cap)
            what = f"training step {cursor.steps} rank {rank} ({shard.path})"
            batches.append(_make_batch(buf, ends, max_seq_len, self.ngram_half_rows, self.sign_pool_rows,
                                       self.token_map, self.pin_memory, what))
        after = _Cursor(shard_index, next_bos, cursor.steps + 1, cursor.tokens + self.world_size * tokens_per_rank)
        return batches, after

    def _end_of_data_message(self, cursor: _Cursor, tokens_per_rank: int) -> str:
        names = [p.name for p in self.files]
        listed = ", ".join(names) if len(names) <= 4 else f"{names[0]}, ..., {names[-1]}"
        held = sum(shard_num_tokens(p) for p in self.files)
        return (f"training data exhausted at step {cursor.steps}: {cursor.tokens:,} input tokens handed out to "
                f"{self.world_size} rank(s), of the {held:,} tokens in all {len(names)} files ({listed}) in "
                f"{self.files[0].parent} (the rest were cut document tails and shard ends); a step of "
                f"{tokens_per_rank:,} tokens per rank does not fit in what is left. Download more shards "
                f"(python data/cached_fineweb10B.py N), tokenize more text, or train fewer steps.")

    # -- public --

    def next_batches(self, tokens_per_rank: int, doc_cap: int) -> list[Batch]:
        """One step: the batch of every rank this loader plays, in the order of `ranks`."""
        if tokens_per_rank < 1 or doc_cap < 1:
            raise ValueError(f"tokens_per_rank ({tokens_per_rank}) and doc_cap ({doc_cap}) must be positive")
        geometry = (tokens_per_rank, doc_cap)
        ahead, self._ahead = self._ahead, None
        if ahead is not None and ahead[0] == geometry and ahead[1] == self._cursor:
            batches, cursor = ahead[2].result()
        else:  # the first step, or the geometry changed: the batch assembled ahead is not this one
            batches, cursor = self._assemble(self._cursor, tokens_per_rank, doc_cap)
        self._cursor = cursor
        if self._assembler is not None:  # most steps keep the geometry: assemble the next one now
            self._ahead = (geometry, cursor, self._assembler.submit(self._assemble, cursor, *geometry))
        return batches

    def next_batch(self, tokens_per_rank: int, doc_cap: int) -> Batch:
        """One step's batch of this loader's single rank."""
        if len(self.ranks) != 1:
            raise ValueError(f"next_batch serves one rank; this loader plays ranks {self.ranks}: use next_batches")
        return self.next_batches(tokens_per_rank, doc_cap)[0]

    def close(self) -> None:
        """Stop the background threads (work in flight finishes first)."""
        for pool in (self._assembler, self._shard_reader):
            if pool is not None:
                pool.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> TrainLoader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def dummy_batch(tokens_per_rank: int, doc_cap: int, *, seed: int = 0, virtual_seq_cap: int = VIRTUAL_SEQ_CAP,
                ngram_half_rows: int = NGRAM_HALF_ROWS, sign_pool_rows: int = NGRAM_SIGN_POOL_ROWS,
                token_map: np.ndarray | None = None) -> Batch:
    """A batch of random tokens with the geometry of a real one (documents of doc_cap tokens, the
    virtual cap, the padded cu_seqlens): the untimed warmup runs on these, never on the data."""
    rng = np.random.default_rng(seed)
    buf = rng.integers(0, BOS_ID, tokens_per_rank + 1).astype(np.uint16)  # (T+1,)
    buf[::doc_cap] = BOS_ID
    pieces = [min(doc_cap, tokens_per_rank - start) for start in range(0, tokens_per_rank, doc_cap)]
    return _make_batch(buf, attention_segment_ends(pieces, virtual_seq_cap), min(doc_cap, virtual_seq_cap), ngram_half_rows, sign_pool_rows,
                       token_map, False,
                       f"warmup batch of {tokens_per_rank} tokens")


# ------------------------------------------------------------------------------------------------
# Validation batches


def val_batches(files: str | Sequence[str | Path], rank: int, world_size: int, tokens_per_rank: int,
                total_tokens: int, *, ngram_half_rows: int = NGRAM_HALF_ROWS,
                sign_pool_rows: int = NGRAM_SIGN_POOL_ROWS, token_map: np.ndarray | None = None,
                pin_memory: bool = False) -> Iterator[Batch]:
    """The validation stream, unaligned (record #360: track_1_short/data.py): step s gives rank r the tokens
    [pos + r T, pos + (r+1) T + 1) with pos = s W T, from the start of the first file on every call.
    Segments run BOS to BOS (a BOS at position 0 gives an empty first segment); no doc cap.

    One process reading the same stream with world_size=1 gets the same slices, in rank order.
    """
    step_tokens = world_size * tokens_per_rank
    if not 0 <= rank < world_size or tokens_per_rank < 1:
        raise ValueError(f"rank {rank} of world_size {world_size}, tokens_per_rank {tokens_per_rank}: invalid")
    if total_tokens % step_tokens:
        raise ValueError(f"val tokens {total_tokens} must be a multiple of world_size x tokens_per_rank "
                         f"= {step_tokens}")
    paths = _resolve_files(files, "validation data")
    file_index, pos = 0, 0
    # Memory-mapped, and only the slices read are checked: an evaluation reads 10.5M of the val
    # shard's 100M tokens, on the clock.
    tokens = read_shard(paths[0], check_tokens=False)
    for step in range(total_tokens // step_tokens):
        while pos + step_tokens + 1 > tokens.size:  # this file cannot serve a whole step: next file
            file_index, pos = file_index + 1, 0
            if file_index == len(paths):
                raise EndOfData(f"validation data exhausted at step {step}: {step * step_tokens:,} of {total_tokens:,} "
                                f"tokens read from [{', '.join(p.name for p in paths)}]; each step needs "
                                f"{step_tokens + 1:,} tokens from one file")
            tokens = read_shard(paths[file_index], check_tokens=False)
        start = pos + rank * tokens_per_rank
        buf = np.asarray(tokens[start:start + tokens_per_rank + 1])  # (T+1,)
        check_token_ids(paths[file_index], buf, offset=start)
        bos_positions = np.flatnonzero(buf[:-1] == BOS_ID).tolist()
        yield _make_batch(buf, bos_positions, tokens_per_rank, ngram_half_rows, sign_pool_rows, token_map, pin_memory,
                          f"validation step {step} rank {rank} ({paths[file_index]})")
        pos += step_tokens
