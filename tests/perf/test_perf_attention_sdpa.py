"""perf/attention_backends.py: the dense varlen mask and paired heads against a brute-force loop."""
import math

import pytest
import torch

from perf.attention_backends import sdpa_varlen_attention, varlen_attention_mask


def _random_cu_seqlens(gen, T, pad):
    cuts = torch.randperm(T - 1, generator=gen)[: int(torch.randint(1, 6, (1,), generator=gen))] + 1
    cu = [0] + sorted(cuts.tolist()) + [T] + [T] * pad
    return torch.tensor(cu, dtype=torch.int32)


def _doc_of(t, cu):
    for d in range(len(cu) - 1):
        if cu[d] <= t < cu[d + 1]:
            return d
    raise AssertionError(t)


def _brute_force(q, k, v, cu, window, scale, paired):
    """Per (token, head) query: collect the visible (token, head) keys by the rules, softmax, sum."""
    T, H, _ = q.shape
    cu = cu.tolist()
    out = torch.zeros(T, H, v.shape[-1], dtype=torch.float64)
    for t in range(T):
        for h in range(H):
            # stream position and stream head of a logical (token, head)
            pos = (lambda tt, hh: 2 * tt + hh // (H // 2)) if paired else (lambda tt, hh: tt)
            stream = (lambda hh: hh % (H // 2)) if paired else (lambda hh: hh)
            keys = [(tk, hk) for tk in range(T) for hk in range(H)
                    if stream(hk) == stream(h) and _doc_of(tk, cu) == _doc_of(t, cu)
                    and 0 <= pos(t, h) - pos(tk, hk) <= window]
            logits = torch.tensor([scale * float(q[t, h].double() @ k[tk, hk].double()) for tk, hk in keys])
            w = torch.softmax(logits, 0)
            for wi, (tk, hk) in zip(w, keys):
                out[t, h] += wi * v[tk, hk].double()
    return out


@pytest.mark.parametrize("paired", [False, True])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_attention_matches_brute_force(paired, seed):
    gen = torch.Generator().manual_seed(seed)
    T, H, dqk, dv = 24, 6, 8, 16  # different q/k and v widths, as on the narrow layers
    window = [3, 7, 40][seed]
    cu = _random_cu_seqlens(gen, T, pad=seed)
    q, k, v = (torch.randn(T, H, d, generator=gen) for d in (dqk, dqk, dv))
    want = _brute_force(q, k, v, cu, window, 0.3, paired)
    for chunk in (2048, 5):  # one block, and query chunks that cut through documents and windows
        got = sdpa_varlen_attention(q, k, v, cu, window, 0.3, paired=paired, chunk=chunk)
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


def test_mask_by_loop():
    gen = torch.Generator().manual_seed(5)
    T, window = 40, 5
    cu = _random_cu_seqlens(gen, T, pad=2)
    mask = varlen_attention_mask(cu, T, window)
    for i in range(T):
        for j in range(T):
            want = _doc_of(i, cu.tolist()) == _doc_of(j, cu.tolist()) and 0 <= i - j <= window
            assert bool(mask[i, j]) == want


def test_bad_cu_seqlens_are_rejected():
    q = torch.randn(8, 2, 4)
    with pytest.raises(ValueError, match="cu_seqlens"):
        sdpa_varlen_attention(q, q, q, torch.tensor([0, 4, 6], dtype=torch.int32), 8, 1.0)
    with pytest.raises(ValueError, match="cu_seqlens"):
        sdpa_varlen_attention(q, q, q, torch.tensor([0, 6, 4, 8], dtype=torch.int32), 8, 1.0)


def _dense_reference(q, k, v, cu, window, scale):
    """Unpaired attention in float64 as three plain expressions: scores, masked softmax, weighted values."""
    mask = varlen_attention_mask(cu, q.shape[0], window)  # (T, T)
    scores = torch.einsum("thd,shd->hts", q.double(), k.double()) * scale
    weights = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
    return torch.einsum("hts,shd->thd", weights, v.double())


@pytest.mark.parametrize("dqk, dv", [(8, 16), (16, 8)])
def test_mixed_widths_take_the_fused_cpu_kernel_with_the_dense_gradients(dqk, dv):
    """On the CPU, a layer whose q/k and v widths differ runs SDPA's fused kernel on zero-padded fp32 heads
    (the math path, or the bf16 kernel, was about 3x slower at the smoke shapes), and its output and its q, k, v
    gradients are the dense formula's; bf16 heads give the fp32 computation rounded once to bf16."""
    gen = torch.Generator().manual_seed(7)
    T, H, window = 40, 4, 9
    cu = _random_cu_seqlens(gen, T, pad=1)
    q, k, v = (torch.randn(T, H, d, generator=gen, requires_grad=True) for d in (dqk, dqk, dv))
    probe = torch.randn(T, H, dv, generator=gen)
    with torch.profiler.profile() as prof:
        got = sdpa_varlen_attention(q, k, v, cu, window, 0.3, chunk=16)
        (got * probe).sum().backward()
    names = {event.key for event in prof.key_averages()}
    assert "aten::_scaled_dot_product_flash_attention_for_cpu" in names, sorted(names)
    assert "aten::_scaled_dot_product_attention_math" not in names
    grads = [t.grad.double() for t in (q, k, v)]  # float32 leaves: the reference accumulates in float64 below
    for t in (q, k, v):
        t.grad = None
    want = _dense_reference(q, k, v, cu, window, 0.3)
    (want * probe.double()).sum().backward()
    assert got.shape == (T, H, dv)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    for g, t in zip(grads, (q, k, v)):
        torch.testing.assert_close(g, t.grad.double(), rtol=1e-4, atol=1e-5)
    q16, k16, v16 = (t.detach().bfloat16() for t in (q, k, v))
    got16 = sdpa_varlen_attention(q16, k16, v16, cu, window, 0.3, chunk=16)
    assert got16.dtype == torch.bfloat16
    assert torch.equal(got16, sdpa_varlen_attention(q16.float(), k16.float(), v16.float(), cu, window, 0.3,
                                                    chunk=16).bfloat16())
