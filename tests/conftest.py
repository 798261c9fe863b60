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

# One intra-op thread in every process a test starts, as in the tests themselves (`single_thread` below)
# and as torchrun gives each rank: a subprocess left to use both cores beside the other pytest worker
# oversubscribes CI's two (tools/gpu_check.py's dry run: 50 s alone, 177 s in CI on 2026-12-06).
os.environ.setdefault("OMP_NUM_THREADS", "1")

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


# pytest-xdist hands whole files to its workers (`--dist loadfile --no-loadscope-reorder`, pyproject.toml),
# one at a time as a worker runs dry, in collection order. A long file handed out last would run alone
# at the end while the other core idles, so the longest go first, longest first (seconds: one fresh-clone
# `.ci/run`'s --durations summed per file, the long subprocess runs of tests/long_runs.py included).
# A stale order costs only time; a file that no longer exists stops the session.
LONGEST_FILES_FIRST = (   # seconds per file, one fresh-clone CI run, 2 workers (2026-12-06; "before": the cuts since)
    "tests/run/test_run_smoke.py",                          # 700 before: the smoke acceptance run, 35 steps
    "tests/run/test_run_train.py",                          # 405
    "tests/run/test_run_proposals.py",                      # 300: the stack compiled and captured, 19 steps
    "tests/run/test_run_virtual_ranks.py",                  # 263
    "tests/tools/test_tools_cross_compile.py",              # 153: SM90 and L40S cross-compiles
    "tests/perf/test_perf_host_table.py",                   # 147
    "tests/perf/test_perf_cuda_graphs_capture.py",          # 125
    "tests/tools/test_tools_gpu_check.py",                  # 69: gpu_check's dry run
    "tests/model/test_model_compile_record.py",             # 114 before: the record shapes traced, FA3 a stand-in op
    "tests/run/test_run_features.py",                       # 50
    "tests/records/test_records_certify.py",
    "tests/optim/test_optim_distributed.py",
    "tests/tools/test_tools_capture_contract.py",
)


MAX_WORKERS = 8   # more workers than this mostly repeat each worker's start-up (torch's import, fixtures)


def pytest_xdist_auto_num_workers(config) -> int:
    """`-n auto`: one worker per core this process may use, at most MAX_WORKERS."""
    return max(1, min(len(os.sched_getaffinity(0)), MAX_WORKERS))


def _longest_files_first(items) -> None:
    rank = {}
    for i, name in enumerate(LONGEST_FILES_FIRST):
        if not (REPO_ROOT / name).is_file():
            raise pytest.UsageError(f"tests/conftest.py: LONGEST_FILES_FIRST names {name}, which does not exist")
        rank[name] = i
    def key(item):
        path = Path(item.path).resolve()
        name = path.relative_to(REPO_ROOT).as_posix() if path.is_relative_to(REPO_ROOT) else str(path)
        return rank.get(name, len(rank))
    items.sort(key=key)   # stable: each file's tests keep their order


def pytest_collection_modifyitems(config, items):
    import torch

    _longest_files_first(items)
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs CUDA (run tools/gpu_check.py on a GPU machine)")
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


def pytest_sessionfinish(session, exitstatus):
    from tests import long_runs

    long_runs.cleanup()   # the long runs' folders (tests/long_runs.py)
