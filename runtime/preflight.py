"""Preflight: every check a record run needs on a fresh GPU node, each with its one-line fix.

    python -m runtime.preflight                        # the record: 8×H100 SXM, the pinned stack, the data
    python -m runtime.preflight --config dev --data-path DIR
    python -m runtime.preflight --dry-run              # list the checks (name, what, fix); touches no GPU

A rented node fails a record in ways that cost an hour each: another torch has no FA3 build
variant, the Hub answers 401, `libcudart.so.13` is missing, a driver below 580 runs every step
about 35% slower with no error, a shard or the GPT-2 BPE files are missing half-way through a run.
Each such cause is one named check here, printed as a row `PASS|WARN|FAIL name  detail` with the
fix under every FAIL/WARN; the exit status is 1 on any FAIL.

Every check is a small pure decision function over a probe's raw answer (`check_torch(version,
cuda)`, `check_gpus(nvidia_smi_csv, ...)`, ...), so the tests feed fake answers; the probes are thin.
The raw answers go to `<records_dir>/logs/environment.txt` (the node as found), written atomically.
`check_node(cfg, backend)` (`cheap_checks(cfg)` + `raise_on_fail(rows)`) is what the record preset
runs before the clock: no kernel launch, no process group, no download. Presets other than the record turn the record-only
FAILs (exact torch, 8 GPUs, SM90, driver, CUDA 13 runtime, FA3, host RAM) into WARNs, and presets
that may run on the CPU (smoke) also the Triton launch and NCCL.

Run the tests: pytest tests/runtime/test_runtime_preflight.py -q
"""
from __future__ import annotations

import csv
import ctypes
import glob
import io
import os
import platform
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]

RECORD_TORCH = "2.10.0+cu128"  # record #360: the torch the FA3 build variant (torch210-cxx11-cu128) is for
RECORD_GPU_COUNT = 8  # record #360: one node of 8×H100 SXM
RECORD_COMPUTE_CAP = "9.0"  # record #360: SM90 (H100/H200); FA3 and the fp8 kernels target it
MIN_GPU_MEMORY_MIB = 79 * 1024  # ours: an 80 GB H100 reports 81,559 MiB; the record reserves 65,224 MiB
BUSY_MEMORY_MIB = 1024  # ours: an idle GPU holds a few MiB; more means another process owns it
BUSY_UTILIZATION_PCT = 10  # ours: an idle GPU reads 0%
MIN_DRIVER_MAJOR = 580  # record #360: below it the whole step runs ~35% slower, silently
MIN_PYTHON = (3, 10)  # pyproject.toml requires-python (the record's image has 3.12)
CUDART_13 = "libcudart.so.13"  # record #360: the FA3 binary links the CUDA 13 runtime
MIN_FREE_DISK_BYTES = 10 * 10**9  # ours: Inductor + Triton caches of the record's graphs and the hub cache
MIN_HOST_RAM_BYTES = 32 * 2**30  # ours: 8 ranks with compile workers and pinned batch buffers
WARN_HOST_RAM_BYTES = 64 * 2**30  # ours: below this, compile workers of 8 ranks can swap
# ours: a host-memory n-gram table (perf/host_table.py) needs the whole table in the node's RAM plus
# its pinned staging (tools.memory: 5.8 GiB for the record's recipe on 1 process) and the run's own
HOST_TABLE_MARGIN_BYTES = 16 * 2**30
HOST_TABLE_PINNED_BYTES = 6 * 2**30  # ours: the staging tools.memory counts, pinned by the CUDA host allocator
NCCL_TIMEOUT_S = 180  # ours: spawn 8 processes, init NCCL, one all_reduce
# tiktoken's GPT-2 files (tiktoken_ext/openai_public.py): the canonical mask (record #92) tokenizes with them
TIKTOKEN_GPT2_URLS = ("https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/vocab.bpe",
                      "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/encoder.json")
NVIDIA_SMI_QUERY = "index,name,memory.total,memory.used,utilization.gpu,driver_version,compute_cap"
PASS, WARN, FAIL = "PASS", "WARN", "FAIL"


@dataclass(frozen=True)
class Check:
    """A check as the dry run lists it: what it verifies and the fix when it fails."""
    name: str
    what: str
    fix: str


@dataclass(frozen=True)
class Row:
    """One check's verdict on this node."""
    name: str
    status: str  # PASS, WARN or FAIL
    detail: str  # what was found
    fix: str = ""  # one line; empty on PASS


