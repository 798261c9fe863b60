"""One faked NVIDIA GPU (an H100 by default; an L40S or an A100 on request) on a CPU-only PyTorch:
enough for dynamo, AOT autograd and inductor to build what a GPU run compiles, and for Triton to
compile every kernel to a cubin for that GPU's architecture (sm_90, sm_89, sm_80) with its own ptxas.
Nothing ever runs on it: no kernel is loaded, launched or benchmarked.

Used by `python -m tools.cross_compile`, in a process of its own. The pieces:
- a preloaded C++ library (`PRELOAD_SOURCE`, built once with the C++ compiler against torch's headers)
  that registers c10's no-op `FakeGuardImpl` as the CUDA device guard and CUDA hooks that report one
  device. The guard lets in-place ops and device switches run on fake CUDA tensors; the hooks make
  `at::getAccelerator()` answer CUDA, which the autograd engine asks when AOT autograd traces the
  backward (without them: "Cannot access accelerator device when none is available"). The hooks
  are created once, at the first query, before Python can load anything, so the library goes in
  through LD_PRELOAD and the process re-executes itself with it (`reexec_with_preload`). It knows
  nothing of the GPU's kind: that is the Python side's.
- `install(sm)`: torch.cuda's and dynamo's device queries answer for the GPU of `DEVICES[sm]`
  (properties as a namedtuple, so dynamo folds them to constants; `perf.backend.detect` then picks
  the path such a GPU gets), a Triton driver whose target is sm_<sm> and that never loads a binary,
  stubs for what inductor's generated wrapper imports, and the inductor steps that would evaluate or
  time something on the device turned off (each named in `DEVICE_EVALUATING_OPTIONS` with its
  reason). Compile workers are forked, so they inherit it all.
- `on_fake_cuda()`: factory calls default to the fake device inside a FakeTensorMode, with
  `torch.tensor(data)` made on the CPU and moved (copying data needs CUDA's kernels).
- `KernelLedger`: every cubin Triton built, per compiled graph, read where inductor would have made
  its launchers (which would load the cubin on the device). There, as loading would, each kernel's
  shared memory is checked against the GPU's per-block limit: configs over it are dropped, and a
  kernel none of whose configs fits is retried without pipelining, then fails, as on the GPU.
- `fa3_standin()`: FA3's `flash_attn_varlen_func` signature as torch custom ops with shape-only
  (fake) kernels and an autograd formula, so a compiled graph holds FA3 as the opaque extern call
  the hub build is (the real binary cannot load on a CPU). Needs no fake device: the FA3 start-up
  check's tests use it on the CPU.
"""
from __future__ import annotations

import collections
import contextlib
import hashlib
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

PRELOAD_ENV = "LD_PRELOAD"
MARKER_ENV = "SPEEDRUN_FAKE_GPU"  # set in the re-executed process: the library it preloaded

# The GPUs as torch.cuda reports them. Inductor sizes its kernels from these (SM count, threads and
# registers per SM), picks its flex-attention configs by capability, and the ledger checks each
# kernel's shared memory against shared_memory_per_block_optin as loading it would.
DeviceProperties = collections.namedtuple("DeviceProperties", [
    "name", "major", "minor", "total_memory", "multi_processor_count", "warp_size",
    "max_threads_per_multi_processor", "max_threads_per_block", "regs_per_multiprocessor",
    "shared_memory_per_block", "shared_memory_per_block_optin", "shared_memory_per_multiprocessor",
    "L2_cache_size", "clock_rate", "memory_clock_rate", "memory_bus_width", "gcnArchName", "uuid",
    "is_integrated", "is_multi_gpu_board"])
# H100 SXM5 (H100 datasheet: 132 SMs, 80 GB HBM3, 50 MB L2; compute capability 9.0: 228 KB shared
# memory per SM of which 227 KB per block, 2048 threads per SM): the record's GPU.
H100 = DeviceProperties(
    name="NVIDIA H100 80GB HBM3", major=9, minor=0, total_memory=80 * 2**30, multi_processor_count=132,
    warp_size=32, max_threads_per_multi_processor=2048, max_threads_per_block=1024,
    regs_per_multiprocessor=65536, shared_memory_per_block=48 * 1024, shared_memory_per_block_optin=227 * 1024,
    shared_memory_per_multiprocessor=228 * 1024, L2_cache_size=50 * 2**20, clock_rate=1980000,
    memory_clock_rate=2619000, memory_bus_width=5120, gcnArchName="", uuid="fake-sm90", is_integrated=0,
    is_multi_gpu_board=0)
