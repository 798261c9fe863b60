"""One speedrun, top to bottom: the record #360 recipe (README record #92, ANVIL2) or a smaller preset.

    torchrun --standalone --nproc_per_node=8 train_gpt.py                                 # the record
    torchrun --standalone --nproc_per_node=1 train_gpt.py --config dev                    # one GPU
    torchrun --standalone --nproc_per_node=2 train_gpt.py --config smoke --data-path DIR  # CPU, minutes

args → config → setup → build → warmup → reset → timed loop → final validation → log.
The clock follows upstream's rules: warmup (compilation, one step per schedule geometry, and with
SPEEDRUN_CUDA_GRAPHS the capture of every step region, each checked against eager) is untimed
and undone in place; the clock starts after a barrier; per-run work (prefix table, canonical mask,
validation batch reads, tail-average ship) is on the clock; validation forwards are not.
Math lives in model/ and optim/, speed in perf/, batches in data/, logs in records/.
"""
from __future__ import annotations

import os

os.environ.setdefault("PYTORCH_ALLOC_CONF", "expandable_segments:True")  # record #360

import argparse
import collections
import contextlib
import datetime
import gc
import resource
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
import torch.distributed as dist

from config import RUN_PRESETS, ConfigError, RunConfig
from config_check import (ArgumentParser, apply_overrides, check_run, exit_on_config_error, records_folder,
                          records_folder_problems, shard_globs)
from data.loader import TrainLoader, dummy_batch, val_batches
from data.ngram import ngram_hash_sizes
from model.canonical_mask import CanonicalMaskBuild
from model.embeddings import NgramTable
from model.gpt import GPT, StepArgs
from model.loss import CandidateSampler
from model.prefix import build_prefix_table, build_prefix_table_sharded, gpt2_encoding
from optim.manager import NgramRowOptimizer, OptimizerManager
from optim.row_exchange import RowExchange
from optim.schedule import StepWeights, TrainingSchedule
from optim.tail_average import TailAverages
from perf import backend as perf_backend
from perf.attention_backends import assert_record_backends
from perf.collectives import named_timeouts
from perf.compile import compile_model, compiled_graphs
from perf.cost import RunCost, device_peak, schedule_cost
from perf.cuda_graphs.capture import RegionGraphs
from perf.cuda_graphs.contract import run_state
from perf.kernels.mlp import FP8_EXACT_SCALE_CALLS
from perf.pinned_batches import PinnedBatchRing
from perf.preflight import cheap_checks, raise_on_fail
from perf.sync_check import host_side, sync_check
from records.run_log import format_peak_memory_line, format_step_line, format_val_line, read_source
from records.run_record import RunRecorder, check_finite

REPO_ROOT = Path(__file__).resolve().parent
PRINT_EVERY = 25  # record #360: a step line every 25 steps, plus the last two
MIB = 1 << 20


# ----------------------------------------------------------------------------------------------------
# args → config
# ----------------------------------------------------------------------------------------------------


def parse_args(argv=None) -> tuple[RunConfig, argparse.Namespace]:
    ap = ArgumentParser(prog="train_gpt.py", description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="Presets: record (8×H100, the #360 recipe; refuses anything else), dev (1-8 "
                                        "CUDA GPUs, same recipe, gradient accumulation), smoke (CPU/gloo, minutes).")
    ap.add_argument("--config", default="record", choices=sorted(RUN_PRESETS), help="preset (default: record)")
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
    ap.add_argument("--save-checkpoint", action="store_true", help="save model, optimizer, step, config and code at the end")
    ap.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE", dest="assignments",
                    help="set any config field, typed from its dataclass: --set optim.anvil_lr=0.02, "
                         "--set schedule.stages.2.lr_mul=1.5, --set model.mlp_hidden_dim=256 (repeatable; "
                         "applied last, logged and recorded in runs.jsonl)")
    ap.add_argument("--eval-checkpoint", type=Path, default=None, metavar="DIR",
                    help="only run the final validation of a checkpoint saved by --save-checkpoint")
    args = ap.parse_args(argv)  # syntax only: config_check.check_run judges the values, all at once

    cfg = RUN_PRESETS[args.config]
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
    return cfg, args


# ----------------------------------------------------------------------------------------------------
# setup: processes, devices, the checks that must fail before any training
# ----------------------------------------------------------------------------------------------------


