"""train_gpt.py end to end on CPU: the failures a user meets, 1 vs 2 ranks, checkpoints, sync checks, overlap,
progress (the whole-schedule smoke acceptance run: tests/run/test_run_smoke.py).

The runs train on the embedded corpus (data/synthetic.py, the smoke preset's default data), written
into a temp dir once per session (conftest's `synthetic_shards`), so they need nothing from outside
the repository.
In-process runs call train_gpt.main() (one process, no torchrun); the distributed ones launch
torchrun with gloo in a subprocess.
"""
import json
import os
import re
import subprocess
import sys

import pytest
import torch

from config import RUN_PRESETS
from model.gpt import GPT
from records.run_log import REPO_ROOT, parse_log
from runtime.loss_watch import NonFiniteLossError
import train_gpt


@pytest.fixture(scope="module")
def shards(synthetic_shards):
    return synthetic_shards


def _runs(records):
    return [json.loads(line) for line in (records / "runs.jsonl").read_text().splitlines()]


def _main(records, *args):
    train_gpt.main(["--config", "smoke", "--records-dir", str(records), "--no-warmup", "--val-every", "0",
                    "--val-tokens", "2048", "--seed", "0", *args])


def _torchrun(nproc, *args, timeout=900, env=None):
    """stdout of a torchrun of train_gpt.py; with `env`, those variables are added and stderr is
    merged into the output in order (unbuffered), for TORCH_LOGS."""
    run_env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    run_env.update(env or {})
    if env:
        run_env["PYTHONUNBUFFERED"] = "1"
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
                           "train_gpt.py", "--config", "smoke", *args], cwd=REPO_ROOT, env=run_env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT if env else subprocess.PIPE,
                          text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-5000:] + (proc.stderr or "")[-3000:]
    return proc.stdout


# ---- failures during a run: each a clear message and a runs.jsonl entry ---------------------------
# (bad configurations are refused before the run: tests/run/test_run_bad_input.py)


def _poison_forward(monkeypatch, at_call, make):
    """Replace the training forward's result at its `at_call`-th call (counting from 1)."""
    original, calls = GPT.forward, {"n": 0}

    def forward(self, *args, **kwargs):
        loss = original(self, *args, **kwargs)
        if self.training or args[-1].training:
            calls["n"] += 1
            if calls["n"] == at_call:
                return make(loss)
        return loss

    monkeypatch.setattr(GPT, "forward", forward)


@pytest.mark.parametrize("flags, message, progress", [
    ((), "is nan at step 1", 2),  # the smoke preset's per-step loss line: read at once, after the step's progress
    (("--set", "log_train_loss=false"), r"is nan at step 1 \(read from a copy that landed after the step, "
                                        r"without a host sync; finite at step 0", 1)])  # the loss watch
def test_nan_loss_stops_naming_the_step_and_term(tmp_path, shards, monkeypatch, flags, message, progress):
    _poison_forward(monkeypatch, at_call=3, make=lambda loss: loss * float("nan"))  # step 1 (2 micro-batches a step)
    with pytest.raises(NonFiniteLossError, match=message):
        _main(tmp_path, "--data-path", str(shards), "--max-steps", "3", *flags)
    (entry,) = _runs(tmp_path)
    assert entry["status"] == "failed" and "training loss (main + MTP + prefix terms)" in entry["error"]
    assert entry["steps"] == progress  # progress recorded: step 1 finished its update before the check


def test_ctrl_c_is_interrupted_and_the_log_flushed(tmp_path, shards, monkeypatch):
    def interrupt(loss):
        raise KeyboardInterrupt

    _poison_forward(monkeypatch, at_call=3, make=interrupt)
    with pytest.raises(KeyboardInterrupt):
        _main(tmp_path, "--data-path", str(shards), "--max-steps", "3")
    (entry,) = _runs(tmp_path)
    assert entry["status"] == "interrupted" and entry["error"] == "interrupted (Ctrl-C) after step 1"
    log = open(entry["log_path"]).read()
    assert "KeyboardInterrupt" in log and "step:1/70 train_loss:" in log


# ---- the math does not depend on the process layout; checkpoints round-trip ----------------------


def _train_losses(log_path):
    return [float(m[1]) for m in re.finditer(r"^step:\d+/\d+ train_loss:([0-9.]+)$", open(log_path).read(), re.M)]


