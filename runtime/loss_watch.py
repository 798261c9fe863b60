"""The training loss's NaN check, read without a host sync.

Every `PRINT_EVERY` steps (train_gpt.py) the timed loop checks that the training loss is finite. Read
with `.item()` at once, that check drains the host's lead over the device (48 times in a record run,
a sync record #360 does not pay). Here the step's loss sum is all-reduced on the device, copied to
host staging by a non-blocking copy behind an event, and read when that event has completed: `poll`
at every later step asks the event (`query`, no wait) and reads the copy once it has landed, at the
latest at the next check, where it waits if it must (a device more than a logging period behind its
host). So a NaN stops the run at most one logging period late, the message naming the step whose
loss it was and the steps since the previous check, within which the NaN arose.

    watch = LossWatch(device, world_size, on_read=print_point)
    watch.observe(step, loss_sum, tokens, train_ms)  # a checked step: all-reduce, copy, event (device work only)
    watch.poll()                                     # every step: a landed copy is read and checked
    watch.finish()                                   # after the loop: the last copy, waited for

Each loss read is also a point of the run's training curve: `curve` holds (step + 1, train_ms, loss)
per read, train_ms being the host's clock when the loop observed the step (what it had issued, not
what the device had finished), and `on_read` is called with each point as it is read (train_gpt.py
logs it as `step:{s}/{N} train_loss:{loss:.4f}` and runs.jsonl keeps the list: `train_curve`). The
curve costs no sync: it is the NaN check's own read.

On CPU every copy has landed when it returns, so the check is read at the next poll; the stream
checks (perf/streams.py) hold the copy and its read to a GPU's rules all the same.
"""
from __future__ import annotations

import math
from typing import Callable

import torch
import torch.distributed as dist

from perf import streams

WHAT = "training loss (main + MTP + prefix terms)"


class NonFiniteLossError(RuntimeError):
    """A loss term became NaN or inf; the message names the step and the term."""


def check_finite(step: int, terms: dict[str, float]) -> None:
    """Raise NonFiniteLossError naming the first non-finite loss term (terms: name -> value)."""
    for name, value in terms.items():
        if value != value or value in (float("inf"), float("-inf")):
            raise NonFiniteLossError(f"loss term {name!r} is {value} at step {step}: stopping the run")


class LossWatch:
    def __init__(self, device, world_size: int, on_read: Callable[[int, float, float], None] | None = None):
        self.device, self.world_size = torch.device(device), world_size
        self.host = streams.pinned_empty((1,), torch.float32, self.device, "the loss watch")
        self.pending: tuple[int, int, float, streams.Event] | None = None  # (step, tokens, train_ms, event)
        self.checked_through = -1  # the last step whose loss was read and found finite
        self.last_loss: float | None = None  # the last loss read (mean per token)
        self.curve: list[tuple[int, float, float]] = []  # (steps done, train_ms, loss) per point, in step order
        self.on_read = on_read

    def observe(self, step: int, loss_sum: torch.Tensor, tokens: int, train_ms: float) -> None:
        """Start the check of this step's loss (the process's summed loss, detached): device work only.
        train_ms: the loop's clock at this step, kept for the curve point."""
        if self.pending is not None:  # the previous copy shares the staging: read it first
            self._read(wait=True)
        if self.world_size > 1:
            dist.all_reduce(loss_sum)
        current = streams.current_stream(self.device)
        streams.copy(self.host, loss_sum.reshape(1).float(), current, "the loss watch's copy")
        event = streams.Event(self.device)
        event.record(current)
        self.pending = (step, tokens, train_ms, event)

    def poll(self) -> None:
        """Read and check the pending copy if it has landed (no wait)."""
        if self.pending is not None and self.pending[3].query():
            self._read(wait=False)

    def finish(self) -> None:
        """Read and check the last copy, waiting for it (after the timed loop)."""
        if self.pending is not None:
            self._read(wait=True)

    def add_point(self, step: int, train_ms: float, loss: float) -> None:
        """A point of the training curve at `step` (0-based; stored as steps done): the watch's own
        reads, and a loss the caller read itself (train_gpt.py --log-train-loss, every step)."""
        point = (step + 1, float(train_ms), float(loss))
        self.curve.append(point)
        if self.on_read is not None:
            self.on_read(*point)

    def _read(self, wait: bool) -> None:
        step, tokens, train_ms, event = self.pending
        if wait:
            event.synchronize()
        streams.host_read(self.host, "the loss watch's staging")
        loss = self.host.tolist()[0] / tokens  # a host read of host memory: no device sync
        self.pending = None
        if not math.isfinite(loss):
            since = f"finite at step {self.checked_through} (the previous check), so it turned non-finite in steps " \
                    f"{self.checked_through + 1}..{step}" if self.checked_through >= 0 else "the first check"
            raise NonFiniteLossError(f"loss term {WHAT!r} is {loss} at step {step} (read from a copy that landed "
                                     f"after the step, without a host sync; {since}): stopping the run")
        self.checked_through, self.last_loss = step, loss
        self.add_point(step, train_ms, loss)
