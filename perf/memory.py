"""What one rank of a training run holds in device memory, and an estimate of its peak, built on the
meta device, so the record size costs no memory:

    python -m perf.memory --config record                           # per rank, 8 ranks
    python -m perf.memory --config dev --world-size 1               # one GPU
    python -m perf.memory --config record --set features.ngram=false # an ablation (any --set)
The memory report (`memory_report`) has three parts:
* static: what a rank holds for the whole run, from the real classes built on "meta" (GPT, an
  OptimizerManager answering as rank 0 of W, NgramTable, the n-gram row optimizer, TailAverages,
  StepWeights), plus the canonical mask; the warmup-reset snapshot is host memory, listed apart;
* per schedule geometry (`StepSettings.geometry`, one compiled graph each): the step's inputs on the
  device, an upper bound of the n-gram gradients held until the next table event, and the
  training forward and backward run on "meta" under the portable path (`PORTABLE_BACKEND`, with the
  attention counted as a flash kernel keeps it: `flash_attention_standin`): the tensors saved for
  the backward (a `saved_tensors_hooks` pack hook, deduplicated by storage) and the live activation
  memory over time (a dispatch mode that follows every storage an op creates until it is freed),
  whose maximum counts the saved tensors plus the temporaries of that moment;
* the estimate: static + the worst geometry's (inputs + held n-gram gradients + activation peak).
`main` adds the CUDA-graph capture check's cost per captured key (device reads, host copies, the
bound on its host memory: perf/cuda_graphs/cost.py), before the estimate's closing lines.
The record preset takes about 6 s on a 2-core CPU (every geometry, forward and backward).
"""
from __future__ import annotations

import contextlib
import dataclasses
import weakref
from types import SimpleNamespace
from unittest import mock

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from config import RUN_PRESETS, RunConfig
from config_check import parse_preset_args
from data.loader import NO_NGRAM, dummy_batch
from data.ngram import ngram_hash_sizes
from model import attention as model_attention
from model.embeddings import NgramTable
from model.gpt import GPT, StepArgs
from optim.manager import NgramRowOptimizer, OptimizerManager
from optim.schedule import StepSettings, StepWeights, TrainingSchedule
from optim.tail_average import TailAverages
from perf.backend import current as current_backend, use_backend
from perf.cuda_graphs.cost import capture_check_cost, format_capture_check
from perf.host_table import H100_MEMORY_BYTES, choose_placement

GIB = 2 ** 30


# ================================================================================================
# Memory of one training rank
# ================================================================================================

# The path the meta forward runs: plain PyTorch (the fp8 GEMMs through torch._scaled_mm, the
# portable cross-entropy), the attention replaced by `flash_attention_standin` unless asked for SDPA.
# The fast path's Triton kernels save other tensors (the fp8 MLP kernel: a copy of post8ᵀ where the
# portable twin keeps a view). Both CEs save the same (the e4m3 logits and lse); the portable twin's
# fp32 temporaries come one slab of CE_SLAB_ROWS rows at a time, where the kernel has none.
PORTABLE_BACKEND = dict(triton=False, attention="sdpa", fp8=True, compile=False, host_checks=False)


