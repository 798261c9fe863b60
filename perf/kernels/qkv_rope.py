"""The training QKV projection of record #360 fused around its fp8 GEMM: e4m3 input in both layouts,
the packed [W_qk; W_v] GEMM, and an epilogue doing the QK-norm, the rotary (paired heads and the
partial key offset included) and the q/k/v split; the backward's norm/rotary gradient, V gradient and
their e4m3 quantize in one kernel. Same math as model/attention.py's unfused path (perf/fp8.py
`fp8_qkv`, then `normed_rotary_qk` below), fewer launches and no fp32 [T, 2H, d] intermediates.

    x8, x8ᵀ   = e4m3(x / s_x)                                       quantize_dual_*          1 launch
    qkv       = (x8 · W8ᵀ)·s_x·(s_w·sa0)  (torch._scaled_mm)        paired: two column GEMMs 1-2 GEMMs
    q, k      = rotary(rms(qk)), key offset on K                     qk_norm_rope_*           1 launch
    backward: g8, g8ᵀ = e4m3(dtype(∂(q, k)/∂qk) ‖ dv) / s_g)       qkv_rope_backward_*      1 launch
              dW′ = g8ᵀ·x8, dx = g8·W8 (torch._scaled_mm, no fast accumulation)              2 GEMMs

Scales (record #360: track_1_short/model/attention.py; perf/fp8.py): s_x = 8/448 static, s_w = amax(W)/448 exact per
layer, sa0 folded into the dequant scale, s_g = 1/448 static. The norm is per head, fp32, no weight,
eps = F.rms_norm's; rotary y = factor1·n + factor2·swap(n) with bf16 tables (model/rotary.py);
paired layers rotate even heads at position 2t and odd heads at 2t+1 (the paired heads); the key offset gives
key t the stationary dims (≥ rotary_dim) of key t−1's normed vector, key 0 keeping its own (the partial key offset).
That math is written once, in plain PyTorch, as `normed_rotary_qk` here (perf sits below model, so the
definition lives with its kernel): model/attention.py's unfused path calls it, and so does the twin.

Launches per attention layer and training step, against record #360's `PackedFP8QKVFunction`:
forward 1 quantize + 1 GEMM (2 on paired layers, so V is dense) + 1 epilogue, as upstream (which
hoists the quantize into the model so layers 8 and 10 share it); backward 1 kernel + 2 GEMMs, as
upstream. Not fused here: the RMS norm of the attention input (model/gpt.py owns it: the normed
tensor also feeds the value-embedding gate, the shared late input and the post-loop MUDD mix), the
per-forward weight quantize (upstream caches it per optimizer step) and the rotary tables (built by
`Yarn.tables`; upstream caches them).

Each piece has a portable twin (plain PyTorch): `quantize_dual_portable`, `qk_norm_rope_portable`,
`qkv_rope_backward_portable`; the forward twin is `normed_rotary_qk` and the unfused path's cast, the
backward twin op for op its autograd backward, so with the Triton kernels off the fused op is bitwise
the unfused one (tests hold it). The public op, `fp8_qkv_rope`, picks the kernels or the twins on
`perf.backend.current().triton`; the model calls it when `current().fused_qkv` (SPEEDRUN_FUSED_QKV) is on.

Tests: tests/perf/test_perf_kernels_qkv_rope.py (pytest tests/perf/test_perf_kernels_qkv_rope.py -q).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from perf.backend import current
from perf.fp8 import E4M3, E4M3_MAX, QKV_GRAD_SCALE, QKV_X_SCALE, _scale, quantize, scaled_mm
from perf.kernels.mlp import _cast
from perf.residual_fusion import RMS_NORM_EPS

OUT_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


# ------------------------------------------------------------------------------------------------
# Portable twins: the definition of the math the kernels must match (the unfused path, op for op).

def quantize_dual_portable(x: Tensor, x_s: Tensor) -> tuple[Tensor, Tensor]:
    """(x8 [T, D], x8ᵀ [D, T]) = e4m3(clamp(x / x_s, ±448)), perf/fp8.py `quantize`; x8ᵀ a view here."""
    x8 = quantize(x, x_s, E4M3)
    return x8, x8.t()


def _swap_pairs(u: Tensor) -> Tensor:
    """u with each adjacent pair of the last dim (2j, 2j+1) exchanged."""
    return u.unflatten(-1, (-1, 2)).flip(-1).flatten(-2)


def rotate(u: Tensor, factor1: Tensor, factor2: Tensor) -> Tensor:
    """y = factor1·u + factor2·swap(u) in fp32, swap exchanging each adjacent pair (2j, 2j+1).

    u [T, heads, d] fp32; factors (model/rotary.py `Yarn.tables`, bf16) broadcastable to it. Per pair
    (a, b) at angle θ: y_2j = cos θ·a + sin θ·b, y_2j+1 = cos θ·b − sin θ·a.
    """
    return factor1.float() * u + factor2.float() * _swap_pairs(u)


def _head_factors(factor1: Tensor, factor2: Tensor, num_heads: int, paired: bool) -> tuple[Tensor, Tensor]:
    """The tables broadcast over [T, 2H, d] (Q heads then K heads): paired rows [T, 2d] give even heads
    the first half (position 2t), odd heads the second (2t+1), record #360's track_1_short/model/attention.py."""
    T = factor1.shape[0]
    if paired:
        d = factor1.shape[1] // 2
        parity = torch.arange(2 * num_heads, device=factor1.device) % num_heads % 2
        return tuple(f.view(T, 2, d)[:, parity] for f in (factor1, factor2))  # (T, 2H, d)
    return factor1[:, None], factor2[:, None]  # (T, 1, d)


