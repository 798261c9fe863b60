"""The n-gram table in host memory: rows read and written by the device a few at a time.

The record's table is 84,602,880 rows × 768 bf16 = 121.03 GiB (PR #360). On 8 ranks each GPU holds
1/8 of it; one GPU cannot hold it at all. But a step reads only its batch's distinct rows (record
#360 stage 2: 0.7–1.2 GB per step on one process) and a table event writes back only the rows the
cycle touched, so the table can live in host memory and the device can hold just those rows.

`HostRows` is a shard [rows, D] in ordinary (pageable) host memory and one worker thread that
moves rows, so the main thread never waits for a host copy:

    pending = table.start_gather(index)     # thread: rows[index] into pinned staging, then the
    rows = pending.result()                 #   host→device copy on a side stream; main: the
                                            #   current stream waits for it (no host sync)
    table.scatter(index, new_rows)          # device→host copy into pinned staging, then the
                                            #   thread waits for it and writes the rows back

The thread runs its jobs in submission order, so a gather submitted after a scatter reads the
written rows: the math is the device table's, bit for bit (index_select and index_copy_ of the
same rows). Pinned staging comes from torch's caching host allocator (`pin_memory=True`), which
keeps a block alive until the copies that use it are done. On a CPU run the "device" is the
host: the same code path, with plain copies, which the stream checks (perf/streams.py) hold to a
GPU's rules.

The thread is a `perf.streams.DeviceWorker`: a capture (CUDA graphs, the warmup) drains and holds
it, so it never issues device work (a pinned allocation, a copy, an event) while the main thread
captures; the next step's prefetched gather is submitted just before the captured forward/backward
and runs after it (issue 38). Its errors are raised on the main thread, at the next call.
"""
from __future__ import annotations

import os
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch
from torch import Tensor

from config import NGRAM_TABLE_PLACEMENTS
from perf import streams

# ours: where `ngram_table=auto` puts the table: in host memory when this rank's shard would take
# more than this fraction of the device's memory (the rest of a one-GPU record step peaks at
# 34 GiB with the table off the device: tools.memory --config record --world-size 1)
HOST_TABLE_DEVICE_FRACTION = 0.5


# ours: threads that share each gather's and write-back's rows (contiguous slices, every slice done
# before the job ends, so submission order holds). One thread measured 3.4x the predicted one-H100
# step over the recipe's run, 13.6x at a stage-2 table event (python -m tools.bench_host_rows,
# docs/one_gpu.md "What the worker must sustain"); an 8×H100 node's host has tens of cores for the
# one process of the one-GPU recipe. Capped at the machine's cores.
HOST_ROWS_THREADS = 8
MIN_SLICE_ROWS = 1024  # ours: a smaller job runs on the worker alone (a slice's dispatch would cost more)

# what torch.cuda.get_device_properties reports for an H100 SXM 80GB (79.1 GiB): tools.memory's device
H100_MEMORY_BYTES = 84_942_979_072


def choose_placement(setting: str, shard_bytes: int, device: torch.device,
                     device_bytes: int | None = None) -> tuple[str, str]:
    """(placement, why) for a table shard of `shard_bytes` on `device` under the run's
    `ngram_table` setting ("auto", "device" or "host"). device_bytes: the device's memory (default:
    what torch reports for `device`; tools.memory passes an H100's)."""
    if setting not in NGRAM_TABLE_PLACEMENTS:
        raise ValueError(f"ngram_table={setting!r}: expected one of {NGRAM_TABLE_PLACEMENTS}")
    if setting != "auto":
        return setting, f"ngram_table={setting} (set)"
    if device.type != "cuda":
        return "device", "ngram_table=auto: the device is the host"
    total = device_bytes if device_bytes is not None else torch.cuda.get_device_properties(device).total_memory
    if shard_bytes > HOST_TABLE_DEVICE_FRACTION * total:
        return "host", (f"ngram_table=auto: the shard's {shard_bytes / 2**30:.2f} GiB exceed "
                        f"{HOST_TABLE_DEVICE_FRACTION:.0%} of the device's {total / 2**30:.1f} GiB")
    return "device", (f"ngram_table=auto: the shard's {shard_bytes / 2**30:.2f} GiB fit in "
                      f"{HOST_TABLE_DEVICE_FRACTION:.0%} of the device's {total / 2**30:.1f} GiB")


class PendingRows:
    """A gather in flight (`HostRows.start_gather`): `result()` is the rows on the device."""

    def __init__(self, table: "HostRows", future: Future):
        self._table, self._future = table, future

    def result(self) -> Tensor:
        # the thread's host work is done; the copy may be in flight
        rows, event = self._table._worker.result(self._future, "a host-rows gather")
        reader = streams.current_stream(rows.device)  # the stream that reads the rows: the caller's
        reader.wait_event(event)                       # the device waits, not the host
        streams.keep_alive(rows, reader)               # allocated on the side stream, read on this one
        return rows


