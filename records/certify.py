"""Certify a change: interleaved runs of a baseline and one or more sides on one machine, every run counted.

    python -m records.certify [--baseline REV] [--candidate REV] --runs N [--nproc P] [--name NAME]
        [--baseline-args ARGS] [--candidate-args ARGS] [--baseline-env NAME=VALUE]...
        [--candidate-env NAME=VALUE]... [--side NAME [--side-rev NAME=REV] [--side-args NAME=ARGS]
        [--side-env NAME=VAR=VALUE]...]... [--steps-sweep N1,N2,...] [--out DIR] [--resume] [--dry-run]
        -- TRAIN_GPT_ARGS...

Each side is a revision (default HEAD), train_gpt.py arguments of its own (`--candidate-args "--set
features.ngram=false"`: split like a shell line, appended after TRAIN_GPT_ARGS, so a side's flag
wins over a shared one) and environment variables of its own (`--candidate-env
SPEEDRUN_CUDA_GRAPHS=0`, repeatable, set over certify's environment). So an ablation is one command
on one revision:
`python -m records.certify --runs 5 --candidate-args "--set features.ngram=false" -- --data-path D`.

The baseline is every other side's reference. Besides the candidate, `--side NAME` (repeatable)
adds a side labelled NAME, with `--side-rev NAME=REV`, `--side-args NAME=ARGS` and `--side-env
NAME=VAR=VALUE` for its revision, arguments and environment; with --side, the candidate runs only
where a --candidate flag names it. `--steps-sweep N1,N2,...` runs the candidate at each base step
count instead (train_gpt.py --steps N, which sets schedule.base_steps: the stage ends are built
from it), each count a side labelled stepsN, and the write-up names the fewest steps whose runs
meet upstream's loss bar. Two sides that are the same (revision, arguments and the environment
their runs see) are refused, naming both: nothing to compare.

Upstream's bar for a record is many independent runs whose mean val loss is below 3.28 at p < 0.01,
and a time comparison against the baseline on the same machine. Done by hand it goes wrong in known
ways: same-seed repeats passed off as independent runs, the baseline timed on another node, failed
runs quietly left out. This runs the experiment the way upstream PR #366 did (12 + 12 runs,
interleaved on one node):

  * one detached `git worktree` per side, in a temporary folder outside the checkout (removed
    at the end, also after an error or Ctrl-C); every side reads the same shards (`--data-path`
    made absolute against the current folder; a certification without --data-path or DATA_PATH
    is refused, since the preset's default folder is git-ignored and so absent from a worktree);
  * runs interleaved round-robin, baseline, side 1, side 2, ..., baseline, ... (N of each), each
    `SIDE_ENV python -m torch.distributed.run --standalone --nproc_per_node=P train_gpt.py
    TRAIN_GPT_ARGS SIDE_ARGS --label SIDE --records-dir DIR` inside its side's worktree, so every
    run lands in DIR/runs.jsonl (`label` names its side, `overrides` holds the --set flags it ran
    with) and DIR/logs/;
  * unseeded: `--seed` in TRAIN_GPT_ARGS or a side's args (TRAIN_SEED in the environment or a
    side's) is refused, because runs from one seed repeat one initialization and are not
    independent samples;
  * every run is kept: a failed run is counted as failed; a run that dies before writing its log
    keeps its console output as its log (DIR/logs/certify-NN-LABEL.txt); each run's console
    output is also kept under DIR/console/;
  * the ledger DIR/certify.json (written atomically) holds the plan (revisions resolved to
    commits, each side's arguments and environment, the order) and each run's outcome. Ctrl-C
    stops after recording the run it interrupted; `--resume` reruns that run (the interrupted
    attempt stays listed in the write-up, with its log) and continues, and refuses a plan that
    differs from the ledger's.

At the end it writes DIR/statistics.md (each side's revision, arguments and environment, the
machine, run order, each side's statistics from records.report, its Welch tests against the
baseline and its verdict against upstream's bar; for a sweep, the fewest steps), DIR/runs.tsv
(which log is which run), DIR/statistics.py (recomputes statistics.md's run table, statistics,
verdicts and fewest steps from the logs and runs.tsv alone: standard library, scipy for the
p-values), DIR/curves.png (the finished runs' loss curves, one colour per side: records.report
--curves; shown in statistics.md and README.md) and DIR/README.md (the skeleton of an upstream
write-up with the commands to reproduce). `--dry-run` prints every run's command and folder, in
the order they would run, and runs nothing.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from cli import ArgumentParser, exit_on_config_error
from records import report
from records import statistics as statistics_page  # the folder's statistics.py, and statistics.md's layout
from records.run_log import parse_log
from records.runs_log import read_runs
from records.statistics import BASELINE
LEDGER_NAME = "certify.json"
ORDER_NAME = "runs.tsv"
LEDGER_VERSION = 2  # 2: plan["sides"], any number of them (1: plan["baseline"], plan["candidate"])
TSV_COLUMNS = ("index", "label", "commit", "status", "run_id", "log", "steps")
CURVES_NAME = "curves.png"  # ours: the write-up's picture of the runs' loss curves
README_PLACEHOLDER = "**The change.** (describe it; link the upstream PR)"


class CertifyError(Exception):
    """A certification that cannot start or continue; the message says which flag or file and why."""


# ------------------------------------------------------------------------------------------------
# git
# ------------------------------------------------------------------------------------------------


def git(args: list[str], cwd: Path) -> str:
    res = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True)
    if res.returncode != 0:
        raise CertifyError(f"git {' '.join(args)} (in {cwd}) failed: {res.stderr.strip()}")
    return res.stdout.strip()


def resolve_revision(repo: Path, rev: str, what: str) -> dict:
    """rev's commit and subject; `what` names the flag that gave it in the refusal (--baseline 'main')."""
    try:
        commit = git(["rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}"], repo)
    except CertifyError:
        commit = ""
    if not commit:
        raise CertifyError(f"{what} is not a commit of the repository at {repo} (expected a branch, "
                           f"tag, commit hash or HEAD~k)")
    return {"rev": rev, "commit": commit, "subject": git(["log", "-1", "--format=%s", commit], repo)}


# ------------------------------------------------------------------------------------------------
# the launcher (module-level so tests can replace it)
# ------------------------------------------------------------------------------------------------


def launcher_command(nproc: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]