class _FlashAttentionStandin(torch.autograd.Function):
    """What a flash-attention kernel keeps for its backward (FA3 on the fast path; SDPA's flash or
    memory-efficient kernels on a GPU): q, k, v, the output and an fp32 log-sum-exp per head and
    position. Nothing is computed: it exists for the count on "meta", where SDPA runs its math kernel,
    which would save fp32 probabilities [heads, chunk, keys] per query chunk that no GPU path keeps."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        out = v.new_empty((*q.shape[:-1], v.shape[-1]))  # (T, H, d_v)
        lse = torch.empty(q.shape[1], q.shape[0], dtype=torch.float32, device=q.device)  # (H, T)
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        q, k, v, _, _ = ctx.saved_tensors
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def flash_attention_standin(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, window: int, softmax_scale: float,
                            paired: bool = False, max_seqlen: int | None = None) -> Tensor:
    """`perf.attention_backends.varlen_attention`'s signature, `_FlashAttentionStandin`'s memory."""
    return _FlashAttentionStandin.apply(q, k, v)


def nbytes(t: Tensor) -> int:
    return t.numel() * t.element_size()


def storage_key(t: Tensor) -> int:
    """Identity of t's storage: the address of its StorageImpl (`untyped_storage()._cdata`). Views
    share it, and meta tensors have a StorageImpl too (with no data), so it works on "meta". It is
    unique among live storages only: compare keys of tensors that are alive together."""
    return t.untyped_storage()._cdata


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


@dataclasses.dataclass
class RankOnMeta:
    """What train_gpt.py's `Run` allocates on one rank's device, built on "meta"."""
    cfg: RunConfig
    world_size: int
    schedule: TrainingSchedule
    model: GPT
    manager: OptimizerManager
    table: NgramTable | None  # None: features.ngram off
    ngram_opt: NgramRowOptimizer | None
    tails: TailAverages
    step_weights: StepWeights
    canonical_mask: Tensor | None

    @property
    def accum(self) -> int:
        """Virtual ranks each process plays (gradient accumulation steps)."""
        return self.cfg.virtual_world_size // self.world_size

    def static_tensors(self) -> list[Tensor]:
        """Every tensor above that lives for the whole run (parameters, buffers, states)."""
        out = [*self.model.parameters(), *self.model.buffers(), *_fields(self.step_weights)]
        if self.table is not None:
            out += [self.table.rows, *_fields(self.ngram_opt.state)]
        for e in self.manager.entries.values():
            out += [*_fields(e.state), *(t for t in (e.held, e.matrix_mults) if t is not None)]
        for acc in self.tails.accumulators:
            out += list(acc.bufs.values())
        return out + ([self.canonical_mask] if self.canonical_mask is not None else [])


def _fields(obj) -> list[Tensor]:
    values = [getattr(obj, f.name) for f in dataclasses.fields(obj)] if dataclasses.is_dataclass(obj) \
        else list(vars(obj).values())
    return [v for v in values if isinstance(v, Tensor)]


def build_rank_on_meta(cfg: RunConfig, world_size: int, rank: int = 0) -> RankOnMeta:
    """Run.__init__'s device allocations for `rank` of `world_size` processes, on "meta" (fp8 on
    unless features.fp8 is off; switched-off features allocate nothing, as in the run)."""
    if world_size < 1 or cfg.virtual_world_size % world_size:
        raise ValueError(f"--world-size {world_size}: the {cfg.name} preset splits its batch over "
                         f"{cfg.virtual_world_size} ranks, so the process count must divide it")
    features = cfg.features
    schedule = TrainingSchedule(cfg.schedule, features)
    with torch.device("meta"):
        model = GPT(cfg.model, fp8=True, features=features)
        manager = OptimizerManager(model.named_parameters(), schedule, cfg.optim, layout=(rank, world_size),
                                   absent=model.switched_off_parameters)
        if features.value_embeds:
            model.value_embed_grad_buffer = manager.cycle_gradient("value_embeds")
        table = ngram_opt = None
        if features.ngram:
            table = NgramTable(cfg.model, rank, world_size, device="meta")
            # the row optimizer reads only the exchange's split (a RowExchange needs a process group)
            split = SimpleNamespace(num_rows=cfg.model.ngram_rows, rows_per_rank=table.rows.size(0),
                                    rank=rank, world_size=world_size, lanes=1)
            ngram_opt = NgramRowOptimizer(table.rows, table.rows.size(0), manager, split)
        tails = TailAverages(manager, schedule)
        step_weights = StepWeights(schedule, "meta")
        V = cfg.model.vocab_size
        mask = torch.zeros((V, (V + 7) // 8), dtype=torch.uint8) if cfg.canonical_mask else None
        model.refresh_fp8()
    return RankOnMeta(cfg, world_size, schedule, model, manager, table, ngram_opt, tails, step_weights, mask)


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


def _gib(b: int) -> str:
    return f"{b / GIB:.2f}"


def _shape(t: Tensor) -> str:
    return f"[{', '.join(f'{s:,}' for s in t.shape)}]"


def static_items(rank: RankOnMeta) -> list[MemoryItem]:
    """Per-rank memory held for the whole run, item by item (device items, then the host snapshot)."""
    m, cfg = rank.model, rank.cfg
    params = dict(m.named_parameters())
    items = [MemoryItem("parameters", sum(map(nbytes, params.values())),
                        f"{sum(p.numel() for p in params.values()):,} values, every rank (bf16; 4 fp32 scalars)")]
    grads = [p for n, p in params.items() if n != "value_embeds"]
    items.append(MemoryItem("gradients (.grad)", sum(map(nbytes, grads)),
                            "parameter dtype; all but value_embeds (its backward adds into the fp16 cycle buffer)"))
    optimizer = cfg.optim.bank_optimizer
    replicated = [e for e in rank.manager.entries.values() if e.shard is None]
    for name, e in rank.manager.entries.items():
        if e.rule.optim == "bank":
            s = e.state
            items.append(MemoryItem(f"{optimizer} {name}", sum(map(nbytes, _fields(s))) + nbytes(e.matrix_mults),
                                    f"shard {_shape(s.mantissa)}: velocity {s.velocity.shape[0]}×fp32, "
                                    f"lane energy {_shape(s.lane_energy)} fp32, mantissa uint16"))
        elif e.shard is not None:
            items.append(MemoryItem(f"adam {name}", sum(map(nbytes, _fields(e.state))),
                                    f"moments 2×fp32 {_shape(e.state.exp_avg)} (rows {e.shard.chunk:,} of "
                                    f"{e.shard.n:,})"))
    items.append(MemoryItem("adam, replicated parameters", sum(nbytes(t) for e in replicated for t in _fields(e.state)),
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
        items.append(MemoryItem("n-gram row Adam state", sum(map(nbytes, _fields(st))),
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
    other_bytes = sum(nbytes(b) for _, b in others) + sum(map(nbytes, _fields(rank.step_weights)))
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

    @property
    def activation_peak(self) -> int:
        return max(self.forward_peak, self.backward_peak)

    @property
    def total(self) -> int:
        return self.inputs + self.held_ngram + self.prefetch + self.activation_peak


def geometries(schedule: TrainingSchedule) -> list[tuple[StepSettings, list[int]]]:
    """(the first step's settings, every step) of each schedule geometry, in schedule order."""
    found: dict[tuple, tuple[StepSettings, list[int]]] = {}
    for step in range(schedule.total_steps):
        s = schedule.settings(step)
        found.setdefault(s.geometry, (s, []))[1].append(step)
    return list(found.values())


def saved_for_backward(fn, ignore: set[int] = frozenset()) -> tuple[object, dict[int, TensorInfo]]:
    """fn()'s result and the tensors autograd saved for its backward: storage key -> info (whole
    storage bytes), each storage once however many views of it were saved, storages in `ignore`
    left out. Nothing is kept alive: saved tensors live until the backward anyway, so their keys
    stay distinct while fn runs."""
    saved: dict[int, TensorInfo] = {}

    def pack(t: Tensor) -> Tensor:
        key = storage_key(t)
        if key not in ignore and key not in saved:
            saved[key] = TensorInfo(tuple(t.shape), t.dtype, t.untyped_storage().nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, saved


@dataclasses.dataclass
class MetaStep:
    """One training forward's inputs for a schedule geometry, on "meta" at the per-rank shapes (the
    host batch kept: its cu_seqlens are the documents' lengths, which a meta tensor cannot hold)."""
    host_batch: object  # data.loader.Batch: dummy_batch's documents of doc_cap tokens
    batch: object  # the same on "meta"
    inputs: list[Tensor]  # every tensor the step feeds the model
    args: StepArgs
    tokens: int  # T, per virtual rank
    rows: Tensor | None  # the n-gram sink leaf [2T, D] (None: features.ngram off)

    def forward(self, model: GPT) -> Tensor:
        b = self.batch
        return model(b.inputs, b.targets, b.cu_seqlens, self.rows, b.ngram_sign_rows, self.args)


def meta_step(rank: RankOnMeta, settings: StepSettings, steps: list[int]) -> MetaStep:
    """The inputs `training.Run.train_step` gives the model at `settings`' geometry, on "meta"."""
    cfg, m, D = rank.cfg, rank.model, rank.cfg.model.model_dim
    T = settings.batch_tokens // cfg.virtual_world_size
    ngram = rank.table is not None
    host = dummy_batch(T, settings.doc_cap, virtual_seq_cap=cfg.schedule.virtual_seq_cap,
                       **(ngram_hash_sizes(cfg.model) if ngram else NO_NGRAM))
    with torch.device("meta"):
        batch = host.to("meta")
        rows = inverse = None
        if ngram:
            rows = torch.empty(2 * T, D, dtype=m.ngram_sign_pool.dtype, requires_grad=True)  # the sink leaf
            inverse = torch.empty(2 * T, dtype=torch.int64)  # the plan's inverse map (RowPlan.inverse_dev)
        candidates = torch.empty(settings.softmax_p, dtype=torch.int64) if settings.softmax_p else None
        mtp, prefix = rank.step_weights.load(steps[0])
    inputs = [batch.inputs, batch.targets, batch.cu_seqlens] + \
        ([batch.ngram_ids, batch.ngram_sign_rows, rows, inverse] if ngram else []) + \
        ([candidates] if candidates is not None else [])
    args = StepArgs(ws_short=settings.ws_short, ws_long=settings.ws_long, mtp_weights=mtp,
                    prefix_weight=prefix, candidates=candidates, training=True, max_seq_len=batch.max_seq_len)
    return MetaStep(host, batch, inputs, args, T, rows)


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
        with use_backend(**PORTABLE_BACKEND), attention, tracker:
            loss, saved = saved_for_backward(lambda: step.forward(m), ignore)
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
                      tracker.peak(forward_end, backward_end, grads), tracker.temporaries(0, forward_end))


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


def memory_report(cfg: RunConfig, world_size: int) -> MemoryReport:
    rank = build_rank_on_meta(cfg, world_size)
    return MemoryReport(rank, static_items(rank),
                        [step_memory(rank, s, steps) for s, steps in geometries(rank.schedule)])


def format_memory(report: MemoryReport, top: int = 6, capture: str | None = None) -> str:
    """The report as text; capture: a section inserted before the closing paragraph (main's capture check)."""
    rank, cfg = report.rank, report.rank.cfg
    off = cfg.features.off()
    lines = [f"memory of one training rank: --config {cfg.name}, {rank.world_size} process(es) × "
             f"{rank.accum} accumulation step(s), {'fp8' if cfg.features.fp8 else 'bf16'} training, rank 0's "
             f"shards (1 GiB = 2^30 bytes)" + (f"; switched off: {', '.join(off)}" if off else ""), ""]
    width = max(len(i.name) for i in report.static) + 2
    lines.append(f"{'static, device':<{width}} {'GiB':>7}  what")
    for item in (i for i in report.static if i.where == "device"):
        lines.append(f"  {item.name:<{width - 2}} {_gib(item.bytes):>7}  {item.detail}")
    lines.append(f"  {'total':<{width - 2}} {_gib(report.static_bytes):>7}")
    lines.append(f"{'host (not on the device)':<{width}}")
    host = [i for i in report.static if i.where == "host"]
    for item in host:
        lines.append(f"  {item.name:<{width - 2}} {_gib(item.bytes):>7}  {item.detail}")
    lines.append(f"  {'total':<{width - 2}} {_gib(sum(i.bytes for i in host)):>7}  per process (perf.preflight checks "
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
                     f"{_gib(s.inputs):>7} {_gib(s.held_ngram):>8} {_gib(s.prefetch):>7} {_gib(s.saved):>7} {_gib(s.forward_peak):>7} "
                     f"{_gib(s.backward_peak):>7} {_gib(s.total):>7}")
    lines += ["  inputs: the batch, its pulled n-gram rows [2T, D] bf16, the row plan, the candidates; n-gram≤: the "
              "gradient rows NgramRowOptimizer holds until the next table event, bounded by 2T distinct rows; "
              "ahead: the next step's n-gram rows pulled during this one (SPEEDRUN_ROW_PREFETCH; rows received, "
              "U ≤ 2T, and on several ranks the rows served, 2T on average); saved: what autograd keeps for the backward (unique storages); fwd/bwd pk: the most activation "
              "memory alive at once (saved + temporaries; parameter gradients are in static); step: inputs + "
              "n-gram≤ + ahead + the larger peak. Saved storages are told apart by untyped_storage()._cdata (views "
              "count once)"]
    w = report.worst
    lines += ["", f"largest tensors saved for the backward at step {w.settings.step} (the worst geometry), "
              f"{len(w.saved_tensors)} storages, {_gib(w.saved)} GiB:"]
    lines += [f"  {str(i):<32} {_gib(i.bytes):>7} GiB" for i in w.saved_tensors[:top]]
    lines += [f"largest temporaries of that forward (created and freed inside it); its peak holds "
              f"{_gib(w.forward_peak - w.saved)} GiB more than the saved total:"]
    lines += [f"  {str(i):<32} {_gib(i.bytes):>7} GiB" for i in w.temporaries[:top]]
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
    args = parse_preset_args("python -m perf.memory", __doc__, argv, RUN_PRESETS,
                             world_size_help="processes (default: the preset's ranks); each plays the others' "
                                             "batches by gradient accumulation",
                             ranks_of=lambda name: RUN_PRESETS[name].virtual_world_size)
    cfg = args.run_config  # the preset, --set applied (e.g. --set features.ngram=false)
    report = memory_report(cfg, args.world_size or cfg.virtual_world_size)
    print(format_memory(report, capture=format_capture_check(capture_check_cost(report.rank))))


if __name__ == "__main__":
    main()
