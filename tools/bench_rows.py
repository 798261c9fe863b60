"""Bytes each rank moves for the n-gram table's rows: the former all-gather exchange against
optim/row_exchange.py's planned one, on real text at the record's shapes, from the host plans alone
(no process group, no GPU).

    python tools/bench_rows.py                                   # Tiny Shakespeare, 8 ranks x 49,152 tokens
    python tools/bench_rows.py --text my.txt --world-size 8 --tokens-per-rank 49152 --cycle-steps 4

The text is tokenized with tiktoken's GPT-2 encoding (offline: TIKTOKEN_CACHE_DIR defaults to
../shared/tiktoken_cache beside the repository) and cut into the stage-2 batches of a record run
(record #360: 8 ranks x 49,152 tokens per step, table events every 4th step from step 336, the
record's 84,602,880-row table of 768 bf16), wrapping around the text as needed. Each rank's 2T
n-gram row ids (data/ngram.py) are planned with optim.row_exchange.split_requests / plan_push, and
the bytes counted per rank, to and from the other ranks (a rank's own rows never leave it):

* old pull (the former optim/manager.py pull_rows): all_gather of (count, lo, hi) and of the
  distinct ids padded to the largest count (int64), then an all_to_all of [W, width, 768] bf16
  answers, zeros where the rank does not own the id;
* old push (gather_owned_rows), per table event: all_gather of the count, of the cycle's distinct
  ids padded to the largest count (int64) and of the fp32 [width, 768] merged rows;
* new pull: counts and exactly the distinct ids asked of each owner (int64, host group), then
  exactly those rows (bf16); new push, per event: each owner's distinct rows of the cycle (fp32),
  no ids (the owner knows them from the cycle's pulls).

It also times the host planning (numpy) per step and per event. When the text wraps, the steps of
a cycle repeat text, so the cycle's distinct rows (both pushes' bytes) are fewer than on FineWeb.
"""
import os
import statistics
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))  # the repo root, when run as a script
SHARED = REPO_ROOT.parent / "shared"
os.environ.setdefault("HF_HUB_OFFLINE", "1")
if (SHARED / "tiktoken_cache").is_dir():
    os.environ.setdefault("TIKTOKEN_CACHE_DIR", str(SHARED / "tiktoken_cache"))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from cli import ArgumentParser, exit_on_config_error, positive_int  # noqa: E402
from config import ConfigError, ModelConfig  # noqa: E402
from data.ngram import ngram_row_ids  # noqa: E402
from optim.row_exchange import RowPlan, plan_push, split_requests  # noqa: E402

ID_BYTES, BF16, FP32 = 8, 2, 4  # ids travel as int64; pulled rows bf16; pushed gradient rows fp32
MB = 1e6


def tokens_of(path: Path) -> np.ndarray:
    import tiktoken
    text = path.read_text(encoding="utf-8")
    return np.asarray(tiktoken.get_encoding("gpt2").encode_ordinary(text), dtype=np.int32)


def plans_of(requests: list[np.ndarray], num_rows: int) -> tuple[list[RowPlan], float]:
    """Every rank's RowPlan of one step, as RowExchange.plan builds them but with the count and id
    exchange done here (no process group); and the median host time of split_requests."""
    world = len(requests)
    split, times = [], []
    for ids in requests:
        t0 = time.perf_counter()
        split.append(split_requests(ids, num_rows, world))
        times.append(time.perf_counter() - t0)
    rows_per_rank = num_rows // world
    offsets = [np.concatenate([[0], np.cumsum(ask)]) for _, _, ask in split]
    plans = []
    for rank, (unique, inverse, ask) in enumerate(split):
        serve = tuple(int(split[a][2][rank]) for a in range(world))
        served = np.concatenate([split[a][0][offsets[a][rank]:offsets[a][rank + 1]] for a in range(world)])
        served = served - rank * rows_per_rank
        plans.append(RowPlan(rank, world, unique, inverse, tuple(int(c) for c in ask), serve, served,
                             torch.from_numpy(inverse), torch.from_numpy(served)))
    return plans, statistics.median(times)


def others(counts, rank: int) -> int:
    return sum(c for i, c in enumerate(counts) if i != rank)


