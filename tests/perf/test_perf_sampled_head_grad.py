"""perf/sampled_head_grad.py, PR #371's sampled lm_head weight gradient: the kept rows against the
hash written out by hand, their uniformity, the counter's in-place advance and reset, the exact
negative part bit for bit against the dense x8ᵀ·min(G, 0) of a real CE backward, duplicates against a
brute-force loop, unbiasedness (error ∝ 1/√n), the hook in fp8_lm_head_loss (dx bit for bit, dW
within its predicted sampling noise) and torch.compile(fullgraph=True)."""
import pytest
import torch

from perf.backend import use_backend
from perf.fp8 import (E4M3, LM_HEAD_GRAD_SCALE, LM_HEAD_W_SCALE, LM_HEAD_X_SCALE, fp8_lm_head_loss,
                      lm_head_logits_e4m3, quantize)
from perf.kernels.cross_entropy import loss_weights, softcapped_ce_e4m3, softcapped_ce_grad_e5m2
from perf.sampled_head_grad import (HeadSample, head_grad_negative_part, head_grad_positive_part, head_sample_rows,
                                    sampled_lm_head_weight_grad)

X_S = torch.tensor(LM_HEAD_X_SCALE, dtype=torch.float32)
G_S = torch.tensor(LM_HEAD_GRAD_SCALE, dtype=torch.float32)
MTP = (1.0, 0.5, 0.25)


def _hash_offset(j: int, c: int, group: int) -> int:
    """PR #371's hash in plain Python integers, each step reduced mod 2³² (frontier_approx_backward.md §3.3)."""
    m = 0xFFFFFFFF
    a = ((c + 72821) * 0x9E3779B9) & m
    z = (j ^ a) & m
    z = ((z ^ (z >> 16)) * 0x85EBCA6B) & m
    z = ((z ^ (z >> 13)) * 0xC2B2AE35) & m
    z = (z ^ (z >> 16)) & m
    return z % group


@pytest.mark.parametrize("group", [4, 2, 8])
def test_kept_rows_are_the_hash_written_out_by_hand(group):
    """s_j = group·j + (h(j, c) mod group) for counters small and past 2³² (the key wraps), on the device
    in int64 with no uint32 and no overflow (0xC2B2AE35·(2³² − 1) > 2⁶³: the products go in halves)."""
    n_groups = 64
    for c in (0, 1, 7, 8, 12345, 2**31 - 1, 2**32 - 72821, 2**32 + 3, 3 * 2**40 + 11):
        got = head_sample_rows(torch.tensor(c, dtype=torch.int64), n_groups * group, group)
        assert got.dtype == torch.int64 and got.shape == (n_groups,)
        assert got.tolist() == [group * j + _hash_offset(j, c, group) for j in range(n_groups)]


def test_kept_rows_pinned_values():
    """Offsets pinned as literals (from the plain-integer formula above, once), so the formula and the
    implementation cannot drift together."""
    for c, offsets in ((0, [1, 3, 1, 0, 2, 1, 3, 2]), (12345, [3, 3, 0, 0, 2, 2, 1, 0])):
        assert [_hash_offset(j, c, 4) for j in range(8)] == offsets
        rows = head_sample_rows(torch.tensor(c, dtype=torch.int64), 32)
        assert rows.tolist() == [4 * j + o for j, o in enumerate(offsets)]


def test_offsets_are_uniform_and_change_with_the_counter():
    """4096 counters × 1024 groups: each offset within 1 % of 25 %, and a group's offset under two
    consecutive counters equal a quarter of the time (the counter reshuffles every group)."""
    counts = torch.zeros(4, dtype=torch.int64)
    same, previous = 0, None
    for c in range(4096):
        off = head_sample_rows(torch.tensor(c, dtype=torch.int64), 4096) % 4  # (1024,)
        counts += torch.bincount(off, minlength=4)
        if previous is not None:
            same += int((off == previous).sum())
        previous = off
    freq = counts.double() / counts.sum()
    assert ((freq - 0.25).abs() < 0.0025).all(), freq
    assert abs(same / (4095 * 1024) - 0.25) < 0.0025


def test_counter_advances_by_the_stride_and_resets_in_place():
    sample = HeadSample(rank=3, world_size=8)
    storage = sample.counter.data_ptr()
    assert sample.counter.dtype == torch.int64 and sample.counter.dim() == 0 and int(sample.counter) == 3
    sample.advance()
    sample.advance()
    assert int(sample.counter) == 19
    sample.reset()
    assert int(sample.counter) == 3
    sample.reset(5)
    assert int(sample.counter) == 5 and sample.counter.data_ptr() == storage
    # each sampled dW advances it by the stride, after using the counter it found
    g8, x8, targets, prefix, gather = _ce_case(16, 8, 12, seed=1)
    for k in range(3):
        want_rows = head_sample_rows(torch.tensor(5 + 8 * k), 16)
        want = head_grad_positive_part(g8, x8, G_S, X_S, want_rows, 4) + \
            head_grad_negative_part(g8, x8, G_S, X_S, targets, 3, prefix, gather)
        got = sampled_lm_head_weight_grad(g8, x8, G_S, X_S, targets, 3, prefix, gather, sample, torch.float32)
        assert torch.equal(got, want.t())
        assert int(sample.counter) == 5 + 8 * (k + 1) and sample.counter.data_ptr() == storage


