"""The loader's n-gram hashes index exactly the model's tables: ngram_hash_sizes(ModelConfig) for
every preset, and keyword names that TrainLoader and val_batches accept."""
import inspect

import numpy as np
import pytest
import torch

from config import MODEL_PRESETS
from data.loader import TrainLoader, val_batches
from data.ngram import NGRAM_HALF_ROWS, NGRAM_SIGN_POOL_ROWS, ngram_hash_sizes, ngram_row_ids, ngram_sign_rows
from model.embeddings import NgramTable, ngram_sign_pool


def test_smoke_sizes_by_hand():
    # smoke: a 16,384-row table (two halves of 8192) and the record's 8192-row sign pool
    assert ngram_hash_sizes(MODEL_PRESETS["smoke"]) == {"ngram_half_rows": 8192, "sign_pool_rows": 8192}
    # the data defaults are the record model's
    assert ngram_hash_sizes(MODEL_PRESETS["record"]) == {"ngram_half_rows": NGRAM_HALF_ROWS,
                                                         "sign_pool_rows": NGRAM_SIGN_POOL_ROWS}
    assert (NGRAM_HALF_ROWS, NGRAM_SIGN_POOL_ROWS) == (42_301_440, 8192)  # record #360 (track_1_short/ngram_table.py)


@pytest.mark.parametrize("fn", [TrainLoader.__init__, val_batches])
def test_the_loader_takes_these_keywords(fn):
    params = inspect.signature(fn).parameters
    assert set(ngram_hash_sizes(MODEL_PRESETS["smoke"])) <= set(params)


@pytest.mark.parametrize("preset", sorted(MODEL_PRESETS))
def test_hashes_reach_the_ends_of_the_model_tables(preset):
    """Row ids cover [0, ngram_rows) up to its reserved last rows, and sign rows index the pool
    the model builds; 2 ranks' NgramTable shards own every id."""
    cfg = MODEL_PRESETS[preset]
    sizes = ngram_hash_sizes(cfg)
    x = np.random.default_rng(0).integers(0, 50257, 4096).astype(np.int32)
    rows = ngram_row_ids(x, sizes["ngram_half_rows"])
    signs = ngram_sign_rows(x, sizes["sign_pool_rows"])
    assert int(rows.min()) >= 0 and int(rows.max()) == cfg.ngram_rows - 1  # trigram reserved row
    assert int(rows[:x.size].max()) == cfg.ngram_rows // 2 - 1             # bigram reserved row
    assert int(signs.min()) >= 0 and int(signs.max()) < cfg.ngram_sign_rows
    if preset == "smoke":  # the real tables (record sizes would allocate 130 GB)
        assert int(signs.max()) >= cfg.ngram_sign_rows // 2  # the pool's upper half is reached
        pool = ngram_sign_pool(cfg)
        assert pool[signs.long()].shape == (2 * x.size, cfg.model_dim)
        shards = [NgramTable(cfg, r, 2) for r in range(2)]
        owned = sum(((rows >= s.lo) & (rows < s.hi)).long() for s in shards)
        assert torch.equal(owned, torch.ones_like(owned))
