"""Value-embedding lookup: a row gather whose backward scatter-adds the row gradients.

`value_embeds` is [4·V, 768] bf16 (record #360: track_1_short/model/gpt.py): plane p holds rows [p·V, (p+1)·V)
and serves one of the value-embedding layers (1, 2, 8, 10). The forward gathers the rows of this
batch's tokens; the backward sums the gradients of repeated rows (a batch repeats common tokens
thousands of times) in fp32 and adds the sums to the destination with one rounding. In the record
the destination is a persistent fp16 buffer [4·V, 768] that accumulates the row gradients of the
steps of one update cycle (track_1_short/perf/value_embed_pull.py), so the parameter never gets a dense `.grad`.

Public function, dispatched on `perf.backend.current().triton` when called:
    value_embed(table, ids, grad_buffer=None) -> table[ids]          shape ids.shape + (D,)
        backward: grad_buffer given -> grad_buffer[r] += Σ_{i: ids[i]=r} grad[i] (in place; no table grad)
                  grad_buffer None  -> table's gradient, dense, with the same sums in table's dtype
Building blocks with the same contracts in both paths (`*_portable` define the math):
    gather_rows(table, ids) -> (N, D)                      rows of table for flat int ids (N,)
    scatter_add_rows_(dst, ids, grad) -> dst               dst[r] ← dst[r] + Σ grad[i] over ids[i] = r

Run the parity tests: pytest tests/kernels -q (CPU, Triton interpreter).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from perf.backend import current, host_checks


def _check_ids(name: str, table: torch.Tensor, ids: torch.Tensor) -> None:
    if table.dim() != 2:
        raise ValueError(f"{name}: the table must be 2-D (rows, D), got shape {tuple(table.shape)}")
    if ids.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{name}: ids must be int32 or int64, got {ids.dtype}")
    if ids.device != table.device:
        raise ValueError(f"{name}: ids are on {ids.device} but the table is on {table.device}")
    # A range check reads the ids on the host: a stall on a GPU, a graph break under compile (host_checks()).
    if host_checks() and ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= table.shape[0]):
        raise IndexError(f"{name}: ids must lie in [0, {table.shape[0]}), got range "
                         f"[{int(ids.min())}, {int(ids.max())}]")


def _check_gather(table: torch.Tensor, ids: torch.Tensor) -> None:
    _check_ids("gather_rows", table, ids)
    if ids.dim() != 1:
        raise ValueError(f"gather_rows: ids must be flat (N,), got shape {tuple(ids.shape)}")


def _check_scatter(dst: torch.Tensor, ids: torch.Tensor, grad: torch.Tensor) -> None:
    _check_ids("scatter_add_rows_", dst, ids)
    if ids.dim() != 1 or grad.shape != (ids.shape[0], dst.shape[1]):
        raise ValueError(f"scatter_add_rows_: expected ids (N,) and grad (N, {dst.shape[1]}), got ids "
                         f"{tuple(ids.shape)} and grad {tuple(grad.shape)}")


# ------------------------------------------------------------------------------------------------
# Portable twins: the definition of the math

def gather_rows_portable(table: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    _check_gather(table, ids)
    return table.index_select(0, ids)  # (N, D)


def scatter_add_rows_portable_(dst: torch.Tensor, ids: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """Sizes fixed by N (no torch.unique, no host sync): a stable sort groups the repeats of each
    row in their original order, so each row's fp32 sum adds its gradients in input order."""
    _check_scatter(dst, ids, grad)
    n = ids.numel()
    if n == 0:
        return dst
    sorted_ids, order = torch.sort(ids.long(), stable=True)  # (N,)
    run_start = torch.ones(n, dtype=torch.bool, device=ids.device)
    run_start[1:] = sorted_ids[1:] != sorted_ids[:-1]
    slot = torch.cumsum(run_start, 0) - 1  # (N,) which distinct row (run) each sorted entry adds to
    sums = torch.zeros((n, dst.shape[1]), dtype=torch.float32, device=dst.device)
    sums.index_add_(0, slot, grad[order].float())  # duplicates summed in fp32, in input order
    run_row = torch.zeros(n, dtype=torch.long, device=ids.device).scatter_(0, slot, sorted_ids)  # (N,)
    # slots past the last run are unused: they repeat run 0 (same row, same value), a harmless write
    used = torch.arange(n, device=ids.device) <= slot[-1]
    run_row = torch.where(used, run_row, run_row[0])
    sums = torch.where(used[:, None], sums, sums[0])
    dst.index_put_((run_row,), (dst[run_row].float() + sums).to(dst.dtype))  # one rounding per row
    return dst


