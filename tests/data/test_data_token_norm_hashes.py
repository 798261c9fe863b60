"""features.token_norm_hashes (PR #375) in the loader: the n-gram row and sign hashes read each token's
class, everything else keeps raw ids. The hashes against frontier_doc_copy.md §1.5's worked table
(stream A, hand-checked numbers) and against the raw hashes of the mapped ids."""
import numpy as np
import pytest

from data.loader import TrainLoader, val_batches
from data.ngram import ngram_row_ids, ngram_sign_rows
from data.shards import write_shard

BOS = 50256
# " the cat sat. The cat sat down. the cat" (§1.5's stream A) and its classes (" The" 383 -> " the" 262)
STREAM_A = [BOS, 262, 3797, 3332, 13, 383, 3797, 3332, 866, 13, 262, 3797]


def _hand_map(vocab=50304):
    """The part of the map stream A reads: 383 -> 262, every other id itself (model/token_norm.py maps
    those ids so: tests/model/test_model_token_norm.py)."""
    m = np.arange(vocab, dtype=np.int32)
    m[383] = 262
    return m


def test_stream_a_hashes_are_the_worked_table():
    n = _hand_map()[np.array(STREAM_A, dtype=np.int32)]
    rows = ngram_row_ids(n).numpy()  # record #360's table: half 42,301,440
    signs = ngram_sign_rows(n).numpy()
    T = len(STREAM_A)
    at = [0, 1, 2, 3, 5, 6, 7]
    assert rows[:T][at].tolist() == [42301439, 20632011, 13299658, 17915303, 9717981, 13299658, 17915303]
    assert rows[T:][at].tolist() == [84602879, 84602879, 43894772, 66538160, 61433902, 51775771, 66538160]
    assert signs[:T][at].tolist() == [0, 5162, 3737, 4395, 2469, 3737, 4395]
    assert signs[T:][at].tolist() == [0, 0, 7525, 4693, 4353, 5832, 4693]
    raw = ngram_row_ids(np.array(STREAM_A, dtype=np.int32)).numpy()  # #360: the raw ids differ from t = 5
    assert raw[:T][at].tolist() == [42301439, 20632011, 13299658, 17915303, 13718380, 18392007, 17915303]


def test_the_loader_hashes_classes_and_keeps_raw_ids(tmp_path):
    rng = np.random.default_rng(0)
    token_map = np.arange(50304, dtype=np.int32)
    token_map[rng.integers(0, 50256, 5000)] = rng.integers(0, 1000, 5000)  # any map: the loader only applies it
    docs = []
    for _ in range(80):
        docs += [BOS, *rng.integers(0, 50256, int(rng.integers(20, 90))).tolist()]
    write_shard(tmp_path / "t_train_000.bin", np.array(docs, dtype=np.uint16))
    write_shard(tmp_path / "t_val_000.bin", np.array(docs, dtype=np.uint16))
    sizes = dict(ngram_half_rows=8192, sign_pool_rows=8192)
    with TrainLoader(str(tmp_path / "t_train_*.bin"), [0, 1], 2, token_map=token_map, **sizes) as mapped, \
            TrainLoader(str(tmp_path / "t_train_*.bin"), [0, 1], 2, **sizes) as raw:
        for _ in range(2):
            for a, b in zip(mapped.next_batches(512, 128), raw.next_batches(512, 128)):
                x = a.inputs.numpy()
                assert (x == b.inputs.numpy()).all() and (a.targets == b.targets).all()  # raw ids
                assert (a.cu_seqlens == b.cu_seqlens).all()
                assert (a.ngram_ids == ngram_row_ids(token_map[x], 8192)).all()  # the raw hashes of the classes
                assert (a.ngram_sign_rows == ngram_sign_rows(token_map[x], 8192)).all()
                assert (b.ngram_ids == ngram_row_ids(x, 8192)).all()
                assert not (a.ngram_ids == b.ngram_ids).all()
    (v,) = list(val_batches(str(tmp_path / "t_val_*.bin"), 0, 1, 1024, 1024, token_map=token_map, **sizes))
    assert (v.ngram_ids == ngram_row_ids(token_map[v.inputs.numpy()], 8192)).all()
    assert (v.inputs.numpy() == np.array(docs[:1024])).all()
