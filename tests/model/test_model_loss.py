"""model/loss.py and the fp8 lm_head against loops and dequantized references."""
import math

import pytest
import torch

import model.loss as loss_module
from model.loss import CandidateSampler, softcap, softcapped_loss_sum, training_loss, validation_loss
from perf.fp8 import LM_HEAD_GRAD_SCALE, LM_HEAD_W_SCALE, LM_HEAD_X_SCALE, fp8_lm_head


def _loop_loss(logits, targets, mtp, prefix, pw):
    T, N = logits.shape
    total = 0.0
    for t in range(T):
        z = [23 / (1 + math.exp(-(float(l) + 5) / 7.5)) for l in logits[t]]
        lse = math.log(sum(math.exp(v) for v in z))
        for k, w in enumerate(mtp):
            if t + k < T and 0 <= targets[t + k] < N:
                total += w * (lse - z[targets[t + k]])
        if prefix is not None and prefix[t] >= 0:
            total += pw * (lse - z[prefix[t]])
    return total


def test_softcapped_loss_matches_a_loop():
    gen = torch.Generator().manual_seed(0)
    T, N = 9, 13
    logits = 4 * torch.randn(T, N, generator=gen)
    targets = torch.randint(0, N, (T,), generator=gen)
    targets[3] = -100  # skipped
    prefix = torch.randint(-1, N, (T,), generator=gen)
    got = softcapped_loss_sum(logits, targets, (1.0, 0.5, 0.25), prefix, 0.2)
    want = _loop_loss(logits, targets.tolist(), (1.0, 0.5, 0.25), prefix.tolist(), 0.2)
    assert got.item() == pytest.approx(want, rel=1e-5)
    assert torch.equal(softcap(torch.tensor([-5.0])), torch.tensor([11.5]))


def test_sampled_softmax_is_the_loss_over_the_candidate_columns():
    gen = torch.Generator().manual_seed(1)
    T, D, V = 7, 16, 40
    x = torch.randn(T, D, generator=gen)
    w = torch.randn(D, V, generator=gen)
    targets = torch.randint(0, V, (T,), generator=gen)
    cand = torch.unique(torch.cat([targets, torch.tensor([0, 5, 39])]))
    prefix = torch.randint(-1, V, (T,), generator=gen)
    got = training_loss(x, w, targets, (1.0, 0.5), prefix, 0.3, candidates=cand, fp8=False)
    col = {int(c): i for i, c in enumerate(cand)}
    sub_t = [col[int(t)] for t in targets]
    sub_p = [col.get(int(p), -1) if p >= 0 else -1 for p in prefix]  # prefix outside C: dropped
    want = _loop_loss(x @ w[:, cand], sub_t, (1.0, 0.5), sub_p, 0.3)
    assert got.item() == pytest.approx(want, rel=1e-5)
    with pytest.raises(ValueError, match="candidate"):
        training_loss(x, w, targets, (1.0,), None, 0.0, candidates=cand[cand != targets[0]], fp8=False)


def test_validation_loss_is_mean_softcapped_ce(monkeypatch):
    gen = torch.Generator().manual_seed(2)
    x, w = torch.randn(5, 8, generator=gen), torch.randn(8, 11, generator=gen)
    targets = torch.randint(0, 11, (5,), generator=gen)
    want = _loop_loss(x @ w, targets.tolist(), (1.0,), None, 0.0) / 5
    assert validation_loss(x, w, targets).item() == pytest.approx(want, rel=1e-5)
    monkeypatch.setattr(loss_module, "EVAL_CE_SLAB_ROWS", 2)  # slabs of 2, 2, 1 rows
    assert validation_loss(x, w, targets).item() == pytest.approx(want, rel=1e-5)


