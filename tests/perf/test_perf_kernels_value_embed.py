"""Value-embedding gather / scatter-add: twins against loops, kernels against twins, autograd, dispatch."""
import pytest
import torch

from perf.kernels import value_embed as ve
from perf.backend import use_backend
from tools.gpu_check import ulp_distance

pytestmark = pytest.mark.triton


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _table(rows=50, dim=37, dtype=torch.bfloat16, seed=0):
    return torch.randn(rows, dim, generator=_gen(seed)).to(dtype)


def _ids_with_duplicates(n=40, rows=50, dtype=torch.int64, seed=1):
    ids = torch.randint(0, rows, (n,), generator=_gen(seed))
    ids[::3] = 7  # one hot row, repeated more often than the interpreter's BLOCK_J (4) several times over
    ids[-1] = rows - 1  # the last row: bounds
    return ids.to(dtype)


def _loop_scatter(dst, ids, grad):
    """Independent reference: per-row float64 sums in a Python loop, then one rounding per touched row."""
    out = dst.clone()
    sums = {}
    for i, r in enumerate(ids.tolist()):
        sums[r] = sums.get(r, 0) + grad[i].double()
    for r, s in sums.items():
        out[r] = (dst[r].double() + s).to(dst.dtype)
    return out


def test_portable_twins_match_loops():
    table, ids = _table(), _ids_with_duplicates()
    rows = ve.gather_rows_portable(table, ids)
    for i, r in enumerate(ids.tolist()):
        assert torch.equal(rows[i], table[r])
    grad = torch.randn(ids.numel(), 37, generator=_gen(2)).bfloat16()
    dst = _table(dtype=torch.float16, seed=3)
    got = ve.scatter_add_rows_portable_(dst.clone(), ids, grad)
    # fp32 sums of <= 14 bf16 terms vs float64: far below half an fp16 ulp except where sums cancel.
    assert ulp_distance(got, _loop_scatter(dst, ids, grad), atol=14 * 2.0**-24 * 14 * 4) <= 1.0
    untouched = torch.ones(50, dtype=torch.bool)
    untouched[ids] = False
    assert torch.equal(got[untouched], dst[untouched])


@pytest.mark.parametrize("ids_dtype", [torch.int32, torch.int64])
def test_gather_kernel_is_exact(ids_dtype):
    table, ids = _table(), _ids_with_duplicates(n=37, dtype=ids_dtype)
    assert torch.equal(ve.gather_rows_triton(table, ids), ve.gather_rows_portable(table, ids))


def test_gather_kernel_reads_strided_ids():
    table, ids = _table(), _ids_with_duplicates(n=40)
    strided = ids[::2]  # (20,), stride 2
    assert torch.equal(ve.gather_rows_triton(table, strided), table[strided])


@pytest.mark.parametrize("dst_dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n", [1, 40])
def test_scatter_add_kernel_matches_twin(dst_dtype, n):
    # fp32 sums in another order, one rounding (truncated in the interpreter): <= 1 ulp of dst's dtype.
    ids = _ids_with_duplicates(n=n)
    grad = torch.randn(n, 37, generator=_gen(2)).bfloat16()
    dst = _table(dtype=dst_dtype, seed=3)
    got = ve.scatter_add_rows_triton_(dst.clone(), ids, grad)
    want = ve.scatter_add_rows_portable_(dst.clone(), ids, grad)
    repeats = int(torch.bincount(ids).max())
    assert ulp_distance(got, want, atol=repeats * 2.0**-24 * repeats * 4) <= 1.0
    untouched = torch.ones(50, dtype=torch.bool)
    untouched[ids] = False
    assert torch.equal(got[untouched], dst[untouched])  # rows not in ids are never written


@pytest.mark.parametrize("use_triton", [False, True])
def test_value_embed_autograd_dense_and_buffer(use_triton):
    table = _table(rows=4 * 12, dim=20).requires_grad_()
    ids = torch.randint(0, 48, (3, 9), generator=_gen(4))
    ids[:, 0] = 5  # duplicates across the batch
    grad = torch.randn(3, 9, 20, generator=_gen(5)).bfloat16()
    with use_backend(triton=use_triton):
        out = ve.value_embed(table, ids)
        assert out.shape == (3, 9, 20) and torch.equal(out, table.detach()[ids])
        (dense,) = torch.autograd.grad(out, table, grad)
        buffer = torch.zeros(48, 20, dtype=torch.float16)
        ve.value_embed(table, ids, grad_buffer=buffer).backward(grad)
    expected = _loop_scatter(torch.zeros(48, 20, dtype=torch.float64), ids.reshape(-1), grad.reshape(-1, 20))
    assert dense.dtype == torch.bfloat16 and ulp_distance(dense, expected, torch.bfloat16, atol=1e-6) <= 1.0
    assert ulp_distance(buffer, expected, torch.float16, atol=1e-6) <= 1.0
    assert table.grad is None  # with a buffer the parameter never gets a dense gradient


def test_buffer_accumulates_across_steps():
    table = _table(rows=10, dim=16).requires_grad_()
    ids = torch.tensor([3, 3, 9])
    buffer = torch.zeros(10, 16, dtype=torch.float32)
    with use_backend(triton=True):
        for _ in range(3):
            ve.value_embed(table, ids, grad_buffer=buffer).sum().backward()
    assert torch.equal(buffer[3], torch.full((16,), 6.0)) and torch.equal(buffer[9], torch.full((16,), 3.0))
    assert buffer[[0, 1, 2, 4, 5, 6, 7, 8]].abs().sum() == 0


def test_bad_inputs_are_named():
    table = _table(rows=10, dim=4)
    with pytest.raises(IndexError, match=r"gather_rows: ids must lie in \[0, 10\), got range \[0, 10\]"):
        ve.gather_rows(table, torch.tensor([0, 10]))
    with pytest.raises(ValueError, match=r"gather_rows: ids must be flat \(N,\), got shape \(1, 2\)"):
        ve.gather_rows(table, torch.tensor([[0, 1]]))
    with pytest.raises(TypeError, match="ids must be int32 or int64"):
        ve.value_embed(table, torch.tensor([0.0]))
    with pytest.raises(ValueError, match="grad_buffer must match the table's shape"):
        ve.value_embed(table, torch.tensor([1]), grad_buffer=torch.zeros(9, 4))
    with pytest.raises(ValueError, match=r"expected ids \(N,\) and grad \(N, 4\)"):
        ve.scatter_add_rows_(table, torch.tensor([1, 2]), torch.zeros(3, 4))


def test_backend_switch_dispatches(monkeypatch):
    table, ids = _table(rows=10, dim=4), torch.tensor([1, 2])
    calls = []
    real = ve.gather_rows_triton
    monkeypatch.setattr(ve, "gather_rows_triton", lambda t, i: calls.append("gather") or real(t, i))
    monkeypatch.setattr(ve, "scatter_add_rows_triton_", lambda d, i, g: "scatter kernel")
    with use_backend(triton=True):
        ve.value_embed(table, ids)
        assert ve.gather_rows(table, ids) is not None and calls == ["gather", "gather"]
        assert ve.scatter_add_rows_(table, ids, torch.zeros(2, 4)) == "scatter kernel"
    with use_backend(triton=False):
        ve.value_embed(table, ids)
        assert calls == ["gather", "gather"]
        assert torch.equal(ve.scatter_add_rows_(torch.zeros(10, 4), ids, torch.ones(2, 4))[1:3], torch.ones(2, 4))
