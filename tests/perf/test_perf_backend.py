"""The backend switch: hardware defaults, env overrides, the record's refusal message."""
from pathlib import Path

import pytest
import torch

from perf import backend as be


def _is_fast_path(b: be.Backend) -> bool:
    """The record's fast path: CUDA, Triton, fp8 GEMMs, FA3, torch.compile and CUDA graphs."""
    return b.device == "cuda" and b.triton and b.fp8 and b.attention == "fa3" and b.compile and b.cuda_graphs


def test_cpu_defaults_are_the_portable_path():
    b = be.detect(env={}, device="cpu")
    assert (b.triton, b.fp8, b.attention, b.compile) == (False, True, "sdpa", False)
    assert not _is_fast_path(b)


def test_triton_on_cpu_is_opt_in_and_needs_the_interpreter():
    assert not be.detect(env={"TRITON_INTERPRET": "1"}, device="cpu").triton
    assert be.detect(env={"TRITON_INTERPRET": "1", "SPEEDRUN_TRITON": "1"}, device="cpu").triton
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        be.detect(env={"SPEEDRUN_TRITON": "1"}, device="cpu")


def test_env_overrides_and_bad_values():
    b = be.detect(env={"SPEEDRUN_CUDA_GRAPHS": "1", "SPEEDRUN_ATTENTION": "flex"}, device="cpu")
    assert (b.cuda_graphs, b.attention, b.fp8) == (True, "flex", True)  # fp8 GEMMs run on a CPU
    with pytest.raises(ValueError, match="SPEEDRUN_COMPILE=yes: must be 0 or 1"):
        be.detect(env={"SPEEDRUN_COMPILE": "yes"}, device="cpu")


def test_fp8_has_one_switch_and_the_old_variable_says_where_it_is():
    """features.fp8 is the switch (config.py); the backend only reads whether the device runs fp8 GEMMs."""
    assert "SPEEDRUN_FP8" not in be.BACKEND_VARIABLES
    assert be.detect(env={"SPEEDRUN_FP8": "0"}, device="cpu").fp8  # not read: config_check refuses it instead
    [problem] = be.unknown_variables({"SPEEDRUN_FP8": "0"})
    assert problem.startswith("SPEEDRUN_FP8=0: unknown variable, nothing reads it; fp8 has one switch, the recipe's: "
                              "--set features.fp8=false")
    with pytest.raises(ValueError, match="SPEEDRUN_ATTENTION"):
        be.detect(env={"SPEEDRUN_ATTENTION": "xformers"}, device="cpu")


def test_record_refuses_anything_but_the_fast_path():
    with pytest.raises(RuntimeError) as err:
        be.require_fast_path(be.detect(env={}, device="cpu"))
    msg = str(err.value)
    assert "a CUDA device" in msg and "FA3 attention (SPEEDRUN_ATTENTION=sdpa)" in msg and "--config smoke" in msg
    fast = be.Backend(device="cuda", sm=90, triton=True, fp8=True, attention="fa3", compile=True, cuda_graphs=True)
    be.require_fast_path(fast)  # no error
    with pytest.raises(RuntimeError, match=r"an SM90 GPU \(H100/H200; found SM80\)"):
        be.require_fast_path(be.Backend(device="cuda", sm=80, triton=True, fp8=True, attention="fa3", compile=True,
                                        cuda_graphs=True))
    with pytest.raises(RuntimeError, match=r"CUDA graphs \(SPEEDRUN_CUDA_GRAPHS=0\)"):
        be.require_fast_path(be.Backend(device="cuda", sm=90, triton=True, fp8=True, attention="fa3", compile=True))


def test_cuda_graphs_default_on_cuda_only_and_switchable():
    assert be.detect(env={}, device="cpu").cuda_graphs is False
    assert be.detect(env={"SPEEDRUN_CUDA_GRAPHS": "1"}, device="cpu").cuda_graphs is True  # the CPU twin
    with pytest.raises(ValueError, match="SPEEDRUN_CUDA_GRAPHS=on: must be 0 or 1"):
        be.detect(env={"SPEEDRUN_CUDA_GRAPHS": "on"}, device="cpu")


def test_use_backend_restores():
    before = be.current()
    with be.use_backend(triton=not before.triton) as b:
        assert be.current() is b and b.triton != before.triton
    assert be.current() == before


def test_compile_backend_sync_check_and_host_checks():
    cpu = be.detect(env={}, device="cpu")
    assert (cpu.compile_backend, cpu.sync_check, cpu.host_checks) == ("inductor", False, True)
    checked = be.detect(env={"SPEEDRUN_SYNC_CHECK": "1", "SPEEDRUN_COMPILE": "1",
                             "SPEEDRUN_COMPILE_BACKEND": "aot_eager"}, device="cpu")
    # the sync check runs the CPU "as on GPU": no host value checks
    assert (checked.compile, checked.compile_backend, checked.sync_check, checked.host_checks) == \
        (True, "aot_eager", True, False)
    assert be.detect(env={"SPEEDRUN_HOST_CHECKS": "0"}, device="cpu").host_checks is False
    with pytest.raises(ValueError, match="SPEEDRUN_COMPILE_BACKEND=cudagraphs: must be one of"):
        be.detect(env={"SPEEDRUN_COMPILE_BACKEND": "cudagraphs"}, device="cpu")
    fast = be.Backend(device="cuda", sm=90, triton=True, fp8=True, attention="fa3", compile=True,
                      compile_backend="aot_eager", cuda_graphs=True)
    with pytest.raises(RuntimeError, match=r"inductor \(SPEEDRUN_COMPILE_BACKEND=aot_eager\)"):
        be.require_fast_path(fast)


def test_host_checks_follow_the_switch_and_never_run_inside_compile():
    with be.use_backend(host_checks=True):
        assert be.host_checks()
        seen = []
        torch.compile(lambda x: seen.append(be.host_checks()) or x + 1, backend="eager", fullgraph=True)(torch.ones(1))
        assert seen == [False]
    with be.use_backend(host_checks=False):
        assert not be.host_checks()
    torch._dynamo.reset()


def test_every_bad_variable_is_reported_at_once_and_typos_are_named():
    from config import ConfigError

    with pytest.raises(ConfigError) as err:
        be.detect(env={"SPEEDRUN_COMPILE": "2", "SPEEDRUN_ATTENTION": "flash", "SPEEDRUN_ROW_PREFETCH": "true"}, device="cpu")
    assert [p.split(":")[0] for p in err.value.problems] == [
        "SPEEDRUN_ATTENTION=flash", "SPEEDRUN_COMPILE=2", "SPEEDRUN_ROW_PREFETCH=true"]
    assert be.unknown_variables({"SPEEDRUN_CUDAGRAPHS": "1", "SPEEDRUN_FA3_DIR": "/x", "OTHER": "1"}) == [
        "SPEEDRUN_CUDAGRAPHS=1: unknown variable, nothing reads it; did you mean SPEEDRUN_CUDA_GRAPHS?"]
    # docs/execution_paths.md's switch table names every variable the backend reads
    readme = (Path(__file__).resolve().parents[2] / "docs" / "execution_paths.md").read_text()
    assert [name for name in be.BACKEND_VARIABLES if name not in readme] == []
