"""Checkpoints (runtime/checkpoints.py save_checkpoint / read_checkpoint / load_checkpoint), without a training run.

A checkpoint holds what evaluation reads (issue #32 point 6: no optimizer state) and loads at any
world size (issue #30 point 5): the n-gram rows saved by W ranks land in the shards of W' ranks, read
from memory-mapped files, only the overlapping rows, in pieces. The runs themselves (1 process and
2 ranks, each evaluating the other's checkpoint) are in tests/run/test_run_train.py.
"""
import dataclasses
import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from config import RUN_PRESETS
from model.embeddings import NgramTable
from runtime import checkpoints
from runtime.config_check import checkpoint_problems
import train_gpt

# the smoke preset with a 64-row n-gram table (8 rows per rank at W=8): small enough to check by hand
CFG = dataclasses.replace(RUN_PRESETS["smoke"], model=dataclasses.replace(RUN_PRESETS["smoke"].model, ngram_rows=64))
DIM = CFG.model.model_dim


class TinyModel(torch.nn.Module):
    """What load_checkpoint asks of the model: a state_dict and refresh_fp8."""

    def __init__(self, fill: float = 0.0):
        super().__init__()
        self.w = torch.nn.Parameter(torch.full((3, 2), fill))
        self.refreshed = 0

    def refresh_fp8(self):
        self.refreshed += 1


def fake_run(rank: int, world: int, full: torch.Tensor | None = None, fill: float = 0.0, cfg=CFG):
    """What save_checkpoint and load_checkpoint read of a training.Run: cfg, setup, table, model.
    With `full` (the whole table), this rank's shard holds its rows."""
    table = NgramTable(cfg.model, rank, world)
    if full is not None:
        table.rows.copy_(full[table.lo:table.hi])
    setup = SimpleNamespace(rank=rank, world_size=world, is_master=rank == 0)
    return SimpleNamespace(cfg=cfg, setup=setup, table=table, model=TinyModel(fill))


