"""What one rank of a training run holds in device memory, and an estimate of its peak, built on the
meta device, so the record size costs no memory:

    python -m tools.memory --config record                           # per rank, 8 ranks
    python -m tools.memory --config dev --world-size 1               # one GPU
    python -m tools.memory --config record --set features.ngram=false # an ablation (any --set)
The memory report (`memory_report`) has three parts:
* static: what a rank holds for the whole run, read from the run itself built on "meta"
  (`build_rank_on_meta`, runtime/meta_rank.py: training.Run as rank 0 of W, its GPT, OptimizerManager,
  NgramTable, n-gram row optimizer and StepWeights), plus the TailAverages and the canonical mask
  train_gpt.py builds beside it; the warmup-reset snapshot is host memory, listed apart;
* per schedule geometry (`StepSettings.geometry`, one compiled graph each): the step's inputs on the
  device, an upper bound of the n-gram gradients held until the next table event, and the
  training forward and backward run on "meta" under the portable path (`PORTABLE_BACKEND`, with the
  attention counted as a flash kernel keeps it: `flash_attention_standin`; both runtime/meta_rank.py's,
  as is the step's input, `meta_step`): the tensors saved for
  the backward (a `saved_tensors_hooks` pack hook, deduplicated by storage) and the live activation
  memory over time (a dispatch mode that follows every storage an op creates until it is freed),
  whose maximum counts the saved tensors plus the temporaries of that moment;
* the estimate: static + the worst geometry's (inputs + held n-gram gradients + activation peak).
`main` adds the CUDA-graph capture check's cost per captured key (device reads, host copies, the
bound on its host memory: tools/capture_cost.py), before the estimate's closing lines.
The record preset takes about 6 s on a 2-core CPU (every geometry, forward and backward).
"""
from __future__ import annotations

import contextlib
import dataclasses
import weakref
from unittest import mock

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from cli import parse_preset_args
from config import RUN_PRESETS, RunConfig
from model import attention as model_attention
from perf.backend import current as current_backend, use_backend
from optim.schedule import StepSettings
from runtime.meta_rank import (GIB, PORTABLE_BACKEND, RankOnMeta, build_rank_on_meta, each_with_progress,
                                   flash_attention_standin, geometries, gib, meta_step, nbytes, print_progress,
                                   storage_key, tensor_fields)
from runtime.op_count import pointer_kernels
from tools.capture_cost import capture_check_cost, format_capture_check
from perf.host_table import H100_MEMORY_BYTES, choose_placement


# ================================================================================================
# Memory of one training rank
# ================================================================================================


@dataclasses.dataclass(frozen=True)
class MemoryItem:
    name: str
    bytes: int
    detail: str = ""
    where: str = "device"  # "device" or "host"


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    shape: tuple[int, ...]
    dtype: torch.dtype
    bytes: int  # of the whole storage (a view keeps all of it alive)

    def __str__(self) -> str:
        return f"{list(self.shape)} {str(self.dtype).removeprefix('torch.')}"