CHECKS = (
    Check("python", f"Python >= {'.'.join(map(str, MIN_PYTHON))}", "use the record's image (Python 3.12) or any Python >= 3.10"),
    Check("torch", f"torch is exactly {RECORD_TORCH} (the only torch the FA3 build has a variant for; a cu128 "
                   f"nightly loads it but trained with NaNs once)",
          "pip install -r requirements.txt -r requirements-h100.txt (pins torch==2.10.0+cu128 from the cu128 index)"),
    Check("gpus", f"{RECORD_GPU_COUNT} GPUs, SM{RECORD_COMPUTE_CAP.replace('.', '')}, >= 79 GiB each, SXM, idle "
                  f"(nvidia-smi --query-gpu)", "rent 8×H100 SXM 80GB; stop other processes on the GPUs (nvidia-smi)"),
    Check("driver", f"NVIDIA driver >= {MIN_DRIVER_MAJOR} (below it the step is ~35% slower, with no error)",
          f"install driver >= {MIN_DRIVER_MAJOR} (or pick a node image that has it)"),
    Check("cudart13", f"{CUDART_13} loads (the FA3 binary links the CUDA 13 runtime)",
          "pip install nvidia-cuda-runtime==13.1.80 and add its lib folder to LD_LIBRARY_PATH, or use the "
          "Dockerfile (CUDA 13.1 image)"),
    Check("fa3", "FA3 resolves (SPEEDRUN_FA3_DIR, the kernels cache or the pinned hub revision), its sha256 matches "
                 "and its varlen call traces on fake tensors (what torch.compile needs)",
          "hf auth login, or pre-seed the cache / set SPEEDRUN_FA3_DIR (README: Traps on a fresh GPU node)"),
    Check("triton", "a Triton kernel compiles and runs on cuda:0 (needs a C compiler and Python.h)",
          "install build-essential and python3-dev; unset TRITON_INTERPRET"),
    Check("nccl", "an NCCL all_reduce across all GPUs gives the world size",
          "check NCCL_* variables, the GPUs' topology (nvidia-smi topo -m) and that no GPU is busy"),
    Check("data", "train and val shards present, holding enough tokens for the schedule",
          "python data/cached_fineweb10B.py 9 (or --data-path DIR / DATA_PATH)"),
    Check("tiktoken", "tiktoken's GPT-2 files readable offline (the canonical mask tokenizes with them)",
          "python -c \"import tiktoken; tiktoken.get_encoding('gpt2')\" once online, or set TIKTOKEN_CACHE_DIR"),
    Check("disk", f"free disk >= {MIN_FREE_DISK_BYTES // 10**9} GB under the Inductor, Triton and Hub caches",
          "free space, or point TORCHINDUCTOR_CACHE_DIR / TRITON_CACHE_DIR / HF_HOME at a larger disk"),
    Check("ram", f"available host RAM >= {MIN_HOST_RAM_BYTES >> 30} GiB (WARN below {WARN_HOST_RAM_BYTES >> 30} GiB)",
          "stop other processes or rent a node with more memory"),
    Check("host_table", "a host-memory n-gram table (ngram_table=host, or auto on a GPU it does not fit) fits the "
          "available RAM with a margin, and the locked-memory limit allows its pinned staging",
          "run on fewer ranks' worth of table per node, free RAM, or raise the limit (ulimit -l unlimited; "
          "docker run --ulimit memlock=-1)"),
    Check("compiler", "a C compiler (cc/gcc/clang or $CC) and Python.h (Triton builds its launcher with them)",
          "apt-get install build-essential python3-dev (or the -dev package of your Python)"),
)
FIXES = {c.name: c.fix for c in CHECKS}
RECORD_ONLY = ("torch", "gpus", "driver", "cudart13", "fa3", "ram")  # relaxed to WARN on presets other than the record
CUDA_ONLY = ("triton", "nccl")  # relaxed to WARN on presets that may run on the CPU


def _row(name: str, ok: bool, detail: str, fix: str | None = None, warn: bool = False) -> Row:
    if ok:
        return Row(name, PASS, detail)
    return Row(name, WARN if warn else FAIL, detail, fix or FIXES[name])


# ------------------------------------------------------------------------------------------------
# Decisions: pure functions of a probe's raw answer


