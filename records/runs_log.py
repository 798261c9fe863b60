"""The append-only records log `records/runs.jsonl`: one JSON object per run, one line each.

Every run that started appends exactly one line when it ends: finished, failed or interrupted.
Fields (docs/records.md, "Logs and records"): run_id, started (ISO time), config, label, world_size,
device, git_commit, git_dirty, steps, train_time_ms, val_loss, peak_memory_allocated_mib,
peak_memory_reserved_mib, status, error, log_path; tokens_per_s (global tokens over the timed
training), mfu (runtime.throughput.RunCost: the model's FLOPs over the time at the device's bf16 dense peak,
the standard MFU) and peak_fraction (each kind of FLOP at its own peak, fp8 at the fp8 peak: the
fraction of the tensor-core floor reached), both null where the device's peak is unknown (a CPU);
overrides (train_gpt.py --set assignments, null when none); train_losses (--log-train-loss: every
step's loss); train_curve ([step, train_time_ms, loss] per training loss read: the curves of
`python -m records.report --curves`; absent from older lines).

Appends are atomic across processes: the whole line goes out in one write(2) on an O_APPEND
descriptor while holding an exclusive flock, so concurrent writers (several runs on one node, or
a crashed one) never tear or interleave a line, whatever its length.
"""
from __future__ import annotations

import datetime as _dt
import fcntl
import json
import os
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

from records.run_log import REPO_ROOT

DEFAULT_RUNS_PATH = REPO_ROOT / "records" / "runs.jsonl"
STATUSES = ("finished", "failed", "interrupted")


def new_run_id() -> str:
    return str(uuid.uuid4())  # upstream: run ids are uuid4


def now_iso() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


@dataclass
class RunRecord:
    run_id: str
    started: str
    config: str
    world_size: int
    device: str
    git_commit: str
    git_dirty: bool | None
    status: str
    log_path: str
    label: str = ""
    steps: int | None = None
    train_time_ms: float | None = None
    val_loss: float | None = None
    peak_memory_allocated_mib: float | None = None
    peak_memory_reserved_mib: float | None = None
    error: str | None = None
    tokens_per_s: float | None = None
    mfu: float | None = None  # model FLOPs / (time × bf16 dense peak)
    peak_fraction: float | None = None  # Σ FLOPs of each kind / its own peak, over the time
    overrides: list[str] | None = None  # train_gpt.py --set assignments (None: the preset as it is)
    train_losses: list[float] | None = None  # --log-train-loss: every step's training loss, full precision
    # the training curve: [steps done, train_time_ms, loss] per loss the run read (runtime/loss_watch.py:
    # every PRINT_EVERY-th step on a GPU, every step on CPU or with --log-train-loss); a failed run's
    # holds the points read before it stopped; None in lines written before it existed
    train_curve: list[list[float]] | None = None
    proposal: str = ""  # train_gpt.py --proposal NAME (config.PROPOSALS): the open PR the run reproduces

    def __post_init__(self):
        if self.status not in STATUSES:
            raise ValueError(f"RunRecord.status must be one of {STATUSES}, got {self.status!r}")


def append_run(record: RunRecord | dict, path: Path | str = DEFAULT_RUNS_PATH) -> None:
    """Append one record as one line, atomically with respect to other appending processes."""
    entry = asdict(record) if isinstance(record, RunRecord) else dict(record)
    data = (json.dumps(entry, sort_keys=False) + "\n").encode("utf-8")  # json.dumps never emits \n
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # a write(2) may be split above PIPE_BUF; the lock keeps it whole
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)  # closing releases the lock


def read_runs(path: Path | str = DEFAULT_RUNS_PATH) -> tuple[list[dict], list[tuple[int, str]]]:
    """(records, problems): every well-formed line, and (line number, why) for each skipped one."""
    records, problems = [], []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                entry = json.loads(line)
            except json.JSONDecodeError as e:
                problems.append((lineno, f"not valid JSON ({e.msg} at column {e.colno})"))
                continue
            if not isinstance(entry, dict):
                problems.append((lineno, f"expected a JSON object, got {type(entry).__name__}"))
                continue
            records.append(entry)
    return records, problems
