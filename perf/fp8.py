"""fp8 building blocks of the portable path: saturating casts, tile amaxes, `_scaled_mm` layouts.

torch.float8_e4m3fn / float8_e5m2 casts and torch._scaled_mm run on CPU (torch >= 2.13), so the fp8
recipe of record #360 (scales, clamps, delayed amaxes) runs in CPU tests exactly as on a GPU.
Two rules hold everywhere: clamp before every fp8 cast (an e4m3fn overflow is NaN, not a
saturation), and `_scaled_mm`'s second operand is column-major (cuBLASLt's layout; the CPU accepts
either, so `col_major` keeps the portable path honest about what the GPU needs).

The fp8 lm_head loss (`fp8_lm_head_loss`, one autograd node: GEMM → e4m3 logits → softcapped CE)
returns the loss and lse [T], and with gather_cols [T, M] also zg [T, M], the softcapped logits z at
those columns, all three differentiable: their gradients meet in the CE's one e5m2 backward launch
(perf/kernels/cross_entropy.py). A loss term in lse and a few gathered z (CPLM's mixture NLL, PR #379,
in lse_t, z_t[y_t] and z_t[<copy>]) is then a line in model/, not a kernel edit; PR #379's
`SoftcapLSEGather` is the same idea (frontier_cplm.md §9).
"""
from __future__ import annotations

import torch
from torch import Tensor

from perf.kernels.cross_entropy import CE_SLAB_ROWS, loss_weights, softcapped_ce_e4m3, softcapped_ce_grad_e5m2

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
E4M3_MAX = torch.finfo(E4M3).max  # 448
E5M2_MAX = torch.finfo(E5M2).max  # 57344


def _scale(value: float, device) -> Tensor:
    """A static fp32 0-D scale made on the device by a fill (torch.tensor would copy it from
    pageable host memory: a sync on a GPU, and a non-fake constant under dynamo's meta tracing)."""
    return torch.full((), value, dtype=torch.float32, device=device)


def quantize(x: Tensor, scale: Tensor | float, dtype: torch.dtype) -> Tensor:
    """Saturating fp8 cast of x / scale: fp32 divide, clamp to the format's range, round to nearest."""
    fmax = torch.finfo(dtype).max
    return (x.float() / scale).clamp_(-fmax, fmax).to(dtype)


def col_major(t: Tensor) -> Tensor:
    """The same [rows, cols] matrix stored column-major (strides (1, rows)), as _scaled_mm's mat2 wants."""
    return t.t().contiguous().t()


# One fp8 GEMM as an opaque custom op (record #360 wraps its fp8 GEMMs the same way): inductor calls
# it as an extern kernel, cuBLASLt's _scaled_mm, instead of lowering torch._scaled_mm itself. The
# lowering considers inductor's own Triton templates on SM90 and reshapes each 0-D scale to [1, 1];
# a scale that is a 0-D view of a per-slot buffer (`state.post_scale[k]`) then fails to lower
# ("12 != 1"; python -m tools.cross_compile finds it, tests/tools/test_tools_cross_compile.py keeps it).
@torch.library.custom_op("speedrun::scaled_mm", mutates_args=())
def _scaled_mm_op(a: Tensor, b: Tensor, scale_a: Tensor, scale_b: Tensor, out_dtype: torch.dtype,
                  fast_accum: bool) -> Tensor:
    if b.stride(0) != 1:
        b = col_major(b)
    return torch._scaled_mm(a.contiguous(), b, scale_a=scale_a.float().reshape(()),
                            scale_b=scale_b.float().reshape(()), out_dtype=out_dtype,
                            use_fast_accum=fast_accum)


@_scaled_mm_op.register_fake
def _(a, b, scale_a, scale_b, out_dtype, fast_accum):
    return a.new_empty((a.shape[0], b.shape[1]), dtype=out_dtype)  # (M, N), row-major as cuBLASLt writes it


def scaled_mm(a: Tensor, b: Tensor, scale_a: Tensor, scale_b: Tensor, out_dtype: torch.dtype,
              fast_accum: bool) -> Tensor:
    """(a·scale_a) @ (b·scale_b) for fp8 a (row-major) and b (made column-major), fp32 0-D scales
    (views of per-slot buffers are fine).

    fast_accum is allowed only on forward GEMMs: with it a gradient GEMM can return NaN on H100.
    """
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[0]:
        raise ValueError(f"scaled_mm: a {tuple(a.shape)} and b {tuple(b.shape)} must be [M, K] and [K, N]")
    return _scaled_mm_op(a, b, scale_a, scale_b, out_dtype, fast_accum)


