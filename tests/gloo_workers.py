"""Launching a worker script on several CPU processes (gloo) for the distributed tests.

Each worker gets argv = [rank, world, port, out] and writes its results to f"{out}.{rank}";
`run_workers` returns every rank's combined stdout/stderr and fails the test, naming the rank, on a
non-zero exit or a timeout (every rank is killed then, so a stuck collective cannot hang CI).

A worker that reaches its end leaves through `os._exit(0)` (EPILOGUE, appended to every script),
skipping the interpreter's finalization. A c10d op run under a TorchDispatchMode (the contract
checker, the CUDA-graph tape) leaves PyTorch holding the process group (torch 2.13, measured: gloo's
5-6 threads still alive after destroy_process_group, 2 without the mode), so its worker threads
outlive the script; one that frees a collective's tensor after finalization has begun cannot take
the GIL and aborts the process ("terminate called without an active exception"), about one run in
twenty of the tape tests on 2 loaded cores. A worker that raises still exits non-zero.
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


EPILOGUE = """

# appended by tests/gloo_workers.py: leave without finalization (see its docstring)
import gc as _gc, os as _os, sys as _sys
_gc.collect()   # closes files the script left open
_sys.stdout.flush(); _sys.stderr.flush()
_os._exit(0)
"""


def run_workers(script: str, tmp_path: Path, world: int, out: Path, timeout: float = 150,
                env: dict | None = None) -> list[str]:
    """Run `script` (Python source) as ranks 0..world-1 of a gloo group on a free port."""
    path = tmp_path / "worker.py"
    path.write_text(script + EPILOGUE)
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
