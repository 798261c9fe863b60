"""Which execution path runs: the portable twin (plain PyTorch) or the fast path (Triton, FA3, compile).

One algorithm, two paths (docs/design.md). Every fast op has a portable twin with the same signature;
the op's public function asks `current()` which one to call. The choice comes from the hardware and
can be overridden with environment variables (read once, at first use):

    SPEEDRUN_TRITON=0|1          Triton kernels (default: 1 on CUDA, 0 on CPU; 1 on CPU needs TRITON_INTERPRET=1)
    SPEEDRUN_ATTENTION=sdpa|flex|fa3   attention backend (default: fa3 on SM90, flex on other CUDA, sdpa on CPU)
    SPEEDRUN_COMPILE=0|1         torch.compile the model (default: 1 on CUDA, 0 on CPU)
    SPEEDRUN_COMPILE_BACKEND=inductor|aot_eager|eager   torch.compile's backend (default inductor;
                                 aot_eager and eager trace exactly what a GPU run traces, on CPU, in tests)
    SPEEDRUN_CUDA_GRAPHS=0|1     capture the forward/backward (per geometry) and the optimizer update (per
                                 phase) in the warmup, replay them in the timed loop (perf/cuda_graphs/
                                 capture.py; default 1 on CUDA, 0 on CPU, where 1 replays the CPU twin)
    SPEEDRUN_SYNC_CHECK=0|1      fail on any host sync inside the timed training step (runtime/sync_check.py)
    SPEEDRUN_STREAM_CHECK=0|1    on CPU, model a GPU's side streams and stop at a wait left out, a staging
                                 buffer reused while its copy is in flight, a keep-alive on the wrong stream
                                 or device work from another thread during a capture (perf/streams.py;
                                 default 0, always 1 in the tests)
    SPEEDRUN_HOST_CHECKS=0|1     debugging checks that read tensor values on the host (index ranges, ...):
                                 default 1 on CPU, 0 on CUDA and under SPEEDRUN_SYNC_CHECK=1 (a GPU would
                                 wait on them); never inside torch.compile
    SPEEDRUN_OVERLAP=0|1         every overlap piece below at once (default 1); the finer switches
                                 override it one by one, so an experimenter can ablate each:
    SPEEDRUN_PINNED_BATCHES=0|1  batches through a pinned host ring and a side-stream copy (CUDA; on CPU
                                 the same code with plain tensors)
    SPEEDRUN_FUSED_QKV=0|1       the fused RMS-norm / e4m3 / QKV / rotary path (the Triton kernels with
                                 SPEEDRUN_TRITON=1, their portable twins otherwise)
    SPEEDRUN_SHARDED_PREFIX=0|1  the prefix table built one slice per rank and all-gathered
    SPEEDRUN_DEFERRED_GATHERS=0|1  the banks' all-gathers launched after the captured update and waited
                                 at the next step's top, before the forward (several ranks)
    SPEEDRUN_ROW_PREFETCH=0|1    the next step's n-gram rows pulled at this step's top, across this
                                 step's forward and backward (steps that are not table events)

A record run never falls back silently: `require_fast_path` lists everything the record needs that
this backend lacks, and the record preset stops with that message.
"""
from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, replace

import torch

ATTENTION_BACKENDS = ("sdpa", "flex", "fa3")
COMPILE_BACKENDS = ("inductor", "aot_eager", "eager")  # the record: inductor; the others trace the same graphs


@dataclass(frozen=True)
class Backend:
    device: str  # "cpu" or "cuda"
    sm: int  # compute capability as 10*major + minor (90 for H100); 0 on CPU
    triton: bool
    fp8: bool  # the device runs fp8 GEMMs (torch._scaled_mm: SM89+, and CPU); the switch is features.fp8
    attention: str
    compile: bool
    compile_backend: str = "inductor"
    cuda_graphs: bool = False  # regions captured in the warmup and replayed (perf/cuda_graphs/capture.py)
    sync_check: bool = False  # the timed step fails on a host sync (runtime/sync_check.py)
    host_checks: bool = False  # value checks that read tensors on the host (see host_checks())
    # overlap pieces (issue "Overlap"): each one hides work behind compute without changing the math
    pinned_batches: bool = True  # pinned host ring + side-stream batch copies
    fused_qkv: bool = True  # fused RMS-norm / e4m3 / QKV GEMM epilogue / rotary
    sharded_prefix: bool = True  # prefix table: one slice per rank, all-gathered
    deferred_gathers: bool = True  # bank all-gathers waited at the next step's top
    row_prefetch: bool = True  # the next step's n-gram rows pulled during this step


