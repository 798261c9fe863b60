"""CPLM (upstream PR #379): a copy pointer mixed into the next-token distribution, as plain torch.

The next token's distribution becomes a mixture of the LM softmax and a pointer over the earlier tokens
of the same document (frontier_cplm.md §1):

    p(y) = p̃_lm(y)·(1 − α·(1 − a_sink)) + α·p_copy(y)

α is the softmax mass of the `<copy>` column (COPY_TOKEN_ID, the first padding column of lm_head), p̃_lm
the LM softmax renormalized without it, p_copy(y) the mass one pointer head puts on earlier positions
j of the query's document whose input token x_j is y, and a_sink the mass on a learned sink key (handed
back to the LM, so the mixture sums to 1 over the columns other than `<copy>`).

This module is CPLM's math above the kernels: the pointer's parameters and their init, the head that
turns the final normed rows into (p_copy, a_sink) (`copy_head`: bf16 projections, QK norm, the pointer of
perf/kernels/copy_pointer.py, whose portable twin `copy_pointer` is the pointer's definition, dense in its
band), the two mixture NLLs, the training loss's form (`mixture_nll`) and the validation's
(`validation_mixture_nll`), which agree unless 1 − α < 1e-6 (the spec's FLAG 3), and the validation's
diagnostic sums. model/loss.py applies the mixture: in training, to the lse and the gathered softcapped
logits of the target and `<copy>` columns that the fused CE hands back (no kernel defines it); in
validation, to the masked full softmax.

    p_copy, a_sink = copy_head(h, bank, k_sink, gain, inputs, targets, cu_seqlens, band)   # (N,), (N,) fp32
    nll = mixture_nll(z_target, z_copy, lse, p_copy, a_sink)                              # (N,)

What the PR's package carries and its certified run leaves off (frontier_cplm.md §9) is not here: the
gate and sink λ's are constant 1 (their warmups are off), so they are the default `gate` of the NLLs.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from perf.kernels.copy_pointer import copy_pointer_portable as copy_pointer  # the definition (perf/kernels/copy_pointer.py)
from perf.kernels.copy_pointer import copy_pointer as pointer  # the Triton kernels on the fast path, else the definition
from perf.kernels.copy_pointer import pointer_documents  # noqa: F401 (re-exported)

# PR #379 (track_1_short/cplm_copy.py, its certified runs: frontier_cplm.md §2)
COPY_TOKEN_ID = 50257      # the `<copy>` column: GPT-2's first padding id (never an input)
COPY_DIM = 128             # the pointer's q/k width
COPY_BAND_TRAIN = 2048     # the training band L (blocks of L tokens; a query sees back to its block's start − L)
COPY_BAND_VAL = 8192       # the validation band (CPLM_EVAL_BLOCK=8192)
ALPHA_FLOOR = 1e-6         # 1 − α is clamped at >= 1e-6
NLL_EPS = 1e-9             # NLL = −ln(p + 1e-9)
QK_NORM_EPS = torch.finfo(torch.float32).eps  # PR #379: rms_norm in fp32, eps = fp32 machine epsilon
DIAGNOSTICS = ("count", "nll", "lm_nll", "alpha", "a_sink", "copy_share")  # PR #379's cplm_diag [6] sums


def copy_bank_bound(model_dim: int) -> float:
    """The q/k bank's uniform init bound √3·D^-0.5 (PR #379: 0.0625 at D = 768, twice the backbone banks')."""
    return math.sqrt(3) * model_dim ** -0.5


def init_copy_parameters(model_dim: int, device=None) -> tuple[Tensor, Tensor, Tensor]:
    """(copy_qk_bank [2, d, D] fp32 uniform(±copy_bank_bound), copy_k_sink [d] N(0, 1)·d^-0.5, copy_qk_gain [1] = 1),
    drawn from the default generator after every other draw of the model (PR #379 draws them last, so a seeded
    backbone is the record's)."""
    bank = torch.empty(2, COPY_DIM, model_dim, device=device).uniform_(-copy_bank_bound(model_dim),
                                                                        copy_bank_bound(model_dim))
    k_sink = torch.randn(COPY_DIM, device=device) * COPY_DIM ** -0.5
    return bank, k_sink, torch.ones(1, device=device)


def pointer_qk(h: Tensor, bank: Tensor, gain: Tensor) -> tuple[Tensor, Tensor]:
    """q, k [N, d] in h's dtype from the final normed rows h [N, D] (frontier_cplm.md §4): one plain GEMM
    [q | k] = h·[W_q; W_k]ᵀ (bf16 in a run, not fp8), then q ← rms_norm_fp32(q)·g and k ← rms_norm_fp32(k),
    no weight, cast back; the sink key is not normed."""
    qk = F.linear(h, bank.reshape(2 * COPY_DIM, -1).to(h.dtype))  # (N, 2d)
    q, k = qk.float().split(COPY_DIM, dim=1)
    q = F.rms_norm(q, (COPY_DIM,), eps=QK_NORM_EPS) * gain
    k = F.rms_norm(k, (COPY_DIM,), eps=QK_NORM_EPS)
    return q.to(h.dtype), k.to(h.dtype)


def copy_head(h: Tensor, bank: Tensor, k_sink: Tensor, gain: Tensor, inputs: Tensor, targets: Tensor,
              cu_seqlens: Tensor, band: int) -> tuple[Tensor, Tensor]:
    """(p_copy [N], a_sink [N]) fp32 of the final normed rows h [N, D]: `pointer_qk`, then the pointer
    (perf/kernels/copy_pointer.py: the Triton kernels on the fast path, the dense definition otherwise)
    over the documents of cu_seqlens within `band`. Nothing is detached: the pointer trains h too."""
    q, k = pointer_qk(h, bank, gain)
    return pointer(q, k, k_sink, inputs, targets, cu_seqlens, band)


def mixture_nll(z_target: Tensor, z_copy: Tensor, lse: Tensor, p_copy: Tensor, a_sink: Tensor,
                gate: float | Tensor = 1.0) -> Tensor:
    """−ln p(y) per row as the training kernel computes it (frontier_cplm.md §6): pl = π_y, α = gate·π_c,
    r = 1/max(1 − α, 1e-6), p = pl·(1 + α·a_sink·r) + α·p_copy, NLL = −ln(p + 1e-9); z the softcapped
    logits of the target and `<copy>` columns, lse over every column (`<copy>` included)."""
    pl = torch.exp(z_target - lse)
    alpha = gate * torch.exp(z_copy - lse)
    r = 1.0 / torch.clamp(1.0 - alpha, min=ALPHA_FLOOR)
    return -torch.log(pl * (1.0 + alpha * a_sink * r) + alpha * p_copy + NLL_EPS)


def validation_mixture_nll(z_target: Tensor, z_copy: Tensor, lse: Tensor, p_copy: Tensor, a_sink: Tensor,
                           gate: float | Tensor = 1.0) -> Tensor:
    """−ln p(y) per row as the validation computes it (frontier_cplm.md §7): p̃ = p_lm / max(1 − α, 1e-6),
    p = p̃·(1 − α(1 − a_sink)) + α·p_copy; the same as `mixture_nll` unless 1 − α < 1e-6."""
    p_lm = torch.exp(z_target - lse)
    alpha = gate * torch.exp(z_copy - lse)
    p_tilde = p_lm / torch.clamp(1.0 - alpha, min=ALPHA_FLOOR)
    return -torch.log(p_tilde * (1.0 - alpha * (1.0 - a_sink)) + alpha * p_copy + NLL_EPS)


def copy_column_index(candidates: Tensor | None, like: Tensor) -> Tensor:
    """The `<copy>` column of the training CE, per row [N] int64 on like's device: COPY_TOKEN_ID under the
    full softmax; under the sampled softmax its position in the ascending candidate set C (the number of
    candidates below it: static shape, no host read), as PR #379's kernel reads it from a device index."""
    if candidates is None:
        return torch.full(like.shape, COPY_TOKEN_ID, dtype=torch.long, device=like.device)
    return (candidates < COPY_TOKEN_ID).sum().expand(like.shape)


def validation_sums(z: Tensor, targets: Tensor, p_copy: Tensor, a_sink: Tensor) -> Tensor:
    """fp32 [6] sums over the rows of softcapped, masked validation logits z [n, V] (`<copy>` unmasked):
    count, Σ NLL, Σ −ln p̃ (the LM alone), Σ α, Σ a_sink, Σ α·p_copy/p (the copy share), in DIAGNOSTICS'
    order. The NLL is `validation_mixture_nll` over lse of every column."""
    lse = torch.logsumexp(z, dim=-1)  # (n,)
    z_target = z.gather(1, targets.long()[:, None]).squeeze(1)
    z_copy = z[:, COPY_TOKEN_ID]
    nll = validation_mixture_nll(z_target, z_copy, lse, p_copy, a_sink)
    alpha = torch.exp(z_copy - lse)
    lm_nll = -torch.log(torch.exp(z_target - lse) / torch.clamp(1.0 - alpha, min=ALPHA_FLOOR) + NLL_EPS)
    share = alpha * p_copy / torch.exp(-nll)
    count = nll.new_full((), float(z.shape[0]))  # a fill: no host-to-device copy of a constant
    return torch.stack([count, nll.sum(), lm_nll.sum(), alpha.sum(), a_sink.sum(), share.sum()])


def diagnostics_line(sums: Tensor) -> str:
    """`cplm: nll 3.2742, lm_nll 3.3572, α 0.0568, a_sink 0.0028, copy_share 0.0581` (means over the rows summed
    in `sums`, PR #379's line after the val line)."""
    count, *rest = sums.double().tolist()
    nll, lm_nll, alpha, a_sink, share = (v / max(count, 1.0) for v in rest)
    return (f"cplm: nll {nll:.4f}, lm_nll {lm_nll:.4f}, α {alpha:.4f}, a_sink {a_sink:.4f}, "
            f"copy_share {share:.4f} ({int(count):,} tokens)")
