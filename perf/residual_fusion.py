"""The residual fusions of record #360: `scale`, `scale_add` and `rms_norm_with_head`.

The residual update of every block is x = r·x + p·y with learned 0-D scalars r (resid λ) and
p (post λ). In stock autograd each scalar's gradient is its own full-tensor reduction in the
tensor's dtype; here both scalars' gradients are fp32 per-row sums stacked into one reduction.
Forward values are exactly the plain expressions'. Per-token coefficients (the MUDD μ) are not
scalars and keep plain autograd.

`rms_norm_with_head(x, width)` returns F.rms_norm(x) and its first `width` channels recomputed
from the shared per-row rstd, so the head's gradient stays `width` columns wide instead of being
padded to the full width and folded into the norm's backward (the value-embedding gate input).

Contracts: docs/design.md, "The residual fusions". Tests: tests/perf/test_perf_residual_fusion.py.
"""
from __future__ import annotations

import torch
from torch import Tensor

# F.rms_norm's default eps: the machine epsilon of its fp32 compute type, for fp32 and bf16 inputs.
RMS_NORM_EPS = torch.finfo(torch.float32).eps


def _check_scalar(name: str, s: Tensor) -> None:
    if not isinstance(s, Tensor) or s.dim() != 0:
        shape = tuple(s.shape) if isinstance(s, Tensor) else type(s).__name__
        raise ValueError(f"residual_fusion: {name} must be a 0-D tensor (a learned λ), got {shape}; "
                         "per-token coefficients keep plain autograd")


def _row_sums(g: Tensor, x: Tensor) -> Tensor:
    """Σ over the last dim of g·x in fp32, one entry per row: (rows,)."""
    return (g.float() * x.float()).reshape(-1, g.shape[-1]).sum(dim=-1)


class _Scale(torch.autograd.Function):
    @staticmethod
    def forward(ctx, r: Tensor, x: Tensor) -> Tensor:
        ctx.save_for_backward(r, x)
        return r * x

    @staticmethod
    def backward(ctx, g: Tensor):
        r, x = ctx.saved_tensors
        grad_r = _row_sums(g, x).sum().to(r.dtype) if ctx.needs_input_grad[0] else None
        grad_x = g * r if ctx.needs_input_grad[1] else None
        return grad_r, grad_x


class _ScaleAdd(torch.autograd.Function):
    @staticmethod
    def forward(ctx, r: Tensor, x: Tensor, p: Tensor, y: Tensor) -> Tensor:
        ctx.save_for_backward(r, x, p, y)
        return r * x + p * y

    @staticmethod
    def backward(ctx, g: Tensor):
        r, x, p, y = ctx.saved_tensors
        grad_r = grad_p = None
        if ctx.needs_input_grad[0] or ctx.needs_input_grad[2]:
            # both scalars' per-row sums in one (2, rows) reduction
            totals = torch.stack([_row_sums(g, x), _row_sums(g, y)]).sum(dim=1)  # (2,)
            grad_r, grad_p = totals[0].to(r.dtype), totals[1].to(p.dtype)
        grad_x = g * r if ctx.needs_input_grad[1] else None
        grad_y = g * p if ctx.needs_input_grad[3] else None
        return grad_r, grad_x, grad_p, grad_y


def scale(r: Tensor, x: Tensor) -> Tensor:
    """r·x for a 0-D r, with r's gradient as an fp32 row-sum reduction."""
    _check_scalar("r", r)
    return _Scale.apply(r, x)


def scale_add(r: Tensor, x: Tensor, p: Tensor, y: Tensor) -> Tensor:
    """r·x + p·y for 0-D r and p; both scalar gradients come from one stacked fp32 reduction."""
    _check_scalar("r", r)
    _check_scalar("p", p)
    if x.shape != y.shape:
        raise ValueError(f"scale_add: x {tuple(x.shape)} and y {tuple(y.shape)} must have one shape")
    return _ScaleAdd.apply(r, x, p, y)


def rms_norm_with_head(x: Tensor, width: int) -> tuple[Tensor, Tensor]:
    """(F.rms_norm(x), F.rms_norm(x)[..., :width]), the head rebuilt from the shared fp32 rstd.

    Same arithmetic as F.rms_norm (fp32 upcast, eps = fp32 machine epsilon), so both outputs are
    bitwise its values; plain autograd then routes the head's gradient through x[..., :width].
    """
    if not 0 < width <= x.shape[-1]:
        raise ValueError(f"rms_norm_with_head: width {width} must be in [1, {x.shape[-1]}]")
    xf = x.float()
    rstd = torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + RMS_NORM_EPS)  # (..., 1)
    normed = (xf * rstd).to(x.dtype)
    head = (xf[..., :width] * rstd).to(x.dtype)
    return normed, head
