"""runtime/preflight.py: each check's decision over faked probe answers, the dry run, a CPU record run."""
import os
import shutil
import subprocess
import sys
from dataclasses import replace

import pytest
import torch

from config import RUN_PRESETS
from runtime import preflight as pf

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# nvidia-smi --query-gpu=index,name,memory.total,memory.used,utilization.gpu,driver_version,compute_cap
#            --format=csv,noheader,nounits on an idle 8×H100 SXM node
H100_SXM = "".join(f"{i}, NVIDIA H100 80GB HBM3, 81559, 1, 0, 580.65.06, 9.0\n" for i in range(8))


def _smi(rows: str, header: bool = False) -> str:
    head = "index, name, memory.total [MiB], memory.used [MiB], utilization.gpu [%], driver_version, compute_cap\n"
    return (head if header else "") + rows


@pytest.mark.parametrize("version, cuda, ok", [
    ("2.10.0+cu128", "12.8", True),
    ("2.10.0.dev20251001+cu128", "12.8", False),  # a nightly: loaded FA3 but trained with NaNs once
    ("2.13.0+cpu", None, False),
    ("2.11.0+cu128", "12.8", False),  # no FA3 build variant
    ("2.10.0+cu126", "12.6", False),
    (None, None, False),
])
def test_check_torch(version, cuda, ok):
    row = pf.check_torch(version, cuda)
    assert (row.status == pf.PASS) == ok
    if not ok:
        assert row.status == pf.FAIL and "requirements-h100.txt" in row.fix
    if version and "dev" in version:
        assert "nightly" in row.detail
    if version == "2.11.0+cu128":
        assert "build variant" in row.detail and pf.RECORD_TORCH in row.detail


def test_parse_nvidia_smi_with_header_units_and_na():
    gpus = pf.parse_nvidia_smi(_smi("0, NVIDIA H100 PCIe, 81559, [N/A], 3, 575.51.03, 9.0\n", header=True))
    assert gpus == [pf.Gpu(0, "NVIDIA H100 PCIe", 81559, -1, 3, "575.51.03", "9.0")]
    assert pf.parse_nvidia_smi("NVIDIA-SMI has failed because it couldn't communicate with the driver") == []


def test_check_gpus_eight_idle_h100_sxm():
    row = pf.check_gpus(_smi(H100_SXM, header=True))
    assert row.status == pf.PASS and row.detail == "8× NVIDIA H100 80GB HBM3"


def test_check_gpus_count_sm_memory_busy_and_pcie():
    four = "".join(H100_SXM.splitlines(keepends=True)[:4])
    assert "4 GPU(s), the record runs on 8" in pf.check_gpus(four).detail
    a100 = H100_SXM.replace("NVIDIA H100 80GB HBM3, 81559", "NVIDIA A100-SXM4-40GB, 40960").replace("9.0", "8.0")
    row = pf.check_gpus(a100)
    assert row.status == pf.FAIL and "not SM90" in row.detail and "below" in row.detail
    busy = H100_SXM.replace("0, NVIDIA H100 80GB HBM3, 81559, 1, 0", "0, NVIDIA H100 80GB HBM3, 81559, 40000, 97")
    row = pf.check_gpus(busy)
    assert row.status == pf.FAIL and "GPU [0] busy" in row.detail
    assert pf.check_gpus(busy, require_idle=False).status == pf.PASS  # inside a run its own ranks hold memory
    pcie = H100_SXM.replace("NVIDIA H100 80GB HBM3", "NVIDIA H100 PCIe")
    row = pf.check_gpus(pcie)
    assert row.status == pf.WARN and "not SXM" in row.detail
    assert pf.check_gpus(None).status == pf.FAIL
    assert pf.check_gpus(None, record=False).status == pf.WARN


def test_check_driver():
    assert pf.check_driver(H100_SXM).status == pf.PASS
    row = pf.check_driver(H100_SXM.replace("580.65.06", "575.57.08"))
    assert row.status == pf.FAIL and "575.57.08" in row.detail and "35%" in row.detail and "580" in row.fix
    assert pf.check_driver(None).status == pf.FAIL