def run_process(cmd: list[str], cwd: Path, env: dict, out_path: Path) -> int:
    """Run `cmd` in `cwd`, stdout and stderr into `out_path`; its exit code. Ctrl-C waits for it to end."""
    with open(out_path, "wb") as out:
        # its own process group: a Ctrl-C reaches certify only, which passes it on exactly once (a second
        # SIGINT would cut torchrun's shutdown short, before the run writes its runs.jsonl line)
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            return proc.wait()
        except KeyboardInterrupt:
            try:
                os.killpg(proc.pid, signal.SIGINT)  # torchrun and its ranks, as a terminal's Ctrl-C would
            except ProcessLookupError:
                pass
            try:
                proc.wait(timeout=60)  # let torchrun stop its ranks and the run write its line
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            raise


# ------------------------------------------------------------------------------------------------
# the plan
# ------------------------------------------------------------------------------------------------


ENV_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# a side's name labels its runs (runs.jsonl, the tables) and names its files (worktree, console/NN-NAME.txt)
SIDE_NAME_RE = re.compile(r"[A-Za-z][A-Za-z0-9._-]{0,39}")
# what no side may set in its own environment: the seed (not independent runs), the shards (every side
# reads the same ones: --data-path once, after `--`)
SIDE_ENV_FORBIDDEN = ("TRAIN_SEED", "DATA_PATH")


def _spells(arg: str, flag: str) -> bool:
    """Whether `arg` is `flag` (or `flag=VALUE`) to train_gpt.py, whose argparse also takes a flag's
    abbreviation (--see 1 is --seed 1)."""
    name = arg.split("=", 1)[0]
    return name.startswith("--") and len(name) > 2 and flag.startswith(name)


def _refuse_certify_flags(args: list[str], where: str) -> None:
    """Refuses, in TRAIN_GPT_ARGS or a side's args, the flags certify sets itself or forbids."""
    for arg in args:
        for flag in ("--label", "--records-dir"):
            if _spells(arg, flag):
                raise CertifyError(f"{where} must not hold {arg.split('=', 1)[0]} ({flag}): certify sets it for "
                                   f"every run (--label SIDE, --records-dir --out DIR)")
        if _spells(arg, "--seed"):
            raise CertifyError(f"{where} must not hold {arg.split('=', 1)[0]} (--seed): runs from one seed repeat "
                               f"one initialization, so they are not independent runs and their p-values mean "
                               f"nothing; certify runs unseeded, as upstream's record runs are")


def refuse_steps(args: list[str], where: str) -> None:
    """With --steps-sweep, which gives each side `--steps N`: refuses a step count of the user's own, which
    would fight it (train_gpt.py applies --set after --steps, so `--set schedule.base_steps` would win)."""
    for i, arg in enumerate(args):
        if _spells(arg, "--steps"):
            raise CertifyError(f"{where} must not hold {arg.split('=', 1)[0]} (--steps) with --steps-sweep: the "
                               f"sweep gives each of its sides --steps N")
        value = arg.split("=", 1)[1] if arg.startswith("--set=") else (
            args[i + 1] if arg == "--set" and i + 1 < len(args) else "")
        if value.split("=", 1)[0].strip() == "schedule.base_steps":
            raise CertifyError(f"{where} must not hold --set {value} with --steps-sweep: the sweep gives each of "
                               f"its sides --steps N, and train_gpt.py applies --set after --steps, so it would "
                               f"run every side at one step count")


def check_train_args(train_args: list[str], cwd: Path, env: dict) -> list[str]:
    """TRAIN_GPT_ARGS with --data-path made absolute; refuses what certify sets or forbids."""
    _refuse_certify_flags(train_args, "TRAIN_GPT_ARGS")
    out, i, data_path = [], 0, None
    while i < len(train_args):
        arg = train_args[i]
        if _spells(arg, "--data-path"):
            if "=" in arg:
                value = arg.split("=", 1)[1]
            elif i + 1 < len(train_args):
                i += 1
                value = train_args[i]
            else:
                raise CertifyError("--data-path in TRAIN_GPT_ARGS needs a folder")
            data_path = str((cwd / value).resolve()) if not Path(value).is_absolute() else value
            out += ["--data-path", data_path]
        else:
            out.append(arg)
        i += 1
    if env.get("TRAIN_SEED"):
        raise CertifyError("TRAIN_SEED is set in the environment: every run would repeat one seed, so the runs "
                           "would not be independent; unset it (certify runs unseeded)")
    if data_path is None:
        if not env.get("DATA_PATH"):
            raise CertifyError("pass --data-path DIR after `--` (or set DATA_PATH): the presets' default shard "
                               "folders are git-ignored, so a fresh worktree of a revision has none, and every "
                               "side must read the same shards")
        out += ["--data-path", str((cwd / env["DATA_PATH"]).resolve())]
    if not Path(out[out.index("--data-path") + 1]).is_dir():
        raise CertifyError(f"--data-path {out[out.index('--data-path') + 1]} is not a folder (expected the "
                           f"folder holding the train and val shards)")
    return out


def check_side(spec: dict) -> None:
    """Refuses what a side's own arguments and environment must not set (spec: as side_specs makes it)."""
    _refuse_certify_flags(spec["args"], spec["args_flag"])
    for arg in spec["args"]:
        if _spells(arg, "--data-path"):
            raise CertifyError(f"{spec['args_flag']} must not hold {arg.split('=', 1)[0]} (--data-path): every "
                               f"side reads the same shards; give --data-path once, after `--`")
    for name in SIDE_ENV_FORBIDDEN:
        if name in spec["env"]:
            raise CertifyError(f"{spec['env_flag']}{name}=...: a side must not set {name} "
                               + ("(one seed: the runs would not be independent; certify runs unseeded)"
                                  if name == "TRAIN_SEED" else
                                  "(every side reads the same shards: --data-path once, after `--`)"))


def side_words(side: dict) -> list[str]:
    """A side's own environment and arguments, as a shell line has them: NAME=VALUE ... ARGS ..."""
    return [f"{k}={v}" for k, v in side["env"].items()] + side["args"]


