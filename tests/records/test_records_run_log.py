"""The run log: full source capture, git and environment header, upstream line formats."""
import re

import pytest

from records.run_log import (_STEP_RE, REPO_ROOT, RunLog, format_peak_memory_line, format_step_line,
                             format_val_line, parse_log)


def test_log_holds_every_project_py_file_and_parses_back(tmp_path):
    with RunLog("test-run", logs_dir=tmp_path, console=False) as log:
        for step in (25, 50, 99, 100):
            log.print0(format_step_line(step, 100, step * 17.5))
        log.print0(format_val_line(100, 100, 3.27741, 1750.4))
        log.print0(format_peak_memory_line(53424.2, 65224.0))
    text = (tmp_path / "test-run.txt").read_text()

    # Every .py file in the repository (found independently of the module's own walk) is present.
    expected = sorted(p.relative_to(REPO_ROOT).as_posix() for p in REPO_ROOT.rglob("*.py")
                      if not any(part.startswith(".") or part == "__pycache__" for part in p.relative_to(REPO_ROOT).parts))
    parsed = parse_log(text)
    assert sorted(parsed.sources) == expected
    assert "records/run_log.py" in parsed.sources
    assert (REPO_ROOT / "records" / "run_log.py").read_text() in text

    assert "git commit: " in text and "Running PyTorch" in text and "Running Python" in text
    assert "Running Triton version" in text
    assert parsed.steps == [(25, 100, 438), (50, 100, 875), (99, 100, 1732), (100, 100, 1750)]
    assert parsed.vals == [(100, 100, 3.2774, 1750)]
    assert parsed.peak_memory_mib == (53424, 65224)


def test_line_formats_match_upstream_text():
    # Hand-written strings in the upstream formats (record #360: track_1_short/run_log.py).
    assert format_step_line(25, 1194, 437.6) == "step:25/1194 train_time:438ms step_avg:17.50ms"
    # ours appends tokens/s, the standard MFU and the peak fraction; the parser still reads the line
    ours = format_step_line(25, 1194, 437.6, 8.0e6, 0.312, 0.201)
    assert ours == "step:25/1194 train_time:438ms step_avg:17.50ms tokens/s:8000000 mfu:31.2% peak_fraction:20.1%"
    assert _STEP_RE.match(ours).groups() == ("25", "1194", "438", "17.50")
    assert format_val_line(1194, 1194, 3.27741, 39846.2) == \
        "step:1194/1194 val_loss:3.2774 train_time:39846ms step_avg:33.37ms"
    assert format_peak_memory_line(53424, 65224) == "peak memory allocated: 53424 MiB reserved: 65224 MiB"


def test_exception_is_logged_and_flushed(tmp_path):
    with pytest.raises(RuntimeError):
        with RunLog("crash", logs_dir=tmp_path, console=False) as log:
            log.print0("step:1/10 train_time:5ms step_avg:5.00ms")
            raise RuntimeError("loss is nan at step 1")
    text = (tmp_path / "crash.txt").read_text()
    assert "RuntimeError: loss is nan at step 1" in text
    assert parse_log(text).steps == [(1, 10, 5)]


def test_buffered_until_flush(tmp_path):
    log = RunLog("buffered", logs_dir=tmp_path, console=False)
    size_before = (tmp_path / "buffered.txt").stat().st_size
    log.print0("x" * 100)
    log.flush()
    assert (tmp_path / "buffered.txt").stat().st_size > size_before
    log.close()


def test_disabled_on_other_ranks(tmp_path):
    log = RunLog("rank1", logs_dir=tmp_path, enabled=False)
    log.print0("anything", console=True)
    log.flush()
    log.close()
    assert not (tmp_path / "rank1.txt").exists()


def test_refuses_to_overwrite(tmp_path):
    RunLog("dup", logs_dir=tmp_path, console=False).close()
    with pytest.raises(FileExistsError, match="dup.txt"):
        RunLog("dup", logs_dir=tmp_path, console=False)


def test_a_record_log_with_training_loss_lines_still_parses_with_upstream_patterns(tmp_path):
    """The curve points (`step:s/N train_loss:x`, perf/loss_watch.py) sit among a record log's lines;
    upstream's patterns (unanchored searches, as its scripts run them: hand-written here) and ours
    read the step, val and memory lines as before, and ours reads the points too."""
    from records.run_log import format_train_loss_line

    with RunLog("record-format", logs_dir=tmp_path, console=False) as log:
        log.print0(format_val_line(0, 1194, 10.8258, 0.0))
        for step in (25, 50):
            log.print0(format_step_line(step, 1194, step * 33.4, 8.0e6, 0.31, 0.2))
            log.print0(format_train_loss_line(step, 1194, 4.0 + 1 / step))  # read after its step line
        log.print0(format_val_line(1194, 1194, 3.27741, 39846.2))
        log.print0(format_peak_memory_line(53424, 65224))
    text = (tmp_path / "record-format.txt").read_text()
    assert format_train_loss_line(25, 1194, 4.04) == "step:25/1194 train_loss:4.0400"

    run_lines = text[text.index("step:0/1194"):].splitlines()
    upstream_val = re.compile(r"step:(\d+)/(\d+) val_loss:([\d.]+) train_time:(\d+)ms")
    upstream_step = re.compile(r"step:(\d+)/(\d+) train_time:(\d+)ms step_avg:([\d.]+)ms")
    assert [m.groups() for m in map(upstream_val.search, run_lines) if m] == \
        [("0", "1194", "10.8258", "0"), ("1194", "1194", "3.2774", "39846")]
    assert [m.groups()[:3] for m in map(upstream_step.search, run_lines) if m] == \
        [("25", "1194", "835"), ("50", "1194", "1670")]
    parsed = parse_log(text)
    assert parsed.steps == [(25, 1194, 835), (50, 1194, 1670)]
    assert parsed.vals == [(0, 1194, 10.8258, 0), (1194, 1194, 3.2774, 39846)]
    assert parsed.peak_memory_mib == (53424, 65224)
    assert parsed.train_losses == [(25, 1194, 4.04), (50, 1194, 4.02)]
