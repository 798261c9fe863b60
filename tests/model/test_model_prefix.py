"""model/prefix.py: the prefix table against a brute-force search of the GPT-2 vocabulary, and the
stored copy (what a machine without tiktoken's GPT-2 files reads) against the build from those files."""
import hashlib

import pytest
import torch

import model.prefix as prefix
from model.prefix import build_prefix_table, gpt2_token_bytes


def _brute_force(token, by_id, vocab):
    b = by_id[token]
    for length in range(len(b) - 1, 0, -1):
        if b[:length] in vocab:
            return vocab[b[:length]]
    return -1


def test_prefix_table_matches_brute_force_on_gpt2(gpt2_bpe):
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


def test_the_stored_table_is_the_build_from_tiktokens_files(gpt2_bpe, tmp_path):
    """The copy a fresh clone offline reads is the build from tiktoken's GPT-2 files, at the padded
    record vocabulary and a small one (where a prefix past the table becomes -1), and rewriting it
    from those files reproduces its bytes."""
    for vocab in (50304, 50257, 1000):
        assert torch.equal(prefix.stored_prefix_table(vocab), build_prefix_table(vocab, gpt2_token_bytes())), vocab
    prefix.write_stored_table(tmp_path / "table.npy.gz")
    assert (tmp_path / "table.npy.gz").read_bytes() == prefix.STORED_TABLE.read_bytes()


def test_without_tiktokens_files_the_builds_read_the_stored_table(monkeypatch):
    """With tiktoken unable to load GPT-2 (no cache, no network), the whole and the sliced builds
    answer from the stored copy, pinned by its hash (its content is checked against tiktoken's
    files above, where they are present)."""
    assert hashlib.sha256(prefix.STORED_TABLE.read_bytes()).hexdigest() == \
        "3939f62cee958b69c10f8315abab6a8c887c227dd36a1bed1dd1a3e7b40458f5"

    def no_files():
        raise ConnectionError("no network")

    monkeypatch.setattr(prefix, "gpt2_encoding", no_files)
    prefix.gpt2_bpe_available.cache_clear()
    try:
        assert prefix.gpt2_bpe_available() is False
        whole = build_prefix_table(50304)
        assert torch.equal(whole, prefix.stored_prefix_table(50304))
        assert (whole[:256] == -1).all() and (whole[50256:] == -1).all() and int((whole >= 0).sum()) == 50000
        slices = [prefix.build_prefix_table_slice(50304, r, 3) for r in range(3)]
        assert torch.equal(torch.cat(slices), whole)
    finally:
        prefix.gpt2_bpe_available.cache_clear()