class Setup:
    """This process's place in the run: rank, world, device, and which virtual ranks it plays."""

    def __init__(self, cfg: RunConfig):
        self.rank = int(os.environ.get("RANK", 0))
        self.world_size = int(os.environ.get("WORLD_SIZE", 1))
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        want_cuda = cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())
        self.device = torch.device("cuda", local_rank) if want_cuda else torch.device("cpu")
        if want_cuda:
            torch.cuda.set_device(self.device)
        self.backend = perf_backend.current()
        self.is_master = self.rank == 0
        # gradient accumulation: process p plays virtual ranks p·A .. p·A + A − 1
        self.accum = cfg.virtual_world_size // self.world_size
        self.virtual_ranks = list(range(self.rank * self.accum, (self.rank + 1) * self.accum))

    def check(self, cfg: RunConfig) -> None:
        """The record's node checks (the configuration itself was checked up front, config_check.py)."""
        if cfg.requires_fast_path:  # a record run never falls back to a slower path
            assert_record_backends(self.backend)
            # the node's stack, GPUs, driver, CUDA 13 runtime, data, BPE files, disk, RAM, compiler
            raise_on_fail(cheap_checks(cfg))

    def init_process_group(self, timeout_s: int) -> None:
        if self.world_size > 1:
            dist.init_process_group(backend="nccl" if self.device.type == "cuda" else "gloo",
                                    timeout=datetime.timedelta(seconds=timeout_s))

    def synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        if self.world_size > 1:
            dist.barrier()


# ----------------------------------------------------------------------------------------------------
# build
# ----------------------------------------------------------------------------------------------------


def run_eagerly(region: str, key, fn):
    """`RegionGraphs.run`'s signature without CUDA graphs: just the call."""
    return fn()


@dataclass
class RowPrefetch:
    """Row pulls launched a step ahead (`Run.prefetch`): one per batch, valid while the n-gram
    table's version stands."""
    batches: list
    pulls: list  # optim/row_exchange.py PendingPull, one per batch
    version: int

    def wait(self) -> None:
        for pull in self.pulls:
            pull.wait()


