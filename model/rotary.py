"""Rotary position tables with YaRN window growth (record #360: three tables, narrow, paired, wide).

Frequencies ω_j = (1/1024)^(j/(n−1)), j < n = rotary_dim/2 (record: 32), each used by two adjacent
dims, so `rotary_dim` dims rotate; a head wider than that keeps the rest stationary (ω = 0).
Row t of a table is (cos(t·ω), sin(t·ω) with odd columns negated), rounded to bf16 as record #360
stores it; a paired table packs positions 2t and 2t+1 side by side for the paired-head layers.
The rotation that reads the tables, y = factor1·u + factor2·swap(u), is perf/kernels/qkv_rope.py
`rotate`, inside `normed_rotary_qk` (the attention's QK-norm + rotary, written once for the model and
the fused kernel's portable twin).
When the schedule grows the attention window, `rescale(old, new)` interpolates the frequencies
(YaRN, α = 1, β = 32) and grows the softmax scale by 1 + 0.2·ln(new/old).
Rows are built on demand for the T positions of a batch (the fast path may cache them).
The whole YaRN state is in the state_dict: the frequencies as a buffer, the softmax scale (a Python
float, because attention kernels take it as one) as the module's extra state, so a model loaded
from a checkpoint validates with the scales it trained with.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor, nn

YARN_ALPHA = 1.0  # record #360: frequencies turning <= 1 time in the old window are fully scaled
YARN_BETA = 32.0  # record #360: frequencies turning >= 32 times in the old window are kept
YARN_SCALE_GAIN = 0.2  # record #360: attn_scale *= 1 + 0.2·ln(new/old)
ROTARY_MIN_FREQ = 1 / 1024  # record #360: ω runs from 1 down to 1/1024


class Yarn(nn.Module):
    def __init__(self, head_dim: int, rotary_dim: int, attn_scale: float, paired: bool = False):
        super().__init__()
        if rotary_dim % 2 or rotary_dim > head_dim:
            raise ValueError(f"Yarn: rotary_dim {rotary_dim} must be even and <= head_dim {head_dim}")
        self.head_dim, self.rotary_dim, self.paired = head_dim, rotary_dim, paired
        self.initial_attn_scale = attn_scale
        self.register_buffer("angular_freq", torch.zeros(head_dim), persistent=True)  # (head_dim,)
        self.reset()

    @torch.no_grad()
    def reset(self) -> None:
        n = self.rotary_dim // 2
        freq = ROTARY_MIN_FREQ ** torch.linspace(0, 1, n, dtype=torch.float32, device=self.angular_freq.device)
        self.angular_freq.zero_()
        self.angular_freq[: self.rotary_dim] = freq.repeat_interleave(2)  # dims 2j, 2j+1 share ω_j
        self.attn_scale = self.initial_attn_scale

    @torch.no_grad()
    def rescale(self, old_window: int, new_window: int) -> None:
        """Stretch the frequencies for a window change old → new (both in tokens)."""
        if old_window <= 0 or new_window <= 0:
            raise ValueError(f"Yarn.rescale: windows must be positive tokens, got {old_window} → {new_window}")
        rotations = old_window * self.angular_freq / (2 * math.pi)
        ramp = ((rotations - YARN_ALPHA) / (YARN_BETA - YARN_ALPHA)).clamp(0, 1)
        s = old_window / new_window
        self.angular_freq.mul_(s + ramp * (1 - s))
        self.attn_scale *= 1 + YARN_SCALE_GAIN * math.log(new_window / old_window)

    def get_extra_state(self) -> dict:
        return {"attn_scale": self.attn_scale}

    def set_extra_state(self, state: dict) -> None:
        self.attn_scale = float(state["attn_scale"])

    def tables(self, num_rows: int) -> tuple[Tensor, Tensor]:
        """(factor1, factor2), bf16 [num_rows, head_dim] (paired: [num_rows, 2·head_dim])."""
        positions = torch.arange(num_rows * (2 if self.paired else 1), dtype=torch.float32,
                                 device=self.angular_freq.device)
        theta = positions[:, None] * self.angular_freq[None, :]  # (rows, head_dim)
        sign = torch.ones(self.head_dim, device=theta.device)
        sign[1::2] = -1
        factor1, factor2 = theta.cos().bfloat16(), (theta.sin() * sign).bfloat16()
        if self.paired:  # row t = [position 2t | position 2t+1]
            factor1 = factor1.reshape(num_rows, 2 * self.head_dim)
            factor2 = factor2.reshape(num_rows, 2 * self.head_dim)
        return factor1, factor2