def tile_amax(w: Tensor, tile: int = 64) -> Tensor:
    """Per-tile max|w| of a [..., H, D] stack over a tile×tile grid (edges zero-padded): [..., n_tiles]."""
    *lead, H, D = w.shape
    th, td = -(-H // tile), -(-D // tile)
    padded = torch.nn.functional.pad(w.detach().abs().float(), (0, td * tile - D, 0, th * tile - H))
    tiles = padded.reshape(*lead, th, tile, td, tile).transpose(-3, -2)
    return tiles.amax(dim=(-2, -1)).reshape(*lead, th * td)


# The fp8 lm_head of record #360 (track_1_short/model/gpt.py): per-tensor static scales.
LM_HEAD_X_SCALE = 100 / 448  # record #360: the final normed rows (|x| <= √768 = 27.7) map to <= 124
LM_HEAD_W_SCALE = 2.0 / 448  # record #360: lm_head entries up to ±2 are representable
LM_HEAD_GRAD_SCALE = 0.75 / 8 / 448  # record #360: /8 moves the e5m2 flush-to-zero floor 3 octaves down


def quantize_lm_head(w: Tensor) -> Tensor:
    """e4m3 copy of lm_head [D, V] as record #360 caches it: clamp(bf16(w·(1/w_s)), ±448)."""
    scaled = (w.float() * (1.0 / LM_HEAD_W_SCALE)).to(torch.bfloat16).float()
    return scaled.clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)


# The lm_head's e4m3 logits as one opaque custom op: the slab loop must run as written. Inside a
# compiled graph inductor would otherwise run every slab's GEMM first and fuse all the clamps and
# casts into one kernel over [T, N] (every fp32 slab alive at once: 2.8 GB per rank at the record's
# stage 2, T = 49,152 and P = 14,336), and that kernel does not even compile: its e4m3 NaN fill
# constant fails in Triton 3.8 ("'llvm.fptrunc' op result #0 must be floating point"; found by
# python -m tools.cross_compile --config record --steps 681).
@torch.library.custom_op("speedrun::lm_head_logits_e4m3", mutates_args=())
def _lm_head_logits_e4m3_op(x8: Tensor, w8: Tensor, x_s: Tensor, w_s: Tensor) -> Tensor:
    T, N = x8.shape[0], w8.shape[1]
    w8 = col_major(w8)  # once, not per slab
    logits8 = torch.empty((T, N), dtype=E4M3, device=x8.device)
    for lo in range(0, T, CE_SLAB_ROWS):
        slab = scaled_mm(x8[lo: lo + CE_SLAB_ROWS], w8, x_s, w_s, torch.float32, True)  # (rows, N) fp32
        logits8[lo: lo + CE_SLAB_ROWS] = slab.clamp_(-E4M3_MAX, E4M3_MAX).to(E4M3)
    return logits8


@_lm_head_logits_e4m3_op.register_fake
def _(x8, w8, x_s, w_s):
    return x8.new_empty((x8.shape[0], w8.shape[1]), dtype=E4M3)  # (T, N)


def lm_head_logits_e4m3(x8: Tensor, w8: Tensor, x_s: Tensor, w_s: Tensor) -> Tensor:
    """e4m3 logits [T, N] = saturate(x8·x_s @ w8·w_s) with fast accumulation, one slab of
    CE_SLAB_ROWS rows at a time so the GEMM's fp32 output stays a bounded temporary (the record's
    kernel writes e4m3 from its epilogue; `_scaled_mm` has no saturating e4m3 output on every build).
    One opaque op, in eager and compiled graphs alike (see above)."""
    return _lm_head_logits_e4m3_op(x8, w8, x_s, w_s)