def host_table_staging(rank: RankOnMeta) -> list[MemoryItem]:
    """The pinned host buffers of a host-memory n-gram table (perf/host_table.py) at the worst step:
    a gather per pull in flight (this micro-batch's and the next step's prefetched ones: ≤ 2 ids per
    token of a virtual rank's batch) and a table event's write-back (≤ the cycle's distinct rows)."""
    schedule, cfg, d = rank.schedule, rank.cfg, rank.cfg.model.model_dim
    ids = max(2 * schedule.batch_tokens(s) // cfg.virtual_world_size for s in range(schedule.total_steps))
    events = [s for s in range(schedule.total_steps) if schedule.is_table_event(s)]
    cycle = max((b - a for a, b in zip(events, events[1:])), default=1)  # steps held before an event
    rows = min(rank.table.rows.size(0), cycle * rank.accum * ids)
    return [MemoryItem("n-gram gather staging", (rank.accum + 1) * ids * d * 2,
                       f"pinned bf16 [{ids:,}, {d}] per pull in flight ({rank.accum} prefetched + 1)", where="host"),
            MemoryItem("n-gram write-back staging", rows * d * 2,
                       f"pinned bf16 [{rows:,}, {d}]: a table event's rows ({cycle}-step cycle)", where="host")]


def _shape(t: Tensor) -> str:
    return f"[{', '.join(f'{s:,}' for s in t.shape)}]"


def static_items(rank: RankOnMeta) -> list[MemoryItem]:
    """Per-rank memory held for the whole run, item by item (device items, then the host snapshot)."""
    m, cfg = rank.model, rank.cfg
    params = dict(m.named_parameters())
    fp32 = sum(p.dtype == torch.float32 for p in params.values())
    items = [MemoryItem("parameters", sum(map(nbytes, params.values())),
                        f"{sum(p.numel() for p in params.values()):,} values, every rank (bf16; {fp32} fp32 tensors)")]
    grads = [p for n, p in params.items() if n != "value_embeds"]
    items.append(MemoryItem("gradients (.grad)", sum(map(nbytes, grads)),
                            "parameter dtype; all but value_embeds (its backward adds into the fp16 cycle buffer)"))
    optimizer = cfg.optim.bank_optimizer
    replicated = [e for e in rank.manager.entries.values() if e.shard is None]
    for name, e in rank.manager.entries.items():
        if e.rule.optim == "bank":
            s = e.state
            items.append(MemoryItem(f"{optimizer} {name}", sum(map(nbytes, tensor_fields(s))) + nbytes(e.matrix_mults),
                                    f"shard {_shape(s.mantissa)}: velocity {s.velocity.shape[0]}×fp32, "
                                    f"lane energy {_shape(s.lane_energy)} fp32, mantissa uint16"))
        elif e.shard is not None:
            items.append(MemoryItem(f"adam {name}", sum(map(nbytes, tensor_fields(e.state))),
                                    f"moments 2×fp32 {_shape(e.state.exp_avg)} (rows {e.shard.chunk:,} of "
                                    f"{e.shard.n:,})"))
    items.append(MemoryItem("adam, replicated parameters", sum(nbytes(t) for e in replicated for t in tensor_fields(e.state)),
                            f"moments 2×fp32 of {len(replicated)} small parameters"))
    for name, e in rank.manager.entries.items():
        if e.held is not None:
            items.append(MemoryItem(f"{name} cycle gradient", nbytes(e.held),
                                    f"fp16 {_shape(e.held)}: the table cycle's gradient sum"))
    t = rank.table
    if t is not None:  # (features.ngram off: neither)
        placement, why = choose_placement(cfg.ngram_table, nbytes(t.rows), torch.device("cuda"), H100_MEMORY_BYTES)
        items.append(MemoryItem("n-gram table shard", nbytes(t.rows),
                                f"bf16 {_shape(t.rows)}: rows {t.lo:,}-{t.hi:,} of {t.num_rows:,}; on an H100, "
                                f"{why}", where=placement))
        if placement == "host":  # perf/host_table.py: gathers and write-backs through pinned staging
            items += host_table_staging(rank)
        st = rank.ngram_opt.state
        items.append(MemoryItem("n-gram row Adam state", sum(map(nbytes, tensor_fields(st))),
                                f"second moment fp32, last event int32 per row; "
                                f"{st.log_beta2_sum.numel():,} fp64 log-β2 sums"))
    if rank.accum > 1:  # optim/lanes.py: each virtual rank's own gradients and fp8 delayed scales
        lane = [p for e in rank.manager.entries.values() if e.rule.optim != "bank" and e.name != "value_embeds"
                for p in [e.param]] + [e.held for e in rank.manager.entries.values() if e.held is not None]
        delayed = m.mlp_fp8.delayed_state() if m.mlp_fp8 is not None else []
        items.append(MemoryItem("virtual-rank lanes", rank.accum * (sum(map(nbytes, lane + delayed))),
                                f"{rank.accum} copies of the Adam gradients, the fp16 cycle gradient and the fp8 "
                                f"delayed scales (optim/lanes.py)"))
    fp8 = dict(m.mlp_fp8.named_buffers()) if m.mlp_fp8 is not None else {}
    items.append(MemoryItem("fp8 MLP caches (Fp8MLPState)", sum(map(nbytes, fp8.values())),
                            "e4m3 W1, W2 in both layouts, per-slot scales and tile amaxes"))
    fp8_ids = {id(b) for b in fp8.values()}
    others = [(n, b) for n, b in m.named_buffers() if id(b) not in fp8_ids]
    other_bytes = sum(nbytes(b) for _, b in others) + sum(map(nbytes, tensor_fields(rank.step_weights)))
    items.append(MemoryItem("other buffers", other_bytes,
                            f"{', '.join(n for n, _ in others)}, the MTP/prefix weight tables"))
    for acc in rank.tails.accumulators:
        items.append(MemoryItem(f"tail average {acc.tag}", sum(map(nbytes, acc.bufs.values())),
                                f"fp32 copies of own shards: {', '.join(acc.names)}"))
    if rank.canonical_mask is not None:
        items.append(MemoryItem("canonical mask", nbytes(rank.canonical_mask),
                                f"uint8 {_shape(rank.canonical_mask)} (record #92), built on the clock"))
    snapshot = sum(nbytes(v) for v in m.state_dict().values() if torch.is_tensor(v))
    items.append(MemoryItem("warmup-reset snapshot (Run.initial_state)", snapshot,
                            "the state_dict's tensors; pinned on CUDA, copied back once", where="host"))
    return items


class LiveStorages(TorchDispatchMode):
    """Follows every storage an op creates, from the op to its release, on any device ("meta"
    included): an event list from which the live total at any moment is replayed. Outputs that view
    a known storage, and storages in `ignore` (parameters, buffers, states, inputs), are not counted."""

    def __init__(self, ignore: set[int]):
        super().__init__()
        self.ignore = ignore
        self.live: dict[int, int] = {}  # storage key -> serial
        self.info: list[TensorInfo] = []  # by serial
        self.events: list[tuple[int, bool]] = []  # (serial, allocated?) in time order

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, Tensor):
                self._track(t)
        return out

    def _track(self, t: Tensor) -> None:
        storage = t.untyped_storage()
        key = storage._cdata
        if key in self.ignore or key in self.live:
            return
        serial = len(self.info)
        self.info.append(TensorInfo(tuple(t.shape), t.dtype, storage.nbytes()))
        self.live[key] = serial
        self.events.append((serial, True))
        weakref.finalize(storage, self._free, key, serial)

    def _free(self, key: int, serial: int) -> None:
        if self.live.get(key) == serial:
            del self.live[key]
        self.events.append((serial, False))

    def mark(self) -> int:
        return len(self.events)

    def peak(self, start: int, end: int, exclude: set[int] = frozenset()) -> int:
        """Largest live total from just before event `start` to just after event `end` - 1, storages in
        `exclude` (serials) left out."""
        live = best = 0
        for i, (serial, alloc) in enumerate(self.events[:end]):
            if i == start:
                best = live
            if serial not in exclude:
                live += self.info[serial].bytes if alloc else -self.info[serial].bytes
            if i >= start:
                best = max(best, live)
        return best

    def temporaries(self, start: int, end: int) -> list[TensorInfo]:
        """Storages both created and freed within events [start, end), largest first."""
        made = {s for s, alloc in self.events[start:end] if alloc}
        freed = {s for s, alloc in self.events[start:end] if not alloc}
        return sorted((self.info[s] for s in made & freed), key=lambda i: -i.bytes)


