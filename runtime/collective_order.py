"""One order of collectives on every rank: each rank records the collectives it issues, and a check
at the end of the warmup compares the ranks' sequences and the ordering rule (issue 22).

NCCL matches the collectives of a communicator by their order: two ranks that issue them in a
different order hang (or exchange the wrong tensors) without a word, after minutes of compiling.
Our optimizer graph captures its reduce-scatters and gathers, and eager collectives (the deferred
bank gathers, the prefetched row pulls, the n-gram push) share that communicator, so the README
states a rule:

    an eager collective is waited before the next graph that holds collectives on its group runs.

    recorder = CollectiveRecorder(where=lambda: run.position)
    run.region_runner = recorder.runner(run.region_runner)   # marks each region call
    with recorder:
        ...                                     # the warmup: every region key, every collective kind
    log(recorder.check_across_ranks(group))     # gathers every rank's record; raises on a difference

What is recorded, per collective (`Collective`): the c10d op, its group, the elements this rank
sends and their dtype, `where()` at the launch, the region call it was issued in, and when its Work
was waited. What is checked (`check_across_ranks`, every rank raises the same error):
* every rank issued the same sequence: op, group, element count (an all_to_all with per-peer
  splits: its row shape, and each rank's rows to a peer are the rows that peer expects), dtype,
  region and key, and the collective before which it was waited;
* the ordering rule above, on every rank (`ordering_violations`).

How (torch 2.13): c10d collectives are dispatcher ops (`torch.ops.c10d.allreduce_`,
`_reduce_scatter_base_`, `alltoall_base_`, ...), so a TorchDispatchMode sees each launch with its
tensors and process group; it steps aside while dynamo compiles (`ignore_compile_internals`, as
runtime/sync_check.py), and compiling under it leaves no extra graph (checked: the smoke run compiled
with aot_eager under the warmup's recorder logs "compiled graphs: warmup 3, timed 0"). `Work.wait` is a pybind method, not a dispatcher op:
the recorder wraps it on the class (and on the subclasses that define their own, e.g. the fake
process group's) while it records, and knows the Work a launch returned because pybind hands
Python the same object for the same C++ Work while the recorder holds it.

Regions: `runner(inner)` wraps `Run.region_runner`. A collective issued while the region's own
function runs is the graph's (a capture records it); one issued inside the region call but outside
its function is the graph machinery's (a CPU-twin replay re-running the tape, the capture check's
all-reduce of its verdict): in the sequence, but neither held by the graph nor eager. A CUDA replay
issues nothing on the host: a key holds collectives when any of its recorded calls' functions did.

Not seen: collectives a CUDA graph replays (the capture and the first eager call of each key are
seen, on every rank alike), waits through a ScriptObject (the CPU twin's replay), and functional
collectives (`_c10d_functional`, waited by `wait_tensor`): the recorder refuses those by name (the
project issues none). Point-to-point ops would differ between ranks by design; the project has
none, and the check would report them as a difference.

torch's own TORCH_DISTRIBUTED_DEBUG=DETAIL (ProcessGroupWrapper, around gloo and NCCL groups
alike) exchanges each collective's op and shapes across ranks on a helper gloo group before it
runs: on 2 gloo ranks it names a swapped op (both ranks' op types, shapes and dtypes) but not where
in the run they were, and it roughly doubled the time of a small all-reduce there. It checks at
launch, so a captured collective is checked at its capture and never at a replay, and it never
sees waits: a 2-GPU development check, not a record's. The README says when to use which.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class CollectiveOrderError(RuntimeError):
    """The ranks issued different collectives, or an eager collective was not waited before the
    next graph holding collectives on its group."""


# the argument that holds what this rank sends (c10d op schemas, torch 2.13); any other c10d op
# with a process group counts every tensor before its process group
_SENT_ARG = {"allreduce_": 0, "allreduce_coalesced_": 0, "broadcast_": 0, "reduce_": 0, "barrier": 0,
             "monitored_barrier_": 0, "send": 0, "recv_": 0, "recv_any_source_": 0,
             "_allgather_base_": 1, "allgather_": 1, "allgather_coalesced_": 1, "allgather_into_tensor_coalesced_": 1,
             "_reduce_scatter_base_": 1, "reduce_scatter_": 1, "reduce_scatter_tensor_coalesced_": 1,
             "alltoall_base_": 1, "alltoall_": 1, "gather_": 1, "scatter_": 1}


@dataclass
class Collective:
    """One collective as this rank issued it."""
    index: int                     # its place in this rank's sequence
    op: str                        # the c10d op ("allreduce_", "_reduce_scatter_base_", "alltoall_base_", ...)
    group: str                     # "<backend> group <name>" (group names are the same on every rank)
    group_size: int
    numel: int                     # elements this rank sends
    dtype: str
    row_shape: tuple[int, ...]     # alltoall_base_: the shape of one row (dim 0 is split between peers)
    send_rows: tuple[int, ...]     # alltoall_base_: rows to each peer; () for an even split
    recv_rows: tuple[int, ...]     # alltoall_base_: rows from each peer; () for an even split
    region: str | None             # "optimizer key ..." when issued inside a region call, else None
    call: int | None               # that region call's index in CollectiveRecorder.region_calls
    in_fn: bool                    # inside the region's own function (the graph's collective)
    where: str                     # where() at the launch
    launched: int                  # the recorder's clock at the launch
    waited: int | None = None      # the clock at its first Work.wait, None if never waited
    waited_before: int | None = None  # the number of collectives launched when it was waited

    @property
    def place(self) -> str:
        if self.region is None:
            return "outside regions"
        return f"in region {self.region}" + ("" if self.in_fn else " (graph machinery: a replay or the capture check)")

    @property
    def signature(self) -> tuple:
        """What every rank must agree on (not `where`: it only explains)."""
        size = ("rows", self.row_shape) if self.send_rows else self.numel
        return self.op, self.group, self.dtype, size, self.region, self.in_fn, self.waited_before

    def describe(self) -> str:
        size = f"{self.numel} x {self.dtype}"
        if self.send_rows:
            size += f" (rows of {list(self.row_shape)}: sends {list(self.send_rows)}, receives {list(self.recv_rows)})"
        if self.waited_before is None:
            waited = "never waited"
        else:
            waited = f"waited before #{self.waited_before}" if self.waited_before > self.index + 1 else "waited at once"
        return f"#{self.index} {self.op} on {self.group}: {size}, {self.place}, {waited}, at {self.where or '?'}"


@dataclass
class RegionCall:
    """One call of Run.region_runner: (region, key) and its span on the recorder's clock."""
    region: str                    # "optimizer key OptimizerPhase(...)"
    key: tuple                     # (region name, repr(key)): what a graph is captured for
    where: str
    start: int
    end: int | None = None
    inside: bool = False           # its function is running now


