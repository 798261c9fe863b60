"""What a training step costs, before renting and after: FLOPs, bytes moved, the time floor.

    python -m perf.cost --config record                 # per geometry, per optimizer phase, the schedule's floor
    python -m perf.cost --config dev --world-size 1
    python -m perf.cost --config smoke

Everything is counted on "meta" (no allocation, seconds) from the project's own code, at one rank's
shapes (`perf.memory.build_rank_on_meta`):
* model FLOPs: one training forward and backward per schedule geometry on the portable path, under
  `FlopCounter`, a dispatch mode that applies torch's own formulas (`torch.utils.flop_counter`) to
  every GEMM and sorts them by kind: `torch._scaled_mm` is an fp8 GEMM, a bf16 `mm` a bf16 GEMM,
  others (fp32) an fp32 GEMM. The Triton kernels are counted by their portable twins (the same GEMMs).
  The attention runs as `CountedAttention`, varlen_attention's signature with FA3's exact work: 2
  FLOPs per (query, key) pair per q/k and v dimension in the forward, the backward recomputing QKᵀ
  (3 d_qk + 2 d_v per pair), the pairs counted from the batch's segments and the window;
* pointwise ops count one FLOP per output element (a floor on their work; they are memory-bound and
  appear in the time floor only through the HBM estimates below);
* the optimizer: `OptimizerManager.step` run on "meta" for each optimizer phase (Adam or not, table
  event or not), its collectives replaced by counters: the bytes each rank sends per step, by kind;
* the n-gram row pull (every step) and gradient push (each table event): from the unique-row ratios
  `perf/bench_rows.py` measured at stage-2 shapes (below, stated);
* HBM bytes of the memory-bound ops that dominate: the cross-entropy's fp8 logits and the n-gram
  gather, estimated from their shapes.
The floor: tensor-core FLOPs at the device's dense peak (fp8 GEMMs at the fp8 peak, the rest at
bf16), plus the estimated HBM traffic at HBM bandwidth; communication at the NVLink bandwidth one GPU
sends; overlapped (max) and serial (sum). It leaves out kernel launch gaps, the host, the warmup,
validation, and everything a kernel does below its peak.

`RunCost` gives a run its tokens/s and MFU (`train_gpt.py` logs them; `runs.jsonl` keeps them).
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
from unittest import mock

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

from config import RUN_PRESETS, RunConfig
from config_check import parse_preset_args

aten = torch.ops.aten
GEMM_KINDS = ("fp8 GEMM", "bf16 GEMM", "fp32 GEMM", "attention")
KINDS = GEMM_KINDS + ("pointwise",)


# ----------------------------------------------------------------------------------------------------
# devices: datasheet peaks
# ----------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class DevicePeak:
    name: str
    fp8_tflops: float  # dense tensor-core TFLOP/s
    bf16_tflops: float
    tf32_tflops: float
    hbm_tb_per_s: float
    link_gb_per_s: float  # NVLink, one direction, per GPU
    source: str

    def tflops(self, kind: str) -> float:
        return {"fp8 GEMM": self.fp8_tflops, "fp32 GEMM": self.tf32_tflops}.get(kind, self.bf16_tflops)


# NVIDIA's datasheets quote fp8/bf16/tf32 "with sparsity"; the dense figures are half. NVLink 4: 900
# GB/s per GPU both directions together, 450 GB/s each way.
H100_SXM = DevicePeak("H100 SXM", 1978.9, 989.4, 494.7, 3.35, 450.0,
                      "NVIDIA H100 Tensor Core GPU datasheet (SXM5: 3,958 fp8 / 1,979 bf16 / 989 tf32 TFLOP/s "
                      "sparse; 3.35 TB/s HBM3; NVLink 900 GB/s)")
H200_SXM = DevicePeak("H200 SXM", 1978.9, 989.4, 494.7, 4.8, 450.0,
                      "NVIDIA H200 Tensor Core GPU datasheet (SXM: the H100's tensor cores; 4.8 TB/s HBM3e; "
                      "NVLink 900 GB/s)")
# torch.cuda.get_device_name() → peak; the PCIe and NVL parts have lower clocks: unknown here, so no MFU
DEVICE_NAMES = (("H100 80GB HBM3", H100_SXM), ("H100 SXM", H100_SXM), ("H200", H200_SXM))


def device_peak(device_name: str) -> DevicePeak | None:
    """The datasheet peak of a device by its CUDA name, None for a device not in the table (no MFU
    then, rather than a wrong one). "NVIDIA H200 NVL" is a lower-clocked part: not matched."""
    if "NVL" in device_name or "PCIe" in device_name:
        return None
    return next((peak for key, peak in DEVICE_NAMES if key in device_name), None)


# ----------------------------------------------------------------------------------------------------
# counting FLOPs
# ----------------------------------------------------------------------------------------------------


class FlopCounter(TorchDispatchMode):
    """FLOPs of every op dispatched inside it, by kind (see the module docstring)."""

    def __init__(self):
        super().__init__()
        self.flops: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        packet = func._overloadpacket
        if packet in _FP8_CUSTOM_GEMMS:  # perf/fp8.py's opaque ops: [M, K] @ [K, N] in fp8
            (m, k), n = args[0].shape, args[1].shape[1]
            self.flops["fp8 GEMM"] += 2 * m * k * n
        elif packet in flop_registry:
            self.flops[gemm_kind(packet, args)] += flop_registry[packet](*args, **kwargs, out_val=out)
        elif torch.Tag.pointwise in func.tags and isinstance(out, torch.Tensor):
            self.flops["pointwise"] += out.numel()
        return out


import perf.fp8  # noqa: E402,F401  (registers the custom ops below)

_FP8_CUSTOM_GEMMS = (torch.ops.speedrun.scaled_mm, torch.ops.speedrun.lm_head_logits_e4m3)


def gemm_kind(packet, args) -> str:
    if packet is aten._scaled_mm:
        return "fp8 GEMM"
    dtype = next((a.dtype for a in args if isinstance(a, torch.Tensor)), None)
    return "bf16 GEMM" if dtype in (torch.bfloat16, torch.float16) else "fp32 GEMM"


def attention_pairs(segment_lengths, window: int) -> int:
    """(query, key) pairs of causal attention with a sliding window (query i sees keys i − window..i
    of its own segment), summed over segments: per segment of L positions, Σ_i (min(i, window) + 1)."""
    total = 0
    for length in segment_lengths:
        full = min(length, window + 1)  # the first window + 1 queries see every earlier key
        total += full * (full + 1) // 2 + (length - full) * (window + 1)
    return total


def attention_flops(cu_seqlens, window: int, heads: int, d_qk: int, d_v: int, paired: bool) -> tuple[int, int]:
    """(forward, backward) FLOPs of `varlen_attention` as FA3 does it: forward QKᵀ and PV, 2 FLOPs per
    multiply-add; backward recomputes QKᵀ, then dV, dP, dQ, dK. Paired heads see the positions
    doubled with half the heads (perf.attention_backends._stream_layout)."""
    cu = [int(c) for c in cu_seqlens]
    if paired:
        cu, heads = [2 * c for c in cu], heads // 2
    pairs = attention_pairs([b - a for a, b in zip(cu, cu[1:])], window) * heads
    return 2 * pairs * (d_qk + d_v), 2 * pairs * (3 * d_qk + 2 * d_v)


class CountedAttention:
    """`perf.attention_backends.varlen_attention`'s signature: counts FLOPs, computes nothing. The
    meta cu_seqlens hold no values, so the host batch's segments are given here."""

    def __init__(self, counter: FlopCounter, host_cu_seqlens):
        self.counter, self.cu = counter, host_cu_seqlens

    def __call__(self, q, k, v, cu_seqlens, window, softmax_scale, paired=False, max_seqlen=None):
        flops = attention_flops(self.cu, window, q.shape[1], q.shape[2], v.shape[2], paired)
        return _AttentionShapes.apply(q, k, v, self.counter, flops)