@dataclasses.dataclass
class StepMemory:
    """One schedule geometry's per-step memory on a rank (bytes)."""
    settings: StepSettings
    steps: int  # how many steps of the schedule have this geometry
    tokens: int  # per virtual rank
    inputs: int  # the step's inputs on the device: batch, pulled n-gram rows, row plan, candidates
    held_ngram: int  # upper bound: n-gram gradient rows held until the next table event
    prefetch: int  # the next step's row pulls in flight during this step (SPEEDRUN_ROW_PREFETCH)
    saved: int  # tensors saved for the backward (new in the forward, unique storages)
    saved_tensors: list[TensorInfo]
    forward_peak: int  # live activations at the forward's worst moment (saved so far + temporaries)
    backward_peak: int  # ... at the backward's (parameter gradients left out: static)
    temporaries: list[TensorInfo]  # created and freed inside the forward, largest first
    # features.cplm: what it saves for the backward, by part (`CPLM_PARTS`), each part's new storages (the
    # head's include the pointer kernels'); inside `saved`. None without the feature
    cplm_saved: dict[str, list[TensorInfo]] | None = None

    @property
    def activation_peak(self) -> int:
        return max(self.forward_peak, self.backward_peak)

    @property
    def total(self) -> int:
        return self.inputs + self.held_ngram + self.prefetch + self.activation_peak


