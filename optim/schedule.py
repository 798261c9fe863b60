"""The training schedule: stage ends, learning-rate multiplier, rail beta, windows, batch sizes,
MTP / prefix weights, sampled-softmax P and the step-indexed switches (record #360: track_1_short/schedule.py).

Every value is a pure function of the step and a `ScheduleConfig` (config.py), so a researcher can
see an edit before renting GPUs:

    python -m optim.schedule --config record                 # the stage table
    python -m optim.schedule --config smoke --plot sched.png # + lr, rail beta, batch and P by step

Steps are 0-based; a run has `total_steps` training steps and the final validation is "step
total_steps", which belongs to the last stage.

A compiled model keeps one graph per step *geometry* (`StepSettings.geometry`: shapes, windows,
which loss terms exist); the loss weights that change inside a geometry reach it as tensors
(`StepWeights`), so the timed loop never recompiles.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
from dataclasses import dataclass

import torch

from config import SCHEDULE_PRESETS, ConfigError, FeatureConfig, ScheduleConfig, StageConfig

# PR #371 calibrates on steps 592-593 of record #360's stage 1 [320, 681) (hard-wired there): its place in
# the stage, so a schedule of other length (smoke, a proposal's base steps) calibrates at the same point
CALIBRATION_FRACTION = (592 - 320) / (681 - 320)


@dataclass(frozen=True)
class StageSpan:
    index: int
    start: int   # first step of the stage
    end: int     # one past its last step
    stage: StageConfig


@dataclass(frozen=True)
class StepSettings:
    """Everything the schedule sets at the top of one training step (track_1_short/schedule.py
    advance_schedule), computed once: the model's geometry and loss weights (training.Run), and the
    optimizer's lr, betas and cadences (optim/manager.py OptimizerManager.step)."""
    step: int
    stage: int
    lr_mult: float         # the optimizers' lr multiplier (stage lr_mul, then the cooldown)
    rail_beta: float       # ANVIL's momentum (and the fast rail's beta before the engage step)
    rails_engaged: bool    # the fast rail's fixed beta and blend from here
    batch_tokens: int
    doc_cap: int
    ws_short: int
    ws_long: int
    mtp_weights: tuple[float, ...]
    prefix_weight: float
    softmax_p: int
    adam_step: bool        # the Adam parameters update (odd steps)
    table_event: bool      # the n-gram table and value embeddings update
    table_period4: bool    # their events every 4th step (squared betas, doubled decay)
    head_sample: bool = False  # PR #371: the lm_head's dW sampled (features.approx_lm_head_grad)
    attention_mode: int = 0  # PR #371: 0 exact, 1 calibration, 2 restricted (features.approx_attention_backward)

    @property
    def geometry(self) -> tuple:
        """What the compiled forward specializes on: tokens, doc cap (max segment), sampled-softmax
        width, MTP count, whether the prefix term exists, the windows (YaRN tables and scales
        change with them), whether the lm_head's dW is sampled and the attention backward's mode (PR #371).
        Steps with equal geometry share one compiled graph."""
        return (self.batch_tokens, self.doc_cap, self.softmax_p, len(self.mtp_weights), self.prefix_weight != 0,
                self.ws_short, self.ws_long, self.head_sample, self.attention_mode)


