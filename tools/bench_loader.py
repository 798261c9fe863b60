"""Host batch-assembly time of the training loader for the record's stage-2 batch.

    python tools/bench_loader.py                    # 49,152 tokens per rank, doc cap 3072, 8 ranks
    python tools/bench_loader.py --tokens-per-rank 16384 --doc-cap 896

Writes a synthetic shard (FineWeb-like document lengths: log-normal, median ~490, mean ~810 tokens)
to a temp dir, then times TrainLoader.next_batch with prefetch off (the whole assembly: the 8-rank
document split, this rank's concatenation, the n-gram row and sign hashes, cu_seqlens), its parts,
and, with prefetch on, what a caller that trains ~33 ms per step still waits. Target: < 5 ms.
"""
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root, when run as a script

import numpy as np  # noqa: E402

from cli import ArgumentParser, exit_on_config_error, positive_int  # noqa: E402
from data.loader import TrainLoader, attention_segment_ends, document_spans  # noqa: E402
from data.ngram import ngram_row_ids, ngram_sign_rows  # noqa: E402
from data.shards import BOS_ID, read_shard, write_shard  # noqa: E402


def synthetic_shard(path: Path, num_tokens: int, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    lengths = np.maximum(1, rng.lognormal(mean=6.2, sigma=1.0, size=num_tokens // 300)).astype(np.int64)
    lengths = lengths[:np.searchsorted(np.cumsum(lengths + 1), num_tokens)]
    tokens = rng.integers(0, BOS_ID, int((lengths + 1).sum()), dtype=np.uint16)
    tokens[np.cumsum(np.r_[0, lengths[:-1] + 1])] = BOS_ID  # each document starts with BOS
    write_shard(path, tokens)


def summary(times_s: list[float]) -> str:
    ms = [t * 1e3 for t in times_s]
    return f"median {statistics.median(ms):6.2f} ms  mean {statistics.mean(ms):6.2f} ms  max {max(ms):6.2f} ms"


def main(argv=None):
    parser = ArgumentParser(prog="python -m tools.bench_loader", description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens-per-rank", type=positive_int, default=49152, help="stage 2 (record #360's config.py)")
    parser.add_argument("--doc-cap", type=positive_int, default=3072, help="stage 2 doc cap (record #360's config.py)")
    parser.add_argument("--world-size", type=positive_int, default=8)
    parser.add_argument("--steps", type=positive_int, default=40)
    parser.add_argument("--shard-tokens", type=positive_int, default=40_000_000)
    parser.add_argument("--train-ms", type=float, default=33.0, help="simulated step time (#360 stage 2)")
    with exit_on_config_error("python -m tools.bench_loader"):
        args = parser.parse_args(argv)
    T, cap, W = args.tokens_per_rank, args.doc_cap, args.world_size

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "synthetic_train_000001.bin"
        synthetic_shard(path, args.shard_tokens)
        print(f"host: {os.cpu_count()} CPUs; shard: {args.shard_tokens:,} tokens; batch: {T:,} tokens per rank, "
              f"doc cap {cap}, {W} ranks")

        loader = TrainLoader([path], 0, W, prefetch=False)
        loader.next_batch(T, cap)  # reads the shard and builds its BOS index
        assemble = []
        for _ in range(args.steps):
            start = time.perf_counter()
            batch = loader.next_batch(T, cap)
            assemble.append(time.perf_counter() - start)
        loader.close()

        tokens = read_shard(path)
        bos = np.flatnonzero(tokens == BOS_ID).tolist()
        spans_t, concat_t, hash_t, cu_t = [], [], [], []
        next_bos = 0
        for _ in range(args.steps):
            t0 = time.perf_counter()
            spans, next_bos = document_spans(bos, tokens.size, next_bos, W, T, cap)
            t1 = time.perf_counter()
            buf = np.concatenate([tokens[s:e] for s, e in spans[0]])
            inputs = buf[:-1].astype(np.int32)
            t2 = time.perf_counter()
            ngram_row_ids(inputs)
            ngram_sign_rows(inputs)
            t3 = time.perf_counter()
            attention_segment_ends([e - s for s, e in spans[0]], 2560)
            t4 = time.perf_counter()
            spans_t.append(t1 - t0), concat_t.append(t2 - t1), hash_t.append(t3 - t2), cu_t.append(t4 - t3)

        loader = TrainLoader([path], 0, W, prefetch=True)
        loader.next_batch(T, cap)
        waits = []
        for _ in range(args.steps):
            time.sleep(args.train_ms / 1e3)  # the GPU step, during which the next batch is assembled
            start = time.perf_counter()
            loader.next_batch(T, cap)
            waits.append(time.perf_counter() - start)
        loader.close()

    print(f"segments per batch: {int((batch.cu_seqlens < T).sum())} of {batch.cu_seqlens.numel()} rows")
    print(f"assembly, prefetch off:   {summary(assemble)}   (target < 5 ms)")
    print(f"  document split ({W} ranks): {summary(spans_t)}")
    print(f"  concatenate + int32:     {summary(concat_t)}")
    print(f"  n-gram rows + signs:     {summary(hash_t)}")
    print(f"  segment ends:            {summary(cu_t)}")
    print(f"caller wait, prefetch on: {summary(waits)}   (after {args.train_ms:.0f} ms of simulated training)")


if __name__ == "__main__":
    main()
