"""The cross-compile (tools/cross_compile.py, tools/fake_gpu.py): what an H100, an L40S / RTX 4090 or an
A100 compiles, built on a CPU.

The slow tests run `python -m tools.cross_compile` in a subprocess (it re-executes itself with the fake
device's preloaded library): one smoke training geometry forward and backward for SM90 with Triton,
fp8, the fused QKV path and the FA3 stand-in; two single-GEMM graphs that pin the `_scaled_mm`
scale-view failure inductor met before fp8 GEMMs became an opaque op; and for an L40S (SM89) flex
attention, its fallback for FA3, at the recipe's head widths in a training and a validation graph,
and the fp8 MLP kernel recompiled with one pipeline stage (its record tile is over the L40S's shared
memory per block). The fast tests check the graph plan, the backend each faked GPU gets, the command
line, the report parsing and the FA3 start-up check (on the CPU, with fake tensors).

Run: pytest tests/tools/test_tools_cross_compile.py -q   (the slow ones: about 5 minutes on 2 cores; in the
whole suite the file is among the first handed to a worker: conftest's LONGEST_FILES_FIRST)
"""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from config import RUN_PRESETS, ConfigError
from perf import attention_backends as ab
from perf.backend import detect
from tests import long_runs
from tools.cross_compile import GraphReport, GraphSpec, count_wrapper, failing_op, plan_graphs

REPO_ROOT = Path(__file__).resolve().parents[2]
CASES = "tests/tools/cross_compile_cases.py"
# the model's Triton kernels, forward and backward (the optimizer's run outside the model's graphs)
MODEL_KERNELS = {"_up_relu2_fp8_kernel", "_dpre_fp8_kernel", "_quantize_dual_kernel", "_qk_norm_rope_kernel",
                 "_qkv_rope_backward_kernel", "_ngram_forward_kernel", "_ngram_backward_kernel",
                 "_gather_rows_kernel", "_scatter_add_rows_kernel", "_softcapped_ce_kernel",
                 "_softcapped_ce_grad_e5m2_kernel"}


def _cross_compile(*args, timeout=1500):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-m", "tools.cross_compile", *args], cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)
    return proc.returncode, proc.stdout, proc.stderr


# The slowest of these tests (about 3 min alone): one smoke training geometry cross-compiled for SM90 with one
# compile process (tests/long_runs.py). (With `--proposal doc_copy` the same geometry compiles too, the matcher's
# sort an extern call: 187 s alone on this machine, 2026-12-04, against 105 s; in CI the matcher and the copy
# vector compile as functions, test_the_doc_copy_matcher_compiles_for_sm90_with_its_sort_and_scatters.)
CROSS_COMPILE_SMOKE_ARGS = ("--config", "smoke", "--steps", "0", "--no-validation", "--jobs", "1")
long_runs.register("smoke_cross_compile",
                   lambda folder: [[sys.executable, "-m", "tools.cross_compile", *CROSS_COMPILE_SMOKE_ARGS]],
                   env={"TRITON_INTERPRET": None})  # Triton must compile


# The SM90 function cases in one process (tests/long_runs.py): one start-up of the faked GPU and torch, one
# cold cache whose common kernels build once (CI time: three processes before, 2026-12-06). It exits 1: the
# scale-view case must fail, naming its op; every other row must pass.
SM90_FUNCTIONS = ("raw_scaled_mm_slot_view", "mlp_scaled_mm_slot_view", "doc_copy_matcher_and_copy_vector",
                  "cplm_head_and_mixture_loss", "restricted_attention_paired")
long_runs.register("sm90_functions",
                   lambda folder: [[sys.executable, "-m", "tools.cross_compile",
                                    *(f"--function={CASES}:{name}" for name in SM90_FUNCTIONS)]],
                   env={"TRITON_INTERPRET": None})


def _sm90_function(name: str) -> tuple[str, str, list[str]]:
    """(stdout, stderr, table row) of the case `name` in the shared SM90 run, which must have run to its
    end (exit 1: the one case meant to fail)."""
    code, out, err, _ = long_runs.result("sm90_functions")
    assert code == 1 and "FAILED function raw_scaled_mm_slot_view" in err, out[-3000:] + err[-3000:]
    return out, err, _row(out, f"function {name}")


