"""Every parameter and buffer of the model with its shape, dtype, count and optimizer, and the totals,
built on the meta device, so the record size costs no memory:

    python -m model.summary --config record                           # or dev, smoke
    python -m model.summary --config smoke --set features.ngram=false # a feature switched off

What one rank of a training run holds in device memory is `python -m tools.memory` (it builds the
optimizer and the n-gram table too, which the model does not import).
"""
from __future__ import annotations

import torch

from cli import parse_preset_args
from config import RUN_PRESETS, FeatureConfig, ModelConfig
from model.gpt import GPT

# Optimizer of each parameter in record #360 (track_1_short/training.py): ANVIL on the three banks, Adam on the rest.
OPTIMIZER_GROUPS = {
    "qk_bank": "anvil", "vo_bank": "anvil", "mlp_bank": "anvil",
    "value_embeds": "adam (row-sparse)", "lm_head.weight": "adam (sharded)", "embed.weight": "adam (sharded)",
}


def build_on_meta(cfg: ModelConfig, features: FeatureConfig = FeatureConfig()) -> GPT:
    with torch.device("meta"):
        return GPT(cfg, features=features)


def summary_rows(model: GPT) -> list[tuple[str, str, str, str, int, str]]:
    """(kind, name, shape, dtype, count, optimizer) for every parameter and buffer."""
    rows = []
    for name, p in model.named_parameters():
        rows.append(("param", name, str(list(p.shape)), str(p.dtype).removeprefix("torch."), p.numel(),
                     OPTIMIZER_GROUPS.get(name, "adam")))
    for name, b in model.named_buffers():
        rows.append(("buffer", name, str(list(b.shape)), str(b.dtype).removeprefix("torch."), b.numel(), "-"))
    return rows


def parameter_count(model: GPT) -> int:
    return sum(p.numel() for p in model.parameters())


def format_summary(cfg: ModelConfig, model: GPT, world_size: int = 8) -> str:
    rows = summary_rows(model)
    header = ("kind", "name", "shape", "dtype", "count", "optimizer")
    widths = [max(len(str(r[i])) for r in rows + [header]) for i in range(len(header))]
    fmt = lambda r: "  ".join(str(v).rjust(w) if i == 4 else str(v).ljust(w) for i, (v, w) in enumerate(zip(r, widths)))
    lines = [fmt(header), fmt(tuple("-" * w for w in widths))] + [fmt(r) for r in rows]
    n_params = parameter_count(model)
    n_buffers = sum(r[4] for r in rows if r[0] == "buffer")
    per_rank = cfg.ngram_rows // world_size
    lines += ["",
              f"parameters: {n_params:,}",
              f"buffers: {n_buffers:,} elements"]
    if model.features.ngram:
        lines.append(f"n-gram table (not a parameter): {cfg.ngram_rows:,} rows × {cfg.model_dim} = "
                     f"{cfg.ngram_rows * cfg.model_dim:,} ({per_rank:,} rows, "
                     f"{per_rank * cfg.model_dim * 2 / 2 ** 30:.2f} GiB bf16 per rank on {world_size} ranks)")
    else:
        lines.append("n-gram table: none (features.ngram off: no table, sign pool or row exchange)")
    if model.features.off():
        lines.append(f"switched off: {', '.join(model.features.off())} (config.FeatureConfig)")
    if model.features.added():
        lines.append(f"past the record, on: {', '.join(model.features.added())} (config.FeatureConfig)")
    return "\n".join(lines)


def main(argv=None) -> None:
    args = parse_preset_args("python -m model.summary", __doc__, argv, RUN_PRESETS, world_size_default=8,
                             world_size_help="ranks the n-gram table is sharded over (default: 8)")
    cfg = args.run_config  # the preset, --set applied (model.* and features.* matter here)
    print(format_summary(cfg.model, build_on_meta(cfg.model, cfg.features), args.world_size))


if __name__ == "__main__":
    main()
