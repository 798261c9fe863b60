"""The CUDA-graph capture contract, checked on any device (a CPU is enough):

    python -m tools.capture_contract --config smoke --steps 6

A CUDA graph records the kernels of one call of a region and replays them: the same kernels, the
same Python scalars baked into their arguments, the same device addresses. A region is capturable
only if every call of it with the same key would have recorded the same graph. `ContractChecker`
watches each call of each region (a TorchDispatchMode sees every aten op inside it, eager or
compiled by aot_eager) and reports, per region and key:

* host sync: an op a GPU would have to wait on (`runtime/sync_check.py`'s list: `.item()`, `bool()` of
  a tensor, data-dependent output shapes); a capture fails on it;
* storage moved: from the second call of a key on (the first call is the untimed warm-up that
  upstream runs before capturing), a tensor that existed before the region (parameter, gradient,
  optimizer state, buffer, static input) is read or written at another storage address than the
  capture call used at the same op; a replay would read the stale address;
* new persistent tensor: a tensor created inside the region that is model or optimizer state after
  it (a fresh `exp_avg`, a `.grad` set to a new tensor, `p.data = ...`); a replay would overwrite
  it in the graph's private pool. Also state that the region's Python released or replaced
  (`p.grad = None`): a replay runs no Python;
* Python scalar changes: a non-tensor op argument (lr, a bias correction, a beta) that differs
  between the capture call and a later call of the same key, at the same op; a graph bakes in the
  capture's value. Reported with the op, the project line and both values;
* different kernels: a later call runs another op sequence or other shapes than the capture call
  (the key misses something that changes the kernels);
* pageable copy: a copy into device memory from pageable host memory inside the region.

Tensors are named by parameter, gradient, buffer, optimizer-state or static-input name
(`run_state`, perf/cuda_graphs/state.py); an unnamed tensor from outside a region that changes
address is a per-step input that did not go through a static buffer.

The regions of a training step (`training.Run.train_step` runs each through `Run.run_region(name, key, fn)`;
perf/cuda_graphs/capture.py captures and replays them):

* "forward_backward", keyed by the step geometry (`StepSettings.geometry`): one micro-batch's
  forward and backward, reading the static input buffers (`Run.upload(static=True)`: tokens,
  targets, cu_seqlens, sign rows, sampled-softmax candidates) and the static n-gram sink leaf,
  accumulating into the persistent `.grad`s. The row plan, the row pull (an all_to_all with host-
  planned sizes) and the sink gradient's per-row merge (its size is the batch's distinct rows) stay
  outside, before and after it.
* "optimizer", keyed by `OptimizerManager.phase(step)`: `manager.update(step)`,
  reading the per-step hyperparameters from device scalars that `manager.load_scalars(step)`
  fills outside it. The banks' deferred all-gathers (SPEEDRUN_DEFERRED_GATHERS) are launched
  after it and waited at the next `Run.flush`, outside any region: a collective captured in a
  graph must be waited in it. The one-off untie (host state: the split flag) runs outside too.
  The n-gram table event (`ngram_opt.step`) stays outside: its all_to_all sizes and its row count
  change from event to event.
* "fp8_refresh", keyed by the refresh mode (the first 16 refreshes use exact weight scales):
  `model.refresh_fp8(exact)`, run by `Run.flush` at the next step's top, after the gathers; the
  refresh count (`model.next_fp8_refresh_exact()`, host state) is taken after the update.
"""
from __future__ import annotations

import contextlib
import dataclasses
import linecache
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor
from torch.utils._pytree import tree_flatten

from perf.cuda_graphs.state import LIFT_OPS, OpRecordingMode, run_state, storage_ptr
from runtime.sync_check import sync_reason

REPO_ROOT = Path(__file__).resolve().parents[1]
_SKIP_FILES = {str(Path(__file__).resolve()), str(REPO_ROOT / "runtime" / "sync_check.py")}
_project_file: dict[str, bool] = {}


WHERE_DEPTH = 3  # project frames kept per op: the line, and two callers to tell call sites apart


def _where() -> tuple[tuple[str, int, str], ...]:
    """(file, line, function) of the innermost WHERE_DEPTH project frames, innermost first (cheap:
    walks frames, no traceback)."""
    f, out = sys._getframe(2), []
    while f is not None and len(out) < WHERE_DEPTH:
        name = f.f_code.co_filename
        ok = _project_file.get(name)
        if ok is None:
            path = str(Path(name).resolve()) if name and not name.startswith("<") else ""
            ok = _project_file[name] = path.startswith(str(REPO_ROOT)) and path not in _SKIP_FILES \
                and "/site-packages/" not in path
        if ok:
            out.append((name, f.f_lineno, f.f_code.co_name))
        f = f.f_back
    return tuple(out)


