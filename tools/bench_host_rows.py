"""What the host table's worker thread must sustain: `HostRows`' row gathers and write-backs at the
recipe's per-step row counts, timed on this machine (issue 38, point 7).

    python -m tools.bench_host_rows                          # recipe, one process, stage-2 steps, 4 GiB table
    python -m tools.bench_host_rows --threads 2              # and with 2 intra-op threads / 2 split threads
    python -m tools.bench_host_rows --table-gib 8 --start 681 --steps 8 --seed 0
    python -m tools.bench_host_rows --config smoke --table-gib 0.004 --steps 2   # tiny (the test)

One process of `--config recipe --world-size 1` (perf/host_table.py) holds the whole 121 GiB table in
pageable host memory and one worker thread moves its rows. Per step the worker:
* gathers each micro-batch's distinct rows (one `start_gather` per lane: the process plays 8
  virtual ranks) into staging, the host half of `HostRows._gather` (then a host→device copy);
* at a table event also gathers the cycle's distinct rows (the row optimizer's `shard.gather`) and
  writes the new ones back (`index_copy_` after the device→host copy, `HostRows._write`).
The row counts are tools.cost's: `host_table_bytes` for each step of the schedule (its
UNIQUE_IDS_PER_STEP / UNIQUE_IDS_PER_CYCLE ratios, stated there, measured on Tiny Shakespeare), taken
per step (`TrainingSchedule.is_table_event(step)`), divided by the row's bytes. A lane's gather is
`host_table_bytes` at one micro-batch (accum 1).

The table is scaled to this machine's memory (`--table-gib`, default 4 GiB; the real one is
121 GiB): the rows are drawn at random over the whole table, distinct and sorted as a plan's are,
since the real table is far larger than any cache, and the table is written first (untouched pages
would all read the kernel's one zero page). A smaller table puts the rows closer together than the
real one does (at a stage-2 event the recipe touches 1.57M of its 84.6M rows, 1.9%; of a 4 GiB
table, 56%), which helps the hardware prefetchers: these GB/s are an upper bound in that respect;
`--table-gib` larger shows how much it matters.

Each variant ("path") is timed over the same steps and rows, in the worker's own wall time:
* `HostRows`: the class itself on device "cpu" (`start_gather(...).result()`, `scatter` then
  `synchronize`), split over its `threads` (HOST_ROWS_THREADS, capped at this machine's cores). Its
  CPU path is the CUDA one's code with plain copies (perf/streams.py): the gather's index_select
  writes fresh host staging (a new allocation each time, its pages faulted in, where CUDA reuses a
  cached pinned block) and the "host→device" copy is a host memcpy on the worker, which on CUDA is
  a DMA on the copy engines; `scatter`'s device→host copy into staging runs on the calling thread
  and is not counted;
* `staged, 1 thread`: the host half of the CUDA path, what the worker itself does there: index_select
  into a preallocated staging buffer (a cached pinned block on CUDA; pageable here, as no pin is
  possible without CUDA), `index_copy_` from a staging buffer into the table, on one worker thread;
* `--threads N` (N > 1) adds `intra-op N` (the same, `torch.set_num_threads(N)` while the worker runs)
  and `split N` (N worker threads, each a contiguous slice of the index into its slice of the
  staging, one intra-op thread each; every write-back is finished before the next gather starts).
Not included anywhere: cudaHostAlloc, the H2D/D2H DMA and its PCIe time (tools.cost prices
those at HOST_LINK_GB_PER_S), and the main thread's own work (tools/bench_host.py).

Printed per path: each part's GB/s (bytes moved / seconds, a row's bytes counted once per part), the
worker's seconds per timed step (mean and the slowest), and their ratio to the predicted one-H100
step (PREDICTED_ONE_H100_S over the schedule's steps); then the whole run estimated from the measured
GB/s and every step's row counts. Timings are noisy on a shared CPU: the load average is printed.
"""
from __future__ import annotations

import collections
import math
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root, when run as a script

import numpy as np  # noqa: E402
import torch  # noqa: E402

from cli import ArgumentParser, exit_on_config_error, positive_int  # noqa: E402
from config import RUN_PRESETS, ConfigError  # noqa: E402
from optim.schedule import TrainingSchedule  # noqa: E402
from tools.cost import host_table_bytes  # noqa: E402
from perf.host_table import HostRows  # noqa: E402

