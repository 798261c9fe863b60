"""NorMuon, record #89's bank optimizer, kept so researchers can compare ANVIL against it
(`OptimConfig.bank_optimizer = "normuon"`). Reference: record #89's train_gpt.py (PR #342), NorMuonAndAdam.

Differences from ANVIL (optim/anvil.py): one momentum buffer instead of two rails; a separate
Frobenius-norm pass (margin 1.02) then 5 Polar Express maps instead of 6 ANVIL maps; cautious
decay gated on the *update's* sign instead of the slow rail's; weight decay 1.2 instead of 2.25.
The per-lane equalizer and the fp32 master weight (bf16 + uint16 sidecar) are shared.
"""
from __future__ import annotations

from torch import Tensor

from optim.anvil import BankState, BankStepScalars, cautious_master_update, lane_equalize, quintic_maps

# Polar Express coefficients for 5 iterations, safety factor 2e-2, cushion 2 (record #89's train_gpt.py).
POLAR_EXPRESS_MAPS = (
    (8.156554524902461, -22.48329292557795, 15.878769915207462),
    (4.042929935166739, -2.808917465908714, 0.5000178451051316),
    (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
    (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
    (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
)


def polar_express(x: Tensor, margin: float = 1.02, eps: float = 1e-6) -> Tensor:
    """X / (margin * ||X||_F + eps) per matrix (a separate norm pass on the bf16 X), then the five
    Polar Express maps in bf16 (record #89: margin 1.02, eps 1e-6)."""
    norm = x.float().square().sum(dim=(-2, -1), keepdim=True).sqrt()
    x = (x.float() / (norm * margin + eps)).bfloat16()
    return quintic_maps(x, POLAR_EXPRESS_MAPS)


def normuon_update(p: Tensor, grad: Tensor, state: BankState, s: BankStepScalars) -> None:
    """One NorMuon step on a bank chunk p (bf16 [matrices, rows, cols], in place) from its
    rank-averaged gradient. state.velocity holds one rail ([1, ...]): the momentum buffer."""
    g = grad.float()
    buf = state.velocity[0]
    buf.lerp_(g, 1 - s.momentum if s.momentum_lerp is None else s.momentum_lerp)
    u = g.lerp(buf, s.momentum)      # Nesterov: (1 - mu) G + mu buf
    x = polar_express(u.bfloat16(), s.margin, s.eps)
    x = lane_equalize(x, state.lane_energy, s.beta2)
    cautious_master_update(p, state.mantissa, x, x, s.eff_wd, s.eff_lr)


def muon_momentum(step: int, total_steps: int, warmup: int = 300, cooldown: int = 50,
                  lo: float = 0.85, hi: float = 0.95) -> float:
    """Record #89's momentum schedule: 0.85 -> 0.95 over 300 steps, back to 0.85 over the last 50."""
    if step < warmup:
        return lo + (hi - lo) * step / warmup
    if step > total_steps - cooldown:
        return hi - (hi - lo) * (step - (total_steps - cooldown)) / cooldown
    return hi
