"""PR #371 part 1 (ApproximateBackward, romeerp): the sampled LM-head weight gradient of the
sampled-softmax fp8 tail (upstream: records/track_1_short/2026-09-24_ApproximateBackward/source/
approx_backward/, the head part; frontier_approx_backward.md §3, §5, §7).

Record #360's backward computes dW_C = x_s·g_s·X ᵀ·G over all T rows (X = x8 [T, D] e4m3 codes,
G = g8 [T, N] e5m2 codes of the CE's logit gradient, N the candidate set's width). #371 keeps one row
of every group of `group` = 4 consecutive rows (stratified, no torch RNG, §3.3),

    s_j = group·j + (h(j, c) mod group),   j = 0 … T/group − 1,

with c a device counter and h a counter-keyed 32-bit hash (all arithmetic mod 2³²):
    a = (c + 72821)·0x9E3779B9;  z = j XOR a;  z = (z XOR z >> 16)·0x85EBCA6B;
    z = (z XOR z >> 13)·0xC2B2AE35;  h = z XOR z >> 16,
and estimates dWᵀ column by column (§3.4):

    dWᵀ[v, :] = group·g_s·x_s·Σ_j max(G[s_j, v], 0)·X[s_j, :]                  (positive part, sampled)
              + g_s·x_s·Σ_r Σ_{c ∈ N(r), c = v} min(G[r, c], 0)·X[r, :]           (negative part, exact)

N(r) is row r's set of distinct target columns: targets[r + q] for q < num_mtp with r + q < T, the
prefix target prefix_targets[r] when ≥ 0, and (ours, beyond the PR) gather_cols[r, m]: CPLM's
`<copy>` column, like any gathered z, carries a gradient of either sign (perf/kernels/
cross_entropy.py, "The gathered z"), so the gathered columns belong to the exact negative set too. A column equal to
an earlier one of the same row is counted once (MTP targets in q order, then the prefix, then the
gathered columns in m order).

Why the negatives need only those columns: the CE's logit gradient is (S_t·softmax_c − Σ w·[c is a
target of row t] + Σ_m g_zg·[c = gather_cols[t, m]] + g_lse_t·softmax_c)·(23/7.5)·σ(1 − σ)·g, and
every term outside the targets and gathered columns is ≥ 0 when g ≥ 0 and g_lse ≥ 0 (a training
step has g = 1; an lse that enters a loss as a log-partition has g_lse ≥ 0; CPLM's mixture NLL
does). Under that precondition G = max(G, 0) + min(G, 0) splits exactly, the estimate is unbiased
over the choice inside each group (E[group·max(G[s_j], 0)] = Σ_group max(G, 0)), and only the
positive part has variance. A loss term with g_lse < 0 would put negatives outside N(r), which the
positive part clamps away: a bias, not an error this op can see.

Numerics. Positive part: the kept rows' max(G, 0) (still exact e5m2 codes: the sign bit cleared, an
integer select on the bytes) and X rows, one `_scaled_mm` (e5m2 × e4m3, scale_a = group·g_s, scale_b =
x_s, no fast accumulation, fp32 out [N, D]), contraction T/group instead of T. Negative part: every
product of an e4m3 code and an e5m2 code has ≤ 7 significant bits, so G[r, c]·X[r, :] is exact in fp32;
those products are summed into row c of an fp32 [N, D] buffer by `index_add_` (on a GPU fp32 atomics:
the order, and so the last bits, are nondeterministic, as in the PR), then scaled once by g_s·x_s.
The PR scales each contribution before its atomic add; ours rounds once less and, when the code sums
are exact, equals the dense x8ᵀ·min(G, 0) bit for bit. One final cast of the fp32 sum to the
lm_head's dtype, transposed to the [D, N] the densify step expects: the only low-precision rounding,
as in #360. dx is untouched (perf/fp8.py computes it from the full g8 as before).

Why plain torch (§7: "a plain-PyTorch version on the GPU works too"): the work is two gathers, an
integer select, one `_scaled_mm` through perf.fp8's opaque `scaled_mm` op, and a few `index_add_`s:
static shapes, no host read (the counter never leaves the device), so it traces under
torch.compile(fullgraph=True), captures in a CUDA graph, and needs no Triton twin. The counter
advances in place at the end (`HeadSample.advance`), inside the backward: under AOT autograd that is
a data mutation of a forward input in the backward, which it keeps in the graph, so every replay of
a captured backward advances it (§5).

Per-rank state: one HeadSample per rank, virtual ranks included (docs/one_gpu.md): counter =
rank at start and after the post-warmup reset, stride = world size, so rank r's k-th call uses
c = r + k·world_size and no two ranks share a counter value (§3.3).

The run's switch (HEAD_SAMPLE_GROUP, the T ≥ 32,768 row gate, steps 320–1106) is wired where the
model calls `fp8_lm_head_loss(..., head_sample=...)`; this module is the op.
Tests: pytest tests/perf/test_perf_sampled_head_grad.py -q
"""
from __future__ import annotations

