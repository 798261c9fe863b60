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
