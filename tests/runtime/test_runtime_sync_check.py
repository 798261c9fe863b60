"""runtime/sync_check.py: what the CPU check flags (each kind of host sync a GPU would wait on), that it
names the project line, that host_side() lets host work through, and that it sees compiled graphs."""
import pytest
import torch

from runtime import sync_check as sync_check_module
from runtime.sync_check import HostSyncError, host_side, sync_check


def _raises(fn, what: str):
    with pytest.raises(HostSyncError) as err:
        with sync_check("cpu"):
            fn()
    assert what in str(err.value), str(err.value)
    return str(err.value)


@pytest.mark.parametrize("name, fn, what", [
    ("item", lambda t: t.sum().item(), "_local_scalar_dense"),
    ("int", lambda t: int(t.max()), "_local_scalar_dense"),
    ("bool-if", lambda t: bool((t > 0).any()), "_local_scalar_dense"),
    ("float", lambda t: float(t[0]), "_local_scalar_dense"),
    ("nonzero", lambda t: (t > 0).nonzero(), "nonzero"),
    ("unique", lambda t: torch.unique(t), "torch.unique"),
    ("masked_select", lambda t: t.masked_select(t > 0), "masked_select"),
    ("bool mask index", lambda t: t[t > 0], "boolean-mask indexing"),
    ("bool mask assign", lambda t: t.__setitem__(t > 0, 0.0), "boolean-mask indexing"),
    ("repeat_interleave", lambda t: torch.repeat_interleave(torch.tensor([1, 2])), "repeat_interleave"),
    ("equal", lambda t: torch.equal(t, t), "torch.equal"),
])
def test_each_kind_of_sync_is_flagged(name, fn, what):
    t = torch.randn(16)
    _raises(lambda: fn(t), what)


def test_message_names_the_project_line():
    t = torch.randn(4)

    def step():
        return t.sum().item()  # the offending line

    msg = _raises(step, "_local_scalar_dense")
    assert "tests/runtime/test_runtime_sync_check.py:" in msg and "the offending line" in msg and "in step" in msg


def test_sync_free_work_passes_and_host_side_is_let_through():
    t = torch.randn(64)
    with sync_check("cpu"):
        order = torch.sort(t, stable=True).indices  # fixed shapes: fine
        u = t.index_select(0, order).cumsum(0)
        torch.where(u > 0, u, 0.0).sum()
        with host_side():  # host work by design: the loader, plans, the sampler
            assert int((t > 0).sum()) == int((t > 0).nonzero().numel())
        with pytest.raises(HostSyncError):
            t.sum().item()  # checked again after host_side
    t.sum().item()  # and nothing is checked after the block


def test_disabled_is_a_no_op():
    with sync_check("cpu", enabled=False):
        torch.randn(3).sum().item()


def test_compiled_graphs_run_under_the_check_and_are_checked(monkeypatch):
    def f(x):
        return (x * 2).cumsum(0)

    compiled = torch.compile(f, backend="aot_eager", fullgraph=True, dynamic=False)
    x = torch.randn(8)
    try:
        with sync_check("cpu"):
            out = compiled(x)  # compiles with the check stepped aside, runs with it on
            assert out.shape == (8,)
            with pytest.raises(HostSyncError):
                out.sum().item()  # eager code after the compiled call is checked
        # the compiled graph's own aten calls reach the check: pretend cumsum were a sync
        real = sync_check_module.sync_reason
        monkeypatch.setattr(sync_check_module, "sync_reason",
                            lambda func, a, k: "test" if "cumsum" in str(func) else real(func, a, k))
        with pytest.raises(HostSyncError, match="aten.cumsum"):
            with sync_check("cpu"):
                compiled(x)
    finally:
        torch._dynamo.reset()
