"""The CPLM pointer head (upstream PR #379, frontier_cplm.md §5): the definition, dense in its band.

Query i, in block b = ⌊i/L⌋ of L tokens, sees source j iff j < i, doc(j) = doc(i) and j ≥ bL − L;
s_ij = q_i·k_j/√d and the sink's s0_i = q_i·k_sink/√d (fp32 accumulation); Z_i = e^s0_i + Σ_valid e^s_ij,
a_sink_i = e^s0_i/Z_i and p_copy_i = Σ_{valid j: x_j = y_i} e^s_ij/Z_i. A query without a source gets
a_sink 1, p_copy 0; the current token is never its own source.

perf sits below model (docs/design.md), so the math lives here, with the kernels that implement it;
model/cplm.py (the mixture) calls `copy_pointer`.

    p_copy, a_sink = copy_pointer_portable(q, k, k_sink, inputs, targets, cu_seqlens, band)   # (N,), (N,) fp32

The fast path (PR #379's `copy_sink_probs_fused` / `CopySinkFused`), `copy_pointer_triton`, same contract:
flash-style Triton kernels that never hold more than a (BLOCK_M, BLOCK_N) tile of scores.
    forward   one program per query tile: key tiles from ⌊max(dstart, bL − L, 0)/BLOCK_N⌋·BLOCK_N to the
              tile's last row, an online softmax seeded with the sink (max s0_i, sum 1) that also keeps
              the hit mass; writes lse_i = ln Z_i, p_copy_i, a_sink_i                        1 launch
    backward  ∂L/∂s_ij = a_ij·(gP_i·[x_j = y_i] − drow_i), drow_i = gP_i·p_copy_i + gA_i·a_sink_i:
              dq over query tiles (the forward's key range), dk over key tiles (queries up to
              min(dend(last key), (⌊last key/L⌋ + 2)·L, N))                                 2 launches
The sink score s0 = q·k_sink/√d is a torch product outside the kernels, so ∂L/∂s0 = a_sink·(gA − drow)
reaches q and k_sink through ordinary autograd. Document bounds come from a device searchsorted (no
host sync: the op lives inside the compiled, captured step). `copy_pointer` picks the path on
`perf.backend.current().triton`. The band need not be a multiple of the tile: each row checks its own
band start, so the CPU tests can use small bands (PR #379 requires L to be a multiple of 64).

Run the parity tests: pytest tests/perf/test_perf_kernels_copy_pointer.py -q (CPU, Triton interpreter).
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch import Tensor

from perf.backend import current


def pointer_documents(cu_seqlens: Tensor, n: int) -> Tensor:
    """doc(i) [n] int64: the number of cu_seqlens entries <= i (entries clamped to n): equal for
    positions of one attention segment (training) or one BOS-delimited document (validation)."""
    cu = cu_seqlens.long().clamp(max=n)
    return torch.searchsorted(cu, torch.arange(n, device=cu.device), right=True)


def _check_inputs(name: str, q: Tensor, k: Tensor, k_sink: Tensor, inputs: Tensor, targets: Tensor,
                  band: int) -> None:
    """Shapes and band, from Python ints only (no host sync): both paths raise the same messages."""
    if q.dim() != 2:
        raise ValueError(f"{name}: q must be [N, d], got {tuple(q.shape)}")
    N, d = q.shape
    if k.shape != (N, d) or k_sink.shape != (d,) or inputs.shape != (N,) or targets.shape != (N,):
        raise ValueError(f"{name}: q, k must be [N, d], k_sink [d], inputs and targets [N]; got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(k_sink.shape)}, {tuple(inputs.shape)}, "
                         f"{tuple(targets.shape)}")
    if band < 1:
        raise ValueError(f"{name}: band must be a positive token count, got {band}")


def copy_pointer_portable(q: Tensor, k: Tensor, k_sink: Tensor, inputs: Tensor, targets: Tensor, cu_seqlens: Tensor,
                 band: int) -> tuple[Tensor, Tensor]:
    """The pointer head (frontier_cplm.md §5): (p_copy [N], a_sink [N]) fp32, differentiable in q, k, k_sink.

    q, k [N, d] (already QK-normed, q gained; bf16 in a run), k_sink [d]; inputs [N] (x_j, the tokens
    a source copies), targets [N] (y_i); cu_seqlens the documents (see `pointer_documents`); band L.
    Query i, in block b = ⌊i/L⌋, sees source j iff j < i, doc(j) = doc(i) and j ≥ bL − L. Scores in fp32,
    s_ij = q_i·k_j/√d, s0_i = q_i·k_sink/√d; Z_i = e^s0_i + Σ_valid e^s_ij; a_sink_i = e^s0_i/Z_i and
    p_copy_i = Σ_{valid j: x_j = y_i} e^s_ij/Z_i. A query without a source gets a_sink 1, p_copy 0.
    Computed per block against the 2L keys it may see ([⌈N/L⌉, L, 2L] scores: dense in the band)."""
    _check_inputs("copy_pointer_portable", q, k, k_sink, inputs, targets, band)
    N, d = q.shape
    scale = 1.0 / math.sqrt(d)
    # a band past N changes nothing (every query is in block 0, which sees back to the document's start):
    # N keeps the scores [1, N, 2N], not [1, L, 2L] (a CPU validation's 1,024 rows against L = 8192)
    band = max(1, min(band, N))
    blocks = -(-N // band)
    pad = blocks * band - N
    device = q.device
    doc = pointer_documents(cu_seqlens, N)
    # keys padded by one band in front (block 0's "previous block") and to whole blocks behind
    kp = torch.cat([k.new_zeros(band, d), k, k.new_zeros(pad, d)]).float()  # (band + blocks·band, d)
    xp = torch.cat([inputs.new_full((band,), -1), inputs, inputs.new_full((pad,), -1)]).long()
    dp = torch.cat([doc.new_full((band,), -1), doc, doc.new_full((pad,), -2)])
    qb = torch.cat([q, q.new_zeros(pad, d)]).float().view(blocks, band, d)  # (B, L, d)
    window = torch.arange(blocks, device=device)[:, None] * band + torch.arange(2 * band, device=device)  # (B, 2L)
    kw, xw, dw = kp[window], xp[window], dp[window]  # (B, 2L, d), (B, 2L), (B, 2L): keys bL − L .. bL + L − 1
    i = torch.arange(blocks * band, device=device).view(blocks, band)  # (B, L) query positions
    j = window - band  # (B, 2L) key positions
    qdoc = torch.cat([doc, doc.new_full((pad,), -3)]).view(blocks, band)
    valid = (j[:, None, :] < i[:, :, None]) & (dw[:, None, :] == qdoc[:, :, None])  # (B, L, 2L)
    yq = torch.cat([targets.long(), targets.new_full((pad,), -4).long()]).view(blocks, band)
    hit = valid & (xw[:, None, :] == yq[:, :, None])
    s = torch.einsum("bld,bmd->blm", qb, kw) * scale  # (B, L, 2L)
    s0 = (qb @ k_sink.float()) * scale  # (B, L)
    s = s.masked_fill(~valid, float("-inf"))
    m = torch.maximum(s0, s.amax(-1))  # (B, L): finite (s0 is)
    e = torch.exp(s - m[..., None])  # 0 where invalid
    e0 = torch.exp(s0 - m)
    z = e0 + e.sum(-1)
    p_copy = (e * hit).sum(-1) / z
    a_sink = e0 / z
    return p_copy.reshape(-1)[:N], a_sink.reshape(-1)[:N]


# ------------------------------------------------------------------------------------------------
# The fast path: flash-style Triton kernels (PR #379's `CopySinkFused`), same math, no dense band
#
# Documents on the device, as [N] int32 vectors from one searchsorted (no host sync): doc(i) as
# `pointer_documents`, dstart(i) the largest cu_seqlens entry <= i (0 if none), dend(i) the smallest
# entry > i (N if none). They only bound the loops; which pairs count is decided per element
# (`_valid_pairs`), so a loose bound costs time, never a wrong number.

def _documents(cu_seqlens: Tensor, n: int) -> tuple[Tensor, Tensor, Tensor]:
    """(doc, dstart, dend), int32 [n] each, on cu_seqlens' device. cu_seqlens may repeat entries
    (0 at the front, n as trailing padding); entries are clamped to n, as `pointer_documents` does."""
    cu = cu_seqlens.long().clamp(max=n)
    doc = pointer_documents(cu, n)  # (n,) int64: the number of entries <= i
    dstart = torch.cat([cu.new_zeros(1), cu])[doc]  # cu[doc − 1]: the last entry <= i (0 when none)
    dend = torch.cat([cu, cu.new_full((1,), n)])[doc]  # cu[doc]: the first entry > i (n past the last)
    return doc.int(), dstart.int(), dend.int()


@triton.jit
def _row_tile(ptr, rows, row_ok, D: tl.constexpr, BLOCK_D: tl.constexpr):
    """(len(rows), BLOCK_D) tile of a row-major [N, D] tensor in its own dtype; rows past N (row_ok
    False) and columns past D read 0. The column mask is emitted only when BLOCK_D > D (d not a power
    of two, or below tl.dot's 16)."""
    dcols = tl.arange(0, BLOCK_D)
    ptrs = ptr + rows[:, None] * D + dcols[None, :]
    if BLOCK_D == D:
        return tl.load(ptrs, mask=row_ok[:, None], other=0.0)
    else:
        return tl.load(ptrs, mask=row_ok[:, None] & (dcols[None, :] < D), other=0.0)


@triton.jit
def _dot(a, b, UPCAST: tl.constexpr):
    """a·b with fp32 accumulation. UPCAST (the interpreter, whose bf16 tl.dot is garbage in Triton 3.8;
    fp32 operands on a GPU, which would otherwise get TF32): fp32 operands, IEEE products. Otherwise
    a is cast to b's dtype first (bf16 on the GPU: ∂L/∂s is rounded to bf16 before each tile product,
    as PR #379 does)."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a.to(b.dtype), b)


@triton.jit
def _key_start(dstart_ptr, m0, L, BLOCK_N: tl.constexpr):
    """First key tile of the query tile starting at m0: ⌊max(dstart(m0), ⌊m0/L⌋·L − L, 0)/BLOCK_N⌋·BLOCK_N.
    Every later row's document and band start no earlier, so no row of the tile has a source before it."""
    lo = tl.maximum(tl.load(dstart_ptr + m0), (m0 // L) * L - L)
    lo = tl.maximum(lo, 0)  # non-negative before the division (C and NumPy round negatives differently)
    return (lo // BLOCK_N) * BLOCK_N


@triton.jit
def _valid_pairs(rows, cols, doc_i, doc_j, band_i):
    """(BLOCK_M, BLOCK_N) pairs where key j is a source of query i: j < i, doc(j) = doc(i), j ≥ the
    row's band start ⌊i/L⌋·L − L. Rows past N load doc −1 and keys past N doc −2, so those pairs
    never match (doc ids are >= 0): the j < N rule is in the sentinels."""
    return (cols[None, :] < rows[:, None]) & (doc_j[None, :] == doc_i[:, None]) & (cols[None, :] >= band_i[:, None])


@triton.jit
def _score_grad(q, k, rows, cols, doc_i, doc_j, band_i, y_i, x_j, lse, g_copy, drow,
                SCALE: tl.constexpr, UPCAST: tl.constexpr):
    """∂L/∂s (BLOCK_M, BLOCK_N) fp32 for a query tile q and key tile k: a_ij·(gP_i·[x_j = y_i] − drow_i)
    on valid pairs (a_ij = exp(s_ij − lse_i), the forward's probability recomputed), 0 elsewhere."""
    s = _dot(q, tl.trans(k), UPCAST) * SCALE  # (BM, BN)
    valid = _valid_pairs(rows, cols, doc_i, doc_j, band_i)
    a = tl.exp(tl.where(valid, s, float("-inf")) - lse[:, None])  # 0 off the valid pairs
    hit = x_j[None, :] == y_i[:, None]
    return a * (tl.where(hit, g_copy[:, None], 0.0) - drow[:, None])


@triton.jit
def _key_tile(k_ptr, doc_ptr, inputs_ptr, cols, N, D: tl.constexpr, BLOCK_D: tl.constexpr):
    """A key tile's (k (BLOCK_N, BLOCK_D), col_ok, doc_j, x_j): keys past N read doc −2 and token −1,
    so they pair with no query and match no target."""
    col_ok = cols < N
    k = _row_tile(k_ptr, cols, col_ok, D, BLOCK_D)
    doc_j = tl.load(doc_ptr + cols, mask=col_ok, other=-2)
    x_j = tl.load(inputs_ptr + cols, mask=col_ok, other=-1)
    return k, col_ok, doc_j, x_j


@triton.jit
def _query_grad_tile(q_ptr, doc_ptr, targets_ptr, lse_ptr, g_copy_ptr, drow_ptr, rows, N, L,
                     D: tl.constexpr, BLOCK_D: tl.constexpr):
    """A query tile's backward inputs (q (BLOCK_M, BLOCK_D), row_ok, doc_i, y_i, lse_i, gP_i, drow_i, band
    start_i): rows past N read doc −1 and target −1; the band start per row, as a tile may straddle blocks."""
    row_ok = rows < N
    q = _row_tile(q_ptr, rows, row_ok, D, BLOCK_D)
    doc_i = tl.load(doc_ptr + rows, mask=row_ok, other=-1)
    y_i = tl.load(targets_ptr + rows, mask=row_ok, other=-1)
    lse = tl.load(lse_ptr + rows, mask=row_ok, other=0.0)
    g_copy = tl.load(g_copy_ptr + rows, mask=row_ok, other=0.0)
    drow = tl.load(drow_ptr + rows, mask=row_ok, other=0.0)
    return q, row_ok, doc_i, y_i, lse, g_copy, drow, (rows // L) * L - L


@triton.jit
def _copy_pointer_fwd_kernel(
    q_ptr, k_ptr, s0_ptr, inputs_ptr, targets_ptr, doc_ptr, dstart_ptr, lse_ptr, p_copy_ptr, a_sink_ptr,
    N, L,
    SCALE: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """One program per tile of BLOCK_M queries: lse_i = ln Z_i, p_copy_i and a_sink_i (fp32 [N] each).

    Portable twin: `copy_pointer_portable` (p_copy, a_sink). Online softmax over the key tiles from
    `_key_start` up to the tile's last row, whose running max starts at the sink score s0_i with a
    running sum of 1 (e^{s0 − m} at m = s0: the sink is the first term, so Z_i > 0 and the max is
    finite even for a query with no source); beside the total it keeps the hit mass Σ_{x_j = y_i}.
    No [N, N] or [N/L, L, 2L] tensor: each pair's score lives in one (BLOCK_M, BLOCK_N) tile.
    """
    m0 = tl.program_id(0) * BLOCK_M
    rows = m0 + tl.arange(0, BLOCK_M)
    row_ok = rows < N
    q = _row_tile(q_ptr, rows, row_ok, D, BLOCK_D)  # (BM, BD)
    s0 = tl.load(s0_ptr + rows, mask=row_ok, other=0.0)
    doc_i = tl.load(doc_ptr + rows, mask=row_ok, other=-1)
    y_i = tl.load(targets_ptr + rows, mask=row_ok, other=-1)
    band_i = (rows // L) * L - L  # per row: a tile may straddle blocks when L is not a multiple of BLOCK_M
    m_i = s0  # running max
    z_i = tl.full((BLOCK_M,), 1.0, tl.float32)  # Σ e^{s − m}: the sink's e^{s0 − s0}
    h_i = tl.zeros((BLOCK_M,), tl.float32)  # the hit mass, same scale
    last = tl.minimum(m0 + BLOCK_M, N) - 1  # the tile's last row: keys j < i stop before it
    for n0 in range(_key_start(dstart_ptr, m0, L, BLOCK_N), last, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        k, col_ok, doc_j, x_j = _key_tile(k_ptr, doc_ptr, inputs_ptr, cols, N, D, BLOCK_D)  # k: (BN, BD)
        s = _dot(q, tl.trans(k), UPCAST) * SCALE  # (BM, BN) fp32
        s = tl.where(_valid_pairs(rows, cols, doc_i, doc_j, band_i), s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))  # finite: m_i starts at s0
        rescale = tl.exp(m_i - m_new)
        e = tl.exp(s - m_new[:, None])  # 0 off the valid pairs
        z_i = z_i * rescale + tl.sum(e, axis=1)
        h_i = h_i * rescale + tl.sum(tl.where(x_j[None, :] == y_i[:, None], e, 0.0), axis=1)
        m_i = m_new
    tl.store(lse_ptr + rows, m_i + tl.log(z_i), mask=row_ok)
    tl.store(p_copy_ptr + rows, h_i / z_i, mask=row_ok)
    tl.store(a_sink_ptr + rows, tl.exp(s0 - m_i) / z_i, mask=row_ok)


@triton.jit
def _copy_pointer_dq_kernel(
    q_ptr, k_ptr, inputs_ptr, targets_ptr, doc_ptr, dstart_ptr, lse_ptr, g_copy_ptr, drow_ptr, dq_ptr,
    N, L,
    SCALE: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """One program per query tile: dq_i = SCALE·Σ_j ∂L/∂s_ij·k_j over the forward's key range (`_score_grad`),
    fp32 accumulation, stored in q's dtype. Portable twin: autograd of `copy_pointer_portable` (the part
    through the pair scores; the sink's part reaches q through s0 outside the kernel)."""
    m0 = tl.program_id(0) * BLOCK_M
    rows = m0 + tl.arange(0, BLOCK_M)
    q, row_ok, doc_i, y_i, lse, g_copy, drow, band_i = _query_grad_tile(
        q_ptr, doc_ptr, targets_ptr, lse_ptr, g_copy_ptr, drow_ptr, rows, N, L, D, BLOCK_D)  # q: (BM, BD)
    acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    last = tl.minimum(m0 + BLOCK_M, N) - 1
    for n0 in range(_key_start(dstart_ptr, m0, L, BLOCK_N), last, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        k, col_ok, doc_j, x_j = _key_tile(k_ptr, doc_ptr, inputs_ptr, cols, N, D, BLOCK_D)  # k: (BN, BD)
        ds = _score_grad(q, k, rows, cols, doc_i, doc_j, band_i, y_i, x_j, lse, g_copy, drow, SCALE, UPCAST)
        acc += _dot(ds, k, UPCAST)  # (BM, BD)
    dcols = tl.arange(0, BLOCK_D)
    tl.store(dq_ptr + rows[:, None] * D + dcols[None, :], (acc * SCALE).to(dq_ptr.dtype.element_ty),
             mask=row_ok[:, None] & (dcols[None, :] < D))


@triton.jit
def _copy_pointer_dk_kernel(
    q_ptr, k_ptr, inputs_ptr, targets_ptr, doc_ptr, dend_ptr, lse_ptr, g_copy_ptr, drow_ptr, dk_ptr,
    N, L,
    SCALE: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """One program per key tile of BLOCK_N: dk_j = SCALE·Σ_i ∂L/∂s_ij·q_i, fp32 accumulation, stored in
    k's dtype. Queries from the tile's first key up to min(dend(last key), (⌊last key/L⌋ + 2)·L, N):
    a later query is in another document, or two blocks on, where the band no longer reaches the tile."""
    n0 = tl.program_id(0) * BLOCK_N
    cols = n0 + tl.arange(0, BLOCK_N)
    k, col_ok, doc_j, x_j = _key_tile(k_ptr, doc_ptr, inputs_ptr, cols, N, D, BLOCK_D)  # k: (BN, BD)
    last = tl.minimum(n0 + BLOCK_N, N) - 1  # the tile's last key
    end = tl.minimum(tl.minimum(tl.load(dend_ptr + last), (last // L + 2) * L), N)
    acc = tl.zeros((BLOCK_N, BLOCK_D), tl.float32)
    for m0 in range(n0, end, BLOCK_M):
        rows = m0 + tl.arange(0, BLOCK_M)
        q, row_ok, doc_i, y_i, lse, g_copy, drow, band_i = _query_grad_tile(
            q_ptr, doc_ptr, targets_ptr, lse_ptr, g_copy_ptr, drow_ptr, rows, N, L, D, BLOCK_D)  # q: (BM, BD)
        ds = _score_grad(q, k, rows, cols, doc_i, doc_j, band_i, y_i, x_j, lse, g_copy, drow, SCALE, UPCAST)
        acc += _dot(tl.trans(ds), q, UPCAST)  # (BN, BD)
    dcols = tl.arange(0, BLOCK_D)
    tl.store(dk_ptr + cols[:, None] * D + dcols[None, :], (acc * SCALE).to(dk_ptr.dtype.element_ty),
             mask=col_ok[:, None] & (dcols[None, :] < D))


# Launch configurations by name; tests compile every "cuda*" one for SM90 (tests/perf/test_perf_compile_sm90.py).
TILES = {
    "cuda": dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=3),  # PR #379's (d = 128; L a multiple of 64)
    "interpreter": dict(BLOCK_M=16, BLOCK_N=16, num_warps=1, num_stages=1),  # CPU tests: several tiles per block
}
TENSOR_CORE_DTYPES = (torch.bfloat16, torch.float16)  # tl.dot in the operands' own dtype on a GPU


def _tiles(device: torch.device) -> dict:
    return TILES["cuda" if device.type == "cuda" else "interpreter"]


def _constexprs(q: Tensor, k: Tensor) -> dict:
    """The kernels' constexprs for q, k [N, d]: the scale, d, its tile width (a power of two >= 16, the
    columns past d masked) and UPCAST (`_dot`)."""
    d = q.shape[1]
    upcast = q.device.type != "cuda" or q.dtype != k.dtype or q.dtype not in TENSOR_CORE_DTYPES
    return dict(SCALE=1.0 / math.sqrt(d), D=d, BLOCK_D=max(16, triton.next_power_of_2(d)), UPCAST=upcast,
                **_tiles(q.device))


class CopyPointerFunction(torch.autograd.Function):
    """(p_copy, a_sink) fp32 [N] of q, k [N, d] and the sink scores s0 [N] (fp32, computed by the caller
    so their gradient reaches q and k_sink through ordinary autograd). Forward: one launch, which keeps
    lse, p_copy and a_sink [N] for the backward (nothing of size N × keys). Backward: the dq launch over
    query tiles and the dk launch over key tiles, both recomputing the pair probabilities from lse;
    ∂L/∂s0 = a_sink·(gA − drow) is a torch expression on [N] vectors. Shapes and band are Python ints:
    no host sync, so it traces under torch.compile(fullgraph=True) and CUDA-graph capture."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, s0: Tensor, inputs: Tensor, targets: Tensor, doc: Tensor,
                dstart: Tensor, dend: Tensor, band: int) -> tuple[Tensor, Tensor]:
        N = q.shape[0]
        f32 = dict(dtype=torch.float32, device=q.device)
        lse, p_copy, a_sink = torch.empty(N, **f32), torch.empty(N, **f32), torch.empty(N, **f32)
        meta = _constexprs(q, k)
        if N > 0:
            _copy_pointer_fwd_kernel[(triton.cdiv(N, meta["BLOCK_M"]),)](
                q, k, s0, inputs, targets, doc, dstart, lse, p_copy, a_sink, N, band, **meta)
        ctx.save_for_backward(q, k, inputs, targets, doc, dstart, dend, lse, p_copy, a_sink)
        ctx.band = band
        return p_copy, a_sink

    @staticmethod
    def backward(ctx, g_copy: Tensor, g_sink: Tensor):
        q, k, inputs, targets, doc, dstart, dend, lse, p_copy, a_sink = ctx.saved_tensors
        N, band = q.shape[0], ctx.band
        g_copy, g_sink = g_copy.float().contiguous(), g_sink.float().contiguous()  # (N,), (N,)
        drow = g_copy * p_copy + g_sink * a_sink  # Σ_j a_ij·∂L/∂(a_ij): the softmax's row term
        ds0 = a_sink * (g_sink - drow)  # (N,) ∂L/∂s0
        meta = _constexprs(q, k)
        dq = dk = None
        if ctx.needs_input_grad[0]:
            dq = torch.empty_like(q)
            if N > 0:
                _copy_pointer_dq_kernel[(triton.cdiv(N, meta["BLOCK_M"]),)](
                    q, k, inputs, targets, doc, dstart, lse, g_copy, drow, dq, N, band, **meta)
        if ctx.needs_input_grad[1]:
            dk = torch.empty_like(k)
            if N > 0:
                _copy_pointer_dk_kernel[(triton.cdiv(N, meta["BLOCK_N"]),)](
                    q, k, inputs, targets, doc, dend, lse, g_copy, drow, dk, N, band, **meta)
        return dq, dk, ds0, None, None, None, None, None, None


def copy_pointer_triton(q: Tensor, k: Tensor, k_sink: Tensor, inputs: Tensor, targets: Tensor, cu_seqlens: Tensor,
                        band: int) -> tuple[Tensor, Tensor]:
    """`copy_pointer_portable`'s contract on the Triton kernels: (p_copy [N], a_sink [N]) fp32,
    differentiable in q, k and k_sink; no host sync (documents by device searchsorted)."""
    _check_inputs("copy_pointer_triton", q, k, k_sink, inputs, targets, band)
    N, d = q.shape
    s0 = (q.float() @ k_sink.float()) * (1.0 / math.sqrt(d))  # (N,) fp32, as the twin scores the sink
    doc, dstart, dend = _documents(cu_seqlens, N)
    return CopyPointerFunction.apply(q.contiguous(), k.contiguous(), s0.contiguous(), inputs.contiguous(),
                                     targets.contiguous(), doc, dstart, dend, band)


# ------------------------------------------------------------------------------------------------
# Public op

def copy_pointer(q: Tensor, k: Tensor, k_sink: Tensor, inputs: Tensor, targets: Tensor, cu_seqlens: Tensor,
                 band: int) -> tuple[Tensor, Tensor]:
    """The pointer head, (p_copy [N], a_sink [N]) fp32: the Triton kernels when
    `perf.backend.current().triton`, else the definition (`copy_pointer_portable`)."""
    if current().triton:
        return copy_pointer_triton(q, k, k_sink, inputs, targets, cu_seqlens, band)
    return copy_pointer_portable(q, k, k_sink, inputs, targets, cu_seqlens, band)
