"""Bad input is refused before the work starts (issue 25): every case below stops before the process
group, the model or any batch exists, prints one `train_gpt.py: error: ...` line per problem naming
the flag or variable, exits 2 without a traceback, and leaves one `failed` runs.jsonl line.

docs/bad_input.md's table lists the same cases."""
import json
import os
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import numpy as np
import pytest
import torch

from config import RUN_PRESETS, ConfigError
from data.shards import BOS_ID, write_shard
import train_gpt

REPO_ROOT = Path(__file__).resolve().parents[2]
SMOKE = RUN_PRESETS["smoke"]


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    """Synthetic smoke shards: 400k training tokens (the 70-step schedule reads ~150k) and 4 validation
    × 8,192 (+ 1) tokens, in documents of 50 tokens."""
    out = tmp_path_factory.mktemp("shards")
    rng = np.random.default_rng(0)
    for name, n in (("synthetic_train_000001.bin", 400_000), ("synthetic_val_000000.bin", 4 * 8192 + 1)):
        tokens = rng.integers(0, 50_000, n)
        tokens[::50] = BOS_ID
        write_shard(out / name, tokens)
    return out


@pytest.fixture(scope="module")
def other_preset_checkpoint(tmp_path_factory):
    """A folder shaped like --save-checkpoint's, saved by a dev run (its model config only)."""
    folder = tmp_path_factory.mktemp("ckpt") / "state_step000010"
    folder.mkdir()
    torch.save({"step": 10, "config": asdict(RUN_PRESETS["dev"]), "model": {}}, folder / "model.pt")
    torch.save({}, folder / "rank0.pt")
    return folder


@pytest.fixture(scope="module")
def gap_checkpoint(tmp_path_factory):
    """A smoke checkpoint saved by 2 ranks whose rank1.pt is gone (half the n-gram rows in no file)."""
    folder = tmp_path_factory.mktemp("ckpt") / "state_step000004"
    folder.mkdir()
    half = SMOKE.model.ngram_rows // 2
    torch.save({"step": 4, "config": asdict(SMOKE), "world_size": 2, "model": {}, "code": ""}, folder / "model.pt")
    torch.save({"step": 4, "ngram_lo": 0, "ngram_hi": half,
                "ngram_rows": torch.zeros(half, SMOKE.model.model_dim, dtype=torch.bfloat16)}, folder / "rank0.pt")
    return folder


