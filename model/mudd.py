"""MUDD (multiway dynamic dense connections) of record #360: per-token coefficients from the stream.

Two small MLPs (D → hidden, exact GELU → n) produce per-token scalars:
* blocks (`mudd_w1` [2, h, D], `mudd_w2` [2, 14, h], `mudd_b2` [2, 14], fixed output scale 0.1):
  block 0 gives layer 10's 14 coefficients; block 1 the post-loop mix's 10 coefficients plus
  per-channel-group deltas from `mudd_w2g` [14, 12, h];
* gates (`mudd_gate_w1` [2, h, D], `mudd_gate_w2` [2, 23, h], `mudd_gate_b2` [2, 23], learned
  0-D scale `mudd_gate_scale`): the pre gate (23 lanes, from x0) and the post gate (13 lanes, from
  the residual at layer 4's start).
Biases are stored divided by the output scale (record #360: track_1_short/model/gpt.py).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

MUDD_SCALE = 0.1  # record #360: fixed output scale of the MUDD blocks
MUDD_GATE_SCALE_INIT = 0.1  # record #360: init of the learned gate scale
MUDD_GROUPS = 12  # record #360: the post-loop deltas act on 12 channel groups
LAST_LAYER_MUDD_COEFS = 14  # record #360: layer 10's coefficients
POST_LOOP_MUDD_COEFS = 10  # record #360: the post-loop mix's sources
PRE_GATE_LANES = 23  # record #360: XSA 12, attention gate 6, x0 3, n-gram 2
POST_GATE_LANES = 13  # record #360: attention gate 6, x0 3, n-gram 3, skip 1

# Lane layouts (record #360: track_1_short/model/gpt.py); per-token scalars, each [T] after unpacking.
PRE_GATE_XSA = {1: slice(0, 6), 3: slice(6, 12)}
PRE_GATE_ATTN_GATE = {3: slice(12, 18)}
PRE_GATE_X0 = {0: 18, 1: 19, 2: 20}
PRE_GATE_NGRAM = {0: 21, 1: 22}
POST_GATE_ATTN_GATE = {10: slice(0, 6)}
POST_GATE_X0 = {4: 6, 5: 7, 7: 8}
POST_GATE_NGRAM = {4: 9, 5: 10, 9: 11}
POST_GATE_SKIP = 12


def mudd_block_bias(num_coefs: int) -> Tensor:
    """Stored (÷0.1) bias init of both blocks: [2, num_coefs] fp32."""
    b = torch.zeros(2, num_coefs)
    resid = math.sqrt(1.1) / MUDD_SCALE  # record #360: dynamic resid λ ≈ √1.1 (bf16 stores 10.5)
    # block 0 (layer 10): VE gates μ6, μ7 = 2.0; resid μ8, μ12 ≈ 1.05; post μ9, μ13 = 1.0; n-gram μ11 = 0.05
    for lane, value in ((6, 20.0), (7, 20.0), (8, resid), (9, 10.0), (11, 0.5), (12, resid), (13, 10.0)):
        b[0, lane] = value
    b[1, 1] = -5.0  # record #360: post-loop "backout", −0.5 on cache[7]
    return b


def mudd_gate_bias() -> Tensor:
    """Stored (÷0.1) bias init of the pre (row 0) and post (row 1) gates: [2, 23] fp32."""
    b = torch.zeros(2, PRE_GATE_LANES)
    b[0, PRE_GATE_ATTN_GATE[3]] = 2.5  # record #360: attention output gates start at 0.25
    for lane in PRE_GATE_NGRAM.values():
        b[0, lane] = 0.5  # record #360: n-gram injections start at 0.05
    b[1, POST_GATE_ATTN_GATE[10]] = 2.5
    for lane in POST_GATE_NGRAM.values():
        b[1, lane] = 0.5
    b[1, POST_GATE_SKIP] = 5.0  # record #360: skip gate starts at 0.5
    return b


def mudd_coefficients(x: Tensor, w1: Tensor, w2: Tensor, b2: Tensor, num_coefs: int) -> tuple[Tensor, Tensor]:
    """(μ [T, n], hidden [T, h]) of one block from the raw residual x [T, D]."""
    hidden = F.gelu(x @ w1.t())  # (T, h)
    mu = (hidden @ w2[:num_coefs].t() + b2[:num_coefs]) * MUDD_SCALE  # (T, n)
    return mu, hidden


def mudd_group_deltas(hidden: Tensor, w2g: Tensor, num_coefs: int) -> Tensor:
    """Per-channel-group deltas Δ [T, n, 12] of the post-loop block."""
    return torch.einsum("th,kgh->tkg", hidden, w2g[:num_coefs]) * MUDD_SCALE


def mudd_gate(x: Tensor, w1: Tensor, w2: Tensor, b2: Tensor, scale: Tensor, num_lanes: int) -> Tensor:
    """Raw gate lanes [T, n] (no squashing; consumers apply tanh/σ where the recipe says)."""
    hidden = F.gelu(x @ w1.t())
    return (hidden @ w2[:num_lanes].t() + b2[:num_lanes]) * scale.to(x.dtype)


def post_loop_mix(x: Tensor, sources: list[Tensor], mu: Tensor, delta: Tensor) -> Tensor:
    """x + Σ_k (μ_k + Δ_k,g)·src_k[g] over 12 channel groups g: [T, D]."""
    T, D = x.shape
    coef = mu[:, :, None] + delta  # (T, n, 12)
    src = torch.stack(sources, dim=1).view(T, len(sources), MUDD_GROUPS, D // MUDD_GROUPS)  # (T, n, 12, D/12)
    return x + (coef[..., None] * src).sum(dim=1).view(T, D)
