"""The acceptance run: the whole smoke schedule at base 25 steps (35 steps: all six stages, every graph the
70-step preset compiles), its 2 ranks played by one process, compiled fullgraph with aot_eager under the sync
check, on the embedded corpus. It learns, says where its training
loss jumps, embeds the modules it imported in its log, compiles every graph in its warmup and none after,
and never syncs a step. Its own file so that pytest-xdist (`--dist loadfile`) gives its run, the suite's
longest (about 7 min of one core), a worker of its own from the start (conftest's LONGEST_FILES_FIRST).

Base 25, not the preset's 60 (CI time, 2026-12-06: the 70-step run took 1,019 s of CI's 28 min, base 30's 40
steps 679 s of its 22; validating every 30 steps keeps one validation inside the run, at other windows): the stages
keep their order, batches, windows, softmax widths and loss terms, so the geometries and their graphs are the
preset's; what shrinks is the steps inside them. The 70-step run stays the documented smoke run
(`--config smoke`: docs/data.md, docs/features.md; seed 0 through step 34, where margin 1.05 diverged).

One process, not 2 gloo ranks (CI time, 2026-12-06): two processes compiled the same 9 graphs twice (230 s
of each core of 500 s) and, beside the other pytest worker, put three processes on CI's two cores. What
the ranks add is checked where it is cheaper: one process computes what 2 gloo ranks compute, bit for bit
(tests/run/test_run_virtual_ranks.py, 20 steps across the first stage transition, and its torchrun says no
deprecated collective); every collective runs eagerly, outside the compiled model, so the graphs a rank
compiles are the graphs this process compiles."""
import dataclasses
import re
import sys

import pytest
import torch

from config import RUN_PRESETS
from records.run_log import parse_log
from tests import long_runs
from tests.run.test_run_train import _runs


# ---- the acceptance run: the whole smoke schedule, its 2 ranks in one process ------------------------


# seed 0 (issue 40): with record #360's Frobenius margin (1.05) this run diverged at step 34 on the embedded
# corpus; the smoke preset's margin 1.10 (config.py, OPTIM_PRESETS) carries it through, as it does seeds 1-4
# (docs/data.md, "A divergence it found")
SMOKE_SEED = 0
# the smoke schedule at 25 base steps: 35 steps, geometries from 0, 7, 15, 24, 28, 29 (CI time). Not fewer: the
# tail average's 15-step window must lie in the 4-step table cadence, which starts at step 20 (optim/tail_average.py)
BASE_STEPS = 25
VAL_EVERY = 30  # so that one validation falls inside the run (at 30, stage 5's windows), as the preset's 35 does in 70
SMOKE_ENV = {"SPEEDRUN_COMPILE": "1", "SPEEDRUN_COMPILE_BACKEND": "aot_eager", "SPEEDRUN_SYNC_CHECK": "1",
             "TORCH_LOGS": "recompiles,graph_breaks", "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1",
             "RANK": None, "WORLD_SIZE": None, "LOCAL_RANK": None}  # None: removed (one process, not a rank)


def _smoke_commands(folder):
    """The acceptance run's commands in `folder`: the embedded corpus written (what `synthetic_shards`
    writes, the same seeded spec), then the whole smoke schedule, one process playing its 2 ranks."""
    data = folder / "synthetic"
    return [[sys.executable, "-c", "import sys; from data.synthetic import write_corpus; "
             "write_corpus(sys.argv[1], progress=False)", str(data)],
            [sys.executable, "train_gpt.py", "--config", "smoke", "--data-path", str(data), "--records-dir", str(folder / "records"),
             "--seed", str(SMOKE_SEED), "--val-tokens", "2048", "--val-every", str(VAL_EVERY),
             "--set", f"schedule.base_steps={BASE_STEPS}"]]


# The acceptance run (tests/long_runs.py): about 7 min of one core when run alone.
long_runs.register("smoke_run", _smoke_commands, env=SMOKE_ENV, merge_stderr=True)


def _schedule():
    """The acceptance run's schedule: the smoke preset's at `BASE_STEPS`."""
    from optim.schedule import TrainingSchedule

    return TrainingSchedule(dataclasses.replace(RUN_PRESETS["smoke"].schedule, base_steps=BASE_STEPS))


@pytest.fixture(scope="module")
def smoke_run():
    """The acceptance run: the whole smoke schedule at `BASE_STEPS`, one process playing its 2 ranks, seed `SMOKE_SEED`, compiled fullgraph
    with aot_eager (what a GPU run traces) under the sync check, with dynamo's recompile and graph-break
    logs: (runs.jsonl entry, stdout), validating 2,048 tokens each time. One full run serves the
    learning and the tracing tests (CI time); that compiled and eager runs agree is
    test_compiled_and_eager_losses_agree_for_three_steps. One validation step (2,048 tokens) per
    validation instead of sixteen: the portable attention dominates a validation on CPU, and the
    learning check needs only the trend (CI time)."""
    code, out, _, folder = long_runs.result("smoke_run")
    assert code == 0, out[-8000:]
    (entry,) = _runs(folder / "records")
    return entry, out