def check_python(version: tuple[int, ...]) -> Row:
    found = ".".join(map(str, version[:3]))
    return _row("python", tuple(version[:2]) >= MIN_PYTHON, f"Python {found}")


def check_torch(version: str | None, cuda: str | None) -> Row:
    """version: torch.__version__ (e.g. '2.10.0+cu128'); cuda: torch.version.cuda ('12.8', None on CPU)."""
    if version is None:
        return _row("torch", False, "torch is not importable")
    found = f"torch {version} (CUDA {cuda or 'none'})"
    if version == RECORD_TORCH and cuda == "12.8":
        return _row("torch", True, found)
    if "dev" in version:
        return _row("torch", False, f"{found}: a nightly; a cu128 nightly loads FA3 but trained with NaNs once")
    if cuda is None:
        return _row("torch", False, f"{found}: a CPU build; the record needs {RECORD_TORCH}")
    return _row("torch", False, f"{found}: the FA3 build has no variant for it (\"Cannot find a build "
                                f"variant\"); the record needs {RECORD_TORCH}")


@dataclass(frozen=True)
class Gpu:
    """One row of `nvidia-smi --query-gpu=NVIDIA_SMI_QUERY --format=csv,noheader,nounits`."""
    index: int
    name: str
    memory_total_mib: int
    memory_used_mib: int
    utilization_pct: int
    driver: str
    compute_cap: str


def parse_nvidia_smi(text: str) -> list[Gpu]:
    """The GPUs in nvidia-smi's CSV answer (with or without the header line and units)."""
    gpus = []
    for fields in csv.reader(io.StringIO(text)):
        fields = [f.strip() for f in fields]
        if len(fields) != 7 or not fields[0].isdigit():  # the header, blank lines, error text
            continue

        def number(s: str) -> int:
            s = s.split()[0] if s.split() else ""
            return int(float(s)) if s.replace(".", "", 1).isdigit() else -1  # "[N/A]" -> -1

        gpus.append(Gpu(int(fields[0]), fields[1], number(fields[2]), number(fields[3]), number(fields[4]),
                        fields[5], fields[6]))
    return gpus


def is_sxm(name: str) -> bool:
    """nvidia-smi names SXM H100/H200 boards without a form factor ('NVIDIA H100 80GB HBM3'), others with one."""
    upper = name.upper()
    return "SXM" in upper or not any(tag in upper for tag in ("PCIE", "NVL"))


def check_gpus(nvidia_smi_csv: str | None, want_count: int = RECORD_GPU_COUNT, require_idle: bool = True,
               record: bool = True) -> Row:
    """nvidia_smi_csv: the answer to NVIDIA_SMI_QUERY, None when nvidia-smi is missing or failed."""
    gpus = parse_nvidia_smi(nvidia_smi_csv or "")
    if not gpus:
        return _row("gpus", False, "no GPU: nvidia-smi is missing or listed none", warn=not record)
    names = sorted({g.name for g in gpus})
    problems = []
    if want_count and len(gpus) != want_count:
        problems.append(f"{len(gpus)} GPU(s), the record runs on {want_count}")
    wrong_sm = [g.index for g in gpus if g.compute_cap != RECORD_COMPUTE_CAP]
    if wrong_sm:
        caps = sorted({g.compute_cap for g in gpus if g.index in wrong_sm})
        problems.append(f"GPU {wrong_sm} not SM90 (compute_cap {', '.join(caps)})")
    small = [g.index for g in gpus if 0 <= g.memory_total_mib < MIN_GPU_MEMORY_MIB]
    if small:
        problems.append(f"GPU {small} below {MIN_GPU_MEMORY_MIB} MiB")
    if require_idle:
        busy = [g.index for g in gpus if g.memory_used_mib > BUSY_MEMORY_MIB or g.utilization_pct > BUSY_UTILIZATION_PCT]
        if busy:
            problems.append(f"GPU {busy} busy (memory used / utilization)")
    found = f"{len(gpus)}× {', '.join(names)}"
    if problems:
        return _row("gpus", False, f"{found}: " + "; ".join(problems), warn=not record)
    if not all(is_sxm(g.name) for g in gpus):
        return _row("gpus", False, f"{found}: not SXM boards (PCIe/NVL): slower links and clocks, times not "
                                   f"comparable with the record", warn=True)
    return _row("gpus", True, found)


