"""Feature switches (config.FeatureConfig, `--set features.X=false`): each removes its feature's cost,
not only its effect. Per switch, what the run, the model, the schedule and the optimizer no longer
build or call; the model without a feature against the record model with that feature zeroed; one
in-process smoke run with every switch off, whose log names them. The switches that exist elsewhere
(ANVIL -> NorMuon, SPEEDRUN_CUDA_GRAPHS, SPEEDRUN_COMPILE) are checked at the end.
"""
import contextlib
import dataclasses
import json
import re

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from cli import apply_overrides
from config import FEATURES as DECLARED, RUN_PRESETS, ConfigError, FeatureConfig, features_line
from data.loader import NO_NGRAM, dummy_batch
from model.gpt import GPT, StepArgs
from perf import backend as perf_backend
from optim.manager import OptimizerManager
from optim.schedule import StepWeights, TrainingSchedule
from optim.tail_average import TailAverages
from runtime import training
from runtime.config_check import checkpoint_problems
from tests.tiny_shards import write_tiny_shards

SMOKE = RUN_PRESETS["smoke"]
FEATURES = [f.name for f in dataclasses.fields(FeatureConfig)]
RECORD_FEATURES = [f.name for f in DECLARED if f.default]  # the record's, on by default; the rest are proposals'
ALL_OFF = FeatureConfig(**{name: False for name in FEATURES})


def _only_off(name: str) -> FeatureConfig:
    return dataclasses.replace(FeatureConfig(), **{name: False})


def _run(features: FeatureConfig, **overrides) -> training.Run:
    cfg = dataclasses.replace(SMOKE, seed=0, features=features, **overrides)
    return training.Run(cfg, training.Setup(cfg))


def _batches(run: training.Run, step: int) -> list:
    tokens = run.schedule.batch_tokens(step) // run.cfg.virtual_world_size
    return [dummy_batch(tokens, run.schedule.doc_cap(step), seed=10 * step + r, **run.hash_args)
            for r in run.setup.virtual_ranks]


def _forbid(monkeypatch, module, *names):
    """Make each module.name raise if anything calls (or constructs) it."""
    for name in names:
        def refuse(*args, _name=name, **kwargs):
            raise AssertionError(f"{module.__name__}.{_name} was called with its feature switched off")
        monkeypatch.setattr(module, name, refuse)


def _step_args(model: GPT, schedule: TrainingSchedule, step: int) -> StepArgs:
    mtp, prefix = StepWeights(schedule).load(step)
    s = schedule.settings(step)
    return StepArgs(ws_short=s.ws_short, ws_long=s.ws_long, mtp_weights=mtp, prefix_weight=prefix, training=True,
                    max_seq_len=schedule.max_seq_len(step))


# ---- the switches as config ------------------------------------------------------------------------


def test_every_switch_defaults_to_the_record_and_is_set_from_the_command_line():
    assert FEATURES == [f.name for f in DECLARED]  # one field per declaration (config.FEATURES), in its order
    for preset in RUN_PRESETS.values():
        assert preset.features == FeatureConfig() and FeatureConfig().off() == []
    assert features_line(FeatureConfig()) is None  # the record logs no features line
    for f in DECLARED:  # the record's features switch off; those past it (a proposal's) switch on
        cfg = apply_overrides(SMOKE, [f"features.{f.name}={'false' if f.default else 'true'}"])
        assert (cfg.features.off(), cfg.features.added()) == (([f.name], []) if f.default else ([], [f.name]))
        assert features_line(cfg.features).startswith(f"features: {f.name} {'off' if f.default else 'on'} (")
    with pytest.raises(ConfigError, match="FeatureConfig has no field 'ngrm' \\(did you mean ngram\\?\\)"):
        apply_overrides(SMOKE, ["features.ngrm=false"])
    with pytest.raises(ConfigError, match="'maybe' is not a bool"):
        apply_overrides(SMOKE, ["features.fp8=maybe"])


# ---- per switch: what is no longer built or called ------------------------------------------------


