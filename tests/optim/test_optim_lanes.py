"""optim/lanes.py: per-virtual-rank copies, checked against plain arithmetic."""
import torch

from optim.lanes import Lanes


def test_lanes_start_empty_and_keep_what_appears_later():
    """A run with every feature off has no fp8 state and no gradient before its first backward: the
    first load holds nothing and must not fail; a gradient that appears at save starts the other
    lanes at zero, and reduce adds the lanes in order."""
    live: list[torch.Tensor] = []
    lanes = Lanes(2, lambda: live)
    lanes.load(0)                       # nothing to load yet
    grad = torch.tensor([1.0, 2.0])
    live.append(grad)                   # the first backward made a gradient
    lanes.save(0)
    lanes.load(1)
    assert torch.equal(grad, torch.zeros(2))   # lane 1 has none yet
    grad += torch.tensor([10.0, 20.0])
    lanes.save(1)
    lanes.reduce([grad])
    assert torch.equal(grad, torch.tensor([11.0, 22.0]))
    lanes.clear([grad])
    assert all(torch.equal(c, torch.zeros(2)) for c in lanes.copies[0])
