"""Optimizer benchmark: the per-step time of OptimizerManager on CPU for the smoke model (or a
stand-in), and the ANVIL cascade's FLOPs per step at the record's per-rank chunk shapes.

    python tools/bench_optim.py                      # the smoke GPT's parameters, ANVIL and NorMuon
    python tools/bench_optim.py --model small        # the small stand-in (banks that need padding)
    python tools/bench_optim.py --model record       # record shapes (slow on CPU: minutes)
    python tools/bench_optim.py --steps 20 --world-size 8

Prints numbers only; nothing here is asserted.
"""
from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402

from cli import ArgumentParser, exit_on_config_error, positive_int  # noqa: E402
from config import SCHEDULE_PRESETS, OptimConfig  # noqa: E402
from optim.anvil import ANVIL_MAPS, cascade_flops  # noqa: E402
from optim.manager import OptimizerManager  # noqa: E402
from optim.normuon import POLAR_EXPRESS_MAPS  # noqa: E402
from optim.schedule import TrainingSchedule  # noqa: E402
from optim.standin import StandInDims, StandInParams  # noqa: E402


def record_chunk_shapes(world_size: int) -> dict[str, tuple[int, int, int]]:
    """Per-rank bank chunks of the record model (qk 48, vo 16, mlp 24 matrices)."""
    d = StandInDims()
    return {"qk_bank": (d.qk_groups // world_size, d.qk_rows, d.dim),
            "vo_bank": (d.vo_matrices // world_size, d.dim, d.dim),
            "mlp_bank": (2 * d.mlp_slots // world_size, d.mlp_hidden, d.dim)}


def set_random_grads(model, seed: int) -> None:
    """A fresh random gradient on every parameter (the optimizer clears what it consumed)."""
    gen = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=gen).to(p.dtype)


def time_steps(model_kind: str, bank_optimizer: str, steps: int) -> tuple[float, float]:
    """Median ms per step over `steps` steps (after one warm step): (all steps, Adam steps only).
    Medians, because a shared CPU makes single steps noisy."""
    if model_kind == "smoke":
        from config import MODEL_PRESETS
        from model.gpt import GPT
        model = GPT(MODEL_PRESETS["smoke"])
    else:
        model = StandInParams.record() if model_kind == "record" else StandInParams.small()
    sched = TrainingSchedule(SCHEDULE_PRESETS["smoke"])
    mgr = OptimizerManager(model.named_parameters(), sched, OptimConfig(bank_optimizer=bank_optimizer))
    times, adam_times = [], []
    for step in tqdm(range(steps + 1), desc=f"{model_kind} {bank_optimizer}", leave=False):
        set_random_grads(model, seed=step)
        t0 = time.perf_counter()
        mgr.step(step % sched.total_steps)
        dt = (time.perf_counter() - t0) * 1e3
        if step:                                     # step 0 allocates and warms up
            times.append(dt)
            if sched.is_adam_step(step % sched.total_steps):
                adam_times.append(dt)
    return statistics.median(times), statistics.median(adam_times or [float("nan")])


def main(argv=None) -> int:
    parser = ArgumentParser(prog="python -m tools.bench_optim", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=("smoke", "small", "record"), default="smoke")
    parser.add_argument("--steps", type=positive_int, default=30)
    parser.add_argument("--world-size", type=positive_int, default=8, help="ranks for the FLOP count")
    with exit_on_config_error("python -m tools.bench_optim"):
        args = parser.parse_args(argv)
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} CPU threads, one process")
    for opt in ("anvil", "normuon"):
        median, adam = time_steps(args.model, opt, args.steps)
        print(f"optimizer step ({args.model} model, {opt}): {median:.1f} ms/step median, "
              f"{adam:.1f} ms on Adam steps")
    print(f"\ncascade FLOPs per step per rank at record shapes, {args.world_size} ranks:")
    total = {"anvil": 0, "normuon": 0}
    for name, shape in record_chunk_shapes(args.world_size).items():
        anvil = cascade_flops(shape, len(ANVIL_MAPS))
        normuon = cascade_flops(shape, len(POLAR_EXPRESS_MAPS))
        total["anvil"] += anvil
        total["normuon"] += normuon
        print(f"  {name:<9} chunk {shape}: ANVIL {anvil / 1e9:7.2f} GFLOP, NorMuon {normuon / 1e9:7.2f} GFLOP")
    print(f"  total: ANVIL {total['anvil'] / 1e9:.2f} GFLOP/rank/step "
          f"({total['anvil'] * args.world_size / 1e9:.1f} over all ranks), "
          f"NorMuon {total['normuon'] / 1e9:.2f} GFLOP/rank/step")
    print("  (6 maps x [Gram + A^2 + X update]; the first Gram doubles as the normalization; "
          "NorMuon: 5 maps, its separate norm pass not counted)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
