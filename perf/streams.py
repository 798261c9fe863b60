"""Side-stream work and the threads that issue it, with a model of a GPU's rules checked on CPU.

Every host↔device copy that runs beside the compute (the n-gram rows of the host table, the pinned
batch ring, the small pinned uploads) goes through this layer:

    side = side_stream(device, "host-rows")
    rows = to_device(staged, side, "host-rows gather")   # a copy on `side`, into a block allocated there
    event = Event(device); event.record(side)
    current_stream(device).wait_event(event)             # the consumer's stream waits; the host does not
    keep_alive(rows, current_stream(device))             # the block outlives the consumer's reads
    host_write(slot, "batch ring slot 1")                # before the host rewrites a copy's source

On CUDA these are the plain torch.cuda calls. On a CPU every copy is synchronous and there is one
stream, so a wait left out, a buffer reused too early or a block freed under a reader never shows.
With the checks on (`SPEEDRUN_STREAM_CHECK=1`: always in the tests, tests/conftest.py; optional in
a run) a ledger models the GPU instead and stops at the first violation (`StreamViolation`, naming
the job, its stream and the buffer):

* **unwaited read**: an op on a stream reads a copy's output (or a block a copy writes) before that
  stream waited for an event recorded behind the copy (`Stream.wait_event`, `wait_stream`) and
  before the host synchronized one (`Event.synchronize` or a `query` that returned True). The reads
  are seen by `StreamCheckMode`, entered around the training step and validation (runtime/training.py);
* **early reuse**: the host writes a copy's source, or reads a device→host copy's destination,
  before the host knows the copy is done (`host_write`, `host_read`: the pinned staging of the host
  table, the batch ring's slots, the small-upload staging);
* **wrong keep-alive**: a block allocated on one stream and read on another without
  `keep_alive(block, reader)` (CUDA's `record_stream`) naming that reader: the allocator could hand
  the block to the next allocation on the producer's stream while the reader still reads it;
* **device work from another thread during a capture**: while a region is being captured
  (`capturing`), any call of this layer from a thread other than the capturing one. On CUDA a
  global-mode capture is invalidated by such a call ("operation not permitted when stream is
  capturing": pytorch/pytorch PR #175425 gives the pinned-allocation case from a worker); here it
  stops the run naming the thread's job and the region, on CPU and CUDA alike.

The capture rule is kept, not only checked: `DeviceWorker` (the one thread that issues a component's
side-stream work, in submission order) is drained and held for every capture (`capturing` drains
every live worker first; jobs submitted meanwhile wait for the capture's end). The warmup is off the
clock, so the hold costs the timed loop nothing, and captures keep torch's default global mode.
"""
from __future__ import annotations

import contextlib
import itertools
import os
import threading
import weakref
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode

CHECK_ENV = "SPEEDRUN_STREAM_CHECK"


def checks_enabled() -> bool:
    """The ledger's checks (module docstring): on with SPEEDRUN_STREAM_CHECK=1 (tests/conftest.py
    sets it for every test and every process a test starts)."""
    return os.environ.get(CHECK_ENV, "0") == "1"


class StreamViolation(RuntimeError):
    """A side-stream rule broken (module docstring); the message names the job, stream and buffer."""


class CaptureConflict(StreamViolation):
    """Device work issued by another thread while a region was being captured."""


def _storage(t: Tensor) -> int:
    return t.untyped_storage().data_ptr() if t.device.type != "meta" else 0


def _owner(t: Tensor) -> Tensor:
    """The tensor that owns t's block: a view's base (a ring slot outlives the views copied from it)."""
    return t._base if t._base is not None else t


# ----------------------------------------------------------------------------------------------------
# the ledger (CPU, checks on)
# ----------------------------------------------------------------------------------------------------


@dataclass(eq=False)
class _Job:
    """One copy: issued on `stream`, writing `dst` (allocated on `alloc_stream`), reading `src`."""
    number: int
    what: str
    stream: str
    alloc_stream: str | None
    dst: weakref.ref | None = None
    src: weakref.ref | None = None
    visible: set = field(default_factory=set)  # streams that waited for an event behind it
    host_done: bool = False                   # the host synchronized an event behind it