# `python -m tools.cost --config record --world-size 1` (2026-12-02, docs/one_gpu.md "What it
# costs"): the recipe on one H100 SXM, predicted 316 s. cost.py computes it inside its report
# (`_fewer_gpus_lines`, a meta count of every geometry and optimizer phase: tens of seconds), so the
# figure is taken as printed; --step-s overrides the per-step budget.
PREDICTED_ONE_H100_S = 316.0
DEFAULT_TABLE_GIB = 4.0  # ours: fits this machine's 24 GiB beside the other work on it
KEEPS_UP = 0.5  # ours (issue 38 point 7): a worker busy more than half the step leaves no margin
DTYPE = torch.bfloat16  # the table's dtype (runtime/training.py: HostRows(..., torch.bfloat16, ...))
PARTS = (("gather", "lane gathers (index_select)"),
         ("event_gather", "event gather (index_select)"),
         ("write_back", "event write-back (index_copy_)"))


# ----------------------------------------------------------------------------------------------------
# the row counts: tools.cost's host bytes, per step
# ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StepRows:
    step: int
    lanes: int        # gathers per step: the virtual ranks this process plays
    lane_rows: int    # distinct rows of one lane's gather
    event_rows: int   # distinct rows an event gathers and writes back (0: not an event)


def step_rows(cfg, world_size: int, schedule: TrainingSchedule, step: int) -> StepRows:
    """`step`'s rows as tools.cost.host_table_bytes counts them (its bytes over a bf16 row's)."""
    row = cfg.model.model_dim * torch.finfo(DTYPE).bits // 8
    tokens, accum = schedule.batch_tokens(step) // cfg.virtual_world_size, cfg.virtual_world_size // world_size
    event = schedule.is_table_event(step)
    (lane_bytes,) = host_table_bytes(cfg, tokens, 1, False).values()   # one micro-batch: one gather
    moved = host_table_bytes(cfg, tokens, accum, event)
    event_bytes = sum(v for k, v in moved.items() if "event" in k)      # read and written back: 2 × rows
    return StepRows(step, accum, lane_bytes // row, event_bytes // (2 * row))


# ----------------------------------------------------------------------------------------------------
# the paths: what the worker runs for a gather and a write-back
# ----------------------------------------------------------------------------------------------------


class HostRowsPath:
    """HostRows itself, device "cpu": each part timed from the calling thread (submit to done)."""

    def __init__(self, table: HostRows):
        self.name, self.table = "HostRows (device cpu)", table

    def gather(self, index: np.ndarray) -> float:
        t0 = time.perf_counter()
        rows = self.table.start_gather(index).result()
        dt = time.perf_counter() - t0
        check_rows(self.table.data, index, rows)
        return dt

    def write_back(self, index: np.ndarray, values: torch.Tensor) -> float:
        self.table.scatter(index, values)  # values.clone() here: the CPU stand-in for the D2H copy, not timed
        t0 = time.perf_counter()           # the worker is writing from the submit on
        self.table.synchronize()
        return time.perf_counter() - t0

    def close(self) -> None:
        pass


class StagedPath:
    """The worker's host half of the CUDA path: index_select into preallocated staging, index_copy_
    from staging, on `threads` worker threads (each a contiguous slice of the index), torch using
    `intra_op` threads meanwhile. Timed inside the worker job(s): first start to last end."""

    def __init__(self, name: str, table: HostRows, staging: torch.Tensor, threads: int = 1, intra_op: int = 1):
        self.name, self.data, self.threads, self.intra_op = name, table.data, threads, intra_op
        self.staging = staging  # shared by the paths (they run one after the other)
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="bench-rows")

    def _run(self, fn, index: np.ndarray, n: int) -> float:
        idx = torch.from_numpy(np.ascontiguousarray(index, dtype=np.int64))
        bounds = np.linspace(0, n, self.threads + 1).astype(np.int64)
        saved = torch.get_num_threads()
        torch.set_num_threads(self.intra_op)  # process-wide in torch: set around the jobs, not inside each
        try:
            t0 = time.perf_counter()
            jobs = [self.pool.submit(fn, idx[a:b], int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:]) if b > a]
            for job in jobs:
                job.result()
            return time.perf_counter() - t0
        finally:
            torch.set_num_threads(saved)

    def gather(self, index: np.ndarray) -> float:
        n = len(index)
        dt = self._run(lambda idx, a, b: torch.index_select(self.data, 0, idx, out=self.staging[a:b]), index, n)
        check_rows(self.data, index, self.staging[:n])
        return dt

    def write_back(self, index: np.ndarray, values: torch.Tensor) -> float:
        self.staging[:len(index)].copy_(values)  # the D2H copy's landing place (DMA on CUDA): not timed
        return self._run(lambda idx, a, b: self.data.index_copy_(0, idx, self.staging[a:b]), index, len(index))

    def close(self) -> None:
        self.pool.shutdown(wait=True)


