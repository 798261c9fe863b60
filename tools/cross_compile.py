"""What a GPU compiles, built on a CPU: every graph of a run cross-compiled for a faked H100, L40S or A100.

The faked GPU is an H100 (sm_90 cubins) by default; `--sm 89` fakes an L40S (an RTX 4090's
architecture: sm_89), `--sm 80` an A100 (sm_80).

    python -m tools.cross_compile --config smoke            # every training geometry and validation graph
    python -m tools.cross_compile --config record --steps 681 --no-validation   # one record geometry
    python -m tools.cross_compile --config recipe --world-size 1 --sm 89   # the one-GPU recipe on an L40S

A CPU-only torch with one faked GPU (tools/fake_gpu.py: the process re-executes itself with a small
preloaded library) compiles exactly what a run compiles: the backend `perf.backend.detect` picks for
that GPU (SM90: Triton, fp8, fused QKV, FA3 through a stand-in op with a shape-only kernel; SM89: the
same with flex attention for FA3; SM80: no fp8 either, so bf16 GEMMs and the unfused QKV), with the
environment's SPEEDRUN_* switches applied as a run applies them; the model built as `training.Run`
builds it for `--world-size` processes (fp8 weight caches where fp8 runs, the optimizer's
value-embedding gradient buffer), compiled through `perf/compile.py` unchanged (inductor, fullgraph,
static shapes). Each training geometry of the schedule (`StepSettings.geometry`) compiles forward
and backward, as its first step would; each validation forward compiles at the windows it will
see. A process playing several virtual ranks runs one rank's micro-batch per forward (T = the
step's tokens / the preset's virtual ranks), so its graphs are one rank's of the 8-process run.
Tensors are fake (shapes only), so the record's shapes cost no memory. Nothing runs: inductor
generates the CUDA wrapper and its Triton kernels, and Triton compiles every kernel, the project's
included, to a cubin for the GPU's architecture with its own ptxas.

It prints one row per graph: compile seconds, inductor's Triton kernels, the project's Triton
kernels, the cubins built, and the extern calls (cuBLAS GEMMs, `_scaled_mm`, FA3). A graph that fails
to lower is named with the op and inductor's error, and the command exits 1 once every graph was tried.

What this proves, and what only a GPU can: see docs/cross_compile.md.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import re
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

EXIT_FAILED = 1
EXIT_USAGE = 2
DEVICES_SM = (90, 89, 80)  # tools/fake_gpu.py DEVICES: the GPUs --sm fakes (kept here so --help needs no torch import)
TRACEBACK_ENV = "SPEEDRUN_CROSS_COMPILE_TRACEBACK"  # 1: print each failing graph's whole traceback
TEMP_CACHE_ENV = "SPEEDRUN_CROSS_COMPILE_TEMP_CACHE"  # the fresh cache folder this run made (removed at exit)


@dataclass(frozen=True)
class GraphSpec:
    """One compiled graph of a run: a training geometry (forward and backward) or a validation forward."""
    name: str
    training: bool
    step: int  # training: the geometry's first step; validation: -1 mid-run (windows YaRN-rescaled as the
    #   run's), total_steps for the final one (the extended long window, no YaRN: training.Run.set_windows)
    windows: tuple[int, int]
    canonical_mask: bool = False


def plan_graphs(cfg, steps: list[int] | None = None, backward: bool = True, validation: bool = True) -> list[GraphSpec]:
    """The graphs a run of `cfg` compiles, in the order the warmup meets them: one per training
    geometry (or only those of `steps`), then the validation forwards (the windows in force at each
    intermediate validation, then the final one, with record #92's mask when the preset has it)."""
    from optim.schedule import TrainingSchedule

    schedule = TrainingSchedule(cfg.schedule, cfg.features)
    n = schedule.total_steps
    specs, seen = [], set()
    wanted = None if steps is None else {schedule.settings(s).geometry for s in steps}
    for step in range(n):
        s = schedule.settings(step)
        if s.geometry in seen or (wanted is not None and s.geometry not in wanted):
            continue
        seen.add(s.geometry)
        if s.attention_mode == 1:  # PR #371's calibration steps run the uncompiled model (runtime/training.py)
            continue
        tokens = s.batch_tokens // cfg.virtual_world_size
        name = (f"train step {step}: T={tokens} P={s.softmax_p or 'full'} mtp={len(s.mtp_weights)} "
                f"prefix={'on' if s.prefix_weight else 'off'} windows={s.ws_short}/{s.ws_long}"
                + (" restricted attention backward" if s.attention_mode == 2 else ""))
        specs.append(GraphSpec(name + ("" if backward else " (forward only)"), True, step, (s.ws_short, s.ws_long)))
    if validation:
        val_windows = sorted({schedule.windows(max(k - 1, 0)) for k in range(0, n, cfg.val_every)}) \
            if cfg.val_every else []
        for windows in val_windows:
            specs.append(GraphSpec(f"validation windows={windows[0]}/{windows[1]}", False, -1, windows))
        final = schedule.final_windows()
        specs.append(GraphSpec(f"final validation windows={final[0]}/{final[1]}"
                               + (" canonical mask" if cfg.canonical_mask else ""), False, n, final, cfg.canonical_mask))
    return specs


# ------------------------------------------------------------------------------------------------
# What each compiled graph holds, read off inductor's generated wrapper


@dataclass
class GraphReport:
    spec: GraphSpec
    seconds: float = 0.0
    inductor_kernels: int = 0
    project_kernels: int = 0
    cubins: int = 0
    extern_calls: int = 0
    extern_names: tuple[str, ...] = ()
    project_names: tuple[str, ...] = ()
    # kernels none of whose configs fit the GPU's shared memory per block, recompiled with one pipeline
    # stage as inductor does at their first launch: "name (asked KiB, one stage KiB)"
    unpipelined: tuple[str, ...] = ()
    error: str | None = None  # "op: exception: first line"
    detail: str = ""  # the error's first lines (inductor's IR of the failing node)


TRITON_DEF = re.compile(r"async_compile\.triton\('(\w+)'")
EXTERN_CALL = re.compile(r"\b(extern_kernels\.\w+|torch\.ops\.\w+\.\w+(?:\.\w+)?)\(")


def count_wrapper(sources: list[str], report: GraphReport) -> None:
    """Kernels and extern calls of the wrappers inductor generated for one graph (forward, backward)."""
    names = [m for src in sources for m in TRITON_DEF.findall(src)]
    report.inductor_kernels = sum(name.startswith("triton_") for name in names)  # inductor names its own so
    report.project_kernels = len(names) - report.inductor_kernels  # user kernels keep their names
    report.project_names = tuple(sorted({name for name in names if not name.startswith("triton_")}))
    calls = [m for src in sources for m in EXTERN_CALL.findall(src)]
    report.extern_calls = len(calls)
    report.extern_names = tuple(sorted(set(calls)))


def failing_op(exc: BaseException) -> str:
    """The op inductor names in a lowering error ('target: aten._scaled_mm.default'), else the
    exception's type."""
    text = str(exc)
    match = re.search(r"target: ([\w.:]+)", text) or re.search(r"(Triton kernel \w+)", text)
    if match:
        return match.group(1)
    cause = exc.__cause__ or exc.__context__
    if cause is not None and cause is not exc:
        inner = failing_op(cause)
        if inner != type(cause).__name__:
            return inner
    return type(exc).__name__


def first_lines(exc: BaseException, n: int) -> str:
    lines = [line for line in str(exc).strip().splitlines() if line.strip()]
    return "\n".join(lines[:n])


# ------------------------------------------------------------------------------------------------
# Compiling one graph without running it


class WrapperCapture:
    """The wrapper source of every graph inductor turns into a module, in order."""

    def __init__(self):
        self.sources: list[str] = []

    def install(self) -> None:
        from torch._inductor.graph import GraphLowering

        original = GraphLowering._compile_to_module_lines
        capture = self

        def compile_to_module_lines(self, wrapper_code):
            capture.sources.append(wrapper_code.value)
            return original(self, wrapper_code)

        GraphLowering._compile_to_module_lines = compile_to_module_lines


def compile_without_running(compiled_module, args: tuple, contexts=()) -> None:
    """Compile `compiled_module(*args)` (a `torch.compile`d nn.Module) as its first call would:
    dynamo, AOT autograd (the backward lowered now, not at the first backward) and the module's own
    backend, and do not run it (dynamo's ahead-of-time path, what `OptimizedModule._aot_compile` does
    for one input)."""
    from torch._dynamo.aot_compile import aot_compile_fullgraph
    from torch._dynamo.eval_frame import innermost_backend

    ctx = compiled_module.dynamo_ctx
    with contextlib.ExitStack() as stack:
        for c in contexts:
            stack.enter_context(c)
        # dynamic: the module's own setting (compile_model: False). Left unset, dynamo would make the
        # dimensions that differ from the previous graph's symbolic, as a run never does.
        aot_compile_fullgraph(compiled_module._orig_mod.forward, (args, {}), hooks=ctx._hooks,
                              backend=innermost_backend(ctx.callback), dynamic=ctx._dynamic)


def load_case(ref: str):
    """`FILE.py:NAME` or `package.module:NAME`: a function returning (fn, args), called on the fake device."""
    import importlib
    import importlib.util

    where, _, name = ref.rpartition(":")
    if not where or not name:
        raise ValueError(f"--function {ref!r}: expected FILE.py:NAME or module:NAME")
    if where.endswith(".py"):
        if not os.path.isfile(where):
            raise ValueError(f"--function {ref!r}: no file {where}")
        module_name = "_cross_compile_case_" + Path(where).stem
        spec = importlib.util.spec_from_file_location(module_name, where)
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module  # dynamo finds a traced function's globals through its module
        spec.loader.exec_module(module)
    else:
        module = importlib.import_module(where)
    if not hasattr(module, name):
        raise ValueError(f"--function {ref!r}: {where} has no {name}")
    return getattr(module, name)


class FunctionModule(torch.nn.Module):
    """A case's function as the module torch.compile takes (at module level: dynamo's ahead-of-time
    path refuses to package a class defined in a local scope)."""

    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, *args):
        return self.fn(*args)


