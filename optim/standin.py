"""Parameters with the GPT's names, dtypes and (scaled) shapes but no forward pass
(record #360: track_1_short/model/gpt.py). Kept beside the real model for two things it cannot give cheaply:
bank matrix counts that need padding on 2 and 4 ranks (`small`: the GPT's 48/16/24 always divide),
and record-shaped real tensors for tools/bench_optim.py without the model's buffers. The table and
frozen-slot tests run on the real GPT (tests/optim/test_optim_model_wiring.py), which also checks
that this list keeps the GPT's names, record shapes and dtypes.

    python -c "from optim.standin import StandInParams; print(StandInParams.record())"
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class StandInDims:
    vocab: int = 50304          # record #360: 50257 padded to a multiple of 128
    dim: int = 768
    qk_groups: int = 48         # 42 live + 6 zero padding (record #360)
    qk_rows: int = 256          # two heads of 128
    vo_matrices: int = 16       # 14 live + 2 padding
    mlp_slots: int = 12         # 11 layers + the parallel MLP
    mlp_hidden: int = 2816
    mudd_hidden: int = 64
    mudd_groups: int = 12


class _Weight(nn.Module):
    def __init__(self, t: torch.Tensor):
        super().__init__()
        self.weight = nn.Parameter(t)


class StandInParams(nn.Module):
    """The record model's parameter list: bf16 matrices, fp32 scalars and lambdas."""

    def __init__(self, d: StandInDims = StandInDims(), seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)

        def uniform(*shape, bound=1 / 32, dtype=torch.bfloat16):
            return ((torch.rand(shape, generator=g) * 2 - 1) * bound).to(dtype)

        D, V = d.dim, d.vocab
        self.lm_head = _Weight((torch.randn(D, V, generator=g) * 0.005).bfloat16())  # stored [D, V]
        self.embed = _Weight(self.lm_head.weight.data.mT.contiguous())               # tied at init
        self.value_embeds = nn.Parameter((torch.randn(4 * V, D, generator=g) * 0.01).bfloat16())
        self.ve_gate_bank = nn.Parameter(uniform(3, 6, 12))
        self.qk_bank = nn.Parameter(uniform(d.qk_groups, d.qk_rows, D))
        self.vo_bank = nn.Parameter(uniform(d.vo_matrices, D, D))
        self.mlp_bank = nn.Parameter(uniform(d.mlp_slots, 2, d.mlp_hidden, D))
        self.smear_gate = _Weight(uniform(1, 12))
        self.post_lambdas = nn.Parameter(torch.ones(11, 2))
        self.resid_lambdas = nn.Parameter(torch.full((11, 2), 1.1 ** 0.5))
        self.scalars = nn.Parameter(torch.tensor([0.5, 1.0] * 11 + [0.0, -1.5]))
        H, G = d.mudd_hidden, d.mudd_groups
        self.mudd_w1 = nn.Parameter(uniform(2, H, D, bound=D ** -0.5))
        self.mudd_w2 = nn.Parameter(uniform(2, 14, H))
        self.mudd_b2 = nn.Parameter(uniform(2, 14))
        self.mudd_w2g = nn.Parameter(uniform(14, G, H))
        self.mudd_gate_scale = nn.Parameter(torch.tensor(0.1))
        self.mudd_gate_w1 = nn.Parameter(uniform(2, H, D, bound=D ** -0.5))
        self.mudd_gate_w2 = nn.Parameter(uniform(2, 23, H))
        self.mudd_gate_b2 = nn.Parameter(uniform(2, 23))

    @classmethod
    def record(cls, seed: int = 0) -> "StandInParams":
        return cls(StandInDims(), seed)

    @classmethod
    def small(cls, seed: int = 0) -> "StandInParams":
        """CPU-test size. Bank matrix counts 6, 3 and 8 exercise padding for 4 and 2 ranks."""
        return cls(StandInDims(vocab=96, dim=32, qk_groups=6, qk_rows=16, vo_matrices=3, mlp_slots=4,
                               mlp_hidden=48, mudd_hidden=8, mudd_groups=4), seed)

    def random_grads(self, seed: int) -> None:
        """Fill every .grad with fresh noise (accumulating, as backward would)."""
        g = torch.Generator().manual_seed(seed)
        for p in self.parameters():
            noise = torch.randn(p.shape, generator=g).to(p.dtype)
            p.grad = noise if p.grad is None else p.grad + noise
