"""Tail averages: tick steps and rates of record #360 (track_1_short/tail_average.py), the accumulators against
plain Python EMAs, and the ship (blends, order, decontraction)."""
import pytest
import torch

from config import SCHEDULE_PRESETS
from optim.manager import OptimizerManager
from optim.schedule import TrainingSchedule
from optim.standin import StandInParams
from optim.tail_average import TailAverages


def make(preset):
    sched = TrainingSchedule(SCHEDULE_PRESETS[preset])
    model = StandInParams.small()
    mgr = OptimizerManager(model.named_parameters(), sched)
    return sched, model, mgr, TailAverages(mgr, sched)


def ticks(tails, tag, n):
    return [s for s in range(n) if tails.rate(tag, s) is not None]


def test_record_tick_steps_and_rates():
    sched, _, _, tails = make("record")
    n = 1194
    ema = ticks(tails, "tail-ema", n)
    assert ema == [896] + list(range(897, 1194, 2)) and len(ema) == 150
    r = 2 / 299
    assert tails.rate("tail-ema", 896) == pytest.approx(r)
    assert tails.rate("tail-ema", 897) == pytest.approx(1 - (1 - r) ** 2)
    assert tails.rate("tail-ema", 1193) == pytest.approx(r)
    avg = ticks(tails, "tail-avg", n)
    assert avg == list(range(945, 1194, 4)) and len(avg) == 63
    assert tails.rate("tail-avg", 945) == pytest.approx(4 / 53)
    blend = ticks(tails, "bank-blend", n)
    assert blend == list(range(897, 1190, 4)) + [1192, 1193] and len(blend) == 76
    assert tails.rate("bank-blend", 1192) == pytest.approx(2 / 75)
    ve = ticks(tails, "value-embed-avg", n)
    assert ve == list(range(947, 1192, 4)) and len(ve) == 62


def test_accumulate_and_ship_against_plain_loops():
    sched, model, mgr, tails = make("smoke")
    n = sched.total_steps
    cfg = sched.cfg
    gen = torch.Generator().manual_seed(0)
    history = {name: [] for name, _ in model.named_parameters()}
    for step in range(n):   # stand-in for training: new weights every step
        for name, p in model.named_parameters():
            p.data.copy_(torch.randn(p.shape, generator=gen).to(p.dtype))
            history[name].append(p.detach().float().clone())
        tails.tick(step)

    def plain(name, rule):
        acc = None
        for step in range(n):
            rate = rule(step)
            if rate is None:
                continue
            acc = history[name][step].clone() if acc is None else acc + rate * (history[name][step] - acc)
        return acc

    r = 2 / (cfg.tail_ema_window + 1)
    ema_rule = lambda s: (None if s < n - cfg.tail_ema_window else
                          (r if s == n - cfg.tail_ema_window else None) if s % 2 == 0 else
                          (r if s == n - 1 else 1 - (1 - r) ** 2))
    avg_rule = lambda s: (4 / 53 if s >= n - cfg.tail_avg_window and (n - 1 - s) % 4 == 0 else None)
    blend_rule = lambda s: (2 / (cfg.bank_blend_window // 4 + 1)
                            if s >= n - cfg.bank_blend_window and (s % 4 == 1 or s >= n - 2) else None)
    ve_rule = lambda s: (4 / 53 if s >= n - cfg.tail_avg_window and sched.is_table_event(s) else None)
    expected_acc = {"lm_head.weight": plain("lm_head.weight", ema_rule), "vo_bank": plain("vo_bank", avg_rule),
                    "qk_bank": plain("qk_bank", blend_rule), "value_embeds": plain("value_embeds", ve_rule)}
    torch.testing.assert_close(tails.accumulators[0].bufs["lm_head.weight"], expected_acc["lm_head.weight"])
    torch.testing.assert_close(tails.accumulators[1].bufs["vo_bank"], expected_acc["vo_bank"].view(-1, 32, 32))
    torch.testing.assert_close(tails.accumulators[2].bufs["qk_bank"], expected_acc["qk_bank"])
    torch.testing.assert_close(tails.accumulators[3].bufs["value_embeds"], expected_acc["value_embeds"])

    final = {name: h[-1] for name, h in history.items()}
    vo_blend_acc = plain("vo_bank", blend_rule)
    tails.ship()

    def bf16(t):
        return t.bfloat16().float()
    # lm_head: lerp(final, ema, 0.65), then rescaled to the final norm
    lm = bf16(torch.lerp(final["lm_head.weight"], expected_acc["lm_head.weight"], 0.65))
    lm = lm * (final["lm_head.weight"].norm() / lm.norm())
    torch.testing.assert_close(model.lm_head.weight.float(), lm, rtol=1e-2, atol=1e-2)
    assert model.lm_head.weight.float().norm().item() == pytest.approx(final["lm_head.weight"].norm().item(), rel=5e-3)
    # vo: the tail average, then lerp toward the bank-blend EMA by 0.55 - 0.2007, then rescaled
    vo = bf16(torch.lerp(bf16(expected_acc["vo_bank"]), vo_blend_acc, 0.55 - 0.2007))
    vo = vo * (final["vo_bank"].norm() / vo.norm())
    torch.testing.assert_close(model.vo_bank.float(), vo, rtol=1e-2, atol=1e-2)
    # value_embeds: replaced by its average, no rescale (1 bf16 ulp: lerp_ vs a + r (b - a))
    torch.testing.assert_close(model.value_embeds.float(), bf16(expected_acc["value_embeds"]),
                               rtol=2 ** -7, atol=1e-6)


def test_window_longer_than_cadence_is_rejected():
    from dataclasses import replace
    cfg = replace(SCHEDULE_PRESETS["smoke"], tail_avg_window=60)
    sched = TrainingSchedule(cfg)
    mgr = OptimizerManager(StandInParams.small().named_parameters(), sched)
    with pytest.raises(ValueError, match="tail_avg_window"):
        TailAverages(mgr, sched)
