"""Checkpoints: what --save-checkpoint writes and --eval-checkpoint / evaluate.py load (docs/checkpoints.md).

    folder = save_checkpoint(run, step, logs_dir, run_id)   # logs/<run_id>/state_stepNNNNNN/
    saved = read_checkpoint(folder, cfg)                    # checked, memory-mapped (runtime/config_check.py)
    step = load_checkpoint(run, folder)                     # into a built Run (runtime/training.py)
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from tqdm import tqdm

from config import FeatureConfig, RunConfig
from model.embeddings import ngram_shard_range
from runtime.source import REPO_ROOT, read_source, run_source_files
from perf.host_table import HostRows

if TYPE_CHECKING:  # an annotation only: checking a folder (runtime/config_check.py) builds no run
    from runtime.training import Run


# What a checkpoint holds (issue #32 point 6): what evaluation and sampling read, nothing else.
# Resuming a run was weighed and not built: a bitwise resume needs the optimizers' state (moments,
# mantissas, tail averages, the n-gram rows' Adam), the schedule position, the loader's position,
# every sampler's RNG, the delayed fp8 scales and the deferred gathers in flight, each kept per
# virtual rank, and its test (resumed losses bitwise the uninterrupted run's) would follow every
# change to those pieces. A run here is minutes (record #360: 39.9 s on 8xH100), so a rerun is the
# resume. Dropping the optimizers' state takes a smoke checkpoint from 305 MB to 66 MB and a record
# one from 124.6 to 121.6 GiB (docs/checkpoints.md).
MODEL_FILE_KEYS = frozenset({"step", "config", "world_size", "model", "code"})  # code: provenance, read by people
SHARD_FILE_KEYS = frozenset({"step", "ngram_lo", "ngram_hi", "ngram_rows"})
# rows are copied from the mapped files onto the table in pieces of this size, so neither the host
# nor the device holds a second copy of a shard (record #360: 15 GiB of rows per rank file)
CHECKPOINT_CHUNK_BYTES = 256 * 2**20


class CheckpointError(ValueError):
    """A folder that is not a checkpoint this run can load: one line naming the file and what was
    expected (train_gpt.py and runtime/config_check.py make it an exit-2 refusal)."""


def save_checkpoint(run: Run, step: int, logs_dir: Path, run_id: str) -> Path:
    """logs/<run_id>/state_step{step:06d}/: model.pt (rank 0: step, config, code, world size, the
    model's weights) and rank{r}.pt (each rank's n-gram rows; none without the table), each written
    to a temp file and renamed, in torch.save's zip format, which torch.load can memory-map. Every
    rank writes into rank 0's run folder (each rank's log draws its own run id) and returns once all
    files are written."""
    grouped = run.setup.world_size > 1 and dist.is_initialized()
    if grouped:
        agreed = [run_id]
        dist.broadcast_object_list(agreed, src=0)
        run_id = agreed[0]
    folder = logs_dir / run_id / f"state_step{step:06d}"
    folder.mkdir(parents=True, exist_ok=True)

    def atomic_save(obj: dict, path: Path) -> None:
        tmp = path.with_suffix(".tmp")
        torch.save(obj, tmp)
        tmp.replace(path)

    if run.setup.is_master:
        atomic_save({"step": step, "config": asdict(run.cfg), "code": read_source(run_source_files(REPO_ROOT), REPO_ROOT),
                     "model": run.model.state_dict(), "world_size": run.setup.world_size}, folder / "model.pt")
    if run.table is not None:  # features.ngram off: no table, no rank files
        rows = run.table.rows.host_tensor() if isinstance(run.table.rows, HostRows) else run.table.rows
        atomic_save({"step": step, "ngram_lo": run.table.lo, "ngram_hi": run.table.hi, "ngram_rows": rows},
                    folder / f"rank{run.setup.rank}.pt")
    if grouped:
        dist.barrier()
    return folder


@dataclass
class SavedShard:
    """One rank file's n-gram rows [lo, hi) of the table, memory-mapped (read when sliced)."""
    path: Path
    lo: int
    hi: int
    rows: torch.Tensor  # (hi − lo, D) bf16, on the host, backed by the file


