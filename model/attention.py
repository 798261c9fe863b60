"""Causal self-attention of record #360: per-layer head widths, QK-norm, YaRN rotary, the partial
key offset, paired heads, XSA, output gates, value-embedding adds and the O projection with o_gain.

`CausalSelfAttention` holds no parameters: GPT cuts each layer's weights out of the banks to the
layer's widths (nn.Linear layout) and passes them in with an `AttnArgs`:
    qk_w [2·H·d_qk, D] (Q heads then K heads), v_w [H·d_v, D], o_w [D, H·d_v].
Shapes in comments: T tokens of the rank's packed batch, H heads, D model width.

The QKV projection is one GEMM over [W_qk; W_v]: in training the packed fp8 projection of
perf/fp8.py (sa0 folded into its dequant scale), in validation bf16 with sa0 on the weight. With
`perf.backend.current().fused_qkv` (SPEEDRUN_FUSED_QKV, default on) training runs the same math as
perf/kernels/qkv_rope.py `fp8_qkv_rope`: the input quantize, the GEMM, the QK-norm and rotary in
fewer launches (bitwise this path's on the portable backend). The QK-norm, rotary and key offset are
written once, as perf/kernels/qkv_rope.py `normed_rotary_qk`: both paths run it (perf sits below
model, so the definition lives beside its kernel).
The O weight (bf16 in both) carries sa1 and, when given, the layer's attention post-λ (`o_gain`):
out = y·bf16(sa1·o_gain·W_O)ᵀ, one rounding of the product, so p's gradient is a reduction over the
weight instead of over the [T, D] output (record #360: track_1_short/model/attention.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from model.rotary import Yarn
from perf.attention_backends import varlen_attention
from perf.backend import current
from perf.fp8 import fp8_qkv
from perf.kernels.qkv_rope import fp8_qkv_rope, normed_rotary_qk
from perf.windowed_backward import AttentionSnapshot, restricted_backward_attention, snapshot_attention

XSA_EPS = 1e-8  # record #360: floor of ‖v‖² in the XSA projection


@dataclass
class AttnArgs:
    """What one attention layer reads besides its weights (B = 1, so no batch dims)."""
    sa_lambdas: Tensor  # fp32 [2]: sa0 scales the QKV weight, sa1 the O weight
    cu_seqlens: Tensor  # int32 [R], padded with T
    window: int  # tokens a query looks back (blocks × 128; interleaved positions on paired layers)
    yarn: Yarn  # the layer's rotary table
    key_offset: bool = False  # long-window layers: stationary key dims from the previous token
    attn_gate: Tensor | None = None  # [T, H] raw per-head output gate
    aux_v: Tensor | None = None  # [T, H·head_dim] added to V (value embeddings, MUDD v)
    xsa_alpha: Tensor | None = None  # [T, H] raw XSA lanes (tanh applied here)
    o_gain: Tensor | None = None  # 0-D: the layer's attention post-λ, folded into the O weight
    fp8: bool = False  # training: the packed fp8 QKV projection (sa0 in its dequant scale)
    max_seqlen: int | None = None  # longest attention segment (FA3 needs it as a constant under compile)
    # PR #371 part 2 (model/attention_calibration.py): 0 the stock backward; 1 calibration (the stock
    # backward, the first rows snapshotted into `snapshot`); 2 the backward restricted per head by
    # `head_windows` (int32 [FA3 heads], −1 = full, read on the device)
    backward_mode: int = 0
    head_windows: Tensor | None = None
    snapshot: AttentionSnapshot | None = None


def scaled_weight(c: Tensor, w: Tensor) -> Tensor:
    """c·w with one rounding to w's dtype (c an fp32 0-D gain)."""
    return (c.float() * w.float()).to(w.dtype)


class CausalSelfAttention(torch.nn.Module):
    def __init__(self, num_heads: int, head_dim: int, qk_dim: int, v_dim: int, paired: bool):
        super().__init__()
        self.num_heads, self.head_dim, self.qk_dim, self.v_dim, self.paired = num_heads, head_dim, qk_dim, v_dim, paired

    def forward(self, x: Tensor, qk_w: Tensor, v_w: Tensor, o_w: Tensor, args: AttnArgs) -> Tensor:
        T, H, dq, dv = x.shape[0], self.num_heads, self.qk_dim, self.v_dim
        if args.yarn.head_dim != dq:
            raise ValueError(f"attention: rotary table width {args.yarn.head_dim} != d_qk {dq}")
        if args.key_offset and dq <= args.yarn.rotary_dim:
            raise ValueError("attention: the key offset needs stationary dims (d_qk > rotary_dim)")
        sa0, sa1 = args.sa_lambdas[0], args.sa_lambdas[1]
        factor1, factor2 = args.yarn.tables(T)  # bf16 (T, dq), paired (T, 2·dq)
        rotary_dim = args.yarn.rotary_dim
        if args.fp8 and current().fused_qkv:  # the same math in fewer launches (SPEEDRUN_FUSED_QKV)
            q, k, v = fp8_qkv_rope(x, qk_w, v_w, sa0, factor1, factor2, H, rotary_dim, self.paired,
                                   args.key_offset)  # (T, H, dq), (T, H, dq), (T, H, dv)
        else:
            if args.fp8:
                qkv = fp8_qkv(x, qk_w, v_w, sa0)  # (T, (2·dq + dv)·H)
            else:
                qkv = x @ scaled_weight(sa0, torch.cat([qk_w, v_w])).t()
            qk, v = qkv.split([2 * H * dq, H * dv], dim=-1)
            q, k = normed_rotary_qk(qk.view(T, 2 * H, dq), factor1, factor2, rotary_dim, self.paired,
                                    args.key_offset)  # (T, H, dq) fp32 each
            q, k = q.to(x.dtype), k.to(x.dtype)
            v = v.view(T, H, dv)
        if args.aux_v is not None:
            v = v + args.aux_v.view(T, H, self.head_dim)[..., :dv]
        if args.backward_mode == 2:
            y = restricted_backward_attention(q, k, v, args.cu_seqlens, args.window, args.yarn.attn_scale,
                                              args.head_windows, paired=self.paired,
                                              max_seqlen=args.max_seqlen)  # (T, H, dv)
        elif args.backward_mode == 1:
            y = snapshot_attention(q, k, v, args.cu_seqlens, args.window, args.yarn.attn_scale, args.snapshot,
                                   paired=self.paired, max_seqlen=args.max_seqlen)  # (T, H, dv)
        else:
            y = varlen_attention(q, k, v, args.cu_seqlens, args.window, args.yarn.attn_scale,
                                 paired=self.paired, max_seqlen=args.max_seqlen)  # (T, H, dv)
        if args.xsa_alpha is not None:  # remove a learned share of y along the token's own value
            coef = (y * v).sum(-1, keepdim=True) / (v * v).sum(-1, keepdim=True).clamp_min(XSA_EPS)
            y = y - torch.tanh(args.xsa_alpha.to(y.dtype))[..., None] * coef * v
        if args.attn_gate is not None:
            y = y * args.attn_gate[..., None].to(y.dtype)
        c = sa1 if args.o_gain is None else sa1 * args.o_gain.float()
        return y.reshape(T, H * dv) @ scaled_weight(c, o_w).t()  # (T, D)
