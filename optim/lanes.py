"""What each virtual rank keeps for itself when one process plays several (gradient accumulation).

A run of the record's recipe on fewer than 8 processes plays 8 virtual ranks: process p plays
ranks p·A .. p·A + A − 1 (config.RunConfig.virtual_world_size). For it to compute what 8 ranks
compute, every piece of state a rank keeps for itself must be kept per virtual rank:

* gradients that live across steps: the Adam parameters sum two steps before their update and
  value_embeds a whole table cycle (fp16, record #360). On 8 ranks each rank sums its own steps and
  the reduce then adds the ranks' sums; one process must do the same additions, not interleave the
  ranks' steps in one buffer. The bank gradients are consumed every step: their in-place sum over
  the micro-batches, g0 + g1, is what the reduce of two ranks adds (so they need no lane).
* the fp8 MLP's delayed scales and amaxes (perf/kernels/mlp.py DELAYED_STATE): each rank's come
  from its own batch.

The model keeps one live copy of each tensor, where every kernel and captured graph reads it. A
`Lanes` object holds one copy per virtual rank beside it and swaps by copying: `load(a)` before
virtual rank a's forward-backward, `save(a)` after it (and after that rank's own gradient folds,
OptimizerManager.fold_local). The copies are in-place device copies between captured regions, so
CUDA graphs keep their addresses. Before the update, `reduce` sets each gradient the update reads
to the lanes' sum in virtual-rank order (what the reduce of the ranks adds; the manager then
divides by the virtual ranks), and `clear` zeroes the lanes of what the update consumed.
The n-gram table's row gradients are kept apart by the row exchange itself (RowPlan.lane), and
the candidate samplers, loader positions and row plans are per virtual rank by construction.
"""
from __future__ import annotations

from typing import Callable, Iterable

import torch
from torch import Tensor


class Lanes:
    """Per-virtual-rank copies of a set of live tensors (`count` lanes).

    tensors: returns the live tensors to keep per lane, in a stable order; it may grow (a .grad
    appears at the first backward): a tensor first seen at `save(a)` starts every other lane at
    zero (no gradient yet), one first seen at `load` starts every lane as a copy of itself."""

    def __init__(self, count: int, tensors: Callable[[], Iterable[Tensor]]):
        if count < 2:
            raise ValueError(f"Lanes: count={count}; one rank per process keeps its state in place")
        self.count, self._tensors = count, tensors
        self.live: list[Tensor] = []
        self.copies: list[list[Tensor]] = []   # copies[i][a]: lane a's copy of live[i]
        self.seeds: dict[int, list[Tensor]] = {}  # live index → each lane's own start value (`seed`)

    def _index(self, t: Tensor) -> int | None:
        return next((i for i, u in enumerate(self.live) if u is t), None)

    def _track(self, fresh) -> None:
        for t in self._tensors():
            if self._index(t) is None:
                self.live.append(t)
                self.copies.append([fresh(t) for _ in range(self.count)])

    @torch.no_grad()
    def seed(self, t: Tensor, values: list[Tensor]) -> None:
        """Keep live tensor t per lane, lane a starting (and restarting at `reset`) from values[a], not from
        t: state whose ranks start apart, such as the sampled lm_head gradient's counter (PR #371: rank r
        starts at r)."""
        if len(values) != self.count or self._index(t) is not None:
            raise ValueError(f"Lanes.seed: one start value per lane ({self.count}), for a tensor not yet kept")
        self.live.append(t)
        self.copies.append([v.detach().clone() for v in values])
        self.seeds[len(self.live) - 1] = [v.detach().clone() for v in values]

    @torch.no_grad()
    def load(self, lane: int) -> None:
        """The live tensors ← lane `lane`'s copies (before that virtual rank's forward-backward)."""
        self._track(lambda t: t.detach().clone())
        if self.live:  # nothing yet: no gradient before the first backward, no fp8 state without fp8
            torch._foreach_copy_(self.live, [c[lane] for c in self.copies])

    @torch.no_grad()
    def save(self, lane: int) -> None:
        """Lane `lane`'s copies ← the live tensors (after its backward and its gradient folds)."""
        self._track(lambda t: torch.zeros_like(t))
        if self.live:
            torch._foreach_copy_([c[lane] for c in self.copies], self.live)

    @torch.no_grad()
    def reduce(self, tensors: Iterable[Tensor]) -> None:
        """Each given live tensor that lanes keep ← the sum of its lanes in lane order, l0 + l1 + ...
        (from l0, no zero added first), rounded in its dtype after each addition, as the ranks'
        reduce adds. A tensor no lane keeps (a bank gradient) already holds that sum: the virtual
        ranks' backwards added into it in order."""
        for t in tensors:
            i = self._index(t)
            if i is None:
                continue
            t.copy_(self.copies[i][0])
            for copy in self.copies[i][1:]:
                t.add_(copy)

    @torch.no_grad()
    def clear(self, tensors: Iterable[Tensor]) -> None:
        """Zero every lane's copy of the given live tensors (what an update consumed)."""
        for t in tensors:
            i = self._index(t)
            if i is not None:
                for copy in self.copies[i]:
                    copy.zero_()

    def lane_copies(self, tensors: Iterable[Tensor]) -> list[list[Tensor]]:
        """Per lane, its copies of the given live tensors (in the order given)."""
        index = [self._index(t) for t in tensors]
        if None in index:
            raise KeyError("Lanes.lane_copies: a tensor that no lane keeps")
        return [[self.copies[i][a] for i in index] for a in range(self.count)]

    @torch.no_grad()
    def reset(self) -> None:
        """Every lane ← the live tensors' current values (after the post-warmup reset restored them); a
        seeded tensor's lanes ← their own start values."""
        for i, (t, copies) in enumerate(zip(self.live, self.copies)):
            for a, copy in enumerate(copies):
                copy.copy_(self.seeds[i][a] if i in self.seeds else t)