class Run:
    """The model, its n-gram table shard, the optimizers and the per-rank samplers of one run."""

    def __init__(self, cfg: RunConfig, setup: Setup):
        self.cfg, self.setup = cfg, setup
        if cfg.seed is not None:
            torch.manual_seed(cfg.seed)
        self.schedule = TrainingSchedule(cfg.schedule)
        self.model = GPT(cfg.model, fp8=setup.backend.fp8).to(setup.device)
        if setup.world_size > 1:  # every rank starts from rank 0's weights and sign pool
            for t in [*self.model.parameters(), self.model.ngram_sign_pool]:
                dist.broadcast(t.data, 0)
        self.table = NgramTable(cfg.model, setup.rank, setup.world_size, device=setup.device)
        # keep_grads: gradients zeroed in place, never released (a captured backward adds into them)
        # defer_gathers (SPEEDRUN_DEFERRED_GATHERS): the bank all-gathers run between steps (`flush`)
        self.manager = OptimizerManager(self.model.named_parameters(), self.schedule, cfg.optim, keep_grads=True,
                                        defer_gathers=setup.backend.deferred_gathers)
        # value_embeds' backward adds straight into the optimizer's fp16 cycle buffer (record #360)
        self.model.value_embed_grad_buffer = self.manager.cycle_gradient("value_embeds")
        # the table's rows move between ranks by host-planned exchanges (no host sync on the device)
        self.exchange = RowExchange(cfg.model.ngram_rows, setup.rank, setup.world_size, setup.device)
        self.ngram_opt = NgramRowOptimizer(self.table.rows, self.table.rows.size(0), self.manager, self.exchange)
        self.step_weights = StepWeights(self.schedule, setup.device)  # MTP / prefix weights as tensors
        self.samplers = [CandidateSampler(cfg.model.vocab_size, r, cfg.virtual_world_size)
                         for r in setup.virtual_ranks]
        self.windows = self.schedule.windows(0)
        # the post-warmup reset's snapshot of the weights, off the device for the whole run: pinned
        # host memory on CUDA (copied back non-blocking; the clock starts after a synchronize), a
        # plain host copy otherwise. Tensors only: the YaRN scales (extra state) reset by reset_rotary.
        pin = setup.device.type == "cuda"
        self.initial_state = {
            k: torch.empty(v.shape, dtype=v.dtype, device="cpu", pin_memory=pin).copy_(v)
            for k, v in self.model.state_dict().items() if torch.is_tensor(v)}
        self.model.refresh_fp8()  # the fp8 weight caches, before the first training forward
        self.forward = compile_model(self.model, setup.backend)  # fullgraph; the module itself when not compiling
        self.hash_sizes = ngram_hash_sizes(cfg.model)  # the loader's n-gram hashes match the model's tables
        # CUDA graphs (SPEEDRUN_CUDA_GRAPHS): train_step runs each capturable region through
        # run_region(name, key, fn); the warmup captures every key, the timed loop replays
        # (perf/cuda_graphs/capture.py; on CPU its twin). perf/cuda_graphs/contract.py swaps its checker in as region_runner.
        self.graphs = RegionGraphs.for_device(setup.device, lambda: run_state(self), strict=cfg.requires_fast_path) \
            if setup.backend.cuda_graphs else None
        self.region_runner = self.graphs.run if self.graphs is not None else run_eagerly
        self.step_position = self.position = "setup"  # where a collective timeout names this rank
        self.static_inputs: dict[tuple, torch.Tensor] = {}  # (name, shape, dtype) -> device buffer
        self.batch_ring = PinnedBatchRing(setup.device) if setup.backend.pinned_batches else None
        # what the last update leaves for `flush`: the fp8 refresh (its exact mode) and, in the
        # manager, the deferred bank gathers
        self.fp8_refresh_pending: bool | None = None
        # SPEEDRUN_ROW_PREFETCH: the next step's row pulls, launched during this step
        self.prefetched: RowPrefetch | None = None

    def run_region(self, region: str, key, fn):
        """fn() as the capturable region (region, key): captured or replayed under CUDA graphs, else
        run; the position notes it for a collective timeout. (A method, not a closure stored on the
        run: that cycle kept the Run, its process-group tensors included, alive into interpreter exit,
        where gloo's threads aborted 1 exit in 6.)"""
        self.position = f"{self.step_position}, region {region} key {key!r}"
        out = self.region_runner(region, key, fn)
        self.position = f"{self.step_position}, between regions"
        return out

    def flush(self) -> None:
        """Finish the last optimizer update before anything reads the weights: wait for its
        deferred bank gathers (on CUDA the stream waits, not the host), then re-quantize the fp8
        MLP weights (a captured region of its own, keyed by the refresh mode). At the top of every
        training step and validation, in `reset`, and before the tail averages ship; a no-op when
        nothing is pending. The banks are first read by layer 0, so waiting here, before the
        forward, is waiting just before the first reader."""
        self.manager.wait_gathers()
        exact, self.fp8_refresh_pending = self.fp8_refresh_pending, None
        if exact is not None:
            self.run_region("fp8_refresh", exact, lambda: self.model.refresh_fp8(exact))

    def close(self) -> None:
        """Before destroy_process_group: no gather in flight, and no graph left holding the
        communicator (see RegionGraphs.release)."""
        self.manager.wait_gathers()
        if self.graphs is not None:
            self.graphs.release()

    def upload(self, host_batch, softmax_p: int, sampler: CandidateSampler | None = None, static: bool = False,
               plan=None):
        """The host batch on the device, its n-gram row plan and its sampled-softmax candidates.

        The plan and the candidates are built from the host batch (host work the sync check lets
        through); everything reaches the device by non-blocking copies (pinned memory on CUDA).
        static: copy into this geometry's static input buffers (`static_input`), as a captured
        training step needs, instead of into fresh device tensors. plan: the batch's row plan when
        already made (a prefetched pull's)."""
        with host_side():
            if plan is None:
                plan = self.exchange.plan(host_batch.ngram_ids)  # a host collective: every rank, same order
            candidates = sampler.candidates(host_batch.targets, softmax_p) if softmax_p else None
            if candidates is not None and self.setup.device.type == "cuda":
                candidates = candidates.pin_memory()
        if self.batch_ring is not None:  # a pinned slot and a side-stream copy (SPEEDRUN_PINNED_BATCHES)
            host_batch = self.batch_ring.to_device(host_batch)
        if static:
            batch = replace(host_batch, **{f: self.static_input(f, getattr(host_batch, f))
                                           for f in ("inputs", "targets", "cu_seqlens", "ngram_sign_rows")})  # ngram_ids: host only (the plan)
            if candidates is not None:
                candidates = self.static_input("candidates", candidates)
            return batch, plan, candidates
        batch = host_batch.to(self.setup.device, non_blocking=True)  # a no-op after the ring
        if candidates is not None:
            candidates = candidates.to(self.setup.device, non_blocking=True)
        return batch, plan, candidates

    def static_buffer(self, name: str, shape, dtype: torch.dtype, requires_grad: bool = False) -> torch.Tensor:
        """The run's device buffer for inputs of this name, shape and dtype: one buffer per step
        geometry, the same storage every step, so a captured step reads its inputs where it was
        captured. A requires_grad buffer is a leaf whose .grad persists too (the caller zeroes it)."""
        key = (name, tuple(shape), dtype)
        buf = self.static_inputs.get(key)
        if buf is None:
            buf = self.static_inputs[key] = torch.empty(shape, dtype=dtype, device=self.setup.device)
            buf.requires_grad_(requires_grad)
        return buf

    def static_input(self, name: str, src: torch.Tensor) -> torch.Tensor:
        """`src` copied (non-blocking, in place) into its static buffer (`static_buffer`)."""
        buf = self.static_buffer(name, src.shape, src.dtype)
        buf.copy_(src, non_blocking=True)
        return buf

    def set_windows(self, windows: tuple[int, int], yarn: bool = True) -> None:
        if windows != self.windows and yarn:
            self.model.rescale_rotary(self.windows, windows)
        self.windows = windows

    def train_step(self, step: int, batches, next_batches=None) -> torch.Tensor:
        """Forward and backward of this process's batches, then every optimizer. Returns the summed
        loss of the process's tokens (detached). next_batches: the batches of the step that follows
        (the loop's peek), whose n-gram rows are then pulled during this step (SPEEDRUN_ROW_PREFETCH)."""
        self.step_position = self.position = f"training step {step}"
        self.flush()  # the previous update's deferred gathers and fp8 refresh, before the forward
        s = self.schedule.settings(step)
        self.set_windows((s.ws_short, s.ws_long))
        mtp_weights, prefix_weight = self.step_weights.load(step)  # tensors: new values, same graph
        total = torch.zeros((), device=self.setup.device)
        table = self.table.rows
        prefetched = self.take_prefetched(batches)
        for i, (sampler, host_batch) in enumerate(zip(self.samplers, batches)):
            pulled = prefetched[i] if prefetched is not None else None
            batch, plan, candidates = self.upload(host_batch, s.softmax_p, sampler, static=True,
                                                  plan=pulled.plan if pulled is not None else None)
            # the sink leaf: the pulled rows (an all_to_all with host-planned sizes, outside the
            # captured region) expanded straight into this geometry's static leaf
            rows = self.static_buffer("ngram_rows", (plan.inverse_dev.numel(), table.size(1)), table.dtype,
                                      requires_grad=True)
            (pulled or self.exchange.start_pull(table, plan)).finish(out=rows)
            if i == len(batches) - 1:  # this step's own pulls are done: the next step's go now
                self.prefetch(step, next_batches)
            args = StepArgs(ws_short=s.ws_short, ws_long=s.ws_long, mtp_weights=mtp_weights,
                            prefix_weight=prefix_weight, candidates=candidates, training=True,
                            max_seq_len=batch.max_seq_len)

            def forward_backward(batch=batch, rows=rows, args=args):
                loss = self.forward(batch.inputs, batch.targets, batch.cu_seqlens, rows, batch.ngram_sign_rows, args)
                (loss / self.setup.accum).backward()  # the record's gradient: the mean over 8 ranks of each rank's sum
                return loss.detach()

            loss = self.run_region("forward_backward", s.geometry, forward_backward)
            self.ngram_opt.accumulate(plan, rows.grad)  # merged per distinct row: a per-batch size, outside
            rows.grad.zero_()  # the next backward accumulates into it (x + 0 is x, bitwise)
            total += loss
        if self.prefetched is not None:
            # the prefetch's exchange is done before the optimizer graph, whose captured
            # collectives would otherwise share the communicator with it unordered (on CUDA: a
            # stream wait; its rows stay unexpanded until the next step)
            self.prefetched.wait()
        # the host half of the update, outside the region: this step's lr, betas, bias corrections
        # into device scalars (in place)
        self.manager.load_scalars(step)
        self.run_region("optimizer", self.manager.phase(step), lambda: self.manager.step(step, untie=False))
        # the banks' all-gathers (SPEEDRUN_DEFERRED_GATHERS) and the fp8 refresh after them wait for
        # `flush`, at the next step's top; the refresh count is taken now (host state, in step order)
        self.manager.launch_deferred_gathers(step)
        if self.model.mlp_fp8 is not None:
            self.fp8_refresh_pending = self.model.next_fp8_refresh_exact()
        if self.manager.untie_due(step):  # once per run: embed's moments from lm_head's, host state too
            self.manager.untie()
        self.ngram_opt.step(step)
        return total

    def prefetch(self, step: int, next_batches) -> None:
        """Plan the next step's row pulls and launch them (SPEEDRUN_ROW_PREFETCH), unless this
        step is a table event: the event rewrites the table after the backward, and the next
        step must read its rows after that."""
        if next_batches is None or not self.setup.backend.row_prefetch or self.schedule.is_table_event(step):
            return
        with host_side():
            plans = [self.exchange.plan(b.ngram_ids) for b in next_batches]  # host collectives, step order
        self.prefetched = RowPrefetch(next_batches, [self.exchange.start_pull(self.table.rows, p) for p in plans],
                                      self.ngram_opt.version)

    def take_prefetched(self, batches):
        """The pulls `prefetch` launched for these batches (None when it did not), checked to be
        still valid: the same batch objects, no table change since."""
        prefetched, self.prefetched = self.prefetched, None
        if prefetched is None:
            return None
        if len(batches) != len(prefetched.batches) or any(a is not b for a, b in zip(batches, prefetched.batches)):
            raise RuntimeError("train_step: the batches differ from the next_batches the previous step "
                               "prefetched rows for (pass the loop's peeked batches unchanged)")
        if prefetched.version != self.ngram_opt.version:
            raise RuntimeError("train_step: the n-gram table changed after the rows were prefetched "
                               "(a table event or a reset came between)")
        return prefetched.pulls

    def region_keys(self, step: int) -> list[tuple[str, object]]:
        """The (region, key)s a run meets at `step` from step 0: what the warmup must capture (the
        fp8 refresh of a step's update runs at the next `flush`, once per step all the same)."""
        keys = [("forward_backward", self.schedule.settings(step).geometry),
                ("optimizer", self.manager.phase_at(step))]
        if self.model.mlp_fp8 is not None:
            keys.append(("fp8_refresh", self.fp8_refreshes_before(step) < FP8_EXACT_SCALE_CALLS))
        return keys

    @staticmethod
    def fp8_refreshes_before(step: int) -> int:
        """fp8 refreshes a run has done when `step` updates: the reset's, then one per step."""
        return step + 1

    def warmup(self, val_steps: list[int], log, horizon: int | None = None) -> None:
        """The untimed warmup on dummy data, so that every graph compiles here and the clock meets
        none: a training step at every schedule geometry (`warmup_steps`), the validation forward
        at the windows each intermediate validation will see (those of the step before it), and
        the final validation (final windows, a stand-in canonical mask of the real one's shape).
        Windows, YaRN scales and the order of window changes are the timed run's; each step's row
        pulls are prefetched as in the timed loop. `reset()` undoes it all."""
        cfg, schedule = self.cfg, self.schedule
        horizon = min(horizon or schedule.total_steps, schedule.total_steps)
        steps = warmup_steps(schedule, self.region_keys if self.graphs is not None else None, horizon)
        if self.graphs is not None:  # a key the run meets once is not worth a graph: it runs eagerly
            met = collections.Counter(key for st in range(horizon) for key in self.region_keys(st))
            self.graphs.eager_keys = {key for key, count in met.items() if count < 2}
        pending = {schedule.windows(max(k - 1, 0)) for k in val_steps}  # windows in force at each validation
        log.print0(f"warming up on dummy data at steps {steps}, validation at windows {sorted(pending)} "
                   f"and {schedule.final_windows()}", console=True)
        def batches(step: int) -> list:
            tokens = schedule.batch_tokens(step) // cfg.virtual_world_size
            return [dummy_batch(tokens, schedule.doc_cap(step), seed=step, **self.hash_sizes)
                    for _ in self.setup.virtual_ranks]

        following = batches(steps[0]) if steps else None
        for i, step in enumerate(steps):
            if self.windows in pending:
                pending.discard(self.windows)
                self.validate(self.dummy_val_batches(), self.windows)
            if self.model.mlp_fp8 is not None:  # the fp8 refresh mode the timed loop has at this step
                self.model.mlp_fp8.refresh_calls = self.fp8_refreshes_before(step)
            current, following = following, batches(steps[i + 1]) if i + 1 < len(steps) else None
            self.train_step(step, current, following)
        if pending:
            raise RuntimeError(f"warmup: no warmup step runs at windows {sorted(pending)} of an intermediate "
                               f"validation (warmup_steps must visit every stage)")
        if self.graphs is not None and self.graphs.pending():
            raise RuntimeError(f"warmup: CUDA-graph keys warmed once but never captured: {self.graphs.pending()} "
                               f"(warmup_steps must visit every key twice)")
        self.set_windows(schedule.final_windows(), yarn=False)
        vocab = cfg.model.vocab_size
        mask = torch.zeros((vocab, (vocab + 7) // 8), dtype=torch.uint8, device=self.setup.device) \
            if cfg.canonical_mask else None
        self.validate(self.dummy_val_batches(), schedule.final_windows(), mask)

    def dummy_val_batches(self) -> list[list]:
        """One validation step of random tokens with the real validation geometry (one segment per
        rank, no doc cap): what the warmup compiles the validation forward on."""
        per_rank = self.cfg.val_batch_tokens // self.cfg.virtual_world_size
        return [[dummy_batch(per_rank, per_rank, seed=r, virtual_seq_cap=per_rank, **self.hash_sizes)]
                for r in self.setup.virtual_ranks]

    def reset(self) -> None:
        """Undo the warmup in place (addresses unchanged): weights, optimizer state, table, samplers."""
        self.flush()  # no gather may land after the weights are restored
        if self.prefetched is not None:
            self.prefetched.wait()
            self.prefetched = None
        with torch.no_grad():
            for name, t in self.model.state_dict().items():
                if name in self.initial_state:  # tensors; the YaRN scales (extra state) reset below
                    t.copy_(self.initial_state[name], non_blocking=True)  # host → device, in place
            self.table.rows.zero_()
        # gradients zeroed in place, not released: the captured backward accumulates into them
        self.model.zero_grad(set_to_none=False)
        for buf in self.static_inputs.values():
            if buf.grad is not None:
                buf.grad.zero_()
        self.manager.reset()
        self.ngram_opt.reset()
        for sampler in self.samplers:
            sampler.reset()
        self.model.reset_rotary()
        self.windows = self.schedule.windows(0)
        self.model.rearm_fp8()
        self.model.refresh_fp8()

    def val_batches(self, val_glob: str) -> list[list]:
        """Every validation batch this process evaluates (read on the clock, record #360)."""
        cfg = self.cfg
        per_rank = cfg.val_batch_tokens // cfg.virtual_world_size
        return [list(val_batches(val_glob, r, cfg.virtual_world_size, per_rank, cfg.val_tokens, **self.hash_sizes))
                for r in self.setup.virtual_ranks]

    @torch.no_grad()
    def validate(self, batches: list[list], windows: tuple[int, int], canonical_mask=None) -> float:
        """Mean next-token loss over cfg.val_tokens (each process evaluates its virtual ranks)."""
        cfg, setup = self.cfg, self.setup
        self.step_position = self.position = "validation"
        self.flush()  # the last update's gathers and fp8 refresh
        total = torch.zeros((), dtype=torch.float64, device=setup.device)
        for step_batches in zip(*batches):
            for host_batch in step_batches:
                batch, plan, _ = self.upload(host_batch, 0)
                rows = self.exchange.pull(self.table.rows, plan)
                args = StepArgs(ws_short=windows[0], ws_long=windows[1], training=False,
                                max_seq_len=batch.max_seq_len, canonical_mask=canonical_mask)
                loss = self.forward(batch.inputs, batch.targets, batch.cu_seqlens, rows, batch.ngram_sign_rows, args)
                total += loss.double() * batch.inputs.numel()
        if setup.world_size > 1:
            dist.all_reduce(total)
        return total.item() / cfg.val_tokens


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


def warmup_steps(schedule: TrainingSchedule, region_keys=None, horizon: int | None = None) -> list[int]:
    """The first step of every schedule geometry (`StepSettings.geometry`: one compiled graph each)
    and the step after it (so Adam and table steps run too), plus the split step: every shape the
    clock will meet. With region_keys (step -> the CUDA-graph (region, key)s of that step, when
    capturing), also the earliest steps that make every key the clock meets more than once run
    twice: once to warm up, once to capture (perf/cuda_graphs/capture.py). horizon: the run stops
    before this step (--max-steps): only steps before it are planned for."""
    n = min(schedule.total_steps, horizon or schedule.total_steps)
    seen, steps = set(), {schedule.split_step, schedule.split_step + 1}
    for step in range(n):
        geometry = schedule.settings(step).geometry
        if geometry not in seen:
            seen.add(geometry)
            steps.update((step, step + 1))
    steps = {st for st in steps if st < n}
    if region_keys is not None:  # (keys the run meets once run eagerly: nothing to capture)
        met = collections.Counter(key for st in range(n) for key in region_keys(st))
        visits = collections.Counter(key for st in steps for key in region_keys(st))
        for step in range(n):
            keys = region_keys(step)
            if step not in steps and any(visits[key] < 2 <= met[key] for key in keys):
                steps.add(step)
                visits.update(keys)
    return sorted(steps)


def run_cost(cfg: RunConfig, setup: Setup, schedule: TrainingSchedule, log) -> RunCost:
    """The run's tokens/s and MFU (perf/cost.py). MFU needs the model's FLOPs per geometry, counted
    on "meta" before the warmup (seconds, off the clock), and the device's datasheet peak: without
    one (a CPU, a GPU not in perf.cost's table) the log shows no MFU rather than a wrong one."""
    peak = device_peak(torch.cuda.get_device_name(setup.device)) if setup.device.type == "cuda" else None
    if peak is None:
        return RunCost(schedule)
    cost = RunCost(schedule, schedule_cost(cfg, setup.world_size, optimizer=False), peak)
    log.print0(f"mfu against {peak.name}: {peak.fp8_tflops:,.0f} fp8 / {peak.bf16_tflops:,.0f} bf16 dense TFLOP/s "
               f"(perf/cost.py)", console=True)
    return cost


# ----------------------------------------------------------------------------------------------------
# checkpoints
# ----------------------------------------------------------------------------------------------------


def save_checkpoint(run: Run, step: int, logs_dir: Path, run_id: str) -> Path:
    """logs/<run_id>/state_step{step:06d}/: model.pt (rank 0) and rank{r}.pt (each rank's n-gram
    shard and optimizer state), written to temp files and renamed."""
    folder = logs_dir / run_id / f"state_step{step:06d}"
    folder.mkdir(parents=True, exist_ok=True)

    def atomic_save(obj, path: Path) -> None:
        tmp = path.with_suffix(".tmp")
        torch.save(obj, tmp)
        tmp.replace(path)

    if run.setup.is_master:
        atomic_save({"step": step, "config": asdict(run.cfg), "code": read_source(REPO_ROOT),
                     "model": run.model.state_dict(), "world_size": run.setup.world_size}, folder / "model.pt")
    atomic_save({"ngram_lo": run.table.lo, "ngram_hi": run.table.hi, "ngram_rows": run.table.rows,
                 "optimizer": {name: e.state for name, e in run.manager.entries.items()},
                 "optimizer_split": run.manager.split, "ngram_state": run.ngram_opt.state},
                folder / f"rank{run.setup.rank}.pt")
    return folder


def load_checkpoint(run: Run, folder: Path) -> int:
    """Model weights and this rank's n-gram rows (from whichever saved shards overlap them)."""
    model_file = folder / "model.pt"
    if not model_file.is_file():
        raise FileNotFoundError(f"--eval-checkpoint {folder}: no model.pt there (expected a folder written by "
                                f"--save-checkpoint: records/logs/<run_id>/state_stepNNNNNN)")
    saved = torch.load(model_file, map_location=run.setup.device, weights_only=False)
    run.model.load_state_dict(saved["model"])
    for shard_file in sorted(folder.glob("rank*.pt")):
        shard = torch.load(shard_file, map_location=run.setup.device, weights_only=False)
        lo, hi = max(shard["ngram_lo"], run.table.lo), min(shard["ngram_hi"], run.table.hi)
        if lo < hi:
            run.table.rows[lo - run.table.lo: hi - run.table.lo] = shard["ngram_rows"][lo - shard["ngram_lo"]: hi - shard["ngram_lo"]]
    run.model.refresh_fp8()
    return saved["step"]


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
    try:
        known, _ = lenient.parse_known_args(argv)
    except (SystemExit, argparse.ArgumentError):
        known = argparse.Namespace(config=None, records_dir=None, label=None)
    name = known.config or "record"
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
                     logs_dir=records / "logs", runs_path=records / "runs.jsonl") as rec, \
            contextlib.ExitStack() as guards:
        log = rec.log
        setup = Setup(cfg)
        setup.check(cfg)
        train_glob, val_glob = shard_globs(cfg)
        setup.init_process_group(cfg.collective_timeout_s)
        log.print0(f"config {cfg.name}: {setup.world_size} process(es) × {setup.accum} accumulation step(s) "
                   f"= {cfg.virtual_world_size} ranks of the recipe; device {setup.device}; backend {setup.backend}",
                   console=True)
        if cfg.overrides:
            log.print0("config overrides: " + " ".join(f"--set {a}" for a in cfg.overrides), console=True)

        run = Run(cfg, setup)
        # a collective another rank never reaches ends the run naming this rank's step and region
        guards.enter_context(named_timeouts(lambda: run.position, cfg.collective_timeout_s))
        log.print0(f"collectives: {dist.get_backend() if dist.is_initialized() else 'none (one process)'}, "
                   f"timeout {cfg.collective_timeout_s} s (collective_timeout_s)", console=True)
        schedule = run.schedule
        n = schedule.total_steps
        log.print0(f"[schedule] stage ends={schedule.stage_ends} steps={n} split={schedule.split_step}", console=True)

        if args.eval_checkpoint is not None:
            step = load_checkpoint(run, args.eval_checkpoint)
            val_loss = run.validate(run.val_batches(val_glob), schedule.final_windows())
            log.print0(format_val_line(step, n, val_loss, 0.0), console=True)
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
        if run.graphs is not None:  # every key the clock meets was captured (and checked) in the warmup
            run.graphs.freeze()
            log.print0(f"cuda graphs: {run.graphs.summary()}", console=True)
            if setup.device.type == "cuda":
                torch.cuda.empty_cache()  # the eager warm-up calls' cached blocks; the graphs keep their pool
        tails = TailAverages(run.manager, schedule)
        loader = TrainLoader(train_glob, setup.virtual_ranks, cfg.virtual_world_size, **run.hash_sizes,
                             pin_memory=setup.device.type == "cuda" and run.batch_ring is None)  # the ring pins
        mask_build = CanonicalMaskBuild(cfg.model.vocab_size) if cfg.canonical_mask and setup.is_master else None

        # the clock
        gpt2_encoding()  # tiktoken's one-time BPE load (~0.2-0.9 s) off the clock; the prefix table reads it
        validation_graphs = 0
        setup.synchronize()
        train_ms, t0 = 0.0, time.perf_counter()
        graphs_before_loop = compiled_graphs()
        if mask_build is not None:
            mask_build.start()  # a forked child builds it while we train (record #92)
        # one slice per process, all-gathered (SPEEDRUN_SHARDED_PREFIX), else the whole build here
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
        with garbage_collector_paused():  # record #360: no collection pauses inside the timed loop
            for step in range(steps):
                if cfg.val_every and step % cfg.val_every == 0:  # intermediate validation: off the clock
                    setup.synchronize()
                    train_ms += 1000 * (time.perf_counter() - t0)
                    graphs = compiled_graphs()
                    val_loss = run.validate(run.val_batches(val_glob), run.windows)  # no canonical mask mid-run
                    validation_graphs += compiled_graphs() - graphs
                    log.print0(format_val_line(step, n, val_loss, train_ms), console=True)
                    setup.synchronize()
                    t0 = time.perf_counter()
                if step and schedule.softmax_p(step) != schedule.softmax_p(step - 1):
                    log.print0(softmax_change_line(step, n, schedule.softmax_p(step - 1), schedule.softmax_p(step),
                                                   cfg.model.vocab_size), console=True)
                with sync_check(setup.device, enabled=setup.backend.sync_check):  # SPEEDRUN_SYNC_CHECK=1
                    # the loop reads one step ahead: the row prefetch plans the next step's rows now
                    batches, following = following, next_batches(step + 1)
                    loss_sum = run.train_step(step, batches, following)
                    tails.tick(step)  # this rank's rows: updated in place, gathers in flight or not
                rec.progress(step + 1)
                if cfg.log_train_loss or setup.device.type == "cpu" or (step + 1) % PRINT_EVERY == 0:
                    if setup.world_size > 1:
                        dist.all_reduce(loss_sum)
                    train_loss = loss_sum.item() / schedule.batch_tokens(step)
                    check_finite(step, {"training loss (main + MTP + prefix terms)": train_loss})
                    if cfg.log_train_loss:
                        log.print0(f"step:{step + 1}/{n} train_loss:{train_loss:.4f}", console=setup.device.type == "cpu")
                if (step + 1) % PRINT_EVERY == 0 or step >= n - 2 or step + 1 == steps:
                    elapsed = train_ms + 1000 * (time.perf_counter() - t0)
                    log.print0(format_step_line(step + 1, n, elapsed, cost.tokens_per_s(step + 1, elapsed),
                                                cost.mfu(step + 1, elapsed)), console=True)
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
                   tokens_per_s=cost.tokens_per_s(steps, train_ms), mfu=cost.mfu(steps, train_ms))
        run.close()


if __name__ == "__main__":
    main()
