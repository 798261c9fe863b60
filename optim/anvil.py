"""ANVIL, the bank optimizer of record #360: twin-rail velocity, Nesterov lookahead, Frobenius
normalization from the first Gram's trace, a cascade of six quintic maps, a per-lane equalizer,
and sign-aligned (cautious) decay on an fp32 master weight kept as bf16 + a uint16 sidecar.

This is the portable definition (plain PyTorch, bf16 matmuls as on the GPU). It works on one
rank's chunk of a bank: a [matrices, rows, cols] bf16 view. Sharding, comms and the schedule live
in optim/manager.py; NorMuon (record #89), which shares the equalizer and the master-weight
update, is in optim/normuon.py. Reference: record #360's track_1_short/optim/anvil.py.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from perf.kernels.symmetric_matmul import poly, xtx, xxt

# Six quintic maps X <- aX + b(XX^T)X + c(XX^T)^2 X, re-derived for record #360 (not Polar
# Express). The product of the a's is 643.13 (the small-singular-value gain); on normalized
# singular values in [3e-3, 1/1.05] the composed map stays inside [0.9951, 1.00041].
ANVIL_MAPS = (
    (3.923798038567, -6.095026865488, 3.905234618423),
    (3.278126713798, -3.328923386476, 0.989127286973),
    (3.505298394150, -5.137358782410, 1.968325560615),
    (2.815058591845, -3.685181239622, 1.417196497642),
    (2.245503932403, -2.443826979899, 0.963091710461),
    (2.256537145403, -2.166840097229, 0.929501253245),
)
LANE_ENERGY_FLOOR = 1e-10  # record #360: the equalizer's rsqrt floor (and its norm-ratio floor)
# record #360: matrices with more rows than this (mlp, 2816) do aX + XB as a matmul then an add
# (two bf16 roundings); smaller ones as one fused baddbmm (one rounding). Kept for the rounding.
SPLIT_BADDBMM_MIN_ROWS = 1024


def is_tall(x: Tensor) -> bool:
    """Tall matrices (rows > cols) take the small Gram X^T X and multiply on the right."""
    return x.size(-2) > x.size(-1)


def gram(x: Tensor) -> Tensor:
    """The small Gram matrix of each matrix in the batch: X^T X if tall, else X X^T (bf16).
    Symmetric, so the fast path computes only its upper tiles (perf/kernels/symmetric_matmul.py)."""
    return xtx(x) if is_tall(x) else xxt(x)


def quintic_maps(x: Tensor, maps, first_gram: Tensor | None = None) -> Tensor:
    """Apply X <- aX + X(bA + cA^2) (tall) or aX + (bA + cA^2)X (wide), A = the small Gram, for
    each (a, b, c) in `maps`, in bf16 as on the GPU. `first_gram` is reused for the first map
    (ANVIL has it from the normalization). The symmetric products (the Gram A and bA + cA^2) go
    through perf/kernels/symmetric_matmul.py; the X update is a plain GEMM (not symmetric)."""
    tall = is_tall(x)
    split = x.size(-2) > SPLIT_BADDBMM_MIN_ROWS
    fused = torch.baddbmm if x.dim() == 3 else torch.addmm
    for k, (a, b, c) in enumerate(maps):
        a_mat = first_gram if (k == 0 and first_gram is not None) else gram(x)
        b_mat = poly(a_mat, b, c)                                     # bA + cA^2
        left, right = (x, b_mat) if tall else (b_mat, x)
        if split:
            x = (left @ right).add_(x, alpha=a)
        else:
            x = fused(x, left, right, beta=a)                         # aX + XB (or BX)
    return x


def anvil_cascade(x: Tensor, margin: float = 1.05, eps: float = 1e-6, maps=ANVIL_MAPS) -> Tensor:
    """Drive every singular value of each matrix of x (bf16, [..., rows, cols]) towards 1.

    The first Gram's trace is ||X||_F^2, so normalization is free: X / d and A / d^2 with
    d = margin * ||X||_F + eps (record #360: 1.05, 1e-6), and A feeds the first map."""
    a_mat = gram(x)
    trace = a_mat.diagonal(dim1=-2, dim2=-1).float().sum(-1)[..., None, None]
    d = trace.sqrt() * margin + eps
    x = (x.float() / d).bfloat16()
    a_mat = (a_mat.float() / d.square()).bfloat16()
    return quintic_maps(x, maps, first_gram=a_mat)


def lane_reduce_dim(chunk_shape) -> int:
    """Lanes run along the longer dimension: one per row when rows >= cols, else one per column."""
    return -1 if chunk_shape[-2] >= chunk_shape[-1] else -2


def lane_energy_shape(chunk_shape) -> tuple[int, ...]:
    chunk_shape = tuple(chunk_shape)
    if lane_reduce_dim(chunk_shape) == -1:
        return (*chunk_shape[:-1], 1)
    return (*chunk_shape[:-2], 1, chunk_shape[-1])


def lane_equalize(v: Tensor, lane_energy: Tensor, beta2: float) -> Tensor:
    """NorMuon's per-lane variance estimator (record #89's train_gpt.py, record #360's
    track_1_short/optim/anvil.py step 5), in place on v.

    Each lane is scaled by rsqrt(EMA of its mean squared update), then the whole matrix is
    rescaled to its pre-equalization Frobenius norm. lane_energy (fp32) is updated in place."""
    dim = lane_reduce_dim(v.shape)
    lane_len = v.size(dim)
    lane_power = v.float().square().mean(dim=dim, keepdim=True)
    pre_norm = (lane_power.sum(dim=(-2, -1), keepdim=True) * lane_len).sqrt()
    lane_energy.lerp_(lane_power, 1 - beta2)
    gain = lane_energy.clamp_min(LANE_ENERGY_FLOOR).rsqrt()
    post_norm = (lane_power * lane_len * gain.square()).sum(dim=(-2, -1), keepdim=True).sqrt()
    scale = gain * (pre_norm / post_norm.clamp_min(LANE_ENERGY_FLOOR))
    return v.mul_(scale.to(v.dtype))


def master_weight(p: Tensor, mantissa: Tensor) -> Tensor:
    """fp32 master value from the bf16 weight (high 16 bits) and the uint16 sidecar (low 16)."""
    hi = p.view(torch.int16).to(torch.int32) << 16
    lo = mantissa.view(torch.int16).to(torch.int32) & 0xFFFF
    return (hi | lo).view(torch.float32)


def store_master_weight(master: Tensor, p: Tensor, mantissa: Tensor) -> None:
    """Split fp32 `master` back into the bf16 weight (truncated high half) and the sidecar."""
    bits = master.view(torch.int32)
    p.view(torch.int16).copy_((bits >> 16).to(torch.int16))
    mantissa.view(torch.int16).copy_(((bits << 16) >> 16).to(torch.int16))  # low half, sign-extended


def cautious_master_update(p: Tensor, mantissa: Tensor, update: Tensor, gate: Tensor,
                           eff_wd: float | Tensor, eff_lr: Tensor) -> None:
    """p <- p - [gate * p >= 0] * p * eff_wd * eff_lr - update * eff_lr on the fp32 master value.

    p is a bf16 [matrices, rows, cols] view (written in place); eff_lr is per matrix
    ([matrices, 1, 1] fp32); eff_wd a float or a 0-D fp32 tensor holding it (bitwise the same).
    Decay where the gate and the weight agree in sign (0 counts as agreeing, record #89/#360
    convention: >= 0)."""
    if p.dtype != torch.bfloat16 or mantissa.dtype != torch.uint16:
        raise TypeError(f"master update needs a bf16 weight and a uint16 sidecar, got {p.dtype} "
                        f"and {mantissa.dtype}")
    master = master_weight(p, mantissa)
    aligned = (gate.float() * master) >= 0
    master = master - master * aligned * eff_wd * eff_lr - update.float() * eff_lr
    store_master_weight(master, p, mantissa)


@dataclass
class BankState:
    """One rank's optimizer state for one bank chunk ([matrices, rows, cols])."""
    velocity: Tensor      # fp32 [2, matrices, rows, cols]: ANVIL's fast and slow rail (NorMuon: [1, ...])
    lane_energy: Tensor   # fp32, the equalizer's per-lane EMA
    mantissa: Tensor      # uint16 [matrices, rows, cols]: low half of the fp32 master weights

    @classmethod
    def zeros(cls, chunk_shape, rails: int = 2, device=None) -> "BankState":
        chunk_shape = tuple(chunk_shape)
        return cls(velocity=torch.zeros((rails, *chunk_shape), dtype=torch.float32, device=device),
                   lane_energy=torch.zeros(lane_energy_shape(chunk_shape), dtype=torch.float32,
                                           device=device),
                   mantissa=torch.zeros(chunk_shape, dtype=torch.uint16, device=device))

    def zero_(self) -> None:
        self.velocity.zero_()
        self.lane_energy.zero_()
        self.mantissa.zero_()


@dataclass(frozen=True)
class BankStepScalars:
    """The per-step numbers a bank update reads (set from the schedule by optim/manager.py).

    The ones that change from step to step (momentum, eff_wd, fast_beta, momentum_lerp) may be
    Python floats or 0-D fp32 tensors holding them: a captured CUDA graph reads them from device
    memory that changes in place. Both forms give bitwise the same update (each value is rounded
    once to fp32 where it is used)."""
    momentum: float | Tensor   # Nesterov lookahead: the scheduled rail beta (NorMuon: its momentum)
    eff_wd: float | Tensor     # wd_mul * weight_decay * lr
    eff_lr: Tensor             # fp32 [matrices, 1, 1]: lr_mul * shape multiplier * per-matrix mul * lr
    fast_beta: float | Tensor = 0.0  # ANVIL: the fast rail's beta this step
    fast_weight: float = 1.0   # ANVIL: the fast rail's weight in the blend
    slow_beta: float = 0.98    # record #360 RAIL_SLOW_BETA
    beta2: float = 0.9         # record #360: equalizer EMA
    margin: float = 1.05       # record #360 FROBENIUS_MARGIN
    eps: float = 1e-6          # record #360 FROBENIUS_EPS
    momentum_lerp: float | Tensor | None = None  # NorMuon: 1 − momentum rounded once (None: from momentum)


def one_minus_fp32(x: float | Tensor) -> float | Tensor:
    """1 − fp32(x) computed in fp32, as record #360 computes it from its 0-D fp32 scalar tensors
    (not fp32(1 − x): the two differ in the last bit for most x, e.g. 0.9). A 0-D fp32 tensor x
    gives the same value as a 0-D tensor (an fp32 subtraction on the device)."""
    if isinstance(x, Tensor):
        return 1 - x
    return float(np.float32(1.0) - np.float32(x))


def twin_rail_lookahead(g: Tensor, velocity: Tensor, s: BankStepScalars) -> Tensor:
    """Update both rails from the fp32 gradient g and return the Nesterov lookahead
    (1 − μ)·G + μ·blend. The fast rail's lerp weight and the blend's slow weight are 1 − fp32(β)
    and 1 − fp32(w) in fp32 (record #360 rounds them so); the slow rail's is fp32(1 − 0.98), a
    constant in record #360 too."""
    fast, slow = velocity[0], velocity[1]
    fast.lerp_(g, one_minus_fp32(s.fast_beta))
    slow.lerp_(g, 1 - s.slow_beta)   # accumulates from step 0; gates the decay
    blend = s.fast_weight * fast + one_minus_fp32(s.fast_weight) * slow
    return g.lerp(blend, s.momentum)  # Nesterov lookahead: (1 - mu) G + mu B


def anvil_update(p: Tensor, grad: Tensor, state: BankState, s: BankStepScalars) -> None:
    """One ANVIL step on a bank chunk p (bf16 [matrices, rows, cols], updated in place) from its
    rank-averaged gradient `grad` (same shape)."""
    u = twin_rail_lookahead(grad.float(), state.velocity, s)
    x = anvil_cascade(u.bfloat16(), s.margin, s.eps)
    x = lane_equalize(x, state.lane_energy, s.beta2)
    slow = state.velocity[1]  # the slow rail gates the decay
    cautious_master_update(p, state.mantissa, x, slow, s.eff_wd, s.eff_lr)


def rail_settings(step: int, rail_beta: float, engaged: bool, fast_beta: float = 0.85,
                  fast_weight: float = 0.4385) -> tuple[float, float]:
    """(fast rail beta, fast rail weight) at `step`: before the engage step the fast rail follows
    the scheduled rail beta and is used alone (plain Nesterov momentum); afterwards it is fixed
    at 0.85 and blended 0.4385 : 0.5615 with the slow rail (record #360, step 514)."""
    return (fast_beta, fast_weight) if engaged else (rail_beta, 1.0)


def shape_lr_multiplier(chunk_shape) -> float:
    """max(1, rows / cols)^0.5 (record #360: 1.915 for mlp 2816x768, 1 for qk and vo)."""
    return max(1.0, chunk_shape[-2] / chunk_shape[-1]) ** 0.5


def cascade_flops(chunk_shape, n_maps: int = len(ANVIL_MAPS)) -> int:
    """Multiply-add FLOPs (2 per MAC) of one cascade over a [matrices, rows, cols] chunk: the
    Gram (n_maps times: the first one doubles as the normalization), A^2, and the X update."""
    m, r, c = chunk_shape
    big, small = max(r, c), min(r, c)
    per_map = 2 * big * small * small * 2 + 2 * small ** 3  # Gram + X-update, and A @ A
    return m * n_maps * per_map