def _bad_inputs(shards: Path, tmp: Path, checkpoint: Path, gap: Path = Path("gap")):
    """(case, extra argv, extra env, [the message each expected line holds]); the test makes tmp/a_file
    and tmp/empty/."""
    a_file, empty = tmp / "a_file", tmp / "empty"
    data = ["--data-path", str(shards)]
    return [
        ("val tokens not a multiple of a validation step", [*data, "--val-tokens", "3000"], {},
         ["--val-tokens 3000: must be a positive multiple of one validation step, 2,048 tokens"]),
        ("val tokens zero", [*data, "--val-tokens", "0"], {}, ["--val-tokens 0: must be a positive multiple"]),
        ("val tokens beyond the val shards", [*data, "--val-tokens", "40960"], {},
         ["--val-tokens 40960: the validation shards serve 32,768 tokens"]),
        ("max steps zero", [*data, "--max-steps", "0"], {}, ["--max-steps 0: must be at least 1"]),
        ("max steps negative", [*data, "--max-steps", "-3"], {}, ["--max-steps -3: must be at least 1"]),
        ("max steps beyond the schedule", [*data, "--max-steps", "71"], {},
         ["--max-steps 71: the schedule has 70 steps"]),
        ("val every negative", [*data, "--val-every", "-1"], {}, ["--val-every -1: must be >= 0"]),
        ("steps zero", [*data, "--steps", "0"], {}, ["--steps 0: must be a positive number of base steps"]),
        ("steps too few for the stages", [*data, "--steps", "3"], {},
         ["--steps 3: the schedule cannot be built (stage 3 is empty"]),
        ("steps not a number (env)", data, {"NUM_SCHEDULED_ITERATIONS": "ten"},
         ["argument --steps: invalid int value: 'ten'"]),
        ("too few training tokens", [*data, "--steps", "2000"], {},
         ["the training shards hold 400,000 tokens, 2010 steps read at least 4,278,196"]),
        ("seed negative", [*data, "--seed", "-1"], {}, ["--seed -1: must be in [0, 2**63)"]),
        ("preset typo", ["--config", "smok"], {}, ["argument --config: invalid choice: 'smok'"]),
        ("unknown flag", [*data, "--max-step", "3", "--val-tokns", "8192"], {},
         ["unrecognized arguments: --val-tokns 8192"]),
        ("a bool variable not 0/1", data, {"SPEEDRUN_CUDA_GRAPHS": "2"}, ["SPEEDRUN_CUDA_GRAPHS=2: must be 0 or 1"]),
        ("an unknown SPEEDRUN_ variable", data, {"SPEEDRUN_OVERLAPP": "0"},
         ["SPEEDRUN_OVERLAPP=0: unknown variable, nothing reads it; did you mean SPEEDRUN_OVERLAP?"]),
        ("an attention backend typo", data, {"SPEEDRUN_ATTENTION": "xformers"},
         ["SPEEDRUN_ATTENTION=xformers: must be one of sdpa, flex, fa3"]),
        ("a world size the preset cannot use", data, {"WORLD_SIZE": "3"},
         ["WORLD_SIZE=3: --config smoke runs on 1 or 2 process(es)"]),
        ("a rank outside the world", data, {"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "x"},
         ["LOCAL_RANK=x: must be an integer"]),
        ("the record preset on a CPU", ["--config", "record", *data], {"WORLD_SIZE": "8"},
         ["--config record: needs CUDA GPUs"]),
        ("a data path that is a file", ["--data-path", str(a_file)], {}, [f"--data-path {a_file}: is a file"]),
        ("an empty shard folder", ["--data-path", str(empty)], {},
         ["no training shards match *_train_*.bin", "no validation shards match *_val_*.bin"]),
        ("a missing data folder", ["--data-path", str(tmp / "nowhere")], {}, ["no such folder"]),
        ("FineWeb not downloaded", ["--data-path", str(tmp / "fineweb10B")], {},
         ["no such folder; pass --data-path DIR (or DATA_PATH) holding the shards, or get them with "
          "`python data/cached_fineweb10B.py 1`"]),
        ("a checkpoint folder without model.pt", [*data, "--eval-checkpoint", str(empty)], {},
         ["no model.pt there"]),
        ("a checkpoint of another preset", [*data, "--eval-checkpoint", str(checkpoint)], {},
         ["saved by a --config dev run whose model differs from --config smoke's (head_dim, mlp_hidden_dim, model_dim, "]),
        ("a checkpoint missing a rank file", [*data, "--eval-checkpoint", str(gap)], {},
         [f"--eval-checkpoint {gap / 'rank1.pt'}: missing; model.pt says 2 rank(s) saved this checkpoint, so n-gram "
          "rows [8,192, 16,384) are in no file"]),
        ("a --set of an unknown field", [*data, "--set", "optim.anvil_lrr=0.02"], {},
         ["--set optim.anvil_lrr=0.02: OptimConfig has no field 'anvil_lrr' (did you mean anvil_lr?)"]),
        ("a --set of the wrong type", [*data, "--set", "model.mlp_hidden_dim=wide"], {},
         ["--set model.mlp_hidden_dim=wide: 'wide' is not an integer"]),
        ("a --set the model refuses", [*data, "--set", "model.num_heads=5"], {},
         ["--set model.num_heads=5: ModelConfig: num_heads·head_dim = 80 must equal model_dim 96"]),
        ("a --set of an unknown optimizer", [*data, "--set", "optim.bank_optimizer=adamw"], {},
         ["optim.bank_optimizer=adamw: must be anvil (record #360) or normuon (record #89)"]),
        ("--quick with another preset", ["--quick", "--config", "record", *data], {},
         ["--quick runs the smoke preset; drop --config record (or --quick)"]),
        ("several problems at once", [*data, "--val-tokens", "3000", "--max-steps", "0", "--val-every", "-2"],
         {"SPEEDRUN_ROW_PREFETCH": "yes"},
         ["SPEEDRUN_ROW_PREFETCH=yes: must be 0 or 1", "--max-steps 0", "--val-every -2", "--val-tokens 3000"]),
        ("the retired fp8 variable", data, {"SPEEDRUN_FP8": "0"},
         ["SPEEDRUN_FP8=0: unknown variable, nothing reads it; fp8 has one switch, the recipe's: --set features.fp8=false"]),
    ]


CASES = [case[0] for case in _bad_inputs(Path("shards"), Path("tmp"), Path("checkpoint"))]


@pytest.mark.parametrize("case", CASES)
def test_bad_input_is_refused_before_the_run(case, shards, other_preset_checkpoint, gap_checkpoint, tmp_path,
                                             monkeypatch, capsys):
    (name, argv, env, expected), = [c for c in _bad_inputs(shards, tmp_path, other_preset_checkpoint, gap_checkpoint)
                                    if c[0] == case]
    (tmp_path / "a_file").write_text("not a folder")
    (tmp_path / "empty").mkdir()
    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    monkeypatch.setattr(train_gpt, "run_one", lambda *a: pytest.fail(f"{name}: the run started"))
    records = tmp_path / "records"
    with pytest.raises(SystemExit) as stop:
        train_gpt.main(["--config", "smoke", "--records-dir", str(records), *argv])
    assert stop.value.code == 2
    out, err = capsys.readouterr()
    lines = err.splitlines()
    assert lines and all(line.startswith("train_gpt.py: error: ") for line in lines), err
    assert "Traceback" not in out + err
    for message in expected:
        assert any(message in line for line in lines), (message, err)
    (entry,) = [json.loads(line) for line in (records / "runs.jsonl").read_text().splitlines()]
    assert entry["status"] == "failed" and entry["error"].startswith("refused before training: ")
    assert all(message in entry["error"] for message in expected)
    # the log (source, environment, then the run's lines) ends with the refusal, no traceback after it
    assert Path(entry["log_path"]).read_text().rstrip().splitlines()[-1] == f"run failed: {entry['error']}"


def test_an_unwritable_records_folder_is_refused_without_a_line(tmp_path, monkeypatch, capsys):
    if os.geteuid() == 0:  # root writes through permission bits: use a place nobody can write
        records = Path("/proc/speedrun-records")
    else:
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o555)
        records = locked / "records"
    monkeypatch.setattr(train_gpt, "run_one", lambda *a: pytest.fail("the run started"))
    with pytest.raises(SystemExit) as stop:
        train_gpt.main(["--config", "smoke", "--records-dir", str(records), "--val-tokens", "100"])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert f"train_gpt.py: error: --records-dir {records}: cannot write there" in err
    assert "--val-tokens 100: must be a positive multiple" in err and "Traceback" not in err
    assert not records.exists()


