"""The self-contained run log: `records/logs/<run_id>.txt`, written by rank 0 of every run.

A log holds everything needed to trust and reproduce a run (upstream convention, record #360):
  1. the source of the project's modules the run imported (as upstream embeds the code its run
     executed), each after a path header, and a line saying how many files and bytes;
  2. the git commit and whether the tree was dirty;
  3. an environment header (Python, PyTorch, CUDA, Triton, devices, `nvidia-smi`);
  4. the run's own lines in the upstream formats (see `format_step_line` and friends), which
     `parse_log` reads back for the records report.

One buffered handle (1 MiB, record #360) is opened once; it is flushed where the clock is stopped
(the caller calls `flush()`), at interpreter exit, and when the `with` block exits on an exception.
On ranks other than 0 the log is disabled and every method is a no-op, so call sites need no `if`.
"""
from __future__ import annotations

import atexit
import contextlib
import os
import platform
import re
import shutil
import subprocess
import sys
import traceback
from dataclasses import dataclass, field
from pathlib import Path

from records.statistics import VAL_RE
from runtime.source import SOURCE_RULE, format_source_line, read_source, run_source_files

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_LOGS_DIR = REPO_ROOT / "records" / "logs"

LOG_BUFFER_BYTES = 1 << 20  # record #360: one buffered handle, 1 MiB
ENV_RULE = "=" * 100  # record #360 run_log: 100 '=' around the environment header

# ------------------------------------------------------------------------------------------------
# The upstream line formats (record #360: track_1_short/run_log.py). Writers and parsers sit side by side so they agree.
# ------------------------------------------------------------------------------------------------


def format_step_line(step: int, total_steps: int, train_time_ms: float, tokens_per_s: float | None = None,
                     mfu: float | None = None, peak_fraction: float | None = None) -> str:
    """`step:{s}/{N} train_time:{ms:.0f}ms step_avg:{ms/s:.2f}ms`; `step` counts finished steps. Ours
    appends ` tokens/s:{:.0f}`, ` mfu:{:.1f}%` (the standard MFU: model FLOPs over the time at the bf16
    dense peak) and ` peak_fraction:{:.1f}%` (each kind at its own peak) when known (tools/cost.py
    RunCost): upstream's parsers, which search for the fields above, still read the line."""
    line = f"step:{step}/{total_steps} train_time:{train_time_ms:.0f}ms step_avg:{train_time_ms / max(step, 1):.2f}ms"
    if tokens_per_s is not None:
        line += f" tokens/s:{tokens_per_s:.0f}"
    if mfu is not None:
        line += f" mfu:{100 * mfu:.1f}%"
    if peak_fraction is not None:
        line += f" peak_fraction:{100 * peak_fraction:.1f}%"
    return line


def format_val_line(step: int, total_steps: int, val_loss: float, train_time_ms: float) -> str:
    """`step:{s}/{N} val_loss:{:.4f} train_time:{ms:.0f}ms step_avg:{:.2f}ms` (clock excludes val)."""
    return (f"step:{step}/{total_steps} val_loss:{val_loss:.4f} train_time:{train_time_ms:.0f}ms "
            f"step_avg:{train_time_ms / max(step, 1):.2f}ms")


def format_train_loss_line(step: int, total_steps: int, train_loss: float) -> str:
    """`step:{s}/{N} train_loss:{:.4f}`: a point of the training curve (runtime/loss_watch.py; every step
    with --log-train-loss). No `train_time:` field, so neither `_STEP_RE` nor upstream's step-line
    patterns take it for a step line; `parse_log` reads it into `train_losses`."""
    return f"step:{step}/{total_steps} train_loss:{train_loss:.4f}"


def format_peak_memory_line(allocated_mib: float, reserved_mib: float) -> str:
    return f"peak memory allocated: {allocated_mib:.0f} MiB reserved: {reserved_mib:.0f} MiB"


_STEP_RE = re.compile(r"^step:(\d+)/(\d+) train_time:(\d+)ms step_avg:([0-9.]+)ms(?: tokens/s:\d+)?(?: mfu:[0-9.]+%)?(?: peak_fraction:[0-9.]+%)?$")
_VAL_RE = VAL_RE  # records/statistics.py: one pattern for the log, the report and a certification folder
_TRAIN_LOSS_RE = re.compile(r"^step:(\d+)/(\d+) train_loss:([0-9.naif+-]+)$")
_PEAK_RE = re.compile(r"^peak memory allocated: (\d+) MiB reserved: (\d+) MiB$")


@dataclass
class ParsedLog:
    """What `parse_log` recovers from a log's run lines."""

    steps: list[tuple[int, int, int]] = field(default_factory=list)  # (step, total, train_time_ms)
    vals: list[tuple[int, int, float, int]] = field(default_factory=list)  # (step, total, loss, ms)
    train_losses: list[tuple[int, int, float]] = field(default_factory=list)  # (step, total, loss)
    peak_memory_mib: tuple[int, int] | None = None  # (allocated, reserved)
    sources: list[str] = field(default_factory=list)  # the path headers of the captured source


def parse_log(text: str) -> ParsedLog:
    parsed = ParsedLog()
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if m := _STEP_RE.match(line):
            parsed.steps.append((int(m[1]), int(m[2]), int(m[3])))
        elif m := _VAL_RE.match(line):
            parsed.vals.append((int(m[1]), int(m[2]), float(m[3]), int(m[4])))
        elif m := _TRAIN_LOSS_RE.match(line):
            parsed.train_losses.append((int(m[1]), int(m[2]), float(m[3])))
        elif m := _PEAK_RE.match(line):
            parsed.peak_memory_mib = (int(m[1]), int(m[2]))
        elif (line.startswith("# ") and 0 < i < len(lines) - 1
              and lines[i - 1] == SOURCE_RULE and lines[i + 1] == SOURCE_RULE):
            parsed.sources.append(line[2:])
    return parsed


