"""Batches to the device through a ring of pinned host slots and a side-stream copy (SPEEDRUN_PINNED_BATCHES).

What it replaces: `host_batch.to(device, non_blocking=True)`. From pageable memory (the validation
batches) that copy is staged through a driver buffer and returns only when the host side is done;
from a freshly pinned tensor (the training loader's pin_memory) each batch pays a page-locked
allocation; and either way the copy queues on the compute stream, behind every kernel the host has
already launched, so the copy engine idles while the batch waits its turn.

What it does: the batch's tensors are copied (a host memcpy) into the next of R slots of reusable
host buffers, pinned on CUDA; a side stream copies the slot into fresh device tensors and records the
slot's event; the compute stream waits on that event, so the step reads the batch only once it has
landed, and the copy itself overlaps whatever the compute stream is running. On CPU the same code
runs with plain host buffers through perf/streams.py, whose checks (SPEEDRUN_STREAM_CHECK=1, on in
the tests) hold it to a GPU's rules: a slot rewritten while its copy may be in flight, or a batch
read before the compute stream waited for its slot's event, stops the run.

Invariant: a slot is rewritten only after the event recorded behind its last host→device copy has
completed (a DMA reads pinned memory asynchronously, so a host that runs ahead would otherwise
overwrite a batch still being copied: the race of a single reused pinned buffer). The device tensors
are fresh allocations, handed to the compute stream with record_stream, so no reader of a batch ever
sees a slot reused.

Depth R = 3 (RING_SLOTS): record #360 keeps 40 slots and copies on the compute stream, where a
slot's copy retires only when the GPU reaches it, so a ring there must be deeper than the host's lead
over the device. Here the side stream waits on nothing, so a slot's copy retires one DMA after its
upload (tens of µs for a training batch of 49,152 tokens, 1.4 MB), however far the host runs ahead.
Two slots are the minimum for overlap (fill one while the other's DMA is in flight); the third
absorbs uploads issued back to back (gradient accumulation puts several per step on fewer GPUs).
Each slot holds the largest batch, a validation batch of 262,144 tokens per rank at the record's
8 ranks (7.3 MB), so the ring pins ~22 MB. `waits` counts the uploads that found their slot in flight.

Buffers grow to the largest batch seen, all slots at once (the batch size changes between schedule
stages): the untimed warmup visits every geometry, so the timed loop allocates no pinned memory.

    ring = PinnedBatchRing(device)
    batch = ring.to_device(host_batch)   # same type as host_batch.to(device, non_blocking=True)
    batch, extra = ring.upload(host_batch, candidates=candidates)   # more tensors in the same slot

The same reuse for the host's other small per-step uploads (issue 22: host work per step):
`PinnedStaging` copies host arrays on the current stream through R reused buffers, for the row
plans' index vectors (optim/row_exchange.py) and the optimizer's scalar table (optim/manager.py),
where each upload allocated pinned memory of its own.
"""
from __future__ import annotations

from dataclasses import fields, is_dataclass, replace

import numpy as np
import torch
from torch import Tensor

from perf import streams

RING_SLOTS = 3  # ours (module docstring); record #360's ring has 40 slots, copied on the compute stream
# ours: PinnedStaging copies on the compute stream, so a slot retires only when the device reaches its
# copy: R slots let the host run R uploads ahead of the device before it waits (record #360 keeps a
# 16-slot ring for its bank scalars and 16-slot rings for its row want-lists)
STAGING_SLOTS = 4


class _Slot:
    def __init__(self, event):
        self.buffers: dict = {}  # field name (PinnedStaging: dtype) → flat host buffer (pinned on CUDA)
        self.event = event  # recorded on the copy stream after this slot's last host→device copies


def _await_slot(slot, what: str) -> bool:
    """Block until the slot's last host→device copy has completed; True when it was still in flight
    (the caller counts the waits). A real CUDA event is complete after synchronize; anything else
    is a bug, and the slot is not overwritten."""
    if slot.event.query():
        return False
    slot.event.synchronize()
    if not slot.event.query():
        raise RuntimeError(f"{what}'s previous host→device copy is still in flight after waiting on its event; "
                           f"refusing to overwrite the slot")
    return True


