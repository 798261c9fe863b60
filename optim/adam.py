"""The per-parameter optimizer table and the Adam side of record #360: dense Adam with cautious
decay (every non-bank parameter), the value-embedding schedule change at step 336, the
lm_head -> embed moment transfer at the split, and the row-sparse Adam of the n-gram table.

Reference: record #360's track_1_short/training.py (the table, the tie) and ngram_table.py. The table is keyed by
the model's `named_parameters()` names; `build_param_table` fails, naming the parameter, when a
parameter has no entry (or an entry has no parameter), so a new parameter cannot silently go
untrained.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable

import numpy as np
import torch
from torch import Tensor

from config import FEATURES, Feature, ParamRule
from perf.kernels.transpose import transpose_into


def _adam(betas, lr_mul=1.0, wd_mul=1.0, comms="replicated", cadence="adam") -> ParamRule:
    return ParamRule("adam", comms, cadence, betas, lr_mul, wd_mul)


_BANK = ParamRule("bank", "sharded", "every")

# record #360 (track_1_short/training.py): betas; lr_mul; wd_mul. The bank shape multiplier and per-matrix
# multipliers are applied by optim/manager.py. The parameters a feature switch adds carry their rows in
# their declaration (config.FEATURES: value_embeds, ve_gate_bank), joined below.
BASE_PARAM_TABLE: dict[str, ParamRule] = {
    "qk_bank": _BANK,
    "vo_bank": _BANK,
    "mlp_bank": _BANK,
    "scalars": _adam((0.9, 0.99), lr_mul=5.0, wd_mul=0.0),
    "smear_gate.weight": _adam((0.9, 0.99), lr_mul=0.01, wd_mul=0.0),
    "lm_head.weight": _adam((0.5, 0.95), wd_mul=150.0, comms="sharded"),  # carries embed's grad while tied
    "post_lambdas": _adam((0.9, 0.95), wd_mul=0.0),
    "resid_lambdas": _adam((0.9, 0.95), lr_mul=5.0, wd_mul=0.0),
    "embed.weight": _adam((0.5, 0.95), wd_mul=150.0, comms="sharded"),      # skipped while tied
    "mudd_w1": _adam((0.9, 0.99), lr_mul=0.25),
    "mudd_w2": _adam((0.9, 0.99), lr_mul=0.25),
    "mudd_w2g": _adam((0.9, 0.99), lr_mul=0.25),
    "mudd_b2": _adam((0.9, 0.99), lr_mul=0.25, wd_mul=0.0),
    "mudd_gate_w1": _adam((0.9, 0.99), lr_mul=0.1),
    "mudd_gate_w2": _adam((0.9, 0.99), lr_mul=0.1),
    "mudd_gate_b2": _adam((0.9, 0.99), lr_mul=0.1, wd_mul=0.0),
    "mudd_gate_scale": _adam((0.9, 0.99), lr_mul=0.1, wd_mul=0.0),
}


def param_table(features: tuple[Feature, ...] = FEATURES) -> dict[str, ParamRule]:
    """The optimizer table of a model with every declared feature: the base rows, then each
    feature's parameters' rows in declaration order. (Entries are made in the model's
    named_parameters() order, not this one: the order here names nothing but error messages.)"""
    table = dict(BASE_PARAM_TABLE)
    for feature in features:
        for name, rule in feature.params:
            if name in table:
                raise ValueError(f"feature {feature.name!r} declares parameter {name!r}, which already has a row")
            table[name] = rule
    return table


# the record's rows (its features'); and every declared feature's, a proposal's too
RECORD_PARAM_TABLE: dict[str, ParamRule] = param_table(tuple(f for f in FEATURES if f.default))
PARAM_TABLE: dict[str, ParamRule] = param_table(FEATURES)


def run_param_table(features) -> dict[str, ParamRule]:
    """The table of a run with these switches (training.Run): the record's rows, plus those of each
    feature past the record it switches on (its record features switched off are the manager's
    `absent`, GPT.switched_off_parameters)."""
    added = [f.name for f in FEATURES if not f.default and getattr(features, f.name)]
    return RECORD_PARAM_TABLE if not added else {**RECORD_PARAM_TABLE, **{
        n: PARAM_TABLE[n] for f in FEATURES if f.name in added for n in f.param_names}}
VALUE_EMBEDS = "value_embeds"
LM_HEAD = "lm_head.weight"
EMBED = "embed.weight"


def build_param_table(named_parameters: Iterable[tuple[str, Tensor]],
                      table: dict[str, ParamRule] = RECORD_PARAM_TABLE) -> dict[str, tuple[Tensor, ParamRule]]:
    """name -> (parameter, rule) for every parameter, in the model's order.

    Raises ValueError naming the parameter when one has no entry, and naming the entry when the
    table lists a parameter the model does not have."""
    out: dict[str, tuple[Tensor, ParamRule]] = {}
    for name, param in named_parameters:
        if name in out:
            raise ValueError(f"parameter {name!r} appears twice in named_parameters()")
        if name not in table:
            raise ValueError(f"parameter {name!r} (shape {tuple(param.shape)}) has no optimizer "
                             f"entry: add its row to BASE_PARAM_TABLE in optim/adam.py, or to its feature's "
                             f"declaration (config.FEATURES) when a switch adds it")
        out[name] = (param, table[name])
    missing = [n for n in table if n not in out]
    if missing:
        raise ValueError(f"optimizer table entries {missing} match no model parameter")
    return out


def value_embed_hparams(rule: ParamRule, period4: bool) -> tuple[tuple[float, float], float]:
    """(betas, wd_mul) of value_embeds: from the 4-step table cadence on, one event stands for
    two, so both betas are squared and the decay doubled (record #360: (0.5625, 0.9025), 10)."""
    if not period4:
        return rule.betas, rule.wd_mul
    b1, b2 = rule.betas
    return (b1 * b1, b2 * b2), rule.wd_mul * 2


@dataclass
class AdamState:
    exp_avg: Tensor      # fp32, shaped like the parameter (or this rank's shard)
    exp_avg_sq: Tensor
    step: int = 0        # counts this parameter's own Adam updates (bias correction)

    @classmethod
    def zeros_like(cls, t: Tensor) -> "AdamState":
        z = torch.zeros(t.shape, dtype=torch.float32, device=t.device)
        return cls(z, torch.zeros_like(z))

    def zero_(self) -> None:
        self.exp_avg.zero_()
        self.exp_avg_sq.zero_()
        self.step = 0


def adam_step_scalars(lr: float, betas: tuple[float, float], t: int, weight_decay: float) -> tuple[float, float]:
    """(step size, decay coefficient) of Adam update number t (1-based): the bias-corrected lr
    lr·√(1 − β2^t)/(1 − β1^t) and lr²·weight_decay, host doubles (the update rounds them to fp32
    where it multiplies, as a Python scalar or a 0-D fp32 tensor alike)."""
    beta1, beta2 = betas
    return lr * (1 - beta2 ** t) ** 0.5 / (1 - beta1 ** t), lr * lr * weight_decay


def adam_update(p: Tensor, grad: Tensor, state: AdamState, betas: tuple[float, float], lr: float,
                eps: float, weight_decay: float) -> None:
    """One Adam step with bias correction and cautious decay, in place on p (any dtype).

    lr is the effective lr (base * schedule * lr_mul); the decay coefficient is lr^2 * weight_decay
    (weight_decay = base decay * wd_mul), applied where update * p > 0 (strict, unlike the banks)."""
    state.step += 1
    step_size, decay = adam_step_scalars(lr, betas, state.step, weight_decay)
    adam_apply(p, grad, state, betas, step_size, decay, eps)


def adam_apply(p: Tensor, grad: Tensor, state: AdamState, betas: tuple[float, float],
               step_size: float | Tensor, decay: float | Tensor, eps: float) -> None:
    """The device part of one Adam step (`adam_update` less the host step count): step_size and
    decay are `adam_step_scalars`' values, as Python floats or as 0-D fp32 tensors holding them
    (a CUDA graph's form: the values change in place, the kernels stay). Both forms multiply in
    fp32 with the value rounded once to fp32, so they are bitwise equal."""
    beta1, beta2 = betas
    g = grad.float()
    state.exp_avg.mul_(beta1).add_(g, alpha=1 - beta1)
    state.exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    update = state.exp_avg / (state.exp_avg_sq.sqrt() + eps) * step_size
    pf = p.float()
    update = update + pf * ((update * pf) > 0) * decay
    p.copy_(pf - update)


def embed_moments_from_lm_head(lm_head_moment: Tensor) -> Tensor:
    """At the split: embed's full moment [V, D] is the full lm_head moment [D, V] transposed
    (lm_head is stored [D, V]: embed's vocab rows are lm_head's columns)."""
    out = lm_head_moment.new_empty(lm_head_moment.shape[::-1])
    return transpose_into(out, lm_head_moment)


# --- the n-gram table's row-sparse Adam -------------------------------------------------------

# record #360 (track_1_short/ngram_table.py): 382 table events in a record run (168 every 2nd step, then 214 every
# 4th); the replay table starts with room for them and doubles (a device copy) past it.
RECORD_TABLE_EVENTS = 382


@dataclass
class RowAdamState:
    """Per-row state of one rank's n-gram shard: beta1 = 0, so one second moment per row, plus the
    running log-sum of the events' beta2 that replays the decays a row missed in closed form."""
    exp_avg_sq: Tensor               # fp32 (rows,): EMA of the row's mean squared gradient
    last_event: Tensor               # int32 (rows,): the event that last touched the row (0 = never)
    log_beta2_sum: Tensor            # fp64 (capacity + 1,): slot e = sum of ln fp32(beta2_i), i = 1..e; slot 0 = 0
    events: int = 0                  # table events so far (host)
    log_beta2_total: float = 0.0     # host copy of slot `events`

    @classmethod
    def zeros(cls, rows: int, device=None, capacity: int = RECORD_TABLE_EVENTS) -> "RowAdamState":
        return cls(torch.zeros(rows, dtype=torch.float32, device=device),
                   torch.zeros(rows, dtype=torch.int32, device=device),
                   torch.zeros(capacity + 1, dtype=torch.float64, device=device))

    def zero_(self) -> None:
        self.exp_avg_sq.zero_()
        self.last_event.zero_()
        self.log_beta2_sum.zero_()
        self.events, self.log_beta2_total = 0, 0.0


def row_sparse_adam_event(shard: Tensor, state: RowAdamState, local_rows: Tensor, grad_sum: Tensor,
                          lr: float, beta2: float, weight_decay: float, world_size: int,
                          eps: float = 1e-10, host_rows=None) -> Tensor:
    """One table event on this rank's shard (record #360: track_1_short/ngram_table.py), with no host sync.

    local_rows: (M,) int64, the distinct touched rows (indices into shard); grad_sum: (M, D), their
    gradients summed over ranks and the cycle's steps. lr is the effective lr (0.008 * schedule *
    70); the decay coefficient is lr^2 * weight_decay (0.005 * wd_mul). Untouched rows do not move;
    the beta2 decays they miss are applied the next time they are touched, in closed form:
    v <- v * exp(S[event - 1] - S[last]), S the fp64 running sum of ln beta2 (the events' beta2
    rounded to fp32, the factor the eager `beta2 * v` multiplies by), one rounding to fp32 instead
    of one per missed event. A row touched at every event gets the factor exp(0) = 1 exactly, so
    it is bitwise the dense every-event update; a row that missed k events differs from the
    sequential replay by the k roundings that replay did (tests/optim/test_optim_adam.py states
    the measured error). shard may be a host-memory row store (perf/host_table.py HostRows): its
    rows are read and written back by `host_rows`, the same rows as local_rows on the host.
    Returns the rows' new values (M, D) in the shard's dtype, as written."""
    state.events += 1
    event = state.events
    if event >= state.log_beta2_sum.numel():    # past the preallocated events: double (device copy)
        state.log_beta2_sum = torch.cat([state.log_beta2_sum, torch.zeros_like(state.log_beta2_sum)])
    missed_until = state.log_beta2_total                        # S[event - 1], a host float
    state.log_beta2_total = missed_until + math.log(float(np.float32(beta2)))
    state.log_beta2_sum[event].fill_(state.log_beta2_total)     # a kernel argument, not a sync
    v = state.exp_avg_sq.index_select(0, local_rows)                                    # (M,)
    last = state.last_event.index_select(0, local_rows)                                 # (M,)
    missed = torch.exp(missed_until - state.log_beta2_sum.index_select(0, last))        # (M,) fp64
    v = (v.double() * missed).float()
    m = grad_sum.float() / world_size                                                   # (M, D)
    v = beta2 * v + (1 - beta2) * m.square().mean(dim=-1)
    update = m / (v.sqrt() + eps)[:, None] * (lr * (1 - beta2 ** event) ** 0.5)
    on_host = not isinstance(shard, Tensor)
    p = (shard.gather(host_rows) if on_host else shard.index_select(0, local_rows)).float()  # (M, D)
    update = update + p * ((update * p) > 0) * (lr * lr * weight_decay)
    new_rows = (p - update).to(shard.dtype)                                             # (M, D)
    if on_host:
        shard.scatter(host_rows, new_rows)
    else:
        shard.index_copy_(0, local_rows, new_rows)
    state.exp_avg_sq.index_copy_(0, local_rows, v)
    state.last_event.index_fill_(0, local_rows, event)
    return new_rows
