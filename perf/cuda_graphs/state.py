"""What a region's capture and its contract check share, below the run that uses them: every tensor
of a training.Run that outlives a region, by name (`run_state`), a storage's address (`storage_ptr`),
and the dispatch mode both record a region's ops through (`OpRecordingMode`, `LIFT_OPS`).

training.Run names its state for the capture (perf/cuda_graphs/capture.py), and the contract checker
(tools/capture_contract.py) and the capture-check count on "meta" (tools/capture_cost.py) name
it the same way. This module imports no project module, so runtime/training.py, capture.py and the tools
that build runs all import it without an import circle.
"""
from __future__ import annotations

import dataclasses

from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode


def storage_ptr(t: Tensor) -> int:
    """The address of t's storage (0 for tensors without data: empty, meta, wrapper subclasses)."""
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return 0


# torch.tensor(...) and Python numbers used as tensors inside a region: their argument is a host
# constant made right there (not dispatched), not a tensor from outside the region
LIFT_OPS = {"aten::lift_fresh", "aten::lift_fresh_copy", "aten::lift"}


class OpRecordingMode(TorchDispatchMode):
    """A dispatch mode that sees a region's aten ops as they run: eager ops and the ops of compiled
    (aot_eager) graphs, but not dynamo's tracing of them, which runs no kernel a graph would hold.
    The contract checker and the CPU capture twin (capture.py) both record through one."""

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True  # off while dynamo traces, on while compiled graphs run


# ----------------------------------------------------------------------------------------------------
# naming the state of a run
# ----------------------------------------------------------------------------------------------------


def _walk(prefix: str, obj, out: list, skip=("param", "view", "rule", "shard", "manager", "exchange")) -> None:
    if isinstance(obj, Tensor):
        out.append((prefix, obj))
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            if f.name not in skip:
                _walk(f"{prefix}.{f.name}", getattr(obj, f.name), out)
    elif isinstance(obj, dict):
        for k, v in obj.items():
            _walk(f"{prefix}[{k}]", v, out)
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            _walk(f"{prefix}[{i}]", v, out)


def module_state(model) -> list[tuple[str, Tensor]]:
    """A module's parameters, their gradients and its buffers, by name."""
    out: list[tuple[str, Tensor]] = []
    for name, p in model.named_parameters():
        out.append((name, p))
        if p.grad is not None:
            out.append((f"{name}.grad", p.grad))
    out.extend(model.named_buffers())
    return out


def optimizer_state(manager) -> list[tuple[str, Tensor]]:
    """An optim.manager.OptimizerManager's per-parameter state, cycle gradients and device scalars:
    `optimizer[<param>].state.exp_avg`, `optimizer[<param>].scalars[step_size]`, ..."""
    out: list[tuple[str, Tensor]] = []
    for name, entry in manager.entries.items():
        _walk(f"optimizer[{name}]", entry, out)
    return out


def run_state(run) -> list[tuple[str, Tensor]]:
    """[(name, tensor)] of everything of a training.Run that outlives a region: parameters and
    their gradients, buffers, optimizer states and device scalars, the n-gram table and its
    optimizer, the schedule's weight buffers, the sampled lm_head gradient's counter, the static
    inputs (first name wins for shared storage: parameters first)."""
    out = module_state(run.model) + optimizer_state(run.manager)
    if run.table is not None:  # (features.ngram off: no table, no row optimizer)
        _walk("ngram_optimizer.state", run.ngram_opt.state, out)
        if isinstance(run.table.rows, Tensor):  # a host table (perf/host_table.py HostRows) is no device state:
            out.append(("ngram_table.rows", run.table.rows))  # only its worker writes it, outside every region
    _walk("step_weights", vars(run.step_weights), out)
    if getattr(run, "head_sample", None) is not None:  # PR #371's counter, advanced inside the captured backward
        out.append(("head_sample.counter", run.head_sample.counter))
    for (name, shape, dtype), t in run.static_inputs.items():
        label = f"static_input[{name} {list(shape)} {str(dtype).removeprefix('torch.')}]"
        out.append((label, t))
        if t.grad is not None:
            out.append((f"{label}.grad", t.grad))
    return out
