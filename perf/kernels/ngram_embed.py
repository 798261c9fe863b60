"""N-gram embedding output: two looked-up table rows, each multiplied by a ±1 sign row, summed per token.

Record #360 (track_1_short/ngram_table.py, track_1_short/perf/kernels/ngram_embed.py): per token t the model adds
    B[t] = row_bi[t] ⊙ sign[sign_bi[t]] + row_tri[t] ⊙ sign[sign_tri[t]]
computed in fp32 and stored in bf16 with one rounding. The rows come already gathered from this
rank's n-gram cache as one [2T, D] tensor (bigram rows first, then trigram rows): a leaf, the
"sink", whose gradient is the row-sparse gradient the n-gram Adam consumes. Its backward is
    d_rows[t] = dB[t] ⊙ sign[sign_bi[t]],   d_rows[T + t] = dB[t] ⊙ sign[sign_tri[t]]     (bf16)
so the cache and the table never get a dense gradient. The record fused this into one kernel so
AOTAutograd does not recompute the gathers (worth 3.4 ms/step, record #360's README).

Public function, dispatched on `perf.backend.current().triton` when called:
    ngram_embed(rows, sign_pool, sign_rows) -> (T, D) in rows' dtype
        rows       (2T, D) bf16       bigram rows [0, T), trigram rows [T, 2T)
        sign_pool  (S, D)             ±1 entries (record: 8192 rows, bf16); gets no gradient
        sign_rows  (2T,) int32/int64  the sign row of each looked-up row
The `ngram_embed_portable` twin (same signature, its own autograd Function) defines the math.

Run the parity tests: pytest tests/kernels -q (CPU, Triton interpreter).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from perf.backend import current, host_checks


def _check(rows: torch.Tensor, sign_pool: torch.Tensor, sign_rows: torch.Tensor) -> None:
    if rows.dim() != 2 or rows.shape[0] % 2:
        raise ValueError(f"ngram_embed: rows must be (2T, D) (bigram rows, then trigram rows), got {tuple(rows.shape)}")
    if sign_pool.dim() != 2 or sign_pool.shape[1] != rows.shape[1]:
        raise ValueError(f"ngram_embed: sign_pool must be (S, {rows.shape[1]}), got {tuple(sign_pool.shape)}")
    if sign_rows.shape != (rows.shape[0],) or sign_rows.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"ngram_embed: sign_rows must be int32/int64 of shape ({rows.shape[0]},), got "
                         f"{sign_rows.dtype} {tuple(sign_rows.shape)}")
    if not (rows.device == sign_pool.device == sign_rows.device):
        raise ValueError(f"ngram_embed: rows, sign_pool, sign_rows must share a device, got "
                         f"{rows.device}, {sign_pool.device}, {sign_rows.device}")
    # A range check reads the ids on the host: a stall on a GPU, a graph break under compile (host_checks()).
    if host_checks() and sign_rows.numel() and (
            int(sign_rows.min()) < 0 or int(sign_rows.max()) >= sign_pool.shape[0]):
        raise IndexError(f"ngram_embed: sign_rows must lie in [0, {sign_pool.shape[0]}), got range "
                         f"[{int(sign_rows.min())}, {int(sign_rows.max())}]")


# ------------------------------------------------------------------------------------------------
# Portable twin: the definition of the math

class _NgramEmbedPortable(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows, sign_pool, sign_rows):
        T = rows.shape[0] // 2
        signs = sign_pool[sign_rows].float()  # (2T, D)
        signed = rows.float() * signs
        ctx.save_for_backward(sign_pool, sign_rows)
        ctx.rows_dtype = rows.dtype
        return (signed[:T] + signed[T:]).to(rows.dtype)  # (T, D), one rounding

    @staticmethod
    def backward(ctx, grad_out):
        sign_pool, sign_rows = ctx.saved_tensors
        signs = sign_pool[sign_rows].float()  # (2T, D)
        g = grad_out.float()
        d_rows = (torch.cat([g, g]) * signs).to(ctx.rows_dtype)  # (2T, D): the sink gradient
        return d_rows, None, None


def ngram_embed_portable(rows: torch.Tensor, sign_pool: torch.Tensor, sign_rows: torch.Tensor) -> torch.Tensor:
    _check(rows, sign_pool, sign_rows)
    return _NgramEmbedPortable.apply(rows, sign_pool, sign_rows)


# ------------------------------------------------------------------------------------------------
# Triton kernels

@triton.jit
def _ngram_forward_kernel(
    rows_ptr, pool_ptr, sign_rows_ptr, out_ptr, T, D,
    stride_r, stride_p, stride_o,
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """out[t] = rows[t]·sign[sr[t]] + rows[T+t]·sign[sr[T+t]] in fp32, one rounding, for a (BLOCK_T × BLOCK_D) tile.

    Portable twin: `ngram_embed_portable` (forward). Parity: the same two fp32 products and one
    fp32 add (products with ±1 are exact, so the fp32 sum is bitwise the twin's), then one rounding:
    bit-exact on a GPU; within 1 bf16 ulp in the interpreter, whose stores truncate.
    """
    rt = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    rd = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    t_ok = rt < T
    mask = t_ok[:, None] & (rd[None, :] < D)
    rt64 = rt.to(tl.int64)
    sign_bi = tl.load(sign_rows_ptr + rt, mask=t_ok, other=0).to(tl.int64)
    sign_tri = tl.load(sign_rows_ptr + T + rt, mask=t_ok, other=0).to(tl.int64)
    bi = tl.load(rows_ptr + rt64[:, None] * stride_r + rd[None, :], mask=mask, other=0.0).to(tl.float32)
    tri = tl.load(rows_ptr + (T + rt64)[:, None] * stride_r + rd[None, :], mask=mask, other=0.0).to(tl.float32)
    s_bi = tl.load(pool_ptr + sign_bi[:, None] * stride_p + rd[None, :], mask=mask, other=0.0).to(tl.float32)
    s_tri = tl.load(pool_ptr + sign_tri[:, None] * stride_p + rd[None, :], mask=mask, other=0.0).to(tl.float32)
    out = bi * s_bi + tri * s_tri
    tl.store(out_ptr + rt64[:, None] * stride_o + rd[None, :], out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _ngram_backward_kernel(
    grad_ptr, pool_ptr, sign_rows_ptr, d_rows_ptr, T, D,
    stride_g, stride_p, stride_dr,
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """d_rows[t] = dB[t]·sign[sr[t]] and d_rows[T+t] = dB[t]·sign[sr[T+t]] for a (BLOCK_T × BLOCK_D) tile of dB.

    Portable twin: `ngram_embed_portable` (backward). A product with ±1 is exact, so the sink
    gradient is bit-exact against the twin (in the interpreter too: nothing is rounded).
    """
    rt = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    rd = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    t_ok = rt < T
    mask = t_ok[:, None] & (rd[None, :] < D)
    rt64 = rt.to(tl.int64)
    g = tl.load(grad_ptr + rt64[:, None] * stride_g + rd[None, :], mask=mask, other=0.0).to(tl.float32)
    sign_bi = tl.load(sign_rows_ptr + rt, mask=t_ok, other=0).to(tl.int64)
    sign_tri = tl.load(sign_rows_ptr + T + rt, mask=t_ok, other=0).to(tl.int64)
    s_bi = tl.load(pool_ptr + sign_bi[:, None] * stride_p + rd[None, :], mask=mask, other=0.0).to(tl.float32)
    s_tri = tl.load(pool_ptr + sign_tri[:, None] * stride_p + rd[None, :], mask=mask, other=0.0).to(tl.float32)
    out_ty = d_rows_ptr.dtype.element_ty
    tl.store(d_rows_ptr + rt64[:, None] * stride_dr + rd[None, :], (g * s_bi).to(out_ty), mask=mask)
    tl.store(d_rows_ptr + (T + rt64)[:, None] * stride_dr + rd[None, :], (g * s_tri).to(out_ty), mask=mask)


# Launch configurations by name (both kernels); tests compile every "cuda*" one for SM90 (tests/kernels).
TILES = {
    "cuda": dict(BLOCK_T=8, BLOCK_D=256, num_warps=4),
    "interpreter": dict(BLOCK_T=4, BLOCK_D=16, num_warps=1),  # CPU tests: small and quick
}


def _tiles(device: torch.device) -> dict:
    return TILES["cuda" if device.type == "cuda" else "interpreter"]


def _contiguous_rows(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


class _NgramEmbedTriton(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows, sign_pool, sign_rows):
        rows, sign_pool = _contiguous_rows(rows), _contiguous_rows(sign_pool)
        sign_rows = sign_rows.contiguous()  # the kernels read sign_rows[t] at sign_rows_ptr + t
        T, D = rows.shape[0] // 2, rows.shape[1]
        out = torch.empty((T, D), dtype=rows.dtype, device=rows.device)
        tiles = _tiles(rows.device)
        grid = (triton.cdiv(T, tiles["BLOCK_T"]), triton.cdiv(D, tiles["BLOCK_D"]))
        _ngram_forward_kernel[grid](rows, sign_pool, sign_rows, out, T, D,
                                    rows.stride(0), sign_pool.stride(0), out.stride(0), **tiles)
        ctx.save_for_backward(sign_pool, sign_rows)
        ctx.rows_dtype = rows.dtype
        return out

    @staticmethod
    def backward(ctx, grad_out):
        sign_pool, sign_rows = ctx.saved_tensors
        grad_out = _contiguous_rows(grad_out)
        T, D = grad_out.shape
        d_rows = torch.empty((2 * T, D), dtype=ctx.rows_dtype, device=grad_out.device)
        tiles = _tiles(grad_out.device)
        grid = (triton.cdiv(T, tiles["BLOCK_T"]), triton.cdiv(D, tiles["BLOCK_D"]))
        _ngram_backward_kernel[grid](grad_out, sign_pool, sign_rows, d_rows, T, D,
                                     grad_out.stride(0), sign_pool.stride(0), d_rows.stride(0), **tiles)
        return d_rows, None, None


def ngram_embed_triton(rows: torch.Tensor, sign_pool: torch.Tensor, sign_rows: torch.Tensor) -> torch.Tensor:
    _check(rows, sign_pool, sign_rows)
    return _NgramEmbedTriton.apply(rows, sign_pool, sign_rows)


# ------------------------------------------------------------------------------------------------
# Public op

def ngram_embed(rows: torch.Tensor, sign_pool: torch.Tensor, sign_rows: torch.Tensor) -> torch.Tensor:
    """B[t] = rows[t]·sign_pool[sign_rows[t]] + rows[T+t]·sign_pool[sign_rows[T+t]] -> (T, D); backward: the sink gradient."""
    fn = ngram_embed_triton if current().triton else ngram_embed_portable
    return fn(rows, sign_pool, sign_rows)