def test_ngram_off_allocates_no_table_exchange_sign_pool_or_hashes(monkeypatch):
    import data.loader
    import model.gpt
    _forbid(monkeypatch, training, "NgramTable", "RowExchange", "NgramRowOptimizer")
    _forbid(monkeypatch, data.loader, "ngram_row_ids", "ngram_sign_rows")
    run = _run(_only_off("ngram"))
    assert run.table is None and run.exchange is None and run.ngram_opt is None
    assert run.model.ngram_sign_pool is None and "ngram_sign_pool" not in dict(run.model.named_buffers())
    assert run.hash_args == NO_NGRAM
    batch = _batches(run, 0)[0]
    assert batch.ngram_ids is None and batch.ngram_sign_rows is None
    from perf.cuda_graphs.state import run_state
    assert not [name for name, _ in run_state(run) if "ngram" in name]
    _forbid(monkeypatch, model.gpt, "ngram_embed")  # no embedding, so no injection
    run.train_step(0, _batches(run, 0))
    assert not [key for key in run.static_inputs if key[0].startswith("ngram")]  # no sink leaf, no sign rows


def test_without_ngram_the_model_is_the_record_model_with_a_zero_table():
    """The injections (layer 0, 1, 4, 5, 9 and MUDD μ11) are all that the table adds: the record
    model reading zero rows gives bitwise the loss of the model without the table."""
    torch.manual_seed(0)
    record = GPT(SMOKE.model, fp8=False)
    torch.manual_seed(0)
    ablated = GPT(SMOKE.model, fp8=False, features=_only_off("ngram"))
    ablated.load_state_dict({k: v for k, v in record.state_dict().items() if k != "ngram_sign_pool"})
    schedule = TrainingSchedule(SMOKE.schedule)
    b = dummy_batch(128, 896, seed=3, ngram_half_rows=SMOKE.model.ngram_rows // 2)
    args = _step_args(record, schedule, 0)
    rows = torch.zeros(2 * 128, SMOKE.model.model_dim, dtype=torch.bfloat16)
    want = record(b.inputs, b.targets, b.cu_seqlens, rows, b.ngram_sign_rows, args)
    got = ablated(b.inputs, b.targets, b.cu_seqlens, None, None, args)
    assert torch.equal(got, want)
    nonzero = record(b.inputs, b.targets, b.cu_seqlens, rows + 0.5, b.ngram_sign_rows, args)
    assert not torch.equal(nonzero, want)  # (the rows do reach the loss when the table is on)
    with pytest.raises(ValueError, match="features.ngram is off: pass ngram_rows=None"):
        ablated(b.inputs, b.targets, b.cu_seqlens, rows, b.ngram_sign_rows, args)


def test_value_embeds_off_leaves_no_parameter_state_gradient_buffer_or_average():
    run = _run(_only_off("value_embeds"))
    params = dict(run.model.named_parameters())
    assert "value_embeds" not in params and "ve_gate_bank" not in params
    assert run.model.switched_off_parameters == ("value_embeds", "ve_gate_bank")
    assert "value_embeds" not in run.manager.entries and "ve_gate_bank" not in run.manager.entries
    assert not any(e.held is not None for e in run.manager.entries.values())  # no fp16 cycle gradient
    assert run.model.value_embed_grad_buffer is None
    tails = TailAverages(run.manager, run.schedule)
    assert [a.tag for a in tails.accumulators] == ["tail-ema", "tail-avg", "bank-blend"]
    # the table cadence selects no kernels any more: optimizer keys (CUDA graphs) collapse
    steps = range(run.schedule.total_steps)
    phases = {run.manager.phase_at(s) for s in steps}
    assert not any(p.table_event or p.period4 for p in phases)
    with torch.device("meta"):
        record = OptimizerManager(GPT(SMOKE.model).named_parameters(), run.schedule, layout=(0, 1))
        model = GPT(SMOKE.model, fp8=False, features=_only_off("value_embeds"))
    assert len(phases) < len({record.phase_at(s) for s in steps})
    # (value_embeddings is never called: the run with every switch off below forbids it)
    # the manager refuses a missing parameter it was not told about (the feature's rows, in its declaration's
    # order), and an unknown absent name
    with pytest.raises(ValueError, match=r"optimizer table entries \['value_embeds', 've_gate_bank'\] match no"):
        OptimizerManager(model.named_parameters(), run.schedule, layout=(0, 1))
    with pytest.raises(ValueError, match=r"absent parameters \['value_embed'\] are not in the optimizer table"):
        OptimizerManager(model.named_parameters(), run.schedule, layout=(0, 1), absent=["value_embed"])


def test_without_value_embeds_the_model_is_the_record_model_with_zero_value_embeddings():
    """V gets nothing but layer 10's MUDD mix, and the post-loop mix drops the four planes: the
    record model (fp32 here, so that only summation order differs) with zero planes."""
    torch.manual_seed(0)
    record = GPT(SMOKE.model, dtype=torch.float32, fp8=False, features=FeatureConfig(residual_fusions=False))
    with torch.no_grad():
        record.value_embeds.zero_()
    ablated = GPT(SMOKE.model, dtype=torch.float32, fp8=False, features=FeatureConfig(value_embeds=False, residual_fusions=False))
    ablated.load_state_dict({k: v for k, v in record.state_dict().items()
                             if k not in ("value_embeds", "ve_gate_bank")})
    with torch.no_grad():  # make the MUDD mix's value-embedding coefficients matter, were they kept
        for m in (record, ablated):
            torch.manual_seed(1)
            m.mudd_w2.normal_(0, 0.5)
            m.mudd_w2g.normal_(0, 0.5)
    schedule = TrainingSchedule(SMOKE.schedule)
    b = dummy_batch(128, 896, seed=4, ngram_half_rows=SMOKE.model.ngram_rows // 2)
    args = _step_args(record, schedule, 0)
    rows = torch.randn(2 * 128, SMOKE.model.model_dim)
    want = record(b.inputs, b.targets, b.cu_seqlens, rows, b.ngram_sign_rows, args)
    got = ablated(b.inputs, b.targets, b.cu_seqlens, rows, b.ngram_sign_rows, args)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)  # (bitwise on this machine)
    with torch.no_grad():
        record.value_embeds.normal_()
    assert not torch.allclose(record(b.inputs, b.targets, b.cu_seqlens, rows, b.ngram_sign_rows, args), want,
                              rtol=1e-6, atol=0)  # (the planes do reach the loss when they are on: 3e-5 here)


def test_sampled_softmax_off_is_the_full_softmax_every_step_with_no_candidate_sets(monkeypatch):
    on, off = TrainingSchedule(SMOKE.schedule), TrainingSchedule(SMOKE.schedule, _only_off("sampled_softmax"))
    assert any(on.softmax_p(s) for s in range(on.total_steps))
    assert [off.softmax_p(s) for s in range(off.total_steps)] == [0] * off.total_steps
    assert {off.settings(s).geometry[2] for s in range(off.total_steps)} == {0}
    _forbid(monkeypatch, training, "CandidateSampler")
    run = _run(_only_off("sampled_softmax"))
    assert run.samplers == []  # (no candidate set is built in a step: the run with every switch off below)


def test_mtp_off_is_one_weight_every_step():
    on, off = TrainingSchedule(SMOKE.schedule), TrainingSchedule(SMOKE.schedule, _only_off("mtp"))
    assert len(on.mtp_weights(0)) == 3  # record #360's stage 0: three terms
    assert [off.mtp_weights(s) for s in range(off.total_steps)] == [(1.0,)] * off.total_steps
    weights = StepWeights(off)
    assert weights.mtp_table.shape == (off.total_steps, 1) and torch.equal(weights.mtp_table, torch.ones(off.total_steps, 1))


def test_prefix_loss_off_has_no_term_no_table_and_no_build(monkeypatch):
    on, off = TrainingSchedule(SMOKE.schedule), TrainingSchedule(SMOKE.schedule, _only_off("prefix_loss"))
    assert StepWeights(on).load(0)[1] is not None
    weights = StepWeights(off)
    assert all(weights.load(s)[1] is None for s in range(off.total_steps))  # StepArgs.prefix_on: False, statically
    assert not any(off.settings(s).geometry[4] for s in range(off.total_steps))
    model = GPT(SMOKE.model, fp8=False, features=_only_off("prefix_loss"))
    assert model.prefix_table is None and "prefix_table" not in dict(model.named_buffers())
    with pytest.raises(ValueError, match="no prefix table"):
        model.set_prefix_table(torch.zeros(SMOKE.model.vocab_size, dtype=torch.long))
    b = dummy_batch(128, 896, seed=5, ngram_half_rows=SMOKE.model.ngram_rows // 2)
    args = StepArgs(mtp_weights=(1.0,), prefix_weight=torch.tensor(0.25))
    with pytest.raises(ValueError, match="features.prefix_loss is off"):
        model(b.inputs, b.targets, b.cu_seqlens, torch.zeros(256, SMOKE.model.model_dim, dtype=torch.bfloat16),
              b.ngram_sign_rows, args)


class Float8Ops(TorchDispatchMode):
    """Counts the ops that produce or read fp8 tensors."""

    def __init__(self):
        super().__init__()
        self.ops = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        tensors = [t for t in (*args, *(out if isinstance(out, (tuple, list)) else (out,)))
                   if isinstance(t, torch.Tensor)]
        if any(t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) for t in tensors):
            self.ops.add(str(func))
        return out


def test_fp8_off_runs_bf16_gemms_and_keeps_no_fp8_cache():
    assert perf_backend.current().fp8  # the backend could: the switch alone turns fp8 off
    schedule = TrainingSchedule(SMOKE.schedule)
    b = dummy_batch(128, 896, seed=6, ngram_half_rows=SMOKE.model.ngram_rows // 2)
    rows = torch.zeros(256, SMOKE.model.model_dim, dtype=torch.bfloat16, requires_grad=True)
    seen = {}
    for features in (FeatureConfig(), _only_off("fp8")):
        torch.manual_seed(0)
        model = GPT(SMOKE.model, features=features)
        model.refresh_fp8()
        args = _step_args(model, schedule, 0)
        with Float8Ops() as mode:
            model(b.inputs, b.targets, b.cu_seqlens, rows, b.ngram_sign_rows, args).backward()
        seen[features.fp8] = (mode.ops, model)
    assert seen[True][0], "the record forward/backward runs fp8 ops (else this test could not fail)"
    ops, model = seen[False]
    assert ops == set() and model.mlp_fp8 is None and not model.fp8
    fp8_buffers = lambda m: [n for n, t in m.named_buffers() if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)]
    assert fp8_buffers(model) == [] and len(fp8_buffers(seen[True][1])) == 4  # the e4m3 W1, W2 caches, both layouts


def test_tools_show_the_switches(capsys):
    from model import summary
    from optim import schedule
    from tools.memory import static_items
    from runtime.meta_rank import build_rank_on_meta
    summary.main(["--config", "smoke", "--set", "features.ngram=false"])
    out = capsys.readouterr().out
    assert "n-gram table: none (features.ngram off" in out and "ngram_sign_pool" not in out
    assert "switched off: ngram" in out
    summary.main(["--config", "smoke"])
    assert "n-gram table (not a parameter): 16,384 rows" in capsys.readouterr().out
    assert schedule.main(["--config", "smoke", "--set", "features.mtp=false", "--set", "features.prefix_loss=false",
                          "--set", "features.sampled_softmax=false"]) == 0
    rows = capsys.readouterr().out.splitlines()
    assert "switched off: sampled_softmax, mtp, prefix_loss (config.FeatureConfig)" in rows
    stage0 = next(r for r in rows if r.startswith(" 0 "))
    assert "[1.0] -> [1.0]" in stage0 and "(0.0,)" in stage0 and stage0.endswith("full@0")
    cfg = dataclasses.replace(SMOKE, features=ALL_OFF)
    names = {item.name for item in static_items(build_rank_on_meta(cfg, 2))}
    assert not {"n-gram table shard", "n-gram row Adam state", "adam value_embeds", "value_embeds cycle gradient"} & names
    assert "fp8 MLP caches (Fp8MLPState)" in names  # listed, at 0 bytes
    assert {"n-gram table shard", "value_embeds cycle gradient"} <= {i.name for i in static_items(build_rank_on_meta(SMOKE, 2))}


def test_an_evaluation_refuses_a_checkpoint_saved_with_other_switches(tmp_path):
    folder = tmp_path / "state_step000001"
    folder.mkdir()
    rows = SMOKE.model.ngram_rows
    torch.save({"step": 1, "config": dataclasses.asdict(SMOKE), "world_size": 1, "model": {}, "code": ""},
               folder / "model.pt")
    torch.save({"step": 1, "ngram_lo": 0, "ngram_hi": rows, "ngram_rows": torch.zeros(rows, SMOKE.model.model_dim)},
               folder / "rank0.pt")
    assert checkpoint_problems(SMOKE, folder) == []
    (line,) = checkpoint_problems(dataclasses.replace(SMOKE, features=_only_off("ngram")), folder)
    assert "saved by a run with other feature switches (features.ngram=true)" in line


# ---- one smoke run with every switch off ------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_shards(tmp_path_factory):
    """Random documents of 64 tokens: one training step and one validation step of the smoke preset."""
    return write_tiny_shards(tmp_path_factory.mktemp("shards"))


def test_a_smoke_run_with_every_switch_off_builds_none_of_them(tmp_path, tiny_shards, monkeypatch):
    import model.gpt
    import train_gpt
    from model.loss import CandidateSampler
    _forbid(monkeypatch, training, "NgramTable", "RowExchange", "NgramRowOptimizer", "CandidateSampler")
    _forbid(monkeypatch, train_gpt, "build_prefix_table", "build_prefix_table_sharded")
    _forbid(monkeypatch, model.gpt, "ngram_embed", "value_embeddings")
    _forbid(monkeypatch, CandidateSampler, "candidates")
    flags = [a for name in RECORD_FEATURES for a in ("--set", f"features.{name}=false")]
    small = ["--set", "schedule.stages.0.batch_tokens=256", "--set", "val_batch_tokens=512"]  # a quarter of the CPU work
    train_gpt.main(["--config", "smoke", "--records-dir", str(tmp_path), "--data-path", str(tiny_shards), "--no-warmup",
                    "--max-steps", "1", "--val-every", "0", "--val-tokens", "512", "--seed", "0", *flags, *small])
    (entry,) = [json.loads(line) for line in (tmp_path / "runs.jsonl").read_text().splitlines()]
    assert entry["status"] != "failed" and entry["overrides"] == (flags + small)[1::2]
    log = open(entry["log_path"]).read()  # (it holds the source too: lines are matched whole)
    (line,) = re.findall(r"^features: .*$", log, re.M)
    assert line.startswith("features: ngram off (no n-gram table, row exchange, row optimizer, sign pool or "
                           "injections), value_embeds off (")
    assert all(f"{name} off (" in line for name in RECORD_FEATURES) and " on (" not in line
    assert re.search(r"^step:1/70 train_loss:[0-9.]+$", log, re.M) and np.isfinite(entry["val_loss"])


# ---- the switches that live elsewhere ---------------------------------------------------------------


def test_normuon_cuda_graphs_and_compile_switches_remove_theirs():
    cfg = apply_overrides(SMOKE, ["optim.bank_optimizer=normuon"])
    manager = OptimizerManager(GPT(cfg.model, fp8=False).to("meta").named_parameters(), TrainingSchedule(cfg.schedule),
                               cfg.optim, layout=(0, 1))
    assert {e.state.velocity.shape[0] for e in manager.entries.values() if e.rule.optim == "bank"} == {1}  # one rail
    with perf_backend.use_backend(cuda_graphs=False, compile=False):
        run = _run(FeatureConfig())
        assert run.graphs is None and run.region_runner("optimizer", None, lambda: 7) == 7  # the plain call
        assert run.forward is run.model  # no torch.compile wrapper
    with perf_backend.use_backend(cuda_graphs=True, compile=True, compile_backend="eager"):
        run = _run(FeatureConfig())
        assert run.graphs is not None and run.forward is not run.model


def test_the_restricted_attention_backward_is_refused_on_an_attention_it_does_not_run():
    """features.approx_attention_backward (PR #371 part 2) runs its restricted backward on FA3 or the portable
    attention: a run on flex (whose forward hands no LSE over) stops at setup, naming the switch and the
    backend, rather than train with the stock backward under the switch's name."""
    cfg = dataclasses.replace(RUN_PRESETS["smoke"], features=FeatureConfig(approx_attention_backward=True, ngram=False))
    setup = training.Setup(cfg, backend=dataclasses.replace(perf_backend.current(), attention="flex"))
    with pytest.raises(ConfigError, match=r"features.approx_attention_backward=true \(PR #371 part 2\) runs its "
                                          r"restricted backward on FA3 .* or on the portable attention.*'flex'"):
        training.Run(cfg, setup)


@pytest.mark.slow
def test_the_calibration_reads_the_host_on_its_two_steps_only_and_the_restricted_step_after_it_reads_its_tables(
        monkeypatch):
    """features.approx_attention_backward on the smoke preset at base 30 steps (calibration on 16-17, restricted
    from 18), steps of a Run on dummy batches (one process playing 2 ranks), each under the sync check: the calibration's host
    reads pass (`permitted_sync`, only around them: without it the first one is caught), the tables hold the
    choice after step 17 (run alone) with the log's lines, and step 18 hands the model mode 2 and those tables (its forward
    and backward stood in: the model's side is tests/model/test_model_attention_modes.py)."""
    from runtime import sync_check
    from runtime.sync_check import HostSyncError

    cfg = RUN_PRESETS["smoke"]
    cfg = dataclasses.replace(cfg, seed=0, schedule=dataclasses.replace(cfg.schedule, base_steps=30),
                              features=FeatureConfig(approx_attention_backward=True, ngram=False))
    with perf_backend.use_backend(sync_check=True, host_checks=False):  # (the input checks read the host)
        run = training.Run(cfg, training.Setup(cfg))
    assert [run.schedule.attention_mode(s) for s in (15, 16, 17, 18)] == [0, 1, 1, 2]

    def step(s):
        tokens = run.schedule.batch_tokens(s) // cfg.virtual_world_size
        batches = [dummy_batch(tokens, run.schedule.doc_cap(s), seed=1000 * s + r, **run.hash_args)
                   for r in run.setup.virtual_ranks]
        with perf_backend.use_backend(sync_check=True, host_checks=False), sync_check.sync_check(run.setup.device):
            run.train_step(s, batches)

    with monkeypatch.context() as m:  # the exemption taken away: the calibration's first host read is caught
        m.setattr(training, "permitted_sync", contextlib.nullcontext)
        with pytest.raises(HostSyncError, match="host sync in a checked region"):
            step(16)
    run.reset()
    tables = {layer: t.clone() for layer, t in run.calibration.tables.items()}
    assert all((t == -1).all() for t in tables.values())
    # untrained weights on dummy data: no shortened window passes 0.2; with no bound every head takes the cheapest
    # (paired layers, 64-row tiles: 64; the others, 128-row tiles, 64 and 128 tie on cost: the smaller error)
    run.calibration.threshold = float("inf")
    step(17)  # the second calibration step alone (CI time: step 16 measures the same way, and chooses nothing)
    lines = run.calibration_lines
    assert len(lines) == 6 and lines[0].startswith("attention backward (PR #371): windows chosen from 2 snapshot(s)")
    for layer, table in run.calibration.tables.items():
        assert table.tolist() == [64] * 3 if layer in (0, 2, 5) else set(table.tolist()) <= {64, 128}, (layer, lines)
    calls = []
    monkeypatch.setattr(run, "forward_backward", lambda batch, rows, args: calls.append(args) or torch.zeros(()))
    step(18)
    assert len(calls) == 2  # both virtual ranks
    args = calls[0]
    assert args.attention_mode == 2 and args.attention_calibration is run.calibration
