"""N-gram embedding with sign rows: twin against a loop, kernel against twin (forward and sink backward), dispatch."""
import pytest
import torch

from perf.kernels import ngram_embed as ng
from perf.backend import use_backend
from tools.gpu_check import ulp_distance

pytestmark = pytest.mark.triton


def _inputs(T=7, D=37, pool_rows=16, ids_dtype=torch.int32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    rows = torch.randn(2 * T, D, generator=gen).bfloat16().requires_grad_()
    pool = torch.randn(pool_rows, D, generator=gen).sign().bfloat16()  # ±1, as the record's pool
    sign_rows = torch.randint(0, pool_rows, (2 * T,), generator=gen).to(ids_dtype)
    sign_rows[0] = sign_rows[T] = pool_rows - 1  # the last pool row: bounds
    grad = torch.randn(T, D, generator=gen).bfloat16()
    return rows, pool, sign_rows, grad


def test_portable_twin_matches_a_loop():
    rows, pool, sr, grad = _inputs(T=5, D=6)
    out = ng.ngram_embed_portable(rows, pool, sr)
    (d_rows,) = torch.autograd.grad(out, rows, grad)
    T = 5
    for t in range(T):
        bi, tri = sr[t].item(), sr[T + t].item()
        for d in range(6):
            exact = rows[t, d].item() * pool[bi, d].item() + rows[T + t, d].item() * pool[tri, d].item()
            assert out[t, d].item() == torch.tensor(exact, dtype=torch.float64).bfloat16().item()  # one rounding of the exact sum
            assert d_rows[t, d].item() == grad[t, d].item() * pool[bi, d].item()  # ±1: exact
            assert d_rows[T + t, d].item() == grad[t, d].item() * pool[tri, d].item()


@pytest.mark.parametrize("T,D,ids_dtype", [(7, 37, torch.int32), (1, 16, torch.int64), (9, 5, torch.int32)])
def test_kernel_matches_twin_forward_and_backward(T, D, ids_dtype):
    rows, pool, sr, grad = _inputs(T, D, ids_dtype=ids_dtype)
    out_k, out_t = ng.ngram_embed_triton(rows, pool, sr), ng.ngram_embed_portable(rows, pool, sr)
    # Same exact fp32 sum, one rounding: the interpreter truncates where the twin rounds, so <= 1 ulp.
    assert out_k.shape == (T, D) and out_k.dtype == torch.bfloat16
    assert ulp_distance(out_k, out_t) <= 1.0
    (d_k,) = torch.autograd.grad(out_k, rows, grad)
    (d_t,) = torch.autograd.grad(out_t, rows, grad)
    assert torch.equal(d_k, d_t)  # products with ±1 are exact: bit-identical sink gradients


def test_kernel_takes_strided_gradient_and_sign_rows():
    rows, pool, sr, grad = _inputs(T=6, D=20)
    sr = torch.stack([sr, sr.flip(0)], dim=1)[:, 1]  # (12,), stride 2
    assert sr.stride() == (2,)
    wide = torch.randn(6, 40).bfloat16()
    g = wide[:, 5:25]  # (6, 20) with row stride 40
    (d_k,) = torch.autograd.grad(ng.ngram_embed_triton(rows, pool, sr), rows, g)
    (d_t,) = torch.autograd.grad(ng.ngram_embed_portable(rows, pool, sr), rows, g)
    assert torch.equal(d_k, d_t)


def test_bad_inputs_are_named():
    rows, pool, sr, _ = _inputs(T=3, D=4)
    with pytest.raises(ValueError, match=r"rows must be \(2T, D\)"):
        ng.ngram_embed(rows[:5], pool, sr[:5])
    with pytest.raises(ValueError, match=r"sign_pool must be \(S, 4\)"):
        ng.ngram_embed(rows, pool[:, :3], sr)
    with pytest.raises(ValueError, match=r"sign_rows must be int32/int64 of shape \(6,\)"):
        ng.ngram_embed(rows, pool, sr.float())
    with pytest.raises(IndexError, match=r"sign_rows must lie in \[0, 16\)"):
        ng.ngram_embed(rows, pool, sr + 16)


def test_backend_switch_dispatches(monkeypatch):
    rows, pool, sr, _ = _inputs(T=3, D=4)
    monkeypatch.setattr(ng, "ngram_embed_triton", lambda r, p, s: "kernel")
    with use_backend(triton=True):
        assert ng.ngram_embed(rows, pool, sr) == "kernel"
    with use_backend(triton=False):
        assert torch.equal(ng.ngram_embed(rows, pool, sr), ng.ngram_embed_portable(rows, pool, sr))
