"""The ANVIL / NorMuon cascades run their symmetric products through perf/kernels/symmetric_matmul.py:
the portable path is still the plain formula (bitwise), and the Triton path (interpreter on CPU)
calls the kernels and lands as close to an fp64 cascade as the portable path does."""
import pytest
import torch

from perf.kernels import symmetric_matmul as sm
from perf.backend import use_backend
from optim.anvil import ANVIL_MAPS, anvil_cascade, quintic_maps
from optim.normuon import POLAR_EXPRESS_MAPS, polar_express

SHAPES = [(2, 24, 40), (2, 48, 32)]  # wide (X X^T, left multiply) and tall (X^T X, right multiply)


def _bf16(shape, seed=0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).bfloat16()


def plain_bf16_maps(x, maps):
    """The cascade as written before the kernels: bf16 GEMMs, B = baddbmm(A, A, A), one fused
    baddbmm for aX + XB (the chunks here have far fewer than 1024 rows)."""
    for a, b, c in maps:
        tall = x.size(-2) > x.size(-1)
        gram = x.mT @ x if tall else x @ x.mT
        bmat = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.baddbmm(x, x, bmat, beta=a) if tall else torch.baddbmm(x, bmat, x, beta=a)
    return x


def fp64_cascade(x, maps, margin):
    x = x.double()
    x = x / (margin * x.square().sum(dim=(-2, -1), keepdim=True).sqrt() + 1e-6)
    for a, b, c in maps:
        s = x @ x.mT
        x = a * x + b * s @ x + c * s @ s @ x
    return x


def rel(got, want):
    return ((got.double() - want).norm() / want.norm()).item()


@pytest.mark.parametrize("shape", SHAPES)
def test_portable_maps_are_the_plain_bf16_formula(shape):
    x = _bf16(shape).float()
    x = (x / (1.05 * x.square().sum(dim=(-2, -1), keepdim=True).sqrt())).bfloat16()  # normalized
    with use_backend(triton=False):
        assert torch.equal(quintic_maps(x, ANVIL_MAPS), plain_bf16_maps(x, ANVIL_MAPS))


@pytest.mark.triton
@pytest.mark.parametrize("shape", SHAPES)
def test_fast_path_calls_the_symmetric_kernels(shape, monkeypatch):
    calls = {"xxt": 0, "xtx": 0, "poly": 0}
    for name in calls:
        kernel = getattr(sm, f"{name}_triton")

        def counted(*args, _name=name, _kernel=kernel):
            calls[_name] += 1
            return _kernel(*args)
        monkeypatch.setattr(sm, f"{name}_triton", counted)
    with use_backend(triton=True):
        anvil_cascade(_bf16(shape))
    gram = "xtx" if shape[-2] > shape[-1] else "xxt"
    # one Gram per map (the first doubles as the normalization), one b·A + c·A² per map
    assert calls == {"xxt": 0, "xtx": 0, gram: len(ANVIL_MAPS), "poly": len(ANVIL_MAPS)}


@pytest.mark.triton
@pytest.mark.parametrize("shape", SHAPES)
def test_fast_path_cascades_match_fp64_like_the_portable_path(shape):
    """Relative Frobenius error against an fp64 cascade, measured: ANVIL 5.2e-3 portable,
    6.5-7.3e-3 Triton; Polar Express 1.5-1.7e-2 portable, 4.9-6.2e-2 Triton (its first map's
    large coefficients amplify the interpreter's truncating bf16 stores; on a GPU the kernels
    round). Bounds: twice the ANVIL measurement, and NorMuon's 0.1 of test_optim_anvil.py."""
    x = _bf16(shape)
    want_anvil, want_pe = fp64_cascade(x, ANVIL_MAPS, 1.05), fp64_cascade(x.float(), POLAR_EXPRESS_MAPS, 1.02)
    for triton in (False, True):
        with use_backend(triton=triton):
            assert rel(anvil_cascade(x), want_anvil) < 1.5e-2, triton
            assert rel(polar_express(x), want_pe) < 0.1, triton