# Every SPEEDRUN_* variable the project reads; any other name with the prefix is refused as a typo.
BACKEND_VARIABLES = ("SPEEDRUN_TRITON", "SPEEDRUN_ATTENTION", "SPEEDRUN_COMPILE",
                     "SPEEDRUN_COMPILE_BACKEND", "SPEEDRUN_CUDA_GRAPHS", "SPEEDRUN_SYNC_CHECK",
                     "SPEEDRUN_HOST_CHECKS", "SPEEDRUN_OVERLAP", "SPEEDRUN_PINNED_BATCHES", "SPEEDRUN_FUSED_QKV",
                     "SPEEDRUN_SHARDED_PREFIX", "SPEEDRUN_DEFERRED_GATHERS", "SPEEDRUN_ROW_PREFETCH")
# Variables that switched something once, with where the switch lives now.
RETIRED_VARIABLES = {"SPEEDRUN_FP8": "fp8 has one switch, the recipe's: --set features.fp8=false (bf16 GEMMs); "
                                     "whether the device runs fp8 GEMMs is read from the device"}
OTHER_VARIABLES = ("SPEEDRUN_FA3_DIR",  # perf/attention_backends.py: a local FA3 build
                   "SPEEDRUN_STREAM_CHECK",  # perf/streams.py: the side-stream checks on CPU (tests: always)
                   "SPEEDRUN_FAKE_GPU", "SPEEDRUN_CROSS_COMPILE_TRACEBACK",  # tools/cross_compile.py's own
                   "SPEEDRUN_CROSS_COMPILE_TEMP_CACHE")


def _env_flag(env, name: str, default: bool, problems: list[str]) -> bool:
    value = env.get(name)
    if value is None or value == "":
        return default
    if value not in ("0", "1"):
        problems.append(f"{name}={value}: must be 0 or 1 (unset: {int(default)} here)")
        return default
    return value == "1"


def unknown_variables(env=os.environ) -> list[str]:
    """One problem per SPEEDRUN_* variable the project does not read (a typo would be ignored)."""
    import difflib

    known = BACKEND_VARIABLES + OTHER_VARIABLES
    problems = []
    for name in sorted(n for n in env if n.startswith("SPEEDRUN_") and n not in known):
        close = difflib.get_close_matches(name, known, n=1)
        hint = RETIRED_VARIABLES.get(name) or (f"did you mean {close[0]}?" if close else "see the README's switch table")
        problems.append(f"{name}={env[name]}: unknown variable, nothing reads it; {hint}")
    return problems


