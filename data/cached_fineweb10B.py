"""Download the GPT-2 token shards of FineWeb10B from the Hugging Face dataset kjj0/fineweb10B-gpt2.

    python data/cached_fineweb10B.py 9          # the val shard and train shards 1..9 (100M tokens each)
    python data/cached_fineweb10B.py --dir /scratch/fineweb10B

Files land in data/fineweb10B/ (or --dir): fineweb_val_000000.bin and fineweb_train_000001.bin up
to N (all 103 by default; a record run reads about 4). A file already there with a valid header and
size is skipped, so rerunning after a failure resumes. Each download is checked (header, size,
token ids) and deleted if corrupt. HF_ENDPOINT (a mirror) and HF_HUB_OFFLINE work as in
huggingface_hub. (Upstream's script counted N with the val shard: its N = 9 fetched 8 train shards.)
"""
import os
import sys

if __name__ == "__main__" and not __package__:
    # Run as a script: Python put data/ first on sys.path, where data/tokenize.py would shadow the
    # standard library's `tokenize` (imported by huggingface_hub). Put the repo root there instead.
    _data_dir = os.path.dirname(os.path.realpath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.realpath(p or os.curdir) != _data_dir]
    sys.path.insert(0, os.path.dirname(_data_dir))

import argparse  # noqa: E402  (after the sys.path fix above)
from pathlib import Path  # noqa: E402

from data.shards import ShardError, read_shard, shard_num_tokens  # noqa: E402

REPO_ID = "kjj0/fineweb10B-gpt2"  # the record's data source (record #89's README and train_gpt.py)
NUM_TRAIN_SHARDS = 103  # fineweb_train_000001 .. 000103: the full FineWeb10B (upstream data/cached_fineweb10B.py)
DEFAULT_DIR = Path(__file__).resolve().parent / "fineweb10B"


def shard_names(num_train_shards: int) -> list[str]:
    return ["fineweb_val_000000.bin"] + [f"fineweb_train_{i:06d}.bin" for i in range(1, num_train_shards + 1)]


def fetch(name: str, out_dir: Path, force: bool) -> Path:
    from huggingface_hub import hf_hub_download  # reads HF_ENDPOINT / HF_HUB_OFFLINE at import

    return Path(hf_hub_download(repo_id=REPO_ID, filename=name, repo_type="dataset", local_dir=out_dir,
                                force_download=force))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="data/cached_fineweb10B.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("num_train_shards", nargs="?", type=int, default=NUM_TRAIN_SHARDS, metavar="N",
                        help=f"train shards to fetch, from 000001 (default: all {NUM_TRAIN_SHARDS})")
    parser.add_argument("--dir", type=Path, default=DEFAULT_DIR, help=f"destination (default: {DEFAULT_DIR})")
    args = parser.parse_args(argv)
    if args.num_train_shards < 0:
        parser.error(f"N must be >= 0, got {args.num_train_shards}")
    retry = f"python data/cached_fineweb10B.py {args.num_train_shards} --dir {args.dir}"
    names = shard_names(args.num_train_shards)

    for i, name in enumerate(names, 1):
        path = args.dir / name
        force = False
        if path.exists():
            try:
                num_tokens = shard_num_tokens(path)
                print(f"[{i}/{len(names)}] {name}: complete ({num_tokens:,} tokens), skipped")
                continue
            except ShardError as e:
                print(f"[{i}/{len(names)}] {name}: incomplete or corrupt ({e}), downloading again")
                force = True
        else:
            print(f"[{i}/{len(names)}] {name}: downloading")
        try:
            fetch(name, args.dir, force)
        except KeyboardInterrupt:
            raise
        except Exception as e:  # network, HTTP and hub errors alike: say what failed and how to go on
            offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")
            hint = ("HF_HUB_OFFLINE is set, so nothing can be downloaded: unset it. " if offline else "")
            endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co")
            raise SystemExit(f"failed to download {name} from {endpoint} (dataset {REPO_ID}): "
                             f"{type(e).__name__}: {e}\n{hint}Files already complete are kept; rerun "
                             f"`{retry}` to retry.")
        try:
            read_shard(path)  # header, size and every token id
        except ShardError as e:
            path.unlink(missing_ok=True)
            raise SystemExit(f"downloaded {name} is corrupt: {e}\nDeleted it; rerun `{retry}` to retry.")
    print(f"{len(names)} files ready in {args.dir}")


if __name__ == "__main__":
    main()