THREE_STEPS = ["--no-warmup", "--val-every", "0", "--val-tokens", "2048", "--seed", "0", "--max-steps", "3",
               "--log-train-loss"]


def _three_steps_in_process(shards, records, overlap: str, *extra) -> tuple[dict, object]:
    """THREE_STEPS in this process with the backend a fresh process started with
    SPEEDRUN_OVERLAP=`overlap` detects: (runs.jsonl entry, records dir). With WORLD_SIZE unset,
    train_gpt.main runs what `torchrun --nproc_per_node=1` runs (no process group either way),
    without its process and torch start-up. On one intra-op thread, as torchrun's processes run
    (OMP_NUM_THREADS=1): module fixtures run before `single_thread`, and on 2 threads this CPU
    (2026-12-03) rounds the second step's loss differently (12.424768 against 12.424812 on 1 thread
    and on 2 gloo ranks), which an earlier machine did not."""
    from dataclasses import asdict

    from perf import backend as perf_backend

    backend = perf_backend.detect(env={**os.environ, "SPEEDRUN_OVERLAP": overlap})
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with perf_backend.use_backend(**asdict(backend)):
            train_gpt.main(["--config", "smoke", "--data-path", str(shards), *THREE_STEPS, *extra,
                            "--records-dir", str(records)])
    finally:
        torch.set_num_threads(threads)
    (entry,) = _runs(records)
    return entry, records


@pytest.fixture(scope="module")
def eager_three_steps(tmp_path_factory, shards):
    """3 smoke steps in this process, eager, no warmup, every overlap piece on (the default), the
    checkpoint saved: (runs.jsonl entry, records dir). The reference of the warmup, compiled, layout
    and overlap tests, and the checkpoint the 2-process evaluation reads: one run serves them all
    (it was run twice, here and as a 1-process torchrun of the same arguments; CI time)."""
    records = tmp_path_factory.mktemp("nproc1-overlap1")
    # the --set is a no-op (record #360's own anvil_lr): the run records it, the math is unchanged
    return _three_steps_in_process(shards, records, "1", "--save-checkpoint", "--set", "optim.anvil_lr=0.023")


def test_a_cpu_run_records_tokens_per_second_its_overrides_and_no_mfu(eager_three_steps):
    """runtime/throughput.py's RunCost on a CPU: tokens/s in the last step line and in runs.jsonl; no MFU (no
    device peak to measure against); the --set assignments logged and recorded."""
    from optim.schedule import TrainingSchedule

    entry, _ = eager_three_steps
    tokens = sum(TrainingSchedule(RUN_PRESETS["smoke"].schedule).batch_tokens(s) for s in range(3))
    assert entry["tokens_per_s"] == pytest.approx(tokens / (entry["train_time_ms"] / 1000), rel=1e-6)
    assert entry["mfu"] is None and entry["peak_fraction"] is None and entry["overrides"] == ["optim.anvil_lr=0.023"]
    log = open(entry["log_path"]).read()
    assert "config overrides: --set optim.anvil_lr=0.023" in log
    assert re.search(r"^step:3/70 train_time:\d+ms step_avg:[0-9.]+ms tokens/s:\d+$", log, re.M)
    assert parse_log(log).steps[-1][0] == 3  # our parser reads the extended line


@pytest.fixture(scope="module")
def three_step_torchruns(tmp_path_factory, shards, eager_three_steps):
    """3 smoke steps on 1 process (in this process) and on 2 gloo ranks (torchrun), the overlap
    pieces on (the default) and off: {(nproc, "1" | "0"): (runs.jsonl entry, records dir)}. Shared
    by the layout and the overlap tests (CI time); the 1-process default run is `eager_three_steps`
    and the 2-rank default run saves its checkpoint too (each layout evaluates the other's)."""
    runs = {(1, "1"): eager_three_steps}
    records = tmp_path_factory.mktemp("nproc1-overlap0")
    runs[1, "0"] = _three_steps_in_process(shards, records, "0")
    for overlap in ("1", "0"):
        records = tmp_path_factory.mktemp(f"nproc2-overlap{overlap}")
        _torchrun(2, "--data-path", str(shards), *THREE_STEPS, "--records-dir", str(records),
                  *(["--save-checkpoint"] if overlap == "1" else []), env={"SPEEDRUN_OVERLAP": overlap})
        (entry,) = _runs(records)
        runs[2, overlap] = entry, records
    return runs


