"""Symmetric products of the ANVIL cascade: Gram matrices X·Xᵀ, Xᵀ·X and the map polynomial b·A + c·A².

Each ANVIL map (record #360: track_1_short/optim/anvil.py, step 4) computes X ← aX + B·X (or X·B)
with B = b·A + c·A², where A is the Gram matrix of X: A = XᵀX when the matrix has more rows than
columns, else XXᵀ. Both A and B are symmetric, so a kernel only needs the tiles on and above the
diagonal and mirrors them; that halves the multiply-adds of every Gram and every A² in the cascade. Per-rank chunk shapes in the
record: qk (6, 256, 768) -> xxt (6, 256, 256); vo (2, 768, 768) -> xxt (2, 768, 768);
mlp (3, 2816, 768) -> xtx (3, 768, 768).

Public functions (bf16 in, fp32 accumulation, bf16 out), dispatched on `perf.backend.current().triton`:
    xxt(X)         (B, M, K) -> (B, M, M)     X @ Xᵀ
    xtx(X)         (B, M, K) -> (B, K, K)     Xᵀ @ X
    poly(A, b, c)  (B, M, M) -> (B, M, M)     b·A + c·A@A, for symmetric A
2-D inputs are accepted and treated as a batch of one. The `*_portable` twins define the math.

Run the parity tests: pytest tests/kernels -q (CPU, Triton interpreter).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from perf.backend import current


def _check_bf16(name: str, X: torch.Tensor) -> None:
    if X.dtype != torch.bfloat16:
        raise TypeError(f"{name}: expected a bfloat16 tensor (the ANVIL cascade runs in bf16), got {X.dtype}")
    if X.dim() not in (2, 3):
        raise ValueError(f"{name}: expected a (M, K) or (B, M, K) tensor, got shape {tuple(X.shape)}")


def _check_square(name: str, A: torch.Tensor) -> None:
    _check_bf16(name, A)
    if A.shape[-1] != A.shape[-2]:
        raise ValueError(f"{name}: A must be square (a symmetric Gram matrix), got shape {tuple(A.shape)}")


# ------------------------------------------------------------------------------------------------
# Portable twins: the definition of the math

def xxt_portable(X: torch.Tensor) -> torch.Tensor:
    _check_bf16("xxt", X)
    return X @ X.mT  # bf16 GEMM with fp32 accumulation, one rounding


def xtx_portable(X: torch.Tensor) -> torch.Tensor:
    _check_bf16("xtx", X)
    return X.mT @ X


def poly_portable(A: torch.Tensor, b: float, c: float) -> torch.Tensor:
    _check_square("poly", A)
    if A.dim() == 2:
        return torch.addmm(A, A, A, beta=b, alpha=c)
    return torch.baddbmm(A, A, A, beta=b, alpha=c)  # b·A + c·(A@A) in fp32, one rounding


# ------------------------------------------------------------------------------------------------
# Triton kernel

@triton.jit
def _gram_kernel(
    y_ptr, a_ptr, out_ptr,
    M, K,
    stride_yb, stride_ym, stride_yk,
    stride_ab, stride_am, stride_an,
    stride_ob, stride_om, stride_on,
    alpha, beta,
    ADD_INPUT: tl.constexpr, UPCAST_DOT: tl.constexpr,
    BLOCK: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """out = alpha·(Y @ Yᵀ) [+ beta·A] for one batch entry and one (BLOCK × BLOCK) tile at or above the diagonal.

    Portable twins: `xxt_portable` (Y = X), `xtx_portable` (Y = Xᵀ through swapped strides) and
    `poly_portable` (Y = A symmetric, so Y@Yᵀ = A², with ADD_INPUT adding b·A in the epilogue).
    The tile (i, j) with j > i is also stored transposed at (j, i), so only the upper triangle of
    tiles is computed. Parity: fp32 accumulation in a different order than the twin's GEMM, then one
    rounding to bf16: within 1 bf16 ulp of the twin (the interpreter truncates instead of rounding,
    which still lands within 1 ulp) plus a small absolute slack for sums that cancel.
    UPCAST_DOT: the interpreter's bf16 dot is wrong, so there the operands go to fp32 with an
    IEEE dot; bf16×bf16 products are exact in fp32, so this is the same arithmetic as the GPU's bf16 dot.
    """
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    batch = tl.program_id(2)
    if pid_n < pid_m:  # below the diagonal: written by the mirror store of tile (pid_n, pid_m)
        return
    rm = pid_m * BLOCK + tl.arange(0, BLOCK)
    rn = pid_n * BLOCK + tl.arange(0, BLOCK)
    rk = tl.arange(0, BLOCK_K)
    y_base = y_ptr + batch * stride_yb
    acc = tl.zeros((BLOCK, BLOCK), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        k_ok = kk < K
        y_rows = tl.load(y_base + rm[:, None] * stride_ym + kk[None, :] * stride_yk,
                         mask=(rm[:, None] < M) & k_ok[None, :], other=0.0)  # (BLOCK, BLOCK_K)
        y_cols = tl.load(y_base + kk[:, None] * stride_yk + rn[None, :] * stride_ym,
                         mask=k_ok[:, None] & (rn[None, :] < M), other=0.0)  # (BLOCK_K, BLOCK) = Y[n-tile]ᵀ
        if UPCAST_DOT:
            acc += tl.dot(y_rows.to(tl.float32), y_cols.to(tl.float32), input_precision="ieee")
        else:
            acc = tl.dot(y_rows, y_cols, acc)
    in_bounds = (rm[:, None] < M) & (rn[None, :] < M)
    acc = acc * alpha
    if ADD_INPUT:
        a = tl.load(a_ptr + batch * stride_ab + rm[:, None] * stride_am + rn[None, :] * stride_an,
                    mask=in_bounds, other=0.0)
        acc += beta * a.to(tl.float32)
    out = acc.to(out_ptr.dtype.element_ty)
    out_base = out_ptr + batch * stride_ob
    tl.store(out_base + rm[:, None] * stride_om + rn[None, :] * stride_on, out, mask=in_bounds)
    if pid_n > pid_m:  # mirror: the same rounded values, so the result is exactly symmetric
        tl.store(out_base + rn[:, None] * stride_om + rm[None, :] * stride_on, tl.trans(out),
                 mask=(rn[:, None] < M) & (rm[None, :] < M))


# Launch configurations by name; tests compile every "cuda*" one for SM90 (tests/kernels).
TILES = {
    "cuda_large": dict(BLOCK=128, BLOCK_K=64, num_warps=8, num_stages=3),
    "cuda_small": dict(BLOCK=64, BLOCK_K=64, num_warps=4, num_stages=4),  # more programs for small Grams
    "interpreter": dict(BLOCK=16, BLOCK_K=16, num_warps=1, num_stages=1),  # CPU tests: small and quick
}


def _tiles(device: torch.device, M: int, batch: int) -> dict:
    """The interpreter's small tiles on CPU; on a GPU 128-wide tiles unless that leaves SMs idle."""
    if device.type != "cuda":
        return TILES["interpreter"]
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    upper_tiles_128 = triton.cdiv(M, 128) * (triton.cdiv(M, 128) + 1) // 2
    return TILES["cuda_large"] if batch * upper_tiles_128 >= sms else TILES["cuda_small"]