def side_specs(args: argparse.Namespace) -> list[dict]:
    """Every side of the command line, in run order: the baseline; the candidate (with --side, only where
    a --candidate flag names it), or with --steps-sweep one side per step count, the candidate's revision,
    arguments and environment with `--steps N` appended; then each --side. A spec: label, rev, args, env,
    steps (a sweep's N, or None) and the flags that set them, for the refusals to name."""
    def spec(label, rev, rev_text, args_flag, env_flag, own, steps=None):
        return {"label": label, "rev": rev, "rev_text": rev_text, "args_flag": args_flag, "env_flag": env_flag,
                "args": list(own["args"]), "env": dict(own["env"]), "steps": steps}
    specs = [spec("baseline", args.baseline, f"--baseline {args.baseline!r}", "--baseline-args", "--baseline-env ",
                  args.sides["baseline"])]
    candidate = spec("candidate", args.candidate, f"--candidate {args.candidate!r}", "--candidate-args",
                     "--candidate-env ", args.sides["candidate"])
    if args.steps_sweep:
        specs += [dict(candidate, label=f"steps{n}", args=[*candidate["args"], "--steps", str(n)], steps=n)
                  for n in args.steps_sweep]
    elif args.candidate_named or not args.more_sides:
        specs.append(candidate)
    for name, own in args.more_sides.items():
        specs.append(spec(name, own["rev"], f"--side {name} (revision {own['rev']!r})", f"--side-args {name}",
                          f"--side-env {name}=", own))
    return specs


def _seen_env(side: dict, other: dict, env: dict) -> dict:
    """The values a side's runs see of the variables either side sets: its own, else certify's."""
    return {k: side["env"].get(k, env.get(k)) for k in set(side["env"]) | set(other["env"])}


def make_plan(repo: Path, specs: list[dict], runs: int, nproc: int, name: str, train_args: list[str],
              env: dict | None = None) -> dict:
    """specs: side_specs; env: certify's environment, under each side's (two sides are the same if their
    runs see the same)."""
    env = env or {}
    sides, texts, commits = {}, {}, {}
    for spec in specs:
        check_side(spec)
        if spec["rev"] not in commits:  # a sweep's sides share one revision
            commits[spec["rev"]] = resolve_revision(repo, spec["rev"], spec["rev_text"])
        sides[spec["label"]] = {**commits[spec["rev"]], "args": spec["args"], "env": spec["env"]}
        if spec["steps"] is not None:
            sides[spec["label"]]["steps"] = spec["steps"]
        texts[spec["label"]] = spec["rev_text"]
    labels = list(sides)
    for i, a in enumerate(labels):  # every pair: two copies of one side would compare nothing
        for b in labels[i + 1:]:
            x, y = sides[a], sides[b]
            if x["commit"] == y["commit"] and x["args"] == y["args"] and _seen_env(x, y, env) == _seen_env(y, x, env):
                own = f"; both with {shlex.join(side_words(x))!r}" if side_words(x) else ""
                hint = ("--candidate-args \"--set ...\" or --candidate-env NAME=VALUE" if b == "candidate" else
                        "a step count of its own" if y.get("steps") else
                        f"--side-args {b}=\"--set ...\" or --side-env {b}=NAME=VALUE")
                raise CertifyError(f"{texts[a]} and {texts[b]} are the same commit {x['commit']}{own}, and the "
                                   f"sides {a} and {b} differ in no argument or environment variable: nothing to "
                                   f"compare (an ablation gives {b} {hint})")
    return {"name": name, "repo": str(repo), "runs_per_group": runs, "nproc": nproc, "train_args": train_args,
            "sides": sides, "order": [label for _ in range(runs) for label in labels]}


def train_command(plan: dict, label: str, out_dir: Path) -> list[str]:
    """The command of one run of side `label` (its environment: run_env)."""
    return [*launcher_command(plan["nproc"]), "train_gpt.py", *plan["train_args"], *plan["sides"][label]["args"],
            "--label", label, "--records-dir", str(out_dir)]


def run_env(plan: dict, label: str, env: dict) -> dict:
    """The environment of one run of side `label`: certify's, with the side's variables set over it."""
    return {**env, **plan["sides"][label]["env"]}


def shell_line(plan: dict, label: str, out_dir: Path) -> str:
    """One run of side `label` as a shell line: NAME=VALUE ... python -m torch.distributed.run ..."""
    return shlex.join([f"{k}={v}" for k, v in plan["sides"][label]["env"].items()]
                      + train_command(plan, label, out_dir))


def worktree_name(plan: dict, label: str) -> str:
    return f"{label}-{plan['sides'][label]['commit'][:12]}"


# ------------------------------------------------------------------------------------------------
# the ledger
# ------------------------------------------------------------------------------------------------


def atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(path)


def save_ledger(out_dir: Path, ledger: dict) -> None:
    atomic_write(out_dir / LEDGER_NAME, json.dumps(ledger, indent=1) + "\n")


def load_ledger(out_dir: Path) -> dict:
    path = out_dir / LEDGER_NAME
    try:
        ledger = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise CertifyError(f"--resume: cannot read the ledger {path}: {e}") from e
    if ledger.get("version") == 1:  # two sides, plan["baseline"] and plan["candidate"]: the same runs, read on
        plan = ledger["plan"]
        plan["sides"] = {label: plan.pop(label) for label in ("baseline", "candidate")}
        ledger["version"] = LEDGER_VERSION
    if ledger.get("version") != LEDGER_VERSION:
        raise CertifyError(f"--resume: {path} has version {ledger.get('version')!r}, expected {LEDGER_VERSION} "
                           f"(or 1, which is read): written by another records/certify.py; resume it with that one")
    return ledger


def plan_differences(old: dict, new: dict) -> list[str]:
    """What a --resume would change: one line per differing key, per side for the sides (the order is
    theirs and the runs', so it is left out)."""
    out = []
    for k in sorted((set(old) | set(new)) - {"repo", "order"}):
        a, b = old.get(k), new.get(k)
        if k == "sides" and isinstance(a, dict) and isinstance(b, dict) and list(a) == list(b):
            out += [f"side {label}: ledger {a[label]!r}, now {b[label]!r}" for label in a if a[label] != b[label]]
        elif a != b:
            out.append(f"{k}: ledger {a!r}, now {b!r}")
    return out


# ------------------------------------------------------------------------------------------------
# one run
# ------------------------------------------------------------------------------------------------


def _new_jsonl_records(path: Path, offset: int) -> list[dict]:
    if not path.is_file():
        return []
    with open(path, "rb") as f:
        f.seek(offset)
        tail = f.read().decode("utf-8", errors="replace")
    records = []
    for line in tail.splitlines():
        try:
            entry = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(entry, dict):
            records.append(entry)
    return records


