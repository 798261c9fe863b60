"""Bad input is refused before the work starts: every flag, variable and preset constraint, checked up front.

`check_run(cfg, args)` looks at everything a run's configuration decides before the process group,
the model or any data is touched (the flags, the SPEEDRUN_* variables, torchrun's WORLD_SIZE/RANK,
the schedule, the data folder and its shards, the records folder, the checkpoint to evaluate) and
raises one `config.ConfigError` holding every problem found, one line each: the flag or variable,
its value, what is allowed, the fix. Entry points run under `cli.exit_on_config_error`, which
prints those lines and exits 2 without a traceback; a traceback stays for bugs. The command-line
plumbing every entry point shares (the parser, --set, the tools' --config line) is cli.py's.

docs/bad_input.md lists what is checked.
"""
from __future__ import annotations

import argparse
import glob
import os
from pathlib import Path

from config import NGRAM_TABLE_PLACEMENTS, ConfigError, RunConfig, feature_problems

REPO_ROOT = Path(__file__).resolve().parents[1]


# ----------------------------------------------------------------------------------------------------
# train_gpt.py's run
# ----------------------------------------------------------------------------------------------------


def records_folder(cfg: RunConfig) -> Path:
    return Path(cfg.records_dir) if Path(cfg.records_dir).is_absolute() else REPO_ROOT / cfg.records_dir


def records_folder_problems(records: Path) -> list[str]:
    """Whether logs/ and runs.jsonl can be written under `records`, tried for real (permission bits
    say nothing for root): the folder is made if missing and a temp file written and removed in it and
    in logs/. Checked first: a refused run is recorded there, so a folder that cannot take the record
    is reported without one."""
    import tempfile

    flag = f"--records-dir {records}"
    if records.exists() and not records.is_dir():
        return [f"{flag}: is a file; expected a folder (it gets logs/ and runs.jsonl)"]
    if (records / "runs.jsonl").is_dir():
        return [f"{flag}: runs.jsonl there is a folder; expected the runs file"]
    try:
        for folder in (records, records / "logs"):
            folder.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryFile(dir=folder):
                pass
    except OSError as e:
        return [f"{flag}: cannot write there ({e.strerror or e}: {e.filename or folder}); fix its permissions "
                f"or pass another --records-dir"]
    return []


def data_folder(cfg: RunConfig) -> Path:
    """The shard folder: --data-path as given, or relative to the repository when it is not found."""
    root = Path(cfg.data_path)
    if not root.is_absolute() and not root.exists():
        root = REPO_ROOT / root
    return root


def shard_globs(cfg: RunConfig) -> tuple[str, str]:
    root = data_folder(cfg)
    return str(root / cfg.train_pattern), str(root / cfg.val_pattern)


def _embedded(cfg: RunConfig) -> bool:
    """The run reads the embedded corpus's folder (data/synthetic), which is written on first use."""
    import data.synthetic as synthetic

    return data_folder(cfg).resolve() == synthetic.DEFAULT_DIR


def _get_shards_hint(cfg: RunConfig) -> str:
    if "fineweb" in cfg.train_pattern or "fineweb" in Path(cfg.data_path).name:
        # the record reads about 4 train shards of 100M tokens (upstream fetches 8); the smoke run 160k tokens
        return f"python data/cached_fineweb10B.py {1 if cfg.name == 'smoke' else 9}"
    if _embedded(cfg):
        return "python data/synthetic.py --out DIR --train-tokens N, then --data-path DIR"
    return "python data/tokenize.py YOUR_TEXT... --out DIR, then --data-path DIR"


