"""The ReLU² MLP of record #360: the training fp8 autograd Function (portable twin) and the bf16 MLP.

    out = relu(x @ W1ᵀ)² @ W2        W1 = c_fc [H, D], W2 = c_proj [H, D], x the normed residual [T, D]

Training (record_360.md §4.3), all scales per-tensor fp32, per bank slot k:
  s_x = 2⁻⁴ static (post-RMS-norm rows have max|x| ≤ √768 < 448·2⁻⁴); s_w1[k], s_w2[k] exact
  (bf16 amax/448) for the first 16 refreshes after init or `rearm`, then the previous refresh's
  per-64×64-tile amaxes × 1.12/448; s_post[k] delayed (last step's amax of relu(pre)² × 1.03/448);
  s_g = 2⁻⁶ static e5m2 for the incoming gradient; s_dpre[k] delayed (last step's amax × 1.25/57344).
  A delayed scale whose amax is still 0 keeps its value. A clamp precedes every fp8 cast, and no
  gradient GEMM uses fast accumulation.
The post-λ fold: the residual's post λ p rides the down-projection's dequant scale (s_w2·p forward,
s_w2·s_g·p in the dgrad), so the caller adds the output without a multiply; p's gradient is
⟨dW2′, W2⟩ in fp32 against the master W2 (dW2′ = dL/d(p·W2)), and dW2 = p·dW2′.

This is the portable path: torch float8 casts and torch._scaled_mm, which run on CPU. The compute
dtype follows x (bf16 in the model; fp32 inputs give fp32 intermediates, which the tests use).
The Triton kernels of the fast path must match `Fp8MLPFunction` and come with their own issue.
Tests: tests/perf/test_perf_mlp_fp8.py.
"""
from __future__ import annotations

import torch
from torch import Tensor, nn

from perf.fp8 import E4M3, E4M3_MAX, E5M2, E5M2_MAX, quantize, scaled_mm, tile_amax

FP8_MLP_X_SCALE = 2.0 ** -4  # record #360: static e4m3 scale of the normed MLP input
FP8_GRAD_SCALE = 2.0 ** -6  # record #360: static e5m2 scale of the incoming gradient
FP8_WEIGHT_HEADROOM = 1.12  # record #360: the delayed weight amax is one refresh old
FP8_POST_HEADROOM = 1.03  # record #360: delayed relu(pre)² scale headroom
FP8_DPRE_HEADROOM = 1.25  # record #360: delayed dpre scale headroom
FP8_EXACT_SCALE_CALLS = 16  # record #360: exact weight scales for the first 16 refreshes
WEIGHT_TILE = 64  # record #360: weight amaxes are kept per 64×64 tile (what the Triton kernel emits)


