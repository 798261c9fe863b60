"""Host time of a record-shaped training step with the device work stubbed out: does the host keep
33 ms steps fed? (issue 22, item 3)

    python tools/bench_host.py --config record                # stage 2 steps, 49,152 tokens per rank
    python tools/bench_host.py --config record --device-ms 33 # each step lasts 33 ms, as on the GPUs
    python tools/bench_host.py --config record --start 340 --steps 48
    python tools/bench_host.py --config smoke --steps 4       # tiny (the test)

What runs is `training.Run.train_step` itself and the loop around it as train_gpt.py drives it
(`loader.next_batches(step + 1)`, then `train_step(step, batches, following)`), for rank 0 of the
preset's world with one batch per step (one process per rank, as the record runs), the collector off
as in the timed loop, one intra-op thread (torchrun's default). Only the device is stubbed:

* "device" tensors live on "meta" (the model, the n-gram table shard, the static inputs and the
  sink leaf): an op on them dispatches and checks shapes, computes nothing; a copy to them is
  skipped. The host-side ones a GPU step touches through tiny device tensors (the optimizer's
  device scalars that `load_scalars` writes, the step weights) are real CPU tensors, so those
  writes cost what a CPU op costs;
* the captured regions are replays of nothing (`Run.run_region` runs its dispatch; the "graph"
  returns its static loss and leaves the sink leaf's persistent .grad in place);
* torch.distributed is a local stand-in for one rank of the world (`StandInCollectives`): the row
  plan's two gloo all_to_alls return the sizes and ids a rank would get from peers like itself
  (every peer asks this rank for as many rows as it asks itself); the device all_to_alls are
  skipped. A world-size-8 barrier cannot be timed on 2 cores: its wait is not in these numbers;
* pinned memory needs CUDA: every allocation the code would pin is a plain host allocation here,
  so cudaHostAlloc and the caching host allocator's event bookkeeping are not measured.

Everything else is real: the loader and its prefetch thread on a synthetic shard (FineWeb-like
document lengths, Zipf-distributed tokens: about as many distinct targets as record #360 reports), the
numpy row plans and push plans, the candidate sets, the batch ring's host copies, Python dispatch.
Parts are timed exclusively on the main thread (a part nested in another counts once, in the inner
one), as CPU time (what the part costs a core of its own) and wall time (here: plus waiting for a
core on a shared machine, and for helper threads in "waits"); work on other threads (the loader's
assembly, the row exchange's prep thread) is reported apart: it overlaps the main thread, on a core
of its own on a GPU node. By default the loop runs at the host's own pace, as fast as the host can;
--device-ms 33 makes each step last 33 ms (the host sleeps out the rest, as a host that runs ahead
of the GPUs waits for them), which gives the helper threads the lead they have in a real run. Also
printed: load_scalars' aten ops, each a kernel launch on a GPU (a cost the CPU's tiny ops here do
not show). Timings are noisy on a shared CPU: compare medians of several runs.
"""
from __future__ import annotations

import contextlib
import gc
import math
import os
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root, when run as a script

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

import optim.row_exchange as row_exchange  # noqa: E402
from runtime import training  # noqa: E402
from cli import ArgumentParser, add_set_argument, exit_on_config_error, positive_int, preset_run_config  # noqa: E402
from config import RUN_PRESETS, ConfigError  # noqa: E402
from data.loader import TrainLoader  # noqa: E402
from data.shards import BOS_ID, write_shard  # noqa: E402
from optim.schedule import StepWeights, TrainingSchedule  # noqa: E402
from perf import backend as perf_backend  # noqa: E402
from runtime.sync_check import host_side  # noqa: E402

STEP_MS = 33.0  # record #360: step_avg 33.4 ms (its README), the round 33 ms
# ours: token ranks drawn with p(r) ~ r^-1.05 give ~10.8k distinct targets in 49,152 tokens, record
# #360's "about 11k distinct at batch 24" (track_1_short/sampled_softmax.py); uniform tokens would give 24k, more than
# any candidate set holds
ZIPF_EXPONENT = 1.05
DEVICE = torch.device("meta")

