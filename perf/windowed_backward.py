"""The restricted attention backward of upstream PR #371 part 2 (frontier_approx_backward.md §4.4), portable.

The forward is the record's full-window attention, unchanged; the backward drops, per head, the
(query i, key j) pairs that lie further apart than the head's window. Per segment and head h, with the
forward's full-window log-sum-exp LSE_i and output O_i, scale s, the launch window W and the head's
effective window w_h = W if code_h < 0 else min(code_h, W):

    P_ij  = exp(s·q_i·k_j − LSE_i)  for 0 <= i − j <= w_h inside the segment, else 0
    D_i   = Σ_d dO_id·O_id                        (the full-window output)
    dV_j  = Σ_i P_ij·dO_i
    dS_ij = P_ij·(dO_i·v_j − D_i)
    dQ_i  = s·Σ_j dS_ij·k_j          dK_j = s·Σ_i dS_ij·q_i

Nothing is renormalized: LSE and D stay the full-window forward's, so a shortened row's kept P_ij sum to
less than 1. It is a biased approximation of the exact gradient, not the gradient of a shorter-window
forward. Every code −1 ("full") makes it the exact attention gradient (w_h = W for every head).

Layouts (FA3's, so the fast path hands its own tensors over unchanged):
    q, k [n, H, d_qk], v, out, d_out [n, H, d_v] (d_qk may differ from d_v: 64/128 on the narrow layers)
    lse  [H, n] fp32, natural log, the softmax scale inside (FA3 varlen's softmax_lse: [num_heads, total_q])
    cu_seqlens int32 [R], trailing entries padded with n
    head_windows int32 [H] on the device, −1 = full: read by device ops only (no host sync), because it is
        a persistent table whose contents the calibration overwrites in place after the CUDA graphs that
        read it were captured (PR #371: the tables hold −1 through warmup, the codes from step 593 on).
These are *stream* positions and heads. On the paired layers (record #360 layers 0, 2, 5) the model's
[T, 6, d] is FA3's [2T, 3, d] (`perf.attention_backends._stream_layout`, the SDPA and FA3 paths' helper):
position 2t carries heads 0..2 of token t, 2t+1 heads 3..5, cu_seqlens double, and the window counts
interleaved positions (w = 64 ≈ 32 tokens). The head table then has 3 entries, entry h' covering the
model's heads h' and h' + 3. `windowed_backward_attention` takes the model's layout and a `paired` flag
like `sdpa_varlen_attention` and maps it; the two functions below work on the stream layout.

    out, lse = windowed_attention_forward(q, k, v, cu_seqlens, scale, window)       # [n, H, d_v], [H, n]
    dq, dk, dv = windowed_attention_backward(q, k, v, out, lse, d_out, cu_seqlens, scale, window, head_windows)
    y = windowed_backward_attention(q, k, v, cu_seqlens, window, scale, head_windows, paired)  # autograd
    dq, dk, dv = windowed_attention_backward_fast(...)  # the same arguments: the Triton kernels when
                                                        # perf.backend.current().triton, else the definition
    y = restricted_backward_attention(q, k, v, cu_seqlens, window, scale, head_windows, paired, max_seqlen)
                                        # mode 2 as the model calls it: the ops on FA3, the twin on sdpa

Queries run in chunks against the keys the launch window reaches, as in `sdpa_varlen_attention`, so the
score tiles are [H, chunk, chunk + W]; the math is fp32 (fp64 for fp64 inputs, for the tests), the
gradients come back in the inputs' dtypes. This is the definition and the CPU path. The fast path
(`restricted_attention_op`, what mode 2 runs on FA3) is two opaque custom ops: FA3's forward handing over its
LSE, and the Triton kernels (perf/kernels/windowed_backward.py) for the backward; it matches the definition.

Run the tests: pytest tests/perf/test_perf_windowed_backward.py -q
"""
from __future__ import annotations

import torch
from torch import Tensor

from perf.attention_backends import (_stream_layout, fa3_varlen_forward_with_lse, sdpa_varlen_attention, segment_ids,
                                     varlen_attention)
from perf.backend import current
from perf.kernels.windowed_backward import check_backward_inputs, check_layout, windowed_attention_backward_triton

DEFAULT_CHUNK = 2048  # query positions per score tile: sdpa_varlen_attention's default, the same masks
FULL_WINDOW_CODE = -1  # PR #371: a head-table entry below 0 means the launch window ("full")