def test_as_a_process_rank_0_prints_and_records_other_ranks_only_exit(shards, tmp_path):
    """What torchrun's ranks do with a refused configuration: exit 2 before any process group (so no
    rank waits), rank 0 prints the lines and writes the one runs.jsonl line."""
    records = tmp_path / "records"
    base = {k: v for k, v in os.environ.items() if not k.startswith("SPEEDRUN_")}
    argv = [sys.executable, "train_gpt.py", "--config", "smoke", "--records-dir", str(records),
            "--data-path", str(shards), "--val-tokens", "3000", "--max-steps", "0"]
    procs = {rank: subprocess.run(argv, cwd=REPO_ROOT, capture_output=True, text=True, timeout=120,
                                  env=dict(base, WORLD_SIZE="2", RANK=str(rank), LOCAL_RANK=str(rank)))
             for rank in (1, 0)}
    assert [p.returncode for p in procs.values()] == [2, 2]
    assert procs[1].stdout == procs[1].stderr == procs[0].stdout == ""
    assert procs[0].stderr.splitlines() == [
        "train_gpt.py: error: --max-steps 0: must be at least 1 (a truncated run trains that many steps; omit "
        "the flag to run the whole schedule)",
        "train_gpt.py: error: --val-tokens 3000: must be a positive multiple of one validation step, 2,048 tokens "
        "(2 ranks × 1,024); try --val-tokens 2048"]
    (entry,) = [json.loads(line) for line in (records / "runs.jsonl").read_text().splitlines()]
    assert entry["status"] == "failed" and entry["world_size"] == 2


def test_a_good_configuration_passes_the_check(shards):
    """The check refuses nothing the smoke run needs (the whole schedule, validation every 35 steps)."""
    from runtime.config_check import check_run

    cfg, args = train_gpt.parse_args(["--config", "smoke", "--data-path", str(shards), "--val-tokens", "32768"])
    check_run(cfg, args, env={})


