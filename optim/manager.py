"""The optimizer of a run: every model parameter's update, sharded over ranks, with the
communication order of record #360 (track_1_short/training.py, track_1_short/optim/anvil.py).

    manager = OptimizerManager(model.named_parameters(), schedule, OptimConfig())
    for step in range(schedule.total_steps):
        loss.backward()                          # gradients of the summed loss
        manager.step(schedule.settings(step))    # scalars, reduce, update, gather, clear, untie

`step` is the one call a run makes per step (training.Run.train_step, with its region runner, its
virtual ranks' lanes and the n-gram row optimizer); it owns the order of the work:

    load_scalars   the step's lr, betas, decays into device scalars (host work, outside any region)
    lanes.reduce   one process playing several ranks: their gradients summed in rank order
    update         reduce-scatter, update, gather: the region ("optimizer", phase), captured under
                   CUDA graphs, so it reads only device memory and sets no host state
    lanes.clear    the consumed gradients of every virtual rank
    launch_deferred_gathers   the banks' all-gathers, waited before the next read (`wait_gathers`)
    untie          at the split step, embed's moments from lm_head's (host state: outside the region)
    rows.step      the n-gram table's event (NgramRowOptimizer), when the step is one

The pieces stay public for the tools that price or check one of them (tools/cost.py,
tools/capture_contract.py); none of them re-runs another that its caller skipped: `update` refuses a
step whose scalars were not loaded, or whose virtual ranks were not folded.

* Banks (qk, vo, mlp): each step, the gradient viewed as [matrices, rows, cols] is
  reduce-scattered (average over ranks) so each rank updates 1/W of the matrices with ANVIL (or
  NorMuon), then all-gathered. A matrix count that does not divide by W is padded with zero
  matrices inside the optimizer (their lr is 0); upstream instead requires divisibility, and the
  record's banks (48, 16, 24 matrices) divide by 1, 2, 4 and 8.
* Adam parameters: sharded ones (lm_head, embed, value_embeds) are reduce-scattered along dim 0
  (rows padded the same way), updated per shard and all-gathered; replicated ones are
  all-reduced and updated everywhere. They step on odd steps over the sum of two steps'
  gradients (the gradients are simply not cleared on even steps); value_embeds steps on the
  table's update events over the cycle's gradient, summed in fp16 as record #360 does. Record
  #360 exchanges only the value-embed rows the cycle touched; here the whole summed gradient is
  reduce-scattered: the same averaged shard gradient, so the same update (every row of the shard
  gets momentum and decay at each event in both).
* embed is tied to lm_head until the split step: embed's gradient is transposed into lm_head's
  before the reduce, and embed <- lm_head^T after the gather. At the split step lm_head's moments
  are gathered, transposed and resharded into embed's. The transposes are perf/kernels/transpose.py's
  (tiled Triton kernels on the fast path; fp32 sum, one rounding, as bf16 `add_` on the portable one).
* Order: replicated all-reduces first (phase 0), then reduce-scatters in SCATTER_ORDER (phase 1),
  then waits + updates + all-gathers in WORK_ORDER (phase 2), then the lm_head gather and the tied
  copy (phase 3). Collectives are asynchronous (async_op=True) so later launches overlap earlier
  work. Gloo (CPU) and NCCL both support the reduce-scatter, all-gather and AVG used here (checked
  on torch 2.13 gloo); no PREMUL_SUM, no fp8 tensors.
* Deferred gathers (defer_gathers, record #360): the banks' all-gathers leave `step`; the caller
  launches them after it (`launch_deferred_gathers`) and waits before the banks are next read
  (`wait_gathers`; training.Run.flush at the next step's top), so they run under whatever comes
  between. Each rank's own matrices are updated in place, so its own rows are final meanwhile.

The n-gram table is not a parameter: `NgramRowOptimizer` (below) runs its row-sparse Adam on the
rank's contiguous row shard, from each step's (row plan, sink gradient); optim/row_exchange.py
`RowExchange` plans the batch's rows on the host, pulls them from their owners for the forward and
routes the gradients back at table events.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Iterable

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor

from config import OptimConfig
from perf.kernels.transpose import transpose_add_, transpose_into
from optim.adam import (EMBED, LM_HEAD, RECORD_PARAM_TABLE, VALUE_EMBEDS, AdamState, ParamRule,
                        RowAdamState, adam_apply, adam_step_scalars, build_param_table, embed_moments_from_lm_head,
                        row_sparse_adam_event, value_embed_hparams)
from optim.anvil import BankState, BankStepScalars, anvil_update, rail_settings, shape_lr_multiplier
from optim.normuon import muon_momentum, normuon_update
from optim.row_exchange import RowExchange, RowPlan
from optim.schedule import StepSettings, TrainingSchedule
from perf import streams
from perf.collectives import all_gather_single, reduce_scatter_single
from perf.pinned_batches import PinnedStaging


# record #360 (track_1_short/training.py): launch the big bank reduce-scatters first; update the small parameters while
# they are in flight; the mlp bank (largest gather) last. Replicated params go in phase 0.
SCATTER_ORDER = ("qk_bank", "vo_bank", "mlp_bank", VALUE_EMBEDS, LM_HEAD, EMBED)
WORK_ORDER = ("qk_bank", "vo_bank", LM_HEAD, EMBED, VALUE_EMBEDS, "mlp_bank")
MLP_BANK = "mlp_bank"
SCALAR_STAGING_SLOTS = 16  # record #360: a 16-slot pinned ring for its per-step bank scalars


@dataclass
class RowSharding:
    """Rows [lo, hi) of a leading dimension of size n, padded to W * chunk."""
    n: int
    world_size: int
    rank: int

    @property
    def chunk(self) -> int:
        return math.ceil(self.n / self.world_size)

    @property
    def padded(self) -> int:
        return self.chunk * self.world_size

    @property
    def lo(self) -> int:
        return self.rank * self.chunk

    @property
    def real_rows(self) -> slice:
        """This rank's rows that exist in the parameter."""
        return slice(min(self.lo, self.n), min(self.lo + self.chunk, self.n))

    def pad(self, t: Tensor) -> Tensor:
        """t with zero rows appended up to the padded size (t itself when no padding)."""
        if self.padded == self.n:
            return t
        return torch.cat([t, t.new_zeros((self.padded - self.n, *t.shape[1:]))])

    def local(self, full: Tensor) -> Tensor:
        """This rank's chunk of `full` (a view when unpadded, a padded copy otherwise)."""
        if self.padded == self.n:
            return full[self.lo:self.lo + self.chunk]
        return self.pad(full)[self.lo:self.lo + self.chunk].clone()


