"""What a training step costs, before renting and after: FLOPs, bytes moved, the time floor, MFU.

    python -m tools.cost --config record                 # per geometry, per optimizer phase, the schedule's floor
    python -m tools.cost --config dev --world-size 1
    python -m tools.cost --config smoke
    python -m tools.cost --config record --proposal cplm  # and the PR's time predicted on the record's measured one
    python -m tools.cost --frontier                      # every proposal predicted, one table (docs/frontier.md)

Everything is counted on "meta" (no allocation, seconds) from the project's own code, at one rank's
shapes (`runtime.meta_rank.build_rank_on_meta`: the run itself, built on "meta"), by `FlopCounter`, a
dispatch mode that sees every op:
* FLOPs: one training forward and backward per schedule geometry on the portable path, torch's own
  formulas (`torch.utils.flop_counter`) for every GEMM, sorted by kind: `torch._scaled_mm` and our
  fp8 custom ops are fp8 GEMMs, a bf16 `mm` a bf16 GEMM, others (fp32) fp32 GEMMs. The attention
  runs as `CountedAttention`, varlen_attention's signature with FA3's exact work: 2 FLOPs per
  (query, key) pair per q/k and v dimension in the forward, the backward recomputing QKᵀ (3 d_qk +
  2 d_v per pair), the pairs counted from the batch's segments and the window. Pointwise ops count
  one FLOP per output element (their time is their bytes, below);
* CPLM's pointer (features.cplm, PR #379): its three Triton kernels (perf/kernels/copy_pointer.py) run
  as `op_count.pointer_kernels` stands them in for the dense definition, priced like the attention: the
  64×64 score tiles each visits over the batch's segments and the band (`pointer_tiles`, the kernels'
  loop bounds), 2·d FLOPs per pair of a tile per product (the forward 1, dq and dk 2 each, one of them
  recomputed: hardware, not model FLOPs), each tensor argument read once; the head and the mixture are
  counted again alone for the CPLM lines (`cplm_cost`);
* bytes: every op reads its tensor inputs and writes its outputs at their dtypes (views and
  allocations free; a gather reads the rows it returns, a scatter the rows it adds to). The Triton
  kernels of the fast path are counted as the kernels (`FUSED_KERNELS`: their portable twins run,
  each call one op: what it reads from memory and what it leaves there); everything else is what
  the eager portable path moves, unfused, and `FlopCounter.fusable` estimates what fusing single-
  reader chains (what torch.compile does first) saves;
* the optimizer: `OptimizerManager.step` run on "meta" for each optimizer phase (Adam or not, table
  event or not), its FLOPs and bytes, its collectives replaced by counters: the bytes each rank
  sends per step, by kind;
* the n-gram row pull (every step) and gradient push (each table event): from the unique-row ratios
  `tools/bench_rows.py` measured at stage-2 shapes (below, stated), and their HBM traffic estimated.
The floor: a roofline of every op (a GEMM or the attention at max(its FLOPs at its kind's dense
peak, its bytes at HBM bandwidth); a memory-bound op at its bytes), the single-reader fusion's
savings taken off; communication at the NVLink bandwidth one GPU sends; overlapped (max) and serial
(sum). Beside it, the FLOPs alone (tensor cores at peak) and the unfused bytes. fp32 GEMMs are priced
at the fp32 CUDA-core peak (`tf32_matmuls`: nothing enables TF32). It leaves out kernel launch gaps,
the host, the warmup, validation, and everything a kernel does below its peak.

A change priced on the record measured: record #360's log gives each schedule stretch's ms/step
(`stretches`: its stages, stage 2 cut where its softmax width changes; tools/record_timing.py), and the
floor per step there a ratio per stretch (1.28× to 1.58×: what the floor leaves out, as the record ran
it). With --proposal or --set on the record preset's 8 ranks a run is predicted as Σ over its stretches
of its steps × its floor ms/step × the record's ratio for the stretch of the same index, plus the
record's one-off start and end: the record's time plus the floor's change, scaled stretch by stretch.
`--frontier` prints that for every proposal beside its PR's claim (docs/frontier.md). What a change does
to the terms the floor leaves out (work that runs further below its peak than the step's average,
launches it adds or removes) no ratio of the record's can know.

The run's own tokens/s, MFU and peak fraction (`RunCost`, the device peaks) live in
runtime/throughput.py and the counter (`FlopCounter`, `geometry_cost`) in runtime/op_count.py, which
this tool shares: the run imports neither the optimizer's phases, the bytes sent nor the floors.
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import re
import sys
from unittest import mock

import torch

from cli import exit_on_config_error, parse_preset_args
from config import RUN_PRESETS, ConfigError, RunConfig
from runtime.meta_rank import build_rank_on_meta, each_with_progress, geometries, print_progress, standin_collectives
from runtime.op_count import (KINDS, FlopCounter, GeometryCost, Traffic, fused_kernels, geometry_cost, pointer_kernels,
                               pointer_tiles)
from runtime.throughput import GEMM_KINDS, H100_SXM, H200_SXM, DevicePeak, mfu, tf32_matmuls
from tools.record_timing import RECORD_360, StretchTimes



# ----------------------------------------------------------------------------------------------------
# one rank's step: the model per geometry, the optimizer per phase, the n-gram rows
# ----------------------------------------------------------------------------------------------------

# tools/bench_rows.py at stage-2 shapes (8 ranks × 49,152 tokens, Tiny Shakespeare wrapped): 57k
# distinct n-gram ids of the 98k a rank's step holds (2 per token), and the README's push figures
# (494-558 MB per rank per table event, fp32 rows of 768) put a 4-step cycle's distinct rows at about
# half its ids. FineWeb's ratios differ; these are stated, not measured on it.
UNIQUE_IDS_PER_STEP = 0.58
UNIQUE_IDS_PER_CYCLE = 0.50


@dataclasses.dataclass
class PhaseCost:
    """One optimizer update (OptimizerManager.step) of a phase, on one rank."""
    phase: object  # optim.manager.OptimizerPhase
    steps: list[int]
    flops: dict[str, int]
    sent_bytes: dict[str, int]  # what this rank sends, by collective and parameter group
    traffic: Traffic | None = None


def counted_collectives(sent: collections.Counter, world_size: int):
    """The manager's collectives (runtime.meta_rank.standin_collectives) as counters of the bytes this
    rank sends on a ring (reduce-scatter and all-gather: (W-1)/W of the whole tensor; all-reduce:
    twice that), by collective and dtype."""
    share = (world_size - 1) / world_size

    def note(kind: str, written: torch.Tensor, whole: torch.Tensor) -> None:
        sent[f"{kind} ({whole.dtype})"] += int((2 if kind == "all-reduce" else 1) * whole.numel()
                                               * whole.element_size() * share)

    return standin_collectives(note)


def phase_costs(rank) -> list[PhaseCost]:
    """`OptimizerManager.update` once per optimizer phase of the schedule, on "meta", every parameter
    holding a gradient; the untie (once, at the split) is left out."""
    manager, schedule = rank.manager, rank.schedule
    # the update as upstream's graphs run it: gradients released, not zeroed in place (the run's
    # manager keeps them for its captured backward, `keep_grads`: not part of the record's step)
    keep_grads, manager.keep_grads = manager.keep_grads, False
    found: dict = {}  # period4 and rails change constants, not work: grouped
    for step in range(schedule.total_steps):
        phase = manager.phase_at(step)
        found.setdefault(dataclasses.replace(phase, period4=False, rails=False), []).append(step)
    costs = []
    for phase, steps in found.items():
        counter, sent = FlopCounter(), collections.Counter()
        manager.split = not phase.tied
        # the step's scalars are written on the host and copied in once (optim.manager.ScalarTable):
        # outside the meta default device, whose host staging buffers would be meta too
        for p in rank.model.parameters():
            p.grad = torch.empty_like(p)  # on meta, as the parameters; the scalars load for the entries due
        manager.load_scalars(steps[0])
        with torch.device("meta"), counted_collectives(sent, rank.world_size), fused_kernels(counter), counter:
            if manager.local_ranks > 1:  # a run folds each virtual rank after its backward; one fold counted here
                manager.fold_local(steps[0])
            manager.update(steps[0])
            if manager.deferred:
                manager.launch_deferred_gathers(steps[0])
                manager.wait_gathers()
        rank.model.zero_grad(set_to_none=True)
        costs.append(PhaseCost(phase, steps, {k: counter.flops[k] for k in KINDS}, dict(sent), Traffic.of(counter)))
    manager.split, manager.keep_grads = False, keep_grads
    return costs


def ngram_sent_bytes(cfg: RunConfig, world_size: int, tokens: int, accum: int, table_event: bool) -> dict[str, int]:
    """What one rank sends per step for the n-gram rows (optim/row_exchange.py): the rows others pull
    from it (bf16, as many as it pulls on average) and, at a table event, the cycle's gradient rows
    owned elsewhere (fp32). The ids themselves go over the host group and are left out."""
    if world_size == 1 or not cfg.features.ngram:
        return {}
    D, remote = cfg.model.model_dim, (world_size - 1) / world_size
    ids = 2 * tokens * accum  # a bigram and a trigram id per token
    sent = {"n-gram row pull (bf16)": int(UNIQUE_IDS_PER_STEP * ids * remote * D * 2)}
    if table_event:
        cycle = 4  # steps of gradients a 4-step event pushes (2 before the 4-step cadence: an upper bound)
        sent["n-gram gradient push (fp32)"] = int(UNIQUE_IDS_PER_CYCLE * cycle * ids * remote * D * 4)
    return sent


# ours: host↔device bandwidth a host-memory n-gram table moves rows at (PCIe Gen5 x16: 64 GB/s each
# way on paper; 50 GB/s is what pinned copies reach in practice, the figure upstream PR #366 planned with)
HOST_LINK_GB_PER_S = 50.0
# tools.cost --config record (8 ranks, 2026-12-02): the fused floor is 30.04 s and record #360 ran in
# 39.9 s, 1.33× it; a prediction for fewer GPUs assumes the same fraction of its own floor
RECORD_FLOOR_SECONDS = 30.04


def host_table_bytes(cfg: RunConfig, tokens: int, accum: int, table_event: bool) -> dict[str, int]:
    """Host↔device bytes one process moves per step for an n-gram table in host memory
    (perf/host_table.py): each micro-batch's distinct rows host→device, and at a table event the
    cycle's distinct rows read and written back (the same unique-id ratios as `ngram_sent_bytes`)."""
    D, ids = cfg.model.model_dim, 2 * tokens * accum
    moved = {"n-gram row gather, host→device (bf16)": int(UNIQUE_IDS_PER_STEP * ids * D * 2)}
    if table_event:
        rows = UNIQUE_IDS_PER_CYCLE * 4 * ids  # a 4-step cycle's distinct rows (2-step cycles: fewer)
        moved["n-gram event rows, host→device and back (bf16)"] = int(2 * rows * D * 2)
    return moved


