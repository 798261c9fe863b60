"""Input-side embeddings of record #360: value-embedding planes, the smear, the hashed n-gram table.

* Value embeddings: `value_embeds` [4·V, D], plane p = rows [p·V, (p+1)·V), read by token id and
  added to V on layers (1, 2, 8, 10). The gather and its scatter-add backward (repeated rows summed
  in fp32, one rounding) are perf/kernels/value_embed.py's `value_embed`.
* Smear: x[t] += λ·σ(w·x[t][:12])·x[t−1] over the packed stream (x[0] unchanged).
* N-gram table: ngram_rows × D bf16 rows, bigram half then trigram half, zero-initialized, and not a
  model parameter: each rank holds a contiguous 1/world_size shard (`NgramTable`). The caller
  gathers a batch's 2T rows (first T bigram, last T trigram; optim/row_exchange.py `RowExchange.pull`) and
  passes them to the forward with their sign rows; perf/kernels/ngram_embed.py's `ngram_embed` forms
  B[t] = row_bi·sign_bi + row_tri·sign_tri in fp32 with one rounding. The row-sparse Adam belongs
  to the optimizer.
"""
from __future__ import annotations

import torch
from torch import Tensor

from config import ModelConfig
from perf.kernels.value_embed import value_embed

SMEAR_CHANNELS = 12  # record #360: the smear gate reads the token's first 12 channels
NUM_VALUE_EMBED_PLANES = 4  # record #360: planes for layers (1, 2, 8, 10)


def value_embeddings(value_embeds: Tensor, inputs: Tensor, vocab_size: int,
                     grad_buffer: Tensor | None = None) -> list[Tensor]:
    """The planes' rows for the batch's tokens: NUM_VALUE_EMBED_PLANES × (T, D).

    One gather over the flat table (row p·V + id), so the backward scatter-adds one gradient:
    each repeated row's gradients summed in fp32 and rounded once (record #360's value-embed
    backward; a bf16 `F.embedding` backward would accumulate in bf16). With `grad_buffer` (the
    optimizer's fp16 cycle sum, shaped like the table) the sums are added into it instead of
    into a dense `.grad`.
    """
    offsets = vocab_size * torch.arange(NUM_VALUE_EMBED_PLANES, device=inputs.device)
    rows = value_embed(value_embeds, inputs.long()[None, :] + offsets[:, None], grad_buffer)  # (4, T, D)
    return list(rows.unbind(0))


def smear(x: Tensor, gate_w: Tensor, smear_lambda: Tensor) -> Tensor:
    """x [T, D] with each token (from the second on) mixing in the previous token's embedding."""
    gate = torch.sigmoid(x[1:, :SMEAR_CHANNELS] @ gate_w.t())  # (T−1, 1), reads the current token
    return torch.cat([x[:1], x[1:] + smear_lambda.to(x.dtype) * gate * x[:-1]])


def ngram_sign_pool(cfg: ModelConfig, generator: torch.Generator | None = None, device=None) -> Tensor:
    """[sign_rows, D] of ±1: signs of standard normals (rank 0's pool is broadcast to the others)."""
    draw = torch.randn(cfg.ngram_sign_rows, cfg.model_dim, generator=generator, device=device)
    return torch.where(draw >= 0, 1.0, -1.0).to(torch.bfloat16)


def ngram_shard_range(num_rows: int, rank: int, world_size: int) -> tuple[int, int]:
    """Contiguous rows [lo, hi) of the n-gram table owned by `rank` of `world_size`."""
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"n-gram table: rank {rank} is outside world size {world_size}")
    if num_rows % world_size:
        raise ValueError(f"n-gram table: {num_rows} rows do not shard evenly over {world_size} ranks")
    per_rank = num_rows // world_size
    return rank * per_rank, (rank + 1) * per_rank


class NgramTable:
    """This rank's contiguous shard of the hashed n-gram table (bf16, zero-initialized).

    Rank r of W owns rows [r·R, (r+1)·R) with R = ngram_rows / W (record: 10,575,360 of 84,602,880
    per rank on 8 ranks, so ranks 0–3 hold bigram rows and 4–7 trigram rows).
    """

    def __init__(self, cfg: ModelConfig, rank: int, world_size: int, device=None, dtype=torch.bfloat16,
                 rows=None):
        """rows: a zero row store of this shard's [hi - lo, dim] to use instead of a device tensor
        (training.Run passes perf/host_table.py HostRows when the table lives in host memory)."""
        self.num_rows, self.dim = cfg.ngram_rows, cfg.model_dim
        self.rank, self.world_size = rank, world_size
        self.lo, self.hi = self.owned_range(rank, world_size)
        if rows is not None and tuple(rows.size()) != (self.hi - self.lo, self.dim):
            raise ValueError(f"NgramTable: rows of shape {tuple(rows.size())}, expected this shard's "
                             f"[{self.hi - self.lo}, {self.dim}]")
        self.rows = rows if rows is not None else torch.zeros(self.hi - self.lo, self.dim, dtype=dtype, device=device)

    @property
    def half(self) -> int:
        """First trigram row (the bigram channel is rows [0, half))."""
        return self.num_rows // 2

    def owned_range(self, rank: int, world_size: int) -> tuple[int, int]:
        """Rows [lo, hi) that `rank` of `world_size` owns."""
        return ngram_shard_range(self.num_rows, rank, world_size)

    def lookup(self, row_ids: Tensor) -> Tensor:
        """Rows of this shard by global row id: [N, D]; ids outside the shard are an error."""
        ids = row_ids.long()
        if ids.numel() and (int(ids.min()) < self.lo or int(ids.max()) >= self.hi):
            raise IndexError(f"NgramTable.lookup: rank {self.rank} owns rows [{self.lo}, {self.hi}), got ids "
                             f"in [{int(ids.min())}, {int(ids.max())}]")
        return self.rows[ids - self.lo]
