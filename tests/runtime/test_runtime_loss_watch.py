"""runtime/loss_watch.py: the NaN check's reads are the run's training curve, each point once, in order."""
import math

import pytest
import torch

from runtime.loss_watch import LossWatch
from runtime.loss_watch import NonFiniteLossError


def test_each_read_is_a_curve_point_with_its_steps_time_and_mean_loss():
    seen = []
    watch = LossWatch("cpu", 1, on_read=lambda *point: seen.append(point))
    # (step, summed loss, tokens, the loop's clock): the point is (step + 1, that clock, sum / tokens)
    checks = [(0, 8192.0, 2048, 11.5), (24, 6144.0, 2048, 310.25), (49, 3072.0, 1024, 612.0)]
    for step, total, tokens, ms in checks:
        watch.observe(step, torch.tensor(total), tokens, ms)
        watch.poll()  # on CPU the copy has landed: read now
    watch.finish()
    expected = [(step + 1, ms, total / tokens) for step, total, tokens, ms in checks]
    assert watch.curve == expected == seen
    assert watch.checked_through == 49 and watch.last_loss == 3.0


def test_a_check_read_at_the_next_observe_or_at_finish_is_one_point():
    watch = LossWatch("cpu", 1)
    watch.observe(0, torch.tensor(20.0), 10, 1.0)
    watch.observe(1, torch.tensor(10.0), 10, 2.0)  # the staging is shared: step 0 is read first
    watch.finish()
    watch.finish()  # nothing pending: no second point
    assert watch.curve == [(1, 1.0, 2.0), (2, 2.0, 1.0)]


def test_a_loss_read_by_the_caller_is_a_point_too():  # train_gpt.py --log-train-loss
    seen = []
    watch = LossWatch("cpu", 1, on_read=lambda *point: seen.append(point))
    watch.add_point(4, 123.5, 7.25)
    assert watch.curve == seen == [(5, 123.5, 7.25)]


def test_a_non_finite_loss_stops_and_is_no_point():
    watch = LossWatch("cpu", 1)
    watch.observe(0, torch.tensor(5.0), 5, 1.0)
    watch.poll()
    watch.observe(1, torch.tensor(math.nan), 5, 2.0)
    with pytest.raises(NonFiniteLossError, match="is nan at step 1"):
        watch.poll()
    assert watch.curve == [(1, 1.0, 1.0)]
