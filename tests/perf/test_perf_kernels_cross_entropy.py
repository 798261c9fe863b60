"""Fused softcapped CE: kernel against a float64 autograd reference and its portable twin (interpreter),
twins and kernels against model/loss.py's definition with a gradient flowing into lse and into the
gathered z (fp8_lm_head_loss and torch.compile included), the dispatch, input errors, and ragged GPU
shapes at the GPU tile (gpu marker)."""

import pytest
import torch
import triton
import triton.language as tl

import model.loss as loss_module
from perf.kernels import cross_entropy as ce
from perf.backend import use_backend
from perf.fp8 import LM_HEAD_GRAD_SCALE, LM_HEAD_W_SCALE, LM_HEAD_X_SCALE, fp8_lm_head_loss, quantize_lm_head
from tests.model.test_model_loss import fp8_head_case
from tools.gpu_check import ulp_distance

pytestmark = pytest.mark.triton

# (T, N, mtp weights, with prefix, logits dtype). N is not a multiple of the interpreter's 16-wide
# blocks; T = 2 < K = 3 leaves rows whose MTP targets all fall past the end.
CASES = [
    (13, 37, (1.0, 0.5, 0.25), True, torch.float32),
    (9, 50, (1.0,), False, torch.float32),
    (2, 20, (1.0, 0.5, 0.25), True, torch.float32),
    (11, 33, (0.7, 0.3), True, torch.bfloat16),
]


