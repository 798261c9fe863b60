"""One rank of a training run on the "meta" device, for the tools that count it without allocating:
the memory report (tools/memory.py), the FLOP and byte count (tools/cost.py) and the CUDA-graph
capture check's cost (tools/capture_cost.py).

The rank is the run itself: `build_rank_on_meta` builds a `training.Run` through the same
`Run.__init__` as train_gpt.py, for `rank` of `world_size` processes on "meta" (`training.Setup`
given that rank, device "meta" and `META_BACKEND`), plus what train_gpt.py builds beside the run
(the tail averages, the canonical mask). What the tools then share lives here too, in one place:
the inputs of a training forward per schedule geometry (`meta_step`), the portable path the
forward runs on (`PORTABLE_BACKEND`, the attention as a flash kernel keeps it), the optimizer's
collectives replaced by completed no-ops (`standin_collectives`), and the small helpers (`GIB`,
`gib`, `nbytes`, `storage_key`, `tensor_fields`).
"""
from __future__ import annotations

import contextlib
import dataclasses
import sys
import time
from unittest import mock

import torch
from torch import Tensor

from config import RunConfig
from data.loader import NO_NGRAM, dummy_batch
from data.ngram import ngram_hash_sizes
from model.gpt import GPT, StepArgs
from perf import backend as perf_backend
from optim.schedule import StepSettings, TrainingSchedule
from optim.tail_average import TailAverages
from runtime import training

GIB = 2 ** 30

# The backend a rank is modelled with: the record's fp8 GEMMs (unless features.fp8 is off), nothing
# compiled or captured, the banks' all-gathers inside the optimizer step (not deferred).
META_BACKEND = dict(fp8=True, compile=False, cuda_graphs=False, deferred_gathers=False)

# The path the meta forward runs: plain PyTorch (the fp8 GEMMs through torch._scaled_mm, the
# portable cross-entropy), the attention replaced by `flash_attention_standin` unless asked for SDPA.
# The fast path's Triton kernels save other tensors (the fp8 MLP kernel: a copy of post8ᵀ where the
# portable twin keeps a view). Both CEs save the same (the e4m3 logits and lse); the portable twin's
# fp32 temporaries come one slab of CE_SLAB_ROWS rows at a time, where the kernel has none.
PORTABLE_BACKEND = dict(triton=False, attention="sdpa", fp8=True, compile=False, host_checks=False)


def gib(b: int) -> str:
    return f"{b / GIB:.2f}"


def nbytes(t: Tensor) -> int:
    return t.numel() * t.element_size()


def storage_key(t: Tensor) -> int:
    """Identity of t's storage: the address of its StorageImpl (`untyped_storage()._cdata`). Views
    share it, and meta tensors have a StorageImpl too (with no data), so it works on "meta". It is
    unique among live storages only: compare keys of tensors that are alive together."""
    return t.untyped_storage()._cdata


def tensor_fields(obj) -> list[Tensor]:
    """The tensors among a dataclass's fields (or an object's attributes)."""
    values = [getattr(obj, f.name) for f in dataclasses.fields(obj)] if dataclasses.is_dataclass(obj) \
        else list(vars(obj).values())
    return [v for v in values if isinstance(v, Tensor)]


# ----------------------------------------------------------------------------------------------------
# the rank
# ----------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class RankOnMeta:
    """One rank of a run on "meta": the run (`training.Run`, built by its own __init__) and what
    train_gpt.py builds beside it (the tail averages; the canonical mask, built on the clock)."""
    run: training.Run
    tails: TailAverages
    canonical_mask: Tensor | None

    @property
    def cfg(self) -> RunConfig:
        return self.run.cfg

    @property
    def world_size(self) -> int:
        return self.run.setup.world_size

    @property
    def accum(self) -> int:
        """Virtual ranks each process plays (gradient accumulation steps)."""
        return self.run.setup.accum

    @property
    def schedule(self) -> TrainingSchedule:
        return self.run.schedule

    @property
    def model(self) -> GPT:
        return self.run.model

    @property
    def manager(self):
        return self.run.manager

    @property
    def table(self):
        """The n-gram table shard (None: features.ngram off)."""
        return self.run.table

    @property
    def ngram_opt(self):
        return self.run.ngram_opt

    @property
    def step_weights(self):
        return self.run.step_weights

    def static_tensors(self) -> list[Tensor]:
        """Every tensor above that lives for the whole run (parameters, buffers, states)."""
        out = [*self.model.parameters(), *self.model.buffers(), *tensor_fields(self.step_weights)]
        if self.table is not None:
            out += [self.table.rows, *tensor_fields(self.ngram_opt.state)]
        for e in self.manager.entries.values():
            out += [*tensor_fields(e.state), *(t for t in (e.held, e.matrix_mults) if t is not None)]
        for acc in self.tails.accumulators:
            out += list(acc.bufs.values())
        return out + ([self.canonical_mask] if self.canonical_mask is not None else [])


