"""The n-gram table's row exchange, planned on the host: which rank asks which rows of whom, so
that the device only moves exactly the requested rows, with sizes it never has to read back
(record #360, modules §4.5 "RowOwners"; upstream track_1_short plans the same way).

The table (record: 84,602,880 rows of 768 bf16) is split into contiguous equal per-rank ranges,
rank r owning [r·R, (r+1)·R) with R = num_rows // W (model/embeddings.py `ngram_shard_range`).
Every step each rank reads the rows of its batch's 2T n-gram ids, and at each table event every
owner needs the gradients of its rows from every rank.

Why the host: the ids exist there before they are uploaded (data/loader.py builds
`Batch.ngram_ids`, int32 (2T,), as a host tensor). So everything whose size depends on their
values (the sorted distinct ids, the inverse map, how many ids each owner is asked for, how many
each asker asks) is computed with numpy, and the counts and ids travel over a CPU (gloo) process
group. The device then runs only fixed-size work whose sizes the host already knows (index_select,
`all_to_all_single` with host split sizes, index_add_): no `.item()`, no `torch.unique`, no boolean
masks, nothing read back, so a GPU never waits on the host for this.

    exchange = RowExchange(cfg.ngram_rows, rank, world_size, device)   # every rank, same point
    plan = exchange.plan(batch.ngram_ids)          # host; a collective over the host group
    rows = exchange.pull(table.rows, plan)         # (2T, 768) bf16, bit-exact copies
    ...backward...
    ngram_opt.accumulate(plan, rows.grad)          # optim/manager.py NgramRowOptimizer
    ngram_opt.step(step)                           # at table events: exchange.push, row-sparse Adam

The ids go over the host group (not the device) because the owner needs them on the host: at a
table event it plans its gradient merge (which rows it receives from whom, their distinct set and
the merge index) from the ids it was asked for during the cycle, and a device copy of them could
only be read back with a sync. The push then reuses the pull's routes reversed: no count or id
exchange at events. Traffic per rank (perf/bench_rows.py measures it on real text): the pull
sends each owner its distinct ids (int64, host group) and gets back exactly those rows (bf16);
the push sends each owner one fp32 row per distinct row of the cycle it owns.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor


def _host_ids(row_ids, what: str) -> np.ndarray:
    """row_ids (a host tensor, numpy array or sequence) as a 1-D int64 numpy array."""
    if isinstance(row_ids, Tensor):
        if row_ids.device.type != "cpu":
            raise ValueError(f"{what}: row_ids must be a host tensor (plan from data/loader.py "
                             f"Batch.ngram_ids before .to(device)), got one on {row_ids.device}")
        row_ids = row_ids.numpy()
    ids = np.asarray(row_ids)
    if ids.ndim != 1:
        raise ValueError(f"{what}: row_ids must be 1-D [N], got shape {ids.shape}")
    if ids.size and not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"{what}: row_ids must be integers, got dtype {ids.dtype}")
    return ids.astype(np.int64, copy=False)


def split_requests(row_ids, num_rows: int, world_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Host planning of one rank's request, no communication: (unique (U,) int64 sorted distinct
    ids, inverse (N,) int64 with row_ids[i] == unique[inverse[i]], ask_counts (W,) int64: how
    many of `unique` each owner holds; they are contiguous in `unique` since it is sorted).

    Raises IndexError naming the table's range when an id is outside [0, num_rows)."""
    ids = _host_ids(row_ids, "RowExchange.plan")
    if ids.size and (ids.min() < 0 or ids.max() >= num_rows):
        raise IndexError(f"RowExchange.plan: row ids span [{ids.min()}, {ids.max()}], outside the "
                         f"table's rows [0, {num_rows})")
    unique, inverse = np.unique(ids, return_inverse=True)                  # (U,), (N,)
    starts = np.arange(world_size + 1, dtype=np.int64) * (num_rows // world_size)
    ask_counts = np.diff(np.searchsorted(unique, starts))                  # (W,)
    return unique, inverse.reshape(-1).astype(np.int64, copy=False), ask_counts.astype(np.int64)


def _offsets(counts: Sequence[int]) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(counts, dtype=np.int64)])