class _AttentionShapes(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, counter, flops):
        ctx.counter, ctx.backward_flops = counter, flops[1]
        ctx.shapes = (q.shape, k.shape, v.shape)
        counter.flops["attention"] += flops[0]
        return v.new_empty((*q.shape[:-1], v.shape[-1]))  # (T, H, d_v)

    @staticmethod
    def backward(ctx, grad):
        ctx.counter.flops["attention"] += ctx.backward_flops
        return (*(grad.new_empty(shape) for shape in ctx.shapes), None, None)


# ----------------------------------------------------------------------------------------------------
# one rank's step: the model per geometry, the optimizer per phase, the n-gram rows
# ----------------------------------------------------------------------------------------------------

# perf/bench_rows.py at stage-2 shapes (8 ranks × 49,152 tokens, Tiny Shakespeare wrapped): 57k
# distinct n-gram ids of the 98k a rank's step holds (2 per token), and the README's push figures
# (494-558 MB per rank per table event, fp32 rows of 768) put a 4-step cycle's distinct rows at about
# half its ids. FineWeb's ratios differ; these are stated, not measured on it.
UNIQUE_IDS_PER_STEP = 0.58
UNIQUE_IDS_PER_CYCLE = 0.50


@dataclasses.dataclass
class GeometryCost:
    """One training forward and backward of every virtual rank this process plays, at one geometry."""
    settings: object  # optim.schedule.StepSettings of the geometry's first step
    steps: list[int]
    tokens: int  # per virtual rank
    accum: int
    flops: dict[str, int]  # per process and step, by kind
    hbm_bytes: dict[str, int]  # estimated traffic of the memory-bound ops that dominate

    @property
    def model_flops(self) -> int:
        return sum(self.flops[k] for k in GEMM_KINDS)


