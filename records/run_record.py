"""One run's record keeping: its log file and its runs.jsonl line, whatever way the run ends.

    with RunRecorder(config="smoke", world_size=2, rank=rank, device="cpu") as rec:
        rec.log.print0("...", console=True)
        rec.progress(step=s, train_time_ms=ms)          # what a failure report will say
        rec.finish(val_loss=3.27, train_time_ms=39_900.0, steps=1194, peak_memory_mib=(53424, 65224))

Leaving the block appends exactly one runs.jsonl line on rank 0: `finished` after `finish()`,
`interrupted` on Ctrl-C, `failed` (with the error) on any exception or if `finish()` was never
called; a config.ConfigError is logged as the refusal's reasons, without a traceback. The exception still propagates; the log is flushed and closed first.
"""
from __future__ import annotations

from pathlib import Path

from config import ConfigError
from records.run_log import DEFAULT_LOGS_DIR, RunLog, device_names
from records.runs_log import DEFAULT_RUNS_PATH, RunRecord, append_run, new_run_id, now_iso


class RunRecorder:
    def __init__(self, config: str, world_size: int, rank: int = 0, device: str | None = None,
                 label: str = "", run_id: str | None = None, logs_dir: Path | str = DEFAULT_LOGS_DIR,
                 runs_path: Path | str = DEFAULT_RUNS_PATH, console: bool = True, overrides: list[str] | None = None,
                 proposal: str = ""):
        self.is_master = rank == 0
        self.runs_path = Path(runs_path)
        self.log = RunLog(run_id or new_run_id(), logs_dir=logs_dir, enabled=self.is_master, console=console)
        self.record = RunRecord(
            run_id=self.log.run_id, started=now_iso(), config=config, world_size=world_size,
            device=device or ", ".join(sorted(set(device_names()))), git_commit=self.log.git_commit,
            git_dirty=self.log.git_dirty, status="failed", log_path=str(self.log.path), label=label,
            overrides=overrides or None, proposal=proposal)
        self._finished = False

    def progress(self, step: int, train_time_ms: float | None = None) -> None:
        self.record.steps = step
        if train_time_ms is not None:
            self.record.train_time_ms = train_time_ms

    def finish(self, val_loss: float, train_time_ms: float, steps: int,
               peak_memory_mib: tuple[float, float] | None = None, tokens_per_s: float | None = None,
               mfu: float | None = None, peak_fraction: float | None = None) -> None:
        self.record.tokens_per_s, self.record.mfu, self.record.peak_fraction = tokens_per_s, mfu, peak_fraction
        self.record.val_loss = float(val_loss)
        self.record.train_time_ms = float(train_time_ms)
        self.record.steps = steps
        if peak_memory_mib is not None:
            self.record.peak_memory_allocated_mib, self.record.peak_memory_reserved_mib = peak_memory_mib
        self._finished = True

    def __enter__(self) -> RunRecorder:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None and self._finished:
            self.record.status = "finished"
        elif exc_type is not None and issubclass(exc_type, KeyboardInterrupt):
            self.record.status = "interrupted"
            self.record.error = f"interrupted (Ctrl-C) after step {self.record.steps}"
        elif exc_type is not None and issubclass(exc_type, ConfigError):  # refused up front: no traceback
            self.record.status = "failed"
            self.record.error = "refused before training: " + "; ".join(exc.problems)
            exc_type = exc = tb = None
        else:
            self.record.status = "failed"
            self.record.error = (f"{exc_type.__name__}: {exc}" if exc_type is not None
                                 else "the run ended without a final validation")
        if self.is_master:
            if self.record.error:
                self.log.print0(f"run {self.record.status}: {self.record.error}", console=True)
            self.log.__exit__(exc_type, exc, tb)  # flush, log the traceback (of a bug), close
            append_run(self.record, self.runs_path)
