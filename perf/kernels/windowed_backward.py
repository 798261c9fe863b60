"""The restricted (per-head windowed) attention backward of upstream PR #371 part 2, in Triton: the fast
path's twin of `perf.windowed_backward.windowed_attention_backward` (the definition; frontier_approx_backward.md §4.4).

Per segment and head h, with the forward's full-window log-sum-exp LSE_i and output O_i, scale s, the
launch window W and the head's effective window w_h = W if code_h < 0 else min(code_h, W):

    P_ij  = exp(s·q_i·k_j − LSE_i)  for 0 <= i − j <= w_h inside the segment, else 0
    D_i   = Σ_d dO_id·O_id                        (the full-window output: nothing renormalized)
    dV_j  = Σ_i P_ij·dO_i
    dS_ij = P_ij·(dO_i·v_j − D_i)
    dQ_i  = s·Σ_j dS_ij·k_j          dK_j = s·Σ_i dS_ij·q_i

Why Triton and not the stock FA3 backward once per window group: the per-head windows are known only at
the calibration step (593), after the CUDA graphs were captured, and one FA3 call per distinct window
would change the graphs' launches and shapes with the table's contents. These kernels read the head's
code from the int32 table on the device (once per program), so one captured graph serves every table:
warmup's all −1 ("full") and the calibrated codes written in place later (PR #371's patched FA3 does
the same with a device pointer to the table, frontier_approx_backward.md §4.5).

    dq, dk, dv = windowed_attention_backward_triton(q, k, v, out, lse, d_out, cu_seqlens, scale, window,
                                                    head_windows)   # exactly windowed_attention_backward's

Launch structure (FA2-style, 3 launches, deterministic: no atomics):
    delta   grid (⌈n/BLOCK_M⌉, H): D_i = Σ_d dO_id·O_id, fp32 [H, n]
    dk/dv   grid (⌈n/BLOCK_N⌉, H): one key tile of BLOCK_N per program, dK, dV held in fp32 registers; it
            visits the query tiles from its first key up to min(segment end of its last key, last key
            + w_h + 1): the query tiles wholly beyond key + w_h are never visited, the boundary tiles
            are masked element-wise (0 <= i − j <= w_h and the same segment)
    dq      grid (⌈n/BLOCK_M⌉, H): one query tile per program, keys from max(segment start, first
            query − w_h) (rounded down to a key tile) to its last query, dQ in fp32 registers
dQ has its own launch rather than fp32 atomics from the dk/dv programs (FA3's way): it recomputes
s·q·kᵀ and dO·vᵀ (7 tile GEMMs per visited (query tile, key tile) instead of 5), but every output element is
written once by one program, so the result is bitwise repeatable run to run, there is no fp32 dQ
accumulator [n, H, d_qk] to zero and convert, and nothing relies on the order of atomics in a captured
graph. Whether the two extra GEMMs cost more than the atomics on an H100 is for the benchmark.

Segments come from cu_seqlens on the device (one searchsorted: segment id, start and end per position,
as perf/kernels/copy_pointer.py's documents): no host sync, so the op can live inside the compiled,
captured step. Positions, heads and windows are the *stream* layout's, as in the definition: on the
paired layers (record #360 layers 0, 2, 5) FA3's [2T, 3, d] view, windows in interleaved positions.

Shapes (stream layout): q, k [n, H, d_qk], v, out, d_out [n, H, d_v] (any strides with a unit last one;
otherwise copied), lse [H, n] fp32 (FA3 varlen's softmax_lse), cu_seqlens int32 [R] padded with n,
head_windows int32 [H] (−1 = full). Record: d_qk/d_v 64/128 on the paired layers, 64/64 on layers 1
and 8; bf16 (fp32 in the tests). scale is a constexpr (one compile per value: the record's is fixed), window
an int argument (384 and 640 share a compile). Gradients come back in q's, k's, v's dtypes, accumulated in fp32. On a
GPU with bf16 operands the tile GEMMs take P and dS rounded to bf16 (as FA2/FA3 do); fp32 operands, and
everything under the interpreter, run IEEE fp32 dots (docs/design.md: the interpreter's bf16 tl.dot is wrong).

Run the parity tests: pytest tests/perf/test_perf_kernels_windowed_backward.py -q (CPU, Triton interpreter).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from perf.attention_backends import _check_segments

# Launch configurations by name; tests compile every "cuda*" one for SM90 (tests/perf/test_perf_compile_sm90.py).
# PR #371's FA3 backward tiles (frontier_approx_backward.md §4.1): key tile 128; query tile 128 on the
# 64/64 layers (1, 8), 64 on the paired 64/128 layers (0, 2, 5), where d_v = 128 doubles dV and dO.
# SM90 (bf16): shared memory 99,072 / 123,392 bytes (dk/dv, dq) paired, 99,840 / 98,816 on 64/64; the 64/64 dk/dv
# kernel uses 255 registers and spills 124 bytes at BLOCK_M 128 (BLOCK_M 64 is the first thing to time).
TILES = {
    "cuda": dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=2),  # d_v <= 64 (layers 1, 8)
    "cuda_dv128": dict(BLOCK_M=64, BLOCK_N=128, num_warps=8, num_stages=2),  # d_v = 128 (paired layers)
    "interpreter": dict(BLOCK_M=16, BLOCK_N=16, num_warps=1, num_stages=1),  # CPU tests: many tiles per segment
}
TENSOR_CORE_DTYPES = (torch.bfloat16, torch.float16)  # tl.dot in the operands' own dtype on a GPU
KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
INT32_MAX = 2 ** 31 - 1  # element offsets (row · stride + head · stride + column) are int32 in the kernels


# ------------------------------------------------------------------------------------------------
# Device helpers

@triton.jit
def _tile(ptr, rows, row_ok, stride_n, D: tl.constexpr, BLOCK_D: tl.constexpr):
    """(len(rows), BLOCK_D) tile of one head of an [n, H, D] tensor (ptr already at the head, unit last
    stride) in its own dtype; rows past n (row_ok False) and columns past D read 0. The column mask is
    emitted only when BLOCK_D > D (D not a power of two, or below tl.dot's 16)."""
    dcols = tl.arange(0, BLOCK_D)
    ptrs = ptr + rows[:, None] * stride_n + dcols[None, :]
    if BLOCK_D == D:
        return tl.load(ptrs, mask=row_ok[:, None], other=0.0)
    else:
        return tl.load(ptrs, mask=row_ok[:, None] & (dcols[None, :] < D), other=0.0)


@triton.jit
def _store_tile(ptr, rows, row_ok, stride_n, value, D: tl.constexpr, BLOCK_D: tl.constexpr):
    """Store an fp32 (len(rows), BLOCK_D) tile in ptr's dtype, rows past n and columns past D left alone."""
    dcols = tl.arange(0, BLOCK_D)
    tl.store(ptr + rows[:, None] * stride_n + dcols[None, :], value.to(ptr.dtype.element_ty),
             mask=row_ok[:, None] & (dcols[None, :] < D))


@triton.jit
def _dot(a, b, UPCAST: tl.constexpr):
    """a·b with fp32 accumulation. UPCAST (the interpreter, whose bf16 tl.dot is garbage in Triton 3.8;
    fp32 operands on a GPU, which would otherwise get TF32): fp32 operands, IEEE products. Otherwise a is
    cast to b's dtype first (bf16 on the GPU: P and dS are rounded to bf16 before their GEMMs, as FA2/FA3)."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a.to(b.dtype), b)


@triton.jit
def _head_window(head_windows_ptr, h, window):
    """w_h: the launch window where the head's code is < 0 ("full"), else min(code, window). Read from
    the device table when the program runs, so a table refilled in place is seen by a replayed graph."""
    code = tl.load(head_windows_ptr + h)
    return tl.where(code < 0, window, tl.minimum(code, window))


@triton.jit
def _kept_pairs(rows, cols, seg_i, seg_j, w):
    """(len(rows), len(cols)) pairs query i keeps key j: same segment and 0 <= i − j <= w. Rows past n
    load segment −1 and keys past n −2 (ids are >= 0), so those pairs never match."""
    dist = rows[:, None] - cols[None, :]
    return (dist >= 0) & (dist <= w) & (seg_i[:, None] == seg_j[None, :])


# ------------------------------------------------------------------------------------------------
# Kernels

@triton.jit
def _query_tile(q_ptr, d_out_ptr, seg_ptr, lse_ptr, delta_ptr, h, rows, n,
                stride_qn, stride_qh, stride_gn, stride_gh, stride_lh,
                DQK: tl.constexpr, BLOCK_DQK: tl.constexpr, DV: tl.constexpr, BLOCK_DV: tl.constexpr):
    """Head h's query tile for the backward: (q, dO, segment id, LSE, D) at `rows`; rows past n read 0
    and segment −1, so they pair with no key."""
    row_ok = rows < n
    q = _tile(q_ptr + h * stride_qh, rows, row_ok, stride_qn, DQK, BLOCK_DQK)
    g = _tile(d_out_ptr + h * stride_gh, rows, row_ok, stride_gn, DV, BLOCK_DV)
    seg_i = tl.load(seg_ptr + rows, mask=row_ok, other=-1)
    lse = tl.load(lse_ptr + h * stride_lh + rows, mask=row_ok, other=0.0)
    delta = tl.load(delta_ptr + h * n + rows, mask=row_ok, other=0.0)
    return q, g, seg_i, lse, delta


@triton.jit
def _delta_kernel(
    out_ptr, d_out_ptr, delta_ptr,
    n, stride_on, stride_oh, stride_gn, stride_gh,
    DV: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr,
):
    """D_i = Σ_d dO_id·O_id in fp32, delta [H, n] contiguous; one program per (query tile, head)."""
    m0 = tl.program_id(0) * BLOCK_M
    h = tl.program_id(1)
    rows = m0 + tl.arange(0, BLOCK_M)
    row_ok = rows < n
    o = _tile(out_ptr + h * stride_oh, rows, row_ok, stride_on, DV, BLOCK_DV).to(tl.float32)  # (BM, BDV)
    g = _tile(d_out_ptr + h * stride_gh, rows, row_ok, stride_gn, DV, BLOCK_DV).to(tl.float32)
    tl.store(delta_ptr + h * n + rows, tl.sum(o * g, axis=1), mask=row_ok)


@triton.jit
def _dkdv_kernel(
    q_ptr, k_ptr, v_ptr, d_out_ptr, lse_ptr, delta_ptr, seg_ptr, seg_end_ptr, head_windows_ptr, dk_ptr, dv_ptr,
    n, window,
    stride_qn, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh, stride_gn, stride_gh, stride_lh,
    stride_dkn, stride_dkh, stride_dvn, stride_dvh,
    SCALE: tl.constexpr, DQK: tl.constexpr, BLOCK_DQK: tl.constexpr, DV: tl.constexpr, BLOCK_DV: tl.constexpr,
    UPCAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """One program per (key tile of BLOCK_N, head): dK_j = s·Σ_i dS_ij·q_i and dV_j = Σ_i P_ij·dO_i over the
    queries i in [j, min(segment end, j + w_h)], fp32 accumulation, stored in dk's and dv's dtypes.

    Scores are built transposed, (keys, queries), so the key tile's accumulators need no transpose."""
    n0 = tl.program_id(0) * BLOCK_N
    h = tl.program_id(1)
    w = _head_window(head_windows_ptr, h, window)
    cols = n0 + tl.arange(0, BLOCK_N)  # keys j
    col_ok = cols < n
    k = _tile(k_ptr + h * stride_kh, cols, col_ok, stride_kn, DQK, BLOCK_DQK)  # (BN, BDQK)
    v = _tile(v_ptr + h * stride_vh, cols, col_ok, stride_vn, DV, BLOCK_DV)  # (BN, BDV)
    seg_j = tl.load(seg_ptr + cols, mask=col_ok, other=-2)
    last = tl.minimum(n0 + BLOCK_N, n) - 1  # the tile's last key
    # segment ends never decrease with j, so no key of the tile keeps a query at or past this
    end = tl.minimum(tl.load(seg_end_ptr + last), last + w + 1)
    dk = tl.zeros((BLOCK_N, BLOCK_DQK), tl.float32)
    dv = tl.zeros((BLOCK_N, BLOCK_DV), tl.float32)
    for m0 in range(n0, end, BLOCK_M):
        rows = m0 + tl.arange(0, BLOCK_M)  # queries i
        q, g, seg_i, lse, delta = _query_tile(q_ptr, d_out_ptr, seg_ptr, lse_ptr, delta_ptr, h, rows, n,
                                              stride_qn, stride_qh, stride_gn, stride_gh, stride_lh,
                                              DQK, BLOCK_DQK, DV, BLOCK_DV)  # q (BM, BDQK), g (BM, BDV)
        s_t = _dot(k, tl.trans(q), UPCAST) * SCALE  # (BN, BM): s·q_i·k_j
        keep_t = tl.trans(_kept_pairs(rows, cols, seg_i, seg_j, w))  # (BN, BM)
        # masked before exp: a dropped pair may score far above LSE_i (past w_h, another segment)
        p_t = tl.exp(tl.where(keep_t, s_t, float("-inf")) - lse[None, :])  # (BN, BM), 0 off the kept pairs
        dv += _dot(p_t, g, UPCAST)  # (BN, BDV)
        dp_t = _dot(v, tl.trans(g), UPCAST)  # (BN, BM): dO_i·v_j
        ds_t = p_t * (dp_t - delta[None, :])
        dk += _dot(ds_t, q, UPCAST)  # (BN, BDQK)
    _store_tile(dk_ptr + h * stride_dkh, cols, col_ok, stride_dkn, dk * SCALE, DQK, BLOCK_DQK)
    _store_tile(dv_ptr + h * stride_dvh, cols, col_ok, stride_dvn, dv, DV, BLOCK_DV)


@triton.jit
def _dq_kernel(
    q_ptr, k_ptr, v_ptr, d_out_ptr, lse_ptr, delta_ptr, seg_ptr, seg_start_ptr, head_windows_ptr, dq_ptr,
    n, window,
    stride_qn, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh, stride_gn, stride_gh, stride_lh,
    stride_dqn, stride_dqh,
    SCALE: tl.constexpr, DQK: tl.constexpr, BLOCK_DQK: tl.constexpr, DV: tl.constexpr, BLOCK_DV: tl.constexpr,
    UPCAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """One program per (query tile of BLOCK_M, head): dQ_i = s·Σ_j dS_ij·k_j over the keys j in
    [max(segment start, i − w_h), i], fp32 accumulation, stored in dq's dtype."""
    m0 = tl.program_id(0) * BLOCK_M
    h = tl.program_id(1)
    w = _head_window(head_windows_ptr, h, window)
    rows = m0 + tl.arange(0, BLOCK_M)  # queries i
    row_ok = rows < n
    q, g, seg_i, lse, delta = _query_tile(q_ptr, d_out_ptr, seg_ptr, lse_ptr, delta_ptr, h, rows, n,
                                          stride_qn, stride_qh, stride_gn, stride_gh, stride_lh,
                                          DQK, BLOCK_DQK, DV, BLOCK_DV)  # q (BM, BDQK), g (BM, BDV)
    # segment starts never decrease with i: the first query's start bounds every row's (>= 0)
    lo = tl.maximum(tl.load(seg_start_ptr + m0), m0 - w)
    lo = (lo // BLOCK_N) * BLOCK_N  # key tiles aligned to BLOCK_N (lo >= 0: no negative division)
    last = tl.minimum(m0 + BLOCK_M, n) - 1  # the tile's last query: no key past it is kept
    dq = tl.zeros((BLOCK_M, BLOCK_DQK), tl.float32)
    for n0 in range(lo, last + 1, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)  # keys j
        col_ok = cols < n
        k = _tile(k_ptr + h * stride_kh, cols, col_ok, stride_kn, DQK, BLOCK_DQK)  # (BN, BDQK)
        v = _tile(v_ptr + h * stride_vh, cols, col_ok, stride_vn, DV, BLOCK_DV)  # (BN, BDV)
        seg_j = tl.load(seg_ptr + cols, mask=col_ok, other=-2)
        s = _dot(q, tl.trans(k), UPCAST) * SCALE  # (BM, BN)
        keep = _kept_pairs(rows, cols, seg_i, seg_j, w)
        p = tl.exp(tl.where(keep, s, float("-inf")) - lse[:, None])  # (BM, BN)
        dp = _dot(g, tl.trans(v), UPCAST)  # (BM, BN)
        ds = p * (dp - delta[:, None])
        dq += _dot(ds, k, UPCAST)  # (BM, BDQK)
    _store_tile(dq_ptr + h * stride_dqh, rows, row_ok, stride_dqn, dq * SCALE, DQK, BLOCK_DQK)


# ------------------------------------------------------------------------------------------------
# Host side

def segment_bounds(cu_seqlens: Tensor, n: int) -> tuple[Tensor, Tensor, Tensor]:
    """(segment id, segment start, segment end), int32 [n] each, on cu_seqlens' device, from one
    searchsorted (no host sync). The id is the number of cu_seqlens entries <= i (equal ids: one segment,
    `perf.attention_backends.segment_ids` + 1); start the last entry <= i, end the first entry > i (n past
    the last). Entries are clamped to n; repeated entries (padding) make empty segments."""
    cu = cu_seqlens.long().clamp(max=n)
    seg = torch.searchsorted(cu, torch.arange(n, device=cu.device), right=True)  # (n,) int64
    start = torch.cat([cu.new_zeros(1), cu])[seg]
    end = torch.cat([cu, cu.new_full((1,), n)])[seg]
    return seg.int(), start.int(), end.int()


def check_layout(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor) -> None:
    """q, k [n, H, d_qk], v [n, H, d_v] and cu_seqlens' segments: the checks the definition
    (perf/windowed_backward.py, which imports this module) and the kernels share."""
    if q.dim() != 3 or k.shape != q.shape or v.dim() != 3 or v.shape[:2] != q.shape[:2]:
        raise ValueError(f"windowed attention: q, k [n, H, d_qk] and v [n, H, d_v], got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    _check_segments(cu_seqlens, q.shape[0])


def check_backward_inputs(name, q, k, v, out, lse, d_out, cu_seqlens, head_windows) -> None:
    """The restricted backward's checks from shapes and dtypes only, shared by the definition and the kernels:
    the layout, out and d_out like v, lse [H, n], the int32 code table [H]."""
    check_layout(q, k, v, cu_seqlens)
    n, H, _ = q.shape
    if out.shape != v.shape or d_out.shape != v.shape or lse.shape != (H, n) or head_windows.shape != (H,):
        raise ValueError(f"{name}: out, d_out {tuple(v.shape)}, lse {(H, n)} and "
                         f"head_windows {(H,)} expected, got {tuple(out.shape)}, {tuple(d_out.shape)}, "
                         f"{tuple(lse.shape)}, {tuple(head_windows.shape)}")
    if head_windows.dtype != torch.int32:
        raise TypeError(f"head_windows must be int32 (the persistent code table), got {head_windows.dtype}")


def _check_inputs(name, q, k, v, out, lse, d_out, cu_seqlens, head_windows) -> None:
    """`check_backward_inputs`, then what the kernels alone need: their dtypes and int32 offsets."""
    check_backward_inputs(name, q, k, v, out, lse, d_out, cu_seqlens, head_windows)
    bad = [t.dtype for t in (q, k, v, out, d_out) if t.dtype not in KERNEL_DTYPES]
    if bad:
        raise TypeError(f"{name}: q, k, v, out, d_out must be bf16, fp16 or fp32 (the definition "
                        f"runs the others), got {bad[0]}")
    span = max(1 + sum((size - 1) * abs(stride) for size, stride in zip(t.shape, t.stride()))
               for t in (q, k, v, out, d_out, lse))
    if min(q.shape) > 0 and span > INT32_MAX:  # record: 65,536 × 3 × 128 = 25M elements per tensor
        raise ValueError(f"{name}: the kernels index elements with int32 offsets; a tensor spans {span} > {INT32_MAX}")


def _unit_last_stride(t: Tensor) -> Tensor:
    """The kernels index rows and heads by stride, the last dimension densely: copy only if it is not."""
    return t if t.stride(-1) == 1 else t.contiguous()


def _tiles(device: torch.device, d_v: int) -> dict:
    if device.type != "cuda":
        return TILES["interpreter"]
    return TILES["cuda_dv128" if d_v > 64 else "cuda"]


def _constexprs(q: Tensor, k: Tensor, v: Tensor, d_out: Tensor, scale: float) -> dict:
    """The kernels' constexprs: the scale, the head widths and their tile widths (powers of two >= 16, the
    columns past d masked), UPCAST (`_dot`) and the tiles."""
    d_qk, d_v = q.shape[-1], v.shape[-1]
    same = q.dtype == k.dtype == v.dtype == d_out.dtype
    upcast = q.device.type != "cuda" or not same or q.dtype not in TENSOR_CORE_DTYPES
    return dict(SCALE=float(scale), DQK=d_qk, BLOCK_DQK=max(16, triton.next_power_of_2(d_qk)), DV=d_v,
                BLOCK_DV=max(16, triton.next_power_of_2(d_v)), UPCAST=upcast, **_tiles(q.device, d_v))


def windowed_attention_backward_triton(q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, d_out: Tensor,
                                       cu_seqlens: Tensor, scale: float, window: int, head_windows: Tensor,
                                       chunk: int = 2048) -> tuple[Tensor, Tensor, Tensor]:
    """`perf.windowed_backward.windowed_attention_backward` on the Triton kernels: (dq, dk, dv), stream layout,
    contiguous, in q's, k's, v's dtypes (bf16, fp16 or fp32), fp32 accumulation.

    window is the forward's (launch) window W, a Python int (fixed per schedule stage, as the graphs'
    shapes are); head_windows the int32 [H] code table (−1 = W), read on the device by the kernels. chunk
    is the definition's query chunk, unused here (the kernels never hold more than a tile of scores).
    Three launches (module docstring), no host sync."""
    name = "windowed_attention_backward_triton"
    _check_inputs(name, q, k, v, out, lse, d_out, cu_seqlens, head_windows)
    n, H, d_qk = q.shape
    d_v = v.shape[-1]
    q, k, v, out, d_out = (_unit_last_stride(t) for t in (q, k, v, out, d_out))  # (n, H, d)
    lse = lse if lse.dtype == torch.float32 and lse.stride(-1) == 1 else lse.float().contiguous()  # (H, n)
    head_windows = head_windows.contiguous()  # (H,): the table itself when dense (always, in a run)
    dq = torch.empty(n, H, d_qk, dtype=q.dtype, device=q.device)
    dk = torch.empty(n, H, d_qk, dtype=k.dtype, device=k.device)
    dv = torch.empty(n, H, d_v, dtype=v.dtype, device=v.device)
    if n == 0 or H == 0:
        return dq, dk, dv
    seg, seg_start, seg_end = segment_bounds(cu_seqlens, n)  # (n,) int32 each
    delta = torch.empty(H, n, dtype=torch.float32, device=q.device)  # (H, n) D_i
    meta = _constexprs(q, k, v, d_out, scale)
    block_m, block_n = meta["BLOCK_M"], meta["BLOCK_N"]
    launch = dict(num_warps=meta["num_warps"], num_stages=meta["num_stages"])
    tiles = {key: meta[key] for key in ("SCALE", "DQK", "BLOCK_DQK", "DV", "BLOCK_DV", "UPCAST", "BLOCK_M", "BLOCK_N")}
    _delta_kernel[(triton.cdiv(n, block_m), H)](
        out, d_out, delta, n, out.stride(0), out.stride(1), d_out.stride(0), d_out.stride(1),
        DV=d_v, BLOCK_DV=meta["BLOCK_DV"], BLOCK_M=block_m, **launch)
    strides = (q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
               d_out.stride(0), d_out.stride(1), lse.stride(0))
    _dkdv_kernel[(triton.cdiv(n, block_n), H)](
        q, k, v, d_out, lse, delta, seg, seg_end, head_windows, dk, dv, n, window, *strides,
        dk.stride(0), dk.stride(1), dv.stride(0), dv.stride(1), **tiles, **launch)
    _dq_kernel[(triton.cdiv(n, block_m), H)](
        q, k, v, d_out, lse, delta, seg, seg_start, head_windows, dq, n, window, *strides,
        dq.stride(0), dq.stride(1), **tiles, **launch)
    return dq, dk, dv
