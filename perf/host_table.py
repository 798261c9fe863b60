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
host: the same code path, with plain copies.
"""
from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch
from torch import Tensor

from config import NGRAM_TABLE_PLACEMENTS

# ours: where `ngram_table=auto` puts the table: in host memory when this rank's shard would take
# more than this fraction of the device's memory (the rest of a one-GPU record step peaks at
# 34 GiB with the table off the device: perf.tools.memory --config record --world-size 1)
HOST_TABLE_DEVICE_FRACTION = 0.5


# what torch.cuda.get_device_properties reports for an H100 SXM 80GB (79.1 GiB): perf.tools.memory's device
H100_MEMORY_BYTES = 84_942_979_072


def choose_placement(setting: str, shard_bytes: int, device: torch.device,
                     device_bytes: int | None = None) -> tuple[str, str]:
    """(placement, why) for a table shard of `shard_bytes` on `device` under the run's
    `ngram_table` setting ("auto", "device" or "host"). device_bytes: the device's memory (default:
    what torch reports for `device`; perf.tools.memory passes an H100's)."""
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

    def __init__(self, future: Future):
        self._future = future

    def result(self) -> Tensor:
        rows, event = self._future.result()  # the thread's host work is done; the copy may be in flight
        if event is not None:
            torch.cuda.current_stream(rows.device).wait_event(event)  # the device waits, not the host
        return rows


class HostRows:
    """A row shard [rows, dim] in host memory, read and written by rows off the main thread."""

    def __init__(self, rows: int, dim: int, dtype: torch.dtype, device):
        self.device = torch.device(device)
        self.shape = (rows, dim)
        self.dtype = dtype
        self.data = torch.zeros(rows, dim, dtype=dtype)  # pageable host memory: no 121 GiB pin
        self._cuda = self.device.type == "cuda"
        self._stream = torch.cuda.Stream(self.device) if self._cuda else None
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="host-rows")

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
        idx = torch.from_numpy(np.ascontiguousarray(index, dtype=np.int64))
        if not self._cuda:
            return self.data.index_select(0, idx), None
        staged = torch.empty((idx.numel(), self.shape[1]), dtype=self.dtype, pin_memory=True)
        torch.index_select(self.data, 0, idx, out=staged)
        with torch.cuda.stream(self._stream):
            rows = staged.to(self.device, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self._stream)
        rows.record_stream(torch.cuda.current_stream(self.device))  # read later on the main stream
        return rows, event

    def start_gather(self, index: np.ndarray) -> PendingRows:
        """rows[index] on the device, gathered and copied on the worker thread (index: host int64)."""
        return PendingRows(self._thread.submit(self._gather, index))

    def gather(self, index: np.ndarray) -> Tensor:
        return self.start_gather(index).result()

    def _write(self, index: np.ndarray, staged: Tensor, event) -> None:
        if event is not None:
            event.synchronize()  # this thread waits for the device→host copy; the main thread does not
        self.data.index_copy_(0, torch.from_numpy(np.ascontiguousarray(index, dtype=np.int64)), staged)

    def scatter(self, index: np.ndarray, values: Tensor) -> None:
        """rows[index] ← values (device [len(index), dim]); written back on the worker thread, before
        any gather submitted after this call."""
        if values.shape != (len(index), self.shape[1]) or values.dtype != self.dtype:
            raise ValueError(f"HostRows.scatter: values must be {self.dtype} [{len(index)}, {self.shape[1]}], "
                             f"got {values.dtype} {tuple(values.shape)}")
        event = None
        if self._cuda:
            staged = torch.empty(values.shape, dtype=self.dtype, pin_memory=True)
            staged.copy_(values, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        else:
            staged = values.clone()  # the caller may reuse its tensor
        self._thread.submit(self._write, index, staged, event)

    @torch.no_grad()
    def zero_(self) -> "HostRows":
        self._thread.submit(self.data.zero_).result()
        return self

    def synchronize(self) -> None:
        """Wait for every submitted gather and write-back (before the rows are read on the host)."""
        self._thread.submit(lambda: None).result()

    def close(self) -> None:
        self._thread.shutdown(wait=True)