# ----------------------------------------------------------------------------------------------------
# features.cplm (PR #379): the pointer head and the mixture, counted alone
# ----------------------------------------------------------------------------------------------------

# the training loss's per-row gathers for the mixture (model/loss.py, perf/kernels/cross_entropy.py), bytes
# per row, not counted alone: the `<copy>` column index int64 written (8), the [T, 2] int64 gather_cols
# stacked (16 read, 16 written), the CE reading it (16) and writing zg fp32 [T, 2] (8); its backward reading
# gather_cols (16) and grad_zg (8). Inside the CE's one pass over the logits in each direction: no extra pass
CE_GATHER_BYTES_PER_ROW = 8 + 32 + 24 + 24


@dataclasses.dataclass
class CplmCost:
    """features.cplm at one geometry, per process and step: the pointer head (model/cplm.py `copy_head`: the
    q/k projections, the QK norm, the pointer on its Triton kernels, `pointer_kernels`) and the mixture NLL
    (`mixture_nll`), run alone on meta, forward and backward, with the arguments the step's forward gave
    them. The step's own count (`GeometryCost`) holds the same work; this isolates it."""
    segments: list[int]  # the pointer's documents: the lengths of the host batch's attention segments
    band: int
    pairs: int  # valid (query, source) pairs: j < i in i's segment, j ≥ ⌊i/L⌋·L − L
    pointer: dict[str, dict[str, int]]  # the kernels: tiles, FLOPs, bytes by "forward", "dq", "dk"
    flops: dict[str, int]  # head and mixture, by kind (the kernels as "attention"; "attention recompute" inside)
    traffic: Traffic  # head and mixture
    rows: int  # T × virtual ranks: the rows the CE gathers at

    @property
    def gather_bytes(self) -> int:
        return CE_GATHER_BYTES_PER_ROW * self.rows

    def seconds(self, peak: DevicePeak) -> float:
        """The roofline of the head and the mixture (fused, as the step's floor) and the CE's gathers."""
        return self.traffic.seconds(peak, fused=True) + self.gather_bytes / (peak.hbm_tb_per_s * 1e12)