import torch
from torch import Tensor

from perf.fp8 import E4M3, E5M2, scaled_mm

HEAD_SAMPLE_GROUP = 4  # PR #371: HEAD_SAMPLE_GROUP, one row kept out of every 4 (only 0 = off or 4 upstream)
NEG_SLAB_ROWS = 8192  # ours: rows per index_add_ of the negative part, bounding its fp32 [rows, D]
#                       product (8192 × 768 × 4 B = 25 MB) as the CE's slabs bound theirs

_MASK32 = 0xFFFFFFFF
# PR #371's hash constants (§3.3): a golden-ratio key of the counter, then murmur3's fmix32 finalizer
_SEED_OFFSET = 72821
_KEY_MUL = 0x9E3779B9
_FMIX_MUL1 = 0x85EBCA6B
_FMIX_MUL2 = 0xC2B2AE35


def _mul32(z: Tensor, const: int) -> Tensor:
    """(z·const) mod 2³² for int64 z in [0, 2³²), without int64 overflow: a full product can reach
    0xC2B2AE35·(2³² − 1) ≈ 1.4e19 > 2⁶³ − 1, so the constant goes in 16-bit halves (each partial
    product < 2⁴⁸) and only the low 16 bits of the high half's product matter after the shift."""
    lo, hi = const & 0xFFFF, const >> 16
    return (z * lo + (((z * hi) & 0xFFFF) << 16)) & _MASK32


def head_sample_rows(counter: Tensor, n_rows: int, group: int = HEAD_SAMPLE_GROUP) -> Tensor:
    """int64 [n_rows // group]: the kept row s_j = group·j + (h(j, c) mod group) of each group j of
    `group` consecutive rows, c = the 0-D int64 device counter (read on the device, never on the host).
    PR #371 §3.3; the hash in the module docstring, in int64 masked to 32 bits (no uint32 arithmetic)."""
    if n_rows % group:
        raise ValueError(f"head_sample_rows: {n_rows} rows are not a multiple of the group {group}: "
                         f"the sampled lm_head gradient keeps one row of every {group}")
    if counter.dim() != 0 or counter.dtype != torch.int64:
        raise ValueError(f"head_sample_rows: counter must be a 0-D int64 tensor, got {counter.dtype} "
                         f"{tuple(counter.shape)}")
    j = torch.arange(n_rows // group, dtype=torch.int64, device=counter.device)  # (T/g,)
    a = _mul32((counter + _SEED_OFFSET) & _MASK32, _KEY_MUL)  # 0-D
    z = j ^ a
    z = _mul32(z ^ (z >> 16), _FMIX_MUL1)
    z = _mul32(z ^ (z >> 13), _FMIX_MUL2)
    z = z ^ (z >> 16)
    return j * group + z % group  # (T/g,)


class HeadSample:
    """One rank's row-sampling state for PR #371's lm_head dW: the device counter (0-D int64, = rank
    at start and after `reset`), the stride it advances by per call (the world size, virtual ranks
    included) and the group (4).

    The counter is persistent: `reset` refills it and `advance` adds to it in place (same storage),
    so a captured graph that reads or advances it stays valid."""

    def __init__(self, rank: int, world_size: int, device: torch.device | str = "cpu",
                 group: int = HEAD_SAMPLE_GROUP):
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"HeadSample: rank {rank} must be in [0, world_size = {world_size})")
        if group < 1:
            raise ValueError(f"HeadSample: group must be >= 1, got {group}")
        self.rank, self.stride, self.group = rank, world_size, group
        self.counter = torch.full((), rank, dtype=torch.int64, device=device)  # a fill: no host copy

    def reset(self, rank: int | None = None) -> None:
        """Refill the counter with `rank` (default: this sampler's rank) in place (the post-warmup reset)."""
        self.counter.fill_(self.rank if rank is None else rank)

    def advance(self) -> None:
        """counter += stride, in place on the device (once per sampled dW, inside the backward)."""
        self.counter.add_(self.stride)

    def rows(self, n_rows: int) -> Tensor:
        """The kept rows for the current counter: `head_sample_rows(counter, n_rows, group)`."""
        return head_sample_rows(self.counter, n_rows, self.group)

    def weight_grad(self, g8: Tensor, x8: Tensor, g_scale: Tensor, x_scale: Tensor, targets: Tensor, num_mtp: int,
                    prefix_targets: Tensor | None, gather_cols: Tensor | None, out_dtype: torch.dtype) -> Tensor:
        """`sampled_lm_head_weight_grad` with this sampler (the hook perf/fp8.py calls: it imports no
        module of its own that imports it back)."""
        return sampled_lm_head_weight_grad(g8, x8, g_scale, x_scale, targets, num_mtp, prefix_targets, gather_cols,
                                           self, out_dtype)


