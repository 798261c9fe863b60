"""perf/residual_fusion.py against the plain expressions and plain autograd."""
import pytest
import torch
import torch.nn.functional as F

from perf.residual_fusion import rms_norm_with_head, scale, scale_add

DTYPES = [torch.float32, torch.bfloat16]


def _inputs(dtype, shape=(3, 17, 64), seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen).to(dtype)
    y = torch.randn(shape, generator=gen).to(dtype)
    g = torch.randn(shape, generator=gen).to(dtype)
    r = torch.tensor(1.0488, dtype=dtype)
    p = torch.tensor(0.731, dtype=dtype)
    return x, y, g, r, p


def _leaves(*ts):
    return [t.detach().clone().requires_grad_(True) for t in ts]


@pytest.mark.parametrize("dtype", DTYPES)
def test_scale_matches_plain_expression(dtype):
    x, _, g, r, _ = _inputs(dtype)
    rf, xf = _leaves(r, x)
    rp, xp = _leaves(r, x)
    out = scale(rf, xf)
    ref = rp * xp
    assert torch.equal(out, ref)
    out.backward(g)
    ref.backward(g)
    assert torch.equal(xf.grad, xp.grad)
    # independent fp32 reference for the scalar gradient
    want = (g.double() * x.double()).sum()
    tol = 1e-6 if dtype == torch.float32 else 2 ** -7
    assert abs(rf.grad.double() - want) <= tol * abs(want)
    if dtype == torch.float32:
        assert abs(rf.grad - rp.grad) <= 1e-6 * abs(rp.grad)


@pytest.mark.parametrize("dtype", DTYPES)
def test_scale_add_matches_plain_expression(dtype):
    x, y, g, r, p = _inputs(dtype)
    rf, xf, pf, yf = _leaves(r, x, p, y)
    rp, xp, pp, yp = _leaves(r, x, p, y)
    out = scale_add(rf, xf, pf, yf)
    ref = rp * xp + pp * yp
    assert torch.equal(out, ref)
    out.backward(g)
    ref.backward(g)
    assert torch.equal(xf.grad, xp.grad) and torch.equal(yf.grad, yp.grad)
    tol = 1e-6 if dtype == torch.float32 else 2 ** -7
    for got, src, plain in ((rf.grad, x, rp.grad), (pf.grad, y, pp.grad)):
        want = (g.double() * src.double()).sum()
        assert got.dtype == dtype
        assert abs(got.double() - want) <= tol * abs(want)
        if dtype == torch.float32:
            assert abs(got - plain) <= 1e-6 * abs(plain)


def test_fp32_scalar_with_bf16_tensor_keeps_scalar_dtype():
    x, y, g, _, _ = _inputs(torch.bfloat16)
    r = torch.tensor(0.9, requires_grad=True)
    p = torch.tensor(1.1, requires_grad=True)
    out = scale_add(r, x, p, y)
    assert torch.equal(out, r.detach() * x + p.detach() * y)
    out.backward(g)
    assert r.grad.dtype == torch.float32
    want = (g.double() * x.double()).sum()
    assert abs(r.grad.double() - want) <= 1e-5 * abs(want)


def test_non_scalar_lambdas_are_rejected():
    x = torch.randn(4, 8)
    with pytest.raises(ValueError, match="0-D"):
        scale(torch.ones(1), x)
    with pytest.raises(ValueError, match="0-D"):
        scale_add(torch.tensor(1.0), x, torch.ones(4, 1), x)
    with pytest.raises(ValueError, match="0-D"):
        scale_add(1.0, x, torch.tensor(1.0), x)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_with_head_is_bitwise_rms_norm(dtype):
    x, _, _, _, _ = _inputs(dtype, shape=(2, 33, 96), seed=1)
    x = x * 5
    normed, head = rms_norm_with_head(x, 6)
    ref = F.rms_norm(x, (x.shape[-1],))
    assert torch.equal(normed, ref)
    assert torch.equal(head, ref[..., :6])


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_with_head_gradient(dtype):
    x, _, g, _, _ = _inputs(dtype, shape=(5, 48), seed=2)
    gh = torch.randn(5, 6, generator=torch.Generator().manual_seed(3)).to(dtype)
    (xf,) = _leaves(x)
    normed, head = rms_norm_with_head(xf, 6)
    (normed.float() * g.float()).sum().add((head.float() * gh.float()).sum()).backward()
    # fp64 reference of the same function: d/dx of <g, x̂> + <gh, x̂[:, :6]>
    xd = x.double().requires_grad_(True)
    xhat = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + torch.finfo(torch.float32).eps)
    ((xhat * g.double()).sum() + (xhat[:, :6] * gh.double()).sum()).backward()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(xf.grad.double(), xd.grad, rtol=tol, atol=tol)


def test_rms_norm_with_head_rejects_bad_width():
    with pytest.raises(ValueError, match="width"):
        rms_norm_with_head(torch.randn(2, 8), 9)
