"""torch.compile of the model, as record #360 does it: once, fullgraph, static shapes, no extra flags.

    model = compile_model(model)   # after building the model, before the warmup steps

Record #360 (its train_gpt.py) compiles the whole model with
torch.compile(model, dynamic=False, fullgraph=True) and raises dynamo's recompile limit to 64, because
each distinct step shape (tokens per rank, windows, MTP count, sampled-softmax width P, ...) is its
own graph. The speedrun's rules forbid extra torch._inductor.config flags, so none are set here.
On the portable path (`perf.backend.current().compile` is False: CPU by default, or SPEEDRUN_COMPILE=0)
the model is returned as it is. SPEEDRUN_COMPILE_BACKEND=aot_eager (or eager) compiles with that
backend instead of inductor: dynamo and AOT autograd trace the same Python on a CPU as on a GPU, so
CPU tests see every graph break and recompile a GPU run would meet (the record requires inductor).

`compiled_graphs()` reads dynamo's own counters: how many graphs it compiled so far, and the
train loop logs `compiled graphs: warmup N, timed M` from two readings.
"""
from __future__ import annotations

import os

import torch

from perf.backend import Backend, current

RECOMPILE_LIMIT = 64  # record #360: dynamo.config.recompile_limit (one graph per distinct step shape)


def compile_model(model: torch.nn.Module, backend: Backend | None = None) -> torch.nn.Module:
    """The compiled model when the backend compiles, else `model` itself (the same object)."""
    backend = backend or current()
    if not backend.compile:
        return model
    torch._dynamo.config.recompile_limit = RECOMPILE_LIMIT
    if backend.compile_backend == "inductor":
        return torch.compile(model, dynamic=False, fullgraph=True)
    return torch.compile(model, backend=backend.compile_backend, dynamic=False, fullgraph=True)


def compiled_graphs() -> int:
    """Graphs dynamo has compiled in this process so far (its `unique_graphs` counter): each
    new step geometry adds one; a recompile in the timed loop shows up as a difference."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


class NothingCompiled(RuntimeError):
    """A compiled run whose warmup compiled no graph: the clock would time the eager model."""


def check_warmup_compiled(warmup_graphs: int, backend: Backend) -> None:
    """Stop a compiled run (SPEEDRUN_COMPILE=1; the record) whose warmup compiled nothing, before
    the clock starts. dynamo can skip every frame without an error (TORCH_COMPILE_DISABLE=1,
    torch._dynamo.config.disable, a frame skipped under a dispatch mode, a torch version that
    declines the model): the log's `compiled graphs: warmup 0` came too late to notice."""
    if warmup_graphs > 0:
        return
    disabled = [why for why, on in (("TORCH_COMPILE_DISABLE is set", os.environ.get("TORCH_COMPILE_DISABLE", "")
                                     not in ("", "0")),
                                    ("torch._dynamo.config.disable is True", torch._dynamo.config.disable)) if on]
    raise NothingCompiled(
        f"compile: SPEEDRUN_COMPILE=1 (backend {backend.compile_backend}) but the warmup compiled no graph "
        f"(dynamo's unique_graphs counter did not move){': ' + ', '.join(disabled) if disabled else ''}; the "
        f"timed loop would run the eager model. Stopping before the clock (SPEEDRUN_COMPILE=0 runs eager on purpose).")


def allocator_settings_line(device: torch.device) -> str:
    """The log line of what the allocator was asked for (PYTORCH_ALLOC_CONF, which train_gpt.py sets
    to record #360's expandable_segments:True unless the caller set it) and what the process got:
    on CUDA, read back from the caching allocator's own segments (`torch.cuda.memory_snapshot`:
    each segment says whether it is expandable), so a setting made too late (after CUDA's first
    allocation) or ignored by a torch version shows here."""
    asked = os.environ.get("PYTORCH_ALLOC_CONF") or os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or "(unset)"
    if device.type != "cuda":
        return f"allocator: PYTORCH_ALLOC_CONF={asked} (the CUDA caching allocator's setting; a {device.type} run has none)"
    segments = torch.cuda.memory_snapshot()
    expandable = sum(bool(seg.get("is_expandable")) for seg in segments)
    got = "expandable segments" if segments and expandable == len(segments) else \
        "no expandable segments" if not expandable else "mixed segments"
    return (f"allocator: PYTORCH_ALLOC_CONF={asked}; in effect: {got} ({expandable} of {len(segments)} segments "
            f"expandable, torch.cuda.memory_snapshot)")