def normed_rotary_qk(qk: Tensor, factor1: Tensor, factor2: Tensor, rotary_dim: int, paired: bool,
                     key_offset: bool) -> tuple[Tensor, Tensor]:
    """QK-norm, rotary and the partial key offset of record #360 (track_1_short/model/attention.py):
    fp32 (q, k) [T, H, d] from qk [T, 2H, d] (Q heads then K heads, any dtype and row stride).

        n   = u·rsqrt(mean(u²) + eps)          u = fp32(qk), per head, no weight, eps = F.rms_norm's
        y   = factor1·n + factor2·swap(n)       `rotate`, bf16 tables [T, d] (paired: [T, 2d]) in fp32
        q, k = y[:, :H], y[:, H:];  with key_offset: k[t, :, rotary_dim:] = k[t−1, :, rotary_dim:], t ≥ 1

    Paired layers rotate even logical heads at position 2t, odd heads at 2t+1. The one definition of
    this math: the model's unfused path (model/attention.py) and the kernel's portable twin
    (`qk_norm_rope_portable`) both call it; `_qk_norm_rope_kernel` implements it and
    tests/perf/test_perf_kernels_qkv_rope.py holds the kernel to it.
    """
    H = qk.shape[1] // 2
    u = qk.float()
    n = u * torch.rsqrt(u.pow(2).mean(dim=-1, keepdim=True) + RMS_NORM_EPS)  # (T, 2H, d) fp32
    f1, f2 = _head_factors(factor1, factor2, H, paired)  # (T, 2H, d) or (T, 1, d)
    y = rotate(n, f1, f2)  # (T, 2H, d) fp32
    q, k = y[:, :H], y[:, H:]
    if key_offset:  # stationary dims of key t come from key t−1 (across documents too); key 0 keeps its own
        k = torch.cat([k[:, :, :rotary_dim], torch.cat([k[:1, :, rotary_dim:], k[:-1, :, rotary_dim:]])], dim=-1)
    return q, k


def qk_norm_rope_portable(qk: Tensor, factor1: Tensor, factor2: Tensor, num_heads: int, rotary_dim: int,
                          paired: bool, key_offset: bool) -> tuple[Tensor, Tensor]:
    """(q, k) [T, H, d] in qk's dtype from qk [T, 2H, d]: `normed_rotary_qk`, then the cast to the
    projection dtype (the unfused path's cast), so the fused path is bitwise the unfused one."""
    if qk.shape[1] != 2 * num_heads:
        raise ValueError(f"qk_norm_rope: qk must be [T, 2·{num_heads}, d], got {tuple(qk.shape)}")
    q, k = normed_rotary_qk(qk, factor1, factor2, rotary_dim, paired, key_offset)  # (T, H, d) fp32
    return q.to(qk.dtype), k.to(qk.dtype)