def _unused(path: Path) -> Path:
    """`path`, or `STEM-2.txt`, `STEM-3.txt`, ... when taken (a rerun of an interrupted run)."""
    candidate, k = path, 1
    while candidate.exists():
        k += 1
        candidate = path.with_name(f"{path.stem}-{k}{path.suffix}")
    return candidate


def _relative(path: Path, folder: Path) -> str:
    try:
        return path.resolve().relative_to(folder.resolve()).as_posix()
    except ValueError:  # a log outside the folder (should not happen): keep where it is
        return str(path)


def run_one(index: int, plan: dict, out_dir: Path, worktree: Path, env: dict) -> tuple[dict, bool]:
    """(the run's ledger entry, whether Ctrl-C interrupted it)."""
    label = plan["order"][index]
    cmd = train_command(plan, label, out_dir)
    runs_path, logs_dir = out_dir / "runs.jsonl", out_dir / "logs"
    logs_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "console").mkdir(exist_ok=True)
    console = _unused(out_dir / "console" / f"{index + 1:02d}-{label}.txt")  # a rerun keeps the attempt's
    offset = runs_path.stat().st_size if runs_path.is_file() else 0
    logs_before = set(logs_dir.glob("*.txt"))
    started = _dt.datetime.now(_dt.timezone.utc)
    interrupted, rc = False, None
    try:
        rc = run_process(cmd, worktree, run_env(plan, label, env), console)
    except KeyboardInterrupt:
        interrupted = True
    seconds = (_dt.datetime.now(_dt.timezone.utc) - started).total_seconds()

    new = _new_jsonl_records(runs_path, offset)
    rec = new[-1] if new else None
    log = None
    if rec and rec.get("log_path") and Path(rec["log_path"]).is_file():
        log = Path(rec["log_path"])
    else:
        new_logs = sorted(set(logs_dir.glob("*.txt")) - logs_before)
        log = new_logs[0] if new_logs else None
    run_id = rec.get("run_id") if rec else (log.stem if log else None)
    if log is None:  # died before writing its log: its console output is its log
        log = _unused(logs_dir / f"certify-{index + 1:02d}-{label}.txt")
        text = console.read_text(encoding="utf-8", errors="replace") if console.is_file() else ""
        atomic_write(log, f"# console output of run {index + 1} ({label}, commit {plan['sides'][label]['commit']}), "
                          f"exit code {rc}: the run died before writing its run log\n{text}")
    vals = parse_log(log.read_text(encoding="utf-8", errors="replace")).vals
    if interrupted:
        status, error = "interrupted", "interrupted by the operator (Ctrl-C)"
    elif rec and rec.get("status") == "finished" and rc == 0 and vals:
        status, error = "finished", None
    else:
        status = "failed"
        why = [f"exit code {rc}"] if rc else []
        if rec is None:
            why.append("no runs.jsonl line")
        elif rec.get("error"):
            why.append(str(rec["error"]))
        if not vals and rec is not None and rec.get("status") == "finished":
            why.append("no val_loss line in its log")
        error = "; ".join(why) or "failed"
    entry = {"index": index, "label": label, "commit": plan["sides"][label]["commit"], "status": status,
             "run_id": run_id, "log": _relative(log, out_dir), "console": _relative(console, out_dir), "returncode": rc,
             "started": started.isoformat(timespec="seconds"), "seconds": round(seconds, 1), "error": error,
             "device": rec.get("device") if rec else None,
             # the result as the log prints it (val loss to 4 decimals, whole ms): what statistics.py reads
             "val_loss": vals[-1][2] if status == "finished" else None,
             "train_time_ms": vals[-1][3] if status == "finished" else None}
    return entry, interrupted


# ------------------------------------------------------------------------------------------------
# the write-up
# ------------------------------------------------------------------------------------------------


def slot_rows(ledger: dict) -> list[dict]:
    """One row per planned run in order: its outcome, or status `pending`."""
    by_index = {r["index"]: r for r in ledger["runs"]}
    sides = ledger["plan"]["sides"]
    return [by_index.get(i, {"index": i, "label": label, "commit": sides[label]["commit"], "status": "pending",
                             "run_id": None, "log": None, "val_loss": None, "train_time_ms": None})
            for i, label in enumerate(ledger["plan"]["order"])]


def write_order_tsv(out_dir: Path, ledger: dict) -> None:
    """runs.tsv: which log is which run (planned runs in order, then interrupted attempts), and a step
    sweep's step count (what statistics.py needs to name the fewest steps)."""
    sides = ledger["plan"]["sides"]
    lines = ["\t".join(TSV_COLUMNS)]
    for r in slot_rows(ledger) + ledger["interrupted_attempts"]:
        lines.append("\t".join([str(r["index"] + 1), r["label"], r["commit"], r["status"],
                                r.get("run_id") or "-", r.get("log") or "-",
                                str(sides[r["label"]].get("steps") or "-")]))
    atomic_write(out_dir / ORDER_NAME, "\n".join(lines) + "\n")


def render_results(rows: list[dict], attempts: list[dict], plan: dict) -> str:
    """The run table, statistics, verdicts (and a sweep's fewest steps) of statistics.md: the numbers
    from records.report, the page from statistics.py's own `render` (one layout and one verdict for
    both, so the standalone script prints exactly these sections from the logs)."""
    def finished(label):
        fin = [r for r in rows if r["label"] == label and r["status"] == "finished"]
        return [r["val_loss"] for r in fin], [r["train_time_ms"] / 1000 for r in fin]

    base = finished(BASELINE)
    sides = []
    for label, side in plan["sides"].items():
        mine = [r for r in rows if r["label"] == label]
        losses, times = finished(label)
        entry = {"label": label, "steps": side.get("steps"), "planned": len(mine), "finished": len(losses),
                 "failed": sum(r["status"] in ("failed", "interrupted") for r in mine), "cells": None, "loss": None,
                 "comparison": None, "time": None}
        if losses:
            stats = report.group_stats(losses, times)
            entry["cells"] = report.format_group_cells(stats)
            entry["loss"] = (stats.loss_mean, stats.p_below_target)
            if label != BASELINE and base[0]:
                comparison = report.compare(losses, times, *base)
                entry["comparison"] = report.format_comparison_cells(comparison)
                entry["time"] = (comparison.d_time_s, comparison.p_time)
        sides.append(entry)
    shown = [dict(r, index=r["index"] + 1) for r in rows]  # the ledger counts from 0, the page from 1
    shown_attempts = [dict(a, index=a["index"] + 1) for a in attempts]
    return statistics_page.render(shown, shown_attempts, plan["runs_per_group"], sides) + "\n"