@pytest.mark.slow
def test_smoke_run_learns(smoke_run):
    entry, out = smoke_run
    schedule = _schedule()
    n = schedule.total_steps
    assert entry["status"] == "finished" and entry["steps"] == n == 35 and entry["world_size"] == 1
    assert "config smoke: 1 process(es) × 2 accumulation step(s) = 2 ranks of the recipe" in out
    log = open(entry["log_path"]).read()
    vals = parse_log(log).vals
    # the log embeds the modules the run imported (records/run_log.py), never a test, and says how many
    (count,) = re.findall(r"^source: (\d+) files, [\d,]+ bytes embedded \(", log, re.M)
    assert int(count) == len(parse_log(log).sources) > 40 and "def test_" not in log
    untrained, final = vals[0][2], vals[-1][2]
    print(f"smoke: untrained val loss {untrained:.4f}, final {final:.4f}, train time {entry['train_time_ms'] / 1000:.1f} s")
    assert vals[0][0] == 0 and vals[-1][0] == n
    assert untrained == pytest.approx(torch.log(torch.tensor(50304.0)).item(), abs=0.05)  # uniform at init
    # issue 34: on the embedded corpus the whole schedule ends at least 2 nats below ln 50304 (the 70-step
    # preset: 6.60 measured over 32,768 tokens; its entropy rate, the floor, is 2.72)
    assert final <= untrained - 2.0
    assert f"step:{n}/{n} val_loss:" in out
    assert "FutureWarning" not in out and "DeprecationWarning" not in out, out
    # the train loss jumps where the softmax widens; the log says so at that step
    full_from = next(s for s in range(1, n) if schedule.softmax_p(s) == 0 and schedule.softmax_p(s - 1))
    assert (f"step:{full_from + 1}/{n} training loss from here: full softmax over 50304 classes (was sampled "
            f"softmax over {schedule.softmax_p(full_from - 1)} classes); the train_loss values jump up") in out


# ---- the fast path traces once and never waits (issue: the record step traces once) ---------------


def _expected_graphs(schedule, steps: int, val_every: int) -> int:
    """Graphs a compiled run needs, counted from the schedule's per-step values: one per distinct
    training shape/flag set, one per distinct windows at an intermediate validation (those of the
    step before it), one for the final validation."""
    training = {(schedule.batch_tokens(s), schedule.max_seq_len(s), schedule.softmax_p(s),
                 len(schedule.mtp_weights(s)), schedule.prefix_weight(s) > 0, schedule.windows(s))
                for s in range(steps)}
    validation = {schedule.windows(max(k - 1, 0)) for k in range(0, steps, val_every)}
    return len(training) + len(validation) + 1


@pytest.mark.slow
def test_compiled_smoke_run_traces_once_and_never_syncs(smoke_run):
    """The acceptance run (`smoke_run`): every graph compiles in the warmup, none after (no
    recompile, no graph break in dynamo's own logs), and no step syncs (the run would have failed)."""
    entry, out = smoke_run
    assert entry["status"] == "finished" and entry["steps"] == 35
    schedule = _schedule()
    expected = _expected_graphs(schedule, schedule.total_steps, VAL_EVERY)
    log = open(entry["log_path"]).read()
    assert f"compiled graphs: warmup {expected}, timed 0" in log, re.findall(r"compiled graphs.*", log)
    assert "compiled graphs: validation after the warmup 0" in log
    # one progress line per graph compiled in the warmup, n of the plan's N, as many as dynamo counted
    # (the first graph a validation: the warmup starts with the untrained validation's windows)
    lines = re.findall(r"^warmup: compiled (.+) (\d+)/(\d+)( \(\d+ graphs\))? in \d+\.\d s$", log, re.M)
    assert [(int(n), int(total), more) for _, n, total, more in lines] == \
        [(n, expected, "") for n in range(1, expected + 1)], lines
    # each training graph compiled at the first step of its geometry, in order; the final validation last
    geometry = lambda s: (schedule.batch_tokens(s), schedule.max_seq_len(s), schedule.softmax_p(s),  # noqa: E731
                          len(schedule.mtp_weights(s)), schedule.prefix_weight(s) > 0, schedule.windows(s))
    firsts = [s for s in range(schedule.total_steps) if s == 0 or geometry(s) != geometry(s - 1)]
    compiled_at = [int(what.rsplit(" at step ", 1)[1]) for what, *_ in lines if what.startswith("forward_backward (")]
    assert compiled_at == firsts and lines[-1][0].startswith("final validation ("), lines
    after_reset = out.split("resetting model and optimizer state", 1)[1]
    assert "[__recompiles]" not in after_reset and "[__graph_breaks]" not in after_reset, after_reset[:3000]
