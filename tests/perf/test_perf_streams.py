"""perf/streams.py: the GPU's side-stream rules, checked on CPU (SPEEDRUN_STREAM_CHECK=1, tests/conftest.py).

Each rule gets a fault injected into the real component that keeps it (the host table, the batch ring,
the small-upload staging, a capture) and must be caught by name; the same components without the
fault pass. The whole one-GPU recipe shape (host table, prefetch, the graphs twin) runs under the
checks in tests/perf/test_perf_host_table.py.
"""
import time

import numpy as np
import pytest
import torch

from data.loader import dummy_batch
from perf.cuda_graphs.capture import RegionGraphs
from perf import streams
from perf.host_table import HostRows
from perf.pinned_batches import PinnedBatchRing, PinnedStaging

HASH = dict(ngram_half_rows=1000, sign_pool_rows=64)  # small hash tables: any batch will do


def test_the_checks_are_on_in_the_tests():
    assert streams.checks_enabled()


@pytest.fixture
def table():
    rows = HostRows(32, 4, torch.bfloat16, "cpu")
    rows.data.copy_(torch.arange(128, dtype=torch.bfloat16).view(32, 4))
    yield rows
    rows.close()


# ---- unwaited reads and keep-alive ------------------------------------------------------------------


def test_a_gather_read_on_the_callers_stream_passes_on_any_stream(table):
    index = np.array([3, 1, 30])
    consumer = streams.side_stream("cpu", "consumer")
    with streams.use(consumer), streams.StreamCheckMode():  # result() waits and keeps alive for this stream
        rows = table.gather(index)
        assert torch.equal(rows * 1, table.data[torch.from_numpy(index)])


def test_a_read_without_waiting_for_the_copy_is_caught(table, monkeypatch):
    monkeypatch.setattr(streams.Stream, "wait_event", lambda self, event: None)  # the fault: no wait
    rows = table.gather(np.array([2, 5]))
    with pytest.raises(streams.StreamViolation, match=r"on stream 'default' reads the output of copy #\d+ "
                                                      r"\(host-rows gather\) issued on stream 'host-rows' "
                                                      r"without waiting for an event"):
        with streams.StreamCheckMode():
            rows.sum()


def test_record_stream_on_a_stream_that_is_not_the_readers_is_caught(table):
    """The old `_gather` called record_stream on the worker thread's current stream: right only while
    the reader happened to run on that stream too."""
    pending = table._worker.submit(table._gather, np.array([4, 7]))
    rows, event = table._worker.result(pending, "a gather")
    reader = streams.side_stream("cpu", "reader")
    reader.wait_event(event)
    streams.keep_alive(rows, streams.Stream("cpu", streams.DEFAULT))  # the fault: the worker's stream
    with pytest.raises(streams.StreamViolation, match=r"allocated on stream 'host-rows', but keep_alive "
                                                      r"\(record_stream\) named default"):
        with streams.use(reader), streams.StreamCheckMode():
            rows.sum()


# ---- buffers reused while a copy may still use them -------------------------------------------------


def test_a_staging_slot_rewritten_while_its_copy_is_in_flight_is_caught(monkeypatch):
    staging = PinnedStaging("cpu", slots=2)
    for value in range(4):  # slots reused in turn: each waits for its previous copy's event first
        staging.to_device([np.full(3, value)], torch.int64)
    monkeypatch.setattr(PinnedStaging, "_wait", lambda self, index: None)  # the fault: no wait before reuse
    with pytest.raises(streams.StreamViolation, match=r"the host writes pinned staging slot 0 \(torch.int64\) "
                                                      r"while copy #\d+ \(pinned staging slot 0"):
        staging.to_device([np.ones(3)], torch.int64)


def test_a_ring_slot_rewritten_while_its_copy_is_in_flight_is_caught(monkeypatch):
    ring = PinnedBatchRing("cpu", slots=2)
    batches = [dummy_batch(64, 64, seed=s, **HASH) for s in range(4)]
    for b in batches[:3]:
        ring.to_device(b)
    monkeypatch.setattr(PinnedBatchRing, "_wait", lambda self, index: None)  # the fault
    with pytest.raises(streams.StreamViolation, match=r"the host writes batch ring slot 1 \(inputs\) while copy "
                                                      r"#\d+ \(batch ring slot 1 \(inputs\), stream 'batch-ring'\)"):
        ring.to_device(batches[3])