def cross_compile_cases(refs: list[str], progress=print) -> list[GraphReport]:
    """Cross-compile functions named `FILE.py:NAME` (each returns `(fn, args)` built on the fake
    device) with the record's compile settings: one graph each, forward and backward when an input
    requires grad. For unit checks of what inductor makes of one op."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from perf.backend import current, use_backend
    from perf.compile import compile_model
    from tools.fake_gpu import on_fake_cuda

    reports = []
    with FakeTensorMode(allow_non_fake_inputs=True), use_backend(**target_backend().__dict__):
        for i, ref in enumerate(refs):
            with on_fake_cuda():
                fn, args = load_case(ref)()
            spec = GraphSpec(f"function {ref.rpartition(':')[2]}", training=True, step=0, windows=(0, 0))
            progress(f"[{i + 1}/{len(refs)}] {spec.name} ...")
            report = _compile_one(spec, compile_model(FunctionModule(fn), current()), tuple(args), (), _capture())
            progress(f"    {format_row(report)}")
            reports.append(report)
    return reports


_CAPTURE: WrapperCapture | None = None


def _capture() -> WrapperCapture:
    global _CAPTURE
    if _CAPTURE is None:
        _CAPTURE = WrapperCapture()
        _CAPTURE.install()
    return _CAPTURE


def _compile_one(spec: GraphSpec, compiled, args: tuple, contexts, capture: WrapperCapture) -> GraphReport:
    from tools.fake_gpu import LEDGER

    report = GraphReport(spec)
    wrappers, ledger = len(capture.sources), LEDGER.mark()
    t0 = time.perf_counter()
    try:
        compile_without_running(compiled, args, contexts)
    except Exception as exc:  # report, keep going: every graph is tried
        if os.environ.get(TRACEBACK_ENV) == "1":
            import traceback
            traceback.print_exc()
        report.error = f"{failing_op(exc)}: {type(exc).__name__}: {first_lines(exc, 1)}"
        report.detail = first_lines(exc, 12)
    report.seconds = time.perf_counter() - t0
    count_wrapper(capture.sources[wrappers:], report)
    report.cubins = len(LEDGER.since(ledger))
    report.unpipelined = tuple(f"{name} ({asked // 1024} KiB, one stage {single // 1024} KiB)"
                               for name, asked, single in LEDGER.unpipelined_since(ledger))
    return report


def target_backend(env=os.environ):
    """The backend a run on the faked GPU gets (`perf.backend.detect` on it, with the environment's
    SPEEDRUN_* switches): on SM90 the record's fast path, on SM89 flex attention for FA3, on SM80 no
    fp8 either. It must compile with inductor: that is what is cross-compiled."""
    from config import ConfigError
    from perf.backend import detect

    backend = detect(env, device="cuda")
    if not backend.compile or backend.compile_backend != "inductor":
        raise ConfigError([f"tools.cross_compile compiles with inductor: unset SPEEDRUN_COMPILE and "
                           f"SPEEDRUN_COMPILE_BACKEND (found compile={int(backend.compile)}, "
                           f"backend {backend.compile_backend})"])
    return backend


def describe_backend(backend) -> str:
    """`fp8 on, attention fa3, Triton on, fused QKV on`: what decides which graphs a GPU compiles."""
    on = lambda flag: "on" if flag else "off"  # noqa: E731
    return (f"fp8 {on(backend.fp8)}, attention {backend.attention}, Triton {on(backend.triton)}, "
            f"fused QKV {on(backend.fused_qkv and backend.fp8)}")


# ------------------------------------------------------------------------------------------------
# A preset's graphs


def build_model(cfg, backend, world_size: int):
    """The model as `training.Run` builds it for rank 0 of `world_size` processes, on the fake CUDA
    device: fp8 caches refreshed where the backend runs fp8, the optimizer's value-embedding gradient
    buffer attached (the warmup compiles before the prefix table is set; a buffer's values do not
    change the graph)."""
    from model.gpt import GPT
    from optim.adam import run_param_table
    from optim.manager import OptimizerManager
    from optim.schedule import TrainingSchedule
    from tools.fake_gpu import on_fake_cuda

    schedule = TrainingSchedule(cfg.schedule, cfg.features)
    with on_fake_cuda():
        model = GPT(cfg.model, fp8=backend.fp8, features=cfg.features, block_size=cfg.schedule.block_size)
        manager = OptimizerManager(model.named_parameters(), schedule, cfg.optim, table=run_param_table(cfg.features),
                                   layout=(0, world_size), absent=model.switched_off_parameters,
                                   local_ranks=cfg.virtual_world_size // world_size)
        if cfg.features.value_embeds:
            model.value_embed_grad_buffer = manager.cycle_gradient("value_embeds")
        model.refresh_fp8()
    return model, schedule


def graph_inputs(cfg, schedule, spec: GraphSpec) -> tuple:
    """The forward's arguments for one graph, shaped as the run passes them (fake tensors)."""
    from data.loader import cu_seqlens_rows
    from model.gpt import StepArgs

    dev, D = "cuda:0", cfg.model.model_dim
    if spec.training:
        s = schedule.settings(spec.step)
        T = s.batch_tokens // cfg.virtual_world_size
        # StepWeights passes a view of a [K_max] buffer, but dynamo (torch 2.13) cannot take a view of
        # a tensor of another fake mode as an input ("needs to be a FakeTensor wrapped by this instance
        # of Dynamo"): graph inputs here are whole tensors of the same shape, dtype and device
        mtp = torch.zeros(len(s.mtp_weights), dtype=torch.float32, device=dev)
        prefix = torch.zeros((), dtype=torch.float32, device=dev) if s.prefix_weight else None
        candidates = torch.zeros(s.softmax_p, dtype=torch.int64, device=dev) if s.softmax_p else None
        head_sample = None
        if s.head_sample:  # PR #371: the counter a run keeps per rank (training.Run), rank 0's
            from perf.sampled_head_grad import HeadSample
            head_sample = HeadSample(0, cfg.virtual_world_size, dev)
        calibration = None
        if s.attention_mode:  # PR #371 part 2: the head tables a run keeps (training.Run), all full
            from model.attention_calibration import CalibrationState, eligible_layers
            calibration = CalibrationState(eligible_layers(cfg.model.num_heads), device=dev)
        args = StepArgs(ws_short=s.ws_short, ws_long=s.ws_long, mtp_weights=mtp,
                        prefix_weight=prefix, candidates=candidates, training=True,
                        max_seq_len=schedule.max_seq_len(spec.step), head_sample=head_sample,
                        attention_mode=s.attention_mode, attention_calibration=calibration)
        rows = torch.zeros(2 * T, D, dtype=torch.bfloat16, device=dev, requires_grad=True)  # the sink leaf
    else:
        T = cfg.val_batch_tokens // cfg.virtual_world_size
        V = cfg.model.vocab_size
        mask = torch.zeros((V, (V + 7) // 8), dtype=torch.uint8, device=dev) if spec.canonical_mask else None
        args = StepArgs(ws_short=spec.windows[0], ws_long=spec.windows[1], training=False, max_seq_len=T,
                        canonical_mask=mask)
        rows = torch.zeros(2 * T, D, dtype=torch.bfloat16, device=dev)
    inputs = torch.zeros(T, dtype=torch.int32, device=dev)
    targets = torch.zeros(T, dtype=torch.int64, device=dev)
    cu_seqlens = torch.zeros(cu_seqlens_rows(T), dtype=torch.int32, device=dev)
    sign_rows = torch.zeros(2 * T, dtype=torch.int32, device=dev)
    return inputs, targets, cu_seqlens, rows, sign_rows, args


def cross_compile_preset(cfg, specs: list[GraphSpec], backward: bool = True, progress=print,
                         world_size: int | None = None) -> list[GraphReport]:
    """Cross-compile `specs` of `cfg` for rank 0 of `world_size` processes (default: one per virtual
    rank) with the faked GPU's backend (`target_backend`)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from perf import attention_backends
    from perf.backend import current, use_backend
    from perf.compile import compile_model
    from tools.fake_gpu import fa3_standin

    capture = _capture()
    backend = target_backend()
    if backend.attention == "fa3":
        attention_backends._fa3_interface = fa3_standin()  # the hub binary cannot load on a CPU
    reports = []
    with FakeTensorMode(allow_non_fake_inputs=True), use_backend(**backend.__dict__):
        model, schedule = build_model(cfg, backend, world_size or cfg.virtual_world_size)
        compiled = compile_model(model, current())
        windows = schedule.windows(0)
        for i, spec in enumerate(specs):
            if spec.windows != windows and spec.step < schedule.total_steps:  # the run's YaRN rescale
                model.rescale_rotary(windows, spec.windows)
                windows = spec.windows
            args = graph_inputs(cfg, schedule, spec)
            contexts = [] if spec.training and backward else [torch.no_grad()]
            progress(f"[{i + 1}/{len(specs)}] {spec.name} ...")
            report = _compile_one(spec, compiled, args, contexts, capture)
            progress(f"    {format_row(report)}")
            reports.append(report)
    return reports


HEADER = f"{'graph':<72} {'seconds':>8} {'inductor':>8} {'project':>8} {'cubins':>7} {'extern':>7}"


def format_row(r: GraphReport) -> str:
    if r.error:
        return f"{r.spec.name:<72} {r.seconds:>8.1f}  FAILED: {r.error}"
    return (f"{r.spec.name:<72} {r.seconds:>8.1f} {r.inductor_kernels:>8} {r.project_kernels:>8} "
            f"{r.cubins:>7} {r.extern_calls:>7}")


def format_table(reports: list[GraphReport], total_seconds: float) -> str:
    lines = [HEADER, *(format_row(r) for r in reports)]
    ok = [r for r in reports if not r.error]
    lines.append(f"{'total':<72} {total_seconds:>8.1f} {sum(r.inductor_kernels for r in ok):>8} "
                 f"{sum(r.project_kernels for r in ok):>8} {sum(r.cubins for r in ok):>7} "
                 f"{sum(r.extern_calls for r in ok):>7}")
    for label, field in (("project kernels", "project_names"), ("extern calls", "extern_names"),
                         ("recompiled with one pipeline stage, every config over the GPU's shared memory "
                          "per block", "unpipelined")):
        names = sorted({name for r in ok for name in getattr(r, field)})
        if names:
            lines.append(f"{label}: " + ", ".join(names))
    return "\n".join(lines)


def parse_args(argv):
    from cli import add_proposal_argument, preset_run_config
    from config import RUN_PRESETS

    p = argparse.ArgumentParser(prog="python -m tools.cross_compile", description=__doc__.split("\n")[0])
    p.add_argument("--config", choices=sorted(RUN_PRESETS), default="smoke", help="the preset whose graphs compile")
    p.add_argument("--sm", type=int, default=90, choices=sorted(DEVICES_SM, reverse=True),
                   help="the GPU to fake: 90 an H100 (default), 89 an L40S or RTX 4090 (fp8, no FA3), "
                        "80 an A100 (no fp8, no FA3)")
    p.add_argument("--world-size", type=int, default=None,
                   help="processes of the run (default: one per virtual rank of the preset); rank 0's "
                        "graphs compile")
    p.add_argument("--steps", default=None,
                   help="comma-separated training steps: compile only their geometries (default: every geometry)")
    p.add_argument("--no-backward", action="store_true", help="training graphs forward only")
    p.add_argument("--no-validation", action="store_true", help="skip the validation forwards")
    p.add_argument("--function", action="append", default=[], metavar="FILE.py:NAME",
                   help="cross-compile this function instead of the preset's graphs (it returns (fn, args); "
                        "repeatable)")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1,
                   help="processes compiling Triton kernels (default: one per core)")
    p.add_argument("--keep-cache", action="store_true",
                   help="reuse inductor's and Triton's caches (default: fresh, so every kernel is built)")
    add_proposal_argument(p)
    args = p.parse_args(argv)
    if args.jobs < 1:
        p.error(f"--jobs {args.jobs}: expected at least 1")
    cfg = args.run_config = preset_run_config(args.config, [], args.proposal)
    if args.world_size is None:
        args.world_size = cfg.virtual_world_size
    elif args.world_size not in cfg.allowed_world_sizes:
        p.error(f"--world-size {args.world_size}: --config {args.config} runs on "
                f"{', '.join(map(str, cfg.allowed_world_sizes))} processes")
    if args.steps is not None:
        from optim.schedule import TrainingSchedule

        try:
            args.steps = [int(s) for s in args.steps.split(",") if s.strip()]
        except ValueError:
            p.error(f"--steps {args.steps!r}: expected comma-separated step numbers")
        total = TrainingSchedule(cfg.schedule, cfg.features).total_steps
        outside = [s for s in args.steps if not 0 <= s < total]
        if outside or not args.steps:
            p.error(f"--steps {outside or args.steps}: the {args.config} schedule has steps 0..{total - 1}")
    return args


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    from tools import fake_gpu

    if not fake_gpu.preloaded():
        if not args.keep_cache and "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
            cache = tempfile.mkdtemp(prefix="speedrun_cross_compile_")  # cold: every kernel is built
            os.environ.update({"TORCHINDUCTOR_CACHE_DIR": cache, "TRITON_CACHE_DIR": os.path.join(cache, "triton"),
                               TEMP_CACHE_ENV: cache})
        fake_gpu.reexec_with_preload(["-m", "tools.cross_compile", *argv])
    fake_gpu.install(args.sm, compile_workers=args.jobs)
    try:
        return _run(args)
    finally:
        from torch._inductor.async_compile import shutdown_compile_workers

        shutdown_compile_workers()  # before the cache goes: a worker may still be compiling into it
        if os.environ.get(TEMP_CACHE_ENV):
            shutil.rmtree(os.environ[TEMP_CACHE_ENV], ignore_errors=True)


def _run(args) -> int:
    from config import ConfigError
    from tools.fake_gpu import DEVICES

    t0 = time.perf_counter()
    try:
        backend = target_backend()
    except ConfigError as exc:
        print(f"tools.cross_compile: {exc}", file=sys.stderr)
        return EXIT_USAGE
    device = f"one faked {DEVICES[args.sm].name} (SM{args.sm}, sm_{args.sm} cubins); backend: {describe_backend(backend)}"
    if args.function:
        print(f"cross-compiling {len(args.function)} function(s) for {device}", flush=True)
        reports = cross_compile_cases(args.function, progress=lambda line: print(line, flush=True))
        return _finish(reports, time.perf_counter() - t0)
    cfg = args.run_config
    specs = plan_graphs(cfg, args.steps, backward=not args.no_backward, validation=not args.no_validation)
    print(f"cross-compiling {len(specs)} graph(s) of --config {cfg.name}"
          + (f" --proposal {cfg.proposal}" if cfg.proposal else "") + f" --world-size {args.world_size} "
          f"(rank 0 plays {cfg.virtual_world_size // args.world_size} of {cfg.virtual_world_size} virtual ranks) "
          f"for {device} (inductor cache {os.environ.get('TORCHINDUCTOR_CACHE_DIR', 'default')})", flush=True)
    reports = cross_compile_preset(cfg, specs, backward=not args.no_backward,
                                   progress=lambda line: print(line, flush=True), world_size=args.world_size)
    return _finish(reports, time.perf_counter() - t0)


def _finish(reports: list[GraphReport], seconds: float) -> int:
    print(format_table(reports, seconds), flush=True)
    failed = [r for r in reports if r.error]
    for r in failed:
        print(f"FAILED {r.spec.name}: {r.error}\n{r.detail}", file=sys.stderr)
    return EXIT_FAILED if failed else 0


if __name__ == "__main__":
    sys.exit(main())
