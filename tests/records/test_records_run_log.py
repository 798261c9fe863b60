"""The run log: full source capture, git and environment header, upstream line formats."""
import re
import sys
import types
from pathlib import Path

import pytest

from records.run_log import (_STEP_RE, REPO_ROOT, RunLog, format_peak_memory_line, format_step_line,
                             format_val_line, parse_log)
from runtime.source import run_source_files


def test_log_holds_the_imported_project_modules_and_parses_back(tmp_path):
    with RunLog("test-run", logs_dir=tmp_path, console=False) as log:
        for step in (25, 50, 99, 100):
            log.print0(format_step_line(step, 100, step * 17.5))
        log.print0(format_val_line(100, 100, 3.27741, 1750.4))
        log.print0(format_peak_memory_line(53424.2, 65224.0))
    text = (tmp_path / "test-run.txt").read_text()

    # The project modules this process imported (found here from sys.modules' own files), less tests
    # and tools: this test module is imported, and must not be embedded.
    imported = {Path(m.__file__).resolve() for m in list(sys.modules.values())
                if isinstance(getattr(m, "__file__", None), str) and m.__file__.endswith(".py")}
    expected = sorted(p.relative_to(REPO_ROOT).as_posix() for p in imported
                      if p.is_relative_to(REPO_ROOT) and p.is_file() and p.relative_to(REPO_ROOT).parts[0] != "tests"
                      and p.relative_to(REPO_ROOT).parts[0] != "tools")
    parsed = parse_log(text)
    assert sorted(parsed.sources) == expected
    assert "records/run_log.py" in parsed.sources and Path(__file__).resolve() in imported
    assert not any(name.startswith("tests/") for name in parsed.sources)
    assert (REPO_ROOT / "records" / "run_log.py").read_text() in text
    size = sum((REPO_ROOT / name).stat().st_size for name in expected)
    assert f"\nsource: {len(expected)} files, {size:,} bytes embedded (" in text

    assert "git commit: " in text and "Running PyTorch" in text and "Running Python" in text
    assert "Running Triton version" in text
    assert parsed.steps == [(25, 100, 438), (50, 100, 875), (99, 100, 1732), (100, 100, 1750)]
    assert parsed.vals == [(100, 100, 3.2774, 1750)]
    assert parsed.peak_memory_mib == (53424, 65224)


def test_run_source_leaves_out_tests_tools_venvs_and_other_files(tmp_path, monkeypatch):
    root = tmp_path / "repo"
    files = ["train_gpt.py", "model/gpt.py", "tests/test_x.py", "tools/cost.py", ".venv/lib/x.py",
             "venv/lib/python3.12/site-packages/pkg/mod.py", "model/__pycache__/gpt.py", "notes.txt"]
    for name in files:
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(f"# {name}\n")
    (tmp_path / "elsewhere.py").write_text("")
    modules = {name: types.SimpleNamespace(__file__=str(root / name)) for name in files}
    modules["outside"] = types.SimpleNamespace(__file__=str(tmp_path / "elsewhere.py"))
    modules["builtin"] = types.SimpleNamespace()                                      # no __file__
    modules["gone"] = types.SimpleNamespace(__file__=str(root / "deleted.py"))         # not on disk
    monkeypatch.chdir(root)
    modules["__main__"] = types.SimpleNamespace(__file__="train_gpt.py")               # relative, as run
    found = [p.relative_to(root.resolve()).as_posix() for p in run_source_files(root, modules)]
    assert found == ["model/gpt.py", "train_gpt.py"]


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
    """The curve points (`step:s/N train_loss:x`, runtime/loss_watch.py) sit among a record log's lines;
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