# L40S (L40S datasheet: 142 SMs, 48 GB GDDR6 on a 384-bit bus, 96 MB L2; compute capability 8.9, as an
# RTX 4090's: fp8 tensor cores, no TMA/wgmma, so no FA3; 100 KB shared memory per SM of which 99 KB
# per block, 1536 threads per SM)
L40S = DeviceProperties(
    name="NVIDIA L40S", major=8, minor=9, total_memory=48 * 2**30, multi_processor_count=142,
    warp_size=32, max_threads_per_multi_processor=1536, max_threads_per_block=1024,
    regs_per_multiprocessor=65536, shared_memory_per_block=48 * 1024, shared_memory_per_block_optin=99 * 1024,
    shared_memory_per_multiprocessor=100 * 1024, L2_cache_size=96 * 2**20, clock_rate=2520000,
    memory_clock_rate=9001000, memory_bus_width=384, gcnArchName="", uuid="fake-sm89", is_integrated=0,
    is_multi_gpu_board=0)
# A100 SXM4 80GB (A100 datasheet: 108 SMs, 80 GB HBM2e, 40 MB L2; compute capability 8.0: bf16 tensor
# cores, no fp8; 164 KB shared memory per SM of which 163 KB per block, 2048 threads per SM)
A100 = DeviceProperties(
    name="NVIDIA A100-SXM4-80GB", major=8, minor=0, total_memory=80 * 2**30, multi_processor_count=108,
    warp_size=32, max_threads_per_multi_processor=2048, max_threads_per_block=1024,
    regs_per_multiprocessor=65536, shared_memory_per_block=48 * 1024, shared_memory_per_block_optin=163 * 1024,
    shared_memory_per_multiprocessor=164 * 1024, L2_cache_size=40 * 2**20, clock_rate=1410000,
    memory_clock_rate=1593000, memory_bus_width=5120, gcnArchName="", uuid="fake-sm80", is_integrated=0,
    is_multi_gpu_board=0)
DEVICES = {90: H100, 89: L40S, 80: A100}  # compute capability (10·major + minor) -> the GPU faked for it
CUDA_VERSION = "12.8"  # record #360's torch 2.10.0+cu128: what inductor reads as torch.version.cuda

# Inductor steps that run or time code on the device, off for the cross-compile only:
DEVICE_EVALUATING_OPTIONS = {
    # folds constant subgraphs of the joint graph by executing them on the device (real tensors)
    "joint_graph_constant_folding": False,
    # pads matmul shapes only where a benchmark on the device says padding wins
    "shape_padding": False,
    # autotuning and coordinate descent time kernels on the device; the record sets none of them
    "max_autotune": False,
    "max_autotune_gemm": False,
    "coordinate_descent_tuning": False,
    # compile workers are forked from this process, so they inherit its fake device (a fresh
    # subprocess, inductor's default, would not)
    "worker_start_method": "fork",
}

PRELOAD_SOURCE = r"""
// Built by tools/fake_gpu.py and preloaded into the cross-compile's process: a CUDA device guard that
// does nothing (c10's FakeGuardImpl) and CUDA hooks reporting one device, in a CPU-only torch.
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/core/impl/FakeGuardImpl.h>
#include <ATen/detail/CUDAHooksInterface.h>

C10_REGISTER_GUARD_IMPL(CUDA, c10::impl::FakeGuardImpl<c10::DeviceType::CUDA>);

namespace at {
struct CUDAHooks : CUDAHooksInterface {
  explicit CUDAHooks(CUDAHooksArgs) {}
  bool hasCUDA() const override { return true; }
  bool isBuilt() const override { return true; }
  bool isAvailable() const override { return true; }
  bool hasPrimaryContext(c10::DeviceIndex) const override { return true; }
  void init() const override {}
  c10::DeviceIndex deviceCount() const override { return 1; }
  int getNumGPUs() const override { return 1; }
  c10::DeviceIndex current_device() const override { return 0; }
  c10::DeviceIndex getCurrentDevice() const override { return 0; }
  void setCurrentDevice(c10::DeviceIndex) const override {}
  c10::DeviceIndex exchangeDevice(c10::DeviceIndex) const override { return 0; }
  c10::DeviceIndex maybeExchangeDevice(c10::DeviceIndex) const override { return 0; }
};
REGISTER_CUDA_HOOKS(CUDAHooks);
}  // namespace at
"""