def _check(g8: Tensor, x8: Tensor, targets: Tensor, prefix_targets: Tensor | None, gather_cols: Tensor | None,
           name: str) -> None:
    if g8.dim() != 2 or g8.dtype != E5M2 or x8.dim() != 2 or x8.dtype != E4M3 or x8.shape[0] != g8.shape[0]:
        raise ValueError(f"{name}: g8 must be e5m2 [T, N] and x8 e4m3 [T, D], got {g8.dtype} {tuple(g8.shape)} "
                         f"and {x8.dtype} {tuple(x8.shape)}")
    T = g8.shape[0]
    if targets.shape != (T,) or (prefix_targets is not None and prefix_targets.shape != (T,)):
        raise ValueError(f"{name}: targets and prefix_targets must be [T] = [{T}]")
    if gather_cols is not None and (gather_cols.dim() != 2 or gather_cols.shape[0] != T):
        raise ValueError(f"{name}: gather_cols must be [T, M] with T = {T}, got {tuple(gather_cols.shape)}")


def _target_slots(targets: Tensor, num_mtp: int, prefix_targets: Tensor | None, gather_cols: Tensor | None,
                  N: int) -> tuple[Tensor, Tensor]:
    """(cols, live), each [T, S]: row r's candidate-negative columns N(r) as S static slots (the MTP
    targets targets[r + q], q < num_mtp, then the prefix target, then the gathered columns) and
    whether the slot counts: inside [0, N) (past the end, −1 and −100 are out) and not equal to an
    earlier slot of the same row (a duplicate is counted once)."""
    T = targets.shape[0]
    slots = [torch.cat([targets[q:], targets.new_full((min(q, T),), -1)]) for q in range(num_mtp)]  # (T,) each
    if prefix_targets is not None:
        slots.append(prefix_targets)
    if gather_cols is not None:
        slots.extend(gather_cols.unbind(1))
    cols = torch.stack([s.long() for s in slots], dim=1)  # (T, S)
    live = (cols >= 0) & (cols < N)
    for k in range(1, cols.shape[1]):  # S ≤ 6: pairwise compares, static
        earlier = (cols[:, :k] == cols[:, k:k + 1]).any(dim=1)  # (T,)
        live[:, k] &= ~earlier
    return cols, live