def qkv_rope_backward_portable(grad_q: Tensor, grad_k: Tensor, grad_v: Tensor, qk: Tensor, factor1: Tensor,
                               factor2: Tensor, rotary_dim: int, paired: bool, key_offset: bool,
                               g_s: Tensor) -> tuple[Tensor, Tensor]:
    """(g8 [T, R], g8ᵀ [R, T]) e4m3 with R = 2H·d + H·d_v: the QKV output gradient, quantized.

    The gradient of `qk_norm_rope_portable` written out as autograd computes it (same ops, same
    order, so bitwise equal): cast back to fp32, the key offset's shifted slices, the rotary's
    transpose (factor1·g + swap(factor2·g)), the norm's (n = u·r, r = rsqrt(mean u² + eps)):
        du = gn·r + (−½·Σ(gn·u)·r³ / d)·2u,
    rounded to qk's dtype; then [dqk ‖ dv] / g_s clamped to ±448 and cast to e4m3 (perf/fp8.py).
    """
    T, H2, d = qk.shape
    H = H2 // 2
    gk = grad_k.float()
    if key_offset:  # key t's stationary dims were key t+1's output too; key 0's also its own
        stat = gk[:, :, rotary_dim:]
        nxt = torch.cat([stat[1:], torch.zeros_like(stat[:1])])
        stat = torch.cat([nxt[:1] + stat[:1], nxt[1:]])
        gk = torch.cat([gk[:, :, :rotary_dim], stat], dim=-1)
    g = torch.cat([grad_q.float(), gk], dim=1)  # (T, 2H, d)
    f1, f2 = _head_factors(factor1, factor2, H, paired)
    gn = g * f1.float() + _swap_pairs(g * f2.float())
    u = qk.float()
    r = torch.rsqrt(u.pow(2).mean(dim=-1, keepdim=True) + RMS_NORM_EPS)
    grad_r = (gn * u).sum(dim=-1, keepdim=True)
    grad_ms = -0.5 * grad_r * r.pow(3)
    du = gn * r + grad_ms.expand(u.shape) / d * (2.0 * u)
    grad = torch.cat([du.to(qk.dtype).reshape(T, H2 * d), grad_v.reshape(T, -1).to(qk.dtype)], dim=1)
    g8 = quantize(grad, g_s, E4M3)
    return g8, g8.t()


# ------------------------------------------------------------------------------------------------
# Triton kernels. Pointer arguments end in _ptr (tests/perf/test_perf_compile_sm90.py builds
# their signatures from the names). Interpreter accommodations as in perf/kernels/mlp.py: fp32 math,
# and every bf16/fp8 store rounded onto its grid first (`_cast`); every fp8 cast is clamped first.