@dataclasses.dataclass
class PhaseCost:
    """One optimizer update (OptimizerManager.step) of a phase, on one rank."""
    phase: object  # optim.manager.OptimizerPhase
    steps: list[int]
    flops: dict[str, int]
    sent_bytes: dict[str, int]  # what this rank sends, by collective and parameter group


def geometry_cost(rank, settings, steps) -> GeometryCost:
    """Count one forward and backward at `settings`' geometry on "meta" (perf.memory's inputs)."""
    from model import attention as model_attention
    from perf.memory import PORTABLE_BACKEND, meta_step
    from perf.backend import use_backend

    cfg, D = rank.cfg, rank.cfg.model.model_dim
    step = meta_step(rank, settings, steps)
    counter = FlopCounter()
    attention = CountedAttention(counter, step.host_batch.cu_seqlens.tolist())
    with torch.device("meta"), use_backend(**PORTABLE_BACKEND), \
            mock.patch.object(model_attention, "varlen_attention", attention), counter:
        loss = step.forward(rank.model)
        loss.backward()
    rank.model.zero_grad(set_to_none=True)
    T, A = step.tokens, rank.accum
    # estimates: the CE's e4m3 logits written and read and its e5m2 gradient written, per class
    # column (P sampled, or the vocabulary); the n-gram rows: 2T bf16 rows pulled into the sink and
    # read by the forward, their fp32 gradients written and merged
    classes = settings.softmax_p or cfg.model.vocab_size
    if cfg.features.fp8:
        hbm = {"cross-entropy logits (e4m3 + e5m2 grad)": 3 * T * classes * A}
    else:  # features.fp8 off: at least bf16 logits written and read and a bf16 gradient written
        hbm = {"cross-entropy logits (bf16 + bf16 grad)": 6 * T * classes * A}
    if cfg.features.ngram:  # (features.ngram off: no rows)
        hbm["n-gram rows (bf16 gather, fp32 grads)"] = 2 * T * D * (2 + 2 + 4 + 4) * A
    return GeometryCost(settings, steps, T, A, {k: counter.flops[k] * A for k in KINDS}, hbm)


@contextlib.contextmanager
def counted_collectives(sent: collections.Counter, world_size: int):
    """The manager's collectives as counters of the bytes this rank sends on a ring (reduce-scatter
    and all-gather: (W-1)/W of the full tensor; all-reduce: twice that), by collective and dtype."""
    import torch.distributed as dist

    import optim.manager as manager_module

    class Done:
        def wait(self):
            pass

    share = (world_size - 1) / world_size

    def reduce_scatter(out, full, op=None, group=None, async_op=False):
        sent[f"reduce-scatter ({full.dtype})"] += int(full.numel() * full.element_size() * share)
        return Done()

    def all_gather(out, local, group=None, async_op=False):
        sent[f"all-gather ({out.dtype})"] += int(out.numel() * out.element_size() * share)
        return Done()

    def all_reduce(t, op=None, group=None, async_op=False):
        sent[f"all-reduce ({t.dtype})"] += int(2 * t.numel() * t.element_size() * share)
        return Done()

    with mock.patch.object(manager_module, "reduce_scatter_single", reduce_scatter), \
            mock.patch.object(manager_module, "all_gather_single", all_gather), \
            mock.patch.object(dist, "all_reduce", all_reduce), mock.patch.object(dist, "get_backend", lambda *a: "nccl"):
        yield


