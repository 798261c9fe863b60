"""Download the GPT-2 token shards of FineWeb10B from the Hugging Face dataset kjj0/fineweb10B-gpt2.

    python data/cached_fineweb10B.py 9          # the val shard and train shards 1..9 (100M tokens each)
    python data/cached_fineweb10B.py --dir /scratch/fineweb10B

Files land in data/fineweb10B/ (or --dir): fineweb_val_000000.bin and fineweb_train_000001.bin up
to N (all 103 by default; a record run reads about 4). huggingface_hub does the transfer (a progress
bar on a terminal; a dropped connection is resumed where it stopped, with an HTTP Range request)
into DIR/.download/; each file is then checked (its sha256 against the hub's ETag, the LFS object id;
its shard header and size; every token id) and only then moved into DIR, so DIR never holds a
partial or corrupt shard: a corrupt download is deleted and named. A file already in DIR with a valid
header and size is skipped, so rerunning after a failure continues with the missing files.
HF_ENDPOINT (a mirror) and HF_HUB_OFFLINE work as in huggingface_hub. (Upstream's script counted N
with the val shard: its N = 9 fetched 8 train shards.)
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
import hashlib  # noqa: E402
import re  # noqa: E402
import shutil  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

from data.shards import ShardError, read_shard, shard_num_tokens  # noqa: E402

REPO_ID = "kjj0/fineweb10B-gpt2"  # the record's data source (record #89's README and train_gpt.py)
NUM_TRAIN_SHARDS = 103  # fineweb_train_000001 .. 000103: the full FineWeb10B (upstream data/cached_fineweb10B.py)
DEFAULT_DIR = Path(__file__).resolve().parent / "fineweb10B"


def shard_names(num_train_shards: int) -> list[str]:
    return ["fineweb_val_000000.bin"] + [f"fineweb_train_{i:06d}.bin" for i in range(1, num_train_shards + 1)]


STAGING = ".download"  # inside --dir: huggingface_hub's local_dir, where a file waits for its checks
SHA256 = re.compile(r"[0-9a-f]{64}")
CHUNK = 1 << 24


def fetch(name: str, staging: Path) -> tuple[Path, str | None]:
    """Download `name` into `staging` (force: never trust a leftover there): (path, the hub's ETag).
    The hub's ETag of an LFS file (every shard) is its sha256."""
    from huggingface_hub import get_hf_file_metadata, hf_hub_download, hf_hub_url  # read HF_ENDPOINT at import

    etag = get_hf_file_metadata(hf_hub_url(REPO_ID, name, repo_type="dataset")).etag
    path = hf_hub_download(repo_id=REPO_ID, filename=name, repo_type="dataset", local_dir=staging,
                           force_download=True)
    return Path(path), etag


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(CHUNK):
            digest.update(block)
    return digest.hexdigest()


def check_download(path: Path, etag: str | None) -> str:
    """Raise ShardError naming what is wrong with a downloaded shard; return how it was checked."""
    if etag is not None and SHA256.fullmatch(etag):
        got = sha256_of(path)
        if got != etag:
            raise ShardError(f"{path.name}: sha256 {got} differs from the hub's {etag} (corrupted in transfer)")
        how = "sha256"
    else:
        how = "no sha256 from the hub"
    num_tokens = len(read_shard(path))  # header, size and every token id
    return f"{num_tokens:,} tokens, {how}, header and token ids checked"


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
    staging = args.dir / STAGING

    for i, name in enumerate(names, 1):
        path = args.dir / name
        if path.exists():
            try:
                num_tokens = shard_num_tokens(path)
                print(f"[{i}/{len(names)}] {name}: complete ({num_tokens:,} tokens), skipped", flush=True)
                continue
            except ShardError as e:
                print(f"[{i}/{len(names)}] {name}: incomplete or corrupt ({e}), downloading again", flush=True)
        else:
            print(f"[{i}/{len(names)}] {name}: downloading", flush=True)
        t0 = time.perf_counter()
        try:
            staged, etag = fetch(name, staging)
        except KeyboardInterrupt:
            raise
        except Exception as e:  # network, HTTP and hub errors alike: say what failed and how to go on
            offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")
            hint = ("HF_HUB_OFFLINE is set, so nothing can be downloaded: unset it. " if offline else "")
            endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co")
            error = " ".join(f"{type(e).__name__}: {e}".split()).rstrip(".")  # one line, whatever the hub's message
            raise SystemExit(f"failed to download {name} from {endpoint} (dataset {REPO_ID}): {error}. "
                             f"{hint}Files already complete are kept; rerun `{retry}` to retry.")
        try:
            checked = check_download(staged, etag)
        except ShardError as e:
            staged.unlink(missing_ok=True)
            raise SystemExit(f"downloaded {name} is corrupt: {e}. Deleted it; rerun `{retry}` to retry.")
        os.replace(staged, path)  # only a checked file gets the shard's name
        seconds = time.perf_counter() - t0
        print(f"[{i}/{len(names)}] {name}: {path.stat().st_size / 1e6:,.1f} MB in {seconds:.1f} s ({checked})",
              flush=True)
    shutil.rmtree(staging, ignore_errors=True)  # the hub's bookkeeping for the staged files
    print(f"{len(names)} files ready in {args.dir}")


if __name__ == "__main__":
    main()