def test_fp8_lm_head_matches_dequantized_reference():
    gen = torch.Generator().manual_seed(3)
    T, D, V = 16, 32, 64
    x = torch.randn(T, D, generator=gen).bfloat16().requires_grad_()
    w = (0.3 * torch.randn(D, V, generator=gen)).bfloat16().requires_grad_()
    cols = torch.tensor([2, 3, 17, 40, 63])
    logits = fp8_lm_head(x, w, cols)
    x_deq = (x.detach().float() / LM_HEAD_X_SCALE).to(torch.float8_e4m3fn).double() * LM_HEAD_X_SCALE
    w_deq = (w.detach().float() / LM_HEAD_W_SCALE).bfloat16().float().to(torch.float8_e4m3fn).double() * LM_HEAD_W_SCALE
    exact = (x_deq @ w_deq[:, cols]).float()
    torch.testing.assert_close(logits, exact.to(torch.float8_e4m3fn).float(), rtol=0, atol=0.5)
    assert torch.equal(logits, logits.to(torch.float8_e4m3fn).float())  # on the e4m3 grid
    g = torch.randn(T, len(cols), generator=gen) * 0.01
    logits.backward(g)
    g_deq = (g / LM_HEAD_GRAD_SCALE).to(torch.float8_e5m2).double() * LM_HEAD_GRAD_SCALE
    torch.testing.assert_close(x.grad.double(), g_deq @ w_deq[:, cols].t(), rtol=2e-2, atol=1e-3)
    dw = torch.zeros(D, V, dtype=torch.float64)
    dw[:, cols] = x_deq.t() @ g_deq
    torch.testing.assert_close(w.grad.double(), dw, rtol=2e-2, atol=1e-3)
    assert w.grad[:, [0, 1, 4]].abs().sum() == 0  # exact zeros outside the candidates


def test_candidate_sampler_follows_the_sweep():
    V, P = 50304, 2048
    targets = torch.tensor([5, 5, 9, 50300, 123])
    sampler = CandidateSampler(V, rank=3, world_size=8)
    assert sampler.offset == 6288 * 3
    cand = sampler.candidates(targets, P)
    assert cand.numel() == P and torch.equal(cand, torch.sort(cand).values)
    assert torch.isin(targets, cand).all()
    # the negatives are the first P − U unmarked classes of the sweep from the rank's offset
    sweep = [(20011 * k) % V for k in range(6288 * 3, 6288 * 3 + 4000)]
    negatives = [c for c in sweep if c not in {5, 9, 50300, 123}][: P - 4]
    assert set(cand.tolist()) == {5, 9, 50300, 123} | set(negatives)
    assert sampler.offset == 6288 * 3 + int((P - 4) * 1.7) + 256
    with pytest.raises(ValueError, match="distinct targets"):
        sampler.candidates(torch.arange(10), 5)


def test_candidate_sampler_fallback_spreads_evenly():
    sampler = CandidateSampler(64)
    cand = sampler.candidates(torch.arange(0, 64, 2), 60)  # needs 28 of the 32 odd classes
    assert cand.numel() == 60 and torch.isin(torch.arange(0, 64, 2), cand).all()


def test_softcapped_loss_gradient_matches_autograd_of_the_plain_expression():
    gen = torch.Generator().manual_seed(4)
    T, N = 11, 17
    logits = (4 * torch.randn(T, N, generator=gen)).requires_grad_()
    targets = torch.randint(0, N, (T,), generator=gen)
    targets[2] = -1
    prefix = torch.randint(-1, N, (T,), generator=gen)
    softcapped_loss_sum(logits, targets, (1.0, 0.5, 0.25), prefix, 0.3).backward()
    ref_logits = logits.detach().double().requires_grad_()
    z = 23 * torch.sigmoid((ref_logits + 5) / 7.5)
    lse = torch.logsumexp(z, -1)
    total = 0
    for k, w in enumerate((1.0, 0.5, 0.25)):
        for t in range(T - k):
            if targets[t + k] >= 0:
                total = total + w * (lse[t] - z[t, targets[t + k]])
    for t in range(T):
        if prefix[t] >= 0:
            total = total + 0.3 * (lse[t] - z[t, prefix[t]])
    total.backward()
    torch.testing.assert_close(logits.grad.double(), ref_logits.grad, rtol=1e-5, atol=1e-6)