class _Ledger:
    """What a GPU would still be doing: the copies not yet known complete, by the storage they
    write (`dst`) and read (`src`), and which streams may read each block (`keep_alive`)."""

    def __init__(self):
        self.lock = threading.RLock()
        self.numbers = itertools.count(1)
        self.by_dst: dict[int, _Job] = {}
        self.by_src: dict[int, _Job] = {}
        self.alive_for: dict[int, tuple[weakref.ref, set]] = {}  # storage -> (tensor, streams kept for)
        self.pending: dict[str, list[_Job]] = {}  # stream -> jobs no host sync has covered yet
        self.local = threading.local()             # the calling thread's current stream (CPU)

    # -- streams per thread --------------------------------------------------------------------------
    def current(self) -> str:
        return getattr(self.local, "stream", DEFAULT)

    # -- bookkeeping ---------------------------------------------------------------------------------
    @staticmethod
    def _live(ref: weakref.ref | None) -> Tensor | None:
        return ref() if ref is not None else None

    def _job_for(self, table: dict, t: Tensor) -> _Job | None:
        key = _storage(t)
        job = table.get(key)
        if job is None:
            return None
        live = self._live(job.dst if table is self.by_dst else job.src)
        if live is None or _storage(live) != key:  # freed, or the address reused by another block
            del table[key]
            return None
        return job

    def issue(self, what: str, stream: str, dst: Tensor, src: Tensor | None, alloc_stream: str | None) -> _Job:
        with self.lock:
            job = _Job(next(self.numbers), what, stream, alloc_stream, weakref.ref(_owner(dst)),
                       weakref.ref(_owner(src)) if src is not None else None, visible={stream})
            self.by_dst[_storage(dst)] = job
            if src is not None:
                self.by_src[_storage(src)] = job
            waiting = self.pending.setdefault(stream, [])
            waiting[:] = [j for j in waiting if self._live(j.dst) is not None or self._live(j.src) is not None]
            waiting.append(job)
            return job

    def covered(self, stream: str) -> list[_Job]:
        with self.lock:
            return list(self.pending.get(stream, ()))

    def made_visible(self, jobs: list[_Job], stream: str) -> None:
        with self.lock:
            for job in jobs:
                job.visible.add(stream)

    def host_synchronized(self, jobs: list[_Job]) -> None:
        with self.lock:
            for job in jobs:
                job.host_done = True
                waiting = self.pending.get(job.stream, [])
                if job in waiting:
                    waiting.remove(job)

    def stream_waits_for_stream(self, waiter: str, producer: str) -> None:
        with self.lock:
            for job in self.by_dst.values():
                if producer in job.visible:
                    job.visible.add(waiter)

    def kept_alive(self, t: Tensor, stream: str) -> None:
        with self.lock:
            key = _storage(t)
            ref, streams = self.alive_for.get(key, (None, set()))
            if ref is None or ref() is None:
                streams = set()
            self.alive_for[key] = (weakref.ref(t), streams | {stream})

    # -- the rules -----------------------------------------------------------------------------------
    def check_read(self, t: Tensor, stream: str, op: str) -> None:
        with self.lock:
            job = self._job_for(self.by_dst, t)
            if job is None:
                return
            if not job.host_done and stream not in job.visible:
                raise StreamViolation(
                    f"stream check: {op} on stream {stream!r} reads the output of copy #{job.number} "
                    f"({job.what}) issued on stream {job.stream!r} without waiting for an event recorded "
                    f"behind it (Stream.wait_event / Event.synchronize, perf/streams.py): on a GPU it may "
                    f"read the block before the copy lands")
            if job.alloc_stream is not None and job.alloc_stream != stream:
                ref, streams = self.alive_for.get(_storage(t), (None, set()))
                if ref is None or ref() is None or stream not in streams:
                    named = ", ".join(sorted(streams)) if ref is not None and ref() is not None else "no stream"
                    raise StreamViolation(
                        f"stream check: {op} on stream {stream!r} reads the block of copy #{job.number} "
                        f"({job.what}), allocated on stream {job.alloc_stream!r}, but keep_alive "
                        f"(record_stream) named {named}: once freed, the allocator may hand the block to the "
                        f"next allocation on {job.alloc_stream!r} while {stream!r} still reads it")

    def check_host_write(self, t: Tensor, what: str) -> None:
        with self.lock:
            for table, role in ((self.by_src, "source"), (self.by_dst, "destination")):
                job = self._job_for(table, t)
                if job is not None and not job.host_done:
                    raise StreamViolation(
                        f"stream check: the host writes {what} while copy #{job.number} ({job.what}, stream "
                        f"{job.stream!r}) may still use it as its {role}: wait for an event recorded behind "
                        f"the copy first (perf/streams.py)")

    def check_host_read(self, t: Tensor, what: str) -> None:
        with self.lock:
            job = self._job_for(self.by_dst, t)
            if job is not None and not job.host_done:
                raise StreamViolation(
                    f"stream check: the host reads {what} before copy #{job.number} ({job.what}, stream "
                    f"{job.stream!r}) is known complete: synchronize an event recorded behind it first "
                    f"(perf/streams.py)")


