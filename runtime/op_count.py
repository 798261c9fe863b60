"""A training step's FLOPs and bytes, counted on "meta" from the project's own code, one geometry at a time.

`FlopCounter` is a dispatch mode that sees every op of one forward and backward of the run built on
"meta" (runtime/meta_rank.py); `count_geometries` counts each geometry of the schedule. A run on a GPU
whose peak is known takes its MFU's numerator from here (runtime/throughput.py); the cost tool
(tools/cost.py) adds the optimizer, the bytes sent and the floors, and documents the counting rules.
"""
from __future__ import annotations

import bisect
import collections
import contextlib
import dataclasses
from unittest import mock

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

from config import RunConfig
from model.attention_calibration import PR_371_RUN_01_WINDOWS
from runtime.meta_rank import PORTABLE_BACKEND, build_rank_on_meta, each_with_progress, geometries, meta_step, storage_key
from runtime.throughput import GEMM_KINDS, DevicePeak

aten = torch.ops.aten
KINDS = GEMM_KINDS + ("pointwise",)


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


class CountedRestrictedAttention:
    """`perf.windowed_backward.restricted_backward_attention`'s signature (PR #371's mode 2): the forward
    FA3's full-window work; the backward each FA3 head's pairs within its own window w_h = min(code, W)
    (W for a code −1), 2·(3·d_qk + 2·d_v) FLOPs per pair, its recompute 2·d_qk per pair. The codes come
    from `codes[layer]`, the layers' tables found by identity (meta tables hold no values)."""

    def __init__(self, counter: FlopCounter, host_cu_seqlens, tables: dict, codes: dict):
        self.counter, self.cu = counter, host_cu_seqlens
        self.layer_of = {id(table): layer for layer, table in tables.items()}
        self.codes = codes

    def __call__(self, q, k, v, cu_seqlens, window, softmax_scale, head_windows, paired=False, max_seqlen=None):
        # max_seqlen: the FA3 op's launch bound (model/attention.py passes it since the FA3 path): no work of its own
        forward, _ = attention_flops(self.cu, window, q.shape[1], q.shape[2], v.shape[2], paired)
        cu = [2 * int(c) for c in self.cu] if paired else [int(c) for c in self.cu]
        lengths = [b - a for a, b in zip(cu, cu[1:])]
        codes = self.codes[self.layer_of[id(head_windows)]]
        pairs = sum(attention_pairs(lengths, window if c < 0 else min(c, window)) for c in codes)
        d_qk, d_v = q.shape[2], v.shape[2]
        return _AttentionShapes.apply(q, k, v, self.counter,
                                      (forward, 2 * pairs * (3 * d_qk + 2 * d_v), 2 * pairs * d_qk))


class _AttentionShapes(torch.autograd.Function):
    """FA3's work and traffic: the forward reads q, k, v and writes the output and an fp32 lse per
    head and position; the backward reads those and the output's gradient and writes dq, dk, dv."""

    @staticmethod
    def forward(ctx, q, k, v, counter, flops):
        # FA3's backward recomputes QKᵀ: 2·d_qk per pair beyond the 2× forward of a plain backward,
        # hardware work (in the floor) and not model work (out of MFU)
        # (a third entry: the recompute of a backward that visits fewer pairs than its forward, PR #371 part 2)
        ctx.counter, ctx.backward_flops = counter, flops[1]
        ctx.recompute = flops[2] if len(flops) > 2 else flops[1] - 2 * flops[0]
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
# CPLM's pointer (PR #379): its Triton kernels' work, by the score tiles they visit
# ----------------------------------------------------------------------------------------------------

# perf/kernels/copy_pointer.py's launches: (kernel, part, tile products per visited tile, outputs: the last
# this-many tensor arguments). The forward scores each tile (q·kᵀ); the dq and dk kernels each recompute
# the scores and multiply ∂L/∂s by k (dq) or q (dk): one product of each is recomputation
POINTER_KERNELS = (("_copy_pointer_fwd_kernel", "forward", 1, 3),
                   ("_copy_pointer_dq_kernel", "dq", 2, 1),
                   ("_copy_pointer_dk_kernel", "dk", 2, 1))