def phase_costs(rank) -> list[PhaseCost]:
    """`OptimizerManager.step` once per optimizer phase of the schedule, on "meta", every parameter
    holding a gradient; the untie (once, at the split) is left out."""
    manager, schedule = rank.manager, rank.schedule
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
        with torch.device("meta"), counted_collectives(sent, rank.world_size), counter:
            manager.step(steps[0], untie=False)
            if manager.deferred:
                manager.launch_deferred_gathers(steps[0])
                manager.wait_gathers()
        rank.model.zero_grad(set_to_none=True)
        costs.append(PhaseCost(phase, steps, {k: counter.flops[k] for k in KINDS}, dict(sent)))
    manager.split = False
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


@dataclasses.dataclass
class ScheduleCost:
    cfg: RunConfig
    world_size: int
    geometries: list[GeometryCost]
    phases: list[PhaseCost]

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
                **ngram_sent_bytes(self.cfg, self.world_size, g.tokens, g.accum, g.settings.table_event)}

    def floor(self, step: int, peak: DevicePeak) -> tuple[float, float]:
        """(compute, communication) seconds of `step` on one rank at `peak`: tensor-core FLOPs (model
        and optimizer) plus the HBM estimates; bytes sent at the link bandwidth."""
        g, p = self.geometry_at(step), self.phase_at(step)
        compute = sum((g.flops[k] + p.flops[k]) / (peak.tflops(k) * 1e12) for k in GEMM_KINDS)
        compute += sum(g.hbm_bytes.values()) / (peak.hbm_tb_per_s * 1e12)
        comm = sum(self.sent_bytes(step).values()) / (peak.link_gb_per_s * 1e9)
        return compute, comm


def schedule_cost(cfg: RunConfig, world_size: int | None = None, optimizer: bool = True) -> ScheduleCost:
    """Every geometry's and (with `optimizer`) every optimizer phase's cost for one rank of
    `world_size` processes."""
    from perf.memory import build_rank_on_meta, geometries

    world_size = world_size or cfg.virtual_world_size
    rank = build_rank_on_meta(cfg, world_size)
    return ScheduleCost(cfg, world_size, [geometry_cost(rank, s, steps) for s, steps in geometries(rank.schedule)],
                        phase_costs(rank) if optimizer else [])


class RunCost:
    """What a run logs: tokens/s from the schedule's batches, and MFU where the device's peak is known
    (the model's forward and backward FLOPs of every step so far, each kind at its own peak, over the
    time taken: the fraction of the tensor-core floor reached)."""

    def __init__(self, schedule, cost: ScheduleCost | None = None, peak: DevicePeak | None = None):
        self.schedule, self.cost, self.peak = schedule, cost, peak
        self._tokens = [0]
        self._floor = [0.0]
        for step in range(schedule.total_steps):
            self._tokens.append(self._tokens[-1] + schedule.batch_tokens(step))
            if cost is not None and peak is not None:
                g = cost.geometry_at(step)
                self._floor.append(self._floor[-1] + sum(g.flops[k] / (peak.tflops(k) * 1e12) for k in GEMM_KINDS))

    def tokens_per_s(self, steps_done: int, train_ms: float) -> float | None:
        return self._tokens[steps_done] / (train_ms / 1000) if train_ms > 0 else None

    def mfu(self, steps_done: int, train_ms: float) -> float | None:
        if self.peak is None or self.cost is None or train_ms <= 0:
            return None
        return self._floor[steps_done] / (train_ms / 1000)


# ----------------------------------------------------------------------------------------------------
# the report
# ----------------------------------------------------------------------------------------------------

RECORD_SECONDS = 39.9  # record #360 (README record #92): the time the floor is compared with


def _g(flops: float) -> str:
    return f"{flops / 1e9:,.2f}"


