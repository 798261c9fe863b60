"""Recompute statistics.md's run table, statistics and verdict from the logs alone.

    python statistics.py        # in the certification folder; prints those sections of statistics.md

This file is records/statistics.py, copied verbatim into each certification folder by records/certify.py.
In the repository it is the one home of the speedrun's t-tests and of the validation line's pattern:
records/report.py, records/certify.py and records/run_log.py import them from here, so the folder's
script and the repository can never disagree.

runs.tsv says which log is which run (index, label, commit, status, run id, log, and a step sweep's
--steps); each run's result is its log's last upstream validation line, `step:{s}/{N}
val_loss:{:.4f} train_time:{ms}ms step_avg:{:.2f}ms`. A side is a label: the baseline, and every
other label in the order runs.tsv first lists it, each with its statistics, its Welch tests against
the baseline and its verdict; for a step sweep, the fewest steps whose runs meet upstream's loss bar.
Checks that each log's `git commit:` line is the revision runs.tsv names, and that a finished run
has a validation line. Standard library only; scipy (if installed) for p-values.
"""
import sys
from pathlib import Path

# this file is named statistics.py: keep its folder off the path so `import statistics` is the stdlib's
# (imported as records.statistics, the path is left alone)
if __name__ == "__main__":
    _HERE = Path(__file__).resolve().parent
    sys.path = [p for p in sys.path if Path(p or ".").resolve() != _HERE]

import csv  # noqa: E402
import math  # noqa: E402
import re  # noqa: E402
import statistics  # noqa: E402

TARGET = 3.28  # the speedrun's target (track 1: val loss <= 3.28 on FineWeb)
P_LOSS_BAR = 0.01  # upstream: mean val loss below 3.28 at p < 0.01 (one-sided t-test)
P_TIME_BAR = 0.05  # faster than the baseline: mean time lower, two-sided Welch p < 0.05
BASELINE = "baseline"  # the side every other side is measured against
# the upstream validation line, as records/run_log.py writes and parses it
VAL_RE = re.compile(r"^step:(\d+)/(\d+) val_loss:([0-9.naif+-]+) train_time:(\d+)ms step_avg:([0-9.]+)ms$")
COMMIT_RE = re.compile(r"^git commit: (\S+)")



def _scipy_stats():
    """scipy.stats, or None: the p-values need it, nothing else does (imported when first asked)."""
    try:
        from scipy import stats
    except ImportError:
        return None
    return stats


def mean_std(v):
    return statistics.fmean(v), (statistics.stdev(v) if len(v) > 1 else math.nan)


def fmt_pm(mean, std, digits):
    return f"{mean:.{digits}f} ± {std:.{digits}f}" if not math.isnan(std) else f"{mean:.{digits}f}"


def fmt_p(p):
    if p is None:
        return "needs scipy"
    return "n/a" if math.isnan(p) else f"{p:.2e}"


def target_test(losses, target=TARGET):
    """(t margin below target, degrees of freedom, one-sided p or None without scipy): t is printed as
    (target − mean)/(s/√n), positive when below, as upstream statistics.md does."""
    n = len(losses)
    if n < 2:
        return math.nan, 0, math.nan
    mean, std = mean_std(losses)
    t = (target - mean) / (std / math.sqrt(n)) if std > 0 else math.inf
    stats = _scipy_stats()
    if stats is None:
        return t, n - 1, None
    return t, n - 1, float(stats.ttest_1samp(losses, target, alternative="less").pvalue)


def welch_p(a, b):
    """Two-sided Welch p of mean(a) != mean(b); nan when a side has fewer than 2 runs, None without scipy."""
    if len(a) < 2 or len(b) < 2:
        return math.nan
    stats = _scipy_stats()
    if stats is None:
        return None
    return float(stats.ttest_ind(a, b, equal_var=False).pvalue)


