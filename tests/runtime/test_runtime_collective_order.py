"""One order of collectives on every rank (runtime/collective_order.py, issue 22 item 2).

* The comparison itself, on hand-built sequences: a swap, a missing collective, all_to_all rows a
  peer does not expect, a group that does not span every rank.
* The optimizer's NCCL branch (reduce_scatter_single instead of gloo's all-reduce and view) on
  torch's fake process group at 8 ranks, the record's world size: the sequence of one Adam step
  against hand-computed sizes, and this rank's rows bitwise those of one process and of the gloo
  branch (the fake group hands each rank the data as if every rank held the same gradient).
* 2 gloo ranks: the manager and the row exchange in a training step's order pass the check; a
  row pull left in flight across the optimizer region breaks the ordering rule; one rank launching
  two collectives in swapped order is named at the first differing collective, on both ranks; and
  the NCCL branch of the reduce-scatter (get_backend reading "nccl") leaves the parameters of the
  gloo branch bit for bit.
"""
import textwrap
from unittest import mock

import pytest
import torch
import torch.distributed as dist

from runtime.collective_order import Collective, CollectiveOrderError, CollectiveRecorder, compare_sequences
from tests.gloo_workers import run_workers
from perf.collectives import reduce_scatter_single


def collective(index, op="allreduce_", group="gloo group 0", numel=4, dtype="float32", send=(), recv=(),
               waited_before=None, size=2, where="training step 1, between regions"):
    return Collective(index=index, op=op, group=group, group_size=size, numel=numel, dtype=dtype,
                      row_shape=(8,) if send else (), send_rows=send, recv_rows=recv, region=None, call=None,
                      in_fn=False, where=where, launched=index, waited=index,
                      waited_before=index + 1 if waited_before is None else waited_before)


# ----------------------------------------------------------------------------------------------------
# the comparison
# ----------------------------------------------------------------------------------------------------
def test_equal_sequences_pass_and_a_swap_is_named_at_its_first_index():
    a = [collective(0), collective(1, op="_allgather_base_", numel=6, dtype="bfloat16"), collective(2)]
    assert compare_sequences([a, list(a)]) == []
    b = [a[0], collective(1, numel=4), collective(2, op="_allgather_base_", numel=6, dtype="bfloat16")]
    (problem,) = compare_sequences([a, b])
    assert problem.splitlines() == [
        "collective order differs between ranks at collective #1 (ranks issued [3, 3] collectives; NCCL would "
        "hang or mix up the tensors here):",
        "  rank 0: #1 _allgather_base_ on gloo group 0: 6 x bfloat16, outside regions, waited at once, at "
        "training step 1, between regions",
        "  rank 1: #1 allreduce_ on gloo group 0: 4 x float32, outside regions, waited at once, at training "
        "step 1, between regions"]


def test_a_shorter_sequence_a_late_wait_and_only_the_differing_ranks_are_named():
    a = [collective(0, size=3), collective(1, size=3)]
    (problem,) = compare_sequences([a, a, a[:1]])
    assert problem.splitlines()[1:] == ["  rank 0: #1 allreduce_ on gloo group 0: 4 x float32, outside regions, "
                                        "waited at once, at training step 1, between regions",
                                        "  rank 2: nothing (it issued only 1)"]
    a = [collective(0), collective(1)]
    late = [collective(0, waited_before=2), collective(1)]     # waited after the next launch
    (problem,) = compare_sequences([a, late])
    assert "collective #0" in problem and "waited before #2" in problem


def test_all_to_all_rows_must_match_what_the_peer_expects():
    # rank 0 sends 3 rows to itself and 1 to rank 1; rank 1 sends 2 to rank 0 and 5 to itself
    ok = [[collective(0, op="alltoall_base_", numel=32, send=(3, 1), recv=(3, 2))],
          [collective(0, op="alltoall_base_", numel=56, send=(2, 5), recv=(1, 5))]]
    assert compare_sequences(ok) == []       # per-rank sizes differ by design: rows, not totals, agree
    bad = [ok[0], [collective(0, op="alltoall_base_", numel=56, send=(2, 5), recv=(2, 5))]]
    assert compare_sequences(bad) == ["all_to_all #0 on gloo group 0: rank 0 sends 1 rows to rank 1, which expects 2 "
                                      "(at training step 1, between regions)"]