def full_table(seed: int = 0) -> torch.Tensor:
    return torch.randn(CFG.model.ngram_rows, DIM, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


def save_by(world: int, full: torch.Tensor, logs: Path, step: int = 5, run_id: str = "run") -> Path:
    """The checkpoint `world` ranks write at `step` (every rank calls save_checkpoint, as in a run)."""
    folders = {checkpoints.save_checkpoint(fake_run(r, world, full, fill=1.5), step, logs, run_id) for r in range(world)}
    (folder,) = folders
    return folder


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """{W: checkpoint folder written by W ranks} for W in 1, 2, 4, 8, and the full table."""
    logs, full = tmp_path_factory.mktemp("logs"), full_table()
    return {w: save_by(w, full, logs, run_id=f"w{w}") for w in (1, 2, 4, 8)}, full


# ---- any world size loads any other's checkpoint ------------------------------------------------


@pytest.mark.parametrize("saved_by,loaded_by", [(8, 1), (8, 2), (8, 4), (8, 8), (1, 8), (2, 8), (4, 8), (2, 1), (1, 2)])
def test_rows_saved_by_w_ranks_land_in_the_shards_of_w_prime(saved, saved_by, loaded_by, monkeypatch):
    """Each loading rank's shard equals the full table sliced by hand at its own [lo, hi), with
    pieces of 3 rows, so pieces straddle the saved shards' boundaries (8 rows at W=8)."""
    folders, full = saved
    monkeypatch.setattr(checkpoints, "CHECKPOINT_CHUNK_BYTES", 3 * DIM * 2)
    per_rank = CFG.model.ngram_rows // loaded_by
    for rank in range(loaded_by):
        run = fake_run(rank, loaded_by)
        assert checkpoints.load_checkpoint(run, folders[saved_by]) == 5
        assert torch.equal(run.table.rows, full[rank * per_rank:(rank + 1) * per_rank])
        assert torch.equal(run.model.w, torch.full((3, 2), 1.5)) and run.model.refreshed == 1


class RecordingRows:
    """A saved shard's rows that note every slice taken of them."""

    def __init__(self, rows: torch.Tensor, log: list, name: int):
        self.rows, self.log, self.name = rows, log, name

    def __getitem__(self, index: slice) -> torch.Tensor:
        self.log.append((self.name, index.start, index.stop))
        return self.rows[index]


def test_only_the_overlapping_rows_are_read_in_pieces():
    """A shard of rows [20, 44) of a table saved as 8 shards of 8 rows: the copy reads shards 2-5
    only, rows [4, 8) of shard 2, all of 3 and 4, [0, 4) of 5, in pieces of at most 3 rows."""
    full, log = full_table(1), []
    shards = [checkpoints.SavedShard(Path(f"rank{r}.pt"), 8 * r, 8 * r + 8, RecordingRows(full[8 * r:8 * r + 8], log, r))
              for r in range(8)]
    dst = torch.zeros(24, DIM, dtype=torch.bfloat16)
    assert checkpoints.copy_overlapping_rows(dst, 20, shards, chunk_rows=3) == 24
    assert torch.equal(dst, full[20:44])
    assert log == [(2, 4, 7), (2, 7, 8), (3, 0, 3), (3, 3, 6), (3, 6, 8), (4, 0, 3), (4, 3, 6), (4, 6, 8),
                   (5, 0, 3), (5, 3, 4)]


@pytest.mark.skipif(not Path("/proc/self/maps").is_file(), reason="reads the process's mappings (Linux)")
def test_the_rank_files_are_memory_mapped_not_read(saved):
    """read_checkpoint's rows live in a mapping of their rank file (torch.load mmap=True): the host
    holds no copy of a shard; pages are read as the copy touches them."""
    folders, _ = saved
    checkpoint = checkpoints.read_checkpoint(folders[2], CFG)
    maps = Path("/proc/self/maps").read_text().splitlines()
    for shard in checkpoint.shards:
        ptr = shard.rows.data_ptr()
        ranges = [tuple(int(x, 16) for x in line.split()[0].split("-")) for line in maps
                  if line.endswith(str(shard.path))]
        assert any(lo <= ptr < hi for lo, hi in ranges), (shard.path, ranges)


# ---- a checkpoint holds what is read (issue #32 point 6) --------------------------------------------


class RecordingDict(dict):
    """A loaded file's dict that notes every key read."""

    def __init__(self, data, log: set):
        super().__init__(data)
        self.log = log

    def __getitem__(self, key):
        self.log.add(key)
        return super().__getitem__(key)

    def get(self, key, default=None):
        self.log.add(key)
        return super().get(key, default)


def test_the_files_hold_exactly_what_loading_reads(saved, monkeypatch):
    """model.pt holds the step, config, world size, weights and code; rank{r}.pt the step and the
    rows with their range; loading reads every entry but the code (kept for people: the source
    that wrote the weights). No optimizer state is saved, and so none goes unread."""
    folders, _ = saved
    folder = folders[2]
    assert sorted(p.name for p in folder.iterdir()) == ["model.pt", "rank0.pt", "rank1.pt"]
    files = {p.name: torch.load(p, weights_only=True) for p in folder.iterdir()}
    assert set(files["model.pt"]) == checkpoints.MODEL_FILE_KEYS == {"step", "config", "world_size", "model", "code"}
    for name in ("rank0.pt", "rank1.pt"):
        assert set(files[name]) == checkpoints.SHARD_FILE_KEYS == {"step", "ngram_lo", "ngram_hi", "ngram_rows"}
    assert "# runtime/training.py" in files["model.pt"]["code"]

    read = {}
    load_mapped = checkpoints._load_mapped
    monkeypatch.setattr(checkpoints, "_load_mapped",
                        lambda path, what: RecordingDict(load_mapped(path, what), read.setdefault(path.name, set())))
    checkpoints.load_checkpoint(fake_run(0, 1), folder)
    assert read == {"model.pt": checkpoints.MODEL_FILE_KEYS - {"code"},
                    "rank0.pt": checkpoints.SHARD_FILE_KEYS, "rank1.pt": checkpoints.SHARD_FILE_KEYS}


def test_without_the_ngram_table_there_is_no_rank_file(tmp_path):
    cfg = dataclasses.replace(CFG, features=dataclasses.replace(CFG.features, ngram=False))
    run = fake_run(0, 1, cfg=cfg)
    run.table = None
    folder = checkpoints.save_checkpoint(run, 3, tmp_path, "run")
    assert [p.name for p in folder.iterdir()] == ["model.pt"]
    loaded = fake_run(0, 1, cfg=cfg)
    loaded.table = None
    assert checkpoints.load_checkpoint(loaded, folder) == 3


# ---- bad checkpoints: one line naming the file and what was expected --------------------------------


def _copy(folder: Path, to: Path) -> Path:
    to.mkdir()
    for p in folder.iterdir():
        (to / p.name).write_bytes(p.read_bytes())
    return to


def _bad_checkpoints(saved, tmp: Path):
    """(case, folder, the config loading it, the exception, [what the line holds])."""
    folders, full = saved
    gap = _copy(folders[2], tmp / "gap")
    (gap / "rank1.pt").unlink()
    mixed = _copy(folders[2], tmp / "mixed")
    (mixed / "rank1.pt").write_bytes((folders[4] / "rank1.pt").read_bytes())
    stale = _copy(folders[2], tmp / "stale")
    (stale / "rank1.pt").write_bytes((save_by(2, full, tmp / "other", step=7) / "rank1.pt").read_bytes())
    stray = _copy(folders[2], tmp / "stray")
    (stray / "rank2.pt").write_bytes((folders[4] / "rank2.pt").read_bytes())
    narrow = _copy(folders[1], tmp / "narrow")
    torch.save({"step": 5, "ngram_lo": 0, "ngram_hi": 64, "ngram_rows": torch.zeros(64, 4)}, narrow / "rank0.pt")
    foreign = tmp / "foreign"
    foreign.mkdir()
    torch.save({"state_dict": {"w": torch.zeros(2)}}, foreign / "model.pt")
    text = tmp / "text"
    text.mkdir()
    (text / "model.pt").write_text("not a checkpoint")
    pickled = tmp / "pickled"
    pickled.mkdir()
    torch.save({"config": SimpleNamespace(a=1)}, pickled / "model.pt")
    bigger = dataclasses.replace(CFG, model=dataclasses.replace(CFG.model, ngram_rows=128))
    return [
        ("a missing folder", tmp / "nowhere", CFG, FileNotFoundError, [f"{tmp / 'nowhere'}: no such folder"]),
        ("no model.pt", tmp, CFG, FileNotFoundError, [f"{tmp}: no model.pt there"]),
        ("a missing rank file", gap, CFG, FileNotFoundError,
         [f"{gap / 'rank1.pt'}: missing; model.pt says 2 rank(s) saved this checkpoint, so n-gram rows [32, 64) "
          "are in no file"]),
        ("a table of another size", folders[2], bigger, checkpoints.CheckpointError,
         ["saved by a --config smoke run whose model differs from --config smoke's (ngram_rows)"]),
        ("a rank file of another world size", mixed, CFG, checkpoints.CheckpointError,
         [f"{mixed / 'rank1.pt'}: holds n-gram rows [16, 32) shaped (16, {DIM}), expected rank 1 of 2's rows [32, 64) "
          "of the 64-row table"]),
        ("rows of another width", narrow, CFG, checkpoints.CheckpointError,
         [f"{narrow / 'rank0.pt'}: holds n-gram rows [0, 64) shaped (64, 4), expected", f"shaped (64, {DIM})"]),
        ("a rank file of another step", stale, CFG, checkpoints.CheckpointError,
         [f"{stale / 'rank1.pt'}: saved at step 7, model.pt at step 5"]),
        ("a rank file too many", stray, CFG, checkpoints.CheckpointError,
         [f"{stray / 'rank2.pt'}: model.pt says 2 rank(s) saved this checkpoint, expected rank0.pt .. rank1.pt only"]),
        ("a foreign model.pt", foreign, CFG, checkpoints.CheckpointError, [f"{foreign / 'model.pt'}: no run config in it"]),
        ("a model.pt that is no torch file", text, CFG, checkpoints.CheckpointError,
         [f"{text / 'model.pt'}: cannot be read as a --save-checkpoint model.pt (RuntimeError: "]),
        ("a model.pt that would run code to load", pickled, CFG, checkpoints.CheckpointError,
         [f"{pickled / 'model.pt'}: cannot be read as a --save-checkpoint model.pt (UnpicklingError: "]),
    ]


def test_a_bad_checkpoint_is_one_line_naming_the_file(saved, tmp_path, monkeypatch):
    """Each bad folder: load_checkpoint raises before copying a row (the run's table stays zero),
    and config_check reports the same line, prefixed with the flag."""
    for case, folder, cfg, error, expected in _bad_checkpoints(saved, tmp_path):
        run = fake_run(0, 1, cfg=cfg)
        with pytest.raises(error) as caught:
            checkpoints.load_checkpoint(run, folder)
        line = str(caught.value)
        assert "\n" not in line and all(e in line for e in expected), (case, line)
        assert not run.table.rows.any() and run.model.refreshed == 0, case
        assert checkpoint_problems(cfg, folder) == [f"--eval-checkpoint {line}"], case


def _tiny_shards(out: Path) -> Path:
    from data.shards import BOS_ID, write_shard

    rng = np.random.default_rng(0)
    for name, n in (("synthetic_train_000001.bin", 20_000), ("synthetic_val_000000.bin", 4 * 2048 + 1)):
        tokens = rng.integers(0, 50_000, n)
        tokens[::50] = BOS_ID
        write_shard(out / name, tokens)
    return out


def test_train_gpt_refuses_a_checkpoint_with_a_gap_at_load_too(tmp_path, monkeypatch, capsys):
    """A rank file gone after the up-front check (config_check, tested above) is refused by
    load_checkpoint in the run: exit 2, one line, a `failed` runs.jsonl line, no traceback."""
    smoke = RUN_PRESETS["smoke"]
    runs = [fake_run(r, 2, cfg=smoke) for r in range(2)]
    folder = {checkpoints.save_checkpoint(run, 4, tmp_path / "logs", "run") for run in runs}.pop()
    (folder / "rank1.pt").unlink()
    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(train_gpt, "check_run", lambda cfg, args: None)  # the folder changed after the check
    shards = tmp_path / "shards"
    shards.mkdir()
    records = tmp_path / "records"
    with pytest.raises(SystemExit) as stop:
        train_gpt.main(["--config", "smoke", "--records-dir", str(records), "--data-path", str(_tiny_shards(shards)),
                        "--val-tokens", "2048", "--eval-checkpoint", str(folder)])
    assert stop.value.code == 2
    out, err = capsys.readouterr()
    expected = f"train_gpt.py: error: --eval-checkpoint {folder / 'rank1.pt'}: missing; model.pt says 2 rank(s)"
    assert err.startswith(expected) and len(err.splitlines()) == 1 and "Traceback" not in out + err, err
    (entry,) = [json.loads(line) for line in (records / "runs.jsonl").read_text().splitlines()]
    assert entry["status"] == "failed" and "rank1.pt: missing" in entry["error"]