class Fp8LMHeadLossFunction(torch.autograd.Function):
    """The summed softcapped training loss of x [T, D] through the fp8 lm_head W[:, cols] (cols None =
    every column), the rows' lse [T] and, with gather_cols [T, M], the gathered softcapped logits zg
    [T, M]: record #360's full-stack fp8 tail (track_1_short/model/gpt.py) as one autograd node with
    two differentiable outputs (three with gather_cols).

    Forward: e4m3 x and W, logits written as e4m3 bytes (1 per element, `lm_head_logits_e4m3`), the
    CE reads them (perf/kernels/cross_entropy.py). Saved for the backward: x8, W8, the e4m3 logits
    and lse [T] (and gather_cols); nothing wider than a byte at [T, N].
    Backward (the logit rounding passes the gradient straight through): the CE recomputes σ from the
    e4m3 logits and writes the logit gradient of grad_out·Σ L + Σ grad_lse·lse + Σ grad_zg·zg as e5m2
    with grad_s (grad_lse, grad_zg None when nothing used lse, zg: the lse-free, gather-free launch;
    torch.compile passes zeros instead, which give the same numbers); dx and dW without fast
    accumulation; dW is dense [D, V] with zeros outside `cols`.

    head_sample (a perf/sampled_head_grad.py `HeadSample`, sampled softmax only): dW over the
    candidate columns is PR #371's estimate instead (one row of every group, negatives exact;
    `sampled_lm_head_weight_grad`), and the sampler's device counter advances; dx is unchanged.
    The type is named, not imported: that module imports this one (`scaled_mm`), and a circle is
    refused (tests/test_imports.py); the backward calls only its `weight_grad`.
    """

    @staticmethod
    def forward(ctx, x: Tensor, w: Tensor, cols: Tensor | None, targets: Tensor, prefix_targets: Tensor | None,
                weights: Tensor, num_mtp: int, gather_cols: Tensor | None,
                head_sample: "HeadSample | None" = None) -> tuple[Tensor, ...]:
        ctx.set_materialize_grads(False)  # an unused lse (zg) arrives as None
        x_s = _scale(LM_HEAD_X_SCALE, x.device)
        w_s = _scale(LM_HEAD_W_SCALE, x.device)
        x8 = quantize(x, x_s, E4M3)  # (T, D)
        w8 = quantize_lm_head(w)  # (D, V)
        if cols is not None:
            w8 = w8[:, cols]  # (D, P)
        logits8 = lm_head_logits_e4m3(x8, w8, x_s, w_s)  # (T, N) e4m3
        out = softcapped_ce_e4m3(logits8, targets, prefix_targets, weights, num_mtp, gather_cols)  # total, lse[, zg]
        ctx.save_for_backward(x8, w8, cols, logits8, out[1], targets, prefix_targets, weights, gather_cols)
        ctx.num_mtp, ctx.x_dtype, ctx.w_dtype, ctx.w_shape = num_mtp, x.dtype, w.dtype, w.shape
        ctx.head_sample = head_sample  # its counter is persistent: not saved (no version check on it)
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor | None, grad_lse: Tensor | None, grad_zg: Tensor | None = None):
        x8, w8, cols, logits8, lse, targets, prefix_targets, weights, gather_cols = ctx.saved_tensors
        if grad_out is None:  # only lse (or zg) was used
            grad_out = lse.new_zeros(())
        x_s = _scale(LM_HEAD_X_SCALE, lse.device)
        w_s = _scale(LM_HEAD_W_SCALE, lse.device)
        g_s = _scale(LM_HEAD_GRAD_SCALE, lse.device)
        g8 = softcapped_ce_grad_e5m2(logits8, lse, targets, prefix_targets, weights, ctx.num_mtp,
                                     grad_out, g_s, grad_lse, gather_cols, grad_zg)  # (T, N) e5m2
        dx = scaled_mm(g8, w8.t(), g_s, w_s, ctx.x_dtype, False) if ctx.needs_input_grad[0] else None
        dw = None
        if ctx.needs_input_grad[1]:
            if ctx.head_sample is None:
                dw_cols = scaled_mm(x8.t(), g8, x_s, g_s, ctx.w_dtype, False)  # (D, N)
            else:  # PR #371: sampled rows for max(G, 0), exact negatives; advances the counter
                dw_cols = ctx.head_sample.weight_grad(g8, x8, g_s, x_s, targets, ctx.num_mtp, prefix_targets,
                                                      gather_cols, ctx.w_dtype)  # (D, N)
            if cols is None:
                dw = dw_cols
            else:  # densify: exact zeros outside the candidate columns
                dw = torch.zeros(ctx.w_shape, dtype=ctx.w_dtype, device=lse.device)
                dw[:, cols] = dw_cols
        return dx, dw, None, None, None, None, None, None, None


