"""Varlen causal sliding-window attention backends. Portable path: SDPA with a dense boolean mask.

The packed batch of one rank holds many documents; `cu_seqlens` (int32 [R], trailing entries
padded with T) marks their starts. A query sees the keys of its own segment at distances
0..window to its left (FA3's window_size = (window, 0)). Paired-head layers (record #360 layers
0, 2, 5) reinterpret [T, 6, d] as [2T, 3, d]: position 2t carries heads 0..2 of token t, 2t+1 heads
3..5, so heads h and h+3 share one attention stream, segments and window count interleaved
positions. q/k and v may have different head widths (64/128 on the narrow layers).

Queries run in chunks, each against the keys its window reaches, so the dense masks stay small;
still, this path is for CPU tests and small runs: FA3 is the fast path.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def segment_ids(cu_seqlens: Tensor, num_positions: int) -> Tensor:
    """Segment index of every packed position: int64 [num_positions]."""
    positions = torch.arange(num_positions, device=cu_seqlens.device)
    return torch.searchsorted(cu_seqlens.to(torch.int64), positions, right=True) - 1


def _window_mask(seg: Tensor, pos: Tensor, queries: slice, keys: slice, window: int) -> Tensor:
    dist = pos[queries, None] - pos[None, keys]
    return (seg[queries, None] == seg[None, keys]) & (dist >= 0) & (dist <= window)


def varlen_attention_mask(cu_seqlens: Tensor, num_positions: int, window: int) -> Tensor:
    """Boolean [T, T] mask, True where query i may attend key j: same segment, 0 <= i − j <= window."""
    seg = segment_ids(cu_seqlens, num_positions)
    pos = torch.arange(num_positions, device=cu_seqlens.device)
    return _window_mask(seg, pos, slice(None), slice(None), window)


def check_cu_seqlens(cu_seqlens: Tensor, num_tokens: int) -> None:
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"cu_seqlens must be 1-D with >= 2 entries, got {tuple(cu_seqlens.shape)}")
    if int(cu_seqlens[0]) != 0 or int(cu_seqlens[-1]) != num_tokens:
        raise ValueError(f"cu_seqlens must start at 0 and end at T={num_tokens} (pad with T), got "
                         f"{int(cu_seqlens[0])}..{int(cu_seqlens[-1])}")
    if bool((cu_seqlens[1:] < cu_seqlens[:-1]).any()):
        raise ValueError("cu_seqlens must be non-decreasing")


def sdpa_varlen_attention(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, window: int,
                          softmax_scale: float, paired: bool = False, chunk: int = 2048) -> Tensor:
    """Attention of q, k [T, H, d_qk] and v [T, H, d_v] over the packed documents → [T, H, d_v].

    Queries go in chunks of `chunk` positions against the keys they can reach (the chunk and the
    `window` positions before it), so the mask is [chunk, chunk + window], not [T, T].
    """
    T, H, _ = q.shape
    check_cu_seqlens(cu_seqlens, T)
    if paired:  # the same memory seen as twice the positions with half the heads
        if H % 2:
            raise ValueError(f"paired heads need an even head count, got {H}")
        q, k, v = (t.reshape(2 * T, H // 2, t.shape[-1]) for t in (q, k, v))
        cu_seqlens = 2 * cu_seqlens
    n = q.shape[0]
    seg = segment_ids(cu_seqlens, n)
    pos = torch.arange(n, device=q.device)
    q, k, v = (t.transpose(0, 1) for t in (q, k, v))  # (heads, n, d)
    outputs = []
    for lo in range(0, n, chunk):
        hi = min(n, lo + chunk)
        k_lo = max(0, lo - window)
        mask = _window_mask(seg, pos, slice(lo, hi), slice(k_lo, hi), window)  # (chunk, keys)
        outputs.append(F.scaled_dot_product_attention(q[:, lo:hi], k[:, k_lo:hi], v[:, k_lo:hi],
                                                      attn_mask=mask, scale=softmax_scale))
    y = torch.cat(outputs, dim=1)  # (heads, n, d_v)
    return y.transpose(0, 1).reshape(T, H, v.shape[-1])
