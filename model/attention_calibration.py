"""Which attention heads may take a shortened backward: the calibration of upstream PR #371 part 2.

PR #371 ("ApproximateBackward", frontier_approx_backward.md §4) runs the backward of five short-window
layers' attention with a per-head window (perf/windowed_backward.py defines it). The windows are chosen
once, from the exact gradients of two training steps:

    steps 592, 593 (mode 1)  the exact backward runs; the first PREFIX_LIMIT rows of q, k, v, O, dO, LSE
                             are snapshotted and, after the backward, measured (`CalibrationState.measure`):
        end      = complete_document_prefix(cu_seqlens)          whole documents only (a cut one would
                                                                 have another O and LSE than in the batch)
        X_ref    = the full-window backward on rows [0, end)     (the reference)
        X_w      = the backward with every head at min(w, W),    w ∈ CANDIDATE_WINDOWS
        e(w,X,h) = sqrt(Σ_{t<end,d} (X_w − X_ref)² / max(Σ_{t<end,d} X_ref², 1e-30)),  X ∈ (dQ, dK, dV)
                   kept as a running max over the two steps      `relative_errors`, [W, 3, H]
    step 593, after it       MAX over ranks (one all-reduce), E(w, h) = max over the three gradients, and
                             per head the cheapest window with E <= 0.2, cost ceil((128 + min(w, W))/block_m)
                             ("full" costs ceil((128 + W)/block_m) and has error 0; ties go to the smaller
                             error), written in place into the layer's int32 head table  `choose_windows`
    steps 594..1106 (mode 2) the restricted backward reads the tables

Everything here is plain torch on the device except the prefix cut (cu_seqlens read on the host, as
upstream does on steps 592-593 only) and `log_record`. The tables and the error maxima are persistent
buffers (`CalibrationState`): CUDA graphs captured in the warmup bake their addresses, so `reset()` and
`finish()` write them in place.

Rows, heads and windows are FA3's (stream) ones: on the paired layers 0, 2, 5 the snapshot's rows are
interleaved positions of [2T, 3, d] (8192 rows ≈ 4096 tokens, w = 64 ≈ 32 tokens), cu_seqlens doubled,
and the table has 3 entries (perf/windowed_backward.py, "paired").

Run the tests: pytest tests/model/test_model_attention_calibration.py -q
"""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from perf.windowed_backward import (FULL_WINDOW_CODE, AttentionSnapshot, varlen_attention_lse,
                                    windowed_attention_backward, windowed_attention_backward_fast)

# PR #371 (approx_backward/, records/track_1_short/2026-09-24_ApproximateBackward/source/approx_backward/
# attention.py; hard-wired there, frontier_approx_backward.md §2, §6)
CALIBRATION_STEPS = (592, 593)  # PR #371: mode 1, the exact backward measured (stage 1, W = 384)
RESTRICTED_STEPS = (594, 1107)  # PR #371: mode 2 on [594, 1107); from 1107 the stock backward again
PREFIX_LIMIT = 8192  # PR #371: rows of the snapshot (FA3 rows: interleaved positions on paired layers)
CANDIDATE_WINDOWS = (64, 128, 256)  # PR #371: the shortened windows tried, ascending
ERROR_THRESHOLD = 0.2  # PR #371: the largest relative gradient error a shortened head may have
ERROR_FLOOR = 1e-30  # PR #371: the denominator's floor, so an all-zero reference gives a finite error
KEY_TILE = 128  # PR #371: FA3's backward key tile on both specializations, the 128 of the cost
GRADIENTS = ("dq", "dk", "dv")  # the middle axis of every [W, 3, H] error tensor


@dataclass(frozen=True)
class EligibleLayer:
    """A layer whose attention backward may be shortened, in FA3's view (frontier_approx_backward.md §4.1)."""
    heads: int  # FA3 (stream) heads: 3 on the paired layers, whose [T, 6, d] is [2T, 3, d]
    block_m: int  # query rows per tile of the FA3 backward specialization this layer runs
    paired: bool


# PR #371: layers 0, 2, 5 (paired, d_qk 64 / d_v 128: 64×128 tiles) and 1, 8 (d 64 / 64: 128×128 tiles);
# layers 3 and 10 (long window, d_qk 128) are never touched. 21 (layer, head) pairs in all.
ELIGIBLE_LAYERS: dict[int, EligibleLayer] = {
    0: EligibleLayer(heads=3, block_m=64, paired=True),
    1: EligibleLayer(heads=6, block_m=128, paired=False),
    2: EligibleLayer(heads=3, block_m=64, paired=True),
    5: EligibleLayer(heads=3, block_m=64, paired=True),
    8: EligibleLayer(heads=6, block_m=128, paired=False),
}