def data_problems(cfg: RunConfig, steps: int | None, schedule, validation: bool = True) -> list[str]:
    """The shard folder exists, its training shards hold the tokens of `steps` steps (None: an
    evaluation, no training data read) and (with `validation`) its validation shards hold
    cfg.val_tokens. The embedded corpus (the smoke preset's data/synthetic) is written here on first
    use, or rewritten if incomplete (data/synthetic.py: seconds, every rank may call it)."""
    from data.shards import ShardError, shard_num_tokens

    root, how = data_folder(cfg), _get_shards_hint(cfg)
    if _embedded(cfg):
        import data.synthetic as synthetic

        try:
            synthetic.ensure_corpus(synthetic.DEFAULT_DIR, progress=os.environ.get("RANK", "0") in ("0", ""))
        except OSError as e:
            return [f"--data-path {cfg.data_path}: cannot write the embedded corpus there ({e.strerror or e}: "
                    f"{e.filename or root}); run `python data/synthetic.py --out DIR` somewhere writable, then "
                    f"--data-path DIR"]
    if not root.exists():
        return [f"--data-path {cfg.data_path}: no such folder; pass --data-path DIR (or DATA_PATH) holding the "
                f"shards, or get them with `{how}`"]
    if not root.is_dir():
        return [f"--data-path {cfg.data_path}: is a file; expected the folder holding the shards "
                f"({cfg.train_pattern}, {cfg.val_pattern})"]
    problems = []
    train_glob, val_glob = shard_globs(cfg)

    def sizes(pattern: str, kind: str) -> list[int] | None:
        files = sorted(glob.glob(pattern))
        if not files:
            problems.append(f"--data-path {cfg.data_path}: no {kind} shards match {Path(pattern).name} in {root}; "
                            f"get them with `{how}`")
            return None
        try:
            return [shard_num_tokens(f) for f in files]
        except (ShardError, OSError) as e:
            problems.append(f"--data-path {cfg.data_path}: {e}")
            return None

    if steps is not None:
        have = sizes(train_glob, "training")
        # a batch takes its tokens plus one target per rank (data/loader.py)
        needed = sum(schedule.batch_tokens(s) + cfg.virtual_world_size for s in range(steps))
        if have is not None and sum(have) < needed:
            problems.append(f"--data-path {cfg.data_path}: the training shards hold {sum(have):,} tokens, {steps} "
                            f"steps read at least {needed:,}; add shards (`{how}`) or run fewer steps "
                            f"(--max-steps, --steps)")
    val_sizes = sizes(val_glob, "validation") if validation else None
    if val_sizes is not None and cfg.val_tokens > 0 and cfg.val_tokens % cfg.val_batch_tokens == 0:
        # data/loader.val_batches: each validation step reads val_batch_tokens + 1 from one file
        servable = sum(max(n - 1, 0) // cfg.val_batch_tokens for n in val_sizes) * cfg.val_batch_tokens
        if servable < cfg.val_tokens:
            problems.append(f"--val-tokens {cfg.val_tokens}: the validation shards serve {servable:,} tokens "
                            f"({cfg.val_batch_tokens:,} + 1 per step from one file); pass --val-tokens "
                            f"{servable} or less, or add validation shards")
    return problems


def checkpoint_problems(cfg: RunConfig, folder: Path) -> list[str]:
    """--eval-checkpoint: a folder written by --save-checkpoint for this preset's model and switches,
    its rank files tiling the n-gram table (checkpoints.read_checkpoint: the files memory-mapped, no
    tensor read)."""
    from runtime.checkpoints import CheckpointError, read_checkpoint

    try:
        read_checkpoint(folder, cfg)
    except (FileNotFoundError, CheckpointError) as e:
        return [f"--eval-checkpoint {e}"]
    return []


def world_problems(cfg: RunConfig, env) -> list[str]:
    """torchrun's variables: parseable, and a process count the preset runs on."""
    values = {}
    for name, default in (("WORLD_SIZE", "1"), ("RANK", "0"), ("LOCAL_RANK", "0")):
        text = env.get(name, default)
        try:
            values[name] = int(text)
        except ValueError:
            return [f"{name}={text}: must be an integer (torchrun sets it; unset it to run one process)"]
    world, rank = values["WORLD_SIZE"], values["RANK"]
    if world < 1 or not 0 <= rank < world:
        return [f"RANK={rank} WORLD_SIZE={world}: need 0 <= RANK < WORLD_SIZE (torchrun sets both)"]
    if world not in cfg.allowed_world_sizes or cfg.virtual_world_size % world:
        return [f"WORLD_SIZE={world}: --config {cfg.name} runs on {' or '.join(map(str, cfg.allowed_world_sizes))} "
                f"process(es) (torchrun --nproc_per_node); --config dev runs on 1, 2, 4 or 8 GPUs, "
                f"--config smoke on 1 or 2 CPU processes"]
    return []


def device_problems(cfg: RunConfig) -> list[str]:
    import torch

    if cfg.device == "cuda" and not torch.cuda.is_available():
        return [f"--config {cfg.name}: needs CUDA GPUs, but torch.cuda.is_available() is False "
                f"(torch {torch.__version__}); use --config smoke on a CPU machine"]
    return []


def check_run(cfg: RunConfig, args: argparse.Namespace, env=os.environ) -> None:
    """Raise ConfigError listing every problem of this run's configuration (nothing is touched:
    no process group, no model, no data read beyond shard headers; the one write is the embedded
    corpus on its first use, see data_problems)."""
    from optim.schedule import TrainingSchedule
    from perf import backend as perf_backend

    problems = (list(getattr(args, "set_problems", [])) + records_folder_problems(records_folder(cfg))
                + world_problems(cfg, env) + device_problems(cfg) + perf_backend.unknown_variables(env))
    device = "cuda" if cfg.device == "cuda" or (cfg.device == "auto" and _cuda()) else "cpu"
    if device == "cpu" or _cuda():  # (a CUDA preset on a CPU machine is reported above)
        try:
            perf_backend.detect(env, device=device)
        except ConfigError as e:
            problems += e.problems

    schedule = None
    if cfg.schedule.base_steps < 1:
        problems.append(f"--steps {cfg.schedule.base_steps}: must be a positive number of base steps "
                        f"(--config {cfg.name}: {_default_steps(cfg)})")
    else:
        try:
            schedule = TrainingSchedule(cfg.schedule)
        except ValueError as e:
            problems.append(f"--steps {cfg.schedule.base_steps}: the schedule cannot be built ({e}); "
                            f"--config {cfg.name} runs {_default_steps(cfg)} base steps")
    total = schedule.total_steps if schedule is not None else None
    if cfg.max_steps is not None:
        if cfg.max_steps < 1:
            problems.append(f"--max-steps {cfg.max_steps}: must be at least 1 (a truncated run trains that many "
                            f"steps; omit the flag to run the whole schedule)")
        elif total is not None and cfg.max_steps > total:
            problems.append(f"--max-steps {cfg.max_steps}: the schedule has {total} steps; pass at most {total} "
                            f"(or omit the flag)")
    if cfg.collective_timeout_s < 1:
        problems.append(f"collective_timeout_s={cfg.collective_timeout_s}: must be at least 1 second")
    if cfg.ngram_table not in NGRAM_TABLE_PLACEMENTS:
        problems.append(f"--set ngram_table={cfg.ngram_table}: expected one of {', '.join(NGRAM_TABLE_PLACEMENTS)} "
                        f"(where the n-gram table lives; auto: host memory when it does not fit the device)")
    if cfg.val_every < 0:
        problems.append(f"--val-every {cfg.val_every}: must be >= 0 (0: validate only at the end)")
    if cfg.val_tokens < 1 or cfg.val_tokens % cfg.val_batch_tokens:
        per_rank = cfg.val_batch_tokens // cfg.virtual_world_size
        fix = max(cfg.val_batch_tokens, cfg.val_tokens // cfg.val_batch_tokens * cfg.val_batch_tokens)
        problems.append(f"--val-tokens {cfg.val_tokens}: must be a positive multiple of one validation step, "
                        f"{cfg.val_batch_tokens:,} tokens ({cfg.virtual_world_size} ranks × {per_rank:,}); "
                        f"try --val-tokens {fix}")
    problems += feature_problems(cfg.features)  # a switch whose requirements are off
    if cfg.features.doc_copy and schedule is not None:
        from model.doc_copy import COPY_MAX_TOKENS
        longest = max(max(schedule.batch_tokens(s) for s in range(total)), cfg.val_batch_tokens) // cfg.virtual_world_size
        if longest > COPY_MAX_TOKENS:
            problems.append(f"features.doc_copy: a rank's batch of {longest:,} tokens exceeds the matcher's power tables "
                            f"({COPY_MAX_TOKENS:,} tokens, PR #378's); use smaller batches or val_batch_tokens")
    if cfg.optim.bank_optimizer not in ("anvil", "normuon"):
        problems.append(f"optim.bank_optimizer={cfg.optim.bank_optimizer}: must be anvil (record #360) or normuon "
                        f"(record #89)")
    if cfg.seed is not None and not 0 <= cfg.seed < 2 ** 63:
        problems.append(f"--seed {cfg.seed}: must be in [0, 2**63) (or TRAIN_SEED unset: unseeded, as records run)")

    eval_folder = getattr(args, "eval_checkpoint", None)
    if eval_folder is not None:
        problems += checkpoint_problems(cfg, Path(eval_folder))
    if schedule is not None:  # an evaluation reads no training data
        steps = None if eval_folder is not None else max(0, min(total, cfg.max_steps or total))
        problems += data_problems(cfg, steps, schedule)
    if problems:
        raise ConfigError(problems)


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _default_steps(cfg: RunConfig) -> int:
    from config import RUN_PRESETS

    return RUN_PRESETS[cfg.name].schedule.base_steps
