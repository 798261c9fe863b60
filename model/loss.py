"""The output head and losses of record #360: softcapped cross-entropy with multi-token prediction,
the prefix-token auxiliary term, the sampled (candidate-set) softmax, and the validation loss.

The training loss is defined here, in plain torch (`softcap`, `candidate_positions`,
`softcapped_ce`). Softcap: z = 23·σ((ℓ + 5)/7.5). Training loss of token t (record #360:
track_1_short/model/gpt.py `_loss`), summed over the rank's tokens (not averaged):
    L_t = Σ_k [t+k < T]·w_k·(lse_t − z_t[y_{t+k}]) + [p_t ≥ 0]·w_p·(lse_t − z_t[p_t])
with the MTP weights w_k, p_t = prefix_table[y_t] and lse_t = ln Σ_c exp z_tc over the full
vocabulary or over the step's candidate set C. MTP targets are the following rows' next-token
targets, with no masking at document ends. In training the logits come from the fp8 lm_head
(perf/fp8.py); validation uses bf16 logits and a softcap in bf16, then a plain fp32 cross-entropy
averaged over tokens.

perf/ implements this math for training (a kernel imports no model file, so the kernel module
restates it; tests/perf/test_perf_kernels_cross_entropy.py and tests/model/test_model_loss.py hold
it to `softcapped_ce`). With fp8 (the record), `fp8_lm_head_loss` (perf/fp8.py) is the GEMM and the
CE in one autograd node: e4m3 logits go straight into the softcapped CE, which keeps only them
(1 byte per element) and lse for the backward and writes the logit gradient in e5m2. Without fp8,
`softcapped_loss_lse` does the same on the bf16 GEMM's bf16 logits (2 bytes per element; its fp32
temporaries one slab of rows at a time), so the ablation differs from the record by its GEMMs and
the logits' width only. Both return (Σ_t L_t, lse [T]) with lse differentiable,
so a term in lse is one line in `training_loss`, no kernel edit (docs/loss_terms.md). Both
CEs (the fused kernels on the fast path, their portable twins elsewhere) compute σ and z in fp32
with the exact gradient (the record's kernel caches σ in fp16 and sums all MTP weights into its
softmax term even on the last K−1 rows, a quirk on <= 2 rows per rank that ours leaves out).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from model.canonical_mask import apply_canonical_mask
from model.cplm import COPY_TOKEN_ID, copy_column_index, mixture_nll, validation_sums
from perf.backend import host_checks
from perf.bf16_gemm import bf16_matmul
from perf.kernels.cross_entropy import softcapped_loss_lse
from perf.fp8 import fp8_lm_head_loss

SOFTCAP_A, SOFTCAP_B, SOFTCAP_C = 23.0, 5.0, 7.5  # record #360: z = 23·σ((ℓ + 5)/7.5)
LM_HEAD_INIT_STD = 0.005  # record #360
SAMPLED_SWEEP_STRIDE = 20011  # record #360: negatives follow k ↦ 20011·k mod V (coprime to 50304)
EVAL_CE_SLAB_ROWS = 32768  # record #360: validation CE slab
SAMPLED_DRAW_FACTOR, SAMPLED_DRAW_EXTRA = 1.7, 256  # record #360: a sweep window of 1.7·need + 256


class TransposedLinear(nn.Module):
    """lm_head with its weight stored transposed, [in, out] = [D, V] (record #360's CastedLinearT)."""

    def __init__(self, in_features: int, out_features: int, device=None, dtype=None):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(in_features, out_features, device=device, dtype=dtype))

    def forward(self, x: Tensor) -> Tensor:
        return x @ self.weight


def softcap(logits: Tensor) -> Tensor:
    """z = 23·σ((ℓ + 5)/7.5) in the logits' dtype: every z lies in (0, 23)."""
    return SOFTCAP_A * torch.sigmoid((logits + SOFTCAP_B) / SOFTCAP_C)


