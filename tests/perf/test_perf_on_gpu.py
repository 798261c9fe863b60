"""The kernels at their GPU launch configurations on ragged shapes (needs CUDA; tools/gpu_check.py runs these).

The interpreter tests use small tiles, and the record shapes are multiples of the GPU tiles, so only
these tests send partial GPU tiles through the masks. Same tolerances as the interpreter tests: a
GPU rounds where the interpreter truncates, so 1 ulp still bounds the reordered fp32 sums.
"""
import pytest
import torch

from perf.kernels import ngram_embed as ng
from perf.kernels import symmetric_matmul as sm
from perf.kernels import transpose as tr
from perf.kernels import value_embed as ve
from tools.gpu_check import ulp_distance

pytestmark = [pytest.mark.gpu, pytest.mark.triton]


def _randn(*shape, dtype=torch.bfloat16, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(shape, device="cuda", generator=gen).to(dtype)


# (50, 130, 72): enough tiles for the 128-wide configuration on H100/H200; the others take the 64-wide one.
@pytest.mark.parametrize("shape", [(3, 200, 136), (1, 130, 300), (2, 1100, 96), (50, 130, 72)])
def test_symmetric_kernels_on_gpu(shape):
    X = _randn(*shape)
    X = (X / X.norm(dim=(-2, -1), keepdim=True)).bfloat16()
    inner = max(shape[1:])
    slack = inner * inner * 2.0**-24 * float(X.float().abs().max()) ** 2
    for kernel, twin in [(sm.xxt_triton, sm.xxt_portable), (sm.xtx_triton, sm.xtx_portable)]:
        got = kernel(X)
        assert ulp_distance(got, twin(X), atol=slack) <= 1.0 and torch.equal(got, got.mT)
    A = sm.xxt_portable(X)
    m = A.shape[-1]
    slack = m * m * 2.0**-24 * 4 * float(A.float().abs().max()) ** 2 + m * 2.0**-24 * 7
    got = sm.poly_triton(A, -6.0, 3.9)
    assert ulp_distance(got, sm.poly_portable(A, -6.0, 3.9), atol=slack) <= 1.0 and torch.equal(got, got.mT)


def test_transpose_kernels_on_gpu():
    src = _randn(1000, 77)
    dst = torch.empty(77, 1000, dtype=torch.bfloat16, device="cuda")
    assert torch.equal(tr.transpose_into_triton(dst, src), src.T)
    acc = _randn(77, 1000, seed=1)
    assert torch.equal(tr.transpose_add_triton_(acc.clone(), src), tr.transpose_add_portable_(acc.clone(), src))


def test_value_embed_kernels_on_gpu():
    table = _randn(500, 300)
    ids = torch.randint(0, 500, (1000,), device="cuda")
    ids[::10] = 3  # a row repeated 100 times: several BLOCK_J chunks of one run
    assert torch.equal(ve.gather_rows_triton(table, ids), table[ids])
    grad, dst = _randn(1000, 300, seed=1), _randn(500, 300, dtype=torch.float16, seed=2)
    got = ve.scatter_add_rows_triton_(dst.clone(), ids, grad)
    assert ulp_distance(got, ve.scatter_add_rows_portable_(dst.clone(), ids, grad), atol=100 * 100 * 2.0**-24 * 5) <= 1.0


def test_ngram_embed_kernels_on_gpu():
    T, D = 1001, 300
    rows = _randn(2 * T, D).requires_grad_()
    pool = _randn(64, D, seed=1).sign()
    sign_rows = torch.randint(0, 64, (2 * T,), device="cuda", dtype=torch.int32)
    grad = _randn(T, D, seed=2)
    out_k, out_t = ng.ngram_embed_triton(rows, pool, sign_rows), ng.ngram_embed_portable(rows, pool, sign_rows)
    assert torch.equal(out_k, out_t)  # same exact fp32 sum, both round to nearest
    assert torch.equal(torch.autograd.grad(out_k, rows, grad)[0], torch.autograd.grad(out_t, rows, grad)[0])