def _gram_triton(Y: torch.Tensor, A: torch.Tensor | None = None, alpha: float = 1.0, beta: float = 0.0) -> torch.Tensor:
    """alpha·Y@Yᵀ (+ beta·A) for a (B, M, K) view Y (any strides); returns a contiguous (B, M, M)."""
    batch, M, K = Y.shape
    out = torch.empty((batch, M, M), dtype=Y.dtype, device=Y.device)
    a = A if A is not None else out  # unread when ADD_INPUT is off
    tiles = _tiles(Y.device, M, batch)
    grid = (triton.cdiv(M, tiles["BLOCK"]), triton.cdiv(M, tiles["BLOCK"]), batch)
    _gram_kernel[grid](
        Y, a, out, M, K,
        *Y.stride(), *a.stride(), *out.stride(),
        float(alpha), float(beta),
        ADD_INPUT=A is not None, UPCAST_DOT=Y.device.type != "cuda", **tiles,
    )
    return out


def _batched(X: torch.Tensor) -> torch.Tensor:
    return X.unsqueeze(0) if X.dim() == 2 else X


def xxt_triton(X: torch.Tensor) -> torch.Tensor:
    _check_bf16("xxt", X)
    out = _gram_triton(_batched(X))
    return out.squeeze(0) if X.dim() == 2 else out


def xtx_triton(X: torch.Tensor) -> torch.Tensor:
    _check_bf16("xtx", X)
    out = _gram_triton(_batched(X).mT)  # Xᵀ as a strided view: no copy
    return out.squeeze(0) if X.dim() == 2 else out


def poly_triton(A: torch.Tensor, b: float, c: float) -> torch.Tensor:
    _check_square("poly", A)
    A3 = _batched(A)
    out = _gram_triton(A3, A3, alpha=c, beta=b)  # A symmetric: A@Aᵀ = A@A
    return out.squeeze(0) if A.dim() == 2 else out


# ------------------------------------------------------------------------------------------------
# Public ops

def xxt(X: torch.Tensor) -> torch.Tensor:
    """X @ Xᵀ for bf16 X of shape (M, K) or (B, M, K)."""
    return xxt_triton(X) if current().triton else xxt_portable(X)


def xtx(X: torch.Tensor) -> torch.Tensor:
    """Xᵀ @ X for bf16 X of shape (M, K) or (B, M, K)."""
    return xtx_triton(X) if current().triton else xtx_portable(X)


def poly(A: torch.Tensor, b: float, c: float) -> torch.Tensor:
    """b·A + c·A² for a symmetric bf16 A of shape (M, M) or (B, M, M) (the cascade's B matrix)."""
    return poly_triton(A, b, c) if current().triton else poly_portable(A, b, c)
