"""What the CUDA-graph capture check (perf/cuda_graphs/capture.py) costs one rank, computed on "meta"
at a preset's shapes; `python -m tools.memory --config record` prints it (its "capture check" section).

The rank is the run itself, built on "meta" (runtime/meta_rank.py's `build_rank_on_meta`), and the
warmup's plan is the run's own: `training.warmup_steps` with its `Run.region_keys`, keys met once
run eagerly (no check). For each key it captures:

* written: the state the region writes, found structurally. The region runs once on "meta", as
  tools/memory.py runs a step (portable path, attention as a flash kernel keeps it), under
  `WrittenStorages`, a dispatch mode that notes every storage an op's schema marks written
  (in-place and out= ops, through any view or `.data`); the optimizer's collectives write their
  destinations; a gradient the backward creates counts as written. Storages are named by
  `run_state` (perf/cuda_graphs/state.py), the meta steps' inputs in the run's static buffers. It
  is what the check's warm-up finds on a real call, or more (a write that leaves the bits as they
  were, such as zeroing a zero gradient, is invisible to a fingerprint):
  tests/perf/test_perf_cuda_graphs_capture.py compares it with the smoke twin's.
* fingerprinted: the checked state present at the key's first call (capture.py
  `written_outside_regions` left out), read twice (before and after), in chunks whose int64
  temporaries peak at 2 x 8 x min(FINGERPRINT_CHUNK, the largest tensor's elements) bytes;
  `all state` is what the check read before the exclusion (the n-gram table shard included).
* host: the capture's copies into the staging pool (device to host): the written state at the
  start, again after the replay, and the outputs. The check then reads the graphed copies back one
  pool block at a time (host to device) and the start copy twice (the restores).
The pool is reused by every capture: its size, the bound on the check's host memory per rank, is
the largest key's 2 x written + outputs, rounded up to STAGING_BLOCK.
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
from unittest import mock

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from model import attention as model_attention
from perf.backend import use_backend
from runtime import training
from perf.cuda_graphs.capture import (FINGERPRINT_CHUNK, STAGING_ALIGN, STAGING_BLOCK, _unique_storages,
                                      written_outside_regions)
from perf.cuda_graphs.state import run_state
from runtime.meta_rank import (PORTABLE_BACKEND, RankOnMeta, flash_attention_standin, geometries, gib, meta_step, nbytes,
                            standin_collectives, storage_key)


class WrittenStorages(TorchDispatchMode):
    """The storages the ops it sees write: every tensor argument whose schema alias annotation is a
    write (`Tensor(a!)`: in-place ops, out= ops, the mutable arguments of any op)."""

    def __init__(self):
        super().__init__()
        self.keys: set[int] = set()

    def note(self, t: Tensor) -> None:
        self.keys.add(storage_key(t))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for i, arg in enumerate(func._schema.arguments):
            if arg.alias_info is None or not arg.alias_info.is_write:
                continue
            value = kwargs.get(arg.name) if arg.kwarg_only or i >= len(args) else args[i]
            for t in tree_leaves(value):
                if isinstance(t, Tensor):
                    self.note(t)
        return func(*args, **kwargs)


def written_by_collectives(recorder: WrittenStorages):
    """The optimizer's collectives as no-ops that write their destinations (tools/cost.py counts the
    same stand-ins' bytes)."""
    return standin_collectives(lambda kind, written, whole: recorder.note(written))


# ----------------------------------------------------------------------------------------------------
# the state of a rank on "meta", named as the check names it
# ----------------------------------------------------------------------------------------------------


def _unique_views(named: list[tuple[str, Tensor]]) -> list[tuple[str, Tensor]]:
    """capture._unique_storages on "meta" (where every data pointer is 0): storages told apart by
    their StorageImpl."""
    return _unique_storages(named, storage_key=storage_key)


def _static_inputs(step) -> dict[tuple, Tensor]:
    """The static input buffers `Run.train_step` fills for a runtime.meta_rank.MetaStep, keyed as
    `Run.static_buffer` keys them (name, shape, dtype); the n-gram sink leaf among them."""
    b = step.batch
    fields = {"inputs": b.inputs, "targets": b.targets, "cu_seqlens": b.cu_seqlens}
    if step.rows is not None:
        fields["ngram_sign_rows"] = b.ngram_sign_rows
        fields["ngram_rows"] = step.rows
    if step.args.candidates is not None:
        fields["candidates"] = step.args.candidates
    return {(name, tuple(t.shape), t.dtype): t for name, t in fields.items()}


