"""Long subprocess proofs, run once per pytest process and read by every test that needs them.

A test whose proof is a long subprocess (a torchrun, a cross-compile, a dry run of a tool) registers
that subprocess here, at import, with a name:

    long_runs.register("smoke_run", _smoke_commands, env=SMOKE_ENV, merge_stderr=True)

and asks for it with `long_runs.result(name)`: the first call runs it (its commands in turn, until one
fails) in a temporary folder of its own; later calls in the same process get the same result. The
folders are removed at the end of the session (conftest's `pytest_sessionfinish`).

The suite runs under pytest-xdist with `--dist loadfile` (pyproject.toml): every test of a file goes
to one worker, so the tests that read one run share it, and CI's two cores each run a worker. The
files whose runs are long are handed out first (conftest's `LONGEST_FILES_FIRST`), so no long run
starts last. Before issue 41's second pass a thread started these runs beside a single-process
session (one core idled); the workers now keep both cores busy, and the runs need no thread.
"""
import os
import shutil
import signal
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

REPO_ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Run:
    name: str
    commands: Callable[[Path], list[list[str]]]   # its folder -> the commands, run in turn until one fails
    env: dict[str, str | None]                    # changes to os.environ (None removes a variable)
    merge_stderr: bool
    timeout_s: float
    result: tuple[int | None, str, str, Path] | None = None


_RUNS: dict[str, Run] = {}


def register(name: str, commands: Callable[[Path], list[list[str]]], env: dict[str, str | None] | None = None,
             merge_stderr: bool = False, timeout_s: float = 1800) -> None:
    """Declare the run `name`. Idempotent: a module imported twice (as a test and by another test
    file) registers once."""
    _RUNS.setdefault(name, Run(name, commands, dict(env or {}), merge_stderr, timeout_s))


def result(name: str) -> tuple[int | None, str, str, Path]:
    """(exit code of the last command run, stdout, stderr, its folder) of the run `name`, run here on
    the first call. A command past its timeout is killed with its process group and reads as -1."""
    run = _RUNS[name]
    if run.result is None:
        run.result = _run(run)
    return run.result


def _run(run: Run) -> tuple[int | None, str, str, Path]:
    folder = Path(tempfile.mkdtemp(prefix=f"speedrun_{run.name}_"))
    env = {k: v for k, v in os.environ.items() if run.env.get(k, "") is not None}
    env.update({k: v for k, v in run.env.items() if v is not None})
    out_path, err_path = folder / "stdout.txt", folder / "stderr.txt"
    code = None
    with open(out_path, "w") as out, open(err_path, "w") as err:
        for command in run.commands(folder):
            # its own session: a timeout kills torchrun's ranks with it
            proc = subprocess.Popen(command, cwd=REPO_ROOT, env=env, stdout=out,
                                    stderr=subprocess.STDOUT if run.merge_stderr else err,
                                    text=True, start_new_session=True)
            try:
                code = proc.wait(timeout=run.timeout_s)
            except subprocess.TimeoutExpired:
                _kill(proc)
                code = -1
                err.write(f"\ntests/long_runs.py: {run.name}: timed out after {run.timeout_s} s: {command}\n")
            except BaseException:   # Ctrl-C or a failing session: the ranks go with it
                _kill(proc)
                raise
            if code != 0:
                break
    return code, out_path.read_text(), err_path.read_text(), folder


def _kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()


def cleanup() -> None:
    """At the end of the session: remove every run's folder."""
    for run in _RUNS.values():
        if run.result is not None:
            shutil.rmtree(run.result[3], ignore_errors=True)