def check_driver(nvidia_smi_csv: str | None, record: bool = True) -> Row:
    gpus = parse_nvidia_smi(nvidia_smi_csv or "")
    if not gpus:
        return _row("driver", False, "no driver version: nvidia-smi is missing or listed no GPU", warn=not record)
    version = gpus[0].driver
    try:
        major = int(version.split(".")[0])
    except ValueError:
        return _row("driver", False, f"unreadable driver version {version!r}", warn=not record)
    if major < MIN_DRIVER_MAJOR:
        return _row("driver", False, f"driver {version}: below {MIN_DRIVER_MAJOR} the step runs ~35% slower "
                                     f"with no error", warn=not record)
    return _row("driver", True, f"driver {version}")


def check_cudart(loaded: bool, error: str, wheel_libs: list[str], record: bool = True) -> Row:
    """loaded: ctypes.CDLL(CUDART_13) worked; wheel_libs: copies found under site-packages/nvidia."""
    if loaded:
        return _row("cudart13", True, f"{CUDART_13} loads")
    if wheel_libs:
        fix = f"export LD_LIBRARY_PATH={os.path.dirname(wheel_libs[0])}:$LD_LIBRARY_PATH (the wheel's copy)"
        return _row("cudart13", False, f"{CUDART_13} does not load ({error}) but {wheel_libs[0]} exists", fix,
                    warn=not record)
    return _row("cudart13", False, f"{CUDART_13} does not load ({error})", warn=not record)


def check_fa3(answer: dict, record: bool = True) -> Row:
    """answer: {'source', 'binary', 'sha256'} from a verified load, or {'error': message}."""
    if "error" in answer:
        return _row("fa3", False, answer["error"], warn=not record)
    return _row("fa3", True, f"{answer['source']}: {answer['binary']} sha256 {answer['sha256'][:16]}…")


def check_triton(answer: dict) -> Row:
    """answer: {'ok': True, 'detail'} after a kernel ran and its result matched, or {'error': message}."""
    if "error" in answer:
        return _row("triton", False, answer["error"])
    return _row("triton", True, answer["detail"])


def check_nccl(answer: dict, world_size: int) -> Row:
    """answer: {'sum': value every rank saw} or {'error': message}; the sum of ones must be the world size."""
    if "error" in answer:
        return _row("nccl", False, answer["error"])
    if answer["sum"] != world_size:
        return _row("nccl", False, f"all_reduce of ones over {world_size} GPUs gave {answer['sum']}")
    return _row("nccl", True, f"all_reduce over {world_size} GPU(s) gave {world_size}")


def check_data(error: str | None, train_glob: str) -> Row:
    """error: config_check's data problems (missing shards, too few tokens), None when it passed."""
    if error:
        fix = None if "fineweb" in train_glob else "python data/tokenize.py YOUR_TEXT... --out DIR, then --data-path DIR"
        return _row("data", False, error, fix)
    return _row("data", True, f"{train_glob}: enough tokens for the schedule")


def check_tiktoken(cached: dict[str, bool], load_error: str | None) -> Row:
    """cached: per GPT-2 file URL, whether tiktoken's cache holds it; load_error: get_encoding('gpt2') failing."""
    missing = [url.rsplit("/", 1)[1] for url, ok in cached.items() if not ok]
    if missing:
        return _row("tiktoken", False, f"not in tiktoken's cache: {', '.join(missing)} (a record run offline "
                                       f"cannot build the canonical mask)")
    if load_error:
        return _row("tiktoken", False, f"get_encoding('gpt2') failed: {load_error}")
    return _row("tiktoken", True, "GPT-2 vocab.bpe and encoder.json cached")


def check_disk(free_bytes: dict[str, int], minimum: int = MIN_FREE_DISK_BYTES) -> Row:
    """free_bytes: per cache folder (or its nearest existing parent), the free bytes on its disk."""
    short = {p: b for p, b in free_bytes.items() if b < minimum}
    listing = ", ".join(f"{p} {b / 1e9:.1f} GB" for p, b in (short or free_bytes).items())
    if short:
        return _row("disk", False, f"below {minimum / 1e9:.0f} GB free: {listing}")
    return _row("disk", True, f"free: {listing}")


