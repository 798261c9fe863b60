"""Every config field is read by what it configures (docs/DESIGN: "or it is gone"). The walk below
takes every field of RunConfig and its sections (model, schedule and its stages, optim, features),
changes it, builds the piece of the run that field configures through the run's own constructors
and checks that the piece sees the change: a table of field -> (new value, probe). A new field
without a probe fails the walk. The fields only the run outline reads (train_gpt.py: the records
folder, the log, the loop's length and checkpoints) are checked on one smoke run that changes all of
them at once, which also checks that `--set schedule.virtual_seq_cap=N` cuts the training segments
at N. The two fields no run configures by `--set` are refused by name.
"""
import dataclasses
import json
import re
import typing
from pathlib import Path

import numpy as np
import pytest
import torch

from cli import apply_overrides
from config import RUN_PRESETS, ConfigError, RunConfig, StageConfig
from model.gpt import GPT
from optim.manager import OptimizerManager
from optim.schedule import TrainingSchedule
from optim.tail_average import TailAverages
from runtime import config_check
from runtime.meta_rank import build_rank_on_meta
from tests.tiny_shards import write_tiny_shards

SMOKE = dataclasses.replace(RUN_PRESETS["smoke"], seed=0)


def field_paths(cls=RunConfig, prefix="") -> list[str]:
    """Every leaf field under cls as a `--set` path; a tuple of stages contributes `stages.*.FIELD`."""
    hints, out = typing.get_type_hints(cls), []
    for f in dataclasses.fields(cls):
        kind = hints[f.name]
        if dataclasses.is_dataclass(kind):
            out += field_paths(kind, f"{prefix}{f.name}.")
        elif typing.get_args(kind) and typing.get_args(kind)[0] is StageConfig:
            out += field_paths(StageConfig, f"{prefix}{f.name}.*.")
        else:
            out.append(prefix + f.name)
    return out


# ---- the pieces of a run, each built by the constructor the run uses --------------------------------


def schedule_piece(cfg: RunConfig) -> tuple:
    """The schedule the run steps through (optim/schedule.py), every step's settings."""
    s = TrainingSchedule(cfg.schedule, cfg.features)
    steps = range(s.total_steps)
    return s.total_steps, [s.settings(i) for i in steps], [s.max_seq_len(i) for i in steps], s.final_windows()


def _meta_optimizer(cfg: RunConfig):
    schedule = TrainingSchedule(cfg.schedule, cfg.features)
    with torch.device("meta"):
        model = GPT(cfg.model, features=cfg.features)
        manager = OptimizerManager(model.named_parameters(), schedule, cfg.optim, layout=(0, 1),
                                   absent=model.switched_off_parameters)
    return schedule, manager


def optimizer_piece(cfg: RunConfig) -> tuple:
    """Every step's optimizer scalars as the manager computes them (tensors left out: on meta)."""
    schedule, manager = _meta_optimizer(cfg)
    out = []
    for step in range(schedule.total_steps):
        for e in manager.entries.values():
            if e.rule.optim == "bank":
                scalars = manager.bank_scalars(e, step)
                out.append({k: v for k, v in vars(scalars).items() if not isinstance(v, torch.Tensor)})
            else:
                out.append(manager.adam_hparams(e, step))
        out.append(manager.ngram_event_hparams(step))
        out.append(manager.untie_due(step))  # the embed/lm_head split
    return tuple(map(repr, out))


def tails_piece(cfg: RunConfig) -> tuple:
    """The tail averages train_gpt.py builds over the manager: windows, blends, every step's rate."""
    schedule, manager = _meta_optimizer(cfg)
    with torch.device("meta"):
        tails = TailAverages(manager, schedule)
    return tuple((a.tag, a.window, tuple(a.blend.items()), tuple(tails.rate(a.tag, s) for s in range(tails.total_steps)))
                 for a in tails.accumulators)


def rank_piece(cfg: RunConfig) -> tuple:
    """One rank of the run on meta, built by training.Run itself (runtime/meta_rank.py): the model's
    parameters and buffers, its window block and paths, the n-gram table, the loader's hashes, the
    samplers, the virtual ranks and the canonical mask."""
    rank = build_rank_on_meta(cfg, 1)
    run, model = rank.run, rank.model
    return ([(n, tuple(t.shape), t.dtype) for n, t in [*model.named_parameters(), *model.named_buffers()]],
            model.block_size, model.fp8, model.fused_residuals,
            None if run.table is None else tuple(run.table.rows.shape),
            {**run.hash_args, "token_map": run.token_norm and run.token_norm.sha256}, len(run.samplers),
            run.setup.virtual_ranks, rank.canonical_mask is not None)