def read_rows(folder):
    rows, attempts, problems = [], [], []
    with open(folder / "runs.tsv", encoding="utf-8", newline="") as f:
        for r in csv.DictReader(f, delimiter="\t"):
            row = {"index": int(r["index"]), "label": r["label"], "status": r["status"],
                   "run_id": None if r["run_id"] == "-" else r["run_id"], "log": None if r["log"] == "-" else r["log"],
                   "val_loss": None, "train_time_ms": None,
                   # a step sweep's --steps N (a column since many sides; "-" for a side of its own arguments)
                   "steps": int(r["steps"]) if (r.get("steps") or "-") != "-" else None}
            if row["log"]:
                lines = (folder / row["log"]).read_text(encoding="utf-8", errors="replace").splitlines()
                vals = [m for m in map(VAL_RE.match, lines) if m]
                commits = [m[1] for m in map(COMMIT_RE.match, lines) if m]
                if commits and commits[0] != r["commit"]:
                    problems.append(f"run {row['index']}: log {row['log']} is from commit {commits[0]}, "
                                    f"runs.tsv says {r['commit']}")
                if row["status"] == "finished":
                    if vals:
                        row["val_loss"], row["train_time_ms"] = float(vals[-1][3]), int(vals[-1][4])
                    else:
                        problems.append(f"run {row['index']}: runs.tsv says finished, but {row['log']} has no "
                                        f"val_loss line: counted as failed")
                        row["status"] = "failed"
            (attempts if row["status"] == "interrupted" and _is_attempt(rows, row) else rows).append(row)
    return rows, attempts, problems


def _is_attempt(rows, row):  # an interrupted run that was rerun: its index is already in the table
    return any(r["index"] == row["index"] for r in rows)


def dash(x, fmt):
    return "-" if x is None else format(x, fmt)


def _finished(rows, label):
    """(val losses, train times in s) of a side's finished runs."""
    fin = [r for r in rows if r["label"] == label and r["status"] == "finished"]
    return [r["val_loss"] for r in fin], [r["train_time_ms"] / 1000 for r in fin]


def main():
    folder = _HERE
    rows, attempts, problems = read_rows(folder)
    per_group = sum(r["label"] == BASELINE for r in rows)
    base_losses, base_times = _finished(rows, BASELINE)
    sides = []
    for label in dict.fromkeys(r["label"] for r in rows):  # the sides, in the order they first ran
        mine = [r for r in rows if r["label"] == label]
        losses, times = _finished(rows, label)
        side = {"label": label, "steps": mine[0]["steps"], "planned": len(mine), "finished": len(losses),
                "failed": sum(r["status"] in ("failed", "interrupted") for r in mine), "cells": None, "loss": None,
                "comparison": None, "time": None}
        if losses:
            t, df, p = target_test(losses)
            side["cells"] = [str(len(losses)), fmt_pm(*mean_std(times), 3), fmt_pm(*mean_std(losses), 5),
                             "n/a" if math.isnan(t) else f"{t:.2f}", str(df), fmt_p(p)]
            side["loss"] = (statistics.fmean(losses), p)
            if label != BASELINE and base_losses:
                d_time, p_time = statistics.fmean(times) - statistics.fmean(base_times), welch_p(times, base_times)
                side["comparison"] = [f"{d_time:+.3f}", fmt_p(p_time),
                                      f"{statistics.fmean(losses) - statistics.fmean(base_losses):+.5f}",
                                      fmt_p(welch_p(losses, base_losses))]
                side["time"] = (d_time, p_time)
        sides.append(side)
    print(render(rows, attempts, per_group, sides))
    for p in problems:
        print(f"warning: {p}", file=sys.stderr)
    return 1 if problems else 0