@dataclass(frozen=True)
class OptimizerPhase:
    """The schedule flags that select the optimizer's kernels at a step (which parameters update,
    and every Python constant of their updates): a CUDA-graph key."""
    adam: bool          # the Adam parameters update (odd steps)
    table_event: bool   # value_embeds updates (the n-gram table's cadence)
    tied: bool          # embed is tied to lm_head (its gradient folds into lm_head's); the untie
                        # itself runs after the update, outside it (`untie_due`)
    period4: bool       # value_embeds' squared betas and doubled decay (4-step table cadence)
    rails: bool         # ANVIL's fast rail has a fixed beta and is blended (fast_weight)


@dataclass
class Entry:
    name: str
    param: Tensor
    rule: ParamRule
    view: Tensor                       # the parameter as the optimizer sees it (banks: [M, R, C])
    shard: RowSharding | None          # None for replicated
    state: object                      # BankState or AdamState
    matrix_mults: Tensor | None = None  # banks: [chunk, 1, 1] fp32 per-matrix mul (0 frozen/padding, 2 c_proj, 1)
    lr_scale: float = 1.0              # banks: lr_mul * shape multiplier (a host double)
    held: Tensor | None = None         # table cadence: the cycle's gradient sum (fp16, record #360)
    # the per-step hyperparameters as device tensors that change in place (OptimizerManager.load_scalars):
    # 0-D fp32 each (banks: momentum, eff_wd, fast_beta, momentum_lerp; Adam: step_size, decay),
    # banks' eff_lr [chunk, 1, 1] fp32
    scalars: dict[str, Tensor] = field(default_factory=dict)

    def bank_eff_lr(self, lr: float) -> Tensor:
        """[chunk, 1, 1] fp32 effective lr: m · fp32(lr_mul · shape · lr), the product taken in
        double and rounded once, as record #360 stages it (m is 0, 1 or 2: scaling is exact)."""
        return self.matrix_mults * (self.lr_scale * lr)

    def gradient(self) -> Tensor | None:
        return self.held if self.held is not None else self.param.grad


class ScalarTable:
    """Every entry's 0-D device scalars (Entry.scalars) as views of one fp32 device table, written
    from a host copy through reused pinned buffers: one host→device copy per step
    (`OptimizerManager.load_scalars`) where a fill_ per scalar was a launch each (4 per bank, 2 per
    Adam parameter: 42 at an Adam step of the record; tools/bench_host.py counts them). The host
    copy keeps every scalar's current value, so the copy leaves the entries a step does not update
    as they were; the values are rounded to fp32 on the host as fill_ rounds them (bitwise the same
    device scalars). Built before any write, when the scalars still hold their initial zeros."""

    def __init__(self, entries: dict[str, Entry]):
        slots = [(name, k) for name, e in entries.items() for k, t in e.scalars.items() if t.dim() == 0]
        device = entries[slots[0][0]].scalars[slots[0][1]].device if slots else torch.device("cpu")
        self.index = {slot: i for i, slot in enumerate(slots)}
        self.host = np.zeros(len(slots), dtype=np.float32)                    # (K,)
        self.device = torch.zeros(len(slots), dtype=torch.float32, device=device)  # (K,)
        for (name, k), i in self.index.items():
            entries[name].scalars[k] = self.device[i]  # a 0-D view, in place of the entry's own scalar
        self.staging = PinnedStaging(device, slots=SCALAR_STAGING_SLOTS)

    def set(self, name: str, **values: float) -> None:
        for key, value in values.items():
            self.host[self.index[(name, key)]] = value

    def upload(self) -> None:
        self.staging.to_device([self.host], torch.float32, out=self.device)