@pytest.mark.distributed
def test_one_and_two_ranks_train_the_same_and_checkpoints_round_trip(tmp_path, shards, three_step_torchruns):
    (run1, one), (run2, _) = three_step_torchruns[1, "1"], three_step_torchruns[2, "1"]
    losses1, losses2 = _train_losses(run1["log_path"]), _train_losses(run2["log_path"])
    assert len(losses1) == len(losses2) == 3
    # Same batches, same init; 1 process plays both ranks, each with its own gradients and fp8
    # scales (optim/lanes.py), and adds them as gloo's reduce of 2 does: bitwise the same run
    assert run1["train_losses"] == run2["train_losses"], (run1["train_losses"], run2["train_losses"])
    assert run1["val_loss"] == run2["val_loss"]

    # The 1-process checkpoint, evaluated by 2 processes (the n-gram shards are re-split).
    ckpt = next((one / "logs").glob("*/state_step000003"))
    assert {p.name for p in ckpt.iterdir()} == {"model.pt", "rank0.pt"}
    _torchrun(2, "--data-path", str(shards), "--val-tokens", "2048", "--records-dir", str(tmp_path / "eval"),
              "--eval-checkpoint", str(ckpt))
    (evaluated,) = _runs(tmp_path / "eval")
    assert evaluated["val_loss"] == run1["val_loss"]  # bitwise (measured; it was checked to rel 1e-6)


@pytest.mark.distributed
@pytest.mark.slow
def test_a_two_rank_checkpoint_evaluated_in_one_process_gives_the_two_rank_val_loss(tmp_path, shards,
                                                                                 three_step_torchruns):
    """Issue #30's acceptance: the 2-rank run's checkpoint (each rank wrote its half of the n-gram
    table into rank 0's run folder), evaluated in this process, whose one shard takes rows from both
    files: the 2-rank run's val loss to the last bit (a full-precision float in runs.jsonl)."""
    run2, two = three_step_torchruns[2, "1"]
    ckpt = next((two / "logs").glob("*/state_step000003"))
    assert {p.name for p in ckpt.iterdir()} == {"model.pt", "rank0.pt", "rank1.pt"}
    _main(tmp_path, "--data-path", str(shards), "--eval-checkpoint", str(ckpt))
    (evaluated,) = _runs(tmp_path)
    assert evaluated["val_loss"] == run2["val_loss"]


@pytest.mark.slow
def test_warmup_then_reset_leaves_no_trace(tmp_path, shards, eager_three_steps):
    """The untimed warmup (a step at every schedule geometry, the split included) followed by the
    in-place reset must train exactly like a run without warmup."""
    train_gpt.main(["--config", "smoke", "--records-dir", str(tmp_path / "warm"), "--val-every", "0",
                    "--val-tokens", "2048", "--seed", "0", "--data-path", str(shards), "--max-steps", "3",
                    "--log-train-loss"])
    (cold, _), (warm,) = eager_three_steps, _runs(tmp_path / "warm")
    assert "warming up on dummy data" in open(warm["log_path"]).read()
    assert _train_losses(warm["log_path"]) == _train_losses(cold["log_path"])
    assert warm["val_loss"] == cold["val_loss"]


def test_compiled_and_eager_losses_agree_for_three_steps(tmp_path, shards, eager_three_steps):
    from perf import backend as perf_backend

    torch._dynamo.reset()
    try:
        with perf_backend.use_backend(compile=True, compile_backend="aot_eager", host_checks=False):
            _main(tmp_path / "compiled", "--data-path", str(shards), "--max-steps", "3", "--log-train-loss")
    finally:
        torch._dynamo.reset()
    (eager, _), (compiled,) = eager_three_steps, _runs(tmp_path / "compiled")
    eager_losses, compiled_losses = _train_losses(eager["log_path"]), _train_losses(compiled["log_path"])
    assert len(compiled_losses) == 3
    assert compiled_losses == pytest.approx(eager_losses, rel=1e-4), (compiled_losses, eager_losses)
    assert compiled["val_loss"] == pytest.approx(eager["val_loss"], rel=1e-4)


# Each wrapper adds one host sync to one part of the timed step; the check must stop the run at it.
def _sync_in_forward(monkeypatch):
    original = GPT.forward

    def forward(self, *args, **kwargs):
        loss = original(self, *args, **kwargs)
        if loss.item() > 1e30:  # INJECTED SYNC forward
            raise AssertionError
        return loss

    monkeypatch.setattr(GPT, "forward", forward)