@dataclass
class SavedCheckpoint:
    """A checked --save-checkpoint folder, its tensors memory-mapped: `read_checkpoint`."""
    step: int
    world_size: int
    model: dict  # the model's state_dict (host tensors backed by model.pt)
    shards: list[SavedShard]  # by rank: together rows [0, ngram_rows), none without the table


def _load_mapped(path: Path, what: str) -> dict:
    """torch.load of a checkpoint file, mapped (mmap: nothing is read until a tensor is touched) and
    weights_only (tensors and plain values: a foreign pickle runs no code here)."""
    try:
        saved = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except Exception as e:  # truncated, not torch.save's zip format, or a foreign pickle
        reason = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise CheckpointError(f"{path}: cannot be read as {what} ({type(e).__name__}: {reason[:200]})") from None
    if not isinstance(saved, dict):
        raise CheckpointError(f"{path}: holds a {type(saved).__name__}, expected {what} (a dict)")
    return saved


CHECKPOINT_FOLDER = "expected records/logs/<run_id>/state_stepNNNNNN, written by --save-checkpoint"


def open_model_file(folder: Path) -> tuple[Path, dict]:
    """(folder/model.pt, its contents, memory-mapped and weights_only): the first check of every reader
    (read_checkpoint here, evaluate.py's). Raises FileNotFoundError (no folder, no model.pt) or
    CheckpointError (not a torch.save dict), one line naming the file."""
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder}: no such folder; {CHECKPOINT_FOLDER}")
    model_file = folder / "model.pt"
    if not model_file.is_file():
        raise FileNotFoundError(f"{folder}: no model.pt there; {CHECKPOINT_FOLDER}")
    return model_file, _load_mapped(model_file, "a --save-checkpoint model.pt")


def read_checkpoint(folder: Path, cfg: RunConfig) -> SavedCheckpoint:
    """The checkpoint in `folder`, checked against `cfg` before anything is copied: model.pt saved
    with this preset's model and feature switches, and one rank file per saving rank whose rows tile
    the n-gram table [0, ngram_rows) with no gap, all saved at the same step. Raises
    FileNotFoundError (a missing folder or file) or CheckpointError, one line naming the file."""
    folder = Path(folder)
    where = CHECKPOINT_FOLDER
    model_file, saved = open_model_file(folder)
    if not isinstance(saved.get("config"), dict):
        raise CheckpointError(f"{model_file}: no run config in it; {where}")
    saved_cfg = saved["config"]
    saved_features = saved_cfg.get("features", asdict(FeatureConfig()))  # saved before the switches: all on
    if saved_features != asdict(cfg.features):
        changed = sorted(k for k, v in asdict(cfg.features).items() if saved_features.get(k) != v)
        raise CheckpointError(
            f"{folder}: saved by a run with other feature switches ("
            + ", ".join(f"features.{k}=" + str(saved_features.get(k)).lower() for k in changed)
            + "); pass the same --set features.* as the run that saved it")
    if saved_cfg.get("model") != asdict(cfg.model):
        changed = sorted(k for k, v in asdict(cfg.model).items() if saved_cfg.get("model", {}).get(k) != v)
        name = saved_cfg.get("name", "?")
        raise CheckpointError(f"{folder}: saved by a --config {name} run whose model differs from --config "
                              f"{cfg.name}'s ({', '.join(changed)}); pass --config {name}")
    missing = sorted(MODEL_FILE_KEYS - saved.keys())
    if missing:
        raise CheckpointError(f"{model_file}: has no {', '.join(missing)} entries; {where}")
    step, world = saved["step"], saved["world_size"]
    if not isinstance(world, int) or world < 1:
        raise CheckpointError(f"{model_file}: world_size {world!r}, expected the saving run's process count (>= 1)")
    shards = []
    if cfg.features.ngram:
        num_rows, dim = cfg.model.ngram_rows, cfg.model.model_dim
        for rank in range(world):
            path = folder / f"rank{rank}.pt"
            lo, hi = ngram_shard_range(num_rows, rank, world)
            if not path.is_file():
                raise FileNotFoundError(f"{path}: missing; model.pt says {world} rank(s) saved this checkpoint, "
                                        f"so n-gram rows [{lo:,}, {hi:,}) are in no file")
            shard = _load_mapped(path, "a --save-checkpoint rank file")
            missing = sorted(SHARD_FILE_KEYS - shard.keys())
            if missing:
                raise CheckpointError(f"{path}: has no {', '.join(missing)} entries; expected rank {rank}'s "
                                      f"n-gram rows [{lo:,}, {hi:,}) of the {num_rows:,}-row table")
            rows = shard["ngram_rows"]
            got = (shard["ngram_lo"], shard["ngram_hi"], tuple(rows.shape) if torch.is_tensor(rows) else rows)
            if got != (lo, hi, (hi - lo, dim)):
                raise CheckpointError(
                    f"{path}: holds n-gram rows [{got[0]}, {got[1]}) shaped {got[2]}, expected rank {rank} of "
                    f"{world}'s rows [{lo:,}, {hi:,}) of the {num_rows:,}-row table (model.ngram_rows), "
                    f"shaped ({hi - lo}, {dim})")
            if shard["step"] != step:
                raise CheckpointError(f"{path}: saved at step {shard['step']}, model.pt at step {step}; "
                                      f"expected the files of one --save-checkpoint")
            shards.append(SavedShard(path, lo, hi, rows))
        extra = sorted(p.name for p in folder.glob("rank*.pt") if p.stem[4:] not in {str(r) for r in range(world)})
        if extra:
            raise CheckpointError(f"{folder / extra[0]}: model.pt says {world} rank(s) saved this checkpoint, "
                                  f"expected rank0.pt .. rank{world - 1}.pt only")
    return SavedCheckpoint(step, world, saved["model"], shards)


