"""Launching a worker script on several CPU processes (gloo) for the distributed tests.

Each worker gets argv = [rank, world, port, out] and writes its results to f"{out}.{rank}";
`run_workers` returns every rank's combined stdout/stderr and fails the test, naming the rank, on a
non-zero exit or a timeout (every rank is killed then, so a stuck collective cannot hang CI).
"""
import socket
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_workers(script: str, tmp_path: Path, world: int, out: Path, timeout: float = 150,
                env: dict | None = None) -> list[str]:
    """Run `script` (Python source) as ranks 0..world-1 of a gloo group on a free port."""
    path = tmp_path / "worker.py"
    path.write_text(script)
    port = str(free_port())
    run_env = {"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1", **(env or {})}
    procs = [subprocess.Popen([sys.executable, str(path), str(r), str(world), port, str(out)], cwd=REPO,
                              env=run_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(world)]
    logs = []
    for r, p in enumerate(procs):
        try:
            log, _ = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail(f"rank {r} of {world} timed out")
        assert p.returncode == 0, f"rank {r} of {world} failed:\n{log[-3000:]}"
        logs.append(log)
    return logs