def verdict_lines(results: str) -> list[str]:
    """The verdicts (one per side against the baseline, or INCOMPLETE) and a sweep's fewest steps, as
    render_results wrote them: what the console and README.md's Result repeat."""
    out, section = [], None
    for line in results.splitlines():
        if line.startswith("## "):
            section = line[3:]
        elif (section == "Verdict" and line.startswith(("- ", "**"))) or (section == "Step sweep"
                                                                         and line.startswith("**")):
            out.append(line)
    return out


_MACHINE_PREFIXES = ("Running Python", "Running PyTorch", "Running Triton", "Devices:")


def machine_lines(out_dir: Path, rows: list[dict]) -> list[str]:
    """The environment header lines of the runs' logs (and the nvidia-smi driver line), deduplicated."""
    seen: dict[str, int] = {}
    for r in rows:
        if not r.get("log"):
            continue
        path = out_dir / r["log"]
        if not path.is_file():
            continue
        for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
            line = line.strip()
            if line.startswith(_MACHINE_PREFIXES) or "Driver Version" in line:
                seen[line] = seen.get(line, 0) + 1
    devices = sorted({r["device"] for r in rows if r.get("device")})
    out = [f"- {line} ({n} log{'s' if n > 1 else ''})" for line, n in seen.items()]
    out += [f"- runs.jsonl device: {d}" for d in devices]
    return out or ["- (no run log holds an environment header)"]


def write_outputs(out_dir: Path, ledger: dict) -> str:
    plan = ledger["plan"]
    rows = slot_rows(ledger)
    write_order_tsv(out_dir, ledger)
    results = render_results(rows, ledger["interrupted_attempts"], plan)
    head = [f"# Certification: {plan['name']}", ""]
    head += [side_line(plan, label) for label in plan["sides"]]
    head += [f"- {plan['runs_per_group']} runs per side, interleaved ({', '.join(plan['sides'])}, ...), "
             f"`--nproc_per_node={plan['nproc']}`; train_gpt.py arguments of every side: "
             f"`{shlex.join(plan['train_args'])}`", "", "## Machine", "", *machine_lines(out_dir, rows), ""]
    failures = [r for r in ledger["runs"] + ledger["interrupted_attempts"] if r["status"] != "finished"]
    if failures:
        head += ["## Runs that did not finish (counted, never dropped)", ""]
        head += [f"- run {r['index'] + 1} ({r['label']}) {r['status']}: {' '.join(str(r['error']).split())} "
                 f"(log `{r['log']}`, console `{r['console']}`)"
                 for r in sorted(failures, key=lambda r: (r["index"], r["started"]))]
        head.append("")
    head += ["Recompute the run table, the statistics and the verdicts from the logs alone: "
             "`python statistics.py` in this folder.", ""]
    curves = write_curves(out_dir, rows, list(plan["sides"]))
    head += ["## Curves", "", curves, ""]
    text = "\n".join(head) + "\n" + results
    atomic_write(out_dir / "statistics.md", text)
    atomic_write(out_dir / "statistics.py", Path(statistics_page.__file__).read_text(encoding="utf-8"))
    readme = out_dir / "README.md"  # rewritten until someone fills in the change
    if not readme.exists() or README_PLACEHOLDER in readme.read_text(encoding="utf-8", errors="replace"):
        atomic_write(out_dir / "README.md", readme_text(plan, out_dir, results, curves))
    return text


def write_curves(out_dir: Path, rows: list[dict], labels: list[str]) -> str:
    """DIR/curves.png, the finished runs' loss curves, one colour per side in run order (records.report
    --curves: the training loss each run read, the val loss where it validated more than once),
    rewritten with the write-up; returns the Markdown that shows it (or says why there is none)."""
    runs_path = out_dir / "runs.jsonl"
    finished = {r["run_id"]: r for r in rows if r["status"] == "finished" and r.get("run_id")}
    records = read_runs(runs_path)[0] if runs_path.is_file() else []
    groups: dict[str, list[dict]] = {}
    for label in labels:
        for rec in records:
            row = finished.get(rec.get("run_id"))
            if row is not None and row["label"] == label:  # the log where the ledger has it (moved folders too)
                groups.setdefault(label, []).append(dict(rec, log_path=str(out_dir / row["log"])))
    if not groups:
        return "(no finished run yet: no curves)"
    try:
        drawn = report.plot_curves(groups, out_dir / CURVES_NAME)
    except ImportError:
        return "(matplotlib is not installed (pip install matplotlib): no curves drawn)"
    train = sum(g.startswith("train") for g in drawn["step"])
    return (f"![loss curves: training loss per run, val loss where a run validated more than once, against step "
            f"and training time; one colour per side]({CURVES_NAME})\n\n"
            f"{train} training curve(s) of {sum(map(len, groups.values()))} finished run(s), one colour per side "
            f"({', '.join(groups)}; runs without runs.jsonl `train_curve` predate it); `python -m records.report "
            f"--runs runs.jsonl --group-by label --curves {CURVES_NAME}` redraws it.")


def side_line(plan: dict, label: str) -> str:
    """A side as the write-up lists it: revision, and the arguments and environment of its own."""
    side = plan["sides"][label]
    args = f"`{shlex.join(side['args'])}`" if side["args"] else "none"
    env = f"`{shlex.join(f'{k}={v}' for k, v in side['env'].items())}`" if side["env"] else "none"
    return (f"- {label}: `{side['commit']}` {side['subject']} (`{side['rev']}`); its own train_gpt.py "
            f"arguments: {args}; its own environment: {env}")


def _sweep_template(plan: dict) -> dict | None:
    """A step sweep's candidate, as --candidate and its flags gave it (its sides' args less `--steps N`)."""
    swept = [s for s in plan["sides"].values() if s.get("steps")]
    return dict(swept[0], args=swept[0]["args"][:-2], steps=[s["steps"] for s in swept]) if swept else None


