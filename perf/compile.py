"""torch.compile of the model, as record #360 does it: once, fullgraph, static shapes, no extra flags.

    model = compile_model(model)   # after building the model, before the warmup steps

Record #360 (record_360.md §6.1) compiles the whole model with
torch.compile(model, dynamic=False, fullgraph=True) and raises dynamo's recompile limit to 64, because
each distinct step shape (tokens per rank, windows, MTP count, sampled-softmax width P, ...) is its
own graph. The speedrun's rules forbid extra torch._inductor.config flags, so none are set here.
On the portable path (`perf.backend.current().compile` is False: CPU by default, or SPEEDRUN_COMPILE=0)
the model is returned as it is.
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
    return torch.compile(model, dynamic=False, fullgraph=True)