def test_a_group_that_does_not_span_every_rank_is_refused_by_name():
    seq = [collective(0, group="gloo group 3", size=1)]
    (problem,) = compare_sequences([seq, seq])
    assert problem.startswith("collective order: gloo group 3 spans 1 of 2 ranks; the check compares whole sequences")


# ----------------------------------------------------------------------------------------------------
# the NCCL branch on torch's fake process group (one process, 8 ranks)
# ----------------------------------------------------------------------------------------------------
def _two_steps(manager, model):
    for step in (0, 1):                      # banks only, then an Adam step with a value_embeds event
        model.random_grads(seed=step)        # identical on every rank
        manager.step(step)


def test_the_nccl_branch_on_a_fake_group_of_8_ranks_shards_like_one_process():
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from config import SCHEDULE_PRESETS
    from optim.adam import EMBED
    from optim import manager as optim_manager
    from optim.manager import OptimizerManager
    from optim.schedule import TrainingSchedule
    from optim.standin import StandInParams

    sched = TrainingSchedule(SCHEDULE_PRESETS["smoke"])
    reference = StandInParams.small(seed=0)
    _two_steps(OptimizerManager(reference.named_parameters(), sched), reference)   # one process
    rank = 2   # its qk, vo and mlp matrices exist (vo's 3 are padded to 8)
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=8)
    wait = torch._C._distributed_c10d.Work.__dict__["wait"]
    try:
        nccl_model, gloo_model = StandInParams.small(seed=0), StandInParams.small(seed=0)
        nccl = OptimizerManager(nccl_model.named_parameters(), sched)
        recorder = CollectiveRecorder(lambda: "step")
        fake_reduce_scatter = optim_manager.reduce_scatter_single

        def identical_ranks(out, full, *args, **kwargs):
            # every rank holds the same gradient, so the AVG reduce-scatter is this rank's chunk of
            # it; the fake group writes that itself in torch 2.13, and leaves `out` as allocated
            # (uninitialized) in torch 2.10, the record's: written here for both
            work = fake_reduce_scatter(out, full, *args, **kwargs)
            out.copy_(full.chunk(dist.get_world_size())[rank])
            return work

        with recorder, mock.patch.object(optim_manager, "reduce_scatter_single", identical_ranks):
            _two_steps(nccl, nccl_model)         # get_backend() is "fake": the NCCL branch
        gloo = OptimizerManager(gloo_model.named_parameters(), sched)
        with mock.patch.object(dist, "get_backend", lambda group=None: "gloo"):
            _two_steps(gloo, gloo_model)
    finally:
        dist.destroy_process_group()
    assert torch._C._distributed_c10d.Work.__dict__["wait"] is wait   # the recorder put Work.wait back

    # step 1 (hand-computed from StandInParams.small: dim 32, vocab 96): 13 replicated all-reduces,
    # then the reduce-scatters in SCATTER_ORDER of the padded tensors, then each shard's gather
    ops = [(c.op, c.numel, c.dtype) for c in recorder.collectives]
    assert ops[:6] == [  # step 0: the banks only
        ("_reduce_scatter_base_", 8 * 16 * 32, "bfloat16"), ("_reduce_scatter_base_", 8 * 32 * 32, "bfloat16"),
        ("_reduce_scatter_base_", 8 * 48 * 32, "bfloat16"), ("_allgather_base_", 16 * 32, "bfloat16"),
        ("_allgather_base_", 32 * 32, "bfloat16"), ("_allgather_base_", 48 * 32, "bfloat16")]
    step1 = ops[6:]
    assert [op for op, _, _ in step1[:13]] == ["allreduce_"] * 13
    assert step1[13:] == [
        ("_reduce_scatter_base_", 8 * 16 * 32, "bfloat16"),   # qk_bank: 6 matrices padded to 8
        ("_reduce_scatter_base_", 8 * 32 * 32, "bfloat16"),   # vo_bank: 3 padded to 8
        ("_reduce_scatter_base_", 8 * 48 * 32, "bfloat16"),   # mlp_bank: 8
        ("_reduce_scatter_base_", 384 * 32, "float16"),       # value_embeds: the cycle's fp16 sum
        ("_reduce_scatter_base_", 32 * 96, "bfloat16"),       # lm_head (embed's gradient folded in)
        ("_allgather_base_", 16 * 32, "bfloat16"), ("_allgather_base_", 32 * 32, "bfloat16"),
        ("_allgather_base_", 4 * 96, "bfloat16"), ("_allgather_base_", 48 * 32, "bfloat16"),
        ("_allgather_base_", 48 * 32, "bfloat16")]
    assert all(c.waited is not None and c.group_size == 8 for c in recorder.collectives)

    ref = dict(reference.named_parameters())
    compared = 0
    for name, entry in nccl.entries.items():
        if name == EMBED:   # tied: a transpose of the gathered lm_head, whose other ranks' rows are the fake's
            continue
        own = nccl.own_shard(name)
        expected = ref[name].data.view(entry.view.shape)
        if entry.shard is not None:
            expected = expected[entry.shard.real_rows]
            assert own.numel() > 0, name
        assert torch.equal(own, expected), f"{name}: rank {rank}'s rows differ from one process's"
        assert torch.equal(own, gloo.own_shard(name)), f"{name}: the NCCL and gloo branches differ"
        compared += 1
    assert compared == len(nccl.entries) - 1