def render(rows, attempts, per_group, sides):
    """The run table, the statistics, the verdicts and (for a step sweep) the fewest steps, as
    statistics.md has them (records/certify.py renders statistics.md through this function too).
    rows, attempts: dicts with index (from 1), label, run_id, val_loss, train_time_ms, status, log;
    sides, in run order, the baseline first: dicts with label, steps (the sweep's --steps, or None),
    planned, finished, failed, cells ([n, time, loss, t, df, p] or None), loss ((mean val loss,
    one-sided p) or None), comparison ([Δ time, p, Δ loss, p] against the baseline, or None) and time
    ((Δ time s, Welch p) or None)."""
    out = ["## Runs, in the order they ran", "",
           "| # | label | run id | val loss | train time (ms) | status |", "|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['index']} | {r['label']} | {r.get('run_id') or '-'} | {dash(r['val_loss'], '.4f')} "
                   f"| {dash(r['train_time_ms'], '.0f')} | {r['status']} |")
    if attempts:
        out += ["", "Interrupted by the operator (Ctrl-C) and rerun; kept, not used in the statistics:", ""]
        out += [f"- run {a['index']} ({a['label']}): {a.get('log') or 'no log'}" for a in attempts]
    out += ["", "## Statistics", "",
            f"Val loss and train time as the logs print them (4 decimals, whole ms); mean ± sample std over each "
            f"side's finished runs; t = ({TARGET} − mean)/(s/√n), p one-sided (mean below {TARGET}).", "",
            f"| side | planned | finished | failed | n | train time (s) | val loss | t (below {TARGET}) | df "
            f"| p(loss < {TARGET}) |", "|---|---|---|---|---|---|---|---|---|---|"]
    for s in sides:
        cells = s["cells"] or ["0", "-", "-", "-", "-", "-"]
        out.append(f"| {s['label']} | {s['planned']} | {s['finished']} | {s['failed']} | " + " | ".join(cells) + " |")
    compared = [s for s in sides if s["comparison"] is not None]
    if compared:
        out += ["", "| comparison | Δ time (s) | p time (Welch) | Δ loss | p loss (Welch) |", "|---|---|---|---|---|"]
        out += [f"| {s['label']} − {BASELINE} | " + " | ".join(s["comparison"]) + " |" for s in compared]
    pending = [r for r in rows if r["status"] == "pending"]
    out += ["", "## Verdict", "",
            f"The bar (upstream's rules), each side against the baseline: every run counted ({per_group} per "
            f"side; the side's and the baseline's all finished: none failed, none left out); the side's mean val "
            f"loss below {TARGET} with one-sided p < {P_LOSS_BAR}; the side faster than the baseline, timed on "
            f"the same machine, interleaved: lower mean train time with two-sided Welch p < {P_TIME_BAR}."
            + (" Each side is judged alone, with no correction for the number of sides: the more sides, the "
               "likelier one passes by chance." if len(sides) > 2 else ""), ""]
    if pending:
        out.append(incomplete(rows, pending))
    else:
        out += [f"- {s['label']}: {side_verdict(rows, s)}" for s in sides if s["label"] != BASELINE]
    if any(s["steps"] is not None for s in sides):
        out += step_sweep(rows, sides, pending)
    return "\n".join(out)


def incomplete(rows, pending):
    return f"**INCOMPLETE**: {len(pending)} of {len(rows)} runs have not run (continue with --resume)."


def meets_loss_bar(loss):
    """loss: (mean val loss, one-sided p) of a side: upstream's bar, mean below TARGET at p < P_LOSS_BAR."""
    mean, p = loss
    return mean < TARGET and p < P_LOSS_BAR  # p nan (one finished run) never passes