# ----------------------------------------------------------------------------------------------------
# Work.wait, wrapped while a recorder records
# ----------------------------------------------------------------------------------------------------
_active: list["CollectiveRecorder"] = []
_originals: dict[type, object] = {}


def _work_classes() -> list[type]:
    """Work and every subclass that defines its own wait (pybind's FakeWork, Python's _IllegalWork)."""
    found, stack = [], [torch._C._distributed_c10d.Work]
    while stack:
        cls = stack.pop()
        if "wait" in cls.__dict__:
            found.append(cls)
        stack.extend(cls.__subclasses__())
    return found


def _wrapped_wait(original):
    def wait(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        for recorder in _active:
            recorder._waited(self)
        return result
    wait.__doc__ = getattr(original, "__doc__", None)
    return wait


def _patch_waits() -> None:
    for cls in _work_classes():
        _originals[cls] = cls.__dict__["wait"]
        cls.wait = _wrapped_wait(_originals[cls])


def _restore_waits() -> None:
    for cls, original in _originals.items():
        cls.wait = original
    _originals.clear()


class _LaunchMode(TorchDispatchMode):
    """Hands every c10d collective to the recorder after it launched; every other op runs as is."""

    def __init__(self, recorder: "CollectiveRecorder"):
        super().__init__()
        self.recorder = recorder

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True  # off while dynamo traces and compiles, on while compiled graphs run

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "_c10d_functional":
            raise CollectiveOrderError(f"{func} at {self.recorder.where() or '?'}: a functional collective (waited "
                                       "by wait_tensor, not Work.wait); the order recorder follows torch.distributed's "
                                       "eager collectives only")
        out = func(*args, **(kwargs or {}))
        if func.namespace == "c10d":
            self.recorder._launched(func, args, out)
        return out


# ----------------------------------------------------------------------------------------------------
# the recorder
# ----------------------------------------------------------------------------------------------------
class CollectiveRecorder:
    """Records this rank's collectives while entered (see the module docstring). where: a
    callable naming the run's position at a launch (train's `lambda: run.position`)."""

    def __init__(self, where: Callable[[], str] | None = None):
        self.where = where or (lambda: "")
        self.collectives: list[Collective] = []
        self.region_calls: list[RegionCall] = []
        self._clock = 0
        self._open: list[int] = []     # the region calls entered and not left (indices into region_calls)
        self._pending: dict[int, tuple[object, Collective]] = {}  # id(Work) -> (Work kept alive, its collective)
        self._mode: _LaunchMode | None = None

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    # --- entering and leaving ------------------------------------------------------------------
    def __enter__(self) -> "CollectiveRecorder":
        if self._mode is not None:
            raise RuntimeError("CollectiveRecorder: already recording")
        if not _active:
            _patch_waits()
        _active.append(self)
        self._mode = _LaunchMode(self)
        self._mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._mode.__exit__(*exc)
        self._mode = None
        _active.remove(self)
        if not _active:
            _restore_waits()
        self._pending.clear()   # Works never waited stay never waited; their tensors are released

    @property
    def recording(self) -> bool:
        return self._mode is not None

    # --- regions -------------------------------------------------------------------------------
    def runner(self, inner: Callable) -> Callable:
        """`inner`'s signature (region, key, fn) -> fn's result (Run.region_runner): each call
        marked as a region call, and the span of fn itself as the graph's own."""
        def run(region: str, key, fn: Callable):
            call = RegionCall(f"{region} key {key!r}", (region, repr(key)), self.where(), self._tick())
            self.region_calls.append(call)
            self._open.append(len(self.region_calls) - 1)

            def own():
                call.inside = True
                try:
                    return fn()
                finally:
                    call.inside = False
            try:
                return inner(region, key, own)
            finally:
                self._open.pop()
                call.end = self._tick()
        return run

    # --- what the mode and the wait wrapper report ----------------------------------------------
    def _launched(self, func, args, out) -> None:
        pg_index = next((i for i, a in enumerate(args) if isinstance(a, torch.ScriptObject)
                         and "ProcessGroup" in str(a._type())), None)
        if pg_index is None:   # c10d::check_for_nan and the like: not a collective
            return
        pg = torch._C._distributed_c10d.ProcessGroup.unbox(args[pg_index])
        op = func._schema.name.split("::")[-1]
        sent = args[_SENT_ARG[op]] if op in _SENT_ARG else args[:pg_index]
        tensors = [t for t in tree_flatten(sent)[0] if isinstance(t, torch.Tensor)]
        send_rows = recv_rows = ()
        row_shape: tuple[int, ...] = ()
        if op == "alltoall_base_":
            output_splits, input_splits = args[pg_index + 1], args[pg_index + 2]
            row_shape = tuple(args[1].shape[1:])
            if input_splits or output_splits:
                send_rows, recv_rows = tuple(input_splits), tuple(output_splits)
        index = self._open[-1] if self._open else None
        call = self.region_calls[index] if index is not None else None
        c = Collective(index=len(self.collectives), op=op, group=f"{pg.name()} group {pg.group_name}",
                       group_size=pg.size(), numel=sum(t.numel() for t in tensors),
                       dtype=",".join(sorted({str(t.dtype).removeprefix("torch.") for t in tensors})) or "-",
                       row_shape=row_shape, send_rows=send_rows, recv_rows=recv_rows,
                       region=call.region if call is not None else None, call=index,
                       in_fn=call is not None and call.inside,
                       where=self.where(), launched=self._tick())
        self.collectives.append(c)
        for work in tree_flatten(out)[0]:
            if isinstance(work, torch.ScriptObject) and "Work" in str(work._type()):
                work = torch._C._distributed_c10d.Work.unbox(work)
                self._pending[id(work)] = (work, c)  # held: pybind returns this same object to the caller

    def _waited(self, work) -> None:
        entry = self._pending.pop(id(work), None)
        if entry is not None:
            c = entry[1]
            c.waited, c.waited_before = self._tick(), len(self.collectives)

    # --- the checks ------------------------------------------------------------------------------
    def ordering_violations(self) -> list[str]:
        """Each eager collective (outside every region call) still unwaited when a region call
        starts whose key's function issued collectives on the same group (in any recorded call)."""
        holding: dict[tuple, set[str]] = {}
        for c in self.collectives:
            if c.call is not None and c.in_fn:
                holding.setdefault(self.region_calls[c.call].key, set()).add(c.group)
        starts = [call.start for call in self.region_calls]
        found = []
        for c in self.collectives:
            if c.call is not None:
                continue
            for call in self.region_calls[bisect.bisect_right(starts, c.launched):]:
                if c.waited is not None and c.waited < call.start:
                    break
                if c.group in holding.get(call.key, ()):
                    at = f" (at {call.where})" if call.where and call.region not in call.where else ""
                    found.append(f"{c.describe()}; still in flight when region {call.region} started{at}, whose "
                                 f"graph holds collectives on {c.group}")
                    break
        return found

    def check_order(self) -> str:
        """The ordering rule on this rank alone; raises CollectiveOrderError naming each violation."""
        violations = self.ordering_violations()
        if violations:
            raise CollectiveOrderError(_rule_message({0: violations}))
        return f"collective order: {len(self.collectives)} collectives, each eager one waited before the next graph"

    def check_across_ranks(self, group=None) -> str:
        """Gather every rank's record over `group` (a gloo group: host objects; it must span every
        rank) and check that all ranks issued the same sequence and kept the ordering rule. Every
        rank raises the same CollectiveOrderError on a difference (ranks whose sequences differ in
        length too: the gather sends each rank's whole record). Returns a one-line summary.
        Call it after recording, on every rank."""
        if self.recording:
            raise RuntimeError("CollectiveRecorder.check_across_ranks: leave the recorder first (its own gather "
                               "would be recorded)")
        world = dist.get_world_size(group)
        gathered: list = [None] * world
        dist.all_gather_object(gathered, (self.collectives, self.ordering_violations()), group=group)
        sequences = [g[0] for g in gathered]
        problems = compare_sequences(sequences)
        violations = {r: g[1] for r, g in enumerate(gathered) if g[1]}
        if problems or violations:
            text = "\n".join(problems)
            if violations:
                text += ("\n" if text else "") + _rule_message(violations)
            raise CollectiveOrderError(text)
        groups = sorted({c.group for c in sequences[0]})
        return (f"collective order: {len(sequences[0])} collectives on {len(groups)} group(s) ({', '.join(groups)}), "
                f"the same on {world} ranks; each eager one waited before the next graph holding collectives")


def _rule_message(violations: dict[int, list[str]]) -> str:
    lines = ["an eager collective was not waited before the next graph holding collectives on its group (NCCL "
             "orders one communicator by launch: a replay would queue behind or ahead of it):"]
    for rank, found in violations.items():
        lines += [f"  rank {rank}: {v}" for v in found[:5]]
        if len(found) > 5:
            lines.append(f"  rank {rank}: ... and {len(found) - 5} more")
    return "\n".join(lines)


def compare_sequences(sequences: list[list[Collective]]) -> list[str]:
    """Problems with the ranks' sequences (index = rank), empty when they agree: the first
    collective where some rank differs from rank 0 (both entries named, or the missing one), a
    group that does not span every rank, and all_to_all splits a peer does not expect."""
    world = len(sequences)
    for seq in sequences:
        for c in seq:
            if c.group_size != world:
                return [f"collective order: {c.group} spans {c.group_size} of {world} ranks; the check compares whole "
                        f"sequences, so every group must span all ranks ({c.describe()})"]
    lengths = [len(s) for s in sequences]
    for i in range(max(lengths)):
        entries = [s[i] if i < len(s) else None for s in sequences]
        first = entries[0]
        if all(e is not None and first is not None and e.signature == first.signature for e in entries):
            continue
        lines = [f"collective order differs between ranks at collective #{i} (ranks issued {lengths} collectives; "
                 "NCCL would hang or mix up the tensors here):"]
        for rank, e in enumerate(entries):
            if rank == 0 or e is None or first is None or e.signature != first.signature:
                lines.append(f"  rank {rank}: " + (e.describe() if e is not None
                                                   else f"nothing (it issued only {lengths[rank]})"))
        return ["\n".join(lines)]
    problems = []   # the sequences agree; each all_to_all with splits: what each peer expects
    for i in (i for i, c in enumerate(sequences[0]) if c.send_rows):
        for sender in range(world):
            for peer in range(world):
                sends, expects = sequences[sender][i].send_rows[peer], sequences[peer][i].recv_rows[sender]
                if sends != expects:
                    problems.append(f"all_to_all #{i} on {sequences[0][i].group}: rank {sender} sends {sends} rows "
                                    f"to rank {peer}, which expects {expects} (at {sequences[sender][i].where or '?'})")
    return problems