def pointer_pairs(cu_seqlens, n: int, band: int) -> int:
    """Valid (query, source) pairs of the pointer (frontier_cplm.md §5): query i sees j iff dstart(i) ≤ j < i
    and j ≥ ⌊i/L⌋·L − L, the documents those of cu_seqlens (entries clamped to n)."""
    cu = torch.tensor([min(int(c), n) for c in cu_seqlens], dtype=torch.long)
    i = torch.arange(n)
    doc = torch.searchsorted(cu, i, right=True)
    dstart = torch.cat([cu.new_zeros(1), cu])[doc]
    lo = torch.maximum(dstart, (i // band) * band - band).clamp(min=0)
    return int((i - lo).clamp(min=0).sum())


@contextlib.contextmanager
def recorded_cplm_calls():
    """The step's `copy_head` (model/gpt.py) and `mixture_nll` (model/loss.py) calls, their arguments kept
    (on meta: shapes, no values), the calls themselves unchanged."""
    import model.gpt
    import model.loss

    calls: dict = {}

    def recorder(owner, name):
        fn = getattr(owner, name)

        def call(*args, **kwargs):
            calls[name] = (fn, args, kwargs)
            return fn(*args, **kwargs)
        return mock.patch.object(owner, name, call)

    with recorder(model.gpt, "copy_head"), recorder(model.loss, "mixture_nll"):
        yield calls


def cplm_cost(rank, g: GeometryCost, calls: dict) -> CplmCost:
    """Count the step's CPLM calls (`recorded_cplm_calls`) alone: the head from fresh leaves of its inputs
    to (p_copy, a_sink), then the mixture of those and fresh leaves of the CE's lse and gathered z, one
    backward through both. h already holds a gradient (the lm_head's): autograd adds the pointer's to it, as
    in the step."""
    from perf.backend import use_backend
    from runtime.meta_rank import PORTABLE_BACKEND, meta_step

    head, head_args, head_kwargs = calls["copy_head"]
    mixture, mix_args, _ = calls["mixture_nll"]
    cu = meta_step(rank, g.settings, g.steps).host_batch.cu_seqlens.tolist()
    h, *rest = head_args
    band = rest[-1] if isinstance(rest[-1], int) else head_kwargs["band"]
    counter = FlopCounter()
    with torch.device("meta"), use_backend(**PORTABLE_BACKEND), fused_kernels(counter), \
            pointer_kernels(counter, cu) as pointer:
        h = h.detach().requires_grad_()
        h.grad = torch.empty_like(h)
        leaves = [t.detach().requires_grad_() for t in mix_args[:3]]  # z_target, z_copy, lse
        with counter:
            p_copy, a_sink = head(h, *rest, **head_kwargs)
            mixture(*leaves, p_copy, a_sink).sum().backward()
    rank.model.zero_grad(set_to_none=True)
    A, T = rank.accum, g.tokens
    lengths = [b - a for a, b in zip(cu, cu[1:]) if b > a]
    return CplmCost(lengths, band, pointer_pairs(cu, T, band) * A,
                    {part: {k: v * A for k, v in c.items()} for part, c in pointer.items()},
                    {k: counter.flops[k] * A for k in (*KINDS, "attention recompute")}, Traffic.of(counter, A), T * A)


@dataclasses.dataclass
class ScheduleCost:
    cfg: RunConfig
    world_size: int
    geometries: list[GeometryCost]
    phases: list[PhaseCost]
    cplm: list[CplmCost] | None = None  # features.cplm: per geometry, in the same order

    def geometry_at(self, step: int) -> GeometryCost:
        return self._by_step()[0][step]

    def phase_at(self, step: int) -> PhaseCost:
        return self._by_step()[1][step]

    def _by_step(self):
        if not hasattr(self, "_index"):
            self._index = ({s: g for g in self.geometries for s in g.steps}, {s: p for p in self.phases for s in p.steps})
        return self._index

    def sent_bytes(self, step: int) -> dict[str, int]:
        g = self.geometry_at(step)
        return {**self.phase_at(step).sent_bytes,
                **ngram_sent_bytes(self.cfg, self.world_size, g.tokens, g.accum, self.is_table_event(step))}

    @property
    def table_on_host(self) -> bool:
        """Whether ngram_table (auto: by an H100's memory) puts this rank's table in host memory."""
        from perf.host_table import H100_MEMORY_BYTES, choose_placement
        if not self.cfg.features.ngram:
            return False
        shard = self.cfg.model.ngram_rows // self.world_size * self.cfg.model.model_dim * 2
        return choose_placement(self.cfg.ngram_table, shard, torch.device("cuda"), H100_MEMORY_BYTES)[0] == "host"

    def host_bytes(self, step: int) -> dict[str, int]:
        if not self.table_on_host:
            return {}
        g = self.geometry_at(step)
        return host_table_bytes(self.cfg, g.tokens, g.accum, self.is_table_event(step))

    def is_table_event(self, step: int) -> bool:
        """The step's own table event, from its optimizer phase (a phase is per step; a geometry
        groups steps of one shape, events or not: its first step's flag priced every step of it,
        counting all 67 steps of 1107-1173 as events and none elsewhere)."""
        return self.phase_at(step).phase.table_event

    def floor(self, step: int, peak: DevicePeak, with_bytes: str | None = "fused") -> tuple[float, float]:
        """(compute, communication) seconds of `step` on one rank at `peak`. with_bytes None: the
        tensor-core FLOPs (model and optimizer) at their peaks alone. "unfused": the roofline of every
        op the counter saw (`Traffic.seconds`), each memory-bound op reading its inputs and writing
        its outputs; "fused": the same less what fusing single-reader chains saves. Both add the
        estimates outside the step. Communication: the bytes sent at the link bandwidth."""
        g, p = self.geometry_at(step), self.phase_at(step)
        if with_bytes is None:
            compute = sum((g.flops[k] + p.flops[k]) / (peak.tflops(k) * 1e12) for k in GEMM_KINDS)
        else:
            fused = with_bytes == "fused"
            compute = g.traffic.seconds(peak, fused) + (p.traffic.seconds(peak, fused) if p.traffic else 0.0)
            compute += sum(g.hbm_bytes.values()) / (peak.hbm_tb_per_s * 1e12)
        comm = sum(self.sent_bytes(step).values()) / (peak.link_gb_per_s * 1e9)
        return compute, comm


def schedule_cost(cfg: RunConfig, world_size: int | None = None, optimizer: bool = True,
                  progress=None) -> ScheduleCost:
    """Every geometry's and (with `optimizer`) every optimizer phase's cost for one rank of
    `world_size` processes; `progress` gets a line per geometry counted (main: on stderr)."""
    world_size = world_size or cfg.virtual_world_size
    rank = build_rank_on_meta(cfg, world_size)
    each = each_with_progress(geometries(rank.schedule), lambda g: f"cost: geometry at step {g[0].step}", progress)
    counted, cplm = [], []
    for settings, steps in each:
        with recorded_cplm_calls() as calls:
            counted.append(geometry_cost(rank, settings, steps))
        if cfg.features.cplm:
            cplm.append(cplm_cost(rank, counted[-1], calls))
    return ScheduleCost(cfg, world_size, counted, phase_costs(rank) if optimizer else [],
                        cplm if cfg.features.cplm else None)


RECORD_SECONDS = 39.9  # record #360 (README record #92): the time the floor is compared with


def _g(flops: float) -> str:
    return f"{flops / 1e9:,.2f}"


def matcher_lines(cost: ScheduleCost, peak: DevicePeak) -> list[str]:
    """features.doc_copy: the matcher's bytes per geometry (its sort and scans, its scatters and
    gathers, the rest), their share of the geometry's memory-bound bytes and their time at HBM
    bandwidth; none without the feature."""
    if cost.geometries[0].matcher is None:
        return []
    bw = peak.hbm_tb_per_s * 1e12
    lines = ["  doc_copy matcher (model/doc_copy.py), one rank's step, unfused: MB sort and scans / scatters and "
             "gathers / pointwise and copies, share of the step's memory-bound bytes, ms at HBM bandwidth"]
    for g in cost.geometries:
        m = g.matcher
        other, moved = m["other"], m["gather and scatter"]
        rest = sum(m.values()) - other - moved
        lines.append(f"  {g.steps[0]:>5}-{g.steps[-1]:<5} T={g.tokens:,}: {other / 1e6:,.1f} / {moved / 1e6:,.1f} / "
                     f"{rest / 1e6:,.1f} MB, {100 * sum(m.values()) / g.traffic.memory_bound_bytes:.2f} % of "
                     f"{g.traffic.memory_bound_bytes / 1e9:,.2f} GB, {1000 * sum(m.values()) / bw:.3f} ms")
    return lines


def _segments(lengths: list[int]) -> str:
    """'16 × 2,048' or '16 × 2,560 + 16 × 512': the segments' lengths, by count, longest first."""
    counts = collections.Counter(lengths)
    return " + ".join(f"{n} × {length:,}" for length, n in sorted(counts.items(), reverse=True))


def cplm_lines(cost: ScheduleCost, peak: DevicePeak) -> list[str]:
    """features.cplm: per geometry, the pointer's kernels (tiles, FLOPs, bytes), the projections and the
    rest of the head and the mixture, their time at the roofline and their share of the step's fused floor;
    none without the feature."""
    if not cost.cplm:
        return []
    from model.cplm import COPY_DIM
    from perf.kernels.copy_pointer import TILES

    bm, bn = TILES["cuda"]["BLOCK_M"], TILES["cuda"]["BLOCK_N"]
    lines = [f"  cplm (PR #379), one rank's step: the pointer's 3 Triton kernels priced by the {bm}×{bn} score tiles "
             f"they visit, band L = {cost.cplm[0].band:,}; its documents are the step's attention segments, priced "
             f"as the attention is (documents of the stage's doc cap, cut at the virtual sequence cap; real "
             f"documents are shorter: fewer pairs)",
             f"  GFLOP pointer forward / dq / dk (in the attention column; 2·{COPY_DIM} per pair per tile product: the "
             f"forward's q·kᵀ, and dq and dk each recompute it, then multiply by k or q) and the q/k projections "
             f"(bf16 GEMM), forward + backward; MB the kernels move (q, k, dq, dk, the per-row fp32 scalars and "
             f"int32 bounds, each once) and the rest (QK norm, sink score, mixture), unfused → fused; ms at the "
             f"roofline, the CE's gathers in; share of the step's fused ms (optimizer in)"]
    for g, c in zip(cost.geometries, cost.cplm):
        p = c.pointer
        evaluated = p["tiles"]["forward"] * bm * bn
        rest = c.traffic.memory_bound_bytes
        ms = 1000 * c.seconds(peak)
        step_ms = 1000 * cost.floor(g.steps[0], peak, "fused")[0] if cost.phases else None
        lines.append(
            f"  {g.steps[0]:>5}-{g.steps[-1]:<5} T={g.tokens:,} ({_segments(c.segments)}): tiles "
            f"{p['tiles']['forward']:,} forward and dq, {p['tiles']['dk']:,} dk ({100 * c.pairs / evaluated:.0f} % "
            f"of the forward's {evaluated / 1e6:,.1f}M pairs valid); GFLOP {_g(p['flops']['forward'])} / "
            f"{_g(p['flops']['dq'])} / {_g(p['flops']['dk'])}, projections {_g(c.flops['bf16 GEMM'])}; MB "
            f"{sum(p['bytes'].values()) / 1e6:,.1f}, rest {rest / 1e6:,.1f} → {(rest - c.traffic.fusable) / 1e6:,.1f}; "
            f"{ms:.3f} ms" + (f", {100 * ms / step_ms:.1f} % of {step_ms:.2f} ms" if step_ms else ""))
    return lines


def cplm_schedule_lines(cost: ScheduleCost, peak: DevicePeak, steps, fused_floor: float) -> list[str]:
    """features.cplm over the schedule: its FLOPs, its time at the roofline, the CE's gathers (negligible)
    and, for the record's preset on its ranks, the schedule's fused floor against the record's."""
    if not cost.cplm:
        return []
    by_step = dict(zip((g.steps[0] for g in cost.geometries), cost.cplm))
    at = [by_step[cost.geometry_at(s).steps[0]] for s in steps]
    pointer = sum(sum(c.pointer["flops"].values()) for c in at)
    recompute = sum(c.flops["attention recompute"] for c in at)
    projections = sum(c.flops["bf16 GEMM"] for c in at)
    seconds = sum(c.seconds(peak) for c in at)
    wide = max(cost.cplm, key=lambda c: c.rows)
    lines = [f"  cplm over the {len(steps)} steps: pointer kernels {pointer / 1e12:,.1f} TFLOP ({recompute / 1e12:,.1f} of "
             f"it the backward kernels' recomputed scores), projections {projections / 1e12:,.1f} TFLOP; the head and "
             f"the mixture {seconds:.2f} s of the {fused_floor:.2f} s fused floor ({100 * seconds / fused_floor:.1f} %); the CE's per-row gathers (z at the target and "
             f"`<copy>`, {CE_GATHER_BYTES_PER_ROW} B per row: {wide.gather_bytes / 1e6:.1f} MB at T = {wide.rows:,}) "
             f"are negligible, inside its one pass over the logits each way"]
    cfg = cost.cfg
    if cfg.name == "record" and not cfg.features.off() and cost.world_size == cfg.virtual_world_size:
        from optim.schedule import TrainingSchedule

        record_steps = TrainingSchedule(RUN_PRESETS["record"].schedule).total_steps
        lines.append(f"  cplm: the schedule's fused floor is {fused_floor:.2f} s over {len(steps)} steps, against the "
                     f"record's {RECORD_FLOOR_SECONDS:.2f} s over {record_steps} (RECORD_FLOOR_SECONDS): "
                     f"{fused_floor - RECORD_FLOOR_SECONDS:+.2f} s".replace("-", "−"))
    return lines


def format_cost(cost: ScheduleCost, peak: DevicePeak = H100_SXM, calibration: Calibration | None = None) -> str:
    """The report; with `calibration` (the record preset on its 8 ranks) the record per stretch and, for a
    change (--proposal, --set), its time predicted on the record's measured one."""
    cfg, W = cost.cfg, cost.world_size
    n = len({s for g in cost.geometries for s in g.steps})
    off, added = cfg.features.off(), cfg.features.added()
    lines = [f"--config {cfg.name}, {W} process(es) × {cost.geometries[0].accum} virtual rank(s); one rank's "
             f"step, GFLOP (forward + backward), counted on meta"
             + (f"; switched off: {', '.join(off)} (config.FeatureConfig)" if off else "")
             + (f"; past the record, on: {', '.join(added)}" if added else ""), ""]
    head = (f"{'steps':>11} {'n':>4} {'T/rank':>7} {'P':>6} " + " ".join(f"{k:>10}" for k in KINDS)
            + f" {'N (M)':>6} {'6·N·T':>10} {'GB':>6} {'fused':>6}"
            + (f" {'ms FLOPs':>8} {'ms bytes':>8}" if cost.phases else ""))
    lines += [f"model, per geometry (N: the parameters the step's GEMMs use, see `step_parameters`; GB: the "
              f"memory-bound ops' bytes, unfused, and fused: less what fusing single-reader chains saves; "
              f"ms: this geometry's first step, compute, with the optimizer, on {peak.name}, FLOPs at the "
              f"peaks alone and with every op's bytes, fused):", head]
    for g in cost.geometries:
        s = g.settings
        t = g.traffic
        row = (f"{g.steps[0]:>5}-{g.steps[-1]:<5} {len(g.steps):>4} {g.tokens:>7,} {s.softmax_p or '-':>6} "
               + " ".join(f"{_g(g.flops[k]):>10}" for k in KINDS) + f" {sum(g.params.values()) / 1e6:>6.1f}"
               + f" {_g(g.six_n_t):>10} {t.memory_bound_bytes / 1e9:>6.1f} {(t.memory_bound_bytes - t.fusable) / 1e9:>6.1f}")
        if cost.phases:
            row += (f" {1000 * cost.floor(g.steps[0], peak, None)[0]:>8.2f}"
                    f" {1000 * cost.floor(g.steps[0], peak, 'fused')[0]:>8.2f}")
        lines.append(row)
    lines += matcher_lines(cost, peak)
    lines += cplm_lines(cost, peak)
    g = cost.geometries[-1]
    lines.append("  N by group at " + f"steps {g.steps[0]}-{g.steps[-1]}: "
                 + ", ".join(f"{k} {v / 1e6:.1f}M" for k, v in g.params.items())
                 + f"; the model holds {_all_matrix_params(cost) / 1e6:.1f}M parameters in matrices (banks padded, "
                 f"the full lm_head)")
    lines += ["", "optimizer, per phase (adam / table event / tied):",
              f"{'phase':>14} {'n':>5} " + " ".join(f"{k:>10}" for k in KINDS) + f" {'GB':>6}  sent per step (MB)"]
    for p in cost.phases:
        ph = p.phase
        tag = f"{'A' if ph.adam else '-'}{'T' if ph.table_event else '-'}{'t' if ph.tied else '-'}"
        sent = ", ".join(f"{k} {v / 1e6:,.0f}" for k, v in sorted(p.sent_bytes.items())) or "-"
        lines.append(f"{tag:>14} {len(p.steps):>5} " + " ".join(f"{_g(p.flops[k]):>10}" for k in KINDS)
                     + f" {p.traffic.memory_bound_bytes / 1e9:>6.1f}  {sent}")
    steps = range(n)
    floors = {mode: [cost.floor(s, peak, mode) for s in steps] for mode in (None, "unfused", "fused")}
    comm = sum(f[1] for f in floors["fused"])
    compute = {mode: sum(f[0] for f in fl) for mode, fl in floors.items()}
    overlapped = {mode: sum(max(f) for f in fl) for mode, fl in floors.items()}
    serial = {mode: sum(f[0] + f[1] for f in fl) for mode, fl in floors.items()}
    model = sum(cost.geometry_at(s).model_flops for s in steps)
    hardware = sum(cost.geometry_at(s).hardware_flops for s in steps)
    optimizer = sum(sum(cost.phase_at(s).flops[k] for k in GEMM_KINDS) for s in steps)
    sent, hbm, by_kind = collections.Counter(), collections.Counter(), collections.Counter()
    gemm_bytes = fusable = 0
    for s in steps:
        sent.update(cost.sent_bytes(s))
        g, p = cost.geometry_at(s), cost.phase_at(s)
        hbm.update(g.hbm_bytes)
        for t in (g.traffic, p.traffic):
            if t is not None:
                by_kind.update(t.bytes)
                gemm_bytes += t.gemm_bytes
                fusable += t.fusable
    bw = peak.hbm_tb_per_s * 1e12
    fp32 = f"fp32 at {peak.tflops('fp32 GEMM'):,.0f} ({'TF32 enabled' if tf32_matmuls() else 'TF32 off'})"
    lines += ["", f"the schedule, {n} steps, one rank:",
              f"  model FLOPs {model / 1e15:,.2f} PFLOP (tensor cores; {hardware / 1e15:,.2f} with FA3's backward "
              f"recomputing QKᵀ), optimizer {optimizer / 1e15:,.3f} PFLOP",
              "  sent: " + "; ".join(f"{k} {v / 1e9:,.1f} GB" for k, v in sorted(sent.items())),
              f"  bytes (model and optimizer): GEMM and attention operands {gemm_bytes / 1e9:,.1f} GB (inside their "
              f"roofline); memory-bound ops, unfused, {sum(by_kind.values()) / 1e9:,.1f} GB: "
              + "; ".join(f"{k} {v / 1e9:,.1f}" for k, v in by_kind.items() if v)
              + f"; fusing single-reader chains would save {fusable / 1e9:,.1f} GB ({fusable / bw:.2f} s)",
              "  outside the step, estimated: " + ("; ".join(f"{k} {v / 1e9:,.1f} GB" for k, v in sorted(hbm.items())) or "-"),
              f"  floor on {W}× {peak.name} ({peak.source}): fp8 GEMMs at {peak.fp8_tflops:,.0f}, bf16 at "
              f"{peak.bf16_tflops:,.0f}, {fp32} TFLOP/s, HBM at {peak.hbm_tb_per_s} TB/s, communication "
              f"{comm:.2f} s (at {peak.link_gb_per_s:.0f} GB/s sent per GPU); compute, overlapped (max per step), serial:",
              f"    FLOPs alone (tensor cores at peak)          {compute[None]:6.2f} s {overlapped[None]:6.2f} s "
              f"{serial[None]:6.2f} s",
              f"    with every op's bytes, unfused (roofline)   {compute['unfused']:6.2f} s {overlapped['unfused']:6.2f} s "
              f"{serial['unfused']:6.2f} s",
              f"    with every op's bytes, fused (the floor)    {compute['fused']:6.2f} s {overlapped['fused']:6.2f} s "
              f"{serial['fused']:6.2f} s"]
    if cfg.name == "record" and not off and W == cfg.virtual_world_size:
        lines.append(f"    record #360: {RECORD_SECONDS} s = {RECORD_SECONDS / overlapped['fused']:.2f}× the overlapped floor "
                     f"({RECORD_SECONDS / overlapped['unfused']:.2f}× unfused, {RECORD_SECONDS / overlapped[None]:.2f}× "
                     f"FLOPs alone), {RECORD_SECONDS / serial['fused']:.2f}× the serial one")
        lines.append(f"    MFU basis (train_gpt.py's mfu): model FLOPs / (time × {peak.bf16_tflops:,.1f} TFLOP/s bf16 dense "
                     f"peak): record #360 at {RECORD_SECONDS} s on {W} GPUs would be "
                     f"{mfu(model, RECORD_SECONDS, peak):.1%} (peak fraction, each kind at its own peak: "
                     f"{overlapped[None] / RECORD_SECONDS:.1%})")
    else:
        lines.append(f"    MFU basis (train_gpt.py's mfu): model FLOPs / (time × {peak.bf16_tflops:,.1f} TFLOP/s bf16 "
                     f"dense peak); peak fraction: each kind at its own peak")
    lines += cplm_schedule_lines(cost, peak, steps, overlapped["fused"])
    if W < cfg.virtual_world_size:
        lines += _fewer_gpus_lines(cost, steps)
    if calibration is not None:
        lines += calibration_lines(calibration, peak)
        if cfg != RUN_PRESETS["record"]:
            lines += prediction_lines(predict(cost, calibration, peak))
    lines.append("  left out: launch gaps, the host, the warmup and validation (off the clock), kernels below "
                 "peak, fusion beyond single-reader chains, the ids' host exchange, the one-off untie")
    return "\n".join(lines)


def _fewer_gpus_lines(cost: ScheduleCost, steps) -> list[str]:
    """The record's recipe on fewer GPUs than its ranks: host↔device bytes of a host-memory table and a
    predicted time per GPU model, each step's compute, link and host copies overlapped."""
    W = cost.world_size
    host = collections.Counter()
    for s in steps:
        host.update(cost.host_bytes(s))
    lines = [f"  the recipe on {W} GPU(s): n-gram table in {'host' if cost.table_on_host else 'device'} memory"
             + (": " + "; ".join(f"{k} {v / 1e9:,.1f} GB" for k, v in sorted(host.items()))
                + f" over the run, {sum(host.values()) / 1e9 / len(steps):.2f} GB per step on average "
                f"(at {HOST_LINK_GB_PER_S:.0f} GB/s, {sum(host.values()) / (HOST_LINK_GB_PER_S * 1e9):.1f} s in all, "
                f"on a side stream under the compute)" if host else "")]
    for peak in (H100_SXM, H200_SXM):
        total = 0.0
        for s in steps:
            compute, comm = cost.floor(s, peak, "fused")
            total += max(compute, comm, sum(cost.host_bytes(s).values()) / (HOST_LINK_GB_PER_S * 1e9))
        lines.append(f"  predicted on {W}× {peak.name}: floor {total:.1f} s × {RECORD_SECONDS / RECORD_FLOOR_SECONDS:.2f} "
                     f"(record #360's {RECORD_SECONDS} s over its 8-GPU floor of {RECORD_FLOOR_SECONDS} s) = "
                     f"{total * RECORD_SECONDS / RECORD_FLOOR_SECONDS:.0f} s")
    lines.append("  assumes: the same fraction of the floor as the record on 8×H100, host copies hidden under "
                 "compute, FineWeb's distinct-row ratios as measured on Tiny Shakespeare (UNIQUE_IDS_PER_STEP)")
    return lines


# ----------------------------------------------------------------------------------------------------
# the record's measured time per stretch: a change priced as a delta on it
# ----------------------------------------------------------------------------------------------------

def stretches(schedule_cfg) -> list[range]:
    """The schedule's stretches, in order: its stages, a stage cut again where its sampled-softmax width
    changes (record: 0-319, 320-680, 681-964, 965-1106, 1107-1173, 1174-1193), the split of record #360's
    log (tools/record_timing.py). Cut by the widths the stages declare whatever features.sampled_softmax
    says, so an ablation keeps the record's stretches and maps onto them by index."""
    from optim.schedule import TrainingSchedule

    schedule = TrainingSchedule(schedule_cfg)  # every feature on: each declared width
    key = [(schedule.span(s).index, schedule.softmax_p(s)) for s in range(schedule.total_steps)]
    cuts = [0] + [s for s in range(1, len(key)) if key[s] != key[s - 1]]
    return [range(a, b) for a, b in zip(cuts, cuts[1:] + [len(key)])]


def stretch_floors(cost: ScheduleCost, peak: DevicePeak = H100_SXM) -> list[tuple[range, float]]:
    """(stretch, its fused floor in ms per step): each step's overlapped floor (max of compute and
    communication, `ScheduleCost.floor`), its own geometry and optimizer phase, averaged over the stretch."""
    return [(r, 1000 * sum(max(cost.floor(s, peak, "fused")) for s in r) / len(r))
            for r in stretches(cost.cfg.schedule)]


@dataclasses.dataclass(frozen=True)
class Calibration:
    """Record #360's measured ms/step per stretch (its log, tools/record_timing.py) held against its fused
    floor per step there: the ratio says how far above the floor each stretch ran (launch gaps, the host,
    kernels below peak, all that the floor leaves out), stretch by stretch rather than one figure."""
    floor_ms: tuple[float, ...]  # the record's floor, ms per step, per stretch (`stretch_floors`)
    measured: StretchTimes

    @property
    def ratios(self) -> tuple[float, ...]:
        return tuple(m / f for m, f in zip(self.measured.ms_per_step, self.floor_ms))

    @property
    def fixed_ms(self) -> float:
        """The clock's one-off costs (the run's start, the terminal ships): no step count scales them."""
        return self.measured.start_ms + self.measured.end_ms


def calibrate(record: ScheduleCost, peak: DevicePeak = H100_SXM, measured: StretchTimes = RECORD_360) -> Calibration:
    """The record preset's cost (8 ranks) against `measured`: their stretches must be the same steps."""
    floors = stretch_floors(record, peak)
    if tuple(len(r) for r, _ in floors) != measured.steps:
        raise ValueError(f"the record preset's stretches have {[len(r) for r, _ in floors]} steps and record "
                         f"#360's log {list(measured.steps)}: the schedule changed under RECORD_360 "
                         f"(tools/record_timing.py)")
    return Calibration(tuple(f for _, f in floors), measured)


def predict_ms(steps, floor_ms, ratios, fixed_ms: float) -> float:
    """A run's predicted time: Σ over stretches of its steps × its floor ms/step × the record's ratio
    there, plus the record's one-off costs. The record itself gets its measured time back exactly."""
    return sum(n * f * r for n, f, r in zip(steps, floor_ms, ratios)) + fixed_ms


# a claim's "T ± s s ... vs B ± b s" (the ± optional), as config.PROPOSALS writes them
_CLAIM = re.compile(r"^([\d.]+)(?: ± ([\d.]+))? s\b.*? vs ([\d.]+)(?: ± ([\d.]+))? s\b")


@dataclasses.dataclass(frozen=True)
class Claim:
    """A PR's measured time against the record measured on its own node (config.PROPOSALS' claim): nodes
    differ (the record's own 39.9 s ran elsewhere), so a prediction is held against its delta and ratio."""
    seconds: float
    spread: float | None  # the ± it states: its runs' spread; None where it states none
    baseline: float
    baseline_spread: float | None

    @property
    def delta(self) -> float:
        return self.seconds - self.baseline

    @property
    def ratio(self) -> float:
        return self.seconds / self.baseline

    @property
    def delta_spread(self) -> float | None:
        """The spread of one run's difference, the two ± combined (√(s² + b²)); None without both."""
        if self.spread is None or self.baseline_spread is None:
            return None
        return (self.spread ** 2 + self.baseline_spread ** 2) ** 0.5


def parse_claim(text: str) -> Claim | None:
    """'36.009 ± 0.039 s (8 runs) vs 40.575 ± 0.024 s for #360 ...' → Claim; None for a claim with no
    time ("none: ..."; the stack)."""
    m = _CLAIM.match(text)
    if m is None:
        return None
    return Claim(*(float(g) if g is not None else None for g in m.groups()))


@dataclasses.dataclass(frozen=True)
class Prediction:
    """One run priced on the record's measured time, per stretch."""
    label: str
    stretches: tuple[range, ...]
    floor_ms: tuple[float, ...]  # its own floor per step, per stretch
    calibration: Calibration
    claim: Claim | None = None
    pr: str = ""

    @property
    def seconds(self) -> float:
        c = self.calibration
        return predict_ms([len(r) for r in self.stretches], self.floor_ms, c.ratios, c.fixed_ms) / 1000

    @property
    def delta(self) -> float:
        """Predicted minus record #360's measured time (its log's run)."""
        return self.seconds - self.calibration.measured.total_ms / 1000

    @property
    def floor_seconds(self) -> float:
        return sum(len(r) * f for r, f in zip(self.stretches, self.floor_ms)) / 1000


def predict(cost: ScheduleCost, calibration: Calibration, peak: DevicePeak = H100_SXM,
            label: str | None = None) -> Prediction:
    """`cost` (the record preset with --proposal and --set applied, 8 ranks) priced per stretch on the
    record's ratios; a proposal's claim kept where nothing was --set on top of it."""
    from config import PROPOSALS

    cfg = cost.cfg
    floors = stretch_floors(cost, peak)
    if len(floors) != len(calibration.floor_ms):
        raise ConfigError(f"--set/--proposal: the schedule has {len(floors)} stretches "
                         f"({', '.join(f'{r.start}-{r.stop - 1}' for r, _ in floors)}) and record #360's log "
                         f"{len(calibration.floor_ms)}: its ratios map onto the record's stage table only")
    proposal = PROPOSALS.get(cfg.proposal)
    claim = parse_claim(proposal.claim) if proposal is not None and not cfg.overrides else None
    label = label or (cfg.proposal or cfg.name) + ("".join(f" --set {a}" for a in cfg.overrides))
    return Prediction(label, tuple(r for r, _ in floors), tuple(f for _, f in floors), calibration, claim,
                      proposal.pr if proposal is not None else "")


def _signed(x: float, digits: int = 2) -> str:
    return f"{x:+.{digits}f}".replace("-", "−")


def _record_ranges(measured: StretchTimes) -> list[range]:
    ends = [0]
    for n in measured.steps:
        ends.append(ends[-1] + n)
    return [range(a, b) for a, b in zip(ends, ends[1:])]


def calibration_lines(calibration: Calibration, peak: DevicePeak = H100_SXM) -> list[str]:
    """The record per stretch: steps, floor ms/step, measured ms/step (its log), their ratio."""
    m = calibration.measured
    lines = [f"  record #360 per stretch on 8× {peak.name}: the floor (fused, overlapped, each step's own "
             f"optimizer phase) against its log's measured ms/step (tools/record_timing.py)",
             f"  {'steps':>11} {'n':>5} {'floor ms/step':>14} {'measured ms/step':>17} {'ratio':>6}"]
    for r, f, ms, ratio in zip(_record_ranges(m), calibration.floor_ms, m.ms_per_step, calibration.ratios):
        lines.append(f"  {r.start:>5}-{r.stop - 1:<5} {len(r):>5} {f:>14.2f} {ms:>17.2f} {ratio:>6.3f}")
    floor = sum(n * f for n, f in zip(m.steps, calibration.floor_ms))
    lines.append(f"  one-off on the clock: {m.start_ms:.0f} ms at the start, {m.end_ms:.0f} ms after the last "
                 f"step; the run: floor {floor / 1000:.2f} s, measured {m.total_ms / 1000:.3f} s "
                 f"({m.total_ms / floor:.3f}× on the whole)")
    return lines


def prediction_lines(p: Prediction) -> list[str]:
    """One run predicted per stretch, its delta on the record and, for a proposal, its PR's claim."""
    c = p.calibration
    lines = [f"  predicted for {p.label}: per stretch, its steps × its floor ms/step × the record's ratio there, "
             f"plus the record's one-off {c.fixed_ms / 1000:.2f} s",
             f"  {'steps':>11} {'n':>5} {'floor ms/step':>14} {'ratio':>6} {'predicted ms/step':>18}"
             f" {'record n':>9} {'record ms/step':>15}"]
    for r, f, ratio, n, ms in zip(p.stretches, p.floor_ms, c.ratios, c.measured.steps, c.measured.ms_per_step):
        lines.append(f"  {r.start:>5}-{r.stop - 1:<5} {len(r):>5} {f:>14.2f} {ratio:>6.3f} {f * ratio:>18.2f}"
                     f" {n:>9} {ms:>15.2f}")
    record = c.measured.total_ms / 1000
    lines.append(f"  predicted {p.seconds:.3f} s: record #360's measured {record:.3f} s {_signed(p.delta, 3)} s "
                 f"({p.seconds / record:.3f}×)")
    if p.claim is not None:
        k = p.claim
        error = p.delta - k.delta
        spread = k.delta_spread
        verdict = ("the PR states no spread" if spread is None else
                   f"{'within' if abs(error) <= spread else 'outside'} its spread "
                   f"(± {spread:.3f} s, its two ± combined)")
        lines.append(f"  {p.pr} measured {_pm(k.seconds, k.spread)} vs {_pm(k.baseline, k.baseline_spread)} for #360 "
                     f"on its node: {_signed(k.delta, 3)} s ({k.ratio:.3f}×); our delta misses it by "
                     f"{_signed(error, 3)} s, {verdict}")
    return lines


def _pm(x: float, spread: float | None, unit: str = " s") -> str:
    return (f"{x:.3f} ± {spread:.3f}" if spread is not None else f"{x:.3f}") + unit


def frontier_predictions(assignments=(), progress=None, peak: DevicePeak = H100_SXM) -> list[Prediction]:
    """The record and every proposal (config.PROPOSALS) on the record preset's 8 ranks, `assignments`
    (--set) applied to each, priced on the record's ratios: one count per run."""
    from cli import preset_run_config
    from config import PROPOSALS

    record = schedule_cost(preset_run_config("record", list(assignments)), progress=progress)
    plain = record if not assignments else schedule_cost(RUN_PRESETS["record"], progress=progress)
    calibration = calibrate(plain, peak)
    found = [predict(record, calibration, peak)]
    for name in PROPOSALS:
        cost = schedule_cost(preset_run_config("record", list(assignments), name), progress=progress)
        found.append(predict(cost, calibration, peak))
    return found


def format_frontier(predictions: list[Prediction], peak: DevicePeak = H100_SXM) -> str:
    """One table: each run's steps, floor and predicted time, its delta on the record, and the PR's claim
    against its own baseline with how far our delta misses it."""
    c = predictions[0].calibration
    record = c.measured.total_ms / 1000
    lines = [f"the frontier on 8× {peak.name}: each run priced on record #360's measured time per stretch "
             f"({record:.3f} s, its log; tools/record_timing.py), Σ steps × floor ms/step × the record's ratio, "
             f"plus its one-off {c.fixed_ms / 1000:.2f} s",
             "ratios per stretch: " + ", ".join(f"{r.start}-{r.stop - 1} {x:.3f}"
                                                 for r, x in zip(_record_ranges(c.measured), c.ratios)),
             "",
             f"{'run':<18} {'steps':>5} {'floor s':>8} {'predicted s':>11} {'Δ s':>7} {'ratio':>6}   "
             f"{'PR measured s':>16} {'PR baseline s':>16} {'PR Δ s':>7} {'PR ratio':>8} {'Δ error s':>9}  "
             f"within spread"]
    for p in predictions:
        row = (f"{p.label:<18} {sum(len(r) for r in p.stretches):>5} {p.floor_seconds:>8.2f} {p.seconds:>11.3f} "
               f"{_signed(p.delta, 3):>7} {p.seconds / record:>6.3f}")
        k = p.claim
        if k is not None:
            spread = k.delta_spread
            error = p.delta - k.delta
            within = "-" if spread is None else f"{'yes' if abs(error) <= spread else 'no'} (± {spread:.3f})"
            row += (f"   {_pm(k.seconds, k.spread, ''):>16} {_pm(k.baseline, k.baseline_spread, ''):>16} "
                    f"{_signed(k.delta, 3):>7} {k.ratio:>8.3f} {_signed(error, 3):>9}  {within}")
        lines.append(row)
    lines.append("Δ: predicted − the record's measured; PR Δ: the PR's mean − #360's on the PR's node; Δ error: "
                 "Δ − PR Δ; within spread: |Δ error| ≤ √(s² + b²) of the PR's two ±")
    return "\n".join(lines)


def _all_matrix_params(cost: ScheduleCost) -> int:
    """Every parameter in a matrix except the lookup tables: what 6·N·T counted before it counted use."""
    from model.summary import build_on_meta

    model = build_on_meta(cost.cfg.model, cost.cfg.features)
    lookups = ("embed", "value_embeds")
    return sum(p.numel() for name, p in model.named_parameters()
               if p.dim() >= 2 and not any(name.startswith(k) for k in lookups))


def main(argv=None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    # --frontier is this tool's alone: taken out before the shared preset flags are parsed
    frontier = "--frontier" in argv
    argv = [a for a in argv if a != "--frontier"]
    prog = "python -m tools.cost"
    args = parse_preset_args(prog, __doc__.split("\n\n")[0], argv, RUN_PRESETS,
                             world_size_help="processes (default: the preset's ranks, 8 for record and dev; "
                                             "2 for smoke)",
                             ranks_of=lambda name: RUN_PRESETS[name].virtual_world_size)
    cfg = args.run_config  # the preset, --proposal and --set applied (e.g. --set features.sampled_softmax=false)
    if frontier:
        with exit_on_config_error(prog):
            wrong = [f"--config {args.config}" if args.config != "record" else "",
                     f"--proposal {args.proposal}" if args.proposal else "",
                     f"--world-size {args.world_size}" if args.world_size not in (None, 8) else ""]
            if any(wrong):
                raise ConfigError([f"--frontier: {w}: the frontier prices every proposal on the record preset's 8 "
                                   f"ranks, where record #360's log calibrates it; drop {w}" for w in wrong if w])
        print(format_frontier(frontier_predictions(args.assignments, progress=print_progress)))
        return
    cost = schedule_cost(cfg, args.world_size, progress=print_progress)
    calibration = None
    if cfg.name == "record" and cost.world_size == cfg.virtual_world_size:
        # the record's log calibrates 8 ranks of the record preset; a change needs the record counted too
        record = cost if cfg == RUN_PRESETS["record"] else schedule_cost(RUN_PRESETS["record"], progress=print_progress)
        calibration = calibrate(record)
    with exit_on_config_error(prog):  # a schedule the record's stretches do not map onto: one line, exit 2
        print(format_cost(cost, calibration=calibration))


if __name__ == "__main__":
    main()
