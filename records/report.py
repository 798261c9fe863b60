"""Summarise runs.jsonl: is it a record, and is it faster than the baseline?

    python -m records.report [--runs FILE] [--group-by KEY] [--baseline VALUE] [--plot OUT.png]
        [--curves OUT.png|OUT.svg]

Per group (default key: config; any runs.jsonl field works, e.g. label or git_commit) of finished
runs: n, mean ± sample std of train time and of val loss, the one-sided t-test of the mean val loss
being below the 3.28 target (`scipy.stats.ttest_1samp(..., alternative='less')`; t is printed as the
margin (3.28 − mean)/(s/√n), positive when below, as upstream statistics.md does), and a Welch
t-test (two-sided) of each group against the baseline group on time and on loss, and the mean
tokens/s, MFU (model FLOPs over the time at the bf16 dense peak) and peak fraction (each kind at
its own peak) of the runs that logged them (runtime/throughput.py; "-" where none did). Printed as a
Markdown table. Without scipy the p-values are left out (the rest still prints); without
matplotlib --plot and --curves are skipped with a message. Malformed lines are reported with their
line number.

--curves draws the loss curves of the same runs, one colour per group, against step and against
training time (two panels): each run's training loss (runs.jsonl `train_curve`, the losses the run
read: runtime/loss_watch.py) as a solid line, and its val loss (the log's val_loss lines) as a dashed
line with markers where the run validated more than once; the 3.28 target as a black dashed line.
PNG or SVG, as the file's suffix says.
"""
from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

from records.run_log import parse_log
from records.runs_log import DEFAULT_RUNS_PATH, read_runs
from records.statistics import TARGET as TARGET_VAL_LOSS
from records.statistics import fmt_p, fmt_pm, mean_std, target_test, welch_p

def group_runs(runs: list[dict], key: str) -> dict[str, list[dict]]:
    groups: dict[str, list[dict]] = {}
    for run in runs:
        groups.setdefault(str(run.get(key, "")), []).append(run)
    return groups


@dataclass
class GroupStats:
    """One group's numbers, as the report table and records.certify's statistics.md print them."""

    n: int
    time_mean_s: float
    time_std_s: float  # nan with one run
    loss_mean: float
    loss_std: float
    t_margin: float  # (target − mean)/(s/√n): positive when below the target; nan under 2 runs
    df: int
    p_below_target: float | None  # one-sided; nan under 2 runs, None without scipy


@dataclass
class Comparison:
    """A group against the baseline: differences of the means and two-sided Welch p-values."""

    d_time_s: float
    p_time: float | None
    d_loss: float
    p_loss: float | None


def group_stats(losses: list[float], times_s: list[float], target: float = TARGET_VAL_LOSS) -> GroupStats:
    t_margin, df, p = target_test(losses, target)
    return GroupStats(len(losses), *mean_std(times_s), *mean_std(losses), t_margin, df, p)


def compare(losses: list[float], times_s: list[float], base_losses: list[float],
            base_times_s: list[float]) -> Comparison:
    return Comparison(statistics.fmean(times_s) - statistics.fmean(base_times_s), welch_p(times_s, base_times_s),
                      statistics.fmean(losses) - statistics.fmean(base_losses), welch_p(losses, base_losses))


def format_group_cells(g: GroupStats) -> list[str]:
    """n, time, loss, t, df, p: the report's formatting (records.certify prints the same cells)."""
    return [str(g.n), fmt_pm(g.time_mean_s, g.time_std_s, 3), fmt_pm(g.loss_mean, g.loss_std, 5),
            "n/a" if math.isnan(g.t_margin) else f"{g.t_margin:.2f}", str(g.df), fmt_p(g.p_below_target)]


def format_comparison_cells(c: Comparison) -> list[str]:
    return [f"{c.d_time_s:+.3f}", fmt_p(c.p_time), f"{c.d_loss:+.5f}", fmt_p(c.p_loss)]


def is_finished(run: dict) -> bool:
    """A run the statistics use: status finished, with a numeric val loss and train time."""
    return (run.get("status") == "finished" and isinstance(run.get("val_loss"), (int, float))
            and isinstance(run.get("train_time_ms"), (int, float)))


def _losses_times(runs: list[dict]) -> tuple[list[float], list[float]]:
    return [r["val_loss"] for r in runs], [r["train_time_ms"] / 1000 for r in runs]


