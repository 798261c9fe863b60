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

# PR #379 (track_1_short/cplm_copy.py, its certified runs: frontier_cplm.md §2)
COPY_TOKEN_ID = 50257      # the `<copy>` column: GPT-2's first padding id (never an input)
COPY_DIM = 128             # the pointer's q/k width
COPY_BAND_TRAIN = 2048     # the training band L (blocks of L tokens; a query sees back to its block's start − L)
COPY_BAND_VAL = 8192       # the validation band (CPLM_EVAL_BLOCK=8192)
ALPHA_FLOOR = 1e-6         # 1 − α is clamped at >= 1e-6
NLL_EPS = 1e-9             # NLL = −ln(p + 1e-9)


def pointer_documents(cu_seqlens: Tensor, n: int) -> Tensor:
    """doc(i) [n] int64: the number of cu_seqlens entries <= i (entries clamped to n): equal for
    positions of one attention segment (training) or one BOS-delimited document (validation)."""
    cu = cu_seqlens.long().clamp(max=n)
    return torch.searchsorted(cu, torch.arange(n, device=cu.device), right=True)


def copy_pointer(q: Tensor, k: Tensor, k_sink: Tensor, inputs: Tensor, targets: Tensor, cu_seqlens: Tensor,
                 band: int) -> tuple[Tensor, Tensor]:
    """The pointer head (frontier_cplm.md §5): (p_copy [N], a_sink [N]) fp32, differentiable in q, k, k_sink.

    q, k [N, d] (already QK-normed, q gained; bf16 in a run), k_sink [d]; inputs [N] (x_j, the tokens
    a source copies), targets [N] (y_i); cu_seqlens the documents (see `pointer_documents`); band L.
    Query i, in block b = ⌊i/L⌋, sees source j iff j < i, doc(j) = doc(i) and j ≥ bL − L. Scores in fp32,
    s_ij = q_i·k_j/√d, s0_i = q_i·k_sink/√d; Z_i = e^s0_i + Σ_valid e^s_ij; a_sink_i = e^s0_i/Z_i and
    p_copy_i = Σ_{valid j: x_j = y_i} e^s_ij/Z_i. A query without a source gets a_sink 1, p_copy 0.
    Computed per block against the 2L keys it may see ([⌈N/L⌉, L, 2L] scores: dense in the band)."""
    N, d = q.shape
    if k.shape != (N, d) or k_sink.shape != (d,) or inputs.shape != (N,) or targets.shape != (N,):
        raise ValueError(f"copy_pointer: q, k must be [N, d], k_sink [d], inputs and targets [N]; got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(k_sink.shape)}, {tuple(inputs.shape)}, "
                         f"{tuple(targets.shape)}")
    if band < 1:
        raise ValueError(f"copy_pointer: band must be a positive token count, got {band}")
    scale = 1.0 / math.sqrt(d)
    blocks = -(-N // band)
    pad = blocks * band - N
    device = q.device
    doc = pointer_documents(cu_seqlens, N)
    # keys padded by one band in front (block 0's "previous block") and to whole blocks behind
    kp = torch.cat([k.new_zeros(band, d), k, k.new_zeros(pad, d)]).float()  # (band + blocks·band, d)
    xp = torch.cat([inputs.new_full((band,), -1), inputs, inputs.new_full((pad,), -1)]).long()
    dp = torch.cat([doc.new_full((band,), -1), doc, doc.new_full((pad,), -2)])
    qb = torch.cat([q, q.new_zeros(pad, d)]).float().view(blocks, band, d)  # (B, L, d)
    window = torch.arange(blocks, device=device)[:, None] * band + torch.arange(2 * band, device=device)  # (B, 2L)
    kw, xw, dw = kp[window], xp[window], dp[window]  # (B, 2L, d), (B, 2L), (B, 2L): keys bL − L .. bL + L − 1
    i = torch.arange(blocks * band, device=device).view(blocks, band)  # (B, L) query positions
    j = window - band  # (B, 2L) key positions
    qdoc = torch.cat([doc, doc.new_full((pad,), -3)]).view(blocks, band)
    valid = (j[:, None, :] < i[:, :, None]) & (dw[:, None, :] == qdoc[:, :, None])  # (B, L, 2L)
    yq = torch.cat([targets.long(), targets.new_full((pad,), -4).long()]).view(blocks, band)
    hit = valid & (xw[:, None, :] == yq[:, :, None])
    s = torch.einsum("bld,bmd->blm", qb, kw) * scale  # (B, L, 2L)
    s0 = (qb @ k_sink.float()) * scale  # (B, L)
    s = s.masked_fill(~valid, float("-inf"))
    m = torch.maximum(s0, s.amax(-1))  # (B, L): finite (s0 is)
    e = torch.exp(s - m[..., None])  # 0 where invalid
    e0 = torch.exp(s0 - m)
    z = e0 + e.sum(-1)
    p_copy = (e * hit).sum(-1) / z
    a_sink = e0 / z
    return p_copy.reshape(-1)[:N], a_sink.reshape(-1)[:N]


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
