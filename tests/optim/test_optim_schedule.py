"""The schedule reproduces hand-listed record #360 numbers (reference: track_1_short/schedule.py, config.py)."""
import subprocess
import sys
from pathlib import Path

import pytest

from config import SCHEDULE_PRESETS, ScheduleConfig
from optim.schedule import TrainingSchedule, main
from tests.recipe import pin, recipe

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def record():
    return TrainingSchedule(SCHEDULE_PRESETS["record"])


@recipe
def test_stage_ends_split_and_totals(record):
    pin(record.stage_ends, [0, 320, 681, 1107, 1174, 1194], "the stage ends")
    pin((record.total_steps, record.scheduled_steps), (1194, 1174), "(total, scheduled) steps")
    pin(record.split_step, 1175, "the split step")
    pin(record.cooldown_start, 234, "the cooldown's first step")
    pin(sum(record.batch_tokens(s) for s in range(1194)), 328_663_040, "the training tokens (schedule.py)")


@pytest.mark.parametrize("step,expected", [
    (0, 1.0), (233, 1.0), (234, 1.0), (235, 0.99926), (319, 0.93670), (320, 1.40838),
    (680, 0.94115), (681, 1.04999), (700, 1.021085), (1106, 0.40345), (1107, 0.39118),
    (1173, 0.30136), (1174, 0.30), (1193, 0.30),
])
@recipe
def test_lr_multiplier(record, step, expected):
    pin(record.lr_mult(step), expected, f"lr_mult at step {step}", abs=1e-5)


@recipe
def test_lr_multiplier_hand_formula(record):
    # step 700: stage 2 (lr_mul 1.73), tau = (700 - 234) / 940
    tau = 466 / 940
    pin(record.lr_mult(700), 1.73 * (1 - tau) + 0.30 * tau, "lr_mult at step 700, linear from stage 2's 1.73 "
        "to the 0.30 floor", rel=1e-12)


@pytest.mark.parametrize("step,expected", [
    (0, 0.85), (100, 0.883333), (239, 0.929667), (240, 0.93), (700, 0.93), (1144, 0.93),
    (1145, 0.9284), (1174, 0.882), (1193, 0.8516),
])
@recipe
def test_rail_beta(record, step, expected):
    pin(record.rail_beta(step), expected, f"rail_beta at step {step}", abs=1e-6)


@recipe
def test_rails_engage_at_514(record):
    pin(next(s for s in range(1194) if record.rails_engaged(s)), 514, "the step the rails engage")


@pytest.mark.parametrize("step,expected", [
    (0, (1.0, 0.5, 0.25)), (160, (1.0, 0.5, 0.125)), (319, (1.0, 0.5, 0.25 / 320)),
    (320, (1.0, 0.5)), (680, (1.0, 0.5 / 361)), (681, (1.0,)), (1107, (1.0,)), (1193, (1.0,)),
])
@recipe
def test_mtp_weights(record, step, expected):
    pin(record.mtp_weights(step), expected, f"the MTP weights at step {step}", abs=1e-12)


@pytest.mark.parametrize("step,expected", [
    (0, 0.25), (319, 0.25), (320, 0.20), (410, 0.20), (411, 0.15), (500, 0.15), (501, 0.10),
    (590, 0.10), (591, 0.05), (680, 0.05), (681, 0.0), (1193, 0.0),
])
@recipe
def test_prefix_weight(record, step, expected):
    pin(record.prefix_weight(step), expected, f"the prefix weight at step {step}")


@pytest.mark.parametrize("step,expected", [
    (0, 10240), (680, 10240), (681, 14336), (822, 14336), (823, 14336), (964, 14336),
    (965, 24576), (1106, 24576), (1107, 0), (1193, 0), (1194, 0),
])
@recipe
def test_softmax_p(record, step, expected):
    pin(record.softmax_p(step), expected, f"the sampled softmax's P at step {step}")


@pytest.mark.parametrize("step,windows,doc_cap,max_seq,batch", [
    (0, (1, 3), 896, 896, 131072), (320, (3, 7), 2048, 2048, 262144),
    (681, (5, 11), 3072, 2560, 393216), (1107, (5, 11), 3072, 2560, 327680),
    (1174, (6, 13), 3072, 2560, 131072), (1193, (6, 13), 3072, 2560, 131072),
])
@recipe
def test_windows_caps_batches(record, step, windows, doc_cap, max_seq, batch):
    pin((record.windows(step), record.doc_cap(step), record.max_seq_len(step), record.batch_tokens(step)),
        (windows, doc_cap, max_seq, batch), f"(windows, doc cap, max seq len, batch tokens) at step {step}")