def _inputs(T, N, dtype, seed=0, device="cpu"):
    gen = torch.Generator(device=device).manual_seed(seed)
    logits = (4 * torch.randn(T, N, generator=gen, device=device)).to(dtype)
    targets = torch.randint(0, N, (T,), generator=gen, device=device)
    targets[T // 2] = -100  # ignored
    targets[-1] = N + 3  # outside [0, N): skipped as well
    prefix = torch.randint(-1, N, (T,), generator=gen, device=device)  # −1: no prefix
    return logits, targets, prefix


def _float64_reference(logits, targets, mtp, prefix, prefix_weight):
    """Σ_t L_t and dΣ/dℓ from the formula in plain float64 autograd, term by term."""
    ell = logits.detach().double().requires_grad_()
    T, N = ell.shape
    z = 23 * torch.sigmoid((ell + 5) / 7.5)
    lse = torch.logsumexp(z, dim=-1)
    total = ell.new_zeros(())
    for k, w in enumerate(mtp):
        for t in range(T - k):
            if 0 <= int(targets[t + k]) < N:
                total = total + w * (lse[t] - z[t, targets[t + k]])
    if prefix is not None:
        for t in range(T):
            if 0 <= int(prefix[t]) < N:
                total = total + prefix_weight * (lse[t] - z[t, prefix[t]])
    total.backward()
    return total.detach(), ell.grad


def _loss_and_grad(fn, logits, targets, mtp, prefix, prefix_weight, grad_out=1.0):
    leaf = logits.detach().clone().requires_grad_()
    loss = fn(leaf, targets, mtp, prefix, prefix_weight)
    loss.backward(torch.tensor(grad_out, device=logits.device))
    return loss.detach(), leaf.grad


@pytest.mark.parametrize("T,N,mtp,with_prefix,dtype", CASES)
def test_kernel_matches_float64_reference_and_twin(T, N, mtp, with_prefix, dtype):
    logits, targets, prefix = _inputs(T, N, dtype)
    prefix = prefix if with_prefix else None
    want_loss, want_grad = _float64_reference(logits, targets, mtp, prefix, 0.3)
    got_loss, got_grad = _loss_and_grad(ce.softcapped_loss_sum_triton, logits, targets, mtp, prefix, 0.3)
    twin_loss, twin_grad = _loss_and_grad(ce.softcapped_loss_sum_portable, logits, targets, mtp, prefix, 0.3)
    assert got_loss.dtype == torch.float32 and got_grad.dtype == dtype
    # fp32 math with a different summation order than float64: a few fp32 ulps of |L| and of |grad|
    assert got_loss.double().item() == pytest.approx(want_loss.item(), rel=1e-5)
    assert got_loss.item() == pytest.approx(twin_loss.item(), rel=1e-6)
    if dtype == torch.float32:
        torch.testing.assert_close(got_grad.double(), want_grad, rtol=0, atol=1e-6)
        torch.testing.assert_close(got_grad, twin_grad, rtol=0, atol=1e-6)
    else:  # both round the same fp32 gradient to bf16; the interpreter truncates: <= 1 bf16 ulp
        assert ulp_distance(got_grad, twin_grad, atol=1e-6) <= 1.0
        assert ulp_distance(got_grad, want_grad, torch.bfloat16, atol=1e-6) <= 1.0


def test_kernel_gradient_scales_with_grad_out_and_skips_when_not_needed():
    logits, targets, prefix = _inputs(7, 40, torch.float32, seed=1)
    loss1, grad1 = _loss_and_grad(ce.softcapped_loss_sum_triton, logits, targets, (1.0, 0.5), prefix, 0.2)
    loss3, grad3 = _loss_and_grad(ce.softcapped_loss_sum_triton, logits, targets, (1.0, 0.5), prefix, 0.2, grad_out=3.0)
    assert torch.equal(loss1, loss3)
    torch.testing.assert_close(grad3, 3 * grad1, rtol=1e-6, atol=0)
    no_grad_loss = ce.softcapped_loss_sum_triton(logits, targets, (1.0, 0.5), prefix, 0.2)
    assert not no_grad_loss.requires_grad and torch.equal(no_grad_loss, loss1)


def test_row_without_terms_has_zero_gradient():
    logits, _, _ = _inputs(4, 24, torch.float32, seed=2)
    targets = torch.tensor([3, -100, -100, 5])
    _, grad = _loss_and_grad(ce.softcapped_loss_sum_triton, logits, targets, (1.0,), None, 0.0)
    assert torch.equal(grad[1:3], torch.zeros(2, 24)) and grad[0].abs().sum() > 0


def test_weights_may_be_device_tensors():
    logits, targets, prefix = _inputs(6, 30, torch.float32, seed=3)
    as_floats = ce.softcapped_loss_sum_triton(logits, targets, (1.0, 0.5), prefix, 0.25)
    as_tensors = ce.softcapped_loss_sum_triton(logits, targets, (torch.tensor(1.0), torch.tensor(0.5)), prefix,
                                               torch.tensor(0.25))
    assert torch.equal(as_floats, as_tensors)


def test_dispatch_and_training_loss_on_both_paths(monkeypatch):
    """training_loss (sampled softmax over P candidates) runs the kernel when the backend says triton."""
    calls = []
    kernel = ce.softcapped_loss_lse_triton
    monkeypatch.setattr(ce, "softcapped_loss_lse_triton", lambda *a: calls.append("triton") or kernel(*a))
    gen = torch.Generator().manual_seed(4)
    T, D, V = 10, 16, 60
    x = torch.randn(T, D, generator=gen)
    w = torch.randn(D, V, generator=gen)
    targets = torch.randint(0, V, (T,), generator=gen)
    cand = torch.unique(torch.cat([targets, torch.arange(0, V, 4)]))  # P = |C| < V
    prefix = torch.randint(-1, V, (T,), generator=gen)
    results = {}
    for on_triton in (False, True):
        with use_backend(triton=on_triton):
            xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
            loss = loss_module.training_loss(xg, wg, targets, (1.0, 0.5), prefix, 0.3, candidates=cand, fp8=False)
            loss.backward()
            results[on_triton] = (loss.detach(), xg.grad, wg.grad)
    assert calls == ["triton"]  # once, and only under triton=True
    assert results[True][0].item() == pytest.approx(results[False][0].item(), rel=1e-6)
    for got, want in zip(results[True][1:], results[False][1:]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------------------------------------
# model/loss.py defines the math; the twins and kernels here implement it, lse gradient included


def test_softcap_constants_are_the_models():
    """The kernel module restates model/loss.py's softcap (a kernel imports no model file)."""
    assert (ce.SOFTCAP_A, ce.SOFTCAP_B, ce.SOFTCAP_C) == (loss_module.SOFTCAP_A, loss_module.SOFTCAP_B,
                                                          loss_module.SOFTCAP_C)


def _model_reference(logits, targets, mtp, prefix, prefix_weight, grad_out, grad_lse):
    """model/loss.py `softcapped_ce` in float64: (Σ L, lse) and the logit gradient of
    grad_out·Σ L + Σ_t grad_lse_t·lse_t by autograd."""
    ell = logits.detach().double().requires_grad_()
    loss, lse = loss_module.softcapped_ce(ell, targets, mtp, prefix, prefix_weight)
    torch.autograd.backward([loss, lse], [torch.tensor(grad_out, dtype=torch.float64), grad_lse.double()])
    return loss.detach(), lse.detach(), ell.grad


def _lse_grad(T, seed=7):
    return torch.randn(T, generator=torch.Generator().manual_seed(seed))  # O(1): the lse term is not small


# (T, N, mtp, with prefix, logits dtype, grad_out); grad_out = 0: only lse is used (the loss gets None)
LSE_CASES = [
    (9, 37, (1.0, 0.5, 0.25), True, torch.float32, 1.7),
    (7, 33, (0.7, 0.3), True, torch.bfloat16, 1.7),
    (5, 20, (1.0,), False, torch.float32, 0.0),
]


@pytest.mark.parametrize("impl", ["portable", "triton"])
@pytest.mark.parametrize("T,N,mtp,with_prefix,dtype,grad_out", LSE_CASES)
def test_loss_and_lse_match_the_model_definition_with_an_lse_gradient(impl, T, N, mtp, with_prefix, dtype, grad_out):
    """softcapped_loss_lse (non-fp8 path): loss, lse and the logit gradient with a random grad_lse,
    against model/loss.py's definition."""
    fn = getattr(ce, f"softcapped_loss_lse_{impl}")
    logits, targets, prefix = _inputs(T, N, dtype)
    prefix = prefix if with_prefix else None
    grad_lse = _lse_grad(T)
    want_loss, want_lse, want_grad = _model_reference(logits, targets, mtp, prefix, 0.3, grad_out, grad_lse)
    leaf = logits.detach().clone().requires_grad_()
    loss, lse = fn(leaf, targets, mtp, prefix, 0.3)
    if grad_out == 0:
        lse.backward(grad_lse)  # the loss is unused: its gradient arrives as None
    else:
        torch.autograd.backward([loss, lse], [torch.tensor(grad_out), grad_lse])
    assert loss.dtype == lse.dtype == torch.float32 and lse.shape == (T,)
    assert loss.item() == pytest.approx(want_loss.item(), rel=1e-5)
    torch.testing.assert_close(lse.double(), want_lse, rtol=1e-6, atol=0)
    if dtype == torch.float32:  # fp32 math, another summation order: a few fp32 ulps of |grad| <= 4
        torch.testing.assert_close(leaf.grad.double(), want_grad, rtol=0, atol=4e-6)
    else:  # the fp32 gradient rounded to bf16 once (the interpreter truncates): <= 1 bf16 ulp
        assert ulp_distance(leaf.grad, want_grad, torch.bfloat16, atol=1e-6) <= 1.0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_twin_in_several_slabs_is_the_definition_and_the_one_slab_twin(monkeypatch, dtype):
    """The non-fp8 twin computes lse and the gradient one slab of rows at a time (no fp32 [T, N]):
    over ragged slabs of 4 rows (forward) and 3 (backward) it is model/loss.py's definition (lse to
    fp32 rounding, the bf16 gradient to one bf16 ulp) and the one-slab twin (fp32 elementwise math on
    other slab shapes: a few fp32 ulps, bf16 after one rounding: <= 1 ulp)."""
    T, N, mtp = 11, 37, (1.0, 0.5, 0.25)
    logits, targets, prefix = _inputs(T, N, dtype, seed=9)
    grad_lse = _lse_grad(T)
    want_loss, want_lse, want_grad = _model_reference(logits, targets, mtp, prefix, 0.3, 1.7, grad_lse)

    def run():
        leaf = logits.detach().clone().requires_grad_()
        loss, lse = ce.softcapped_loss_lse_portable(leaf, targets, mtp, prefix, 0.3)
        torch.autograd.backward([loss, lse], [torch.tensor(1.7), grad_lse])
        return loss.detach(), lse.detach(), leaf.grad

    one_slab = run()
    monkeypatch.setattr(ce, "CE_SLAB_ROWS", 4)
    monkeypatch.setattr(ce, "GRAD_SLAB_ROWS", 3)
    loss, lse, grad = run()
    assert grad.dtype == dtype
    assert loss.item() == pytest.approx(want_loss.item(), rel=1e-5)
    torch.testing.assert_close(lse.double(), want_lse, rtol=1e-6, atol=0)
    torch.testing.assert_close(lse, one_slab[1], rtol=1e-6, atol=0)
    assert loss.item() == pytest.approx(one_slab[0].item(), rel=1e-6)
    if dtype == torch.float32:
        torch.testing.assert_close(grad.double(), want_grad, rtol=0, atol=4e-6)
        torch.testing.assert_close(grad, one_slab[2], rtol=0, atol=1e-6)
    else:
        assert ulp_distance(grad, want_grad, torch.bfloat16, atol=1e-6) <= 1.0
        assert ulp_distance(grad, one_slab[2], atol=1e-6) <= 1.0


@pytest.mark.parametrize("impl", ["portable", "triton"])
@pytest.mark.parametrize("T,N,mtp,with_prefix,_,grad_out", LSE_CASES)
def test_e4m3_ce_with_an_lse_gradient_matches_the_model_definition(impl, T, N, mtp, with_prefix, _, grad_out):
    """The fp8 path's CE: lse of e4m3 logits and the e5m2 gradient with a random grad_lse against
    model/loss.py's definition (to e5m2 precision), and kernel against twin (one e5m2 step)."""
    logits8, targets, prefix = _e4m3_inputs(T, N)
    prefix = prefix if with_prefix else None
    weights = ce.loss_weights(mtp, 0.3 if with_prefix else None, "cpu")
    grad_lse = _lse_grad(T)
    want_loss, want_lse, want_grad = _model_reference(logits8.float(), targets, mtp, prefix, 0.3, grad_out, grad_lse)
    loss, lse = getattr(ce, f"softcapped_ce_e4m3_{impl}")(logits8, targets, prefix, weights, len(mtp))
    assert loss.item() == pytest.approx(want_loss.item(), rel=1e-5)
    torch.testing.assert_close(lse.double(), want_lse, rtol=1e-6, atol=0)
    args = (logits8, lse, targets, prefix, weights, len(mtp), torch.tensor(grad_out), torch.tensor(GRAD_SCALE))
    got = getattr(ce, f"softcapped_ce_grad_e5m2_{impl}")(*args, grad_lse)
    exact = (want_grad / GRAD_SCALE).clamp(-57344, 57344)
    # e5m2 rounds to within half a step: 2^-3 relative above 2^-14, 2^-17 absolute below
    assert ((got.double() - exact).abs() <= exact.abs() / 8 + 2.0 ** -17 + 1e-9).all()
    if impl == "triton":
        twin = ce.softcapped_ce_grad_e5m2_portable(*args, grad_lse)
        steps = _e5m2_steps(got, twin)
        assert steps.max() <= 1 and (steps > 0).float().mean() <= 0.02


@pytest.mark.parametrize("impl", ["portable", "triton"])
def test_a_zero_lse_gradient_is_the_lse_free_backward_bit_for_bit(impl):
    """torch.compile hands an unused output's gradient over as zeros (eager autograd as None): both
    must give the numbers of the lse-free backward, bit for bit, on both paths."""
    logits, targets, prefix = _inputs(6, 27, torch.float32, seed=5)
    grads = []
    for grad_lse in (None, torch.zeros(6)):
        leaf = logits.clone().requires_grad_()
        loss, lse = getattr(ce, f"softcapped_loss_lse_{impl}")(leaf, targets, (1.0, 0.5), prefix, 0.3)
        torch.autograd.backward([loss] if grad_lse is None else [loss, lse],
                                [torch.tensor(0.37)] if grad_lse is None else [torch.tensor(0.37), grad_lse])
        grads.append(leaf.grad)
    assert torch.equal(grads[0], grads[1])
    logits8 = (2 * logits).clamp(-448, 448).to(torch.float8_e4m3fn)
    weights = ce.loss_weights((1.0, 0.5), 0.3, "cpu")
    _, lse = ce.softcapped_ce_e4m3_portable(logits8, targets, prefix, weights, 2)
    args = (logits8, lse, targets, prefix, weights, 2, torch.tensor(0.37), torch.tensor(GRAD_SCALE))
    grad_e5m2 = getattr(ce, f"softcapped_ce_grad_e5m2_{impl}")
    assert torch.equal(grad_e5m2(*args).view(torch.uint8), grad_e5m2(*args, torch.zeros(6)).view(torch.uint8))


def test_bad_inputs_name_the_tensor():
    logits = torch.zeros(4, 8)
    with pytest.raises(ValueError, match="logits must be float32 or bfloat16"):
        ce.softcapped_loss_sum(logits.half(), torch.zeros(4, dtype=torch.long), (1.0,), None, 0.0)
    with pytest.raises(ValueError, match=r"targets must be \[T\] = \[4\]"):
        ce.softcapped_loss_sum_triton(logits, torch.zeros(5, dtype=torch.long), (1.0,), None, 0.0)
    with pytest.raises(ValueError, match="prefix_targets"):
        ce.softcapped_loss_sum_portable(logits, torch.zeros(4, dtype=torch.long), (1.0,), torch.zeros(3), 0.0)
    logits8, idx = logits.to(torch.float8_e4m3fn), torch.zeros(4, dtype=torch.long)
    one = torch.tensor(1.0)
    for impl in ("portable", "triton"):
        with pytest.raises(ValueError, match=r"softcapped_ce_grad_e5m2: grad_lse must be \[T\] = \[4\], got \(4, 1\)"):
            getattr(ce, f"softcapped_ce_grad_e5m2_{impl}")(logits8, torch.zeros(4), idx, None,
                                                          ce.loss_weights((1.0,), None, "cpu"), 1, one, one,
                                                          torch.zeros(4, 1))




# ------------------------------------------------------------------------------------------------
# e4m3 logits in, e5m2 gradient out (the fp8 training path)

GRAD_SCALE = 0.75 / 8 / 448  # record #360's lm_head gradient scale (perf/fp8.py LM_HEAD_GRAD_SCALE)


@triton.jit
def _e5m2_bits_probe(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + offs, ce._e5m2_bits(tl.load(x_ptr + offs, mask=offs < n, other=0.0)), mask=offs < n)


def test_e5m2_encoder_is_torchs_cast_bit_for_bit():
    """The kernel's integer fp32 → e5m2 rounding against torch's cast: every e5m2 value, every
    midpoint between neighbours (ties to even), signed zeros, fp32 denormals, and 100k random values
    over 30 octaves."""
    grid = torch.arange(256, dtype=torch.uint8).view(torch.float8_e5m2).float()
    grid = torch.sort(grid[torch.isfinite(grid)]).values
    gen = torch.Generator().manual_seed(0)
    rand = torch.randn(100_000, generator=gen) * torch.exp2(torch.randint(-26, 4, (100_000,), generator=gen).float())
    x = torch.cat([grid, (grid[1:] + grid[:-1]) / 2, torch.tensor([0.0, -0.0, 1e-40, -1e-40, 2.0 ** -17]),
                   (rand * 4096).clamp(-57344, 57344)])
    got = torch.empty(x.numel(), dtype=torch.uint8)
    _e5m2_bits_probe[(triton.cdiv(x.numel(), 4096),)](x, got, x.numel(), BLOCK=4096)
    want = x.to(torch.float8_e5m2).view(torch.uint8)
    assert torch.equal(got, want), x[got != want][:8]


def _e4m3_inputs(T, N, seed=0, device="cpu"):
    logits, targets, prefix = _inputs(T, N, torch.float32, seed, device)
    return (2 * logits).clamp(-448, 448).to(torch.float8_e4m3fn), targets, prefix


def _e5m2_steps(a, b):
    """How many representable e5m2 values lie between a and b, elementwise (codes of one sign are
    monotone in the value)."""
    def ordinal(t):
        code = t.view(torch.uint8).long()
        return torch.where(code >= 128, -(code - 128), code)
    return (ordinal(a) - ordinal(b)).abs()


@pytest.mark.parametrize("T,N,mtp,with_prefix,_", CASES)
def test_e4m3_kernels_match_twin_and_float64_reference(T, N, mtp, with_prefix, _):
    """Forward (loss, lse) and backward (e5m2 gradient) of e4m3 logits: the kernels against their
    portable twins and the float64 autograd reference, grad_out = 3 and record #360's grad scale."""
    logits8, targets, prefix = _e4m3_inputs(T, N)
    prefix = prefix if with_prefix else None
    weights = ce.loss_weights(mtp, 0.3 if with_prefix else None, "cpu")
    want_loss, want_grad = _float64_reference(logits8.float(), targets, mtp, prefix, 0.3)
    got_loss, got_lse = ce.softcapped_ce_e4m3_triton(logits8, targets, prefix, weights, len(mtp))
    twin_loss, twin_lse = ce.softcapped_ce_e4m3_portable(logits8, targets, prefix, weights, len(mtp))
    assert got_loss.item() == pytest.approx(want_loss.item(), rel=1e-5)
    assert got_loss.item() == pytest.approx(twin_loss.item(), rel=1e-6)
    torch.testing.assert_close(got_lse, twin_lse, rtol=1e-6, atol=0)
    grad_out, grad_scale = torch.tensor(3.0), torch.tensor(GRAD_SCALE)
    got = ce.softcapped_ce_grad_e5m2_triton(logits8, got_lse, targets, prefix, weights, len(mtp), grad_out, grad_scale)
    twin = ce.softcapped_ce_grad_e5m2_portable(logits8, twin_lse, targets, prefix, weights, len(mtp), grad_out,
                                              grad_scale)
    assert got.dtype == twin.dtype == torch.float8_e5m2 and got.shape == (T, N)
    # same fp32 operation order; exp and the sum order may differ by an fp32 ulp, which can move a
    # value across an e5m2 rounding boundary: at most one step, on few elements
    steps = _e5m2_steps(got, twin)
    assert steps.max() <= 1 and (steps > 0).float().mean() <= 0.02
    exact = (3 * want_grad / GRAD_SCALE).clamp(-57344, 57344)
    # e5m2 rounds to within half a step: 2^-3 relative above 2^-14, 2^-17 absolute below
    assert ((got.double() - exact).abs() <= exact.abs() / 8 + 2.0 ** -17 + 1e-9).all()


def test_e4m3_ce_rejects_other_logit_dtypes():
    logits = torch.zeros(4, 8)
    with pytest.raises(ValueError, match=r"softcapped_ce_e4m3: logits must be float8_e4m3fn \[T, N\]"):
        ce.softcapped_ce_e4m3(logits, torch.zeros(4, dtype=torch.long), None, ce.loss_weights((1.0,), None, "cpu"), 1)


@pytest.mark.gpu
def test_e4m3_kernels_on_gpu_ragged_rows():
    """The GPU tile with a partial last block: kernel against twin on the same GPU."""
    logits8, targets, prefix = _e4m3_inputs(37, 5000, device="cuda")
    weights = ce.loss_weights((1.0, 0.5, 0.25), 0.3, "cuda")
    got_loss, got_lse = ce.softcapped_ce_e4m3_triton(logits8, targets, prefix, weights, 3)
    twin_loss, twin_lse = ce.softcapped_ce_e4m3_portable(logits8, targets, prefix, weights, 3)
    assert got_loss.item() == pytest.approx(twin_loss.item(), rel=1e-5)
    scale = (torch.tensor(1.0, device="cuda"), torch.tensor(GRAD_SCALE, device="cuda"))
    got = ce.softcapped_ce_grad_e5m2_triton(logits8, got_lse, targets, prefix, weights, 3, *scale)
    twin = ce.softcapped_ce_grad_e5m2_portable(logits8, twin_lse, targets, prefix, weights, 3, *scale)
    steps = _e5m2_steps(got, twin)
    assert steps.max() <= 1 and (steps > 0).float().mean() <= 0.02  # GPU exp is approximate


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_on_gpu_ragged_rows(dtype):
    """The GPU tile (2048 columns) with a partial last block, against the twin on the same GPU."""
    logits, targets, prefix = _inputs(37, 5000, dtype, device="cuda")
    got_loss, got_grad = _loss_and_grad(ce.softcapped_loss_sum_triton, logits, targets, (1.0, 0.5, 0.25), prefix, 0.3)
    want_loss, want_grad = _loss_and_grad(ce.softcapped_loss_sum_portable, logits, targets, (1.0, 0.5, 0.25), prefix, 0.3)
    assert got_loss.item() == pytest.approx(want_loss.item(), rel=1e-5)
    assert ulp_distance(got_grad, want_grad, atol=2e-6) <= 1.0  # GPU exp is approximate: ~16 fp32 ulps at 1.4


# ------------------------------------------------------------------------------------------------
# The gathered z: zg [T, M] = softcap(ℓ)[t, gather_cols[t, m]], differentiable, its gradient folded
# into the same backward launch (CPLM's mixture NLL, PR #379, is a torch line in (lse, zg))

def _gather_cols(T, N, targets, seed=11):
    """int64 [T, 2] as CPLM's (y_t, <copy>), with the edge cases: a column −1 and one past N (zg 0,
    no gradient), a row gathering one column twice, a gathered column that is also the row's target."""
    cols = torch.randint(0, N, (T, 2), generator=torch.Generator().manual_seed(seed))
    cols[1, 0], cols[2, 1] = -1, N + 2
    cols[3, 1] = cols[3, 0]
    cols[0, 0] = targets[0] if 0 <= int(targets[0]) < N else 0
    return cols


def _gathered_reference(logits, targets, mtp, prefix, prefix_weight, cols, grads):
    """model/loss.py `softcapped_ce` and `softcap` in float64: (loss, lse, zg) and the logit gradient
    of Σ of each used output times its incoming gradient (grads: three entries, None = unused)."""
    ell = logits.detach().double().requires_grad_()
    loss, lse = loss_module.softcapped_ce(ell, targets, mtp, prefix, prefix_weight)
    N = ell.shape[1]
    inside = (cols >= 0) & (cols < N)
    zg = torch.where(inside, loss_module.softcap(ell).gather(1, cols.clamp(0, N - 1)), 0.0)  # (T, M)
    outs = [(o, g.double()) for o, g in zip((loss, lse, zg), grads) if g is not None]
    torch.autograd.backward([o for o, _ in outs], [g for _, g in outs])
    return loss.detach(), lse.detach(), zg.detach(), ell.grad


def _gather_grads(T, used, grad_out, seed=12):
    """The incoming gradients of (loss, lse, zg): random O(1) grad_lse and grad_zg [T, 2], None where
    `used` (a string of l, s, z) leaves an output out; grad_zg nonzero at the out-of-range columns too."""
    gen = torch.Generator().manual_seed(seed)
    grads = (torch.tensor(grad_out), torch.randn(T, generator=gen), torch.randn(T, 2, generator=gen))
    return tuple(g if key in used else None for key, g in zip("lsz", grads))


def _backward_used(outs, grads):
    torch.autograd.backward([o for o, g in zip(outs, grads) if g is not None], [g for g in grads if g is not None])


# (T, N, mtp, with prefix, logits dtype, outputs used, grad_out): "lsz" all three; "lz" lse unused
# (None), "z" only zg (the loss and lse get None: the fold with g = 0)
GATHER_CASES = [
    (9, 37, (1.0, 0.5, 0.25), True, torch.float32, "lsz", 1.7),
    (7, 33, (0.7, 0.3), True, torch.bfloat16, "lsz", 1.0),
    (8, 29, (1.0, 0.5), True, torch.float32, "lz", 1.0),
    (6, 20, (1.0,), False, torch.float32, "z", 0.0),
]


@pytest.mark.parametrize("impl", ["portable", "triton"])
@pytest.mark.parametrize("T,N,mtp,with_prefix,dtype,used,grad_out", GATHER_CASES)
def test_gathered_z_and_its_gradient_match_the_model_definition(impl, T, N, mtp, with_prefix, dtype, used, grad_out):
    """softcapped_loss_lse with gather_cols (non-fp8 path): loss, lse, zg and the logit gradient of
    g·loss + Σ g_lse·lse + Σ g_zg·zg against float64 autograd of model/loss.py; a gathered column
    outside [0, N) gives zg 0 and no gradient."""
    fn = getattr(ce, f"softcapped_loss_lse_{impl}")
    logits, targets, prefix = _inputs(T, N, dtype)
    prefix = prefix if with_prefix else None
    cols = _gather_cols(T, N, targets)
    grads = _gather_grads(T, used, grad_out)
    want_loss, want_lse, want_zg, want_grad = _gathered_reference(logits, targets, mtp, prefix, 0.3, cols, grads)
    leaf = logits.detach().clone().requires_grad_()
    loss, lse, zg = fn(leaf, targets, mtp, prefix, 0.3, cols)
    _backward_used((loss, lse, zg), grads)
    assert zg.dtype == torch.float32 and zg.shape == (T, 2) and zg.requires_grad
    assert loss.item() == pytest.approx(want_loss.item(), rel=1e-5)
    torch.testing.assert_close(lse.double(), want_lse, rtol=1e-6, atol=0)
    torch.testing.assert_close(zg.double(), want_zg, rtol=1e-6, atol=0)  # z < 23: a few fp32 ulps
    assert zg[1, 0] == 0 and zg[2, 1] == 0  # columns −1 and N + 2
    if dtype == torch.float32:  # fp32 math, another summation order: a few fp32 ulps of |grad| <= 4
        torch.testing.assert_close(leaf.grad.double(), want_grad, rtol=0, atol=4e-6)
    else:  # the fp32 gradient rounded to bf16 once (the interpreter truncates): <= 1 bf16 ulp
        assert ulp_distance(leaf.grad, want_grad, torch.bfloat16, atol=1e-6) <= 1.0
    # no gradient from an out-of-range column: the same grad_zg with those two entries zeroed, bit for bit
    masked = grads[2].clone()
    masked[1, 0] = masked[2, 1] = 0
    again = logits.detach().clone().requires_grad_()
    _backward_used(fn(again, targets, mtp, prefix, 0.3, cols), (*grads[:2], masked))
    assert torch.equal(again.grad, leaf.grad)


@pytest.mark.parametrize("impl", ["portable", "triton"])
@pytest.mark.parametrize("T,N,mtp,with_prefix,_,used,grad_out", GATHER_CASES)
def test_e4m3_ce_with_gathered_z_matches_the_model_definition(impl, T, N, mtp, with_prefix, _, used, grad_out):
    """The fp8 path's CE with gather_cols: zg of the e4m3 logits, and the e5m2 gradient of
    g·loss + Σ g_lse·lse + Σ g_zg·zg against model/loss.py's definition (to e5m2 precision), kernel
    against twin (one e5m2 step), nothing at an out-of-range column."""
    logits8, targets, prefix = _e4m3_inputs(T, N)
    prefix = prefix if with_prefix else None
    weights = ce.loss_weights(mtp, 0.3 if with_prefix else None, "cpu")
    cols = _gather_cols(T, N, targets)
    grads = _gather_grads(T, used, grad_out)
    want_loss, want_lse, want_zg, want_grad = _gathered_reference(logits8.float(), targets, mtp, prefix, 0.3, cols,
                                                                  grads)
    loss, lse, zg = getattr(ce, f"softcapped_ce_e4m3_{impl}")(logits8, targets, prefix, weights, len(mtp), cols)
    assert loss.item() == pytest.approx(want_loss.item(), rel=1e-5)
    torch.testing.assert_close(lse.double(), want_lse, rtol=1e-6, atol=0)
    torch.testing.assert_close(zg.double(), want_zg, rtol=1e-6, atol=0)
    assert zg[1, 0] == 0 and zg[2, 1] == 0
    grad_fn = getattr(ce, f"softcapped_ce_grad_e5m2_{impl}")
    g_out = torch.tensor(0.0) if grads[0] is None else grads[0]  # fp8_lm_head_loss's zero for an unused loss
    args = (logits8, lse, targets, prefix, weights, len(mtp), g_out, torch.tensor(GRAD_SCALE), grads[1], cols)
    got = grad_fn(*args, grads[2])
    exact = (want_grad / GRAD_SCALE).clamp(-57344, 57344)
    # e5m2 rounds to within half a step: 2^-3 relative above 2^-14, 2^-17 absolute below
    assert ((got.double() - exact).abs() <= exact.abs() / 8 + 2.0 ** -17 + 1e-9).all()
    masked = grads[2].clone()
    masked[1, 0] = masked[2, 1] = 0
    assert torch.equal(grad_fn(*args, masked).view(torch.uint8), got.view(torch.uint8))
    if impl == "triton":
        steps = _e5m2_steps(got, ce.softcapped_ce_grad_e5m2_portable(*args, grads[2]))
        assert steps.max() <= 1 and (steps > 0).float().mean() <= 0.02


@pytest.mark.parametrize("impl", ["portable", "triton"])
def test_a_zero_zg_gradient_is_the_gather_free_backward_bit_for_bit(impl):
    """gather_cols changes no old output, and a zero grad_zg (what torch.compile hands an unused zg)
    gives the gather-free gradient bit for bit, with and without an lse gradient, on both paths."""
    T, N = 6, 27
    logits, targets, prefix = _inputs(T, N, torch.float32, seed=5)
    cols = _gather_cols(T, N, targets)
    fn = getattr(ce, f"softcapped_loss_lse_{impl}")
    for grad_lse in (None, _lse_grad(T)):
        grads = []
        for gather in (None, cols):
            leaf = logits.clone().requires_grad_()
            outs = fn(leaf, targets, (1.0, 0.5), prefix, 0.3, gather)
            if gather is not None:
                assert all(torch.equal(a, b) for a, b in zip(outs[:2], fn(logits, targets, (1.0, 0.5), prefix, 0.3)))
            _backward_used(outs, (torch.tensor(0.37), grad_lse, None if gather is None else torch.zeros(T, 2)))
            grads.append(leaf.grad)
        assert torch.equal(grads[0], grads[1])
    logits8 = (2 * logits).clamp(-448, 448).to(torch.float8_e4m3fn)
    weights = ce.loss_weights((1.0, 0.5), 0.3, "cpu")
    forward = getattr(ce, f"softcapped_ce_e4m3_{impl}")
    loss, lse = forward(logits8, targets, prefix, weights, 2)
    assert all(torch.equal(a, b) for a, b in zip((loss, lse), forward(logits8, targets, prefix, weights, 2, cols)))
    grad_e5m2 = getattr(ce, f"softcapped_ce_grad_e5m2_{impl}")
    args = (logits8, lse, targets, prefix, weights, 2, torch.tensor(1.0), torch.tensor(GRAD_SCALE))
    for grad_lse in (None, _lse_grad(T)):
        want = grad_e5m2(*args, grad_lse).view(torch.uint8)
        assert torch.equal(grad_e5m2(*args, grad_lse, cols, torch.zeros(T, 2)).view(torch.uint8), want)
        assert torch.equal(grad_e5m2(*args, grad_lse, cols).view(torch.uint8), want)  # cols without grad_zg


def test_gather_cols_errors_name_the_tensor():
    logits, idx = torch.zeros(4, 8), torch.zeros(4, dtype=torch.long)
    with pytest.raises(ValueError, match=r"gather_cols must be int64 \[T, M\] with T = 4, got torch.int32"):
        ce.softcapped_loss_lse_portable(logits, idx, (1.0,), None, 0.0, torch.zeros(4, 2, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"gather_cols must be int64 \[T, M\] with T = 4"):
        ce.softcapped_loss_lse_triton(logits, idx, (1.0,), None, 0.0, torch.zeros(4, dtype=torch.long))
    logits8, one = logits.to(torch.float8_e4m3fn), torch.tensor(1.0)
    args = (logits8, torch.zeros(4), idx, None, ce.loss_weights((1.0,), None, "cpu"), 1, one, one, None)
    for impl in ("portable", "triton"):
        grad_e5m2 = getattr(ce, f"softcapped_ce_grad_e5m2_{impl}")
        with pytest.raises(ValueError, match="grad_zg needs the gather_cols"):
            grad_e5m2(*args, None, torch.zeros(4, 2))
        with pytest.raises(ValueError, match=r"grad_zg must be \[T, M\] = \[4, 2\], got \(4, 3\)"):
            grad_e5m2(*args, torch.zeros(4, 2, dtype=torch.long), torch.zeros(4, 3))


def _fp8_gather_reference(x, w, cols, targets, mtp, prefix, pw, gather, grads):
    """fp8_lm_head_loss with gather in float64 from the same fp8-rounded operands (e4m3 x and W, e4m3
    logits), model/loss.py's (loss, lse) and softcap for zg, the logit gradient rounded to e5m2 with
    record #360's grad scale, then dx = g·Wᵀ and dW = xᵀ·g (zeros outside cols)."""
    x_d = (x.detach().float() / LM_HEAD_X_SCALE).to(torch.float8_e4m3fn).double() * LM_HEAD_X_SCALE
    w_d = quantize_lm_head(w.detach()).double() * LM_HEAD_W_SCALE
    w_cols = w_d if cols is None else w_d[:, cols]
    logits = (x_d @ w_cols).clamp(-448, 448).to(torch.float8_e4m3fn).double()
    loss, lse, zg, g = _gathered_reference(logits, targets, mtp, prefix, pw, gather, grads)
    g = (g / LM_HEAD_GRAD_SCALE).clamp(-57344, 57344).to(torch.float8_e5m2).double() * LM_HEAD_GRAD_SCALE
    dw = torch.zeros_like(w_d)
    dw[:, slice(None) if cols is None else cols] = x_d.t() @ g
    return loss, lse, zg, g @ w_cols.t(), dw


@pytest.mark.parametrize("triton", [False, True], ids=["portable", "triton"])
@pytest.mark.parametrize("sampled", [True, False], ids=["sampled", "full"])
def test_fp8_lm_head_loss_with_gathered_z_matches_float64_reference(triton, sampled):
    """fp8_lm_head_loss with gather_cols (positions in the candidate set when sampled, as the
    targets): loss, lse, zg, and dx, dW of g·loss + Σ g_lse·lse + Σ g_zg·zg against float64 autograd
    of the definition on the same fp8-rounded operands, within the e5m2 tolerance of the plain loss's test."""
    x, w, cols, N, targets, prefix, mtp = fp8_head_case(sampled)  # the plain fp8 loss test's inputs
    T, V = x.shape[0], w.shape[1]
    gather = _gather_cols(T, N, targets)
    gather[:, 1] = N - 1  # CPLM's <copy>: one fixed column on every row (sampled: its position in C)
    grads = _gather_grads(T, "lsz", 2.0)
    with use_backend(triton=triton):
        loss, lse, zg = fp8_lm_head_loss(x, w, targets, mtp, prefix, 0.3, cols, gather)
        _backward_used((loss, lse, zg), grads)
    want = _fp8_gather_reference(x, w, cols, targets, mtp, prefix, 0.3, gather, grads)
    assert loss.item() == pytest.approx(want[0].item(), rel=1e-5)
    torch.testing.assert_close(lse.double(), want[1], rtol=1e-6, atol=0)
    torch.testing.assert_close(zg.double(), want[2], rtol=1e-6, atol=0)
    # e5m2 keeps 2 mantissa bits: one element rounded the other way moves a sum by <= 1/8 of its term
    torch.testing.assert_close(x.grad.double(), want[3], rtol=5e-2, atol=2e-3)
    torch.testing.assert_close(w.grad.double(), want[4], rtol=5e-2, atol=2e-3)
    if cols is not None:
        outside = torch.ones(V, dtype=torch.bool)
        outside[cols] = False
        assert w.grad[:, outside].abs().sum() == 0  # exact zeros outside the candidates


@pytest.mark.parametrize("path", ["fp8", "bf16"])
def test_gathered_z_gradient_traces_under_compile(path):
    """torch.compile(fullgraph=True, aot_eager) through the portable CE with gather_cols: with every
    output used, the compiled step's dx, dW are eager's; with zg returned but unused, the compiled
    backward receives a zero grad_zg and matches eager's gather-free step bit for bit."""
    gen = torch.Generator().manual_seed(6)
    T, D, V = 8, 16, 24
    x = (2 * torch.randn(T, D, generator=gen)).bfloat16()
    w = (0.5 * torch.randn(D, V, generator=gen)).bfloat16()
    targets = torch.randint(0, V, (T,), generator=gen)
    gather = _gather_cols(T, V, targets)
    g_lse, g_zg = _gather_grads(T, "lsz", 1.0)[1:]

    def loss_of(x, w, gather, use_zg):
        if path == "fp8":
            outs = fp8_lm_head_loss(x, w, targets, (1.0, 0.5), None, None, None, gather)
        else:
            outs = ce.softcapped_loss_lse(x @ w, targets, (1.0, 0.5), None, None, gather)
        loss = outs[0] + (outs[1] * g_lse).sum()
        return loss + (outs[2] * g_zg).sum() if use_zg else loss

    def step(fn, gather, use_zg):
        xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
        fn(xg, wg, gather, use_zg).backward()
        return xg.grad, wg.grad

    compiled = torch.compile(loss_of, backend="aot_eager", fullgraph=True, dynamic=False)
    try:
        with use_backend(triton=False):
            for got, want in zip(step(compiled, gather, True), step(loss_of, gather, True)):
                torch.testing.assert_close(got, want, rtol=0, atol=0)
            for got, want in zip(step(compiled, gather, False), step(loss_of, None, False)):
                assert torch.equal(got, want)
    finally:
        torch._dynamo.reset()


@pytest.mark.gpu
def test_gathered_z_kernels_on_gpu_ragged_rows():
    """The GPU tile with a partial last block and gather_cols: zg and the gradients with a random
    grad_lse and grad_zg, kernels against twins on the same GPU (bf16 and e4m3 paths)."""
    T, N, mtp = 37, 5000, (1.0, 0.5, 0.25)
    logits, targets, prefix = _inputs(T, N, torch.bfloat16, device="cuda")
    cols = _gather_cols(T, N, targets.cpu()).cuda()
    grads = tuple(g.cuda() for g in _gather_grads(T, "lsz", 1.0))
    results = []
    for impl in ("triton", "portable"):
        leaf = logits.clone().requires_grad_()
        outs = getattr(ce, f"softcapped_loss_lse_{impl}")(leaf, targets, mtp, prefix, 0.3, cols)
        _backward_used(outs, grads)
        results.append((outs[2].detach(), leaf.grad))
    torch.testing.assert_close(results[0][0], results[1][0], rtol=2e-6, atol=0)  # GPU sigmoid is approximate
    assert ulp_distance(results[0][1], results[1][1], atol=2e-6) <= 1.0
    logits8 = (2 * logits.float()).clamp(-448, 448).to(torch.float8_e4m3fn)
    weights = ce.loss_weights(mtp, 0.3, "cuda")
    _, lse, zg = ce.softcapped_ce_e4m3_triton(logits8, targets, prefix, weights, 3, cols)
    _, twin_lse, twin_zg = ce.softcapped_ce_e4m3_portable(logits8, targets, prefix, weights, 3, cols)
    torch.testing.assert_close(zg, twin_zg, rtol=2e-6, atol=0)
    scale = (grads[0], torch.tensor(GRAD_SCALE, device="cuda"))
    got = ce.softcapped_ce_grad_e5m2_triton(logits8, lse, targets, prefix, weights, 3, *scale, grads[1], cols, grads[2])
    twin = ce.softcapped_ce_grad_e5m2_portable(logits8, twin_lse, targets, prefix, weights, 3, *scale, grads[1], cols,
                                               grads[2])
    steps = _e5m2_steps(got, twin)
    assert steps.max() <= 1 and (steps > 0).float().mean() <= 0.02  # GPU exp is approximate