@triton.jit
def _quantize_dual_kernel(x_ptr, scale_ptr, x8_ptr, x8_t_ptr, T, D, stride_xt,
                          INTERPRETER: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    """x8 [T, D] and x8ᵀ [D, T] = e4m3(clamp(x / s, ±448)). Portable twin: `quantize_dual_portable`
    (bitwise: one fp32 division and one round to nearest each)."""
    rt = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    rd = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask = (rt[:, None] < T) & (rd[None, :] < D)
    x = tl.load(x_ptr + rt[:, None] * stride_xt + rd[None, :], mask=mask, other=0.0).to(tl.float32)
    # div_rn: IEEE division, as torch's (Triton's `/` on fp32 is the approximate one on the GPU)
    scaled = tl.minimum(tl.maximum(tl.div_rn(x, tl.load(scale_ptr)), -448.0), 448.0)
    x8 = _cast(scaled, tl.float8e4nv, INTERPRETER)  # (BLOCK_T, BLOCK_D)
    tl.store(x8_ptr + rt[:, None] * D + rd[None, :], x8, mask=mask)
    tl.store(x8_t_ptr + rd[:, None] * T + rt[None, :], tl.trans(x8), mask=(rd[:, None] < D) & (rt[None, :] < T))


@triton.jit
def _load_head(qk_ptr, rt, head, d, d_swap, mask, stride_qkt, stride_qkh):
    """fp32 (BLOCK_T, BLOCK_D) rows of one head and the same rows with each pair swapped."""
    base = qk_ptr + rt[:, None] * stride_qkt + head * stride_qkh
    u = tl.load(base + d[None, :], mask=mask, other=0.0).to(tl.float32)
    u_swap = tl.load(base + d_swap[None, :], mask=mask, other=0.0).to(tl.float32)
    return u, u_swap


@triton.jit
def _rstd(u, QK_DIM: tl.constexpr, EPS: tl.constexpr):
    return tl.rsqrt(tl.sum(u * u, axis=1) / QK_DIM + EPS)


@triton.jit
def _qk_norm_rope_kernel(
    qk_ptr, factor1_ptr, factor2_ptr, q_ptr, k_ptr,
    T, stride_qkt, stride_qkh, stride_ft,
    NUM_HEADS: tl.constexpr, QK_DIM: tl.constexpr, ROTARY_DIM: tl.constexpr, EPS: tl.constexpr,
    PAIRED: tl.constexpr, KEY_OFFSET: tl.constexpr, OUT_DTYPE: tl.constexpr, INTERPRETER: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """q, k [T, H, d] from qk [T, 2H, d]: per program BLOCK_T tokens of logical head h, its Q and K head.

    n = u·rsqrt(Σu²/d + eps), y = factor1·n + factor2·swap(n) in fp32, stored in OUT_DTYPE; with
    KEY_OFFSET, dims ≥ ROTARY_DIM of key t are key t−1's n (the tables there are 1 and 0: ω = 0), key 0
    keeps its own: `normed_rotary_qk`. Portable twin: `qk_norm_rope_portable`. Parity: Σu² runs in
    another order than torch's mean, so r can differ by an fp32 ulp and an output land one OUT_DTYPE ulp off.
    """
    h = tl.program_id(1)
    rt = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    d = tl.arange(0, BLOCK_D)
    d_swap = d ^ 1
    mask = (rt[:, None] < T) & (d[None, :] < QK_DIM)
    if PAIRED:  # paired rows: [position 2t | position 2t+1]; even heads read the first half
        f_offset = (h % 2) * QK_DIM
    else:
        f_offset = 0
    f_row = factor1_ptr + rt[:, None] * stride_ft + f_offset
    f1 = tl.load(f_row + d[None, :], mask=mask, other=0.0).to(tl.float32)
    f2 = tl.load(factor2_ptr + rt[:, None] * stride_ft + f_offset + d[None, :], mask=mask, other=0.0).to(tl.float32)
    out = rt[:, None] * (NUM_HEADS * QK_DIM) + h * QK_DIM + d[None, :]  # (T, H, d) contiguous
    for kind in tl.static_range(2):  # 0: the query head h, 1: the key head H + h
        u, u_swap = _load_head(qk_ptr, rt, h + kind * NUM_HEADS, d, d_swap, mask, stride_qkt, stride_qkh)
        r = _rstd(u, QK_DIM, EPS)[:, None]
        y = f1 * (u * r) + f2 * (u_swap * r)  # (BLOCK_T, BLOCK_D)
        if kind == 0:
            tl.store(q_ptr + out, _cast(y, OUT_DTYPE, INTERPRETER), mask=mask)
        else:
            if KEY_OFFSET:
                prev = tl.maximum(rt - 1, 0)  # token 0 reads itself: its own stationary dims
                u_prev = tl.load(qk_ptr + prev[:, None] * stride_qkt + (h + NUM_HEADS) * stride_qkh + d[None, :],
                                 mask=mask, other=0.0).to(tl.float32)
                y = tl.where(d[None, :] >= ROTARY_DIM, u_prev * _rstd(u_prev, QK_DIM, EPS)[:, None], y)
            tl.store(k_ptr + out, _cast(y, OUT_DTYPE, INTERPRETER), mask=mask)


@triton.jit
def _qkv_rope_backward_kernel(
    grad_q_ptr, grad_k_ptr, grad_v_ptr, qk_ptr, factor1_ptr, factor2_ptr, scale_ptr, g8_ptr, g8_t_ptr,
    T, stride_qkt, stride_qkh, stride_ft, stride_gqt, stride_gqh, stride_gkt, stride_gkh, stride_gvt, stride_gvh,
    NUM_HEADS: tl.constexpr, QK_DIM: tl.constexpr, V_DIM: tl.constexpr, ROTARY_DIM: tl.constexpr,
    EPS: tl.constexpr, PAIRED: tl.constexpr, KEY_OFFSET: tl.constexpr, QK_DTYPE: tl.constexpr,
    INTERPRETER: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_V: tl.constexpr,
):
    """g8 [T, R] and g8ᵀ [R, T] (R = 2H·d + H·d_v) for BLOCK_T tokens of logical head h: its Q head,
    K head and V head, in both layouts.

    Per head: g (the key offset's shifted stationary gradient on K), gn = factor1·g + swap(factor2·g),
    du = gn·r + (−½·Σ(gn·u)·r³/d)·2u rounded to QK_DTYPE, then e4m3(clamp(du / s_g, ±448)); V: e4m3 of
    dv / s_g. Portable twin: `qkv_rope_backward_portable`. Parity: the Σu² and Σgn·u orders differ
    from torch's, so du can land one QK_DTYPE ulp off and a g8 byte one e4m3 ulp off.
    """
    h = tl.program_id(1)
    rt = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    d = tl.arange(0, BLOCK_D)
    d_swap = d ^ 1
    tmask = rt < T
    mask = tmask[:, None] & (d[None, :] < QK_DIM)
    if PAIRED:
        f_offset = (h % 2) * QK_DIM
    else:
        f_offset = 0
    f1 = tl.load(factor1_ptr + rt[:, None] * stride_ft + f_offset + d[None, :], mask=mask, other=0.0).to(tl.float32)
    f2_swap = tl.load(factor2_ptr + rt[:, None] * stride_ft + f_offset + d_swap[None, :], mask=mask,
                      other=0.0).to(tl.float32)
    g_s = tl.load(scale_ptr)
    R: tl.constexpr = NUM_HEADS * (2 * QK_DIM + V_DIM)
    for kind in tl.static_range(2):  # 0: the query head h, 1: the key head H + h
        if kind == 0:
            g_row = grad_q_ptr + rt[:, None] * stride_gqt + h * stride_gqh
            g = tl.load(g_row + d[None, :], mask=mask, other=0.0).to(tl.float32)
            g_swap = tl.load(g_row + d_swap[None, :], mask=mask, other=0.0).to(tl.float32)
        else:
            g_row = grad_k_ptr + rt[:, None] * stride_gkt + h * stride_gkh
            g = tl.load(g_row + d[None, :], mask=mask, other=0.0).to(tl.float32)
            g_swap = tl.load(g_row + d_swap[None, :], mask=mask, other=0.0).to(tl.float32)
            if KEY_OFFSET:  # stationary dims: key t+1's gradient (none after the last), plus key 0's own at t = 0
                nmask = mask & (rt[:, None] + 1 < T)
                n_row = grad_k_ptr + (rt[:, None] + 1) * stride_gkt + h * stride_gkh
                nxt = tl.load(n_row + d[None, :], mask=nmask, other=0.0).to(tl.float32)
                nxt_swap = tl.load(n_row + d_swap[None, :], mask=nmask, other=0.0).to(tl.float32)
                first = rt[:, None] == 0
                stat = d[None, :] >= ROTARY_DIM  # pairs never straddle ROTARY_DIM (it is even)
                g = tl.where(stat, tl.where(first, nxt + g, nxt), g)
                g_swap = tl.where(stat, tl.where(first, nxt_swap + g_swap, nxt_swap), g_swap)
        u = tl.load(qk_ptr + rt[:, None] * stride_qkt + (h + kind * NUM_HEADS) * stride_qkh + d[None, :],
                    mask=mask, other=0.0).to(tl.float32)
        gn = g * f1 + g_swap * f2_swap  # (BLOCK_T, BLOCK_D)
        r = _rstd(u, QK_DIM, EPS)
        grad_ms = -0.5 * tl.sum(gn * u, axis=1) * (r * r * r)
        du = gn * r[:, None] + (grad_ms[:, None] / QK_DIM) * (2.0 * u)
        du = _cast(du, QK_DTYPE, INTERPRETER).to(tl.float32)
        g8 = _cast(tl.minimum(tl.maximum(tl.div_rn(du, g_s), -448.0), 448.0), tl.float8e4nv, INTERPRETER)
        col = (h + kind * NUM_HEADS) * QK_DIM + d
        tl.store(g8_ptr + rt[:, None] * R + col[None, :], g8, mask=mask)
        tl.store(g8_t_ptr + col[:, None] * T + rt[None, :], tl.trans(g8), mask=(d[:, None] < QK_DIM) & tmask[None, :])
    dv_ = tl.arange(0, BLOCK_V)
    vmask = tmask[:, None] & (dv_[None, :] < V_DIM)
    gv = tl.load(grad_v_ptr + rt[:, None] * stride_gvt + h * stride_gvh + dv_[None, :], mask=vmask, other=0.0)
    gv = _cast(gv.to(tl.float32), QK_DTYPE, INTERPRETER).to(tl.float32)  # dv arrives in the projection dtype
    v8 = _cast(tl.minimum(tl.maximum(tl.div_rn(gv, g_s), -448.0), 448.0), tl.float8e4nv, INTERPRETER)
    vcol = 2 * NUM_HEADS * QK_DIM + h * V_DIM + dv_
    tl.store(g8_ptr + rt[:, None] * R + vcol[None, :], v8, mask=vmask)
    tl.store(g8_t_ptr + vcol[:, None] * T + rt[None, :], tl.trans(v8), mask=(dv_[:, None] < V_DIM) & tmask[None, :])


# Launch configurations by name; tests compile every "cuda*" one for SM90 (tests/kernels).
# The kernels are memory-bound streams. The transposed fp8 stores write BLOCK_T-byte runs per
# feature row, so BLOCK_T = 32 fills a 32-byte sector (as record #360's backward); the epilogue reads
# BLOCK_T rows of one head's Q and K (d ≤ 128) per program.
TILES = {
    "cuda_quantize": dict(BLOCK_T=64, BLOCK_D=128, num_warps=4, num_stages=1),
    "cuda_rope": dict(BLOCK_T=32, num_warps=4, num_stages=1),
    "cuda_rope_backward": dict(BLOCK_T=32, num_warps=4, num_stages=1),
    # CPU tests: small blocks so ragged T and D cross block edges
    "interpreter_quantize": dict(BLOCK_T=8, BLOCK_D=16, num_warps=1, num_stages=1),
    "interpreter_rope": dict(BLOCK_T=4, num_warps=1, num_stages=1),
    "interpreter_rope_backward": dict(BLOCK_T=4, num_warps=1, num_stages=1),
}


def _tiles(device: torch.device, name: str) -> dict:
    tiles = TILES[f"cuda_{name}" if device.type == "cuda" else f"interpreter_{name}"]
    return {**tiles, "INTERPRETER": device.type != "cuda"}


def _check_dtype(name: str, dtype: torch.dtype) -> None:
    if dtype not in OUT_DTYPES:
        raise TypeError(f"{name}: the Triton path computes in bfloat16 (the model) or float32, got {dtype}")


def quantize_dual_triton(x: Tensor, x_s: Tensor) -> tuple[Tensor, Tensor]:
    """Fast twin of `quantize_dual_portable`: one kernel, x8 [T, D] and x8ᵀ [D, T] (two tensors)."""
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"quantize_dual: x must be [T, D] with unit column stride, got {tuple(x.shape)} {x.stride()}")
    T, D = x.shape
    x8 = torch.empty((T, D), dtype=E4M3, device=x.device)
    x8_t = torch.empty((D, T), dtype=E4M3, device=x.device)
    tiles = _tiles(x.device, "quantize")
    grid = (triton.cdiv(T, tiles["BLOCK_T"]), triton.cdiv(D, tiles["BLOCK_D"]))
    _quantize_dual_kernel[grid](x, x_s, x8, x8_t, T, D, x.stride(0), **tiles)
    return x8, x8_t


def _check_rope(name: str, qk: Tensor, factor1: Tensor, factor2: Tensor, num_heads: int, rotary_dim: int,
                paired: bool) -> None:
    T, H2, d = qk.shape
    if H2 != 2 * num_heads or qk.stride(2) != 1:
        raise ValueError(f"{name}: qk must be [T, 2·{num_heads}, d] with unit last stride, got {tuple(qk.shape)}")
    width = 2 * d if paired else d
    if factor1.shape != (T, width) or factor2.shape != factor1.shape or factor1.stride() != factor2.stride() \
            or factor1.stride(1) != 1:
        raise ValueError(f"{name}: the tables must be two alike [{T}, {width}] with unit column stride, "
                         f"got {tuple(factor1.shape)} {factor1.stride()} and {tuple(factor2.shape)} {factor2.stride()}")
    if rotary_dim % 2 or rotary_dim > d:
        raise ValueError(f"{name}: rotary_dim {rotary_dim} must be even and <= d {d}")
    _check_dtype(name, qk.dtype)


def qk_norm_rope_triton(qk: Tensor, factor1: Tensor, factor2: Tensor, num_heads: int, rotary_dim: int,
                        paired: bool, key_offset: bool) -> tuple[Tensor, Tensor]:
    """Fast twin of `qk_norm_rope_portable`: one kernel, q and k [T, H, d] contiguous."""
    _check_rope("qk_norm_rope", qk, factor1, factor2, num_heads, rotary_dim, paired)
    T, _, d = qk.shape
    q = torch.empty((T, num_heads, d), dtype=qk.dtype, device=qk.device)
    k = torch.empty_like(q)
    tiles = _tiles(qk.device, "rope")
    grid = (triton.cdiv(T, tiles["BLOCK_T"]), num_heads)
    _qk_norm_rope_kernel[grid](qk, factor1, factor2, q, k, T, qk.stride(0), qk.stride(1), factor1.stride(0),
                               NUM_HEADS=num_heads, QK_DIM=d, ROTARY_DIM=rotary_dim, EPS=RMS_NORM_EPS,
                               PAIRED=paired, KEY_OFFSET=key_offset, OUT_DTYPE=OUT_DTYPES[qk.dtype],
                               BLOCK_D=triton.next_power_of_2(d), **tiles)
    return q, k


def qkv_rope_backward_triton(grad_q: Tensor, grad_k: Tensor, grad_v: Tensor, qk: Tensor, factor1: Tensor,
                             factor2: Tensor, rotary_dim: int, paired: bool, key_offset: bool,
                             g_s: Tensor) -> tuple[Tensor, Tensor]:
    """Fast twin of `qkv_rope_backward_portable`: one kernel, g8 [T, R] and g8ᵀ [R, T] (two tensors)."""
    T, H2, d = qk.shape
    H = H2 // 2
    _check_rope("qkv_rope_backward", qk, factor1, factor2, H, rotary_dim, paired)
    grad_q, grad_k, grad_v = (g if g.stride(-1) == 1 else g.contiguous() for g in (grad_q, grad_k, grad_v))
    dv = grad_v.shape[-1]
    if grad_q.shape != (T, H, d) or grad_k.shape != (T, H, d) or grad_v.shape[:2] != (T, H):
        raise ValueError(f"qkv_rope_backward: gradients {tuple(grad_q.shape)}, {tuple(grad_k.shape)}, "
                         f"{tuple(grad_v.shape)} do not match qk {tuple(qk.shape)}")
    R = H * (2 * d + dv)
    g8 = torch.empty((T, R), dtype=E4M3, device=qk.device)
    g8_t = torch.empty((R, T), dtype=E4M3, device=qk.device)
    tiles = _tiles(qk.device, "rope_backward")
    grid = (triton.cdiv(T, tiles["BLOCK_T"]), H)
    _qkv_rope_backward_kernel[grid](
        grad_q, grad_k, grad_v, qk, factor1, factor2, g_s, g8, g8_t,
        T, qk.stride(0), qk.stride(1), factor1.stride(0), grad_q.stride(0), grad_q.stride(1),
        grad_k.stride(0), grad_k.stride(1), grad_v.stride(0), grad_v.stride(1),
        NUM_HEADS=H, QK_DIM=d, V_DIM=dv, ROTARY_DIM=rotary_dim, EPS=RMS_NORM_EPS, PAIRED=paired,
        KEY_OFFSET=key_offset, QK_DTYPE=OUT_DTYPES[qk.dtype], BLOCK_D=triton.next_power_of_2(d),
        BLOCK_V=triton.next_power_of_2(dv), **tiles)
    return g8, g8_t


# ------------------------------------------------------------------------------------------------
# The training Function: one body for both paths; only the three fused pieces differ.

class Fp8QKVRopeFunction(torch.autograd.Function):
    """q, k, v of x·(sa0·[W_qk; W_v])ᵀ through e4m3 (perf/fp8.py `Fp8QKVFunction`'s scales), q and k
    normed and rotated. use_triton picks the three fused pieces (the kernels) or their twins.

    Saved for the backward: x8ᵀ (the dW GEMM's column-major operand), W8, the bf16 [W_qk; W_v] (for
    d sa0), sa0, the pre-norm qk projection and the tables; nothing in fp32.
    """

    @staticmethod
    def forward(ctx, x: Tensor, w_qk: Tensor, w_v: Tensor, sa0: Tensor, factor1: Tensor, factor2: Tensor,
                num_heads: int, rotary_dim: int, paired: bool, key_offset: bool, use_triton: bool):
        T, H = x.shape[0], num_heads
        d, dv, split = w_qk.shape[0] // (2 * H), w_v.shape[0] // H, w_qk.shape[0]
        w = torch.cat([w_qk, w_v])  # (R, D)
        x_s = _scale(QKV_X_SCALE, x.device)
        w_s = (w.detach().abs().amax().float().clamp(min=1e-12) / E4M3_MAX)  # exact, per layer (perf/fp8.py)
        x8, x8_t = (quantize_dual_triton if use_triton else quantize_dual_portable)(x, x_s)  # (T, D), (D, T)
        w8 = quantize(w, w_s, E4M3)
        sa0_val = sa0.detach().float()
        if paired:  # two column GEMMs, so V is born dense (paired attention merges its token and head axes)
            qk = scaled_mm(x8, w8[:split].t(), x_s, w_s * sa0_val, x.dtype, True)  # (T, 2H·d)
            v = scaled_mm(x8, w8[split:].t(), x_s, w_s * sa0_val, x.dtype, True)  # (T, H·dv)
        else:
            qk, v = scaled_mm(x8, w8.t(), x_s, w_s * sa0_val, x.dtype, True).split([split, H * dv], dim=-1)
        qk = qk.view(T, 2 * H, d)
        rope = qk_norm_rope_triton if use_triton else qk_norm_rope_portable
        q, k = rope(qk, factor1, factor2, H, rotary_dim, paired, key_offset)  # (T, H, d) each
        ctx.save_for_backward(x8_t, w8, w, sa0, qk, factor1, factor2)
        ctx.scales, ctx.split, ctx.dtypes = (x_s, w_s, sa0_val), split, (x.dtype, w.dtype)
        ctx.rope, ctx.use_triton = (rotary_dim, paired, key_offset), use_triton
        return q, k, v.view(T, H, dv)

    @staticmethod
    def backward(ctx, grad_q: Tensor, grad_k: Tensor, grad_v: Tensor):
        x8_t, w8, w, sa0, qk, factor1, factor2 = ctx.saved_tensors
        x_s, w_s, sa0_val = ctx.scales
        x_dtype, w_dtype = ctx.dtypes
        g_s = _scale(QKV_GRAD_SCALE, qk.device)
        backward = qkv_rope_backward_triton if ctx.use_triton else qkv_rope_backward_portable
        g8, g8_t = backward(grad_q, grad_k, grad_v, qk, factor1, factor2, *ctx.rope, g_s)  # (T, R), (R, T)
        dw_folded = scaled_mm(g8_t, x8_t.t(), g_s, x_s, w_dtype, False)  # (R, D) = dL/d(sa0·W)
        dx = scaled_mm(g8, w8, g_s, w_s * sa0_val, x_dtype, False)  # (T, D)
        grad_sa0 = (dw_folded.float() * w.float()).sum().to(sa0.dtype) if ctx.needs_input_grad[3] else None
        dw = (dw_folded.float() * sa0_val).to(w_dtype)
        return dx, dw[: ctx.split], dw[ctx.split:], grad_sa0, None, None, None, None, None, None, None


def fp8_qkv_rope(x: Tensor, w_qk: Tensor, w_v: Tensor, sa0: Tensor, factor1: Tensor, factor2: Tensor,
                 num_heads: int, rotary_dim: int, paired: bool, key_offset: bool) -> tuple[Tensor, Tensor, Tensor]:
    """Training q, k [T, H, d] and v [T, H, d_v] of the normed attention input x [T, D] (x's dtype).

    w_qk [2H·d, D] (Q heads then K heads), w_v [H·d_v, D], sa0 0-D, factor1/factor2 the layer's
    rotary rows for T tokens (`Yarn.tables(T)`; [T, 2d] when paired). Equal to perf/fp8.py
    `fp8_qkv` followed by `normed_rotary_qk` and the cast to x's dtype.
    """
    if x.dim() != 2 or sa0.dim() != 0:
        raise ValueError(f"fp8_qkv_rope: x must be [T, D] and sa0 0-D, got {tuple(x.shape)} and {tuple(sa0.shape)}")
    if w_qk.shape[0] % (2 * num_heads) or w_v.shape[0] % num_heads:
        raise ValueError(f"fp8_qkv_rope: weights {tuple(w_qk.shape)}, {tuple(w_v.shape)} do not split into "
                         f"2·{num_heads} and {num_heads} heads")
    if key_offset and rotary_dim >= w_qk.shape[0] // (2 * num_heads):
        raise ValueError("fp8_qkv_rope: the key offset needs stationary dims (d > rotary_dim)")
    return Fp8QKVRopeFunction.apply(x, w_qk, w_v, sa0, factor1, factor2, num_heads, rotary_dim, paired,
                                    key_offset, current().triton)
