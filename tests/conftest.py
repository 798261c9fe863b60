"""Shared test set-up: offline hub, the GPT-2 BPE cache, shared text, the embedded corpus, and GPU skipping.

Every end-to-end test trains on the embedded corpus (data/synthetic.py, the `synthetic_shards`
fixture), so a fresh clone runs them with nothing from outside the repository. Tests read
`../shared` (beside the repository root) where present, but never copy it into the project: its
English text for the real-text checks (`real_text_path`; without it, the repository's own Markdown
and Python sources stand in, so no test skips for want of it) and tiktoken's GPT-2 BPE files for the
tokenizer's (`gpt2_bpe`, which skips with one line where tiktoken has neither a cache nor network).
"""
import os
from pathlib import Path

import pytest

def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


REPO_ROOT = Path(__file__).resolve().parents[1]
SHARED_DIR = REPO_ROOT.parent / "shared"
TINY_SHAKESPEARE = SHARED_DIR / "data" / "tinyshakespeare.txt"

# Tests never touch the network: the hub stays offline and tiktoken reads the shared BPE cache.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
if (SHARED_DIR / "tiktoken_cache").is_dir():
    os.environ.setdefault("TIKTOKEN_CACHE_DIR", str(SHARED_DIR / "tiktoken_cache"))

# The side-stream checks (perf/streams.py) in every test and every process a test starts: on a CPU
# they model what a GPU would still be copying, and stop at a wait left out or a buffer reused early.
os.environ.setdefault("SPEEDRUN_STREAM_CHECK", "1")

# Without a GPU, Triton kernels can only run in Triton's interpreter, and @triton.jit reads this
# variable when a kernel is defined, so it is set before any test imports a kernel module. It only
# makes kernels runnable: whether the model calls them is perf.backend's choice (portable on CPU).
if not _cuda_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def single_thread():
    """Tests use small tensors: a second intra-op thread only adds synchronisation (about 4x
    slower per step on a shared 2-core CI machine, measured on the smoke model)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs CUDA (run perf/gpu_check.py on a GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


NOT_SOURCES = ("__pycache__", "build", "venv", "site-packages", "node_modules")
REPOSITORY_TEXT_MIN_CHARS = 1_000_000  # about 300k GPT-2 tokens, as much as Tiny Shakespeare gives


@pytest.fixture(scope="session")
def real_text_path(tmp_path_factory) -> Path:
    """Real text for the checks that need it (the tokenizer, the canonical mask): ../shared's Tiny
    Shakespeare where present, else the repository's own Markdown and Python sources (sorted, joined
    by blank lines, written once per session). The stand-in keeps ASCII only: GPT-2 emits a few pairs
    the record's mask drops after a token that ends inside a multi-byte character (the emoji seam in
    tests/model/test_model_canonical_mask.py), and a doc edit must not be able to fail the test."""
    if TINY_SHAKESPEARE.is_file():
        return TINY_SHAKESPEARE
    sources = sorted(p for pattern in ("*.md", "*.py") for p in REPO_ROOT.rglob(pattern)
                     if not any(part.startswith(".") or part in NOT_SOURCES for part in
                                p.relative_to(REPO_ROOT).parts))
    text = "\n\n".join(p.read_text(encoding="utf-8", errors="replace") for p in sources)
    text = text.encode("ascii", errors="replace").decode("ascii")
    assert len(text) >= REPOSITORY_TEXT_MIN_CHARS, f"the repository's own text is {len(text):,} characters"
    path = tmp_path_factory.mktemp("real_text") / "repository.txt"
    path.write_text(text, encoding="utf-8")
    return path


@pytest.fixture(scope="session")
def gpt2_bpe():
    """tiktoken's GPT-2 encoding, where its BPE files load offline (TIKTOKEN_CACHE_DIR, set above from
    ../shared, or tiktoken's own cache); training does not need them (model/prefix.py's stored table)."""
    from model.prefix import gpt2_bpe_available, gpt2_encoding

    if not gpt2_bpe_available():
        pytest.skip("GPT-2 BPE files missing: tiktoken has neither a cache (TIKTOKEN_CACHE_DIR) nor network")
    return gpt2_encoding()


@pytest.fixture(scope="session")
def synthetic_shards(tmp_path_factory) -> Path:
    """The embedded corpus (data/synthetic.py, the smoke preset's default data), written once per
    session into a temp folder (about 3 s): the shards every end-to-end test trains on."""
    from data.synthetic import write_corpus

    out = tmp_path_factory.mktemp("synthetic")
    write_corpus(out, progress=False)
    return out


# ---- the SM90 cross-compile of one smoke geometry, started early on the idle core -----------------
# Most tests run one thread (`single_thread` above), so one of CI's two cores idles for most of the
# session. The slowest single test, cross-compiling a smoke training geometry for SM90 (about 3 min
# alone), starts in the background as soon as collection selects it, with one compile process, and
# its test (tests/perf/test_perf_cross_compile.py) later only waits for it and reads its output.
CROSS_COMPILE_SMOKE_ARGS = ("--config", "smoke", "--steps", "0", "--no-validation", "--jobs", "1")
_CROSS_COMPILE_TEST = "test_a_smoke_training_geometry_compiles_for_sm90_forward_and_backward"
_cross_compile_run: dict = {}


def _start_cross_compile(out_dir: Path) -> None:
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # Triton must compile
    out, err = open(out_dir / "stdout.txt", "w+"), open(out_dir / "stderr.txt", "w+")
    proc = subprocess.Popen([sys.executable, "-m", "perf.tools.cross_compile", *CROSS_COMPILE_SMOKE_ARGS], cwd=REPO_ROOT,
                            env=env, stdout=out, stderr=err, text=True)
    _cross_compile_run.update(proc=proc, out=out, err=err)


def pytest_collection_finish(session):
    if any(item.name == _CROSS_COMPILE_TEST for item in session.items):
        import tempfile

        _start_cross_compile(Path(tempfile.mkdtemp(prefix="speedrun_cross_compile_test_")))


def pytest_sessionfinish(session, exitstatus):
    proc = _cross_compile_run.get("proc")
    if proc is not None and proc.poll() is None:  # the test was interrupted or never ran
        proc.kill()
        proc.wait()


@pytest.fixture(scope="session")
def smoke_cross_compile(tmp_path_factory):
    """(exit code, stdout, stderr) of `python -m perf.tools.cross_compile` on one smoke training geometry."""
    if "proc" not in _cross_compile_run:  # not started at collection (e.g. selected by a plugin later)
        _start_cross_compile(tmp_path_factory.mktemp("cross_compile"))
    proc, out, err = _cross_compile_run["proc"], _cross_compile_run["out"], _cross_compile_run["err"]
    code = proc.wait(timeout=1800)
    out.seek(0)
    err.seek(0)
    return code, out.read(), err.read()
