"""records.certify on a toy git repository whose train_gpt.py is a fake trainer (no model, no data).

The fake writes a log in the upstream line format under --records-dir/logs/ and a runs.jsonl line
shaped like records.runs_log.RunRecord, with a val loss and time that depend on its revision (and
cycle through mean − s, mean, mean + s, so the statistics are deterministic); one revision crashes
before writing anything; another sleeps until Ctrl-C. An ablation's switches reach it: `--set
features.ngram=false` adds 0.002 to its val loss and SPEEDRUN_CUDA_GRAPHS=0 100 ms to its time, and
it records its --set flags in runs.jsonl's `overrides` as train_gpt.py does; `--steps N` (a step
sweep) takes 0.0001 off its val loss per step past 1000 and scales its time by N/1000. The launcher is
replaced by plain `python` except in the torchrun test.
"""
import ast
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from records import certify, report, run_log
from records import statistics as statistics_module

FAKE_TRAINER = r'''
import argparse, datetime, json, os, subprocess, sys, uuid
MEAN_LOSS, MEAN_MS, CRASH, SLEEP = {loss!r}, {ms!r}, {crash!r}, {sleep!r}
ap = argparse.ArgumentParser()
ap.add_argument("--label"); ap.add_argument("--records-dir"); ap.add_argument("--data-path")
ap.add_argument("--max-steps", type=int, default=3)
ap.add_argument("--steps", type=int, default=None)
ap.add_argument("--set", action="append", default=[], dest="assignments")
args, _ = ap.parse_known_args()
print("fake env SPEEDRUN_CUDA_GRAPHS =", os.environ.get("SPEEDRUN_CUDA_GRAPHS"), flush=True)
if args.steps is not None:  # a step sweep: 0.0001 less loss per step past 1000, the time in proportion
    MEAN_LOSS, MEAN_MS = MEAN_LOSS + 0.0001 * (1000 - args.steps), round(MEAN_MS * args.steps / 1000)
if "features.ngram=false" in args.assignments:
    MEAN_LOSS += 0.002
if os.environ.get("SPEEDRUN_CUDA_GRAPHS") == "0":
    MEAN_MS += 100
assert os.path.isabs(args.data_path) and os.path.isdir(args.data_path), args.data_path
if SLEEP:  # until Ctrl-C
    print("fake trainer sleeping", flush=True)
    import time; time.sleep(120)
if CRASH:
    print("Traceback (most recent call last):\nRuntimeError: the fake trainer crashes", file=sys.stderr)
    sys.exit(1)
runs = os.path.join(args.records_dir, "runs.jsonl")
k = sum(json.loads(l)["label"] == args.label for l in open(runs)) if os.path.exists(runs) else 0
off = (-1, 0, 1)[k % 3]
loss, ms = round(MEAN_LOSS + 0.0005 * off, 4), MEAN_MS + 10 * off
commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
run_id = str(uuid.uuid4())
log = os.path.join(args.records_dir, "logs", run_id + ".txt")
os.makedirs(os.path.dirname(log), exist_ok=True)
n = args.max_steps
with open(log, "w") as f:
    f.write(f"git commit: {{commit}} dirty: False\n")
    f.write("Running PyTorch 2.13.0 compiled for CUDA None\nDevices: fake device\n")
    f.write(f"step:{{n}}/{{n}} val_loss:{{loss:.4f}} train_time:{{ms}}ms step_avg:{{ms / n:.2f}}ms\n")
rec = dict(run_id=run_id, started=datetime.datetime.now().isoformat(), config="fake", world_size=1,
           device="fake device", git_commit=commit, git_dirty=False, status="finished", log_path=log,
           label=args.label, overrides=args.assignments or None, steps=n, train_time_ms=float(ms), val_loss=loss,
           train_curve=[[s, ms * s / n, 10.0 - s] for s in range(1, n + 1)])
with open(runs, "a") as f:
    f.write(json.dumps(rec) + "\n")
print("fake run done", run_id)
'''


def _git(repo, *args):
    return subprocess.run(["git", *args], cwd=repo, check=True, capture_output=True, text=True).stdout.strip()


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    """Four commits: baseline (3.2750, 1000 ms), fast (3.2740, 900 ms), crash, slow (sleeps until Ctrl-C)."""
    root = tmp_path_factory.mktemp("toy")
    repo = root / "repo"
    repo.mkdir()
    _git(repo, "init", "-q")
    _git(repo, "config", "user.email", "t@example.com")
    _git(repo, "config", "user.name", "t")
    commits = {}
    for name, loss, ms, crash, sleep in (("baseline", 3.2750, 1000, False, False), ("fast", 3.2740, 900, False, False),
                                         ("crash", 3.2740, 900, True, False), ("slow", 3.2740, 900, False, True)):
        (repo / "train_gpt.py").write_text(FAKE_TRAINER.format(loss=loss, ms=ms, crash=crash, sleep=sleep))
        _git(repo, "add", "train_gpt.py")
        _git(repo, "commit", "-q", "-m", f"fake trainer: {name}")
        commits[name] = _git(repo, "rev-parse", "HEAD")
    (root / "shards").mkdir()
    return repo, commits


@pytest.fixture
def fast_launcher(monkeypatch):
    monkeypatch.setattr(certify, "launcher_command", lambda nproc: [sys.executable])


def _certify(repo, monkeypatch, baseline, candidate, out, runs=3, extra=()):
    monkeypatch.chdir(repo)
    return certify.main(["--baseline", baseline, "--candidate", candidate, "--runs", str(runs), "--nproc", "1",
                         "--name", "toy", "--out", str(out), *extra, "--", "--data-path", "../shards",
                         "--max-steps", "3"])