@recipe
def test_settings_bundle(record):
    s = record.settings(967)   # 967 = 3 mod 4: a table event
    assert (s.stage, s.softmax_p, s.ws_short, s.ws_long, s.doc_cap, record.max_seq_len(967)) == (2, 24576, 5, 11, 3072, 2560)
    assert s.adam_step and s.table_event and s.mtp_weights == (1.0,) and s.prefix_weight == 0.0
    assert s.lr_mult == record.lr_mult(967) and s.rail_beta == 0.93 and s.batch_tokens == 393216
    assert s.table_period4 and s.rails_engaged  # 967 >= 336 (every 4th step) and >= 514 (rails blended)
    assert not record.settings(335).table_period4 and not record.settings(513).rails_engaged


@recipe
def test_final_validation_window(record):
    pin(record.final_windows(), (6, 20), "the final validation's windows (blocks)")


@recipe
def test_adam_and_table_cadence(record):
    adam = [s for s in range(1194) if record.is_adam_step(s)]
    events = [s for s in range(1194) if record.is_table_event(s)]
    assert len(adam) == 597 and adam[:3] == [1, 3, 5] and adam[-1] == 1193
    assert events == list(range(1, 336, 2)) + list(range(339, 1192, 4))
    assert len(events) == 382
    assert sum(1 for s in events if s < 336) == 168


def test_smoke_crosses_every_transition():
    sched = TrainingSchedule(SCHEDULE_PRESETS["smoke"])
    cfg = sched.cfg
    assert 60 <= sched.total_steps <= 120
    assert len(sched.spans) == 5 and all(sp.end > sp.start for sp in sched.spans)
    steps = range(sched.total_steps)
    assert any(not sched.rails_engaged(s) for s in steps) and any(sched.rails_engaged(s) for s in steps)
    assert 0 < cfg.table_period4_step < sched.total_steps and cfg.table_period4_step % 4 == 0
    assert sched.split_step < sched.total_steps
    assert len({sched.softmax_p(s) for s in steps}) == 4  # two sampled sizes in stage 2, and full
    # the tail windows start after the 4-step table cadence (TailAverages asserts this too)
    assert sched.total_steps - cfg.tail_avg_window >= cfg.table_period4_step


def test_bad_config_is_named():
    with pytest.raises(ValueError, match="growth_steps"):
        TrainingSchedule(ScheduleConfig(growth_steps=3))
    with pytest.raises(ValueError, match="stages"):
        TrainingSchedule(ScheduleConfig(stages=SCHEDULE_PRESETS["record"].stages[:4]))


def test_cli_prints_table_and_plots(tmp_path, capsys):
    out_png = tmp_path / "sched.png"
    assert main(["--config", "smoke", "--plot", str(out_png)]) == 0
    text = capsys.readouterr().out
    assert "stage ends [0, 17, 36, 60, 64, 70]" in text
    # the per-rank column at the preset's 2 ranks (smoke stage 0: 1,024 tokens), unless --world-size says
    assert " 0     0-16        1024     512 " in text
    assert main(["--config", "smoke", "--world-size", "1"]) == 0
    assert " 0     0-16        1024    1024 " in capsys.readouterr().out
    assert out_png.stat().st_size > 1000 and out_png.read_bytes()[:4] == b"\x89PNG"


