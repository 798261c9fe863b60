"""tools/bench_host_rows.py (issue 38 point 7): the bench runs tiny and its numbers are the ones an
independent count gives; its row counts are tools.cost's; bad flags exit 2 naming the flag.
No wall-clock time is asserted."""
import re

import pytest

from config import RUN_PRESETS
from optim.schedule import TrainingSchedule
from tools import bench_host_rows
from tools.cost import UNIQUE_IDS_PER_CYCLE, UNIQUE_IDS_PER_STEP, host_table_bytes

SMOKE = RUN_PRESETS["smoke"]
RECIPE = RUN_PRESETS["recipe"]
TINY = ["--config", "smoke", "--table-gib", "0.004", "--start", "34", "--steps", "2", "--step-s", "0.25"]


def expected_rows(cfg, step: int, world_size: int = 1) -> tuple[int, int, int]:
    """(gathers, rows per gather, event rows) of `step` counted here: a bigram and a trigram id per
    token, cost.py's distinct-id ratios, one gather per virtual rank the process plays."""
    schedule = TrainingSchedule(cfg.schedule, cfg.features)
    tokens = schedule.batch_tokens(step) // cfg.virtual_world_size
    accum = cfg.virtual_world_size // world_size
    event = schedule.is_table_event(step)
    return (accum, int(UNIQUE_IDS_PER_STEP * 2 * tokens),
            int(UNIQUE_IDS_PER_CYCLE * 4 * 2 * tokens * accum) if event else 0)


def test_the_tiny_bench_moves_the_bytes_counted_here(capsys):
    report = bench_host_rows.main(TINY + ["--threads", "2"])
    out = capsys.readouterr().out
    D = SMOKE.model.model_dim
    steps = [34, 35]
    assert [s.step for s in report.steps] == steps
    counted = {"gather": 0, "event_gather": 0, "write_back": 0}
    for step in steps:
        lanes, lane_rows, event_rows = expected_rows(SMOKE, step)
        counted["gather"] += lanes * lane_rows * D * 2
        counted["event_gather"] += event_rows * D * 2
        counted["write_back"] += event_rows * D * 2
    assert counted["event_gather"] > 0  # step 35 is a table event
    assert report.moved == counted
    # the printed bytes: the same
    line = next(line for line in out.splitlines() if line.startswith("bytes moved over the timed steps"))
    printed = {k: int(v.replace(",", "")) for k, v in re.findall(r"(lane gathers|event gather|event write-back) "
                                                                  r"\([a-z_]+\) ([0-9,]+) B", line)}
    assert printed == {"lane gathers": counted["gather"], "event gather": counted["event_gather"],
                       "event write-back": counted["write_back"]}
    assert [p.name for p in report.paths] == ["HostRows (device cpu)", "staged, 1 thread", "intra-op 2", "split 2"]
    for path in report.paths:
        assert len(path.step_seconds) == 2 and all(t > 0 for t in path.step_seconds)
        assert sum(path.step_seconds) == pytest.approx(sum(path.seconds.values()))
        for part in counted:  # GB/s is bytes over seconds
            assert path.gb_per_s(part, report.moved) == pytest.approx(counted[part] / 1e9 / path.seconds[part])
        assert f"{path.name:<24}" in out
    assert report.step_budget_s == 0.25 and "reference step: 0.2500 s (--step-s)" in out
    assert report.table_rows == int(0.004 * 2**30) // (D * 2)


def test_the_recipe_rows_are_cost_py_host_bytes_step_by_step():
    """At the recipe's real counts (one process: 8 lanes), each step's rows are host_table_bytes' over
    a row's bytes, the step's own table event counted; the whole run sums to host_table_bytes summed."""
    schedule = TrainingSchedule(RECIPE.schedule, RECIPE.features)
    row = RECIPE.model.model_dim * 2
    assert schedule.total_steps == 1194 and bench_host_rows.default_start(schedule) == 681
    for step in (0, 681, 682, 683, 1107, 1108, 1110, 1193):
        r = bench_host_rows.step_rows(RECIPE, 1, schedule, step)
        lanes, lane_rows, event_rows = expected_rows(RECIPE, step)
        assert (r.lanes, r.lane_rows, r.event_rows) == (lanes, lane_rows, event_rows)
        moved = host_table_bytes(RECIPE, schedule.batch_tokens(step) // 8, 8, schedule.is_table_event(step))
        # one gather per lane, each rounded down to whole rows: within a row per lane of cost.py's bytes
        assert sum(moved.values()) == pytest.approx((r.lanes * r.lane_rows + 2 * r.event_rows) * row, abs=r.lanes * row)
    assert bench_host_rows.step_rows(RECIPE, 1, schedule, 683) == bench_host_rows.StepRows(683, 8, 57_016, 1_572_864)


@pytest.mark.parametrize("flags, named", [
    (["--table-gib", "0"], "--table-gib"),
    (["--table-gib", "0.0001"], "--table-gib"),   # fewer rows than a step moves
    (["--threads", "0"], "--threads"),
    (["--steps", "0"], "--steps"),
    (["--start", "70"], "--start"),
    (["--world-size", "3"], "--world-size"),
    (["--step-s", "nan"], "--step-s"),
    (["--seed", "-1"], "--seed"),
])
def test_bad_flags_exit_2_naming_the_flag(flags, named, capsys):
    with pytest.raises(SystemExit) as exc:
        bench_host_rows.main(["--config", "smoke"] + flags)
    assert exc.value.code == 2
    assert named in capsys.readouterr().err