def test_check_cudart_names_the_wheel_copy():
    assert pf.check_cudart(True, "", []).status == pf.PASS
    lib = "/venv/lib/python3.12/site-packages/nvidia/cu13/lib/libcudart.so.13"
    row = pf.check_cudart(False, "libcudart.so.13: cannot open shared object file", [lib])
    assert row.status == pf.FAIL and row.fix.startswith("export LD_LIBRARY_PATH=/venv/lib/python3.12/site-packages/nvidia/cu13/lib:")
    assert "nvidia-cuda-runtime==13.1.80" in pf.check_cudart(False, "not found", []).fix


def test_check_fa3_triton_nccl():
    assert pf.check_fa3({"source": "local /fa3", "binary": "/fa3/x.so", "sha256": "ab" * 32}).status == pf.PASS
    row = pf.check_fa3({"error": "RuntimeError: FA3: ... 401"})
    assert row.status == pf.FAIL and "hf auth login" in row.fix
    assert pf.check_triton({"ok": True, "detail": "ran"}).status == pf.PASS
    assert pf.check_triton({"error": "no CUDA device"}).status == pf.FAIL
    assert pf.check_nccl({"sum": 8}, 8).status == pf.PASS
    assert pf.check_nccl({"sum": 7}, 8).status == pf.FAIL
    assert pf.check_nccl({"error": "NCCL error"}, 8).status == pf.FAIL


@pytest.mark.distributed
def test_the_all_reduce_probe_spawns_real_ranks():
    """The NCCL probe's plumbing (spawn, file rendezvous, per-rank answers), with gloo on this CPU."""
    answer, world_size = pf.probe_nccl(world_size=2, backend="gloo")
    assert answer == {"sum": 2.0, "per_rank": [2.0, 2.0]} and world_size == 2
    assert pf.check_nccl(answer, world_size).status == pf.PASS


def test_check_data_missing_shards(tmp_path):
    cfg = replace(RUN_PRESETS["record"], data_path=str(tmp_path))
    error, train_glob = pf.probe_data(cfg)
    row = pf.check_data(error, train_glob)
    assert row.status == pf.FAIL and "no training shards match" in row.detail and str(tmp_path) in row.detail
    assert "cached_fineweb10B.py" in row.fix
    assert pf.check_data(None, "x/*.bin").status == pf.PASS
    assert "data/tokenize.py" in pf.check_data("no training shards match d/*_train_*.bin", "d/*_train_*.bin").fix


def test_check_tiktoken_disk_ram_compiler():
    urls = pf.TIKTOKEN_GPT2_URLS
    assert pf.check_tiktoken({u: True for u in urls}, None).status == pf.PASS
    row = pf.check_tiktoken({urls[0]: True, urls[1]: False}, None)
    assert row.status == pf.FAIL and "encoder.json" in row.detail and "vocab.bpe" not in row.detail
    assert pf.check_disk({"/tmp/a": 11 * 10**9, "/home/b": 50 * 10**9}).status == pf.PASS
    row = pf.check_disk({"/tmp/a": 9 * 10**9, "/home/b": 50 * 10**9})
    assert row.status == pf.FAIL and "/tmp/a 9.0 GB" in row.detail and "/home/b" not in row.detail
    assert pf.check_ram(128 * 2**30).status == pf.PASS
    assert pf.check_ram(48 * 2**30).status == pf.WARN
    assert pf.check_ram(16 * 2**30).status == pf.FAIL
    table = 84_602_880 * 768 * 2  # the record's whole table, 121.03 GiB
    assert pf.check_host_table("device", table, 8 * 2**30, 0).status == pf.PASS
    assert pf.check_host_table("host", table, 200 * 2**30, None).status == pf.PASS
    row = pf.check_host_table("host", table, 128 * 2**30, None)  # 121.03 + 16 margin > 128
    assert row.status == pf.FAIL and "needs 137.0 GiB (121.03 table + 16 margin), available: 128.0 GiB" in row.detail
    row = pf.check_host_table("host", table, 200 * 2**30, 64 * 2**20)
    assert row.status == pf.WARN and "locked-memory limit 64 MiB" in row.detail
    assert pf.check_compiler("/usr/bin/cc", "/usr/include/python3.12", True).status == pf.PASS
    row = pf.check_compiler(None, "/usr/include/python3.12", False)
    assert row.status == pf.FAIL and "C compiler" in row.detail and "Python.h" in row.detail


def test_check_python():
    assert pf.check_python((3, 12, 3)).status == pf.PASS
    assert pf.check_python((3, 9, 18)).status == pf.FAIL


