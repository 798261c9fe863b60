"""Fused softcapped CE: kernel against a float64 autograd reference and its portable twin (interpreter),
twins and kernels against model/loss.py's definition with a gradient flowing into lse, the dispatch,
input errors, and ragged GPU shapes at the GPU tile (gpu marker)."""

import pytest
import torch
import triton
import triton.language as tl

import model.loss as loss_module
from perf.kernels import cross_entropy as ce
from perf.backend import use_backend
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