def test_cli_module_entry_point():
    res = subprocess.run([sys.executable, "-m", "optim.schedule", "--config", "record"], cwd=REPO,
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert "stage ends [0, 320, 681, 1107, 1174, 1194]" in res.stdout
    assert "14336@681, 24576@965" in res.stdout
    # a bad --config: tests/run/test_run_bad_input.py::test_every_entry_point_refuses_in_one_line


# ---- the proposals' schedules: the record's rules at their base steps (frontier_doc_copy.md §1.4,
# frontier_cplm.md §8) ----

# (base steps, stage ends, split, cooldown start, lr_mult at stage starts 1..4, (step, P) changes, prefix
# weight changes, first rail-β cooldown step, table events, last event), typed out from the spec's table
PROPOSAL_SCHEDULES = {
    "record": (1122, [0, 320, 681, 1107, 1174, 1194], 1175, 234, [1.40838, 1.04999, 0.39118, 0.30],
               [(0, 10240), (681, 14336), (965, 24576), (1107, 0)], [320, 411, 501, 591, 681], 1145, 382, 1191),
    "token_norm_hashes": (1107, [0, 316, 672, 1093, 1159, 1179], 1159, 231, [1.40825, 1.05044, 0.39098, 0.30],
                          [(0, 10240), (672, 14336), (953, 24576), (1093, 0)], [316, 405, 494, 583, 672], 1130,
                          378, 1175),
    "doc_copy": (1060, [0, 303, 643, 1048, 1112, 1132], 1113, 222, [1.40897, 1.05356, 0.39199, 0.30],
                 [(0, 10240), (643, 14336), (913, 24576), (1048, 0)], [303, 388, 473, 558, 643], 1083, 367, 1131),
    # frontier_cplm.md §8: 978 scheduled iterations (the rail engage, table cadence and tail windows keep
    # the record's fixed steps: 346 events, the last at 1047)
    "cplm": (978, [0, 279, 593, 971, 1030, 1050], 1031, 205, [1.41057, 1.05747, 0.39149, 0.30],
             [(0, 10240), (593, 14336), (845, 24576), (971, 0)], [279, 358, 436, 515, 593], 1001, 346, 1047),
}


@pytest.mark.parametrize("name", sorted(PROPOSAL_SCHEDULES))
def test_each_proposal_runs_its_prs_schedule(name):
    from config import PROPOSALS, RUN_PRESETS

    base, ends, split, cooldown, lr_mults, softmax, prefix, rail, events, last = PROPOSAL_SCHEDULES[name]
    cfg = RUN_PRESETS["record"] if name == "record" else PROPOSALS[name].apply(RUN_PRESETS["record"])
    assert cfg.schedule.base_steps == base
    s = TrainingSchedule(cfg.schedule)
    n = s.total_steps
    assert s.stage_ends == ends and s.split_step == split and s.cooldown_start == cooldown
    assert [round(s.lr_mult(e), 5) for e in ends[1:5]] == lr_mults
    assert [(t, s.softmax_p(t)) for t in range(n) if t == 0 or s.softmax_p(t) != s.softmax_p(t - 1)] == softmax
    assert [t for t in range(1, n) if s.prefix_weight(t) != s.prefix_weight(t - 1)] == prefix
    assert min(t for t in range(1, n) if s.rail_beta(t) < s.rail_beta(t - 1)) == rail
    table_events = [t for t in range(n) if s.is_table_event(t)]
    assert (len(table_events), table_events[-1]) == (events, last)
    assert [s.windows(e) for e in ends[:-1]] == [(1, 3), (3, 7), (5, 11), (5, 11), (6, 13)]


def test_the_sampled_lm_head_gradient_is_on_where_pr_371_samples_it():
    """features.approx_lm_head_grad (PR #371): the sampled-softmax steps with at least the stage-1 batch, 320-1106
    on the record (787 steps, its HEAD_SAMPLE_MIN_ROWS = 32,768 rows per rank), scaled with the smoke's stages;
    it joins the geometry, and without the switch no step has it."""
    from config import RUN_PRESETS, FeatureConfig, ScheduleConfig

    on = TrainingSchedule(ScheduleConfig(), FeatureConfig(approx_lm_head_grad=True))
    steps = [s for s in range(on.total_steps) if on.settings(s).head_sample]
    assert (steps[0], steps[-1], len(steps)) == (320, 1106, 787)
    assert on.batch_tokens(320) // 8 == 32768 and on.batch_tokens(319) // 8 == 16384
    assert on.settings(320).geometry != TrainingSchedule(ScheduleConfig()).settings(320).geometry
    smoke = TrainingSchedule(RUN_PRESETS["smoke"].schedule, FeatureConfig(approx_lm_head_grad=True))
    assert [s for s in range(smoke.total_steps) if smoke.head_sample(s)] == list(range(17, 60))
    record = TrainingSchedule(ScheduleConfig())
    assert not any(record.settings(s).head_sample for s in range(record.total_steps))


def test_the_attention_backward_modes_fall_where_pr_371_puts_them():
    """features.approx_attention_backward (PR #371 part 2): mode 1 on its hard-wired steps 592-593, mode 2 on
    594-1106, 0 elsewhere (the taper and extension exact); scaled to the smoke schedule at the same place in
    stage 1 (17 + round(272/361 · 19) = 31); each mode its own geometry; off, every step 0."""
    from config import RUN_PRESETS, FeatureConfig, ScheduleConfig

    on = TrainingSchedule(ScheduleConfig(), FeatureConfig(approx_attention_backward=True))
    modes = [on.settings(s).attention_mode for s in range(on.total_steps)]
    assert [s for s, m in enumerate(modes) if m == 1] == [592, 593]
    assert [s for s, m in enumerate(modes) if m == 2] == list(range(594, 1107))
    assert on.stage_ends[1:4] == [320, 681, 1107] and on.windows(592) == (3, 7)  # stage 1: W = 3 · 128 = 384
    assert len({on.settings(s).geometry for s in (591, 592, 594)}) == 3
    assert on.settings(592).geometry == on.settings(593).geometry  # PR #371 asserts they share a key
    smoke = TrainingSchedule(RUN_PRESETS["smoke"].schedule, FeatureConfig(approx_attention_backward=True))
    modes = [smoke.attention_mode(s) for s in range(smoke.total_steps)]
    assert (modes.index(1), modes.index(2), len(modes) - modes[::-1].index(2)) == (31, 33, 60)
    record = TrainingSchedule(ScheduleConfig())
    assert not any(record.settings(s).attention_mode for s in range(record.total_steps))
