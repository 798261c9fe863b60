"""What a training step costs, before renting and after: FLOPs, bytes moved, the time floor, MFU.

    python -m perf.checks.cost --config record                 # per geometry, per optimizer phase, the schedule's floor
    python -m perf.checks.cost --config dev --world-size 1
    python -m perf.checks.cost --config smoke

Everything is counted on "meta" (no allocation, seconds) from the project's own code, at one rank's
shapes (`perf.checks.meta_rank.build_rank_on_meta`: the run itself, built on "meta"), by `FlopCounter`, a
dispatch mode that sees every op:
* FLOPs: one training forward and backward per schedule geometry on the portable path, torch's own
  formulas (`torch.utils.flop_counter`) for every GEMM, sorted by kind: `torch._scaled_mm` and our
  fp8 custom ops are fp8 GEMMs, a bf16 `mm` a bf16 GEMM, others (fp32) fp32 GEMMs. The attention
  runs as `CountedAttention`, varlen_attention's signature with FA3's exact work: 2 FLOPs per
  (query, key) pair per q/k and v dimension in the forward, the backward recomputing QKᵀ (3 d_qk +
  2 d_v per pair), the pairs counted from the batch's segments and the window. Pointwise ops count
  one FLOP per output element (their time is their bytes, below);
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
  `perf/tools/bench_rows.py` measured at stage-2 shapes (below, stated), and their HBM traffic estimated.
The floor: a roofline of every op (a GEMM or the attention at max(its FLOPs at its kind's dense
peak, its bytes at HBM bandwidth); a memory-bound op at its bytes), the single-reader fusion's
savings taken off; communication at the NVLink bandwidth one GPU sends; overlapped (max) and serial
(sum). Beside it, the FLOPs alone (tensor cores at peak) and the unfused bytes. fp32 GEMMs are priced
at the fp32 CUDA-core peak (`tf32_matmuls`: nothing enables TF32). It leaves out kernel launch gaps,
the host, the warmup, validation, and everything a kernel does below its peak.

`RunCost` gives a run its tokens/s, its MFU on the standard basis (model FLOPs, without FA3's
recomputation, over the time at the bf16 dense peak: `mfu`) and its peak fraction (each kind at its
own peak); `train_gpt.py` logs them, `runs.jsonl` keeps them.
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
from unittest import mock

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

from cli import parse_preset_args
from config import RUN_PRESETS, RunConfig
from perf.checks.meta_rank import (PORTABLE_BACKEND, build_rank_on_meta, each_with_progress, geometries, meta_step,
                                   print_progress, standin_collectives, storage_key)

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
    bf16_tflops: float  # dense tensor-core TFLOP/s: the basis of MFU
    tf32_tflops: float  # dense tensor-core TFLOP/s, for fp32 GEMMs only where TF32 is enabled
    fp32_tflops: float  # CUDA cores (no tensor cores): fp32 GEMMs with TF32 off, torch's default
    hbm_tb_per_s: float
    link_gb_per_s: float  # NVLink, one direction, per GPU
    source: str

    def tflops(self, kind: str) -> float:
        if kind == "fp32 GEMM":
            return self.tf32_tflops if tf32_matmuls() else self.fp32_tflops
        return self.fp8_tflops if kind == "fp8 GEMM" else self.bf16_tflops


def tf32_matmuls() -> bool:
    """Whether this process lets cuBLAS run fp32 matmuls as TF32. Neither record #360's trainer (its
    setup sets no matmul precision) nor this repository enables it, and torch's default ("highest")
    keeps fp32 matmuls in fp32 on the CUDA cores, so fp32 GEMMs are priced at the fp32 peak; a process
    that sets `torch.set_float32_matmul_precision("high")` gets the TF32 peak instead."""
    return torch.get_float32_matmul_precision() != "highest"


# NVIDIA's datasheets quote fp8/bf16/tf32 tensor-core figures "with sparsity"; the dense figures are
# half. fp32 (CUDA cores) is quoted dense. NVLink 4: 900 GB/s per GPU both directions together, 450 each way.
H100_SXM = DevicePeak("H100 SXM", 1978.9, 989.4, 494.7, 67.0, 3.35, 450.0,
                      "NVIDIA H100 Tensor Core GPU datasheet, SXM5: 3,958 fp8 / 1,979 bf16 / 989 tf32 tensor-core "
                      "TFLOP/s sparse, 67 fp32 TFLOP/s; 3.35 TB/s HBM3; NVLink 900 GB/s")
H200_SXM = DevicePeak("H200 SXM", 1978.9, 989.4, 494.7, 67.0, 4.8, 450.0,
                      "NVIDIA H200 Tensor Core GPU datasheet, SXM: the H100's tensor cores and 67 fp32 TFLOP/s; "
                      "4.8 TB/s HBM3e; NVLink 900 GB/s")
# torch.cuda.get_device_name() → peak; the PCIe and NVL parts have lower clocks: unknown here, so no MFU
DEVICE_NAMES = (("H100 80GB HBM3", H100_SXM), ("H100 SXM", H100_SXM), ("H200", H200_SXM))


def device_peak(device_name: str) -> DevicePeak | None:
    """The datasheet peak of a device by its CUDA name, None for a device not in the table (no MFU
    then, rather than a wrong one). "NVIDIA H200 NVL" is a lower-clocked part: not matched."""
    if "NVL" in device_name or "PCIe" in device_name:
        return None
    return next((peak for key, peak in DEVICE_NAMES if key in device_name), None)


def mfu(model_flops: float, seconds: float, peak: DevicePeak) -> float:
    """Model FLOPs utilization on the standard basis: the model's FLOPs (forward and backward, every
    kind, no recomputation) over the time at the device's dense bf16 tensor-core peak, as published
    MFUs are; fp8 GEMMs count at the bf16 peak like the rest."""
    return model_flops / (seconds * peak.bf16_tflops * 1e12)


# ----------------------------------------------------------------------------------------------------
# counting FLOPs and bytes
# ----------------------------------------------------------------------------------------------------

# allocations: nothing read or written (the op that fills the tensor is counted)
_ALLOCATIONS = {aten.empty, aten.empty_strided, aten.new_empty, aten.new_empty_strided, aten.empty_like}
# gathers read only the rows they return from their first operand (embedding: the table)
_GATHERS = {aten.embedding, aten.index, aten.index_select, aten.gather}
# in-place scatters read and write only the rows their source covers in their first operand
_SCATTERS = {aten.index_put_, aten._index_put_impl_, aten.index_add_, aten.scatter_add_, aten.index_copy_,
             aten.scatter_}
BYTE_KINDS = ("pointwise", "copy and cast", "gather and scatter", "other", "fused kernel")


def footprint(t: torch.Tensor) -> int:
    """Bytes an op moves for tensor t: its elements at its dtype, a broadcast (stride 0) dimension once."""
    n = 1
    for size, stride in zip(t.shape, t.stride()):
        if stride != 0:
            n *= size
    return n * t.element_size()


def _tensors(tree) -> list[torch.Tensor]:
    from torch.utils._pytree import tree_leaves

    return [t for t in tree_leaves(tree) if isinstance(t, torch.Tensor)]


class _Node:
    """One op (or one fused kernel) of the byte count: what it moved and whether it is memory-bound."""
    __slots__ = ("memory_bound",)

    def __init__(self, memory_bound: bool):
        self.memory_bound = memory_bound


class FlopCounter(TorchDispatchMode):
    """FLOPs and bytes of every op dispatched inside it (see the module docstring).

    flops: by kind. gemm_ops: Counter[(kind, flops, bytes)] of every GEMM and attention call, each with
    the bytes of its operands and result, for a roofline (time = max(FLOPs at peak, bytes at HBM
    bandwidth)). bytes: the memory-bound ops' traffic by BYTE_KINDS, unfused: each op reads its
    inputs and writes its outputs at their dtypes (views and allocations are free). `fusable()`: what
    fusing each memory-bound op into its only reader would save (see there). Inside `kernel(...)`
    (the Triton kernels' portable twins, `fused_kernels`) a whole call is one op: the tensors it reads
    from outside and the tensors it returns or writes in place, its internal temporaries free."""

    def __init__(self):
        super().__init__()
        self.flops: collections.Counter[str] = collections.Counter()
        self.gemm_ops: collections.Counter[tuple[str, int, int]] = collections.Counter()
        self.bytes: collections.Counter[str] = collections.Counter()
        # the value each storage holds now: (producing node, bytes written, [(reading node, bytes)])
        self._values: dict[int, tuple[_Node | None, int, list]] = {}
        self._finished: list[tuple[_Node | None, int, list]] = []
        self._alive: list = []  # storages held, so that no key is reused while counting
        self._region: dict | None = None

    # --- the graph of values, for the fusion estimate ---
    def _read(self, node: _Node, key: int, nbytes: int) -> None:
        self._values.setdefault(key, (None, 0, []))[2].append((node, nbytes))

    def _write(self, node: _Node, t: torch.Tensor, nbytes: int) -> None:
        key = storage_key(t)
        if key in self._values:
            self._finished.append(self._values[key])
        else:
            self._alive.append(t.untyped_storage())
        self._values[key] = (node, nbytes, [])

    def fusable(self) -> int:
        """Bytes that vertical fusion would save: a value written by a memory-bound op and read by
        exactly one op, itself memory-bound, need not be written nor read (the producer computes into
        its reader). Values read twice or more, or by a GEMM, attention or nothing, stay. An estimate
        of what torch.compile's fusion removes from the unfused count, not a measurement."""
        saved = 0
        for node, written, readers in [*self._finished, *self._values.values()]:
            if node is not None and node.memory_bound and len(readers) == 1 and readers[0][0].memory_bound:
                saved += written + readers[0][1]
        return saved

    # --- one op ---
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        packet = func._overloadpacket
        gemm = None
        if packet in _FP8_CUSTOM_GEMMS:  # perf/fp8.py's opaque ops: [M, K] @ [K, N] in fp8
            (m, k), n = args[0].shape, args[1].shape[1]
            gemm = ("fp8 GEMM", 2 * m * k * n)
        elif packet in flop_registry:
            gemm = (gemm_kind(packet, args), flop_registry[packet](*args, **kwargs, out_val=out))
        elif torch.Tag.pointwise in func.tags and isinstance(out, torch.Tensor):
            self.flops["pointwise"] += out.numel()
        if gemm is not None:
            self.flops[gemm[0]] += gemm[1]
        self._count_bytes(func, packet, args, kwargs, out, gemm)
        return out

    def _count_bytes(self, func, packet, args, kwargs, out, gemm) -> None:
        if packet in _ALLOCATIONS:
            for t in _tensors(out):
                if self._region is not None:
                    self._region["fresh"].add(storage_key(t))
                else:
                    self._write(_Node(False), t, 0)  # a fresh storage, nothing moved
            return
        inputs, outputs = _tensors((args, kwargs)), _tensors(out)
        mutable = func._schema.is_mutable
        in_keys = {storage_key(t) for t in inputs}
        if not mutable and outputs and all(storage_key(t) in in_keys for t in outputs):
            return  # a view (or an alias): no bytes
        reads: dict[int, int] = {}
        writes: list[tuple[torch.Tensor, int]] = []
        for i, t in enumerate(inputs):
            nbytes = footprint(t)
            if i == 0 and packet in _GATHERS and outputs:
                nbytes = min(nbytes, footprint(outputs[0]))
            elif i == 0 and packet in _SCATTERS:
                nbytes = min(nbytes, max((footprint(u) for u in inputs[1:]), default=0))
            elif i == 0 and packet is aten.copy_:
                continue  # the destination is written, not read
            reads[storage_key(t)] = max(reads.get(storage_key(t), 0), nbytes)
        for t in outputs:
            nbytes = footprint(t)
            if packet in _SCATTERS:
                nbytes = min(nbytes, max((footprint(u) for u in inputs[1:]), default=0))
            writes.append((t, nbytes))
        if self._region is not None:
            self._region_op(reads, writes, gemm, mutable)
            return
        node = _Node(gemm is None)
        for key, nbytes in reads.items():
            self._read(node, key, nbytes)
        for t, nbytes in writes:
            self._write(node, t, nbytes)
        total = sum(reads.values()) + sum(nbytes for _, nbytes in writes)
        if gemm is not None:
            self.gemm_ops[(gemm[0], gemm[1], total)] += 1
        else:
            self.bytes[_byte_kind(func, packet)] += total

    # --- a fused kernel: one op made of many ---
    @contextlib.contextmanager
    def kernel(self):
        """Count the ops inside as one kernel; `yield`s a function to call with its outputs."""
        if self._region is not None:  # already inside a kernel: one level counts
            yield lambda out: None
            return
        region = self._region = {"reads": {}, "fresh": set(), "written": {}, "gemm": collections.Counter(), "out": []}
        try:
            yield lambda out: region["out"].extend(_tensors(out))
        finally:
            self._region = None
        self._close_region(region)

    def _region_op(self, reads, writes, gemm, mutable: bool) -> None:
        region = self._region
        for key, nbytes in reads.items():
            if key not in region["fresh"]:  # a tensor from outside, read once by the kernel
                region["reads"][key] = max(region["reads"].get(key, 0), nbytes)
        for t, nbytes in writes:
            key = storage_key(t)
            if not mutable:
                region["fresh"].add(key)  # a new tensor: a temporary of the kernel, unless returned
            region["written"][key] = (t, max(nbytes, region["written"].get(key, (t, 0))[1]))
        if gemm is not None:
            region["gemm"][gemm[0]] += gemm[1]

    def _close_region(self, region) -> None:
        returned = {storage_key(t) for t in region["out"]}
        node = _Node(not region["gemm"])
        total = 0
        for key, nbytes in region["reads"].items():
            self._read(node, key, nbytes)
            total += nbytes
        for key, (t, nbytes) in region["written"].items():
            if key in returned or key not in region["fresh"]:  # visible outside: written to memory
                self._write(node, t, nbytes)
                total += nbytes
        if region["gemm"]:
            kind = region["gemm"].most_common(1)[0][0]  # the kernel priced as its main GEMM
            self.gemm_ops[(kind, sum(region["gemm"].values()), total)] += 1
        else:
            self.bytes["fused kernel"] += total

    def external(self, kind: str, flops: int, reads, writes) -> None:
        """An op the dispatcher does not see (the counted attention): its FLOPs and bytes."""
        node = _Node(False)
        total = 0
        for t in reads:
            self._read(node, storage_key(t), footprint(t))
            total += footprint(t)
        for t in writes:
            self._write(node, t, footprint(t))
            total += footprint(t)
        self.flops[kind] += flops
        self.gemm_ops[(kind, flops, total)] += 1


def _byte_kind(func, packet) -> str:
    if packet in _GATHERS or packet in _SCATTERS or packet is aten.embedding_dense_backward:
        return "gather and scatter"
    if packet in (aten._to_copy, aten.copy_, aten.clone, aten.cat, aten.stack, aten.constant_pad_nd):
        return "copy and cast"
    if torch.Tag.pointwise in func.tags:
        return "pointwise"
    return "other"


# the Triton kernels of the fast path, by their portable twins: (module, attribute); an autograd
# Function's forward and backward are each one kernel
FUSED_KERNELS = (
    ("perf.kernels.cross_entropy", "softcapped_ce_e4m3_portable"),
    ("perf.kernels.cross_entropy", "softcapped_ce_grad_e5m2_portable"),
    ("perf.kernels.cross_entropy", "_SoftcappedLoss.forward"),
    ("perf.kernels.cross_entropy", "_SoftcappedLoss.backward"),
    ("perf.kernels.mlp", "up_relu2_fp8_portable"),
    ("perf.kernels.mlp", "dpre_fp8_portable"),
    ("perf.kernels.ngram_embed", "_NgramEmbedPortable.forward"),
    ("perf.kernels.ngram_embed", "_NgramEmbedPortable.backward"),
    ("perf.kernels.qkv_rope", "quantize_dual_portable"),
    ("perf.kernels.qkv_rope", "qk_norm_rope_portable"),
    ("perf.kernels.qkv_rope", "qkv_rope_backward_portable"),
    ("perf.kernels.value_embed", "gather_rows_portable"),
    ("perf.kernels.value_embed", "scatter_add_rows_portable_"),
)


@contextlib.contextmanager
def fused_kernels(counter: FlopCounter):
    """Each twin in FUSED_KERNELS counted as the one kernel the fast path launches (`FlopCounter.kernel`):
    its FLOPs as they are, its bytes what it reads from and leaves in memory."""
    import importlib

    def wrap(fn, static):
        def counted(*args, **kwargs):
            with counter.kernel() as returned:
                out = fn(*args, **kwargs)
                returned(out)
            return out
        return staticmethod(counted) if static else counted

    with contextlib.ExitStack() as stack:
        for module_name, attribute in FUSED_KERNELS:
            owner = importlib.import_module(module_name)
            *path, name = attribute.split(".")
            for part in path:
                owner = getattr(owner, part)
            static = isinstance(owner, type)
            stack.enter_context(mock.patch.object(owner, name, wrap(getattr(owner, name), static)))
        yield


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
    """FA3's work and traffic: the forward reads q, k, v and writes the output and an fp32 lse per
    head and position; the backward reads those and the output's gradient and writes dq, dk, dv."""

    @staticmethod
    def forward(ctx, q, k, v, counter, flops):
        # FA3's backward recomputes QKᵀ: 2·d_qk per pair beyond the 2× forward of a plain backward,
        # hardware work (in the floor) and not model work (out of MFU)
        ctx.counter, ctx.backward_flops, ctx.recompute = counter, flops[1], flops[1] - 2 * flops[0]
        out = v.new_empty((*q.shape[:-1], v.shape[-1]))  # (T, H, d_v)
        lse = q.new_empty(q.shape[:-1], dtype=torch.float32)  # (T, H)
        counter.external("attention", flops[0], (q, k, v), (out, lse))
        ctx.inputs = (q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, lse = ctx.inputs
        grads = tuple(t.new_empty(t.shape) for t in (q, k, v))
        ctx.counter.external("attention", ctx.backward_flops, (q, k, v, out, lse, grad), grads)
        ctx.counter.flops["attention recompute"] += ctx.recompute
        return (*grads, None, None)


# ----------------------------------------------------------------------------------------------------
# one rank's step: the model per geometry, the optimizer per phase, the n-gram rows
# ----------------------------------------------------------------------------------------------------

# perf/tools/bench_rows.py at stage-2 shapes (8 ranks × 49,152 tokens, Tiny Shakespeare wrapped): 57k
# distinct n-gram ids of the 98k a rank's step holds (2 per token), and the README's push figures
# (494-558 MB per rank per table event, fp32 rows of 768) put a 4-step cycle's distinct rows at about
# half its ids. FineWeb's ratios differ; these are stated, not measured on it.
UNIQUE_IDS_PER_STEP = 0.58
UNIQUE_IDS_PER_CYCLE = 0.50


@dataclasses.dataclass
class Traffic:
    """What a counted region (a step's forward and backward, an optimizer update) does besides its
    FLOPs: GEMM and attention calls with their bytes (for the roofline), the memory-bound ops' bytes
    unfused by kind, and what fusing single-reader chains would save (FlopCounter.fusable)."""
    gemm_ops: dict  # (kind, FLOPs, bytes) → calls
    bytes: dict[str, int]  # memory-bound ops, unfused, by BYTE_KINDS
    fusable: int

    @classmethod
    def of(cls, counter: FlopCounter, times: int = 1) -> "Traffic":
        return cls({key: n * times for key, n in counter.gemm_ops.items()},
                   {k: counter.bytes[k] * times for k in BYTE_KINDS}, counter.fusable() * times)

    @property
    def memory_bound_bytes(self) -> int:
        return sum(self.bytes.values())

    @property
    def gemm_bytes(self) -> int:
        return sum(n * b for (_, _, b), n in self.gemm_ops.items())

    def seconds(self, peak: DevicePeak, fused: bool) -> float:
        """The roofline of the region on `peak`: every GEMM and attention call at max(its FLOPs at its
        kind's peak, its bytes at HBM bandwidth), plus the memory-bound bytes (less what fusion saves,
        if `fused`) at HBM bandwidth."""
        bw = peak.hbm_tb_per_s * 1e12
        gemms = sum(n * max(f / (peak.tflops(k) * 1e12), b / bw) for (k, f, b), n in self.gemm_ops.items())
        return gemms + (self.memory_bound_bytes - (self.fusable if fused else 0)) / bw


@dataclasses.dataclass
class GeometryCost:
    """One training forward and backward of every virtual rank this process plays, at one geometry."""
    settings: object  # optim.schedule.StepSettings of the geometry's first step
    steps: list[int]
    tokens: int  # per virtual rank
    accum: int
    flops: dict[str, int]  # per process and step, by kind (and "attention recompute", inside "attention")
    hbm_bytes: dict[str, int]  # estimated traffic outside the model's forward and backward
    traffic: Traffic | None = None  # bytes per process and step, counted
    params: dict[str, int] | None = None  # the parameters the step's GEMMs use, by group (`step_parameters`)

    @property
    def model_flops(self) -> int:
        """The model's FLOPs, forward and backward, without FA3's recomputation: the MFU numerator."""
        return sum(self.flops[k] for k in GEMM_KINDS) - self.flops.get("attention recompute", 0)

    @property
    def hardware_flops(self) -> int:
        return sum(self.flops[k] for k in GEMM_KINDS)

    @property
    def six_n_t(self) -> int:
        return 6 * sum(self.params.values()) * self.tokens * self.accum


@dataclasses.dataclass
class PhaseCost:
    """One optimizer update (OptimizerManager.step) of a phase, on one rank."""
    phase: object  # optim.manager.OptimizerPhase
    steps: list[int]
    flops: dict[str, int]
    sent_bytes: dict[str, int]  # what this rank sends, by collective and parameter group
    traffic: Traffic | None = None


def step_parameters(model, softmax_p: int | None) -> dict[str, int]:
    """N of 6·N·T: the parameters the step's GEMMs multiply by, by group, each counted as the GEMMs
    touch it. The attention weights as `GPT.attn_weights` cuts them from the banks (the live slots,
    each head's d_qk and d_v columns: not the padded slots nor the narrow heads' unused rows); the
    MLP bank's slots the model reads (not layer 7's, which has no MLP); the lm_head's columns the
    loss multiplies by (the P candidates under the sampled softmax, else V); the MUDD, gate and
    smear matrices whole. Embedding tables (embed, value_embeds, the n-gram table) are lookups, not
    GEMMs, and the λ scalars multiply elementwise."""
    from model.gpt import NO_MLP_LAYERS

    D, V = model.lm_head.weight.shape
    banks = ("lm_head.weight", "embed.weight", "value_embeds", "qk_bank", "vo_bank", "mlp_bank")
    return {
        "attention": sum(w.numel() for weights in model.attn_weights().values() for w in weights),
        "MLP": (model.mlp_bank.shape[0] - len(NO_MLP_LAYERS)) * model.mlp_bank[0].numel(),
        "lm_head": D * (softmax_p or V),
        "gates and MUDD": sum(p.numel() for name, p in model.named_parameters() if p.dim() >= 2 and name not in banks),
    }


def geometry_cost(rank, settings, steps) -> GeometryCost:
    """Count one forward and backward at `settings`' geometry on "meta" (meta_rank.meta_step's inputs)."""
    from model import attention as model_attention
    from perf.backend import use_backend

    cfg, D = rank.cfg, rank.cfg.model.model_dim
    step = meta_step(rank, settings, steps)
    counter = FlopCounter()
    attention = CountedAttention(counter, step.host_batch.cu_seqlens.tolist())
    with torch.device("meta"), use_backend(**PORTABLE_BACKEND), \
            mock.patch.object(model_attention, "varlen_attention", attention), fused_kernels(counter), counter:
        loss = step.forward(rank.model)
        loss.backward()
    rank.model.zero_grad(set_to_none=True)
    T, A = step.tokens, rank.accum
    # outside the counted forward and backward, estimated: the n-gram rows pulled into the sink (2T
    # bf16 rows read from the table shard and written) and their fp32 gradients merged at the table
    # event (written, read back); features.ngram off: no rows
    hbm = {"n-gram row pull and gradient merge (estimate)": 2 * T * D * (2 + 2 + 4 + 4) * A} if cfg.features.ngram else {}
    return GeometryCost(settings, steps, T, A, {k: counter.flops[k] * A for k in (*KINDS, "attention recompute")},
                        hbm, Traffic.of(counter, A), step_parameters(rank.model, settings.softmax_p))


def counted_collectives(sent: collections.Counter, world_size: int):
    """The manager's collectives (perf.checks.meta_rank.standin_collectives) as counters of the bytes this
    rank sends on a ring (reduce-scatter and all-gather: (W-1)/W of the whole tensor; all-reduce:
    twice that), by collective and dtype."""
    share = (world_size - 1) / world_size

    def note(kind: str, written: torch.Tensor, whole: torch.Tensor) -> None:
        sent[f"{kind} ({whole.dtype})"] += int((2 if kind == "all-reduce" else 1) * whole.numel()
                                               * whole.element_size() * share)

    return standin_collectives(note)


def phase_costs(rank) -> list[PhaseCost]:
    """`OptimizerManager.step` once per optimizer phase of the schedule, on "meta", every parameter
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
            manager.step(steps[0], untie=False)
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
# perf.checks.cost --config record (8 ranks, 2026-12-02): the fused floor is 30.04 s and record #360 ran in
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
    return ScheduleCost(cfg, world_size, [geometry_cost(rank, s, steps) for s, steps in each],
                        phase_costs(rank) if optimizer else [])


class RunCost:
    """What a run logs: tokens/s from the schedule's batches and, where the device's peak is known,
    over the steps so far: MFU on the standard basis (`mfu`: model FLOPs over the time at the bf16
    dense peak) and the peak fraction (each kind at its own peak, fp8 GEMMs at the fp8 peak: the
    fraction of the tensor-core floor reached)."""

    def __init__(self, schedule, cost: ScheduleCost | None = None, peak: DevicePeak | None = None):
        self.schedule, self.cost, self.peak = schedule, cost, peak
        self._tokens = [0]
        self._model_flops = [0]
        self._floor = [0.0]
        for step in range(schedule.total_steps):
            self._tokens.append(self._tokens[-1] + schedule.batch_tokens(step))
            if cost is not None and peak is not None:
                g = cost.geometry_at(step)
                self._model_flops.append(self._model_flops[-1] + g.model_flops)
                self._floor.append(self._floor[-1] + sum(g.flops[k] / (peak.tflops(k) * 1e12) for k in GEMM_KINDS))

    def tokens_per_s(self, steps_done: int, train_ms: float) -> float | None:
        return self._tokens[steps_done] / (train_ms / 1000) if train_ms > 0 else None

    def mfu(self, steps_done: int, train_ms: float) -> float | None:
        """Model FLOPs / (time × bf16 dense peak): the standard MFU."""
        if self.peak is None or self.cost is None or train_ms <= 0:
            return None
        return mfu(self._model_flops[steps_done], train_ms / 1000, self.peak)

    def peak_fraction(self, steps_done: int, train_ms: float) -> float | None:
        """Σ over kinds of FLOPs / that kind's peak, over the time: the tensor-core floor reached."""
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
    if W < cfg.virtual_world_size:
        lines += _fewer_gpus_lines(cost, steps)
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


def _all_matrix_params(cost: ScheduleCost) -> int:
    """Every parameter in a matrix except the lookup tables: what 6·N·T counted before it counted use."""
    from model.summary import build_on_meta

    model = build_on_meta(cost.cfg.model, cost.cfg.features)
    lookups = ("embed", "value_embeds")
    return sum(p.numel() for name, p in model.named_parameters()
               if p.dim() >= 2 and not any(name.startswith(k) for k in lookups))


def main(argv=None) -> None:
    args = parse_preset_args("python -m perf.checks.cost", __doc__.split("\n\n")[0], argv, RUN_PRESETS,
                             world_size_help="processes (default: the preset's ranks, 8 for record and dev; "
                                             "2 for smoke)",
                             ranks_of=lambda name: RUN_PRESETS[name].virtual_world_size)
    cfg = args.run_config  # the preset, --set applied (e.g. --set features.sampled_softmax=false)
    print(format_cost(schedule_cost(cfg, args.world_size, progress=print_progress)))


if __name__ == "__main__":
    main()
