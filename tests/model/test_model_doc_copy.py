"""DocCopy's matcher (PR #378, model/doc_copy.py) against a brute-force reference that scans every
earlier position of the document for every length; the spec's worked examples (frontier_doc_copy.md
§2.8) and hash constants; causality (nothing after t changes t's answer); the copy vector's bucket-0
mask; and the compiled matcher equal to the eager one."""
import numpy as np
import pytest
import torch

from model.doc_copy import (BOS_ID, COPY_BUCKETS, COPY_LENGTHS, DOC_MUL, LEN_MUL, copy_vector, doc_copy_features,
                            hash_powers, window_keys)

POWERS = hash_powers(4096)


def brute_force(x: list[int], n: list[int]) -> tuple[list[int], list[int]]:
    """The definition, position by position: the longest L whose window of classes n[t-L+1..t] (inside
    t's document) occurred ending at an earlier j of the same document; candidate x[j*+1] for the
    latest such j, bucket 1 + 3·k(L) + min(count, 3) - 1."""
    T, cand, bucket = len(x), [], []
    for t in range(T):
        start = max([p for p in range(t + 1) if x[p] == BOS_ID], default=0)  # t's document starts here
        best = None
        for k, L in enumerate(COPY_LENGTHS):
            if t - L + 1 < start:
                break
            window = n[t - L + 1:t + 1]
            earlier = [j for j in range(start + L - 1, t) if n[j - L + 1:j + 1] == window]
            if earlier:
                best = (k, max(earlier), len(earlier))
        if best is None:
            cand.append(-1)
            bucket.append(0)
        else:
            k, j, c = best
            cand.append(x[j + 1])
            bucket.append(1 + 3 * k + min(c, 3) - 1)
    return cand, bucket


def _features(x, norm_map):
    c, b = doc_copy_features(torch.tensor(x, dtype=torch.int32), norm_map, *POWERS)
    return c.tolist(), b.tolist()