def check_ram(available_bytes: int | None) -> Row:
    if available_bytes is None:
        return _row("ram", False, "cannot read MemAvailable from /proc/meminfo", warn=True)
    found = f"{available_bytes / 2**30:.1f} GiB available"
    if available_bytes < MIN_HOST_RAM_BYTES:
        return _row("ram", False, found)
    return _row("ram", True, found) if available_bytes >= WARN_HOST_RAM_BYTES else _row("ram", False, found, warn=True)


def check_host_table(placement: str, table_bytes: int, available_bytes: int | None, memlock_bytes: int | None) -> Row:
    """placement: where the run puts its n-gram table; table_bytes: the table of every process on this
    node; memlock_bytes: RLIMIT_MEMLOCK (None: unlimited)."""
    if placement != "host":
        return _row("host_table", True, "the n-gram table lives on the device")
    need = table_bytes + HOST_TABLE_MARGIN_BYTES
    if available_bytes is None or available_bytes < need:
        have = "unknown" if available_bytes is None else f"{available_bytes / 2**30:.1f} GiB"
        return _row("host_table", False, f"the table in host memory needs {need / 2**30:.1f} GiB "
                                         f"({table_bytes / 2**30:.2f} table + {HOST_TABLE_MARGIN_BYTES >> 30} margin), "
                                         f"available: {have}")
    if memlock_bytes is not None and memlock_bytes < HOST_TABLE_PINNED_BYTES:
        return _row("host_table", False, f"locked-memory limit {memlock_bytes / 2**20:.0f} MiB is below the "
                                         f"{HOST_TABLE_PINNED_BYTES >> 30} GiB of pinned staging", warn=True)
    return _row("host_table", True, f"{table_bytes / 2**30:.2f} GiB table in host memory, "
                                    f"{available_bytes / 2**30:.1f} GiB available")


def probe_host_table(cfg) -> tuple[str, int]:
    """(placement of this node's table, its bytes on this node): every local process's shard."""
    import torch

    from perf.host_table import choose_placement
    processes = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    shard = cfg.model.ngram_rows // world * cfg.model.model_dim * 2
    if not cfg.features.ngram or not torch.cuda.is_available():
        return "device", shard * processes
    return choose_placement(cfg.ngram_table, shard, torch.device("cuda", 0))[0], shard * processes


def probe_memlock() -> int | None:
    import resource
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    return None if soft == resource.RLIM_INFINITY else soft


def check_compiler(compiler: str | None, python_h: str | None, python_h_exists: bool) -> Row:
    missing = ([] if compiler else ["a C compiler (cc, gcc, clang or $CC)"]) + \
              ([] if python_h_exists else [f"Python.h (looked in {python_h})"])
    if missing:
        return _row("compiler", False, "missing " + " and ".join(missing))
    return _row("compiler", True, f"{compiler}, {python_h}")


# ------------------------------------------------------------------------------------------------
# Probes: thin, each returns its raw answer (never raises)


def probe_torch() -> tuple[str | None, str | None]:
    try:
        import torch
    except Exception:
        return None, None
    return torch.__version__, torch.version.cuda