def candidate_positions(candidates: Tensor, vocab_size: int, targets: Tensor,
                        prefix_targets: Tensor | None) -> tuple[Tensor, Tensor | None]:
    """The sampled softmax's relabelling: class ids → positions in the sorted candidate set C
    (int64 [P]), the column of lm_head[:, C] that holds them. A target outside C maps to −1;
    a prefix class outside C (or none, −1) maps to −1, which drops its term."""
    position = torch.full((vocab_size + 1,), -1, dtype=torch.long, device=candidates.device)  # entry V: "none"
    position[candidates] = torch.arange(candidates.numel(), device=candidates.device)
    if prefix_targets is not None:
        prefix_targets = position[torch.where(prefix_targets >= 0, prefix_targets, vocab_size)]
    return position[targets], prefix_targets


def softcapped_ce(logits: Tensor, targets: Tensor, mtp_weights, prefix_targets: Tensor | None,
                  prefix_weight) -> tuple[Tensor, Tensor]:
    """The training CE of record #360, the definition the fused CEs implement: (Σ_t L_t 0-D, lse [T]),
    in fp32 (or wider, if the logits are) with ordinary autograd.

    logits [T, N]; targets [T] and prefix_targets [T] (or None) are class positions in [0, N), others
    skipped; mtp_weights the w_k (floats or 0-D tensors), prefix_weight w_p.

    lse_t = ln Σ_{c<N} exp z_tc is over the N columns given: the full vocabulary, or under the
    sampled softmax the step's candidate set C (N = P), not the vocabulary. So an lse-based term
    sees lse over C: it is ln of the partition function restricted to this step's targets and
    sampled negatives, below the full-vocabulary lse, and its gradient reaches only the logits of C
    (classes outside C get none that step); its size follows P, which changes with the schedule.
    lse_t exists for every row, also for rows whose terms are all skipped.
    """
    z = softcap(logits.to(torch.promote_types(logits.dtype, torch.float32)))  # (T, N)
    lse = torch.logsumexp(z, dim=-1)  # (T,)
    N = z.shape[1]
    terms = [(targets[k:], w) for k, w in enumerate(mtp_weights)]  # row t predicts y_{t+k}, t < T − k
    if prefix_targets is not None:
        terms.append((prefix_targets, prefix_weight))
    total = z.new_zeros(())
    for classes, w in terms:
        n = classes.numel()
        present = (classes >= 0) & (classes < N)
        picked = z[:n].gather(1, classes.clamp(0, N - 1)[:, None]).squeeze(1)  # (n,) z_t[class]
        total = total + (w * torch.where(present, lse[:n] - picked, 0.0)).sum()
    return total, lse


