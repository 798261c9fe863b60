"""fp8 building blocks of the portable path: saturating casts, tile amaxes, `_scaled_mm` layouts.

torch.float8_e4m3fn / float8_e5m2 casts and torch._scaled_mm run on CPU (torch >= 2.13), so the fp8
recipe of record #360 (scales, clamps, delayed amaxes) runs in CPU tests exactly as on a GPU.
Two rules hold everywhere: clamp before every fp8 cast (an e4m3fn overflow is NaN, not a
saturation), and `_scaled_mm`'s second operand is column-major (cuBLASLt's layout; the CPU accepts
either, so `col_major` keeps the portable path honest about what the GPU needs).
"""
from __future__ import annotations

import torch
from torch import Tensor

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
E4M3_MAX = torch.finfo(E4M3).max  # 448
E5M2_MAX = torch.finfo(E5M2).max  # 57344


def quantize(x: Tensor, scale: Tensor | float, dtype: torch.dtype) -> Tensor:
    """Saturating fp8 cast of x / scale: fp32 divide, clamp to the format's range, round to nearest."""
    fmax = torch.finfo(dtype).max
    return (x.float() / scale).clamp(-fmax, fmax).to(dtype)


def col_major(t: Tensor) -> Tensor:
    """The same [rows, cols] matrix stored column-major (strides (1, rows)), as _scaled_mm's mat2 wants."""
    return t.t().contiguous().t()


def scaled_mm(a: Tensor, b: Tensor, scale_a: Tensor, scale_b: Tensor, out_dtype: torch.dtype,
              fast_accum: bool) -> Tensor:
    """(a·scale_a) @ (b·scale_b) for fp8 a (row-major) and b (made column-major), fp32 0-D scales.

    fast_accum is allowed only on forward GEMMs: with it a gradient GEMM can return NaN on H100.
    """
    if b.stride(0) != 1:
        b = col_major(b)
    return torch._scaled_mm(a.contiguous(), b, scale_a=scale_a.float().reshape(()),
                            scale_b=scale_b.float().reshape(()), out_dtype=out_dtype,
                            use_fast_accum=fast_accum)


def tile_amax(w: Tensor, tile: int = 64) -> Tensor:
    """Per-tile max|w| of a [..., H, D] stack over a tile×tile grid (edges zero-padded): [..., n_tiles]."""
    *lead, H, D = w.shape
    th, td = -(-H // tile), -(-D // tile)
    padded = torch.nn.functional.pad(w.detach().abs().float(), (0, td * tile - D, 0, th * tile - H))
    tiles = padded.reshape(*lead, th, tile, td, tile).transpose(-3, -2)
    return tiles.amax(dim=(-2, -1)).reshape(*lead, th * td)
