"""PR #375's normalization map, built from GPT-2's BPE files by model/token_norm.py, against PR #375's
published facts (frontier_doc_copy.md §1.1): its digest and counts computed here from the built array,
the worked table, the tokens that keep their id and the class sizes."""
import collections
import hashlib

import numpy as np
import pytest

from model import token_norm
from model.token_norm import build_token_norm_map, normalization_key, token_norm_map

V = 50304  # the model's padded vocabulary


@pytest.fixture(scope="module")
def built(gpt2_bpe):
    from model.prefix import gpt2_token_bytes
    return build_token_norm_map(V, gpt2_token_bytes())


def test_the_map_has_pr_375s_digest_and_counts(built):
    head = built[:50257].astype("<i4")  # GPT-2's 50,257 ids, little-endian int32, as PR #375 hashes them
    assert hashlib.sha256(head.tobytes()).hexdigest() == \
        "79fb57ac259495ba36f1afb9b0d5da35f3048b5067fa59c101d5a3c1ed15c2a2"
    assert len(set(head.tolist())) == 32_980
    assert sum(i != int(m) for i, m in enumerate(head)) == 17_277
    assert (built[50256:] == np.arange(50256, V)).all()  # <|endoftext|> and the padding map to themselves
    assert built.dtype == np.int32 and built.shape == (V,)


def test_the_worked_table(built):
    expect = {262: 262, 1169: 262, 383: 262, 464: 262, 3336: 262,  # " the", "the", " The", "The", " THE"
              5145: 0, 23748: 15496, 837: 11,                       # " !", " hello", " ,"
              68: 36, 2634: 36, 38251: 36,                          # "e", "é", " é" -> "E"
              352: 16, 17031: 10163, 40304: 26725,                  # " 1", " 123", " café" -> " cafe"
              338: 338, 13: 13}                                     # "'s", "." keep their ids
    assert {i: int(built[i]) for i in expect} == expect


def test_whole_utf8_tokens_with_an_empty_key_keep_their_id_and_the_class_sizes(built, gpt2_bpe):
    from model.prefix import gpt2_token_bytes
    by_id = {i: b for b, i in gpt2_token_bytes().items()}
    empty = []
    for i in range(50256):
        try:
            by_id[i].decode("utf-8")
        except UnicodeDecodeError:
            continue
        if normalization_key(by_id[i]) == "":
            empty.append(i)
    assert empty == [199, 200, 24333, 37929, 44208, 47903, 48077, 48763, 48869]
    assert all(built[i] == i for i in empty)
    sizes = collections.Counter(collections.Counter(built[:50257].tolist()).values())
    assert [sizes[1], sizes[2], sizes[3], sizes[4]] == [23_526, 5_351, 1_713, 1_541]
    members = collections.Counter(built[:50257].tolist())
    largest = max(members, key=members.get)
    assert (largest, members[largest]) == (197, 26)  # TAB's class: every whitespace-only token
    assert all(built[i] == 197 for i in (198, 220, 628, 1849))  # LF, space, "\n\n", NBSP


def test_keys_fold_case_accents_and_outer_whitespace_but_not_punctuation():
    assert normalization_key(b" The") == normalization_key(b"THE") == "the"
    assert normalization_key(" café".encode()) == "cafe"
    assert normalization_key(b"\t \n") == " "  # one run, exactly a space: kept
    assert normalization_key(b"\x0b") == ""  # VT alone strips to nothing
    assert normalization_key(b"\xc3") == ""  # a fragment of a 2-byte character
    assert normalization_key(b" ,") == "," and normalization_key(b"'s") == "'s"


def test_a_map_off_the_digest_stops_naming_what_it_got(monkeypatch, gpt2_bpe):
    token_norm_map.cache_clear()
    real = token_norm.build_token_norm_map

    def moved(vocab_size, token_bytes):  # as if this Python's Unicode tables moved one token
        out = real(vocab_size, token_bytes)
        out[2634] = 2634
        return out

    monkeypatch.setattr(token_norm, "build_token_norm_map", moved)
    try:
        with pytest.raises(RuntimeError, match=r"32,981 classes, 17,276 remapped, sha256 [0-9a-f]{64}; PR #375's is "
                                               r"32,980 / 17,277 / 79fb57ac"):
            token_norm_map(V)
    finally:
        monkeypatch.undo()
        token_norm_map.cache_clear()
    m = token_norm_map(V)  # the real one again
    assert (m.classes, m.remapped) == (32_980, 17_277) and "sha256 79fb57ac" in m.line()
