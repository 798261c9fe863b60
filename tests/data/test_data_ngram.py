"""n-gram row ids and sign rows against a brute-force Python-int computation (int32 wrap by hand)."""
import numpy as np
import pytest
import torch

from data.ngram import NGRAM_HALF_ROWS, ngram_row_ids, ngram_sign_rows


def i32(v: int) -> int:
    """Python int -> the value an int32 holds after wrapping (two's complement)."""
    v &= 0xFFFFFFFF
    return v - (1 << 32) if v >= 1 << 31 else v


def brute_rows(x: list[int], half: int) -> list[int]:
    """Record #360 (track_1_short/ngram_table.py), one position at a time; Python's % is the floor modulo."""
    m = half - 1
    bigram, trigram = [], []
    for t in range(len(x)):
        if t == 0:
            bigram.append(m)
        else:
            prev = m if t == 1 else x[t - 1]  # the in-place quirk: position 1 sees the reserved id
            bigram.append(i32(i32(36313 * x[t]) ^ i32(27191 * prev)) % m)
        if t < 2:
            trigram.append(half + m)
        else:
            h = i32(i32(17351 * x[t]) ^ i32(60961 * x[t - 1]) ^ i32(45259 * x[t - 2]))
            trigram.append(half + h % m)
    return bigram + trigram


def brute_signs(x: list[int], pool: int) -> list[int]:
    """Record #360 (track_1_short/ngram_table.py): & (pool - 1) of the wrapped int32 hash; row 0 with short history."""
    bigram = [0 if t < 1 else i32(i32(30011 * x[t - 1]) ^ i32(48271 * x[t])) & (pool - 1) for t in range(len(x))]
    trigram = [0 if t < 2 else i32(i32(26801 * x[t - 2]) ^ i32(39779 * x[t - 1]) ^ i32(58699 * x[t])) & (pool - 1)
               for t in range(len(x))]
    return bigram + trigram


def sample_tokens(n: int, seed: int) -> list[int]:
    """Random ids with the largest ones mixed in, so every product that can wrap does."""
    rng = np.random.default_rng(seed)
    x = rng.integers(0, 50257, n)
    large = rng.random(n) < 0.3
    x[large] = rng.choice([50256, 50255, 50000, 44000, 0, 1], size=int(large.sum()))
    x[:4] = [50256, 50255, 50256, 44000]
    return x.tolist()


@pytest.mark.parametrize("half", [NGRAM_HALF_ROWS, 377_280, 1000])
def test_row_ids_match_brute_force(half):
    x = sample_tokens(300, seed=half)
    got = ngram_row_ids(np.array(x, dtype=np.int32), half)
    assert got.dtype == torch.int32 and got.shape == (600,)
    assert got.tolist() == brute_rows(x, half)
    assert 0 <= got[:300].min() and got[:300].max() < half
    assert half <= got[300:].min() and got[300:].max() < 2 * half


@pytest.mark.parametrize("pool", [8192, 64])
def test_sign_rows_match_brute_force(pool):
    x = sample_tokens(300, seed=pool)
    got = ngram_sign_rows(torch.tensor(x, dtype=torch.int32), pool)
    assert got.dtype == torch.int32 and got.tolist() == brute_signs(x, pool)
    assert 0 <= got.min() and got.max() < pool


def test_products_really_wrap():
    # Guard the brute force itself: these products exceed int32, so the wrap matters.
    assert 60961 * 50256 > 2**31 and 48271 * 50256 > 2**31 and 27191 * (NGRAM_HALF_ROWS - 1) > 2**31
    assert i32(2**31) == -2**31 and i32(-1) == -1 and i32(2**32 + 5) == 5


def test_record_89_hand_value_at_position_one():
    # record #89's train_gpt.py bigram hash: with 377,280 rows (M = 377,279), 27191 * M wraps to 1,668,658,697, so the
    # bigram row at t = 1 depends on x[1] alone: (36313 * x[1] XOR 1668658697) mod M.
    x1 = 464
    expected = ((36313 * x1) ^ 1_668_658_697) % 377_279
    assert ngram_row_ids([50256, x1], 377_280)[1].item() == expected
    # At t = 0 and t < 2 the reserved last rows; the sign rows are 0 there.
    assert ngram_row_ids([50256, x1], 377_280).tolist() == [377_279, expected, 754_559, 754_559]
    assert ngram_sign_rows([50256, x1]).tolist()[2:] == [0, 0]


@pytest.mark.parametrize("n", [0, 1, 2, 3])
def test_short_inputs(n):
    x = sample_tokens(4, seed=0)[:n]
    assert ngram_row_ids(x, 1000).tolist() == brute_rows(x, 1000)
    assert ngram_sign_rows(x, 64).tolist() == brute_signs(x, 64)


def test_bad_arguments():
    with pytest.raises(ValueError, match="power of two"):
        ngram_sign_rows([1, 2, 3], 1000)
    with pytest.raises(ValueError, match="half_rows"):
        ngram_row_ids([1, 2, 3], 2**30)
    with pytest.raises(ValueError, match="1-D"):
        ngram_row_ids(np.zeros((2, 2), dtype=np.int32))
