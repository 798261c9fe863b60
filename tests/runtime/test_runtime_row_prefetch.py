"""training.Run's row prefetch (SPEEDRUN_ROW_PREFETCH): the next step's n-gram rows are planned and
pulled during this step (across a table event on one process: the rows the event rewrote are then
patched in), the next step uses them instead of planning again, and a prefetch that no longer fits
(other batches, a table change since) stops the step. Losses with the prefetch on and off are compared bit for bit in tests/run/test_run_train.py
(test_overlap_on_and_off_train_bitwise_alike)."""
import pytest
import torch

from data.loader import dummy_batch
from perf import backend as perf_backend
from tools.capture_contract import build_run


@pytest.fixture(scope="module")
def run():
    with perf_backend.use_backend(host_checks=False, row_prefetch=True):
        yield build_run("smoke", seed=0)


def batches(run, step: int, seed: int = 0) -> list:
    tokens = run.schedule.batch_tokens(step) // run.cfg.virtual_world_size
    return [dummy_batch(tokens, run.schedule.doc_cap(step), seed=100 * step + 10 * seed + r, **run.hash_args)
            for r in run.setup.virtual_ranks]


def count_plans(run, monkeypatch) -> list:
    planned = []
    plan = run.exchange.plan

    def counting(ids, lane=0):
        planned.append(ids)
        return plan(ids, lane)

    monkeypatch.setattr(run.exchange, "plan", counting)
    return planned


@pytest.mark.slow
def test_rows_are_pulled_a_step_ahead_and_patched_across_table_events(run, monkeypatch):
    schedule = run.schedule
    assert not schedule.is_table_event(0) and schedule.is_table_event(1) and not schedule.is_table_event(2)
    b = [batches(run, s) for s in range(4)]
    planned = count_plans(run, monkeypatch)
    with perf_backend.use_backend(host_checks=False, row_prefetch=True):
        run.train_step(0, b[0], b[1])       # own 2 plans, then step 1's 2 (step 0 is no table event)
        assert len(planned) == 4 and run.prefetched is not None and run.prefetched.batches is b[1]
        # the prefetched rows are the rows a pull made now returns (the table has not changed)
        for host_batch, pull in zip(b[1], run.prefetched.pulls):
            now = run.exchange.pull(run.table.rows, run.exchange.plan(host_batch.ngram_ids))
            assert torch.equal(pull.finish().view(torch.int16), now.view(torch.int16))
        del planned[:]
        # uses the prefetch; a table event, on one process: step 2's rows pulled ahead all the same,
        # and the event's rewritten rows patched into them
        run.train_step(1, b[1], b[2])
        assert len(planned) == 2 and run.prefetched.batches is b[2]
        assert run.prefetched.version == run.ngram_opt.version
        event_rows = set(run.ngram_opt.last_event[0].tolist())
        patched = 0
        for host_batch, pull in zip(b[2], run.prefetched.pulls):
            now = run.exchange.pull(run.table.rows, run.exchange.plan(host_batch.ngram_ids))
            assert torch.equal(pull.finish().view(torch.int16), now.view(torch.int16))
            patched += len(event_rows & set(pull.plan.unique.tolist()))
        assert patched > 0  # the event rewrote rows the next step reads: the patch did something
        del planned[:]
        run.train_step(2, b[2], b[3])       # uses them, and pulls step 3's ahead
        assert len(planned) == 2 and run.prefetched.batches is b[3]
        run.train_step(3, b[3], None)       # the last step of a loop: nothing ahead
        assert run.prefetched is None


@pytest.mark.slow
def test_a_prefetch_that_no_longer_fits_stops_the_step(run):
    schedule = run.schedule
    step = next(s for s in range(4, 20) if not schedule.is_table_event(s))
    with perf_backend.use_backend(host_checks=False, row_prefetch=True):
        run.train_step(step, batches(run, step), batches(run, step + 1))
        with pytest.raises(RuntimeError, match="batches differ from the next_batches"):
            run.train_step(step + 1, batches(run, step + 1, seed=1))   # equal contents, other objects
        run.train_step(step, batches(run, step), ahead := batches(run, step + 1))
        run.ngram_opt.version += 1          # as a table event or a reset would
        with pytest.raises(RuntimeError, match="n-gram table changed after the rows were prefetched"):
            run.train_step(step + 1, ahead)