def _cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "speedrun"


def preload_library_path() -> Path:
    """Where the library for this torch and this source lives (built by `build_preload_library`)."""
    key = hashlib.sha256((torch.__version__ + PRELOAD_SOURCE).encode()).hexdigest()[:16]
    return _cache_dir() / f"fake_gpu_{key}.so"


def build_preload_library() -> Path:
    """The preload library, compiled with the C++ compiler (c++, or $CXX) on first use: a few seconds."""
    out = preload_library_path()
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    torch_dir = Path(torch.__file__).parent
    cxx = os.environ.get("CXX", "c++")
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        src, tmp_out = Path(tmp) / "fake_gpu.cpp", Path(tmp) / out.name
        src.write_text(PRELOAD_SOURCE)
        cmd = [cxx, "-std=c++17", "-O1", "-shared", "-fPIC",
               f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
               f"-I{torch_dir / 'include'}", str(src), f"-L{torch_dir / 'lib'}", "-lc10", "-ltorch_cpu",
               f"-Wl,-rpath,{torch_dir / 'lib'}", "-o", str(tmp_out)]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True)
        except FileNotFoundError as exc:
            raise RuntimeError(f"fake GPU: no C++ compiler ({cxx}); install g++ or set CXX") from exc
        if proc.returncode != 0:
            raise RuntimeError(f"fake GPU: building {out.name} failed:\n{' '.join(cmd)}\n{proc.stderr[-3000:]}")
        os.replace(tmp_out, out)  # atomic: a concurrent build never sees half a library
    return out


def preloaded() -> bool:
    """Whether this process runs with the preload library (torch's accelerator is then CUDA)."""
    return bool(os.environ.get(MARKER_ENV)) and torch._C._get_accelerator().type == "cuda"


def reexec_with_preload(argv: list[str]) -> None:
    """Replace this process with `python argv...` running with the preload library (never returns)."""
    library = build_preload_library()
    env = dict(os.environ)
    env[PRELOAD_ENV] = " ".join(p for p in (str(library), env.get(PRELOAD_ENV, "")) if p)
    env[MARKER_ENV] = str(library)
    env.pop("TRITON_INTERPRET", None)  # Triton must compile, not interpret
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *argv], env)


# ------------------------------------------------------------------------------------------------
# The Python side: torch.cuda, dynamo's device interface, Triton's driver, inductor's runtime imports


class KernelLedger:
    """Every Triton binary built in this process, in order: (kernel name, cubin bytes). Filled where
    inductor would make the kernel's launchers (which would load the cubin on the device). And the
    kernels none of whose configs fit the GPU's shared memory per block, recompiled with one pipeline
    stage as inductor would at their first launch: (kernel name, bytes the leanest config asked,
    bytes with one stage)."""

    def __init__(self):
        self.cubins: list[tuple[str, int]] = []
        self.unpipelined: list[tuple[str, int, int]] = []

    def mark(self) -> tuple[int, int]:
        return len(self.cubins), len(self.unpipelined)

    def since(self, mark: tuple[int, int]) -> list[tuple[str, int]]:
        return self.cubins[mark[0]:]

    def unpipelined_since(self, mark: tuple[int, int]) -> list[tuple[str, int, int]]:
        return self.unpipelined[mark[1]:]


LEDGER = KernelLedger()


def _cubin_bytes(kernel) -> int:
    """Size of a compiled Triton kernel's cubin, however inductor holds it (a Triton CompiledKernel or
    inductor's static launcher, which keeps the raw bytes or a path)."""
    asm = getattr(kernel, "asm", None)
    if asm is not None:
        return len(asm["cubin"])
    raw = getattr(kernel, "cubin_raw", None)
    if raw:
        return len(raw)
    path = getattr(kernel, "cubin_path", None)
    if path and os.path.exists(path):
        return os.path.getsize(path)
    raise RuntimeError(f"fake GPU: no cubin for {getattr(kernel, 'name', kernel)}")


def _shared_bytes(kernel) -> int:
    """Shared memory per block a compiled kernel asks for at launch (a Triton CompiledKernel's
    metadata, or inductor's static launcher's copy of it)."""
    shared = getattr(kernel, "shared", None)
    return shared if shared is not None else kernel.metadata.shared


