"""model/embeddings.py and model/mudd.py against loops."""
import dataclasses

import pytest
import torch

from config import MODEL_PRESETS
from model.embeddings import NgramTable, ngram_shard_range, smear, value_embeddings
from model.mudd import MUDD_GROUPS, mudd_block_bias, mudd_gate_bias, post_loop_mix


def test_value_embedding_gradient_sums_repeats_in_fp32():
    """A batch repeats common tokens: each row's gradient is the fp32 sum of its repeats rounded
    once to bf16 (perf/kernels/value_embed.py, record #360), not a bf16 running sum."""
    gen = torch.Generator().manual_seed(3)
    T, D, V = 3000, 8, 5
    table = (0.01 * torch.randn(4 * V, D, generator=gen)).bfloat16().requires_grad_()
    ids = torch.randint(0, V, (T,), generator=gen, dtype=torch.int32)
    grads = torch.randn(4, T, D, generator=gen).bfloat16()
    torch.autograd.backward(value_embeddings(table, ids, V), list(grads.unbind(0)))
    want = torch.zeros(4 * V, D, dtype=torch.float64)
    for p in range(4):
        want.index_add_(0, p * V + ids.long(), grads[p].double())
    assert torch.equal(table.grad, want.bfloat16())  # one rounding of the sum (a bf16 running sum misses)


def test_ngram_table_shards():
    record = MODEL_PRESETS["record"]
    table = NgramTable(dataclasses.replace(record, ngram_rows=1024), rank=0, world_size=8)
    assert table.owned_range(7, 8) == (896, 1024) and table.rows.shape == (128, 768)
    # record sizes without allocating: ownership is arithmetic
    assert ngram_shard_range(record.ngram_rows, 1, 8) == (10_575_360, 21_150_720)
    assert ngram_shard_range(record.ngram_rows, 3, 8)[1] == record.ngram_rows // 2  # ranks 0–3: bigram half
    with pytest.raises(ValueError, match="evenly"):
        ngram_shard_range(record.ngram_rows, 0, 7)
    cfg = dataclasses.replace(MODEL_PRESETS["smoke"], ngram_rows=64)
    shards = [NgramTable(cfg, r, 4) for r in range(4)]
    assert [(s.lo, s.hi) for s in shards] == [(0, 16), (16, 32), (32, 48), (48, 64)]
    shards[2].rows[3] = 7.0
    assert torch.equal(shards[2].lookup(torch.tensor([35, 32])), torch.stack([shards[2].rows[3], shards[2].rows[0]]))
    with pytest.raises(IndexError, match="owns rows"):
        shards[2].lookup(torch.tensor([31]))


def test_smear_and_value_embeddings_by_loop():
    gen = torch.Generator().manual_seed(1)
    T, D, V = 5, 16, 10
    x = torch.randn(T, D, generator=gen)
    w = torch.randn(1, 12, generator=gen)
    lam = torch.tensor(0.7)
    out = smear(x, w, lam)
    assert torch.equal(out[0], x[0])
    for t in range(1, T):
        gate = torch.sigmoid(x[t, :12] @ w[0])
        torch.testing.assert_close(out[t], x[t] + 0.7 * gate * x[t - 1])
    table = torch.randn(4 * V, D, generator=gen)
    ids = torch.tensor([3, 0, 9], dtype=torch.int32)
    planes = value_embeddings(table, ids, V)
    for p in range(4):
        assert torch.equal(planes[p], table[p * V + ids.long()])


def test_post_loop_mix_by_loop():
    gen = torch.Generator().manual_seed(2)
    T, D, n = 3, 24, 4
    x = torch.randn(T, D, generator=gen)
    sources = [torch.randn(T, D, generator=gen) for _ in range(n)]
    mu, delta = torch.randn(T, n, generator=gen), torch.randn(T, n, MUDD_GROUPS, generator=gen)
    out = post_loop_mix(x, sources, mu, delta)
    width = D // MUDD_GROUPS
    for t in range(T):
        for c in range(D):
            want = x[t, c] + sum((mu[t, k] + delta[t, k, c // width]) * sources[k][t, c] for k in range(n))
            assert out[t, c].item() == pytest.approx(want.item(), rel=1e-5, abs=1e-5)


def test_bias_inits_are_the_record_values():
    b = mudd_block_bias(14) * 0.1
    assert b[0].tolist() == pytest.approx([0, 0, 0, 0, 0, 0, 2.0, 2.0, 1.1 ** 0.5, 1.0, 0, 0.05, 1.1 ** 0.5, 1.0])
    assert b[1].tolist() == pytest.approx([0, -0.5] + [0] * 12)
    g = mudd_gate_bias() * 0.1
    assert g[0].tolist() == pytest.approx([0] * 12 + [0.25] * 6 + [0, 0, 0, 0.05, 0.05])
    assert g[1, :13].tolist() == pytest.approx([0.25] * 6 + [0, 0, 0, 0.05, 0.05, 0.05, 0.5])
    assert torch.equal(mudd_block_bias(14).bfloat16()[0, 8], torch.tensor(10.5).bfloat16())  # bf16 storage
