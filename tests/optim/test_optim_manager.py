"""OptimizerManager.step is the one call a run makes per step: it owns the order of its work (scalars,
the captured update, the deferred gathers' launch, the untie, the n-gram table event), reads the
step's settings once, and re-runs nothing a caller skipped (optim/manager.py)."""
import pytest
import torch

from config import SCHEDULE_PRESETS
from optim.manager import NgramRowOptimizer, OptimizerManager, RowExchange
from optim.schedule import TrainingSchedule
from optim.standin import StandInParams

SMOKE = TrainingSchedule(SCHEDULE_PRESETS["smoke"])  # 70 steps: the split (65), table events, the 4-step cadence
TABLE_ROWS, TABLE_DIM = 64, 32


def _optimizers(seed: int = 0):
    model = StandInParams.small(seed=seed)
    mgr = OptimizerManager(model.named_parameters(), SMOKE, keep_grads=True)
    table = (torch.randn(TABLE_ROWS, TABLE_DIM, generator=torch.Generator().manual_seed(1)) * 0.02).bfloat16()
    exchange = RowExchange(TABLE_ROWS, 0, 1, "cpu")
    return model, mgr, NgramRowOptimizer(table, TABLE_ROWS, mgr, exchange), exchange


def _backward(model, rows: NgramRowOptimizer, exchange: RowExchange, step: int) -> None:
    model.random_grads(seed=step)
    g = torch.Generator().manual_seed(1000 + step)
    ids = torch.randint(0, TABLE_ROWS, (24,), generator=g, dtype=torch.int32)
    rows.accumulate(exchange.plan(ids), torch.randn(24, TABLE_DIM, generator=g).bfloat16())


def test_one_step_call_is_the_pieces_in_the_records_order_bitwise():
    """The reference drives the pieces by hand in record #360's order (what training.Run did before
    the one call); the whole smoke schedule, across the split and every table cadence."""
    model, mgr, rows, exchange = _optimizers()
    ref_model, ref, ref_rows, ref_exchange = _optimizers()
    events = []
    for step in range(SMOKE.total_steps):
        _backward(model, rows, exchange, step)
        events.append(mgr.step(SMOKE.settings(step), rows=rows))
        _backward(ref_model, ref_rows, ref_exchange, step)
        ref.load_scalars(step)
        ref.update(step)
        ref.launch_deferred_gathers(step)
        if ref.untie_due(step):
            ref.untie()
        assert ref_rows.step(step) == events[-1]
    assert mgr.split and events == [SMOKE.is_table_event(s) for s in range(SMOKE.total_steps)]
    for (name, p), q in zip(model.named_parameters(), ref_model.parameters()):
        assert torch.equal(p, q), name
    assert torch.equal(rows.shard, ref_rows.shard)


def test_the_step_reads_its_settings_and_not_the_schedule(monkeypatch):
    """Handed the step's settings, the manager goes back to the schedule for none of its answers."""
    model, mgr, rows, exchange = _optimizers()
    settings = [SMOKE.settings(s) for s in range(SMOKE.total_steps)]
    for name in ("settings", "lr_mult", "rail_beta", "rails_engaged", "is_adam_step", "is_table_event",
                 "table_period4"):
        def asked(*args, _name=name, **kwargs):
            raise AssertionError(f"the optimizer asked the schedule for {_name} at a step it was given")
        monkeypatch.setattr(SMOKE, name, asked)
    for s in settings:
        _backward(model, rows, exchange, s.step)
        mgr.step(s, rows=rows)
    assert mgr.split


def test_nothing_re_runs_what_a_caller_skipped():
    model, mgr, _, _ = _optimizers()
    model.random_grads(seed=0)
    with pytest.raises(RuntimeError, match=r"load_scalars\(1\) first"):
        mgr.update(1)  # the scalars are loaded by load_scalars (or step), never silently by update
    with pytest.raises(RuntimeError, match="one rank per process folds inside update"):
        mgr.fold_local(1)  # a second fold would add embed's gradient into lm_head's twice
    several = StandInParams.small()
    lanes = OptimizerManager(several.named_parameters(), SMOKE, keep_grads=True, local_ranks=2)
    several.random_grads(seed=0)
    lanes.load_scalars(1)
    with pytest.raises(RuntimeError, match="2 virtual ranks' gradients were not folded"):
        lanes.update(1)
    lanes.fold_local(1)
    lanes.update(1)  # folded: it runs