class PinnedBatchRing:
    """A ring of `slots` host staging slots for batches (dataclasses of tensors and plain values,
    data.loader.Batch) on their way to `device`.

    event_factory: makes each slot's event (default perf.streams.Event: CUDA's, or the ledger's on
    CPU); tests pass events whose completion they control. stream: the copy stream (default a new
    perf.streams side stream)."""

    def __init__(self, device: torch.device | str, slots: int = RING_SLOTS, *, event_factory=None, stream=None):
        self.device = torch.device(device)
        if slots < 1:
            raise ValueError(f"PinnedBatchRing needs at least one slot, got {slots}")
        self.cuda = self.device.type == "cuda"
        self.stream = streams.side_stream(self.device, "batch-ring") if stream is None else stream
        event_factory = event_factory or (lambda: streams.Event(self.device))
        self.slots = [_Slot(event_factory()) for _ in range(slots)]
        self.next_slot = 0
        self.capacity: dict[str, tuple[int, torch.dtype]] = {}  # field → (elements, dtype) of every slot
        self.waits = 0  # uploads that found their slot's previous copy still in flight
        self.staged = None  # the host slot views of the last upload (tests and benchmarks read them)

    def _wait(self, index: int) -> None:
        """Block until slot `index`'s last host→device copy has completed."""
        self.waits += _await_slot(self.slots[index], f"pinned batch ring: slot {index}")

    def _host_buffer(self, numel: int, dtype: torch.dtype) -> Tensor:
        return streams.pinned_empty(numel, dtype, self.device, "the batch ring")

    def _grow(self, tensors: dict[str, Tensor]) -> None:
        """Give every slot buffers that hold `tensors` (all slots at once: an allocation of pinned
        memory in the timed loop would stall it)."""
        grown = {}
        for name, t in tensors.items():
            numel, dtype = self.capacity.get(name, (0, t.dtype))
            if dtype != t.dtype or numel < t.numel():
                grown[name] = (max(t.numel(), numel if dtype == t.dtype else 0), t.dtype)
        if not grown:
            return
        for index, slot in enumerate(self.slots):
            self._wait(index)  # the old buffer may still be the source of a copy
            for name, (numel, dtype) in grown.items():
                slot.buffers[name] = self._host_buffer(numel, dtype)
        self.capacity.update(grown)

    def to_device(self, host_batch):
        """`host_batch` on the device, through the next slot: the same type and values as
        host_batch.to(device, non_blocking=True), ordered before anything the current stream runs next."""
        return self.upload(host_batch)[0]

    def upload(self, host_batch, **extra: Tensor) -> tuple[object, dict[str, Tensor]]:
        """`to_device(host_batch)`, and the further host tensors `extra` (the step's sampled-softmax
        candidates) staged in the same slot and copied with it: (the device batch, {name: device
        tensor}). A field of None (a host-only field the caller left out, say) is not copied."""
        if not is_dataclass(host_batch):
            raise TypeError(f"PinnedBatchRing.to_device takes a dataclass of tensors (data.loader.Batch), "
                            f"got {type(host_batch).__name__}")
        tensors = {f.name: getattr(host_batch, f.name) for f in fields(host_batch)
                   if isinstance(getattr(host_batch, f.name), Tensor)}
        clash = sorted(set(tensors) & set(extra))
        if clash:
            raise ValueError(f"PinnedBatchRing.upload: extra tensors {clash} share a name with the batch's fields")
        for name, t in [*tensors.items(), *extra.items()]:
            if not isinstance(t, Tensor) or t.device.type != "cpu":
                where = t.device if isinstance(t, Tensor) else type(t).__name__
                raise ValueError(f"PinnedBatchRing.to_device: field {name} is on {where}, expected a host tensor")
        tensors.update(extra)
        index = self.next_slot
        self.next_slot = (index + 1) % len(self.slots)
        self._grow(tensors)
        self._wait(index)
        slot = self.slots[index]
        staged = {}
        for name, t in tensors.items():
            streams.host_write(slot.buffers[name], f"batch ring slot {index} ({name})")
            view = slot.buffers[name][:t.numel()].view(t.shape)
            view.copy_(t)  # host memcpy; the slot's previous copy has retired (waited above)
            staged[name] = view
        self.staged = replace(host_batch, **{k: v for k, v in staged.items() if k not in extra})
        compute = streams.current_stream(self.device)
        # fresh device tensors, not device slots: a step still reading the batch R uploads later is
        # never overwritten (on CPU, .to(cpu) would return the slot itself)
        moved = {name: streams.to_device(view, self.stream, f"batch ring slot {index} ({name})")
                 for name, view in staged.items()}
        slot.event.record(self.stream)
        compute.wait_event(slot.event)
        for t in moved.values():  # allocated on the copy stream, read on the compute stream
            streams.keep_alive(t, compute)
        batch = replace(host_batch, **{k: v for k, v in moved.items() if k not in extra})
        return batch, {k: moved[k] for k in extra}