def probe_nvidia_smi() -> str | None:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        out = subprocess.run([exe, f"--query-gpu={NVIDIA_SMI_QUERY}", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"error: {exc}"
    return out.stdout if out.returncode == 0 else f"error (exit {out.returncode}): {out.stderr.strip()}"


def probe_cudart() -> tuple[bool, str, list[str]]:
    try:
        ctypes.CDLL(CUDART_13)
        return True, "", []
    except OSError as exc:
        error = str(exc)
    roots = {p for p in (sysconfig.get_paths().get("purelib"), sysconfig.get_paths().get("platlib")) if p}
    wheel_libs = sorted(f for root in roots for f in glob.glob(os.path.join(root, "nvidia", "**", CUDART_13),
                                                                 recursive=True))
    return False, error, wheel_libs


def probe_fa3() -> dict:
    """Load FA3 the way a record run does (perf.attention_backends.load_fa3) and report its binary."""
    try:
        import torch

        from perf import attention_backends as ab
        if not torch.cuda.is_available():
            return {"error": f"no CUDA device (torch {torch.__version__}): FA3 loads only on the GPU node"}
        local = ab.fa3_local_dir()
        source = f"local {local}" if local else f"{ab.FA3_REPO}@{ab.FA3_REVISION[:12]} (kernels cache or hub)"
        interface = ab.load_fa3()
        package_dir = Path(getattr(interface, "__file__", "")).parent
        binary = ab.verify_fa3_binary(package_dir)  # load_fa3 checked it; name the file for the log
        ab.check_fa3_compilable(interface)  # its ops trace under torch.compile (fake kernels)
        return {"source": source, "binary": str(binary), "sha256": ab.sha256_of(binary)}
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}


def probe_triton() -> dict:
    """Compile one Triton kernel, run it on cuda:0 and compare with torch."""
    try:
        import torch
        if not torch.cuda.is_available():
            return {"error": "no CUDA device: cannot launch a Triton kernel"}
        if os.environ.get("TRITON_INTERPRET") == "1":
            return {"error": "TRITON_INTERPRET=1 runs kernels in the interpreter, not compiled"}
        import triton
        import triton.language as tl

        @triton.jit
        def add_one(x_ptr, n, BLOCK: tl.constexpr):
            offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
            mask = offsets < n
            tl.store(x_ptr + offsets, tl.load(x_ptr + offsets, mask=mask) + 1.0, mask=mask)

        x = torch.arange(1000, device="cuda:0", dtype=torch.float32)  # (1000,)
        add_one[(triton.cdiv(x.numel(), 256),)](x, x.numel(), BLOCK=256)
        torch.cuda.synchronize()
        if not torch.equal(x.cpu(), torch.arange(1000, dtype=torch.float32) + 1):
            return {"error": "a Triton kernel ran on cuda:0 but wrote wrong values"}
        return {"ok": True, "detail": f"triton {triton.__version__}: a kernel compiled and ran on cuda:0"}
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}


def _all_reduce_worker(rank: int, world_size: int, folder: str, backend: str) -> None:
    """One rank: all_reduce a one, write what it got to <folder>/rank<r> (NCCL on cuda:<rank>, gloo on CPU)."""
    import torch
    import torch.distributed as dist

    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=f"file://{os.path.join(folder, 'rendezvous')}", rank=rank,
                            world_size=world_size)
    try:
        x = torch.ones(1, device=device)  # (1,)
        dist.all_reduce(x)
        Path(folder, f"rank{rank}").write_text(str(x.item()))
    finally:
        dist.destroy_process_group()


def probe_nccl(world_size: int | None = None, backend: str = "nccl") -> tuple[dict, int]:
    """One all_reduce of ones over every visible GPU (or world_size ranks), in spawned processes with a
    file rendezvous; the answer is the smallest sum any rank saw."""
    try:
        import time

        import torch
        import torch.multiprocessing as mp
        if world_size is None:
            world_size = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if world_size == 0:
            return {"error": "no CUDA device: nothing to all_reduce over"}, 0
        with tempfile.TemporaryDirectory() as folder:
            context = mp.start_processes(_all_reduce_worker, args=(world_size, folder, backend),
                                         nprocs=world_size, join=False, start_method="spawn")
            deadline = time.monotonic() + NCCL_TIMEOUT_S
            while not context.join(timeout=1):
                if time.monotonic() > deadline:
                    for process in context.processes:
                        process.kill()
                    return {"error": f"{backend} all_reduce over {world_size} ranks did not finish in "
                                     f"{NCCL_TIMEOUT_S} s"}, world_size
            sums = [float(Path(folder, f"rank{r}").read_text()) for r in range(world_size)]
        return {"sum": min(sums), "per_rank": sums}, world_size
    except Exception as exc:
        last = str(exc).strip().splitlines()[-1] if str(exc).strip() else ""
        return {"error": f"{type(exc).__name__}: {last}"}, world_size or 0


def probe_data(cfg) -> tuple[str | None, str]:
    """train_gpt's up-front data check for the whole schedule (config_check.data_problems): None, or
    its problems."""
    from runtime.config_check import data_problems, shard_globs
    from optim.schedule import TrainingSchedule

    train_glob = shard_globs(cfg)[0]
    try:
        schedule = TrainingSchedule(cfg.schedule)
    except ValueError as exc:
        return f"the schedule cannot be built: {exc}", train_glob
    problems = data_problems(cfg, schedule.total_steps, schedule)
    return ("; ".join(problems) or None), train_glob


