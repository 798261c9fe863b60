"""Sharded optimizer and tail averages on 2 and 4 gloo ranks leave the same parameters as one
process.

Every rank sees identical gradients, so the averaged gradient equals the single-process one
exactly; each rank updates whole matrices (banks) or whole rows (Adam shards) with the same
arithmetic per matrix/row, so the result is expected bitwise. The run is the whole smoke schedule
(70 steps: every stage, the table cadence switch, the rail engage step, the embed split, the tail
windows and the ship); the small stand-in's banks (6, 3 and 8 matrices) are padded on 4 and 2
ranks. An n-gram table of 64 rows is sharded 64/W rows per rank, with bf16 sink gradients
(whose fp32 sums are exact in any order).

The same run with deferred gathers (defer_gathers: the unpadded banks' all-gathers launched after
the update and waited at the next step's top, as train_gpt does) leaves the same parameters."""
import textwrap

import pytest
import torch

from optim.standin import StandInParams
from tests.gloo_workers import run_workers


WORKER = textwrap.dedent('''
    import datetime, sys
    import torch, torch.distributed as dist
    from config import SCHEDULE_PRESETS
    from optim.manager import NgramRowOptimizer, OptimizerManager, RowExchange
    from optim.schedule import TrainingSchedule
    from optim.standin import StandInParams
    from optim.tail_average import TailAverages

    rank, world, port, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    if world > 1:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world, timeout=datetime.timedelta(seconds=60))
    torch.set_num_threads(1)
    model = StandInParams.small(seed=0)
    sched = TrainingSchedule(SCHEDULE_PRESETS["smoke"])
    defer = out.endswith("_defer")
    mgr = OptimizerManager(model.named_parameters(), sched, frozen_matrices={"mlp_bank": {2, 3}},
                           defer_gathers=defer)
    tails = TailAverages(mgr, sched)
    table = (torch.randn(64, 32, generator=torch.Generator().manual_seed(1)) * 0.02).bfloat16()
    rows = 64 // world
    exchange = RowExchange(64, rank, world, "cpu")
    ngram = NgramRowOptimizer(table[rank * rows:(rank + 1) * rows].clone(), rows, mgr, exchange)
    refused = None
    for step in range(sched.total_steps):
        if step == 1 and mgr._in_flight:  # a step before the wait is refused, state untouched
            try:
                mgr.step(step)
            except RuntimeError as e:
                refused = str(e)
        mgr.wait_gathers()                   # training.Run.flush, at the top of the next step
        model.random_grads(seed=step)        # identical on every rank
        g = torch.Generator().manual_seed(1000 + step)
        ngram.accumulate(exchange.plan(torch.randint(0, 64, (24,), generator=g, dtype=torch.int32)),
                         torch.randn(24, 32, generator=g).bfloat16())
        mgr.step(step, rows=ngram)           # the update, the deferred gathers' launch, the table event
        tails.tick(step)                     # this rank's rows are final while the gathers fly
    tails.ship()                             # waits for the last step's gathers first
    saved = {n: p.detach().clone() for n, p in model.named_parameters()}
    saved["ngram_shard"] = ngram.shard
    saved["deferred"], saved["refused"] = mgr.deferred, refused
    torch.save(saved, f"{out}.{rank}")
    if world > 1:
        dist.barrier()  # no rank tears gloo down while a peer is still in a collective
        dist.destroy_process_group()
''')


def run_ranks(tmp_path, world: int, logs: list | None = None, defer: bool = False) -> list[dict]:
    out = tmp_path / f"params_w{world}{'_defer' if defer else ''}"
    worker_logs = run_workers(WORKER, tmp_path, world, out)
    if logs is not None:
        logs.extend(worker_logs)
    return [torch.load(f"{out}.{r}") for r in range(world)]


@pytest.mark.distributed
@pytest.mark.slow
def test_sharded_ranks_match_one_process(tmp_path):
    reference = run_ranks(tmp_path, 1)[0]
    logs = []
    for world in (2, 4):
        results = run_ranks(tmp_path, world, logs)
        for rank, params in enumerate(results):
            for name, ref in reference.items():
                if name not in ("ngram_shard", "deferred", "refused"):
                    assert torch.equal(params[name], ref), f"{name} differs on rank {rank} of {world}"
        # the n-gram table: each rank owns a contiguous row range
        table = torch.cat([params["ngram_shard"] for params in results])
        assert torch.equal(table, reference["ngram_shard"]), f"n-gram table differs on {world} ranks"
    # and the run really moved every trained parameter
    start = dict(StandInParams.small(seed=0).named_parameters())
    moved = [n for n in start if not torch.equal(reference[n], start[n])]
    assert set(moved) == set(start), set(start) - set(moved)
    init_table = (torch.randn(64, 32, generator=torch.Generator().manual_seed(1)) * 0.02).bfloat16()
    assert not torch.equal(reference["ngram_shard"], init_table)
    # the collectives use torch's current names where it has them (no FutureWarning every step)
    assert not any("FutureWarning" in log for log in logs), next(log for log in logs if "FutureWarning" in log)[-2000:]


@pytest.mark.distributed
@pytest.mark.slow
def test_deferred_gathers_leave_the_same_parameters(tmp_path):
    """defer_gathers on 2 ranks (the stand-in's qk and mlp banks divide by 2 and are deferred; the
    padded vo bank keeps its gather inside the step): bitwise the parameters of one process, and a
    step called while gathers are in flight is refused, naming them."""
    reference = run_ranks(tmp_path, 1)[0]
    assert reference["deferred"] == ()  # one process: nothing to gather
    for rank, params in enumerate(run_ranks(tmp_path, 2, defer=True)):
        assert params["deferred"] == ("qk_bank", "mlp_bank"), params["deferred"]
        assert "deferred gathers of ['qk_bank', 'mlp_bank'] were never waited" in params["refused"], params["refused"]
        for name, ref in reference.items():
            if name not in ("ngram_shard", "deferred", "refused"):
                assert torch.equal(params[name], ref), f"{name} differs on rank {rank} with deferred gathers"
