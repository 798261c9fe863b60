"""One speedrun, top to bottom: the record #360 recipe (README record #92, ANVIL2) or a smaller preset.

    torchrun --standalone --nproc_per_node=8 train_gpt.py                                 # the record
    torchrun --standalone --nproc_per_node=1 train_gpt.py --config dev                    # one GPU
    torchrun --standalone --nproc_per_node=2 train_gpt.py --config smoke --data-path DIR  # CPU, minutes

args → config → setup → build → warmup → reset → timed loop → final validation → log.
The clock follows upstream's rules: warmup (compilation, one step per schedule geometry, and with
SPEEDRUN_CUDA_GRAPHS the capture of every step region, each checked against eager) is untimed
and undone in place; the clock starts after a barrier; per-run work (prefix table, canonical mask,
validation batch reads, tail-average ship) is on the clock; validation forwards are not.
Math lives in model/ and optim/, batches in data/, what it runs on (kernels, fp8, streams, compile, CUDA graphs) in perf/, the run's machinery in runtime/
(Setup, Run: the step, warmup, reset, validation: runtime/training.py), logs in records/.
"""
from __future__ import annotations

import os

os.environ.setdefault("PYTORCH_ALLOC_CONF", "expandable_segments:True")  # record #360

import argparse
import contextlib
import gc
import resource
import time
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist

from cli import ArgumentParser, add_proposal_argument, apply_overrides, exit_on_config_error
from config import PROPOSALS, RUN_PRESETS, ConfigError, RunConfig, features_line, proposal_line
from data.loader import TrainLoader
from model.canonical_mask import CanonicalMaskBuild
from model.prefix import STORED_TABLE, build_prefix_table, build_prefix_table_sharded, gpt2_bpe_available
from optim.schedule import TrainingSchedule
from optim.tail_average import TailAverages
from records.run_log import (format_peak_memory_line, format_step_line, format_train_loss_line, format_val_line,
                             progress_bar)
from records.run_record import RunRecorder
from runtime.checkpoints import CheckpointError, load_checkpoint, save_checkpoint
from perf.compile import allocator_settings_line, check_warmup_compiled, compiled_graphs
from runtime.config_check import check_run, records_folder, records_folder_problems, shard_globs
from runtime.loss_watch import LossWatch, check_finite
from runtime.preflight import check_node
from runtime.sync_check import host_side, sync_check
from runtime.throughput import RunCost, device_peak
from runtime.training import Run, Setup
from perf.collectives import named_timeouts

PRINT_EVERY = 25  # record #360: a step line every 25 steps, plus the last two
MIB = 1 << 20


# ----------------------------------------------------------------------------------------------------
# args → config
# ----------------------------------------------------------------------------------------------------


