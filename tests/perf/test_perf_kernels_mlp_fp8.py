"""perf/kernels/mlp.py: the fp8 MLP Function against dequantized fp32 references and plain autograd."""
import pytest
import torch

from perf.kernels.mlp import Fp8MLPState, bf16_mlp, fp8_mlp

T, D, H, S = 48, 96, 160, 3


def _q(v, scale, dtype):
    """Independent reference quantizer: saturate, then round to the fp8 format."""
    fmax = torch.finfo(dtype).max
    return torch.clamp(v.double() / float(scale), -fmax, fmax).float().to(dtype)


def _setup(seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, D, generator=gen)
    x = (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True))).to(dtype)  # normed rows, like the model
    bank = (torch.rand(S, 2, H, D, generator=gen) * 2 - 1) * 0.05
    g = (torch.randn(T, D, generator=gen) * 0.05).to(dtype)
    state = Fp8MLPState(S, H, D)
    return x, bank.to(dtype), g, state


def _warm(state, bank, x, slot, p):
    """One refresh + step so the delayed post/dpre scales hold real amaxes, then refresh again."""
    state.refresh(bank)
    w1, w2 = bank[slot, 0].clone().requires_grad_(), bank[slot, 1].clone().requires_grad_()
    fp8_mlp(x, w1, w2, p, state, slot).sum().backward()
    state.refresh(bank)


def test_forward_equals_dequantized_reference():
    x, bank, _, state = _setup()
    slot, p = 1, torch.tensor(0.8125)
    _warm(state, bank, x, slot, p)
    out = fp8_mlp(x, bank[slot, 0], bank[slot, 1], p, state, slot)
    s_x, s_w1, s_w2, s_post = 2.0 ** -4, state.w1_scale[slot], state.w2_scale[slot], state.post_scale[slot]
    x_deq = _q(x, s_x, torch.float8_e4m3fn).double() * s_x
    w1_deq = _q(bank[slot, 0], s_w1, torch.float8_e4m3fn).double() * float(s_w1)
    w2_deq = _q(bank[slot, 1], s_w2, torch.float8_e4m3fn).double() * float(s_w2)
    post = torch.relu((x_deq @ w1_deq.t()).float()).square()
    post_deq = _q(post, s_post, torch.float8_e4m3fn).double() * float(s_post)
    ref = 0.8125 * (post_deq @ w2_deq)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
    # and it is the MLP: close to the exact fp32 p·mlp(x) within fp8 error
    exact = 0.8125 * bf16_mlp(x, bank[slot, 0], bank[slot, 1])
    assert (out - exact).norm() / exact.norm() < 0.1


def test_fold_gradients():
    x, bank, g, state = _setup(seed=1)
    slot = 2
    p = torch.tensor(1.25, requires_grad=True)
    _warm(state, bank, x, slot, p.detach())
    xg = x.clone().requires_grad_()
    w1, w2 = bank[slot, 0].clone().requires_grad_(), bank[slot, 1].clone().requires_grad_()
    out = fp8_mlp(xg, w1, w2, p, state, slot)
    out.backward(g)
    # independent dW2′ = post_qᵀ · g_q from the dequantized e4m3 post and e5m2 gradient
    s_x, s_w1, s_post = 2.0 ** -4, float(state.w1_scale[slot]), float(state.post_scale[slot])
    x_deq = _q(x, s_x, torch.float8_e4m3fn).double() * s_x
    w1_deq = _q(bank[slot, 0], s_w1, torch.float8_e4m3fn).double() * s_w1
    post = torch.relu((x_deq @ w1_deq.t()).float()).square()
    post_deq = _q(post, s_post, torch.float8_e4m3fn).double() * s_post
    g_deq = _q(g, 2.0 ** -6, torch.float8_e5m2).double() * 2.0 ** -6
    dw2_folded = post_deq.t() @ g_deq
    want_p = (dw2_folded * bank[slot, 1].double()).sum()
    assert abs(p.grad.double() - want_p) <= 1e-4 * abs(want_p)
    torch.testing.assert_close(w2.grad.double(), 1.25 * dw2_folded, rtol=1e-4, atol=1e-6)
    # plain autograd of p·mlp(x) in fp32, within fp8 tolerance; a gradient aligned with the
    # output keeps ⟨g, mlp(x)⟩ away from cancellation, so a relative tolerance on p means something
    y = bf16_mlp(x, bank[slot, 0], bank[slot, 1])
    g2 = 0.05 * y / y.abs().max() + 0.1 * g
    p2 = p.detach().clone().requires_grad_()
    xg, w1, w2 = (t.detach().clone().requires_grad_() for t in (x, bank[slot, 0], bank[slot, 1]))
    fp8_mlp(xg, w1, w2, p2, state, slot).backward(g2)
    pr = p.detach().clone().requires_grad_()
    xr, w1r, w2r = (t.detach().clone().requires_grad_() for t in (x, bank[slot, 0], bank[slot, 1]))
    (pr * bf16_mlp(xr, w1r, w2r)).backward(g2)
    FP8_RTOL = 0.1  # e4m3 operands carry 3 mantissa bits, e5m2 gradients 2
    assert abs(p2.grad - pr.grad) <= FP8_RTOL * abs(pr.grad)
    for got, want in ((xg.grad, xr.grad), (w1.grad, w1r.grad), (w2.grad, w2r.grad)):
        assert (got - want).norm() <= FP8_RTOL * want.norm()