DEFAULT = "default"
LEDGER = _Ledger()


# ----------------------------------------------------------------------------------------------------
# captures and the threads that must keep out of them
# ----------------------------------------------------------------------------------------------------


@dataclass
class _Capture:
    region: str
    key: object
    thread: threading.Thread


_capture: _Capture | None = None
_capture_violations: list[CaptureConflict] = []
_workers: "weakref.WeakSet[DeviceWorker]" = weakref.WeakSet()


def _device_call(what: str) -> None:
    """Every call of this layer that a GPU would see as device work: refused from a thread other
    than the capturing one while a region is being captured."""
    capture = _capture
    if capture is None or threading.current_thread() is capture.thread:
        return
    error = CaptureConflict(
        f"capture rule: thread {threading.current_thread().name!r} ran device work ({what}) while region "
        f"{capture.region!r} key {capture.key!r} was being captured; on a GPU this invalidates the global-mode "
        f"capture ('operation not permitted when stream is capturing'). Submit the thread's side-stream work "
        f"through a DeviceWorker, which perf.streams.capturing holds for every capture.")
    _capture_violations.append(error)
    raise error


@contextlib.contextmanager
def capturing(region: str, key):
    """A region is being captured (perf/cuda_graphs/capture.py wraps each capture): every live
    DeviceWorker is drained first and held until the capture ends, and any device call of this layer
    from another thread stops the run (also when the thread swallowed the error: it is re-raised
    here)."""
    global _capture
    workers = list(_workers)
    for worker in workers:
        worker.hold()
    _capture_violations.clear()
    _capture = _Capture(region, key, threading.current_thread())
    try:
        yield
    finally:
        _capture = None
        for worker in workers:
            worker.release()
    if _capture_violations:
        violation = _capture_violations[0]
        for worker in _workers:  # raised here, on the main thread: not again at the worker's next call
            if worker._error is violation:
                worker._error = None
        raise violation


