"""perf/fp8.py: the packed fp8 QKV projection against a dequantized reference and plain autograd."""
import pytest
import torch

from perf.fp8 import QKV_GRAD_SCALE, QKV_X_SCALE, fp8_qkv


def _deq(v, scale, dtype=torch.float8_e4m3fn):
    fmax = torch.finfo(dtype).max
    return torch.clamp(v.double() / float(scale), -fmax, fmax).float().to(dtype).double() * float(scale)


def test_fp8_qkv_forward_and_sa0_fold():
    gen = torch.Generator().manual_seed(0)
    T, D, Rqk, Rv = 32, 48, 64, 32
    x = torch.randn(T, D, generator=gen)
    x[0, 0] = 20.0  # beyond the static range: saturates at 8
    w_qk = (0.03 * torch.randn(Rqk, D, generator=gen)).requires_grad_()
    w_v = (0.03 * torch.randn(Rv, D, generator=gen)).requires_grad_()
    sa0 = torch.tensor(0.5, requires_grad=True)
    xg = x.clone().requires_grad_()
    out = fp8_qkv(xg, w_qk, w_v, sa0)
    w = torch.cat([w_qk, w_v]).detach()
    w_s = w.abs().max() / 448
    x_deq, w_deq = _deq(x, QKV_X_SCALE), _deq(w, w_s)
    assert x_deq[0, 0] == 8.0
    ref = 0.5 * (x_deq @ w_deq.t())
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
    g = 0.01 * torch.randn(T, Rqk + Rv, generator=gen)
    out.backward(g)
    g_deq = _deq(g, QKV_GRAD_SCALE)
    dw_folded = g_deq.t() @ x_deq
    want_sa0 = (dw_folded * w.double()).sum()
    assert abs(sa0.grad.double() - want_sa0) <= 1e-4 * abs(want_sa0)
    torch.testing.assert_close(torch.cat([w_qk.grad, w_v.grad]).double(), 0.5 * dw_folded, rtol=1e-4, atol=1e-7)
    torch.testing.assert_close(xg.grad.double(), g_deq @ (0.5 * w_deq), rtol=1e-4, atol=1e-7)
    # and within fp8 tolerance of plain autograd of x·(sa0·W)ᵀ
    plain_x, plain_sa0 = x.clone().requires_grad_(), torch.tensor(0.5, requires_grad=True)
    (plain_x @ (plain_sa0 * w).t()).backward(g)
    assert (xg.grad - plain_x.grad).norm() <= 0.1 * plain_x.grad.norm()
    with pytest.raises(ValueError, match="0-D"):
        fp8_qkv(x, w_qk, w_v, torch.ones(1))