def test_an_unwaited_eager_collective_before_a_graph_with_collectives_is_named():
    """The ordering rule on one rank: a pull in flight when the optimizer region starts, on the
    group its reduce-scatter uses, is named; waited first, it passes. In flight across a region
    whose function issues none, it passes, even when the region's runner itself issues one
    outside the function (as the capture check all-reduces its verdict)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    def runner(region, key, fn):           # the graph machinery: a collective beside the region's function
        out = fn()
        if region == "forward_backward":
            dist.all_reduce(torch.zeros(1))
        return out

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        results = []
        for wait_first in (True, False):
            position = {"now": "training step 4"}
            recorder = CollectiveRecorder(lambda: position["now"])
            run = recorder.runner(runner)
            with recorder:
                run("forward_backward", (1024,), lambda: torch.ones(3).sum())
                pull = dist.all_to_all_single(torch.empty(4, 8), torch.ones(4, 8), [2, 2], [3, 1], async_op=True)
                run("forward_backward", (1024,), lambda: torch.ones(3).sum())
                if wait_first:
                    pull.wait()
                position["now"] = "training step 4, region optimizer key 'adam'"
                run("optimizer", "adam", lambda: reduce_scatter_single(torch.empty(2), torch.ones(4)))  # perf.collectives: torch 2.10's name too
                pull.wait()
            try:
                results.append(recorder.check_order())
            except CollectiveOrderError as e:
                results.append(e)
    finally:
        dist.destroy_process_group()
    assert [c.place for c in recorder.collectives] == [
        "in region forward_backward key (1024,) (graph machinery: a replay or the capture check)", "outside regions",
        "in region forward_backward key (1024,) (graph machinery: a replay or the capture check)",
        "in region optimizer key 'adam'"]
    assert results[0] == "collective order: 4 collectives, each eager one waited before the next graph"
    assert isinstance(results[1], CollectiveOrderError)
    assert str(results[1]).splitlines()[1:] == [
        "  rank 0: #1 alltoall_base_ on custom group 0: 32 x float32 (rows of [8]: sends [3, 1], receives [2, 2]), "
        "outside regions, waited before #4, at training step 4; still in flight when region optimizer key 'adam' "
        "started, whose graph holds collectives on custom group 0"]


# ----------------------------------------------------------------------------------------------------
# 2 gloo ranks
# ----------------------------------------------------------------------------------------------------
WORKER = textwrap.dedent('''
    import datetime, sys
    from unittest import mock
    import torch, torch.distributed as dist
    from config import SCHEDULE_PRESETS
    from optim.manager import NgramRowOptimizer, OptimizerManager, RowExchange
    from optim.schedule import TrainingSchedule
    from optim.standin import StandInParams
    from runtime.collective_order import CollectiveOrderError, CollectiveRecorder

    rank, world, port, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    torch.set_num_threads(1)
    sched = TrainingSchedule(SCHEDULE_PRESETS["smoke"])
    position = {"now": "setup"}
    results = {}

    def checked(recorder):
        try:
            return recorder.check_across_ranks()
        except CollectiveOrderError as e:
            return e

    def train(steps, pull_waited_before_optimizer):
        """train_gpt's order: wait the deferred gathers, plan and pull the rows, the optimizer
        region, launch the gathers, the table event."""
        model = StandInParams.small(seed=0)
        mgr = OptimizerManager(model.named_parameters(), sched, keep_grads=True, defer_gathers=True)
        exchange = RowExchange(64, rank, world, "cpu")
        ngram = NgramRowOptimizer(torch.zeros(32, 32), 32, mgr, exchange)
        recorder = CollectiveRecorder(lambda: position["now"])

        runner = recorder.runner(lambda region, key, fn: fn())   # Run.region_runner, wrapped

        def run(region, key, fn):                                   # Run.run_region
            position["now"] = f"{position['step']}, region {region} key {key!r}"
            out = runner(region, key, fn)
            position["now"] = f"{position['step']}, between regions"
            return out
        with recorder:
            for step in range(steps):
                position["step"] = position["now"] = f"training step {step}"
                mgr.wait_gathers()
                model.random_grads(seed=step)
                g = torch.Generator().manual_seed(1000 + step)
                plan = exchange.plan(torch.randint(0, 64, (24,), generator=g, dtype=torch.int32))
                pull = exchange.start_pull(ngram.shard, plan)
                if pull_waited_before_optimizer:
                    pull.wait()
                ngram.accumulate(plan, torch.randn(24, 32, generator=g).bfloat16())
                mgr.load_scalars(step)
                run("optimizer", mgr.phase(step), lambda: mgr.update(step))
                pull.wait()
                mgr.launch_deferred_gathers(step)
                ngram.step(step)
            mgr.wait_gathers()
        return recorder

    recorder = train(4, pull_waited_before_optimizer=True)
    results["kept"] = checked(recorder)
    results["kept_ops"] = [(c.op, c.group, c.region is not None, c.in_fn, c.waited is not None)
                           for c in recorder.collectives]
    results["broken"] = str(checked(train(2, pull_waited_before_optimizer=False)))

    # one rank launches two collectives on two groups in the other order: gloo (a worker thread per
    # group) completes both; NCCL, queueing both on one stream, would hang
    second = dist.new_group(backend="gloo")
    recorder = CollectiveRecorder(lambda: position["now"])
    with recorder:
        position["now"] = "training step 7, between regions"
        launches = [lambda: dist.all_reduce(torch.ones(4), async_op=True),
                    lambda: dist.all_reduce(torch.ones(6, dtype=torch.bfloat16), group=second, async_op=True)]
        if rank == 1:
            launches.reverse()
        for work in [launch() for launch in launches]:
            work.wait()
    results["swapped"] = str(checked(recorder))

    # the NCCL branch of the reduce-scatter (get_backend reads "nccl") against the gloo branch
    params, ops = [], []
    for backend in ("gloo", "nccl"):
        model = StandInParams.small(seed=0)
        mgr = OptimizerManager(model.named_parameters(), sched)
        recorder = CollectiveRecorder()
        with recorder, mock.patch.object(dist, "get_backend", lambda group=None, name=backend: name):
            for step in range(4):
                model.random_grads(seed=step)
                mgr.step(step)
        params.append({n: p.detach().clone() for n, p in model.named_parameters()})
        ops.append(sorted({c.op for c in recorder.collectives}))
    results["branch_ops"] = ops
    results["branch_differs"] = [n for n in params[0] if not torch.equal(params[0][n], params[1][n])]
    torch.save(results, f"{out}.{rank}")
    dist.barrier()
    dist.destroy_process_group()
''')


@pytest.fixture(scope="module")
def gloo_results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("collective_order")
    run_workers(WORKER, tmp, 2, tmp / "result", timeout=120)
    return [torch.load(tmp / f"result.{r}", weights_only=False) for r in range(2)]


@pytest.mark.distributed
def test_a_training_steps_collectives_pass_on_2_gloo_ranks(gloo_results):
    for rank, res in enumerate(gloo_results):
        # by hand: per step the plan's 2 all_to_alls and the pull; steps 0 and 2: the 3 banks' reduces,
        # vo's gather (padded: inside the update) and the 2 deferred ones; steps 1 and 3 add the 13
        # replicated all-reduces, value_embeds' and lm_head's reduces and gathers and the table
        # event's push: 4 * 3 + 2 * 6 + 2 * (6 + 13 + 4 + 1) = 72
        assert res["kept"] == ("collective order: 72 collectives on 1 group(s) (gloo group 0), the same on 2 ranks; "
                               "each eager one waited before the next graph holding collectives"), (rank, res["kept"])
        ops = res["kept_ops"]
        # per step: the row plan's two all_to_alls and the pull, outside regions
        assert sum(op == "alltoall_base_" and not region for op, _, region, _, _ in ops) == 4 * 3 + 2  # + 2 pushes
        # the deferred bank gathers (qk, mlp: the unpadded banks on 2 ranks), eager, waited
        assert [w for op, _, region, _, w in ops if op == "_allgather_base_" and not region] == [True] * 8
        # the reduce (gloo: all-reduce and view) is the optimizer graph's own
        assert all(in_fn for op, _, region, in_fn, _ in ops if op == "allreduce_")
        assert all(waited for *_, waited in ops)


@pytest.mark.distributed
def test_a_row_pull_in_flight_across_the_optimizer_region_breaks_the_rule_on_2_gloo_ranks(gloo_results):
    for res in gloo_results:
        lines = res["broken"].splitlines()
        assert lines[0] == ("an eager collective was not waited before the next graph holding collectives on its group "
                            "(NCCL orders one communicator by launch: a replay would queue behind or ahead of it):")
        assert lines[1].startswith("  rank 0: #2 alltoall_base_ on gloo group 0: ")
        # the pull (#2, after the plan's two) waited after the optimizer's 3 reduces and vo's gather
        assert lines[1].endswith(
            "outside regions, waited before #7, at training step 0; still in flight when region optimizer key "
            "OptimizerPhase(adam=False, table_event=False, tied=True, period4=False, rails=False) started, whose "
            "graph holds collectives on gloo group 0"), lines[1]
        assert sum(line.startswith("  rank 1: ") for line in lines) == 2   # steps 0 and 1, each rank
        assert len(lines) == 5


@pytest.mark.distributed
def test_a_swapped_collective_on_one_of_2_gloo_ranks_is_caught_and_named(gloo_results):
    for res in gloo_results:   # every rank raises the same error
        assert res["swapped"].splitlines() == [
            "collective order differs between ranks at collective #0 (ranks issued [2, 2] collectives; NCCL would "
            "hang or mix up the tensors here):",
            "  rank 0: #0 allreduce_ on gloo group 0: 4 x float32, outside regions, waited before #2, at training "
            "step 7, between regions",
            "  rank 1: #0 allreduce_ on gloo group 1: 6 x bfloat16, outside regions, waited before #2, at training "
            "step 7, between regions"]


@pytest.mark.distributed
def test_the_nccl_reduce_scatter_branch_leaves_the_gloo_branchs_parameters_on_2_gloo_ranks(gloo_results):
    for res in gloo_results:
        assert res["branch_ops"] == [["_allgather_base_", "allreduce_"],
                                     ["_allgather_base_", "_reduce_scatter_base_", "allreduce_"]]
        assert res["branch_differs"] == []