def effective_windows(head_windows: Tensor, window: int) -> Tensor:
    """w_h per head, int64 on the table's device: `window` where the code is < 0, else min(code, window).

    Device ops only: the table is read where it lives, so a captured graph sees the values of replay time.
    """
    codes = head_windows.to(torch.int64)
    return torch.where(codes < 0, torch.full_like(codes, window), codes.clamp_max(window))


def _math_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)  # fp32 for bf16/fp32, fp64 stays fp64 (the tests)


def _query_chunks(n: int, chunk: int, window: int):
    """(lo, hi, k_lo): queries [lo, hi) and the keys [k_lo, hi) their window can reach."""
    for lo in range(0, n, chunk):
        yield lo, min(n, lo + chunk), max(0, lo - window)


def _chunk_mask(seg: Tensor, lo: int, hi: int, k_lo: int, windows) -> Tensor:
    """True where query i in [lo, hi) keeps key j in [k_lo, hi): same segment and 0 <= i − j <= window.
    windows: an int → [c, K]; an int64 [H, 1, 1] tensor (one window per head) → [H, c, K]."""
    pos = torch.arange(k_lo, hi, device=seg.device)
    dist = pos[lo - k_lo:, None] - pos[None, :]  # (c, K)
    same = seg[lo:hi, None] == seg[None, k_lo:hi]
    return same & (dist >= 0) & (dist <= windows)


def varlen_attention_lse(q: Tensor, k: Tensor, cu_seqlens: Tensor, scale: float, window: int,
                         chunk: int = DEFAULT_CHUNK) -> Tensor:
    """LSE_i = ln Σ_j exp(scale·q_i·k_j) over the keys query i sees (same segment, 0 <= i − j <= window):
    [H, n] in fp32 (fp64 for fp64 inputs), FA3 varlen's softmax_lse layout. Stream layout."""
    n, H, _ = q.shape
    acc = _math_dtype(q.dtype)
    seg = segment_ids(cu_seqlens, n)
    qf, kf = (t.to(acc).transpose(0, 1) for t in (q, k))  # (H, n, d_qk)
    lse = torch.empty(H, n, dtype=acc, device=q.device)
    for lo, hi, k_lo in _query_chunks(n, chunk, window):
        keep = _chunk_mask(seg, lo, hi, k_lo, window)  # (c, K)
        s = scale * (qf[:, lo:hi] @ kf[:, k_lo:hi].transpose(1, 2))  # (H, c, K)
        lse[:, lo:hi] = s.masked_fill(~keep, float("-inf")).logsumexp(-1)  # the diagonal is always kept
    return lse


def windowed_attention_forward(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, scale: float, window: int,
                               chunk: int = DEFAULT_CHUNK) -> tuple[Tensor, Tensor]:
    """The full-window forward with the LSE the restricted backward needs: (out [n, H, d_v], lse [H, n]).

    out is `sdpa_varlen_attention`'s, bitwise (the same call on the same stream-layout tensors), so the
    portable path's forward is unchanged when the restricted backward is on, as FA3's is on the fast path
    (PR #371: output and LSE bit-equal to #360's). The LSE comes from a second, plain pass over the same
    dense per-segment window (`varlen_attention_lse`); on the fast path it is FA3's own softmax_lse.
    """
    check_layout(q, k, v, cu_seqlens)
    out = sdpa_varlen_attention(q, k, v, cu_seqlens, window, scale, chunk=chunk)  # (n, H, d_v)
    return out, varlen_attention_lse(q, k, cu_seqlens, scale, window, chunk)


