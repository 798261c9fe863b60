"""Tiled transposes between the token embedding [V, 768] and the lm_head stored transposed [768, V].

While the embedding is tied to the lm_head (record #360: track_1_short/training.py, every step up to the
split step 1175), the optimizer adds embed's gradient, transposed, into lm_head's gradient, and after
lm_head's all-gather copies lm_headᵀ back into embed. Both are one pass over a 50304 × 768 matrix;
the kernels read and write whole tiles so both sides stay coalesced.

Public functions (2-D tensors, dst has src's shape reversed), dispatched on `perf.backend.current().triton`:
    transpose_into(dst, src)   dst ← srcᵀ                                   (exact copy, dtype cast)
    transpose_add_(dst, src)   dst ← dst + srcᵀ   (sum in fp32, one rounding to dst's dtype)
Both write dst in place and return it. The `*_portable` twins define the math.

Run the parity tests: pytest tests/kernels -q (CPU, Triton interpreter).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from perf.backend import current


def _check(name: str, dst: torch.Tensor, src: torch.Tensor) -> None:
    if dst.dim() != 2 or src.dim() != 2:
        raise ValueError(f"{name}: dst and src must be 2-D, got dst {tuple(dst.shape)} and src {tuple(src.shape)}")
    if dst.shape != src.shape[::-1]:
        raise ValueError(f"{name}: dst must have src's shape reversed: src {tuple(src.shape)} -> dst "
                         f"{tuple(src.shape[::-1])}, got dst {tuple(dst.shape)}")
    if dst.device != src.device:
        raise ValueError(f"{name}: dst is on {dst.device} but src is on {src.device}")
    if not (dst.is_floating_point() and src.is_floating_point()):
        raise TypeError(f"{name}: expected floating tensors, got dst {dst.dtype} and src {src.dtype}")


# ------------------------------------------------------------------------------------------------
# Portable twins: the definition of the math

def transpose_into_portable(dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    _check("transpose_into", dst, src)
    return dst.copy_(src.T)


def transpose_add_portable_(dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    _check("transpose_add_", dst, src)
    return dst.copy_(dst.float() + src.T.float())  # fp32 sum, one rounding to dst's dtype


# ------------------------------------------------------------------------------------------------
# Triton kernel

@triton.jit
def _transpose_kernel(
    src_ptr, dst_ptr, M, N,
    stride_sm, stride_sn, stride_dn, stride_dm,
    ACCUMULATE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """dst[n, m] = src[m, n] (ACCUMULATE: dst[n, m] += src[m, n]) for one (BLOCK_M × BLOCK_N) tile of src.

    Portable twins: `transpose_into_portable` (bit-exact: a copy, or one cast to dst's dtype) and
    `transpose_add_portable_` (fp32 sum, one rounding; the interpreter truncates its stores instead
    of rounding, so parity there is within 1 ulp of dst's dtype; on a GPU it is exact).
    """
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    tile = tl.load(src_ptr + rm[:, None] * stride_sm + rn[None, :] * stride_sn,
                   mask=(rm[:, None] < M) & (rn[None, :] < N), other=0.0)  # (BLOCK_M, BLOCK_N)
    tile_t = tl.trans(tile)  # (BLOCK_N, BLOCK_M), laid out along dst's rows
    dst_ptrs = dst_ptr + rn[:, None] * stride_dn + rm[None, :] * stride_dm
    dst_mask = (rn[:, None] < N) & (rm[None, :] < M)
    if ACCUMULATE:
        old = tl.load(dst_ptrs, mask=dst_mask, other=0.0)
        tl.store(dst_ptrs, (old.to(tl.float32) + tile_t.to(tl.float32)).to(dst_ptr.dtype.element_ty), mask=dst_mask)
    else:
        tl.store(dst_ptrs, tile_t.to(dst_ptr.dtype.element_ty), mask=dst_mask)


# Launch configurations by name; tests compile every "cuda*" one for SM90 (tests/kernels).
TILES = {
    "cuda": dict(BLOCK_M=64, BLOCK_N=64, num_warps=4),
    "interpreter": dict(BLOCK_M=16, BLOCK_N=16, num_warps=1),  # CPU tests: small and quick
}


def _launch(dst: torch.Tensor, src: torch.Tensor, accumulate: bool) -> torch.Tensor:
    M, N = src.shape
    tiles = TILES["cuda" if dst.is_cuda else "interpreter"]
    grid = (triton.cdiv(M, tiles["BLOCK_M"]), triton.cdiv(N, tiles["BLOCK_N"]))
    _transpose_kernel[grid](src, dst, M, N, *src.stride(), *dst.stride(), ACCUMULATE=accumulate, **tiles)
    return dst


def transpose_into_triton(dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    _check("transpose_into", dst, src)
    return _launch(dst, src, accumulate=False)


def transpose_add_triton_(dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    _check("transpose_add_", dst, src)
    return _launch(dst, src, accumulate=True)


# ------------------------------------------------------------------------------------------------
# Public ops

def transpose_into(dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """dst ← srcᵀ in place (e.g. embed.weight [V, 768] ← lm_head.weight [768, V]); returns dst."""
    return transpose_into_triton(dst, src) if current().triton else transpose_into_portable(dst, src)


def transpose_add_(dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """dst ← dst + srcᵀ in place, summed in fp32 (e.g. lm_head grad [768, V] += embed grad [V, 768]ᵀ); returns dst."""
    return transpose_add_triton_(dst, src) if current().triton else transpose_add_portable_(dst, src)
