"""tools/bench_host.py and the host work it times (issue 22, item 3), each optimisation against the
path it replaced:

* the bench runs at a tiny size and prints every part, finite;
* the row plan's packed sort (`unique_inverse`) equals np.unique;
* a plan prepared ahead on the prep thread equals the plan made in step, and `plan` does not redo
  its sort; a table event's push routes prepared ahead equal those planned at the event, and so do
  the pushed sums;
* the optimizer's scalar table (one copy per step) holds, after every load, bitwise the values the
  former fill_ per scalar wrote;
* the staging ring and the batch ring's extra tensors copy the exact bytes and never rewrite a slot
  whose copy is in flight;
* in a run (the bench's, on "meta"), a table event prepares the next step's plans and the step
  before it the event's push routes, and the step then uses them.
"""
import math
import threading

import numpy as np
import pytest
import torch

from config import RUN_PRESETS, SCHEDULE_PRESETS, OptimConfig
from data.loader import dummy_batch
from perf import backend as perf_backend
from optim.adam import adam_step_scalars
from optim.manager import NgramRowOptimizer, OptimizerManager
import optim.row_exchange as row_exchange
from optim.row_exchange import RowExchange, plan_push, unique_inverse
from optim.schedule import TrainingSchedule
from optim.standin import StandInParams
from tools import bench_host
from perf import streams
from perf.pinned_batches import PinnedBatchRing, PinnedStaging

ROWS, DIM = 64, 8
SMOKE = TrainingSchedule(SCHEDULE_PRESETS["smoke"])


def threads_of(monkeypatch, name: str) -> list[str]:
    """Record the thread of every call of optim.row_exchange.<name> (looked up at call time)."""
    seen, fn = [], getattr(row_exchange, name)

    def recorded(*args, **kwargs):
        seen.append(threading.current_thread().name)
        return fn(*args, **kwargs)

    monkeypatch.setattr(row_exchange, name, recorded)
    return seen


# ----------------------------------------------------------------------------------------------------
# the bench
# ----------------------------------------------------------------------------------------------------


def test_the_bench_runs_at_a_tiny_size_and_prints_every_part(capsys):
    report = bench_host.main(["--config", "smoke", "--steps", "4", "--warmup-steps", "1"])
    out = capsys.readouterr().out
    assert len(report.steps) == 4 and report.events == sum(SMOKE.is_table_event(s) for s in report.steps)
    for key, label in bench_host.PARTS:
        assert label in out, label
        for ms in (report.cpu_ms[key], report.wall_ms[key]):
            assert math.isfinite(ms) and ms >= -0.05, (key, ms)  # exclusive times: rounding may dip below 0
    assert report.cpu_ms["plans"] > 0 and report.cpu_ms["uploads"] > 0 and report.cpu_ms["load_scalars"] > 0
    assert math.isclose(report.cpu_total, sum(report.cpu_ms.values()))
    total_line = next(line for line in out.splitlines() if line.startswith("total"))
    assert float(total_line.split()[1]) == pytest.approx(report.cpu_total, abs=0.01)