def windowed_attention_backward(q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, d_out: Tensor,
                                cu_seqlens: Tensor, scale: float, window: int, head_windows: Tensor,
                                chunk: int = DEFAULT_CHUNK) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) of the restricted backward (module docstring), stream layout, in q's, k's, v's dtypes.

    window is the forward's (launch) window W; head_windows the int32 [H] code table (−1 = W). All
    codes −1 give the exact attention gradient. lse must be the full-window forward's (never a shorter
    window's): that is what "without renormalizing" means.
    """
    check_backward_inputs("windowed_attention_backward", q, k, v, out, lse, d_out, cu_seqlens, head_windows)
    n, H, _ = q.shape
    acc = _math_dtype(q.dtype)
    seg = segment_ids(cu_seqlens, n)
    windows = effective_windows(head_windows, window)[:, None, None]  # (H, 1, 1), on the device
    qf, kf = (t.to(acc).transpose(0, 1) for t in (q, k))  # (H, n, d_qk)
    vf, gf = (t.to(acc).transpose(0, 1) for t in (v, d_out))  # (H, n, d_v)
    delta = (d_out.to(acc) * out.to(acc)).sum(-1).transpose(0, 1)  # (H, n): D_i of the full-window output
    lse = lse.to(acc)
    dq = torch.empty_like(qf)
    dk, dv = torch.zeros_like(kf), torch.zeros_like(vf)
    for lo, hi, k_lo in _query_chunks(n, chunk, window):
        keep = _chunk_mask(seg, lo, hi, k_lo, windows)  # (H, c, K): each head its own w_h
        s = scale * (qf[:, lo:hi] @ kf[:, k_lo:hi].transpose(1, 2))  # (H, c, K)
        # masked to −inf before exp: a dropped pair may score far above LSE_i (beyond W, another segment)
        p = (s.masked_fill(~keep, float("-inf")) - lse[:, lo:hi, None]).exp()  # (H, c, K)
        dv[:, k_lo:hi] += p.transpose(1, 2) @ gf[:, lo:hi]
        ds = p * (gf[:, lo:hi] @ vf[:, k_lo:hi].transpose(1, 2) - delta[:, lo:hi, None])  # (H, c, K)
        dq[:, lo:hi] = ds @ kf[:, k_lo:hi]
        dk[:, k_lo:hi] += ds.transpose(1, 2) @ qf[:, lo:hi]
    dq.mul_(scale)
    dk.mul_(scale)
    return tuple(g.transpose(0, 1).contiguous().to(t.dtype) for g, t in ((dq, q), (dk, k), (dv, v)))


class WindowedBackwardAttention(torch.autograd.Function):
    """Stream layout: forward = `windowed_attention_forward`'s output (bitwise `sdpa_varlen_attention`'s),
    backward = `windowed_attention_backward` with the head table as it holds at backward time.

    The fast path keeps this contract with FA3's forward (output and LSE bit-equal to the record's) and
    a per-head windowed backward on FA3's tiles."""

    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens, head_windows, window: int, scale: float, chunk: int = DEFAULT_CHUNK):
        out, lse = windowed_attention_forward(q, k, v, cu_seqlens, scale, window, chunk)
        ctx.save_for_backward(q, k, v, out, lse, cu_seqlens, head_windows)
        ctx.window, ctx.scale, ctx.chunk = window, scale, chunk
        return out

    @staticmethod
    def backward(ctx, d_out):
        q, k, v, out, lse, cu_seqlens, head_windows = ctx.saved_tensors
        dq, dk, dv = windowed_attention_backward(q, k, v, out, lse, d_out, cu_seqlens, ctx.scale, ctx.window,
                                                 head_windows, ctx.chunk)
        return dq, dk, dv, None, None, None, None, None


def windowed_backward_attention(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, window: int,
                                softmax_scale: float, head_windows: Tensor, paired: bool = False,
                                chunk: int = DEFAULT_CHUNK) -> Tensor:
    """`sdpa_varlen_attention` (same arguments, same output bitwise) whose backward is the restricted one.

    q, k [T, H, d_qk], v [T, H, d_v] in the model's layout → [T, H, d_v]. head_windows int32 [H], or [H/2]
    with paired=True: one code per FA3 (stream) head, entry h' for the model's heads h' and h' + H/2.
    """
    T, H, _ = q.shape
    q, k, v, cu_seqlens = _stream_layout(q, k, v, cu_seqlens, paired)  # paired: (2T, H/2, d)
    y = WindowedBackwardAttention.apply(q, k, v, cu_seqlens, head_windows, window, softmax_scale, chunk)
    return y.reshape(T, H, v.shape[-1])


def windowed_attention_backward_fast(q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, d_out: Tensor,
                                     cu_seqlens: Tensor, scale: float, window: int, head_windows: Tensor,
                                     chunk: int = DEFAULT_CHUNK) -> tuple[Tensor, Tensor, Tensor]:
    """`windowed_attention_backward` (same arguments, same contract) on the path the backend picks: the
    Triton kernels (perf/kernels/windowed_backward.py: one launch per tile kind, the head table read on
    the device, so one captured graph serves every table) when `perf.backend.current().triton`, else the
    definition itself. Stream layout, as both callees."""
    if current().triton:
        return windowed_attention_backward_triton(q, k, v, out, lse, d_out, cu_seqlens, scale, window,
                                                  head_windows, chunk)
    return windowed_attention_backward(q, k, v, out, lse, d_out, cu_seqlens, scale, window, head_windows, chunk)