class KernelCompileError(RuntimeError):
    """A Triton kernel inside a compiled graph that Triton could not compile for the faked GPU, or
    whose every config needs more shared memory than it has."""

    def __init__(self, kernel: str, cause: BaseException, sm: int | None = None, problem: str = "does not compile"):
        sm = sm if sm is not None else faked_sm()
        fused = kernel.split("_fused_", 1)[1].rsplit("_", 1)[0] if "_fused_" in kernel else ""
        what = f" (inductor's fusion of {fused})" if fused else ""
        message = str(cause).splitlines()[0] if str(cause) else ""
        super().__init__(f"Triton kernel {kernel}{what} {problem} for sm_{sm}: {type(cause).__name__}: {message}"
                         + (" (Triton's own message is on stderr)" if problem == "does not compile" else ""))
        self.kernel = kernel


def _fake_triton_driver(device: DeviceProperties):
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.driver import CudaDriver

    class FakeGPUDriver(CudaDriver):
        """Triton's CUDA driver with the faked GPU's target (sm_90, sm_89, sm_80), minus everything
        that talks to a device."""

        def __init__(self):  # no CudaUtils: it links the CUDA driver library
            self.utils = None
            self.launcher_cls = None

        def get_current_device(self):
            return 0

        def set_current_device(self, index):
            pass

        def get_current_stream(self, index=None):
            return 0

        def get_device_capability(self, index=0):
            return (device.major, device.minor)

        def get_current_target(self):
            return GPUTarget("cuda", 10 * device.major + device.minor, device.warp_size)

        @staticmethod
        def is_active():
            return True

        def get_benchmarker(self):
            def refuse(*args, **kwargs):
                raise RuntimeError("fake GPU: nothing can be timed on a faked device (an autotuning step ran)")
            return refuse

    return FakeGPUDriver()


_device: DeviceProperties | None = None  # the GPU `install` faked


def faked_sm() -> int:
    """The faked GPU's compute capability as 10·major + minor (90 before `install`)."""
    device = _device or H100
    return 10 * device.major + device.minor


def _check_shared_memory(autotuner, device: DeviceProperties) -> None:
    """What loading a kernel's configs checks first (Triton's `CompiledKernel._init_handles`): a config
    asking more shared memory per block than the GPU has cannot load; inductor drops it, and when
    none loads and the config is pipelined, recompiles it with one stage (`_make_launchers`). Any
    other outcome fails, as it would at the kernel's first launch."""
    import copy

    limit = device.shared_memory_per_block_optin
    if any(_shared_bytes(r.kernel) <= limit for r in autotuner.compile_results):
        return
    last = autotuner.compile_results[-1].config
    needs = min(_shared_bytes(r.kernel) for r in autotuner.compile_results)
    if (last.num_stages > 1 or last.kwargs.get("NUM_STAGES", 1) > 1) \
            and autotuner.inductor_meta.get("dynamic_disable_pipelining", True):
        # inductor's `compile_by_disabling_pipelining`, less the launcher: a kernel compiled in a
        # worker came back without its Python function (`prepare_for_pickle`), so it is reloaded first
        autotuner._ensure_kernel_loaded()
        single = copy.deepcopy(last)
        single.num_stages = 1
        if "NUM_STAGES" in single.kwargs:
            single.kwargs["NUM_STAGES"] = 1
        result = autotuner._precompile_config(single)
        autotuner.compile_results = [result]
        LEDGER.cubins.append((autotuner.fn.__name__, _cubin_bytes(result.kernel)))
        if _shared_bytes(result.kernel) <= limit:
            LEDGER.unpipelined.append((autotuner.fn.__name__, needs, _shared_bytes(result.kernel)))
            return
        needs = _shared_bytes(result.kernel)
    cause = RuntimeError(f"needs {needs} bytes of shared memory per block (its leanest config), the "
                         f"{device.name} has {limit}")
    raise KernelCompileError(autotuner.fn.__name__, cause, 10 * device.major + device.minor,
                             problem="does not fit")


_installed = False