def test_unfolded_slot_has_unit_fold_and_no_scalar():
    x, bank, g, state = _setup(seed=2)
    _warm(state, bank, x, 0, None)
    w2 = bank[0, 1].clone().requires_grad_()
    out = fp8_mlp(x, bank[0, 0], w2, None, state, 0)
    folded = fp8_mlp(x, bank[0, 0], bank[0, 1], torch.tensor(1.0), state, 0)
    assert torch.equal(out, folded)


def test_delayed_scales_follow_the_recipe_over_20_calls():
    x, bank, g, state = _setup(seed=3, dtype=torch.bfloat16)
    slot, p = 1, torch.tensor(1.0)
    gen = torch.Generator().manual_seed(9)
    prev_w_amax = None
    prev_post_amax = prev_dpre_amax = None
    post_scale, dpre_scale = 1.0, 2.0 ** -6  # the initial values
    for call in range(20):
        state.refresh(bank)
        w_amax = bank.float().abs().amax(dim=(2, 3))  # (S, 2) max|W1|, max|W2| per slot
        for j, scale in enumerate((state.w1_scale, state.w2_scale)):
            if call < 16:  # exact, computed in the weights' bf16
                want = (bank[:, j].reshape(S, -1).abs().amax(dim=1) / 448).float()
            else:  # previous refresh's amax with 12% headroom
                want = prev_w_amax[:, j] * 1.12 / 448
            torch.testing.assert_close(scale, want, rtol=1e-6, atol=0)
        if prev_post_amax is not None:
            post_scale = max(prev_post_amax * 1.03 / 448, 1e-6)
            dpre_scale = max(prev_dpre_amax * 1.25 / 57344, 1e-12)
        assert state.post_scale[slot].item() == pytest.approx(post_scale, rel=1e-6)
        assert state.dpre_scale[slot].item() == pytest.approx(dpre_scale, rel=1e-6)
        w1, w2 = bank[slot, 0].clone().requires_grad_(), bank[slot, 1].clone().requires_grad_()
        xg = x.clone().requires_grad_()
        out = fp8_mlp(xg, w1, w2, p, state, slot)
        out.backward(g)
        assert torch.isfinite(out).all() and torch.isfinite(xg.grad).all() and torch.isfinite(w1.grad).all()
        # independent amaxes of this step: relu(pre)² from the bf16 pre, and dpre from the reference
        pre = (_q(x, 2.0 ** -4, torch.float8_e4m3fn).float() * 2.0 ** -4) @ (
            _q(bank[slot, 0], state.w1_scale[slot], torch.float8_e4m3fn).float() * state.w1_scale[slot]).t()
        prev_post_amax = torch.relu(pre.bfloat16()).square().float().max().item()
        assert state.post_amax[slot].item() == pytest.approx(prev_post_amax, rel=2e-2)
        prev_post_amax = state.post_amax[slot].item()
        prev_dpre_amax = state.dpre_amax[slot].item()
        assert prev_dpre_amax > 0
        prev_w_amax = w_amax
        # weights drift by more than the 12% headroom on one step: the clamp must keep fp8 finite
        bank = bank * (1.2 if call == 17 else 1.0) + 0.002 * torch.randn(bank.shape, generator=gen).to(bank.dtype)


def test_errors_are_clear():
    x, bank, _, state = _setup()
    with pytest.raises(RuntimeError, match="refresh"):
        fp8_mlp(x, bank[0, 0], bank[0, 1], None, state, 0)
    with pytest.raises(ValueError, match="bank"):
        state.refresh(bank[:, :, :8])
    state.refresh(bank)
    with pytest.raises(ValueError, match="0-D"):
        fp8_mlp(x, bank[0, 0], bank[0, 1], torch.ones(1), state, 0)