def probe_tiktoken() -> tuple[dict[str, bool], str | None]:
    import hashlib
    cache_dir = os.environ.get("TIKTOKEN_CACHE_DIR") or os.environ.get("DATA_GYM_CACHE_DIR") or \
        os.path.join(tempfile.gettempdir(), "data-gym-cache")  # tiktoken/load.py read_file_cached
    cached = {url: os.path.exists(os.path.join(cache_dir, hashlib.sha1(url.encode()).hexdigest()))
              for url in TIKTOKEN_GPT2_URLS}
    if not all(cached.values()):
        return cached, None  # loading now would download: not "offline"
    try:
        import tiktoken
        tiktoken.get_encoding("gpt2")
        return cached, None
    except Exception as exc:
        return cached, f"{type(exc).__name__}: {exc}"


def cache_dirs() -> dict[str, str]:
    """Where Inductor, Triton and the Hugging Face hub cache write (their own defaults)."""
    import getpass
    try:
        user = getpass.getuser()  # torch/_inductor/runtime/cache_dir_utils.py: tmp/torchinductor_<user>
    except Exception:
        user = "unknown"
    home = os.path.expanduser("~")
    return {
        "inductor": os.environ.get("TORCHINDUCTOR_CACHE_DIR") or os.path.join(tempfile.gettempdir(), f"torchinductor_{user}"),
        "triton": os.environ.get("TRITON_CACHE_DIR") or os.path.join(home, ".triton", "cache"),
        "hub": os.environ.get("KERNELS_CACHE") or os.environ.get("HF_HUB_CACHE") or
               os.path.join(os.environ.get("HF_HOME") or os.path.join(home, ".cache", "huggingface"), "hub"),
    }


def probe_disk() -> dict[str, int]:
    free = {}
    for path in cache_dirs().values():
        existing = Path(path)
        while not existing.exists() and existing != existing.parent:
            existing = existing.parent
        free[path] = shutil.disk_usage(existing).free
    return free


def probe_ram() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def probe_compiler() -> tuple[str | None, str, bool]:
    compiler = None
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            compiler = shutil.which(name)
            break
    include = sysconfig.get_paths()["include"]
    return compiler, include, os.path.isfile(os.path.join(include, "Python.h"))


# ------------------------------------------------------------------------------------------------
# Running the checks


def _config(name: str, data_path: str | None = None):
    from config import RUN_PRESETS

    cfg = RUN_PRESETS[name]
    return replace(cfg, data_path=data_path) if data_path else cfg


def _relax(rows: list[Row], record: bool, needs_cuda: bool) -> list[Row]:
    """Presets other than the record: record-only FAILs become WARNs (and CUDA-only ones off CUDA)."""
    relaxed = () if record else RECORD_ONLY + (() if needs_cuda else CUDA_ONLY)
    return [replace(r, status=WARN) if r.status == FAIL and r.name in relaxed else r for r in rows]


def run_checks(cfg, full: bool = True, raw: dict | None = None) -> list[Row]:
    """Every check for `cfg` (full: also FA3, a Triton launch and NCCL); raw collects each probe's answer."""
    raw = raw if raw is not None else {}
    record = cfg.requires_fast_path
    rows = [check_python(tuple(sys.version_info))]
    raw["python"] = sys.version
    raw["torch"] = probe_torch()
    rows.append(check_torch(*raw["torch"]))
    raw["nvidia-smi"] = probe_nvidia_smi()
    want = RECORD_GPU_COUNT if record else 0
    rows.append(check_gpus(raw["nvidia-smi"], want, require_idle=full, record=record))
    rows.append(check_driver(raw["nvidia-smi"], record=record))
    raw["cudart13"] = probe_cudart()
    rows.append(check_cudart(*raw["cudart13"], record=record))
    if full:
        raw["fa3"] = probe_fa3()
        rows.append(check_fa3(raw["fa3"], record=record))
        raw["triton"] = probe_triton()
        rows.append(check_triton(raw["triton"]))
        raw["nccl"], world_size = probe_nccl()
        rows.append(check_nccl(raw["nccl"], world_size))
    raw["data"] = probe_data(cfg)
    rows.append(check_data(*raw["data"]))
    if cfg.canonical_mask:
        raw["tiktoken"] = probe_tiktoken()
        rows.append(check_tiktoken(*raw["tiktoken"]))
    raw["disk"] = probe_disk()
    rows.append(check_disk(raw["disk"]))
    raw["ram"] = probe_ram()
    rows.append(check_ram(raw["ram"]))
    raw["host_table"] = (*probe_host_table(cfg), raw["ram"], probe_memlock())
    rows.append(check_host_table(*raw["host_table"]))
    raw["compiler"] = probe_compiler()
    rows.append(check_compiler(*raw["compiler"]))
    raw["platform"] = platform.platform()
    return _relax(rows, record, needs_cuda=cfg.device == "cuda")


