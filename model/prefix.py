"""The prefix-token table of record #360's auxiliary loss, built from GPT-2's BPE vocabulary.

prefix[t] = the token whose bytes are the longest proper prefix of token t's bytes, or −1 (the 256
single bytes, <|endoftext|> 50256 and the padding ids). The loss reads prefix[target] (the prefix of
the next token). The table is built per run, on the clock (record #360), two ways:

- whole (`build_prefix_table`): sorting the byte strings puts a prefix before everything that
  extends it, so one pass with a stack of open prefixes finds every answer. One process builds it
  all; it is also the reference the sliced build is tested against.
- sliced (`build_prefix_table_slice`, `build_prefix_table_sharded`; SPEEDRUN_SHARDED_PREFIX=1):
  rank r of W answers only the ids of its contiguous range [lo, hi), each by looking its byte
  prefixes up in the vocabulary's bytes → id dict, longest first. Nothing is sorted and no other id
  is visited, so a slice costs 1/W of a lookup over every id (an id's lookup costs a little more than
  its share of the sorted pass: on a CPU core, the largest of 8 slices takes ~1/5 to 1/7 of the whole
  build; `python -m model.prefix` times both); the slices meet in one all-gather. (Record
  #360 splits the work differently: each rank runs the sorted pass over the tokens whose second byte
  falls in its bucket and an all_reduce(MAX) merges them. The lookup needs no closure argument and
  gives contiguous slices, which an all-gather assembles without a reduction.)

The table comes from tiktoken's GPT-2 files when tiktoken has them (cached, or downloadable now);
where it has neither (a fresh clone offline), from the copy stored beside this file
(gpt2_prefix_table.npy.gz, the whole build's result for all 50,257 ids, 118 KB): the same numbers,
which tests/model/test_model_prefix.py rebuilds from tiktoken wherever its files are present.

    python -m model.prefix     # prints a few entries and the build times (needs tiktoken's cached GPT-2 BPE)
    python -m model.prefix --write-stored   # rewrites the stored copy from tiktoken's files
"""
from __future__ import annotations

import functools
import gzip
import io
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor

from perf.collectives import all_gather_single


# ours: the whole build over GPT-2's 50,257 ids (int32 .npy, gzipped), for machines whose tiktoken
# has no GPT-2 files and no network to fetch them
STORED_TABLE = Path(__file__).with_name("gpt2_prefix_table.npy.gz")
GPT2_IDS = 50257


def gpt2_encoding():
    """tiktoken's GPT-2 encoding (read from TIKTOKEN_CACHE_DIR; tiktoken keeps it once loaded)."""
    import tiktoken

    return tiktoken.get_encoding("gpt2")


@functools.cache
def gpt2_bpe_available() -> bool:
    """Whether tiktoken can load GPT-2's BPE files (from its cache, or downloaded now): True loads
    them (the one-time load a run does off the clock); False sends the builds to STORED_TABLE."""
    try:
        gpt2_encoding()
    except Exception:  # no cached files and no network (requests' errors), a bad download (ValueError), ...
        return False
    return True


def stored_prefix_table(vocab_size: int) -> Tensor:
    """int64 [vocab_size]: build_prefix_table(vocab_size) read from STORED_TABLE (a prefix whose id
    is past the table is −1, as in the build; ids past GPT-2's are −1)."""
    with gzip.open(STORED_TABLE, "rb") as f:
        stored = np.load(io.BytesIO(f.read())).astype(np.int64)  # (50257,)
    table = np.full(vocab_size, -1, dtype=np.int64)
    n = min(vocab_size, stored.size)
    table[:n] = np.where(stored[:n] < vocab_size, stored[:n], -1)
    return torch.from_numpy(table)


def write_stored_table(path: Path = STORED_TABLE) -> None:
    """Rebuild the stored copy from tiktoken's files (byte-stable: gzip without a timestamp)."""
    buffer = io.BytesIO()
    np.save(buffer, build_prefix_table(GPT2_IDS, gpt2_token_bytes()).numpy().astype("<i4"))
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(gzip.compress(buffer.getvalue(), compresslevel=9, mtime=0))
    tmp.replace(path)


def gpt2_token_bytes() -> dict[bytes, int]:
    """GPT-2's mergeable ranks, bytes → token id (ids 0..50255; EOT is not a byte string)."""
    return gpt2_encoding()._mergeable_ranks


def build_prefix_table(vocab_size: int, token_bytes: dict[bytes, int] | None = None) -> Tensor:
    """int64 [vocab_size]: the longest proper byte-prefix token of each id, −1 where none. GPT-2's
    (token_bytes None) from tiktoken's files, else from the stored copy."""
    if token_bytes is None and not gpt2_bpe_available():
        return stored_prefix_table(vocab_size)
    token_bytes = gpt2_token_bytes() if token_bytes is None else token_bytes
    # a Python list, made a tensor once: 50k single-element tensor writes cost ~0.1 s on a CPU core
    table = [-1] * vocab_size
    open_prefixes: list[bytes] = []
    for s in sorted(token_bytes):
        while open_prefixes and not s.startswith(open_prefixes[-1]):
            open_prefixes.pop()
        token = token_bytes[s]
        if open_prefixes and token < vocab_size:
            prefix = token_bytes[open_prefixes[-1]]
            table[token] = prefix if prefix < vocab_size else -1
        open_prefixes.append(s)
    return _as_tensor(table)


def _as_tensor(ids: list[int]) -> Tensor:
    """int64 tensor of a list of ints, through numpy (torch.tensor(list) takes ~14 ms for 50k ids,
    numpy ~1.5 ms, measured on a CPU core)."""
    return torch.from_numpy(np.array(ids, dtype=np.int64))


