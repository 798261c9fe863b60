"""CUDA-graph capture and replay (perf/cuda_graphs/capture.py), proved on CPU through its twin:
TapeGraph replays a region's recorded aten ops with a graph's semantics (tensors from outside by
storage, Python scalars as recorded, no Python run), so a region that a CUDA graph would replay
wrongly trains differently here too."""
import re
import textwrap

import pytest
import torch

from perf.cuda_graphs.capture import (CudaGraph, ExcludedStateWritten, GraphMismatch, RegionGraphs, TapeGraph,
                                      progress_line)
from tools.capture_cost import KeyCheckCost


def _toy_training(graphed: bool, python_scalar: bool = False, make_graph=TapeGraph, device="cpu",
                  warm=2, steps=5, strict=False, staging_block=None, table_writer=None, after_warm_call=None):
    """A linear layer trained by a forward/backward region and an update region; warm calls (the
    warmup: each key twice, warm-up then capture), a reset, then `steps` timed calls. Returns the
    losses and the plan. python_scalar: the update multiplies by a per-call Python number, the bug
    a graph bakes in. The named state holds, as a run's does, state the check leaves out (written
    outside the regions): an n-gram-table-like tensor and the static input. table_writer(call,
    rows): what the update does to the table (nothing, as in a run, by default);
    after_warm_call(graphs): called after each warm step; staging_block: the check's pool blocks."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(8, 4).to(device)
    init = {k: v.clone() for k, v in lin.state_dict().items()}
    for p in lin.parameters():
        p.grad = torch.zeros_like(p)
    x = torch.zeros(16, 8, device=device)                   # the static input buffer
    rows = torch.zeros(6, 3, device=device)                 # written only outside the regions
    lr = torch.tensor(0.1, device=device)
    calls = [0]
    named = lambda: [("w", lin.weight), ("b", lin.bias), ("w.grad", lin.weight.grad), ("b.grad", lin.bias.grad),
                     ("static_input[x [16, 8] float32]", x), ("ngram_table.rows", rows)]
    graphs = RegionGraphs(make_graph, named, strict=strict,
                          **({} if staging_block is None else {"staging_block": staging_block}))
    run = graphs.run if graphed else (lambda region, key, fn: fn())

    def forward_backward():
        loss = torch.tanh(lin(x)).pow(2).sum()
        loss.backward()
        return loss.detach()

    def update():
        with torch.no_grad():
            for p in lin.parameters():
                p.sub_((lr * (1 + calls[0]) if python_scalar else lr) * p.grad)
                p.grad.zero_()
            if table_writer is not None:
                table_writer(calls[0], rows)
        calls[0] += 1

    gen = torch.Generator().manual_seed(1)
    for _ in range(warm):
        x.copy_(torch.randn(16, 8, generator=gen))
        run("forward_backward", "g", forward_backward)
        run("optimizer", "p", update)
        if after_warm_call is not None:
            after_warm_call(graphs)
    graphs.freeze()
    with torch.no_grad():   # the post-warmup reset: in place
        for k, v in lin.state_dict().items():
            v.copy_(init[k])
        for p in lin.parameters():
            p.grad.zero_()
    calls[0] = 0
    losses = []
    for _ in range(steps):
        x.copy_(torch.randn(16, 8, generator=gen))
        losses.append(run("forward_backward", "g", forward_backward).clone())
        run("optimizer", "p", update)
    return (torch.stack(losses).cpu() if losses else torch.empty(0)), graphs


def test_tape_replay_trains_bitwise_like_eager():
    eager, _ = _toy_training(graphed=False)
    graphed, graphs = _toy_training(graphed=True)
    assert torch.equal(eager, graphed), (eager, graphed)
    assert set(graphs.graphs) == {("forward_backward", "g"), ("optimizer", "p")}
    assert sum(c.replays for c in graphs.graphs.values()) == 2 * 5   # every timed call replayed
    # the capture check compared every written tensor and the loss, all bitwise
    assert [(r.region, r.tensors, r.bitwise) for r in graphs.reports] == \
        [("forward_backward", 3, 3), ("optimizer", 4, 4)]
    assert "replay vs eager: 7/7 tensors bitwise" in graphs.summary()


def test_the_pool_ends_at_the_largest_keys_copies_and_goes_at_freeze():
    """Hand count, 64-byte blocks: forward_backward writes w.grad (128 B) and b.grad (16 B) and
    returns the loss (4 B): start copies at 0 and 128, graphed at 192 and 320, the loss at 384, so
    388 B, 7 blocks; the update writes w, b, w.grad, b.grad: 2 × (128 + 64 + 128 + 16) = 720 B, 12
    blocks = 768 B, KeyCheckCost's 2 × aligned written + aligned outputs. The check still passes
    bit for bit, and freeze() drops the pool."""
    pools = []
    _, graphs = _toy_training(graphed=True, steps=0, staging_block=64,
                              after_warm_call=lambda g: pools.append((g.staging.nbytes, g.staging.used) if g.staging else 0))
    assert pools == [0, (768, 720)]
    assert KeyCheckCost("optimizer", "p", 0, (), (), (128, 16, 128, 16), (), 0, 0, 0).host_bytes == 768
    assert KeyCheckCost("forward_backward", "g", 0, (), (), (128, 16), (4,), 0, 0, 0).host_bytes == 448
    assert [(r.region, r.tensors, r.bitwise) for r in graphs.reports] == [("forward_backward", 3, 3),
                                                                          ("optimizer", 4, 4)]
    assert graphs.staging is None and graphs.staging_peak == 768  # freeze() dropped it
    assert graphs.summary().endswith("; replays 0; check host pool 0.00 GiB")


def test_excluded_state_is_neither_fingerprinted_nor_copied(monkeypatch):
    from perf.cuda_graphs import capture
    seen = []
    real = capture.state_fingerprints
    monkeypatch.setattr(capture, "state_fingerprints", lambda named: seen.extend(n for n, _ in named) or real(named))
    _, graphs = _toy_training(graphed=True, steps=0)
    assert seen and "ngram_table.rows" not in seen and "static_input[x [16, 8] float32]" not in seen
    assert {"w", "b", "w.grad", "b.grad"} <= set(seen)
    assert graphs.warmed[("optimizer", "p")] == {"w", "b", "w.grad", "b.grad"}


@pytest.mark.parametrize("when", [0, 1])
def test_a_region_writing_excluded_state_stops_the_run(when):
    """The guard: the update writes the table (index_copy_, as the table event does) at its first
    call (the warm-up) or only at its second (the capture): either stops the run, naming it."""
    def writer(call, rows):
        if call == when:
            rows.index_copy_(0, torch.tensor([1, 4]), torch.ones(2, 3))

    with pytest.raises(ExcludedStateWritten, match=r"region 'optimizer' key 'p' wrote ngram_table\.rows"):
        _toy_training(graphed=True, steps=0, table_writer=writer)


def test_a_write_through_a_view_or_a_swapped_tensor_is_caught_too():
    with pytest.raises(ExcludedStateWritten, match="ngram_table.rows"):
        _toy_training(graphed=True, steps=0, table_writer=lambda call, rows: rows[2].fill_(1.0))
    state = {"rows": torch.zeros(4)}
    graphs = RegionGraphs(TapeGraph, lambda: [("ngram_table.rows", state["rows"])])

    def swap():
        state["rows"] = torch.ones(4)   # Python rebinds the state inside the region

    with pytest.raises(ExcludedStateWritten, match="ngram_table.rows"):
        graphs.run("optimizer", "k", swap)


def test_capture_check_stops_on_a_per_step_python_scalar_naming_graph_and_tensors():
    with pytest.raises(GraphMismatch) as err:
        _toy_training(graphed=True, python_scalar=True)
    msg = str(err.value)
    assert "region 'optimizer' key 'p'" in msg and "w [4, 8] float32" in msg and "b [4] float32" in msg, msg


def test_uncaptured_key_runs_eagerly_or_stops_a_strict_run():
    # warm=1: every key warmed once, never captured
    eager, _ = _toy_training(graphed=False, warm=1)
    graphed, graphs = _toy_training(graphed=True, warm=1)
    assert torch.equal(eager, graphed)
    assert graphs.eager_calls == {("forward_backward", "g"): 5, ("optimizer", "p"): 5}
    assert "warmed but never captured" in graphs.summary()
    with pytest.raises(RuntimeError, match="key 'g' is met in the timed loop but was not captured"):
        _toy_training(graphed=True, warm=1, strict=True)


def test_eager_keys_never_capture():
    graphs = RegionGraphs(TapeGraph, lambda: [])
    graphs.eager_keys = {("optimizer", "once")}
    seen = []
    for _ in range(3):
        graphs.run("optimizer", "once", lambda: seen.append(1))
    assert seen == [1, 1, 1] and not graphs.graphs and not graphs.warmed
    assert "eager by plan (met once per run): optimizer 'once'" in graphs.summary()


def test_release_drops_every_graph_and_what_it_recorded():
    """RegionGraphs.release (before destroy_process_group) lets go of the tensors (and, for
    collectives, the process group) a graph recorded: none stays alive through the graphs."""
    import functools
    import weakref
    state = torch.ones(4)
    graphs = RegionGraphs(TapeGraph, lambda: [("state", state)])
    outside = torch.full((4,), 2.0)   # read by the region; after the runs, held by the tape alone
    alive = weakref.ref(outside)
    region = functools.partial(torch.Tensor.mul_, state, outside)
    del outside
    for _ in range(3):
        graphs.run("optimizer", "k", region)
    del region
    assert ("optimizer", "k") in graphs.graphs and torch.equal(state, torch.full((4,), 8.0))
    assert alive() is not None
    graphs.release()
    assert alive() is None and not graphs.graphs and not graphs.capturing


def test_tape_replays_views_of_its_own_allocations_and_python_constants():
    """Ops that read a view of a tensor made earlier in the region, and a torch.tensor constant
    made by Python (which may land where a freed tensor lived), replay to the same values."""
    src = torch.arange(12.0)
    out = torch.zeros(6)

    def region():
        for _ in range(3):
            tmp = src * 2             # made, then freed: its address may be handed out again
            del tmp
        made = src.view(3, 4) + 1
        sign = torch.ones(4)
        sign[1::2] = torch.tensor(-1.0)   # lift_fresh + fill_: a Python-made constant
        out.copy_((made.t()[1:3] * sign[None, :3]).reshape(-1))
        return out.sum() * 1

    expected = region().clone()
    tape = TapeGraph()
    captured = tape.capture(region)
    out.zero_()
    src.add_(1)                         # new values in the same storage: a replay must read them
    tape.replay()
    src_now = src.clone()
    out_eager = torch.zeros(6)
    made = src_now.view(3, 4) + 1
    sign = torch.tensor([1.0, -1.0, 1.0, -1.0])
    out_eager.copy_((made.t()[1:3] * sign[None, :3]).reshape(-1))
    assert torch.equal(out, out_eager) and torch.equal(captured, out_eager.sum())
    assert not torch.equal(expected, captured)


@pytest.mark.slow
def test_smoke_steps_graphed_bitwise_like_eager(monkeypatch):
    """The real step (`python -m tools.capture_compare --config smoke --steps 6`): every region
    captured in the warmup (checked bitwise against eager there) and replayed in the timed steps
    gives the eager losses and the eager final state, bit for bit (Python state a replay skips, a
    per-step number baked into a graph or an input that does not reach the region through a static
    buffer would each break it)."""
    import dataclasses

    from config import RUN_PRESETS
    from tools import capture_compare as compare

    # The warmup ends with a validation forward on one dummy validation batch; its loss is unused
    # here and it writes no state, but it flushes the last warmup update as in a run, so it still
    # runs, on 1,024 tokens instead of the preset's 8,192 (most of each of the two runs' time, the
    # full-vocabulary loss and the masked SDPA at the final windows). (CI time: 88 s → 46 s)
    smoke = RUN_PRESETS["smoke"]
    monkeypatch.setitem(RUN_PRESETS, "smoke", dataclasses.replace(smoke, val_batch_tokens=1024, val_tokens=1024))
    runs = []   # the graphed run's RegionGraphs, for the byte count below
    train_steps = compare.train_steps
    monkeypatch.setattr(compare, "train_steps", lambda *a, **k: runs.append(train_steps(*a, **k)) or runs[-1])
    text, code = compare.graphed_vs_eager("smoke", 6)
    assert code == 0 and "PASS" in text, text
    assert "forward_backward 1, fp8_refresh 1, optimizer 2" in text and "bitwise; replays 32" in text, text

    # tools/capture_cost.py's count on "meta" knows what each region writes: the same keys, and
    # every tensor the twin's warm-up saw change among the ones it counts (it may count more: a write
    # that keeps the bits, zeroing a zero gradient, changes no fingerprint)
    from tools.capture_cost import capture_check_cost
    from runtime.meta_rank import build_rank_on_meta
    graphs = runs[-1][2]
    cost = {(k.region, k.key): set(k.written) for k in capture_check_cost(build_rank_on_meta(RUN_PRESETS["smoke"], 1),
                                                                          horizon=6).keys}
    assert set(cost) == set(graphs.warmed) == set(graphs.graphs), (set(cost), set(graphs.warmed))
    assert {slot: names - cost[slot] for slot, names in graphs.warmed.items() if names - cost[slot]} == {}
    assert sum(len(names) for names in graphs.warmed.values()) >= 100   # the check compared real state


def test_graphed_vs_eager_reports_a_difference(monkeypatch):
    """The CLI's comparison names what differs: a loss and a state tensor."""
    from tools import capture_compare as compare

    def fake(config, steps, graphed, seed=0):
        state = {"qk_bank": torch.ones(3), "scalars": torch.zeros(2)}
        if graphed:
            state["qk_bank"] = torch.tensor([1.0, 1.0, 1.5])
        return [10.0 + graphed], state, RegionGraphs(TapeGraph, lambda: [])

    monkeypatch.setattr(compare, "train_steps", fake)
    text, code = compare.graphed_vs_eager("smoke", 1)
    assert code == 1, text
    assert "step 0: loss 11.0 graphed, 10.0 eager" in text and "state qk_bank differs" in text, text
    assert "scalars" not in text and "FAIL: 2 difference(s)" in text, text