def test_input_errors():
    with pytest.raises(ValueError, match="30 rows are not a multiple of the group 4"):
        head_sample_rows(torch.tensor(0), 30)
    with pytest.raises(ValueError, match="rank 8 must be in"):
        HeadSample(8, 8)
    x, w = torch.randn(12, 8).bfloat16(), torch.randn(8, 20).bfloat16()
    targets = torch.zeros(12, dtype=torch.long)
    with pytest.raises(ValueError, match="needs the sampled softmax's candidate columns"):
        fp8_lm_head_loss(x, w, targets, (1.0,), None, None, None, head_sample=HeadSample(0, 1))
    with pytest.raises(ValueError, match="one row of every 8, but x has 12 rows"):
        fp8_lm_head_loss(x, w, targets, (1.0,), None, None, torch.arange(10), head_sample=HeadSample(0, 1, group=8))


def _ce_case(T, D, N, seed, M=2, spread=True):
    """(g8, x8, targets, prefix, gather) from the real CE backward (`softcapped_ce_grad_e5m2`, portable):
    e4m3 rows and lm_head columns, e4m3 logits, MTP weights (1, 0.5, 0.25), a prefix term (−1 on
    some rows), M gathered columns (CPLM's <copy> = N − 1 on every row, and the row's target) with a
    grad_zg of either sign, a grad_lse ≥ 0. With spread=False the row magnitudes lie in [1, 4]: the
    e4m3 codes' exponents then span 3 octaves, so every column's sum of code products is exact in fp32."""
    gen = torch.Generator().manual_seed(seed)
    if spread:
        x = 2 * torch.randn(T, D, generator=gen)
    else:
        sign = torch.where(torch.rand(T, D, generator=gen) < 0.5, -1.0, 1.0)
        x = sign * (1 + 3 * torch.rand(T, D, generator=gen))
    x8 = quantize(x, X_S, E4M3)  # (T, D)
    w8 = quantize(0.6 * torch.randn(D, N, generator=gen), LM_HEAD_W_SCALE, E4M3)  # (D, N)
    logits8 = lm_head_logits_e4m3(x8, w8, X_S, torch.tensor(LM_HEAD_W_SCALE))
    targets = torch.randint(0, N, (T,), generator=gen)
    targets[T // 3] = -100  # skipped
    prefix = torch.randint(-1, N, (T,), generator=gen)
    gather = torch.stack([torch.full((T,), N - 1), targets.clamp(min=0)], dim=1)[:, :M].contiguous()  # (T, M)
    weights = loss_weights(MTP, 0.3, "cpu")
    grad_lse = torch.rand(T, generator=gen)  # ≥ 0, as an lse that enters a loss as a log-partition
    grad_zg = torch.randn(T, M, generator=gen)  # either sign
    with use_backend(triton=False):
        _, lse, _ = softcapped_ce_e4m3(logits8, targets, prefix, weights, 3, gather)
        g8 = softcapped_ce_grad_e5m2(logits8, lse, targets, prefix, weights, 3, torch.tensor(1.0), G_S, grad_lse,
                                     gather, grad_zg)
    return g8, x8, targets, prefix, gather


def _target_mask(T, N, targets, prefix, gather, num_mtp=3):
    """[T, N] bool: column c is in N(r) (an MTP target, the prefix target or a gathered column)."""
    mask = torch.zeros(T, N, dtype=torch.bool)
    for r in range(T):
        for c in [*(int(targets[r + q]) for q in range(num_mtp) if r + q < T), int(prefix[r]),
                  *(gather[r].tolist() if gather is not None else [])]:
            if 0 <= c < N:
                mask[r, c] = True
    return mask


def test_negative_part_is_the_dense_negative_gradient_bit_for_bit():
    """Why only the target columns: the CE's logit gradient is (S·softmax_c − Σ w·[c is a target] +
    Σ g_zg·[c gathered] + g_lse·softmax_c)·(23/7.5)·σ(1 − σ) with g = 1, so with g_lse ≥ 0 every entry
    outside the MTP targets, the prefix target and the gathered columns is ≥ 0 (checked here on the
    real CE backward). The op's negative part is then the dense x_s·g_s·x8ᵀ·min(G, 0) in fp32: each code
    product is exact (e4m3 × e5m2: ≤ 7 significant bits) and, with the rows' exponents in 3 octaves,
    so is every column's sum, in any order (checked: the fp32 dense product equals the float64 one),
    so the two agree bit for bit: each negative counted once, nothing else added, one scale."""
    T, D, N = 64, 24, 40
    g8, x8, targets, prefix, gather = _ce_case(T, D, N, seed=2, spread=False)
    G = g8.float()  # (T, N) codes
    neg = G.clamp(max=0)
    inside = _target_mask(T, N, targets, prefix, gather)
    assert (neg[~inside] == 0).all() and (neg < 0).sum() > T  # negatives only at target columns, and many
    assert (G[inside] > 0).any()  # a gathered column with a positive gradient exists (sampled, not here)
    dense = x8.float().t() @ neg  # (D, N) code sums
    assert torch.equal(dense.double(), x8.double().t() @ neg.double())  # every sum exact in fp32
    want = dense * (G_S * X_S)
    got = head_grad_negative_part(g8, x8, G_S, X_S, targets, 3, prefix, gather)  # (N, D)
    assert got.dtype == torch.float32 and torch.equal(got.t(), want)
    assert (got.t()[:, (neg < 0).any(0)] != 0).any()


def test_duplicates_are_counted_once_against_a_brute_force_loop():
    """A prefix target equal to an MTP target (q = 1), a gathered column equal to the row's target and
    the <copy> column N − 1 also a target: each column of a row counted once, against a loop over
    rows and columns in float64 (every G negative, so a double count would show)."""
    T, D, N = 24, 8, 10
    gen = torch.Generator().manual_seed(4)
    x8 = quantize(torch.randn(T, D, generator=gen), X_S, E4M3)
    g8 = (-torch.rand(T, N, generator=gen) * 3000 - 100).to(torch.float8_e5m2)  # every entry negative
    targets = torch.randint(0, N, (T,), generator=gen)
    targets[::5] = N - 1  # the <copy> column is some rows' target too
    targets[7] = -100
    prefix = torch.randint(-1, N, (T,), generator=gen)
    prefix[::2] = torch.cat([targets[1:], targets.new_tensor([-1])])[::2]  # = the q = 1 MTP target
    gather = torch.stack([torch.full((T,), N - 1), targets, torch.full((T,), N + 4)], dim=1)  # copy, target, out
    want = torch.zeros(N, D, dtype=torch.float64)
    G, X = g8.double(), x8.double()
    for r in range(T):
        for c in range(N):
            mtp = any(r + q < T and int(targets[r + q]) == c for q in range(3))
            if mtp or int(prefix[r]) == c or c in gather[r].tolist():
                if G[r, c] < 0:
                    want[c] += G[r, c] * X[r]
    got = head_grad_negative_part(g8, x8, G_S, X_S, targets, 3, prefix, gather)
    torch.testing.assert_close(got.double(), want * (G_S.double() * X_S.double()), rtol=1e-6, atol=0)
    assert (prefix[::2] == torch.cat([targets[1:], targets.new_tensor([-1])])[::2]).all()


def _exact_dw(g8, x8):
    """x_s·g_s·x8ᵀ·g8 [D, N] in float64: the exact gradient the estimate is unbiased for."""
    return (x8.double().t() @ g8.double()) * (G_S.double() * X_S.double())


def _predicted_sq_error(g8, x8, group=4):
    """E‖estimate − exact‖² of one estimate: Σ_j Var of group·max(G[s], 0) ⊗ X[s] over s uniform in
    group j (the negative part is exact, the groups independent), in float64."""
    T, N = g8.shape
    pos = g8.double().clamp(min=0).reshape(T // group, group, N)  # (T/g, g, N)
    X = x8.double().reshape(T // group, group, -1)  # (T/g, g, D)
    outer = group * torch.einsum("jin,jid->jind", pos, X) * (G_S.double() * X_S.double())  # (T/g, g, N, D)
    return outer.var(dim=1, unbiased=False).sum().item()


def test_estimate_is_unbiased_error_falls_as_one_over_sqrt_n():
    """The mean of n estimates (counters 0..n−1) against the exact fp32 x_s·g_s·x8ᵀ·g8: relative error
    at n = 16 about 4× the one at n = 256, and each near its prediction √(E‖err‖²/n)."""
    T, D, N = 256, 16, 48
    g8, x8, targets, prefix, gather = _ce_case(T, D, N, seed=5)
    exact = _exact_dw(g8, x8)
    sample = HeadSample(0, 1)
    total = torch.zeros(D, N, dtype=torch.float64)
    errors = {}
    for n in range(1, 257):
        total += sampled_lm_head_weight_grad(g8, x8, G_S, X_S, targets, 3, prefix, gather, sample,
                                             torch.float32).double()
        if n in (16, 256):
            errors[n] = ((total / n - exact).norm() / exact.norm()).item()
    assert int(sample.counter) == 256
    assert 2.5 < errors[16] / errors[256] < 6, errors
    predicted = _predicted_sq_error(g8, x8) ** 0.5 / exact.norm().item()
    for n, err in errors.items():
        assert 0.5 < err / (predicted / n ** 0.5) < 2, (n, err, predicted)


@pytest.mark.parametrize("gathered", [False, True], ids=["plain", "gather"])
def test_fp8_lm_head_loss_dx_bitwise_dw_within_its_sampling_noise(gathered):
    """Through fp8_lm_head_loss on the sampled softmax: loss, lse and dx bit for bit those of the exact
    path; dW zero outside the candidates, and its squared distance to the exact dW within a wide band
    around its predicted E‖err‖² (from the g8 and x8 the backward used), which a dW that ignored the
    sampling (error 0) or counted a group four times over would leave."""
    gen = torch.Generator().manual_seed(6)
    T, D, V = 128, 32, 96
    x = (2 * torch.randn(T, D, generator=gen)).bfloat16()
    w = (0.5 * torch.randn(D, V, generator=gen)).bfloat16()
    cols = torch.randperm(V, generator=gen)[:40].sort().values
    N = cols.numel()
    targets = torch.randint(0, N, (T,), generator=gen)
    prefix = torch.randint(-1, N, (T,), generator=gen)
    gather = torch.stack([torch.full((T,), N - 1), targets], dim=1) if gathered else None

    class Recording(HeadSample):
        def weight_grad(self, g8, x8, *args):
            self.seen = (g8, x8)
            return super().weight_grad(g8, x8, *args)

    def step(head_sample):
        xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
        outs = fp8_lm_head_loss(xg, wg, targets, MTP, prefix, 0.3, cols, gather, head_sample=head_sample)
        loss = outs[0] + outs[1].sum() * 0.1 + (outs[2].sum() * 0.5 if gathered else 0)
        loss.backward()
        return [o.detach() for o in outs], xg.grad, wg.grad

    sample = Recording(2, 4)
    with use_backend(triton=False):
        exact_outs, exact_dx, exact_dw = step(None)
        outs, dx, dw = step(sample)
    assert all(torch.equal(a, b) for a, b in zip(outs, exact_outs))
    assert torch.equal(dx, exact_dx)
    assert int(sample.counter) == 6
    outside = torch.ones(V, dtype=torch.bool)
    outside[cols] = False
    assert (dw[:, outside] == 0).all()
    g8, x8 = sample.seen
    sq_err = (dw[:, cols].double() - exact_dw[:, cols].double()).pow(2).sum().item()
    predicted = _predicted_sq_error(g8, x8)
    assert 0.5 < sq_err / predicted < 2, (sq_err, predicted)  # 0.79..1.16 over 64 counters


def test_compiles_fullgraph_and_advances_the_counter():
    """torch.compile(fullgraph=True, aot_eager) of forward + backward through fp8_lm_head_loss with a
    HeadSample: traces without a graph break, every call advances the counter by the stride (the
    mutation lives in the backward graph, not in the trace), and dx, dW equal eager's for the same
    counter."""
    gen = torch.Generator().manual_seed(7)
    T, D, V = 32, 16, 40
    x = (2 * torch.randn(T, D, generator=gen)).bfloat16()
    w = (0.5 * torch.randn(D, V, generator=gen)).bfloat16()
    cols = torch.arange(0, V, 2)
    targets = torch.randint(0, cols.numel(), (T,), generator=gen)
    prefix = torch.randint(-1, cols.numel(), (T,), generator=gen)
    sample = HeadSample(1, 8)

    def loss_of(x, w):
        loss, lse = fp8_lm_head_loss(x, w, targets, MTP, prefix, 0.3, cols, head_sample=sample)
        return loss + 0.1 * lse.sum()

    def step(fn):
        xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
        fn(xg, wg).backward()
        return xg.grad, wg.grad

    compiled = torch.compile(loss_of, backend="aot_eager", fullgraph=True, dynamic=False)
    try:
        with use_backend(triton=False):
            got = [step(compiled) for _ in range(3)]
            assert int(sample.counter) == 1 + 3 * 8
            sample.reset()
            want = [step(loss_of) for _ in range(3)]
            assert int(sample.counter) == 1 + 3 * 8
    finally:
        torch._dynamo.reset()
    for (gx, gw), (wx, ww) in zip(got, want):
        assert torch.equal(gx, wx) and torch.equal(gw, ww)
    assert not torch.equal(got[0][1], got[1][1])  # a new counter, new rows
