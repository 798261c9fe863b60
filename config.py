"""Run configurations: frozen dataclasses and the named presets (smoke, dev, record).

Each concern owns one section below. A preset name selects one entry from every section; the
command line of train_gpt.py overrides individual fields.
"""
from __future__ import annotations

from dataclasses import dataclass


# ================================================================================================
# Model dimensions (used by model/).
# ================================================================================================


@dataclass(frozen=True)
class ModelConfig:
    """Widths and table sizes of the record #360 network. The topology (which layers have
    attention, MLPs, gates, MUDD) is fixed in model/gpt.py; these numbers only size it."""
    vocab_size: int = 50304  # record #360: GPT-2's 50257 padded to a multiple of 128
    model_dim: int = 768  # record #360
    num_heads: int = 6  # record #360; num_heads · head_dim must equal model_dim
    head_dim: int = 128  # record #360: the wide heads (layers 3, 10) and the bank row width
    narrow_head_dim: int = 64  # record #360: d_qk on 0,1,2,5,8, d_v on 1,8, and the rotary dims
    mlp_hidden_dim: int = 2816  # record #360
    mudd_hidden_dim: int = 64  # record #360: hidden width of the MUDD blocks and the MUDD gates
    ngram_rows: int = 84_602_880  # record #360: bigram half + trigram half, sharded by world size
    ngram_sign_rows: int = 8192  # record #360: the ±1 sign pool (a power of two: rows are hash & 8191)

    def __post_init__(self):
        if self.num_heads * self.head_dim != self.model_dim:
            raise ValueError(f"ModelConfig: num_heads·head_dim = {self.num_heads * self.head_dim} "
                             f"must equal model_dim {self.model_dim}")
        if self.model_dim % 12 or self.num_heads % 2 or self.narrow_head_dim % 2:
            raise ValueError("ModelConfig: model_dim must split into 12 MUDD groups and heads into pairs")
        if not self.narrow_head_dim < self.head_dim:
            raise ValueError("ModelConfig: narrow_head_dim must be below head_dim (the key offset "
                             "needs stationary dims on the wide heads)")
        if self.ngram_rows % 2 or self.ngram_sign_rows & (self.ngram_sign_rows - 1):
            raise ValueError("ModelConfig: ngram_rows must be even (two halves), ngram_sign_rows a power of two")


MODEL_PRESETS = {
    "record": ModelConfig(),
    # One GPU holds the whole n-gram table: 8,388,608 rows (12.9 GB bf16) instead of 130 GB.
    "dev": ModelConfig(ngram_rows=8_388_608),
    # CPU: same topology and vocabulary (GPT-2 tokens), small widths and tables.
    "smoke": ModelConfig(model_dim=96, head_dim=16, narrow_head_dim=8, mlp_hidden_dim=192,
                         mudd_hidden_dim=16, ngram_rows=16_384),
}


# ================================================================================================
# Schedule and optimizer (used by optim/).
# ================================================================================================