def _row(stdout: str, name: str) -> list[str]:
    """The table row of the graph whose name starts with `name`: [seconds, inductor, project, cubins,
    extern], or [seconds, 'FAILED: ...'] for a graph that failed."""
    lines = [line for line in stdout.splitlines() if line.startswith(name)]
    assert lines, stdout[-3000:]
    row = lines[-1]
    if "FAILED: " in row:
        return [row.split("FAILED: ")[0].split()[-1], "FAILED: " + row.split("FAILED: ", 1)[1]]
    return row.split()[-5:]


def test_plan_has_one_graph_per_geometry_and_the_validations():
    smoke = plan_graphs(RUN_PRESETS["smoke"])
    assert [s.step for s in smoke if s.training] == [0, 17, 36, 52, 60, 64]  # each geometry's first step
    assert [s.windows for s in smoke if not s.training] == [(1, 3), (3, 7), (6, 20)]  # val_every=35 and final
    record = plan_graphs(RUN_PRESETS["record"])
    assert len([s for s in record if s.training]) == 6
    (final,) = [s for s in record if not s.training]  # record #360 validates at the end only
    assert final.canonical_mask and final.windows == (6, 20)
    # the recipe on fewer processes: each forward is one virtual rank's micro-batch, the record's shapes
    assert plan_graphs(RUN_PRESETS["recipe"]) == record
    (stage2,) = plan_graphs(RUN_PRESETS["record"], steps=[700, 690], validation=False)
    assert stage2.step == 681 and "T=49152" in stage2.name


@pytest.mark.parametrize("sm, fp8, attention", [(90, True, "fa3"), (89, True, "flex"), (80, False, "flex")])
def test_each_faked_gpu_compiles_the_backend_a_run_on_it_gets(monkeypatch, sm, fp8, attention):
    """The backend comes from `perf.backend.detect` on the faked device's capability, as a run's
    does: an L40S / RTX 4090 keeps fp8 and falls back to flex attention, an A100 loses fp8 too."""
    from tools.cross_compile import DEVICES_SM, describe_backend, target_backend
    from tools.fake_gpu import DEVICES

    assert set(DEVICES_SM) == set(DEVICES)  # --help's list is the faked GPUs'
    device = DEVICES[sm]
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (device.major, device.minor))
    backend = target_backend({})
    assert (backend.sm, backend.fp8, backend.attention, backend.triton) == (sm, fp8, attention, True)
    assert backend == detect({}, device="cuda")  # one function decides, for the run and the cross-compile
    assert f"fp8 {'on' if fp8 else 'off'}, attention {attention}" in describe_backend(backend)
    assert not target_backend({"SPEEDRUN_FUSED_QKV": "0"}).fused_qkv  # the run's switches apply
    with pytest.raises(ConfigError, match="SPEEDRUN_COMPILE"):  # eager graphs are not what is cross-compiled
        target_backend({"SPEEDRUN_COMPILE": "0"})


def test_command_line_names_the_faked_gpu_and_the_world_size(capsys):
    from tools.cross_compile import parse_args

    args = parse_args(["--config", "recipe", "--world-size", "1", "--sm", "89", "--steps", "0"])
    assert (args.sm, args.world_size, args.steps) == (89, 1, [0])
    assert parse_args(["--config", "recipe"]).world_size == 8  # default: one process per virtual rank
    assert parse_args([]).sm == 90
    for argv, message in ((["--sm", "75"], "argument --sm: invalid choice: 75 (choose from 90, 89, 80)"),
                          (["--config", "recipe", "--world-size", "3"],
                           "--world-size 3: --config recipe runs on 1, 2, 4, 8 processes")):
        with pytest.raises(SystemExit):
            parse_args(argv)
        assert message in capsys.readouterr().err