def certify_command(plan: dict) -> str:
    """The command that reruns this certification into OUT_DIR (a shell line, continued over lines: the
    baseline, then each side)."""
    def own(flag_args, flag_env, side, prefix=""):
        words = [flag_args, prefix + shlex.join(side["args"])] if side["args"] else []
        return words + [w for k, v in side["env"].items() for w in (flag_env, f"{prefix}{k}={v}")]
    sides = plan["sides"]
    parts = [["python", "-m", "records.certify", "--baseline", sides[BASELINE]["commit"],
              *own("--baseline-args", "--baseline-env", sides[BASELINE])]]
    template = _sweep_template(plan)
    if template:
        parts.append(["--candidate", template["commit"], *own("--candidate-args", "--candidate-env", template),
                      "--steps-sweep", ",".join(map(str, template["steps"]))])
    elif "candidate" in sides:
        parts.append(["--candidate", sides["candidate"]["commit"],
                      *own("--candidate-args", "--candidate-env", sides["candidate"])])
    for label, side in sides.items():
        if label not in (BASELINE, "candidate") and "steps" not in side:
            parts.append(["--side", label, "--side-rev", f"{label}={side['commit']}",
                          *own("--side-args", "--side-env", side, prefix=f"{label}=")])
    parts.append(["--runs", str(plan["runs_per_group"]), "--nproc", str(plan["nproc"]), "--name", plan["name"],
                  "--out", "OUT_DIR", "--", *plan["train_args"]])
    return " \\\n    ".join(shlex.join(part) for part in parts)


def readme_text(plan: dict, out_dir: Path, results: str, curves: str) -> str:
    verdicts = "\n".join(verdict_lines(results))
    each_run = "\n".join(f"# {label}\n{shell_line(plan, label, out_dir)}" for label in plan["sides"])
    sides = "\n".join(side_line(plan, label) for label in [*plan["sides"]][1:] + [BASELINE])  # the change first
    return f"""# {plan['name']}

<!-- Upstream record write-up skeleton (records/track_1_short/<date>_<name>/): say what changed and why. -->

{README_PLACEHOLDER}

{sides}

## Result

{verdicts}

{plan['runs_per_group']} runs of each side, interleaved on one machine, unseeded; every run counted.
Run table, per-side statistics and machine: [statistics.md](statistics.md).

{curves}

## Reproduce

```bash
git clone <this repository> && cd <it>
# the shards every side reads (the same folder for all):
#   {plan['train_args'][plan['train_args'].index('--data-path') + 1]}
{certify_command(plan)}
```

Each run was, inside a worktree of its side's revision:

```bash
{each_run}
```

Recompute every number from the logs alone (standard library; scipy for the p-values):

```bash
python statistics.py
```

## Files

- `logs/*.txt`: every run's log (a run that died before writing one: its console output, `logs/certify-NN-LABEL.txt`)
- `runs.tsv`: which log is which run, in the order they ran
- `statistics.md`, `statistics.py`: the statistics and the script that recomputes them
- `{CURVES_NAME}`: the runs' loss curves (`python -m records.report --curves`)
- `runs.jsonl`, `certify.json`, `console/`: the runs' records, the certification's ledger, each run's console output
"""


# ------------------------------------------------------------------------------------------------
# statistics.py: a standalone copy of the statistics, written next to the logs
# ------------------------------------------------------------------------------------------------



# ------------------------------------------------------------------------------------------------
# main
# ------------------------------------------------------------------------------------------------


_NEXT_WORD_FLAGS = ("--baseline-args", "--candidate-args", "--side-args")


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    if "--" in argv:
        cut = argv.index("--")
        argv, train_args = argv[:cut], argv[cut + 1:]
    else:
        train_args = []
    # a side's ARGS is the next word whatever it looks like: argparse would read `--candidate-args --no-warmup`
    # as a flag without its value
    joined, i = [], 0
    while i < len(argv):
        if argv[i] in _NEXT_WORD_FLAGS and i + 1 < len(argv):
            joined.append(f"{argv[i]}={argv[i + 1]}")
            i += 2
        else:
            joined.append(argv[i])
            i += 1
    argv = joined
    ap = ArgumentParser(prog="python -m records.certify", description=__doc__.split("\n\n")[0],
                        usage="python -m records.certify [--baseline REV] [--candidate REV] --runs N "
                              "[--candidate-args ARGS] [--candidate-env NAME=VALUE] [--side NAME "
                              "[--side-rev NAME=REV] [--side-args NAME=ARGS] [--side-env NAME=VAR=VALUE]]... "
                              "[--steps-sweep N1,N2,...] [options] -- TRAIN_GPT_ARGS...")
    ap.add_argument("--baseline", default="HEAD",
                    help="the revision to beat, every other side's reference (branch, tag, commit, HEAD~1; "
                         "default HEAD)")
    ap.add_argument("--candidate", default=None,
                    help="the revision with the change (default HEAD); with --side, the candidate runs only "
                         "where a --candidate flag names it")
    for label in ("baseline", "candidate"):
        ap.add_argument(f"--{label}-args", default="", metavar="ARGS",
                        help=f"train_gpt.py arguments of the {label}'s runs only, one string split like a shell "
                             f"line and appended after TRAIN_GPT_ARGS (\"--set features.ngram=false\")")
        ap.add_argument(f"--{label}-env", action="append", default=[], metavar="NAME=VALUE",
                        help=f"an environment variable of the {label}'s runs only, set over certify's own "
                             f"(SPEEDRUN_CUDA_GRAPHS=0; repeatable)")
    ap.add_argument("--side", action="append", default=[], metavar="NAME",
                    help="a further side, compared with the baseline as the candidate is (repeatable; sides run "
                         "in the order given, after the baseline and the candidate): its runs' label, letters, "
                         "digits, '.', '_', '-', starting with a letter; HEAD and nothing of its own unless "
                         "--side-rev, --side-args, --side-env say otherwise")
    ap.add_argument("--side-rev", action="append", default=[], metavar="NAME=REV",
                    help="side NAME's revision (default HEAD)")
    ap.add_argument("--side-args", action="append", default=[], metavar="NAME=ARGS",
                    help="side NAME's own train_gpt.py arguments, as --candidate-args (\"cplm=--proposal cplm\")")
    ap.add_argument("--side-env", action="append", default=[], metavar="NAME=VAR=VALUE",
                    help="an environment variable of side NAME's runs, as --candidate-env (repeatable)")
    ap.add_argument("--steps-sweep", default=None, metavar="N1,N2,...",
                    help="run the candidate at each of these base step counts (train_gpt.py --steps N), each "
                         "count a side of its own, labelled stepsN, in place of the candidate; the write-up "
                         "names the fewest steps whose runs meet upstream's loss bar")
    ap.add_argument("--runs", type=int, required=True, help="runs per side (upstream PR #366: 12)")
    ap.add_argument("--nproc", type=int, default=8, help="processes per run (torchrun --nproc_per_node; default 8)")
    ap.add_argument("--name", default=None, help="the write-up's name (default: the sides' short hashes, and "
                                                 "their own arguments and environment)")
    ap.add_argument("--out", type=Path, default=None,
                    help="the certification folder (default: records/track_1_short/<YYYY-MM-DD>_<NAME>)")
    ap.add_argument("--resume", action="store_true", help="continue the certification in --out from its ledger")
    ap.add_argument("--dry-run", action="store_true", help="print every run's command and folder; run nothing")
    args = ap.parse_args(argv)
    if args.runs < 2:
        ap.error(f"--runs {args.runs}: needs at least 2 runs per side for a t-test")
    if args.nproc < 1:
        ap.error(f"--nproc {args.nproc}: needs at least 1 process")
    # with --side the candidate is one side among others: it runs where a flag of its own names it
    args.candidate_named = bool(args.candidate is not None or args.candidate_args or args.candidate_env)
    args.candidate = args.candidate or "HEAD"
    args.sides = {label: {"args": _split_args(ap, f"--{label}-args", getattr(args, f"{label}_args")),
                          "env": _parse_env(ap, f"--{label}-env", getattr(args, f"{label}_env"))}
                  for label in ("baseline", "candidate")}
    args.more_sides = _parse_more_sides(ap, args)
    args.steps_sweep = _parse_steps_sweep(ap, args.steps_sweep)
    if args.steps_sweep and args.more_sides:
        ap.error(f"--steps-sweep runs the candidate at each step count, and does not combine with --side "
                 f"({', '.join(args.more_sides)}): certify the other sides in a certification of their own")
    return args, train_args