class OptimizerManager:
    """ANVIL/NorMuon for the banks, Adam for the rest, sharded over the default process group
    (or one process when torch.distributed is not initialized)."""

    def __init__(self, named_parameters: Iterable[tuple[str, Tensor]], schedule: TrainingSchedule,
                 cfg: OptimConfig = OptimConfig(), table: dict[str, ParamRule] = RECORD_PARAM_TABLE,
                 frozen_matrices: dict[str, Iterable[int]] | None = None,
                 layout: tuple[int, int] | None = None, keep_grads: bool = False,
                 defer_gathers: bool = False, absent: Iterable[str] = (), local_ranks: int = 1):
        """absent: entries of `table` the model lacks on purpose, a feature being off
        (GPT.switched_off_parameters: value_embeds, ve_gate_bank); they get no entry, state or
        collective, and the rest keep their order. Any other table entry without a parameter is
        still an error (build_param_table).
        frozen_matrices: bank name -> matrix indices (of the [matrices, rows, cols] view) that get
        lr 0 and so never move. Without it, a bank's own `frozen_matrices` attribute is used (the
        record model marks mlp slot 7, layer 7 having no MLP: matrices 14 and 15).
        layout: (rank, world_size) to shard for instead of the process group's, for a rank without
        one: a training.Run on "meta", as the tools model a rank (runtime/meta_rank.py), whose
        collectives they replace.
        keep_grads: zero the consumed gradients in place instead of releasing them (`p.grad = None`),
        so the next backward accumulates into the same storage: what a captured backward and update
        need (training.Run). The values are bitwise the same (x + 0 is x).
        defer_gathers: the banks' all-gathers leave `step` (see `deferred`): the caller launches
        them after it (`launch_deferred_gathers`) and waits before the weights are next read
        (`wait_gathers`), so they overlap whatever runs in between (record #360's deferred
        gathers; training.Run.flush waits at the top of the next step, before the forward).
        local_ranks: the virtual ranks this process plays (gradient accumulation). The gradients
        hold their plain sum (each virtual rank's backward of its own summed loss, unscaled); the
        reduce averages over processes and then divides by local_ranks, as 8 ranks' average does:
        a sum of 2 then a halving is what gloo's AVG of 2 ranks computes, bit for bit. What a rank
        does to its gradients before the reduce (`fold_local`) the caller then runs once per
        virtual rank, on that rank's gradients (optim/lanes.py)."""
        if cfg.bank_optimizer not in ("anvil", "normuon"):
            raise ValueError(f"OptimConfig.bank_optimizer={cfg.bank_optimizer!r}: expected "
                             "'anvil' or 'normuon'")
        self.schedule, self.cfg = schedule, cfg
        self.keep_grads = keep_grads
        if local_ranks < 1:
            raise ValueError(f"OptimizerManager: local_ranks={local_ranks} must be at least 1")
        self.local_ranks = local_ranks
        self._folded: int | None = None  # the step whose rank-local gradient folds were done (fold_local)
        if layout is not None:
            self.rank, self.world_size = layout
        else:
            distributed = dist.is_available() and dist.is_initialized()
            self.world_size = dist.get_world_size() if distributed else 1
            self.rank = dist.get_rank() if distributed else 0
        self.entries: dict[str, Entry] = {}
        absent = set(absent)
        unknown = absent - set(table)
        if unknown:
            raise ValueError(f"absent parameters {sorted(unknown)} are not in the optimizer table")
        table = {name: rule for name, rule in table.items() if name not in absent}
        for name, (param, rule) in build_param_table(named_parameters, table).items():
            if frozen_matrices is not None:
                frozen = frozenset(frozen_matrices.get(name, ()))
            else:
                frozen = frozenset(getattr(param, "frozen_matrices", ()))
            self.entries[name] = self._make_entry(name, param, rule, frozen)
        self.tied = EMBED in self.entries and LM_HEAD in self.entries
        for e in self.entries.values():
            device = e.param.device
            names = ("momentum", "eff_wd", "fast_beta", "momentum_lerp") if e.rule.optim == "bank" else ("step_size", "decay")
            e.scalars = {k: torch.zeros((), dtype=torch.float32, device=device) for k in names}
            if e.rule.optim == "bank":
                e.scalars["eff_lr"] = torch.zeros_like(e.matrix_mults)
        self._loaded: int | None = None            # the step whose scalars the entries hold (load_scalars)
        self._bank_host: dict[str, BankStepScalars] = {}
        if self.tied:
            lm, em = self.entries[LM_HEAD].param, self.entries[EMBED].param
            if tuple(lm.shape) != tuple(em.shape[::-1]):
                raise ValueError(f"{LM_HEAD} {tuple(lm.shape)} must be the transpose of {EMBED} "
                                 f"{tuple(em.shape)} (lm_head is stored transposed)")
        self.split = False
        # the banks whose all-gather `step` leaves to the caller: gathered straight into the
        # parameter (unpadded: this rank's rows are updated in place, so own_shard and the tail
        # averages read the step's values while the gather is in flight)
        self.deferred: tuple[str, ...] = tuple(
            n for n in WORK_ORDER if defer_gathers and self.world_size > 1 and n in self.entries
            and self.entries[n].rule.optim == "bank" and self.entries[n].shard.padded == self.entries[n].shard.n)
        self._in_flight: list[tuple[str, object]] = []   # launched deferred gathers, in launch order
        self._gathers_writing: list = []  # their writes, for perf/streams.py's checks (CPU)

    # --- construction ------------------------------------------------------------------------
    def _make_entry(self, name: str, param: Tensor, rule: ParamRule, frozen: frozenset) -> Entry:
        if rule.optim == "bank":
            if param.dtype != torch.bfloat16 or param.dim() < 3:
                raise ValueError(f"bank {name!r}: expected a bf16 stack of matrices, got "
                                 f"{param.dtype} {tuple(param.shape)}")
            view = param.data.view(-1, *param.shape[-2:])           # e.g. mlp [24, 2816, 768]
            shard = RowSharding(view.size(0), self.world_size, self.rank)
            chunk_shape = (shard.chunk, *view.shape[1:])
            rails = 2 if self.cfg.bank_optimizer == "anvil" else 1
            state = BankState.zeros(chunk_shape, rails=rails, device=param.device)
            mults = []
            for i in range(shard.lo, shard.lo + shard.chunk):
                if i >= shard.n or i in frozen:
                    mults.append(0.0)            # padding and frozen matrices never move
                elif name == MLP_BANK and i % 2 == 1:
                    mults.append(2.0)            # record #360: c_proj (odd bank index) x2
                else:
                    mults.append(1.0)
            if not set(mults) <= {0.0, 1.0, 2.0}:  # bank_eff_lr's single rounding relies on it
                raise ValueError(f"bank {name!r}: per-matrix lr multipliers must be 0, 1 or 2, got {sorted(set(mults))}")
            matrix_mults = torch.tensor(mults, dtype=torch.float32, device=param.device).view(-1, 1, 1)
            # record #360 order: shape multiplier * table lr_mul, then * per-matrix mul * lr
            lr_scale = shape_lr_multiplier(chunk_shape) * rule.lr_mul
            return Entry(name, param, rule, view, shard, state, matrix_mults, lr_scale)
        if rule.optim != "adam":
            raise ValueError(f"parameter {name!r}: unknown optim {rule.optim!r}")
        # Table-cadence gradients (value_embeds) are summed over the cycle in an fp16 buffer, as
        # record #360's value-embed backward does, instead of in the bf16 .grad.
        held = torch.zeros(param.shape, dtype=torch.float16, device=param.device) if rule.cadence == "table" else None
        if rule.comms == "sharded":
            shard = RowSharding(param.size(0), self.world_size, self.rank)
            state = AdamState.zeros_like(shard.local(param.data))
            return Entry(name, param, rule, param.data, shard, state, held=held)
        return Entry(name, param, rule, param.data, None, AdamState.zeros_like(param.data), held=held)

    def cycle_gradient(self, name: str) -> Tensor:
        """The fp16 buffer that sums a table-cadence parameter's gradient over its update cycle
        (value_embeds). A backward may add into it directly (GPT.value_embed_grad_buffer), as
        record #360's value-embedding backward does; dense `.grad`s are added in at each step."""
        held = self.entries[name].held
        if held is None:
            raise ValueError(f"parameter {name!r} has no cycle gradient buffer (only table-cadence "
                             f"parameters do: {[n for n, e in self.entries.items() if e.held is not None]})")
        return held

    def reset(self) -> None:
        """Zero every optimizer state and re-tie embed (after the untimed warmup)."""
        self.wait_gathers()
        for e in self.entries.values():
            e.state.zero_()
            if e.held is not None:
                e.held.zero_()
        self.split = False
        self._loaded = None

    # --- per-step hyperparameters --------------------------------------------------------------
    def settings(self, step: int | StepSettings) -> StepSettings:
        """The step's settings (computed once per step by the caller; a step number is looked up)."""
        return step if isinstance(step, StepSettings) else self.schedule.settings(step)

    def bank_scalars(self, entry: Entry, step: int | StepSettings) -> BankStepScalars:
        s = self.settings(step)
        cfg = self.cfg
        if cfg.bank_optimizer == "anvil":
            lr = cfg.anvil_lr * s.lr_mult
            fast_beta, fast_weight = rail_settings(s.step, s.rail_beta, s.rails_engaged,
                                                   cfg.rail_fast_beta, cfg.rail_fast_weight)
            return BankStepScalars(momentum=s.rail_beta, eff_wd=entry.rule.wd_mul * cfg.anvil_weight_decay * lr,
                                   eff_lr=entry.bank_eff_lr(lr), fast_beta=fast_beta,
                                   fast_weight=fast_weight, slow_beta=cfg.rail_slow_beta,
                                   beta2=cfg.lane_beta2, margin=cfg.frobenius_margin,
                                   eps=cfg.frobenius_eps)
        # record #89's NorMuon, with its momentum schedule (0.85 -> 0.95 -> 0.85) over this run
        lr = cfg.normuon_lr * s.lr_mult
        return BankStepScalars(momentum=muon_momentum(s.step, self.schedule.total_steps),
                               eff_wd=entry.rule.wd_mul * cfg.normuon_weight_decay * lr,
                               eff_lr=entry.bank_eff_lr(lr), beta2=cfg.lane_beta2,
                               margin=cfg.normuon_frobenius_margin, eps=cfg.frobenius_eps)

    def adam_hparams(self, entry: Entry, step: int | StepSettings) -> tuple[tuple[float, float], float, float]:
        """(betas, effective lr, decay coefficient base * wd_mul) of an Adam parameter at step."""
        s = self.settings(step)
        rule = entry.rule
        betas, wd_mul = rule.betas, rule.wd_mul
        if entry.name == VALUE_EMBEDS:
            betas, wd_mul = value_embed_hparams(rule, s.table_period4)
        lr = self.cfg.adam_lr * s.lr_mult * rule.lr_mul
        return betas, lr, self.cfg.adam_weight_decay * wd_mul

    def ngram_event_hparams(self, step: int | StepSettings) -> dict:
        """Keyword arguments of optim.adam.row_sparse_adam_event for the n-gram table at a table
        event (record #360: lr 0.008 * schedule * 70, beta2 0.95 -> 0.9025 and wd_mul 5 -> 10 at
        the 4-step cadence, eps 1e-10)."""
        s = self.settings(step)
        period4 = s.table_period4
        cfg = self.cfg
        return dict(lr=cfg.adam_lr * s.lr_mult * cfg.ngram_lr_mul,
                    beta2=cfg.ngram_beta2 ** 2 if period4 else cfg.ngram_beta2,
                    weight_decay=cfg.adam_weight_decay * cfg.ngram_wd_mul * (2 if period4 else 1),
                    world_size=self.world_size * self.local_ranks, eps=cfg.adam_eps)

    def updates_at(self, entry: Entry, step: int | StepSettings) -> bool:
        cadence = entry.rule.cadence
        if cadence == "every":
            return True
        s = self.settings(step)
        if cadence == "adam":
            if entry.name == EMBED and self.tied and not self.split:
                return False       # updated through lm_head
            return s.adam_step
        return s.table_event

    def phase(self, step: int | StepSettings) -> "OptimizerPhase":
        """What decides the kernels of `step(step)`, the key of a captured optimizer update (see
        OptimizerPhase); equal phases run the same kernels on the same tensors."""
        return self._phase(self.settings(step), self.tied and not self.split)

    def phase_at(self, step: int | StepSettings) -> "OptimizerPhase":
        """The phase `phase(step)` returns when a run reaches `step` from step 0 (tied up to and
        including the split step): what a warmup plans its captures with."""
        s = self.settings(step)
        return self._phase(s, self.tied and s.step <= self.schedule.split_step)

    def _phase(self, s: StepSettings, tied: bool) -> "OptimizerPhase":
        # the table cadence's flags select kernels only when a table-cadence parameter exists (none
        # without value embeddings: then fewer keys, so fewer captured graphs)
        table = any(e.rule.cadence == "table" for e in self.entries.values())
        return OptimizerPhase(adam=s.adam_step, table_event=table and s.table_event, tied=tied,
                              period4=table and s.table_period4, rails=s.rails_engaged)

    # --- the step ---------------------------------------------------------------------------
    def _due(self, step: int | StepSettings) -> list[str]:
        """The parameters that update at `step`: due by cadence and holding a gradient."""
        s = self.settings(step)
        return [name for name, e in self.entries.items()
                if self.updates_at(e, s) and (e.held is not None or e.param.grad is not None)]

    _scalar_table: "ScalarTable | None" = None  # load_scalars builds it at its first call

    @torch.no_grad()
    def load_scalars(self, step: int | StepSettings) -> None:
        """Write `step`'s hyperparameters into the due entries' device scalars (Entry.scalars) and
        advance the Adam step counts: the host half of the step, run before `update` and outside a
        captured update, so that the update reads only device memory whose values change in place
        (no per-step Python number becomes a kernel argument; a replay runs no Python).

        The 0-D scalars are views of one table (`ScalarTable`): the values are written on the host
        and reach the device in one copy; the banks' per-matrix eff_lr is computed on the device
        (its multipliers live there), a multiply and a copy each, as before."""
        s = self.settings(step)
        table = self._scalar_table
        if table is None:  # the first load: every scalar still holds its initial zero
            table = self._scalar_table = ScalarTable(self.entries)
        for name in self._due(s):
            e = self.entries[name]
            if e.rule.optim == "bank":
                host = self.bank_scalars(e, s)
                self._bank_host[name] = host
                e.scalars["eff_lr"].copy_(host.eff_lr)
                table.set(name, momentum=host.momentum, eff_wd=host.eff_wd, fast_beta=host.fast_beta,
                          momentum_lerp=1 - host.momentum)  # NorMuon's lerp weight, rounded once as before
            else:
                e.state.step += 1
                betas, lr, wd = self.adam_hparams(e, s)
                step_size, decay = adam_step_scalars(lr, betas, e.state.step, wd)
                table.set(name, step_size=step_size, decay=decay)
        table.upload()
        self._loaded = s.step

    def _bank_device_scalars(self, entry: Entry) -> BankStepScalars:
        """The loaded step's bank scalars, its per-step values as the entry's device tensors."""
        sc = entry.scalars
        return replace(self._bank_host[entry.name], momentum=sc["momentum"], eff_wd=sc["eff_wd"],
                       eff_lr=sc["eff_lr"], fast_beta=sc["fast_beta"], momentum_lerp=sc["momentum_lerp"])

    def untie_due(self, step: int | StepSettings) -> bool:
        """Whether `step` is the split step, whose update is followed by `untie()`."""
        return self.tied and not self.split and self.settings(step).step == self.schedule.split_step

    @torch.no_grad()
    def step(self, step: int | StepSettings, run_region=None, lanes=None, rows: "NgramRowOptimizer | None" = None) -> bool:
        """Every optimizer's work of one training step, in record #360's order (the module's
        docstring lists it): the one call a run makes after its backwards. Returns whether the
        n-gram table changed (a table event of `rows`), which invalidates rows pulled ahead.

        run_region(region, key, fn): how the update runs (training.Run.run_region: captured or
        replayed under CUDA graphs); None calls it. lanes (optim/lanes.py): the virtual ranks of a
        process playing several, each folded (`fold_local`) after its own backward. rows: the
        n-gram table's row optimizer (NgramRowOptimizer), stepped last."""
        s = self.settings(step)
        self._refuse_gathers_in_flight("step", s.step)  # before any state moves
        self.load_scalars(s)
        consumed = None
        if lanes is not None:  # the virtual ranks' gradients summed in rank order, as their reduce adds
            consumed = self.consumed(s)
            lanes.reduce(self.reduced(s))
        if run_region is None:
            self.update(s)
        else:
            run_region("optimizer", self.phase(s), lambda: self.update(s))
        if consumed is not None:
            lanes.clear(consumed)
        # the banks' all-gathers (defer_gathers) run under whatever comes before `wait_gathers`
        self.launch_deferred_gathers(s)
        if self.untie_due(s):  # once per run: embed's moments from lm_head's, host state too
            self.untie()
        return rows is not None and rows.step(s)

    @torch.no_grad()
    def update(self, step: int | StepSettings) -> None:
        """Reduce, update and gather every parameter due at `step` and clear the gradients used
        (zeroed in place with keep_grads, else released): the captured part of `step`. It reads
        the scalars `load_scalars(step)` wrote and sets no host state (a replay would skip it), so
        the untie and the table event stay outside it. On one rank per process it first folds the
        rank's gradients (`fold_local`); a process playing several ranks folds each after its
        backward, and `update` checks that it did."""
        s = self.settings(step)
        step = s.step
        self._refuse_gathers_in_flight("update", step)
        if self._loaded != step:
            raise RuntimeError(f"OptimizerManager.update({step}): the scalars loaded are step {self._loaded}'s "
                               f"(load_scalars({step}) first; OptimizerManager.step does both)")
        if self.local_ranks == 1:
            self._fold(s)
        elif self._folded != step:
            raise RuntimeError(f"OptimizerManager.update({step}): the {self.local_ranks} virtual ranks' gradients "
                               f"were not folded at this step (fold_local({step}) after each rank's backward)")
        due = set(self._due(s))

        # Phase 0: the replicated Adam params' all-reduces.
        replicated = [n for n, e in self.entries.items() if n in due and e.shard is None]
        pending = {n: self._all_reduce(self.entries[n].gradient()) for n in replicated}
        # Phase 1: reduce-scatters, in scatter order.
        for name in self._ordered(SCATTER_ORDER):
            if name in due and name not in pending:
                pending[name] = self._reduce_scatter(self.entries[name])
        # Phase 2: wait, update, launch the gather, in work order; the replicated ones first.
        gathers = {}
        for name in replicated + [n for n in self._ordered(WORK_ORDER) if n in pending and n not in replicated]:
            work, grad = pending[name]
            if work is not None:
                work.wait()
            if self.local_ranks > 1:  # the average over processes, then over this process's virtual ranks
                grad.div_(self.local_ranks)
            entry = self.entries[name]
            if entry.shard is None:
                self._adam(entry, entry.param.data, grad, s)
                continue
            local = entry.shard.local(entry.view)
            if entry.rule.optim == "bank":
                update = anvil_update if self.cfg.bank_optimizer == "anvil" else normuon_update
                update(local, grad, entry.state, self._bank_device_scalars(entry))
            else:
                self._adam(entry, local, grad, s)
            if name not in self.deferred:  # deferred: launch_deferred_gathers, after this call
                gathers[name] = self._all_gather(entry, local)
        # Phase 3: lm_head's gather first (the tied copy needs it), then the rest.
        for name in sorted(gathers, key=lambda n: n != LM_HEAD):
            self._finish_gather(self.entries[name], *gathers[name])
            if name == LM_HEAD and self.tied and not self.split:
                transpose_into(self.entries[EMBED].param.data, self.entries[LM_HEAD].param.data)
        # Clear the gradients that were consumed (Adam grads keep accumulating until their step).
        consumed = self.consumed(s, due)
        for e in self.entries.values():
            if any(e.param.grad is t for t in consumed):
                self._clear_grad(e.param)
            if any(e.held is t for t in consumed):
                e.held.zero_()
        # _loaded stays `step`: the update sets no host state (a captured one is replayed, and the
        # capture check runs it thrice from the same state); the next load_scalars moves it on

    @torch.no_grad()
    def fold_local(self, step: int | StepSettings) -> None:
        """What a virtual rank does to its own gradients before the reduce, after its backward
        (training.Run with optim/lanes.py, on that rank's gradients): see `_fold`. One rank per
        process folds inside `update`, so this is for a process playing several."""
        if self.local_ranks == 1:
            raise RuntimeError("OptimizerManager.fold_local: one rank per process folds inside update(); "
                               "fold_local is for a process playing several virtual ranks")
        self._fold(self.settings(step))

    def _fold(self, s: StepSettings) -> None:
        """Once per step and rank: the dense .grad of a table-cadence parameter added into its
        cycle buffer (fp16, record #360), and while tied, at an Adam step, embed's gradient into
        lm_head's."""
        step = s.step
        for e in self.entries.values():
            if e.held is not None and e.param.grad is not None:
                e.held.add_(e.param.grad)
                self._clear_grad(e.param)
        if self.tied and not self.split and s.adam_step and LM_HEAD in self._due(s):
            embed = self.entries[EMBED].param
            if embed.grad is not None:     # tied: embed's gradient trains lm_head
                transpose_add_(self.entries[LM_HEAD].param.grad, embed.grad)  # [D, V] += [V, D]^T
        self._folded = step

    def reduced(self, step: int | StepSettings) -> list[Tensor]:
        """The gradient tensors `update(step)` reduces: the due entries' (cycle buffer or .grad)."""
        return [self.entries[name].gradient() for name in self._due(step)]

    def consumed(self, step: int | StepSettings, due: Iterable[str] | None = None) -> list[Tensor]:
        """The gradient tensors `update(step)` clears: the due entries' .grad and cycle buffer, and
        embed's .grad at a tied Adam step (folded into lm_head's). Ask before the update."""
        s = self.settings(step)
        due = self._due(s) if due is None else due
        out = []
        for name in due:
            e = self.entries[name]
            out += [t for t in (e.param.grad, e.held) if t is not None]
        if self.tied and not self.split and s.adam_step:
            embed = self.entries[EMBED].param.grad
            if embed is not None and not any(t is embed for t in out):
                out.append(embed)
        return out

    # --- deferred gathers (defer_gathers) --------------------------------------------------------
    def launch_deferred_gathers(self, step: int | StepSettings) -> None:
        """Launch the all-gathers `update(step)` left out (`deferred` banks due at `step`), in work
        order, without waiting: the shards hold the step's update in place, the gather fills in
        the other ranks' rows. Run right after `update` (outside a captured update: the gather
        is waited outside it too)."""
        for name in self.deferred:
            entry = self.entries[name]
            if self.updates_at(entry, step):
                work, _ = self._all_gather(entry, entry.shard.local(entry.view))
                self._in_flight.append((name, work))
                if work is not None:  # the bank is not read before `wait_gathers` (checked on CPU)
                    self._gathers_writing.append(streams.collective_in_flight(entry.view, f"the deferred all-gather of {name}"))

    def _refuse_gathers_in_flight(self, where: str, step: int) -> None:
        if self._in_flight:
            raise RuntimeError(f"OptimizerManager.{where}({step}): the deferred gathers of "
                               f"{[n for n, _ in self._in_flight]} were never waited (wait_gathers() "
                               f"before the weights are read or updated again)")

    def wait_gathers(self) -> list[str]:
        """Wait for the launched deferred gathers (on CUDA the current stream waits, not the
        host); returns their names (empty when none was in flight)."""
        names = []
        for name, work in self._in_flight:
            work.wait()
            names.append(name)
        for writing in self._gathers_writing:
            writing.waited()
        self._in_flight.clear()
        self._gathers_writing.clear()
        return names

    def _clear_grad(self, param: Tensor) -> None:
        if not self.keep_grads:
            param.grad = None
        elif param.grad is not None:
            param.grad.zero_()  # the next backward adds into it: same storage, same values (x + 0 is x)

    def _ordered(self, order: tuple[str, ...]) -> list[str]:
        """The given order, then any sharded entry it does not name (e.g. a renamed parameter)."""
        named = [n for n in order if n in self.entries]
        rest = [n for n, e in self.entries.items() if e.shard is not None and n not in order]
        return named + rest

    def _adam(self, entry: Entry, p: Tensor, grad: Tensor, s: StepSettings) -> None:
        betas, _, _ = self.adam_hparams(entry, s)  # constant within a phase; lr reaches it as step_size
        adam_apply(p, grad, entry.state, betas, entry.scalars["step_size"], entry.scalars["decay"],
                   self.cfg.adam_eps)

    # --- collectives (no-ops on one process) --------------------------------------------------------
    def _all_reduce(self, grad: Tensor):
        if self.world_size == 1:
            return None, grad
        return dist.all_reduce(grad, op=dist.ReduceOp.AVG, async_op=True), grad

    def _reduce_scatter(self, entry: Entry):
        grad = entry.gradient().view(entry.view.shape)
        if self.world_size == 1:
            return None, grad
        full = entry.shard.pad(grad).contiguous()
        if dist.get_backend() == "gloo":
            # gloo has no reduce-scatter of its own: it all-reduces a clone and copies this rank's
            # chunk out, outside the dispatcher (where neither the sync check nor the CPU capture
            # twin sees it). The same all-reduce here, on a copy, and the chunk as a view.
            if full.untyped_storage().data_ptr() == grad.untyped_storage().data_ptr():
                full = full.clone()
            lo = self.rank * entry.shard.chunk
            return dist.all_reduce(full, op=dist.ReduceOp.AVG, async_op=True), full[lo: lo + entry.shard.chunk]
        out = torch.empty((entry.shard.chunk, *full.shape[1:]), dtype=full.dtype, device=full.device)
        return reduce_scatter_single(out, full, op=dist.ReduceOp.AVG, async_op=True), out

    def _all_gather(self, entry: Entry, local: Tensor):
        if self.world_size == 1:
            return None, None
        shard = entry.shard
        if shard.padded == shard.n:
            target = entry.view          # gather straight into the parameter
        else:
            target = torch.empty((shard.padded, *local.shape[1:]), dtype=local.dtype, device=local.device)
        return all_gather_single(target, local.contiguous(), async_op=True), target

    def _finish_gather(self, entry: Entry, work, target: Tensor | None) -> None:
        if work is None:   # one process: never padded, the update was in place
            return
        work.wait()
        if target is not entry.view:
            entry.view.copy_(target[:entry.shard.n])

    # --- tying ------------------------------------------------------------------------------------
    def untie(self) -> None:
        """Copy lm_head's Adam moments (gathered, transposed, resharded) into embed's; from now on
        embed has its own gradient and update (record #360: after step 1175's tied update)."""
        self.wait_gathers()
        lm, em = self.entries[LM_HEAD], self.entries[EMBED]
        em.state.step = lm.state.step
        for key in ("exp_avg", "exp_avg_sq"):
            full = self._gather_rows(lm, getattr(lm.state, key))            # [D, V] fp32
            rows = slice(em.shard.lo, em.shard.lo + em.shard.chunk)
            moment = em.shard.pad(embed_moments_from_lm_head(full))[rows]
            getattr(em.state, key).copy_(moment)
        self.split = True

    def _gather_rows(self, entry: Entry, local: Tensor) -> Tensor:
        """The full (unpadded) tensor whose rows are sharded like `entry`, from this rank's chunk."""
        if self.world_size == 1:
            return local[:entry.shard.n]
        full = torch.empty((entry.shard.padded, *local.shape[1:]), dtype=local.dtype, device=local.device)
        all_gather_single(full, local.contiguous())
        return full[:entry.shard.n]

    # --- for the tail averages -----------------------------------------------------------------
    def own_shard(self, name: str) -> Tensor:
        """The rows of `name` this rank updates (a view into the parameter; banks as matrices)."""
        entry = self.entries[name]
        if entry.shard is None:
            return entry.view
        return entry.view[entry.shard.real_rows]

    def gather_param(self, name: str) -> None:
        """Rebuild the full parameter on every rank from each rank's own shard."""
        self.wait_gathers()
        entry = self.entries[name]
        if self.world_size == 1 or entry.shard is None:
            return
        local = entry.shard.local(entry.view)
        self._finish_gather(entry, *self._all_gather(entry, local))


