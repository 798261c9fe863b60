"""Tail averages (record #360: track_1_short/tail_average.py): the run ends on blends of late-training
weight averages instead of the raw final iterate.

Each rank averages, in fp32, only the rows it updates in the optimizer (OptimizerManager.own_shard).

  accumulator       weights              ticks (record, n = 1194)                 ship
  tail-ema          lm_head, embed       Adam steps of the last 298 (896 seeds)   lerp(final, ema, 0.65)
  tail-avg          vo_bank, mlp_bank    every 4th step of the last 250, phased   replaced by the average
                                         on the last step (945 seeds)
  value-embed-avg   value_embeds         table events of the last 250 (947 seeds) replaced by the average
  bank-blend        qk, vo, mlp banks    s % 4 == 1 and the last two steps of the  lerp(current, ema, B)
                                         last 298 (897 seeds)

bank-blend ships last, so on vo/mlp it blends from the already-shipped tail average A toward its
EMA X with B - w (Richardson correction: (1-B)A + BX + w(A - X) = lerp(A, X, B - w), B = 0.55,
w = 0.2007). After shipping, every shipped weight is all-gathered and embed, lm_head, mlp, qk and
vo are rescaled to their pre-ship Frobenius norms ("decontraction"); value_embeds is not.
Ticking happens after each step's optimizer update; ship() runs once, before the final validation.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import Tensor

from optim.adam import EMBED, LM_HEAD, VALUE_EMBEDS

DECONTRACTION_NAMES = (EMBED, LM_HEAD, "mlp_bank", "qk_bank", "vo_bank")


@dataclass
class Accumulator:
    tag: str
    names: tuple[str, ...]
    window: int
    rate: Callable[[int], float | None]     # step -> lerp rate of this step's tick, None = no tick
    blend: dict[str, float | None]          # None: replace by the average; b: lerp toward it by b
    bufs: dict[str, Tensor] = field(default_factory=dict)
    seeded: set[str] = field(default_factory=set)


class TailAverages:
    """The four accumulators of record #360 over an OptimizerManager's shards."""

    def __init__(self, manager, schedule):
        cfg, n = schedule.cfg, schedule.total_steps
        if n - cfg.tail_avg_window < cfg.table_period4_step:
            raise ValueError(f"tail_avg_window={cfg.tail_avg_window}: the value-embed average assumes "
                             f"the 4-step table cadence (from step {cfg.table_period4_step}) over its "
                             f"whole window, which starts at step {n - cfg.tail_avg_window}")
        self.manager, self.total_steps = manager, n
        r = 2.0 / (cfg.tail_ema_window + 1)

        def tail_ema(step: int) -> float | None:
            # lm_head/embed only change on odd (Adam) steps: two per-step EMA updates fold into one
            # tick at 1 - (1 - r)^2; the window's first (even) step seeds, the last step ticks at r.
            if step % 2 == 0:
                return r if step == n - cfg.tail_ema_window else None
            return r if step == n - 1 else -math.expm1(2.0 * math.log1p(-r))

        blend_rate = 2.0 / (cfg.bank_blend_window // cfg.bank_blend_period + 1)  # record: 2/75
        self.accumulators = [
            Accumulator("tail-ema", (LM_HEAD, EMBED), cfg.tail_ema_window, tail_ema,
                        {LM_HEAD: cfg.tail_ema_blend, EMBED: cfg.tail_ema_blend}),
            Accumulator("tail-avg", ("vo_bank", "mlp_bank"), cfg.tail_avg_window,
                        lambda s: cfg.tail_avg_rate if (n - 1 - s) % cfg.tail_avg_period == 0 else None,
                        {"vo_bank": None, "mlp_bank": None}),
            Accumulator("bank-blend", ("qk_bank", "vo_bank", "mlp_bank"), cfg.bank_blend_window,
                        lambda s: blend_rate if s % cfg.bank_blend_period == 1 or s >= n - 2 else None,
                        {"qk_bank": cfg.bank_blend, "vo_bank": cfg.bank_blend - cfg.richardson_w,
                         "mlp_bank": cfg.bank_blend - cfg.richardson_w}),
            Accumulator("value-embed-avg", (VALUE_EMBEDS,), cfg.tail_avg_window,
                        lambda s: cfg.tail_avg_rate if schedule.is_table_event(s) else None,
                        {VALUE_EMBEDS: None}),
        ]
        # a parameter switched off (config.FeatureConfig: value_embeds) has no average
        self.accumulators = [a for a in self.accumulators if all(n in manager.entries for n in a.names)]
        # Allocated now, before the clock.
        for acc in self.accumulators:
            for name in acc.names:
                acc.bufs[name] = torch.empty_like(manager.own_shard(name), dtype=torch.float32)

    def rate(self, tag: str, step: int) -> float | None:
        """The lerp rate of accumulator `tag` at `step` (None: no tick), window included."""
        acc = next(a for a in self.accumulators if a.tag == tag)
        return acc.rate(step) if step >= self.total_steps - acc.window else None

    @torch.no_grad()
    def tick(self, step: int) -> None:
        """Fold this step's (post-update) shards into every accumulator that ticks at `step`.
        The first tick of each weight seeds (copies) its accumulator."""
        for acc in self.accumulators:
            rate = self.rate(acc.tag, step)
            if rate is None:
                continue
            for name in acc.names:
                shard = self.manager.own_shard(name)
                if name in acc.seeded:
                    acc.bufs[name].lerp_(shard.float(), rate)
                else:
                    acc.bufs[name].copy_(shard)
                    acc.seeded.add(name)

    def ship_order(self) -> list[Accumulator]:
        by_tag = {a.tag: a for a in self.accumulators}
        return [by_tag[t] for t in ("tail-ema", "tail-avg", "value-embed-avg", "bank-blend") if t in by_tag]

    @torch.no_grad()
    def ship(self) -> None:
        """Write the averages into the weights, gather them, restore the pre-ship norms."""
        self.manager.wait_gathers()  # a deferred gather still in flight would overwrite the ship
        params = {name: self.manager.entries[name].param for name in DECONTRACTION_NAMES}
        before = [params[n].data.float().norm().item() for n in DECONTRACTION_NAMES]
        shipped: list[str] = []
        for acc in self.ship_order():
            for name in acc.names:
                if name not in acc.seeded:
                    raise RuntimeError(f"tail average {acc.tag} never ticked {name}: the run is "
                                       f"shorter than its window ({acc.window} steps)?")
                shard, avg, b = self.manager.own_shard(name), acc.bufs[name], acc.blend[name]
                shard.copy_(avg if b is None else torch.lerp(shard.float(), avg, b))
                if name not in shipped:
                    shipped.append(name)
        for name in shipped:   # each rank wrote only its own rows
            self.manager.gather_param(name)
        for name, b in zip(DECONTRACTION_NAMES, before):
            after = params[name].data.float().norm().item()
            params[name].data.mul_(b / after if after > 0 else 1.0)  # a Python float: one bf16 rounding