def pointer_tiles(cu_seqlens, n: int, band: int, block_m: int, block_n: int) -> dict[str, int]:
    """(BLOCK_M, BLOCK_N) score tiles each pointer kernel visits for n positions in the documents of
    cu_seqlens (entries clamped to n) with band L, from the kernels' loop bounds: the forward and dq
    kernels scan, for query tile m0, the key tiles from ⌊max(dstart(m0), ⌊m0/L⌋·L − L, 0)/BLOCK_N⌋·BLOCK_N
    up to the tile's diagonal; the dk kernel, for key tile n0, the query tiles from n0 up to
    min(dend(its last key), (⌊last key/L⌋ + 2)·L, n). Every tile is computed whole, valid pairs or not."""
    cu = [min(int(c), n) for c in cu_seqlens]

    def bounds(i: int) -> tuple[int, int]:  # (dstart, dend) of position i: the entries around it
        d = bisect.bisect_right(cu, i)
        return (cu[d - 1] if d else 0), (cu[d] if d < len(cu) else n)

    query = key = 0
    for m0 in range(0, n, block_m):
        lo = max(bounds(m0)[0], (m0 // band) * band - band, 0)
        query += len(range(lo // block_n * block_n, min(m0 + block_m, n) - 1, block_n))
    for n0 in range(0, n, block_n):
        last = min(n0 + block_n, n) - 1
        key += len(range(n0, min(bounds(last)[1], (last // band + 2) * band, n), block_m))
    return {"forward": query, "dq": query, "dk": key}


class _PointerLaunch:
    """A stand-in for one of the pointer's Triton kernels (`kernel[grid](*args, **meta)`): computes
    nothing; with a counter, counts the launch as the GPU runs it, at the "cuda" tiles
    (perf.kernels.copy_pointer.TILES), whatever tiles the caller picked for its device: the tiles it
    visits (`pointer_tiles`, over the host batch's segments), 2·BLOCK_M·BLOCK_N·BLOCK_D FLOPs per tile
    product, and every tensor argument read once, its outputs written once (as the attention is priced)."""

    def __init__(self, part: str, products: int, outputs: int, counter, host_cu_seqlens, totals):
        self.part, self.products, self.outputs = part, products, outputs
        self.counter, self.cu, self.totals = counter, host_cu_seqlens, totals

    def __getitem__(self, grid):
        return self.launch

    def launch(self, *args, **meta) -> None:
        from perf.kernels.copy_pointer import TILES

        if self.counter is None:
            return
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        n, band = (a for a in args if isinstance(a, int) and not isinstance(a, bool))  # N, L
        bm, bn = TILES["cuda"]["BLOCK_M"], TILES["cuda"]["BLOCK_N"]
        tiles = pointer_tiles(self.cu, n, band, bm, bn)[self.part]
        flops = self.products * 2 * bm * bn * meta["BLOCK_D"] * tiles
        reads, writes = tensors[:-self.outputs], tensors[-self.outputs:]
        self.counter.external("attention", flops, reads, writes)
        self.counter.flops["attention recompute"] += flops // self.products * (self.products - 1)
        for key, value in (("tiles", tiles), ("flops", flops), ("bytes", sum(map(footprint, tensors)))):
            self.totals[key][self.part] += value


@contextlib.contextmanager
def pointer_kernels(counter: FlopCounter | None, host_cu_seqlens=None, totals=None):
    """CPLM's pointer (model/cplm.py) as the fast path runs it: `copy_pointer_triton` (its torch side as
    it is: the sink score, the document bounds, the autograd Function and what it saves) with its three
    launches replaced by `_PointerLaunch`: counted into `counter` (and `totals`: tiles, FLOPs, bytes by
    kernel) over the segments of host_cu_seqlens, or, counter None, skipped (the memory tool). Without it
    the portable path would run the dense definition, [⌈N/L⌉, L, 2L] fp32 scores."""
    import model.cplm
    from perf.kernels import copy_pointer as kernels

    totals = totals if totals is not None else {part: collections.Counter() for part in ("tiles", "flops", "bytes")}
    dense = (kernels.copy_pointer_portable, kernels.copy_pointer)
    with contextlib.ExitStack() as stack:
        for name, value in list(vars(model.cplm).items()):
            if any(value is f for f in dense):
                stack.enter_context(mock.patch.object(model.cplm, name, kernels.copy_pointer_triton))
        stack.enter_context(mock.patch.object(kernels, "copy_pointer", kernels.copy_pointer_triton))
        for name, part, products, outputs in POINTER_KERNELS:
            stack.enter_context(mock.patch.object(
                kernels, name, _PointerLaunch(part, products, outputs, counter, host_cu_seqlens, totals)))
        yield totals


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
    # features.doc_copy: the matcher's own memory-bound bytes per process and step, by BYTE_KINDS (its
    # stable sort of 10·T int64 keys and the prefix scans are "other"; its scatters and gathers, "gather
    # and scatter"), counted inside `traffic` too; None without the feature
    matcher: dict[str, int] | None = None
    # features.cplm: the pointer's three Triton launches per process and step (`pointer_kernels`): the 64×64
    # score tiles each visits, its FLOPs and its bytes, by kernel ("forward", "dq", "dk"), counted inside
    # `flops` and `traffic` too (as "attention"); None without the feature
    pointer: dict[str, dict[str, int]] | None = None

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
    if settings.attention_mode == 1:  # PR #371's two calibration steps: priced as the stock step (their eager
        settings = dataclasses.replace(settings, attention_mode=0)  # measurement is not counted)
    step = meta_step(rank, settings, steps)
    counter = FlopCounter()
    attention = CountedAttention(counter, step.host_batch.cu_seqlens.tolist())
    matcher = FlopCounter()  # DocCopy's matcher alone: its ops reach `counter` too (the modes nest)
    pointer = {part: collections.Counter() for part in ("tiles", "flops", "bytes")}  # CPLM's kernels alone
    # PR #371's mode 2 at the windows its certify run 01 chose (the tables' values are the run's own)
    calibration = rank.run.calibration
    restricted = mock.patch.object(model_attention, "restricted_backward_attention", CountedRestrictedAttention(
        counter, attention.cu, calibration.tables, PR_371_RUN_01_WINDOWS)) if calibration is not None \
        else contextlib.nullcontext()
    with torch.device("meta"), use_backend(**PORTABLE_BACKEND), \
            mock.patch.object(model_attention, "varlen_attention", attention), fused_kernels(counter), counter, \
            counted_matcher(matcher), pointer_kernels(counter, attention.cu, pointer), restricted:
        loss = step.forward(rank.model)
        loss.backward()
    rank.model.zero_grad(set_to_none=True)
    T, A = step.tokens, rank.accum
    # outside the counted forward and backward, estimated: the n-gram rows pulled into the sink (2T
    # bf16 rows read from the table shard and written) and their fp32 gradients merged at the table
    # event (written, read back); features.ngram off: no rows
    hbm = {"n-gram row pull and gradient merge (estimate)": 2 * T * D * (2 + 2 + 4 + 4) * A} if cfg.features.ngram else {}
    return GeometryCost(settings, steps, T, A, {k: counter.flops[k] * A for k in (*KINDS, "attention recompute")},
                        hbm, Traffic.of(counter, A), step_parameters(rank.model, settings.softmax_p),
                        {k: matcher.bytes[k] * A for k in BYTE_KINDS} if cfg.features.doc_copy else None,
                        {part: {k: v * A for k, v in c.items()} for part, c in pointer.items()} if cfg.features.cplm
                        else None)


@contextlib.contextmanager
def counted_matcher(counter: FlopCounter):
    """DocCopy's matcher (model/doc_copy.py, as model/gpt.py calls it) run under `counter` as well."""
    import model.gpt

    matcher = model.gpt.doc_copy_features

    def counted(*args):
        with counter:
            return matcher(*args)

    with mock.patch.object(model.gpt, "doc_copy_features", counted):
        yield


def count_geometries(cfg: RunConfig, world_size: int, progress=None) -> list[GeometryCost]:
    """One forward and backward per geometry of the schedule, for one rank of `world_size`
    processes; `progress` gets a line per geometry counted."""
    rank = build_rank_on_meta(cfg, world_size)
    each = each_with_progress(geometries(rank.schedule), lambda g: f"cost: geometry at step {g[0].step}", progress)
    return [geometry_cost(rank, s, steps) for s, steps in each]