def parse_args(argv=None) -> tuple[RunConfig, argparse.Namespace]:
    ap = ArgumentParser(prog="train_gpt.py", description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="Presets: record (8×H100, the #360 recipe; refuses anything else), dev (1-8 "
                                        "CUDA GPUs, same recipe, gradient accumulation), smoke (CPU/gloo, minutes).")
    ap.add_argument("--config", default=None, choices=sorted(RUN_PRESETS), help="preset (default: record; smoke with --quick)")
    add_proposal_argument(ap)  # --proposal NAME (config.PROPOSALS); --steps and --set still win
    ap.add_argument("--quick", action="store_true",
                    help="the one-minute check of a change: the smoke preset, no warmup, the steps up to 2 past the first "
                         "stage transition, one validation step at the end (explicit flags still win)")
    ap.add_argument("--data-path", default=os.environ.get("DATA_PATH"),
                    help="folder holding the train and val shards (env DATA_PATH; default: the preset's)")
    ap.add_argument("--steps", type=int, default=os.environ.get("NUM_SCHEDULED_ITERATIONS"),
                    help="base scheduled steps before growth and extension (record: 1122; env NUM_SCHEDULED_ITERATIONS)")
    ap.add_argument("--max-steps", type=int, default=None,
                    help="stop after N >= 1 steps of the schedule (a quick check: no tail-average ship, not a record)")
    ap.add_argument("--seed", type=int, default=os.environ.get("TRAIN_SEED"),
                    help="seed every rank's RNG (env TRAIN_SEED); records run unseeded")
    ap.add_argument("--val-every", type=int, default=None, help="validate every N steps (0: only at the end)")
    ap.add_argument("--val-tokens", type=int, default=None,
                    help="tokens of each validation (a multiple of the preset's validation step)")
    ap.add_argument("--label", default=None, help="a label stored in runs.jsonl (group runs with it in the report)")
    ap.add_argument("--records-dir", default=None, help="where logs/ and runs.jsonl go (default: records)")
    ap.add_argument("--no-canonical-mask", action="store_true", help="validate without record #92's canonical mask")
    ap.add_argument("--no-warmup", action="store_true", help="skip the untimed warmup (never for records)")
    ap.add_argument("--log-train-loss", action="store_true", help="log the training loss every step (syncs the host)")
    ap.add_argument("--save-checkpoint", action="store_true",
                    help="save the model, its n-gram rows, step, config and code at the end (what --eval-checkpoint "
                         "and evaluate.py read; no optimizer state: docs/checkpoints.md)")
    ap.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE", dest="assignments",
                    help="set any config field, typed from its dataclass: --set optim.anvil_lr=0.02, "
                         "--set schedule.stages.2.lr_mul=1.5, --set model.mlp_hidden_dim=256 (repeatable; "
                         "applied last, logged and recorded in runs.jsonl)")
    ap.add_argument("--eval-checkpoint", type=Path, default=None, metavar="DIR",
                    help="only run the final validation of a checkpoint saved by --save-checkpoint")
    args = ap.parse_args(argv)  # syntax only: config_check.check_run judges the values, all at once

    if args.quick and args.config not in (None, "smoke"):
        raise ConfigError(f"--quick runs the smoke preset; drop --config {args.config} (or --quick)")
    args.config = args.config or ("smoke" if args.quick else "record")
    cfg = RUN_PRESETS[args.config]
    if args.proposal:  # before the flags below, which still win
        cfg = PROPOSALS[args.proposal].apply(cfg)
    overrides = {"data_path": args.data_path, "val_every": args.val_every, "val_tokens": args.val_tokens,
                 "label": args.label, "records_dir": args.records_dir, "max_steps": args.max_steps,
                 "seed": int(args.seed) if args.seed is not None else None}
    cfg = replace(cfg, **{k: v for k, v in overrides.items() if v is not None})
    if args.steps is not None:
        cfg = replace(cfg, schedule=replace(cfg.schedule, base_steps=int(args.steps)))
    if args.no_canonical_mask:
        cfg = replace(cfg, canonical_mask=False)
    if args.no_warmup:
        cfg = replace(cfg, warmup=False)
    if args.log_train_loss:
        cfg = replace(cfg, log_train_loss=True)
    if args.save_checkpoint:
        cfg = replace(cfg, save_checkpoint=True)
    args.set_problems = []
    if args.assignments:
        try:  # a bad assignment is reported with every other problem (config_check.check_run)
            cfg = replace(apply_overrides(cfg, args.assignments), overrides=tuple(args.assignments))
        except ConfigError as e:
            args.set_problems = e.problems
    if args.quick:  # after --steps and --set, so the crossing follows an edited schedule; explicit flags win
        cfg = quick(cfg, args)
    return cfg, args