# PR #371's certify run 01 (frontier_approx_backward.md §4.3, "typical outcome"): the codes per FA3 head
# (−1 = full). The cost model prices the restricted steps at these (runtime/op_count.py): a stated
# assumption, since a run's own are known only after its step 593
PR_371_RUN_01_WINDOWS = {0: (128, 64, 256), 1: (-1, -1, 128, 128, -1, 256), 2: (64, 64, 256),
                         5: (64, 256, 128), 8: (256, 256, -1, 256, -1, 128)}


def eligible_layers(num_heads: int) -> dict[int, EligibleLayer]:
    """ELIGIBLE_LAYERS for a model of `num_heads` heads per layer (record #360: 6; the smoke preset's too):
    FA3 heads num_heads / 2 on the paired layers, num_heads on the others; tiles as the record's."""
    return {layer: EligibleLayer(num_heads // 2 if spec.paired else num_heads, spec.block_m, spec.paired)
            for layer, spec in ELIGIBLE_LAYERS.items()}


def attention_backward_mode(step: int, enabled: bool = True) -> int:
    """PR #371's mode(step): 0 the stock backward, 1 calibration (exact backward + snapshot), 2 restricted."""
    if not enabled:
        return 0
    if step in CALIBRATION_STEPS:
        return 1
    return 2 if RESTRICTED_STEPS[0] <= step < RESTRICTED_STEPS[1] else 0


def complete_document_prefix(cu_seqlens_host: Sequence[int], limit: int = PREFIX_LIMIT) -> int:
    """The end of the longest run of whole documents within the first `limit` rows.

    Padding duplicates are removed, offsets above `limit` dropped, and the last remaining offset is the
    end: a document crossing row `limit` is left out, so the prefix's O and LSE are the batch's (attention
    never crosses a segment). 0 when the first document crosses the limit (nothing to measure).
    """
    kept = [c for c in sorted({int(c) for c in cu_seqlens_host}) if c <= limit]  # padding repeats n
    return kept[-1] if kept else 0


def relative_errors(grads_by_window: Sequence[Sequence[Tensor]], reference: Sequence[Tensor], end: int) -> Tensor:
    """e(w, X, h) = sqrt(Σ_{t<end,d} (X_w − X_ref)² / max(Σ_{t<end,d} X_ref², 1e-30)): fp32 [W, 3, H].

    grads_by_window: W triples (dq, dk, dv), each [n, H, d] (stream layout, any float dtype); reference:
    the full-window triple. Only rows t < end count.
    """
    errors = []
    for grads in grads_by_window:
        per_grad = []
        for x, ref in zip(grads, reference, strict=True):
            ref = ref[:end].float()
            diff = x[:end].float() - ref
            per_grad.append(diff.square().sum((0, 2)) / ref.square().sum((0, 2)).clamp_min(ERROR_FLOOR))  # (H,)
        errors.append(torch.stack(per_grad).sqrt())  # (3, H)
    return torch.stack(errors)  # (W, 3, H)


def backward_cost(window: int | None, full_window: int, block_m: int, key_tile: int = KEY_TILE) -> int:
    """Query tiles a key tile visits: ceil((key_tile + w_eff)/block_m), w_eff = min(window, W); None or a
    negative code is "full" (w_eff = W). PR #371's proxy for the backward's work per head."""
    w_eff = full_window if window is None or window < 0 else min(window, full_window)
    return -(-(key_tile + w_eff) // block_m)


def choose_windows(errors: Tensor, candidates: Sequence[int] = CANDIDATE_WINDOWS, *, full_window: int,
                   block_m: int, threshold: float = ERROR_THRESHOLD) -> Tensor:
    """Per head, the code of the cheapest window whose error passes: int32 [H] on errors' device, −1 = full.

    errors [W, 3, H], already MAX-reduced over ranks and steps. E(w, h) = max over the three gradients;
    the options are "full" (error 0, always allowed) and each candidate with E <= threshold (a NaN error
    fails). The lowest `backward_cost` wins, ties to the smaller error, then to the earlier option (full
    first, then the candidates in order): a window >= W costs what full costs and never beats it.
    Device ops only, no host read.
    """
    if errors.dim() != 3 or errors.shape[:2] != (len(candidates), len(GRADIENTS)):
        raise ValueError(f"choose_windows: errors [{len(candidates)}, 3, H] expected, got {tuple(errors.shape)}")
    worst = errors.float().amax(dim=1)  # (W, H): E(w, h)
    options = torch.cat([torch.zeros_like(worst[:1]), worst])  # (1 + W, H): full first
    costs = torch.tensor([backward_cost(None, full_window, block_m)]
                         + [backward_cost(w, full_window, block_m) for w in candidates],
                         dtype=torch.float32, device=errors.device)[:, None]  # (1 + W, 1)
    allowed = options <= threshold
    allowed[0] = True
    cost = torch.where(allowed, costs, float("inf"))  # (1 + W, H)
    cheapest = cost == cost.amin(dim=0, keepdim=True)
    choice = torch.where(cheapest, options, float("inf")).argmin(dim=0)  # (H,): the first smallest error
    codes = torch.tensor([FULL_WINDOW_CODE, *candidates], dtype=torch.int32, device=errors.device)
    return codes[choice]


Backward = Callable[..., tuple[Tensor, Tensor, Tensor]]  # windowed_attention_backward's signature


class CalibrationState:
    """The persistent buffers of the calibration, per eligible layer, on one device.

    tables[layer]   int32 [H], −1 = full: the restricted backward's head windows (its graphs bake them)
    errors[layer]   fp32 [W, 3, H]: running max of `relative_errors` over the calibration steps; views of
                    one storage with one "measured" flag per layer, so `finish` is one all-reduce

    measure (steps 592, 593) → finish (after 593's measurement) → the tables hold the codes. reset() (after
    the warmup) refills everything in place: −1, zeros, no measurement.
    """

    def __init__(self, layers: Mapping[int, EligibleLayer] = ELIGIBLE_LAYERS,
                 candidates: Sequence[int] = CANDIDATE_WINDOWS, threshold: float = ERROR_THRESHOLD,
                 device: torch.device | str = "cpu", limit: int = PREFIX_LIMIT):
        if list(candidates) != sorted(set(candidates)):
            raise ValueError(f"CalibrationState: candidates must be distinct and ascending, got {candidates}")
        self.layers, self.candidates, self.threshold = dict(layers), tuple(candidates), threshold
        self.limit = limit
        # what the mode-1 forward and backward leave per layer (perf/windowed_backward.py snapshot_attention)
        self.snapshots = {layer: AttentionSnapshot(limit) for layer in self.layers}
        W = len(self.candidates)
        sizes = [W * len(GRADIENTS) * spec.heads for spec in self.layers.values()]
        # [errors of every layer | one measured flag per layer]: MAX-reduced together
        self._storage = torch.zeros(sum(sizes) + len(self.layers), dtype=torch.float32, device=device)
        self.errors: dict[int, Tensor] = {}
        self._measured: dict[int, Tensor] = {}
        offset = 0
        for (layer, spec), size in zip(self.layers.items(), sizes):
            self.errors[layer] = self._storage[offset:offset + size].view(W, len(GRADIENTS), spec.heads)
            offset += size
        for i, layer in enumerate(self.layers):
            self._measured[layer] = self._storage[offset + i:offset + i + 1]  # (1,): 1 once a prefix was measured
        self.tables = {layer: torch.full((spec.heads,), FULL_WINDOW_CODE, dtype=torch.int32, device=device)
                       for layer, spec in self.layers.items()}
        self.windows: dict[int, int] = {}  # the full window W each layer was measured at (host)
        self.ends: dict[int, list[int]] = {layer: [] for layer in self.layers}  # per measurement (host, the log)

    def reset(self) -> None:
        """Back to the start, in place: every head full, no error, nothing measured (storages kept)."""
        for table in self.tables.values():
            table.fill_(FULL_WINDOW_CODE)
        self._storage.zero_()
        self.windows.clear()
        for ends in self.ends.values():
            ends.clear()
        for snapshot in self.snapshots.values():
            snapshot.clear()

    def measure_snapshots(self, backward: Backward = windowed_attention_backward_fast) -> None:
        """After a mode-1 backward: measure every layer's snapshot (`measure`), then drop it. The LSE is
        recomputed over the snapshot's rows (`varlen_attention_lse`): a row's keys all lie before it, so
        the prefix's LSE is the batch's. Reads cu_seqlens on the host (a sync: steps 592-593 only)."""
        for layer, snapshot in self.snapshots.items():
            if not snapshot.complete:
                raise RuntimeError(f"CalibrationState.measure_snapshots: layer {layer}'s snapshot is incomplete "
                                   f"(its mode-1 forward or backward did not run)")
            lse = varlen_attention_lse(snapshot.q, snapshot.k, snapshot.cu_seqlens, snapshot.scale, snapshot.window)
            cu_host = [int(c) for c in snapshot.cu_seqlens]  # (int() per entry: a read the CPU sync check sees too)
            self.measure(layer, snapshot.q, snapshot.k, snapshot.v, snapshot.out, lse, snapshot.d_out,
                         cu_host, snapshot.scale, snapshot.window, backward, self.limit)
            snapshot.clear()

    def record(self, layer: int, errors: Tensor | None, end: int, window: int) -> None:
        """Fold one step's [W, 3, H] errors into the layer's running max. end = 0 (errors None): an empty
        prefix measured nothing, and zeros must not pass for a clean bill; a layer no rank measured stays full."""
        self.windows[layer] = window
        self.ends[layer].append(end)
        if end > 0:
            torch.maximum(self.errors[layer], errors.to(self.errors[layer]), out=self.errors[layer])
            self._measured[layer].fill_(1.0)

    def measure(self, layer: int, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, d_out: Tensor,
                cu_seqlens_host: Sequence[int], scale: float, window: int,
                backward: Backward = windowed_attention_backward, limit: int = PREFIX_LIMIT) -> int:
        """Measure one layer's snapshot (stream layout, the first rows of the batch; lse [H, n]) and
        record it; returns the prefix end. cu_seqlens_host: the batch's offsets (stream positions, padding
        included), read on the host. `backward` runs the reference (every head −1) and each candidate
        (every head w): the portable one by default; the fast path passes its own (upstream: the stock FA3
        backward for the reference, the patched one for the candidates)."""
        end = complete_document_prefix(cu_seqlens_host, min(limit, q.shape[0]))
        if end == 0:
            self.record(layer, None, 0, window)
            return 0
        heads = self.layers[layer].heads
        cu = torch.tensor([c for c in sorted({int(c) for c in cu_seqlens_host}) if c <= end],
                          dtype=torch.int32, device=q.device)  # the prefix's documents, ending at `end`
        rows = (q[:end], k[:end], v[:end], out[:end], lse[:, :end].contiguous(), d_out[:end])  # FA3 wants lse dense

        def run(code: int):
            table = torch.full((heads,), code, dtype=torch.int32, device=q.device)
            return backward(*rows, cu, scale, window, table)

        reference = run(FULL_WINDOW_CODE)
        errors = relative_errors([run(w) for w in self.candidates], reference, end)
        self.record(layer, errors, end, window)
        return end

    def finish(self, process_group=None) -> None:
        """MAX over ranks (torch.distributed, when initialized), the choice per layer, the codes copied
        into the tables in place. Every rank ends with the same tables. A layer no rank measured stays full."""
        missing = [layer for layer in self.layers if layer not in self.windows]
        if missing:
            raise RuntimeError(f"CalibrationState.finish: layers {missing} were never measured on this rank")
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(self._storage, op=dist.ReduceOp.MAX, group=process_group)
        for layer, spec in self.layers.items():
            codes = choose_windows(self.errors[layer], self.candidates, full_window=self.windows[layer],
                                   block_m=spec.block_m, threshold=self.threshold)
            codes = torch.where(self._measured[layer] > 0, codes, FULL_WINDOW_CODE)
            self.tables[layer].copy_(codes)

    def log_lines(self, ranks: int) -> list[str]:
        """The log's lines after the choice: one per layer, its windows per head (full = the launch
        window), the error E of each chosen window with the gradient that binds it, the prefix rows."""
        record = self.log_record()
        lines = [f"attention backward (PR #371): windows chosen from {len(next(iter(self.ends.values())))} "
                 f"snapshot(s) per layer on this process (calibration steps × the ranks it plays), the largest "
                 f"relative dQ/dK/dV error over {ranks} rank(s) at most {self.threshold}"]
        for layer, entry in record["layers"].items():
            windows = ", ".join("full" if w < 0 else str(w) for w in entry["windows"])
            errors = ", ".join("-" if b is None else f"{e:.3f} {b}" for e, b in zip(entry["errors"], entry["binding"]))
            lines.append(f"attention backward: layer {layer} (W {entry['window']}): windows {windows}; "
                         f"errors {errors}; prefix rows {entry['ends']}"
                         + ("" if entry["measured"] else " (no complete document in any rank's prefix: full)"))
        return lines

    def log_record(self) -> dict:
        """A JSON-able record for the run's log (reads the device: after `finish`, on steps 592-593 only).

        Per layer: the window code per head (−1 = full), the error E of the chosen window per head
        (0 for full) and the gradient that binds it, E(w, h) for every candidate, and the prefix ends."""
        record = {"candidates": list(self.candidates), "threshold": self.threshold, "layers": {}}
        for layer in self.layers:
            errors = self.errors[layer].float().cpu()  # (W, 3, H)
            worst, binding = errors.max(dim=1)  # (W, H)
            codes = self.tables[layer].cpu().tolist()
            chosen = [self.candidates.index(c) if c >= 0 else None for c in codes]
            record["layers"][str(layer)] = {
                "windows": codes,
                "window": self.windows.get(layer),
                "errors": [0.0 if i is None else round(float(worst[i, h]), 6) for h, i in enumerate(chosen)],
                "binding": [None if i is None else GRADIENTS[int(binding[i, h])] for h, i in enumerate(chosen)],
                "candidate_errors": {str(w): [round(float(e), 6) for e in worst[i]]
                                     for i, w in enumerate(self.candidates)},
                "measured": bool(self._measured[layer].item()),
                "ends": list(self.ends[layer]),
            }
        return record