def cheap_checks(cfg) -> list[Row]:
    """The checks a training rank can run before the clock: no FA3 load, no kernel, no process group,
    and no idle check (the run's own ranks already hold GPU memory)."""
    return run_checks(cfg, full=False)


def check_node(cfg, backend) -> None:
    """The record's node checks, before a run builds anything (train_gpt.py; perf/cuda_graphs/
    contract.py's build_run): a record run never falls back to a slower path
    (`assert_record_backends`), and any FAIL of the cheap checks (the node's stack, GPUs, driver,
    CUDA 13 runtime, data, BPE files, disk, RAM, compiler) stops it. Nothing for a preset that does
    not require the fast path; the configuration itself was checked up front (runtime/config_check.py)."""
    if cfg.requires_fast_path:
        from perf.attention_backends import assert_record_backends

        assert_record_backends(backend)
        raise_on_fail(cheap_checks(cfg))


def raise_on_fail(rows: list[Row]) -> None:
    """Raise one RuntimeError listing every FAIL with its fix."""
    failed = [r for r in rows if r.status == FAIL]
    if failed:
        raise RuntimeError("preflight failed (python -m runtime.preflight for the full list):\n" +
                           "\n".join(f"  {r.name}: {r.detail}\n    fix: {r.fix}" for r in failed))


def format_rows(rows: list[Row]) -> str:
    width = max(len(r.name) for r in rows)
    lines = []
    for r in rows:
        lines.append(f"{r.status}  {r.name:<{width}}  {r.detail}")
        if r.status != PASS:
            lines.append(f"{'':6}{'':<{width}}  fix: {r.fix}")
    return "\n".join(lines)


def write_environment(path: Path, raw: dict, rows: list[Row]) -> Path:
    """The node as found (every probe's raw answer, then the verdicts), written atomically."""
    path.parent.mkdir(parents=True, exist_ok=True)
    text = "".join(f"== {k}\n{v if isinstance(v, str) else repr(v)}\n" for k, v in raw.items())
    text += "== verdicts\n" + format_rows(rows) + "\n"
    fd, tmp = tempfile.mkstemp(prefix=".environment.", dir=path.parent)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)
    return path


def main(argv=None) -> int:
    from cli import ArgumentParser, exit_on_config_error
    from config import RUN_PRESETS, ConfigError
    from runtime.config_check import records_folder_problems

    with exit_on_config_error("python -m runtime.preflight"):
        ap = ArgumentParser(prog="python -m runtime.preflight", description=__doc__.split("\n\n")[0])
        ap.add_argument("--config", default="record", choices=sorted(RUN_PRESETS), help="preset (default: record)")
        ap.add_argument("--data-path", default=os.environ.get("DATA_PATH"), help="folder holding the shards (env DATA_PATH)")
        ap.add_argument("--records-dir", default=None,
                        help="environment.txt goes to <records-dir>/logs/ (default: the preset's)")
        ap.add_argument("--dry-run", action="store_true", help="list the checks (name, what, fix) without running them")
        args = ap.parse_args(argv)
        records_dir = Path(args.records_dir or RUN_PRESETS[args.config].records_dir)
        if not records_dir.is_absolute():
            records_dir = REPO_ROOT / records_dir
        if not args.dry_run and records_folder_problems(records_dir):
            raise ConfigError(records_folder_problems(records_dir))
    if args.dry_run:
        width = max(len(c.name) for c in CHECKS)
        for c in CHECKS:
            print(f"{c.name:<{width}}  {c.what}\n{'':<{width}}  fix: {c.fix}")
        return 0
    cfg = _config(args.config, args.data_path)
    raw: dict = {"config": cfg.name, "data_path": cfg.data_path}
    rows = run_checks(cfg, full=True, raw=raw)
    print(format_rows(rows))
    env = write_environment(records_dir / "logs" / "environment.txt", raw, rows)
    failed = sum(r.status == FAIL for r in rows)
    print(f"\n{failed} FAIL, {sum(r.status == WARN for r in rows)} WARN of {len(rows)} checks; the node as found: {env}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