def test_every_check_has_a_fix_and_a_unique_name():
    names = [c.name for c in pf.CHECKS]
    assert len(names) == len(set(names)) and all(c.fix and c.what for c in pf.CHECKS)


def test_raise_on_fail_lists_every_fail_with_its_fix():
    rows = [pf.Row("python", pf.PASS, "3.12"), pf.Row("ram", pf.WARN, "48 GiB", "more"),
            pf.check_driver(H100_SXM.replace("580.65.06", "575.57.08")), pf.check_torch("2.13.0+cpu", None)]
    with pytest.raises(RuntimeError) as err:
        pf.raise_on_fail(rows)
    text = str(err.value)
    assert "driver: driver 575.57.08" in text and "torch: torch 2.13.0+cpu" in text and "ram" not in text
    assert text.count("fix: ") == 2
    pf.raise_on_fail(rows[:2])  # WARNs do not stop a run


def test_cheap_checks_on_this_cpu_machine(tmp_path):
    rows = pf.cheap_checks(replace(RUN_PRESETS["record"], data_path=str(tmp_path)))
    names = [r.name for r in rows]
    assert "fa3" not in names and "nccl" not in names and "triton" not in names  # nothing launched
    failed = {r.name for r in rows if r.status == pf.FAIL}
    assert "data" in failed
    if shutil.which("nvidia-smi") is None:  # this CPU machine: no GPU (and a CPU torch, but under
        assert {"gpus", "driver"} <= failed  # .ci/torch-pin the record's own CUDA build: its check passes)
        assert ("torch" in failed) == (pf.check_torch(torch.__version__, torch.version.cuda).status == pf.FAIL)
    # the smoke preset needs none of the record's stack: those become warnings
    smoke = pf.cheap_checks(replace(RUN_PRESETS["smoke"], data_path=str(tmp_path)))
    assert {r.name for r in smoke if r.status == pf.FAIL} & set(pf.RECORD_ONLY) == set()


def test_write_environment_is_atomic_and_complete(tmp_path):
    path = pf.write_environment(tmp_path / "logs" / "environment.txt", {"nvidia-smi": H100_SXM, "ram": 7},
                                [pf.check_driver(H100_SXM)])
    text = path.read_text()
    assert "== nvidia-smi\n0, NVIDIA H100 80GB HBM3" in text and "== ram\n7\n" in text
    assert "PASS  driver  driver 580.65.06" in text
    assert [p.name for p in path.parent.iterdir()] == ["environment.txt"]  # no temp file left


def _run(*args, cwd=REPO):
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")  # never touch a GPU from a test
    return subprocess.run([sys.executable, "-m", "runtime.preflight", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


def test_smoke_on_this_cpu_machine_fails_only_on_its_data(tmp_path):
    out = _run("--config", "smoke", "--data-path", str(tmp_path), "--records-dir", str(tmp_path / "records"))
    fails = {line.split()[1] for line in out.stdout.splitlines() if line.startswith("FAIL")}
    assert out.returncode == 1 and "data" in fails and not fails & set(pf.RECORD_ONLY + pf.CUDA_ONLY)


def test_dry_run_lists_every_check():
    out = _run("--dry-run")
    assert out.returncode == 0, out.stderr
    for check in pf.CHECKS:
        assert f"{check.name} " in out.stdout and check.fix in out.stdout


def test_record_on_this_cpu_machine_fails_with_fixes_and_no_traceback(tmp_path):
    empty = tmp_path / "shards"
    empty.mkdir()
    out = _run("--config", "record", "--data-path", str(empty), "--records-dir", str(tmp_path / "records"))
    assert out.returncode == 1
    assert "Traceback" not in out.stdout + out.stderr
    lines = out.stdout.splitlines()
    fails = [i for i, line in enumerate(lines) if line.startswith("FAIL")]
    failed = {lines[i].split()[1] for i in fails}
    assert failed >= {"fa3", "triton", "nccl", "data"}  # CUDA_VISIBLE_DEVICES="": no CUDA device
    if shutil.which("nvidia-smi") is None:
        assert failed >= {"gpus", "driver"}  # and torch unless it is the record's (.ci/torch-pin)
        assert ("torch" in failed) == (pf.check_torch(torch.__version__, torch.version.cuda).status == pf.FAIL)
    assert all(lines[i + 1].strip().startswith("fix: ") for i in fails)
    assert (tmp_path / "records" / "logs" / "environment.txt").is_file()