def head_grad_negative_part(g8: Tensor, x8: Tensor, g_scale: Tensor, x_scale: Tensor, targets: Tensor,
                            num_mtp: int, prefix_targets: Tensor | None = None,
                            gather_cols: Tensor | None = None) -> Tensor:
    """fp32 [N, D]: g_s·x_s·Σ_r Σ_{c ∈ N(r)} min(G[r, c], 0)·X[r, :] into row c (the exact negative part,
    every row, no sampling). Code-unit products are exact in fp32; they are summed by `index_add_` and
    scaled once at the end."""
    _check(g8, x8, targets, prefix_targets, gather_cols, "head_grad_negative_part")
    T, N = g8.shape
    D = x8.shape[1]
    cols, live = _target_slots(targets, num_mtp, prefix_targets, gather_cols, N)  # (T, S) each
    safe = torch.where(live, cols, 0)  # a dead slot reads column 0 and adds nothing
    vals = g8.view(torch.uint8).gather(1, safe).view(E5M2).float()  # (T, S) G codes at the slots
    neg = torch.where(live & (vals < 0), vals, 0.0)  # (T, S) min(G, 0) at the live slots
    # a dead slot adds a zero row; spread over the columns (r mod N) so GPU atomics do not pile onto one
    spread = (torch.arange(T, device=g8.device) % N)[:, None]  # (T, 1)
    dest = torch.where(live, cols, spread)  # (T, S)
    acc = torch.zeros((N, D), dtype=torch.float32, device=g8.device)  # (N, D) code units
    for lo in range(0, T, NEG_SLAB_ROWS):
        xs = x8[lo: lo + NEG_SLAB_ROWS].float()  # (rows, D), exact
        for k in range(cols.shape[1]):
            acc.index_add_(0, dest[lo: lo + NEG_SLAB_ROWS, k], xs * neg[lo: lo + NEG_SLAB_ROWS, k, None])
    return acc.mul_(g_scale.float() * x_scale.float())


def head_grad_positive_part(g8: Tensor, x8: Tensor, g_scale: Tensor, x_scale: Tensor, rows: Tensor,
                            group: int) -> Tensor:
    """fp32 [N, D]: group·g_s·x_s·Σ_j max(G[s_j], 0)ᵀ·X[s_j] over the kept rows s_j (`rows`, [T/group]),
    one e5m2 × e4m3 `_scaled_mm` without fast accumulation (a gradient GEMM, perf/fp8.py `scaled_mm`)."""
    kept = g8.view(torch.uint8).index_select(0, rows)  # (T/g, N) e5m2 bytes
    pos8 = torch.where(kept >= 0x80, 0, kept).view(E5M2)  # max(G, 0): the sign bit clears to +0, exact
    x_kept = x8.index_select(0, rows)  # (T/g, D)
    scale_a = g_scale.float() * group  # exact for a power-of-two group
    return scaled_mm(pos8.t(), x_kept, scale_a, x_scale.float(), torch.float32, False)  # (N, D)


def sampled_lm_head_weight_grad(g8: Tensor, x8: Tensor, g_scale: Tensor, x_scale: Tensor, targets: Tensor,
                                num_mtp: int, prefix_targets: Tensor | None, gather_cols: Tensor | None,
                                sample: HeadSample, out_dtype: torch.dtype = torch.bfloat16) -> Tensor:
    """dW_cols [D, N] in out_dtype (a transposed view of an [N, D] buffer): PR #371's estimate of the
    lm_head weight gradient x_s·g_s·x8ᵀ·g8 over the N candidate columns (module docstring), then the
    sampler's counter advanced by its stride, on the device.

    g8 e5m2 [T, N] (true gradient g_scale·g8), x8 e4m3 [T, D] (true x_scale·x8), targets [T] and
    prefix_targets [T] (−1: none) as column positions, num_mtp ≥ 1, gather_cols int64 [T, M] or None;
    T must be a multiple of sample.group. Static shapes, no host sync; capturable."""
    _check(g8, x8, targets, prefix_targets, gather_cols, "sampled_lm_head_weight_grad")
    rows = sample.rows(g8.shape[0])  # (T/g,)  # PR #371 §3.3
    dw = head_grad_positive_part(g8, x8, g_scale, x_scale, rows, sample.group)  # (N, D) fp32  # PR #371 §3.4
    dw.add_(head_grad_negative_part(g8, x8, g_scale, x_scale, targets, num_mtp, prefix_targets, gather_cols))
    sample.advance()  # PR #371: after the dW work, inside the (captured) backward
    return dw.to(out_dtype).t()  # (D, N): one cast, then the densify step's layout
