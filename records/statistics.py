"""Recompute statistics.md's run table, statistics and verdict from the logs alone.

    python statistics.py        # in the certification folder; prints those sections of statistics.md

This file is records/statistics.py, copied verbatim into each certification folder by records/certify.py.
In the repository it is the one home of the speedrun's t-tests and of the validation line's pattern:
records/report.py, records/certify.py and records/run_log.py import them from here, so the folder's
script and the repository can never disagree.

runs.tsv says which log is which run (index, label, commit, status, run id, log); each run's result
is its log's last upstream validation line, `step:{s}/{N} val_loss:{:.4f} train_time:{ms}ms
step_avg:{:.2f}ms`. Checks that each log's `git commit:` line is the revision runs.tsv names, and
that a finished run has a validation line. Standard library only; scipy (if installed) for p-values.
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
LABELS = ("baseline", "candidate")
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
                   "val_loss": None, "train_time_ms": None}
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


def main():
    folder = _HERE
    rows, attempts, problems = read_rows(folder)
    per_group = sum(r["label"] == LABELS[0] for r in rows)
    groups, data, candidate = {}, {}, None
    for label in LABELS:
        mine = [r for r in rows if r["label"] == label]
        fin = [r for r in mine if r["status"] == "finished"]
        losses, times = [r["val_loss"] for r in fin], [r["train_time_ms"] / 1000 for r in fin]
        data[label] = (losses, times)
        failed = sum(r["status"] in ("failed", "interrupted") for r in mine)
        cells = None
        if fin:
            t, df, p = target_test(losses)
            if label == "candidate":
                candidate = (statistics.fmean(losses), p)
            cells = [str(len(fin)), fmt_pm(*mean_std(times), 3), fmt_pm(*mean_std(losses), 5),
                     "n/a" if math.isnan(t) else f"{t:.2f}", str(df), fmt_p(p)]
        groups[label] = (len(mine), len(fin), failed, cells)
    comparison_cells = time_test = None
    if data["baseline"][0] and data["candidate"][0]:
        (cl, ct), (bl, bt) = data["candidate"], data["baseline"]
        d_time, p_time = statistics.fmean(ct) - statistics.fmean(bt), welch_p(ct, bt)
        comparison_cells = [f"{d_time:+.3f}", fmt_p(p_time), f"{statistics.fmean(cl) - statistics.fmean(bl):+.5f}",
                            fmt_p(welch_p(cl, bl))]
        time_test = (d_time, p_time)
    print(render(rows, attempts, per_group, groups, comparison_cells, candidate, time_test))
    for p in problems:
        print(f"warning: {p}", file=sys.stderr)
    return 1 if problems else 0


def render(rows, attempts, per_group, groups, comparison_cells, candidate, time_test):
    """The run table, the statistics and the verdict, as statistics.md has them (records/certify.py
    renders statistics.md through this function too). rows, attempts: dicts with index (from 1),
    label, run_id, val_loss, train_time_ms, status, log; groups: label -> (planned, finished, failed,
    [n, time, loss, t, df, p] cells or None); comparison_cells: [Δ time, p, Δ loss, p] or None;
    candidate: (mean val loss, one-sided p) or None; time_test: (Δ time s, Welch p) or None."""
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
            f"group's finished runs; t = ({TARGET} − mean)/(s/√n), p one-sided (mean below {TARGET}).", "",
            f"| group | planned | finished | failed | n | train time (s) | val loss | t (below {TARGET}) | df "
            f"| p(loss < {TARGET}) |", "|---|---|---|---|---|---|---|---|---|---|"]
    for label in LABELS:
        planned, finished, failed, cells = groups[label]
        cells = cells or ["0", "-", "-", "-", "-", "-"]
        out.append(f"| {label} | {planned} | {finished} | {failed} | " + " | ".join(cells) + " |")
    if comparison_cells is not None:
        out += ["", "| comparison | Δ time (s) | p time (Welch) | Δ loss | p loss (Welch) |", "|---|---|---|---|---|",
                "| candidate − baseline | " + " | ".join(comparison_cells) + " |"]
    out += ["", "## Verdict", "",
            f"The bar (upstream's rules): every run counted ({per_group} per side, all finished: none "
            f"failed, none left out); the candidate's mean val loss below {TARGET} with one-sided "
            f"p < {P_LOSS_BAR}; the candidate faster than the baseline, timed on the same machine, interleaved: "
            f"lower mean train time with two-sided Welch p < {P_TIME_BAR}.", "",
            verdict(rows, candidate, time_test)]
    return "\n".join(out)


def verdict(rows, cand, cmp):
    """cand: (mean val loss, one-sided p) of the candidate; cmp: (Δ time s, Welch p) against the baseline."""
    pending = [r for r in rows if r["status"] == "pending"]
    if pending:
        return f"**INCOMPLETE**: {len(pending)} of {len(rows)} runs have not run (continue with --resume)."
    bad = [f"run {r['index']} ({r['label']}) {r['status']}" for r in rows if r["status"] != "finished"]
    if cand is None or cmp is None:
        return "**FAIL**: " + "; ".join(bad + ["a revision has no finished run"]) + "."
    (loss_mean, p_loss), (d_time, p_time) = cand, cmp
    if p_loss is None or p_time is None:
        return "**UNDECIDED**: scipy is not installed, so there are no p-values (pip install scipy)."
    reasons = list(bad)
    if not (loss_mean < TARGET and p_loss < P_LOSS_BAR):
        reasons.append(f"candidate val loss {loss_mean:.5f}, p = {fmt_p(p_loss)} "
                       f"(needs mean < {TARGET} at p < {P_LOSS_BAR})")
    if not (d_time < 0 and p_time < P_TIME_BAR):
        reasons.append(f"candidate time {d_time:+.3f} s vs baseline, Welch p = {fmt_p(p_time)} "
                       f"(needs faster at p < {P_TIME_BAR})")
    if reasons:
        return "**FAIL**: " + "; ".join(reasons) + "."
    return (f"**PASS**: every run finished; candidate val loss {loss_mean:.5f} < {TARGET} (p = {fmt_p(p_loss)}); "
            f"{-d_time:.3f} s faster than the baseline (Welch p = {fmt_p(p_time)}).")


if __name__ == "__main__":
    sys.exit(main())
