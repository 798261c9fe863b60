"""The n-gram table in host memory (perf/host_table.py): the same rows and updates as on the device.

HostRows against plain tensor indexing (gathers after write-backs see them: one worker thread,
submission order); a smoke run with the table in host memory trains bitwise like one with it on
the device, across table events; the placement rule of `ngram_table=auto`.
"""
import json
import time

import numpy as np
import pytest
import torch

import train_gpt
from perf.host_table import HostRows, choose_placement
from tests.run.test_run_train import shards  # noqa: F401 (the tokenized text, a fixture)


def test_gathers_and_write_backs_follow_submission_order():
    g = torch.Generator().manual_seed(0)
    reference = torch.randn(64, 8, generator=g).bfloat16()
    table = HostRows(64, 8, torch.bfloat16, "cpu")
    table.data.copy_(reference)
    try:
        for trial in range(20):
            index = np.unique(torch.randint(0, 64, (12,), generator=g).numpy())
            assert torch.equal(table.gather(index), reference[torch.from_numpy(index)])
            values = torch.randn(index.size, 8, generator=g).bfloat16()
            table.scatter(index, values)          # written back on the thread ...
            values.zero_()                        # ... from its own copy: the caller may reuse its tensor
            reference[torch.from_numpy(index)] = table.gather(index)  # ... before this gather reads them
            pending = [table.start_gather(np.arange(64)) for _ in range(3)]
            assert all(torch.equal(p.result(), reference) for p in pending)
        assert torch.equal(table.host_tensor(), reference)
        with pytest.raises(ValueError, match=r"HostRows.scatter: values must be torch.bfloat16 \[2, 8\]"):
            table.scatter(np.array([0, 1]), torch.zeros(2, 8))
    finally:
        table.close()


def test_rows_split_across_threads_are_the_one_threads_rows(monkeypatch):
    """HOST_ROWS_THREADS: a gather and a write-back cut into contiguous slices, one per thread, give
    what plain indexing gives (and a job too small to split runs whole)."""
    monkeypatch.setattr("os.cpu_count", lambda: 4)  # the cap, whatever this machine has
    g = torch.Generator().manual_seed(1)
    reference = torch.randn(9000, 4, generator=g).bfloat16()
    table = HostRows(9000, 4, torch.bfloat16, "cpu", threads=3)
    table.data.copy_(reference)
    calls = []
    sliced = table._sliced
    monkeypatch.setattr(table, "_sliced", lambda copy, rows: (calls.append(rows), sliced(copy, rows)))
    try:
        assert table.threads == 3
        for size in (5000, 100):
            index = np.sort(torch.randperm(9000, generator=g)[:size].numpy())
            assert torch.equal(table.gather(index), reference[torch.from_numpy(index)])
            values = torch.randn(size, 4, generator=g).bfloat16()
            table.scatter(index, values)
            reference[torch.from_numpy(index)] = values
            table.synchronize()
            assert torch.equal(table.data, reference)
        assert calls == [5000, 5000, 100, 100]
    finally:
        table.close()


def test_auto_placement_keeps_a_cpu_table_on_the_device_and_honours_a_setting():
    assert choose_placement("auto", 10**12, torch.device("cpu"))[0] == "device"
    assert choose_placement("host", 1, torch.device("cpu")) == ("host", "ngram_table=host (set)")
    with pytest.raises(ValueError, match="ngram_table='disk'"):
        choose_placement("disk", 1, torch.device("cpu"))


@pytest.mark.slow
def test_a_host_table_trains_bitwise_like_a_device_table(tmp_path, shards):
    """6 smoke steps (3 table events: every 2nd step before the 4-step cadence) and the validation."""
    entries = {}
    for placement in ("device", "host"):
        records = tmp_path / placement
        train_gpt.main(["--config", "smoke", "--data-path", str(shards), "--no-warmup", "--val-every", "0",
                        "--val-tokens", "2048", "--seed", "0", "--max-steps", "6", "--log-train-loss",
                        "--set", f"ngram_table={placement}", "--records-dir", str(records)])
        (line,) = (records / "runs.jsonl").read_text().splitlines()
        entries[placement] = json.loads(line)
        log = open(entries[placement]["log_path"]).read()
        assert f"n-gram table: {placement} memory (ngram_table={placement} (set))" in log
    assert entries["host"]["train_losses"] == entries["device"]["train_losses"]
    assert entries["host"]["val_loss"] == entries["device"]["val_loss"]


@pytest.mark.slow
def test_the_one_gpu_shape_runs_under_the_stream_checks_and_the_capture_rule(tmp_path, shards, monkeypatch):
    """What the one-GPU recipe runs, on CPU: one process playing 2 ranks, the table in host memory,
    the row prefetch on and the CUDA-graph twin capturing the warmup, with the side-stream checks
    (perf/streams.py, on in every test) and the capture rule: the next step's gather, submitted just
    before a captured forward/backward, is drained by the capture, never run inside it."""
    from perf import backend as perf_backend
    from perf import streams

    holds = []
    original = streams.DeviceWorker.hold

    def hold(self):  # how many jobs each capture found in flight
        holds.append(self._outstanding)
        original(self)

    monkeypatch.setattr(streams.DeviceWorker, "hold", hold)
    gather = HostRows._gather

    def slow_gather(self, index):  # still running when the main thread reaches the capture
        time.sleep(0.5)
        return gather(self, index)

    monkeypatch.setattr(HostRows, "_gather", slow_gather)
    with perf_backend.use_backend(cuda_graphs=True, row_prefetch=True):
        train_gpt.main(["--config", "smoke", "--data-path", str(shards), "--val-every", "0", "--val-tokens", "2048",
                        "--seed", "0", "--max-steps", "3", "--set", "ngram_table=host", "--records-dir", str(tmp_path)])
    (line,) = (tmp_path / "runs.jsonl").read_text().splitlines()
    entry = json.loads(line)
    log = open(entry["log_path"]).read()
    assert entry["status"] == "finished" and "n-gram table: host memory" in log
    assert "cuda graphs: graphs captured: forward_backward" in log and "replays" in log
    assert holds and any(holds), f"no capture found a prefetched gather to drain: {holds}"  # drained, not overlapped
