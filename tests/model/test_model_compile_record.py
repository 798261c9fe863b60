"""The record model at record shapes traces as one fullgraph per schedule geometry, on the meta device.

Dynamo decides graph breaks, guards and recompiles from the Python it traces, whatever the device,
so the record's 8-rank shapes (16,384 to 49,152 tokens per rank) can be checked on a CPU machine
with meta tensors (no memory, no arithmetic) and the record's attention, FA3, as the cross-compiles' shape-only
stand-in op. The `eager` backend stops after dynamo: AOT autograd
at record shapes takes minutes on 2 cores, and tests/run's compiled smoke run traces the backward
with `aot_eager` on the same code. The training forward and backward both run (on meta).
"""
import pytest
import torch

from config import RUN_PRESETS
from data.loader import cu_seqlens_rows
from model.gpt import GPT, StepArgs
from perf import backend as perf_backend
from optim.schedule import TrainingSchedule
from perf.compile import compiled_graphs

RECORD_WORLD = 8


def _distinct_shapes(schedule: TrainingSchedule) -> dict[tuple, list[int]]:
    """Steps grouped by everything that changes a shape or a Python value in the forward, read off
    the schedule's own per-step functions (not StepSettings.geometry)."""
    groups: dict[tuple, list[int]] = {}
    for step in range(schedule.total_steps):
        key = (schedule.batch_tokens(step), schedule.max_seq_len(step), schedule.softmax_p(step),
               len(schedule.mtp_weights(step)), schedule.prefix_weight(step) > 0, schedule.windows(step))
        groups.setdefault(key, []).append(step)
    return groups


def _step_inputs(schedule: TrainingSchedule, step: int, dim: int):
    s = schedule.settings(step)
    T = s.batch_tokens // RECORD_WORLD
    with torch.device("meta"):
        inputs, targets = torch.zeros(T, dtype=torch.int32), torch.zeros(T, dtype=torch.int64)
        cu_seqlens = torch.zeros(cu_seqlens_rows(T), dtype=torch.int32)
        rows = torch.zeros(2 * T, dim, dtype=torch.bfloat16, requires_grad=True)
        sign_rows = torch.zeros(2 * T, dtype=torch.int32)
        mtp = torch.tensor(s.mtp_weights)
        prefix = torch.tensor(s.prefix_weight) if s.prefix_weight else None
        candidates = torch.arange(s.softmax_p) if s.softmax_p else None
    args = StepArgs(ws_short=s.ws_short, ws_long=s.ws_long, mtp_weights=mtp, prefix_weight=prefix,
                    candidates=candidates, training=True, max_seq_len=schedule.max_seq_len(step))
    return inputs, targets, cu_seqlens, rows, sign_rows, args


@pytest.mark.slow
def test_record_shapes_one_graph_per_geometry_and_none_after(monkeypatch):
    cfg = RUN_PRESETS["record"]
    schedule = TrainingSchedule(cfg.schedule)
    groups = _distinct_shapes(schedule)
    assert len(groups) == 6  # stages 0, 1, stage 2 at two P, the taper, the extension
    # The record's attention, FA3, as the cross-compiles trace it: one opaque op per layer with a shape-only
    # kernel (tools/fake_gpu.py). The portable SDPA would trace a mask and a call per 2,048-query chunk, up to
    # 48 per paired layer at these shapes, which is not the record's graph and was most of this test's time.
    from perf import attention_backends
    from tools.fake_gpu import fa3_standin

    monkeypatch.setattr(attention_backends, "_fa3_interface", fa3_standin())
    torch._dynamo.reset()
    with perf_backend.use_backend(triton=False, attention="fa3", fp8=True, host_checks=False):
        with torch.device("meta"):
            model = GPT(cfg.model)
        model.refresh_fp8()
        compiled = torch.compile(model, backend="eager", fullgraph=True, dynamic=False)  # fullgraph: a break raises
        before = compiled_graphs()
        for steps in groups.values():  # the warmup: the first step of each geometry
            compiled(*_step_inputs(schedule, steps[0], cfg.model.model_dim)).backward()
        warmup = compiled_graphs() - before
        for steps in groups.values():  # the timed loop: another step of each geometry (its last), other weights
            loss = compiled(*_step_inputs(schedule, steps[-1], cfg.model.model_dim))  # (one: CI time, 2026-12-06)
            loss.backward()
            assert loss.device.type == "meta" and loss.shape == ()
        timed = compiled_graphs() - before - warmup
    torch._dynamo.reset()
    assert (warmup, timed) == (len(groups), 0)
