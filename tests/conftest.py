"""Shared test set-up: offline hub, the GPT-2 BPE cache, shared text, and GPU skipping.

Tests read `../shared` (beside the repository root) but never copy it into the project.
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


@pytest.fixture(scope="session")
def tiny_shakespeare_path() -> Path:
    if not TINY_SHAKESPEARE.is_file():
        pytest.skip(f"shared text missing: {TINY_SHAKESPEARE}")
    return TINY_SHAKESPEARE


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
