"""perf/compile.py: a no-op on the portable path, record #360's exact torch.compile call otherwise."""
import torch

from perf.backend import Backend
from perf.compile import compile_model


def _backend(compile: bool) -> Backend:
    return Backend(device="cuda" if compile else "cpu", sm=90 if compile else 0, triton=compile, fp8=True,
                   attention="fa3" if compile else "sdpa", compile=compile)


def test_compile_off_returns_the_same_model(monkeypatch):
    monkeypatch.setattr(torch, "compile", lambda *a, **k: (_ for _ in ()).throw(AssertionError("compiled")))
    model = torch.nn.Linear(4, 4)
    assert compile_model(model, _backend(False)) is model
    assert compile_model(model) is model  # the CPU default backend does not compile


def test_compile_on_is_the_record_call(monkeypatch):
    calls = []
    monkeypatch.setattr(torch, "compile", lambda model, **kwargs: calls.append((model, kwargs)) or "compiled")
    monkeypatch.setattr(torch._dynamo.config, "recompile_limit", 8)
    model = torch.nn.Linear(4, 4)
    assert compile_model(model, _backend(True)) == "compiled"
    assert calls == [(model, dict(dynamic=False, fullgraph=True))]  # no mode, no options: no extra flags
    assert torch._dynamo.config.recompile_limit == 64


def test_cpu_test_backends_and_the_graph_counter(monkeypatch):
    calls = []
    monkeypatch.setattr(torch, "compile", lambda model, **kwargs: calls.append(kwargs) or "compiled")
    cpu_compile = Backend(device="cpu", sm=0, triton=False, fp8=True, attention="sdpa", compile=True,
                          compile_backend="aot_eager")
    compile_model(torch.nn.Linear(2, 2), cpu_compile)
    assert calls == [dict(backend="aot_eager", dynamic=False, fullgraph=True)]
    monkeypatch.undo()

    from perf.compile import compiled_graphs
    torch._dynamo.reset()
    before = compiled_graphs()
    f = torch.compile(lambda x: x * 2, backend="eager", fullgraph=True, dynamic=False)
    f(torch.ones(3))
    f(torch.ones(3))  # same shape: no new graph
    f(torch.ones(4))  # new shape: one more
    assert compiled_graphs() - before == 2
    torch._dynamo.reset()