def format_cost(cost: ScheduleCost, peak: DevicePeak = H100_SXM) -> str:
    cfg, W = cost.cfg, cost.world_size
    n = len({s for g in cost.geometries for s in g.steps})
    off = cfg.features.off()
    lines = [f"--config {cfg.name}, {W} process(es) × {cost.geometries[0].accum} virtual rank(s); one rank's "
             f"step, GFLOP (forward + backward), counted on meta"
             + (f"; switched off: {', '.join(off)} (config.FeatureConfig)" if off else ""), ""]
    head = (f"{'steps':>11} {'n':>4} {'T/rank':>7} {'P':>6} " + " ".join(f"{k:>10}" for k in KINDS)
            + f" {'6·N·T':>10} {'floor ms':>9}")
    matmul_params = _matmul_params(cost)
    lines += [f"model, per geometry (N = {matmul_params:,} parameters in matmuls; floor: this geometry's first "
              f"step, compute, with the optimizer, on {peak.name}):", head]
    for g in cost.geometries:
        s = g.settings
        six_nd = 6 * matmul_params * g.tokens * g.accum
        lines.append(f"{g.steps[0]:>5}-{g.steps[-1]:<5} {len(g.steps):>4} {g.tokens:>7,} {s.softmax_p or '-':>6} "
                     + " ".join(f"{_g(g.flops[k]):>10}" for k in KINDS) + f" {_g(six_nd):>10}"
                     + (f" {1000 * cost.floor(g.steps[0], peak)[0]:>9.2f}" if cost.phases else ""))
    lines += ["", "optimizer, per phase (adam / table event / tied):",
              f"{'phase':>14} {'n':>5} " + " ".join(f"{k:>10}" for k in KINDS) + "  sent per step (MB)"]
    for p in cost.phases:
        ph = p.phase
        tag = f"{'A' if ph.adam else '-'}{'T' if ph.table_event else '-'}{'t' if ph.tied else '-'}"
        sent = ", ".join(f"{k} {v / 1e6:,.0f}" for k, v in sorted(p.sent_bytes.items())) or "-"
        lines.append(f"{tag:>14} {len(p.steps):>5} " + " ".join(f"{_g(p.flops[k]):>10}" for k in KINDS) + f"  {sent}")
    steps = range(n)
    floors = [cost.floor(s, peak) for s in steps]
    compute, comm = sum(f[0] for f in floors), sum(f[1] for f in floors)
    overlapped, serial = sum(max(f) for f in floors), sum(f[0] + f[1] for f in floors)
    model = sum(cost.geometry_at(s).model_flops for s in steps)
    optimizer = sum(sum(cost.phase_at(s).flops[k] for k in GEMM_KINDS) for s in steps)
    sent = collections.Counter()
    for s in steps:
        sent.update(cost.sent_bytes(s))
    hbm = collections.Counter()
    for s in steps:
        hbm.update(cost.geometry_at(s).hbm_bytes)
    lines += ["", f"the schedule, {n} steps, one rank:",
              f"  model FLOPs {model / 1e15:,.2f} PFLOP (tensor cores), optimizer {optimizer / 1e15:,.3f} PFLOP",
              "  sent: " + "; ".join(f"{k} {v / 1e9:,.1f} GB" for k, v in sorted(sent.items())),
              "  HBM estimates: " + "; ".join(f"{k} {v / 1e9:,.1f} GB" for k, v in sorted(hbm.items())),
              f"  floor on {W}× {peak.name} ({peak.source}):",
              f"    compute {compute:.2f} s (fp8 GEMMs at {peak.fp8_tflops:,.0f}, bf16 at {peak.bf16_tflops:,.0f} "
              f"TFLOP/s; HBM at {peak.hbm_tb_per_s} TB/s), communication {comm:.2f} s (at {peak.link_gb_per_s:.0f} GB/s "
              f"sent per GPU)",
              f"    overlapped (max per step) {overlapped:.2f} s, serial (sum) {serial:.2f} s"]
    if cfg.name == "record" and not off:
        lines.append(f"    record #360: {RECORD_SECONDS} s = {RECORD_SECONDS / overlapped:.2f}× the overlapped floor, "
                     f"{RECORD_SECONDS / serial:.2f}× the serial one")
    lines.append("  left out: launch gaps, the host, the warmup and validation (off the clock), pointwise work "
                 "beyond the HBM estimates, kernels below peak, the ids' host exchange, the one-off untie")
    return "\n".join(lines)


def _matmul_params(cost: ScheduleCost) -> int:
    """Parameters that take part in a matmul per token (N of 6·N·D): the banks, lm_head and the MUDD/
    gate matrices; the embeddings, value embeddings and n-gram table are lookups."""
    from model.summary import build_on_meta

    model = build_on_meta(cost.cfg.model, cost.cfg.features)
    lookups = ("embed", "value_embeds")
    return sum(p.numel() for name, p in model.named_parameters()
               if p.dim() >= 2 and not any(name.startswith(k) for k in lookups))


def main(argv=None) -> None:
    args = parse_preset_args("python -m perf.cost", __doc__.split("\n\n")[0], argv, RUN_PRESETS,
                             world_size_help="processes (default: the preset's ranks, 8 for record and dev; "
                                             "2 for smoke)",
                             ranks_of=lambda name: RUN_PRESETS[name].virtual_world_size)
    cfg = args.run_config  # the preset, --set applied (e.g. --set features.sampled_softmax=false)
    print(format_cost(schedule_cost(cfg, args.world_size)))


if __name__ == "__main__":
    main()