def check_rows(data: torch.Tensor, index: np.ndarray, rows: torch.Tensor) -> None:
    """A spot check, untimed: the first and last gathered rows are the table's."""
    for i in (0, len(index) - 1):
        if not torch.equal(rows[i], data[int(index[i])]):
            raise AssertionError(f"gathered row {i} (table row {int(index[i])}) differs from the table")


# ----------------------------------------------------------------------------------------------------
# the bench
# ----------------------------------------------------------------------------------------------------


@dataclass
class PathResult:
    name: str
    seconds: dict[str, float] = field(default_factory=lambda: {k: 0.0 for k, _ in PARTS})
    step_seconds: list[float] = field(default_factory=list)

    def gb_per_s(self, part: str, moved: dict[str, int]) -> float:
        return moved[part] / 1e9 / self.seconds[part] if self.seconds[part] > 0 else float("nan")


@dataclass
class RowsReport:
    config: str
    world_size: int
    table_rows: int
    dim: int
    steps: list[StepRows]
    moved: dict[str, int]          # part -> bytes moved over the timed steps (the same for every path)
    paths: list[PathResult]
    step_budget_s: float | None    # the predicted one-H100 step the worker's time is compared with
    budget_given: bool             # step_budget_s came from --step-s
    total_steps: int
    run: dict[str, int]            # the whole run's bytes per part (every step's own counts)
    load: tuple[tuple[float, ...], tuple[float, ...]]  # os.getloadavg() before and after


def default_start(schedule: TrainingSchedule) -> int:
    """The first step of the largest batch (recipe: stage 2, 49,152 tokens per rank, step 681)."""
    return max(range(schedule.total_steps), key=lambda s: (schedule.batch_tokens(s), -s))


def progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def bench(cfg, world_size: int, table_gib: float, start: int, steps: int, threads: int = 1, seed: int = 0,
          step_s: float | None = None, warmup_steps: int = 1, quiet: bool = False) -> RowsReport:
    schedule = TrainingSchedule(cfg.schedule, cfg.features)
    D = cfg.model.model_dim
    row_bytes = D * torch.finfo(DTYPE).bits // 8
    table_rows = int(table_gib * 2**30) // row_bytes
    first, end = max(start - warmup_steps, 0), min(start + steps, schedule.total_steps)
    plan = [step_rows(cfg, world_size, schedule, s) for s in range(first, end)]
    widest = max(max(p.lane_rows, p.event_rows) for p in plan)
    if widest > table_rows:
        raise ConfigError(f"--table-gib {table_gib:g}: {table_rows:,} rows of {D}, fewer than the "
                          f"{widest:,} distinct rows a step of --config {cfg.name} moves at once; pass at least "
                          f"{math.ceil(widest * row_bytes / 2**30 * 1000) / 1000:g}")
    say = (lambda m: None) if quiet else progress
    rng = np.random.default_rng(seed)
    t0 = time.perf_counter()
    say(f"writing the {table_rows:,} × {D} table ({table_rows * row_bytes / 2**20:,.1f} MiB) ...")
    table = HostRows(table_rows, D, DTYPE, "cpu")
    _fill(table.data)
    values = torch.randn((max(p.event_rows for p in plan) or 1, D)).to(DTYPE)  # the event's new rows
    # the staging: a cached pinned block on CUDA, its pages resident; here pageable, written once so that
    # no timed part faults its pages in
    staging = torch.zeros((widest, D), dtype=DTYPE)
    paths = [HostRowsPath(table), StagedPath("staged, 1 thread", table, staging)]
    if threads > 1:
        paths += [StagedPath(f"intra-op {threads}", table, staging, intra_op=threads),
                  StagedPath(f"split {threads}", table, staging, threads=threads)]
    results = [PathResult(p.name) for p in paths]
    moved = {k: 0 for k, _ in PARTS}
    load_before = os.getloadavg()
    saved_threads = torch.get_num_threads()
    torch.set_num_threads(1)  # torchrun's OMP_NUM_THREADS=1 for every rank; the intra-op path raises it
    try:
        for i, p in enumerate(plan):
            timed = p.step >= start
            lanes = [np.sort(rng.choice(table_rows, p.lane_rows, replace=False)) for _ in range(p.lanes)]
            event = np.sort(rng.choice(table_rows, p.event_rows, replace=False)) if p.event_rows else None
            for path, result in zip(paths, results):
                spent = {k: 0.0 for k, _ in PARTS}
                for index in lanes:
                    spent["gather"] += path.gather(index)
                if event is not None:  # the row optimizer: read the rows, then write the new ones back
                    spent["event_gather"] += path.gather(event)
                    spent["write_back"] += path.write_back(event, values[:len(event)])
                if timed:
                    for k in spent:
                        result.seconds[k] += spent[k]
                    result.step_seconds.append(sum(spent.values()))
            if event is not None:  # the last path's write-back is the table's now
                check_rows(table.data, event, values[:len(event)])
            if timed:
                moved["gather"] += p.lanes * p.lane_rows * row_bytes
                moved["event_gather"] += p.event_rows * row_bytes
                moved["write_back"] += p.event_rows * row_bytes
            say(f"step {p.step} ({i + 1}/{len(plan)}{'' if timed else ', untimed'}): {p.lanes} × {p.lane_rows:,} "
                f"rows" + (f", event {p.event_rows:,} rows" if p.event_rows else "") + " | "
                + ", ".join(f"{r.name} {r.step_seconds[-1]:.3f} s" for r in results if timed and r.step_seconds)
                + f" | {time.perf_counter() - t0:.0f} s")
    finally:
        torch.set_num_threads(saved_threads)
        for path in paths:
            path.close()
        table.close()
    load_after = os.getloadavg()
    budget = step_s if step_s is not None else (  # the prediction is the record schedule's
        PREDICTED_ONE_H100_S / schedule.total_steps if cfg.schedule == RUN_PRESETS["recipe"].schedule else None)
    run = collections.Counter()
    for s in range(schedule.total_steps):
        r = step_rows(cfg, world_size, schedule, s)
        run["gather"] += r.lanes * r.lane_rows * row_bytes
        run["event_gather"] += r.event_rows * row_bytes
        run["write_back"] += r.event_rows * row_bytes
    return RowsReport(cfg.name, world_size, table_rows, D, [p for p in plan if p.step >= start], moved, results,
                      budget, step_s is not None, schedule.total_steps, dict(run),
                      (load_before, load_after))


