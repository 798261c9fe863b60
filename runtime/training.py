"""The machinery of one run, which train_gpt.py reads top to bottom and the tools drive directly.

    Setup        this process's rank, world, device and virtual ranks; the node checks
    Run          the model, its n-gram table shard, the optimizers and samplers: `train_step` (the
                 captured regions), `warmup` and `reset`, `validate`, `flush`
    warmup_steps the steps the untimed warmup visits (every geometry, and every CUDA-graph key twice)

It lives apart from train_gpt.py so that tools (tools/capture_contract.py and capture.py, tools/cross_compile.py,
tools/memory.py, the tests) build the run exactly as the script does without importing the script: nothing imports
train_gpt.py, so no import circle runs through it (docs/design.md, "Import rules"). Checkpoints, which
read and write a Run: runtime/checkpoints.py.
"""
from __future__ import annotations

import collections
import contextlib
import datetime
import functools
import os
import time
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from config import ConfigError, RunConfig
from data.loader import NO_NGRAM, dummy_batch, val_batches
from data.ngram import ngram_hash_sizes
from model.attention_calibration import CalibrationState, eligible_layers
from model.embeddings import NgramTable, ngram_shard_range
from model.cplm import COPY_TOKEN_ID, diagnostics_line
from model.gpt import GPT, StepArgs
from model.loss import CandidateSampler
from model.token_norm import token_norm_map
from perf import backend as perf_backend
from perf.kernels.mlp import FP8_EXACT_SCALE_CALLS, roll_delayed_scales
from optim.adam import run_param_table
from optim.lanes import Lanes
from optim.manager import NgramRowOptimizer, OptimizerManager
from optim.row_exchange import RowExchange
from optim.schedule import StepWeights, TrainingSchedule
from runtime.collective_order import CollectiveRecorder
from perf.compile import compile_model, compiled_graphs
from perf.cuda_graphs.capture import RegionGraphs
from perf.cuda_graphs.state import run_state
from runtime.sync_check import host_side, permitted_sync
from perf import streams
from perf.host_table import HostRows, choose_placement
from perf.pinned_batches import PinnedBatchRing
from perf.sampled_head_grad import HeadSample


# ----------------------------------------------------------------------------------------------------
# setup: processes, devices, the checks that must fail before any training
# ----------------------------------------------------------------------------------------------------


