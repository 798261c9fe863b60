"""Subprocess runs that start in the background as soon as collection selects a test that reads them.

Most tests run one thread (conftest's `single_thread`), so one of CI's two cores idles for most of a
`pytest` session. A test whose proof is a long subprocess (a torchrun, a cross-compile, a dry run of a
tool) registers that subprocess here, at import, with the tests that read it:

    background.register("smoke_run", __file__, ("test_learns", "test_traces_once"), _smoke_commands)

`conftest.pytest_collection_finish` queues every registered run one of whose tests was selected, in
the order of those tests, and one thread runs the queue, one run at a time, beside the tests. A test
asks for its run with `background.result(name)`: it waits for a run already started, or starts it itself
when the queue has not reached it yet (or never queued it: `pytest -k` on one test). Each run gets its
own temporary folder, removed at the end of the session. Runs are not niced: a niced run that a test
waits for crawls on a machine other work keeps busy (gpu_check's dry run: 342 s instead of about 75 s,
measured at a load average of 4), and on an idle machine the two cores are shared either way. A run's stdout and stderr go to
files in it (stderr merged into stdout with `merge_stderr`). What a test asserts is unchanged: only
when its subprocess runs moves.
"""
import os
import shutil
import signal
import subprocess
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

REPO_ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Job:
    name: str
    tests: set[tuple[Path, str]]                  # (test file, test function name): the tests that read it
    commands: Callable[[Path], list[list[str]]]   # its folder -> the commands, run in turn until one fails
    env: dict[str, str | None]                    # changes to os.environ (None removes a variable)
    merge_stderr: bool
    timeout_s: float
    started: bool = False
    done: threading.Event = field(default_factory=threading.Event)
    folder: Path | None = None
    proc: subprocess.Popen | None = None
    code: int | None = None
    stdout: str = ""
    stderr: str = ""


_JOBS: dict[str, Job] = {}
_LOCK = threading.Lock()
_worker: threading.Thread | None = None
_stopping = threading.Event()


def register(name: str, test_file: str, tests: tuple[str, ...], commands: Callable[[Path], list[list[str]]],
             env: dict[str, str | None] | None = None, merge_stderr: bool = False, timeout_s: float = 1800) -> None:
    """Declare the run `name` that the tests `tests` (function names) of `test_file` read. Idempotent:
    a module imported twice (as a test and by another test file) registers once."""
    if name not in _JOBS:
        _JOBS[name] = Job(name, {(Path(test_file).resolve(), t) for t in tests}, commands, dict(env or {}),
                          merge_stderr, timeout_s)


def queue(items) -> list[str]:
    """Start, in one background thread, each registered run one of whose tests is among `items` (the
    collected tests, in order), ordered by its first test. Returns the queued names."""
    global _worker
    first: dict[str, int] = {}
    for index, item in enumerate(items):
        key = (Path(item.path).resolve(), getattr(item, "originalname", None) or item.name)
        for job in _JOBS.values():
            if key in job.tests:
                first.setdefault(job.name, index)
    names = sorted(first, key=first.get)
    if names:
        _worker = threading.Thread(target=_run_queue, args=(names,), name="background-runs", daemon=True)
        _worker.start()
    return names


def _run_queue(names: list[str]) -> None:
    for name in names:
        if _stopping.is_set():
            return
        job = _claim(name)
        if job is not None:
            _run(job)


def _claim(name: str) -> Job | None:
    """The job, marked started, if nobody started it yet; else None."""
    with _LOCK:
        job = _JOBS[name]
        if job.started:
            return None
        job.started = True
        return job


def _run(job: Job) -> None:
    try:
        job.folder = Path(tempfile.mkdtemp(prefix=f"speedrun_{job.name}_"))
        env = {k: v for k, v in os.environ.items() if job.env.get(k, "") is not None}
        env.update({k: v for k, v in job.env.items() if v is not None})
        out_path, err_path = job.folder / "stdout.txt", job.folder / "stderr.txt"
        with open(out_path, "w") as out, open(err_path, "w") as err:
            for command in job.commands(job.folder):
                if _stopping.is_set():
                    job.code = -1
                    break
                # its own session: a timeout or the end of the session kills torchrun's ranks with it
                job.proc = subprocess.Popen(command, cwd=REPO_ROOT,
                                            env=env, stdout=out, stderr=subprocess.STDOUT if job.merge_stderr else err,
                                            text=True, start_new_session=True)
                try:
                    job.code = job.proc.wait(timeout=job.timeout_s)
                except subprocess.TimeoutExpired:
                    _kill(job.proc)
                    job.code = -1
                    err.write(f"\ntests/background.py: {job.name}: timed out after {job.timeout_s} s: {command}\n")
                if job.code != 0:
                    break
        job.stdout, job.stderr = out_path.read_text(), err_path.read_text()
    except Exception as error:  # noqa: BLE001 (reported to the test that reads the run)
        job.code, job.stderr = -1, f"{job.stderr}\ntests/background.py: {job.name}: {error!r}"
    finally:
        job.done.set()


def result(name: str) -> tuple[int | None, str, str, Path]:
    """(exit code of the last command run, stdout, stderr, its folder) of the run `name`: waits for it,
    or runs it here when the queue has not started it."""
    job = _claim(name)
    if job is not None:
        _run(job)
    job = _JOBS[name]
    job.done.wait()
    return job.code, job.stdout, job.stderr, job.folder


def _kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()


def stop() -> None:
    """At the end of the session: kill what still runs (a test interrupted or never reached) and
    remove every run's folder."""
    _stopping.set()
    for job in _JOBS.values():
        if job.proc is not None:
            _kill(job.proc)
    if _worker is not None:
        _worker.join(timeout=30)
    for job in _JOBS.values():
        if job.folder is not None:
            shutil.rmtree(job.folder, ignore_errors=True)