def main(argv=None) -> None:
    parser = ArgumentParser(prog="python -m tools.bench_rows", description=__doc__.split("\n\n")[0])
    parser.add_argument("--text", type=Path, default=SHARED / "data" / "tinyshakespeare.txt")
    parser.add_argument("--world-size", type=positive_int, default=8)            # record #360: 8 ranks
    parser.add_argument("--tokens-per-rank", type=positive_int, default=49152)   # record #360: stage-2 batch per rank
    parser.add_argument("--cycle-steps", type=positive_int, default=4)           # record #360: events every 4th step from 336
    with exit_on_config_error("python -m tools.bench_rows"):
        args = parser.parse_args(argv)
        if not args.text.is_file():
            raise ConfigError(f"--text {args.text}: no such file; pass an English text file (default: "
                              f"../shared/data/tinyshakespeare.txt)")
    world, tokens, steps = args.world_size, args.tokens_per_rank, args.cycle_steps
    cfg = ModelConfig()
    num_rows, dim = cfg.ngram_rows, cfg.model_dim                      # record #360: 84,602,880 x 768

    stream = tokens_of(args.text)
    needed = world * tokens * steps
    print(f"{args.text.name}: {stream.size:,} GPT-2 tokens; a {steps}-step cycle of {world} ranks x {tokens:,} "
          f"tokens needs {needed:,} ({needed / stream.size:.2f}x the text, wrapped around)")
    stream = np.resize(stream, needed)
    cycle, plan_times = [], []
    for step in range(steps):
        requests = [ngram_row_ids(stream[(step * world + r) * tokens:(step * world + r + 1) * tokens],
                                  num_rows // 2).numpy() for r in range(world)]
        plans, median_s = plans_of(requests, num_rows)
        cycle.append(plans)
        plan_times.append(median_s)
    push_times, routes = [], []
    for rank in range(world):
        t0 = time.perf_counter()
        routes.append(plan_push([plans[rank] for plans in cycle], np.arange(world + 1) * (num_rows // world)))
        push_times.append(time.perf_counter() - t0)

    first = cycle[0]
    width = max(p.unique.size for p in first)                     # old pull: padded to the largest count
    old_pull = (world - 1) * (3 * ID_BYTES + width * ID_BYTES + width * dim * BF16)
    width_c = max(r.cycle_ids.size for r in routes)              # old push: the cycle's largest count
    old_push = (world - 1) * (ID_BYTES + width_c * ID_BYTES + width_c * dim * FP32)

    head = (f"{'rank':>4} {'ids':>7} {'distinct':>8} | {'old pull':>9} {'new sent':>9} {'new recv':>9} {'old/new':>7} | "
            f"{'cycle rows':>10} {'old push':>9} {'new sent':>9} {'new recv':>9} {'old/new':>7}")
    print(f"\nper rank, MB (1e6 bytes) to / from the other ranks; pull per step (step 0), push per table "
          f"event ({steps}-step cycle); old = the same bytes sent and received")
    print(head)
    print("-" * len(head))
    totals = np.zeros(6)
    for rank, (plan, route) in enumerate(zip(first, routes)):
        pull_sent = (world - 1) * ID_BYTES + others(plan.ask_counts, rank) * ID_BYTES \
            + others(plan.serve_counts, rank) * dim * BF16
        pull_recv = (world - 1) * ID_BYTES + others(plan.serve_counts, rank) * ID_BYTES \
            + others(plan.ask_counts, rank) * dim * BF16
        push_sent = others(route.send_counts, rank) * dim * FP32
        push_recv = others(route.recv_counts, rank) * dim * FP32
        row = np.array([old_pull, pull_sent, pull_recv, old_push, push_sent, push_recv])
        totals += row
        print(f"{rank:>4} {plan.num_ids:>7,} {plan.unique.size:>8,} | {old_pull / MB:>9.1f} {pull_sent / MB:>9.1f} "
              f"{pull_recv / MB:>9.1f} {2 * old_pull / (pull_sent + pull_recv):>6.1f}x | {route.cycle_ids.size:>10,} "
              f"{old_push / MB:>9.1f} {push_sent / MB:>9.1f} {push_recv / MB:>9.1f} "
              f"{2 * old_push / (push_sent + push_recv):>6.1f}x")
    print("-" * len(head))
    print(f"{'all':>4} {'':>7} {'':>8} | {totals[0] / MB:>9.1f} {totals[1] / MB:>9.1f} {totals[2] / MB:>9.1f} "
          f"{2 * totals[0] / (totals[1] + totals[2]):>6.1f}x | {'':>10} {totals[3] / MB:>9.1f} {totals[4] / MB:>9.1f} "
          f"{totals[5] / MB:>9.1f} {2 * totals[3] / (totals[4] + totals[5]):>6.1f}x")
    per_step_push = totals[3] / steps, (totals[4] + totals[5]) / 2 / steps
    print(f"\nper step, all ranks: pull old {totals[0] / MB:,.0f} MB vs new {totals[1] / MB:,.0f} MB sent; "
          f"push (per event / {steps}) old {per_step_push[0] / MB:,.0f} MB vs new {per_step_push[1] / MB:,.0f} MB sent")
    print(f"host planning (numpy, this machine): plan (split_requests of {2 * tokens:,} ids) median "
          f"{statistics.median(plan_times) * 1e3:.1f} ms per step; plan_push of a {steps}-step cycle median "
          f"{statistics.median(push_times) * 1e3:.1f} ms per event")


if __name__ == "__main__":
    main()
