"""Host-side hashes of the n-gram embedding: table row ids and sign-pool rows per token position.

Every position t of a rank's packed input stream x[0..T-1] reads two rows of the hashed n-gram table
(a bigram row from the first half, a trigram row from the second) and two rows of the shared +-1 sign
pool. The hashes run over the whole packed stream, not per document, so n-grams span document
boundaries. All products are int32 and wrap on overflow; `%` is the floor (Python-sign) modulo and
`& (pool_rows - 1)` takes the two's-complement low bits, so every id is non-negative. The loader
calls these once per batch (record #360: track_1_short/ngram_table.py).

    from data.ngram import ngram_row_ids, ngram_sign_rows, NGRAM_HALF_ROWS
    rows = ngram_row_ids(inputs, NGRAM_HALF_ROWS)  # (2T,) int32
    signs = ngram_sign_rows(inputs)                # (2T,) int32

The sizes belong to the model (config.ModelConfig: ngram_rows, ngram_sign_rows); a loader for a
given model takes `**ngram_hash_sizes(model_cfg)` so the hashes always index that model's tables.
"""
from __future__ import annotations

import numpy as np
import torch

from config import ModelConfig

# Table size (record #360: track_1_short/ngram_table.py): 84,602,880 rows, bigram half [0, h), trigram half [h, 2h).
# The defaults are the record model's; other presets go through ngram_hash_sizes.
NGRAM_ROWS = ModelConfig().ngram_rows  # record #360: 84,602,880
NGRAM_HALF_ROWS = NGRAM_ROWS // 2  # 42,301,440
NGRAM_SIGN_POOL_ROWS = ModelConfig().ngram_sign_rows  # record #360 (track_1_short/ngram_table.py): 8192 rows of +-1

# Odd multipliers of the hashes (record #360: track_1_short/ngram_table.py), ordered x[t], x[t-1], x[t-2].
BIGRAM_ROW_MULS = (36313, 27191)
TRIGRAM_ROW_MULS = (17351, 60961, 45259)
BIGRAM_SIGN_MULS = (48271, 30011)
TRIGRAM_SIGN_MULS = (58699, 39779, 26801)


def ngram_hash_sizes(cfg: ModelConfig) -> dict[str, int]:
    """The loader's n-gram keyword arguments for a model (data.loader.TrainLoader, val_batches):
    the bigram half of the model's table and its sign-pool rows (smoke: 8192 and 8192)."""
    return {"ngram_half_rows": cfg.ngram_rows // 2, "sign_pool_rows": cfg.ngram_sign_rows}


def _as_int32(inputs) -> np.ndarray:
    x = inputs.numpy() if isinstance(inputs, torch.Tensor) else np.asarray(inputs)
    if x.ndim != 1:
        raise ValueError(f"inputs must be a 1-D token array, got shape {x.shape}")
    return x.astype(np.int32, copy=False)


def _mul(c: int, x: np.ndarray) -> np.ndarray:
    return np.int32(c) * x  # int32 array product: wraps like the recipe's int32 tensors


def ngram_row_ids(inputs, half_rows: int = NGRAM_HALF_ROWS) -> torch.Tensor:
    """Token ids (T,) -> n-gram table rows (2T,) int32: [:T] bigram rows in [0, half_rows),
    [T:] trigram rows in [half_rows, 2*half_rows).

    Each channel reserves its last row for positions without enough history (t = 0 for bigrams,
    t < 2 for trigrams). Record #360 quirk, kept: the bigram at t = 1 hashes the reserved id
    half_rows - 1 as its previous token instead of x[0] (its hash ran in place after out[0] was set).
    """
    x = _as_int32(inputs)
    if not 2 <= half_rows < 2**30:
        raise ValueError(f"half_rows must be in [2, 2**30) so row ids fit int32, got {half_rows}")
    n = x.size
    mod = np.int32(half_rows - 1)  # both channels reduce mod h - 1; row h - 1 is the reserved one
    out = np.empty(2 * n, dtype=np.int32)
    bigram, trigram = out[:n], out[n:]  # (T,), (T,) views
    if n == 0:
        return torch.from_numpy(out)
    prev = x[:-1].copy()
    prev[:1] = mod  # the quirk: position 1's previous token is the reserved id
    bigram[0] = mod
    bigram[1:] = (_mul(BIGRAM_ROW_MULS[0], x[1:]) ^ _mul(BIGRAM_ROW_MULS[1], prev)) % mod
    trigram[:2] = half_rows + mod
    if n > 2:
        h = _mul(TRIGRAM_ROW_MULS[0], x[2:]) ^ _mul(TRIGRAM_ROW_MULS[1], x[1:-1]) ^ _mul(TRIGRAM_ROW_MULS[2], x[:-2])
        trigram[2:] = h % mod + np.int32(half_rows)
    return torch.from_numpy(out)


def ngram_sign_rows(inputs, pool_rows: int = NGRAM_SIGN_POOL_ROWS) -> torch.Tensor:
    """Token ids (T,) -> sign-pool rows (2T,) int32: [:T] bigram sign rows, [T:] trigram sign rows,
    each in [0, pool_rows). Row 0 where the history is short (t = 0; t < 2). Unlike the row hash,
    the bigram sign hash at t = 1 reads the real x[0]."""
    x = _as_int32(inputs)
    if pool_rows <= 0 or pool_rows & (pool_rows - 1):
        raise ValueError(f"pool_rows must be a power of two (the hash keeps its low bits), got {pool_rows}")
    n = x.size
    low_bits = np.int32(pool_rows - 1)
    out = np.zeros(2 * n, dtype=np.int32)
    bigram, trigram = out[:n], out[n:]  # (T,), (T,) views; row 0 stays where history is short
    if n > 1:
        bigram[1:] = (_mul(BIGRAM_SIGN_MULS[0], x[1:]) ^ _mul(BIGRAM_SIGN_MULS[1], x[:-1])) & low_bits
    if n > 2:
        h = _mul(TRIGRAM_SIGN_MULS[0], x[2:]) ^ _mul(TRIGRAM_SIGN_MULS[1], x[1:-1]) ^ _mul(TRIGRAM_SIGN_MULS[2], x[:-2])
        trigram[2:] = h & low_bits
    return torch.from_numpy(out)