# ---- the fast path: FA3's forward with its LSE and the Triton backward, as two opaque ops ------------------
# On the GPU the restricted backward cannot be an autograd.Function around FA3: torch.compile would trace
# FA3's Python wrapper and the Triton launches. Two custom ops with shape-only fakes hold them instead, as
# the compiled graph holds FA3 itself: `restricted_attention_fwd` (FA3 varlen with its softmax LSE, so the
# output is the record's, bitwise) and `restricted_attention_bwd` (`windowed_attention_backward_fast`: the
# Triton kernels reading the head table on the device). Their real bodies pick the forward by backend, so
# the CPU tests run the same ops with the portable forward (`windowed_attention_forward`, sdpa's output).

@torch.library.custom_op("speedrun::restricted_attention_fwd", mutates_args=())
def restricted_attention_fwd(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, head_windows: Tensor, window: int,
                             scale: float, max_seqlen: int) -> tuple[Tensor, Tensor]:
    """Stream layout → (out [n, H, d_v], lse [H, n] fp32), both contiguous. FA3 on the fa3 backend.
    head_windows is not read here: it is an input so that the backward (`_restricted_backward`) has it."""
    if current().attention == "fa3":
        out, lse = fa3_varlen_forward_with_lse(q, k, v, cu_seqlens, window, scale, max_seqlen)
    else:
        out, lse = windowed_attention_forward(q, k, v, cu_seqlens, scale, window)
    return out.contiguous(), lse.float().contiguous()


@restricted_attention_fwd.register_fake
def _(q, k, v, cu_seqlens, head_windows, window, scale, max_seqlen):
    n, H, _ = q.shape
    return q.new_empty((n, H, v.shape[-1])), q.new_empty((H, n), dtype=torch.float32)


@torch.library.custom_op("speedrun::restricted_attention_bwd", mutates_args=())
def restricted_attention_bwd(q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, d_out: Tensor,
                             cu_seqlens: Tensor, head_windows: Tensor, window: int,
                             scale: float) -> tuple[Tensor, Tensor, Tensor]:
    """`windowed_attention_backward_fast` → (dq, dk, dv), contiguous, in q's, k's, v's dtypes."""
    grads = windowed_attention_backward_fast(q, k, v, out, lse, d_out, cu_seqlens, scale, window, head_windows)
    return tuple(g.contiguous() for g in grads)


@restricted_attention_bwd.register_fake
def _(q, k, v, out, lse, d_out, cu_seqlens, head_windows, window, scale):
    return tuple(t.new_empty(t.shape) for t in (q, k, v))  # contiguous, as the real op's


def _save_for_the_backward(ctx, inputs, output):
    q, k, v, cu_seqlens, head_windows, window, scale, _ = inputs
    ctx.save_for_backward(q, k, v, *output, cu_seqlens, head_windows)
    ctx.window, ctx.scale = window, scale


def _restricted_backward(ctx, d_out, d_lse):
    """The forward's LSE output only feeds this backward (d_lse is None or zeros: ignored)."""
    q, k, v, out, lse, cu_seqlens, head_windows = ctx.saved_tensors
    dq, dk, dv = restricted_attention_bwd(q, k, v, out, lse, d_out, cu_seqlens, head_windows, ctx.window, ctx.scale)
    return dq, dk, dv, None, None, None, None, None


restricted_attention_fwd.register_autograd(_restricted_backward, setup_context=_save_for_the_backward)


def restricted_attention_op(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, window: int, softmax_scale: float,
                            head_windows: Tensor, paired: bool = False, max_seqlen: int | None = None) -> Tensor:
    """The fast path's mode 2: `windowed_backward_attention`'s contract (model layout in, [T, H, d_v] out)
    through the two ops. max_seqlen: the longest segment in tokens, as `fa3_varlen_attention` takes it (None
    reads it from cu_seqlens: a host sync, refused under compile)."""
    T, H, _ = q.shape
    if max_seqlen is None:
        if torch.compiler.is_compiling():
            raise ValueError("restricted_attention_op inside torch.compile needs max_seqlen (reading it from "
                             "cu_seqlens would break the graph): pass the configured maximum segment length")
        max_seqlen = int((cu_seqlens[1:] - cu_seqlens[:-1]).max()) if cu_seqlens.numel() > 1 else 0
    q, k, v, cu_seqlens = _stream_layout(q, k, v, cu_seqlens, paired)  # paired: (2T, H/2, d)
    y, _ = restricted_attention_fwd(q, k, v, cu_seqlens.to(torch.int32), head_windows, window, softmax_scale,
                                    2 * max_seqlen if paired else max_seqlen)  # (n, H', d_v), (H', n)
    return y.reshape(T, H, v.shape[-1])