class TrainingSchedule:
    """Per-step values of one ScheduleConfig. `features` (config.FeatureConfig) switches loss
    terms off for every step: without `mtp` one weight (1.0,), without `prefix_loss` a prefix weight
    of 0 (no term: StepWeights gives None), without `sampled_softmax` P = 0 (the full softmax). The
    geometries follow, so an ablated run compiles and captures fewer graphs."""

    def __init__(self, cfg: ScheduleConfig, features: FeatureConfig = FeatureConfig()):
        n_duration = len(cfg.stage_durations)
        if len(cfg.stages) != n_duration + 2:
            raise ValueError(f"ScheduleConfig.stages: expected {n_duration + 2} stages "
                             f"({n_duration} by duration, a taper and an extension), got {len(cfg.stages)}")
        if not 0 <= cfg.growth_stage < n_duration + 1:
            raise ValueError(f"ScheduleConfig.growth_stage={cfg.growth_stage} is not a timed stage")
        if cfg.growth_steps % 2:
            raise ValueError(f"ScheduleConfig.growth_steps={cfg.growth_steps} must be even: later "
                             "boundaries must keep their Adam-step (odd/even) parity")
        if not 0 < cfg.taper_duration < cfg.stage_durations[-1] / sum(cfg.stage_durations):
            raise ValueError(f"ScheduleConfig.taper_duration={cfg.taper_duration} must be positive "
                             "and shorter than the last timed stage")
        self.cfg, self.features = cfg, features
        self.scheduled_steps = cfg.base_steps + cfg.growth_steps  # record: 1174
        self.total_steps = self.scheduled_steps + cfg.extension_steps  # record: 1194
        self.stage_ends = self._stage_ends()
        self.spans = [StageSpan(i, self.stage_ends[i], self.stage_ends[i + 1], s)
                      for i, s in enumerate(cfg.stages)]
        for span in self.spans:
            if span.end <= span.start:
                raise ValueError(f"stage {span.index} is empty (ends {self.stage_ends}); "
                                 "base_steps is too small for these durations")
        # Forced odd so the untie happens on an Adam step (record #360: 1174 | 1 = 1175).
        self.split_step = self.stage_ends[cfg.split_embed_stage] | 1
        self.cooldown_start = int(self.scheduled_steps * (1 - cfg.lr_cooldown_frac))  # record: 234

    def _stage_ends(self) -> list[int]:
        cfg = self.cfg
        total = sum(cfg.stage_durations)
        fractions = [d / total for d in cfg.stage_durations]
        fractions[-1] -= cfg.taper_duration  # the taper is taken out of the last timed stage
        fractions.append(cfg.taper_duration)
        ends, cumulative = [0], 0.0
        for f in fractions:
            cumulative += f
            ends.append(round(cumulative * cfg.base_steps))
        # The growth goes entirely into the growth stage: every later end moves by growth_steps.
        for i in range(cfg.growth_stage + 1, len(ends)):
            ends[i] += cfg.growth_steps
        assert ends[-1] == self.scheduled_steps, (ends, self.scheduled_steps)
        ends.append(self.total_steps)
        return ends

    # --- stage lookup ------------------------------------------------------------------------
    def span(self, step: int) -> StageSpan:
        """The stage holding `step`; the validation step (and beyond) is the last stage's."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        for span in self.spans:
            if step < span.end:
                return span
        return self.spans[-1]

    def progress(self, step: int) -> tuple[StageSpan, float]:
        """(stage, t) with t = the fraction of the stage done at `step`; 1.0 past the end."""
        span = self.span(step)
        if step >= span.end:
            return span, 1.0
        return span, (step - span.start) / (span.end - span.start)

    # --- per-step values -----------------------------------------------------------------------
    def lr_mult(self, step: int) -> float:
        """The stage's lr_mul, then a linear cooldown to the floor over the last
        lr_cooldown_frac of the scheduled steps. The cooldown interpolates from the *current*
        stage's lr_mul, so the multiplier jumps at stage boundaries (record #360)."""
        lr_mul = self.span(step).stage.lr_mul
        if step < self.cooldown_start:
            return lr_mul
        tau = min(1.0, (step - self.cooldown_start) / (self.scheduled_steps - self.cooldown_start))
        return lr_mul * (1 - tau) + self.cfg.lr_floor * tau

    def rail_beta(self, step: int) -> float:
        """ANVIL's Nesterov lookahead (and the fast rail's beta before the engage step): linear
        warmup min -> max, flat, linear back to min over the last rail_cooldown_steps."""
        cfg = self.cfg
        lo, hi = cfg.rail_beta_min, cfg.rail_beta_max
        if step < cfg.rail_warmup_steps:
            return lo + (hi - lo) * step / cfg.rail_warmup_steps
        cooldown_from = self.total_steps - cfg.rail_cooldown_steps
        if step > cooldown_from:
            return hi - (hi - lo) * (step - cooldown_from) / cfg.rail_cooldown_steps
        return hi

    def rails_engaged(self, step: int) -> bool:
        """From this step on the fast rail has a fixed beta and is blended with the slow rail."""
        return step >= self.cfg.rail_engage_step

    def mtp_weights(self, step: int) -> tuple[float, ...]:
        """Weights of the next-token and multi-token-prediction losses (length changes by stage)."""
        if not self.features.mtp:
            return (1.0,)  # the next-token loss alone
        span, t = self.progress(step)
        return tuple(a + (b - a) * t for a, b in zip(span.stage.mtp_start, span.stage.mtp_end))

    def prefix_weight(self, step: int) -> float:
        if not self.features.prefix_loss:
            return 0.0  # no prefix term (StepWeights.load gives None)
        span, t = self.progress(step)
        w = span.stage.prefix_weights
        return w[min(len(w) - 1, int(t * len(w)))]

    def softmax_p(self, step: int) -> int:
        """Sampled-softmax candidate count; 0 = full softmax (stages without counts, and the
        validation step). Record #360 code: 681/823/965, off at 1107 (its README: 961 and 1101)."""
        if step >= self.total_steps or not self.features.sampled_softmax:
            return 0
        span = self.span(step)
        counts = span.stage.softmax_p
        if not counts:
            return 0
        return counts[(step - span.start) * len(counts) // (span.end - span.start)]

    def windows(self, step: int) -> tuple[int, int]:
        """(ws_short, ws_long) in window blocks for a training step."""
        stage = self.span(step).stage
        return stage.ws_short, stage.ws_long

    def final_windows(self) -> tuple[int, int]:
        """Final validation: the last stage's short window and the extended long window (no YaRN)."""
        return self.cfg.stages[-1].ws_short, self.cfg.ws_post_yarn_ext

    def head_sample(self, step: int) -> bool:
        """Whether the lm_head's weight gradient is sampled (features.approx_lm_head_grad, PR #371): on the
        sampled-softmax steps whose batch is at least stage 1's, PR #371's HEAD_SAMPLE_MIN_ROWS = 32,768 rows
        per rank on the record (steps 320-1106), derived from the stage table so the smoke preset scales it."""
        return (self.features.approx_lm_head_grad and self.softmax_p(step) > 0 and len(self.cfg.stages) > 1
                and self.batch_tokens(step) >= self.cfg.stages[1].batch_tokens)

    def calibration_step(self) -> int:
        """The first of PR #371's two calibration steps: where its step 592 sits in record #360's stage 1
        [320, 681), at the same fraction of this schedule's stage 1 (record: 592; smoke: 31)."""
        start, end = self.stage_ends[1], self.stage_ends[2]
        return start + round(CALIBRATION_FRACTION * (end - start))

    def attention_mode(self, step: int) -> int:
        """PR #371's attention backward mode (features.approx_attention_backward): 1 on the two calibration
        steps (the exact backward, measured), 2 from the next step to the taper's first step, exclusive (the
        restricted backward; record: 594-1106), else 0 (the stock backward; the last stages are exact)."""
        if not self.features.approx_attention_backward or len(self.cfg.stages) < 4:
            return 0
        first = self.calibration_step()
        if first <= step <= first + 1:
            return 1
        return 2 if first + 2 <= step < self.stage_ends[-3] else 0

    def batch_tokens(self, step: int) -> int:
        """Global tokens per step (all ranks together)."""
        return self.span(step).stage.batch_tokens

    def doc_cap(self, step: int) -> int:
        return self.span(step).stage.doc_cap

    def max_seq_len(self, step: int) -> int:
        """Longest attention segment in a training batch: the doc cap, cut at virtual_seq_cap."""
        return min(self.doc_cap(step), self.cfg.virtual_seq_cap)

    @staticmethod
    def is_adam_step(step: int) -> bool:
        """Adam parameters update on odd steps, over two steps of summed gradient (record #360)."""
        return step % 2 == 1

    def table_period4(self, step: int) -> bool:
        """From table_period4_step on, the n-gram/value-embed events come every 4th step and
        their beta2 and decay switch ("one event stands for two", record #360 step 336)."""
        return step >= self.cfg.table_period4_step

    def is_table_event(self, step: int) -> bool:
        """n-gram table and value-embed update events: odd steps, then steps = 3 mod 4."""
        return step % 4 == 3 if self.table_period4(step) else step % 2 == 1


    def settings(self, step: int) -> StepSettings:
        """All per-step values at once, for the training loop."""
        ws_short, ws_long = self.windows(step)
        return StepSettings(step=step, stage=self.span(step).index, lr_mult=self.lr_mult(step),
                            rail_beta=self.rail_beta(step), rails_engaged=self.rails_engaged(step),
                            batch_tokens=self.batch_tokens(step), doc_cap=self.doc_cap(step),
                            ws_short=ws_short, ws_long=ws_long, mtp_weights=self.mtp_weights(step),
                            prefix_weight=self.prefix_weight(step), softmax_p=self.softmax_p(step),
                            adam_step=self.is_adam_step(step), table_event=self.is_table_event(step),
                            table_period4=self.table_period4(step), head_sample=self.head_sample(step),
                            attention_mode=self.attention_mode(step))


class StepWeights:
    """The schedule's per-step loss weights as device tensors whose values change in place.

    Record #360 passes its MTP and prefix weights to the compiled model as tensors: a Python float
    would be a constant of the graph, and every new value a recompile. Every step's weights are
    tabulated on the device once, off the clock; `load(step)` copies that step's row into two
    static buffers (a device-side copy: no host staging, no sync, nothing a later step can race)
    and returns views of them at the step's static length.
    """

    def __init__(self, schedule: TrainingSchedule, device=None):
        settings = [schedule.settings(s) for s in range(schedule.total_steps)]
        width = max(len(s.mtp_weights) for s in settings)
        mtp = [list(s.mtp_weights) + [0.0] * (width - len(s.mtp_weights)) for s in settings]
        self.mtp_table = torch.tensor(mtp, dtype=torch.float32, device=device)  # (steps, K_max)
        self.prefix_table = torch.tensor([s.prefix_weight for s in settings], dtype=torch.float32,
                                         device=device)  # (steps,)
        self.mtp = torch.zeros(width, dtype=torch.float32, device=device)  # (K_max,) read by the model
        self.prefix = torch.zeros((), dtype=torch.float32, device=device)
        self.num_mtp = [len(s.mtp_weights) for s in settings]
        self.prefix_on = [s.prefix_weight != 0 for s in settings]

    def load(self, step: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(MTP weights [K], prefix weight 0-D or None when the step has no prefix term) of `step`."""
        self.mtp.copy_(self.mtp_table[step])
        self.prefix.copy_(self.prefix_table[step])
        return self.mtp[: self.num_mtp[step]], self.prefix if self.prefix_on[step] else None


def format_stage_table(sched: TrainingSchedule, world_size: int = 8) -> str:
    """The stage table as text (what `python -m optim.schedule` prints)."""
    cfg = sched.cfg
    rows = [f"stage ends {sched.stage_ends}  total steps {sched.total_steps}  "
            f"(base {cfg.base_steps} + growth {cfg.growth_steps} + extension {cfg.extension_steps})",
            f"split step {sched.split_step}  cooldown from {sched.cooldown_start} to floor "
            f"{cfg.lr_floor}  rails engage at {cfg.rail_engage_step}  table events every 4th step "
            f"from {cfg.table_period4_step}",
            f"final validation windows (blocks of {cfg.block_size}) {sched.final_windows()}",
            *([f"switched off: {', '.join(sched.features.off())} (config.FeatureConfig)"] if sched.features.off() else []),
            *([f"past the record, on: {', '.join(sched.features.added())}"] if sched.features.added() else []),
            ""]
    header = (f"{'#':>2} {'steps':>11} {'batch':>8} {'/rank':>7} {'doc cap':>7} {'ws (s,l)':>9} "
              f"{'lr_mult start->end':>19}  {'MTP start -> end':<34} {'prefix':<22} P")
    rows += [header, "-" * len(header)]
    for span in sched.spans:
        s = span.stage
        last = span.end - 1
        p_changes = []
        for step in range(span.start, span.end):
            p = sched.softmax_p(step)
            if not p_changes or p_changes[-1][1] != p:
                p_changes.append((step, p))
        p_text = ", ".join(f"{p or 'full'}@{st}" for st, p in p_changes)
        mtp = f"{list(sched.mtp_weights(span.start))} -> {[round(w, 4) for w in sched.mtp_weights(last)]}"
        rows.append(f"{span.index:>2} {span.start:>5}-{last:<5} {s.batch_tokens:>8} "
                    f"{s.batch_tokens // world_size:>7} {s.doc_cap:>7} {str((s.ws_short, s.ws_long)):>9} "
                    f"{sched.lr_mult(span.start):>8.5f} ->{sched.lr_mult(last):>8.5f}  {mtp:<34} "
                    f"{str(s.prefix_weights if sched.features.prefix_loss else (0.0,)):<22} {p_text}")
    return "\n".join(rows)


def plot_schedule(sched: TrainingSchedule, path: str) -> None:
    """Per-step lr multiplier, rail beta, batch size and softmax P, written atomically to `path`."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = list(range(sched.total_steps))
    series = [("lr multiplier", [sched.lr_mult(s) for s in steps]),
              ("rail beta", [sched.rail_beta(s) for s in steps]),
              ("batch (global tokens)", [sched.batch_tokens(s) for s in steps]),
              ("sampled softmax P (0 = full)", [sched.softmax_p(s) for s in steps])]
    fig, axes = plt.subplots(len(series), 1, figsize=(9, 9), sharex=True)
    for ax, (title, ys) in zip(axes, series):
        ax.plot(steps, ys, drawstyle="steps-post")
        ax.set_ylabel(title, fontsize=8)
        for end in sched.stage_ends[1:-1]:
            ax.axvline(end, color="grey", linewidth=0.5, linestyle=":")
    axes[-1].set_xlabel("step")
    fig.tight_layout()
    directory = os.path.dirname(os.path.abspath(path))
    suffix = os.path.splitext(path)[1] or ".png"
    fd, tmp = tempfile.mkstemp(dir=directory, suffix=suffix)
    os.close(fd)
    try:
        fig.savefig(tmp)
        os.replace(tmp, path)
    finally:
        plt.close(fig)
        if os.path.exists(tmp):
            os.remove(tmp)


def main(argv: list[str] | None = None) -> int:
    from cli import (ArgumentParser, add_set_argument, check_preset, exit_on_config_error, positive_int,
                     preset_run_config)

    with exit_on_config_error("python -m optim.schedule"):
        parser = ArgumentParser(prog="python -m optim.schedule", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
        parser.add_argument("--config", default="record", help=f"one of {sorted(SCHEDULE_PRESETS)}")
        parser.add_argument("--plot", metavar="FILE.png", help="also draw lr, rail beta, batch and P by step")
        parser.add_argument("--world-size", type=positive_int, default=None,
                            help="ranks, for the per-rank batch column (default: the preset's: 8, smoke 2)")
        add_set_argument(parser)  # e.g. --set features.mtp=false, --set schedule.base_steps=600
        args = parser.parse_args(argv)
        check_preset(args.config, SCHEDULE_PRESETS)
        if args.plot and not os.path.isdir(os.path.dirname(os.path.abspath(args.plot))):
            raise ConfigError(f"--plot {args.plot}: its folder does not exist")
        cfg = preset_run_config(args.config, args.assignments)
        try:
            sched = TrainingSchedule(cfg.schedule, cfg.features)
        except ValueError as e:
            raise ConfigError(f"the schedule cannot be built: {e}") from None

    print(format_stage_table(sched, args.world_size or cfg.virtual_world_size))
    if args.plot:
        plot_schedule(sched, args.plot)
        print(f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