def fp8_lm_head_loss(x: Tensor, w: Tensor, targets: Tensor, mtp_weights, prefix_targets: Tensor | None,
                     prefix_weight, cols: Tensor | None = None, gather_cols: Tensor | None = None,
                     head_sample: "HeadSample | None" = None) -> tuple[Tensor, ...]:
    """(Σ_t L_t 0-D fp32, lse fp32 [T]), model/loss.py `softcapped_ce` of the final normed rows x [T, D]
    through the fp8 lm_head w [D, V], over the columns `cols` only if given (then targets and
    prefix_targets are positions in cols, and lse is over those columns). Both are differentiable.

    gather_cols (int64 [T, M], positions like the targets: in cols if given): also returns zg fp32
    [T, M], the softcapped e4m3 logits z[t, gather_cols[t, m]] (0 outside [0, N)), differentiable,
    as the third value; its gradient joins the same e5m2 backward launch.

    head_sample (perf/sampled_head_grad.py `HeadSample`, or None: the exact dW, bit for bit today's):
    PR #371's sampled lm_head weight gradient over `cols` (required: the PR samples only on the
    sampled-softmax path); T must be a multiple of its group. dx is unchanged."""
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[0]:
        raise ValueError(f"fp8_lm_head_loss: x {tuple(x.shape)} and lm_head {tuple(w.shape)} must be [T, D] and [D, V]")
    if head_sample is not None:
        if cols is None:
            raise ValueError("fp8_lm_head_loss: head_sample (PR #371's sampled lm_head dW) needs the sampled "
                             "softmax's candidate columns `cols`; the full-softmax path stays exact")
        if x.shape[0] % head_sample.group:
            raise ValueError(f"fp8_lm_head_loss: head_sample keeps one row of every {head_sample.group}, "
                             f"but x has {x.shape[0]} rows")
    weights = loss_weights(mtp_weights, prefix_weight, x.device)  # [w_0..w_{K-1}, w_p]
    return Fp8LMHeadLossFunction.apply(x, w, cols, targets, prefix_targets, weights, len(mtp_weights), gather_cols,
                                       head_sample)


# The packed fp8 QKV projection of record #360 training (track_1_short/model/attention.py): static scales for the input
# and the output gradient, an exact per-layer weight scale, sa0 folded into the dequant scale.
QKV_X_SCALE = 8.0 / 448  # record #360: normed attention inputs saturate beyond |x| = 8
QKV_GRAD_SCALE = 1.0 / 448  # record #360: static e4m3 scale of the QKV output gradient


class Fp8QKVFunction(torch.autograd.Function):
    """qkv = x·(sa0·W)ᵀ for W = [W_qk; W_v] through e4m3, with sa0 riding the dequant scale.

    Backward: the output gradient goes e4m3 with the static 1/448 scale; dW′ = g8ᵀ·x8 (= dL/d(sa0·W)),
    d sa0 = ⟨dW′, W⟩ in fp32 against the master weight, dW = sa0·dW′; no fast accumulation.
    """

    @staticmethod
    def forward(ctx, x: Tensor, w_qk: Tensor, w_v: Tensor, sa0: Tensor) -> Tensor:
        w = torch.cat([w_qk, w_v])  # (R, D)
        x_s = _scale(QKV_X_SCALE, x.device)
        w_s = (w.detach().abs().amax().float().clamp(min=1e-12) / E4M3_MAX)  # exact, per layer
        x8, w8 = quantize(x, x_s, E4M3), quantize(w, w_s, E4M3)
        sa0_val = sa0.detach().float()
        qkv = scaled_mm(x8, w8.t(), x_s, w_s * sa0_val, x.dtype, True)  # (T, R)
        ctx.save_for_backward(x8, w8, w, sa0)
        ctx.scales, ctx.split, ctx.dtypes = (x_s, w_s, sa0_val), w_qk.shape[0], (x.dtype, w.dtype)
        return qkv

    @staticmethod
    def backward(ctx, g: Tensor):
        x8, w8, w, sa0 = ctx.saved_tensors
        x_s, w_s, sa0_val = ctx.scales
        x_dtype, w_dtype = ctx.dtypes
        g_s = _scale(QKV_GRAD_SCALE, g.device)
        g8 = quantize(g, g_s, E4M3)  # (T, R)
        dw_folded = scaled_mm(g8.t(), x8, g_s, x_s, w_dtype, False)  # (R, D) = dL/d(sa0·W)
        dx = scaled_mm(g8, w8, g_s, w_s * sa0_val, x_dtype, False)  # (T, D)
        grad_sa0 = (dw_folded.float() * w.float()).sum().to(sa0.dtype) if ctx.needs_input_grad[3] else None
        dw = (dw_folded.float() * sa0_val).to(w_dtype)
        return dx, dw[: ctx.split], dw[ctx.split:], grad_sa0


def fp8_qkv(x: Tensor, w_qk: Tensor, w_v: Tensor, sa0: Tensor) -> Tensor:
    """Training QKV projection of the normed attention input x [T, D]: [T, rows(W_qk) + rows(W_v)]."""
    if sa0.dim() != 0:
        raise ValueError(f"fp8_qkv: sa0 must be 0-D, got {tuple(sa0.shape)}")
    return Fp8QKVFunction.apply(x, w_qk, w_v, sa0)
