"""A preset's first steps graphed against eager, bit for bit: the CUDA-graph capture plan
(perf/cuda_graphs/capture.py) proved end to end, on CUDA or, on a CPU, through its tape twin:

    python -m tools.capture_compare --config smoke --steps 6   # graphed vs eager, bit for bit

Two one-process runs of the preset (`contract.build_run`), each warmed up for the steps asked (with
every region captured in the graphed one), reset, then trained on the same dummy batches: their
losses and every state tensor (`run_state`) must be equal bit for bit. It builds training.Runs, so
it lives apart from capture.py, which runtime/training.py imports (no import circle).
"""
from __future__ import annotations

import argparse
import sys

import torch

from data.loader import dummy_batch
from perf import backend as perf_backend
from perf.cuda_graphs.state import run_state
from tools.capture_contract import build_run

def train_steps(config: str, steps: int, graphed: bool, seed: int = 0):
    """A one-process training.Run of `config`: the warmup planned for the first `steps` steps
    (captures included when graphed), the in-place reset, then `steps` training steps on fixed
    dummy batches. Returns (the step losses, {state name: a host copy after them}, the plan)."""
    class QuietLog:
        def print0(self, *args, **kwargs):
            pass

    with perf_backend.use_backend(host_checks=False, cuda_graphs=graphed):  # host checks: as on a GPU
        run = build_run(config, seed=seed)
        run.warmup([], QuietLog(), horizon=steps)
        run.reset()
        if run.graphs is not None:
            run.graphs.freeze()
        schedule, cfg = run.schedule, run.cfg
        losses = []
        end = min(steps, schedule.total_steps)

        def batches(step: int) -> list | None:
            if step >= end:
                return None
            tokens = schedule.batch_tokens(step) // cfg.virtual_world_size
            return [dummy_batch(tokens, schedule.doc_cap(step), seed=1000 * step + r,
                                virtual_seq_cap=cfg.schedule.virtual_seq_cap, **run.hash_args)
                    for r in run.setup.virtual_ranks]

        following = batches(0)
        for step in range(end):
            current, following = following, batches(step + 1)  # one ahead, as the loop (row prefetch)
            losses.append(run.train_step(step, current, following).item())
        run.flush()  # the last update's fp8 refresh
    state = {name: t.detach().to("cpu", copy=True) for name, t in run_state(run) if t is not None}
    return losses, state, run.graphs


def graphed_vs_eager(config: str = "smoke", steps: int = 6, seed: int = 0) -> tuple[str, int]:
    """(a report, an exit code): the graphed steps against the eager ones, losses and every state
    tensor compared bit for bit."""
    eager_losses, eager_state, _ = train_steps(config, steps, graphed=False, seed=seed)
    losses, state, graphs = train_steps(config, steps, graphed=True, seed=seed)
    lines = [f"--config {config}, {len(losses)} step(s): {graphs.summary()}"]
    bad = [f"step {i}: loss {a!r} graphed, {b!r} eager" for i, (a, b) in enumerate(zip(losses, eager_losses)) if a != b]
    for name, t in eager_state.items():
        other = state.get(name)
        if other is None or other.shape != t.shape or not torch.equal(
                other.reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8)):
            bad.append(f"state {name} differs after the steps")
    if bad:
        lines += bad[:20] + [f"FAIL: {len(bad)} difference(s) between the graphed and the eager run"]
        return "\n".join(lines), 1
    lines.append(f"PASS: losses and {len(eager_state)} state tensors bit for bit equal, graphed and eager")
    return "\n".join(lines), 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="Train a preset's first steps with every region captured and "
                                             "replayed (on CPU: the tape twin) and eagerly; compare bit for bit.")
    ap.add_argument("--config", default="smoke", help="run preset (default: smoke)")
    ap.add_argument("--steps", type=int, default=6, help="training steps, from step 0 (default: 6)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    text, code = graphed_vs_eager(args.config, args.steps, args.seed)
    print(text)
    return code


if __name__ == "__main__":
    sys.exit(main())
