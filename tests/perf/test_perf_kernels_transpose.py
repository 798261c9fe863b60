"""Transpose copy / transpose-add kernels: twins against loops and float64, kernels against twins, dispatch."""
import pytest
import torch

from perf.kernels import transpose as tr
from perf.backend import use_backend
from tools.gpu_check import ulp_distance

pytestmark = pytest.mark.triton

SHAPES = [(37, 23), (16, 16), (5, 70)]  # ragged against the interpreter's 16 × 16 tiles


def _rand(shape, dtype=torch.bfloat16, seed=0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def test_portable_twins_match_a_loop_and_float64():
    src = _rand((5, 7))
    dst = torch.zeros(7, 5, dtype=torch.bfloat16)
    tr.transpose_into_portable(dst, src)
    for i in range(5):
        for j in range(7):
            assert dst[j, i] == src[i, j]
    acc = _rand((7, 5), seed=1)
    # Two bf16 values of similar size sum exactly in fp32, so the single rounding equals float64's.
    expected = (acc.double() + src.double().T).bfloat16()
    assert torch.equal(tr.transpose_add_portable_(acc.clone(), src), expected)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dst_dtype", [torch.bfloat16, torch.float32])
def test_transpose_into_kernel_is_exact(shape, dst_dtype):
    src = _rand(shape)
    got = torch.full(shape[::-1], float("nan"), dtype=dst_dtype)
    want = torch.empty(shape[::-1], dtype=dst_dtype)
    assert tr.transpose_into_triton(got, src) is got
    assert torch.equal(got, tr.transpose_into_portable(want, src))


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dst_dtype", [torch.bfloat16, torch.float32])
def test_transpose_add_kernel_matches_twin(shape, dst_dtype):
    # fp32 sum, one rounding; the interpreter truncates bf16 stores where the twin rounds: <= 1 ulp.
    src, dst = _rand(shape), _rand(shape[::-1], dst_dtype, seed=1)
    got = tr.transpose_add_triton_(dst.clone(), src)
    want = tr.transpose_add_portable_(dst.clone(), src)
    assert ulp_distance(got, want) <= 1.0
    if dst_dtype == torch.float32:
        assert torch.equal(got, want)  # no rounding at all


def test_kernels_write_into_strided_views():
    src = _rand((20, 30))
    big = torch.zeros(30, 50, dtype=torch.bfloat16)
    view = big[:, 10:30]  # (30, 20), row stride 50
    tr.transpose_into_triton(view, src)
    assert torch.equal(view, src.T) and not big[:, :10].any() and not big[:, 30:].any()
    tr.transpose_add_triton_(view, src)
    assert ulp_distance(view, (2 * src.float()).T.bfloat16()) <= 1.0


def test_bad_inputs_are_named():
    with pytest.raises(ValueError, match=r"transpose_into: dst must have src's shape reversed: src \(3, 4\) -> dst \(4, 3\)"):
        tr.transpose_into(torch.zeros(3, 4), torch.zeros(3, 4))
    with pytest.raises(ValueError, match="transpose_add_: dst and src must be 2-D"):
        tr.transpose_add_(torch.zeros(4), torch.zeros(4))


def test_backend_switch_dispatches(monkeypatch):
    src = _rand((4, 6))
    monkeypatch.setattr(tr, "transpose_into_triton", lambda dst, src: "copy kernel")
    monkeypatch.setattr(tr, "transpose_add_triton_", lambda dst, src: "add kernel")
    with use_backend(triton=True):
        assert tr.transpose_into(torch.zeros(6, 4), src) == "copy kernel"
        assert tr.transpose_add_(torch.zeros(6, 4), src) == "add kernel"
    with use_backend(triton=False):
        assert torch.equal(tr.transpose_into(torch.zeros(6, 4, dtype=torch.bfloat16), src), src.T)
        assert torch.equal(tr.transpose_add_(torch.ones(6, 4), src), 1 + src.float().T)
