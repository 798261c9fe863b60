"""tools/gpu_check.py: its parity measure, its registry and runner, and a --dry-run in a subprocess."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests import long_runs
from tools import gpu_check as gc

REPO_ROOT = Path(__file__).resolve().parents[2]
# the dry run (every check in Triton's interpreter, about 75 s alone; tests/long_runs.py); the test reads
# what it wrote
long_runs.register("gpu_check_dry_run",
                   lambda folder: [[sys.executable, "tools/gpu_check.py", "--dry-run", "--out", str(folder / "out")]],
                   timeout_s=900)


def test_ulp_distance_hand_numbers():
    one = torch.tensor([1.0])
    assert gc.ulp_distance(torch.tensor([1.0078125]), one, torch.bfloat16) == 1.0  # 1 + 2^-7: next bf16 after 1
    assert gc.ulp_distance(torch.tensor([258.0]), torch.tensor([256.0]), torch.bfloat16) == 1.0  # ulp at 256 is 2
    assert gc.ulp_distance(torch.tensor([259.0]), torch.tensor([256.0]), torch.bfloat16) == 1.5
    assert gc.ulp_distance(torch.tensor([1.0009765625]), one, torch.float16) == 1.0  # 1 + 2^-10 in fp16
    assert gc.ulp_distance(torch.zeros(3), torch.zeros(3)) == 0.0
    assert gc.ulp_distance(torch.tensor([1e-6]), torch.tensor([0.0]), torch.bfloat16, atol=1e-6) == 0.0
    assert gc.ulp_distance(torch.tensor([-2.0]), torch.tensor([-2.015625]), torch.bfloat16) == 1.0
    with pytest.raises(ValueError, match="shapes differ"):
        gc.ulp_distance(torch.zeros(2), torch.zeros(3))


def test_registry_rejects_duplicates_and_runner_reports_a_raising_check():
    with pytest.raises(ValueError, match="already registered"):
        gc.register("transpose")(lambda ctx: [])

    def broken(ctx):
        raise RuntimeError("kernel exploded")

    gc.CHECKS["test_broken"] = broken
    try:
        ctx = gc.Context(device=torch.device("cpu"), dry_run=True)
        (row,) = gc.run_checks(ctx, ["test_broken"])
    finally:
        del gc.CHECKS["test_broken"]
    assert not row.passed and "RuntimeError: kernel exploded" in row.note


def test_results_row_ratio_and_table():
    r = gc.Result("x", "case", error=0.5, tol=1.0, unit="ulp", kernel_ms=2.0, torch_ms=5.0)
    assert r.passed and r.ratio == 2.5
    lines = gc.table_lines({"device": "dev", "torch": "t", "triton": "tr", "cuda": None}, [r], dry_run=False)
    assert lines[0] == "device: dev | torch t | triton tr | CUDA None"
    assert lines[-1] == "| x | case | 0.5 ulp | 1 | yes | 2.000 | 5.000 | 2.50 | - |  |"


@pytest.mark.triton
def test_dry_run_writes_results():
    code, stdout, stderr, folder = long_runs.result("gpu_check_dry_run")  # tools/gpu_check.py --dry-run --out folder/out
    assert code == 0, stdout + stderr
    out = folder / "out"
    payload = json.loads((out / "results.json").read_text())
    assert payload["dry_run"] and payload["all_passed"]
    env = payload["environment"]
    assert env["device"].startswith("CPU") and env["torch"] == torch.__version__ and env["triton"]
    assert env["backend"]["device"] == "cpu" and env["triton_interpret"] == "1"
    assert {r["check"] for r in payload["results"]} == set(gc.CHECKS)
    assert all(r["passed"] for r in payload["results"])
    kernel_rows = [r for r in payload["results"] if r["check"] not in ("gpu_tests", "sanitizer")]
    assert all(r["kernel_ms"] is not None and r["torch_ms"] is not None for r in kernel_rows)
    (gpu_tests,) = [r for r in payload["results"] if r["check"] == "gpu_tests"]
    assert gpu_tests["case"] == "pytest -m gpu --collect-only" and "deselected" in gpu_tests["note"]
    sanitized = [r for r in payload["results"] if r["check"] == "sanitizer"]  # commands only, without CUDA
    assert [r["case"].split(":")[0] for r in sanitized] == ["smoke", "host table"]
    assert all(r["note"].startswith("dry run: train_gpt.py --config smoke --max-steps 1") for r in sanitized)
    assert sanitized[1]["note"].endswith("--set ngram_table=host")
    md = (out / "results.md").read_text()
    assert f"torch {torch.__version__}" in md and "| check | case | parity |" in md
    assert md.count("| yes |") == len(payload["results"])
    assert f"torch {torch.__version__}" in stdout.splitlines()[0]  # the printed table's header


def test_only_with_no_match_is_an_error(tmp_path):
    proc = subprocess.run([sys.executable, "tools/gpu_check.py", "--dry-run", "--only", "nosuch", "--out", str(tmp_path)],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "matches no check" in proc.stderr