# ---- the two modes as the model calls them (PR #371 §4.2) ------------------------------------------------


def restricted_backward_attention(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, window: int,
                                  softmax_scale: float, head_windows: Tensor, paired: bool = False,
                                  max_seqlen: int | None = None) -> Tensor:
    """Mode 2: `varlen_attention`'s output (bitwise, on its backend) with the restricted backward reading
    `head_windows`. FA3: the two opaque ops (`restricted_attention_op`: FA3's forward and LSE, the Triton
    backward); sdpa: the portable twin (`windowed_backward_attention`, plain torch that compile traces).
    flex has no forward that hands its LSE over here: a run on it stops rather than run another backward
    than the one asked for (runtime/training.py refuses it first)."""
    backend = current().attention
    if backend == "fa3":
        return restricted_attention_op(q, k, v, cu_seqlens, window, softmax_scale, head_windows, paired, max_seqlen)
    if backend != "sdpa":
        raise RuntimeError(f"features.approx_attention_backward: the restricted backward runs on FA3 or the "
                           f"portable attention (sdpa); this backend's attention is {backend!r}")
    return windowed_backward_attention(q, k, v, cu_seqlens, window, softmax_scale, head_windows, paired)


class AttentionSnapshot:
    """Mode 1 (PR #371's two calibration steps): one layer's first `limit` stream rows of q, k, v, the
    output and dO, the batch's stream cu_seqlens, and the window and scale, as `snapshot_attention` took
    them. Plain tensors kept by reference: mode-1 steps run eagerly (runtime/training.py), never captured,
    so nothing needs a persistent buffer (the PR's graphs baked its buffers' addresses)."""

    def __init__(self, limit: int):
        self.limit = limit
        self.clear()

    def clear(self) -> None:
        self.q = self.k = self.v = self.out = self.d_out = self.cu_seqlens = None
        self.window, self.scale = 0, 0.0

    @property
    def complete(self) -> bool:
        """The forward and its backward both came through since the last `clear`."""
        return self.d_out is not None


class _KeepOutputGradient(torch.autograd.Function):
    """Identity whose backward keeps the first rows of the incoming gradient (dO) in a snapshot."""

    @staticmethod
    def forward(ctx, y, snapshot: AttentionSnapshot, stream_shape: tuple, rows: int):
        ctx.snapshot, ctx.stream_shape, ctx.rows = snapshot, stream_shape, rows
        return y.view_as(y)

    @staticmethod
    def backward(ctx, grad):
        ctx.snapshot.d_out = grad.reshape(ctx.stream_shape)[:ctx.rows].detach().clone()
        return grad, None, None, None


def snapshot_attention(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, window: int, softmax_scale: float,
                       snapshot: AttentionSnapshot, paired: bool = False, max_seqlen: int | None = None) -> Tensor:
    """Mode 1: `varlen_attention` on the current backend with its own backward (mode 0's gradients, bit for
    bit), and the snapshot taken: q, k, v and the output now, dO when the backward passes. Eager only (a
    graph would run the copies once, at capture)."""
    if torch.compiler.is_compiling():
        raise RuntimeError("snapshot_attention (PR #371's calibration steps) runs eagerly, outside torch.compile")
    y = varlen_attention(q, k, v, cu_seqlens, window, softmax_scale, paired=paired, max_seqlen=max_seqlen)
    qs, ks, vs, cus = _stream_layout(q, k, v, cu_seqlens, paired)  # (n, H', d): FA3's rows and heads
    stream_shape = (qs.shape[0], qs.shape[1], vs.shape[-1])
    rows = min(snapshot.limit, qs.shape[0])
    snapshot.clear()
    snapshot.q, snapshot.k, snapshot.v = (t[:rows].detach().clone() for t in (qs, ks, vs))
    snapshot.out = y.detach().reshape(stream_shape)[:rows].clone()
    snapshot.cu_seqlens, snapshot.window, snapshot.scale = cus.detach().clone(), window, softmax_scale
    return _KeepOutputGradient.apply(y, snapshot, stream_shape, rows)
