"""model/loss.py and the fp8 lm_head against loops and dequantized references; docs/loss_terms.md's z-loss
example, made as the one-line edit it describes, against the model's definition."""
import __future__
import inspect
import math

import pytest
import torch

import model.loss as loss_module
from model.loss import (CandidateSampler, candidate_positions, softcap, softcapped_ce, training_loss,
                        validation_loss)
from perf.backend import use_backend
from perf.kernels.cross_entropy import softcapped_loss_sum
from perf.fp8 import LM_HEAD_GRAD_SCALE, LM_HEAD_W_SCALE, LM_HEAD_X_SCALE, fp8_lm_head_loss, quantize_lm_head


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


def test_softcapped_ce_definition_matches_a_loop():
    """model/loss.py's definition: Σ L against the loop, lse_t = ln Σ_c exp z_tc row by row, in fp32
    (bf16 logits upcast first) or wider."""
    gen = torch.Generator().manual_seed(6)
    T, N = 9, 13
    logits = 4 * torch.randn(T, N, generator=gen)
    targets = torch.randint(0, N, (T,), generator=gen)
    targets[3], targets[7] = -100, N + 2  # both skipped
    prefix = torch.randint(-1, N, (T,), generator=gen)
    loss, lse = softcapped_ce(logits, targets, (1.0, 0.5, 0.25), prefix, 0.2)
    want = _loop_loss(logits, targets.tolist(), (1.0, 0.5, 0.25), prefix.tolist(), 0.2)
    assert loss.dtype == lse.dtype == torch.float32 and lse.shape == (T,)
    assert loss.item() == pytest.approx(want, rel=1e-5)
    for t in range(T):
        z = [23 / (1 + math.exp(-(float(v) + 5) / 7.5)) for v in logits[t]]
        assert lse[t].item() == pytest.approx(math.log(sum(math.exp(v) for v in z)), rel=1e-6)
    bf16 = logits.bfloat16()
    got16 = softcapped_ce(bf16, targets, (1.0,), None, 0.0)
    assert got16[0].dtype == torch.float32 and torch.equal(got16[1], softcapped_ce(bf16.float(), targets, (1.0,), None,
                                                                                   0.0)[1])
    assert softcapped_ce(logits.double(), targets, (1.0,), None, 0.0)[1].dtype == torch.float64


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
    pos_t, pos_p = candidate_positions(cand, V, targets, prefix)  # the model's definition of the relabelling
    assert pos_t.tolist() == sub_t and pos_p.tolist() == sub_p
    assert softcapped_ce(x @ w[:, cand], pos_t, (1.0, 0.5), pos_p, 0.3)[0].item() == pytest.approx(want, rel=1e-5)
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


def _fp8_lm_head_loss_reference(x, w, cols, targets, mtp, prefix, pw):
    """The fp8 lm_head loss in float64 from dequantized operands: e4m3 x and W, logits rounded to
    e4m3, the softcapped loss term by term; its logit gradient goes through the e5m2 grid (grad_s)
    into dx = g·Wᵀ and dW = xᵀ·g, as the record's backward does."""
    x_deq = (x.detach().float() / LM_HEAD_X_SCALE).to(torch.float8_e4m3fn).double() * LM_HEAD_X_SCALE
    w_deq = (w.detach().float() / LM_HEAD_W_SCALE).bfloat16().float().to(torch.float8_e4m3fn).double() * LM_HEAD_W_SCALE
    w_cols = w_deq if cols is None else w_deq[:, cols]
    logits = (x_deq @ w_cols).clamp(-448, 448).to(torch.float8_e4m3fn).double().requires_grad_()
    z = 23 * torch.sigmoid((logits + 5) / 7.5)
    lse = torch.logsumexp(z, -1)
    T, N = logits.shape
    total = logits.new_zeros(())
    for k, wk in enumerate(mtp):
        for t in range(T - k):
            if 0 <= targets[t + k] < N:
                total = total + wk * (lse[t] - z[t, targets[t + k]])
    for t in range(T):
        if prefix is not None and 0 <= prefix[t] < N:
            total = total + pw * (lse[t] - z[t, prefix[t]])
    total.backward()
    g = (logits.grad / LM_HEAD_GRAD_SCALE).clamp(-57344, 57344).to(torch.float8_e5m2).double() * LM_HEAD_GRAD_SCALE
    dw = torch.zeros_like(w_deq)
    if cols is None:
        dw = x_deq.t() @ g
    else:
        dw[:, cols] = x_deq.t() @ g
    return total.detach(), g @ w_cols.t(), dw