def _random_stream(rng, T, vocab, bos_rate):
    """Few distinct tokens (so contexts repeat at every length), BOS at random, and a copied run of 40."""
    x = rng.integers(0, vocab, T)
    x[rng.random(T) < bos_rate] = BOS_ID
    if T > 100:
        src = int(rng.integers(0, T // 2 - 40))
        dst = int(rng.integers(T // 2, T - 40))
        x[dst:dst + 40] = x[src:src + 40]  # long matches: the L = 24, 32 buckets
    return x.tolist()


@pytest.mark.parametrize("seed", range(6))
def test_the_matcher_is_the_brute_force_definition_bit_for_bit(seed):
    rng = np.random.default_rng(seed)
    vocab = [3, 5, 8, 40, 3, 6][seed]
    norm_map = torch.arange(50304, dtype=torch.int32)
    norm_map[1::2][:vocab] = torch.arange(0, vocab, 2)[: (vocab + 1) // 2].repeat(2)[: norm_map[1::2][:vocab].numel()]
    x = _random_stream(rng, 300 + 37 * seed, vocab, [0.01, 0.02, 0.0, 0.05, 0.2, 0.01][seed])
    n = norm_map[torch.tensor(x)].tolist()
    assert _features(x, norm_map) == brute_force(x, n)


def test_every_bucket_is_reached_and_the_candidate_is_the_raw_token():
    rng = np.random.default_rng(7)
    norm_map = torch.arange(50304, dtype=torch.int32)
    norm_map[1] = 0  # tokens 0 and 1 share a class: matches through the class, candidates stay raw
    seen = set()
    for seed in range(4):
        x = _random_stream(np.random.default_rng(seed + 10), 600, 4, 0.004)
        block = rng.integers(100, 1100, 40).tolist()  # 4 copies apart: every length, 1, 2 and 3+ earlier copies
        for _ in range(4):
            x += rng.integers(0, 4, int(rng.integers(3, 9))).tolist() + block
        c, b = _features(x, norm_map)
        assert (c, b) == brute_force(x, norm_map[torch.tensor(x)].tolist())
        seen |= set(b)
    assert seen == set(range(COPY_BUCKETS))


def _example_map():
    m = torch.arange(50304, dtype=torch.int32)
    m[383] = 262  # " The" -> " the" (the real map does: tests/model/test_model_token_norm.py)
    return m


B = BOS_ID
STREAM_A = [B, 262, 3797, 3332, 13, 383, 3797, 3332, 866, 13, 262, 3797]
STREAM_B = STREAM_A[:8] + [B] + STREAM_A[9:]
STREAM_C = [B, 262, 3797, 3332, 383, 3797, 866, 13, 262, 3797, 262, 3797]


def test_the_worked_examples():
    m = _example_map()
    assert _features(STREAM_A, m) == ([-1, -1, -1, -1, -1, 3797, 3332, 13, -1, 383, 3797, 3332],
                                      [0, 0, 0, 0, 0, 1, 4, 7, 0, 1, 4, 7])
    assert _features(STREAM_B, m) == ([-1, -1, -1, -1, -1, 3797, 3332, 13, -1, -1, -1, -1],
                                      [0, 0, 0, 0, 0, 1, 4, 7, 0, 0, 0, 0])
    assert _features(STREAM_C, m) == ([-1, -1, -1, -1, 3797, 3332, -1, -1, 3797, 866, 3797, 262],
                                      [0, 0, 0, 0, 1, 4, 0, 0, 2, 5, 3, 6])
    for x in (STREAM_A, STREAM_B, STREAM_C):
        assert _features(x, m) == brute_force(x, m[torch.tensor(x)].tolist())


def test_the_worked_examples_with_the_real_map(gpt2_bpe):
    from model.token_norm import token_norm_map
    real = torch.tensor(token_norm_map(50304).ids)
    for x in (STREAM_A, STREAM_B, STREAM_C):
        assert _features(x, real) == _features(x, _example_map())


def test_the_hash_constants():
    fwd, bwd = POWERS
    assert fwd[1:4].tolist() == [-7046029254386353131, -2358710677322311239, 6938460308862072877]
    assert bwd[1].item() == -1018231460777725123
    assert (fwd * bwd == 1).all()  # M^t · M^-t = 1 mod 2^64
    keys, valid = window_keys(torch.tensor(STREAM_A), _example_map(), *POWERS)
    # H_1 at t = 1 and t = 5 (both " the"'s class, y = 263), before the document XOR (document 1)
    assert (keys[0, 1] ^ DOC_MUL).item() == (keys[0, 5] ^ DOC_MUL).item() == 2685821657736338458 == 263 ^ LEN_MUL
    assert not valid[1, 0] and valid[1, 1]  # the L = 2 window at t = 0 reaches before the stream


def test_no_position_reads_a_later_token():
    rng = np.random.default_rng(3)
    norm_map = torch.arange(50304, dtype=torch.int32)
    x = _random_stream(rng, 400, 4, 0.01)
    c, b = _features(x, norm_map)
    for t in range(0, 400, 7):
        changed = x[:t + 1] + rng.integers(0, 50257, 400 - t - 1).tolist()  # every token after t, BOS included
        c2, b2 = _features(changed, norm_map)
        assert (c2[:t + 1], b2[:t + 1]) == (c[:t + 1], b[:t + 1]), t


def test_the_copy_vector_zeroes_bucket_0_and_is_the_plain_expression():
    torch.manual_seed(0)
    copied = torch.randn(6, 8).bfloat16()
    bucket = torch.tensor([0, 3, 0, 30, 1, 3])
    scale = torch.randn(COPY_BUCKETS, requires_grad=True)
    table = torch.randn(COPY_BUCKETS, 8, requires_grad=True)
    live = (torch.arange(COPY_BUCKETS) > 0).float()
    v = copy_vector(copied, bucket, scale, table, live)
    assert v.dtype == torch.bfloat16
    for t, b in enumerate(bucket.tolist()):
        want = torch.zeros(8) if b == 0 else \
            copied[t] * scale[b].detach().bfloat16() + table[b].detach().bfloat16()
        assert torch.equal(v[t], want.bfloat16())
    v.float().sum().backward()
    assert scale.grad[0] == 0 and (table.grad[0] == 0).all()  # bucket 0 never learns
    assert scale.grad[3] != 0 and (table.grad[30] != 0).all()


def test_the_compiled_matcher_is_the_eager_one():
    compiled = torch.compile(doc_copy_features, backend="aot_eager", fullgraph=True, dynamic=False)
    x = torch.tensor(_random_stream(np.random.default_rng(5), 512, 5, 0.01), dtype=torch.int32)
    m = torch.arange(50304, dtype=torch.int32)
    try:
        got = compiled(x, m, *POWERS)
    finally:
        torch._dynamo.reset()
    want = doc_copy_features(x, m, *POWERS)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