class Setup:
    """This process's place in the run: rank, world, device, and which virtual ranks it plays."""

    def __init__(self, cfg: RunConfig, rank: int | None = None, world_size: int | None = None,
                 device: torch.device | str | None = None, backend: perf_backend.Backend | None = None):
        """From torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK) and the detected backend; or,
        with a device given, rank `rank` of `world_size` processes as given, no variable read and no
        device made current: how the tools model one rank of a run on "meta" (runtime/meta_rank.py)."""
        if device is None:
            self.rank = int(os.environ.get("RANK", 0))
            self.world_size = int(os.environ.get("WORLD_SIZE", 1))
            local_rank = int(os.environ.get("LOCAL_RANK", 0))
            want_cuda = cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())
            self.device = torch.device("cuda", local_rank) if want_cuda else torch.device("cpu")
            if want_cuda:
                torch.cuda.set_device(self.device)
        else:
            self.rank, self.world_size, self.device = rank or 0, world_size or 1, torch.device(device)
        self.backend = perf_backend.current() if backend is None else backend
        self.is_master = self.rank == 0
        # gradient accumulation: process p plays virtual ranks p·A .. p·A + A − 1
        self.accum = cfg.virtual_world_size // self.world_size
        self.virtual_ranks = list(range(self.rank * self.accum, (self.rank + 1) * self.accum))

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
    """The model, its n-gram table shard, the optimizers and the per-rank samplers of one run.

    A switched-off feature (cfg.features, config.FeatureConfig) is not built: without `ngram`,
    `table`, `exchange` and `ngram_opt` are None (no shard, no row plan, pull, prefetch, gradient
    merge or table event; the loader hashes nothing); without `sampled_softmax` there are no
    samplers (`samplers` is empty); the model and the schedule drop the rest."""

    def __init__(self, cfg: RunConfig, setup: Setup):
        """On a "meta" setup (`Setup(cfg, rank, world_size, device="meta", backend)`) this builds
        one rank of the run as the tools count it (runtime/meta_rank.py), allocating and communicating
        nothing: no seed (the tool's process keeps its random state), the model made on "meta" (no
        host copy), no process group (no broadcast; the optimizer shards for the Setup's rank), the
        n-gram table on the device (the tools place it themselves) and the reset snapshot on
        "meta"; everything else as in a run."""
        self.cfg, self.setup = cfg, setup
        on_meta = setup.device.type == "meta"
        if cfg.seed is not None and not on_meta:
            torch.manual_seed(cfg.seed)
        features = cfg.features
        self.schedule = TrainingSchedule(cfg.schedule, features)
        with torch.device("meta") if on_meta else contextlib.nullcontext():
            self.model = GPT(cfg.model, fp8=setup.backend.fp8, features=features,
                             block_size=cfg.schedule.block_size).to(setup.device)
        if setup.world_size > 1 and not on_meta:  # every rank starts from rank 0's weights and sign pool
            for t in [*self.model.parameters(), *([self.model.ngram_sign_pool] if features.ngram else [])]:
                dist.broadcast(t.data, 0)
        self.table = self.table_placement = None
        if features.ngram:  # on the device, or in host memory when it does not fit (perf/host_table.py)
            lo, hi = ngram_shard_range(cfg.model.ngram_rows, setup.rank, setup.world_size)
            placement, why = choose_placement(cfg.ngram_table, (hi - lo) * cfg.model.model_dim * 2, setup.device) \
                if not on_meta else ("device", "a rank modelled on meta")
            rows = HostRows(hi - lo, cfg.model.model_dim, torch.bfloat16, setup.device) if placement == "host" else None
            self.table = NgramTable(cfg.model, setup.rank, setup.world_size, device=setup.device, rows=rows)
            self.table_placement = f"n-gram table: {'host memory' if rows is not None else 'device memory'} ({why})"
        # keep_grads: gradients zeroed in place, never released (a captured backward adds into them)
        # defer_gathers (SPEEDRUN_DEFERRED_GATHERS): the bank all-gathers run between steps (`flush`)
        # (a rank on "meta" has no process group: it shards as its Setup says)
        self.manager = OptimizerManager(self.model.named_parameters(), self.schedule, cfg.optim, table=run_param_table(features),
                                        keep_grads=True,
                                        layout=(setup.rank, setup.world_size) if on_meta else None,
                                        defer_gathers=setup.backend.deferred_gathers,
                                        absent=self.model.switched_off_parameters, local_ranks=setup.accum)
        if features.value_embeds:  # value_embeds' backward adds straight into the optimizer's fp16 cycle buffer (record #360)
            self.model.value_embed_grad_buffer = self.manager.cycle_gradient("value_embeds")
        self.exchange, self.ngram_opt = None, None
        if features.ngram:  # the table's rows move between ranks by host-planned exchanges (no host sync on the device)
            self.exchange = RowExchange(cfg.model.ngram_rows, setup.rank, setup.world_size, setup.device,
                                        lanes=setup.accum)
            self.ngram_opt = NgramRowOptimizer(self.table.rows, self.table.rows.size(0), self.manager, self.exchange)
        self.step_weights = StepWeights(self.schedule, setup.device)  # MTP / prefix weights as tensors
        always = (COPY_TOKEN_ID,) if features.cplm else ()  # PR #379: `<copy>` is a candidate every step
        self.samplers = [CandidateSampler(cfg.model.vocab_size, r, cfg.virtual_world_size, always)
                         for r in setup.virtual_ranks] if features.sampled_softmax else []
        self.windows = self.schedule.windows(0)
        self.validation_diagnostics: str | None = None  # a feature's line after the val line (validate)
        # one process playing several ranks: what each keeps for itself, a copy per virtual rank
        # (optim/lanes.py): gradients that live across steps, the fp8 delayed scales
        self.lanes = Lanes(setup.accum, self.per_rank_tensors) if setup.accum > 1 else None
        # PR #371's sampled lm_head dW: one device counter per rank (rank r starts at r, each call adds the
        # world size), advanced inside the captured backward; a process playing several ranks keeps one per lane
        self.head_sample = None
        if features.approx_lm_head_grad:
            if not self.model.fp8:
                raise ConfigError("--set features.approx_lm_head_grad=true samples the fp8 lm_head's weight-gradient "
                                  "GEMM (PR #371); this device runs no fp8 GEMMs (below SM89): switch it off")
            self.head_sample = HeadSample(setup.virtual_ranks[0], cfg.virtual_world_size, setup.device)
            if self.lanes is not None:
                self.lanes.seed(self.head_sample.counter, [torch.full((), r, dtype=torch.int64, device=setup.device)
                                                           for r in setup.virtual_ranks])
        # PR #371 part 2: the five layers' head tables (−1 = full until the calibration writes them in place)
        # and their calibration; mode-1 steps run eagerly and measure after their backward
        self.calibration = None
        self.calibration_lines: list[str] = []  # the choice, for the log (train_gpt.py prints them)
        self.warming_up = False
        if features.approx_attention_backward:
            if setup.backend.attention not in ("fa3", "sdpa"):
                raise ConfigError(f"--set features.approx_attention_backward=true (PR #371 part 2) runs its restricted "
                                  f"backward on FA3 (its forward's LSE, the Triton windowed backward) or on the "
                                  f"portable attention (SPEEDRUN_ATTENTION=sdpa); this run's is "
                                  f"{setup.backend.attention!r}, whose forward hands no LSE over")
            self.calibration = CalibrationState(eligible_layers(cfg.model.num_heads),
                                                device=setup.device)
        # the post-warmup reset's snapshot of the weights, off the device for the whole run: pinned
        # host memory on CUDA (copied back non-blocking; the clock starts after a synchronize), a
        # plain host copy otherwise. Tensors only: the YaRN scales (extra state) reset by reset_rotary.
        pin = setup.device.type == "cuda"
        self.initial_state = {
            k: torch.empty(v.shape, dtype=v.dtype, device="meta" if on_meta else "cpu", pin_memory=pin).copy_(v)
            for k, v in self.model.state_dict().items() if torch.is_tensor(v)}
        self.model.refresh_fp8()  # the fp8 weight caches, before the first training forward
        self.forward = compile_model(self.model, setup.backend)  # fullgraph; the module itself when not compiling
        # the loader's n-gram hashes match the model's tables (none without the table)
        # (with features.token_norm_hashes, over each token's normalization class: PR #375's map, built
        # here before the clock and checked against its digest, model/token_norm.py)
        self.token_norm = token_norm_map(cfg.model.vocab_size) if features.token_norm_hashes else None
        self.hash_args = {**ngram_hash_sizes(cfg.model), "token_map": self.token_norm.ids if self.token_norm else None} \
            if features.ngram else NO_NGRAM
        # CUDA graphs (SPEEDRUN_CUDA_GRAPHS): train_step runs each capturable region through
        # run_region(name, key, fn); the warmup captures every key, the timed loop replays
        # (perf/cuda_graphs/capture.py; on CPU its twin). tools/capture_contract.py swaps its checker in as region_runner.
        self.graphs = RegionGraphs.for_device(setup.device, lambda: run_state(self), strict=cfg.requires_fast_path) \
            if setup.backend.cuda_graphs else None
        # (without CUDA graphs, RegionGraphs.run's signature, just the call; it holds no reference to the run)
        self.region_runner = self.graphs.run if self.graphs is not None else lambda region, key, fn: fn()
        self.step_position = self.position = "setup"  # where a collective timeout names this rank
        self.static_inputs: dict[tuple, torch.Tensor] = {}  # (name, shape, dtype) -> device buffer
        self.batch_ring = PinnedBatchRing(setup.device) if setup.backend.pinned_batches else None
        # what the last update leaves for `flush`: the fp8 refresh (its exact mode) and, in the
        # manager, the deferred bank gathers
        self.fp8_refresh_pending: bool | None = None
        # SPEEDRUN_ROW_PREFETCH: the next step's row pulls, launched during this step
        self.prefetched: RowPrefetch | None = None

    def per_rank_tensors(self) -> list[torch.Tensor]:
        """The live tensors each rank keeps for itself across its steps: the Adam parameters'
        gradients (summed over two steps, or a table cycle in the fp16 cycle buffers) and the fp8
        MLP's delayed scales and amaxes. (The bank gradients are consumed every step.)"""
        out = []
        for e in self.manager.entries.values():
            if e.rule.optim != "bank":
                out += [t for t in (e.param.grad, e.held) if t is not None]
        if self.model.mlp_fp8 is not None:
            out += self.model.mlp_fp8.delayed_state()
        return out

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
            if self.lanes is not None:  # every virtual rank rolls its own delayed scales
                for state in self.lanes.lane_copies(self.model.mlp_fp8.delayed_state()):
                    roll_delayed_scales(*state)

    def close(self) -> None:
        """Before destroy_process_group: no gather in flight, no graph left holding the
        communicator (see RegionGraphs.release), the row exchange's prep thread stopped."""
        self.manager.wait_gathers()
        if self.graphs is not None:
            self.graphs.release()
        if self.exchange is not None:
            self.exchange.close()  # its prep thread (host plans ahead)
        if isinstance(getattr(self.table, "rows", None), HostRows):
            self.table.rows.close()  # its row thread

    def upload(self, host_batch, softmax_p: int, sampler: CandidateSampler | None = None, static: bool = False,
               plan=None, lane: int = 0):
        """The host batch on the device, its n-gram row plan (None without the table) and its
        sampled-softmax candidates.

        The plan and the candidates are built from the host batch (host work the sync check lets
        through); everything reaches the device by non-blocking copies (pinned memory on CUDA).
        static: copy into this geometry's static input buffers (`static_input`), as a captured
        training step needs, instead of into fresh device tensors. plan: the batch's row plan when
        already made (a prefetched pull's). lane: which of the process's virtual ranks the batch is."""
        with host_side():
            if plan is None and self.exchange is not None:
                # a host collective: every rank, same order (its sort done ahead when `prefetch` could)
                plan = self.exchange.plan(host_batch.ngram_ids, lane)
            candidates = sampler.candidates(host_batch.targets, softmax_p) if softmax_p else None
        host_batch = replace(host_batch, ngram_ids=None)  # host only: the plan has read them
        if self.batch_ring is not None:  # a pinned slot and a side-stream copy (SPEEDRUN_PINNED_BATCHES)
            # the candidates ride in the batch's slot: no pinned allocation of their own
            host_batch, extra = self.batch_ring.upload(host_batch, **({} if candidates is None else
                                                                      {"candidates": candidates}))
            candidates = extra.get("candidates", candidates)
        elif candidates is not None and self.setup.device.type == "cuda":
            candidates = candidates.pin_memory()
        if static:
            names = ("inputs", "targets", "cu_seqlens") + (("ngram_sign_rows",) if self.table is not None else ())
            batch = replace(host_batch, **{f: self.static_input(f, getattr(host_batch, f)) for f in names})
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
        (the loop's peek), whose n-gram rows are then pulled during this step (SPEEDRUN_ROW_PREFETCH).
        On CPU with SPEEDRUN_STREAM_CHECK=1 every read is checked against the side-stream copies in
        flight (perf/streams.py)."""
        with streams.checked_reads(self.setup.device):
            return self._train_step(step, batches, next_batches)

    def _train_step(self, step: int, batches, next_batches) -> torch.Tensor:
        self.step_position = self.position = f"training step {step}"
        self.flush()  # the previous update's deferred gathers and fp8 refresh, before the forward
        s = self.schedule.settings(step)  # every per-step value, once: the model's and the optimizer's
        self.set_windows((s.ws_short, s.ws_long))
        mtp_weights, prefix_weight = self.step_weights.load(step)  # tensors: new values, same graph
        prefetched = self.take_prefetched(batches)
        total = torch.zeros((), device=self.setup.device)
        for lane, host_batch in enumerate(batches):  # one batch per virtual rank this process plays
            batch, plan, rows, candidates = self.step_inputs(s, lane, host_batch, prefetched)
            if lane == len(batches) - 1:  # this step's own pulls are done: the next step's go now
                self.prefetch(step, next_batches)
            args = StepArgs(ws_short=s.ws_short, ws_long=s.ws_long, mtp_weights=mtp_weights,
                            prefix_weight=prefix_weight, candidates=candidates, training=True,
                            max_seq_len=batch.max_seq_len, head_sample=self.head_sample if s.head_sample else None,
                            attention_mode=s.attention_mode,
                            attention_calibration=self.calibration if s.attention_mode else None)
            if self.lanes is not None:
                self.lanes.load(lane)  # virtual rank `lane`'s own gradients and fp8 scales
            if s.attention_mode == 1:  # PR #371's calibration step: eager, measured after its backward
                total += self.calibration_forward_backward(batch, rows, args)
            else:
                total += self.run_region("forward_backward", s.geometry, lambda: self.forward_backward(batch, rows, args))
            self.keep_gradients(s, lane, plan, rows)
        if s.attention_mode == 1 and not self.warming_up and step == self.schedule.calibration_step() + 1:
            with permitted_sync():  # one all-reduce MAX, the tables written in place, the choice read for the log
                self.calibration.finish()
                self.calibration_lines = self.calibration.log_lines(self.cfg.virtual_world_size)
        if self.prefetched is not None:
            # the prefetch's exchange is done before the optimizer graph, whose captured
            # collectives would otherwise share the communicator with it unordered (on CUDA: a
            # stream wait; its rows stay unexpanded until the next step)
            self.prefetched.wait()
        # every optimizer, in its own order: scalars, the captured update, the deferred gathers'
        # launch, the untie, the n-gram table event (optim/manager.py OptimizerManager.step)
        table_changed = self.manager.step(s, self.run_region, self.lanes, self.ngram_opt)
        if self.model.mlp_fp8 is not None:  # the refresh runs at `flush`; its count is host state, in step order
            self.fp8_refresh_pending = self.model.next_fp8_refresh_exact()
        if table_changed and self.prefetched is not None:
            self.patch_prefetched()
        return total

    def step_inputs(self, s, lane: int, host_batch, prefetched):
        """Batch `lane` of the step in the static buffers a captured step reads: (batch, its row
        plan, the n-gram rows pulled into the geometry's sink leaf, the sampled-softmax candidates);
        rows and plan are None without the n-gram table. The pull was started a step ahead when
        `prefetch` could; else it starts here."""
        sampler = self.samplers[lane] if self.samplers else None
        pulled = prefetched[lane] if prefetched is not None else None
        batch, plan, candidates = self.upload(host_batch, s.softmax_p, sampler, static=True,
                                              plan=pulled.plan if pulled is not None else None, lane=lane)
        rows = None  # without the n-gram table: no rows, no pull
        if self.table is not None:
            # the sink leaf: the pulled rows (an all_to_all with host-planned sizes, outside the
            # captured region) expanded straight into this geometry's static leaf
            table = self.table.rows
            rows = self.static_buffer("ngram_rows", (plan.inverse_dev.numel(), table.size(1)), table.dtype,
                                      requires_grad=True)
            (pulled or self.exchange.start_pull(table, plan)).finish(out=rows)
        return batch, plan, rows, candidates

    def forward_backward(self, batch, rows, args: StepArgs) -> torch.Tensor:
        """The captured region of a batch: the loss and its backward. Each (virtual) rank's gradient
        of its own summed loss; the optimizer's reduce takes the mean over the 8 ranks (over
        processes, then over this process's virtual ranks)."""
        loss = self.forward(batch.inputs, batch.targets, batch.cu_seqlens, rows, batch.ngram_sign_rows, args)
        loss.backward()
        return loss.detach()

    def calibration_forward_backward(self, batch, rows, args: StepArgs) -> torch.Tensor:
        """A mode-1 step of PR #371 (its two calibration steps): the uncompiled model, outside any CUDA
        graph (its snapshots are host-side Python state), the stock backward, then every eligible layer's
        snapshot measured (host reads: permitted here, on these two steps only). The warmup runs the step
        but measures nothing."""
        loss = self.model(batch.inputs, batch.targets, batch.cu_seqlens, rows, batch.ngram_sign_rows, args)
        loss.backward()
        if not self.warming_up:
            with permitted_sync():
                self.calibration.measure_snapshots()
        return loss.detach()

    def keep_gradients(self, s, lane: int, plan, rows) -> None:
        """What batch `lane`'s backward leaves, put away before the next batch's: the n-gram sink
        gradient merged per distinct row (a per-batch size: outside the region) and the sink zeroed
        for the next backward (x + 0 is x, bitwise); with virtual ranks, what rank `lane` does to its
        gradients before the reduce (OptimizerManager.fold_local), then its lane saved."""
        if self.ngram_opt is not None:
            self.ngram_opt.accumulate(plan, rows.grad)
            rows.grad.zero_()
        if self.lanes is not None:
            self.manager.fold_local(s)
            self.lanes.save(lane)

    def patch_prefetched(self) -> None:
        """After a table event on one process: the pulls launched before it get the rows it rewrote
        (NgramRowOptimizer.patch_pull), and stay valid."""
        for pull in self.prefetched.pulls:
            self.ngram_opt.patch_pull(pull)
        self.prefetched.version = self.ngram_opt.version

    def prefetch(self, step: int, next_batches) -> None:
        """Plan the next step's row pulls and launch them (SPEEDRUN_ROW_PREFETCH). Across a table
        event (it rewrites the table after the backward) only on one process: the rows the event
        rewrites are then patched into the pulled ones (`train_step`, NgramRowOptimizer.patch_pull),
        the others did not change. On several processes an event step's next pulls wait for the
        event: other owners' rows change too. Then (or with the prefetch off) the next step's plans
        are only started, on the exchange's prep thread (`RowExchange.prepare`: they depend on the
        ids alone), and its upload finishes them. When the next step is a table event, its push
        routes are planned ahead too: the cycle's plans are all known once the next step's are
        (`RowExchange.expect_push`; NgramRowOptimizer.accumulate starts them)."""
        if next_batches is None or self.exchange is None:
            return
        # across a table event only on one process, whose event patches the pulled rows it rewrote
        # (NgramRowOptimizer.patch_pull); on several, other owners' rows change too: the pull waits
        across_event = self.schedule.is_table_event(step)
        if not self.setup.backend.row_prefetch or (across_event and self.setup.world_size > 1):
            for b in next_batches:
                self.exchange.prepare(b.ngram_ids)
            return
        with host_side():
            plans = [self.exchange.plan(b.ngram_ids, lane) for lane, b in enumerate(next_batches)]  # host collectives, step order
        if self.schedule.is_table_event(step + 1):  # the loop's next step (the warmup's may differ: then
            self.exchange.expect_push(plans)         # the event finds other plans and plans its push itself)
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
        settings = self.schedule.settings(step)
        keys = [("forward_backward", settings.geometry)] if settings.attention_mode != 1 else []  # mode 1: eager
        keys.append(("optimizer", self.manager.phase_at(step)))
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
        # a line per graph as it is made (the warmup of a record is minutes of compiles and captures):
        # RegionGraphs names each warm-up and capture; without CUDA graphs a compiled run's compiles are
        # named here, the plan counting one graph per geometry, per intermediate validation's windows
        # and the final validation (a step that compiles more says so)
        progress = functools.partial(log.print0, console=True)
        if self.graphs is not None:
            self.graphs.planned = sum(count >= 2 for count in met.values())
            self.graphs.progress = progress
        compiles = CompileProgress(  # (PR #371's calibration steps run the uncompiled model: no graph)
            (0 if self.graphs is not None else len({schedule.settings(st).geometry for st in steps
                                                    if schedule.settings(st).attention_mode != 1}))
            + len(pending) + 1, progress, enabled=self.setup.backend.compile)
        def batches(step: int) -> list:
            tokens = schedule.batch_tokens(step) // cfg.virtual_world_size
            return [dummy_batch(tokens, schedule.doc_cap(step), seed=step, virtual_seq_cap=cfg.schedule.virtual_seq_cap,
                                **self.hash_args)
                    for _ in self.setup.virtual_ranks]

        # one order of collectives on every rank (runtime/collective_order.py): each collective of the
        # warmup is recorded with the run's position and its region call, and the ranks' sequences
        # and the ordering rule are checked at the end, off the clock (no collective on 1 process)
        recorder = CollectiveRecorder(lambda: self.position) if self.setup.world_size > 1 else None
        runner = self.region_runner
        if recorder is not None:
            self.region_runner = recorder.runner(runner)
        self.warming_up = True  # PR #371's calibration measures nothing on dummy data
        try:
            with recorder if recorder is not None else contextlib.nullcontext():
                following = batches(steps[0]) if steps else None
                for i, step in enumerate(steps):
                    if self.windows in pending:
                        pending.discard(self.windows)
                        with compiles.call("validation", self.windows):
                            self.validate(self.dummy_val_batches(), self.windows)
                    if self.model.mlp_fp8 is not None:  # the fp8 refresh mode the timed loop has at this step
                        self.model.mlp_fp8.refresh_calls = self.fp8_refreshes_before(step)
                    current, following = following, batches(steps[i + 1]) if i + 1 < len(steps) else None
                    # under CUDA graphs the step's compile is its forward_backward warm-up's (RegionGraphs' line)
                    with compiles.call("forward_backward", schedule.settings(step).geometry, step) \
                            if self.graphs is None else contextlib.nullcontext():
                        self.train_step(step, current, following)
                if pending:
                    raise RuntimeError(f"warmup: no warmup step runs at windows {sorted(pending)} of an intermediate "
                                       f"validation (warmup_steps must visit every stage)")
                self.flush()  # the last step's fp8 refresh (it runs at the next flush): warmed or captured here
                if self.graphs is not None and self.graphs.pending():
                    raise RuntimeError(f"warmup: CUDA-graph keys warmed once but never captured: "
                                       f"{self.graphs.pending()} (warmup_steps must visit every key twice)")
                self.set_windows(schedule.final_windows(), yarn=False)
                vocab = cfg.model.vocab_size
                mask = torch.zeros((vocab, (vocab + 7) // 8), dtype=torch.uint8, device=self.setup.device) \
                    if cfg.canonical_mask else None
                with compiles.call("final validation", schedule.final_windows()):
                    self.validate(self.dummy_val_batches(), schedule.final_windows(), mask)
        finally:
            self.region_runner = runner
            self.warming_up = False
            if self.graphs is not None:
                self.graphs.progress = None  # the warmup's log only
        if recorder is not None:  # the gather on the exchange's gloo group (a NCCL run), else the default one
            log.print0(recorder.check_across_ranks(self.exchange.group if self.exchange is not None else None),
                       console=True)

    def dummy_val_batches(self) -> list[list]:
        """One validation step of random tokens with the real validation geometry (one segment per
        rank, no doc cap): what the warmup compiles the validation forward on."""
        per_rank = self.cfg.val_batch_tokens // self.cfg.virtual_world_size
        return [[dummy_batch(per_rank, per_rank, seed=r, virtual_seq_cap=per_rank, **self.hash_args)]
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
            if self.table is not None:
                self.table.rows.zero_()
        # gradients zeroed in place, not released: the captured backward accumulates into them
        self.model.zero_grad(set_to_none=False)
        for buf in self.static_inputs.values():
            if buf.grad is not None:
                buf.grad.zero_()
        self.manager.reset()
        if self.ngram_opt is not None:
            self.ngram_opt.reset()
        for sampler in self.samplers:
            sampler.reset()
        self.model.reset_rotary()
        self.windows = self.schedule.windows(0)
        self.model.rearm_fp8()
        self.model.refresh_fp8()
        if self.head_sample is not None:
            self.head_sample.reset()  # its first virtual rank's; the others' are their lanes' seeds
        if self.calibration is not None:
            self.calibration.reset()  # every head full again, in place (the mode-2 graphs read the tables)
            self.calibration_lines = []
        if self.lanes is not None:
            self.lanes.reset()  # every virtual rank: zero gradients, the initial fp8 scales

    def val_batches(self, val_glob: str) -> list[list]:
        """Every validation batch this process evaluates (read on the clock, record #360)."""
        cfg = self.cfg
        per_rank = cfg.val_batch_tokens // cfg.virtual_world_size
        return [list(val_batches(val_glob, r, cfg.virtual_world_size, per_rank, cfg.val_tokens, **self.hash_args))
                for r in self.setup.virtual_ranks]

    @torch.no_grad()
    def validate(self, batches: list[list], windows: tuple[int, int], canonical_mask=None) -> float:
        """Mean next-token loss over cfg.val_tokens (each process evaluates its virtual ranks)."""
        with streams.checked_reads(self.setup.device):  # as in train_step
            return self._validate(batches, windows, canonical_mask)

    def _validate(self, batches: list[list], windows: tuple[int, int], canonical_mask) -> float:
        cfg, setup = self.cfg, self.setup
        self.step_position = self.position = "validation"
        self.flush()  # the last update's gathers and fp8 refresh
        diagnostics = self.model.cplm_diag  # CPLM's sums (PR #379), or None
        if diagnostics is not None:
            diagnostics.zero_()
        total = torch.zeros((), dtype=torch.float64, device=setup.device)
        for step_batches in zip(*batches):
            for host_batch in step_batches:
                batch, plan, _ = self.upload(host_batch, 0)
                rows = self.exchange.pull(self.table.rows, plan) if self.exchange is not None else None
                args = StepArgs(ws_short=windows[0], ws_long=windows[1], training=False,
                                max_seq_len=batch.max_seq_len, canonical_mask=canonical_mask)
                loss = self.forward(batch.inputs, batch.targets, batch.cu_seqlens, rows, batch.ngram_sign_rows, args)
                total += loss.double() * batch.inputs.numel()
        if setup.world_size > 1:
            dist.all_reduce(total)
            if diagnostics is not None:
                dist.all_reduce(diagnostics)
        # the line the run prints after the val line (off the clock): α, a_sink, the copy share
        self.validation_diagnostics = diagnostics_line(diagnostics) if diagnostics is not None else None
        return total.item() / cfg.val_tokens


class CompileProgress:
    """The warmup's line per call that compiled (`call` around each; nothing when `enabled` is off):
    `warmup: compiled forward_backward (1024, 896, ...) at step 0 1/8 in 41.2 s`, n counting the
    graphs compiled so far against the plan's `planned`, the seconds the host spent in the call
    (tracing and compiling; the device's share of the call runs on behind it)."""

    def __init__(self, planned: int, print_line, enabled: bool = True):
        self.planned, self.print_line, self.enabled = planned, print_line, enabled
        self.done = 0

    @contextlib.contextmanager
    def call(self, what: str, key, step: int | None = None):
        if not self.enabled:
            yield
            return
        before, start = compiled_graphs(), time.perf_counter()
        yield
        compiled = compiled_graphs() - before
        if compiled:
            self.done += compiled
            at = f" at step {step}" if step is not None else ""
            more = f" ({compiled} graphs)" if compiled > 1 else ""
            self.print_line(f"warmup: compiled {what} {key!r}{at} {self.done}/{self.planned}{more} in "
                            f"{time.perf_counter() - start:.1f} s")


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