def _sync_in_optimizer(monkeypatch):
    from optim.manager import OptimizerManager

    original = OptimizerManager.update  # the optimizer's captured part (OptimizerManager.step calls it)

    def update(self, step):
        original(self, step)
        int(self.entries["scalars"].param.argmax())  # INJECTED SYNC optimizer

    monkeypatch.setattr(OptimizerManager, "update", update)


def _sync_in_row_exchange(monkeypatch):
    from optim.row_exchange import PendingPull

    original = PendingPull.finish

    def finish(self, out=None):  # every pull of a training step ends here, prefetched or not
        rows = original(self, out=out)
        bool(rows.isnan().any())  # INJECTED SYNC row exchange
        return rows

    monkeypatch.setattr(PendingPull, "finish", finish)


def _sync_in_loss_watch(monkeypatch):
    from runtime.loss_watch import LossWatch

    original = LossWatch.observe

    def observe(self, step, loss_sum, *rest):  # the NaN check of a logging step (every step on CPU)
        bool(loss_sum.isnan())  # INJECTED SYNC loss watch
        return original(self, step, loss_sum, *rest)

    monkeypatch.setattr(LossWatch, "observe", observe)


@pytest.mark.parametrize("inject, where", [(_sync_in_forward, "forward"), (_sync_in_optimizer, "optimizer"),
                                           (_sync_in_row_exchange, "row exchange"),
                                           (_sync_in_loss_watch, "loss watch")])
def test_sync_check_names_an_injected_sync(tmp_path, shards, monkeypatch, inject, where):
    from perf import backend as perf_backend
    from runtime.sync_check import HostSyncError

    inject(monkeypatch)
    with perf_backend.use_backend(sync_check=True, host_checks=False):
        with pytest.raises(HostSyncError) as err:  # the loss watch, not the smoke preset's per-step loss line
            _main(tmp_path, "--data-path", str(shards), "--max-steps", "2", "--set", "log_train_loss=false")
    msg = str(err.value)
    assert "aten._local_scalar_dense" in msg and "tests/run/test_run_train.py:" in msg, msg
    assert f"INJECTED SYNC {where}" in msg, msg
    assert _runs(tmp_path)[0]["status"] == "failed"


def test_sync_check_passes_a_clean_run(tmp_path, shards):
    from perf import backend as perf_backend

    with perf_backend.use_backend(sync_check=True, host_checks=False):  # the logging steps' loss watch too
        _main(tmp_path, "--data-path", str(shards), "--max-steps", "4", "--set", "log_train_loss=false")
    (entry,) = _runs(tmp_path)
    assert entry["status"] == "finished" and entry["steps"] == 4


# ---- overlap: each piece hides work without changing the math -----------------------------------


@pytest.mark.distributed
@pytest.mark.slow
def test_overlap_on_and_off_train_bitwise_alike(tmp_path, shards, three_step_torchruns):
    """Every overlap piece on (the default: pinned batch ring, fused QKV path, sharded prefix table,
    deferred bank gathers, row prefetch) and all off (SPEEDRUN_OVERLAP=0), on 1 process and on 2
    gloo ranks: the same logged train losses and the same final val loss to the last bit (a
    full-precision float in runs.jsonl, a function of every weight after the steps). Then 2 ranks
    with everything on and the regions graphed."""
    results = {key: (_train_losses(entry["log_path"]), entry["val_loss"])
               for key, (entry, _) in three_step_torchruns.items()}
    for nproc in (1, 2):
        assert len(results[nproc, "1"][0]) == 3
        assert results[nproc, "1"] == results[nproc, "0"], (nproc, results)
    # and on 2 ranks with the warmup's captures replayed (the CPU twin of CUDA graphs): the deferred
    # gathers and the prefetched pulls run eagerly between graphs, the fp8 refresh in its own graph
    records = tmp_path / "nproc2-graphed"
    _torchrun(2, "--data-path", str(shards), *[a for a in THREE_STEPS if a != "--no-warmup"],
              "--records-dir", str(records), env={"SPEEDRUN_OVERLAP": "1", "SPEEDRUN_CUDA_GRAPHS": "1"})
    (entry,) = _runs(records)
    assert (_train_losses(entry["log_path"]), entry["val_loss"]) == results[2, "0"]
    log = open(entry["log_path"]).read()
    assert re.search(r"cuda graphs: graphs captured: forward_backward \d+, fp8_refresh \d+, optimizer \d+; "
                     r"replay vs eager: (\d+)/\1 tensors bitwise", log), log[-3000:]