def training_loss(x: Tensor, lm_head_w: Tensor, targets: Tensor, mtp_weights, prefix_targets: Tensor | None,
                  prefix_weight, candidates: Tensor | None = None, fp8: bool = True,
                  copy: tuple[Tensor, Tensor] | None = None, head_sample=None) -> Tensor:
    """Summed training loss of the final normed rows x [T, D] (fp8 lm_head unless fp8=False).

    mtp_weights: the MTP weights (fp32 [K] tensor, or floats); prefix_weight a 0-D tensor or float,
    used when prefix_targets is given. candidates: the step's sorted class ids C (int64 [P]) for the
    sampled softmax, or None for the full softmax. Every target must be in C (CandidateSampler
    builds C from the host batch's targets so that it is; a debug check verifies it where host
    checks run); a prefix class outside C drops that prefix term. The value is `softcapped_ce` of
    x @ lm_head_w[:, C] (fp8-rounded operands and logits with fp8), summed over the rank's rows.

    copy: CPLM's pointer (p_copy [T], a_sink [T]) (PR #379, model/cplm.py), or None. Then the next-token
    term w_0·(lse − z_y) becomes w_0·`mixture_nll`(z_y, z_c, lse, p_copy, a_sink) with c the `<copy>` column
    (its position in C under the sampled softmax); the MTP and prefix terms keep their form, their lse over
    every column `<copy>` included. The CE runs with w_0 = 0 and hands back lse and the two gathered z,
    differentiable, so the mixture is these lines and its gradient rides the CE's one backward pass.

    head_sample: PR #371's counter (perf/sampled_head_grad.py HeadSample), or None: the fp8 lm_head's weight
    gradient over the candidates keeps one row in four for its positive part (an unbiased estimate; dX exact).
    """
    if candidates is not None:
        targets, prefix_targets = candidate_positions(candidates, lm_head_w.shape[1], targets, prefix_targets)
        if host_checks() and bool((targets < 0).any()):
            raise ValueError("training_loss: every target must be in the candidate set")
    gather = {}
    ce_weights = mtp_weights
    if copy is not None:  # CPLM: the CE without its next-token term, plus z at (y_t, <copy>) per row
        gather = {"gather_cols": torch.stack([targets, copy_column_index(candidates, targets)], dim=1)}  # (T, 2)
        ce_weights = (0.0, *list(mtp_weights)[1:])
    if head_sample is not None and not fp8:
        raise ValueError("training_loss: head_sample samples the fp8 lm_head's weight gradient (PR #371); fp8 is off")
    if fp8:  # e4m3 logits straight into the CE, one autograd node (perf/fp8.py)
        out = fp8_lm_head_loss(x, lm_head_w, targets, ce_weights, prefix_targets, prefix_weight, candidates,
                               head_sample=head_sample, **gather)
    else:
        w = lm_head_w if candidates is None else lm_head_w[:, candidates]
        # the logits in the GEMM's dtype (bf16 in training), as the fp8 path keeps its e4m3 ones: the
        # CE reads them, keeps them for its backward and writes the gradient in their dtype; its fp32
        # temporaries live one slab of rows at a time, so no fp32 [T, N] exists
        out = softcapped_loss_lse(bf16_matmul(x, w), targets, ce_weights, prefix_targets, prefix_weight, **gather)
    loss, lse = out[0], out[1]
    if copy is not None:
        z_target, z_copy = out[2].unbind(1)  # (T,), (T,)
        loss = loss + mtp_weights[0] * mixture_nll(z_target, z_copy, lse, *copy).sum()
    # lse [T] (over C under the sampled softmax) is differentiable on both paths, so a term in it is
    # one line here, e.g. a z-loss `loss = loss + 1e-4 * lse.square().sum()` (docs/loss_terms.md);
    # the record has none
    return loss


def validation_logits(x: Tensor, lm_head_w: Tensor) -> Tensor:
    """The validation forward's softcapped logits of the final normed rows x [T, D]: bf16 product and
    softcap (in the logits' dtype), then fp32 [T, V]. `validation_loss` is their cross-entropy;
    evaluate.py reads per-token log-probabilities and next-token choices from them (GPT.forward with
    StepArgs(training=False, logits=True))."""
    return softcap(bf16_matmul(x, lm_head_w)).float()  # (T, V); bf16 GEMMs on a CPU: perf/bf16_gemm.py


