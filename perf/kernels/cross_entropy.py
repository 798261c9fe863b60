"""The fused softcapped cross-entropy of record #360: loss, lse and logit gradient, lse differentiable,
and the softcapped logits at a few given columns per row, differentiable too.

The math is defined in model/loss.py (`softcap`, `softcapped_ce`: the softcap, lse and the per-row
terms). A kernel imports no model file (docs/design.md, "Import rules"), so this module restates it, and
tests/perf/test_perf_kernels_cross_entropy.py holds every twin and kernel here to that definition.
Per row t of the logits ℓ [T, N] (N = 50304 for the full softmax, or the sampled-softmax width P),
with the softcap z = 23·σ((ℓ + 5)/7.5) (record #360: track_1_short/perf/kernels/cross_entropy.py):
    L_t = Σ_k [t+k < T]·w_k·(lse_t − z_t[y_{t+k}]) + [p_t ≥ 0]·w_p·(lse_t − z_t[p_t]),  lse_t = ln Σ_c exp z_tc
where targets outside [0, N) are skipped. z ∈ (0, 23), so lse = 23 + ln Σ exp(z − 23) needs no
running max (the record's fixed-max LSE). Both Σ_t L_t and lse [T] are differentiable: with the
incoming gradients g (of Σ L) and g_lse [T] (of lse),
    ∂/∂z_c = g·(S_t·softmax(z_t)_c − Σ_k w_k·[y_{t+k} = c] − w_p·[p_t = c]) + g_lse_t·softmax(z_t)_c
    ∂z/∂ℓ = (23/7.5)·σ(1 − σ)
with S_t the total weight of the terms present on row t. The backward folds g_lse into per-row
scalars (`_lse_fold`: S_t → S_t + g_lse_t/g, the picks and g kept, or dropped and 1 when g = 0),
so the per-element work is the lse-free path's and a zero g_lse gives its numbers bit for bit.
That matters: torch.compile hands an unused output's gradient over as zeros (eager autograd as
None, which runs the lse-free launch, HAS_LSE_GRAD=False), so the compiled record, which has no
lse term, runs the HAS_LSE_GRAD launch with a zero g_lse: a [T] read more per backward.

The gathered z. Given gather_cols [T, M] (int64, M small and static), every path also returns
    zg [T, M] = z_t[gather_cols[t, m]]  (fp32; 0 where the column is outside [0, N)),
differentiable: its gradient g_zg [T, M] adds Σ_m g_zg[t, m]·[c = gather_cols[t, m]] to ∂/∂z_c above,
in the same backward launch. Why: a loss term that is a function of lse_t and a few z_t[c] (CPLM's
mixture NLL, PR #379: lse_t, z_t[y_t] and z_t[<copy>], with the CE's own next-token weight set to 0)
is then a line of torch in model/, with no kernel edit, exactly as a term in lse is
(docs/loss_terms.md). PR #379 ships the same idea as `SoftcapLSEGather` (frontier_cplm.md §9);
it writes its mixture into the CE kernel's text instead (§6), which is the kernel edit this
avoids. The fold is `_lse_fold`'s, with g_lse = 0 when only zg has a gradient: each gathered column
adds g_zg/g at its one element (M compares per element, like the picks), so the sweep's factor
g·(…)·σ(1 − σ)·23/7.5 gives g_zg there. A zero g_zg, or a column outside [0, N), leaves the element
untouched (a select, not a + 0, which would turn a −0 into +0), so the compiled graph's zero g_zg
gives the gather-free numbers bit for bit (for g ≠ 0; a training step has g = 1); a None g_zg runs
the gather-free launch (NUM_GATHER = 0).

Public functions (dispatched on `perf.backend.current().triton`):
    softcapped_loss_lse(logits, targets, mtp_weights, prefix_targets, prefix_weight, gather_cols=None)
        -> (Σ_t L_t, lse [T]), or (Σ_t L_t, lse [T], zg [T, M]) with gather_cols
        fp32/bf16 logits with autograd (the non-fp8 training path; model/loss.py): the forward
        launch writes the loss, lse (and zg), the backward launch recomputes σ from the saved logits
        and writes the gradient. `softcapped_loss_sum` is the same, loss alone.
    softcapped_ce_e4m3(logits8, targets, prefix_targets, weights, num_mtp, gather_cols=None)
        -> (Σ_t L_t, lse [T]), or (Σ_t L_t, lse [T], zg [T, M]) with gather_cols
    softcapped_ce_grad_e5m2(logits8, lse, targets, prefix_targets, weights, num_mtp, grad_out, grad_scale,
                            grad_lse=None, gather_cols=None, grad_zg=None)
        -> e5m2 [T, N] of ∂(grad_out·Σ L + Σ grad_lse·lse + Σ grad_zg·zg)/∂ℓ / grad_scale
        The fp8 training path (perf/fp8.py `fp8_lm_head_loss`, record #360's full-stack fp8): the
        lm_head GEMM writes e4m3 logits (1 byte per element), the forward reads them and keeps only
        them and lse [T]; the backward recomputes σ from them and writes the gradient straight in
        e5m2, the operand of the lm_head's gradient GEMMs. Nothing fp32 at [T, N] outlives a launch.
The portable twins (`*_portable`) restate model/loss.py's math in the kernels' operation order; the
`*_triton` functions are the kernels.

Differences from the record's CUDA kernel, on purpose: σ is recomputed from the e4m3 logits in the
backward (the record caches it in fp16: 2 bytes per element we do not keep), and S_t counts only the
MTP terms present on the last K−1 rows (the record sums every w_k there, a quirk on <= 2 rows per
rank). So the kernel is the gradient of exactly the loss it returns, like the twin.

Run the parity tests: pytest tests/perf/test_perf_kernels_cross_entropy.py -q (CPU, Triton interpreter).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from perf.backend import current

# model/loss.py's softcap constants, restated (a kernel imports no model file); a test holds them equal
SOFTCAP_A, SOFTCAP_B, SOFTCAP_C = 23.0, 5.0, 7.5  # record #360: z = 23·σ((ℓ + 5)/7.5)


E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
E5M2_MAX = torch.finfo(E5M2).max  # 57344
CE_SLAB_ROWS = 8192  # ours: rows per slab of the portable twins' fp32 [rows, N] temporaries (and the
#                      fp8 lm_head GEMM's fp32 output): 8192 × 50304 × 4 B = 1.6 GB at full vocabulary
GRAD_SLAB_ROWS = CE_SLAB_ROWS // 2  # ours: the bf16/fp32 twin's backward holds two fp32 slabs (σ and dz)
#                      beside the 2-byte gradient it writes: half the rows keep them at one CE slab's bytes


def _check_inputs(logits: Tensor, targets: Tensor, prefix_targets: Tensor | None,
                  dtypes=(torch.float32, torch.bfloat16), name: str = "softcapped_loss_sum") -> None:
    if logits.dim() != 2 or logits.dtype not in dtypes:
        allowed = " or ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise ValueError(f"{name}: logits must be {allowed} [T, N], got {logits.dtype} {tuple(logits.shape)}")
    T = logits.shape[0]
    if targets.shape != (T,):
        raise ValueError(f"{name}: targets must be [T] = [{T}], got {tuple(targets.shape)}")
    if prefix_targets is not None and prefix_targets.shape != (T,):
        raise ValueError(f"{name}: prefix_targets must be [T] = [{T}], got {tuple(prefix_targets.shape)}")


def _check_grad_lse(grad_lse: Tensor | None, T: int, name: str) -> None:
    if grad_lse is not None and grad_lse.shape != (T,):
        raise ValueError(f"{name}: grad_lse must be [T] = [{T}], got {tuple(grad_lse.shape)}")


def _check_gather(gather_cols: Tensor | None, grad_zg: Tensor | None, T: int, name: str) -> None:
    """gather_cols int64 [T, M]; grad_zg (the backward's) [T, M] and only with gather_cols."""
    if gather_cols is not None and (gather_cols.dim() != 2 or gather_cols.shape[0] != T
                                    or gather_cols.dtype != torch.int64):
        raise ValueError(f"{name}: gather_cols must be int64 [T, M] with T = {T}, got {gather_cols.dtype} "
                         f"{tuple(gather_cols.shape)}")
    if grad_zg is not None:
        if gather_cols is None:
            raise ValueError(f"{name}: grad_zg needs the gather_cols it is the gradient at")
        if grad_zg.shape != gather_cols.shape:
            raise ValueError(f"{name}: grad_zg must be [T, M] = {list(gather_cols.shape)}, got {tuple(grad_zg.shape)}")


def _as_weight(w, device) -> Tensor:
    """A float or 0-D tensor weight as an fp32 0-D tensor on `device` (no host sync)."""
    if isinstance(w, Tensor):
        return w.to(device=device, dtype=torch.float32).reshape(())
    return torch.full((), float(w), dtype=torch.float32, device=device)  # a fill: no host copy


def _grad_or_zero(grad: Tensor | None, like: Tensor) -> Tensor:
    """The loss's incoming gradient, 0-D fp32; None (only lse was used) is a zero."""
    return like.new_zeros(()) if grad is None else grad.float().reshape(())


def _lse_fold(grad_out: Tensor, grad_lse: Tensor, row_weight: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """grad_lse folded into per-row scalars, so the per-element work stays the lse-free path's:
    (keep, S', g) with g = grad_out (1 where grad_out = 0), keep = [grad_out ≠ 0], S'_t = keep·S_t +
    grad_lse_t/g, and then g·(S'_t·softmax − keep·Σ w·[c = class]) = grad_out·(S_t·softmax − Σ w·[c =
    class]) + grad_lse_t·softmax. A zero grad_lse gives keep = 1 and S' = S: the lse-free numbers bit
    for bit. Twin of the kernels' `_lse_fold_rows`."""
    nonzero = grad_out != 0
    g = torch.where(nonzero, grad_out, 1.0)
    keep = nonzero.float()
    return keep, row_weight * keep + grad_lse.float() / g, g


def _gathered_z(logits: Tensor, gather_cols: Tensor) -> Tensor:
    """zg [T, M] fp32 = z[t, gather_cols[t, m]], 0 where the column is outside [0, N): the softcap of
    the gathered entries alone (T·M of them), in the kernels' operation order."""
    T, N = logits.shape
    inside = (gather_cols >= 0) & (gather_cols < N)  # (T, M)
    rows = torch.arange(T, device=logits.device)[:, None]  # (T, 1); indexing, since gather has no fp8 kernel
    picked = logits[rows, torch.where(inside, gather_cols, 0)]  # (T, M) in the logits' dtype
    return torch.where(inside, SOFTCAP_A * _softcap_sigma(picked), 0.0)


def _gather_fold(gather_cols: Tensor, grad_zg: Tensor, g: Tensor, N: int) -> tuple[Tensor, Tensor]:
    """grad_zg as per-row additions to dz (the twin of the kernels' `_gather_plus`): (cols, u), each
    [T, M], u = grad_zg/g, so that g·(dz + u at col) puts grad_zg on that z; cols −1 where the column
    is outside [0, N) or grad_zg = 0, which leaves the element untouched (a zero grad_zg: the
    gather-free numbers bit for bit)."""
    grad_zg = grad_zg.float()
    hit = (gather_cols >= 0) & (gather_cols < N) & (grad_zg != 0)
    return torch.where(hit, gather_cols, -1), grad_zg / g


def loss_weights(mtp_weights, prefix_weight, device) -> Tensor:
    """[w_0, .., w_{K-1}, w_p] as one fp32 [K + 1] tensor (w_p = 0 without a prefix term)."""
    if len(mtp_weights) == 0:
        raise ValueError("softcapped_loss_sum: mtp_weights needs at least the next-token weight")
    prefix_weight = 0.0 if prefix_weight is None else prefix_weight
    return torch.stack([_as_weight(w, device) for w in (*mtp_weights, prefix_weight)])


# ------------------------------------------------------------------------------------------------
# Portable twins: model/loss.py's math (`softcapped_ce`) restated in the kernels' operation order

class _SoftcappedLoss(torch.autograd.Function):
    """Σ_t L_t and lse [T] (and zg [T, M] with gather_cols) of logits [T, N] (fp32 or bf16) and their
    logit gradient, one slab of CE_SLAB_ROWS rows at a time: like the kernel, it keeps the logits
    themselves (2 bytes per element in bf16) and lse for the backward, which recomputes σ; the fp32
    [rows, N] temporaries live one slab at a time and the gradient is written in the logits' dtype."""

    @staticmethod
    def forward(ctx, logits: Tensor, targets: Tensor, prefix_targets: Tensor | None, weights: Tensor,
                num_mtp: int, gather_cols: Tensor | None) -> tuple[Tensor, ...]:
        ctx.set_materialize_grads(False)  # an unused lse (zg) arrives as None: the lse-free (gather-free) backward
        total, lse = _slabbed_loss_lse(logits, targets, prefix_targets, weights, num_mtp)
        ctx.save_for_backward(logits, lse, targets, prefix_targets, weights, gather_cols)
        ctx.num_mtp = num_mtp
        if gather_cols is None:
            return total, lse
        return total, lse, _gathered_z(logits, gather_cols)  # zg (T, M)

    @staticmethod
    def backward(ctx, grad_out: Tensor | None, grad_lse: Tensor | None, grad_zg: Tensor | None = None):
        logits, lse, targets, prefix_targets, weights, gather_cols = ctx.saved_tensors
        grad = torch.empty_like(logits)
        _logit_grad_slabs(logits, lse, targets, prefix_targets, weights, ctx.num_mtp, _grad_or_zero(grad_out, lse),
                          grad_lse, grad, lambda g: g, GRAD_SLAB_ROWS, gather_cols, grad_zg)
        return grad, None, None, None, None, None


def softcapped_loss_lse_portable(logits: Tensor, targets: Tensor, mtp_weights, prefix_targets: Tensor | None,
                                 prefix_weight, gather_cols: Tensor | None = None) -> tuple[Tensor, ...]:
    """(Σ_t L_t, lse [T]) for logits [T, N] and targets (class positions in [0, N), others skipped) [T];
    with gather_cols (int64 [T, M]) also zg [T, M] = z at those columns (0 outside [0, N))."""
    _check_inputs(logits, targets, prefix_targets)
    _check_gather(gather_cols, None, logits.shape[0], "softcapped_loss_lse")
    weights = loss_weights(mtp_weights, prefix_weight, logits.device)  # [w_0..w_{K-1}, w_p]
    return _SoftcappedLoss.apply(logits, targets, prefix_targets, weights, len(mtp_weights), gather_cols)


def softcapped_loss_sum_portable(logits: Tensor, targets: Tensor, mtp_weights, prefix_targets: Tensor | None,
                                 prefix_weight) -> Tensor:
    """Σ_t L_t alone (`softcapped_loss_lse_portable`'s loss)."""
    return softcapped_loss_lse_portable(logits, targets, mtp_weights, prefix_targets, prefix_weight)[0]


def _terms(T: int, N: int, targets: Tensor, prefix_targets: Tensor | None, weights: Tensor, num_mtp: int):
    """The loss terms by kind, each (classes, weights) over rows [0, n): MTP k covers rows [0, T − k)
    with classes targets[k:]; the prefix covers [0, T). A class outside [0, N) keeps its slot with
    weight 0 and class 0 standing in (fixed sizes, no host sync)."""
    kinds = [(targets[k:], weights[k]) for k in range(num_mtp)]
    if prefix_targets is not None:
        kinds.append((prefix_targets, weights[num_mtp]))
    out = []
    for classes, w in kinds:
        valid = (classes >= 0) & (classes < N)
        out.append((torch.where(valid, classes, 0), torch.where(valid, w, 0.0)))
    return out


def _slabbed_loss_lse(logits: Tensor, targets: Tensor, prefix_targets: Tensor | None, weights: Tensor,
                      num_mtp: int) -> tuple[Tensor, Tensor]:
    """(Σ_t w_t (lse_t − z_t), lse [T] fp32) of softcapped logits [T, N] (bf16 or e4m3), σ held one slab
    of CE_SLAB_ROWS rows at a time; the picked z recomputed from the picked entries. The portable
    twins' shared forward."""
    T, N = logits.shape
    lse = torch.empty(T, dtype=torch.float32, device=logits.device)
    for lo in range(0, T, CE_SLAB_ROWS):
        sig = _softcap_sigma(logits[lo: lo + CE_SLAB_ROWS])  # (rows, N)
        lse[lo: lo + CE_SLAB_ROWS] = SOFTCAP_A + torch.log(sig.mul_(SOFTCAP_A).sub_(SOFTCAP_A).exp_().sum(dim=-1))
    total = lse.new_zeros(())
    for classes, w in _terms(T, N, targets, prefix_targets, weights, num_mtp):
        n = classes.numel()
        z = SOFTCAP_A * _softcap_sigma(logits[torch.arange(n, device=lse.device), classes])  # (n,)
        total = total + (w * (lse[:n] - z)).sum()
    return total, lse


def _softcap_sigma(logits: Tensor) -> Tensor:
    """σ((ℓ + 5)/7.5) in fp32 of any-dtype logits (e4m3 bytes decode exactly): one new fp32 tensor
    (a copy even of fp32 logits, then in place), the only temporary of its size."""
    return logits.to(torch.float32, copy=True).add_(SOFTCAP_B).div_(SOFTCAP_C).sigmoid_()


def softcapped_ce_e4m3_portable(logits8: Tensor, targets: Tensor, prefix_targets: Tensor | None, weights: Tensor,
                                num_mtp: int, gather_cols: Tensor | None = None) -> tuple[Tensor, ...]:
    """Σ_t L_t (0-D fp32) and lse (fp32 [T]) of e4m3 logits [T, N]: the forward of the fp8 path; with
    gather_cols (int64 [T, M]) also zg (fp32 [T, M]), z at those columns (0 outside [0, N)).

    σ lives one slab of CE_SLAB_ROWS rows at a time; the picked and gathered z are recomputed from
    their bytes."""
    _check_inputs(logits8, targets, prefix_targets, (E4M3,), "softcapped_ce_e4m3")
    _check_gather(gather_cols, None, logits8.shape[0], "softcapped_ce_e4m3")
    total, lse = _slabbed_loss_lse(logits8, targets, prefix_targets, weights, num_mtp)
    if gather_cols is None:
        return total, lse
    return total, lse, _gathered_z(logits8, gather_cols)


def _logit_grad_slabs(logits: Tensor, lse: Tensor, targets: Tensor, prefix_targets: Tensor | None, weights: Tensor,
                      num_mtp: int, grad_out: Tensor, grad_lse: Tensor | None, out: Tensor, finish,
                      slab_rows: int = CE_SLAB_ROWS, gather_cols: Tensor | None = None,
                      grad_zg: Tensor | None = None) -> None:
    """out [T, N] = finish(∂(grad_out·Σ_t L_t + Σ_t grad_lse_t·lse_t + Σ_tm grad_zg_tm·zg_tm)/∂ℓ), one slab
    of `slab_rows` rows at a time, σ recomputed from the logits: ∂L/∂ℓ = (23/7.5)·σ(1 − σ)·(S_t·softmax(z_t)
    − Σ w·[class = target]), ∂lse/∂ℓ = (23/7.5)·σ(1 − σ)·softmax(z_t), ∂zg_tm/∂ℓ = (23/7.5)·σ(1 − σ)·[c =
    gather_cols_tm]. grad_lse (grad_zg) None: no lse (gathered-z) term, the lse-free (gather-free) pass.
    finish maps an fp32 slab of the gradient to what `out` stores (its dtype, the e5m2 scale)."""
    T, N = logits.shape
    terms = _terms(T, N, targets, prefix_targets, weights, num_mtp)
    row_weight = torch.zeros_like(lse)  # S_t
    for classes, w in terms:
        row_weight[: classes.numel()] += w
    grad_out = grad_out.float().reshape(())
    if grad_lse is not None or grad_zg is not None:  # S_t → S'_t, picks ·keep, grad_out → g: per-row scalars only
        # zg alone folds like a zero grad_lse: with g = 0 the picks must go and g become 1 (`_lse_fold`)
        keep, row_weight, grad_out = _lse_fold(grad_out, torch.zeros_like(lse) if grad_lse is None else grad_lse,
                                               row_weight)
        terms = [(classes, w * keep) for classes, w in terms]
    if grad_zg is not None:
        gather_hits, gather_add = _gather_fold(gather_cols, grad_zg, grad_out, N)  # (T, M) each
    for lo in range(0, T, slab_rows):
        hi = min(T, lo + slab_rows)
        sig = _softcap_sigma(logits[lo:hi])  # (rows, N)
        # two fp32 slabs alive at once (σ and dz), every other step in place
        dz = sig.mul(SOFTCAP_A).sub_(lse[lo:hi, None]).exp_().mul_(row_weight[lo:hi, None])  # S_t·softmax
        for classes, w in terms:  # − w at each (row, class) pick of the slab
            n = min(hi, classes.numel()) - lo
            if n > 0:
                rows = torch.arange(n, device=dz.device)
                dz.index_put_((rows, classes[lo: lo + n]), -w[lo: lo + n], accumulate=True)
        if grad_zg is not None:  # + grad_zg/g at each gathered (row, column), in m order, as the kernels
            rows = torch.arange(hi - lo, device=dz.device)
            for m in range(gather_hits.shape[1]):
                col, hit = gather_hits[lo:hi, m], gather_hits[lo:hi, m] >= 0  # (rows,)
                col = torch.where(hit, col, 0)  # a miss reads and writes back column 0 unchanged (no host sync)
                here = dz[rows, col]
                dz[rows, col] = torch.where(hit, here + gather_add[lo:hi, m], here)
        dz.mul_(sig).mul_(sig.neg_().add_(1))  # ·σ(1 − σ)
        out[lo:hi] = finish(dz.mul_(SOFTCAP_A / SOFTCAP_C).mul_(grad_out))


def softcapped_ce_grad_e5m2_portable(logits8: Tensor, lse: Tensor, targets: Tensor, prefix_targets: Tensor | None,
                                     weights: Tensor, num_mtp: int, grad_out: Tensor, grad_scale: Tensor,
                                     grad_lse: Tensor | None = None, gather_cols: Tensor | None = None,
                                     grad_zg: Tensor | None = None) -> Tensor:
    """e5m2 [T, N] of ∂(grad_out·Σ_t L_t + Σ_t grad_lse_t·lse_t + Σ_tm grad_zg_tm·zg_tm)/∂ℓ / grad_scale
    (saturated to ±57344), from the e4m3 logits and the forward's lse (`_logit_grad_slabs`)."""
    _check_inputs(logits8, targets, prefix_targets, (E4M3,), "softcapped_ce_grad_e5m2")
    _check_grad_lse(grad_lse, logits8.shape[0], "softcapped_ce_grad_e5m2")
    _check_gather(gather_cols, grad_zg, logits8.shape[0], "softcapped_ce_grad_e5m2")
    out = torch.empty(logits8.shape, dtype=E5M2, device=logits8.device)
    _logit_grad_slabs(logits8, lse, targets, prefix_targets, weights, num_mtp, grad_out, grad_lse, out,
                      lambda g: g.div_(grad_scale).clamp_(-E5M2_MAX, E5M2_MAX).to(E5M2), CE_SLAB_ROWS,
                      gather_cols, grad_zg)
    return out


# ------------------------------------------------------------------------------------------------
# Triton kernel


@triton.jit
def _mtp_term(targets_ptr, weights_ptr, row, k, T, N):
    """Row t's k-th MTP term: its class targets[t + k] (−1 past the end) and weight (0 when skipped)."""
    target = tl.load(targets_ptr + row + k, mask=row + k < T, other=-1)
    return target, tl.where((target >= 0) & (target < N), tl.load(weights_ptr + k), 0.0)


@triton.jit
def _prefix_term(prefix_ptr, weights_ptr, row, N, NUM_MTP: tl.constexpr):
    """Row t's prefix term: its class prefix[t] (−1: none) and weight w_p (0 when skipped)."""
    prefix = tl.load(prefix_ptr + row)
    return prefix, tl.where((prefix >= 0) & (prefix < N), tl.load(weights_ptr + NUM_MTP), 0.0)


@triton.jit
def _picks_minus(dz, c, targets_ptr, prefix_ptr, weights_ptr, row, T, N, keep,
                 NUM_MTP: tl.constexpr, HAS_PREFIX: tl.constexpr, FOLDED: tl.constexpr):
    """dz − Σ w·[c = class] over the row's terms, in the twin's order (MTP k = 0.., then the prefix);
    FOLDED (a grad_lse or grad_zg folded in) makes each w keep·w (`_lse_fold_rows`, a scalar per row)."""
    for k in tl.static_range(NUM_MTP):
        target, w = _mtp_term(targets_ptr, weights_ptr, row, k, T, N)
        if FOLDED:
            w = w * keep
        dz -= tl.where(c == target, w, 0.0)
    if HAS_PREFIX:
        prefix, w = _prefix_term(prefix_ptr, weights_ptr, row, N, NUM_MTP)
        if FOLDED:
            w = w * keep
        dz -= tl.where(c == prefix, w, 0.0)
    return dz


@triton.jit
def _lse_fold_rows(grad_out, grad_lse, pick_weight):
    """`_lse_fold` for one row: (keep, S', g), scalars, so the row's sweep does the lse-free
    per-element work; a zero grad_lse gives keep = 1, S' = S and g = grad_out bit for bit."""
    nonzero = grad_out != 0.0
    g = tl.where(nonzero, grad_out, 1.0)
    keep = tl.where(nonzero, 1.0, 0.0)
    return keep, pick_weight * keep + grad_lse / g, g


@triton.jit
def _store_gathered_z(row_logits, gather_ptr, zg_ptr, row, N, A: tl.constexpr, B: tl.constexpr, C: tl.constexpr,
                      NUM_GATHER: tl.constexpr):
    """zg[t, m] = z_t[gather_cols[t, m]] (0 where the column is outside [0, N)) for the row's M
    gathered columns, each one masked scalar load (twin: `_gathered_z`)."""
    for m in tl.static_range(NUM_GATHER):
        col = tl.load(gather_ptr + row * NUM_GATHER + m)
        inside = (col >= 0) & (col < N)
        ell = tl.load(row_logits + col, mask=inside, other=0.0).to(tl.float32)
        tl.store(zg_ptr + row * NUM_GATHER + m, tl.where(inside, A * tl.sigmoid((ell + B) / C), 0.0))


@triton.jit
def _gather_plus(dz, c, gather_ptr, grad_zg_ptr, row, N, g, NUM_GATHER: tl.constexpr):
    """dz + grad_zg[t, m]/g at c = gather_cols[t, m], m in order (twin: `_gather_fold`): the sweep's
    factor g then puts grad_zg on that z. A select, not dz + 0 elsewhere (−0 + 0 = +0), and no hit
    for a zero grad_zg or a column outside [0, N): a zero grad_zg gives the gather-free numbers bit
    for bit. Per element, M compares and selects, like the picks."""
    for m in tl.static_range(NUM_GATHER):
        col = tl.load(gather_ptr + row * NUM_GATHER + m)
        grad_zg = tl.load(grad_zg_ptr + row * NUM_GATHER + m)
        col = tl.where((col >= 0) & (col < N) & (grad_zg != 0.0), col, -1)
        dz = tl.where(c == col, dz + grad_zg / g, dz)
    return dz


@triton.jit
def _e5m2_bits(v):
    """Round-to-nearest-even fp32 → e5m2 byte (uint8) for |v| <= 57344 (the caller saturates), bit
    for bit torch's `.to(torch.float8_e5m2)`. Written in integer ops because the interpreter's own
    fp8 store loses the rounding carry (1.94 → 1.0), and integer ops round the same on any backend."""
    bits = v.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    mag = bits & 0x7FFFFFFF
    # normal (|v| >= 2^-14): drop 21 of fp32's 23 mantissa bits, half to even; a carry rolls into the
    # exponent; rebias 127 → 15
    normal = ((mag + 0xFFFFF + ((mag >> 21) & 1)) >> 21) - ((127 - 15) << 2)
    # subnormal (|v| < 2^-14): the code is RNE(|v|·2^16) = RNE(M·2^(E−134)), M the 24-bit significand
    m = (mag & 0x7FFFFF) | 0x800000
    shift = tl.minimum(134 - (mag >> 23), 30)  # >= 22 here; past 25 the result is 0 anyway
    q = m >> shift
    rem = m - (q << shift)
    half = 1 << (shift - 1)
    sub = q + ((rem > half) | ((rem == half) & ((q & 1) == 1))).to(tl.int32)
    return (tl.where(mag >= 0x38800000, normal, sub) | sign).to(tl.uint8)  # 0x38800000 = 2^-14


@triton.jit
def _softcapped_ce_kernel(
    logits_ptr, targets_ptr, prefix_ptr, weights_ptr, row_loss_ptr, lse_ptr, grad_ptr, grad_out_ptr, grad_lse_ptr,
    gather_ptr, zg_ptr, grad_zg_ptr,
    T, N, stride_logits, stride_grad,
    A: tl.constexpr, B: tl.constexpr, C: tl.constexpr,
    NUM_MTP: tl.constexpr, HAS_PREFIX: tl.constexpr, WRITE_GRAD: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_LSE_GRAD: tl.constexpr = False, NUM_GATHER: tl.constexpr = 0,
):
    """One program per row t: L_t into row_loss[t], lse_t into lse[t] and, with WRITE_GRAD,
    ∂(g·L_t + g_lse[t]·lse_t + Σ_m g_zg[t, m]·zg[t, m])/∂ℓ_t into grad[t, :] (g = grad_out[0]; g_lse
    read only with HAS_LSE_GRAD). NUM_GATHER = M > 0: the forward launch (no WRITE_GRAD) writes zg[t, :]
    at gather[t, :] (int64 [T, M]), the backward launch folds g_zg[t, :] in; 0: neither (gather-free).

    Softcap z = A·σ((ℓ + B)/C) with (A, B, C) = (23, 5, 7.5) passed as constexprs.
    Portable twins: `softcapped_loss_lse_portable` (row_loss.sum() and lse are its values, grad its
    gradient) and, for e4m3 logits, `softcapped_ce_e4m3_portable` (value and lse). The non-fp8
    autograd Function launches it twice: without WRITE_GRAD in its forward, with it in its backward
    (sweep 1 recomputes the forward's lse bit for bit).
    weights = [w_0, .., w_{K-1}, w_p] fp32. Two sweeps over the row: Σ exp(z − 23) (fixed max,
    z < 23), then the gradient; σ is recomputed in the second sweep instead of cached. Logits (fp32,
    bf16 or e4m3) are upcast to fp32 before any arithmetic (the interpreter's bf16 arithmetic is
    wrong), so the math is fp32 throughout; only the sum order differs from the twin.
    """
    row = tl.program_id(0).to(tl.int64)  # T·N exceeds 2^31 at full vocab beyond ~42k rows
    row_logits = logits_ptr + row * stride_logits
    cols = tl.arange(0, BLOCK_N)

    # the row's terms: MTP targets of rows t..t+K-1 (skipped past the end or outside [0, N)), the prefix
    pick_weight = 0.0  # S_t
    picked_z = 0.0  # Σ w·z at the picked classes
    for k in tl.static_range(NUM_MTP):
        target, w = _mtp_term(targets_ptr, weights_ptr, row, k, T, N)
        target_logit = tl.load(row_logits + target, mask=w != 0.0, other=0.0).to(tl.float32)
        pick_weight += w
        picked_z += w * A * tl.sigmoid((target_logit + B) / C)
    if HAS_PREFIX:
        prefix, prefix_weight = _prefix_term(prefix_ptr, weights_ptr, row, N, NUM_MTP)
        prefix_logit = tl.load(row_logits + prefix, mask=prefix_weight != 0.0, other=0.0).to(tl.float32)
        pick_weight += prefix_weight
        picked_z += prefix_weight * A * tl.sigmoid((prefix_logit + B) / C)

    # sweep 1: lse = 23 + ln Σ exp(z − 23)
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for n0 in range(0, N, BLOCK_N):
        in_row = n0 + cols < N
        ell = tl.load(row_logits + n0 + cols, mask=in_row, other=0.0).to(tl.float32)
        z = A * tl.sigmoid((ell + B) / C)
        acc += tl.where(in_row, tl.exp(z - A), 0.0)
    lse = A + tl.log(tl.sum(acc, axis=0))
    tl.store(row_loss_ptr + row, pick_weight * lse - picked_z)
    tl.store(lse_ptr + row, lse)
    if NUM_GATHER > 0:
        if not WRITE_GRAD:  # the forward launch; the backward's gather columns are for g_zg
            _store_gathered_z(row_logits, gather_ptr, zg_ptr, row, N, A, B, C, NUM_GATHER)

    # sweep 2: ∂L/∂ℓ = (23/7.5)·σ(1 − σ)·(S·softmax − Σ w·[class = target])·g; with HAS_LSE_GRAD (or
    # NUM_GATHER, g_lse = 0), S, w and g are `_lse_fold_rows`'s per-row scalars (the lse term costs no
    # per-element work), and `_gather_plus` adds g_zg/g at the gathered columns
    if WRITE_GRAD:
        grad_out = tl.load(grad_out_ptr)
        keep = 1.0
        if HAS_LSE_GRAD:
            keep, pick_weight, grad_out = _lse_fold_rows(grad_out, tl.load(grad_lse_ptr + row), pick_weight)
        elif NUM_GATHER > 0:  # zg alone: the fold of a zero g_lse (g = 0 must still drop the picks)
            keep, pick_weight, grad_out = _lse_fold_rows(grad_out, 0.0, pick_weight)
        row_grad = grad_ptr + row * stride_grad
        for n0 in range(0, N, BLOCK_N):
            c = n0 + cols
            in_row = c < N
            ell = tl.load(row_logits + c, mask=in_row, other=0.0).to(tl.float32)
            sig = tl.sigmoid((ell + B) / C)
            dz = _picks_minus(pick_weight * tl.exp(A * sig - lse), c, targets_ptr, prefix_ptr, weights_ptr,
                              row, T, N, keep, NUM_MTP, HAS_PREFIX, HAS_LSE_GRAD or NUM_GATHER > 0)
            dz = _gather_plus(dz, c, gather_ptr, grad_zg_ptr, row, N, grad_out, NUM_GATHER)
            grad = (A / C) * sig * (1.0 - sig) * dz * grad_out  # fp32, rounded once by the store
            tl.store(row_grad + c, grad.to(grad_ptr.dtype.element_ty), mask=in_row)


@triton.jit
def _softcapped_ce_grad_e5m2_kernel(
    logits_ptr, targets_ptr, prefix_ptr, weights_ptr, lse_ptr, grad_out_ptr, grad_scale_ptr, out_ptr, grad_lse_ptr,
    gather_ptr, grad_zg_ptr,
    T, N, stride_logits, stride_out,
    A: tl.constexpr, B: tl.constexpr, C: tl.constexpr, E5M2_MAX: tl.constexpr,
    NUM_MTP: tl.constexpr, HAS_PREFIX: tl.constexpr, BLOCK_N: tl.constexpr, HAS_LSE_GRAD: tl.constexpr = False,
    NUM_GATHER: tl.constexpr = 0,
):
    """One program per row t: the e5m2 bytes of ∂(grad_out·L_t + grad_lse[t]·lse_t + Σ_m
    grad_zg[t, m]·zg[t, m])/∂ℓ_t / grad_scale into out[t, :] (uint8), from the e4m3 logits and the
    forward's lse[t]: the backward of the fp8 path (grad_lse read only with HAS_LSE_GRAD; gather[t, :]
    and grad_zg[t, :] only with NUM_GATHER = M > 0).

    Portable twin: `softcapped_ce_grad_e5m2_portable`, whose fp32 operation order this follows
    (S·exp(23σ − lse), minus the picks, plus grad_zg/g at the gathered columns, ·σ, ·(1 − σ), ·23/7.5,
    ·grad_out, / grad_scale, saturate; with HAS_LSE_GRAD or NUM_GATHER, S, the pick weights and
    grad_out are `_lse_fold_rows`'s).
    """
    row = tl.program_id(0).to(tl.int64)
    row_logits = logits_ptr + row * stride_logits
    row_out = out_ptr + row * stride_out
    cols = tl.arange(0, BLOCK_N)
    pick_weight = 0.0  # S_t
    for k in tl.static_range(NUM_MTP):
        _, w = _mtp_term(targets_ptr, weights_ptr, row, k, T, N)
        pick_weight += w
    if HAS_PREFIX:
        _, w = _prefix_term(prefix_ptr, weights_ptr, row, N, NUM_MTP)
        pick_weight += w
    lse = tl.load(lse_ptr + row)
    grad_out = tl.load(grad_out_ptr)
    grad_scale = tl.load(grad_scale_ptr)
    keep = 1.0
    if HAS_LSE_GRAD:  # S, the pick weights and grad_out become per-row scalars with grad_lse folded in
        keep, pick_weight, grad_out = _lse_fold_rows(grad_out, tl.load(grad_lse_ptr + row), pick_weight)
    elif NUM_GATHER > 0:  # zg alone: the fold of a zero grad_lse (grad_out = 0 must still drop the picks)
        keep, pick_weight, grad_out = _lse_fold_rows(grad_out, 0.0, pick_weight)
    for n0 in range(0, N, BLOCK_N):
        c = n0 + cols
        in_row = c < N
        ell = tl.load(row_logits + c, mask=in_row, other=0.0).to(tl.float32)
        sig = tl.sigmoid((ell + B) / C)
        dz = _picks_minus(tl.exp(sig * A - lse) * pick_weight, c, targets_ptr, prefix_ptr, weights_ptr,
                          row, T, N, keep, NUM_MTP, HAS_PREFIX, HAS_LSE_GRAD or NUM_GATHER > 0)
        dz = _gather_plus(dz, c, gather_ptr, grad_zg_ptr, row, N, grad_out, NUM_GATHER)
        grad = dz * sig * (1.0 - sig) * (A / C) * grad_out / grad_scale
        grad = tl.minimum(tl.maximum(grad, -E5M2_MAX), E5M2_MAX)
        tl.store(row_out + c, _e5m2_bits(grad), mask=in_row)


# Launch configurations by name; tests compile every "cuda*" one for SM90 (tests/kernels).
TILES = {
    "cuda": dict(BLOCK_N=2048, num_warps=8, num_stages=1),  # 50304 and every P are ~25 sweeps of 2048
    "interpreter": dict(BLOCK_N=16, num_warps=1, num_stages=1),  # CPU tests: several ragged blocks per row
}


def _tiles(device: torch.device) -> dict:
    return TILES["cuda" if device.type == "cuda" else "interpreter"]


def _launch_loss(logits: Tensor, targets: Tensor, prefix_targets: Tensor | None, weights: Tensor, num_mtp: int,
                 grad: Tensor | None = None, grad_out: Tensor | None = None, grad_lse: Tensor | None = None,
                 gather_cols: Tensor | None = None, grad_zg: Tensor | None = None
                 ) -> tuple[Tensor, Tensor, Tensor | None]:
    """row_loss [T], lse [T] (fp32) and, with gather_cols and no `grad`, zg [T, M] (else None) of
    logits [T, N]; with `grad`, the gradient for the incoming grad_out (fp32 [1]), grad_lse (fp32 [T]
    or None) and grad_zg (fp32 [T, M] at gather_cols, or None) into it."""
    T, N = logits.shape
    row_loss = torch.empty(T, dtype=torch.float32, device=logits.device)
    lse = torch.empty(T, dtype=torch.float32, device=logits.device)
    # the forward launch gathers zg; the backward launch folds grad_zg, or runs gather-free without one
    gathering = gather_cols is not None and (grad is None or grad_zg is not None)
    zg = None
    if gather_cols is not None and grad is None:
        zg = torch.empty(gather_cols.shape, dtype=torch.float32, device=logits.device)  # (T, M)
    if T > 0:
        _softcapped_ce_kernel[(T,)](
            logits, targets, targets if prefix_targets is None else prefix_targets, weights, row_loss, lse,
            row_loss if grad is None else grad, row_loss if grad_out is None else grad_out,  # unread without
            row_loss if grad_lse is None else grad_lse,  # WRITE_GRAD (and HAS_LSE_GRAD)
            gather_cols.contiguous() if gathering else targets,  # unread with NUM_GATHER = 0
            row_loss if zg is None else zg,  # written only by the gathering forward
            grad_zg.float().contiguous() if gathering and grad is not None else row_loss,  # read by its backward
            T, N, logits.stride(0), 0 if grad is None else grad.stride(0),
            A=SOFTCAP_A, B=SOFTCAP_B, C=SOFTCAP_C, NUM_MTP=num_mtp, HAS_PREFIX=prefix_targets is not None,
            WRITE_GRAD=grad is not None, HAS_LSE_GRAD=grad_lse is not None,
            NUM_GATHER=gather_cols.shape[1] if gathering else 0, **_tiles(logits.device),
        )
    return row_loss, lse, zg


class _FusedSoftcappedLoss(torch.autograd.Function):
    """Forward: one launch for the loss, lse (and zg). Backward: one launch that writes the logit
    gradient from the saved logits (σ recomputed), grad_out, grad_lse and grad_zg folded in. The
    logits are saved in place of a stored gradient of the same size."""

    @staticmethod
    def forward(ctx, logits: Tensor, targets: Tensor, prefix_targets: Tensor | None, weights: Tensor,
                num_mtp: int, gather_cols: Tensor | None) -> tuple[Tensor, ...]:
        ctx.set_materialize_grads(False)  # an unused lse (zg) arrives as None: the lse-free (gather-free) launch
        logits = logits if logits.stride(-1) == 1 else logits.contiguous()
        row_loss, lse, zg = _launch_loss(logits, targets, prefix_targets, weights, num_mtp, gather_cols=gather_cols)
        if ctx.needs_input_grad[0]:
            ctx.save_for_backward(logits, targets, prefix_targets, weights, gather_cols)
            ctx.num_mtp = num_mtp
        return (row_loss.sum(), lse) if zg is None else (row_loss.sum(), lse, zg)

    @staticmethod
    def backward(ctx, grad_out: Tensor | None, grad_lse: Tensor | None, grad_zg: Tensor | None = None):
        logits, targets, prefix_targets, weights, gather_cols = ctx.saved_tensors
        grad = torch.empty_like(logits)
        g = _grad_or_zero(grad_out, weights).reshape(1)
        lse_grad = None if grad_lse is None else grad_lse.float().contiguous()
        _launch_loss(logits, targets, prefix_targets, weights, ctx.num_mtp, grad, g, lse_grad, gather_cols, grad_zg)
        return grad, None, None, None, None, None


def softcapped_loss_lse_triton(logits: Tensor, targets: Tensor, mtp_weights, prefix_targets: Tensor | None,
                               prefix_weight, gather_cols: Tensor | None = None) -> tuple[Tensor, ...]:
    """(Σ_t L_t, lse [T]) for logits [T, N] and targets [T], with gather_cols also zg [T, M]:
    `softcapped_loss_lse_portable`'s contract, one kernel launch each way."""
    _check_inputs(logits, targets, prefix_targets)
    _check_gather(gather_cols, None, logits.shape[0], "softcapped_loss_lse")
    weights = loss_weights(mtp_weights, prefix_weight, logits.device)  # [w_0..w_{K-1}, w_p]
    prefix = None if prefix_targets is None else prefix_targets.contiguous()
    gather = None if gather_cols is None else gather_cols.contiguous()
    return _FusedSoftcappedLoss.apply(logits, targets.contiguous(), prefix, weights, len(mtp_weights), gather)


def softcapped_loss_sum_triton(logits: Tensor, targets: Tensor, mtp_weights, prefix_targets: Tensor | None,
                               prefix_weight) -> Tensor:
    """Σ_t L_t alone (`softcapped_loss_lse_triton`'s loss)."""
    return softcapped_loss_lse_triton(logits, targets, mtp_weights, prefix_targets, prefix_weight)[0]


def softcapped_ce_e4m3_triton(logits8: Tensor, targets: Tensor, prefix_targets: Tensor | None, weights: Tensor,
                              num_mtp: int, gather_cols: Tensor | None = None) -> tuple[Tensor, ...]:
    """`softcapped_ce_e4m3_portable`'s contract in one launch."""
    _check_inputs(logits8, targets, prefix_targets, (E4M3,), "softcapped_ce_e4m3")
    _check_gather(gather_cols, None, logits8.shape[0], "softcapped_ce_e4m3")
    logits8 = logits8 if logits8.stride(-1) == 1 else logits8.contiguous()
    prefix = None if prefix_targets is None else prefix_targets.contiguous()
    row_loss, lse, zg = _launch_loss(logits8, targets.contiguous(), prefix, weights.float().contiguous(), num_mtp,
                                     gather_cols=gather_cols)
    return (row_loss.sum(), lse) if zg is None else (row_loss.sum(), lse, zg)


def softcapped_ce_grad_e5m2_triton(logits8: Tensor, lse: Tensor, targets: Tensor, prefix_targets: Tensor | None,
                                   weights: Tensor, num_mtp: int, grad_out: Tensor, grad_scale: Tensor,
                                   grad_lse: Tensor | None = None, gather_cols: Tensor | None = None,
                                   grad_zg: Tensor | None = None) -> Tensor:
    """`softcapped_ce_grad_e5m2_portable`'s contract in one launch."""
    _check_inputs(logits8, targets, prefix_targets, (E4M3,), "softcapped_ce_grad_e5m2")
    _check_grad_lse(grad_lse, logits8.shape[0], "softcapped_ce_grad_e5m2")
    _check_gather(gather_cols, grad_zg, logits8.shape[0], "softcapped_ce_grad_e5m2")
    logits8 = logits8 if logits8.stride(-1) == 1 else logits8.contiguous()
    T, N = logits8.shape
    out = torch.empty((T, N), dtype=E5M2, device=logits8.device)
    if T > 0:
        prefix = targets if prefix_targets is None else prefix_targets.contiguous()
        f32 = dict(dtype=torch.float32, device=logits8.device)
        _softcapped_ce_grad_e5m2_kernel[(T,)](
            logits8, targets.contiguous(), prefix, weights.float().contiguous(), lse,
            grad_out.to(**f32).reshape(1), grad_scale.to(**f32).reshape(1), out.view(torch.uint8),
            lse if grad_lse is None else grad_lse.to(**f32).contiguous(),  # unread without HAS_LSE_GRAD
            targets if grad_zg is None else gather_cols.contiguous(),  # both unread with NUM_GATHER = 0
            lse if grad_zg is None else grad_zg.to(**f32).contiguous(),
            T, N, logits8.stride(0), out.stride(0),
            A=SOFTCAP_A, B=SOFTCAP_B, C=SOFTCAP_C, E5M2_MAX=E5M2_MAX, NUM_MTP=num_mtp,
            HAS_PREFIX=prefix_targets is not None, HAS_LSE_GRAD=grad_lse is not None,
            NUM_GATHER=0 if grad_zg is None else gather_cols.shape[1], **_tiles(logits8.device),
        )
    return out


# ------------------------------------------------------------------------------------------------
# Public ops

def softcapped_loss_lse(logits: Tensor, targets: Tensor, mtp_weights, prefix_targets: Tensor | None,
                        prefix_weight, gather_cols: Tensor | None = None) -> tuple[Tensor, ...]:
    """(Σ_t L_t 0-D fp32, lse fp32 [T]) for logits [T, N] and targets [T] (class positions; outside
    [0, N) skipped), both differentiable: model/loss.py `softcapped_ce`, fused. With gather_cols
    (int64 [T, M], column positions like the targets), (Σ_t L_t, lse, zg fp32 [T, M]) with zg[t, m] =
    softcap(logits)[t, gather_cols[t, m]] (0 outside [0, N)), differentiable as well.

    mtp_weights: w_k for the targets of rows t, t+1, ...; prefix_targets [T] (−1: none) with weight
    prefix_weight, or None. lse_t is over the N columns given (the candidate set C under the sampled softmax).
    """
    if current().triton:
        return softcapped_loss_lse_triton(logits, targets, mtp_weights, prefix_targets, prefix_weight, gather_cols)
    return softcapped_loss_lse_portable(logits, targets, mtp_weights, prefix_targets, prefix_weight, gather_cols)


def softcapped_loss_sum(logits: Tensor, targets: Tensor, mtp_weights, prefix_targets: Tensor | None,
                        prefix_weight) -> Tensor:
    """Σ_t L_t alone (`softcapped_loss_lse`'s loss)."""
    return softcapped_loss_lse(logits, targets, mtp_weights, prefix_targets, prefix_weight)[0]


def softcapped_ce_e4m3(logits8: Tensor, targets: Tensor, prefix_targets: Tensor | None, weights: Tensor,
                       num_mtp: int, gather_cols: Tensor | None = None) -> tuple[Tensor, ...]:
    """Σ_t L_t (0-D fp32) and lse (fp32 [T]) of e4m3 logits [T, N], and with gather_cols (int64 [T, M])
    zg (fp32 [T, M], the softcapped logits there, 0 outside [0, N)) as a third value (no autograd:
    perf/fp8.py's lm_head loss calls this forward and `softcapped_ce_grad_e5m2` in its backward).

    weights: [w_0, .., w_{K-1}, w_p] fp32 (`loss_weights`); num_mtp = K; targets and prefix_targets
    as in `softcapped_loss_sum`."""
    if current().triton:
        return softcapped_ce_e4m3_triton(logits8, targets, prefix_targets, weights, num_mtp, gather_cols)
    return softcapped_ce_e4m3_portable(logits8, targets, prefix_targets, weights, num_mtp, gather_cols)


def softcapped_ce_grad_e5m2(logits8: Tensor, lse: Tensor, targets: Tensor, prefix_targets: Tensor | None,
                            weights: Tensor, num_mtp: int, grad_out: Tensor, grad_scale: Tensor,
                            grad_lse: Tensor | None = None, gather_cols: Tensor | None = None,
                            grad_zg: Tensor | None = None) -> Tensor:
    """e5m2 [T, N]: ∂(grad_out·Σ_t L_t + Σ_t grad_lse_t·lse_t + Σ_tm grad_zg_tm·zg_tm)/∂ℓ / grad_scale,
    saturated to ±57344 (the lm_head backward's gradient operand), from the e4m3 logits and
    `softcapped_ce_e4m3`'s lse. grad_lse fp32 [T], or None when nothing used lse (the lse-free
    launch); grad_zg fp32 [T, M] at gather_cols (int64 [T, M]), or None when nothing used zg (the
    gather-free launch)."""
    if current().triton:
        return softcapped_ce_grad_e5m2_triton(logits8, lse, targets, prefix_targets, weights, num_mtp, grad_out,
                                              grad_scale, grad_lse, gather_cols, grad_zg)
    return softcapped_ce_grad_e5m2_portable(logits8, lse, targets, prefix_targets, weights, num_mtp, grad_out,
                                            grad_scale, grad_lse, gather_cols, grad_zg)
