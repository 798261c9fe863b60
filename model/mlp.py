"""The ReLU² MLPs of record #360: 12 bank slots (layers 0–6, 8–10; slot 7 frozen and unused;
slot 11 the parallel MLP of layer 8), each relu(x·W1ᵀ)²·W2 with W1 = c_fc, W2 = c_proj [H, D].

Training runs the fp8 Function with the layer's post-λ folded into the down-projection scale, so
the residual add needs no multiply; validation (and devices without fp8) runs the bf16 MLP and the
residual multiplies by p itself. Both live in perf/kernels/mlp.py; this file only picks the slot.
"""
from __future__ import annotations

from torch import Tensor

from perf.kernels.mlp import Fp8MLPState, bf16_mlp, fp8_mlp

NUM_MLP_SLOTS = 12  # record #360
FROZEN_MLP_SLOT = 7  # record #360: layer 7 has no MLP; its slot never runs (per-matrix lr 0)
PARALLEL_MLP_LAYER, PARALLEL_MLP_SLOT = 8, 11  # record #360: a second MLP on layer 8's input


def mlp_slot_output(m: Tensor, mlp_weights: list[tuple[Tensor, Tensor]], slot: int,
                    fp8_state: Fp8MLPState | None, fold_p: Tensor | None = None, m8: Tensor | None = None) -> Tensor:
    """MLP of bank slot `slot` on the normed input m [T, D]: fp8 (p·MLP if fold_p) or bf16 (MLP).

    mlp_weights: the bank's (c_fc, c_proj) pairs, [H, D] each, unbound once per forward.
    """
    w1, w2 = mlp_weights[slot]
    if fp8_state is None:
        return bf16_mlp(m, w1, w2)
    return fp8_mlp(m, w1, w2, fold_p, fp8_state, slot, x8=m8)