def test_a_write_back_read_before_its_copy_landed_is_caught_and_raised_on_the_main_thread(table, monkeypatch):
    monkeypatch.setattr(streams.Event, "synchronize", lambda self: None)  # the fault: the worker does not wait
    table.scatter(np.array([1, 2]), torch.ones(2, 4, dtype=torch.bfloat16))
    with pytest.raises(streams.StreamViolation, match="the host reads the host-rows write-back staging before copy"):
        table.synchronize()  # the worker's error, kept and raised here (never swallowed)
    assert torch.equal(table.data[1:3], torch.arange(4, 12, dtype=torch.bfloat16).view(2, 4))  # not written


def test_write_backs_and_gathers_pass_the_checks_in_order(table):
    reference = table.data.clone()
    for trial in range(5):
        index = np.array([trial, 31 - trial])
        values = torch.full((2, 4), float(trial), dtype=torch.bfloat16)
        table.scatter(index, values)
        reference[torch.from_numpy(index)] = values
        with streams.StreamCheckMode():
            assert torch.equal(table.gather(np.arange(32)) * 1, reference)


# ---- the capture rule ------------------------------------------------------------------------------


def _graphs():
    state = torch.zeros(4)
    return RegionGraphs.for_device(torch.device("cpu"), lambda: [("state", state)]), state


def test_a_worker_job_submitted_before_a_capture_runs_before_it(table):
    """The prefetch submits the next step's gather just before the captured forward/backward: the
    capture drains the worker first, so its device work never overlaps the capture."""
    graphs, state = _graphs()
    order = []

    def gather():
        order.append("gather")
        return table._gather(np.array([0, 1]))

    def region():
        order.append("region")
        state.add_(1)
        return state * 2

    for _ in range(2):  # warm-up, then the capture
        table._worker.submit(gather)
        graphs.run("forward_backward", 0, region)
    assert order == ["gather", "region", "gather", "region", "region"]  # the capture's eager check runs it again
    assert ("forward_backward", 0) in graphs.graphs


def test_a_worker_device_job_during_a_capture_stops_the_run_naming_the_job_and_region(table, monkeypatch):
    monkeypatch.setattr(streams.DeviceWorker, "hold", lambda self: None)  # the fault: the rule not kept
    monkeypatch.setattr(streams.DeviceWorker, "release", lambda self: None)
    graphs, state = _graphs()

    def region():
        if graphs.warmed:  # the capturing call: the worker gathers while the capture is open
            pending = table._worker.submit(table._gather, np.array([0]))
            while not pending.done():
                time.sleep(0.005)
        state.add_(1)
        return state * 1

    graphs.run("forward_backward", 0, region)
    with pytest.raises(streams.CaptureConflict, match=r"thread 'host-rows_0' ran device work \(copy host-rows gather\) "
                                                      r"while region 'forward_backward' key 0 was being captured"):
        graphs.run("forward_backward", 0, region)
    table.synchronize()  # raised once, on the main thread: not again


def test_waiting_inside_a_capture_for_a_held_job_is_refused(table):
    graphs, state = _graphs()

    def region():
        if graphs.warmed:
            table.gather(np.array([0]))  # a region waiting on side-stream work: held until the capture ends
        return state * 1

    graphs.run("forward_backward", 0, region)
    with pytest.raises(streams.CaptureConflict, match="host-rows: waiting for a host-rows gather inside a capture"):
        graphs.run("forward_backward", 0, region)
    assert torch.equal(table.gather(np.array([3])), table.data[3:4])  # released after the capture


def test_a_read_of_a_bank_before_its_deferred_gather_was_waited_is_caught():
    """optim/manager.py's deferred all-gathers write the banks after the update; the next forward may
    read them only after `wait_gathers` (gloo runs the gather on its own threads, so on CPU too)."""
    bank = torch.zeros(4, 3)
    writing = streams.collective_in_flight(bank, "the deferred all-gather of qk_bank")
    with pytest.raises(streams.StreamViolation, match=r"reads the output of copy #\d+ \(the deferred all-gather "
                                                      r"of qk_bank\) issued on stream 'collective'"):
        with streams.StreamCheckMode():
            bank @ torch.ones(3)
    writing.waited()
    with streams.StreamCheckMode():
        bank @ torch.ones(3)