def test_report_reads_the_wrapper_and_names_the_failing_op():
    wrapper = ("triton_poi_fused_0 = async_compile.triton('triton_poi_fused_0', '''...''')\n"
               "_up_relu2_fp8_kernel = async_compile.triton('_up_relu2_fp8_kernel', '''...''')\n"
               "extern_kernels.mm(buf0, buf1, out=buf2)\n"
               "buf3 = torch.ops.speedrun.scaled_mm.default(buf2, buf1, s0, s1, torch.bfloat16, True)\n")
    report = GraphReport(GraphSpec("g", True, 0, (1, 3)))
    count_wrapper([wrapper, wrapper], report)
    assert (report.inductor_kernels, report.project_kernels, report.extern_calls) == (2, 2, 4)
    assert report.project_names == ("_up_relu2_fp8_kernel",)
    lowering = RuntimeError("LoweringException: AssertionError: \n  target: aten._scaled_mm.default\n  args[0]: ...")
    assert failing_op(lowering) == "aten._scaled_mm.default"
    wrapped = RuntimeError("outer")
    wrapped.__cause__ = lowering
    assert failing_op(wrapped) == "aten._scaled_mm.default"
    assert failing_op(ValueError("no op here")) == "ValueError"
    from tools.fake_gpu import KernelCompileError
    kernel = KernelCompileError("triton_poi_fused__to_copy_clamp_124", RuntimeError("PassManager::run failed"))
    assert "inductor's fusion of _to_copy_clamp" in str(kernel)
    assert failing_op(RuntimeError(f"InductorError: {kernel}")) == "Triton kernel triton_poi_fused__to_copy_clamp_124"