class HostRows:
    """A row shard [rows, dim] in host memory, read and written by rows off the main thread."""

    def __init__(self, rows: int, dim: int, dtype: torch.dtype, device, threads: int | None = None):
        self.device = torch.device(device)
        self.shape = (rows, dim)
        self.dtype = dtype
        self.data = torch.zeros(rows, dim, dtype=dtype)  # pageable host memory: no 121 GiB pin
        self._stream = streams.side_stream(self.device, "host-rows")
        self._worker = streams.DeviceWorker("host-rows")
        # host copies only (index_select, index_copy_), inside the worker's jobs: never device work
        self.threads = max(1, min(threads or HOST_ROWS_THREADS, os.cpu_count() or 1))
        self._slices = ThreadPoolExecutor(self.threads - 1, thread_name_prefix="host-rows-slice") \
            if self.threads > 1 else None

    def _sliced(self, copy, rows: int) -> None:
        """copy(lo, hi) over contiguous slices of range(rows), one per thread; all done on return."""
        if self._slices is None or rows < 2 * MIN_SLICE_ROWS:
            copy(0, rows)
            return
        parts = min(self.threads, rows // MIN_SLICE_ROWS)
        bounds = [rows * k // parts for k in range(parts + 1)]
        others = [self._slices.submit(copy, lo, hi) for lo, hi in zip(bounds[1:-1], bounds[2:])]
        copy(bounds[0], bounds[1])
        for other in others:
            other.result()

    def dim(self) -> int:
        return 2

    def host_tensor(self) -> Tensor:
        """The rows as a host tensor, every pending write-back done (checkpoints)."""
        self.synchronize()
        return self.data

    def size(self, dim: int | None = None):
        return self.shape if dim is None else self.shape[dim]

    @property
    def nbytes(self) -> int:
        return self.data.nbytes

    def _gather(self, index: np.ndarray):
        """On the worker thread: rows[index] into pinned staging, then a copy to the device on the
        side stream; returns (rows, the event behind the copy)."""
        idx = torch.from_numpy(np.ascontiguousarray(index, dtype=np.int64))
        staged = streams.pinned_empty((idx.numel(), self.shape[1]), self.dtype, self.device, "a host-rows gather")
        self._sliced(lambda lo, hi: torch.index_select(self.data, 0, idx[lo:hi], out=staged[lo:hi]), idx.numel())
        rows = streams.to_device(staged, self._stream, "host-rows gather")
        event = streams.Event(self.device)
        event.record(self._stream)
        return rows, event

    def start_gather(self, index: np.ndarray) -> PendingRows:
        """rows[index] on the device, gathered and copied on the worker thread (index: host int64)."""
        return PendingRows(self, self._worker.submit(self._gather, index, what="a host-rows gather"))

    def gather(self, index: np.ndarray) -> Tensor:
        return self.start_gather(index).result()

    def _write(self, index: np.ndarray, staged: Tensor, event: streams.Event) -> None:
        event.synchronize()  # this thread waits for the device→host copy; the main thread does not
        streams.host_read(staged, "the host-rows write-back staging")
        idx = torch.from_numpy(np.ascontiguousarray(index, dtype=np.int64))  # distinct rows: slices never overlap
        self._sliced(lambda lo, hi: self.data.index_copy_(0, idx[lo:hi], staged[lo:hi]), idx.numel())

    def scatter(self, index: np.ndarray, values: Tensor) -> None:
        """rows[index] ← values (device [len(index), dim]); written back on the worker thread, before
        any gather submitted after this call."""
        if values.shape != (len(index), self.shape[1]) or values.dtype != self.dtype:
            raise ValueError(f"HostRows.scatter: values must be {self.dtype} [{len(index)}, {self.shape[1]}], "
                             f"got {values.dtype} {tuple(values.shape)}")
        # device→host into staging of its own on the caller's stream (the caller may reuse `values`)
        staged = streams.pinned_empty(values.shape, self.dtype, self.device, "a host-rows write-back")
        current = streams.current_stream(self.device)
        streams.copy(staged, values, current, "host-rows write-back")
        event = streams.Event(self.device)
        event.record(current)
        self._worker.submit(self._write, index, staged, event, what="a host-rows write-back")

    @torch.no_grad()
    def zero_(self) -> "HostRows":
        self._worker.result(self._worker.submit(self.data.zero_, what="zeroing the rows"), "zeroing the rows")
        return self

    def synchronize(self) -> None:
        """Wait for every submitted gather and write-back (before the rows are read on the host)."""
        self._worker.drain()

    def close(self) -> None:
        self._worker.close()
        if self._slices is not None:
            self._slices.shutdown(wait=True)
