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


def test_seeded_lanes_start_apart_and_restart_from_their_seeds():
    """State whose ranks start apart (the sampled lm_head dW's counter, PR #371: rank r starts at r): each lane
    loads its own start value, keeps what its rank did to it, and `reset` restarts every lane from its seed."""
    counter = torch.tensor(0, dtype=torch.int64)
    lanes = Lanes(2, lambda: [])
    lanes.seed(counter, [torch.tensor(0), torch.tensor(1)])
    seen = []
    for _ in range(2):  # two steps, each lane advancing by the world size (2)
        for lane in range(2):
            lanes.load(lane)
            seen.append(int(counter))
            counter += 2
            lanes.save(lane)
    assert seen == [0, 1, 2, 3]
    lanes.reset()
    lanes.load(1)
    assert int(counter) == 1
    try:
        lanes.seed(counter, [torch.tensor(0), torch.tensor(1)])
    except ValueError as e:
        assert "one start value per lane" in str(e)
    else:
        raise AssertionError("a tensor seeded twice must be refused")