# ------------------------------------------------------------------------------------------------
# What the header captures.
# ------------------------------------------------------------------------------------------------


def git_state(root: Path = REPO_ROOT) -> tuple[str, bool | None]:
    """(commit, dirty); ("unknown", None) outside a git checkout or without git."""
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True,
                                text=True, timeout=10, check=True).stdout.strip()
        status = subprocess.run(["git", "status", "--porcelain"], cwd=root, capture_output=True,
                                text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return "unknown", None
    return commit, bool(status.strip())


def device_names() -> list[str]:
    import torch

    if torch.cuda.is_available():
        return [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return [f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"]


# What decides how a hung NCCL collective ends (torch's defaults in parentheses): the watchdog tears
# the process down after the process group's timeout (train_gpt.py: collective_timeout_s) with async
# error handling 3; blocking wait would make every wait() a host sync, which the timed loop avoids.
COLLECTIVE_VARIABLES = (("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3: the watchdog tears the process down"),
                        ("TORCH_NCCL_BLOCKING_WAIT", "0"), ("TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC", "torch's default"),
                        ("TORCH_NCCL_DUMP_ON_TIMEOUT", "torch's default"),
                        ("TORCH_NCCL_TRACE_BUFFER_SIZE", "torch's default"))


def collective_settings() -> str:
    """One line: the collective-timeout variables as set, or torch's default, and any NCCL_* set."""
    parts = [f"{name}={os.environ[name]}" if name in os.environ else f"{name} unset ({default})"
             for name, default in COLLECTIVE_VARIABLES]
    parts += [f"{k}={v}" for k, v in sorted(os.environ.items()) if k.startswith("NCCL_")]
    return "Collective settings: " + ", ".join(parts)


def environment_header() -> str:
    import torch

    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = "not installed"
    lines = [
        ENV_RULE,
        f"Running Python {sys.version}",
        f"Running PyTorch {torch.__version__} compiled for CUDA {torch.version.cuda}",
        f"Running Triton version {triton_version}",
        f"Devices: {', '.join(device_names())}",
        collective_settings(),
    ]
    if shutil.which("nvidia-smi"):
        try:
            smi = subprocess.run(["nvidia-smi"], capture_output=True, text=True, timeout=30)
            lines.append(smi.stdout.rstrip())
        except (OSError, subprocess.SubprocessError) as e:
            lines.append(f"nvidia-smi failed: {e}")
    lines.append(ENV_RULE)
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------
# The log itself.
# ------------------------------------------------------------------------------------------------


def _echo(line: str) -> None:
    print(line, flush=True)


class RunLog:
    """Rank 0's log file. `RunLog(run_id, enabled=(rank == 0))`; use it as a context manager."""

    def __init__(self, run_id: str, logs_dir: Path | str = DEFAULT_LOGS_DIR, enabled: bool = True,
                 console: bool = True, root: Path = REPO_ROOT):
        self.run_id = run_id
        self.enabled = enabled
        self.console = console
        self.path = Path(logs_dir) / f"{run_id}.txt"
        self.git_commit, self.git_dirty = git_state(root) if enabled else ("unknown", None)
        self._file = None
        self.echo = _echo  # how a console line is shown (train_gpt.py routes it around its progress bar)
        if not enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.path.exists():
            raise FileExistsError(f"run log {self.path} already exists: run ids must be unique")
        self._file = open(self.path, "a", buffering=LOG_BUFFER_BYTES, encoding="utf-8")
        atexit.register(self.close)
        sources = run_source_files(root)
        self._file.write(read_source(sources, root) + "\n")
        self._file.write(format_source_line(sources) + "\n")
        self._file.write(f"git commit: {self.git_commit} dirty: {self.git_dirty}\n")
        self._file.write(environment_header() + "\n")
        if console:
            print(f"run log: {self.path}", flush=True)

    def print0(self, line: str, console: bool = False) -> None:
        """Append a line to the log; also print it when `console` (and the log prints at all)."""
        if not self.enabled:
            return
        self._file.write(line + "\n")
        if console and self.console:
            self.echo(line)

    def flush(self) -> None:
        if self._file is not None and not self._file.closed:
            self._file.flush()

    def close(self) -> None:
        if self._file is not None and not self._file.closed:
            self._file.close()

    def __enter__(self) -> RunLog:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.print0("".join(traceback.format_exception(exc_type, exc, tb)).rstrip())
        self.close()


class _NoBar:
    """The progress bar of a run that shows none."""

    def update(self, n: int = 1) -> None:
        pass


@contextlib.contextmanager
def progress_bar(steps: int, log: "RunLog", show: bool = True):
    """tqdm over the timed steps on stderr: steps/s and an ETA (show=False: a bar that draws
    nothing). The log's console lines go through tqdm.write meanwhile (stdout, the bar cleared and
    redrawn around them, so neither garbles the other); the log file never sees the bar."""
    if not show:
        yield _NoBar()
        return
    from tqdm import tqdm

    with tqdm(total=steps, unit="step", desc="training", file=sys.stderr, dynamic_ncols=True) as bar:
        echo, log.echo = log.echo, lambda line: tqdm.write(line, file=sys.stdout)
        try:
            yield bar
        finally:
            log.echo = echo