# ------------------------------------------------------------------------------------------------
# Triton kernels

@triton.jit
def _gather_rows_kernel(
    table_ptr, ids_ptr, out_ptr, N, D,
    stride_t, stride_o,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """out[i, :] = table[ids[i], :] for a (BLOCK_N × BLOCK_D) tile. Twin: `gather_rows_portable`; bit-exact (a copy)."""
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rd = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    row_ok = rn < N
    mask = row_ok[:, None] & (rd[None, :] < D)
    rows = tl.load(ids_ptr + rn, mask=row_ok, other=0).to(tl.int64)  # int64 offsets: row·stride can pass 2^31
    vals = tl.load(table_ptr + rows[:, None] * stride_t + rd[None, :], mask=mask)
    tl.store(out_ptr + rn[:, None].to(tl.int64) * stride_o + rd[None, :], vals, mask=mask)


@triton.jit
def _scatter_add_rows_kernel(
    dst_ptr, grad_ptr, sorted_ids_ptr, order_ptr, run_end_ptr, D,
    stride_dst, stride_g,
    BLOCK_J: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """dst[r] ← dst[r] + Σ grad[i] over ids[i] = r, for the run of equal ids that starts at sorted position i.

    Portable twin: `scatter_add_rows_portable_`. The ids arrive sorted (with `order`, the original
    positions, and `run_end`, where each run of equal ids ends), so one program owns one distinct row:
    no atomics, deterministic, and the sum stays in fp32 until the single rounding to dst's dtype.
    Programs that are not the first of their run exit at once; the grid size does not depend on the
    data, so no host sync is needed. Parity: fp32 sums in a different order than the twin's, one
    rounding: within 1 ulp of dst's dtype (the interpreter truncates its stores) plus fp32 slack.
    """
    i = tl.program_id(0)
    rd = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    d_ok = rd < D
    row = tl.load(sorted_ids_ptr + i)
    prev = tl.load(sorted_ids_ptr + tl.maximum(i - 1, 0))
    if (i == 0) | (prev != row):
        end = tl.load(run_end_ptr + i)
        acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
        for j0 in range(i, end, BLOCK_J):  # a hot row (a common token) repeats thousands of times: BLOCK_J rows a step
            jj = j0 + tl.arange(0, BLOCK_J)
            j_ok = jj < end
            src = tl.load(order_ptr + jj, mask=j_ok, other=0).to(tl.int64)
            g = tl.load(grad_ptr + src[:, None] * stride_g + rd[None, :],
                        mask=j_ok[:, None] & d_ok[None, :], other=0.0)  # (BLOCK_J, BLOCK_D)
            acc += tl.sum(g.to(tl.float32), axis=0)
        dst_row = dst_ptr + row.to(tl.int64) * stride_dst + rd
        old = tl.load(dst_row, mask=d_ok, other=0.0).to(tl.float32)
        tl.store(dst_row, (old + acc).to(dst_ptr.dtype.element_ty), mask=d_ok)


# Launch configurations by name; tests compile every "cuda*" one for SM90 (tests/kernels).
GATHER_TILES = {
    "cuda": dict(BLOCK_N=8, BLOCK_D=256, num_warps=4),
    "interpreter": dict(BLOCK_N=4, BLOCK_D=16, num_warps=1),  # CPU tests: small and quick
}
SCATTER_TILES = {
    "cuda": dict(BLOCK_J=32, BLOCK_D=256, num_warps=4),
    "interpreter": dict(BLOCK_J=4, BLOCK_D=16, num_warps=1),
}


def gather_rows_triton(table: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    _check_gather(table, ids)
    if table.stride(1) != 1:
        raise ValueError("gather_rows: the table's rows must be contiguous (stride 1 along D)")
    ids = ids.contiguous()  # the kernel reads ids[i] at ids_ptr + i
    N, D = ids.numel(), table.shape[1]
    out = torch.empty((N, D), dtype=table.dtype, device=table.device)
    tiles = GATHER_TILES["cuda" if table.is_cuda else "interpreter"]
    grid = (triton.cdiv(N, tiles["BLOCK_N"]), triton.cdiv(D, tiles["BLOCK_D"]))
    _gather_rows_kernel[grid](table, ids, out, N, D, table.stride(0), out.stride(0), **tiles)
    return out


def scatter_add_rows_triton_(dst: torch.Tensor, ids: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    _check_scatter(dst, ids, grad)
    if dst.stride(1) != 1 or grad.stride(1) != 1:
        raise ValueError("scatter_add_rows_: dst and grad rows must be contiguous (stride 1 along D)")
    N, D = ids.numel(), dst.shape[1]
    if N == 0:
        return dst
    sorted_ids, order = torch.sort(ids, stable=True)
    run_end = torch.searchsorted(sorted_ids, sorted_ids, right=True)  # one past each run of equal ids
    tiles = SCATTER_TILES["cuda" if dst.is_cuda else "interpreter"]
    grid = (N, triton.cdiv(D, tiles["BLOCK_D"]))
    _scatter_add_rows_kernel[grid](dst, grad, sorted_ids, order, run_end, D, dst.stride(0), grad.stride(0), **tiles)
    return dst


# ------------------------------------------------------------------------------------------------
# Public ops

def gather_rows(table: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """table[ids] for flat int ids (N,) -> (N, D)."""
    return gather_rows_triton(table, ids) if current().triton else gather_rows_portable(table, ids)


def scatter_add_rows_(dst: torch.Tensor, ids: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """dst[r] ← dst[r] + Σ_{i: ids[i]=r} grad[i], summed in fp32, one rounding; returns dst."""
    return scatter_add_rows_triton_(dst, ids, grad) if current().triton else scatter_add_rows_portable_(dst, ids, grad)


class _ValueEmbed(torch.autograd.Function):
    @staticmethod
    def forward(ctx, table, ids, grad_buffer, use_triton):
        flat_ids = ids.reshape(-1)
        gather = gather_rows_triton if use_triton else gather_rows_portable
        ctx.save_for_backward(flat_ids)
        ctx.grad_buffer, ctx.use_triton, ctx.table_meta = grad_buffer, use_triton, (table.shape, table.dtype)
        return gather(table, flat_ids).view(*ids.shape, table.shape[1])  # ids.shape + (D,)

    @staticmethod
    def backward(ctx, grad_out):
        (flat_ids,) = ctx.saved_tensors
        scatter = scatter_add_rows_triton_ if ctx.use_triton else scatter_add_rows_portable_
        shape, dtype = ctx.table_meta
        grad = grad_out.reshape(-1, shape[1]).contiguous()  # (N, D)
        if ctx.grad_buffer is not None:
            scatter(ctx.grad_buffer, flat_ids, grad)
            return None, None, None, None
        if not ctx.needs_input_grad[0]:
            return None, None, None, None
        dense = torch.zeros(shape, dtype=dtype, device=grad.device)
        return scatter(dense, flat_ids, grad), None, None, None


def value_embed(table: torch.Tensor, ids: torch.Tensor, grad_buffer: torch.Tensor | None = None) -> torch.Tensor:
    """Rows table[ids] (shape ids.shape + (D,)); the backward scatter-adds row gradients (duplicates summed in fp32).

    With `grad_buffer` (same shape as the table, e.g. the record's persistent fp16 [4·V, 768]) the
    backward adds into it in place and the table receives no gradient; without it the table gets a
    dense gradient holding the same sums. As for any autograd op, the backward runs only when the
    table requires grad (the `value_embeds` parameter does). The Triton path needs no host sync
    (sort, searchsorted and a fixed grid), so it can be captured in a CUDA graph.
    """
    if grad_buffer is not None and (grad_buffer.shape != table.shape or grad_buffer.device != table.device):
        raise ValueError(f"value_embed: grad_buffer must match the table's shape {tuple(table.shape)} and device "
                         f"{table.device}, got {tuple(grad_buffer.shape)} on {grad_buffer.device}")
    return _ValueEmbed.apply(table, ids, grad_buffer, current().triton)