# ---- a compile that silently does not happen ---------------------------------------------------------


def test_a_compiled_run_whose_warmup_compiled_nothing_stops_before_the_clock(tmp_path, shards, monkeypatch):
    """A compile that silently does not happen (a torch that declines the model, a wrapper that
    returns it as it is; torch 2.13's fullgraph refuses a dynamo switched off by itself, 2.10 may
    not): the run must not time the eager model."""
    from runtime import training
    from perf import backend as perf_backend
    from perf.compile import NothingCompiled

    monkeypatch.setattr(training, "compile_model", lambda model, backend=None: model)  # the fault
    with perf_backend.use_backend(compile=True, compile_backend="aot_eager"):
        with pytest.raises(NothingCompiled, match=r"SPEEDRUN_COMPILE=1 \(backend aot_eager\) but the warmup compiled "
                                                  r"no graph"):
            train_gpt.main(["--config", "smoke", "--records-dir", str(tmp_path), "--data-path", str(shards),
                            "--max-steps", "1", "--val-tokens", "2048", "--seed", "0"])
    (entry,) = _runs(tmp_path)
    assert entry["status"] == "failed" and not entry["steps"]  # stopped before the first timed step


# ---- what an experimenter sees: curves and progress (issue 40) -------------------------------------


def test_two_smoke_runs_give_one_training_curve_each_in_the_report(tmp_path, shards, capsys, monkeypatch):
    """Two short runs, one reading its loss every step (--log-train-loss, the smoke preset's default),
    one through the loss watch (no sync): each logs its points, runs.jsonl keeps them, and the
    report's --curves draws one training curve per run. The progress bar goes to stderr only."""
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    from records import report

    _main(tmp_path, "--data-path", str(shards), "--max-steps", "2", "--label", "every-step")
    out = capsys.readouterr()
    _main(tmp_path, "--data-path", str(shards), "--max-steps", "2", "--label", "watch", "--set", "log_train_loss=false")
    out_watch = capsys.readouterr()
    runs = _runs(tmp_path)
    assert [r["status"] for r in runs] == ["finished", "finished"]
    for r, console in zip(runs, (out, out_watch)):
        curve = r["train_curve"]
        assert [p[0] for p in curve] == [1, 2] and curve[0][1] < curve[1][1]
        log = open(r["log_path"]).read()
        assert _train_losses(r["log_path"]) == [round(p[2], 4) for p in curve]  # one line per point, not two
        assert len(re.findall(r"^step:\d+/70 train_loss:", console.out, re.M)) == 2  # CPU: the console too
        bar = re.compile(r"training: +\d+%\|")  # tqdm's bar (the log holds this file's source: a pattern)
        assert bar.search(console.err) and ("step/s" in console.err or "s/step" in console.err)
        assert not bar.search(console.out) and not bar.search(log)
    assert runs[0]["train_curve"] == [[s, ms, loss] for (s, ms, _), loss in zip(runs[0]["train_curve"],
                                                                                 runs[0]["train_losses"])]
    figures, close = [], plt.close
    monkeypatch.setattr(plt, "close", lambda fig: figures.append(fig) or close(fig))
    png = tmp_path / "out.png"
    assert report.main(["--runs", str(tmp_path / "runs.jsonl"), "--group-by", "label", "--curves", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for ax in figures[0].axes:
        assert sorted(line.get_gid() for line in ax.get_lines()) == \
            sorted(["target"] + [f"train {r['run_id']}" for r in runs])


def test_the_progress_bar_stays_out_of_a_record_runs_console():
    from config import RUN_PRESETS

    class Rank0:
        is_master = True

    class Rank1:
        is_master = False

    assert not train_gpt.shows_progress_bar(RUN_PRESETS["record"], Rank0())
    assert train_gpt.shows_progress_bar(RUN_PRESETS["recipe"], Rank0())  # one GPU, minutes: not a record
    assert train_gpt.shows_progress_bar(RUN_PRESETS["smoke"], Rank0())
    assert not train_gpt.shows_progress_bar(RUN_PRESETS["smoke"], Rank1())