def _fill(data: torch.Tensor) -> None:
    """Write every page of a large table (distinct values per row block), in slices to bound the temporaries."""
    chunk = 1 << 16  # ours: 65,536 rows a slice (192 MiB of float32 temporaries at D=768)
    for a in range(0, data.shape[0], chunk):
        block = data[a:a + chunk]
        block.copy_(torch.arange(block.numel(), dtype=torch.float32).add_(a).remainder_(251.0).view(block.shape))


def run_estimate(report: RowsReport, result: PathResult) -> float | None:
    """The worker's seconds over the whole run at this path's measured GB/s, from every step's own
    row counts; None when a part was not measured (no table event among the timed steps)."""
    rates = {k: result.gb_per_s(k, report.moved) for k, _ in PARTS}
    if any(not math.isfinite(v) for v in rates.values()):
        return None
    return sum(report.run[k] / 1e9 / rates[k] for k in rates)


def _reference(r: RowsReport) -> str:
    if r.step_budget_s is None:
        return f"reference step: none (--config {r.config} is not the record's schedule; pass --step-s)"
    if r.budget_given:
        return f"reference step: {r.step_budget_s:.4f} s (--step-s)"
    return (f"reference step: {r.step_budget_s:.4f} s (the predicted one-H100 run, {PREDICTED_ONE_H100_S:g} s, over "
            f"{r.total_steps} steps)")