def install(sm: int = 90, compile_workers: int = 1) -> None:
    """Make this process see one GPU of compute capability `sm` (`DEVICES`: 90 an H100, 89 an L40S,
    80 an A100; needs the preload library: see `reexec_with_preload`), with `compile_workers` forked
    processes compiling Triton kernels (1: in this process).
    For processes that only cross-compile: nothing is undone."""
    global _installed, _device
    if _installed:
        if 10 * _device.major + _device.minor != sm:
            raise RuntimeError(f"fake GPU: this process already fakes SM{faked_sm()}, not SM{sm}")
        return
    if sm not in DEVICES:
        raise ValueError(f"fake GPU: no GPU of compute capability {sm} to fake (known: "
                         f"{', '.join(map(str, sorted(DEVICES)))})")
    device = DEVICES[sm]
    if not preloaded():
        raise RuntimeError("fake GPU: the preload library is not loaded; run through tools.cross_compile "
                           "(it re-executes itself with LD_PRELOAD)")
    cuda = torch.cuda
    cuda.is_available = lambda: True
    cuda.is_initialized = lambda: True
    cuda._is_compiled = lambda: True
    cuda._lazy_init = lambda: None
    cuda.device_count = lambda: 1
    cuda.current_device = lambda: 0
    cuda.set_device = lambda device: None
    cuda._exchange_device = lambda device: 0
    cuda._maybe_exchange_device = lambda device: 0
    cuda.get_device_capability = lambda index=None: (device.major, device.minor)
    cuda.get_device_properties = lambda index=None: device
    cuda.get_device_name = lambda index=None: device.name
    cuda.is_bf16_supported = lambda *args, **kwargs: True
    cuda.get_rng_state = lambda device="cuda": torch.zeros(16, dtype=torch.uint8)  # dynamo saves and restores it
    cuda.set_rng_state = lambda *args, **kwargs: None
    torch.version.cuda = CUDA_VERSION
    torch._C._cuda_getCurrentRawStream = lambda device: 0  # imported by inductor's generated wrapper

    from torch._dynamo import device_interface as di
    cuda_interface = di.CudaInterface
    for name, fn in dict(is_available=lambda: True, device_count=lambda: 1, current_device=lambda: 0,
                         set_device=lambda device: None, exchange_device=lambda device: 0,
                         maybe_exchange_device=lambda device: 0,
                         get_compute_capability=lambda index=None: sm,
                         get_device_properties=lambda index=None: device,
                         is_bf16_supported=lambda including_emulation=False: True).items():
        setattr(cuda_interface, name, staticmethod(fn))
    cuda_interface.Worker.get_device_properties = staticmethod(lambda index=None: device)
    cuda_interface.Worker.current_device = staticmethod(lambda: 0)
    cuda_interface.Worker.set_device = staticmethod(lambda device: None)

    import triton.runtime
    driver = _fake_triton_driver(device)
    triton.runtime.driver.set_active(driver)
    triton.runtime.driver._default = driver

    import torch._inductor.config as inductor_config
    for name, value in DEVICE_EVALUATING_OPTIONS.items():
        setattr(inductor_config, name, value)
    inductor_config.compile_threads = compile_workers

    # Inductor traces its pattern-matcher replacements once, on example tensors of the graph's device,
    # for real (outside any fake mode, e.g. torch.tensor(2.0, device=...)); a CPU-only torch has no
    # CUDA kernels for that. The patterns are device-independent graphs (their checks read the
    # matched graph's tensors), so they are traced on the CPU.
    from torch._inductor.fx_passes import joint_graph
    trace_patterns = joint_graph.lazy_init
    joint_graph.lazy_init = lambda input_device=None, *args, **kwargs: trace_patterns(torch.device("cpu"), *args, **kwargs)

    # Dynamo fills its builtin-operator -> Tensor-method table the first time it traces a Python
    # operator it must look up (flex attention's mask_mod, `seg[q_idx] == seg[kv_idx]`, on SM89 and
    # SM80) by calling every operator on example tensors it makes then; inside the cross-compile's
    # FakeTensorMode those are fake and `operator.not_` asks for a value (DataDependentOutputException,
    # torch 2.13). Filled here, outside any fake mode, with real CPU tensors: the table maps Python
    # operators to Tensor methods, whatever the device.
    from torch._dynamo.variables import builtin
    builtin.populate_builtin_to_tensor_fn_map()

    # Where inductor would load each compiled kernel onto the device and build its launchers, record
    # the cubin and check its shared memory instead; the register-spill rescale needs the loaded
    # binary's counts (a device step).
    from torch._inductor.runtime import triton_heuristics

    def record_cubins(self):
        for result in self.compile_results:
            LEDGER.cubins.append((self.fn.__name__, _cubin_bytes(result.kernel)))
        _check_shared_memory(self, device)

    precompile_config = triton_heuristics.CachingAutotuner._precompile_config

    def name_the_kernel(self, cfg):
        try:
            return precompile_config(self, cfg)
        except Exception as exc:  # Triton's own error names only the compiler pass
            raise KernelCompileError(self.fn.__name__, exc) from exc

    triton_heuristics.CachingAutotuner._precompile_config = name_the_kernel
    triton_heuristics.CachingAutotuner._make_launchers = record_cubins
    triton_heuristics.CachingAutotuner._dynamic_scale_rblock = lambda self: None
    _device, _installed = device, True