def collect_canonical_mask(cfg: RunConfig, setup: Setup, build: CanonicalMaskBuild | None):
    """Rank 0's background-built mask, on every rank's device (None when the preset has none)."""
    if not cfg.canonical_mask:
        return None
    vocab = cfg.model.vocab_size
    mask = build.wait().to(setup.device) if build is not None else \
        torch.zeros((vocab, (vocab + 7) // 8), dtype=torch.uint8, device=setup.device)
    if setup.world_size > 1:
        dist.broadcast(mask, 0)
    return mask


def softmax_change_line(step: int, total: int, old_p: int, new_p: int, vocab: int) -> str:
    """The log line at a change of the sampled-softmax width: the training loss is a cross-entropy
    over P classes (or all V), so it jumps when P changes, most at the switch to the full softmax."""
    def classes(p: int) -> str:
        return f"sampled softmax over {p} classes" if p else f"full softmax over {vocab} classes"
    return (f"step:{step + 1}/{total} training loss from here: {classes(new_p)} (was {classes(old_p)}); "
            f"the train_loss values jump {'up' if (new_p or vocab) > (old_p or vocab) else 'down'} with it")


def log_validation_diagnostics(run: Run, log) -> None:
    """The line a feature prints after each val line, off the clock (CPLM, PR #379: α, a_sink, copy share)."""
    if run.validation_diagnostics is not None:
        log.print0(run.validation_diagnostics, console=True)


@contextlib.contextmanager
def garbage_collector_paused():
    """Collect once, freeze what survives (so later collections skip it) and keep the collector
    off until the block ends, as record #360 does for its timed loop; restored on any exit."""
    gc.collect()
    gc.freeze()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
        gc.unfreeze()


def shows_progress_bar(cfg: RunConfig, setup: Setup) -> bool:
    """The console's progress bar over the timed steps: rank 0 of a run that is not a record. A
    record's console (cfg.name == "record", or a preset that requires the fast path) keeps
    upstream's lines alone."""
    return setup.is_master and not (cfg.name == "record" or cfg.requires_fast_path)


def run_cost(cfg: RunConfig, setup: Setup, schedule: TrainingSchedule, log) -> RunCost:
    """The run's tokens/s, MFU and peak fraction (runtime/throughput.py). The last two need the model's
    FLOPs per geometry, counted on "meta" before the warmup (seconds, off the clock: runtime/op_count.py,
    imported only then), and the device's datasheet peak: without one (a CPU, a GPU not in
    runtime.throughput's table) the log shows neither rather than a wrong one."""
    peak = device_peak(torch.cuda.get_device_name(setup.device)) if setup.device.type == "cuda" else None
    if peak is None:
        return RunCost(schedule)
    from runtime.op_count import count_geometries  # the counter and the run on "meta": only where MFU is known
    cost = RunCost(schedule, count_geometries(cfg, setup.world_size), peak)
    log.print0(f"mfu: model FLOPs / (time × {peak.bf16_tflops:,.1f} TFLOP/s, the {peak.name}'s bf16 dense peak); "
               f"peak_fraction: each kind at its own peak ({peak.fp8_tflops:,.1f} fp8, {peak.bf16_tflops:,.1f} bf16) "
               f"(runtime/throughput.py)", console=True)
    return cost


def quick(cfg: RunConfig, args: argparse.Namespace) -> RunConfig:
    """`--quick`: a change trained and validated in about a minute on 2 CPU cores. No warmup; the steps
    up to 2 past the first stage transition, so a new batch size, windows, MTP weights and prefix
    weights are met (read from the schedule, so an edited schedule is still crossed); one validation
    step at the end, none in between. Flags given explicitly keep their values. Not a record: the run
    is truncated (--max-steps)."""
    try:
        schedule = TrainingSchedule(cfg.schedule)
    except ValueError:  # a schedule that cannot be built: config_check.check_run reports it
        return replace(cfg, warmup=False)
    explicit = {"max_steps": args.max_steps, "val_tokens": args.val_tokens, "val_every": args.val_every,
                "label": args.label}
    wanted = {"max_steps": min(schedule.stage_ends[1] + 2, schedule.total_steps), "val_tokens": cfg.val_batch_tokens,
              "val_every": 0, "label": "quick"}
    return replace(cfg, warmup=False, **{k: v for k, v in wanted.items() if explicit[k] is None})


# ----------------------------------------------------------------------------------------------------
# the run
# ----------------------------------------------------------------------------------------------------


def main(argv=None) -> None:
    # bad input is refused before any work: one line per problem, exit 2, a `failed` runs.jsonl line
    with exit_on_config_error("train_gpt.py", is_master=os.environ.get("RANK", "0") in ("0", "")):
        try:
            cfg, args = parse_args(argv)
            check_run(cfg, args)  # flags, SPEEDRUN_*, world size, schedule, data, checkpoint: all at once
        except ConfigError as refusal:
            record_refusal(argv, refusal)
            raise
        try:
            run_one(cfg, args)
        finally:  # also after a failure, so torchrun's other ranks are not left waiting on a collective
            if dist.is_initialized():
                dist.destroy_process_group()


def record_refusal(argv, refusal: ConfigError) -> None:
    """The refused run's `failed` runs.jsonl line (and log), where --records-dir can take them; read
    leniently from argv, since the flags themselves may be what was refused."""
    lenient = argparse.ArgumentParser(add_help=False)
    for flag in ("--config", "--records-dir", "--label"):
        lenient.add_argument(flag)
    lenient.add_argument("--quick", action="store_true")
    try:
        known, _ = lenient.parse_known_args(argv)
    except (SystemExit, argparse.ArgumentError):
        known = argparse.Namespace(config=None, records_dir=None, label=None, quick=False)
    name = known.config or ("smoke" if known.quick else "record")
    preset = RUN_PRESETS.get(name, RUN_PRESETS["record"])
    records = records_folder(replace(preset, records_dir=known.records_dir or preset.records_dir))
    unwritable = records_folder_problems(records)
    if unwritable:  # nowhere to record it: the message says so, with the other problems
        refusal.problems.extend(p for p in unwritable if p not in refusal.problems)
        return
    world_size = os.environ.get("WORLD_SIZE", "1")
    with contextlib.suppress(ConfigError), \
            RunRecorder(config=name, world_size=int(world_size) if world_size.isdigit() else 0,
                        rank=0 if os.environ.get("RANK", "0") in ("0", "") else 1, label=known.label or "",
                        logs_dir=records / "logs", runs_path=records / "runs.jsonl", console=False):
        raise refusal


def run_one(cfg: RunConfig, args: argparse.Namespace) -> None:
    records = records_folder(cfg)
    with RunRecorder(config=cfg.name, world_size=int(os.environ.get("WORLD_SIZE", 1)),
                     rank=int(os.environ.get("RANK", 0)), label=cfg.label, overrides=list(cfg.overrides),
                     logs_dir=records / "logs", runs_path=records / "runs.jsonl", proposal=cfg.proposal) as rec, \
            contextlib.ExitStack() as guards:
        log = rec.log
        setup = Setup(cfg)
        check_node(cfg, setup.backend)  # the record's node checks (runtime/preflight.py)
        train_glob, val_glob = shard_globs(cfg)
        setup.init_process_group(cfg.collective_timeout_s)
        log.print0(f"config {cfg.name}: {setup.world_size} process(es) × {setup.accum} accumulation step(s) "
                   f"= {cfg.virtual_world_size} ranks of the recipe; device {setup.device}; backend {setup.backend}",
                   console=True)
        if proposal_line(cfg):  # an open PR past the record: which, its features, its schedule
            log.print0(proposal_line(cfg), console=True)
        if cfg.overrides:
            log.print0("config overrides: " + " ".join(f"--set {a}" for a in cfg.overrides), console=True)
        if features_line(cfg.features):  # what differs from the record: features off, a proposal's on
            log.print0(features_line(cfg.features), console=True)

        run = Run(cfg, setup)
        # a collective another rank never reaches ends the run naming this rank's step and region
        guards.enter_context(named_timeouts(lambda: run.position, cfg.collective_timeout_s))
        log.print0(f"collectives: {dist.get_backend() if dist.is_initialized() else 'none (one process)'}, "
                   f"timeout {cfg.collective_timeout_s} s (collective_timeout_s)", console=True)
        if run.table_placement:
            log.print0(run.table_placement, console=True)
        if run.token_norm is not None:  # what the hashes (and the copy matcher) read
            log.print0(run.token_norm.line(), console=True)
        schedule = run.schedule
        n = schedule.total_steps
        log.print0(f"[schedule] stage ends={schedule.stage_ends} steps={n} split={schedule.split_step}", console=True)

        if args.eval_checkpoint is not None:
            try:  # checked before the run (runtime/config_check.py); this catches a folder changed since
                step = load_checkpoint(run, args.eval_checkpoint)
            except (FileNotFoundError, CheckpointError) as e:
                raise ConfigError(f"--eval-checkpoint {e}") from None
            val_loss = run.validate(run.val_batches(val_glob), schedule.final_windows())
            log.print0(format_val_line(step, n, val_loss, 0.0), console=True)
            log_validation_diagnostics(run, log)
            rec.finish(val_loss=val_loss, train_time_ms=0.0, steps=step)
            run.close()
            return

        # warmup on dummy data at every schedule geometry (compiles them all), then undo it in place
        cost = run_cost(cfg, setup, schedule, log)  # tokens/s, and MFU where the device's peak is known
        graphs_before_warmup = compiled_graphs()
        steps = min(n, cfg.max_steps) if cfg.max_steps else n
        if cfg.warmup:
            run.warmup(list(range(0, steps, cfg.val_every)) if cfg.val_every else [], log, horizon=steps)
            log.print0("resetting model and optimizer state", console=True)
        run.reset()
        warmup_graphs = compiled_graphs() - graphs_before_warmup
        if setup.backend.compile and cfg.warmup:  # a compile that silently did not happen stops here
            check_warmup_compiled(warmup_graphs, setup.backend)
        if run.graphs is not None:  # every key the clock meets was captured (and checked) in the warmup
            run.graphs.freeze()
            log.print0(f"cuda graphs: {run.graphs.summary()}", console=True)
            if setup.device.type == "cuda":
                torch.cuda.empty_cache()  # the eager warm-up calls' cached blocks; the graphs keep their pool
        log.print0(allocator_settings_line(setup.device), console=True)  # what the warmup's allocations got
        tails = TailAverages(run.manager, schedule)
        loader = TrainLoader(train_glob, setup.virtual_ranks, cfg.virtual_world_size, **run.hash_args,
                             virtual_seq_cap=cfg.schedule.virtual_seq_cap,
                             pin_memory=setup.device.type == "cuda" and run.batch_ring is None)  # the ring pins
        mask_build = CanonicalMaskBuild(cfg.model.vocab_size) if cfg.canonical_mask and setup.is_master else None

        # the clock
        # tiktoken's one-time BPE load (~0.2-0.9 s) off the clock; the prefix table reads it
        if not gpt2_bpe_available() and cfg.features.prefix_loss:
            log.print0(f"prefix table: tiktoken has no GPT-2 files here (no cache, no network): read from "
                       f"{STORED_TABLE.name}, the same table (model/prefix.py)", console=True)
        validation_graphs = 0
        setup.synchronize()
        train_ms, t0 = 0.0, time.perf_counter()
        graphs_before_loop = compiled_graphs()
        if mask_build is not None:
            mask_build.start()  # a forked child builds it while we train (record #92)
        # one slice per process, all-gathered (SPEEDRUN_SHARDED_PREFIX), else the whole build here;
        # none without the prefix term (features.prefix_loss off)
        if cfg.features.prefix_loss:
            run.model.set_prefix_table(
                build_prefix_table_sharded(cfg.model.vocab_size, setup.rank, setup.world_size, setup.device)
                if setup.backend.sharded_prefix and setup.world_size > 1
                else build_prefix_table(cfg.model.vocab_size).to(setup.device))
        def next_batches(step: int) -> list | None:  # None past the last step
            if step >= steps:
                return None
            with host_side():
                return loader.next_batches(schedule.batch_tokens(step) // cfg.virtual_world_size, schedule.doc_cap(step))

        following = next_batches(0)
        # each training loss read (the NaN check's, or every step's with --log-train-loss) is a curve
        # point: a log line (the console's too on CPU, as --log-train-loss prints it; a GPU run's console
        # keeps upstream's lines) and, through the list itself, runs.jsonl's train_curve, failed runs too
        loss_watch = LossWatch(setup.device, setup.world_size, on_read=lambda done, ms, loss: log.print0(
            format_train_loss_line(done, n, loss), console=setup.device.type == "cpu"))
        rec.record.train_curve = loss_watch.curve
        with garbage_collector_paused(), progress_bar(steps, log, shows_progress_bar(cfg, setup)) as bar:  # record #360: no
            # collection pauses inside the timed loop
            for step in range(steps):
                if cfg.val_every and step % cfg.val_every == 0:  # intermediate validation: off the clock
                    setup.synchronize()
                    train_ms += 1000 * (time.perf_counter() - t0)
                    graphs = compiled_graphs()
                    val_loss = run.validate(run.val_batches(val_glob), run.windows)  # no canonical mask mid-run
                    validation_graphs += compiled_graphs() - graphs
                    log.print0(format_val_line(step, n, val_loss, train_ms), console=True)
                    log_validation_diagnostics(run, log)
                    setup.synchronize()
                    t0 = time.perf_counter()
                if step and schedule.softmax_p(step) != schedule.softmax_p(step - 1):
                    log.print0(softmax_change_line(step, n, schedule.softmax_p(step - 1), schedule.softmax_p(step),
                                                   cfg.model.vocab_size), console=True)
                # SPEEDRUN_SYNC_CHECK=1: the step and its logging steps alike wait on nothing
                with sync_check(setup.device, enabled=setup.backend.sync_check):
                    # the loop reads one step ahead: the row prefetch plans the next step's rows now
                    batches, following = following, next_batches(step + 1)
                    loss_sum = run.train_step(step, batches, following)
                    tails.tick(step)  # this rank's rows: updated in place, gathers in flight or not
                    checked = cfg.log_train_loss or setup.device.type == "cpu" or (step + 1) % PRINT_EVERY == 0
                    step_ms = train_ms + 1000 * (time.perf_counter() - t0) if checked else None  # the host's clock
                    if checked and not cfg.log_train_loss:
                        loss_watch.observe(step, loss_sum, schedule.batch_tokens(step), step_ms)  # NaN check, no sync
                    loss_watch.poll()  # the last check's copy, read once it has landed (no wait)
                rec.progress(step + 1)
                if cfg.log_train_loss:  # every step's loss, read at once: a host sync per step (the flag says so)
                    if setup.world_size > 1:
                        dist.all_reduce(loss_sum)
                    train_loss = loss_sum.item() / schedule.batch_tokens(step)
                    check_finite(step, {"training loss (main + MTP + prefix terms)": train_loss})
                    loss_watch.add_point(step, step_ms, train_loss)  # its line and curve point
                    rec.record.train_losses = [*(rec.record.train_losses or []), train_loss]  # to the bit
                for line in run.calibration_lines:  # PR #371's chosen attention windows, once (after its step 593)
                    log.print0(line, console=True)
                run.calibration_lines = []
                if (step + 1) % PRINT_EVERY == 0 or step >= n - 2 or step + 1 == steps:
                    elapsed = train_ms + 1000 * (time.perf_counter() - t0)
                    log.print0(format_step_line(step + 1, n, elapsed, cost.tokens_per_s(step + 1, elapsed),
                                                cost.mfu(step + 1, elapsed), cost.peak_fraction(step + 1, elapsed)),
                               console=True)
                bar.update()
        loss_watch.finish()  # the last check's copy (the clock runs: a wait here is the run's own)
        timed_graphs = compiled_graphs() - graphs_before_loop - validation_graphs
        # on the clock: the final windows (no YaRN re-application), the val batches, the canonical
        # mask, the tail-average ship
        loader.close()
        run.flush()  # the last step's deferred gathers and fp8 refresh, before the ship reads the weights
        run.set_windows(schedule.final_windows(), yarn=False)
        final_batches = run.val_batches(val_glob)
        canonical_mask = collect_canonical_mask(cfg, setup, mask_build)
        if steps == n:
            tails.ship()
        else:
            log.print0(f"truncated at step {steps} of {n} (--max-steps): tail averages not shipped", console=True)
        setup.synchronize()
        train_ms += 1000 * (time.perf_counter() - t0)
        log.flush()

        graphs = compiled_graphs()
        val_loss = run.validate(final_batches, schedule.final_windows(), canonical_mask)
        validation_graphs += compiled_graphs() - graphs
        log.print0(format_val_line(steps, n, val_loss, train_ms), console=True)
        log_validation_diagnostics(run, log)
        if run.graphs is not None and run.graphs.eager_calls:
            log.print0(f"cuda graphs: {run.graphs.summary()}", console=True)
        if setup.backend.compile:  # dynamo's own counters: nothing may compile after the warmup
            log.print0(f"compiled graphs: warmup {warmup_graphs}, timed {timed_graphs}", console=True)
            log.print0(f"compiled graphs: validation after the warmup {validation_graphs}", console=True)
        if setup.device.type == "cuda":
            peak = (torch.cuda.max_memory_allocated() / MIB, torch.cuda.max_memory_reserved() / MIB)
            log.print0(format_peak_memory_line(*peak), console=True)
        else:
            rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
            peak = (rss, rss)
            log.print0(f"peak host memory (maxrss, rank 0): {rss:.0f} MiB", console=True)
        if cfg.save_checkpoint:
            folder = save_checkpoint(run, steps, records / "logs", log.run_id)
            log.print0(f"checkpoint saved to {folder}", console=True)
        rec.finish(val_loss=val_loss, train_time_ms=train_ms, steps=steps, peak_memory_mib=peak,
                   tokens_per_s=cost.tokens_per_s(steps, train_ms), mfu=cost.mfu(steps, train_ms),
                   peak_fraction=cost.peak_fraction(steps, train_ms))
        run.close()


if __name__ == "__main__":
    main()