def format_report(r: RowsReport) -> str:
    D, row = r.dim, r.dim * torch.finfo(DTYPE).bits // 8
    events = sum(1 for s in r.steps if s.event_rows)
    kinds = sorted({(s.lanes, s.lane_rows, s.event_rows) for s in r.steps})
    lines = [
        f"host table worker: --config {r.config} --world-size {r.world_size}, steps {r.steps[0].step}-{r.steps[-1].step} "
        f"({len(r.steps)} timed, {events} table events); per step "
        + "; ".join(f"{n} lane gathers × {lr:,} rows" + (f" + event {er:,} rows read and written" if er else "")
                    for n, lr, er in kinds),
        f"table: {r.table_rows:,} × {D} bf16 = {r.table_rows * row / 2**30:.3g} GiB in pageable host memory, rows "
        f"drawn at random over all of it (the recipe's: 121 GiB); host: {os.cpu_count()} CPUs, torch {torch.__version__}; "
        f"load average {r.load[0][0]:.2f} before, {r.load[1][0]:.2f} after (1 min)",
        "bytes moved over the timed steps: " + ", ".join(f"{label} {r.moved[k]:,} B ({r.moved[k] / 1e9:.3f} GB)"
                                                         for k, label in PARTS),
        _reference(r),
        "",
        f"{'path':<24} " + " ".join(f"{k + ' GB/s':>17}" for k, _ in PARTS)
        + f" {'s/step':>8} {'ratio':>6} {'slowest':>8} {'ratio':>6} {'run s/step':>10} {'ratio':>6}",
    ]

    def ratio(seconds: float | None) -> str:
        return "-" if seconds is None or r.step_budget_s is None else f"{seconds / r.step_budget_s:.2f}"

    for res in r.paths:
        mean, slowest = sum(res.step_seconds) / len(res.step_seconds), max(res.step_seconds)
        est = run_estimate(r, res)
        per_step = None if est is None else est / r.total_steps
        lines.append(f"{res.name:<24} " + " ".join(f"{res.gb_per_s(k, r.moved):17.2f}" for k, _ in PARTS)
                     + f" {mean:8.3f} {ratio(mean):>6} {slowest:8.3f} {ratio(slowest):>6} "
                     + f"{'-' if per_step is None else f'{per_step:.3f}':>10} {ratio(per_step):>6}")
    best = min(r.paths, key=lambda res: sum(res.step_seconds))
    mean = sum(best.step_seconds) / len(best.step_seconds)
    lines += [
        "",
        "s/step: the worker's seconds per timed step (mean; slowest: an event step, if any); ratio: over the "
        "reference step. run s/step: the whole run's mean at this path's GB/s, every step's own rows ("
        + ", ".join(f"{label} {r.run[k] / 1e9:,.1f} GB" for k, label in PARTS) + f" over {r.total_steps} steps)",
        f"fastest here: {best.name}" + ("" if r.step_budget_s is None else
                                        f", {mean / r.step_budget_s:.2f} of the reference step on average over "
                                        f"these steps: " + ("keeps up" if mean / r.step_budget_s <= KEEPS_UP else
                                                            "does not keep up") + f" (threshold {KEEPS_UP:g})"),
        "left out: pinned allocation, the H2D/D2H DMA (on the copy engines, priced by tools.cost), the "
        "main thread; the CPU HostRows path allocates a fresh tensor per gather (CUDA reuses cached pinned blocks)",
    ]
    return "\n".join(lines)


def main(argv=None) -> RowsReport:
    prog = "python -m tools.bench_host_rows"
    with exit_on_config_error(prog):
        parser = ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
        parser.add_argument("--config", default="recipe", choices=sorted(RUN_PRESETS))
        parser.add_argument("--world-size", type=positive_int, default=1,
                            help="processes of the recipe (default 1: one process holds the whole table)")
        parser.add_argument("--table-gib", type=float, default=DEFAULT_TABLE_GIB,
                            help=f"the table's size here, GiB (default {DEFAULT_TABLE_GIB:g}; the recipe's is 121)")
        parser.add_argument("--start", type=int, default=None,
                            help="first timed step (default: the first step of the largest batch)")
        parser.add_argument("--steps", type=positive_int, default=8, help="timed steps (default 8)")
        parser.add_argument("--threads", type=positive_int, default=1,
                            help="N > 1: also time N intra-op threads and N split worker threads")
        parser.add_argument("--seed", type=int, default=0, help="the rows' random draw")
        parser.add_argument("--step-s", type=float, default=None,
                            help=f"the step to compare with (default {PREDICTED_ONE_H100_S:g} s over the schedule's steps)")
        args = parser.parse_args(argv)
        cfg = RUN_PRESETS[args.config]
        if cfg.virtual_world_size % args.world_size or args.world_size > cfg.virtual_world_size:
            raise ConfigError(f"--world-size {args.world_size}: must divide --config {args.config}'s "
                              f"{cfg.virtual_world_size} virtual ranks")
        if not cfg.features.ngram:
            raise ConfigError(f"--config {args.config}: has no n-gram table")
        if not (math.isfinite(args.table_gib) and args.table_gib > 0):
            raise ConfigError(f"--table-gib {args.table_gib}: must be a positive number of GiB")
        schedule = TrainingSchedule(cfg.schedule, cfg.features)
        start = default_start(schedule) if args.start is None else args.start
        if not 0 <= start < schedule.total_steps:
            raise ConfigError(f"--start {start}: must be a step of --config {args.config} [0, {schedule.total_steps})")
        if args.seed < 0:
            raise ConfigError(f"--seed {args.seed}: must be >= 0")
        if args.step_s is not None and not (math.isfinite(args.step_s) and args.step_s > 0):
            raise ConfigError(f"--step-s {args.step_s}: must be a positive number of seconds")
        report = bench(cfg, args.world_size, args.table_gib, start, args.steps, args.threads, args.seed, args.step_s)
    print(format_report(report))
    return report


if __name__ == "__main__":
    main()