def fp8_head_case(sampled: bool):
    """The fp8 lm_head tests' inputs: (x [16, 32] and w [32, 64] bf16 leaves, the candidate columns or None,
    their count N, targets with one skipped, prefix targets (−1 for none), the MTP weights)."""
    gen = torch.Generator().manual_seed(3)
    T, D, V = 16, 32, 64
    x = (2 * torch.randn(T, D, generator=gen)).bfloat16().requires_grad_()
    w = (0.5 * torch.randn(D, V, generator=gen)).bfloat16().requires_grad_()
    cols = torch.tensor([2, 3, 5, 8, 13, 17, 21, 34, 40, 55, 63]) if sampled else None
    N = V if cols is None else cols.numel()
    targets = torch.randint(0, N, (T,), generator=gen)
    targets[4] = -100  # skipped
    prefix = torch.randint(-1, N, (T,), generator=gen)
    return x, w, cols, N, targets, prefix, (1.0, 0.5, 0.25)


@pytest.mark.parametrize("triton", [False, True], ids=["portable", "triton"])
@pytest.mark.parametrize("sampled", [True, False], ids=["sampled", "full"])
def test_fp8_lm_head_loss_matches_float64_reference(triton, sampled):
    """e4m3 logits straight into the CE, on both paths, against the float64 reference of the same
    recipe: the loss to fp32 precision, dx and dW to the e5m2 gradient's precision."""
    x, w, cols, N, targets, prefix, mtp = fp8_head_case(sampled)
    V = w.shape[1]
    with use_backend(triton=triton):
        loss, _ = fp8_lm_head_loss(x, w, targets, mtp, prefix, 0.3, cols)
        loss.backward(torch.tensor(2.0))  # grad_out rides into the e5m2 scale
    want_loss, want_dx, want_dw = _fp8_lm_head_loss_reference(x, w, cols, targets.tolist(), mtp, prefix.tolist(), 0.3)
    assert loss.item() == pytest.approx(want_loss.item(), rel=1e-5)
    # e5m2 keeps 2 mantissa bits: one element rounded the other way moves a sum by <= 1/8 of its term
    torch.testing.assert_close(x.grad.double(), 2 * want_dx, rtol=5e-2, atol=2e-3)
    torch.testing.assert_close(w.grad.double(), 2 * want_dw, rtol=5e-2, atol=2e-3)
    if cols is not None:
        outside = torch.ones(V, dtype=torch.bool)
        outside[cols] = False
        assert w.grad[:, outside].abs().sum() == 0  # exact zeros outside the candidates


def test_fp8_lm_head_loss_is_the_ce_of_its_e4m3_logits():
    """The fused node's loss is softcapped_loss_sum of the logits it rounds to e4m3 (computed here
    through the same _scaled_mm), and it saves nothing wider than a byte at [T, N]."""
    gen = torch.Generator().manual_seed(5)
    T, D, V = 12, 16, 40
    x = torch.randn(T, D, generator=gen).bfloat16().requires_grad_()
    w = (0.4 * torch.randn(D, V, generator=gen)).bfloat16().requires_grad_()
    targets = torch.randint(0, V, (T,), generator=gen)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        loss, _ = fp8_lm_head_loss(x, w, targets, (1.0, 0.5), None, None)
    x8 = (x.detach().float() / LM_HEAD_X_SCALE).to(torch.float8_e4m3fn)
    w8 = quantize_lm_head(w.detach())
    logits = torch._scaled_mm(x8, w8.t().contiguous().t(), scale_a=torch.tensor(LM_HEAD_X_SCALE),
                              scale_b=torch.tensor(LM_HEAD_W_SCALE), out_dtype=torch.float32, use_fast_accum=True)
    want = softcapped_loss_sum(logits.clamp(-448, 448).to(torch.float8_e4m3fn).float(), targets, (1.0, 0.5), None, None)
    assert loss.item() == pytest.approx(want.item(), rel=1e-6)
    wide = [t for t in saved if t.dim() == 2 and t.shape == (T, V)]
    assert [t.dtype for t in wide] == [torch.float8_e4m3fn]


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


# ------------------------------------------------------------------------------------------------
# docs/loss_terms.md's worked example: a z-loss is one line in training_loss

Z_LOSS_LINE = "loss = loss + 1e-4 * lse.square().sum()"  # docs/loss_terms.md, verbatim


def _training_loss_with(line: str):
    """model/loss.py `training_loss` with `line` inserted before its closing `return loss`: the
    docs/loss_terms.md's one-line edit, made on the source, so the test sees what the edited file would run."""
    source = inspect.getsource(loss_module.training_loss)
    closing = "\n    return loss\n"
    assert source.endswith(closing), "training_loss no longer ends in `return loss`: update docs/loss_terms.md's example"
    source = source[: -len(closing)] + f"\n    {line}{closing}"
    namespace = dict(vars(loss_module))
    exec(compile(source, loss_module.__file__, "exec", flags=__future__.annotations.compiler_flag), namespace)
    return namespace["training_loss"]


