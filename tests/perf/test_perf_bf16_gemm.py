"""perf/bf16_gemm.py: bf16 GEMMs on the CPU as fp32 products rounded once, against a float64 product."""
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from perf.bf16_gemm import bf16_matmul


class _GemmDtypes(TorchDispatchMode):
    """The operand dtypes of every aten.mm that runs inside it."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.mm.default:
            self.seen.append((args[0].dtype, args[1].dtype))
        return func(*args, **(kwargs or {}))


def test_bf16_operands_give_the_float64_product_rounded_to_bf16_and_fp32_gradients():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(64, 96, generator=gen).bfloat16().requires_grad_()
    w = (0.05 * torch.randn(96, 300, generator=gen)).bfloat16().requires_grad_()
    with _GemmDtypes() as gemms:
        got = bf16_matmul(x, w)
    assert gemms.seen == [(torch.float32, torch.float32)]  # no bf16 GEMM on the CPU (the point: 15x faster)
    assert got.dtype == torch.bfloat16 and got.shape == (64, 300)
    want = x.detach().double() @ w.detach().double()
    # one rounding of a sum of 96 exact products: within half a bf16 unit of the exact value, plus fp32's sum error
    assert ((got.double() - want).abs() <= want.abs() * 2.0 ** -8 + 1e-6).all()
    assert (got.double() != want.bfloat16().double()).float().mean() < 0.01  # nearly always the exact rounding
    probe = torch.randn(64, 300, generator=gen)
    with _GemmDtypes() as gemms:
        (got.float() * probe).sum().backward()
    assert gemms.seen == [(torch.float32, torch.float32)] * 2  # dX and dW in fp32 too
    g, xd, wd = probe.bfloat16().double(), x.detach().double(), w.detach().double()  # got's gradient is bf16
    assert x.grad.dtype == w.grad.dtype == torch.bfloat16
    for grad, want, scale in ((x.grad, g @ wd.T, g.abs() @ wd.abs().T), (w.grad, xd.T @ g, xd.abs().T @ g.abs())):
        assert ((grad.double() - want).abs() <= want.abs() * 2.0 ** -8 + scale * 2.0 ** -20).all()


def test_other_dtypes_and_devices_are_the_plain_product():
    gen = torch.Generator().manual_seed(4)
    x, w = torch.randn(8, 16, generator=gen), torch.randn(16, 5, generator=gen)
    assert torch.equal(bf16_matmul(x, w), x @ w)  # fp32 on the CPU: the same op
    xm, wm = x.bfloat16().to("meta"), w.bfloat16().to("meta")
    out = bf16_matmul(xm, wm)
    assert out.device.type == "meta" and out.dtype == torch.bfloat16 and out.shape == (8, 5)
