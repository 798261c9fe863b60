"""No compile inside a capture (issue 22, item 1): a region whose capturing call (its second) makes
dynamo compile again is caught, naming the region and key; a record run (strict) stops."""
import pytest
import torch

from perf.cuda_graphs.capture import CompileInCapture, RegionGraphs, TapeGraph

SCALE = {"value": 2}  # a Python number the compiled function reads: dynamo guards on it


def _scaled(x):
    return x * SCALE["value"]


@pytest.fixture
def compiled():
    torch._dynamo.reset()
    fn = torch.compile(_scaled, backend="aot_eager", fullgraph=True, dynamic=False)
    yield fn
    torch._dynamo.reset()


def _graphs(strict):
    state = torch.zeros(4)
    return RegionGraphs(TapeGraph, lambda: [("state", state)], strict=strict), state


@pytest.mark.parametrize("strict", [True, False])
def test_a_recompile_at_the_capturing_call_is_caught(compiled, strict):
    graphs, state = _graphs(strict)
    x = torch.ones(4)

    def region():
        state.add_(compiled(x))
        return state

    graphs.run("optimizer", "phase A", region)  # warm-up: compiles the graph
    SCALE["value"] = 3  # the mutation: a guard now fails, so the capturing call recompiles
    try:
        if strict:
            with pytest.raises(CompileInCapture, match=r"region 'optimizer' key 'phase A' compiled 1 graph\(s\)"):
                graphs.run("optimizer", "phase A", region)
        else:
            graphs.run("optimizer", "phase A", region)
            assert graphs.compiles_in_capture == {("optimizer", "phase A"): 1}
            assert "COMPILED WHILE CAPTURING: optimizer 'phase A' (1 graph(s))" in graphs.summary()
    finally:
        SCALE["value"] = 2


def test_a_region_that_compiles_once_captures_cleanly(compiled):
    graphs, state = _graphs(strict=True)
    x = torch.ones(4)

    def region():
        state.add_(compiled(x))
        return state

    for _ in range(3):  # warm-up (compiles), capture (no compile), replay
        graphs.run("forward_backward", "geometry 0", region)
    assert graphs.compiles_in_capture == {} and ("forward_backward", "geometry 0") in graphs.graphs
    assert "COMPILED" not in graphs.summary()
