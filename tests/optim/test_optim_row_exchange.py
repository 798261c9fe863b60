"""optim/row_exchange.py and the n-gram row optimizer on 1, 2 and 4 gloo ranks, against independent
references, with no host sync on the device side.

* pull: the rows equal a lookup in the whole table, bit for bit (repeats, empty requests, one rank
  asking nothing, nobody asking anything); bad ids raise IndexError naming the table's range.
* push + row-sparse Adam: a few smoke-schedule steps of random (ids, bf16 gradients) per rank,
  with table events in the middle (after 2-step cycles, one of them empty on every rank) and at the
  end (after a 4-step cycle); the shards equal, bit for bit, a brute-force reference: each rank's
  per-step rows merged by a plain loop, summed per row by plain loops from fp32 zero (each
  sender's cycle in step order, then the senders in rank order: the order of the former
  all-gather implementation), then row_sparse_adam_event on the whole table. The gradients span
  orders of magnitude so that another summation order would show.
* no sync: pull, accumulate and step run under a dispatch mode that fails on every op that would
  make a GPU wait on the host (NoHostSync below); host planning (numpy) happens before it.
"""
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from config import SCHEDULE_PRESETS
from optim.adam import RowAdamState, row_sparse_adam_event
from optim.manager import NgramRowOptimizer, OptimizerManager
from optim.row_exchange import RowExchange
from optim.schedule import TrainingSchedule
from optim.standin import StandInParams

REPO = Path(__file__).resolve().parents[2]
ROWS, DIM = 64, 8
SCHEDULE = TrainingSchedule(SCHEDULE_PRESETS["smoke"])
# smoke schedule (table_period4_step 20): events at 17 and 19 (2-step cycles), then 23 (4 steps)
PUSH_STEPS = range(16, 24)

aten = torch.ops.aten
SYNCING = {aten._local_scalar_dense, aten.nonzero, aten._unique, aten._unique2, aten.unique_dim,
           aten.unique_consecutive, aten.masked_select, aten.equal}
INDEXING = {aten.index, aten.index_put_, aten.index_put, aten._index_put_impl_}


class NoHostSync(TorchDispatchMode):
    """Fails on the ops that read a device value back to the host (`.item()`, `int()`, `bool()`,
    nonzero, unique, masked_select, equal) or index with a boolean mask (a data-dependent size):
    what torch.cuda.set_sync_debug_mode("error") would catch on a GPU."""

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.overloadpacket in SYNCING:
            raise AssertionError(f"host sync: {func}")
        if func.overloadpacket in INDEXING:
            masks = [t for t in args[1] if isinstance(t, torch.Tensor) and t.dtype in (torch.bool, torch.uint8)]
            if masks:
                raise AssertionError(f"boolean-mask indexing (a data-dependent size): {func}")
        return func(*args, **kwargs)


def full_table():
    return torch.randn(ROWS, DIM, generator=torch.Generator().manual_seed(7)).bfloat16()


