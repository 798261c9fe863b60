"""optim/schedule.py StepWeights and StepSettings.geometry: the per-step loss weights as in-place
tensors (the values the schedule gives, at fixed addresses) and the geometries a compiled model
specializes on."""
import pytest
import torch

from config import SCHEDULE_PRESETS
from optim.schedule import StepWeights, TrainingSchedule
from tests.recipe import pin, recipe


@pytest.mark.parametrize("preset", ["smoke", "record"])
def test_loaded_weights_are_the_schedule_values_at_fixed_addresses(preset):
    schedule = TrainingSchedule(SCHEDULE_PRESETS[preset])
    weights = StepWeights(schedule)
    addresses = {weights.mtp.data_ptr(), weights.prefix.data_ptr()}
    for step in range(schedule.total_steps):
        mtp, prefix = weights.load(step)
        s = schedule.settings(step)
        assert mtp.tolist() == pytest.approx(list(s.mtp_weights), abs=1e-7)
        assert (prefix is None) == (s.prefix_weight == 0)
        if prefix is not None:
            assert prefix.item() == pytest.approx(s.prefix_weight, abs=1e-7)
        assert {mtp.data_ptr(), weights.prefix.data_ptr()} <= addresses  # updated in place, never moved


@recipe
def test_geometries_of_the_record_schedule():
    """Six graphs for the record: stages 0 and 1, stage 2 with P = 14336 then 24576, the taper and
    the extension (read off the stage table, record #360's track_1_short/config.py)."""
    schedule = TrainingSchedule(SCHEDULE_PRESETS["record"])
    geometries = []
    for step in range(schedule.total_steps):
        g = schedule.settings(step).geometry
        if g not in geometries:
            geometries.append(g)
    pin([(g[0] // 8, g[2], g[3], g[4]) for g in geometries], [
        (16384, 10240, 3, True), (32768, 10240, 2, True), (49152, 14336, 1, False), (49152, 24576, 1, False),
        (40960, 0, 1, False), (16384, 0, 1, False)], "the schedule's geometries (tokens per rank, P, MTP "
        "offsets, prefix term)")
