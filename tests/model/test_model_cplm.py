"""CPLM's definition (PR #379, model/cplm.py) against frontier_cplm.md §11's worked examples (computed
there in float64), a per-query brute-force loop for values and gradients, and the mixture's sums; the
mixture in the training loss against a float64 reference of §6, `<copy>` in the candidate sets, and the
model with features.cplm (its parameters, its validation mixture and diagnostics)."""
import math

import pytest
import torch

from model.cplm import (COPY_BAND_VAL, COPY_TOKEN_ID, copy_column_index, copy_head, copy_pointer,
                        diagnostics_line, mixture_nll, validation_mixture_nll)
from model.loss import CandidateSampler, softcap, training_loss

BOS = 50256


def _example_1():
    """N = 8, d = 4, L = 4, documents [0, 5) and [5, 8); s = 2 on even keys, 0 on odd, s0 = 1."""
    x = torch.tensor([BOS, 11, 12, 11, 13, BOS, 11, 11])
    y = torch.tensor([11, 12, 11, 13, BOS, 11, 11, 11])
    q = torch.ones(8, 4, dtype=torch.float64)
    k = torch.tensor([[1.0, 1, 1, 1] if j % 2 == 0 else [1.0, -1, 1, -1] for j in range(8)], dtype=torch.float64)
    return q, k, torch.full((4,), 0.5, dtype=torch.float64), x, y, torch.tensor([0, 5, 8, 8], dtype=torch.int32)


def test_worked_example_1_the_pointer():
    p_copy, a_sink = copy_pointer(*_example_1(), band=4)
    assert p_copy.tolist() == pytest.approx([0, 0, 0.09003, 0, 0.37900, 0, 0, 0.66524], abs=1e-5)
    assert a_sink.tolist() == pytest.approx([1, 0.26894, 0.24473, 0.14696, 0.13942, 1, 0.73106, 0.24473], abs=1e-5)
    e = math.e  # the table's Z_i, e.g. query 4: e + 2e² + 2
    assert a_sink[4].item() == pytest.approx(e / (e + 2 * e * e + 2), rel=1e-6)  # (fp32 scores, as the spec accumulates)


def test_a_later_block_sees_back_to_its_previous_block_only():
    q, k, k_sink, x, y, _ = _example_1()
    q, k = torch.cat([q, q[:4]]), torch.cat([k, k[:4]])
    x, y = torch.cat([x, torch.tensor([11, 11, 11, 11])]), torch.cat([y, torch.tensor([11, 11, 11, 11])])
    cu = torch.tensor([0, 12, 12], dtype=torch.int32)  # one document of 12
    p_copy, a_sink = copy_pointer(q, k, k_sink, x, y, cu, band=4)
    # query 8 opens block 2: sources 4..7 (s = 2, 0, 2, 0), hits where x_j = 11: j = 6, 7
    e = math.e
    assert a_sink[8].item() == pytest.approx(e / (e + 2 * e * e + 2), rel=1e-6)  # (fp32 scores, as the spec accumulates)
    assert p_copy[8].item() == pytest.approx((e * e + 1) / (e + 2 * e * e + 2), rel=1e-6)  # (fp32 scores, as the spec accumulates)