def checks_piece(cfg: RunConfig) -> tuple:
    """What the run's guards (runtime/config_check.py) say of the config: the process counts it
    allows, the device it needs, the shard globs and the records folder."""
    return (config_check.world_problems(cfg, {"WORLD_SIZE": "2"}), config_check.device_problems(cfg),
            config_check.shard_globs(cfg), config_check.records_folder(cfg))


def seeded_piece(cfg: RunConfig) -> tuple:
    """The seeded run's first weights (training.Run seeds torch before the model is drawn)."""
    from runtime import training
    cfg = dataclasses.replace(cfg, features=dataclasses.replace(cfg.features, ngram=False))  # no table: faster
    run = training.Run(cfg, training.Setup(cfg))
    return (run.model.qk_bank[0, 0, :4].tolist(),)


def fast_path_piece(cfg: RunConfig) -> tuple:
    """The record's preflight (runtime/preflight.py check_node): a preset that needs the fast path
    refuses this CPU machine."""
    from perf import backend as perf_backend
    from runtime.preflight import check_node
    try:
        check_node(cfg, perf_backend.current())
    except (ConfigError, RuntimeError) as e:
        return ("refused", type(e).__name__)
    return ("ran",)


S, O, T, R, C = schedule_piece, optimizer_piece, tails_piece, rank_piece, checks_piece
NORMUON = {"optim.bank_optimizer": "normuon"}  # the NorMuon constants are read when it runs

# ModelConfig's widths are checked together (num_heads · head_dim = model_dim, narrow below wide): these
# change the fields that must move with them in the same step
WIDER = {"model.head_dim": 32, "model.model_dim": 192}
MORE_HEADS = {"model.num_heads": 12, "model.head_dim": 8, "model.narrow_head_dim": 4}

