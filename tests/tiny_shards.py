"""Shards of random 64-token documents for the tests that train the smoke preset a few steps."""
from pathlib import Path

import numpy as np

TRAIN_TOKENS, VAL_TOKENS = 8192, 4096  # the smoke preset's three training steps and one validation step


def write_tiny_shards(out: Path, train: str = "train", val: str = "val") -> Path:
    """tiny_<train>_000000.bin and tiny_<val>_000000.bin under out (seeded: the same tokens every call)."""
    from data.shards import BOS_ID, write_shard
    rng = np.random.default_rng(0)
    for kind, n in ((train, TRAIN_TOKENS), (val, VAL_TOKENS)):
        tokens = rng.integers(0, BOS_ID, n).astype(np.uint16)
        tokens[::64] = BOS_ID
        write_shard(out / f"tiny_{kind}_000000.bin", tokens)
    return out