@dataclass(frozen=True, eq=False)
class RowPlan:
    """One request's routes (from RowExchange.plan): host arrays, and device copies of the two
    index vectors the device needs, uploaded once."""
    rank: int
    world_size: int
    unique: np.ndarray               # (U,) int64: distinct global row ids asked, sorted
    inverse: np.ndarray              # (N,) int64: row_ids[i] == unique[inverse[i]]
    ask_counts: tuple[int, ...]      # (W,): how many of `unique` owner o holds (contiguous)
    serve_counts: tuple[int, ...]    # (W,): how many ids asker a asks of this rank
    served: np.ndarray               # (S,) int64: local rows (global - lo) asked of this rank, by asker, each asker's sorted
    inverse_dev: Tensor              # (N,) int64 on the exchange's device
    served_dev: Tensor               # (S,) int64 on the exchange's device

    @property
    def num_ids(self) -> int:
        """N: how many ids (with repeats) the request had."""
        return int(self.inverse.size)

    def served_by(self, asker: int) -> np.ndarray:
        """The local rows `asker` asked of this rank, sorted."""
        off = _offsets(self.serve_counts)
        return self.served[off[asker]:off[asker + 1]]


class RowExchange:
    """Pull and push of a row-sharded table's rows between ranks, planned on the host.

    num_rows: the table's rows (divisible by world_size); device: where the shard lives; group:
    a CPU (gloo) process group for the host metadata. Default: on world_size > 1 with a non-gloo
    default backend (NCCL), a new gloo group (a collective: every rank constructs its exchange at
    the same point); on a gloo default backend, the default group. The rows themselves travel on
    the default group. world_size == 1 needs no torch.distributed at all."""

    def __init__(self, num_rows: int, rank: int, world_size: int, device, group=None):
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"RowExchange: rank {rank} is outside world size {world_size}")
        if num_rows < 1 or num_rows % world_size:
            raise ValueError(f"RowExchange: num_rows={num_rows} rows do not shard evenly over {world_size} ranks")
        self.num_rows, self.rank, self.world_size = num_rows, rank, world_size
        self.rows_per_rank = num_rows // world_size
        self.lo, self.hi = rank * self.rows_per_rank, (rank + 1) * self.rows_per_rank
        self.device = torch.device(device)
        self.starts = np.arange(world_size + 1, dtype=np.int64) * self.rows_per_rank  # owner o: [starts[o], starts[o+1])
        if world_size > 1:
            if not (dist.is_available() and dist.is_initialized()):
                raise RuntimeError(f"RowExchange: world_size={world_size} needs an initialized process group")
            if (dist.get_rank(), dist.get_world_size()) != (rank, world_size):
                raise ValueError(f"RowExchange: rank {rank} of {world_size} disagrees with the process "
                                 f"group (rank {dist.get_rank()} of {dist.get_world_size()})")
            if group is None and dist.get_backend() != "gloo":
                group = dist.new_group(backend="gloo")
        self.group = group

    # --- planning (host) ----------------------------------------------------------------------
    def plan(self, row_ids) -> RowPlan:
        """Routes for fetching rows `row_ids` (host int tensor or array [N], global ids, any order,
        repeats allowed). Host work only; on world_size > 1 a collective over the host group
        (every rank plans the same number of requests in the same order)."""
        unique, inverse, ask = split_requests(row_ids, self.num_rows, self.world_size)
        if self.world_size == 1:
            serve, served = ask, unique - self.lo
        else:
            serve_t = torch.empty(self.world_size, dtype=torch.int64)      # (W,): asked of me, per asker
            dist.all_to_all_single(serve_t, torch.from_numpy(ask), group=self.group)
            serve = serve_t.numpy()
            served_t = torch.empty(int(serve.sum()), dtype=torch.int64)    # (S,) global ids asked of me
            dist.all_to_all_single(served_t, torch.from_numpy(unique), serve.tolist(), ask.tolist(),
                                   group=self.group)
            served = served_t.numpy() - self.lo
            if served.size and (served.min() < 0 or served.max() >= self.rows_per_rank):
                raise RuntimeError(f"RowExchange.plan: rank {self.rank} was asked for rows outside its "
                                   f"[{self.lo}, {self.hi}): the ranks disagree on num_rows or the split")
        inverse_dev, served_dev = self._upload(inverse, served)
        return RowPlan(self.rank, self.world_size, unique, inverse, tuple(int(c) for c in ask),
                       tuple(int(c) for c in serve), served, inverse_dev, served_dev)

    def _upload(self, *arrays: np.ndarray) -> list[Tensor]:
        """int64 host arrays -> device tensors: one pinned buffer and one non-blocking copy on CUDA
        (the caching host allocator keeps the buffer until the copy is done); plain tensors on CPU."""
        arrays = [np.ascontiguousarray(a, dtype=np.int64) for a in arrays]
        if self.device.type == "cpu":
            return [torch.from_numpy(a) for a in arrays]
        sizes = [int(a.size) for a in arrays]
        host = torch.empty(sum(sizes), dtype=torch.int64, pin_memory=self.device.type == "cuda")
        if sizes:
            np.concatenate(arrays, out=host.numpy())
        return list(host.to(self.device, non_blocking=True).split(sizes))

    def _check(self, plan: RowPlan) -> None:
        if (plan.rank, plan.world_size) != (self.rank, self.world_size):
            raise ValueError(f"RowExchange: a plan of rank {plan.rank} of {plan.world_size} used on rank "
                             f"{self.rank} of {self.world_size}")

    # --- device work (no host syncs) -----------------------------------------------------------
    def pull(self, table_shard: Tensor, plan: RowPlan, out: Tensor | None = None) -> Tensor:
        """The plan's rows, (N, D) in the shard's dtype, bit-exact copies: each owner index-selects
        the rows asked of it and one all_to_all_single (host-known splits) returns them; the asker
        then expands its distinct rows to the N requested positions. out: an (N, D) buffer to
        expand into (a static buffer a captured step reads), returned; else a fresh tensor.
        `start_pull(...).finish(out)`, waited at once."""
        return self.start_pull(table_shard, plan).finish(out)

    def start_pull(self, table_shard: Tensor, plan: RowPlan) -> "PendingPull":
        """The exchange of `pull`, launched and not waited (async_op): its `finish` waits and
        expands. What the table holds now is what `finish` returns, so nothing may write the
        table's rows in between (training.Run's row prefetch pulls a step ahead only across steps
        that are not table events)."""
        self._check(plan)
        if table_shard.dim() != 2 or table_shard.size(0) != self.rows_per_rank:
            raise ValueError(f"RowExchange.pull: table_shard must be [rows_per_rank={self.rows_per_rank}, D], "
                             f"got {tuple(table_shard.shape)}")
        answers = table_shard.index_select(0, plan.served_dev)              # (S, D): by asker
        if self.world_size == 1:
            return PendingPull(plan, answers, None, answers)                # (U, D)
        rows = table_shard.new_empty((plan.unique.size, table_shard.size(1)))  # (U, D): by owner = sorted
        work = dist.all_to_all_single(rows, answers, list(plan.ask_counts), list(plan.serve_counts), async_op=True)
        return PendingPull(plan, rows, work, answers)

    def push(self, held: Sequence[tuple[RowPlan, Tensor]], dim: int) -> tuple[Tensor, Tensor]:
        """A table event's gradient exchange (a collective on world_size > 1).

        held: this rank's (plan, gradient merged per distinct row (U_k, D) fp32) pairs of the cycle,
        in step order. Each rank first sums its cycle per distinct row (step order, fp32 from zero),
        then sends each owner the rows it owns along the pulls' routes reversed; the owner sums
        what it receives per row (sender order, fp32 from zero). Returns (rows (M,) int64: the
        distinct touched rows of this rank's shard, sorted; sums (M, D) fp32). The merge indices
        are planned on the host (plan_push); only the rows move on the device."""
        for plan, grad in held:
            self._check(plan)
            if grad.shape != (plan.unique.size, dim) or grad.dtype != torch.float32:
                raise ValueError(f"RowExchange.push: a held gradient must be fp32 [{plan.unique.size}, {dim}] "
                                 f"(one row per distinct id of its plan), got {grad.dtype} {tuple(grad.shape)}")
        routes = plan_push([plan for plan, _ in held], self.starts)
        *positions, rows, merge_index = self._upload(*routes.positions, routes.rows, routes.merge_index)
        cycle = torch.zeros((routes.cycle_ids.size, dim), dtype=torch.float32, device=self.device)  # (C, D)
        for (_, grad), pos in zip(held, positions):
            cycle.index_add_(0, pos, grad)
        if self.world_size == 1:
            received = cycle                                                            # (R = C, D)
        else:
            received = cycle.new_empty((routes.merge_index.size, dim))                  # (R, D): by sender
            dist.all_to_all_single(received, cycle, list(routes.recv_counts), list(routes.send_counts))
        sums = torch.zeros((routes.rows.size, dim), dtype=torch.float32, device=self.device)  # (M, D)
        sums.index_add_(0, merge_index, received)
        return rows, sums


