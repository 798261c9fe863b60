"""perf/ is laid out as upstream's track_1_short/perf/, and its nested kernels/ shadows nothing."""
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# the project's card names these; upstream's package has perf/kernels/ and perf/residual_fusion.py
CARD_TOP_LEVEL = ("train_gpt.py", "model", "perf", "data", "records", "run.sh", "README.md")
UPSTREAM_PERF_PATHS = ("perf/kernels/mlp.py", "perf/kernels/cross_entropy.py", "perf/residual_fusion.py",
                       "perf/pinned_batches.py", "perf/cuda_graphs/capture.py")


def test_the_top_level_is_the_cards_and_perf_has_upstreams_paths():
    assert [name for name in CARD_TOP_LEVEL if not (REPO / name).exists()] == []
    assert [path for path in UPSTREAM_PERF_PATHS if not (REPO / path).is_file()] == []
    assert not (REPO / "kernels").exists(), "a top-level kernels/ would shadow the pip package `kernels` (FA3)"


def test_python_m_from_the_root_does_not_take_perf_kernels_for_the_pip_package():
    """`python -m` puts the repository root first on sys.path: `import kernels` must still mean the pip
    package (or nothing, where it is not installed), never perf/kernels/."""
    probe = ("import importlib.util, json, perf.kernels; spec = importlib.util.find_spec('kernels'); "
             "print(json.dumps([spec.origin if spec else None, perf.kernels.__file__]))")
    done = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    origin, ours = json.loads(done.stdout.strip().splitlines()[-1])
    assert Path(ours) == REPO / "perf" / "kernels" / "__init__.py"
    assert origin is None or not Path(origin).is_relative_to(REPO / "perf"), origin