def test_the_bench_refuses_a_step_outside_the_schedule(capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench_host.main(["--config", "smoke", "--start", "70"])
    assert exit_info.value.code == 2
    assert "--start 70: must be a step of the smoke preset [0, 70)" in capsys.readouterr().err


# ----------------------------------------------------------------------------------------------------
# row plans
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("n, bound", [(0, 10), (1, 10), (7, 3), (5000, 300), (98304, 84_602_880), (9, 1 << 61)])
def test_the_packed_sort_gives_np_uniques_distinct_ids_and_inverse(n, bound):
    ids = np.random.default_rng(n).integers(0, bound, n, dtype=np.int64)  # (9, 2^61): np.unique's fallback
    unique, inverse = unique_inverse(ids, bound)
    want_unique, want_inverse = np.unique(ids, return_inverse=True)
    assert unique.dtype == inverse.dtype == np.int64
    np.testing.assert_array_equal(unique, want_unique)
    np.testing.assert_array_equal(inverse, want_inverse.reshape(-1))


def _assert_same_plan(got, want):
    for field in ("unique", "inverse", "served"):
        np.testing.assert_array_equal(getattr(got, field), getattr(want, field), err_msg=field)
    assert (got.ask_counts, got.serve_counts) == (want.ask_counts, want.serve_counts)
    if got.inverse_dev.device.type != "meta":
        assert torch.equal(got.inverse_dev, want.inverse_dev) and torch.equal(got.served_dev, want.served_dev)


@pytest.mark.parametrize("device", ["cpu", "meta"])  # meta: through the staging ring, as on a GPU
def test_a_plan_prepared_ahead_equals_the_plan_made_in_step(device, monkeypatch):
    g = torch.Generator().manual_seed(0)
    requests = [torch.randint(0, ROWS, (n,), generator=g, dtype=torch.int32) for n in (40, 0, 17, 40)]
    fresh = RowExchange(ROWS, 0, 1, device)
    want = [fresh.plan(ids) for ids in requests]
    exchange = RowExchange(ROWS, 0, 1, device)
    sorts = threads_of(monkeypatch, "split_requests")
    for ids in requests:
        exchange.prepare(ids)
    got = [exchange.plan(ids) for ids in requests]
    assert len(sorts) == 4 and all(name.startswith("row-plans") for name in sorts), sorts  # the prep thread's
    for g_plan, w_plan in zip(got, want):
        _assert_same_plan(g_plan, w_plan)
    # a request never prepared is planned in step; one prepared and left (the loop changed its
    # batches) is dropped when a later one is planned
    other = torch.randint(0, ROWS, (9,), generator=g, dtype=torch.int32)
    exchange.prepare(requests[0])
    exchange.prepare(requests[2])
    _assert_same_plan(exchange.plan(other), fresh.plan(other))
    assert len(exchange._prepared) == 2
    _assert_same_plan(exchange.plan(requests[2]), want[2])
    assert len(exchange._prepared) == 0


def test_a_prepared_plan_with_a_bad_id_raises_where_it_is_planned():
    exchange = RowExchange(ROWS, 0, 1, "cpu")
    bad = torch.tensor([3, ROWS], dtype=torch.int32)
    exchange.prepare(bad)
    with pytest.raises(IndexError, match=rf"outside the table's rows \[0, {ROWS}\)"):
        exchange.plan(bad)


def _cycle(seed: int, steps: int = 4):
    g = torch.Generator().manual_seed(seed)
    ids = [torch.randint(0, ROWS, (24,), generator=g, dtype=torch.int32) for _ in range(steps)]
    grads = [torch.randn(24, DIM, generator=g).bfloat16() for _ in range(steps)]
    return ids, grads


def test_push_routes_prepared_ahead_equal_those_planned_at_the_event(monkeypatch):
    ids, grads = _cycle(seed=1)
    results, route_threads = [], []
    for ahead in (False, True):
        mgr = OptimizerManager(StandInParams.small(seed=0).named_parameters(), SMOKE)
        exchange = RowExchange(ROWS, 0, 1, "cpu")
        opt = NgramRowOptimizer(torch.zeros(ROWS, DIM), ROWS, mgr, exchange)
        calls = threads_of(monkeypatch, "plan_push")
        plans = [exchange.plan(x) for x in ids]
        for k, (plan, grad) in enumerate(zip(plans, grads)):
            if ahead and k == len(plans) - 2:   # Run.prefetch of the step before the event
                exchange.expect_push(plans[-1:])
            opt.accumulate(plan, grad)
        routes = plan_push(plans, exchange.starts)  # the reference (this module's name: not recorded)
        results.append(exchange.push(opt._held, DIM))
        route_threads.append(list(calls))
        monkeypatch.undo()
    assert route_threads[0] == ["MainThread"]                # at the event, in step
    assert len(route_threads[1]) == 1 and route_threads[1][0].startswith("row-plans")  # once, ahead
    (rows_a, sums_a), (rows_b, sums_b) = results
    assert torch.equal(rows_a, rows_b) and torch.equal(sums_a.view(torch.int32), sums_b.view(torch.int32))
    assert torch.equal(rows_a, torch.from_numpy(routes.rows))


def test_push_routes_prepared_for_other_plans_are_not_used(monkeypatch):
    ids, grads = _cycle(seed=2)
    mgr = OptimizerManager(StandInParams.small(seed=0).named_parameters(), SMOKE)
    exchange = RowExchange(ROWS, 0, 1, "cpu")
    opt = NgramRowOptimizer(torch.zeros(ROWS, DIM), ROWS, mgr, exchange)
    plans = [exchange.plan(x) for x in ids]
    exchange.expect_push([exchange.plan(ids[-1])])  # announced, but the step holds another plan object
    for plan, grad in zip(plans, grads):
        opt.accumulate(plan, grad)
    calls = threads_of(monkeypatch, "plan_push")
    rows, sums = exchange.push(opt._held, DIM)
    assert calls == ["MainThread"]
    want = plan_push(plans, exchange.starts)
    assert torch.equal(rows, torch.from_numpy(want.rows))


# ----------------------------------------------------------------------------------------------------
# the optimizer's scalar table
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bank_optimizer", ["anvil", "normuon"])
def test_the_scalar_table_holds_the_fill_paths_values_bitwise(bank_optimizer):
    """The former load_scalars, written out here: a fill_ of each due scalar with the host value
    (Adam step counts kept by the reference itself), the others left as they were."""
    model = StandInParams.small(seed=0)
    mgr = OptimizerManager(model.named_parameters(), SMOKE, OptimConfig(bank_optimizer=bank_optimizer),
                           keep_grads=True)
    ref = {(n, k): torch.zeros(()) for n, e in mgr.entries.items() for k, t in e.scalars.items() if t.dim() == 0}
    counts = {n: 0 for n in mgr.entries}
    steps = list(range(0, 6)) + list(range(17, 25)) + [SMOKE.split_step - 1, SMOKE.split_step]
    for step in steps:
        model.random_grads(seed=step)
        for name in mgr._due(step):
            e = mgr.entries[name]
            if e.rule.optim == "bank":
                h = mgr.bank_scalars(e, step)
                values = {"momentum": h.momentum, "eff_wd": h.eff_wd, "fast_beta": h.fast_beta,
                          "momentum_lerp": 1 - h.momentum}
            else:
                counts[name] += 1
                betas, lr, wd = mgr.adam_hparams(e, step)
                step_size, decay = adam_step_scalars(lr, betas, counts[name], wd)
                values = {"step_size": step_size, "decay": decay}
            for k, v in values.items():
                ref[(name, k)].fill_(v)
        mgr.load_scalars(step)
        for (name, k), want in ref.items():
            got = mgr.entries[name].scalars[k]
            assert got.dtype == torch.float32 and got.dim() == 0
            assert torch.equal(got.view(torch.int32), want.view(torch.int32)), (step, name, k, got, want)
        assert [e.state.step for e in mgr.entries.values() if e.rule.optim == "adam"] == \
            [counts[n] for n, e in mgr.entries.items() if e.rule.optim == "adam"]
    # one table: every 0-D scalar a view of it
    table = mgr._scalar_table.device
    assert all(t._base is table for e in mgr.entries.values() for t in e.scalars.values() if t.dim() == 0)


# ----------------------------------------------------------------------------------------------------
# staging rings
# ----------------------------------------------------------------------------------------------------


class FakeEvent(streams.Event):
    """A copy in flight until the test says it retired (synchronize retires it). The stream checks'
    event underneath (perf/streams.py): they see the slot free only once it retired."""

    def __init__(self, log: list):
        super().__init__("cpu")
        self.log, self.in_flight = log, False

    def record(self, stream=None):
        super().record(stream)
        self.in_flight = True

    def query(self):
        return not self.in_flight and super().query()

    def synchronize(self):
        self.log.append(self)
        self.in_flight = False
        super().synchronize()


def test_staging_copies_the_arrays_and_reuses_its_slots_once_their_copies_retire():
    log = []
    staging = PinnedStaging("cpu", slots=2, event_factory=lambda: FakeEvent(log))
    a, b = np.arange(5, dtype=np.int64), np.arange(100, 103, dtype=np.int64)
    got = staging.to_device([a, b], torch.int64)
    assert torch.equal(got, torch.tensor([0, 1, 2, 3, 4, 100, 101, 102]))
    assert got.data_ptr() != staging.slots[0].buffers[torch.int64].data_ptr()  # a fresh tensor, not the slot
    out = torch.empty(3, dtype=torch.float32)
    assert staging.to_device([np.array([0.1, 0.2, 0.3], dtype=np.float32)], torch.float32, out=out) is out
    assert torch.equal(out, torch.tensor([0.1, 0.2, 0.3]))
    assert log == []                              # two slots, two copies: nothing waited yet
    slot0 = staging.slots[0].event
    staging.slots[1].event.in_flight = False      # slot 1's copy retired on its own
    staging.to_device([a], torch.int64)           # slot 0 again: its copy is waited for first
    assert log == [slot0] and staging.waits == 1
    staging.to_device([a], torch.int64)           # slot 1: retired, no wait
    assert staging.waits == 1
    with pytest.raises(ValueError, match=r"out must be torch.float32 \[2\] on cpu"):
        staging.to_device([a[:2]], torch.float32, out=torch.empty(3))


def test_the_batch_ring_carries_extra_tensors_in_the_batchs_slot():
    ring = PinnedBatchRing("cpu")
    batch = dummy_batch(64, 16, seed=0, ngram_half_rows=1000, sign_pool_rows=64)
    candidates = torch.arange(0, 200, 3)
    moved, extra = ring.upload(batch, candidates=candidates)
    assert torch.equal(extra["candidates"], candidates) and extra["candidates"].data_ptr() != candidates.data_ptr()
    assert torch.equal(moved.inputs, batch.inputs) and torch.equal(moved.ngram_ids, batch.ngram_ids)
    assert ring.slots[0].buffers["candidates"].numel() == candidates.numel()
    moved, extra = ring.upload(batch)
    assert extra == {} and torch.equal(moved.targets, batch.targets)
    with pytest.raises(ValueError, match=r"extra tensors \['inputs'\] share a name"):
        ring.upload(batch, inputs=candidates)


# ----------------------------------------------------------------------------------------------------
# in a run: plans and push routes made ahead, then used
# ----------------------------------------------------------------------------------------------------


def test_a_run_plans_ahead_around_table_events_and_uses_what_it_planned(monkeypatch):
    cfg = RUN_PRESETS["smoke"]
    schedule = SMOKE
    event = next(s for s in range(24, 40) if schedule.is_table_event(s))   # a 4-step cycle's event
    assert not schedule.is_table_event(event - 1) and not schedule.is_table_event(event + 1)
    world = cfg.virtual_world_size
    backend = perf_backend.current()

    def batches(step):
        tokens = schedule.batch_tokens(step) // world
        return [dummy_batch(tokens, schedule.doc_cap(step), seed=step, ngram_half_rows=cfg.model.ngram_rows // 2,
                            sign_pool_rows=cfg.model.ngram_sign_rows)]

    with bench_host.StandInCollectives(0, world).installed():
        run = bench_host.host_run(cfg, 0, world, backend)
        b = {s: batches(s) for s in range(event - 2, event + 3)}
        sorts, routes = threads_of(monkeypatch, "split_requests"), threads_of(monkeypatch, "plan_push")
        run.train_step(event - 2, b[event - 2], b[event - 1])
        run.train_step(event - 1, b[event - 1], b[event])       # announces the event's last plans
        assert run.exchange._push_upcoming == [p.plan for p in run.prefetched.pulls]
        del sorts[:]
        run.train_step(event, b[event], b[event + 1])           # the event: pushes, prepares step event+1
        assert len(routes) == 1 and routes[0].startswith("row-plans"), routes   # planned ahead, not at the event
        assert run.prefetched is None and [ids for ids, _ in run.exchange._prepared] == [b[event + 1][0].ngram_ids]
        run.exchange._prepared[0][1].result()
        assert len(sorts) == 1 and sorts[0].startswith("row-plans"), sorts
        del sorts[:]
        used = []
        upload = run.upload

        def recording_upload(*args, **kwargs):
            out = upload(*args, **kwargs)
            used.append(out[1])
            return out

        monkeypatch.setattr(run, "upload", recording_upload)
        run.train_step(event + 1, b[event + 1], b[event + 2])
        assert sorts == ["MainThread"], sorts   # only the next step's (pulled now): this step's was done ahead
        fresh = RowExchange(cfg.model.ngram_rows, 0, world, "meta").plan(b[event + 1][0].ngram_ids)
        _assert_same_plan(used[0], fresh)
