"""runs.jsonl: concurrent appends stay whole lines; malformed lines are reported by number."""
import json
import multiprocessing as mp

import pytest

from records.runs_log import RunRecord, append_run, read_runs


def _writer(path, writer_id, n):
    payload = "x" * 6000  # larger than PIPE_BUF (4096): a plain unlocked write could be split
    for i in range(n):
        append_run({"run_id": f"{writer_id}-{i}", "status": "finished", "payload": payload}, path)


def test_two_processes_append_200_lines_each(tmp_path):
    path = tmp_path / "runs.jsonl"
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_writer, args=(str(path), w, 200)) for w in ("a", "b")]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
        assert p.exitcode == 0
    lines = path.read_text().splitlines()
    assert len(lines) == 400
    ids = {json.loads(line)["run_id"] for line in lines}  # every line parses on its own
    assert ids == {f"{w}-{i}" for w in "ab" for i in range(200)}


def test_record_round_trip_and_bad_lines(tmp_path):
    path = tmp_path / "runs.jsonl"
    rec = RunRecord(run_id="r1", started="2026-11-30T05:00:00+00:00", config="smoke", world_size=2,
                    device="cpu", git_commit="abc", git_dirty=False, status="failed",
                    log_path="records/logs/r1.txt", error="NaN loss at step 3 (main loss)")
    append_run(rec, path)
    with open(path, "a") as f:
        f.write("{not json\n[1, 2]\n")
    append_run({"run_id": "r2", "status": "finished"}, path)
    records, problems = read_runs(path)
    assert [r["run_id"] for r in records] == ["r1", "r2"]
    assert records[0]["error"] == "NaN loss at step 3 (main loss)"
    assert [lineno for lineno, _ in problems] == [2, 3]


def test_status_is_checked():
    with pytest.raises(ValueError, match="status"):
        RunRecord(run_id="r", started="", config="", world_size=1, device="", git_commit="",
                  git_dirty=None, status="done", log_path="")