def summary_table(groups: dict[str, list[dict]], key: str, baseline: str | None) -> str:
    base = groups.get(baseline) if baseline is not None else None
    header = [key, "n", "train time (s)", "val loss", f"t (below {TARGET_VAL_LOSS})", "df",
              f"p(loss < {TARGET_VAL_LOSS})"]
    if base is not None:
        header += ["Δ time (s)", "p time (Welch)", "Δ loss", "p loss (Welch)"]
    header += ["tokens/s", "MFU (bf16 peak)", "peak fraction"]
    rows = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for name, runs in groups.items():
        losses, times = _losses_times(runs)
        cells = [f"{name} (baseline)" if name == baseline else name] + format_group_cells(group_stats(losses, times))
        if base is not None and name == baseline:  # compared with itself: nothing to say
            cells += ["-"] * 4
        elif base is not None:
            cells += format_comparison_cells(compare(losses, times, *_losses_times(base)))
        cells += throughput_cells(runs)
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def throughput_cells(runs: list[dict]) -> list[str]:
    """Mean tokens/s, MFU and peak fraction of the runs that logged them (runtime/throughput.py; the last two
    need a known GPU): "-" where none did (older runs.jsonl lines, CPU runs)."""
    cells = []
    for field, fmt in (("tokens_per_s", "{:,.0f}"), ("mfu", "{:.1%}"), ("peak_fraction", "{:.1%}")):
        values = [r[field] for r in runs if isinstance(r.get(field), (int, float))]
        cells.append(fmt.format(statistics.fmean(values)) if values else "-")
    return cells