def requests(rank: int, world: int) -> list[torch.Tensor]:
    """Per call: random ids over the whole table (repeats); rank 0 a hand-picked set across the
    halves, the others ids of the last rank's rows; rank 1 asks nothing while the others ask
    [5, 40, 5]; nobody asks anything."""
    g = torch.Generator().manual_seed(100 + rank)
    calls = [torch.randint(0, ROWS, (40,), generator=g, dtype=torch.int32),
             torch.tensor([63, 0, 31, 32, 0, 63], dtype=torch.int32) if rank == 0
             else torch.randint(ROWS - ROWS // world, ROWS, (9,), generator=g, dtype=torch.int32)]
    calls.append(torch.tensor([5, 40, 5], dtype=torch.int32) if rank != 1 else torch.empty(0, dtype=torch.int32))
    calls.append(torch.empty(0, dtype=torch.int32))
    return calls


def step_grads(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One step's (ids (n,) int32, sink gradient (n, DIM) bf16) of a rank: repeats, nothing at all
    on steps 18-19 (an empty event) and on rank 1's step 21; magnitudes over 2^±20, so that fp32
    sums of three or more of them round, and another summation order would show."""
    g = torch.Generator().manual_seed(1000 * rank + step)
    n = 0 if step in (18, 19) or (rank, step) == (1, 21) else 24
    ids = torch.randint(0, ROWS, (n,), generator=g, dtype=torch.int32)
    grads = torch.randn(n, DIM, generator=g) * torch.exp2(torch.randint(-20, 21, (n, 1), generator=g).float())
    return ids, grads.bfloat16()


def manager() -> OptimizerManager:
    """The optimizer manager of the default process group (its schedule and n-gram hparams)."""
    return OptimizerManager(StandInParams.small(seed=0).named_parameters(), SCHEDULE)


def run_rank(rank: int, world: int) -> dict:
    """This rank's pulls, bad-id message and pushed shard (the same code in-process and in the
    torchrun workers); pull, accumulate and step run under NoHostSync."""
    exchange = RowExchange(ROWS, rank, world, "cpu")
    lo, hi = exchange.lo, exchange.hi
    plans = [exchange.plan(ids) for ids in requests(rank, world)]
    pulled = []
    with NoHostSync():
        for i, plan in enumerate(plans):  # every other pull expands into the caller's leaf (Run's static leaf)
            shard = full_table()[lo:hi].clone()
            if i % 2:
                out = torch.empty(plan.inverse.size, shard.size(1), dtype=shard.dtype, requires_grad=True)
                assert exchange.pull(shard, plan, out=out) is out
                pulled.append(out.detach())
            else:
                pulled.append(exchange.pull(shard, plan))
    try:
        exchange.plan(np.array([3, ROWS], dtype=np.int64))
        bad = ""
    except IndexError as e:
        bad = str(e)
    opt = NgramRowOptimizer(full_table()[lo:hi].clone(), hi - lo, manager(), exchange)
    pushed, push = [], exchange.push

    def recording_push(held, dim):   # keep each event's merged rows: (global ids, fp32 sums)
        rows, sums = push(held, dim)
        pushed.append((rows + lo, sums))
        return rows, sums

    exchange.push = recording_push
    events = []
    for step in PUSH_STEPS:
        ids, grads = step_grads(rank, step)
        plan = exchange.plan(ids)
        with NoHostSync():
            opt.accumulate(plan, grads)
            events.append(opt.step(step))
    return {"pulled": pulled, "bad": bad, "shard": opt.shard, "events": events, "pushed": pushed}


def reference_push(world: int) -> tuple[torch.Tensor, list[dict]]:
    """Brute force: per rank and step, merge rows by a loop; at each event sum each rank's cycle
    per row (step order), then the ranks (rank order), from fp32 zero; Adam on the whole table.
    Returns (the table, per event {row id: fp32 sum})."""
    table, state, held, events = full_table(), RowAdamState.zeros(ROWS), [], []
    hparams = manager().ngram_event_hparams
    for step in PUSH_STEPS:
        merged = []
        for rank in range(world):
            ids, grads = step_grads(rank, step)
            rows = {}
            for i, row in zip(ids.tolist(), grads.float()):
                rows[i] = rows.get(i, torch.zeros(DIM)) + row
            merged.append(rows)
        held.append(merged)
        if not SCHEDULE.is_table_event(step):
            continue
        total = {}
        for rank in range(world):
            cycle = {}
            for merged in held:
                for i, row in merged[rank].items():
                    cycle[i] = cycle.get(i, torch.zeros(DIM)) + row
            for i, row in cycle.items():
                total[i] = total.get(i, torch.zeros(DIM)) + row
        events.append(total)
        ids = sorted(total)
        sums = torch.stack([total[i] for i in ids]) if ids else torch.zeros(0, DIM)
        row_sparse_adam_event(table, state, torch.tensor(ids, dtype=torch.int64), sums,
                              **dict(hparams(step), world_size=world))
        held = []
    return table, events


def check_pulls(results: list[dict], world: int) -> None:
    table = full_table()
    for rank, result in enumerate(results):
        for call, (ids, rows) in enumerate(zip(requests(rank, world), result["pulled"])):
            assert rows.dtype == torch.bfloat16 and rows.shape == (ids.numel(), DIM), (rank, call)
            assert torch.equal(rows, table[ids.long()]), (rank, call)
        assert "row ids span [3, 64], outside the table's rows [0, 64)" in result["bad"], result["bad"]


def check_push(results: list[dict], world: int) -> None:
    assert all(r["events"] == [SCHEDULE.is_table_event(s) for s in PUSH_STEPS] for r in results)
    assert [s for s in PUSH_STEPS if SCHEDULE.is_table_event(s)] == [17, 19, 23]
    reference, sums = reference_push(world)
    for rank, result in enumerate(results):      # each owner's merged gradient rows, bit for bit
        lo, hi = rank * ROWS // world, (rank + 1) * ROWS // world
        for event, ((rows, got), want) in enumerate(zip(result["pushed"], sums)):
            mine = sorted(i for i in want if lo <= i < hi)
            assert rows.tolist() == mine, (rank, event)
            assert all(torch.equal(got[k], want[i]) for k, i in enumerate(mine)), (rank, event)
    assert [len(s) for s in sums][1] == 0 and all(len(s) > 20 for s in sums[::2])   # the middle event is empty
    table = torch.cat([r["shard"] for r in results])
    assert not torch.equal(reference, full_table())
    assert torch.equal(table, reference), f"{world} ranks: {(table != reference).sum().item()} entries differ"


# --- one process -----------------------------------------------------------------------------------

def test_no_host_sync_mode_catches_what_a_gpu_would_wait_for():
    t = torch.arange(6.0)
    for sync in (lambda: t.sum().item(), lambda: int(t[0]), lambda: bool(t.any()), lambda: torch.unique(t),
                 lambda: t.nonzero(), lambda: t[t > 2], lambda: torch.masked_select(t, t > 2),
                 lambda: torch.equal(t, t), lambda: t.index_put_((t > 2,), torch.zeros(())),
                 lambda: torch.unique_consecutive(t)):
        with pytest.raises(AssertionError, match="host sync|boolean-mask"), NoHostSync():
            sync()
    with NoHostSync():   # indexing with planned integer indices is fine
        t.index_select(0, torch.tensor([1, 1])).index_add_(0, torch.tensor([0, 0]), torch.ones(2))


def test_one_process_pulls_and_pushes():
    result = run_rank(0, 1)
    check_pulls([result], 1)
    check_push([result], 1)


@pytest.mark.parametrize("placement", ["device", "host"])
def test_one_process_playing_two_ranks_pushes_their_sums_in_rank_order(placement):
    """One process, two lanes (virtual ranks 0 and 1, RowPlan.lane): each event's merged rows and
    the updated table are bitwise the brute-force reference of 2 ranks (each rank's cycle in step
    order, then the ranks in order), with the table on the device or in host memory."""
    from perf.host_table import HostRows
    exchange = RowExchange(ROWS, 0, 1, "cpu", lanes=2)
    mgr = OptimizerManager(StandInParams.small(seed=0).named_parameters(), SCHEDULE, local_ranks=2)
    shard = full_table().clone()
    if placement == "host":
        shard = HostRows(ROWS, DIM, torch.bfloat16, "cpu")
        shard.data.copy_(full_table())
    opt = NgramRowOptimizer(shard, ROWS, mgr, exchange)
    pushed, push = [], exchange.push

    def recording_push(held, dim):
        rows, sums = push(held, dim)
        pushed.append((rows, sums))
        return rows, sums

    exchange.push = recording_push
    for step in PUSH_STEPS:
        for lane in range(2):
            ids, grads = step_grads(lane, step)
            opt.accumulate(exchange.plan(ids, lane), grads)
        opt.step(step)
    reference, sums = reference_push(2)
    for (rows, got), want in zip(pushed, sums):
        assert rows.tolist() == sorted(want)
        assert all(torch.equal(got[k], want[i]) for k, i in enumerate(sorted(want)))
    table = shard.host_tensor() if placement == "host" else shard
    assert torch.equal(table, reference), f"{(table != reference).sum().item()} entries differ"
    # the old single-lane order (both ranks' steps interleaved in one cycle) does not give these sums
    interleaved = RowExchange(ROWS, 0, 1, "cpu")
    held = []
    for step in range(16, 18):
        for lane in range(2):
            ids, grads = step_grads(lane, step)
            plan = interleaved.plan(ids)
            merged = torch.zeros(plan.unique.size, DIM).index_add_(0, plan.inverse_dev, grads.float())
            held.append((plan, merged))
    _, mixed = interleaved.push(held, DIM)
    assert not torch.equal(mixed, pushed[0][1])


def test_close_stops_the_prep_thread_and_plans_still_match():
    """A plan prepared ahead on the prep thread equals the plan made in place (np.unique as the
    reference); close() stops the thread, and a later plan still works."""
    import threading

    def prep_threads():  # other tests' exchanges may still hold theirs: count only this one's
        return {t for t in threading.enumerate() if t.name.startswith("row-plans")} - before

    before = {t for t in threading.enumerate() if t.name.startswith("row-plans")}
    ids = torch.tensor([7, 3, 7, 60, 3, 0], dtype=torch.int32)
    exchange = RowExchange(ROWS, 0, 1, "cpu")
    exchange.prepare(ids)
    plan = exchange.plan(ids)
    unique, inverse = np.unique(ids.numpy().astype(np.int64), return_inverse=True)
    assert np.array_equal(plan.unique, unique) and np.array_equal(plan.inverse, inverse)
    assert prep_threads()
    exchange.close()
    assert not prep_threads()
    assert np.array_equal(exchange.plan(ids).unique, unique)
    exchange.close()


def test_bad_requests_are_caught_on_the_host():
    exchange = RowExchange(ROWS, 0, 1, "cpu")
    with pytest.raises(IndexError, match=r"row ids span \[-1, 5\], outside the table's rows \[0, 64\)"):
        exchange.plan(torch.tensor([5, -1], dtype=torch.int32))
    with pytest.raises(ValueError, match="host tensor"):
        exchange.plan(torch.zeros(3, dtype=torch.int64, device="meta"))
    with pytest.raises(ValueError, match=r"1-D \[N\]"):
        exchange.plan(torch.zeros(2, 3, dtype=torch.int64))
    with pytest.raises(ValueError, match="table_shard"):
        exchange.pull(full_table()[:10], exchange.plan([1]))
    with pytest.raises(ValueError, match=r"out must be torch.bfloat16 \[1, \d+\]"):
        exchange.pull(full_table(), exchange.plan([1]), out=torch.empty(2, 4))
    with pytest.raises(ValueError, match="do not shard evenly"):
        RowExchange(ROWS + 1, 0, 2, "cpu")
    plan = exchange.plan(np.array([9, 2, 9]))
    assert plan.unique.tolist() == [2, 9] and plan.inverse.tolist() == [1, 0, 1] and plan.ask_counts == (2,)


@pytest.mark.gpu
def test_cuda_plan_pull_and_push_make_no_host_sync():
    """On a GPU, under torch.cuda.set_sync_debug_mode("error") (which also catches what the CPU
    mode cannot: pageable or device-to-host copies, stream synchronizations), the whole cycle
    runs, planning included; pulls are bit-exact; with small-integer gradients (exact fp32 sums in
    any order, so index_add_'s atomics cannot reorder them) the merged rows equal the CPU ones
    bit for bit and the shard is within one bf16 ulp (the Adam's row mean reduces in another order)."""
    results = {}
    for device in ("cpu", "cuda"):
        exchange = RowExchange(ROWS, 0, 1, device)
        opt = NgramRowOptimizer(full_table().to(device), ROWS, manager(), exchange)
        pushed, push = [], exchange.push
        exchange.push = lambda held, dim: pushed.append(push(held, dim)) or pushed[-1]
        steps = []                       # (ids on the host, gradient on the device), made beforehand
        for step in PUSH_STEPS:
            ids, _ = step_grads(0, step)
            grads = torch.randint(-8, 9, (ids.numel(), DIM), generator=torch.Generator().manual_seed(step))
            steps.append((step, ids, grads.bfloat16().to(device)))
        pulled = []
        previous = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("error" if device == "cuda" else previous)
        try:
            for step, ids, grads in steps:
                plan = exchange.plan(ids)
                pulled.append(exchange.pull(opt.shard, plan))
                opt.accumulate(plan, grads)
                opt.step(step)
            if device == "cuda":   # the check is live
                with pytest.raises(RuntimeError, match="synchroniz"):
                    torch.ones(1, device=device).item()
        finally:
            torch.cuda.set_sync_debug_mode(previous)
        results[device] = ([t.cpu() for t in pulled], [(r.cpu(), s.cpu()) for r, s in pushed], opt.shard.cpu())
    (cpu_pulled, cpu_pushed, cpu_shard), (gpu_pulled, gpu_pushed, gpu_shard) = results["cpu"], results["cuda"]
    assert all(torch.equal(a, b) for a, b in zip(cpu_pulled, gpu_pulled))
    assert len(gpu_pushed) == 3 and all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
                                        for a, b in zip(cpu_pushed, gpu_pushed))
    torch.testing.assert_close(gpu_shard.float(), cpu_shard.float(), rtol=2.0**-7, atol=1e-6)


# --- 2 and 4 gloo ranks ------------------------------------------------------------------------------

WORKER = textwrap.dedent('''
    import datetime, sys
    import torch, torch.distributed as dist
    sys.path.insert(0, sys.argv[1])
    from test_optim_row_exchange import run_rank

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))  # torchrun's env://
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.save(run_rank(rank, world), f"{sys.argv[2]}.{rank}")
    # every rank past its last collective before any tears gloo down: a rank that exits while a
    # peer is still in its final exchange can abort in gloo's teardown ("terminate called without
    # an active exception", seen once in 4-rank CI runs on 2 cores)
    dist.barrier()
    dist.destroy_process_group()
''')


@pytest.fixture(scope="module", params=[2, 4], ids=["2ranks", "4ranks"])
def ranks(request, tmp_path_factory):
    """(world, every rank's run_rank result) from one torchrun launch per world size."""
    world, tmp = request.param, tmp_path_factory.mktemp(f"rows{request.param}")
    script, out = tmp / "worker.py", tmp / "result"
    script.write_text(WORKER)
    # torchrun --standalone picks a free port itself
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
           str(script), str(Path(__file__).parent), str(out)]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=150,
                          env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    return world, [torch.load(f"{out}.{r}", weights_only=False) for r in range(world)]


@pytest.mark.distributed
def test_ranks_pull_a_lookup_of_the_whole_table(ranks):
    world, results = ranks
    check_pulls(results, world)


@pytest.mark.distributed
def test_ranks_push_and_adam_equal_a_brute_force_reference(ranks):
    world, results = ranks
    check_push(results, world)
