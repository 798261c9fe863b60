"""bf16 GEMMs on a CPU without bf16 arithmetic: the fp32 product, rounded once to bf16.

A GPU multiplies bf16 operands on its tensor cores, sums in fp32 and rounds the result once to bf16. A CPU
without AVX512-BF16 or AMX (this project's CI machine: AVX2) has no such instruction, and torch's bf16 `mm`
takes a path about 15x slower than its fp32 one: the validation logits of the smoke model, 1,024 × 96 @
96 × 50,304 on one thread, took 8.3 s in bf16 and 0.53 s in fp32 (2026-12-06), so a 2,048-token validation took
20 of a 1-step smoke run's 36 s. Upcasting bf16 to fp32 is exact; the fp32 product rounded once to bf16 is the
GPU's arithmetic up to the order of its sums (bf16 results differ by at most one unit in the last place from
the CPU's bf16 path, as they do between GPU kernels). Autograd sees the casts: the backward GEMMs run in fp32
too, their gradients rounded once to the operands' dtype.

On other devices and dtypes this is `x @ w`, the same ops; under torch.compile the device test is static.
"""
import torch
from torch import Tensor


def bf16_matmul(x: Tensor, w: Tensor) -> Tensor:
    """x @ w; for bf16 operands on the CPU, computed in fp32 and rounded once to bf16 (module docstring)."""
    if x.device.type == "cpu" and x.dtype == w.dtype == torch.bfloat16:
        return (x.float() @ w.float()).to(torch.bfloat16)
    return x @ w