class _DataOnTheCPU(torch.overrides.TorchFunctionMode):
    """torch.tensor / as_tensor with a CUDA device: made on the CPU, then moved (under a fake mode the
    move makes a fake CUDA tensor; the direct call would copy the data with CUDA's kernels, which a
    CPU-only torch lacks)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        device = kwargs.get("device")
        if func in (torch.tensor, torch.as_tensor) and device is not None and torch.device(device).type == "cuda":
            data = func(*args, **{**kwargs, "device": "cpu"})
            fake_mode = torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE)
            if fake_mode is not None:  # a real CPU constant would be moved for real
                data = fake_mode.from_tensor(data)
            return data.to(device)
        return func(*args, **kwargs)


@contextlib.contextmanager
def on_fake_cuda(index: int = 0):
    """Factory calls default to the faked CUDA device (use inside a FakeTensorMode)."""
    with _DataOnTheCPU(), torch.device("cuda", index):
        yield


# ------------------------------------------------------------------------------------------------
# FA3 stand-in: the hub build's varlen call as opaque custom ops with shape-only kernels


def _standin_ops():
    lib = "speedrun_fa3_standin"

    @torch.library.custom_op(f"{lib}::varlen_fwd", mutates_args=(), device_types="cuda")
    def varlen_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                   cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, softmax_scale: float,
                   causal: bool, window_left: int, window_right: int) -> tuple[torch.Tensor, torch.Tensor]:
        raise RuntimeError("the FA3 stand-in only compiles; it has no kernel")

    @varlen_fwd.register_fake
    def _(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
          window_left, window_right):
        T, H, _ = q.shape
        out = q.new_empty((T, H, v.shape[-1]))  # (T, H, d_v)
        lse = q.new_empty((H, T), dtype=torch.float32)  # FA3 varlen's softmax log-sum-exp layout
        return out, lse

    @torch.library.custom_op(f"{lib}::varlen_bwd", mutates_args=(), device_types="cuda")
    def varlen_bwd(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                   lse: torch.Tensor, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, max_seqlen_q: int,
                   max_seqlen_k: int, softmax_scale: float, causal: bool, window_left: int,
                   window_right: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        raise RuntimeError("the FA3 stand-in only compiles; it has no kernel")

    @varlen_bwd.register_fake
    def _(grad_out, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
          causal, window_left, window_right):
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)

    def setup_context(ctx, inputs, output):
        q, k, v, cu_q, cu_k, max_q, max_k, scale, causal, left, right = inputs
        out, lse = output
        ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k)
        ctx.args = (max_q, max_k, scale, causal, left, right)

    def backward(ctx, grad_out, grad_lse):
        q, k, v, out, lse, cu_q, cu_k = ctx.saved_tensors
        dq, dk, dv = varlen_bwd(grad_out, q, k, v, out, lse, cu_q, cu_k, *ctx.args)
        return dq, dk, dv, None, None, None, None, None, None, None, None

    varlen_fwd.register_autograd(backward, setup_context=setup_context)
    return varlen_fwd


class _FA3StandIn:
    """Looks like the hub build's `flash_attn_interface` to perf/attention_backends.py."""

    def __init__(self):
        self._fwd = _standin_ops()

    def flash_attn_varlen_func(self, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                               softmax_scale=None, causal=False, window_size=(-1, -1)):
        scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
        out, _ = self._fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, causal,
                           window_size[0], window_size[1])
        return out


_standin = None


def fa3_standin() -> _FA3StandIn:
    global _standin
    if _standin is None:
        _standin = _FA3StandIn()
    return _standin