def build_rank_on_meta(cfg: RunConfig, world_size: int, rank: int = 0) -> RankOnMeta:
    """`rank` of `world_size` processes, built on "meta" by `training.Run` itself (fp8 on unless
    features.fp8 is off; switched-off features allocate nothing, as in the run)."""
    if world_size < 1 or cfg.virtual_world_size % world_size:
        raise ValueError(f"--world-size {world_size}: the {cfg.name} preset splits its batch over "
                         f"{cfg.virtual_world_size} ranks, so the process count must divide it")
    backend = dataclasses.replace(perf_backend.current(), **META_BACKEND)
    run = training.Run(cfg, training.Setup(cfg, rank, world_size, device="meta", backend=backend))
    with torch.device("meta"):
        tails = TailAverages(run.manager, run.schedule)
        V = cfg.model.vocab_size
        mask = torch.zeros((V, (V + 7) // 8), dtype=torch.uint8) if cfg.canonical_mask else None
    return RankOnMeta(run, tails, mask)


# ----------------------------------------------------------------------------------------------------
# a training forward on "meta", per schedule geometry
# ----------------------------------------------------------------------------------------------------


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


def each_with_progress(items: list, what, progress=None):
    """Yield `items` one by one; once the caller is done with one (it asks for the next), `progress`
    gets `{what(item)} {i}/{n} in {s:.1f} s` (nothing without one). The tools' per-geometry work on
    meta takes seconds each (the record's schedule: 18 geometries), so their mains print it."""
    for i, item in enumerate(items):
        start = time.perf_counter()
        yield item
        if progress is not None:
            progress(f"{what(item)} {i + 1}/{len(items)} in {time.perf_counter() - start:.1f} s")


def print_progress(line: str) -> None:
    """A tool's progress line: on stderr, so its report on stdout stays what it was."""
    print(line, file=sys.stderr, flush=True)


def geometries(schedule: TrainingSchedule) -> list[tuple[StepSettings, list[int]]]:
    """(the first step's settings, every step) of each schedule geometry, in schedule order."""
    found: dict[tuple, tuple[StepSettings, list[int]]] = {}
    for step in range(schedule.total_steps):
        s = schedule.settings(step)
        found.setdefault(s.geometry, (s, []))[1].append(step)
    return list(found.values())


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
                    prefix_weight=prefix, candidates=candidates, training=True, max_seq_len=batch.max_seq_len,
                    head_sample=rank.run.head_sample if settings.head_sample else None,
                    attention_mode=settings.attention_mode,
                    attention_calibration=rank.run.calibration if settings.attention_mode else None)
    return MetaStep(host, batch, inputs, args, T, rows)


# ----------------------------------------------------------------------------------------------------
# the optimizer's collectives
# ----------------------------------------------------------------------------------------------------


class _Done:
    """A collective's work handle that has completed."""

    def wait(self) -> None:
        pass


@contextlib.contextmanager
def standin_collectives(note):
    """The optimizer's collectives (optim.manager's reduce_scatter_single and all_gather_single,
    dist.all_reduce) as completed no-ops on an NCCL-like backend, each told to
    `note(kind, written, whole)`: kind "reduce-scatter", "all-gather" or "all-reduce", the tensor
    it writes on this rank, and the whole tensor it reduces or gathers (a reduce-scatter's full
    input; the all-gather's output; the all-reduce's tensor)."""
    import torch.distributed as dist

    import optim.manager as manager_module

    def reduce_scatter(out, full, op=None, group=None, async_op=False):
        note("reduce-scatter", out, full)
        return _Done()

    def all_gather(out, local, group=None, async_op=False):
        note("all-gather", out, out)
        return _Done()

    def all_reduce(t, op=None, group=None, async_op=False):
        note("all-reduce", t, t)
        return _Done()

    with mock.patch.object(manager_module, "reduce_scatter_single", reduce_scatter), \
            mock.patch.object(manager_module, "all_gather_single", all_gather), \
            mock.patch.object(dist, "all_reduce", all_reduce), mock.patch.object(dist, "get_backend", lambda *a: "nccl"):
        yield