def validation_loss(x: Tensor, lm_head_w: Tensor, targets: Tensor, inputs: Tensor | None = None,
                    canonical_mask: Tensor | None = None, copy: tuple[Tensor, Tensor] | None = None,
                    diagnostics: Tensor | None = None) -> Tensor:
    """Mean next-token CE over the full vocabulary: bf16 logits and softcap, fp32 cross-entropy,
    in slabs of EVAL_CE_SLAB_ROWS rows so the fp32 [rows, V] logits stay bounded.

    canonical_mask (record #92, PR #350): the packed [V, V/8] bits of (prev, cur) pairs GPT-2 never
    emits; after token inputs[t] those classes drop out of row t's softmax.
    copy: CPLM's pointer (p_copy, a_sink) [T] (PR #379, frontier_cplm.md §7): the NLL is the mixture's
    (`validation_mixture_nll`), lse over every column, `<copy>` never masked; its diagnostic sums
    (model/cplm.py DIAGNOSTICS) are added into `diagnostics` (fp32 [6]) when given."""
    total = x.new_zeros((), dtype=torch.float32)
    for lo in range(0, x.shape[0], EVAL_CE_SLAB_ROWS):
        rows = slice(lo, lo + EVAL_CE_SLAB_ROWS)
        z = validation_logits(x[rows], lm_head_w)
        if canonical_mask is not None:
            z_copy = z[:, COPY_TOKEN_ID].clone() if copy is not None else None
            z = apply_canonical_mask(z, inputs[rows], canonical_mask)
            if z_copy is not None:  # PR #379: the mask never drops `<copy>`
                z[:, COPY_TOKEN_ID] = z_copy
        if copy is None:
            total = total + F.cross_entropy(z, targets[rows], reduction="sum")
        else:
            sums = validation_sums(z, targets[rows], copy[0][rows], copy[1][rows])  # (6,)
            total = total + sums[1]
            if diagnostics is not None:
                diagnostics.add_(sums)
    return total / x.shape[0]


class CandidateSampler:
    """The sampled softmax's candidate sets (record #360: track_1_short/sampled_softmax.py): no RNG, one set per step.

    Every class that occurs as a target is in, and every class of `always` (CPLM's `<copy>`, PR #379:
    its column gets a gradient every step); the remaining P − U − len(always) slots are negatives from
    a stride sweep over the vocabulary, each rank starting at its own offset V·rank/world_size.
    """

    def __init__(self, vocab_size: int, rank: int = 0, world_size: int = 1, always: tuple[int, ...] = ()):
        if any(not 0 <= c < vocab_size for c in always):
            raise ValueError(f"CandidateSampler: always-included classes {always} must lie in [0, {vocab_size})")
        self.vocab_size, self.always = vocab_size, tuple(always)
        sweep = (SAMPLED_SWEEP_STRIDE * torch.arange(vocab_size, dtype=torch.long)) % vocab_size
        if torch.unique(sweep).numel() != vocab_size:
            raise ValueError(f"CandidateSampler: stride {SAMPLED_SWEEP_STRIDE} is not coprime to V={vocab_size}")
        self.sweep = torch.cat([sweep, sweep])  # twice, so every window is one slice
        self.rank, self.world_size = rank, world_size
        self.reset()

    def reset(self) -> None:
        self.offset = self.vocab_size * self.rank // self.world_size

    def candidates(self, targets: Tensor, num_candidates: int) -> Tensor:
        """Sorted class ids C, int64 [P], for the rank's targets (host tensors)."""
        V, P = self.vocab_size, num_candidates
        marked = torch.zeros(V, dtype=torch.bool)
        marked[targets.long().cpu()] = True
        distinct = int(marked.sum())
        marked[list(self.always)] = True
        need = P - int(marked.sum())
        if need < 0:
            extra = f" and the always-included classes {list(self.always)}" if self.always else ""
            raise ValueError(f"CandidateSampler: {P} candidates cannot hold {distinct} distinct targets{extra}")
        if need > 0:
            draw = min(V, int(need * SAMPLED_DRAW_FACTOR) + SAMPLED_DRAW_EXTRA)
            window = self.sweep[self.offset: self.offset + draw]
            self.offset = (self.offset + draw) % V
            fresh = window[~marked[window]]
            if fresh.numel() >= need:
                marked[fresh[:need]] = True
            else:  # evenly spaced over every unmarked class
                free = (~marked).nonzero().squeeze(1)
                marked[free[:: free.numel() // need][:need]] = True
        return marked.nonzero().squeeze(1)
