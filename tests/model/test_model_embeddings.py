"""model/embeddings.py and model/mudd.py against loops."""
import dataclasses

import pytest
import torch

from config import MODEL_PRESETS
from model.embeddings import NgramTable, ngram_shard_range, ngram_embedding, smear, value_embeddings
from model.mudd import MUDD_GROUPS, mudd_block_bias, mudd_gate_bias, post_loop_mix


def test_ngram_embedding_and_its_sink_gradient():
    gen = torch.Generator().manual_seed(0)
    T, D = 6, 8
    pool = torch.where(torch.randn(16, D, generator=gen) >= 0, 1.0, -1.0).bfloat16()
    rows = torch.randn(2 * T, D, generator=gen).bfloat16().requires_grad_()
    signs = torch.randint(0, 16, (2 * T,), generator=gen, dtype=torch.int32)
    out = ngram_embedding(rows, signs, pool)
    g = torch.randn(T, D, generator=gen).bfloat16()
    out.backward(g)
    r = rows.detach()
    for t in range(T):
        for d in range(D):
            bi, tri = signs[t].item(), signs[T + t].item()
            want = float(r[t, d]) * float(pool[bi, d]) + float(r[T + t, d]) * float(pool[tri, d])
            assert out[t, d].item() == torch.tensor(want).bfloat16().item()  # fp32 math, one rounding
            assert rows.grad[t, d].item() == float(g[t, d]) * float(pool[bi, d])
            assert rows.grad[T + t, d].item() == float(g[t, d]) * float(pool[tri, d])
    with pytest.raises(ValueError, match="2T"):
        ngram_embedding(rows[:5], signs[:5], pool)


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