# field -> (new value, the piece that must see it[, the preset's other fields changed first, or with it])
PROBES = {
    "model.vocab_size": (50432, R), "model.model_dim": (192, R, WIDER), "model.num_heads": (12, R, MORE_HEADS),
    "model.head_dim": (32, R, WIDER), "model.narrow_head_dim": (4, R),
    "model.mlp_hidden_dim": (128, R), "model.mudd_hidden_dim": (8, R), "model.ngram_rows": (8192, R),
    "model.ngram_sign_rows": (4096, R),
    "schedule.stages.*.batch_tokens": (2048, S), "schedule.stages.*.doc_cap": (512, S),
    "schedule.stages.*.ws_short": (2, S), "schedule.stages.*.ws_long": (4, S), "schedule.stages.*.lr_mul": (1.5, S),
    "schedule.stages.*.mtp_start": ((1.0, 0.5), S), "schedule.stages.*.mtp_end": ((1.0, 0.25, 0.0), S),
    "schedule.stages.*.prefix_weights": ((0.5,), S), "schedule.stages.*.softmax_p": ((256,), S),
    "schedule.base_steps": (50, S), "schedule.stage_durations": ((0.3, 0.3, 0.4), S),
    "schedule.taper_duration": (0.1, S), "schedule.growth_steps": (6, S), "schedule.growth_stage": (1, S),
    "schedule.extension_steps": (8, S), "schedule.lr_cooldown_frac": (0.5, S), "schedule.lr_floor": (0.2, S),
    "schedule.rail_warmup_steps": (10, S), "schedule.rail_cooldown_steps": (5, S), "schedule.rail_beta_min": (0.8, S),
    "schedule.rail_beta_max": (0.95, S), "schedule.rail_engage_step": (25, S), "schedule.table_period4_step": (16, S),
    "schedule.split_embed_stage": (3, O), "schedule.block_size": (64, R), "schedule.virtual_seq_cap": (512, S),
    "schedule.ws_post_yarn_ext": (16, S),
    "schedule.tail_ema_window": (16, T), "schedule.tail_ema_blend": (0.5, T), "schedule.tail_avg_window": (14, T),
    "schedule.tail_avg_period": (3, T), "schedule.tail_avg_rate": (0.1, T), "schedule.bank_blend_window": (16, T),
    "schedule.bank_blend_period": (3, T), "schedule.bank_blend": (0.5, T), "schedule.richardson_w": (0.1, T),
    "optim.bank_optimizer": ("normuon", O), "optim.anvil_lr": (0.03, O), "optim.anvil_weight_decay": (2.0, O),
    "optim.lane_beta2": (0.8, O), "optim.rail_fast_beta": (0.8, O), "optim.rail_slow_beta": (0.97, O),
    "optim.rail_fast_weight": (0.5, O), "optim.frobenius_margin": (1.2, O), "optim.frobenius_eps": (1e-5, O),
    "optim.normuon_lr": (0.03, O, NORMUON), "optim.normuon_weight_decay": (1.0, O, NORMUON),
    "optim.normuon_frobenius_margin": (1.05, O, NORMUON), "optim.adam_lr": (0.01, O), "optim.adam_eps": (1e-8, O),
    "optim.adam_weight_decay": (0.01, O), "optim.ngram_lr_mul": (50.0, O), "optim.ngram_beta2": (0.9, O),
    "optim.ngram_wd_mul": (4.0, O),
    "features.ngram": (False, R), "features.value_embeds": (False, R), "features.sampled_softmax": (False, R),
    "features.mtp": (False, S), "features.prefix_loss": (False, R), "features.fp8": (False, R),
    "features.residual_fusions": (False, R), "features.token_norm_hashes": (True, R),
    "features.doc_copy": (True, R, {"features.token_norm_hashes": True}),
    "features.cplm": (True, R),
    "features.approx_lm_head_grad": (True, S), "features.approx_attention_backward": (True, S),
    "device": ("cuda", C), "virtual_world_size": (4, R), "allowed_world_sizes": ((1,), C),
    "requires_fast_path": (True, fast_path_piece), "data_path": ("elsewhere", C), "train_pattern": ("a_*.bin", C),
    "val_pattern": ("b_*.bin", C), "canonical_mask": (True, R), "seed": (1, seeded_piece),
    "records_dir": ("elsewhere", C),
}
# read by the run outline alone (train_gpt.py): checked on the smoke run below
OUTLINE_FIELDS = {"val_tokens", "val_batch_tokens", "val_every", "warmup", "label", "log_train_loss",
                  "save_checkpoint", "max_steps", "collective_timeout_s", "ngram_table"}
# not set by --set: the preset's name (--config) and the record of the --set flags
REFUSED = {"name", "overrides", "proposal"}


def _changed(cfg: RunConfig, path: str, value, others: dict | None = None) -> RunConfig:
    if path.startswith("model.") and others:  # the widths move together: one ModelConfig
        fields = {p.split(".", 1)[1]: v for p, v in {**others, path: value}.items()}
        return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, **fields))
    if ".*." in path:  # a stage field: in every stage
        section, field = path.split(".*.")
        stages = tuple(dataclasses.replace(s, **{field: value}) for s in cfg.schedule.stages)
        return dataclasses.replace(cfg, schedule=dataclasses.replace(cfg.schedule, stages=stages))
    return apply_overrides(cfg, [f"{path}={','.join(map(str, value)) if isinstance(value, tuple) else value}"])


def test_every_field_has_a_probe_an_outline_check_or_is_refused():
    paths = field_paths()
    assert len(paths) == len(set(paths)) > 80
    assert set(paths) == PROBES.keys() | OUTLINE_FIELDS | REFUSED, "a new config field needs a probe here"
    assert not PROBES.keys() & OUTLINE_FIELDS and not (PROBES.keys() | OUTLINE_FIELDS) & REFUSED


@pytest.mark.parametrize("path", sorted(PROBES))
def test_the_piece_a_field_configures_sees_it(path):
    value, piece, *others = PROBES[path]
    others = others[0] if others else {}
    cfg = SMOKE
    if path.startswith("model."):
        changed = _changed(cfg, path, value, others)
    else:
        for other, v in others.items():
            cfg = _changed(cfg, other, v)
        changed = _changed(cfg, path, value)
    assert changed != cfg, f"{path}={value} is the preset's value"
    assert piece(changed) != piece(cfg), f"{path}: {piece.__name__} does not see it"