def _split_args(ap: ArgumentParser, flag: str, text: str, prefix: str = "") -> list[str]:
    """A side's ARGS (after `prefix`, a side's `NAME=`), split like a shell line."""
    try:
        return shlex.split(text)
    except ValueError as e:
        ap.error(f"{flag} {prefix}{text!r} does not split like a shell line ({e}); quote it as one string, "
                 f"e.g. {flag} \"{prefix}--set features.ngram=false\"")


def _parse_env(ap: ArgumentParser, flag: str, words: list[str], prefix: str = "") -> dict:
    """NAME=VALUE words (each after `prefix`, a side's `NAME=`) as a dict; refuses a malformed or repeated NAME."""
    env = {}
    for word in words:
        name, eq, value = word.partition("=")
        if not eq or not ENV_NAME_RE.fullmatch(name):
            ap.error(f"{flag} {prefix}{word!r}: expected {prefix}NAME=VALUE, NAME of letters, digits and '_', "
                     f"not starting with a digit (e.g. {prefix}SPEEDRUN_CUDA_GRAPHS=0)")
        if name in env:
            ap.error(f"{flag} sets {prefix}{name} twice ({name}={env[name]}, {word}): give it once")
        env[name] = value
    return env


def _parse_more_sides(ap: ArgumentParser, args: argparse.Namespace) -> dict:
    """--side NAME, with --side-rev/--side-args/--side-env NAME=...: name -> {rev, args, env}, in order."""
    sides: dict[str, dict] = {}
    for name in args.side:
        if not SIDE_NAME_RE.fullmatch(name):
            ap.error(f"--side {name!r}: a side's name labels its runs and names its files: 1 to 40 letters, "
                     f"digits, '.', '_' or '-', starting with a letter (e.g. --side cplm)")
        if name.lower() in ("baseline", "candidate"):
            ap.error(f"--side {name}: the baseline and the candidate have flags of their own (--{name.lower()}, "
                     f"--{name.lower()}-args, --{name.lower()}-env); name the side something else")
        if name.lower() in (s.lower() for s in sides):  # worktree and console names must differ on any disk
            ap.error(f"--side {name} is given twice (names are compared ignoring case): each side once")
        sides[name] = {"rev": None, "args": None, "env": []}

    def owner(flag: str, word: str) -> tuple[str, str]:
        name, eq, rest = word.partition("=")
        if not eq or name not in sides:
            known = ", ".join(sides) or "none"
            what = {"--side-rev": "REV", "--side-args": "ARGS", "--side-env": "VAR=VALUE"}[flag]
            ap.error(f"{flag} {word!r}: expected NAME={what}, NAME a side that --side NAME declares (sides: {known})")
        return name, rest

    for flag, key in (("--side-rev", "rev"), ("--side-args", "args")):
        for word in getattr(args, flag[2:].replace("-", "_")):
            name, value = owner(flag, word)
            if sides[name][key] is not None:
                ap.error(f"{flag} gives side {name} twice: once, e.g. {flag} {name}=...")
            sides[name][key] = value
    for word in args.side_env:
        name, value = owner("--side-env", word)
        sides[name]["env"].append(value)
    return {name: {"rev": side["rev"] or "HEAD",
                   "args": _split_args(ap, "--side-args", side["args"] or "", prefix=f"{name}="),
                   "env": _parse_env(ap, "--side-env", side["env"], prefix=f"{name}=")}
            for name, side in sides.items()}


def _parse_steps_sweep(ap: ArgumentParser, text: str | None) -> list[int]:
    if text is None:
        return []
    steps = []
    for word in text.split(","):
        if not word.strip().isdigit() or int(word) < 1:
            ap.error(f"--steps-sweep {text!r}: expected base step counts N1,N2,... (positive integers, comma "
                     f"separated, e.g. --steps-sweep 1050,1100,1122)")
        if int(word) in steps:
            ap.error(f"--steps-sweep {text!r} gives {int(word)} twice: each step count once")
        steps.append(int(word))
    return steps


def default_name(plan: dict) -> str:
    """BASELINE-vs-CANDIDATE: each side's short hash, then its own environment and arguments, folder-safe;
    with more sides the sides' names, with a sweep its step counts."""
    def tag(side):
        own = re.sub(r"[^A-Za-z0-9._]+", "-", " ".join(side_words(side))).strip("-._")
        own = own[:60].rstrip("-._")  # ours: a readable folder name; --name for a longer one
        return side["commit"][:8] + (f"_{own}" if own else "")
    sides, template = plan["sides"], _sweep_template(plan)
    if template:
        return f"{tag(sides[BASELINE])}-vs-{tag(template)}_steps-{'-'.join(map(str, template['steps']))}"[:120]
    if list(sides) == [BASELINE, "candidate"]:
        return f"{tag(sides[BASELINE])}-vs-{tag(sides['candidate'])}"
    return f"{tag(sides[BASELINE])}-vs-{'-'.join(list(sides)[1:])}"[:120]