WORKER = textwrap.dedent("""
    import sys
    import torch
    import torch.distributed as dist
    from perf.cuda_graphs.capture import RegionGraphs, TapeGraph

    rank, world, port, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    p = torch.full((6,), float(rank + 1))
    grad = torch.zeros(6)
    graphs = RegionGraphs(TapeGraph, lambda: [("p", p), ("grad", grad)])

    def update():   # an optimizer's collectives: all-reduce, reduce-scatter, a local update, all-gather
        work = dist.all_reduce(grad, async_op=True)
        work.wait()
        full = p * grad
        work = dist.all_reduce(full, async_op=True)   # optim.manager's reduce-scatter on gloo
        work.wait()
        shard = full[3 * rank: 3 * rank + 3] * 0.5
        dist.all_gather_into_tensor(p, shard)

    seen = []
    for step in range(5):
        grad.copy_(torch.arange(6.0) + step + rank)
        graphs.run("optimizer", "k", update)
        seen.append(p.clone())
    assert set(graphs.graphs) == {("optimizer", "k")}, graphs.summary()
    torch.save(torch.stack(seen), f"{out}.{rank}")
    graphs.release()   # the tape holds the process group: released before it is destroyed
    dist.destroy_process_group()
""")


@pytest.mark.distributed
def test_tape_replays_collectives_on_two_gloo_ranks(tmp_path):
    """Collectives inside a region (c10d ops, waited at replay) replay on every rank in the same
    order: the graphed run matches the same updates computed eagerly."""
    from tests.gloo_workers import run_workers
    out = tmp_path / "seen"
    run_workers(WORKER, tmp_path, 2, out)
    got = [torch.load(f"{out}.{r}") for r in range(2)]
    # eager reference of the same five updates, both ranks in one process
    p = [torch.full((6,), float(r + 1)) for r in range(2)]
    expected = []
    for step in range(5):
        grads = [torch.arange(6.0) + step + r for r in range(2)]
        total = grads[0] + grads[1]
        prods = [p[r] * total for r in range(2)]
        summed = prods[0] + prods[1]
        full = torch.cat([summed[:3] * 0.5, summed[3:] * 0.5])
        p = [full.clone(), full.clone()]
        expected.append(full)
    for r in range(2):
        assert torch.equal(got[r], torch.stack(expected)), (r, got[r], expected)