# (key, label), in the table's order; "rest" is train_step less every part timed inside it
PARTS = (
    ("loader", "loader: next_batches (the loop's wait)"),
    ("plans", "row plans: RowExchange.plan"),
    ("uploads", "uploads: Run.upload less its plans"),
    ("pulls", "row pulls: start_pull, finish (dispatch)"),
    ("prefetch", "prefetch: Run.prefetch less plans, pulls"),
    ("regions", "region dispatch: Run.run_region (replay)"),
    ("accumulate", "sink gradient merge: accumulate"),
    ("load_scalars", "optimizer scalars: load_scalars"),
    ("push_plans", "table events: plan_push"),
    ("events", "table events: the rest of ngram_opt.step"),
    ("rest", "rest of train_step (flush, schedule, ...)"),  # train_step itself, less the parts above
    ("waits", "waits for helper threads (Future.result)"),   # the loader's and the prep thread's results
)


def text_like_shard(path: Path, num_tokens: int, seed: int = 0) -> None:
    """A shard of documents with FineWeb-like lengths (log-normal, median ~490 tokens, as
    tools/bench_loader.py) whose tokens follow a Zipf law over a shuffled vocabulary (ZIPF_EXPONENT)."""
    rng = np.random.default_rng(seed)
    lengths = np.maximum(1, rng.lognormal(mean=6.2, sigma=1.0, size=num_tokens // 300)).astype(np.int64)
    lengths = lengths[:np.searchsorted(np.cumsum(lengths + 1), num_tokens)]
    p = np.arange(1, BOS_ID + 1, dtype=np.float64) ** -ZIPF_EXPONENT
    vocab = rng.permutation(BOS_ID).astype(np.uint16)  # token id of each frequency rank
    tokens = vocab[rng.choice(BOS_ID, size=int((lengths + 1).sum()), p=p / p.sum())]
    tokens[np.cumsum(np.r_[0, lengths[:-1] + 1])] = BOS_ID  # each document starts with BOS
    write_shard(path, tokens)


# ----------------------------------------------------------------------------------------------------
# the stand-ins: collectives of one rank with no peers, graph replays of nothing
# ----------------------------------------------------------------------------------------------------


class _Done:
    """An async collective's work handle that has completed."""

    def wait(self) -> bool:
        return True


class StandInCollectives:
    """torch.distributed as rank `rank` of `world_size` sees it, with no peer behind it.

    all_to_all_single: host (CPU) tensors are the row plan's exchanges, answered as a peer like
    this rank would answer (counts: every asker asks this rank for as many rows as this rank asks
    itself; ids: this rank's own distinct ids, once per asker, so in range and of the right
    sizes); device ("meta") tensors are row exchanges, skipped."""

    NAMES = ("is_available", "is_initialized", "get_rank", "get_world_size", "get_backend", "new_group",
             "all_to_all_single", "barrier")

    def __init__(self, rank: int, world_size: int):
        self.rank, self.world_size = rank, world_size

    def is_available(self) -> bool:
        return True

    def is_initialized(self) -> bool:
        return True

    def get_rank(self, group=None) -> int:
        return self.rank

    def get_world_size(self, group=None) -> int:
        return self.world_size

    def get_backend(self, group=None) -> str:
        return "nccl"  # a GPU run: the row exchange makes its own gloo group for the host plans

    def new_group(self, *args, **kwargs):
        return object()

    def barrier(self, *args, **kwargs):
        return _Done() if kwargs.get("async_op") else None

    def all_to_all_single(self, output, input, output_split_sizes=None, input_split_sizes=None, group=None,
                          async_op=False):
        if output.device.type == "cpu":
            if output_split_sizes is None:            # the counts: (W,) asked of me, per asker
                output.fill_(int(input[self.rank]))
            else:                                     # the ids: my own, once per asker
                offsets = np.concatenate([[0], np.cumsum(input_split_sizes)])
                own = input[int(offsets[self.rank]):int(offsets[self.rank + 1])]
                output.copy_(own.repeat(self.world_size))
        return _Done() if async_op else None

    @contextlib.contextmanager
    def installed(self):
        saved = {name: getattr(dist, name) for name in self.NAMES}
        for name in self.NAMES:
            setattr(dist, name, getattr(self, name))
        try:
            yield self
        finally:
            for name, fn in saved.items():
                setattr(dist, name, fn)


class NoOpReplay:
    """`RegionGraphs.run` once every key is captured: look the graph up, "replay" it (nothing runs)
    and return its static outputs. The forward_backward graph's outputs are its loss and, left in
    place, the persistent .grad of every requires-grad static input (the n-gram sink leaf)."""

    def __init__(self, run: training.Run):
        self.run = run
        self.outputs: dict = {}
        self.replays = 0

    def __call__(self, region: str, key, fn):
        slot = (region, key)
        out = self.outputs.get(slot)
        if out is None:
            out = self.outputs[slot] = (torch.zeros((), dtype=torch.float32, device=DEVICE)
                                        if region == "forward_backward" else None)
        if region == "forward_backward":
            for buf in self.run.static_inputs.values():  # what the first captured backward leaves
                if buf.requires_grad and buf.grad is None:
                    buf.grad = torch.zeros_like(buf)
        self.replays += 1
        return out


class OpCounter(TorchDispatchMode):
    """Counts the aten ops that do work (views and metadata ops aside): each is a kernel launch
    on a GPU, the host cost the CPU's cheap tiny ops here do not show."""

    def __init__(self):
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view and func not in (torch.ops.aten.detach.default, torch.ops.aten.lift_fresh.default):
            self.ops += 1
        return func(*args, **(kwargs or {}))


def launches(fn, *args) -> int:
    """The aten ops `fn(*args)` runs (OpCounter), untimed."""
    with OpCounter() as counter:
        fn(*args)
    return counter.ops


# ----------------------------------------------------------------------------------------------------
# the run, built by Run.__init__ on "meta", then its device stubbed
# ----------------------------------------------------------------------------------------------------


def host_run(cfg, rank: int, world_size: int, backend) -> training.Run:
    """A training.Run for `rank` of `world_size` (one batch per step), built by `Run.__init__` on
    "meta" (`training.Setup` given the rank, nothing allocated or communicated), then stubbed as the
    module docstring says: the host-touched device scalars and the step weights made real CPU
    tensors, the persistent gradients in place, the regions replays of nothing. The banks' gathers
    stay inside the (replayed) optimizer step: deferred gathers are off, as no collective of the
    device runs here. Call under StandInCollectives.installed() (the row plans' host collectives)."""
    backend = replace(backend, compile=False, cuda_graphs=False, deferred_gathers=False)
    run = training.Run(cfg, training.Setup(cfg, rank, world_size, device=DEVICE, backend=backend))
    for e in run.manager.entries.values():  # tiny device tensors the host writes: real CPU ops
        e.scalars = {k: torch.zeros(v.shape, dtype=v.dtype) for k, v in e.scalars.items()}
        if e.matrix_mults is not None:
            e.matrix_mults = torch.ones(e.matrix_mults.shape, dtype=e.matrix_mults.dtype)
    for p in run.model.parameters():  # the persistent gradients a captured backward adds into
        p.grad = torch.zeros_like(p)
    run.step_weights = StepWeights(run.schedule, "cpu")
    run.forward = None  # the regions are replays: the model never runs
    run.region_runner = NoOpReplay(run)
    return run


# ----------------------------------------------------------------------------------------------------
# timing: each part exclusive of the parts nested in it, main thread apart from the others
# ----------------------------------------------------------------------------------------------------


class PartTimer:
    """Wraps callables so that each call adds its time to a part, as wall time and as the calling
    thread's CPU time (time.thread_time: what the part costs a core of its own, whatever else the
    machine runs). On the main thread a part's time excludes the timed calls nested in it (so the
    parts sum to the step); on any other thread (the loader's, the row-plan prep thread) it is
    inclusive, in `other_threads`."""

    def __init__(self):
        self.main = threading.main_thread()
        self.wall: dict[str, float] = {}
        self.cpu: dict[str, float] = {}
        self.other_threads: dict[str, tuple[float, float]] = {}  # part -> (wall, cpu) seconds
        self._lock = threading.Lock()
        self._nested = [[0.0, 0.0]]  # per open call on the main thread: (wall, cpu) of the calls nested in it

    def add(self, part: str, wall: float, cpu: float) -> None:
        self.wall[part] = self.wall.get(part, 0.0) + wall
        self.cpu[part] = self.cpu.get(part, 0.0) + cpu

    def wrap(self, part: str, fn):
        def timed(*args, **kwargs):
            if threading.current_thread() is not self.main:
                start, start_cpu = time.perf_counter(), time.thread_time()
                try:
                    return fn(*args, **kwargs)
                finally:
                    wall, cpu = time.perf_counter() - start, time.thread_time() - start_cpu
                    with self._lock:
                        w, c = self.other_threads.get(part, (0.0, 0.0))
                        self.other_threads[part] = (w + wall, c + cpu)
            self._nested.append([0.0, 0.0])
            start, start_cpu = time.perf_counter(), time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                wall, cpu = time.perf_counter() - start, time.thread_time() - start_cpu
                inner_wall, inner_cpu = self._nested.pop()
                self._nested[-1][0] += wall
                self._nested[-1][1] += cpu
                self.add(part, wall - inner_wall, cpu - inner_cpu)
        return timed

    def reset(self) -> None:
        for d in (self.wall, self.cpu, self.other_threads):
            d.clear()


@contextlib.contextmanager
def patched(obj, name: str, value):
    saved = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, saved)


def instrument(run: training.Run, loader: TrainLoader, timer: PartTimer) -> contextlib.ExitStack:
    """Time the parts of the loop and of `run`'s step: instance attributes, and the module-level
    names the exchange calls (so that its prep thread's calls are timed too)."""
    stack = contextlib.ExitStack()
    parts = [(loader, "next_batches", "loader"), (loader, "_assemble", "loader"),  # (the assembler thread's too)
             (run, "train_step", "rest"), (run, "upload", "uploads"), (run, "prefetch", "prefetch"),
             (run, "run_region", "regions"), (run.manager, "load_scalars", "load_scalars")]
    if run.exchange is not None:
        parts += [(run.exchange, "plan", "plans"), (row_exchange, "split_requests", "plans"),
                  (run.exchange, "start_pull", "pulls"), (row_exchange.PendingPull, "finish", "pulls"),
                  (row_exchange, "plan_push", "push_plans"),
                  (run.ngram_opt, "accumulate", "accumulate"), (run.ngram_opt, "step", "events")]
    parts.append((Future, "result", "waits"))
    for obj, name, part in parts:
        stack.enter_context(patched(obj, name, timer.wrap(part, getattr(obj, name))))
    return stack


# ----------------------------------------------------------------------------------------------------
# the bench
# ----------------------------------------------------------------------------------------------------


@dataclass
class HostReport:
    config: str
    world_size: int
    steps: list[int]
    tokens_per_rank: list[int]
    events: int                          # table events among the timed steps
    cpu_ms: dict[str, float]             # part -> main-thread CPU ms per timed step
    wall_ms: dict[str, float]            # part -> main-thread wall ms per timed step
    step_wall_ms: list[float]            # wall ms of each timed step (loader + train_step)
    other_threads: dict[str, tuple[float, float]]  # part -> (wall, CPU) ms per step on other threads
    scalar_ops: dict[str, int]           # load_scalars' aten ops at an Adam step and at another step
    device_ms: float = 0.0
    step_ms: float = STEP_MS

    def per_event(self, ms: dict[str, float], part: str) -> float:
        return ms[part] * len(self.steps) / self.events

    @property
    def cpu_total(self) -> float:
        return sum(self.cpu_ms.values())

    @property
    def wall_total(self) -> float:
        return sum(self.wall_ms.values())


def default_start(schedule: TrainingSchedule, warmup_steps: int) -> int:
    """The first step of the largest batch (record: stage 2, 49,152 tokens per rank, step 681) plus
    the untimed steps: the stage change (a YaRN rescale, four a run) falls before the timed ones."""
    first = max(range(schedule.total_steps), key=lambda s: (schedule.batch_tokens(s), -s))
    return min(first + warmup_steps, schedule.total_steps - 1)


def bench(cfg, start: int, steps: int, warmup_steps: int, device_ms: float = 0.0, seed: int = 0) -> HostReport:
    """Run the loop from `start - warmup_steps` and time steps [start, start + steps). device_ms:
    each step lasts at least this long, the host sleeping out the rest (a host that runs ahead of
    a device at that pace waits for it somewhere); 0: the host's own pace."""
    import torch._dynamo  # noqa: F401  (some ops' meta kernels, the table event's, import it at first use: not timed)
    world = cfg.virtual_world_size
    backend = perf_backend.current()
    with StandInCollectives(0, world).installed():
        run = host_run(cfg, 0, world, backend)
        schedule = run.schedule
        first, end = max(start - warmup_steps, 0), min(start + steps, schedule.total_steps)
        run.windows = schedule.windows(first)  # as a run arrives at `first` (its rotary buffers are meta)
        tokens = sum(schedule.batch_tokens(s) for s in range(first, end + 1) if s < schedule.total_steps)
        timer, step_wall = PartTimer(), []
        with tempfile.TemporaryDirectory() as tmp:
            shard = Path(tmp) / "synthetic_train_000001.bin"
            text_like_shard(shard, int(1.3 * tokens) + 100_000, seed=seed)  # documents cut at the doc cap: spare
            loader = TrainLoader([shard], [0], world, **run.hash_args, pin_memory=False,  # the ring pins
                                 virtual_seq_cap=run.cfg.schedule.virtual_seq_cap)

            def next_batches(step: int):
                if step >= end:
                    return None
                with host_side():
                    return loader.next_batches(schedule.batch_tokens(step) // world, schedule.doc_cap(step))

            threads = torch.get_num_threads()
            torch.set_num_threads(1)  # torchrun's OMP_NUM_THREADS=1 for every rank
            try:
                with instrument(run, loader, timer):
                    following = next_batches(first)
                    gc.collect()
                    gc.freeze()
                    gc.disable()  # as train_gpt.py's timed loop (garbage_collector_paused)
                    try:
                        for step in range(first, end):
                            if step == start:
                                timer.reset()
                            t0 = time.perf_counter()
                            batches, following = following, next_batches(step + 1)
                            run.train_step(step, batches, following)
                            if step >= start:
                                step_wall.append(1e3 * (time.perf_counter() - t0))
                            time.sleep(max(0.0, t0 + device_ms / 1e3 - time.perf_counter()))
                    finally:
                        gc.enable()
                        gc.unfreeze()
                    if run.prefetched is not None:
                        run.prefetched.wait()
                # after the window (it advances the Adam step counts): load_scalars' ops, launches on a GPU
                adam = next(s for s in reversed(range(end)) if schedule.is_adam_step(s))
                other = next(s for s in reversed(range(end)) if not schedule.is_adam_step(s))
                scalar_ops = {"adam": launches(run.manager.load_scalars, adam),
                              "other": launches(run.manager.load_scalars, other)}
            finally:
                torch.set_num_threads(threads)
                loader.close()
    n = end - start
    events = sum(1 for s in range(start, end) if schedule.is_table_event(s)) if run.ngram_opt is not None else 0
    return HostReport(cfg.name, world, list(range(start, end)),
                      sorted({schedule.batch_tokens(s) // world for s in range(start, end)}), events,
                      {k: 1e3 * timer.cpu.get(k, 0.0) / n for k, _ in PARTS},
                      {k: 1e3 * timer.wall.get(k, 0.0) / n for k, _ in PARTS}, step_wall,
                      {k: (1e3 * w / n, 1e3 * c / n) for k, (w, c) in timer.other_threads.items()}, scalar_ops,
                      device_ms)


def format_report(r: HostReport) -> str:
    tokens = ", ".join(f"{t:,}" for t in r.tokens_per_rank)
    budget = f"{r.step_ms:g} ms"
    lines = [
        f"host side of a training step: --config {r.config}, rank 0 of {r.world_size}, one batch per step, "
        f"steps {r.steps[0]}-{r.steps[-1]} ({len(r.steps)} steps, {tokens} tokens per rank, {r.events} table events)"
        + (f"; device emulated: each step lasts {r.device_ms:g} ms (the host sleeps out the rest)" if r.device_ms else
           "; the host's own pace (no device to wait for)"),
        "device stubbed: tensors on meta, graph replays of nothing; the row plans' gloo all_to_alls: local "
        "stand-ins of the same sizes (no wait for other ranks); pinned allocations: plain host ones (no CUDA)",
        f"host: {os.cpu_count()} CPUs, torch {torch.__version__}, numpy {np.__version__}; CPU = the main "
        f"thread's CPU time (what a core of its own costs), wall = its wall time here (a shared machine "
        f"adds waiting for a core)",
        "",
        f"{'main thread, per step':<44} {'CPU ms':>7} {'of ' + budget:>9} {'wall ms':>8} {'CPU ms/event':>13}",
    ]
    for key, label in PARTS:
        per_event = f"{r.per_event(r.cpu_ms, key):13.2f}" if r.events and key in ("push_plans", "events") else ""
        lines.append(f"{label:<44} {r.cpu_ms[key]:7.2f} {r.cpu_ms[key] / r.step_ms:9.1%} {r.wall_ms[key]:8.2f}"
                     f" {per_event}")
    lines.append(f"{'total':<44} {r.cpu_total:7.2f} {r.cpu_total / r.step_ms:9.1%} {r.wall_total:8.2f}")
    lines.append(f"load_scalars: {r.scalar_ops['adam']} aten ops at an Adam step, {r.scalar_ops['other']} at "
                 f"another (each a kernel launch on a GPU)")
    walls = sorted(r.step_wall_ms)
    lines.append(f"steps' wall ms: median {statistics.median(walls):.2f}, slowest {walls[-1]:.2f}")
    if r.other_threads:
        lines.append("other threads, overlapping the main thread (CPU / wall ms per step): " + ", ".join(
            f"{k} {c:.2f} / {w:.2f}" for k, (w, c) in sorted(r.other_threads.items())))
    return "\n".join(lines)


def main(argv=None) -> HostReport:
    prog = "python tools/bench_host.py"
    with exit_on_config_error(prog):
        parser = ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
        parser.add_argument("--config", default="record", choices=sorted(RUN_PRESETS))
        parser.add_argument("--start", type=int, default=None,
                            help="first timed step (default: the first step of the largest batch, plus "
                                 "--warmup-steps)")
        parser.add_argument("--steps", type=positive_int, default=40, help="timed steps")
        parser.add_argument("--warmup-steps", type=int, default=4,
                            help="untimed steps before --start (static buffers, ring slots, first plans)")
        parser.add_argument("--step-ms", type=float, default=STEP_MS, help="the step the host must keep up with")
        parser.add_argument("--device-ms", type=float, default=0.0,
                            help="emulate a device step this long (the host sleeps out each step's rest: helper "
                                 "threads get the lead they would have); default 0, the host's own pace")
        add_set_argument(parser)
        args = parser.parse_args(argv)
        cfg = preset_run_config(args.config, args.assignments)
        schedule = TrainingSchedule(cfg.schedule, cfg.features)
        start = default_start(schedule, max(args.warmup_steps, 0)) if args.start is None else args.start
        if not 0 <= start < schedule.total_steps:
            raise ConfigError(f"--start {start}: must be a step of the {args.config} preset "
                              f"[0, {schedule.total_steps})")
        if args.warmup_steps < 0:
            raise ConfigError(f"--warmup-steps {args.warmup_steps}: must be >= 0")
        if not (math.isfinite(args.step_ms) and args.step_ms > 0 and math.isfinite(args.device_ms)
                and args.device_ms >= 0):
            raise ConfigError(f"--step-ms {args.step_ms} must be a positive and --device-ms {args.device_ms} a "
                              f"non-negative number of milliseconds")
        report = bench(cfg, start, args.steps, args.warmup_steps, args.device_ms)
    report.step_ms = args.step_ms
    print(format_report(report))
    return report


if __name__ == "__main__":
    main()