def detect(env=os.environ, device: str | None = None) -> Backend:
    """The backend for `device` (default: cuda when available) with the env overrides applied.
    Raises config.ConfigError listing every bad variable at once."""
    from config import ConfigError

    problems: list[str] = []
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda":
        major, minor = torch.cuda.get_device_capability()
        sm = 10 * major + minor
    else:
        sm = 0
    default_attention = "fa3" if sm == 90 else "flex" if device == "cuda" else "sdpa"
    attention = env.get("SPEEDRUN_ATTENTION") or default_attention
    if attention not in ATTENTION_BACKENDS:
        problems.append(f"SPEEDRUN_ATTENTION={attention}: must be one of {', '.join(ATTENTION_BACKENDS)} "
                        f"(unset: {default_attention} here)")
        attention = default_attention
    compile_backend = env.get("SPEEDRUN_COMPILE_BACKEND") or "inductor"
    if compile_backend not in COMPILE_BACKENDS:
        problems.append(f"SPEEDRUN_COMPILE_BACKEND={compile_backend}: must be one of {', '.join(COMPILE_BACKENDS)} "
                        f"(unset: inductor)")
        compile_backend = "inductor"
    flag = lambda name, default: _env_flag(env, name, default, problems)  # noqa: E731
    sync_check = flag("SPEEDRUN_SYNC_CHECK", False)
    overlap = flag("SPEEDRUN_OVERLAP", True)
    triton = flag("SPEEDRUN_TRITON", device == "cuda")
    if triton and device == "cpu" and env.get("TRITON_INTERPRET") != "1":
        problems.append("SPEEDRUN_TRITON=1 on CPU runs Triton's interpreter: set TRITON_INTERPRET=1 too")
    backend = Backend(
        device=device,
        sm=sm,
        triton=triton,
        fp8=device == "cpu" or sm >= 89,  # torch._scaled_mm runs: SM89+ or CPU (features.fp8 is the switch)
        attention=attention,
        compile=flag("SPEEDRUN_COMPILE", device == "cuda"),
        compile_backend=compile_backend,
        cuda_graphs=flag("SPEEDRUN_CUDA_GRAPHS", device == "cuda"),
        sync_check=sync_check,
        host_checks=flag("SPEEDRUN_HOST_CHECKS", device == "cpu" and not sync_check),
        pinned_batches=flag("SPEEDRUN_PINNED_BATCHES", overlap),
        fused_qkv=flag("SPEEDRUN_FUSED_QKV", overlap),
        sharded_prefix=flag("SPEEDRUN_SHARDED_PREFIX", overlap),
        deferred_gathers=flag("SPEEDRUN_DEFERRED_GATHERS", overlap),
        row_prefetch=flag("SPEEDRUN_ROW_PREFETCH", overlap),
    )
    if problems:
        raise ConfigError(problems)
    return backend


def require_fast_path(backend: Backend) -> None:
    """Raise, naming every missing piece, unless `backend` is the record's fast path on SM90."""
    missing = []
    if backend.device != "cuda":
        missing.append("a CUDA device (found only the CPU)")
    elif backend.sm != 90:
        missing.append(f"an SM90 GPU (H100/H200; found SM{backend.sm})")
    if not backend.triton:
        missing.append("Triton kernels (SPEEDRUN_TRITON=0 or Triton unavailable)")
    if not backend.fp8:
        missing.append("fp8 GEMMs (the device runs none)")
    if backend.attention != "fa3":
        missing.append(f"FA3 attention (SPEEDRUN_ATTENTION={backend.attention})")
    if not backend.compile:
        missing.append("torch.compile (SPEEDRUN_COMPILE=0)")
    elif backend.compile_backend != "inductor":
        missing.append(f"inductor (SPEEDRUN_COMPILE_BACKEND={backend.compile_backend})")
    if not backend.cuda_graphs:
        missing.append("CUDA graphs (SPEEDRUN_CUDA_GRAPHS=0)")
    if missing:
        raise RuntimeError("the record preset needs the fast path, but this run lacks: " + "; ".join(missing)
                           + ". Use --config dev (1-8 CUDA GPUs) or --config smoke (CPU) instead.")


def host_checks() -> bool:
    """Whether to run the debugging checks that read tensor values on the host (index ranges, a
    target outside the candidate set, ...). On a GPU each one is a host sync, and inside
    torch.compile a data-dependent branch, so they run only in eager mode with the switch on
    (the CPU default; the CPU "as on GPU" runs, SPEEDRUN_SYNC_CHECK=1, turn it off)."""
    return not torch.compiler.is_compiling() and current().host_checks


_current: Backend | None = None


def current() -> Backend:
    global _current
    if _current is None:
        _current = detect()
    return _current


@contextlib.contextmanager
def use_backend(**overrides):
    """Temporarily replace fields of the current backend (tests use this to switch paths)."""
    global _current
    saved = current()
    _current = replace(saved, **overrides)
    try:
        yield _current
    finally:
        _current = saved
