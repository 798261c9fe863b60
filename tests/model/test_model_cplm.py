"""CPLM's definition (PR #379, model/cplm.py) against frontier_cplm.md §11's worked examples (computed
there in float64), a per-query brute-force loop for values and gradients, and the mixture's sums."""
import math

import pytest
import torch

from model.cplm import copy_pointer, mixture_nll, validation_mixture_nll
from model.loss import softcap

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
