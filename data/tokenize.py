"""Tokenize your own text into training and validation shards (GPT-2 BPE, the FineWeb shard format).

    python data/tokenize.py notes.md books/*.txt --out data/mytext --val-tokens 100000
    python -m data.tokenize corpus.jsonl --out data/corpus --name corpus

Inputs: `.jsonl` files hold one JSON object per line with a `text` field (one document each); every
other file is plain text (Markdown included), split into documents on blank-line runs (`--split
blank`, the default) or taken whole (`--split file`). Every document is preceded by the end-of-text
token 50256, as in the FineWeb shards, and encoded with tiktoken's "gpt2" encoding (special-token
text is encoded as ordinary text). Worker processes encode in parallel with a progress bar.

Output in --out: NAME_val_000000.bin holds the first --val-tokens tokens, then NAME_train_000001.bin,
NAME_train_000002.bin, ... hold --shard-tokens tokens each (the last one the rest). Documents run on
across shard boundaries, as in FineWeb (the loader starts batches at BOS, so a continuation is
skipped). Training reads them with TrainLoader("DIR/NAME_train_*.bin", ...).
"""
import os
import sys

if __name__ == "__main__" and not __package__:
    # Run as a script: Python put data/ first on sys.path, where this file would shadow the standard
    # library's `tokenize` (imported by inspect, linecache, tiktoken, ...). Put the repo root there.
    _data_dir = os.path.dirname(os.path.realpath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.realpath(p or os.curdir) != _data_dir]
    sys.path.insert(0, os.path.dirname(_data_dir))

import argparse  # noqa: E402  (after the sys.path fix above)
import json  # noqa: E402
import multiprocessing  # noqa: E402
from itertools import groupby  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
from tqdm import tqdm  # noqa: E402

from data.shards import BOS_ID, write_shard  # noqa: E402

SHARD_TOKENS = 100_000_000  # FineWeb shards hold 100M tokens (record #89's train_gpt.py)
DOCS_PER_TASK = 512  # documents per worker task: big enough to amortize pickling, small for progress

_encoding = None  # per worker process


def _init_worker():
    global _encoding
    import tiktoken
    _encoding = tiktoken.get_encoding("gpt2")


def encode_documents(docs: list[str]) -> np.ndarray:
    """Documents -> one uint16 array: BOS, doc 0's tokens, BOS, doc 1's tokens, ..."""
    tokens = []
    for doc in docs:
        tokens.append(BOS_ID)
        tokens.extend(_encoding.encode_ordinary(doc))
    return np.array(tokens, dtype=np.uint16)


def paragraphs(text: str) -> list[str]:
    """Runs of non-blank lines, each joined with newlines (blank = empty or whitespace only)."""
    lines = text.splitlines()
    return ["\n".join(run) for blank, run in groupby(lines, key=lambda line: not line.strip()) if not blank]