@contextlib.contextmanager
def holding_static_inputs(run, static_inputs: dict):
    """The run's static input buffers (`Run.static_inputs`, what `Run.static_buffer` fills) set to
    these while the count runs, so that `run_state` names them as in the run."""
    saved, run.static_inputs = run.static_inputs, static_inputs
    try:
        yield
    finally:
        run.static_inputs = saved


# ----------------------------------------------------------------------------------------------------
# the cost
# ----------------------------------------------------------------------------------------------------


def _aligned(sizes) -> int:
    """Bytes the staging pool takes for copies of these sizes (each starts STAGING_ALIGN-aligned)."""
    return sum(-(-n // STAGING_ALIGN) * STAGING_ALIGN for n in sizes)


@dataclasses.dataclass(frozen=True)
class KeyCheckCost:
    """The capture check of one (region, key) on one rank, bytes."""
    region: str
    key: object
    first_step: int                 # the warmup step of its first call (the warm-up)
    written: tuple[str, ...]        # the checked state it writes (run_state names)
    writes_excluded: tuple[str, ...]  # excluded state it writes: none, or the runtime guard stops the run
    written_sizes: tuple[int, ...]  # their bytes
    output_sizes: tuple[int, ...]   # the bytes of its outputs (the forward_backward's loss)
    fingerprinted: int              # checked state present at the first call: read twice
    fingerprinted_all: int          # all state present then (what the check read before the exclusion)
    largest_elements: int           # the largest checked tensor then (sizes the int64 temporaries)

    @property
    def written_bytes(self) -> int:
        return sum(self.written_sizes)

    @property
    def output_bytes(self) -> int:
        return sum(self.output_sizes)

    @property
    def host_bytes(self) -> int:
        """Copied to host at its capture, the pool it needs: the written state twice (the start,
        the graphed result) and the outputs, each copy STAGING_ALIGN-aligned."""
        return 2 * _aligned(self.written_sizes) + _aligned(self.output_sizes)

    @property
    def fingerprint_temporaries(self) -> int:
        """Peak int64 device temporaries of its fingerprints: a chunk widened to int64 and its square."""
        return 2 * 8 * min(FINGERPRINT_CHUNK, self.largest_elements)


@dataclasses.dataclass(frozen=True)
class CaptureCheckCost:
    world_size: int
    keys: list[KeyCheckCost]              # the captured keys, in warmup order
    eager_keys: list[tuple[str, object]]  # met once: run eagerly, not checked
    excluded: list[tuple[str, int]]       # (name, bytes) the check leaves out
    block: int = STAGING_BLOCK

    @property
    def largest(self) -> KeyCheckCost:
        return max(self.keys, key=lambda k: k.host_bytes)

    @property
    def pool_bytes(self) -> int:
        """The staging pool at the end of the warmup, the bound on the check's host memory: the
        largest key's host bytes in whole blocks."""
        need = max((k.host_bytes for k in self.keys), default=0)
        return -(-need // self.block) * self.block

    @property
    def excluded_bytes(self) -> int:
        return sum(b for _, b in self.excluded)

    def totals(self) -> dict[str, int]:
        """Over the whole warmup, bytes: fingerprints (now; before the exclusion), copies each way
        (host to device: the two restores of the start copy, the graphed copies read back)."""
        return {"fingerprint reads": sum(2 * k.fingerprinted for k in self.keys),
                "fingerprint reads, all state": sum(2 * k.fingerprinted_all for k in self.keys),
                "device to host": sum(2 * k.written_bytes + k.output_bytes for k in self.keys),
                "host to device": sum(3 * k.written_bytes + k.output_bytes for k in self.keys)}


def capture_check_cost(rank: RankOnMeta, horizon: int | None = None) -> CaptureCheckCost:
    """The capture check of every key the warmup captures, on one rank (runtime/meta_rank.py's
    RankOnMeta: the run built on "meta"), each region run once on "meta" to find what it writes (the
    module docstring). horizon: a run stopping before this step (`Run.warmup`'s). Leaves gradients
    on the rank's parameters; its manager's split flag and the run's static inputs are put back."""
    run, schedule, manager, model = rank.run, rank.schedule, rank.manager, rank.model
    horizon = min(horizon or schedule.total_steps, schedule.total_steps)
    met = collections.Counter(k for st in range(horizon) for k in run.region_keys(st))
    first: dict = {}   # (region, key) -> the warmup step of its first call; in call order
    for st in training.warmup_steps(schedule, run.region_keys, horizon):
        for slot in run.region_keys(st):   # forward_backward, optimizer, then the update's fp8 refresh
            first.setdefault(slot, st)
    order = {slot: i for i, slot in enumerate(first)}

    # the static inputs of every geometry the warmup meets: one buffer per (name, shape, dtype),
    # shared as Run.static_buffer shares it
    static: dict = {}
    fills: dict = collections.defaultdict(set)   # buffer key -> the forward_backward slots that fill it
    meta_steps = {}
    for settings, steps in geometries(schedule):
        if ("forward_backward", settings.geometry) not in first:
            continue
        step = meta_steps[settings.geometry] = meta_step(rank, settings, steps)
        for k, t in _static_inputs(step).items():
            static.setdefault(k, t)
            fills[k].add(("forward_backward", settings.geometry))
        if step.rows is not None:
            step.rows = static[("ngram_rows", tuple(step.rows.shape), step.rows.dtype)]

    # what each key writes: its region once on "meta", in warmup order (the run's manager keeps its
    # gradients, zeroed in place, as a captured update needs)
    written: dict = {}
    outputs: dict = {}
    split = manager.split
    with holding_static_inputs(run, static):
        try:
            for slot in first:
                region, key = slot
                before = {n for n, _ in run_state(run)}
                recorder = WrittenStorages()
                if region == "optimizer":   # the host half, outside the region as in the run (and off "meta": host tensors)
                    manager.split = not key.tied
                    manager.load_scalars(first[slot])
                with torch.device("meta"):
                    if region == "forward_backward":
                        step = meta_steps[key]
                        standin = mock.patch.object(model_attention, "varlen_attention", flash_attention_standin)
                        with use_backend(**PORTABLE_BACKEND), standin, recorder:
                            loss = step.forward(model)
                            (loss / rank.accum).backward()
                        out = loss.detach()
                    elif region == "optimizer":
                        with written_by_collectives(recorder), recorder:
                            if manager.local_ranks > 1:  # a run folds each virtual rank after its backward;
                                manager.fold_local(first[slot])  # here one fold, counted with the update
                            out = manager.update(first[slot])
                    else:   # fp8_refresh, keyed by its exact mode
                        with use_backend(**PORTABLE_BACKEND), recorder:
                            out = model.refresh_fp8(key)
                named = _unique_views(run_state(run))
                written[slot] = {n for n, t in named if n not in before or storage_key(t) in recorder.keys}
                outputs[slot] = tuple(nbytes(t) for t in tree_leaves(out) if isinstance(t, Tensor))
        finally:
            manager.split = split
        final = _unique_views(run_state(run))

    # the state present at each key's first call: a parameter's .grad from the end of the first
    # forward_backward on; a static buffer from the first call of a geometry that fills it (its
    # upload comes before), its .grad from the end of that call
    buffer_of = {id(t): k for k, t in static.items()} | {id(t.grad): k for k, t in static.items() if t.grad is not None}
    first_backward = min((i for (r, _), i in order.items() if r == "forward_backward"), default=None)

    def present(slot) -> list[tuple[str, Tensor]]:
        i, out = order[slot], []
        for name, t in final:
            buffer = buffer_of.get(id(t))
            if buffer is not None:
                filled = min(order[g] for g in fills[buffer] if g in order)
                if filled > i or (filled == i and name.endswith(".grad")):
                    continue
            elif name.endswith(".grad") and (first_backward is None or first_backward >= i):
                continue
            out.append((name, t))
        return out

    keys = []
    for slot in first:
        if met[slot] < 2:
            continue
        state = present(slot)
        checked = [(n, t) for n, t in state if not written_outside_regions(n)]
        wrote = [(n, t) for n, t in final if n in written[slot] and not written_outside_regions(n)]  # at the capture
        keys.append(KeyCheckCost(slot[0], slot[1], first[slot], tuple(n for n, _ in wrote),
                                 tuple(n for n, _ in final if n in written[slot] and written_outside_regions(n)),
                                 tuple(nbytes(t) for _, t in wrote), outputs[slot],
                                 sum(nbytes(t) for _, t in checked), sum(nbytes(t) for _, t in state),
                                 max((t.numel() for _, t in checked), default=0)))
    excluded = [(n, nbytes(t)) for n, t in final if written_outside_regions(n)]
    return CaptureCheckCost(rank.world_size, keys, [s for s in first if met[s] < 2], excluded)


# ----------------------------------------------------------------------------------------------------
# the table
# ----------------------------------------------------------------------------------------------------


def _key_label(region: str, key) -> str:
    if region == "optimizer" and dataclasses.is_dataclass(key):   # an OptimizerPhase: its flags that are on
        return "+".join(f.name for f in dataclasses.fields(key) if getattr(key, f.name)) or "-"
    if region == "fp8_refresh":
        return "exact scales" if key else "delayed scales"
    return str(key)


def format_capture_check(cost: CaptureCheckCost) -> str:
    """The per-key table, the warmup's totals and the bound (GiB per rank)."""
    blocks = cost.pool_bytes // cost.block
    excluded = collections.Counter()
    for name, b in cost.excluded:
        excluded[name.split("[")[0].split(".")[0]] += b
    lines = [f"capture check (SPEEDRUN_CUDA_GRAPHS, perf/cuda_graphs/capture.py), GiB per rank, on meta: the "
             f"{len(cost.keys)} keys the warmup captures ({len(cost.eager_keys)} met once run eagerly, unchecked).",
             "Left out as written only outside the regions (capture.written_outside_regions; a region writing it "
             "stops the run): " + ", ".join(f"{n} {gib(b)}" for n, b in excluded.most_common()) +
             f" = {gib(cost.excluded_bytes)} GiB.",
             f"  {'region':<16} {'key':<40} {'step':>5} {'written':>7} {'W':>6} {'out B':>6} "
             f"{'fingerprint':>11} {'was':>6} {'int64':>6} {'to host':>8}"]
    for k in cost.keys:
        lines.append(f"  {k.region:<16} {_key_label(k.region, k.key)[:40]:<40} {k.first_step:>5} {len(k.written):>7} "
                     f"{gib(k.written_bytes):>6} {k.output_bytes:>6} {gib(k.fingerprinted):>11} "
                     f"{gib(k.fingerprinted_all):>6} {gib(k.fingerprint_temporaries):>6} {gib(k.host_bytes):>8}")
    for k in cost.keys:
        if k.writes_excluded:
            lines.append(f"  WARNING: {k.region} {_key_label(k.region, k.key)} writes {', '.join(k.writes_excluded)}, "
                         f"which the check leaves out: the run's guard would stop it (ExcludedStateWritten)")
    totals = cost.totals()
    lines += ["  step: the warmup step of its first call; written: the state tensors the region writes (found on meta), "
              "W their bytes, out B its outputs' bytes; fingerprint: the checked state present at its first call, read "
              "twice (before and after it); was: all state then, what the check fingerprinted before the exclusion; "
              "int64: the fingerprints' peak device temporaries; to host: its capture's copies (2 W + outputs)",
              f"  over the warmup: fingerprints read {gib(totals['fingerprint reads'])} GiB (all state: "
              f"{gib(totals['fingerprint reads, all state'])}), device to host {gib(totals['device to host'])} GiB, "
              f"host to device {gib(totals['host to device'])} GiB (the restores and the graphed copies read back, "
              f"one {cost.block // 2 ** 20} MiB block at a time)"]
    if cost.keys:
        w = cost.largest
        lines.append(f"  bound: host bytes per rank ≤ 2 × the largest key's written state + its outputs = 2 × "
                     f"{gib(w.written_bytes)} GiB ({w.region} {_key_label(w.region, w.key)}) → one staging pool of "
                     f"{gib(cost.pool_bytes)} GiB ({blocks} × {cost.block // 2 ** 20} MiB blocks, pinned on CUDA), "
                     f"reused by every capture and freed at the end of the warmup; {cost.world_size} ranks: "
                     f"{gib(cost.world_size * cost.pool_bytes)} GiB of host memory")
    return "\n".join(lines)