class PendingPull:
    """A launched row pull (RowExchange.start_pull): the distinct rows arriving in `rows` (U, D)."""

    def __init__(self, plan: RowPlan, rows: Tensor, work, answers: Tensor):
        self.plan, self.rows, self._work = plan, rows, work
        self._answers = answers  # the send buffer stays alive until the exchange is waited

    def wait(self) -> None:
        """Wait for the exchange (on CUDA the current stream waits; the host does not)."""
        if self._work is not None:
            self._work.wait()
            self._work, self._answers = None, None

    def finish(self, out: Tensor | None = None) -> Tensor:
        """Wait, then the plan's N rows: expanded into `out` (an (N, D) buffer, returned) or a
        fresh tensor."""
        self.wait()
        plan, rows = self.plan, self.rows
        if out is None:
            return rows.index_select(0, plan.inverse_dev)                   # (N, D)
        if out.shape != (plan.inverse_dev.numel(), rows.size(1)) or out.dtype != rows.dtype:
            raise ValueError(f"RowExchange.pull: out must be {rows.dtype} [{plan.inverse_dev.numel()}, {rows.size(1)}], "
                             f"got {out.dtype} {tuple(out.shape)}")
        with torch.no_grad():  # out may be a leaf that requires grad (the step's sink leaf)
            return torch.index_select(rows, 0, plan.inverse_dev, out=out)