def main(argv: list[str] | None = None) -> int:
    with exit_on_config_error("python -m records.certify"):  # one line, exit 2
        args, raw_train_args = parse_args(sys.argv[1:] if argv is None else argv)
    cwd = Path.cwd()
    try:
        repo = Path(git(["rev-parse", "--show-toplevel"], cwd))
        env = dict(os.environ)
        train_args = check_train_args(raw_train_args, cwd, env)
        if args.steps_sweep:
            refuse_steps(train_args, "TRAIN_GPT_ARGS")
            refuse_steps(args.sides["candidate"]["args"], "--candidate-args")
        plan = make_plan(repo, side_specs(args), args.runs, args.nproc, args.name or "", train_args, env)
        name = plan["name"] = args.name or default_name(plan)
        if not re.fullmatch(r"[A-Za-z0-9._-]+", name):
            raise CertifyError(f"--name {name!r}: use letters, digits, '.', '_' and '-' (it names a folder)")
        out_dir = (args.out or repo / "records" / "track_1_short" / f"{_dt.date.today():%Y-%m-%d}_{name}").resolve()
        warn_uncommitted(repo, plan)
        if args.dry_run:
            return dry_run(plan, out_dir)
        return certify(plan, out_dir, args.resume, env)
    except CertifyError as e:
        print(f"python -m records.certify: error: {e}", file=sys.stderr)
        return 2


def warn_uncommitted(repo: Path, plan: dict) -> None:
    """A side at HEAD runs HEAD's commit in a worktree: say so when the checkout has uncommitted changes."""
    head = git(["rev-parse", "HEAD"], repo)
    at_head = [label for label, side in plan["sides"].items() if side["commit"] == head]
    if at_head and git(["status", "--porcelain", "--untracked-files=no"], repo):
        said = " and ".join(at_head) if len(at_head) < 3 else ", ".join(at_head[:-1]) + " and " + at_head[-1]
        print(f"python -m records.certify: note: the checkout has uncommitted changes; the {said} "
              f"run{'s' if len(at_head) == 1 else ''} commit {head[:12]} (HEAD) without them: commit them first "
              f"to certify them", file=sys.stderr)


def dry_run(plan: dict, out_dir: Path) -> int:
    print(f"certification {plan['name']} -> {out_dir} (dry run: nothing runs)")
    print("  $WORKTREES: a new temporary folder holding `git worktree add --detach` of each side's revision, "
          "removed at the end")
    for label in plan["sides"]:
        print(f"  {side_line(plan, label)[2:]} (worktree: $WORKTREES/{worktree_name(plan, label)})")
    for i, label in enumerate(plan["order"]):
        print(f"run {i + 1}/{len(plan['order'])} {label}: cd $WORKTREES/{worktree_name(plan, label)} && "
              f"{shell_line(plan, label, out_dir)}")
    return 0


def certify(plan: dict, out_dir: Path, resume: bool, env: dict) -> int:
    ledger_path = out_dir / LEDGER_NAME
    if resume:
        ledger = load_ledger(out_dir)
        diffs = plan_differences(ledger["plan"], plan)
        if diffs:
            raise CertifyError(f"--resume: the plan differs from {ledger_path}'s: " + "; ".join(diffs))
        for r in [r for r in ledger["runs"] if r["status"] == "interrupted"]:  # rerun, keep the attempt
            ledger["runs"].remove(r)
            ledger["interrupted_attempts"].append(r)
    else:
        if ledger_path.exists():
            raise CertifyError(f"--out {out_dir} already holds a certification ({LEDGER_NAME}): --resume to "
                               f"continue it, or choose another --out")
        if out_dir.exists() and any(out_dir.iterdir()):
            raise CertifyError(f"--out {out_dir} exists and is not empty: choose a new folder")
        ledger = {"version": LEDGER_VERSION, "plan": plan, "runs": [], "interrupted_attempts": []}
    out_dir.mkdir(parents=True, exist_ok=True)
    save_ledger(out_dir, ledger)

    done = {r["index"] for r in ledger["runs"]}
    pending = [i for i in range(len(plan["order"])) if i not in done]
    interrupted = False
    if pending:
        interrupted = _run_pending(plan, ledger, pending, out_dir, env)
    text = write_outputs(out_dir, ledger)
    for line in verdict_lines(text):
        print(line)
    print(f"written: {out_dir / 'statistics.md'}, statistics.py, README.md, runs.tsv")
    if interrupted:
        print(f"interrupted: continue with the same command and --resume (ledger {ledger_path})", file=sys.stderr)
        return 130
    return 0


def _run_pending(plan: dict, ledger: dict, pending: list[int], out_dir: Path, env: dict) -> bool:
    """Run the pending runs in order; True if Ctrl-C stopped them. Worktrees are removed in any case."""
    from tqdm import tqdm

    repo = Path(plan["repo"])
    base = Path(tempfile.mkdtemp(prefix="certify-worktrees-"))
    worktrees: dict[str, Path] = {}
    try:
        for label in sorted({plan["order"][i] for i in pending}):
            path = base / worktree_name(plan, label)
            git(["worktree", "add", "--detach", str(path), plan["sides"][label]["commit"]], repo)
            worktrees[label] = path
        total = len(plan["order"])
        with tqdm(total=total, initial=total - len(pending), unit="run", desc="certify",
                  file=sys.stderr, dynamic_ncols=True) as bar:
            for i in pending:
                label = plan["order"][i]
                bar.set_postfix_str(f"run {i + 1} {label}")
                entry, stopped = run_one(i, plan, out_dir, worktrees[label], env)
                ledger["runs"].append(entry)
                save_ledger(out_dir, ledger)
                if stopped:
                    return True
                bar.update(1)
                if entry["status"] != "finished":
                    bar.write(f"run {i + 1} ({label}) {entry['status']}: {entry['error']} (log {entry['log']}); "
                              f"counted, continuing")
        return False
    except KeyboardInterrupt:  # between runs, or while the worktrees were made
        return True
    finally:
        for path in worktrees.values():
            subprocess.run(["git", "worktree", "remove", "--force", str(path)], cwd=repo, capture_output=True)
        subprocess.run(["git", "worktree", "prune"], cwd=repo, capture_output=True)
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