@pytest.mark.parametrize("path", sorted(REFUSED))
def test_a_field_no_run_sets_is_refused_by_name(path):
    with pytest.raises(ConfigError, match=f"--set {path}=x: {path} cannot be set"):
        apply_overrides(SMOKE, [f"{path}=x"])


# ---- the run outline's fields, and the virtual sequence cap, on one smoke run ----------------------


@pytest.fixture(scope="module")
def tiny_shards(tmp_path_factory):
    """Random documents of 64 tokens, in files of their own names (train_pattern, val_pattern)."""
    return write_tiny_shards(tmp_path_factory.mktemp("shards"), "learn", "check")


def test_a_smoke_run_reads_the_outline_fields_and_cuts_segments_at_the_virtual_seq_cap(tmp_path, tiny_shards,
                                                                                        monkeypatch):
    import train_gpt
    from data.loader import TrainLoader
    from runtime.loss_watch import LossWatch
    from runtime.training import Run
    seen, val_steps, observed = [], [], []

    class RecordedLoader(TrainLoader):  # the batches the training loop is given
        def next_batches(self, *args, **kwargs):
            batches = super().next_batches(*args, **kwargs)
            seen.extend(batches)
            return batches

    class RecordedRun(Run):  # the validation steps it reads
        def val_batches(self, val_glob):
            batches = super().val_batches(val_glob)
            val_steps.append([[b.inputs.numel() for b in step] for step in batches])
            return batches

    class RecordedWatch(LossWatch):  # the losses read without a per-step sync
        def observe(self, step, *args, **kwargs):
            observed.append(step)
            return super().observe(step, *args, **kwargs)

    monkeypatch.setattr(train_gpt, "TrainLoader", RecordedLoader)
    monkeypatch.setattr(train_gpt, "Run", RecordedRun)
    monkeypatch.setattr(train_gpt, "LossWatch", RecordedWatch)
    records = tmp_path / "elsewhere"
    sets = {"schedule.virtual_seq_cap": "24", "schedule.stages.0.batch_tokens": "256", "val_batch_tokens": "512",
            "val_tokens": "1024", "val_every": "2", "warmup": "false", "label": "outline", "log_train_loss": "false",
            "save_checkpoint": "true", "max_steps": "3", "collective_timeout_s": "123", "ngram_table": "host",
            "train_pattern": "*_learn_*.bin", "val_pattern": "*_check_*.bin", "records_dir": str(records),
            "data_path": str(tiny_shards), "seed": "0"}
    assert {k for k in sets if "." not in k} >= OUTLINE_FIELDS
    train_gpt.main(["--config", "smoke", *[a for k, v in sets.items() for a in ("--set", f"{k}={v}")]])
    (entry,) = [json.loads(line) for line in (records / "runs.jsonl").read_text().splitlines()]  # records_dir
    log = open(entry["log_path"]).read()  # (it holds the source too: lines are matched whole)
    assert entry["status"] != "failed" and entry["label"] == "outline" and entry["steps"] == 3  # label, max_steps
    assert entry["overrides"] == [f"{k}={v}" for k, v in sets.items()]
    # virtual_seq_cap: the 64-token documents are cut into attention segments of at most 24 tokens
    assert len(seen) == 3 * 2  # 3 steps of 2 virtual ranks
    for batch in seen:
        cu = batch.cu_seqlens.tolist()
        lengths = np.diff(cu)
        assert lengths.max() == 24 and batch.max_seq_len == 24 and 64 - 2 * 24 in lengths
    assert val_steps == [[[256, 256]] * 2] * 3  # val_tokens / val_batch_tokens = 2 steps, at steps 0, 2 and the end
    assert re.findall(r"^step:(\d+)/70 val_loss:", log, re.M) == ["0", "2", "3"]  # val_every
    assert observed == [0, 1, 2]  # log_train_loss off: the NaN watch reads the losses, no per-step sync
    assert not re.search(r"^warming up on dummy data", log, re.M)  # warmup off
    assert re.search(r"^collectives: none \(one process\), timeout 123 s", log, re.M)
    assert re.search(r"^n-gram table: host memory \(ngram_table=host", log, re.M)
    (folder,) = re.findall(r"^checkpoint saved to (.*)$", log, re.M)  # save_checkpoint
    assert (Path(folder) / "model.pt").exists()
