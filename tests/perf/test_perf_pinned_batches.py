"""perf/pinned_batches.py: batches through the ring equal the host batches field by field, the ring
cycles through its slots, and a slot is never rewritten while its copy is in flight (fake events on
CPU; real pinned memory, streams and events in the gpu test)."""
import dataclasses

import pytest
import torch

from data.loader import Batch, dummy_batch
from perf import streams
from perf.pinned_batches import RING_SLOTS, PinnedBatchRing

# small hash tables: the ids only need to be a batch's real fields, not the record's sizes
HASH = dict(ngram_half_rows=1000, sign_pool_rows=64)


def _batch(tokens: int, seed: int) -> Batch:
    return dummy_batch(tokens, doc_cap=max(tokens // 4, 1), seed=seed, **HASH)


def _assert_same_batch(got: Batch, want: Batch, what: str) -> None:
    assert type(got) is type(want), what
    for f in dataclasses.fields(want):
        g, w = getattr(got, f.name), getattr(want, f.name)
        if isinstance(w, torch.Tensor):
            assert g.dtype == w.dtype and g.shape == w.shape, (what, f.name, g.dtype, g.shape, w.dtype, w.shape)
            assert torch.equal(g.cpu(), w.cpu()), (what, f.name)
        else:
            assert g == w, (what, f.name, g, w)


def _tensor_fields(batch: Batch) -> list[str]:
    return [f.name for f in dataclasses.fields(batch) if isinstance(getattr(batch, f.name), torch.Tensor)]


def test_device_batches_equal_the_host_batches_across_changing_sizes():
    ring = PinnedBatchRing("cpu")
    sizes = [64, 64, 128, 32, 256, 256, 64, 256, 128, 32]  # grows and shrinks, as at stage changes
    host = [_batch(n, seed=i) for i, n in enumerate(sizes)]
    expected = [dataclasses.replace(b, **{k: getattr(b, k).clone() for k in _tensor_fields(b)}) for b in host]
    moved = [ring.to_device(b) for b in host]
    for i, (got, b) in enumerate(zip(moved, host)):
        # the reference: the plain copy the training loop makes today
        _assert_same_batch(got, b.to("cpu"), f"batch {i} ({sizes[i]} tokens)")
        for name in _tensor_fields(b):  # fresh tensors: neither the loader's nor a slot's memory
            assert getattr(got, name).data_ptr() != getattr(b, name).data_ptr(), (i, name)
            assert not any(getattr(got, name).data_ptr() == buf.data_ptr()
                           for slot in ring.slots for buf in slot.buffers.values()), (i, name)
    # every earlier batch survived the later uploads through its slot (no aliasing of the ring)
    for i, (got, want) in enumerate(zip(moved, expected)):
        _assert_same_batch(got, want, f"batch {i} after {len(sizes) - 1 - i} later uploads")


@pytest.mark.parametrize("slots", [2, RING_SLOTS])
def test_slots_cycle_with_period_r(slots):
    ring = PinnedBatchRing("cpu", slots=slots)
    ring.to_device(_batch(256, seed=0))  # the largest batch first: every slot grows to it at once
    addresses = []
    for i, n in enumerate([256, 64, 128, 256, 32, 64, 256, 128] * 2):
        ring.to_device(_batch(n, seed=i + 1))
        addresses.append(tuple(getattr(ring.staged, k).data_ptr() for k in _tensor_fields(ring.staged)))
    assert len(set(addresses[:slots])) == slots  # R different slots ...
    for i in range(slots, len(addresses)):      # ... reused in turn
        assert addresses[i] == addresses[i - slots], i
    capacity = {k: v[0] for k, v in ring.capacity.items()}
    assert capacity == {"inputs": 256, "targets": 256, "cu_seqlens": 128, "ngram_ids": 512, "ngram_sign_rows": 512}


class FakeEvent(streams.Event):
    """An event whose completion the test controls: record() puts a copy in flight; synchronize()
    runs the test's check, then completes the copy unless the test says it never completes. It is
    the stream checks' event underneath (perf/streams.py), so they see it complete only then."""

    def __init__(self, log: list):
        super().__init__("cpu")
        self.log, self.in_flight, self.completes, self.on_wait = log, False, True, None
        self.streams = []

    def record(self, stream=None):
        super().record(stream)
        self.in_flight = True
        self.streams.append(stream)

    def query(self):
        return not self.in_flight and super().query()

    def synchronize(self):
        self.log.append(self)
        if self.on_wait is not None:
            self.on_wait()
        if self.completes:
            self.in_flight = False
            super().synchronize()


def _fake_ring(slots: int):
    log = []
    ring = PinnedBatchRing("cpu", slots=slots, event_factory=lambda: FakeEvent(log))
    return ring, log


def test_a_slot_in_flight_is_waited_for_before_it_is_rewritten():
    ring, log = _fake_ring(2)
    b0, b1, b2, b3 = (_batch(64, seed=s) for s in range(4))
    ring.to_device(b0)
    ring.to_device(b1)
    ev0, ev1 = (slot.event for slot in ring.slots)
    assert ev0.in_flight and ev1.in_flight and ev0.streams == [ring.stream]
    ev1.in_flight = False  # slot 1's copy retires on its own; slot 0's is still running

    def slot0_untouched():  # at the moment the ring waits, slot 0 still holds b0
        assert torch.equal(ring.slots[0].buffers["inputs"][:64], b0.inputs)

    ev0.on_wait = slot0_untouched
    got2 = ring.to_device(b2)  # slot 0 again: must wait for b0's copy first
    assert log == [ev0] and ring.waits == 1
    assert torch.equal(ring.slots[0].buffers["inputs"][:64], b2.inputs)  # then rewritten
    _assert_same_batch(got2, b2, "batch 2")
    ring.to_device(b3)  # slot 1: its copy had completed, so no wait
    assert log == [ev0] and ring.waits == 1


def test_a_copy_that_never_completes_stops_the_ring_before_it_overwrites():
    ring, log = _fake_ring(2)
    b0, b1, b2 = (_batch(64, seed=s) for s in range(3))
    ring.to_device(b0)
    ring.to_device(b1)
    ring.slots[0].event.completes = False
    with pytest.raises(RuntimeError, match="slot 0's previous host→device copy is still in flight"):
        ring.to_device(b2)
    assert torch.equal(ring.slots[0].buffers["inputs"][:64], b0.inputs)  # b0's bytes were left alone


def test_growth_waits_for_every_slot_in_flight():
    ring, log = _fake_ring(3)
    ring.to_device(_batch(64, seed=0))
    ring.to_device(_batch(64, seed=1))  # slots 0 and 1 in flight, slot 2 never used
    big = _batch(128, seed=2)
    got = ring.to_device(big)  # lands in slot 2 but grows all three: 0 and 1 are waited for first
    assert log == [ring.slots[0].event, ring.slots[1].event] and ring.waits == 2
    _assert_same_batch(got, big, "the larger batch")
    assert all(slot.buffers["inputs"].numel() == 128 for slot in ring.slots)


def test_rejects_what_is_not_a_host_batch():
    ring = PinnedBatchRing("cpu")
    with pytest.raises(TypeError, match="dataclass of tensors"):
        ring.to_device(torch.zeros(3))
    with pytest.raises(ValueError, match="at least one slot"):
        PinnedBatchRing("cpu", slots=0)


@pytest.mark.gpu
def test_pinned_ring_on_cuda_with_a_busy_copy_stream():
    """Real pinned slots, a side stream and events: the copy stream is held up by a sleep kernel, so
    the compute stream reads the batch correctly only if it waits on the slot's event, and the
    (R+1)-th upload must wait for slot 0's copy before rewriting it."""
    device = torch.device("cuda")
    ring = PinnedBatchRing(device)
    sizes = [256, 128, 256, 64, 256, 128, 256]
    host = [_batch(n, seed=i) for i, n in enumerate(sizes)]
    ring.to_device(_batch(256, seed=99))  # grow every slot first (as the warmup does)
    torch.cuda.synchronize()
    assert all(buf.is_pinned() for slot in ring.slots for buf in slot.buffers.values())
    waits = ring.waits
    with torch.cuda.stream(ring.stream.cuda):
        torch.cuda._sleep(200_000_000)  # ~0.1 s of the copy stream: its copies retire late
    seen = []
    for b in host[:RING_SLOTS + 1]:
        got = ring.to_device(b)
        assert got.inputs.is_cuda and got.max_seq_len == b.max_seq_len
        seen.append(dataclasses.replace(got, **{k: getattr(got, k).clone() for k in _tensor_fields(got)}))
    assert ring.waits == waits + 1  # upload R+1 found slot 0's copy still behind the sleep
    for b in host[RING_SLOTS + 1:]:
        got = ring.to_device(b)
        seen.append(dataclasses.replace(got, **{k: getattr(got, k).clone() for k in _tensor_fields(got)}))
    torch.cuda.synchronize()
    for i, (got, b) in enumerate(zip(seen, host)):
        _assert_same_batch(got, b.to(device), f"batch {i}")