class DeviceWorker:
    """One thread that runs a component's side-stream jobs in submission order (perf/host_table.py).

    `submit(job, what)` returns a Future. A fire-and-forget job's exception is kept and raised by
    the next `submit`, `result` or `drain` (a worker's error is never swallowed). `hold()` drains
    the queue and keeps the thread from starting another job until `release()`: `capturing` does
    both around every capture, so the thread never issues device work while one is in progress.
    Waiting inside a capture for a job the hold keeps waiting raises instead of deadlocking."""

    def __init__(self, name: str):
        from concurrent.futures import ThreadPoolExecutor

        self.name = name
        self._pool = ThreadPoolExecutor(1, thread_name_prefix=name)
        self._gate = threading.Event()
        self._gate.set()
        self._held = 0
        self._outstanding = 0  # jobs submitted and not finished
        self._count_lock = threading.Lock()
        self._error: BaseException | None = None
        _workers.add(self)

    def _run(self, job, args, what: str):
        self._gate.wait()
        try:
            return job(*args)
        except BaseException as e:
            if self._error is None:
                self._error = e
            raise
        finally:
            with self._count_lock:
                self._outstanding -= 1

    def _raise_kept(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def submit(self, job, *args, what: str = "") -> Future:
        self._raise_kept()
        with self._count_lock:
            self._outstanding += 1
        return self._pool.submit(self._run, job, args, what or getattr(job, "__name__", "job"))

    def result(self, future: Future, what: str):
        """future.result(), refusing to wait for a job held by a capture in progress."""
        if self._held and not future.done():
            self._refuse_wait(what)
        try:
            return future.result()
        except BaseException as e:
            if self._error is e:  # raised here: not again at the next call
                self._error = None
            raise

    def _refuse_wait(self, what: str) -> None:
        raise CaptureConflict(f"{self.name}: waiting for {what} inside a capture, while the worker is held until "
                              f"the capture ends: the region waits on side-stream work (move the wait out of it)")

    def drain(self) -> None:
        """Wait for every job submitted so far; raise the first error any of them kept."""
        if self._held and self._outstanding:
            self._refuse_wait("every job submitted so far")
        self._pool.submit(lambda: None).result()
        self._raise_kept()

    def hold(self) -> None:
        if self._held == 0:
            self._pool.submit(lambda: None).result()  # the queue before the hold runs to its end
            self._gate.clear()
        self._held += 1

    def release(self) -> None:
        self._held -= 1
        if self._held == 0:
            self._gate.set()

    def close(self) -> None:
        self._gate.set()
        self._pool.shutdown(wait=True)
        _workers.discard(self)
        self._raise_kept()


# ----------------------------------------------------------------------------------------------------
# streams and events
# ----------------------------------------------------------------------------------------------------


class Stream:
    """A CUDA stream, or on CPU a name in the ledger. `name` says which it is in messages."""

    def __init__(self, device: torch.device, name: str, cuda=None):
        self.device, self.name, self.cuda = torch.device(device), name, cuda

    def wait_event(self, event: "Event") -> None:
        _device_call(f"stream {self.name!r} waits for an event")
        if self.cuda is not None:
            self.cuda.wait_event(event.cuda)
        elif checks_enabled():  # a test's stand-in event carries no jobs
            LEDGER.made_visible(getattr(event, "jobs", []), self.name)

    def wait_stream(self, other: "Stream") -> None:
        _device_call(f"stream {self.name!r} waits for stream {other.name!r}")
        if self.cuda is not None:
            self.cuda.wait_stream(other.cuda)
        elif checks_enabled():
            LEDGER.stream_waits_for_stream(self.name, other.name)

    def __repr__(self) -> str:
        return f"Stream({self.name!r} on {self.device})"


def current_stream(device) -> Stream:
    """The calling thread's current stream (CUDA: torch's; CPU: the ledger's, `use` sets it)."""
    device = torch.device(device)
    if device.type == "cuda":
        cuda = torch.cuda.current_stream(device)
        return Stream(device, "default" if cuda == torch.cuda.default_stream(device) else f"cuda stream {cuda.stream_id}",
                      cuda)
    return Stream(device, LEDGER.current())


def side_stream(device, name: str) -> Stream:
    """A new stream for copies beside the compute (a torch.cuda.Stream on CUDA)."""
    device = torch.device(device)
    return Stream(device, name, torch.cuda.Stream(device) if device.type == "cuda" else None)


@contextlib.contextmanager
def use(stream: Stream):
    """Make `stream` the calling thread's current stream (torch.cuda.stream on CUDA)."""
    if stream.cuda is not None:
        with torch.cuda.stream(stream.cuda):
            yield
        return
    previous = LEDGER.current()
    LEDGER.local.stream = stream.name
    try:
        yield
    finally:
        LEDGER.local.stream = previous


class Event:
    """A CUDA event, or on CPU the ledger's: it covers the copies issued on its stream before
    `record`; a stream that waits for it may read their outputs, and a host that synchronized it
    (or saw `query()` return True) may reuse their buffers."""

    def __init__(self, device):
        self.device = torch.device(device)
        self.cuda = torch.cuda.Event() if self.device.type == "cuda" else None
        self.recorded_on: str | None = None
        self.jobs: list[_Job] = []

    def record(self, stream: Stream | None = None) -> None:
        stream = stream or current_stream(self.device)
        _device_call(f"an event recorded on stream {stream.name!r}")
        self.recorded_on = stream.name
        if self.cuda is not None:
            self.cuda.record(stream.cuda)
        elif checks_enabled():
            self.jobs = LEDGER.covered(stream.name)

    def query(self) -> bool:
        if self.cuda is not None:
            return self.cuda.query()
        if checks_enabled():
            LEDGER.host_synchronized(self.jobs)  # a CPU copy is complete once issued
        return True

    def synchronize(self) -> None:
        _device_call("the host waits for an event")
        if self.cuda is not None:
            self.cuda.synchronize()
        elif checks_enabled():
            LEDGER.host_synchronized(self.jobs)


# ----------------------------------------------------------------------------------------------------
# copies, blocks and host buffers
# ----------------------------------------------------------------------------------------------------


def copy(dst: Tensor, src: Tensor, stream: Stream, what: str) -> Tensor:
    """dst ← src on `stream`, non-blocking (a copy job in the ledger on CPU)."""
    _device_call(f"copy {what}")
    if stream.cuda is not None:
        with torch.cuda.stream(stream.cuda):
            dst.copy_(src, non_blocking=True)
        return dst
    dst.copy_(src)
    if checks_enabled():
        LEDGER.issue(what, stream.name, dst, src, alloc_stream=None)
    return dst


def to_device(src: Tensor, stream: Stream, what: str) -> Tensor:
    """A fresh block on `stream.device`, allocated on `stream` (its allocator pool) and filled there
    from `src` by a non-blocking copy. A reader on another stream must wait for an event behind the
    copy and `keep_alive` the block for its own stream."""
    _device_call(f"copy {what}")
    if stream.cuda is not None:
        with torch.cuda.stream(stream.cuda):
            out = torch.empty(src.shape, dtype=src.dtype, device=stream.device)
            out.copy_(src, non_blocking=True)
        return out
    out = torch.empty(src.shape, dtype=src.dtype, device=stream.device)
    out.copy_(src)
    if checks_enabled():
        LEDGER.issue(what, stream.name, out, src, alloc_stream=stream.name)
    return out


def keep_alive(t: Tensor, stream: Stream) -> None:
    """The block of `t` is not reused before `stream`'s reads of it (queued so far) are done
    (CUDA: Tensor.record_stream)."""
    _device_call(f"record_stream on {stream.name!r}")
    if stream.cuda is not None:
        t.record_stream(stream.cuda)
    elif checks_enabled():
        LEDGER.kept_alive(t, stream.name)


def pinned_empty(shape, dtype: torch.dtype, device, what: str) -> Tensor:
    """Host staging for copies to or from `device`: page-locked on CUDA (torch's caching host
    allocator), plain host memory on CPU. The allocation is device work (cudaHostAlloc)."""
    cuda = torch.device(device).type == "cuda"
    if cuda:
        _device_call(f"a pinned allocation for {what}")
    return torch.empty(shape, dtype=dtype, pin_memory=cuda)


def host_write(buffer: Tensor, what: str) -> None:
    """The host is about to write `buffer`: no copy in flight may still read or write it."""
    if checks_enabled() and buffer.device.type == "cpu":
        LEDGER.check_host_write(buffer, what)


def host_read(buffer: Tensor, what: str) -> None:
    """The host is about to read `buffer`, the destination of a device→host copy: it must have landed."""
    if checks_enabled() and buffer.device.type == "cpu":
        LEDGER.check_host_read(buffer, what)


class InFlight:
    """An asynchronous collective's write (`collective_in_flight`), until `waited()`."""

    def __init__(self, job: _Job | None):
        self.job = job

    def waited(self) -> None:
        """Its Work was waited: the calling thread's current stream may read the result."""
        if self.job is not None:
            LEDGER.made_visible([self.job], LEDGER.current())


def collective_in_flight(target: Tensor, what: str) -> InFlight:
    """An async collective writes `target` (its Work not yet waited: the deferred bank all-gathers,
    optim/manager.py). On CPU with the checks on, a read of `target` before `waited()` is an unwaited
    read: gloo runs the collective on its own threads, so on a CPU too the read would race it. On
    CUDA nothing is kept: Work.wait() makes the current stream wait."""
    if target.device.type != "cpu" or not checks_enabled():
        return InFlight(None)
    return InFlight(LEDGER.issue(what, "collective", target, None, alloc_stream=None))


# ----------------------------------------------------------------------------------------------------
# the reads
# ----------------------------------------------------------------------------------------------------


class StreamCheckMode(TorchDispatchMode):
    """Checks every aten op's tensor arguments against the ledger: an op runs on the calling
    thread's current stream and must not read what a copy on another stream is still writing
    (`_Ledger.check_read`). Entered on the main thread around the training step and validation."""

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True  # off while dynamo traces, on while its graphs run

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if LEDGER.by_dst:
            stream = LEDGER.current()
            for a in (*args, *kwargs.values()):
                for t in (a if isinstance(a, (list, tuple)) else (a,)):
                    if isinstance(t, Tensor) and t.device.type == "cpu":
                        LEDGER.check_read(t, stream, str(func))
        return func(*args, **kwargs)


def checked_reads(device) -> contextlib.AbstractContextManager:
    """StreamCheckMode where the ledger runs (CPU with the checks on), else nothing."""
    if torch.device(device).type == "cpu" and checks_enabled():
        return StreamCheckMode()
    return contextlib.nullcontext()
