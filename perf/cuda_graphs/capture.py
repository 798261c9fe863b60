"""CUDA-graph capture of the training step's regions, replayed in the timed loop (SPEEDRUN_CUDA_GRAPHS).

Record #360 replays its forward/backward and its optimizer update as CUDA graphs: its ablation
prices the step graphs at 2.99 s and the optimizer-update graphs at 0.92 s of its 39.9 s. A step
is hundreds of small launches (the ANVIL cascade, the Adam tail, the fp8 refresh, the small
replicated parameters) that the host cannot issue as fast as the GPU runs them; a replay issues
them all in one call.

`RegionGraphs.run(region, key, fn)` is what `training.Run.train_step` calls for each capturable
region ("forward_backward" per step geometry, "optimizer" per optimizer phase and fp8 refresh
mode; tools/capture_contract.py states what a region must keep to be capturable):

* while `capturing` (the untimed warmup), the first call of a key runs `fn` eagerly (the warm-up
  a capture needs: lazy state, autotuning, cuBLAS and NCCL set-up; on a side stream on CUDA) and
  notes which state it writes (per-tensor fingerprints before and after). The second call
  captures and checks: that state is saved, the graph captured, the state restored, the graph
  replayed, the state restored again and `fn` run eagerly; the replay must match the eager run
  (`GraphMismatch`, naming the region, key and tensors, stops the run otherwise). The check runs
  on the state a real call meets (the optimizer's gradients in place, say), which is why it waits
  for a second call: `training.warmup_steps` visits every key the run meets more than once twice;
* later calls of a captured key replay the graph and return its static outputs;
* a key in `eager_keys` always runs eagerly: the plan's keys that a run meets only once (a graph
  would not pay; `training.Run.warmup` lists them, the log line names them);
* any other key first met after `freeze()` (the timed loop) runs eagerly, counted in
  `eager_calls`, or, with `strict` (the record), stops the run: a record never falls back silently.

Every capture runs inside `perf.streams.capturing(region, key)`: the worker threads that issue
side-stream work (the host table's) are drained and held until it ends, and a device call of
perf/streams.py from another thread meanwhile stops the run (a global-mode capture would be
invalidated by it on CUDA).

Two graph kinds share that plan:

* `CudaGraph`: `torch.cuda.CUDAGraph`, every graph in one memory pool (graphs replay one at a
  time, in stream order, so their intermediates may share memory; their outputs stay alive);
* `TapeGraph`, the CPU twin: records the region's aten ops (TorchDispatchMode, below autograd,
  so the backward's ops too) and replays them on the recorded tensors: tensors from outside the
  region by their storage (a graph's baked addresses), tensors made inside rebuilt from the
  replayed ops, Python scalars as recorded, no Python run. A region whose Python does work a
  replay skips (a host counter, a tensor swapped in by Python, a per-step Python number) trains
  differently under it, so `SPEEDRUN_CUDA_GRAPHS=1` on CPU proves the capture plan end to end:

      python -m tools.capture_compare --config smoke --steps 6   # graphed vs eager, bit for bit

Bitwise: the CPU twin replays the very ops eager runs, so its check demands equal bits. On CUDA
kernels that accumulate with atomics (embedding backward, split reductions) may differ in the
last bits between two runs, so the check allows `CUDA_TOLERANCE` of the tensor's largest
magnitude and reports how many tensors matched bit for bit.

What the check costs a rank, and its bound (`python -m tools.memory --config record` prints it per
key, computed on "meta" by tools/capture_cost.py):

* it looks only at state a region can write: `written_outside_regions` names what only code
  outside every region writes (the n-gram table shard, 15.1 GiB per rank on the record, its row
  optimizer, the step weights, the static inputs' data) and the check neither fingerprints nor
  copies it. A guard keeps that honest at no device cost: the excluded tensors' version counters
  and storages are read around every eager call while capturing, and a region that wrote one stops
  the run (`ExcludedStateWritten`);
* a key's warm-up fingerprints the rest twice (device reads; int64 temporaries of at most
  2 x 8 x FINGERPRINT_CHUNK bytes at a time);
* its capture copies the written state to host twice (the start, the graphed result) and the
  outputs once, into one `HostStaging` pool reused by every capture: pinned blocks of
  STAGING_BLOCK bytes on CUDA, plain host blocks on CPU, grown to the largest key's need and
  released at `freeze()`. Host bytes per rank <= 2 x the largest key's written state + its
  outputs, rounded up to a block.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist
from torch import Tensor
from torch.utils._pytree import tree_flatten, tree_map

from perf import streams
from perf.cuda_graphs.state import LIFT_OPS  # torch.tensor(...) inside a region: a Python-made constant
from perf.cuda_graphs.state import OpRecordingMode
from perf.cuda_graphs.state import storage_ptr as _storage_ptr

# Largest |graphed - eager| allowed, relative to max |eager| of the tensor, on CUDA: two eager
# runs of a kernel with atomic accumulation differ at this level at most (bf16 rounding of
# reordered sums); a stale address or a skipped Python side effect differs at O(1).
CUDA_TOLERANCE = 1e-2
FINGERPRINT_CHUNK = 1 << 26  # elements per chunk of a state fingerprint (bounds its int64 temporaries)
# ours: the check's host pool grows by blocks of 256 MiB. A power of two: the pinned allocator
# rounds every request up to one, so a block wastes nothing, and the pool exceeds the largest
# key's need by less than one block.
STAGING_BLOCK = 1 << 28
STAGING_ALIGN = 64  # ours: each copy starts on a 64-byte boundary (a multiple of every element size)


def written_outside_regions(name: str) -> bool:
    """Whether only code outside every region writes the state of this state.run_state name,
    so the capture check leaves it out (a region writing it is caught: `ExcludedStateWritten`):

    * ngram_table.rows, ngram_optimizer.state.*: the table event (`NgramRowOptimizer.step`, after
      the optimizer region) and the reset; the row pulls only read the table;
    * step_weights[...]: `StepWeights.load`, at the step's top;
    * static_input[...]: `Run.upload`'s copies and the pull's `finish(out=rows)`, before
      forward_backward, which only reads them. Their `.grad` (the n-gram sink leaf's) is the
      backward's: checked."""
    if name.endswith(".grad"):
        return False
    return name.startswith(("ngram_table.", "ngram_optimizer.", "step_weights[", "static_input["))


def _flat_tensors(outputs) -> list[Tensor]:
    return [t for t in tree_flatten(outputs)[0] if isinstance(t, Tensor)]


# ----------------------------------------------------------------------------------------------------
# the two graph kinds
# ----------------------------------------------------------------------------------------------------


class CudaGraph:
    """One torch.cuda.CUDAGraph: `capture(fn)` records fn's kernels (running none of them) and
    returns its outputs, static tensors that every `replay()` rewrites in place."""

    def __init__(self, pool, stream: torch.cuda.Stream):
        self.graph = torch.cuda.CUDAGraph()
        self.pool, self.stream = pool, stream

    def capture(self, fn: Callable):
        torch.cuda.synchronize()
        with torch.cuda.graph(self.graph, pool=self.pool, stream=self.stream):
            outputs = fn()
        torch.cuda.synchronize()
        return outputs

    def replay(self) -> None:
        self.graph.replay()

    def release(self) -> None:
        self.graph.reset()   # its kernels (NCCL's among them) go before the communicator does


@dataclass(frozen=True)
class _Made:
    """A tensor made inside the region: a view (offset, size, stride, dtype) of the storage the
    region's `storage`-th fresh allocation produced."""
    storage: int
    offset: int
    size: tuple
    stride: tuple
    dtype: torch.dtype
    device: torch.device


@dataclass
class _TapeOp:
    func: object
    args: tuple        # tensors from outside as themselves (kept alive: state), made ones as _Made
    kwargs: dict
    fresh: list        # (index in the flattened outputs, storage number) of each freshly allocated output


class _TapeMode(OpRecordingMode):
    """Runs and records every aten op (see TapeGraph.capture)."""

    def __init__(self, tape: "TapeGraph"):
        super().__init__()
        self.tape = tape

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tape = self.tape
        arg_ptrs = {_storage_ptr(a) for a in tree_flatten((args, kwargs))[0] if isinstance(a, Tensor)}
        if func._schema.name in LIFT_OPS:  # a constant made by Python (torch.tensor(...)): baked as is;
            for ptr in arg_ptrs:               # Python allocated it, maybe where a freed made one lived
                tape.made.pop(ptr, None)
            rec_args, rec_kwargs = args, kwargs
        else:
            rec_args, rec_kwargs = tree_map(tape.encode, args), tree_map(tape.encode, kwargs)
        out = func(*args, **kwargs)
        for o in tree_flatten(out)[0]:
            if isinstance(o, torch.ScriptObject) and hasattr(o, "wait"):
                # a collective's Work: waited here, unrecorded, as the replay will; what its wait
                # runs (gloo copies its result out then) is the collective's, not the region's
                o.wait()
        fresh = []
        for i, t in enumerate(tree_flatten(out)[0]):
            ptr = _storage_ptr(t) if isinstance(t, Tensor) else 0
            # a storage no argument has is a new allocation (a live argument's address cannot be
            # handed out again); the address of a freed one may be, so the number is what counts
            if ptr and ptr not in arg_ptrs:
                tape.made[ptr] = number = len(tape.made_order)
                tape.made_order.append(ptr)
                fresh.append((i, number))
        tape.ops.append(_TapeOp(func, rec_args, rec_kwargs, fresh))
        return out


class TapeGraph:
    """The CPU twin of a CUDA graph (see the module docstring). `capture(fn)` runs fn once,
    recording its aten ops: tensors from outside the region by reference (their storage is what a
    graph bakes in), tensors made inside as views of the region's n-th allocation. `replay()`
    re-runs the ops on those (allocations freed after their last use) and copies the results
    into the capture's outputs, the static tensors a CUDA graph rewrites in place."""

    def __init__(self):
        self.ops: list[_TapeOp] = []
        self.made: dict[int, int] = {}   # storage address -> number of the allocation now living there
        self.made_order: list[int] = []
        self.outputs = None
        self._output_refs: list = []
        self._last_use: dict[int, int] = {}

    def encode(self, a):
        if not isinstance(a, Tensor):
            return a
        number = self.made.get(_storage_ptr(a))
        if number is None:
            return a   # from outside the region
        return _Made(number, a.storage_offset(), tuple(a.shape), tuple(a.stride()), a.dtype, a.device)

    def capture(self, fn: Callable):
        with _TapeMode(self):
            self.outputs = fn()
        self._output_refs = [self.encode(t) for t in _flat_tensors(self.outputs)]
        for i, op in enumerate(self.ops):
            for a in tree_flatten((op.args, op.kwargs))[0]:
                if isinstance(a, _Made):
                    self._last_use[a.storage] = i
        self.made.clear()   # the capture's own tensors are free to go; the records hold no reference
        return self.outputs

    def replay(self) -> None:
        storages: dict[int, torch.UntypedStorage] = {}
        keep = {r.storage for r in self._output_refs if isinstance(r, _Made)}

        def decode(a):
            if not isinstance(a, _Made):
                return a
            return torch.empty(0, dtype=a.dtype, device=a.device).set_(storages[a.storage], a.offset, a.size, a.stride)

        with torch.no_grad(), torch._C._AutoDispatchBelowADInplaceOrView():
            for i, op in enumerate(self.ops):
                out = op.func(*tree_map(decode, op.args), **tree_map(decode, op.kwargs))
                flat = tree_flatten(out)[0]
                for index, number in op.fresh:
                    storages[number] = flat[index].untyped_storage()
                for o in flat:
                    if isinstance(o, torch.ScriptObject) and hasattr(o, "wait"):
                        o.wait()   # a collective's Work, waited where the capture waited on it
                for a in tree_flatten((op.args, op.kwargs))[0]:
                    if isinstance(a, _Made) and self._last_use.get(a.storage) == i and a.storage not in keep:
                        storages.pop(a.storage, None)
            for static, ref in zip(_flat_tensors(self.outputs), self._output_refs):
                if isinstance(ref, _Made):
                    static.copy_(decode(ref))

    def release(self) -> None:
        self.ops.clear()   # the recorded arguments: state tensors and, for collectives, the process group
        self.outputs, self._output_refs = None, []


# ----------------------------------------------------------------------------------------------------
# the capture plan
# ----------------------------------------------------------------------------------------------------


class CompileInCapture(RuntimeError):
    """A region compiled a graph inside its capturing call: on CUDA inductor would compile and
    autotune inside `torch.cuda.graph` (which fails, or bakes a half-built state into the graph)."""


def _compiled_graphs() -> int:
    from perf.compile import compiled_graphs

    return compiled_graphs()


def progress_line(verb: str, region: str, key, n: int, planned: int, seconds: float, compiled: int = 0) -> str:
    """`warmup: captured forward_backward (49152, ...) 3/9 in 12.4 s`: one line per warm-up ("warmed
    up", the eager first call, which compiles a compiled run's graph) and per capture, n of the
    planned keys (`?` when the plan is not known), with the graphs dynamo compiled in the call."""
    of = f"{n}/{planned}" if planned else f"{n}/?"
    graphs = f", compiled {compiled} graph{'s' if compiled != 1 else ''}" if compiled else ""
    return f"warmup: {verb} {region} {key!r} {of} in {seconds:.1f} s{graphs}"


class GraphMismatch(RuntimeError):
    """A captured region's first replay differs from an eager run of the same call."""


def state_fingerprints(named: list[tuple[str, Tensor]]) -> dict[str, Tensor]:
    """Per tensor, two int64 sums of its bits (plain and squared, wrapping): equal bits give equal
    fingerprints; a write that changes any bit changes them except by a vanishing coincidence."""
    out = {}
    for name, t in named:
        words = t.detach().reshape(-1)
        if words.numel() == 0:
            continue
        as_int = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[words.element_size()]
        words = words.view(as_int)
        acc = torch.zeros(2, dtype=torch.int64, device=t.device)
        for lo in range(0, words.numel(), FINGERPRINT_CHUNK):
            w = words[lo: lo + FINGERPRINT_CHUNK].to(torch.int64)
            acc[0] += w.sum()
            acc[1] += (w * w).sum()
        out[name] = acc
    return out


def _unique_storages(named: list[tuple[str, Tensor]], storage_key=None) -> list[tuple[str, Tensor]]:
    """The first name of each view of a storage (a parameter and its optimizer view share one).
    storage_key: what tells storages apart (the data pointer; tools/capture_cost.py passes the
    StorageImpl on "meta", where every data pointer is 0)."""
    storage_key = storage_key or _storage_ptr
    seen, out = set(), []
    for name, t in named:
        if t is None or t.numel() == 0:
            continue
        key = (storage_key(t), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)
        if key not in seen:
            seen.add(key)
            out.append((name, t))
    return out


class ExcludedStateWritten(RuntimeError):
    """A region wrote state the capture check leaves out (`written_outside_regions`)."""


def _excluded_marks(named: list[tuple[str, Tensor]]) -> dict[str, tuple]:
    """Per excluded tensor: (storage address, shape, version counter). Any aten write (in place,
    out=, through a view, all_gather_into_tensor, the table event's index_copy_) bumps the version;
    what does not (writes through `.data`, a c10d all_reduce or all_to_all, a raw Triton launch)
    cannot happen to this state on the regions' code paths, which `tools/capture_cost.py` checks
    structurally on "meta" (tests/perf/test_perf_cuda_graphs_capture_bytes.py)."""
    return {name: (_storage_ptr(t), tuple(t.shape), t._version) for name, t in named}


def _differing_marks(before: dict[str, tuple], after: dict[str, tuple]) -> list[str]:
    return [name for name in before.keys() | after.keys() if before.get(name) != after.get(name)]


@dataclass
class HostCopy:
    """A tensor's bytes in a `HostStaging` pool: (block, start, end) byte ranges, in order."""
    shape: tuple
    dtype: torch.dtype
    pieces: list


class HostStaging:
    """Host memory for the capture check's copies, one pool reused by every capture: blocks of
    `block` bytes (pinned on CUDA), added when a key needs more than the pool holds and kept until
    `release()`, so the pool ends at the largest key's need rounded up to a block. `clear()` before
    each capture; `save` copies a tensor in (device to host), `restore` copies it back and `pieces`
    reads it back one block's worth at a time (host to device), so no device temporary exceeds a
    block."""

    def __init__(self, pin: bool, block: int = STAGING_BLOCK):
        if block <= 0 or block % STAGING_ALIGN:
            raise ValueError(f"HostStaging: block {block} bytes must be a positive multiple of {STAGING_ALIGN}")
        self.pin, self.block = pin, block
        self.blocks: list[Tensor] = []
        self.used = 0   # bytes handed out since the last clear()

    @property
    def nbytes(self) -> int:
        return len(self.blocks) * self.block

    def clear(self) -> None:
        self.used = 0

    def release(self) -> None:
        self.blocks.clear()
        self.used = 0

    @staticmethod
    def _flat_bytes(t: Tensor) -> Tensor:
        return t.detach().reshape(-1).view(torch.uint8)   # (numel * element size,)

    def _ranges(self, start: int, n: int):
        """(block, offset, offset in the tensor, length) of the n bytes from pool position start."""
        done = 0
        while done < n:
            b, off = divmod(start + done, self.block)
            take = min(n - done, self.block - off)
            yield b, off, done, take
            done += take

    def save(self, t: Tensor) -> HostCopy:
        src = t if t.is_contiguous() else t.contiguous()   # (the run's state is contiguous: no temporary)
        flat = self._flat_bytes(src)
        start = -(-self.used // STAGING_ALIGN) * STAGING_ALIGN
        self.used = start + flat.numel()
        while self.nbytes < self.used:
            self.blocks.append(torch.empty(self.block, dtype=torch.uint8, pin_memory=self.pin))
        pieces = []
        for b, off, lo, take in self._ranges(start, flat.numel()):
            self.blocks[b][off: off + take].copy_(flat[lo: lo + take])
            pieces.append((b, off, off + take))
        return HostCopy(tuple(t.shape), t.dtype, pieces)

    def pieces(self, copy: HostCopy):
        """(offset in the tensor's bytes, the host bytes) per piece of `copy`."""
        lo = 0
        for b, start, end in copy.pieces:
            yield lo, self.blocks[b][start:end]
            lo += end - start

    def restore(self, copy: HostCopy, t: Tensor) -> None:
        """t (its shape and dtype) rewritten from `copy`."""
        contiguous = t.is_contiguous()
        dst = t.detach() if contiguous else torch.empty(t.shape, dtype=t.dtype, device=t.device)
        flat = self._flat_bytes(dst)
        for lo, host in self.pieces(copy):
            flat[lo: lo + host.numel()].copy_(host)
        if not contiguous:
            t.detach().copy_(dst)

    def compare(self, copy: HostCopy, t: Tensor) -> tuple[bool, float, float]:
        """(bit for bit equal, max |copy - t|, max |t|) of t against `copy`, one piece on t's
        device at a time (the magnitudes only when the bits differ; a NaN gives a NaN difference)."""
        src = t.detach() if t.is_contiguous() else t.contiguous()
        flat, size = self._flat_bytes(src), t.element_size()
        if all(torch.equal(flat[lo: lo + host.numel()], host.to(t.device)) for lo, host in self.pieces(copy)):
            return True, 0.0, 0.0
        values = src.reshape(-1)
        diffs, scales = [], []
        for lo, host in self.pieces(copy):  # whole elements: blocks and starts are 64-byte aligned
            e = values[lo // size: (lo + host.numel()) // size].double()
            diffs.append((e - host.to(t.device).view(t.dtype).double()).abs().max().item())
            scales.append(e.abs().max().item())
        diff = math.nan if any(math.isnan(d) for d in diffs) else max(diffs)
        return False, diff, max(scales)


@dataclass
class Captured:
    graph: object
    outputs: object
    replays: int = 0


@dataclass
class CheckReport:
    region: str
    key: object
    tensors: int          # state tensors the region writes, compared
    bitwise: int          # of those, equal bit for bit
    worst: float          # the largest relative difference (0.0 when all are bitwise)
    worst_name: str = ""


@dataclass
class RegionGraphs:
    """Per (region, key): capture at the first call while `capturing`, replay afterwards.

    make_graph: a new graph (CudaGraph or TapeGraph); named_state: [(name, tensor)] of everything
    that outlives a region (state.run_state), for the capture check; tolerance: allowed
    |graphed - eager| / max|eager| per tensor (0: bitwise); strict: a key first met after
    `freeze()` stops the run instead of running eagerly; warm_stream: the side stream of the
    eager warm-up call (CUDA); outside_regions: state name -> left out of the check (guarded, see
    `written_outside_regions`); pin_staging, staging_block: the check's host pool (`HostStaging`)."""
    make_graph: Callable[[], object]
    named_state: Callable[[], list]
    tolerance: float = 0.0
    strict: bool = False
    warm_stream: object = None
    capturing: bool = True
    graphs: dict = field(default_factory=dict)        # (region, key) -> Captured
    warmed: dict = field(default_factory=dict)        # (region, key) -> names of the state its warm-up wrote
    eager_keys: set = field(default_factory=set)      # (region, key)s run eagerly by plan (met once per run)
    reports: list = field(default_factory=list)       # CheckReport per capture
    eager_calls: dict = field(default_factory=dict)   # (region, key) -> calls run eagerly after freeze
    compiles_in_capture: dict = field(default_factory=dict)  # (region, key) -> graphs dynamo compiled while capturing
    outside_regions: Callable[[str], bool] = field(default=written_outside_regions)
    pin_staging: bool = False
    staging_block: int = STAGING_BLOCK
    staging: HostStaging | None = None   # the check's host pool, from the first capture to freeze()
    staging_peak: int = 0                # its largest size, bytes (the summary line reports it)
    # the warmup's progress: a line per warm-up and per capture (`progress_line`), given to `progress`
    # (training.Run.warmup logs them); planned: the keys the warmup will capture (0: not known)
    progress: Callable[[str], None] | None = None
    planned: int = 0

    @classmethod
    def for_device(cls, device: torch.device, named_state, strict: bool = False) -> "RegionGraphs":
        """CUDA graphs in one shared pool on CUDA, the tape twin (bitwise check) on CPU."""
        if device.type == "cuda":
            pool, stream = torch.cuda.graph_pool_handle(), torch.cuda.Stream(device)
            return cls(lambda: CudaGraph(pool, stream), named_state, tolerance=CUDA_TOLERANCE,
                       strict=strict, warm_stream=torch.cuda.Stream(device), pin_staging=True)
        return cls(TapeGraph, named_state, tolerance=0.0, strict=strict)

    def freeze(self) -> None:
        """The warmup is over: no capture from here on (the check's host pool goes)."""
        self.capturing = False
        self._drop_staging()

    def _drop_staging(self) -> None:
        if self.staging is None:
            return
        self.staging.release()
        self.staging = None
        if self.pin_staging and hasattr(torch._C, "_host_emptyCache"):
            torch._C._host_emptyCache()   # the pinned blocks back to the system, not kept in torch's cache

    def release(self) -> None:
        """Drops every graph and what it recorded; call it before destroy_process_group. A graph
        that captured collectives uses the communicator: NCCL wants such graphs destroyed before
        their communicator, and the CPU twin's tape holds the process group itself."""
        for captured in self.graphs.values():
            captured.graph.release()
        self.graphs.clear()
        self.capturing = False
        self._drop_staging()

    def pending(self) -> list[tuple[str, object]]:
        """Keys warmed once but not yet captured (they need a second call while capturing)."""
        return [slot for slot in self.warmed if slot not in self.graphs]

    def run(self, region: str, key, fn: Callable):
        slot = (region, key)
        captured = self.graphs.get(slot)
        if captured is not None:
            captured.graph.replay()
            captured.replays += 1
            return captured.outputs
        if slot in self.eager_keys:
            return fn()
        if self.capturing:
            if slot not in self.warmed:
                return self._warm_up(slot, fn)
            return self._capture(region, key, fn)
        if self.strict:
            raise RuntimeError(f"CUDA graphs: region {region!r} key {key!r} is met in the timed loop but was not "
                               f"captured during the warmup (training.warmup_steps must call every key twice); "
                               f"a record run does not fall back to eager")
        self.eager_calls[slot] = self.eager_calls.get(slot, 0) + 1
        return fn()

    # --- capture and check ------------------------------------------------------------------------
    def _split(self, named: list) -> tuple[list, list]:
        """(the state the check looks at, the state it leaves out: `outside_regions`), unique views.
        An excluded name whose storage a checked one shares stays checked."""
        unique = _unique_storages(named)
        checked = [(n, t) for n, t in unique if not self.outside_regions(n)]
        shared = {_storage_ptr(t) for _, t in checked} - {0}
        excluded = [(n, t) for n, t in unique if self.outside_regions(n) and _storage_ptr(t) not in shared]
        checked += [(n, t) for n, t in unique if self.outside_regions(n) and _storage_ptr(t) in shared]
        return checked, excluded

    def _guard(self, region: str, key, marks: dict) -> None:
        """Stop the run if the region wrote (or replaced) state the check leaves out."""
        wrote = _differing_marks(marks, _excluded_marks(self._split(self.named_state())[1]))
        if wrote:
            raise ExcludedStateWritten(
                f"CUDA graphs: region {region!r} key {key!r} wrote {', '.join(sorted(wrote))} (its version counter "
                f"or storage changed), state the capture check leaves out because only code outside the regions "
                f"writes it (perf/cuda_graphs/capture.py written_outside_regions): the check would neither restore "
                f"nor compare it. Move the write out of the region, or take the name out of written_outside_regions "
                f"(python -m tools.memory then prices its copies).")

    def _report(self, verb: str, slot, n: int, seconds: float, compiled: int) -> None:
        if self.progress is not None:
            self.progress(progress_line(verb, *slot, n, self.planned, seconds, compiled))

    def _warm_up(self, slot, fn: Callable):
        """The key's first call, eager (on the side stream on CUDA, as capture needs); notes the
        state it writes (fingerprints of the checked state before and after; the excluded state's
        marks, `_guard`)."""
        began, graphs_before = time.perf_counter(), _compiled_graphs()
        named, excluded = self._split(self.named_state())
        before = state_fingerprints(named)
        marks = _excluded_marks(excluded)
        if self.warm_stream is None:
            out = fn()
        else:
            side, main = self.warm_stream, torch.cuda.current_stream()
            side.wait_stream(main)
            with torch.cuda.stream(side):
                out = fn()
            main.wait_stream(side)
        self._guard(*slot, marks)
        after = state_fingerprints(named)
        born = {n for n, _ in self._split(self.named_state())[0]} - {n for n, _ in named}  # first .grads
        self.warmed[slot] = born | {n for n, _ in named if n in before and not torch.equal(before[n], after[n])}
        # torch.equal above waited for the device: the seconds are the call's, compiles included
        self._report("warmed up", slot, len(self.warmed), time.perf_counter() - began, _compiled_graphs() - graphs_before)
        return out

    def _capture(self, region: str, key, fn: Callable):
        began = time.perf_counter()
        names = self.warmed[(region, key)]
        checked, excluded = self._split(self.named_state())
        written = [(n, t) for n, t in checked if n in names]
        marks = _excluded_marks(excluded)
        if self.staging is None:
            self.staging = HostStaging(self.pin_staging, self.staging_block)
        staging = self.staging
        staging.clear()                                    # the pool is reused: this capture's copies from its start
        start = [staging.save(t) for _, t in written]

        def restore():
            for (_, t), saved in zip(written, start):
                staging.restore(saved, t)

        graph = self.make_graph()
        graphs_before = _compiled_graphs()  # the warm-up call compiled the key's graph: nothing may compile now
        with streams.capturing(region, key):               # no other thread issues device work meanwhile
            outputs = graph.capture(fn)                    # CUDA: nothing runs; the tape: runs once
        compiled = _compiled_graphs() - graphs_before
        if compiled:
            self.compiles_in_capture[(region, key)] = compiled
            if self.strict:
                raise CompileInCapture(
                    f"CUDA graphs: region {region!r} key {key!r} compiled {compiled} graph(s) inside its capturing "
                    f"call (its second call; the first, eager, should have compiled everything it runs): a guard "
                    f"failed between the two calls, so the region reads Python state that changes per call "
                    f"(TORCH_LOGS=recompiles names the guard). A record run does not capture a compile.")
        restore()
        graph.replay()
        graphed = [staging.save(t) for _, t in written]
        graphed_out = [staging.save(t) for t in _flat_tensors(outputs)]
        self.staging_peak = max(self.staging_peak, staging.nbytes)
        restore()
        eager_out = fn()
        self._guard(region, key, marks)
        self._check(region, key, written, graphed, _flat_tensors(eager_out), graphed_out)  # reads on host: waited
        self.graphs[(region, key)] = Captured(graph, outputs)
        self._report("captured", (region, key), len(self.graphs), time.perf_counter() - began, compiled)
        return eager_out

    def _check(self, region, key, written, graphed, eager_out, graphed_out) -> None:
        """Each written tensor and output after the eager call against its graphed host copy."""
        pairs = [(name, t.detach(), g) for (name, t), g in zip(written, graphed)]
        pairs += [(f"output {i}", t.detach(), g) for i, (t, g) in enumerate(zip(eager_out, graphed_out))]
        bitwise, worst, worst_name, bad = 0, 0.0, "", []
        for name, eager, g in pairs:
            what = f"{name} {list(eager.shape)} {str(eager.dtype).removeprefix('torch.')}"
            if (tuple(eager.shape), eager.dtype) != (g.shape, g.dtype):
                bad.append(f"{what}: graphed {list(g.shape)} {str(g.dtype).removeprefix('torch.')}")
                worst, worst_name = float("inf"), name
                continue
            same, diff, scale = self.staging.compare(g, eager)
            if same:
                bitwise += 1
                continue
            rel = diff / scale if scale > 0 else float("inf")
            if not rel <= self.tolerance:   # NaN fails too
                bad.append(f"{what}: max |graphed - eager| {diff:.3e} (max |eager| {scale:.3e})")
            if not rel <= worst:
                worst, worst_name = rel, name
        report = CheckReport(region, key, len(pairs), bitwise, worst, worst_name)
        self.reports.append(report)
        elsewhere = 0
        if dist.is_available() and dist.is_initialized():  # every rank stops, not only the one that differs
            device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
            flags = torch.tensor([float(bool(bad))], device=device)
            dist.all_reduce(flags)
            elsewhere = int(flags.item()) - bool(bad)
        if not bad and elsewhere:
            raise GraphMismatch(f"CUDA graph of region {region!r} key {key!r}: its first replay matches eager here, "
                                f"but not on {elsewhere} other rank(s) (their logs name the tensors)")
        if bad:
            allowed = "bit for bit" if self.tolerance == 0 else f"within {self.tolerance:g} of max |eager|"
            raise GraphMismatch(
                f"CUDA graph of region {region!r} key {key!r}: its first replay does not match an eager run of the "
                f"same call ({allowed}) in {len(bad)} of {len(pairs)} tensors: " + "; ".join(bad[:6])
                + (" ..." if len(bad) > 6 else "") + ". The region keeps Python state a replay skips, or reads "
                "an input that is not a static buffer (python -m tools.capture_contract names it).")

    def summary(self) -> str:
        """One line: graphs captured per region, how many check tensors matched bit for bit, replays."""
        per_region: dict[str, int] = {}
        for region, _ in self.graphs:
            per_region[region] = per_region.get(region, 0) + 1
        tensors = sum(r.tensors for r in self.reports)
        bitwise = sum(r.bitwise for r in self.reports)
        worst = max(self.reports, key=lambda r: r.worst, default=None)
        text = (", ".join(f"{region} {n}" for region, n in sorted(per_region.items())) or "none")
        text = f"graphs captured: {text}; replay vs eager: {bitwise}/{tensors} tensors bitwise"
        if worst is not None and worst.worst > 0:
            text += f", worst {worst.worst:.2e} relative ({worst.region} {worst.key!r} {worst.worst_name})"
        replays = sum(c.replays for c in self.graphs.values())
        text += f"; replays {replays}"
        if self.staging_peak:
            text += (f"; check host pool {self.staging_peak / 2 ** 30:.2f} GiB"
                     + (" pinned" if self.pin_staging else ""))
        if self.eager_keys:
            text += "; eager by plan (met once per run): " + ", ".join(f"{r} {k!r}" for r, k in sorted(
                self.eager_keys, key=repr))
        if self.pending():
            text += "; warmed but never captured: " + ", ".join(f"{r} {k!r}" for r, k in self.pending())
        if self.eager_calls:
            text += f"; run eagerly (not captured): {sum(self.eager_calls.values())} calls of " + \
                ", ".join(f"{r} {k!r}" for r, k in self.eager_calls)
        if self.compiles_in_capture:
            text += "; COMPILED WHILE CAPTURING: " + ", ".join(f"{r} {k!r} ({n} graph(s))"
                                                            for (r, k), n in self.compiles_in_capture.items())
        return text