def prefix_slice_bounds(vocab_size: int, rank: int, world_size: int) -> tuple[int, int]:
    """The ids [lo, hi) rank `rank` answers: equal slices of ceil(vocab_size / world_size) ids (the
    all-gather needs equal sizes), the last one short or empty."""
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"prefix table slice: rank {rank} must be in [0, world_size={world_size})")
    if vocab_size < 1:
        raise ValueError(f"prefix table slice: vocab_size must be positive, got {vocab_size}")
    chunk = -(-vocab_size // world_size)
    lo = min(rank * chunk, vocab_size)
    return lo, min(lo + chunk, vocab_size)


def _slice_bytes(token_bytes: dict[bytes, int] | None, lo: int, hi: int) -> tuple[dict[bytes, int], list]:
    """The bytes → id dict and the byte strings of ids lo..hi−1 (None for an id that is none).

    For GPT-2 each id is asked of tiktoken (its Rust decoder, ~0.4 µs an id), so a slice never
    touches the other ids; a hand-made dict (tests) is inverted whole, which is cheap at its size."""
    if token_bytes is None:
        encoding = gpt2_encoding()
        ranks, decode = encoding._mergeable_ranks, encoding.decode_single_token_bytes
        strings = [decode(t) for t in range(lo, min(hi, encoding.n_vocab))]
        strings += [None] * (hi - lo - len(strings))  # padding ids
        # special tokens (EOT) decode to their text, which is no mergeable byte string
        return ranks, [b if ranks.get(b) == lo + i else None for i, b in enumerate(strings)]
    by_id = {i: b for b, i in token_bytes.items()}
    return token_bytes, [by_id.get(t) for t in range(lo, hi)]


def build_prefix_table_slice(vocab_size: int, rank: int, world_size: int,
                             token_bytes: dict[bytes, int] | None = None) -> Tensor:
    """int64 [hi − lo]: build_prefix_table(vocab_size)[lo:hi] for this rank's ids [lo, hi) (see
    prefix_slice_bounds), computed from those ids alone."""
    lo, hi = prefix_slice_bounds(vocab_size, rank, world_size)
    if token_bytes is None and not gpt2_bpe_available():
        return stored_prefix_table(vocab_size)[lo:hi]
    ranks, strings = _slice_bytes(token_bytes, lo, hi)
    get = ranks.get
    out = [-1] * (hi - lo)
    for i, b in enumerate(strings):
        if b is None:
            continue
        n = len(b) - 1
        while n:  # longest proper prefix first; GPT-2 averages 2.1 lookups an id
            prefix = get(b[:n])
            if prefix is not None:
                # as the whole build: the longest prefix decides, even when its id is past the table
                out[i] = prefix if prefix < vocab_size else -1
                break
            n -= 1
    return _as_tensor(out)


def build_prefix_table_sharded(vocab_size: int, rank: int, world_size: int, device: torch.device | str,
                               group: dist.ProcessGroup | None = None) -> Tensor:
    """The whole int64 [vocab_size] table on `device`, each of the `world_size` processes of `group`
    building its slice of GPT-2's table and one all-gather assembling them (rank order =
    id order). Every process of the group must call it. No host sync: on CUDA the gather is queued
    on the current stream."""
    if not dist.is_initialized():
        raise RuntimeError("build_prefix_table_sharded needs an initialized process group "
                           "(use build_prefix_table in a single process)")
    group_size, group_rank = dist.get_world_size(group), dist.get_rank(group)
    if (group_size, group_rank) != (world_size, rank):
        raise ValueError(f"build_prefix_table_sharded: called as rank {rank} of {world_size}, but the process "
                         f"group has this process as rank {group_rank} of {group_size}")
    chunk = -(-vocab_size // world_size)
    piece = torch.full((chunk,), -1, dtype=torch.long)  # padded: the last slice may be short or empty
    own = build_prefix_table_slice(vocab_size, rank, world_size)
    piece[:own.numel()] = own
    gathered = torch.empty(world_size * chunk, dtype=torch.long, device=device)
    all_gather_single(gathered, piece.to(device), group=group)
    return gathered[:vocab_size]


if __name__ == "__main__":
    import sys
    import time

    if sys.argv[1:] == ["--write-stored"]:
        if not gpt2_bpe_available():
            raise SystemExit("tiktoken cannot load GPT-2's BPE files (no cache, no network): set TIKTOKEN_CACHE_DIR")
        write_stored_table()
        print(f"wrote {STORED_TABLE}")
        raise SystemExit(0)

    def best_ms(fn, repeats: int = 5) -> float:  # the least of a few runs: a shared CPU is noisy
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append(1000 * (time.perf_counter() - t0))
        return min(times)

    t0 = time.perf_counter()
    gpt2_token_bytes()  # tiktoken's first load, timed apart from the build
    load_ms = 1000 * (time.perf_counter() - t0)
    table = build_prefix_table(50304)
    enc = gpt2_token_bytes()
    by_id = {i: b for b, i in enc.items()}
    for token in (1000, 20000, 40000):
        print(token, by_id[token], "->", int(table[token]), by_id.get(int(table[token])))
    print("tokens with a prefix:", int((table >= 0).sum()))
    whole_ms = best_ms(lambda: build_prefix_table(50304))
    slice_ms = [best_ms(lambda: build_prefix_table_slice(50304, r, 8)) for r in range(8)]
    print(f"tiktoken load {load_ms:.0f} ms; whole build {whole_ms:.1f} ms; slices of 8 ranks "
          + " ".join(f"{t:.1f}" for t in slice_ms) + f" ms (max {max(slice_ms):.1f}, sum {sum(slice_ms):.1f})")