def _defined_step(x, w, cand, targets, mtp, prefix, pw, line, fp8, grad_out):
    """The same step from the model's definition (candidate_positions, softcapped_ce) in float64 with
    `line` applied to its (loss, lse): with fp8, on e4m3-rounded operands and logits, and the logit
    gradient rounded to e5m2 as the fp8 backward does. Returns the loss, dx and dW."""
    if fp8:
        x_d = (x.detach().float() / LM_HEAD_X_SCALE).to(torch.float8_e4m3fn).double() * LM_HEAD_X_SCALE
        w_d = quantize_lm_head(w.detach()).double() * LM_HEAD_W_SCALE
    else:
        x_d, w_d = x.detach().double(), w.detach().double()
    if cand is not None:
        targets, prefix = candidate_positions(cand, w.shape[1], targets, prefix)
    w_cols = w_d if cand is None else w_d[:, cand]
    logits = x_d @ w_cols
    if fp8:
        logits = logits.clamp(-448, 448).to(torch.float8_e4m3fn).double()
    logits.requires_grad_()
    names = dict(zip(("loss", "lse"), softcapped_ce(logits, targets, mtp, prefix, pw)))
    exec(line, names)
    names["loss"].backward(torch.tensor(grad_out, dtype=torch.float64))
    g = logits.grad
    if fp8:
        g = (g / LM_HEAD_GRAD_SCALE).clamp(-57344, 57344).to(torch.float8_e5m2).double() * LM_HEAD_GRAD_SCALE
    dw = torch.zeros_like(w_d)
    dw[:, slice(None) if cand is None else cand] = x_d.t() @ g
    return names["loss"].detach(), g @ w_cols.t(), dw


@pytest.mark.parametrize("path,softmax", [("fp8-portable", "sampled"), ("fp8-portable", "full"),
                                          ("fp8-triton", "sampled"), ("fp8-triton", "full"), ("fp32-triton", "sampled")])
def test_readme_z_loss_is_one_line_and_passes_the_ce_parity(path, softmax):
    """A z-loss made as the docs/loss_terms.md's one-line edit of training_loss, no kernel touched: loss, dx and dW
    of the fp8 path (e4m3 logits, e5m2 gradient, portable and Triton) and of the non-fp8 kernel
    against the model's definition with the same line. Under the full softmax, rows 6 and 7 carry no
    CE term (their targets skipped, no prefix), so their dx is the z-loss's alone."""
    gen = torch.Generator().manual_seed(8)
    T, D, V = 12, 32, 48
    sampled = softmax == "sampled"
    x = 2 * torch.randn(T, D, generator=gen)
    w = 0.5 * torch.randn(D, V, generator=gen)
    if path.startswith("fp8"):
        x, w = x.bfloat16(), w.bfloat16()
    targets = torch.randint(0, V, (T,), generator=gen)
    prefix = torch.randint(-1, V, (T,), generator=gen)
    cand = torch.unique(torch.cat([targets, torch.arange(0, V, 5)])) if sampled else None
    if not sampled:  # no CE term on rows 6, 7 (MTP reaches targets 6..9)
        targets[6:10], prefix[6:8] = -100, -1
    mtp, fp8 = (1.0, 0.5, 0.25), path.startswith("fp8")
    z_loss_training = _training_loss_with(Z_LOSS_LINE)
    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
    with use_backend(triton=path.endswith("triton")):
        loss = z_loss_training(xg, wg, targets, mtp, prefix, 0.3, candidates=cand, fp8=fp8)
        loss.backward(torch.tensor(2.0))
    want_loss, want_dx, want_dw = _defined_step(x, w, cand, targets, mtp, prefix, 0.3, Z_LOSS_LINE, fp8, 2.0)
    plain_loss, plain_dx, _ = _defined_step(x, w, cand, targets, mtp, prefix, 0.3, "", fp8, 2.0)
    assert abs(want_loss - plain_loss) > 1e-3 * abs(plain_loss)  # the z-loss is in the value
    assert loss.item() == pytest.approx(want_loss.item(), rel=1e-5)
    if fp8:  # e5m2 keeps 2 mantissa bits: one element rounded the other way moves a sum by <= 1/8 of its term
        torch.testing.assert_close(xg.grad.double(), want_dx, rtol=5e-2, atol=2e-3)
        torch.testing.assert_close(wg.grad.double(), want_dw, rtol=5e-2, atol=2e-3)
    else:
        # fp32 logits and GEMMs against float64: the sums of T or V products, a few fp32 ulps of |dW| <= 20
        torch.testing.assert_close(xg.grad.double(), want_dx, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(wg.grad.double(), want_dw, rtol=1e-5, atol=1e-5)
    if not sampled:  # the z-loss's gradient alone, to the precision of its own size
        assert torch.equal(plain_dx[6:8], torch.zeros(2, D, dtype=torch.float64))
        err = (xg.grad[6:8].double() - want_dx[6:8]).norm() / want_dx[6:8].norm()
        assert want_dx[6:8].norm() > 0 and err < (0.05 if fp8 else 1e-5)