def side_verdict(rows, side):
    """A side against the baseline: its runs and the baseline's all finished, its mean val loss below
    TARGET at one-sided p < P_LOSS_BAR, and faster than the baseline at two-sided Welch p < P_TIME_BAR."""
    label = side["label"]
    bad = [f"run {r['index']} ({r['label']}) {r['status']}" for r in rows
           if r["label"] in (label, BASELINE) and r["status"] != "finished"]
    if side["loss"] is None or side["time"] is None:
        empty = label if side["loss"] is None else BASELINE
        return "**FAIL**: " + "; ".join(bad + [f"{empty} has no finished run"]) + "."
    (loss_mean, p_loss), (d_time, p_time) = side["loss"], side["time"]
    if p_loss is None or p_time is None:
        return "**UNDECIDED**: scipy is not installed, so there are no p-values (pip install scipy)."
    reasons = list(bad)
    if not meets_loss_bar(side["loss"]):
        reasons.append(f"val loss {loss_mean:.5f}, p = {fmt_p(p_loss)} (needs mean < {TARGET} at p < {P_LOSS_BAR})")
    if not (d_time < 0 and p_time < P_TIME_BAR):
        reasons.append(f"time {d_time:+.3f} s vs baseline, Welch p = {fmt_p(p_time)} "
                       f"(needs faster at p < {P_TIME_BAR})")
    if reasons:
        return "**FAIL**: " + "; ".join(reasons) + "."
    return (f"**PASS**: every run finished; val loss {loss_mean:.5f} < {TARGET} (p = {fmt_p(p_loss)}); "
            f"{-d_time:.3f} s faster than the baseline (Welch p = {fmt_p(p_time)}).")


def step_sweep(rows, sides, pending):
    """The step sweep's section: each step count against upstream's loss bar, and the fewest that meets it."""
    swept = sorted((s for s in sides if s["steps"] is not None), key=lambda s: s["steps"])
    out = ["", "## Step sweep", "",
           f"Each step count (train_gpt.py --steps N: schedule.base_steps, from which the stage ends are built) is "
           f"a side of its own. A step count meets the bar when every one of its runs finished and their mean val "
           f"loss is below {TARGET} with one-sided p < {P_LOSS_BAR}, upstream's loss bar (its time against the "
           f"baseline: the verdict above).", "",
           f"| steps | side | finished | val loss | p(loss < {TARGET}) | meets the bar |", "|---|---|---|---|---|---|"]
    undecided = any(s["loss"] is not None and s["loss"][1] is None for s in swept)
    met = {}
    for s in swept:
        met[s["label"]] = (not undecided and s["loss"] is not None and s["finished"] == s["planned"]
                           and meets_loss_bar(s["loss"]))
        cells = s["cells"] or ["0", "-", "-", "-", "-", "-"]
        out.append(f"| {s['steps']} | {s['label']} | {s['finished']}/{s['planned']} | {cells[2]} | {cells[5]} "
                   f"| {'-' if pending or undecided else ('yes' if met[s['label']] else 'no')} |")
    out.append("")
    if pending:
        out.append(f"**Fewest steps**: not known yet: {incomplete(rows, pending)[len('**INCOMPLETE**: '):]}")
    elif undecided:
        out.append("**Fewest steps**: undecided: scipy is not installed, so there are no p-values (pip install scipy).")
    elif not any(met.values()):
        out.append(f"**No step count met the bar**: none of {', '.join(str(s['steps']) for s in swept)} steps had "
                   f"every run finished and a mean val loss below {TARGET} at p < {P_LOSS_BAR}.")
    else:
        best = next(s for s in swept if met[s["label"]])
        runs = [str(r["index"]) for r in rows if r["label"] == best["label"]]
        line = (f"**Fewest steps that meet the bar: {best['steps']}** ({best['label']}: runs {', '.join(runs)}; "
                f"mean val loss {best['loss'][0]:.5f} < {TARGET}, p = {fmt_p(best['loss'][1])}).")
        worse = [str(s["steps"]) for s in swept if s["steps"] > best["steps"] and not met[s["label"]]]
        if worse:  # not monotone: a noisy bar, or too few runs
            line += f" More steps did not always meet it: {', '.join(worse)} did not."
        out.append(line)
    return out


if __name__ == "__main__":
    sys.exit(main())