def copy_overlapping_rows(dst: torch.Tensor, dst_lo: int, shards: list[SavedShard], chunk_rows: int,
                          progress: bool = False) -> int:
    """Fill `dst`, rows [dst_lo, dst_lo + len(dst)) of the n-gram table (on any device), with the
    rows of the saved shards that overlap it, `chunk_rows` rows per copy: only the overlapping rows
    of the mapped files are read, a piece at a time. Returns the rows copied."""
    dst_hi = dst_lo + dst.size(0)
    pieces = [(shard, a, min(a + chunk_rows, hi)) for shard in shards
              for lo, hi in [(max(shard.lo, dst_lo), min(shard.hi, dst_hi))] for a in range(lo, hi, chunk_rows)]
    copied = 0
    for shard, a, b in tqdm(pieces, desc="n-gram rows from the checkpoint", unit="piece", disable=not progress):
        dst[a - dst_lo: b - dst_lo].copy_(shard.rows[a - shard.lo: b - shard.lo])  # (b − a, D)
        copied += b - a
    return copied


def load_checkpoint(run: Run, folder: Path) -> int:
    """The checkpoint's model weights and this process's n-gram rows, whatever world size saved it:
    the files are memory-mapped on the host and only the rows overlapping this shard are copied, in
    pieces of CHECKPOINT_CHUNK_BYTES. Returns the step it was saved at. Raises FileNotFoundError or
    CheckpointError (`read_checkpoint`) before anything is copied."""
    saved = read_checkpoint(folder, run.cfg)
    run.model.load_state_dict(saved.model)
    if run.table is not None:
        rows = run.table.rows.host_tensor() if isinstance(run.table.rows, HostRows) else run.table.rows
        chunk_rows = max(1, CHECKPOINT_CHUNK_BYTES // (rows.size(1) * rows.element_size()))
        big = rows.numel() * rows.element_size() > 8 * CHECKPOINT_CHUNK_BYTES
        copied = copy_overlapping_rows(rows, run.table.lo, saved.shards, chunk_rows,
                                       progress=big and run.setup.is_master)
        if copied != rows.size(0):  # read_checkpoint checked the tiling: a bug if this fails
            raise RuntimeError(f"load_checkpoint: copied {copied} of the shard's {rows.size(0)} n-gram rows")
    run.model.refresh_fp8()
    return saved.step