def plot_runs(groups: dict[str, list[dict]], out_path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curves = {}  # group -> [[(step, val_loss)] per run] from logs that validated more than once
    for name, runs in groups.items():
        for r in runs:
            log = Path(r.get("log_path") or "")
            if log.is_file():
                vals = parse_log(log.read_text(encoding="utf-8", errors="replace")).vals
                if len(vals) > 1:
                    curves.setdefault(name, []).append([(s, loss) for s, _, loss, _ in vals])
    ncols = 3 if curves else 2
    fig, axes = plt.subplots(1, ncols, figsize=(5.5 * ncols, 4.5))
    colors = {name: f"C{i % 10}" for i, name in enumerate(groups)}
    for name, runs in groups.items():
        idx = range(1, len(runs) + 1)
        axes[0].plot(idx, [r["val_loss"] for r in runs], "o", color=colors[name], label=f"{name} (n={len(runs)})")
        axes[1].plot(idx, [r["train_time_ms"] / 1000 for r in runs], "o", color=colors[name], label=name)
    axes[0].axhline(TARGET_VAL_LOSS, color="k", linestyle="--", linewidth=1, label=f"target {TARGET_VAL_LOSS}")
    axes[0].set(title="final val loss per run", xlabel="run # within group", ylabel="val loss")
    axes[1].set(title="train time per run", xlabel="run # within group", ylabel="train time (s)")
    if curves:
        for name, runs_points in curves.items():
            for i, points in enumerate(runs_points):
                axes[2].plot(*zip(*points), marker=".", linewidth=1, color=colors[name],
                             label=f"{name} ({len(runs_points)} runs)" if i == 0 else None)
        axes[2].axhline(TARGET_VAL_LOSS, color="k", linestyle="--", linewidth=1)
        axes[2].set(title="val loss curves (from logs)", xlabel="step", ylabel="val loss")
    from matplotlib.ticker import MaxNLocator

    for ax in axes[:2]:  # runs are counted: whole-number ticks
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    out_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_path.with_name(out_path.name + ".tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    tmp.replace(out_path)


CURVE_FORMATS = ("png", "svg")  # ours: what --curves writes, chosen by the file's suffix


@dataclass
class Curve:
    """One line of the curves figure: a run's training or validation loss."""

    group: str
    run_id: str
    kind: str  # "train" (runs.jsonl train_curve) or "val" (the log's val_loss lines)
    points: list[tuple[int, float, float]]  # (steps done, train_time_ms, loss)


def run_curves(groups: dict[str, list[dict]]) -> list[Curve]:
    """Every run's training curve (where its runs.jsonl line has one: lines older than the field have
    none) and validation curve (where its log holds more than one val_loss line), group by group."""
    curves = []
    for name, runs in groups.items():
        for r in runs:
            run_id = str(r.get("run_id", ""))
            train = r.get("train_curve")
            if isinstance(train, list) and train:
                curves.append(Curve(name, run_id, "train", [(int(s), float(ms), float(loss)) for s, ms, loss in train]))
            log = Path(r.get("log_path") or "")
            if log.is_file():
                vals = parse_log(log.read_text(encoding="utf-8", errors="replace")).vals
                if len(vals) > 1:
                    curves.append(Curve(name, run_id, "val", [(s, float(ms), loss) for s, _, loss, ms in vals]))
    return curves


def plot_curves(groups: dict[str, list[dict]], out_path: Path) -> dict[str, list[str]]:
    """Write the curves figure to out_path (PNG or SVG by its suffix; a temp file renamed into place,
    so a reader never sees half a picture). Returns what was drawn, read back from the figure: per
    panel (its x label), one `KIND RUN_ID` per loss line (the target line left out)."""
    fmt = out_path.suffix.lower().lstrip(".")
    if fmt not in CURVE_FORMATS:
        raise ValueError(f"--curves {out_path}: the suffix must be one of "
                         f"{', '.join('.' + f for f in CURVE_FORMATS)} (it picks the format)")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    curves = run_curves(groups)
    colors = {name: f"C{i % 10}" for i, name in enumerate(groups)}
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8))
    for ax, (xlabel, x_of) in zip(axes, (("step", lambda p: p[0]), ("training time (s)", lambda p: p[1] / 1000))):
        for c in curves:
            style = dict(linewidth=1.2) if c.kind == "train" else dict(linestyle="--", marker="o", markersize=3,
                                                                        linewidth=1)
            ax.plot([x_of(p) for p in c.points], [p[2] for p in c.points], color=colors[c.group],
                    gid=f"{c.kind} {c.run_id}", **style)
        ax.axhline(TARGET_VAL_LOSS, color="k", linestyle="--", linewidth=1, gid="target")
        ax.set(title=f"loss against {xlabel.split(' (')[0]}", xlabel=xlabel, ylabel="loss")
        ax.grid(alpha=0.3)
    counts = {name: len(runs) for name, runs in groups.items()}
    handles = [Line2D([], [], color=colors[name], label=f"{name} (n={counts[name]})") for name in groups]
    handles += [Line2D([], [], color="grey", label="training loss (read by the run)"),
                Line2D([], [], color="grey", linestyle="--", marker="o", markersize=3, label="val loss"),
                Line2D([], [], color="k", linestyle="--", linewidth=1, label=f"target {TARGET_VAL_LOSS}")]
    axes[1].legend(handles=handles, fontsize=7)
    if not curves:
        fig.suptitle("no run has a training curve (runs.jsonl train_curve) or more than one validation", fontsize=9)
    fig.tight_layout()
    drawn = {ax.get_xlabel(): [line.get_gid() for line in ax.get_lines() if line.get_gid() != "target"]
             for ax in axes}
    out_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_path.with_name(f".{out_path.name}.tmp{os.getpid()}")
    try:
        fig.savefig(tmp, format=fmt, dpi=110)
        tmp.replace(out_path)
    finally:
        plt.close(fig)
        tmp.unlink(missing_ok=True)
    return drawn


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m records.report", description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=Path, default=DEFAULT_RUNS_PATH, help="runs.jsonl to read")
    ap.add_argument("--group-by", default="config", help="runs.jsonl field to group by (config, label, git_commit, ...)")
    ap.add_argument("--baseline", default=None, help="the group value to compare every group against (Welch t-tests)")
    ap.add_argument("--plot", type=Path, default=None, help="write a PNG of val loss and train time per run")
    ap.add_argument("--curves", type=Path, default=None, metavar="OUT.png|OUT.svg",
                    help="write the loss curves (training, and val where a run validated more than once) "
                         "against step and training time, one colour per group")
    args = ap.parse_args(argv)
    if args.curves is not None and args.curves.suffix.lower().lstrip(".") not in CURVE_FORMATS:
        print(f"error: --curves {args.curves}: the suffix must be one of "
              f"{', '.join('.' + f for f in CURVE_FORMATS)} (it picks the format)", file=sys.stderr)
        return 2

    if not args.runs.is_file():
        print(f"error: runs file {args.runs} does not exist (runs append to it when they end)", file=sys.stderr)
        return 2
    runs, problems = read_runs(args.runs)
    for lineno, why in problems:
        print(f"warning: {args.runs}:{lineno}: skipped malformed line: {why}", file=sys.stderr)
    runs = [r for r in runs if r.get("kind") != "evaluation"]  # evaluate.py's score lines are not training runs
    finished = [r for r in runs if is_finished(r)]
    if len(finished) < len(runs):
        print(f"note: {len(runs) - len(finished)} run(s) not finished (failed, interrupted or without "
              f"val loss) are left out", file=sys.stderr)
    if not finished:
        print(f"no finished runs in {args.runs}")
        return 1
    groups = group_runs(finished, args.group_by)
    if args.baseline is not None and args.baseline not in groups:
        print(f"error: --baseline {args.baseline!r} is not a value of {args.group_by!r}; groups: "
              f"{', '.join(groups)}", file=sys.stderr)
        return 2
    try:
        import scipy  # noqa: F401
    except ImportError:
        print("note: scipy is not installed (pip install scipy): p-values are left out", file=sys.stderr)
    print(summary_table(groups, args.group_by, args.baseline))
    if args.plot is not None:
        try:
            plot_runs(groups, args.plot)
            print(f"plot written to {args.plot}")
        except ImportError:
            print("note: matplotlib is not installed (pip install matplotlib): no plot written", file=sys.stderr)
    if args.curves is not None:
        try:
            drawn = plot_curves(groups, args.curves)
        except ImportError:
            print("note: matplotlib is not installed (pip install matplotlib): no curves written", file=sys.stderr)
        else:
            lines = drawn["step"]
            print(f"curves written to {args.curves}: {sum(g.startswith('train') for g in lines)} training and "
                  f"{sum(g.startswith('val') for g in lines)} validation curve(s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
