"""Symmetric Gram / poly kernels: twins against float64, kernels against twins (interpreter), dispatch."""
import pytest
import torch

from perf.kernels import symmetric_matmul as sm
from perf.backend import use_backend
from tools.gpu_check import ulp_distance

pytestmark = pytest.mark.triton

# Ragged shapes (not multiples of the interpreter's 16-wide tiles) exercise every mask; (M, K) with
# M > K, M < K and M = K; 2-D inputs are a batch of one.
SHAPES = [(2, 20, 37), (1, 33, 16), (40, 24), (3, 17, 17)]
B, C = -6.095026865488, 3.905234618423  # record #360 (track_1_short/optim/anvil.py): the first ANVIL map's (b, c)


def _sum_slack(terms: int, max_abs: float) -> float:
    # Two fp32 summation orders of `terms` products of size <= max_abs² differ by at most about
    # terms · 2^-24 · terms · max_abs²; values that cancel below that have no meaningful bf16 ulp.
    return terms * terms * 2.0**-24 * max_abs**2


def _bf16(shape, seed=0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).bfloat16()


def _symmetric(m, batch=(), seed=1):
    X = _bf16((*batch, m, m + 5), seed)
    return ((X.double() @ X.double().mT) / (m + 5)).bfloat16()  # exactly symmetric by construction


@pytest.mark.parametrize("shape", SHAPES)
def test_portable_gram_twins_match_float64(shape):
    X = _bf16(shape)
    slack = _sum_slack(max(shape[-2:]), float(X.float().abs().max()))
    # One rounding of the (fp32-accumulated) exact product: at most half a bf16 ulp from float64.
    assert ulp_distance(sm.xxt_portable(X), X.double() @ X.double().mT, torch.bfloat16, atol=slack) <= 0.5
    assert ulp_distance(sm.xtx_portable(X), X.double().mT @ X.double(), torch.bfloat16, atol=slack) <= 0.5


@pytest.mark.parametrize("m", [17, 24])
def test_portable_poly_matches_float64(m):
    A = _symmetric(m, (2,))
    expected = B * A.double() + C * (A.double() @ A.double())
    slack = _sum_slack(m, float(A.float().abs().max())) * abs(C) + m * 2.0**-24 * abs(B)
    assert ulp_distance(sm.poly_portable(A, B, C), expected, torch.bfloat16, atol=slack) <= 0.5
    assert sm.poly_portable(A, B, C).shape == A.shape


@pytest.mark.parametrize("shape", SHAPES)
def test_gram_kernels_match_twins(shape):
    # The interpreter truncates fp32 -> bf16 stores where the twin rounds to nearest: <= 1 ulp.
    X = _bf16(shape)
    slack = _sum_slack(max(shape[-2:]), float(X.float().abs().max()))
    for kernel, twin in [(sm.xxt_triton, sm.xxt_portable), (sm.xtx_triton, sm.xtx_portable)]:
        got, want = kernel(X), twin(X)
        assert got.shape == want.shape and got.dtype == torch.bfloat16
        assert ulp_distance(got, want, atol=slack) <= 1.0
        assert torch.equal(got, got.mT)  # mirrored tiles: exactly symmetric


@pytest.mark.parametrize("m,batch", [(17, (2,)), (40, ()), (16, (1,))])
def test_poly_kernel_matches_twin(m, batch):
    A = _symmetric(m, batch)
    got, want = sm.poly_triton(A, B, C), sm.poly_portable(A, B, C)
    slack = _sum_slack(m, float(A.float().abs().max())) * abs(C) + m * 2.0**-24 * abs(B)
    assert got.shape == A.shape
    assert ulp_distance(got, want, atol=slack) <= 1.0
    assert torch.equal(got, got.mT)


def test_kernels_read_strided_inputs():
    base = _bf16((2, 37, 20))
    X = base.mT  # (2, 20, 37), non-contiguous view
    assert not X.is_contiguous()
    slack = _sum_slack(37, float(X.float().abs().max()))
    assert ulp_distance(sm.xxt_triton(X), sm.xxt_portable(X.contiguous()), atol=slack) <= 1.0
    assert ulp_distance(sm.xtx_triton(X), sm.xtx_portable(X.contiguous()), atol=slack) <= 1.0


def test_bad_inputs_are_named():
    with pytest.raises(TypeError, match="xxt: expected a bfloat16"):
        sm.xxt(torch.randn(4, 5))
    with pytest.raises(ValueError, match=r"xtx: expected a \(M, K\) or \(B, M, K\)"):
        sm.xtx(torch.randn(2, 2, 4, 5).bfloat16())
    with pytest.raises(ValueError, match="poly: A must be square"):
        sm.poly(torch.randn(4, 5).bfloat16(), 1.0, 1.0)


def test_backend_switch_dispatches(monkeypatch):
    X = _bf16((2, 8, 12))
    A = _symmetric(8)
    for name in ("xxt", "xtx", "poly"):
        monkeypatch.setattr(sm, f"{name}_triton", lambda *args, _n=name: f"{_n} kernel")
    with use_backend(triton=True):
        assert (sm.xxt(X), sm.xtx(X), sm.poly(A, B, C)) == ("xxt kernel", "xtx kernel", "poly kernel")
    with use_backend(triton=False):
        assert torch.equal(sm.xxt(X), X @ X.mT) and torch.equal(sm.xtx(X), X.mT @ X)
        assert torch.equal(sm.poly(A, B, C), sm.poly_portable(A, B, C))
