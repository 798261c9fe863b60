"""CPLM (upstream PR #379): a copy pointer mixed into the next-token distribution, as plain torch.

The next token's distribution becomes a mixture of the LM softmax and a pointer over the earlier tokens
of the same document (frontier_cplm.md §1):

    p(y) = p̃_lm(y)·(1 − α·(1 − a_sink)) + α·p_copy(y)

α is the softmax mass of the `<copy>` column (COPY_TOKEN_ID, the first padding column of lm_head), p̃_lm
the LM softmax renormalized without it, p_copy(y) the mass one pointer head puts on earlier positions
j of the query's document whose input token x_j is y, and a_sink the mass on a learned sink key (handed
back to the LM, so the mixture sums to 1 over the columns other than `<copy>`).

This module is the definition: `copy_pointer` (dense within the band, fine for CPU shapes, the reference
a fast kernel is held to) and the two mixture NLLs, the training kernel's form (`mixture_nll`) and the
validation's (`validation_mixture_nll`), which agree unless 1 − α < 1e-6 (the spec's FLAG 3).

    p_copy, a_sink = copy_pointer(q, k, k_sink, inputs, targets, cu_seqlens, band)   # (N,), (N,) fp32
    nll = mixture_nll(z_target, z_copy, lse, p_copy, a_sink)                          # (N,)
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

from perf.kernels.copy_pointer import copy_pointer_portable as copy_pointer  # the definition (perf/kernels/copy_pointer.py)
from perf.kernels.copy_pointer import pointer_documents  # noqa: F401 (re-exported)

# PR #379 (track_1_short/cplm_copy.py, its certified runs: frontier_cplm.md §2)
COPY_TOKEN_ID = 50257      # the `<copy>` column: GPT-2's first padding id (never an input)
COPY_DIM = 128             # the pointer's q/k width
COPY_BAND_TRAIN = 2048     # the training band L (blocks of L tokens; a query sees back to its block's start − L)
COPY_BAND_VAL = 8192       # the validation band (CPLM_EVAL_BLOCK=8192)
ALPHA_FLOOR = 1e-6         # 1 − α is clamped at >= 1e-6
NLL_EPS = 1e-9             # NLL = −ln(p + 1e-9)


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