MISMATCH_WORKER = textwrap.dedent("""
    import sys
    import torch
    import torch.distributed as dist
    from perf.cuda_graphs.capture import GraphMismatch, RegionGraphs, TapeGraph

    rank, world, port, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    p = torch.full((4,), 3.0)
    calls = [0]
    graphs = RegionGraphs(TapeGraph, lambda: [("p", p)])

    def update():   # rank 1 only: a per-call Python number, which a graph bakes in
        dist.all_reduce(p)
        p.mul_(0.25 + (calls[0] if rank == 1 else 0))
        calls[0] += 1

    try:
        for step in range(3):
            graphs.run("optimizer", "k", update)
        message = "no mismatch"
    except GraphMismatch as err:
        message = str(err)
    open(f"{out}.{rank}", "w").write(message)
    graphs.release()
    dist.destroy_process_group()
""")


@pytest.mark.distributed
def test_a_mismatch_on_one_rank_stops_every_rank(tmp_path):
    """A replay that differs on one rank only stops all of them (no rank left waiting in the next
    collective): that rank names its tensors, the others say another rank differs."""
    from tests.gloo_workers import run_workers
    out = tmp_path / "message"
    run_workers(MISMATCH_WORKER, tmp_path, 2, out)
    rank0, rank1 = (open(f"{out}.{r}").read() for r in range(2))
    assert "matches eager here, but not on 1 other rank(s)" in rank0, rank0
    assert "region 'optimizer' key 'k'" in rank1 and "p [4] float32" in rank1, rank1