def format_where(where: tuple[tuple[str, int, str], ...]) -> str:
    """`path:line in function: source`, then `(called from path:line, ...)`."""
    if not where:
        return "(no project frame: an autograd backward node)"
    lines = []
    for name, line, func in where:
        try:
            rel = Path(name).resolve().relative_to(REPO_ROOT)
        except ValueError:
            rel = Path(name)
        lines.append((rel, line, func, name))
    rel, line, func, name = lines[0]
    head = f"{rel}:{line} in {func}: {linecache.getline(name, line).strip()}"
    if len(lines) > 1:
        head += " (called from " + ", ".join(f"{r}:{n}" for r, n, _, _ in lines[1:]) + ")"
    return head


# ----------------------------------------------------------------------------------------------------
# what one call of a region did
# ----------------------------------------------------------------------------------------------------


@dataclass
class OpRecord:
    op: str
    where: tuple[tuple[str, int, str], ...]   # innermost project frames (_where)
    signature: tuple            # (shape, dtype) of every tensor argument, in argument order
    scalars: tuple              # (argument index, value) of every non-tensor argument
    external: tuple             # (argument index, storage ptr) of tensors from outside the region


@dataclass
class RegionCall:
    region: str
    key: object
    index: int                                   # 0 = the first call of this key (the warm-up)
    ops: list[OpRecord] = field(default_factory=list)
    born: set[int] = field(default_factory=set)      # storages first seen as an op's output here
    outside: set[int] = field(default_factory=set)   # storages first seen as an op's input here
    names: dict[int, str] = field(default_factory=dict)   # ptr -> state name, at the region's start


@dataclass(frozen=True)
class Violation:
    kind: str       # host sync | storage moved | new persistent tensor | state changed by Python |
                    # Python scalar changes | different kernels | pageable copy
    region: str
    key: str
    call: int
    message: str

    def __str__(self) -> str:
        return f"[{self.kind}] region {self.region} key {self.key} call {self.call}: {self.message}"


_COPY_OPS = {"aten::copy_", "aten::_to_copy", "aten::copy"}
def _pageable_copy(func, args, kwargs) -> str | None:
    """'src device -> dst device' when the op copies pageable host memory into device memory."""
    name = func._schema.name
    if name not in _COPY_OPS:
        return None
    src = args[1] if name != "aten::_to_copy" else args[0]
    if name == "aten::_to_copy":
        dst_device = kwargs.get("device") or src.device
    else:
        dst_device = args[0].device
    if not isinstance(src, Tensor) or src.device.type != "cpu" or torch.device(dst_device).type == "cpu":
        return None
    try:
        pinned = src.is_pinned()
    except RuntimeError:      # no accelerator to ask: nothing is pinned
        pinned = False
    return None if pinned else f"{src.device} (pageable) -> {torch.device(dst_device)}"


class _RegionMode(OpRecordingMode):
    """Records every aten op of one region call (see RegionCall) and flags host syncs."""

    def __init__(self, checker: "ContractChecker", call: RegionCall):
        super().__init__()
        self.checker, self.call = checker, call

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        call = self.call
        where = _where()
        op = str(func._schema.name)
        reason = sync_reason(func, args, kwargs)
        if reason is not None:
            self.checker.report("host sync", call, f"{op} ({reason}) at {format_where(where)}",
                                dedupe=("sync", op, where))
        pageable = _pageable_copy(func, args, kwargs)
        if pageable is not None:
            self.checker.report("pageable copy", call, f"{op} {pageable} at {format_where(where)}",
                                dedupe=("pageable", op, where))
        flat, _ = tree_flatten((args, kwargs))
        signature, scalars, external = [], [], []
        lift = op in LIFT_OPS
        for i, a in enumerate(flat):
            if isinstance(a, Tensor):
                signature.append((tuple(a.shape), a.dtype))
                ptr = storage_ptr(a)
                if lift:
                    call.born.add(ptr)
                elif ptr and ptr not in call.born:
                    call.outside.add(ptr)
                    external.append((i, ptr))
            elif isinstance(a, (bool, int, float, complex)):
                scalars.append((i, a))
            else:                       # dtype, device, layout, None, strings: part of the kernel choice
                signature.append(repr(a))
        out = func(*args, **kwargs)
        for t in tree_flatten(out)[0]:
            if isinstance(t, Tensor):
                ptr = storage_ptr(t)
                if ptr and ptr not in call.outside:
                    call.born.add(ptr)
        call.ops.append(OpRecord(op, where, tuple(signature), tuple(scalars), tuple(external)))
        return out


def _same_scalar(a, b) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return type(a) is type(b) and a == b