class Fp8MLPState(nn.Module):
    """Per-slot fp8 weight caches and scales of an MLP bank [S, 2, H, D] (non-persistent buffers).

    `refresh(bank)` runs after every optimizer step, before the next training forward; the
    forward/backward record the activation amaxes the next refresh turns into delayed scales.
    """

    def __init__(self, num_slots: int, hidden_dim: int, model_dim: int, device=None):
        super().__init__()
        S, H, D = num_slots, hidden_dim, model_dim
        n_tiles = (-(-H // WEIGHT_TILE)) * (-(-D // WEIGHT_TILE))
        f32 = dict(dtype=torch.float32, device=device)
        buffers = {
            # each weight in both layouts: row-major [S, H, D] and column-major, stored as [S, D, H]
            "w1_f8": torch.zeros(S, H, D, dtype=E4M3, device=device),
            "w1_f8_col": torch.zeros(S, D, H, dtype=E4M3, device=device),
            "w2_f8": torch.zeros(S, H, D, dtype=E4M3, device=device),
            "w2_f8_col": torch.zeros(S, D, H, dtype=E4M3, device=device),
            "w1_scale": torch.ones(S, **f32),
            "w2_scale": torch.ones(S, **f32),
            "w1_tile_amax": torch.zeros(S, n_tiles, **f32),
            "w2_tile_amax": torch.zeros(S, n_tiles, **f32),
            "post_scale": torch.ones(S, **f32),
            "post_amax": torch.zeros(S, **f32),
            "dpre_scale": torch.full((S,), FP8_GRAD_SCALE, **f32),
            "dpre_amax": torch.zeros(S, **f32),
            "x_scale": torch.tensor(FP8_MLP_X_SCALE, **f32),
            "grad_scale": torch.tensor(FP8_GRAD_SCALE, **f32),
        }
        for name, buf in buffers.items():
            self.register_buffer(name, buf, persistent=False)
        self.refresh_calls = 0

    @torch.no_grad()
    def refresh(self, bank: Tensor) -> None:
        """Quantize bank [S, 2, H, D] (c_fc, c_proj) into the caches and roll the delayed scales."""
        if bank.shape[0] != self.w1_f8.shape[0] or bank.shape[2:] != self.w1_f8.shape[1:]:
            raise ValueError(f"Fp8MLPState.refresh: bank {tuple(bank.shape)} does not match the state's "
                             f"[{self.w1_f8.shape[0]}, 2, {self.w1_f8.shape[1]}, {self.w1_f8.shape[2]}]")
        exact = self.refresh_calls < FP8_EXACT_SCALE_CALLS
        self.refresh_calls += 1
        for w, scale, amax, row, col in (
                (bank[:, 0], self.w1_scale, self.w1_tile_amax, self.w1_f8, self.w1_f8_col),
                (bank[:, 1], self.w2_scale, self.w2_tile_amax, self.w2_f8, self.w2_f8_col)):
            if exact:  # in the weights' own dtype (bf16 in training), as record #360 does
                scale.copy_((w.reshape(w.shape[0], -1).abs().amax(dim=1).clamp(min=1e-12) / E4M3_MAX).float())
            else:  # the previous refresh's tile amaxes, 12% headroom for one step of movement
                scale.copy_((amax.amax(dim=1) * (FP8_WEIGHT_HEADROOM / E4M3_MAX)).clamp(min=1e-12))
            row.copy_(quantize(w, scale[:, None, None], E4M3))
            col.copy_(row.transpose(1, 2))
            amax.copy_(tile_amax(w, WEIGHT_TILE))
        _roll_delayed(self.post_amax, self.post_scale, FP8_POST_HEADROOM / E4M3_MAX, 1e-6)
        _roll_delayed(self.dpre_amax, self.dpre_scale, FP8_DPRE_HEADROOM / E5M2_MAX, 1e-12)

    @torch.no_grad()
    def rearm(self) -> None:
        """After the post-warmup reset: exact weight scales again, warmup amaxes forgotten."""
        self.refresh_calls = 0
        for amax in (self.w1_tile_amax, self.w2_tile_amax, self.post_amax, self.dpre_amax):
            amax.zero_()
        self.post_scale.fill_(1.0)
        self.dpre_scale.fill_(FP8_GRAD_SCALE)

    def quantize_input(self, x: Tensor) -> Tensor:
        """e4m3 copy of the normed MLP input (shared by the two MLPs of the parallel layer)."""
        return quantize(x, self.x_scale, E4M3)


def _roll_delayed(amax: Tensor, scale: Tensor, gain: float, floor: float) -> None:
    """scale ← max(amax·gain, floor) where an amax was recorded (amax > 0); then clear the amaxes."""
    a = torch.nan_to_num(amax, nan=0.0, posinf=0.0, neginf=0.0)
    scale.copy_(torch.where(a > 0, (a * gain).clamp(min=floor), scale))
    amax.zero_()


class Fp8MLPFunction(torch.autograd.Function):
    """relu(x @ W1ᵀ)² @ (p·W2) through the fp8 caches of `slot`; p (0-D) or None (no fold)."""

    @staticmethod
    def forward(ctx, x: Tensor, w1: Tensor, w2: Tensor, p: Tensor | None, x8: Tensor,
                state: Fp8MLPState, slot: int) -> Tensor:
        k = slot
        dtype = x.dtype
        p_val = p.detach().float() if p is not None else torch.ones((), device=x.device)
        # pre = (x8 · W1_8ᵀ)·s_x·s_w1, rounded once to the compute dtype; post = relu(pre)²
        pre = scaled_mm(x8, state.w1_f8[k].t(), state.x_scale, state.w1_scale[k], dtype, True)  # (T, H)
        post = torch.relu(pre).square()
        state.post_amax[k] = torch.maximum(state.post_amax[k], post.detach().float().amax())
        post8 = quantize(post, state.post_scale[k], E4M3)  # (T, H); post ≥ 0 so only the top clamps
        # out = (post8 · W2_8)·s_post·(s_w2·p): the post λ rides the weight dequant scale
        out = scaled_mm(post8, state.w2_f8_col[k].t(), state.post_scale[k], state.w2_scale[k] * p_val, dtype, True)
        ctx.save_for_backward(x8, post8, w2, p)
        ctx.state, ctx.slot, ctx.has_p, ctx.dtype, ctx.w1_dtype = state, k, p is not None, dtype, w1.dtype
        ctx.scales = (state.post_scale[k].clone(), p_val)
        return out  # (T, D)

    @staticmethod
    def backward(ctx, g: Tensor):
        x8, post8, w2, p = ctx.saved_tensors
        state, k, dtype = ctx.state, ctx.slot, ctx.dtype
        s_post, p_val = ctx.scales
        s_g = state.grad_scale
        g8 = quantize(g, s_g, E5M2)  # (T, D)
        # dW2′ = post8ᵀ·g8 = dL/d(p·W2); no fast accumulation on gradient GEMMs
        dw2_folded = scaled_mm(post8.t(), g8, s_post, s_g, dtype, False)  # (H, D)
        grad_p = None
        if ctx.has_p and ctx.needs_input_grad[3]:
            grad_p = (dw2_folded.float() * w2.float()).sum().to(p.dtype)  # ⟨dW2′, W2⟩ in fp32
        dw2 = (dw2_folded.float() * p_val).to(w2.dtype) if ctx.has_p else dw2_folded.to(w2.dtype)
        # dpre = 2·(g · (p·W2)ᵀ)·relu(pre), relu(pre) rebuilt as √(post8·s_post)
        acc = scaled_mm(g8, state.w2_f8[k].t(), s_g, state.w2_scale[k] * p_val, torch.float32, False)
        relu_pre = (post8.float() * s_post).sqrt()
        dpre = (2.0 * acc * relu_pre).to(dtype)  # (T, H)
        state.dpre_amax[k] = torch.maximum(state.dpre_amax[k], dpre.float().abs().amax())
        s_dpre = state.dpre_scale[k]
        dpre8 = quantize(dpre, s_dpre, E5M2)
        dw1 = scaled_mm(dpre8.t(), x8, s_dpre, state.x_scale, dtype, False).to(ctx.w1_dtype)  # (H, D)
        dx = scaled_mm(dpre8, state.w1_f8_col[k].t(), s_dpre, state.w1_scale[k], dtype, False)  # (T, D)
        return dx, dw1, dw2, grad_p, None, None, None


def fp8_mlp(x: Tensor, w1: Tensor, w2: Tensor, p: Tensor | None, state: Fp8MLPState, slot: int,
            x8: Tensor | None = None) -> Tensor:
    """Training MLP of bank slot `slot` on x [T, D]: p·relu(x W1ᵀ)² W2 in fp8 (p=None: no fold).

    x8 is the e4m3 input from `state.quantize_input(x)` when two MLPs share one input.
    """
    if x.dim() != 2:
        raise ValueError(f"fp8_mlp: x must be [T, D], got {tuple(x.shape)}")
    if p is not None and p.dim() != 0:
        raise ValueError(f"fp8_mlp: the folded post λ must be 0-D, got {tuple(p.shape)}")
    if state.refresh_calls == 0:
        raise RuntimeError("fp8_mlp: the fp8 weight caches are empty; call refresh(bank) after each "
                           "optimizer step and once before the first training forward")
    if x8 is None:
        x8 = state.quantize_input(x)
    return Fp8MLPFunction.apply(x, w1, w2, p, x8, state, slot)


def bf16_mlp(x: Tensor, w1: Tensor, w2: Tensor) -> Tensor:
    """relu(x W1ᵀ)² W2 in the input dtype: the validation MLP and the MLP of devices without fp8."""
    return torch.relu(x @ w1.t()).square() @ w2