@pytest.mark.gpu
def test_cuda_graph_replays_bitwise_like_eager_on_gpu():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    pool, stream = torch.cuda.graph_pool_handle(), torch.cuda.Stream()
    eager, _ = _toy_training(graphed=False, device="cuda")
    graphed, graphs = _toy_training(graphed=True, device="cuda", make_graph=lambda: CudaGraph(pool, stream))
    assert torch.equal(eager, graphed)
    assert sum(c.replays for c in graphs.graphs.values()) == 10


@pytest.mark.parametrize("preset", ["smoke", "record"])
def test_warmup_plan_visits_every_repeated_key_twice(preset):
    """training.warmup_steps with the run's region keys: every (region, key) the run meets more
    than once is met at least twice in the warmup (warm-up, then capture), checked by brute force
    over the whole schedule; --max-steps plans only the steps before it."""
    import collections

    from runtime import training
    from config import RUN_PRESETS
    from runtime.meta_rank import build_rank_on_meta

    rank = build_rank_on_meta(RUN_PRESETS[preset], 1)   # the run's manager and schedule, on "meta"
    schedule, manager = rank.schedule, rank.manager

    def keys(step):   # what Run.region_keys computes (geometry; optimizer phase; fp8 refresh mode)
        return [("forward_backward", schedule.settings(step).geometry),
                ("optimizer", manager.phase_at(step)), ("fp8_refresh", step + 1 < 16)]

    for horizon in (None, 9):
        n = horizon or schedule.total_steps
        steps = training.warmup_steps(schedule, keys, horizon)
        assert all(0 <= st < n for st in steps)
        met = collections.Counter(k for st in range(n) for k in keys(st))
        visited = collections.Counter(k for st in steps for k in keys(st))
        assert {k for k, c in met.items() if c >= 2 and visited[k] < 2} == set()
        assert set(training.warmup_steps(schedule, None, horizon)) <= set(steps)
    # the tied phase ends after the split step, as the run unties there
    assert manager.phase_at(schedule.split_step).tied and not manager.phase_at(schedule.split_step + 1).tied


def test_the_warmup_names_each_warm_up_and_capture_as_it_goes():
    """A line per graph, in order: each key's warm-up, then its capture, n of the planned keys
    (training.Run.warmup gives the plan and the log); replays after that say nothing."""
    lines, state = [], torch.zeros(3)
    graphs = RegionGraphs(TapeGraph, lambda: [("state", state)], progress=lines.append, planned=2)
    for _ in range(3):
        graphs.run("forward_backward", (1024, 896), lambda: state.add_(1))
        graphs.run("optimizer", "p", lambda: state.mul_(2))
    pattern = re.compile(r"^warmup: (warmed up|captured) (\w+) (.+) (\d)/2 in \d+\.\d s$")
    assert [pattern.match(line).groups() for line in lines] == [
        ("warmed up", "forward_backward", "(1024, 896)", "1"), ("warmed up", "optimizer", "'p'", "2"),
        ("captured", "forward_backward", "(1024, 896)", "1"), ("captured", "optimizer", "'p'", "2")]
    assert progress_line("captured", "forward_backward", (49152, 2048), 3, 0, 12.44, compiled=1) == \
        "warmup: captured forward_backward (49152, 2048) 3/? in 12.4 s, compiled 1 graph"