@dataclass(frozen=True, eq=False)
class PushRoutes:
    """One rank's routes for a table event's gradients, planned on the host from its cycle's pull
    plans (the pulls' routes reversed: no exchange needed)."""
    cycle_ids: np.ndarray            # (C,) int64: this rank's distinct global rows of the cycle, sorted
    positions: list[np.ndarray]      # per held step k: (U_k,) int64 positions of its rows in cycle_ids
    send_counts: tuple[int, ...]     # (W,): rows of cycle_ids each owner holds (contiguous)
    recv_counts: tuple[int, ...]     # (W,): rows each sender sends this rank
    rows: np.ndarray                 # (M,) int64: the distinct local rows received, sorted
    merge_index: np.ndarray          # (R,) int64: received row j is rows[merge_index[j]] (R = sum recv_counts)


def _merge_sorted(runs: Sequence[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """The distinct values of sorted int64 arrays, sorted, and where each element of their
    concatenation is among them. A stable argsort (timsort: it merges the sorted runs) is several
    times faster here than np.unique's sort (measured 6.5 vs 20 ms, 4 runs of 57k ids)."""
    values = np.concatenate(runs) if runs else np.zeros(0, dtype=np.int64)
    order = np.argsort(values, kind="stable")
    ordered = values[order]
    first = np.ones(ordered.size, dtype=bool)              # first of its value in sorted order
    np.not_equal(ordered[1:], ordered[:-1], out=first[1:])
    inverse = np.empty(values.size, dtype=np.int64)
    inverse[order] = np.cumsum(first) - 1
    return ordered[first], inverse


def plan_push(plans: Sequence[RowPlan], starts: np.ndarray) -> PushRoutes:
    """Host planning of a table event from the cycle's plans (step order); starts (W + 1,): the
    owners' first rows. As a sender, a rank sends its cycle's distinct rows (sorted, so grouped by
    owner); as an owner, it receives from each sender the union of the rows that sender asked of
    it during the cycle, sorted: both sides derive the same counts from the same plans."""
    world = starts.size - 1
    cycle_ids, inverse = _merge_sorted([p.unique for p in plans])                  # (C,), (sum U_k,)
    positions = np.split(inverse, np.cumsum([p.unique.size for p in plans])[:-1]) if plans else []
    send_counts = np.diff(np.searchsorted(cycle_ids, starts))
    from_sender = [_merge_sorted([p.served_by(s) for p in plans])[0] for s in range(world)]
    rows, merge_index = _merge_sorted(from_sender)
    return PushRoutes(cycle_ids, positions, tuple(int(c) for c in send_counts),
                      tuple(int(a.size) for a in from_sender), rows, merge_index)
