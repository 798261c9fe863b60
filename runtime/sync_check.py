"""The sync check: make any host–device sync inside the timed training loop an error that names the
op and the line of project code that caused it (SPEEDRUN_SYNC_CHECK=1).

A GPU step that waits on the host loses the overlap the record depends on: the host can no longer
queue step n+1 while the device runs step n. Record #360's timed loop waits only for the logged
lines every 25 steps; ours must too. Wrap each timed step in `sync_check(device)`:

    with sync_check(device):            # the training step, optimizer and row exchange inside
        with host_side():                # work that reads host tensors by design (the batch, plans)
            ...

* CUDA: `torch.cuda.set_sync_debug_mode("error")` for the duration; CUDA raises on the
  synchronizing call itself (its traceback names the line).
* CPU: a TorchDispatchMode that raises on what a GPU would wait on:
  - `aten._local_scalar_dense`: `.item()`, and `int()`, `float()`, `bool()` of a tensor, an `if`
    on a tensor;
  - ops whose output shape depends on the data (`nonzero`, `unique`, `masked_select`,
    boolean-mask indexing, `repeat_interleave` without `output_size`, `bincount`, ...), and
    `aten.equal` (returns a host bool).
  It sees the ops of eager code and of compiled graphs alike (`aot_eager` / `eager` backends run
  aten ops the mode intercepts; it steps aside while dynamo compiles).
  What it cannot see on a CPU: device→host copies (`.cpu()`, `.to("cpu")` of a CPU tensor are
  no-ops, and `.tolist()` / `.numpy()` read memory without dispatching), copies from pageable
  host memory, and stream or event synchronizations. Those show up only on a GPU, with
  `set_sync_debug_mode("error")`.

`host_side()` marks host work inside a checked region: the loader, the sampled-softmax candidate
build and the row-exchange plans read host tensors on purpose (they never touch device memory),
so the CPU check steps aside for them (on CUDA they issue no CUDA call to catch).
"""
from __future__ import annotations

import contextlib
import traceback
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

REPO_ROOT = Path(__file__).resolve().parents[1]

# aten ops whose result a GPU can only produce by waiting for the device (name -> what calls it)
_SCALAR_READS = {
    "_local_scalar_dense": ".item() / int() / float() / bool() of a tensor",
    "equal": "torch.equal (a host bool)",
    "is_nonzero": "bool() of a tensor",
}
_DATA_DEPENDENT_SHAPES = {
    "nonzero": "nonzero / argwhere / where(cond)",
    "_unique2": "torch.unique",
    "unique_dim": "torch.unique(dim=...)",
    "unique_consecutive": "torch.unique_consecutive",
    "_unique": "torch.unique",
    "masked_select": "masked_select",
    "bincount": "bincount (output length from the data)",
    "histc": "histc",
}


class HostSyncError(RuntimeError):
    """A host sync inside a region that must not wait on the device."""


def _project_frame() -> str:
    """`path:line in function: source` of the innermost project frame calling into torch."""
    here = Path(__file__).resolve()
    for frame in reversed(traceback.extract_stack()):
        path = Path(frame.filename).resolve()
        if path == here or REPO_ROOT not in path.parents or frame.name == "__torch_dispatch__":
            continue  # not project code, or another dispatch mode's frame (perf/streams.py's)
        return f"{path.relative_to(REPO_ROOT)}:{frame.lineno} in {frame.name}: {(frame.line or '').strip()}"
    return "(no project frame on the stack)"


def _bool_index(args) -> bool:
    """aten.index / index_put_ with a boolean mask among the indices (a nonzero in disguise)."""
    indices = args[1] if len(args) > 1 else ()
    return any(isinstance(t, torch.Tensor) and t.dtype == torch.bool for t in (indices or ()))


def sync_reason(func, args, kwargs) -> str | None:
    """Why this aten call would make a GPU wait on the host, or None."""
    name = func._schema.name.split("::")[-1]
    if name in _SCALAR_READS:
        return _SCALAR_READS[name]
    if name in _DATA_DEPENDENT_SHAPES:
        return f"{_DATA_DEPENDENT_SHAPES[name]}: output shape depends on the data"
    if name in ("index", "index_put", "index_put_", "_index_put_impl_", "_index_put_impl") and _bool_index(args):
        return "boolean-mask indexing: output shape depends on the data"
    if name == "repeat_interleave" and (kwargs or {}).get("output_size") is None and len(args) < 4:
        return "repeat_interleave without output_size: output shape depends on the data"
    return None


class SyncCheckMode(TorchDispatchMode):
    """Raises HostSyncError on every aten call a GPU would wait on (see the module docstring)."""

    def __init__(self):
        super().__init__()
        self.suspended = 0

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True  # off while dynamo traces and compiles, on while compiled graphs run

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.suspended:
            reason = sync_reason(func, args, kwargs)
            if reason is not None:
                raise HostSyncError(f"host sync in a checked region (SPEEDRUN_SYNC_CHECK=1): {func} ({reason}) "
                                    f"at {_project_frame()}")
        return func(*args, **(kwargs or {}))


_active: list[SyncCheckMode] = []


@contextlib.contextmanager
def sync_check(device: torch.device | str, enabled: bool = True):
    """Inside: a host sync raises (CUDA: set_sync_debug_mode("error"); CPU: SyncCheckMode)."""
    if not enabled:
        yield
        return
    if torch.device(device).type == "cuda":
        previous = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("error")
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode(previous)
        return
    mode = SyncCheckMode()
    _active.append(mode)
    try:
        with mode:
            yield
    finally:
        _active.pop()


@contextlib.contextmanager
def host_side():
    """Host work inside a checked region (reads host tensors on purpose): the CPU check steps
    aside. On CUDA nothing changes: host work issues no CUDA call, and an upload from pageable
    memory in there is still caught."""
    for mode in _active:
        mode.suspended += 1
    try:
        yield
    finally:
        for mode in _active:
            mode.suspended -= 1


@contextlib.contextmanager
def permitted_sync():
    """Host reads the run makes on purpose at a named point of a checked step, and only there: PR #371's
    calibration (steps 592-593; model/attention_calibration.py) reads cu_seqlens and its errors. CPU: the
    check steps aside (as `host_side`); CUDA: the sync debug mode is off for the duration, then back."""
    cuda_modes = []
    if torch.cuda.is_available() and torch.cuda.get_sync_debug_mode() != 0:
        cuda_modes.append(torch.cuda.get_sync_debug_mode())
        torch.cuda.set_sync_debug_mode(0)
    try:
        with host_side():
            yield
    finally:
        if cuda_modes:
            torch.cuda.set_sync_debug_mode(cuda_modes[0])