def read_documents(path: Path, split: str) -> list[str]:
    """The documents of one input file (see the module docstring)."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise SystemExit(f"{path}: cannot read as UTF-8 text: {e}")
    if path.suffix == ".jsonl":
        docs = []
        for lineno, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise SystemExit(f"{path}:{lineno}: not valid JSON: {e}")
            if not isinstance(record, dict) or not isinstance(record.get("text"), str):
                raise SystemExit(f"{path}:{lineno}: expected an object with a string 'text' field")
            docs.append(record["text"])
    elif split == "blank":
        docs = paragraphs(text)
    else:
        docs = [text]
    return [doc for doc in docs if doc.strip()]


def tokenize_documents(docs: list[str], workers: int) -> np.ndarray:
    """All documents, each preceded by BOS, as one uint16 array (in input order)."""
    tasks = [docs[i:i + DOCS_PER_TASK] for i in range(0, len(docs), DOCS_PER_TASK)]
    workers = min(workers, len(tasks))  # a small input does not need a process per core
    # Load the encoding here first: a failure (no network and no TIKTOKEN_CACHE_DIR) then stops the
    # run with its error, where in a pool initializer it would respawn workers forever; and the BPE
    # files are cached on disk before the workers read them.
    try:
        _init_worker()
    except Exception as e:
        raise SystemExit(f"tokenize: tiktoken could not load the GPT-2 encoding ({type(e).__name__}: {e}); "
                         f"it downloads the BPE files once, so allow network access or point "
                         f"TIKTOKEN_CACHE_DIR at a folder that holds them") from e
    bar = tqdm(total=sum(map(len, docs)), unit="char", unit_scale=True, desc="tokenizing")
    chunks = []
    if workers <= 1:
        results = map(encode_documents, tasks)
    else:
        # spawn: workers start clean (no forked threads), re-importing this module by its path or name
        pool = multiprocessing.get_context("spawn").Pool(workers, initializer=_init_worker)
        results = pool.imap(encode_documents, tasks)
    try:
        for task, tokens in zip(tasks, results):
            chunks.append(tokens)
            bar.update(sum(map(len, task)))
    finally:
        bar.close()
        if workers > 1:
            pool.close()
            pool.join()
    return np.concatenate(chunks) if chunks else np.zeros(0, dtype=np.uint16)


def write_shards(tokens: np.ndarray, out: Path, name: str, val_tokens: int, shard_tokens: int) -> list[Path]:
    """The val shard, then the train shards; removes stale NAME_train_* shards beyond the new last one."""
    paths = [out / f"{name}_val_{0:06d}.bin"]
    write_shard(paths[0], tokens[:val_tokens])
    for index, start in enumerate(range(val_tokens, tokens.size, shard_tokens), 1):
        paths.append(out / f"{name}_train_{index:06d}.bin")
        write_shard(paths[-1], tokens[start:start + shard_tokens])
    for stale in sorted(set(out.glob(f"{name}_train_*.bin")) - set(paths)):
        print(f"removing {stale} (left over from an earlier run with more shards)")
        stale.unlink()
    return paths


def main(argv=None):
    parser = argparse.ArgumentParser(
        prog="data/tokenize.py", description=__doc__.split("\n\n")[0],
        epilog="Documents: .jsonl inputs give one document per line (its 'text' field). Other inputs are "
               "plain text, split into documents on blank-line runs (--split blank, default) or one "
               "document per file (--split file). Every document is preceded by token 50256.")
    parser.add_argument("inputs", nargs="+", type=Path, metavar="INPUT", help="text, Markdown or JSONL files")
    parser.add_argument("--out", type=Path, required=True, help="output directory for the shards")
    parser.add_argument("--name", help="shard name prefix (default: the first input's file stem)")
    parser.add_argument("--val-tokens", type=int, default=None,
                        help="tokens in NAME_val_000000.bin, taken from the start (default: 10%% of all tokens)")
    parser.add_argument("--shard-tokens", type=int, default=SHARD_TOKENS,
                        help=f"tokens per training shard (default: {SHARD_TOKENS:,}, as FineWeb)")
    parser.add_argument("--split", choices=("blank", "file"), default="blank",
                        help="plain-text documents: split on blank-line runs (default) or one per file")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="tokenizer processes")
    args = parser.parse_args(argv)

    for path in args.inputs:
        if not path.is_file():
            parser.error(f"input {path} is not a file")
    if args.shard_tokens < 1:
        parser.error(f"--shard-tokens must be positive, got {args.shard_tokens}")
    name = args.name or args.inputs[0].stem
    docs = [doc for path in args.inputs for doc in read_documents(path, args.split)]
    if not docs:
        raise SystemExit(f"no documents in {', '.join(map(str, args.inputs))} (every input is empty)")
    tokens = tokenize_documents(docs, args.workers)
    val_tokens = tokens.size // 10 if args.val_tokens is None else args.val_tokens
    if not 0 < val_tokens < tokens.size:
        raise SystemExit(f"--val-tokens {val_tokens} must be in [1, {tokens.size}): the inputs hold "
                         f"{tokens.size:,} tokens and training needs some")
    paths = write_shards(tokens, args.out, name, val_tokens, args.shard_tokens)
    print(f"{len(docs):,} documents, {tokens.size:,} tokens: {val_tokens:,} validation, "
          f"{tokens.size - val_tokens:,} training in {len(paths) - 1} shard(s) -> {args.out}/{name}_*.bin")


if __name__ == "__main__":
    main()
