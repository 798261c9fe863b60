"""RunRecorder: one runs.jsonl line per run with the right status, whatever way the run ends."""
import json

import pytest

from records.run_log import format_val_line
from records.run_record import RunRecorder
from runtime.loss_watch import NonFiniteLossError, check_finite


def _recorder(tmp_path, **kw):
    return RunRecorder(config="smoke", world_size=2, device="cpu", logs_dir=tmp_path / "logs",
                       runs_path=tmp_path / "runs.jsonl", console=False, **kw)


def _lines(tmp_path):
    return [json.loads(line) for line in (tmp_path / "runs.jsonl").read_text().splitlines()]


def test_finished_run(tmp_path):
    with _recorder(tmp_path, label="baseline") as rec:
        rec.log.print0(format_val_line(10, 10, 3.5, 1234.0))
        rec.finish(val_loss=3.5, train_time_ms=1234.0, steps=10, peak_memory_mib=(10, 20))
    (entry,) = _lines(tmp_path)
    assert entry["status"] == "finished" and entry["error"] is None
    assert (entry["val_loss"], entry["train_time_ms"], entry["steps"], entry["label"]) == (3.5, 1234.0, 10, "baseline")
    assert (entry["peak_memory_allocated_mib"], entry["peak_memory_reserved_mib"]) == (10, 20)
    assert entry["config"] == "smoke" and entry["world_size"] == 2
    assert "step:10/10 val_loss:3.5000" in open(entry["log_path"]).read()


def test_nan_loss_fails_the_run_naming_step_and_term(tmp_path):
    with pytest.raises(NonFiniteLossError, match="loss term 'mtp' is nan at step 7"):
        with _recorder(tmp_path) as rec:
            rec.progress(step=7, train_time_ms=70.0)
            check_finite(7, {"main": 3.0, "mtp": float("nan")})
    (entry,) = _lines(tmp_path)
    assert entry["status"] == "failed" and "loss term 'mtp' is nan at step 7" in entry["error"]
    assert entry["steps"] == 7
    assert "NonFiniteLossError" in open(entry["log_path"]).read()


def test_ctrl_c_is_interrupted(tmp_path):
    with pytest.raises(KeyboardInterrupt):
        with _recorder(tmp_path) as rec:
            rec.progress(step=3)
            raise KeyboardInterrupt
    (entry,) = _lines(tmp_path)
    assert entry["status"] == "interrupted" and entry["error"] == "interrupted (Ctrl-C) after step 3"


def test_run_without_final_validation_is_failed(tmp_path):
    with _recorder(tmp_path):
        pass
    assert _lines(tmp_path)[0]["error"] == "the run ended without a final validation"


def test_other_ranks_write_nothing(tmp_path):
    with _recorder(tmp_path, rank=1) as rec:
        rec.finish(val_loss=1.0, train_time_ms=1.0, steps=1)
    assert not (tmp_path / "runs.jsonl").exists() and not (tmp_path / "logs").exists()


def test_check_finite_accepts_finite_and_rejects_inf():
    check_finite(0, {"main": 10.8, "prefix": 0.0})
    with pytest.raises(NonFiniteLossError, match="'main' is inf at step 2"):
        check_finite(2, {"main": float("inf")})