@pytest.mark.parametrize("module, argv, message", [
    ("optim.schedule", ["--config", "smok"], "--config smok: unknown preset; choose from dev, record, smoke "
                                             "(did you mean smoke?)"),
    ("optim.schedule", ["--world-size", "0"], "argument --world-size: 0: must be a positive integer"),
    ("model.summary", ["--world-size", "-8"], "argument --world-size: -8: must be a positive integer"),
    ("model.summary", ["--config", "huge"], "argument --config: invalid choice: 'huge'"),
    ("tools.memory", ["--world-size", "0"], "argument --world-size: 0: must be a positive integer"),
    ("tools.memory", ["--config", "smoke", "--world-size", "3"], "--world-size 3: must divide --config smoke's 2 ranks"),
    ("tools.cost", ["--config", "dev", "--world-size", "3"], "--world-size 3: must divide --config dev's 8 ranks"),
    ("tools.capture_contract", ["--steps", "2"], "--steps 2: must be in [3, 70]"),
    ("tools.capture_contract", ["--config", "smoek"], "did you mean smoke?"),
    ("runtime.preflight", ["--config", "smoke", "--records-dir", "/proc/speedrun"], "--records-dir /proc/speedrun: "
                                                                                 "cannot write there"),
    ("records.certify", ["--baseline", "HEAD", "--candidate", "HEAD", "--runs", "1"], "--runs 1: needs at least 2"),
    ("tools.bench_loader", ["--steps", "0"], "argument --steps: 0: must be a positive integer"),
    ("tools.bench_optim", ["--world-size", "x"], "argument --world-size: 'x' is not an integer"),
    ("tools.bench_residual_fusion", ["--candidates", "-1"], "argument --candidates: -1: must be an integer >= 0"),
    ("tools.bench_rows", ["--text", "/nonexistent.txt"], "--text /nonexistent.txt: no such file"),
])
def test_every_entry_point_refuses_in_one_line(module, argv, message, capsys):
    import importlib

    with pytest.raises(SystemExit) as stop:
        importlib.import_module(module).main(argv)
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert err.splitlines() == [line for line in err.splitlines() if line.startswith(f"python -m {module}: error: ")]
    assert message in err and "Traceback" not in err


def test_set_parses_each_field_by_its_declared_type():
    from cli import apply_overrides

    cfg, _ = train_gpt.parse_args(["--config", "smoke", "--set", "optim.anvil_lr=0.02", "--set", "schedule.stages.2.lr_mul=1.5",
                                   "--set", "schedule.stages.0.mtp_start=1,0.5", "--set", "seed=none",
                                   "--set", "canonical_mask=true", "--set", "schedule.base_steps=1_000",
                                   "--set", "schedule.stages.4.softmax_p="])
    assert cfg.optim.anvil_lr == 0.02 and cfg.schedule.stages[2].lr_mul == 1.5
    assert cfg.schedule.stages[0].mtp_start == (1.0, 0.5) and cfg.schedule.stages[4].softmax_p == ()
    assert cfg.seed is None and cfg.canonical_mask is True and cfg.schedule.base_steps == 1000
    assert cfg.schedule.stages[1] == SMOKE.schedule.stages[1] and cfg.model == SMOKE.model  # nothing else moved
    assert cfg.overrides[0] == "optim.anvil_lr=0.02" and len(cfg.overrides) == 7
    with pytest.raises(ConfigError) as err:
        apply_overrides(SMOKE, ["model=3", "schedule.stages.9.lr_mul=1", "name=record", "nonsense", "val_every=1.5"])
    assert err.value.problems == [
        "--set model=3: model is a section: name one of its fields (model.FIELD=VALUE)",
        "--set schedule.stages.9.lr_mul=1: '9' is not an index of this tuple: 0..4",
        "--set name=record: name cannot be set: it names the preset (use --config) or records the --set flags",
        "--set nonsense: expected SECTION.FIELD=VALUE (e.g. --set optim.anvil_lr=0.02)",
        "--set val_every=1.5: '1.5' is not an integer"]


def test_quick_crosses_the_first_stage_transition_and_keeps_explicit_flags():
    """--quick: the smoke preset, no warmup, one validation step at the end, and the steps up to 2 past
    stage 0's end: 17 in the smoke schedule, 34 with --steps 120 (0.2854 / 0.9994 × 120) (`python -m optim.schedule --config smoke`)."""
    cfg, _ = train_gpt.parse_args(["--quick"])
    assert (cfg.name, cfg.max_steps, cfg.val_tokens, cfg.val_every, cfg.warmup, cfg.label) == \
        ("smoke", 19, 2048, 0, False, "quick")
    assert train_gpt.parse_args(["--quick", "--steps", "120"])[0].max_steps == 36
    cfg, _ = train_gpt.parse_args(["--quick", "--max-steps", "5", "--val-tokens", "4096", "--val-every", "2",
                                   "--label", "mine"])
    assert (cfg.max_steps, cfg.val_tokens, cfg.val_every, cfg.label, cfg.warmup) == (5, 4096, 2, "mine", False)
