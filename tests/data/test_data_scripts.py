"""The command-line scripts, run as scripts (from another directory) and as modules, in subprocesses:
data/tokenize.py on real text, and data/cached_fineweb10B.py against a stand-in hub on loopback."""
import hashlib
import json
import os
import re
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest

from data.shards import BOS_ID, SHARD_MAGIC, read_shard, write_shard
from data.tokenize import main as tokenize_main, paragraphs

REPO_ROOT = Path(__file__).resolve().parents[2]
TOKENIZE = REPO_ROOT / "data" / "tokenize.py"
DOWNLOAD = REPO_ROOT / "data" / "cached_fineweb10B.py"


def run(args, cwd, env=None, expect_ok=True):
    result = subprocess.run([sys.executable, *map(str, args)], cwd=cwd, env=env, capture_output=True, text=True,
                            timeout=120)
    if expect_ok:
        assert result.returncode == 0, result.stderr
    return result


def shard_tokens(directory: Path, name: str) -> tuple[list[int], list[int]]:
    val = read_shard(directory / f"{name}_val_000000.bin").tolist()
    train = [t for p in sorted(directory.glob(f"{name}_train_*.bin")) for t in read_shard(p).tolist()]
    return val, train


# ---- tokenize ---------------------------------------------------------------------------------


def test_tokenize_help_as_script_and_module(tmp_path):
    as_script = run([TOKENIZE, "--help"], cwd=tmp_path).stdout
    as_module = run(["-m", "data.tokenize", "--help"], cwd=REPO_ROOT).stdout
    for text in (as_script, as_module):
        assert "--val-tokens" in text and "--shard-tokens" in text and "blank-line runs" in text
        assert "one document per file" in text