def _brute_force(q, k, k_sink, x, y, cu, band):
    """One query at a time, every earlier source tested against the rule by hand."""
    n, d = q.shape
    doc = [sum(1 for c in cu.tolist() if min(c, n) <= i) for i in range(n)]
    p_copy, a_sink = [], []
    for i in range(n):
        lo = (i // band) * band - band
        src = [j for j in range(max(lo, 0), i) if doc[j] == doc[i]]
        s0 = q[i].double() @ k_sink.double() / math.sqrt(d)
        s = [q[i].double() @ k[j].double() / math.sqrt(d) for j in src]
        z = torch.exp(s0) + sum(torch.exp(v) for v in s)
        a_sink.append(torch.exp(s0) / z)
        p_copy.append(sum((torch.exp(v) for v, j in zip(s, src) if x[j] == y[i]), torch.zeros((), dtype=torch.float64)) / z)
    return torch.stack(p_copy), torch.stack(a_sink)


@pytest.mark.parametrize("n, band", [(37, 8), (64, 16), (20, 32)])
def test_the_pointer_is_the_brute_force_rule_values_and_gradients(n, band):
    gen = torch.Generator().manual_seed(n)
    q = torch.randn(n, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    k = torch.randn(n, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    k_sink = torch.randn(8, generator=gen, dtype=torch.float64, requires_grad=True)
    x = torch.randint(0, 4, (n,), generator=gen)
    y = torch.randint(0, 4, (n,), generator=gen)
    cu = torch.tensor([0, n // 3, n // 2 + 1, n, n], dtype=torch.int32)
    w1, w2 = torch.randn(n, generator=gen, dtype=torch.float64), torch.randn(n, generator=gen, dtype=torch.float64)
    got = copy_pointer(q, k, k_sink, x, y, cu, band)
    want = _brute_force(q, k, k_sink, x, y, cu, band)
    for a, b in zip(got, want):
        torch.testing.assert_close(a.double(), b, rtol=1e-6, atol=1e-7)
    grads_got = torch.autograd.grad((w1 * got[0]).sum() + (w2 * got[1]).sum(), (q, k, k_sink))
    grads_want = torch.autograd.grad((w1 * want[0]).sum() + (w2 * want[1]).sum(), (q, k, k_sink))
    for a, b in zip(grads_got, grads_want):
        torch.testing.assert_close(a.double(), b, rtol=1e-5, atol=1e-6)


def test_no_source_means_all_sink_and_the_current_token_is_never_its_own_source():
    q, k, k_sink = torch.randn(4, 8), torch.randn(4, 8), torch.randn(8)
    x = torch.tensor([5, 6, 7, 8])
    y = x.clone()  # each query's target is its own input token: only itself could match
    p_copy, a_sink = copy_pointer(q, k, k_sink, x, y, torch.tensor([0, 4, 4], dtype=torch.int32), band=4)
    assert p_copy.tolist() == [0.0] * 4 and a_sink[0].item() == 1.0
    p_copy, a_sink = copy_pointer(q, k, k_sink, x, y, torch.tensor([0, 1, 2, 3, 4], dtype=torch.int32), band=4)
    assert a_sink.tolist() == [1.0] * 4  # every position its own document: no source anywhere


def test_worked_example_2_the_mixture_and_its_gradients():
    logits = torch.tensor([2.0, -1, 0, 4, -3, 1], dtype=torch.float64)
    z = softcap(logits).requires_grad_(True)
    assert z.tolist() == pytest.approx([16.5083, 14.4960, 15.1974, 17.6761, 13.0243, 15.8694], abs=1e-4)
    p_copy = torch.tensor(0.37900, dtype=torch.float64, requires_grad=True)
    a_sink = torch.tensor(0.13942, dtype=torch.float64, requires_grad=True)
    lse = torch.logsumexp(z, 0)
    assert lse.item() == pytest.approx(18.152450, abs=1e-5)
    assert torch.exp(z[3] - lse).item() == pytest.approx(0.621027, abs=1e-5)
    assert torch.exp(z[5] - lse).item() == pytest.approx(0.101974, abs=1e-5)
    nll = mixture_nll(z[3], z[5], lse, p_copy, a_sink)
    assert nll.item() == pytest.approx(0.401213, abs=1e-5)
    assert math.exp(-nll.item()) == pytest.approx(0.669507, abs=1e-5)
    assert validation_mixture_nll(z[3], z[5], lse, p_copy, a_sink).item() == pytest.approx(nll.item(), abs=1e-12)
    dz, dpc, das = torch.autograd.grad(nll, (z, p_copy, a_sink))
    assert dz.tolist() == pytest.approx([0.196331, 0.026246, 0.052927, -0.311091, 0.006025, 0.029563], abs=1e-5)
    assert dz.sum().item() == pytest.approx(0.0, abs=1e-12)
    assert (dpc.item(), das.item()) == pytest.approx((-0.152312, -0.105331), abs=1e-5)


def test_the_mixture_sums_to_one_over_the_columns_but_copy():
    """p(y) for every class y of one query: LM mass renormalized without `<copy>`, the pointer's mass on the
    sources holding y, the sink's mass handed back to the LM: they sum to 1."""
    gen = torch.Generator().manual_seed(0)
    V, c, n = 7, 6, 12  # classes 0..5, `<copy>` is column 6
    z = 23 * torch.rand(V, generator=gen, dtype=torch.float64)
    lse = torch.logsumexp(z, 0)
    q, k = torch.randn(n, 4, generator=gen, dtype=torch.float64), torch.randn(n, 4, generator=gen, dtype=torch.float64)
    k_sink = torch.randn(4, generator=gen, dtype=torch.float64)
    x = torch.randint(0, 6, (n,), generator=gen)
    cu = torch.tensor([0, n, n], dtype=torch.int32)
    total = 0.0
    for y in range(6):
        p_copy, a_sink = copy_pointer(q, k, k_sink, x, torch.full((n,), y), cu, band=16)
        total += math.exp(-mixture_nll(z[y], z[c], lse, p_copy[-1], a_sink[-1]).item()) - 1e-9
    assert total == pytest.approx(1.0, abs=1e-9)


# ---- the mixture in the training loss: the fused CE's lse and gathered z, against a float64 reference ----

V_FULL = 50304  # `<copy>` is column 50257: the vocabulary must reach it


def _mixture_reference(logits, targets, mtp, prefix, pw, copy_col, p_copy, a_sink):
    """frontier_cplm.md §6 in float64, term by term: w_0·mixture NLL + the MTP and prefix terms over lse of
    every column (`<copy>` included)."""
    z = softcap(logits)
    lse = torch.logsumexp(z, -1)
    T = z.shape[0]
    rows = torch.arange(T)
    total = mtp[0] * mixture_nll(z[rows, targets], z[:, copy_col], lse, p_copy, a_sink).sum()
    for k, wk in enumerate(mtp[1:], start=1):
        total = total + wk * (lse[: T - k] - z[rows[: T - k], targets[k:]]).sum()
    if prefix is not None:
        keep = prefix >= 0
        total = total + pw * (lse[keep] - z[rows[keep], prefix[keep]]).sum()
    return total


@pytest.mark.parametrize("sampled", [False, True], ids=["full", "sampled"])
def test_training_loss_with_the_pointer_is_the_mixture_reference(sampled):
    """training_loss(copy=...) on the bf16-free path (fp32 logits): the loss, and the gradients of x, lm_head,
    p_copy and a_sink, against float64 autograd of the spec's formula; under the sampled softmax `<copy>` is
    found by its position in C and the MTP/prefix normalizer is over C."""
    gen = torch.Generator().manual_seed(7)
    T, D = 12, 8
    x = torch.randn(T, D, generator=gen, requires_grad=True)
    w = (0.5 * torch.randn(D, V_FULL, generator=gen)).requires_grad_()
    p_copy = torch.rand(T, generator=gen).mul_(0.5).requires_grad_()
    a_sink = torch.rand(T, generator=gen).mul_(0.5).requires_grad_()
    if sampled:
        cand = torch.sort(torch.cat([torch.randperm(50000, generator=gen)[:13], torch.tensor([50257, 50300])])).values
        targets = cand[torch.tensor([0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 12])]  # every target in C, none <copy>
    else:
        cand = None
        targets = torch.randint(0, 50257, (T,), generator=gen)
    prefix = torch.where(torch.rand(T, generator=gen) < 0.5, targets.flip(0), torch.full_like(targets, -1))
    mtp = torch.tensor([1.0, 0.5, 0.25])
    loss = training_loss(x, w, targets, mtp, prefix, 0.3, cand, fp8=False, copy=(p_copy, a_sink))
    got = torch.autograd.grad(loss, (x, w, p_copy, a_sink))

    xd, wd = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    pcd, asd = p_copy.detach().double().requires_grad_(), a_sink.detach().double().requires_grad_()
    cols = wd if cand is None else wd[:, cand]
    pos = (lambda c: c) if cand is None else (lambda c: torch.searchsorted(cand, c))
    pre = torch.where(prefix >= 0, pos(prefix.clamp(min=0)), -1)
    if cand is not None:
        pre = torch.where(torch.isin(prefix, cand), pre, -1)
    want = _mixture_reference(xd @ cols, pos(targets), mtp.double().tolist(), pre, 0.3,
                              int(pos(torch.tensor(COPY_TOKEN_ID))), pcd, asd)
    grads = torch.autograd.grad(want, (xd, wd, pcd, asd))
    assert loss.item() == pytest.approx(want.item(), rel=1e-5)
    for a, b in zip(got, grads):
        torch.testing.assert_close(a.double(), b, rtol=1e-4, atol=1e-5)
    assert got[1][:, COPY_TOKEN_ID].abs().sum() > 0  # the <copy> column learns


def test_worked_example_2_through_the_fused_ce():
    """Example 2's six logits as one CE row (full width: `<copy>` sits at column 5 of a 6-column set, as under
    the sampled softmax): the NLL and ∂L/∂ℓ = ∂L/∂z·z′ from the CE's lse and gathered z, on the portable twin
    and the Triton kernel (interpreter)."""
    from perf.backend import use_backend
    from perf.kernels.cross_entropy import softcapped_loss_lse

    for triton in (False, True):
        logits = torch.tensor([[2.0, -1, 0, 4, -3, 1]], requires_grad=True)
        p_copy = torch.tensor([0.37900], requires_grad=True)
        a_sink = torch.tensor([0.13942], requires_grad=True)
        with use_backend(triton=triton):
            loss, lse, zg = softcapped_loss_lse(logits, torch.tensor([3]), (0.0,), None, None,
                                                gather_cols=torch.tensor([[3, 5]]))
            nll = loss + mixture_nll(zg[:, 0], zg[:, 1], lse, p_copy, a_sink).sum()
            dl, dpc, das = torch.autograd.grad(nll, (logits, p_copy, a_sink))
        assert nll.item() == pytest.approx(0.401213, abs=1e-5)
        sig = torch.sigmoid((logits.detach() + 5) / 7.5)
        dz = dl / ((23 / 7.5) * sig * (1 - sig))
        assert dz[0].tolist() == pytest.approx([0.196331, 0.026246, 0.052927, -0.311091, 0.006025, 0.029563], abs=1e-5)
        assert (dpc.item(), das.item()) == pytest.approx((-0.152312, -0.105331), abs=1e-5)


def test_copy_is_always_a_candidate_and_its_column_is_found_on_the_device():
    gen = torch.Generator().manual_seed(1)
    sampler = CandidateSampler(V_FULL, always=(COPY_TOKEN_ID,))
    targets = torch.randint(0, 50257, (300,), generator=gen)
    for _ in range(3):
        cand = sampler.candidates(targets, 512)
        assert cand.numel() == 512 and COPY_TOKEN_ID in cand.tolist() and bool((cand[1:] > cand[:-1]).all())
        assert copy_column_index(cand, targets).tolist() == [cand.tolist().index(COPY_TOKEN_ID)] * 300
    assert copy_column_index(None, targets[:4]).tolist() == [COPY_TOKEN_ID] * 4
    with pytest.raises(ValueError, match="512 candidates cannot hold 512 distinct targets and the always-included "
                                         r"classes \[50257\]"):
        sampler.candidates(torch.arange(512), 512)


# ---- the model with features.cplm ------------------------------------------------------------------------

def _smoke_model(cplm: bool):
    from config import MODEL_PRESETS, FeatureConfig
    from model.gpt import GPT

    torch.manual_seed(0)
    return GPT(MODEL_PRESETS["smoke"], dtype=torch.float32, fp8=False, features=FeatureConfig(cplm=cplm))


def test_the_pointer_parameters_come_last_and_leave_the_backbone_seeded_as_the_record():
    base, cplm = _smoke_model(False), _smoke_model(True)
    names = [n for n, _ in cplm.named_parameters()]
    copy_names = ["copy_qk_bank", "copy_k_sink", "copy_qk_gain"]
    assert [n for n in names if n.startswith("copy_")] == copy_names  # after the record's own (then its submodules')
    assert [n for n in names if n not in copy_names] == [n for n, _ in base.named_parameters()]
    params = dict(cplm.named_parameters())
    for n, a in base.named_parameters():
        assert torch.equal(a, params[n]), n  # drawn before the pointer's: bitwise the same init
    D = cplm.cfg.model_dim
    bank, k_sink, gain = cplm.copy_qk_bank, cplm.copy_k_sink, cplm.copy_qk_gain
    assert bank.shape == (2, 128, D) and k_sink.shape == (128,) and gain.tolist() == [1.0]
    assert k_sink.dtype == gain.dtype == torch.float32
    assert bank.abs().max().item() <= math.sqrt(3) * D ** -0.5
    assert bank.abs().max().item() > 0.9 * math.sqrt(3) * D ** -0.5  # uniform over the whole range
    assert k_sink.std().item() == pytest.approx(128 ** -0.5, rel=0.25)
    assert sum(p.numel() for n, p in cplm.named_parameters() if n.startswith("copy_")) == 2 * 128 * D + 129
    assert _smoke_model(False).cplm_diag is None and cplm.cplm_diag.tolist() == [0.0] * 6


def test_the_validation_mixture_and_its_diagnostics():
    """GPT's validation forward with features.cplm: the mean mixture NLL over rows, equal to the definition
    applied to the model's own final rows; the diagnostics' count and sums are the same rows'."""
    from model.gpt import StepArgs
    from model.loss import validation_logits

    model = _smoke_model(True)
    cfg = model.cfg
    gen = torch.Generator().manual_seed(2)
    T = 64
    inputs = torch.randint(0, 50257, (T,), generator=gen).int()
    inputs[40:48] = inputs[10:18]
    targets = torch.cat([inputs[1:].long(), torch.tensor([5])])
    cu = torch.tensor([0, 30, T, T], dtype=torch.int32)
    rows = torch.randn(2 * T, cfg.model_dim, generator=gen)
    sign = torch.randint(0, cfg.ngram_sign_rows, (2 * T,), generator=gen).int()
    captured = {}
    import model.gpt as gpt_module
    real = gpt_module.validation_loss

    def spy(x, w, *args):
        captured["x"] = x
        return real(x, w, *args)

    gpt_module.validation_loss = spy
    try:
        with torch.no_grad():
            got = model(inputs, targets, cu, rows, sign, StepArgs(training=False))
    finally:
        gpt_module.validation_loss = real
    h = captured["x"]
    with torch.no_grad():
        p_copy, a_sink = copy_head(h, model.copy_qk_bank, model.copy_k_sink, model.copy_qk_gain, inputs, targets, cu,
                                   COPY_BAND_VAL)
        z = validation_logits(h, model.lm_head.weight).double()
        lse = torch.logsumexp(z, -1)
        nll = validation_mixture_nll(z[torch.arange(T), targets], z[:, COPY_TOKEN_ID], lse, p_copy.double(),
                                     a_sink.double())
    assert got.item() == pytest.approx(nll.mean().item(), rel=1e-5)
    diag = model.cplm_diag
    assert diag[0].item() == T and diag[1].item() == pytest.approx(nll.sum().item(), rel=1e-5)
    assert diag[4].item() == pytest.approx(a_sink.sum().item(), rel=1e-5)
    line = diagnostics_line(diag)
    assert line.startswith(f"cplm: nll {nll.mean().item():.4f}, lm_nll ") and line.endswith(f"({T} tokens)")


def test_the_canonical_mask_never_drops_copy():
    """validation_loss with the pointer and a canonical mask whose byte over columns 50256..50263 is all set:
    every one of those columns is masked (−60) but `<copy>` (50257), as frontier_cplm.md §7 has it."""
    from model.canonical_mask import MASK_FILL
    from model.loss import validation_logits, validation_loss

    gen = torch.Generator().manual_seed(4)
    T, D = 6, 8
    x, w = torch.randn(T, D, generator=gen), 0.5 * torch.randn(D, V_FULL, generator=gen)
    inputs, targets = torch.randint(0, 50000, (T,), generator=gen), torch.randint(0, 50000, (T,), generator=gen)
    p_copy, a_sink = torch.rand(T, generator=gen) * 0.5, torch.rand(T, generator=gen) * 0.5
    mask = torch.zeros(V_FULL, V_FULL // 8, dtype=torch.uint8)
    mask[:, COPY_TOKEN_ID // 8] = 0xFF
    got = validation_loss(x, w, targets, inputs, mask, (p_copy, a_sink))
    z = validation_logits(x, w).double()
    z[:, [50256, *range(50258, 50264)]] = MASK_FILL
    lse = torch.logsumexp(z, -1)
    want = validation_mixture_nll(z[torch.arange(T), targets], z[:, COPY_TOKEN_ID], lse, p_copy.double(), a_sink.double())
    assert got.item() == pytest.approx(want.mean().item(), rel=1e-6)