class ContractChecker:
    """Watches region calls; `violations` lists what breaks the capture contract.

    state: a function returning [(name, tensor)] of everything that outlives a region (model,
    optimizer, static inputs); called at every region boundary to name tensors and to find new or
    moved state."""

    def __init__(self, state):
        self.state = state
        self.violations: list[Violation] = []
        self.calls: dict[tuple[str, str], int] = {}          # (region, key) -> calls so far
        self.captured: dict[tuple[str, str], RegionCall] = {}  # (region, key) -> the capture call (index 1)
        self._seen: set = set()

    def report(self, kind: str, call: RegionCall, message: str, dedupe=None) -> None:
        tag = (kind, call.region, repr(call.key), dedupe if dedupe is not None else message)
        if tag in self._seen:
            return
        self._seen.add(tag)
        self.violations.append(Violation(kind, call.region, repr(call.key), call.index, message))

    def _named(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for name, t in self.state():
            if t is not None and name not in out:
                out[name] = storage_ptr(t)
        return out

    @contextlib.contextmanager
    def region(self, region: str, key):
        """Wrap one call of a capturable region."""
        slot = (region, repr(key))
        index = self.calls.get(slot, 0)
        self.calls[slot] = index + 1
        call = RegionCall(region, key, index)
        before = self._named()
        for name, ptr in before.items():
            call.names.setdefault(ptr, name)
        with _RegionMode(self, call):
            yield
        if index >= 1:  # the first call of a key is the warm-up: lazy state may appear there
            self._check_state(call, before, self._named())
        if index == 1:
            self.captured[slot] = call
        elif index >= 2:
            self._compare(self.captured[slot], call)

    def run_region(self, region: str, key, fn):
        """`Run.run_region`'s signature: fn() checked as one call of the region."""
        with self.region(region, key):
            return fn()

    def _check_state(self, call: RegionCall, before: dict[str, int], after: dict[str, int]) -> None:
        for name, ptr in after.items():
            old = before.get(name)
            if old == ptr:
                continue
            if ptr in call.born:
                self.report("new persistent tensor", call, f"{name} is a tensor created inside the region "
                            f"({'was unset before' if old is None else 'replacing the one it had'})", dedupe=name)
            elif ptr:
                self.report("storage moved", call, f"{name} now lives at another storage, set by Python "
                            f"inside the region", dedupe=name)
        for name in before.keys() - after.keys():
            self.report("state changed by Python", call, f"{name} was released inside the region (a replay "
                        f"runs no Python: it would stay set)", dedupe=name)

    def _name(self, ptr: int, *calls: RegionCall) -> str | None:
        for c in calls:
            if ptr in c.names:
                return c.names[ptr]
        return None

    def _compare(self, capture: RegionCall, call: RegionCall) -> None:
        if len(capture.ops) != len(call.ops):
            self.report("different kernels", call, f"{len(call.ops)} ops, the capture call ran {len(capture.ops)}",
                        dedupe="count")
        for i, (a, b) in enumerate(zip(capture.ops, call.ops)):
            if a.op != b.op or a.signature != b.signature:
                self.report("different kernels", call, f"op #{i}: {b.op} {b.signature} at {format_where(b.where)}; "
                            f"the capture call ran {a.op} {a.signature} at {format_where(a.where)}", dedupe="ops")
                return  # the sequences no longer line up
            for (ia, va), (ib, vb) in zip(a.scalars, b.scalars):
                if ia != ib or not _same_scalar(va, vb):
                    self.report("Python scalar changes", call,
                                f"{b.op} argument {ib} at {format_where(b.where)}: {va!r} at the capture call, "
                                f"{vb!r} now (a graph bakes in the first)", dedupe=("scalar", b.op, b.where, ib))
            then, now = dict(a.external), dict(b.external)
            for i in sorted(then.keys() | now.keys()):
                pa, pb = then.get(i), now.get(i)
                if pa == pb:
                    continue
                old_name = self._name(pa, capture) if pa else None
                new_name = self._name(pb, call) if pb else None
                name = new_name or old_name
                what = name or ("an unnamed tensor from outside the region (a per-step input not copied "
                                "into a static buffer?)")
                if pa is None or pb is None:
                    detail = ("reads a tensor from outside the region where the capture call read one made inside it"
                              if pa is None else
                              "reads a tensor made inside the region where the capture call read one from outside")
                elif old_name and new_name and old_name != new_name:
                    detail = f"reads {new_name} where the capture call read {old_name}"
                else:
                    detail = "reads another storage than at the capture call"
                self.report("storage moved", call, f"{what}: {b.op} argument {i} at {format_where(b.where)} {detail}",
                            dedupe=name or ("op", b.where))


# ----------------------------------------------------------------------------------------------------
# the CLI: N training steps of a preset on dummy batches, every region checked
# ----------------------------------------------------------------------------------------------------


def build_run(config: str = "smoke", seed: int = 0):
    """A one-process training.Run of a preset, with host checks off (as on a GPU)."""
    from runtime import training
    from config import RUN_PRESETS
    from runtime.preflight import check_node
    cfg = dataclasses.replace(RUN_PRESETS[config], seed=seed)
    setup = training.Setup(cfg)
    check_node(cfg, setup.backend)
    return training.Run(cfg, setup)


def check_run(run, steps: int, start: int = 0, checker: ContractChecker | None = None,
              loader=None) -> ContractChecker:
    """Train steps [start, start + steps) of `run`, every region call checked; returns the checker
    (its `violations`). Batches from `loader` (a data.loader.TrainLoader) or, without one, the
    warmup's dummy batches (random tokens of each step's geometry)."""
    from data.loader import dummy_batch
    checker = checker or ContractChecker(lambda: run_state(run))
    schedule, cfg = run.schedule, run.cfg
    previous = run.region_runner  # what Run.run_region calls: graphs or a plain call; the checker instead
    run.region_runner = checker.run_region
    end = min(start + steps, schedule.total_steps)

    def batches(step: int) -> list | None:
        if step >= end:
            return None
        tokens = schedule.batch_tokens(step) // cfg.virtual_world_size
        if loader is not None:
            return loader.next_batches(tokens, schedule.doc_cap(step))
        return [dummy_batch(tokens, schedule.doc_cap(step), seed=1000 * step + r,
                            virtual_seq_cap=cfg.schedule.virtual_seq_cap, **run.hash_args)
                for r in run.setup.virtual_ranks]

    try:
        following = batches(start)
        for step in range(start, end):
            current, following = following, batches(step + 1)  # one ahead, as the loop (row prefetch)
            run.train_step(step, current, following)
        run.flush()  # the last update's refresh region is checked too
    finally:
        run.region_runner = previous
    return checker


def summary(checker: ContractChecker, steps: int, config: str) -> tuple[str, int]:
    """(the report: every violation, the region calls per key, PASS or FAIL; the exit code)."""
    lines = [str(v) for v in checker.violations]
    calls = "; ".join(f"{region} {key}: {n}" for (region, key), n in sorted(checker.calls.items()))
    lines.append(f"checked {steps} step(s) of --config {config}; region calls per key: {calls}")
    compared = sum(1 for n in checker.calls.values() if n >= 3)
    lines.append(f"{compared} of {len(checker.calls)} keys had a replay to compare with their capture call "
                 f"(a key seen fewer than 3 times is checked for host syncs and new state only)")
    if checker.violations:
        lines.append(f"FAIL: {len(checker.violations)} capture-contract violation(s)")
        return "\n".join(lines), 1
    lines.append("PASS: every region keeps the capture contract")
    return "\n".join(lines), 0


def main(argv=None) -> int:
    from cli import ArgumentParser, check_preset, exit_on_config_error, non_negative_int
    from config import RUN_PRESETS, ConfigError
    from runtime.config_check import data_problems, shard_globs
    from optim.schedule import TrainingSchedule

    prog = "python -m tools.capture_contract"
    with exit_on_config_error(prog):
        ap = ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
        ap.add_argument("--config", default="smoke", help="run preset (default: smoke)")
        ap.add_argument("--steps", type=int, default=6, help="training steps to check, from step 0 (default: 6)")
        ap.add_argument("--seed", type=non_negative_int, default=0)
        ap.add_argument("--data-path", default=None,
                        help="train on these shards (train_gpt.py's --data-path) instead of dummy batches")
        args = ap.parse_args(argv)
        check_preset(args.config, RUN_PRESETS)
        cfg = RUN_PRESETS[args.config]
        total = TrainingSchedule(cfg.schedule).total_steps
        if not 3 <= args.steps <= total:
            raise ConfigError(f"--steps {args.steps}: must be in [3, {total}]: a key needs a warm-up call, a capture "
                              f"call and a call to compare, and --config {args.config} has {total} steps")
        if args.data_path is not None:
            cfg = dataclasses.replace(cfg, data_path=args.data_path)
            schedule = TrainingSchedule(cfg.schedule)
            problems = data_problems(cfg, args.steps, schedule, validation=False)
            if problems:
                raise ConfigError(problems)
    from data.loader import TrainLoader
    from perf import backend as perf_backend
    with perf_backend.use_backend(host_checks=False):  # the CPU-only debugging reads a GPU never does
        run = build_run(args.config, args.seed)
        loader = None
        if args.data_path is not None:
            train_glob, _ = shard_globs(cfg)
            loader = TrainLoader(train_glob, run.setup.virtual_ranks, run.cfg.virtual_world_size, **run.hash_args,
                                 virtual_seq_cap=run.cfg.schedule.virtual_seq_cap)
        try:
            checker = check_run(run, args.steps, loader=loader)
        finally:
            if loader is not None:
                loader.close()
    text, code = summary(checker, args.steps, args.config)
    print(text)
    return code


if __name__ == "__main__":
    sys.exit(main())