def _worktrees(repo):
    return [line for line in _git(repo, "worktree", "list", "--porcelain").splitlines() if line.startswith("worktree ")]


def _section(text, start="## Runs, in the order they ran"):
    return text[text.index(start):]


def _stats_row(text, label):
    for line in text.splitlines():
        if line.startswith(f"| {label} |"):
            return [c.strip() for c in line.strip("|").split("|")]
    raise AssertionError(f"no {label} row in\n{text}")


def _standalone(out):
    res = subprocess.run([sys.executable, "statistics.py"], cwd=out, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    return res.stdout


def test_dry_run_prints_the_plan_and_runs_nothing(toy, monkeypatch, capsys, tmp_path, fast_launcher):
    repo, commits = toy
    out = tmp_path / "cert"
    assert _certify(repo, monkeypatch, commits["baseline"], commits["fast"], out, runs=2, extra=["--dry-run"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("run ")]
    assert [re.match(r"run \d/4 (\w+):", line)[1] for line in lines] == ["baseline", "candidate"] * 2
    shards = str((repo.parent / "shards").resolve())
    assert all(f"--data-path {shards}" in line and f"--records-dir {out}" in line for line in lines)
    assert f"{commits['fast'][:12]} && " in lines[1] and "train_gpt.py" in lines[1]
    assert not out.exists() and len(_worktrees(repo)) == 1


def test_interleaved_runs_statistics_match_report_and_standalone_script(toy, monkeypatch, capsys, tmp_path,
                                                                         fast_launcher):
    repo, commits = toy
    out = tmp_path / "cert"
    assert _certify(repo, monkeypatch, commits["baseline"], commits["fast"], out) == 0
    ledger = json.loads((out / "certify.json").read_text())
    assert ledger["plan"]["order"] == ["baseline", "candidate"] * 3
    assert ledger["plan"]["train_args"][:2] == ["--data-path", str((repo.parent / "shards").resolve())]
    assert [(r["index"], r["label"], r["status"]) for r in ledger["runs"]] == \
        [(i, ("baseline", "candidate")[i % 2], "finished") for i in range(6)]
    runs = [json.loads(line) for line in (out / "runs.jsonl").read_text().splitlines()]
    assert [r["label"] for r in runs] == ["baseline", "candidate"] * 3  # the order they really ran
    assert [r["git_commit"] for r in runs] == [commits["baseline"], commits["fast"]] * 3
    assert len(_worktrees(repo)) == 1  # the worktrees are gone

    md = (out / "statistics.md").read_text()
    assert "**PASS**" in md and commits["fast"] in md and "fake trainer: fast" in md and "Devices: fake device" in md
    assert "| 2 | candidate | " in md and "| 3.2735 | 890 | finished |" in md
    # the same numbers as records.report on the same runs.jsonl
    capsys.readouterr()
    assert report.main(["--runs", str(out / "runs.jsonl"), "--group-by", "label", "--baseline", "baseline"]) == 0
    rep = capsys.readouterr().out
    base_md, cand_md = _stats_row(md, "baseline"), _stats_row(md, "candidate")
    assert cand_md[1:4] == ["3", "3", "0"]
    assert base_md[4:] == _stats_row(rep, "baseline (baseline)")[1:7]
    assert cand_md[4:] == _stats_row(rep, "candidate")[1:7]
    assert _stats_row(md, "candidate − baseline")[1:] == _stats_row(rep, "candidate")[7:11]  # then tokens/s, MFU
    assert cand_md[6] == "3.27400 ± 0.00050" and cand_md[5] == "0.900 ± 0.010"
    # the standalone script recomputes it all from the logs and runs.tsv
    assert _standalone(out) == _section(md)
    tree = ast.parse((out / "statistics.py").read_text())
    imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert imported <= set(sys.stdlib_module_names) | {"scipy"}, imported  # nothing of this repository
    # the folder's script is the repository's statistics module, verbatim: one t-test, one val-line pattern
    assert (out / "statistics.py").read_text() == Path(statistics_module.__file__).read_text()
    assert report.target_test is statistics_module.target_test and run_log._VAL_RE is statistics_module.VAL_RE
    assert "python -m records.certify --baseline " + commits["baseline"] in (out / "README.md").read_text()
    # the curves picture: written, shown in both pages, one training curve per finished run
    assert (out / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for page in (md, (out / "README.md").read_text()):
        assert "](curves.png)" in page and "6 training curve(s) of 6 finished run(s)" in page

    assert _certify(repo, monkeypatch, commits["baseline"], commits["fast"], out) == 2  # no silent overwrite
    assert "--resume" in capsys.readouterr().err


def test_a_crashing_candidate_is_counted_as_failed(toy, monkeypatch, tmp_path, fast_launcher):
    repo, commits = toy
    out = tmp_path / "cert"
    assert _certify(repo, monkeypatch, commits["baseline"], commits["crash"], out, runs=2) == 0
    md = (out / "statistics.md").read_text()
    assert _stats_row(md, "candidate")[1:5] == ["2", "0", "2", "0"]  # planned, finished, failed, n
    assert _stats_row(md, "baseline")[1:5] == ["2", "2", "0", "2"]
    assert md.count("| candidate | - | - | - | failed |") == 2
    assert "**FAIL**" in md and "run 2 (candidate) failed" in md and "run 4 (candidate) failed" in md
    kept = (out / "logs" / "certify-02-candidate.txt").read_text()
    assert "the fake trainer crashes" in kept and "exit code 1" in kept
    ledger = json.loads((out / "certify.json").read_text())
    assert [r["status"] for r in ledger["runs"]] == ["finished", "failed"] * 2
    assert ledger["runs"][1]["error"] == "exit code 1; no runs.jsonl line"
    assert "- run 2 (candidate) failed: exit code 1; no runs.jsonl line (log `logs/certify-02-candidate.txt`" in md
    assert _standalone(out) == _section(md)
    assert len(_worktrees(repo)) == 1


def test_resume_continues_an_interrupted_certification(toy, monkeypatch, capsys, tmp_path, fast_launcher):
    repo, commits = toy
    out = tmp_path / "cert"
    real = certify.run_process
    calls = []

    def interrupted_at_third(cmd, cwd, env, out_path):
        calls.append(cmd)
        rc = real(cmd, cwd, env, out_path)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return rc

    monkeypatch.setattr(certify, "run_process", interrupted_at_third)
    assert _certify(repo, monkeypatch, commits["baseline"], commits["fast"], out, runs=2) == 130
    ledger = json.loads((out / "certify.json").read_text())
    assert [(r["index"], r["status"]) for r in ledger["runs"]] == [(0, "finished"), (1, "finished"), (2, "interrupted")]
    assert "**INCOMPLETE**" in (out / "statistics.md").read_text()
    assert len(_worktrees(repo)) == 1

    monkeypatch.setattr(certify, "run_process", real)
    assert _certify(repo, monkeypatch, commits["baseline"], commits["fast"], out, runs=3, extra=["--resume"]) == 2
    assert "runs_per_group" in capsys.readouterr().err  # a different plan is refused
    assert _certify(repo, monkeypatch, commits["baseline"], commits["fast"], out, runs=2, extra=["--resume"]) == 0
    ledger = json.loads((out / "certify.json").read_text())
    assert sorted(r["index"] for r in ledger["runs"]) == [0, 1, 2, 3]
    assert all(r["status"] == "finished" for r in ledger["runs"])
    assert [a["index"] for a in ledger["interrupted_attempts"]] == [2]
    rerun = next(r for r in ledger["runs"] if r["index"] == 2)
    assert (rerun["console"], ledger["interrupted_attempts"][0]["console"]) == ("console/03-baseline-2.txt",
                                                                               "console/03-baseline.txt")
    assert rerun["log"] != ledger["interrupted_attempts"][0]["log"]
    md = (out / "statistics.md").read_text()
    assert "Interrupted by the operator" in md and ledger["interrupted_attempts"][0]["log"] in md
    assert _stats_row(md, "baseline")[1:5] == ["2", "2", "0", "2"]
    assert _standalone(out) == _section(md)
    assert len(_worktrees(repo)) == 1


@pytest.mark.parametrize("train_args, env, needle", [
    (["--data-path", "../shards", "--seed", "1"], {}, "not independent"),
    (["--data-path", "../shards"], {"TRAIN_SEED": "3"}, "TRAIN_SEED"),
    (["--data-path", "../shards", "--label", "x"], {}, "--label"),
    (["--max-steps", "3"], {"DATA_PATH": ""}, "--data-path"),
    (["--data-path", "../shards", "--see", "1"], {}, "must not hold --see (--seed)"),  # argparse's abbreviation
    (["--data-path", "../shards", "--rec=x"], {}, "must not hold --rec (--records-dir)"),
])
def test_refusals(toy, monkeypatch, capsys, tmp_path, train_args, env, needle):
    repo, commits = toy
    monkeypatch.chdir(repo)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    rc = certify.main(["--baseline", commits["baseline"], "--candidate", commits["fast"], "--runs", "2",
                       "--out", str(tmp_path / "cert"), "--", *train_args])
    assert rc == 2 and needle in capsys.readouterr().err
    assert not (tmp_path / "cert").exists()


def test_refuses_unknown_and_identical_revisions(toy, monkeypatch, capsys):
    repo, commits = toy
    monkeypatch.chdir(repo)
    base = ["--runs", "2", "--dry-run", "--", "--data-path", "../shards"]
    assert certify.main(["--baseline", "no-such-rev", "--candidate", "HEAD", *base]) == 2
    assert "--baseline 'no-such-rev' is not a commit" in capsys.readouterr().err
    assert certify.main(["--baseline", "HEAD", "--candidate", commits["slow"], *base]) == 2
    assert "same commit" in capsys.readouterr().err


def test_through_torchrun(toy, monkeypatch, tmp_path):
    repo, commits = toy
    out = tmp_path / "cert"
    assert _certify(repo, monkeypatch, commits["baseline"], commits["fast"], out, runs=2) == 0
    ledger = json.loads((out / "certify.json").read_text())
    assert [r["status"] for r in ledger["runs"]] == ["finished"] * 4
    assert "torch.distributed.run" in " ".join(certify.train_command(ledger["plan"], "baseline", out))
    assert _standalone(out) == _section((out / "statistics.md").read_text())
    assert len(_worktrees(repo)) == 1


def test_ctrl_c_stops_after_recording_the_interrupted_run(toy, tmp_path):
    repo, commits = toy
    out = tmp_path / "cert"
    env = {**os.environ, "PYTHONPATH": str(Path(certify.__file__).resolve().parents[1])}
    proc = subprocess.Popen([sys.executable, "-m", "records.certify", "--baseline", commits["baseline"],
                             "--candidate", commits["slow"], "--runs", "2", "--nproc", "1", "--out", str(out), "--",
                             "--data-path", "../shards"], cwd=repo, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            # a terminal's SIGINT: in the full suite something in the pytest process leaves
                            # SIGINT ignored, a child inherits that, and certify then slept through the Ctrl-C
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    console = out / "console" / "02-candidate.txt"
    deadline = time.monotonic() + 180  # hang guards, not timings: a loaded 2-core CI machine took over 60 s
    while not (console.is_file() and "fake trainer sleeping" in console.read_text()):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.1)
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=300)  # the write-up after the interrupt draws curves.png too
    assert proc.returncode == 130, stderr
    assert "--resume" in stderr
    ledger = json.loads((out / "certify.json").read_text())
    assert [(r["label"], r["status"]) for r in ledger["runs"]] == [("baseline", "finished"),
                                                                   ("candidate", "interrupted")]
    md = (out / "statistics.md").read_text()
    assert "**INCOMPLETE**" in md and "run 2 (candidate) interrupted" in md
    assert len(_worktrees(repo)) == 1


# ------------------------------------------------------------------------------------------------
# an ablation: each side's own train_gpt.py arguments and environment, on one revision
# ------------------------------------------------------------------------------------------------

ABLATION = ["--candidate-args", "--set features.ngram=false --set 'model.note=two words'",
            "--candidate-env", "SPEEDRUN_CUDA_GRAPHS=0", "--baseline-env", "SPEEDRUN_COMPILE=0"]


def _exit_code(argv):
    try:
        return certify.main(argv)
    except SystemExit as e:  # a command-line refusal (cli.exit_on_config_error)
        return e.code


def test_ablation_runs_each_side_with_its_own_args_and_env(toy, monkeypatch, capsys, tmp_path, fast_launcher):
    repo, commits = toy
    fast, out = commits["fast"], tmp_path / "cert"
    for name in ("SPEEDRUN_CUDA_GRAPHS", "SPEEDRUN_COMPILE"):
        monkeypatch.delenv(name, raising=False)
    real, calls = certify.run_process, []

    def recorded(cmd, cwd, env, out_path):
        calls.append((cmd, Path(cwd), env))
        return real(cmd, cwd, env, out_path)

    monkeypatch.setattr(certify, "run_process", recorded)
    assert _certify(repo, monkeypatch, fast, fast, out, runs=2, extra=ABLATION) == 0

    shards, records = str((repo.parent / "shards").resolve()), str(out.resolve())
    shared = [sys.executable, "train_gpt.py", "--data-path", shards, "--max-steps", "3"]
    expected = {"baseline": [*shared, "--label", "baseline", "--records-dir", records],
                "candidate": [*shared, "--set", "features.ngram=false", "--set", "model.note=two words",
                              "--label", "candidate", "--records-dir", records]}
    assert [cmd for cmd, _, _ in calls] == [expected["baseline"], expected["candidate"]] * 2
    base_env, cand_env = calls[0][2], calls[1][2]
    assert base_env == {**os.environ, "SPEEDRUN_COMPILE": "0"}
    assert cand_env == {**os.environ, "SPEEDRUN_CUDA_GRAPHS": "0"}
    assert [cwd.name for _, cwd, _ in calls[:2]] == [f"baseline-{fast[:12]}", f"candidate-{fast[:12]}"]
    assert "fake env SPEEDRUN_CUDA_GRAPHS = 0" in (out / "console" / "02-candidate.txt").read_text()
    assert "fake env SPEEDRUN_CUDA_GRAPHS = None" in (out / "console" / "01-baseline.txt").read_text()

    runs = [json.loads(line) for line in (out / "runs.jsonl").read_text().splitlines()]
    assert [(r["label"], r["git_commit"], r["overrides"]) for r in runs] == \
        [("baseline", fast, None), ("candidate", fast, ["features.ngram=false", "model.note=two words"])] * 2

    md = (out / "statistics.md").read_text()
    base_line = (f"- baseline: `{fast}` fake trainer: fast (`{fast}`); its own train_gpt.py arguments: none; "
                 f"its own environment: `SPEEDRUN_COMPILE=0`")
    cand_line = (f"- candidate: `{fast}` fake trainer: fast (`{fast}`); its own train_gpt.py arguments: "
                 f"`--set features.ngram=false --set 'model.note=two words'`; its own environment: "
                 f"`SPEEDRUN_CUDA_GRAPHS=0`")
    assert base_line in md.splitlines() and cand_line in md.splitlines()
    # the switches reached the runs: the fake adds 0.002 to the loss (--set) and 100 ms (SPEEDRUN_CUDA_GRAPHS=0)
    assert _stats_row(md, "baseline")[5:7] == ["0.895 ± 0.007", "3.27375 ± 0.00035"]
    assert _stats_row(md, "candidate")[5:7] == ["0.995 ± 0.007", "3.27575 ± 0.00035"]
    cmp = _stats_row(md, "candidate − baseline")
    assert (cmp[1], cmp[3]) == ("+0.100", "+0.00200")
    assert _standalone(out) == _section(md)

    readme = (out / "README.md").read_text()
    assert base_line in readme.splitlines() and cand_line in readme.splitlines()
    assert "# candidate\n" + shlex.join(["SPEEDRUN_CUDA_GRAPHS=0", *expected["candidate"]]) + "\n" in readme
    assert "# baseline\n" + shlex.join(["SPEEDRUN_COMPILE=0", *expected["baseline"]]) + "\n" in readme
    # the reproduce command names both sides' own args and env: it parses back to this plan
    line = readme[readme.index("python -m records.certify"):]
    words = shlex.split(line[:line.index("\n```")].replace("\\\n", " "))
    args, train_args = certify.parse_args(words[3:])
    assert (args.baseline, args.candidate, train_args) == (fast, fast, ["--data-path", shards, "--max-steps", "3"])
    assert args.sides == {"baseline": {"args": [], "env": {"SPEEDRUN_COMPILE": "0"}},
                          "candidate": {"args": ["--set", "features.ngram=false", "--set", "model.note=two words"],
                                        "env": {"SPEEDRUN_CUDA_GRAPHS": "0"}}}
    assert len(_worktrees(repo)) == 1

    # a resume with another side's args is another plan: refused
    capsys.readouterr()
    assert _certify(repo, monkeypatch, fast, fast, out, runs=2,
                    extra=[*ABLATION[:1], "--set features.ngram=true", *ABLATION[2:], "--resume"]) == 2
    assert "the plan differs" in capsys.readouterr().err


def test_ablation_without_revisions_runs_head_on_both_sides(toy, monkeypatch, capsys, tmp_path):
    repo, commits = toy
    head, out = commits["slow"], tmp_path / "cert"  # the toy repository's HEAD
    monkeypatch.chdir(repo)
    argv = ["--runs", "2", "--nproc", "1", "--candidate-args", "--set features.ngram=false", "--candidate-env",
            "SPEEDRUN_CUDA_GRAPHS=0", "--out", str(out), "--dry-run", "--", "--data-path", "../shards"]
    assert certify.main(argv) == 0
    printed, err = capsys.readouterr()
    assert "note:" not in err
    shards = str((repo.parent / "shards").resolve())
    launcher = f"{shlex.quote(sys.executable)} -m torch.distributed.run --standalone --nproc_per_node=1 train_gpt.py"
    expected = {
        "baseline": f"cd $WORKTREES/baseline-{head[:12]} && {launcher} --data-path {shards} --label baseline "
                    f"--records-dir {out}",
        "candidate": f"cd $WORKTREES/candidate-{head[:12]} && SPEEDRUN_CUDA_GRAPHS=0 {launcher} --data-path {shards} "
                     f"--set features.ngram=false --label candidate --records-dir {out}"}
    lines = printed.splitlines()
    assert [line for line in lines if line.startswith("run ")] == \
        [f"run {i + 1}/4 {label}: {expected[label]}" for i, label in enumerate(["baseline", "candidate"] * 2)]
    name = f"{head[:8]}-vs-{head[:8]}_SPEEDRUN_CUDA_GRAPHS-0-set-features.ngram-false"
    assert lines[0] == f"certification {name} -> {out} (dry run: nothing runs)"
    assert any(line.strip().startswith(f"candidate: `{head}` fake trainer: slow (`HEAD`); its own train_gpt.py "
                                       f"arguments: `--set features.ngram=false`; its own environment: "
                                       f"`SPEEDRUN_CUDA_GRAPHS=0`") for line in lines)
    assert not out.exists()

    trainer = repo / "train_gpt.py"  # an uncommitted edit is not what the runs run: said, not refused
    text = trainer.read_text()
    trainer.write_text(text + "# an uncommitted edit\n")
    try:
        assert certify.main(argv) == 0
    finally:
        trainer.write_text(text)
    assert f"note: the checkout has uncommitted changes; the baseline and candidate run commit {head[:12]} (HEAD)" \
        in capsys.readouterr().err


@pytest.mark.parametrize("sides, env, needle", [
    ([], {}, "nothing to compare"),  # both HEAD, nothing of their own
    (["--baseline-args", "--set a.b=1", "--candidate-args", "--set a.b=1"], {}, "nothing to compare"),
    (["--candidate-env", "SPEEDRUN_COMPILE=0"], {"SPEEDRUN_COMPILE": "0"}, "nothing to compare"),  # already so
    (["--candidate-args", "--set 'features.ngram=false"], {},
     "does not split like a shell line (No closing quotation)"),
    (["--candidate-env", "SPEEDRUN_CUDA_GRAPHS"], {}, "--candidate-env 'SPEEDRUN_CUDA_GRAPHS': expected NAME=VALUE"),
    (["--baseline-env", "1X=0"], {}, "--baseline-env '1X=0': expected NAME=VALUE"),
    (["--candidate-env", "A=1", "--candidate-env", "A=2"], {}, "--candidate-env sets A twice"),
    (["--candidate-args", "--seed 1"], {}, "--candidate-args must not hold --seed (--seed)"),
    (["--candidate-args", "--see=1"], {}, "--candidate-args must not hold --see (--seed)"),
    (["--baseline-args", "--data-path /tmp"], {}, "--baseline-args must not hold --data-path (--data-path)"),
    (["--candidate-args", "--label x"], {}, "--candidate-args must not hold --label (--label)"),
    (["--candidate-env", "TRAIN_SEED=1"], {}, "--candidate-env TRAIN_SEED=...: a side must not set TRAIN_SEED"),
    (["--baseline-env", "DATA_PATH=/tmp"], {}, "a side must not set DATA_PATH"),
    # many sides: two the same are refused, naming both; a side's name, and flags naming no side
    (["--side", "a"], {}, "--baseline 'HEAD' and --side a (revision 'HEAD') are the same commit"),
    (["--side", "a", "--side-args", "a=--set x.y=1", "--side", "b", "--side-args", "b=--set x.y=1"], {},
     "the sides a and b differ in no argument or environment variable: nothing to compare"),
    (["--candidate-env", "SPEEDRUN_COMPILE=1", "--side", "c", "--side-env", "c=SPEEDRUN_COMPILE=0"],
     {"SPEEDRUN_COMPILE": "0"}, "--baseline 'HEAD' and --side c (revision 'HEAD') are the same commit"),
    (["--side", "a", "--side-rev", "a=no-such-rev"], {}, "--side a (revision 'no-such-rev') is not a commit"),
    (["--side", "two words"], {}, "--side 'two words': a side's name labels its runs"),
    (["--side", "Baseline"], {}, "--side Baseline: the baseline and the candidate have flags of their own"),
    (["--side", "a", "--side", "A"], {}, "--side A is given twice"),
    (["--side", "a", "--side-args", "b=--set x.y=1"], {}, "--side-args 'b=--set x.y=1': expected NAME=ARGS"),
    (["--side", "a", "--side-args", "--set x.y=1"], {}, "--side-args '--set x.y=1': expected NAME=ARGS"),
    (["--side", "a", "--side-env", "a=1X=0"], {}, "--side-env a='1X=0': expected a=NAME=VALUE"),
    (["--side", "a", "--side-rev", "a=HEAD", "--side-rev", "a=HEAD~1"], {}, "--side-rev gives side a twice"),
    (["--side", "a", "--side-args", "a=--seed 1"], {}, "--side-args a must not hold --seed (--seed)"),
    (["--side", "a", "--side-env", "a=TRAIN_SEED=1"], {}, "--side-env a=TRAIN_SEED=...: a side must not set"),
    # the step sweep: well-formed counts, the candidate alone, no step count of the user's own
    (["--steps-sweep", "10,x"], {}, "--steps-sweep '10,x': expected base step counts"),
    (["--steps-sweep", "10,0"], {}, "--steps-sweep '10,0': expected base step counts"),
    (["--steps-sweep", "10,10"], {}, "--steps-sweep '10,10' gives 10 twice"),
    (["--steps-sweep", "10,20", "--side", "a"], {}, "--steps-sweep runs the candidate at each step count, and "
                                                   "does not combine with --side (a)"),
    (["--steps-sweep", "10,20", "--candidate-args", "--set schedule.base_steps=30"], {},
     "--candidate-args must not hold --set schedule.base_steps=30 with --steps-sweep"),
    (["--steps-sweep", "10,20", "--candidate-args", "--ste=5"], {},
     "--candidate-args must not hold --ste (--steps) with --steps-sweep"),
    (["--steps-sweep", "10,20", "--baseline-args", "--steps 20"], {},
     "--baseline 'HEAD' and --candidate 'HEAD' are the same commit"),  # the baseline may set steps: here, the same
])
def test_side_refusals(toy, monkeypatch, capsys, tmp_path, sides, env, needle):
    repo, _ = toy
    monkeypatch.chdir(repo)
    monkeypatch.delenv("SPEEDRUN_COMPILE", raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    rc = _exit_code(["--runs", "2", "--out", str(tmp_path / "cert"), *sides, "--", "--data-path", "../shards"])
    err = capsys.readouterr().err
    assert rc == 2 and needle in err, err
    assert err.count("\n") == 1 and err.startswith("python -m records.certify: error: ")  # one line
    assert not (tmp_path / "cert").exists()


def test_a_sides_args_are_the_next_word_whatever_it_looks_like():
    args, _ = certify.parse_args(["--runs", "2", "--candidate-args", "--no-warmup", "--baseline-args", "--val-every=0"])
    assert args.sides == {"baseline": {"args": ["--val-every=0"], "env": {}},
                          "candidate": {"args": ["--no-warmup"], "env": {}}}


# ------------------------------------------------------------------------------------------------
# many sides, and a step sweep: each against the one baseline, interleaved
# ------------------------------------------------------------------------------------------------


def _many_sides(commits):
    """A baseline and three others: the candidate at --steps 1050, and two sides of the fast revision."""
    return ["--baseline", commits["baseline"], "--candidate", commits["fast"], "--candidate-args", "--steps 1050",
            "--side", "ngram", "--side-rev", f"ngram={commits['fast']}", "--side-args", "ngram=--set features.ngram=false",
            "--side", "graphs", "--side-rev", f"graphs={commits['fast']}", "--side-args", "graphs=--steps 1050",
            "--side-env", "graphs=SPEEDRUN_CUDA_GRAPHS=0"]


def _run(repo, monkeypatch, out, argv, runs=2):
    monkeypatch.chdir(repo)
    monkeypatch.delenv("SPEEDRUN_CUDA_GRAPHS", raising=False)
    return certify.main([*argv, "--runs", str(runs), "--nproc", "1", "--name", "toy", "--out", str(out), "--",
                         "--data-path", "../shards", "--max-steps", "3"])


def _scipy_cells(losses, times, base_losses=None, base_times=None):
    """The statistics.md cells of one side, from scipy directly: p(loss < 3.28), and against the baseline
    the Welch p of time and of loss, each as the page prints it."""
    from scipy import stats
    cells = {"p": f"{stats.ttest_1samp(losses, 3.28, alternative='less').pvalue:.2e}"}
    if base_losses is not None:
        cells["p time"] = f"{stats.ttest_ind(times, base_times, equal_var=False).pvalue:.2e}"
        cells["p loss"] = f"{stats.ttest_ind(losses, base_losses, equal_var=False).pvalue:.2e}"
    return cells


def test_dry_run_with_three_sides_prints_the_interleaved_order(toy, monkeypatch, capsys, tmp_path):
    repo, commits = toy
    out = tmp_path / "cert"
    assert _run(repo, monkeypatch, out, [*_many_sides(commits), "--dry-run"]) == 0
    shards, b, f = str((repo.parent / "shards").resolve()), commits["baseline"][:12], commits["fast"][:12]
    launcher = f"{shlex.quote(sys.executable)} -m torch.distributed.run --standalone --nproc_per_node=1 train_gpt.py"
    shared, rec = f"--data-path {shards} --max-steps 3", f"--records-dir {out}"
    expected = {
        "baseline": f"cd $WORKTREES/baseline-{b} && {launcher} {shared} --label baseline {rec}",
        "candidate": f"cd $WORKTREES/candidate-{f} && {launcher} {shared} --steps 1050 --label candidate {rec}",
        "ngram": f"cd $WORKTREES/ngram-{f} && {launcher} {shared} --set features.ngram=false --label ngram {rec}",
        "graphs": f"cd $WORKTREES/graphs-{f} && SPEEDRUN_CUDA_GRAPHS=0 {launcher} {shared} --steps 1050 --label graphs "
                  f"{rec}"}
    order = ["baseline", "candidate", "ngram", "graphs"] * 2
    assert [line for line in capsys.readouterr().out.splitlines() if line.startswith("run ")] == \
        [f"run {i + 1}/8 {label}: {expected[label]}" for i, label in enumerate(order)]
    assert not out.exists()


def test_three_sides_each_get_statistics_a_verdict_and_a_colour(toy, monkeypatch, capsys, tmp_path, fast_launcher):
    repo, commits = toy
    out = tmp_path / "cert"
    drawn_groups = []
    real_plot = report.plot_curves
    monkeypatch.setattr(report, "plot_curves", lambda groups, path: drawn_groups.append(
        {k: len(v) for k, v in groups.items()}) or real_plot(groups, path))
    assert _run(repo, monkeypatch, out, _many_sides(commits)) == 0
    printed = capsys.readouterr().out
    order = ["baseline", "candidate", "ngram", "graphs"] * 2
    runs = [json.loads(line) for line in (out / "runs.jsonl").read_text().splitlines()]
    assert [r["label"] for r in runs] == order and sorted(p.name for p in (out / "console").iterdir()) == \
        [f"{i + 1:02d}-{label}.txt" for i, label in enumerate(order)]

    # the fake's numbers, by hand: each side's two runs are its mean − 0.0005 and its mean (10 ms less, and not)
    data = {"baseline": ([3.2745, 3.2750], [0.990, 1.000]),
            "candidate": ([3.2685, 3.2690], [0.935, 0.945]),  # --steps 1050: 3.2740 − 0.005, 900 ms × 1.05
            "ngram": ([3.2755, 3.2760], [0.890, 0.900]),  # --set features.ngram=false: + 0.002
            "graphs": ([3.2685, 3.2690], [1.035, 1.045])}  # --steps 1050 and SPEEDRUN_CUDA_GRAPHS=0: + 100 ms
    md = (out / "statistics.md").read_text()
    means = {"baseline": ("0.995 ± 0.007", "3.27475 ± 0.00035"), "candidate": ("0.940 ± 0.007", "3.26875 ± 0.00035"),
             "ngram": ("0.895 ± 0.007", "3.27575 ± 0.00035"), "graphs": ("1.040 ± 0.007", "3.26875 ± 0.00035")}
    for label, (losses, times) in data.items():
        row = _stats_row(md, label)
        assert row[1:7] == ["2", "2", "0", "2", *means[label]], row
        assert row[9] == _scipy_cells(losses, times)["p"]
        if label != "baseline":
            cells = _scipy_cells(losses, times, *data["baseline"])
            cmp = _stats_row(md, f"{label} − baseline")
            assert (cmp[2], cmp[4]) == (cells["p time"], cells["p loss"])
    assert _stats_row(md, "candidate − baseline")[1] == "-0.055" and _stats_row(md, "graphs − baseline")[1] == "+0.045"
    # the verdicts: the candidate passes (t = 45 on 1 df: p = 0.0071; 55 ms faster, p = 0.016); ngram is faster but
    # its loss is above the bar (t = 17: p = 0.019); graphs has the candidate's loss but is 45 ms slower
    verdicts = [line for line in md.splitlines() if line.startswith("- ") and "**" in line]
    assert [v.split(":")[0] + ":" + v.split(":")[1] for v in verdicts] == \
        ["- candidate: **PASS**", "- ngram: **FAIL**", "- graphs: **FAIL**"]
    assert "time" not in verdicts[1] and "val loss 3.27575" in verdicts[1]
    assert "val loss" not in verdicts[2] and "time +0.045 s vs baseline" in verdicts[2]
    assert [line for line in printed.splitlines() if line.startswith("- ")] == verdicts  # the console's summary
    # every side's line, the standalone script, the curves (one group, so one colour, per side)
    for label in ("ngram", "graphs"):
        assert any(line.startswith(f"- {label}: `{commits['fast']}` fake trainer: fast") for line in md.splitlines())
    assert _standalone(out) == _section(md)
    assert drawn_groups[-1] == {"baseline": 2, "candidate": 2, "ngram": 2, "graphs": 2}
    assert "8 training curve(s) of 8 finished run(s), one colour per side (baseline, candidate, ngram, graphs" in md
    readme = (out / "README.md").read_text()
    assert all(v in readme.splitlines() for v in verdicts)
    # the reproduce command parses back to the same sides
    line = readme[readme.index("python -m records.certify"):]
    args, _ = certify.parse_args(shlex.split(line[:line.index("\n```")].replace("\\\n", " "))[3:])
    assert [s["label"] for s in certify.side_specs(args)] == ["baseline", "candidate", "ngram", "graphs"]
    assert args.more_sides == {"ngram": {"rev": commits["fast"], "args": ["--set", "features.ngram=false"], "env": {}},
                               "graphs": {"rev": commits["fast"], "args": ["--steps", "1050"],
                                          "env": {"SPEEDRUN_CUDA_GRAPHS": "0"}}}
    assert args.sides["candidate"]["args"] == ["--steps", "1050"] and args.candidate == commits["fast"]
    assert len(_worktrees(repo)) == 1


def _sweep(commits, steps):
    return ["--baseline", commits["baseline"], "--candidate", commits["fast"], "--steps-sweep", steps]


def test_steps_sweep_dry_run_lists_every_run(toy, monkeypatch, capsys, tmp_path):
    repo, commits = toy
    out = tmp_path / "cert"
    assert _run(repo, monkeypatch, out, [*_sweep(commits, "1100,1050"), "--candidate-env", "SPEEDRUN_COMPILE=0",
                                         "--dry-run"]) == 0
    shards, b, f = str((repo.parent / "shards").resolve()), commits["baseline"][:12], commits["fast"][:12]
    launcher = f"{shlex.quote(sys.executable)} -m torch.distributed.run --standalone --nproc_per_node=1 train_gpt.py"
    shared = f"--data-path {shards} --max-steps 3"
    expected = {"baseline": f"cd $WORKTREES/baseline-{b} && {launcher} {shared} --label baseline --records-dir {out}"}
    for n in (1100, 1050):
        expected[f"steps{n}"] = (f"cd $WORKTREES/steps{n}-{f} && SPEEDRUN_COMPILE=0 {launcher} {shared} --steps {n} "
                                 f"--label steps{n} --records-dir {out}")
    order = ["baseline", "steps1100", "steps1050"] * 2
    assert [line for line in capsys.readouterr().out.splitlines() if line.startswith("run ")] == \
        [f"run {i + 1}/6 {label}: {expected[label]}" for i, label in enumerate(order)]
    assert not out.exists()


@pytest.mark.parametrize("steps, fewest", [
    ("1100,1050", "1050"),  # both meet the bar (t = 45 and 65 on 1 df); 1050 is the fewer
    ("900,1000", None),  # 3.2840 is above the target; 3.2740 below it, but t = 24 on 1 df: p = 0.013
])
def test_steps_sweep_names_the_fewest_steps_that_meet_the_bar(toy, monkeypatch, capsys, tmp_path, fast_launcher,
                                                              steps, fewest):
    repo, commits = toy
    out = tmp_path / "cert"
    # CI time: the curves are the many-sides test's business (matplotlib draws each picture in about a second)
    monkeypatch.setattr(certify, "write_curves", lambda out_dir, rows, labels: "(no curves: a test)")
    assert _run(repo, monkeypatch, out, _sweep(commits, steps)) == 0
    printed = capsys.readouterr().out
    counts = [int(n) for n in steps.split(",")]
    ledger = json.loads((out / "certify.json").read_text())
    assert ledger["plan"]["order"] == ["baseline", *(f"steps{n}" for n in counts)] * 2
    runs = [json.loads(line) for line in (out / "runs.jsonl").read_text().splitlines()]
    assert [r["git_commit"] for r in runs] == [commits["baseline"], commits["fast"], commits["fast"]] * 2
    md = (out / "statistics.md").read_text()
    sweep = md[md.index("## Step sweep"):]
    for n in sorted(counts):  # the fake: 3.2740 + 0.0001 (1000 − n), its runs that − 0.0005 and that
        mean = 3.2740 + 0.0001 * (1000 - n)
        row = _stats_row(sweep, str(n))
        p = _scipy_cells([round(mean - 0.0005, 4), round(mean, 4)], None)["p"]
        assert row == [str(n), f"steps{n}", "2/2", f"{mean - 0.00025:.5f} ± 0.00035", p,
                       "yes" if n in (1050, 1100) else "no"], row
    conclusion = sweep.rstrip().splitlines()[-1]
    if fewest:
        assert conclusion.startswith(f"**Fewest steps that meet the bar: {fewest}** (steps{fewest}: runs 3, 6; "
                                     f"mean val loss 3.26875 < 3.28, p = ")
    else:
        assert conclusion == ("**No step count met the bar**: none of 900, 1000 steps had every run finished and a "
                              "mean val loss below 3.28 at p < 0.01.")
    assert printed.splitlines()[-2] == conclusion  # the console's summary (then the files written)
    assert conclusion in (out / "README.md").read_text().splitlines()
    if fewest:  # the standalone script names the same fewest steps (once: it imports scipy, a second of CI)
        assert _standalone(out) == _section(md)
    assert "\t".join(["2", f"steps{counts[0]}", commits["fast"], "finished"]) in (out / "runs.tsv").read_text()
    assert len(_worktrees(repo)) == 1


def test_a_v1_ledger_is_read_and_an_unknown_one_refused(tmp_path):
    plan = {"name": "x", "repo": "/r", "runs_per_group": 2, "nproc": 1, "train_args": [],
            "baseline": {"rev": "HEAD", "commit": "a" * 40, "subject": "s", "args": [], "env": {}},
            "candidate": {"rev": "HEAD", "commit": "a" * 40, "subject": "s", "args": ["--x"], "env": {}},
            "order": ["baseline", "candidate"] * 2}
    (tmp_path / "certify.json").write_text(json.dumps({"version": 1, "plan": plan, "runs": [],
                                                        "interrupted_attempts": []}))
    ledger = certify.load_ledger(tmp_path)
    assert ledger["version"] == 2 and list(ledger["plan"]["sides"]) == ["baseline", "candidate"]
    assert ledger["plan"]["sides"]["candidate"]["args"] == ["--x"] and "baseline" not in ledger["plan"]
    (tmp_path / "certify.json").write_text(json.dumps({"version": 99, "plan": plan}))
    with pytest.raises(certify.CertifyError, match="has version 99, expected 2"):
        certify.load_ledger(tmp_path)
