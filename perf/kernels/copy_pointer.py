"""The CPLM pointer head (upstream PR #379, frontier_cplm.md §5): the definition, dense in its band.

Query i, in block b = ⌊i/L⌋ of L tokens, sees source j iff j < i, doc(j) = doc(i) and j ≥ bL − L;
s_ij = q_i·k_j/√d and the sink's s0_i = q_i·k_sink/√d (fp32 accumulation); Z_i = e^s0_i + Σ_valid e^s_ij,
a_sink_i = e^s0_i/Z_i and p_copy_i = Σ_{valid j: x_j = y_i} e^s_ij/Z_i. A query without a source gets
a_sink 1, p_copy 0; the current token is never its own source.

perf sits below model (docs/design.md), so the math lives here, with the kernels that implement it;
model/cplm.py (the mixture) calls `copy_pointer`.

    p_copy, a_sink = copy_pointer_portable(q, k, k_sink, inputs, targets, cu_seqlens, band)   # (N,), (N,) fp32
"""
from __future__ import annotations

import math

import torch
from torch import Tensor


def pointer_documents(cu_seqlens: Tensor, n: int) -> Tensor:
    """doc(i) [n] int64: the number of cu_seqlens entries <= i (entries clamped to n): equal for
    positions of one attention segment (training) or one BOS-delimited document (validation)."""
    cu = cu_seqlens.long().clamp(max=n)
    return torch.searchsorted(cu, torch.arange(n, device=cu.device), right=True)


def copy_pointer_portable(q: Tensor, k: Tensor, k_sink: Tensor, inputs: Tensor, targets: Tensor, cu_seqlens: Tensor,
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
        raise ValueError(f"copy_pointer_portable: q, k must be [N, d], k_sink [d], inputs and targets [N]; got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(k_sink.shape)}, {tuple(inputs.shape)}, "
                         f"{tuple(targets.shape)}")
    if band < 1:
        raise ValueError(f"copy_pointer_portable: band must be a positive token count, got {band}")
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
