"""Record #360's measured time per schedule stretch, from its published training log.

    from tools.record_timing import RECORD_360
    RECORD_360.ms_per_step   # (16.92, 30.24, 44.87, 47.92, 46.91, 22.55): steps 0-319, 320-680, ..., 1174-1193

A record's log prints `step:N/1194 train_time:Tms` every 25 steps (N steps done, the clock's total so
far; `step_avg` on the same line is T/N, a running mean, not a stretch's time). `stretch_times` turns
such a series into each stretch's mean ms/step, and RECORD_360 holds what it gives on record #360's log
(the numbers only; provenance there). tools/cost.py holds them against the fused floor per stretch (a
measured/floor ratio each) and prices a change as the record's time plus the floor's change, per stretch.
"""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class StretchTimes:
    """A run's training clock split by schedule stretch: the steady ms/step of each stretch and the one-off
    costs on the clock that no step count scales (a prediction adds them once)."""
    steps: tuple[int, ...]          # steps in each stretch
    ms_per_step: tuple[float, ...]  # each stretch's mean, the one-off costs taken out
    start_ms: float                 # on the clock before the first steps run at their rate
    end_ms: float                   # on the clock after the last step's line (the final line's past it)

    @property
    def stretch_ms(self) -> tuple[float, ...]:
        return tuple(n * ms for n, ms in zip(self.steps, self.ms_per_step))

    @property
    def total_ms(self) -> float:
        return sum(self.stretch_ms) + self.start_ms + self.end_ms


def _steps_in(a: int, b: int, ends: list[int]) -> list[int]:
    """Steps done in (a, b] that fall in each stretch (ends[k], ends[k + 1]]."""
    return [max(0, min(b, hi) - max(a, lo)) for lo, hi in zip(ends, ends[1:])]


def interior_rates(points: list[tuple[int, float]], ends: list[int]) -> list[float]:
    """Each stretch's steady ms/step: the train_time slope between the first and last logged points inside
    it (ends[k] ≤ N ≤ ends[k + 1]; N = 0 is not logged: the clock's first interval holds the start)."""
    rates = []
    for k, (lo, hi) in enumerate(zip(ends, ends[1:])):
        inside = [(n, t) for n, t in points if lo <= n <= hi and n > 0]
        if len(inside) < 2:
            raise ValueError(f"stretch {k} (steps {lo}-{hi - 1}) holds {len(inside)} logged point(s): "
                             f"its rate needs two")
        (n0, t0), (n1, t1) = inside[0], inside[-1]
        rates.append((t1 - t0) / (n1 - n0))
    return rates


def stretch_times(points: list[tuple[int, float]], ends: list[int], final_ms: float) -> StretchTimes:
    """A log's (steps done, train_time ms) series, the clock at 0 with no step done, split by the stretches
    ending at `ends` (steps done: [0, ..., total]); `final_ms`: the final line's train_time, which holds
    the end-of-run work after the last step.

    The log's lines rarely fall on a stretch's end: the time of an interval between two lines that crosses
    one is split in proportion to each side's steps × its stretch's steady rate (`interior_rates`), so the
    rates' ratio inside the interval is the stretches' own. The first interval's excess over its stretch's
    rate is the run's start (first batch, shard loading, tables built on the clock), and the final line's
    time past the last step's the end: both kept apart, once. Every millisecond of `final_ms` lands in
    exactly one place: total_ms == final_ms."""
    rates = interior_rates(points, ends)
    if points[-1][0] != ends[-1]:
        raise ValueError(f"the series ends at step {points[-1][0]}, the stretches at {ends[-1]}")
    spent = [0.0] * len(rates)
    start_ms, done, clock = 0.0, 0, 0.0
    for n, t in points:
        steps = _steps_in(done, n, ends)
        weights = [s * r for s, r in zip(steps, rates)]
        elapsed = t - clock
        if done == 0:  # the clock's first interval: what its steps' rates leave over is the start
            start_ms = elapsed - sum(weights)
            elapsed -= start_ms
        for k, w in enumerate(weights):
            spent[k] += elapsed * w / sum(weights)
        done, clock = n, t
    steps = tuple(b - a for a, b in zip(ends, ends[1:]))
    return StretchTimes(steps, tuple(ms / n for ms, n in zip(spent, steps)), start_ms, final_ms - clock)


# Record #360 (upstream PR #360, "ANVIL2"; README record #92): the run log
# records/track_1_short/2026-08-30_ANVIL2/this_pr/32a48562-f576-4d46-87cf-de771d1b3bf2.txt of
# KellerJordan/modded-nanogpt at commit fd1b14a5245fc39022220c16c51c50e57f1d31e7 (the record's shipped
# example log: 1194 steps, val_loss 3.2774, final train_time 39,846 ms; 8×H100 80GB HBM3, torch
# 2.10.0+cu128). Its 49 step lines' train_time (every 25 steps to 1175, then 1193 and 1194 at 39,625 ms)
# and the final line's through `stretch_times`, over tools.cost.stretches of the record's schedule (steps
# done [0, 320, 681, 965, 1107, 1174, 1194]), rounded to 0.1 µs (their total: 39,846.004 ms). The steady
# rates inside the stretches (`interior_rates`, over steps done 25-300, 325-675, 700-950, 975-1100,
# 1125-1150, 1175-1194) are 16.985, 30.280, 44.932, 47.920, 46.520 and 22.526 ms/step; the means below
# differ by what the crossing intervals held (1150-1175 took 1,167 ms where the two rates give 1,139).
# start_ms: the first 25 steps took 574 ms, 149.4 more than 25 × 16.985; end_ms: 39,846 − 39,625, the
# terminal tail-average ships, on the clock. One run, not the certification pool's mean (18 runs: 39.914
# ± 0.120 s).
RECORD_360 = StretchTimes(
    steps=(320, 361, 284, 142, 67, 20),
    ms_per_step=(16.9204, 30.2434, 44.8728, 47.9246, 46.9104, 22.5540),
    start_ms=149.3636,
    end_ms=221.0,
)
