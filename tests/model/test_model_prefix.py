"""model/prefix.py: the prefix table against a brute-force search of the GPT-2 vocabulary."""
import torch

from model.prefix import build_prefix_table, gpt2_token_bytes


def _brute_force(token, by_id, vocab):
    b = by_id[token]
    for length in range(len(b) - 1, 0, -1):
        if b[:length] in vocab:
            return vocab[b[:length]]
    return -1


def test_prefix_table_matches_brute_force_on_gpt2():
    vocab = gpt2_token_bytes()
    by_id = {i: b for b, i in vocab.items()}
    table = build_prefix_table(50304, vocab)
    ids = torch.randperm(50256, generator=torch.Generator().manual_seed(0))[:3000].tolist() + [0, 255, 256, 50255]
    for token in ids:
        assert int(table[token]) == _brute_force(token, by_id, vocab), (token, by_id[token])
    assert (table[:256] == -1).all() and (table[50256:] == -1).all()
    assert int((table >= 0).sum()) == 50256 - 256


def test_prefix_table_on_a_handmade_vocabulary():
    vocab = {b"a": 0, b"b": 1, b"ab": 2, b"abc": 3, b"abd": 4, b"b a": 5, b"abcd": 6, b"ba": 7}
    table = build_prefix_table(9, vocab)
    assert table.tolist() == [-1, -1, 0, 2, 2, 1, 3, 1, -1]