def saved_for_backward(fn, ignore: set[int] = frozenset(),
                       saved: dict[int, TensorInfo] | None = None) -> tuple[object, dict[int, TensorInfo]]:
    """fn()'s result and the tensors autograd saved for its backward: storage key -> info (whole
    storage bytes), each storage once however many views of it were saved, storages in `ignore`
    left out. Nothing is kept alive: saved tensors live until the backward anyway, so their keys
    stay distinct while fn runs. saved: the dict to fill (a caller watching it while fn runs)."""
    saved = {} if saved is None else saved

    def pack(t: Tensor) -> Tensor:
        key = storage_key(t)
        if key not in ignore and key not in saved:
            saved[key] = TensorInfo(tuple(t.shape), t.dtype, t.untyped_storage().nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, saved


# features.cplm's parts whose saved tensors the report lists: (part, module, attribute) of the call
CPLM_PARTS = (("pointer kernels", "perf.kernels.copy_pointer", "CopyPointerFunction.apply"),
              ("head", "model.gpt", "copy_head"),
              ("mixture", "model.loss", "mixture_nll"))


@contextlib.contextmanager
def noted_saves(saved: dict[int, TensorInfo], parts: dict[str, set[int]]):
    """Each call of CPLM_PARTS unchanged, the storages `saved` gains during it noted in parts[part]."""
    import importlib

    def noting(part, fn):
        def call(*args, **kwargs):
            before = set(saved)
            out = fn(*args, **kwargs)
            parts.setdefault(part, set()).update(set(saved) - before)
            return out
        return call

    with contextlib.ExitStack() as stack:
        for part, module, attribute in CPLM_PARTS:
            owner = importlib.import_module(module)
            *path, name = attribute.split(".")
            for step in path:
                owner = getattr(owner, step)
            stack.enter_context(mock.patch.object(owner, name, noting(part, getattr(owner, name))))
        yield


def step_memory(rank: RankOnMeta, settings: StepSettings, steps: list[int], flash: bool = True) -> StepMemory:
    """Run one training forward and backward of `settings`' geometry on "meta" at the per-rank
    shapes, under the portable backend, and measure what it saves and holds. flash: the attention
    kernel as a flash kernel keeps it (`flash_attention_standin`); False: SDPA's meta (math) kernel."""
    m, D = rank.model, rank.cfg.model.model_dim
    step = meta_step(rank, settings, steps)
    T, inputs = step.tokens, step.inputs
    with torch.device("meta"):
        ignore = {storage_key(t) for t in rank.static_tensors() + inputs}
        tracker = LiveStorages(ignore)
        attention = mock.patch.object(model_attention, "varlen_attention", flash_attention_standin) \
            if flash else contextlib.nullcontext()
        saved: dict[int, TensorInfo] = {}
        cplm: dict[str, set[int]] = {}
        with use_backend(**PORTABLE_BACKEND), attention, pointer_kernels(None), noted_saves(saved, cplm), tracker:
            loss, saved = saved_for_backward(lambda: step.forward(m), ignore, saved)
            forward_end = tracker.mark()
            (loss / rank.accum).backward()
            del loss
            backward_end = tracker.mark()
        grads = {tracker.live[storage_key(p.grad)] for p in m.parameters()
                 if p.grad is not None and storage_key(p.grad) in tracker.live}
        m.zero_grad(set_to_none=True)
    # n-gram gradients held until the table event (NgramRowOptimizer.accumulate): one fp32 [U, D]
    # per virtual rank and step, U <= 2T distinct rows; at most (cycle - 1)·A + A - 1 of them are
    # held during a forward, cycle = 4 steps from table_period4_step on, else 2
    cycle = 4 if any(rank.schedule.table_period4(s) for s in steps) else 2
    held = ((cycle - 1) * rank.accum + rank.accum - 1) * 2 * T * D * 4 if rank.table is not None else 0
    # the row prefetch (training.Run.prefetch) holds the next step's pulls across this forward and
    # backward, per virtual rank: the rows received (U <= 2T distinct, bf16) and, on several
    # ranks, the rows this rank serves the others (2T on average), at this geometry's T
    pulls = (1 if rank.world_size == 1 else 2) * rank.accum * 2 * T * D * 2 \
        if current_backend().row_prefetch and rank.table is not None else 0
    return StepMemory(settings, len(steps), T, sum(map(nbytes, inputs)), held, pulls, sum(i.bytes for i in saved.values()),
                      sorted(saved.values(), key=lambda i: -i.bytes), tracker.peak(0, forward_end),
                      tracker.peak(forward_end, backward_end, grads), tracker.temporaries(0, forward_end),
                      {part: [saved[k] for k in cplm.get(part, ())] for part, _, _ in CPLM_PARTS}
                      if rank.cfg.features.cplm else None)


def cplm_static(rank: RankOnMeta) -> dict[str, int] | None:
    """features.cplm's static share (inside the static rows): its parameters (config.FEATURES' declaration),
    their values, bytes, gradients' bytes (in the parameters' dtypes) and Adam moments' bytes; None without it."""
    from config import FEATURES

    if not rank.cfg.features.cplm:
        return None
    names = next(f for f in FEATURES if f.name == "cplm").param_names
    params = dict(rank.model.named_parameters())
    return {"values": sum(params[n].numel() for n in names),
            "parameters": sum(nbytes(params[n]) for n in names),
            "gradients": sum(nbytes(params[n]) for n in names),
            "adam": sum(nbytes(t) for n in names for t in tensor_fields(rank.manager.entries[n].state))}


def cplm_lines(report: "MemoryReport") -> list[str]:
    """features.cplm (PR #379): its parameters with their gradients and Adam state (in the static rows) and,
    per geometry, what its parts save for the backward (inside the saved column); none without it."""
    static = cplm_static(report.rank)
    if static is None:
        return []
    params = dict(report.rank.model.named_parameters())
    shapes = ", ".join(f"{n} {str(params[n].dtype).removeprefix('torch.')} {list(params[n].shape)}"
                       for n in ("copy_qk_bank", "copy_k_sink", "copy_qk_gain") if n in params)
    lines = ["", f"cplm (PR #379): {shapes}: {static['values']:,} values, {static['parameters'] / 2**20:.2f} MiB, "
                 f"their gradients {static['gradients'] / 2**20:.2f} MiB and Adam moments (2 × fp32) "
                 f"{static['adam'] / 2**20:.2f} MiB, in the static rows above; saved for its backward, per geometry, "
                 f"MiB (inside saved): the pointer kernels' (q, k bf16 [T, 128]; lse, p_copy, a_sink fp32 [T]; doc, "
                 f"dstart, dend int32 [T]: 536 B per row), the whole head's (those, the projections' input h bf16 "
                 f"[T, D], the QK norm's fp32 tensors and the sink score's fp32 q) and the mixture's ([T] rows)"]
    for s in report.steps:
        saved = {part: sum(i.bytes for i in infos) for part, infos in s.cplm_saved.items()}
        lines.append(f"  step {s.settings.step:>5} T={s.tokens:,}: " + ", ".join(
            f"{part} {b / 2**20:,.2f}" for part, b in saved.items())
            + f" of {s.saved / 2**20:,.0f} saved")
    return lines


@dataclasses.dataclass
class MemoryReport:
    rank: RankOnMeta
    static: list[MemoryItem]
    steps: list[StepMemory]

    @property
    def static_bytes(self) -> int:
        return sum(i.bytes for i in self.static if i.where == "device")

    @property
    def worst(self) -> StepMemory:
        return max(self.steps, key=lambda s: s.total)

    @property
    def peak_bytes(self) -> int:
        return self.static_bytes + self.worst.total


def memory_report(cfg: RunConfig, world_size: int, progress=None) -> MemoryReport:
    """progress: a line per geometry measured (main: on stderr)."""
    rank = build_rank_on_meta(cfg, world_size)
    each = each_with_progress(geometries(rank.schedule), lambda g: f"memory: geometry at step {g[0].step}", progress)
    return MemoryReport(rank, static_items(rank), [step_memory(rank, s, steps) for s, steps in each])


def format_memory(report: MemoryReport, top: int = 6, capture: str | None = None) -> str:
    """The report as text; capture: a section inserted before the closing paragraph (main's capture check)."""
    rank, cfg = report.rank, report.rank.cfg
    off, added = cfg.features.off(), cfg.features.added()
    lines = [f"memory of one training rank: --config {cfg.name}, {rank.world_size} process(es) × "
             f"{rank.accum} accumulation step(s), {'fp8' if cfg.features.fp8 else 'bf16'} training, rank 0's "
             f"shards (1 GiB = 2^30 bytes)" + (f"; switched off: {', '.join(off)}" if off else "")
             + (f"; past the record, on: {', '.join(added)}" if added else ""), ""]
    width = max(len(i.name) for i in report.static) + 2
    lines.append(f"{'static, device':<{width}} {'GiB':>7}  what")
    for item in (i for i in report.static if i.where == "device"):
        lines.append(f"  {item.name:<{width - 2}} {gib(item.bytes):>7}  {item.detail}")
    lines.append(f"  {'total':<{width - 2}} {gib(report.static_bytes):>7}")
    lines.append(f"{'host (not on the device)':<{width}}")
    host = [i for i in report.static if i.where == "host"]
    for item in host:
        lines.append(f"  {item.name:<{width - 2}} {gib(item.bytes):>7}  {item.detail}")
    lines.append(f"  {'total':<{width - 2}} {gib(sum(i.bytes for i in host)):>7}  per process (runtime.preflight checks "
                 f"the node's RAM for it)")
    lines += ["", "per schedule geometry (one compiled graph each), GiB per rank: the training forward and "
              "backward on meta at the per-rank shapes, portable path",
              "(fp8 GEMMs through torch._scaled_mm, the portable CE, eager: no compiled-graph fusion), attention "
              "counted as a flash kernel keeps it (q, k, v, out, fp32 lse);",
              "the fast path's Triton kernels save other things (the fp8 MLP a copy of post8ᵀ, a view here); "
              "the CE's fp32 slabs are the portable twin's (the kernel streams):",
              f"  {'first step':>10} {'steps':>5} {'tokens':>7} {'P':>6} {'MTP':>3} {'prefix':>6} {'windows':>8} "
              f"{'inputs':>7} {'n-gram≤':>8} {'ahead':>7} {'saved':>7} {'fwd pk':>7} {'bwd pk':>7} {'step':>7}"]
    for s in report.steps:
        st = s.settings
        lines.append(f"  {st.step:>10} {s.steps:>5} {s.tokens:>7,} {st.softmax_p or 'V':>6} {len(st.mtp_weights):>3} "
                     f"{'on' if st.prefix_weight else 'off':>6} {str((st.ws_short, st.ws_long)):>8} "
                     f"{gib(s.inputs):>7} {gib(s.held_ngram):>8} {gib(s.prefetch):>7} {gib(s.saved):>7} {gib(s.forward_peak):>7} "
                     f"{gib(s.backward_peak):>7} {gib(s.total):>7}")
    lines += ["  inputs: the batch, its pulled n-gram rows [2T, D] bf16, the row plan, the candidates; n-gram≤: the "
              "gradient rows NgramRowOptimizer holds until the next table event, bounded by 2T distinct rows; "
              "ahead: the next step's n-gram rows pulled during this one (SPEEDRUN_ROW_PREFETCH; rows received, "
              "U ≤ 2T, and on several ranks the rows served, 2T on average); saved: what autograd keeps for the backward (unique storages); fwd/bwd pk: the most activation "
              "memory alive at once (saved + temporaries; parameter gradients are in static); step: inputs + "
              "n-gram≤ + ahead + the larger peak. Saved storages are told apart by untyped_storage()._cdata (views "
              "count once)"]
    lines += cplm_lines(report)
    w = report.worst
    lines += ["", f"largest tensors saved for the backward at step {w.settings.step} (the worst geometry), "
              f"{len(w.saved_tensors)} storages, {gib(w.saved)} GiB:"]
    lines += [f"  {str(i):<32} {gib(i.bytes):>7} GiB" for i in w.saved_tensors[:top]]
    lines += [f"largest temporaries of that forward (created and freed inside it); its peak holds "
              f"{gib(w.forward_peak - w.saved)} GiB more than the saved total:"]
    lines += [f"  {str(i):<32} {gib(i.bytes):>7} GiB" for i in w.temporaries[:top]]
    if capture:
        lines += ["", capture]
    lines += ["",
              "the estimate is static (device) + the worst geometry's step column: what the allocator must hand "
              "out at once. It leaves out the CUDA context and NCCL buffers, allocator caching and fragmentation "
              "(record #360 logged 53,424 MiB allocated, ~65 GB reserved), the optimizer step's transients "
              "(reduce-scatter/all-gather buffers, the ANVIL cascade, the n-gram push), the validation forward, "
              "the attention kernel's backward workspace, and what compilation fuses away or adds.",
              f"static per rank: {report.static_bytes / GIB:.1f} GiB",
              f"per-rank peak estimate: {report.peak_bytes / GIB:.1f} GiB"]
    return "\n".join(lines)


def main(argv=None) -> None:
    args = parse_preset_args("python -m tools.memory", __doc__, argv, RUN_PRESETS,
                             world_size_help="processes (default: the preset's ranks); each plays the others' "
                                             "batches by gradient accumulation",
                             ranks_of=lambda name: RUN_PRESETS[name].virtual_world_size)
    cfg = args.run_config  # the preset, --set applied (e.g. --set features.ngram=false)
    report = memory_report(cfg, args.world_size or cfg.virtual_world_size, progress=print_progress)
    print(format_memory(report, capture=format_capture_check(capture_check_cost(report.rank))))


if __name__ == "__main__":
    main()
