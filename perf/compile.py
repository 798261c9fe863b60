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
