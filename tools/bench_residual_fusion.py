"""CPU benchmark: the smoke model's forward+backward with the fused and with the plain residual
expressions, side by side (same weights, same batch, alternating runs so load drifts hit both).

    python -m tools.bench_residual_fusion --tokens 256 --steps 10 [--config smoke] [--threads 1]
                                         [--candidates 10240] [--fp32] [--no-fp8]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
from tqdm import tqdm

from cli import ArgumentParser, exit_on_config_error, non_negative_int, positive_int
from config import MODEL_PRESETS, FeatureConfig
from model.gpt import GPT, StepArgs
from model.loss import CandidateSampler


def make_batch(cfg, T: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    inputs = torch.randint(0, min(cfg.vocab_size, 50257), (T,), generator=gen, dtype=torch.int32)
    targets = torch.randint(0, min(cfg.vocab_size, 50257), (T,), generator=gen).long()
    cu = torch.tensor([0, T // 2, T], dtype=torch.int32)
    rows = (0.1 * torch.randn(2 * T, cfg.model_dim, generator=gen)).bfloat16()
    signs = torch.randint(0, cfg.ngram_sign_rows, (2 * T,), generator=gen, dtype=torch.int32)
    return inputs, targets, cu, rows, signs


def step_seconds(model: GPT, batch, step: StepArgs) -> float:
    model.zero_grad(set_to_none=True)
    start = time.perf_counter()
    loss = model(*batch, step)
    loss.backward()
    return time.perf_counter() - start


def main(argv=None) -> None:
    parser = ArgumentParser(prog="python -m tools.bench_residual_fusion", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="smoke", choices=sorted(MODEL_PRESETS))
    parser.add_argument("--tokens", type=positive_int, default=256)
    parser.add_argument("--steps", type=positive_int, default=10)
    parser.add_argument("--fp32", action="store_true", help="fp32 weights and activations instead of bf16")
    parser.add_argument("--no-fp8", action="store_true", help="bf16 MLPs and lm_head in training")
    parser.add_argument("--threads", type=positive_int, default=1, help="intra-op threads (tiny ops: 1 is fastest)")
    parser.add_argument("--candidates", type=non_negative_int, default=0,
                        help="sampled softmax over this many classes (record stage 0: 10240); 0 = full softmax")
    with exit_on_config_error("python -m tools.bench_residual_fusion"):
        args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    cfg = MODEL_PRESETS[args.config]
    dtype = torch.float32 if args.fp32 else torch.bfloat16
    torch.manual_seed(0)
    fused = GPT(cfg, dtype=dtype, fp8=not args.no_fp8)
    plain = GPT(cfg, dtype=dtype, fp8=not args.no_fp8, features=FeatureConfig(residual_fusions=False))
    plain.load_state_dict(fused.state_dict())
    models = {"fused": fused, "plain": plain}
    batch = make_batch(cfg, args.tokens)
    batch = batch[:3] + (batch[3].to(dtype),) + batch[4:]
    candidates = CandidateSampler(cfg.vocab_size).candidates(batch[1], args.candidates) if args.candidates else None
    step = StepArgs(ws_short=1, ws_long=3, mtp_weights=(1.0, 0.5, 0.25), candidates=candidates)
    for model in models.values():
        model.refresh_fp8()
        step_seconds(model, batch, step)  # warmup
    times = {name: [] for name in models}
    for _ in tqdm(range(args.steps), desc="fwd+bwd"):
        for name, model in models.items():
            times[name].append(step_seconds(model, batch, step))
    print(f"config={args.config} tokens={args.tokens} dtype={dtype} fp8={not args.no_fp8} "
          f"softmax={args.candidates or 'full'} threads={torch.get_num_threads()} steps={args.steps}")
    print(f"{'residuals':<10} {'median ms':>10} {'min ms':>10}")
    for name, ts in times.items():
        print(f"{name:<10} {1e3 * statistics.median(ts):>10.1f} {1e3 * min(ts):>10.1f}")
    print(f"plain/fused median ratio: {statistics.median(times['plain']) / statistics.median(times['fused']):.3f}")


if __name__ == "__main__":
    main()