class PinnedStaging:
    """Host→device copies of a step's small host-built arrays through `slots` reused host buffers
    (pinned on CUDA), one copy per call on the current stream: the row plans' index vectors
    (optim/row_exchange.py), the optimizer's per-step scalar table (optim/manager.py load_scalars).

    What it replaces: a fresh pinned allocation per upload (`torch.empty(..., pin_memory=True)` or
    `.pin_memory()`), a trip through the caching host allocator each time. Here the buffers are
    allocated once, all slots at once, grown to the largest upload seen (the warmup's): the timed
    loop allocates no host memory. The copy stays on the current stream, in stream order with what
    reads its result; the same invariant as the batch ring keeps a slot from being rewritten while
    its copy may still be reading it (the event recorded behind it, waited if needed).

        staging = PinnedStaging(device)
        dev = staging.to_device([inverse, served], torch.int64)       # (N + S,) one copy
        staging.to_device([values], torch.float32, out=device_table)  # into a device buffer
    """

    def __init__(self, device: torch.device | str, slots: int = STAGING_SLOTS, *, event_factory=None):
        self.device = torch.device(device)
        if slots < 1:
            raise ValueError(f"PinnedStaging needs at least one slot, got {slots}")
        self.cuda = self.device.type == "cuda"
        event_factory = event_factory or (lambda: streams.Event(self.device))
        self.slots = [_Slot(event_factory()) for _ in range(slots)]
        self.next_slot = 0
        self.capacity: dict[torch.dtype, int] = {}  # dtype → elements of every slot's buffer
        self.waits = 0  # copies that found their slot's previous copy still in flight

    def _wait(self, index: int) -> None:
        self.waits += _await_slot(self.slots[index], f"pinned staging: slot {index}")

    def to_device(self, arrays, dtype: torch.dtype, out: Tensor | None = None) -> Tensor:
        """The 1-D host arrays (numpy arrays or host tensors) concatenated, as `dtype`, on the
        device: written into the next slot, then one non-blocking copy into `out` (a 1-D device
        tensor of their total length and `dtype`) or into a fresh device tensor, returned."""
        arrays = [a.numpy() if isinstance(a, Tensor) else np.asarray(a) for a in arrays]
        numel = sum(int(a.size) for a in arrays)
        if out is not None and (out.shape != (numel,) or out.dtype != dtype or out.device != self.device):
            raise ValueError(f"PinnedStaging.to_device: out must be {dtype} [{numel}] on {self.device}, "
                             f"got {out.dtype} {list(out.shape)} on {out.device}")
        if self.capacity.get(dtype, -1) < numel:  # grow every slot at once (module docstring)
            # ours: a quarter to spare, so sizes that creep up (a plan's distinct rows) regrow rarely
            grown = numel + numel // 4
            for index, slot in enumerate(self.slots):
                if dtype in slot.buffers:
                    self._wait(index)  # the old buffer may still be the source of a copy
                slot.buffers[dtype] = streams.pinned_empty(grown, dtype, self.device, "pinned staging")
            self.capacity[dtype] = grown
        index = self.next_slot
        self.next_slot = (index + 1) % len(self.slots)
        self._wait(index)
        slot = self.slots[index]
        host = slot.buffers[dtype][:numel]
        streams.host_write(slot.buffers[dtype], f"pinned staging slot {index} ({dtype})")
        if numel:
            np.concatenate(arrays, out=host.numpy(), casting="same_kind")  # host memcpy into the slot
        if out is None:
            out = torch.empty(numel, dtype=dtype, device=self.device)
        current = streams.current_stream(self.device)
        streams.copy(out, host, current, f"pinned staging slot {index} ({dtype})")
        slot.event.record(current)  # behind the copy, on the current stream
        return out