def test_fa3_check_passes_ops_with_fake_kernels_and_names_those_without():
    from tools.fake_gpu import fa3_standin

    ab.check_fa3_compilable(fa3_standin(), device="cpu")  # forward and backward trace

    @torch.library.custom_op("speedrun_test::varlen_no_fake", mutates_args=())
    def varlen_no_fake(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return torch.empty_like(v)

    class Interface:  # an FA3 build whose op has no fake kernel
        @staticmethod
        def flash_attn_varlen_func(q, k, v, **kwargs):
            return varlen_no_fake(q, k, v)

    with pytest.raises(RuntimeError, match="does not trace on fake tensors.*fake \\(meta\\) kernels"):
        ab.check_fa3_compilable(Interface(), device="cpu")


@pytest.mark.slow
def test_a_scaled_mm_scale_view_fails_naming_the_op_and_the_opaque_gemm_compiles():
    out, err, row = _sm90_function("raw_scaled_mm_slot_view")
    assert row[1].startswith("FAILED: aten._scaled_mm.default")
    assert "FAILED function raw_scaled_mm_slot_view: aten._scaled_mm.default" in err
    assert err.count("FAILED function ") == 1, err[-3000:]   # the only case that fails
    seconds, inductor, project, cubins, extern = _row(out, "function mlp_scaled_mm_slot_view")
    assert int(cubins) >= 1 and int(extern) == 1, out  # the quantized operands' kernel, one cuBLASLt call
    assert "torch.ops.speedrun.scaled_mm.default" in out


@pytest.mark.slow
def test_a_smoke_training_geometry_compiles_for_sm90_forward_and_backward():
    """`python -m tools.cross_compile --config smoke --steps 0 --no-validation`."""
    code, out, err, _ = long_runs.result("smoke_cross_compile")
    assert code == 0, out[-3000:] + err[-3000:]
    seconds, inductor, project, cubins, extern = _row(out, "train step 0: T=512")
    assert int(inductor) > 100 and int(cubins) >= int(inductor) + int(project), out[-2000:]
    names = set(re.search(r"project kernels: (.*)", out).group(1).split(", "))
    assert MODEL_KERNELS <= names, MODEL_KERNELS - names  # every model kernel, forward and backward
    externs = re.search(r"extern calls: (.*)", out).group(1)
    for call in ("torch.ops.speedrun.scaled_mm.default", "torch.ops.speedrun_fa3_standin.varlen_fwd.default",
                 "torch.ops.speedrun_fa3_standin.varlen_bwd.default"):  # fp8 GEMMs; FA3 forward and backward
        assert call in externs, externs


@pytest.mark.slow
def test_the_doc_copy_matcher_compiles_for_sm90_with_its_sort_and_scatters():
    """DocCopy's matcher and copy vector (model/doc_copy.py) at a smoke batch, cross-compiled for SM90: the
    stable sort of the 10·T keys an extern call, the prefix scans, scatters and gathers inductor's kernels."""
    out, _, (seconds, inductor, project, cubins, extern) = _sm90_function("doc_copy_matcher_and_copy_vector")
    assert int(inductor) >= 3 and int(cubins) >= int(inductor), out[-2000:]
    assert "torch.ops.aten.sort.stable" in re.search(r"extern calls: (.*)", out).group(1)


@pytest.mark.slow
def test_cplm_compiles_for_sm90_with_its_pointer_kernels_and_the_gathering_ce():
    """CPLM's head and mixture loss (model/cplm.py, model/loss.py) at a smoke batch, forward and backward,
    cross-compiled for SM90: the pointer's three Triton kernels and the fp8 CE's two (the gathered z in
    and out) inside one graph pair."""
    out, _, (seconds, inductor, project, cubins, extern) = _sm90_function("cplm_head_and_mixture_loss")
    assert int(project) >= 5 and int(cubins) >= int(inductor) + int(project), out[-2000:]
    for kernel in ("_copy_pointer_fwd_kernel", "_copy_pointer_dq_kernel", "_copy_pointer_dk_kernel"):
        assert kernel in out, out[-2000:]

@pytest.mark.slow
def test_the_restricted_attention_backward_compiles_for_sm90_as_two_opaque_ops():
    """PR #371's mode 2 on the fa3 backend at the record's paired widths, forward and backward, cross-compiled
    for SM90: FA3's forward with its LSE and the restricted backward are the graph's two extern calls, as the
    hub FA3 is in the stock graphs (the extern line is the run's union: the other cases call neither op)."""
    out, _, (seconds, inductor, project, cubins, extern) = _sm90_function("restricted_attention_paired")
    assert int(extern) == 2 and int(cubins) >= int(inductor), out[-2000:]
    externs = re.search(r"extern calls: (.*)", out).group(1)
    assert {"torch.ops.speedrun.restricted_attention_fwd.default",
            "torch.ops.speedrun.restricted_attention_bwd.default"} <= set(externs.split(", ")), externs


@pytest.mark.slow
def test_an_l40s_compiles_flex_attention_and_the_fp8_mlp_with_one_pipeline_stage():
    """What an L40S / RTX 4090 gets: flex attention (its FA3 fallback) forward and backward at the
    recipe's head widths, tiles chosen for SM89 within its 99 KiB of shared memory per block, and in
    an inference graph (a validation forward, which failed to lower before the mask's segment ids
    became an opaque op); and the
    fp8 MLP kernel whose record tile does not fit, recompiled with one stage as inductor does at first
    launch (in the parent process, after a compile worker built it: --jobs 2)."""
    code, out, err = _cross_compile("--sm", "89", "--jobs", "2", *(f"--function={CASES}:{name}" for name in (
        "flex_attention_recipe_widths", "flex_attention_validation", "up_relu2_fp8_record_tile")))
    assert code == 0, out[-3000:] + err[-3000:]
    assert "NVIDIA L40S (SM89, sm_89 cubins); backend: fp8 on, attention flex" in out
    seconds, inductor, project, cubins, extern = _row(out, "function flex_attention_recipe_widths")
    assert int(inductor) >= 3 and int(cubins) >= int(inductor), out[-2000:]  # forward, backward, block mask
    seconds, inductor, project, cubins, extern = _row(out, "function flex_attention_validation")
    assert int(inductor) >= 2 and int(cubins) >= int(inductor), out[-2000:]  # forward, block mask
    seconds, inductor, project, cubins, extern = _row(out, "function up_relu2_fp8_record_tile")
    assert (int(project), int(cubins)) == (1, 2), out[-2000:]  # the 3-stage binary, then the 1-stage one
    assert re.search(r"recompiled with one pipeline stage.*: _up_relu2_fp8_kernel \(128 KiB, one stage 48 KiB\)", out)