# --- the n-gram table -----------------------------------------------------------------------------

class NgramRowOptimizer:
    """Row-sparse Adam of the n-gram table on this rank's contiguous row shard (record #360:
    track_1_short/ngram_table.py), with no host sync on the device side.

    Each step's sink gradient (2T, D) is merged per distinct row with its pull plan's inverse
    (fp32 index_add_ from zero, in position order) and held with the plan. At a table event
    `exchange.push` sums each rank's held steps per row (step order), sends every owner its rows
    along the pulls' routes reversed and merges them per row (sender order), all with indices
    planned on the host; then optim.adam.row_sparse_adam_event updates the touched rows. A process
    playing several virtual ranks holds each one's steps apart (the plan's lane), and the owner
    merges them in virtual-rank order: bitwise the sums of any other process layout (on CPU, where
    index_add_ adds in order; CUDA's atomics do not promise an order).
    The last cycle of a run has no event (record #360 too)."""

    def __init__(self, shard: Tensor, rows_per_rank: int, manager: OptimizerManager, exchange: RowExchange):
        if shard.dim() != 2 or shard.size(0) != rows_per_rank:
            raise ValueError(f"n-gram shard must be [rows_per_rank={rows_per_rank}, D], got {tuple(shard.shape)}")
        if exchange.rows_per_rank != rows_per_rank:
            raise ValueError(f"n-gram exchange splits {exchange.num_rows} rows into {exchange.rows_per_rank} "
                             f"per rank, expected rows_per_rank={rows_per_rank}")
        if (exchange.rank, exchange.world_size) != (manager.rank, manager.world_size):
            raise ValueError(f"n-gram exchange is rank {exchange.rank} of {exchange.world_size}, the optimizer "
                             f"manager rank {manager.rank} of {manager.world_size}")
        if exchange.lanes != manager.local_ranks:
            raise ValueError(f"n-gram exchange keeps {exchange.lanes} virtual ranks apart, the optimizer manager "
                             f"plays {manager.local_ranks}")
        self.shard, self.manager, self.exchange = shard, manager, exchange
        schedule = manager.schedule
        events = sum(1 for s in range(schedule.total_steps) if schedule.is_table_event(s))
        self.state = RowAdamState.zeros(rows_per_rank, device=shard.device, capacity=events)
        self._held: list[tuple[RowPlan, Tensor]] = []     # this cycle's (plan, (U_k, D) fp32)
        self.version = 0  # bumped whenever the table's rows change here (events, reset): rows
                          # pulled ahead are valid while it stands (training.Run's row prefetch)

    def accumulate(self, plan: RowPlan, sink_grad: Tensor) -> None:
        """Hold one step's gradient rows, merged per distinct row of the plan."""
        d = self.shard.size(1)
        if sink_grad.shape != (plan.num_ids, d):
            raise ValueError(f"n-gram sink gradient: expected [N={plan.num_ids}, {d}] (one row per id of "
                             f"the plan), got {tuple(sink_grad.shape)}")
        merged = torch.zeros((plan.unique.size, d), dtype=torch.float32, device=self.shard.device)  # (U, D)
        merged.index_add_(0, plan.inverse_dev, sink_grad.float())
        self._held.append((plan, merged))
        # when the cycle's last plans are known (training.Run.prefetch announced them), the event's
        # push routes are planned now, on the exchange's prep thread, a step before `step` needs them
        self.exchange.prepare_push([p for p, _ in self._held])

    @torch.no_grad()
    def step(self, step: int | StepSettings) -> bool:
        """Apply the held gradients if `step` is a table event (a collective then, on every rank);
        returns whether it was. (OptimizerManager.step calls it last.)"""
        s = self.manager.settings(step)
        if not s.table_event:
            return False
        rows, sums = self.exchange.push(self._held, self.shard.size(1))     # (M,), (M, D)
        new_rows = row_sparse_adam_event(self.shard, self.state, rows, sums, **self.manager.ngram_event_hparams(s),
                                         host_rows=self.exchange.pushed_rows)
        self._held.clear()
        self.version += 1
        self.last_event = (self.exchange.pushed_rows, new_rows)
        return True

    def patch_pull(self, pull) -> None:
        """Bring a pull launched before the last table event up to date (one process: it owns every
        row): the event's rows among the pull's distinct rows get their new values; the others did
        not change. Host-side intersection, device index_copy_: no sync."""
        if self.exchange.world_size != 1:
            raise RuntimeError("NgramRowOptimizer.patch_pull: a pull across a table event needs one process "
                               "(on several, other owners' rows changed too)")
        event_rows, new_rows = self.last_event
        _, in_pull, in_event = np.intersect1d(pull.plan.unique - self.exchange.lo, event_rows,
                                              assume_unique=True, return_indices=True)
        if in_pull.size:
            positions, picks = self.exchange.upload_indices(in_pull, in_event)
            pull.patch(positions, new_rows.index_select(0, picks))

    def reset(self) -> None:
        self.state.zero_()
        self._held.clear()
        self.version += 1