def test_tokenize_real_text_as_script_gives_tiktokens_tokens(tmp_path, gpt2_bpe, real_text_path):
    text = real_text_path.read_text(encoding="utf-8")
    # Independent split: a regex on blank-line runs (the script groups lines).
    docs = [d.rstrip("\n") for d in re.split(r"\n(?:[ \t]*\n)+", text) if d.strip()]
    encoding = gpt2_bpe
    expected = [t for doc in docs for t in [BOS_ID, *encoding.encode_ordinary(doc)]]
    assert len(expected) == sum(len(encoding.encode_ordinary(d)) for d in docs) + len(docs)
    assert len(expected) > 240_000  # at least three training shards

    out = tmp_path / "out"
    result = run([TOKENIZE, real_text_path, "--out", out, "--val-tokens", "30000",
                  "--shard-tokens", "120000", "--workers", "2"], cwd=tmp_path)
    assert f"{len(docs):,} documents, {len(expected):,} tokens" in result.stdout
    name = real_text_path.stem
    val, train = shard_tokens(out, name)
    assert len(val) == 30000 and val + train == expected
    train_shards = -(-(len(expected) - 30000) // 120000)  # ceil: full shards, then the rest
    assert sorted(p.name for p in out.iterdir()) == sorted(
        [f"{name}_train_{i:06d}.bin" for i in range(1, train_shards + 1)] + [f"{name}_val_000000.bin"])


def test_tokenize_as_module_with_jsonl_and_markdown(tmp_path, gpt2_bpe):
    records = [{"text": "Hello world."}, {"text": "Second\n\ndocument, one record."}, {"text": "   "}]
    (tmp_path / "a.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n\n", encoding="utf-8")
    (tmp_path / "b.md").write_text("# Title\n\nA paragraph\n  indented line\n \t\n\n\nLast one\n", encoding="utf-8")
    out = tmp_path / "out"
    run(["-m", "data.tokenize", tmp_path / "a.jsonl", tmp_path / "b.md", "--out", out, "--name", "mix",
         "--val-tokens", "3", "--workers", "2"], cwd=REPO_ROOT)
    docs = ["Hello world.", "Second\n\ndocument, one record.", "# Title", "A paragraph\n  indented line", "Last one"]
    encoding = gpt2_bpe
    val, train = shard_tokens(out, "mix")
    assert val + train == [t for doc in docs for t in [BOS_ID, *encoding.encode_ordinary(doc)]]


def test_paragraphs_and_split_per_file(tmp_path, gpt2_bpe):
    assert paragraphs("\n a\nb \n\n \t \n\nc\n") == [" a\nb ", "c"]
    (tmp_path / "t.txt").write_text("one\n\ntwo\n", encoding="utf-8")
    tokenize_main([str(tmp_path / "t.txt"), "--out", str(tmp_path / "o"), "--split", "file", "--val-tokens", "1",
                   "--workers", "1"])
    val, train = shard_tokens(tmp_path / "o", "t")
    assert val + train == [BOS_ID, *gpt2_bpe.encode_ordinary("one\n\ntwo\n")]


def test_tokenize_bad_inputs(tmp_path, gpt2_bpe):
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n{"body": "no text"}\n', encoding="utf-8")
    result = run([TOKENIZE, tmp_path / "bad.jsonl", "--out", tmp_path / "o"], cwd=tmp_path, expect_ok=False)
    assert result.returncode != 0 and "bad.jsonl:2" in result.stderr and "'text'" in result.stderr
    (tmp_path / "small.txt").write_text("a few words\n", encoding="utf-8")
    result = run([TOKENIZE, tmp_path / "small.txt", "--out", tmp_path / "o", "--val-tokens", "99", "--workers", "1"],
                 cwd=tmp_path, expect_ok=False)
    assert result.returncode != 0 and "--val-tokens 99" in result.stderr


# ---- download, against a stand-in hub ---------------------------------------------------------

REPO_PATH = "/datasets/kjj0/fineweb10B-gpt2/resolve/main/"


class StandInHub(ThreadingHTTPServer):
    """Serves `root` on the loopback address the way the hub's /resolve endpoint does for
    huggingface_hub: HEAD and GET with ETag (the sha256, as for LFS files), Content-Length and
    X-Repo-Commit, `Range: bytes=N-` answered with 206 and Content-Range; 404 with X-Error-Code for a
    missing file. Faults, by file name: `drop_once` (the first GET's connection closes after 11 of
    the file's bytes in 12), `corrupt` (one byte of the body flipped, the ETag of the true bytes),
    `hold` (the body stops after 11/12 until `release` is set, at most 60 s)."""

    def __init__(self, root: Path):
        self.root = root
        self.requests: list[tuple[str, str]] = []
        self.ranges: list[tuple[str, str | None]] = []  # (file name, Range header) of every GET
        self.drop_once: set[str] = set()
        self.corrupt: set[str] = set()
        self.hold: set[str] = set()
        self.release = threading.Event()
        self.held = threading.Event()
        super().__init__(("127.0.0.1", 0), _HubHandler)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _HubHandler(BaseHTTPRequestHandler):
    def do_HEAD(self):
        self._serve(with_body=False)

    def do_GET(self):
        self._serve(with_body=True)

    def _serve(self, with_body: bool):
        self.server.requests.append((self.command, self.path))
        name = self.path[len(REPO_PATH):] if self.path.startswith(REPO_PATH) else None
        file = self.server.root / name if name else None
        if file is None or not file.is_file():
            self.send_response(404)
            self.send_header("X-Error-Code", "EntryNotFound")
            self.send_header("X-Repo-Commit", "0" * 40)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        data = file.read_bytes()
        etag = hashlib.sha256(data).hexdigest()
        if with_body and name in self.server.corrupt:
            data = data[:-1] + bytes([data[-1] ^ 1])  # a flipped bit in the last token: size and header intact
        asked = self.headers.get("Range") if with_body else None
        start = int(re.fullmatch(r"bytes=(\d+)-", asked)[1]) if asked else 0
        if with_body:
            self.server.ranges.append((name, asked))
        self.send_response(206 if start else 200)
        if start:
            self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        self.send_header("Content-Length", str(len(data) - start))
        self.send_header("ETag", f'"{etag}"')
        self.send_header("X-Repo-Commit", "1" * 40)
        self.end_headers()
        if not with_body:
            return
        body = data[start:]
        if name in self.server.drop_once or name in self.server.hold:
            self.wfile.write(body[:len(body) * 11 // 12])
            self.wfile.flush()
            if name in self.server.hold:
                self.server.held.set()
                self.server.release.wait(60)
            self.server.drop_once.discard(name)
            self.close_connection = True  # the client sees the connection end before Content-Length
            return
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def hub(tmp_path):
    server = StandInHub(tmp_path / "hub")
    server.root.mkdir()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def hub_env(hub, tmp_path, offline=False):
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env.update(HF_ENDPOINT=hub.endpoint, HF_HOME=str(tmp_path / "hf_home"), HF_HUB_DISABLE_TELEMETRY="1")
    if offline:
        env["HF_HUB_OFFLINE"] = "1"
    return env


def test_download_skip_and_reject(tmp_path, hub):
    rng = np.random.default_rng(0)
    names = ["fineweb_val_000000.bin", "fineweb_train_000001.bin", "fineweb_train_000002.bin"]
    for name in names:
        write_shard(hub.root / name, np.r_[BOS_ID, rng.integers(0, BOS_ID, 999)])
    out, env = tmp_path / "fineweb10B", hub_env(hub, tmp_path)

    # 1. A fresh download, as a script run from another directory.
    run([DOWNLOAD, "2", "--dir", out], cwd=tmp_path, env=env)
    for name in names:
        assert (out / name).read_bytes() == (hub.root / name).read_bytes()
    assert sorted(path for method, path in hub.requests if method == "GET") == sorted(REPO_PATH + n for n in names)

    # 2. A second run skips the complete files without asking the hub anything.
    hub.requests.clear()
    result = run(["-m", "data.cached_fineweb10B", "2", "--dir", out], cwd=REPO_ROOT, env=env)
    assert result.stdout.count("skipped") == 3 and hub.requests == []

    # 3. A truncated local file is fetched again; nothing else is.
    data = (out / names[1]).read_bytes()
    (out / names[1]).write_bytes(data[:-10])
    result = run([DOWNLOAD, "2", "--dir", out], cwd=tmp_path, env=env)
    assert "truncated" in result.stdout and (out / names[1]).read_bytes() == data
    assert [path for method, path in hub.requests if method == "GET"] == [REPO_PATH + names[1]]

    # 4. A file missing on the hub: says what failed and how to retry.
    result = run([DOWNLOAD, "3", "--dir", out], cwd=tmp_path, env=env, expect_ok=False)
    assert result.returncode != 0
    assert "failed to download fineweb_train_000003.bin" in result.stderr and "rerun" in result.stderr
    assert all((out / n).exists() for n in names)

    # 5. A corrupt file (wrong magic) is rejected with a clear message and deleted.
    header = np.zeros(256, dtype="<i4")
    header[:3] = SHARD_MAGIC + 1, 1, 4
    (hub.root / "fineweb_train_000003.bin").write_bytes(header.tobytes() + bytes(8))
    result = run([DOWNLOAD, "3", "--dir", out], cwd=tmp_path, env=env, expect_ok=False)
    assert result.returncode != 0
    assert "fineweb_train_000003.bin is corrupt" in result.stderr and "magic" in result.stderr
    assert "rerun" in result.stderr and not (out / "fineweb_train_000003.bin").exists()

    # 6. Offline: complete files still pass; a missing one says HF_HUB_OFFLINE blocks it.
    hub.requests.clear()
    run([DOWNLOAD, "2", "--dir", out], cwd=tmp_path, env=hub_env(hub, tmp_path, offline=True))
    result = run([DOWNLOAD, "3", "--dir", out], cwd=tmp_path, env=hub_env(hub, tmp_path, offline=True),
                 expect_ok=False)
    assert result.returncode != 0 and "HF_HUB_OFFLINE" in result.stderr and hub.requests == []
    assert len(result.stderr.strip().splitlines()) == 1 and DOWNLOAD.name in result.stderr  # one line, the command


def _run_on_a_terminal(args, cwd, env, timeout=120):
    """(exit code, stdout, what a terminal showed on stderr): stderr is a pseudo-terminal, as for a
    user at a shell, so tqdm draws its bars (it hides them when stderr is a pipe)."""
    import fcntl
    import pty
    import select
    import struct
    import termios

    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))  # tqdm draws nothing at 0 columns
    proc = subprocess.Popen([sys.executable, *map(str, args)], cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=slave, text=True)
    os.close(slave)
    shown, deadline = b"", time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            if select.select([master], [], [], 1)[0]:
                try:
                    chunk = os.read(master, 65536)
                except OSError:  # the child closed its end (EIO on Linux)
                    break
                if not chunk:
                    break
                shown += chunk
            elif proc.poll() is not None:
                break
        out, _ = proc.communicate(timeout=max(1, deadline - time.monotonic()))
    finally:
        if proc.poll() is None:
            proc.kill()
        os.close(master)
    return proc.returncode, out, shown.decode(errors="replace")


@pytest.mark.slow
def test_download_resumes_refuses_corrupt_bytes_and_never_half_writes(tmp_path, hub):
    """The transfer itself, against the stand-in hub: a connection dropped mid-file is resumed with
    a Range request from where it stopped, with a progress bar on a terminal; bytes corrupted in the
    transfer (right size, valid header) are refused by their sha256; a download killed midway
    leaves nothing under the shard's name, and the rerun completes and leaves no staging files."""
    import signal

    rng = np.random.default_rng(1)
    # 12 MB, past huggingface_hub's 10 MiB read chunk, so the dropped transfer has written bytes to resume from
    big = "fineweb_train_000001.bin"
    names = ["fineweb_val_000000.bin", big]
    for name, n in (("fineweb_val_000000.bin", 5000), (big, 6_000_000)):
        write_shard(hub.root / name, np.r_[BOS_ID, rng.integers(0, BOS_ID, n - 1)])
    out, env = tmp_path / "fineweb10B", hub_env(hub, tmp_path)

    # 1. Dropped after 11 of 12 MB: resumed, with a Range request from the bytes already written.
    hub.drop_once.add(big)
    code, stdout, terminal = _run_on_a_terminal([DOWNLOAD, "1", "--dir", out], tmp_path, env)
    assert code == 0, terminal[-3000:]
    assert (out / big).read_bytes() == (hub.root / big).read_bytes()
    gets = [(n, r) for n, r in hub.ranges if n == big]
    assert gets[0] == (big, None) and len(gets) == 2, gets
    resumed_from = int(re.fullmatch(r"bytes=(\d+)-", gets[1][1])[1])
    assert 10 * 2**20 <= resumed_from < (hub.root / big).stat().st_size, gets  # not from 0, not past the end
    assert "100%" in terminal and big in terminal, terminal[-2000:]  # huggingface_hub's bar, on the terminal
    assert f"[2/2] {big}: downloading" in stdout and "sha256, header and token ids checked" in stdout
    assert sorted(p.name for p in out.iterdir()) == sorted(names)  # the staging folder is gone

    # 2. Corrupted in the transfer: same size, valid header and token ids, wrong sha256: refused, deleted.
    (out / big).unlink()
    hub.corrupt.add(big)
    result = run([DOWNLOAD, "1", "--dir", out], cwd=tmp_path, env=env, expect_ok=False)
    assert result.returncode != 0 and "rerun" in result.stderr
    assert f"downloaded {big} is corrupt" in result.stderr and "sha256" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr  # one line
    assert not (out / big).exists() and not list((out / ".download").glob("*.bin"))
    hub.corrupt.clear()

    # 3. Killed in the middle of the transfer: nothing under the shard's name; the rerun completes.
    hub.hold.add(big)
    proc = subprocess.Popen([sys.executable, DOWNLOAD, "1", "--dir", out], cwd=tmp_path, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        assert hub.held.wait(60), "the download never started"
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    finally:
        hub.release.set()
        if proc.poll() is None:
            proc.kill()
    assert not (out / big).exists()
    hub.hold.clear()
    run([DOWNLOAD, "1", "--dir", out], cwd=tmp_path, env=env)
    assert (out / big).read_bytes() == (hub.root / big).read_bytes()
    assert sorted(p.name for p in out.iterdir()) == sorted(names)


def test_download_help_as_script(tmp_path):
    result = run([DOWNLOAD, "--help"], cwd=tmp_path)
    assert "kjj0/fineweb10B-gpt2" in result.stdout and "N" in result.stdout


def test_shard_folders_are_ignored_by_git():
    """The smoke preset writes the embedded corpus into data/synthetic/, the README tokenizes into
    data/tinyshakespeare/ and downloads into data/fineweb10B/: shards there must not make every
    later run's log say git_dirty."""
    if subprocess.run(["git", "rev-parse", "--git-dir"], cwd=REPO_ROOT, capture_output=True).returncode:
        pytest.skip("not a git checkout")
    paths = ["data/tinyshakespeare/tinyshakespeare_train_000001.bin", "data/fineweb10B/fineweb_val_000000.bin",
             "data/synthetic/synthetic_train_000001.bin", "data/synthetic/synthetic.json",
             "data/fineweb10B/.download/fineweb_val_000000.bin", "data/loader.py", "data/synthetic.py"]
    done = subprocess.run(["git", "check-ignore", "--no-index", *paths], cwd=REPO_ROOT, capture_output=True, text=True)
    assert done.stdout.split() == paths[:5]  # the shards and caches are ignored, the code is not
