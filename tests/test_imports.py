"""No import circle anywhere in the repository: every module's imports, read from its source (ast),
form a graph without a cycle.

Every import counts, the ones inside functions too (a lazy import only moves a circle to run time,
where it fails half-way through a command, or hides that two modules depend on each other). An
import names the module and, for `from a.b import c`, a.b.c when that is a module; the packages
above an imported module count too (importing tools.capture_cost runs tools/
__init__.py), but not a module's own packages (perf/cuda_graphs/capture.py is inside perf/, whatever it imports).
Relative imports are resolved. What the files do not say is not seen: `importlib.import_module` of a
computed name, and scripts that tests run in subprocesses (their imports run in another process).
"""
import ast
from pathlib import Path

import pytest

from tests.file_tree import write_tree

REPO = Path(__file__).resolve().parents[1]


def module_name(path: Path, root: Path) -> str:
    """model/loss.py -> model.loss; model/__init__.py -> model."""
    return str(path.relative_to(root)).removesuffix(".py").replace("/", ".").removesuffix(".__init__")


def repository_modules(root: Path) -> dict[str, Path]:
    """The top-level scripts and every module of a package folder (one with an __init__.py) or of
    tests/, by module name: the repository's own code (a virtual environment is not a package)."""
    folders = [d for d in root.iterdir() if d.is_dir() and ((d / "__init__.py").is_file() or d.name == "tests")]
    paths = [*root.glob("*.py"), *(p for folder in folders for p in folder.rglob("*.py"))]
    return {module_name(p, root): p for p in sorted(paths)}


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> dict[str, int]:
    """{repository module: the line of the first import of it} for every import in the file,
    function-local ones included, with the packages above each (not the importer's own)."""
    found: dict[str, int] = {}
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    own = {".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 1)} | {name}
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # from . import x, from ..a import b
                parent = package.split(".")[:len(package.split(".")) - node.level + 1] if package else []
                base = ".".join([*parent, *([base] if base else [])])
            names = [base] + [f"{base}.{alias.name}" if base else alias.name for alias in node.names]
        else:
            continue
        for full in names:
            parts = full.split(".")
            for i in range(1, len(parts) + 1):
                target = ".".join(parts[:i])
                if target in modules and target not in own:
                    found.setdefault(target, node.lineno)
    return found


def import_graph(root: Path) -> dict[str, dict[str, int]]:
    modules = repository_modules(root)
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """One shortest cycle per strongly connected component of more than one module (Tarjan's
    components, then a breadth-first search inside each), as [a, b, ..., a]."""
    index, low, stack, on_stack, components = {}, {}, [], set(), []

    def visit(v: str) -> None:  # iterative: no recursion limit on a deep chain
        work = [(v, iter(sorted(graph[v])))]
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    component.add(w)
                    if w == node:
                        break
                if len(component) > 1:
                    components.append(component)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    found = []
    for component in components:
        start = min(component)
        previous, frontier = {start: None}, [start]
        while frontier and start not in [c for v in frontier for c in graph[v]]:
            nxt = []
            for v in frontier:
                for c in sorted(graph[v]):
                    if c in component and c not in previous:
                        previous[c] = v
                        nxt.append(c)
            frontier = nxt
        last = min(v for v in frontier if start in graph[v])
        path = [last]
        while previous[path[-1]] is not None:
            path.append(previous[path[-1]])
        found.append([*reversed(path), start])
    return found


def describe(cycle: list[str], graph: dict[str, dict[str, int]], modules: dict[str, Path], root: Path) -> str:
    """`a -> b (a.py:12) -> a (b.py:40)`: each import with the file and line that makes it."""
    text = cycle[0]
    for a, b in zip(cycle, cycle[1:]):
        text += f" -> {b} ({modules[a].relative_to(root)}:{graph[a][b]})"
    return text


def test_the_repository_has_no_import_circle():
    graph, modules = import_graph(REPO), repository_modules(REPO)
    assert len(graph) > 100 and "runtime.training" in graph and "perf.cuda_graphs.capture" in graph and "tools.memory" in graph  # it read the tree
    found = [describe(c, graph, modules, REPO) for c in cycles(graph)]
    assert found == [], "import circles (break each by moving what both sides need to a module of its own):\n" \
        + "\n".join(found)


FILES = {  # a hand-made repository: net.a -> net.b -> net.c -> net.a, the last import inside a function
    "net/__init__.py": "",
    "net/a.py": "from net import b\n",
    "net/b.py": "import os\nfrom net.c import f\n",
    "net/c.py": "def f():\n    from . import a\n    return a\n",
    "net/d.py": "import net.c\n",  # outside the circle
    "net/sub/__init__.py": "",
    "net/sub/e.py": "from ..d import x\nfrom net import sub\n",  # its own package: no circle
    "tool.py": "import net.sub.e\n",
    "tests/test_tool.py": "import tool\n",
    "venv/lib/site.py": "import tool\n",  # not a package of the repository: not read
}


@pytest.fixture
def repo(tmp_path):
    return write_tree(tmp_path, FILES)


def test_a_circle_through_a_function_local_import_is_found_and_named(repo):
    graph, modules = import_graph(repo), repository_modules(repo)
    assert "venv.lib.site" not in graph and "tests.test_tool" in graph
    assert graph["net.c"] == {"net.a": 2}  # `from . import a`, inside f
    assert graph["net.sub.e"] == {"net.d": 1}  # net and net.sub are its own packages
    assert graph["tool"] == {"net": 1, "net.sub": 1, "net.sub.e": 1}
    assert [describe(c, graph, modules, repo) for c in cycles(graph)] == [
        "net.a -> net.b (net/a.py:1) -> net.c (net/b.py:2) -> net.a (net/c.py:2)"]


def test_no_circle_once_it_is_broken(repo):
    (repo / "net/c.py").write_text("def f():\n    return 1\n")
    assert cycles(import_graph(repo)) == []


# ----------------------------------------------------------------------------------------------------
# the house plan: one layer per folder, each importing only the layers below it (docs/design.md)
# ----------------------------------------------------------------------------------------------------

# A room is a top-level folder or a top-level module; tests/ is left out. Bottom first.
LAYERS = (
    ("config",),                          # the run's settings: frozen dataclasses and the presets
    ("cli",),                             # the command-line plumbing every entry point (and module main) shares
    ("perf",),                            # what the math runs on: kernels and their twins (perf/kernels/), fp8,
                                          # attention backends, residual fusions, the backend, streams, collectives,
                                          # pinned batches, the host table, compile and CUDA-graph capture
    ("model", "optim", "data"),           # the math: the network, its optimizers and schedule, the batches
    ("runtime",),                         # the run's machinery: Setup/Run, checkpoints, the loss watch, guards
    ("records",),                         # what runs leave: logs, runs.jsonl, the report, certification
    ("train_gpt", "evaluate"),            # the entry points
    ("tools",),                           # commands no run imports: cost, memory, cross-compile, benches, gpu_check
)
MAX_ROOM_SHARE = 0.40  # issue 39: no room holds more than 40% of the code's lines


def room(module: str) -> str:
    return module.split(".")[0]


def layer_of(name: str) -> int | None:
    return next((i for i, rooms in enumerate(LAYERS) if name in rooms), None)


def layer_violations(graph: dict[str, dict[str, int]], layers=LAYERS) -> list[str]:
    """Every import of one room from another that does not go strictly down the layers, and every
    room the plan does not place."""
    of = {r: i for i, rooms in enumerate(layers) for r in rooms}
    broken = sorted({f"{room(m)} is in no layer (tests/test_imports.py LAYERS)" for m in graph
                     if room(m) != "tests" and room(m) not in of})
    for name, imported in sorted(graph.items()):
        a = room(name)
        if a == "tests" or a not in of:
            continue
        for target, line in sorted(imported.items()):
            b = room(target)
            if any(other.startswith(target + ".") for other in imported):
                continue  # a package above an imported module: the module's own line names the import
            if b != a and b in of and of[b] >= of[a]:
                where = "up" if of[b] > of[a] else "across"
                broken.append(f"{name} imports {target} (line {line}): {a} may not import {b}, {where} a layer")
    return broken


def room_circles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    rooms: dict[str, dict[str, int]] = {}
    for name, imported in graph.items():
        if room(name) == "tests":
            continue
        edges = rooms.setdefault(room(name), {})
        for target, line in imported.items():
            if room(target) not in ("tests", room(name)):
                edges.setdefault(room(target), line)
    return cycles(rooms)


def test_every_import_goes_down_the_layers():
    graph = import_graph(REPO)
    assert {"perf.kernels.mlp", "perf.streams", "runtime.training", "tools.cost", "records.certify"} <= set(graph)
    assert layer_violations(graph) == []


def test_no_circle_among_the_rooms():
    assert room_circles(import_graph(REPO)) == []


def test_nothing_imports_the_run_script():
    """What the tools need from a run (Setup, Run) lives in runtime/training.py; the tests call
    train_gpt.main() only. Lazy imports inside functions count (the graph reads them)."""
    graph = import_graph(REPO)
    assert [name for name, imported in graph.items() if "train_gpt" in imported and room(name) != "tests"] == []


def test_no_room_holds_more_than_40_percent_of_the_code():
    modules = repository_modules(REPO)
    lines: dict[str, int] = {}
    for name, path in modules.items():
        if room(name) != "tests":
            lines[room(name)] = lines.get(room(name), 0) + len(path.read_text().splitlines())
    total = sum(lines.values())
    assert total > 15_000 and {"perf", "runtime", "tools", "model"} <= set(lines)  # it read the tree
    heavy = {r: f"{n / total:.0%}" for r, n in lines.items() if n > MAX_ROOM_SHARE * total}
    assert heavy == {}, f"rooms over {MAX_ROOM_SHARE:.0%} of {total:,} lines: {heavy}"


@pytest.mark.parametrize("module, imported, expected", [
    ("perf.kernels.mlp", "model.gpt", "perf.kernels.mlp imports model.gpt (line 3): perf may not import model, up a layer"),
    ("model.gpt", "runtime.training", "model.gpt imports runtime.training (line 3): model may not import runtime, up a layer"),
    ("model.gpt", "tools.cost", "model.gpt imports tools.cost (line 3): model may not import tools, up a layer"),
    ("model.gpt", "optim.anvil", "model.gpt imports optim.anvil (line 3): model may not import optim, across a layer"),
    ("runtime.training", "train_gpt", "runtime.training imports train_gpt (line 3): runtime may not import train_gpt, up a layer"),
])
def test_an_import_up_or_across_the_layers_fails(module, imported, expected):
    graph = {"perf.fp8": {}, "model.gpt": {"perf.fp8": 1}, "runtime.training": {"model.gpt": 2, "perf.fp8": 1},
             "tools.cost": {"runtime.training": 1}, "train_gpt": {"runtime.training": 1}, "optim.anvil": {"perf.fp8": 4},
             "perf.kernels.mlp": {}}
    assert layer_violations(graph) == []  # the hand-made tree is layered
    graph[module] = {**graph[module], imported: 3}
    assert layer_violations(graph) == [expected]


def test_a_room_outside_the_plan_fails_and_a_circle_of_rooms_is_named():
    graph = {"scratch": {"model.gpt": 1}, "model.gpt": {}}
    assert layer_violations(graph) == ["scratch is in no layer (tests/test_imports.py LAYERS)"]
    graph = {"model.gpt": {"runtime.training": 5}, "runtime.training": {"model.gpt": 2}}
    assert room_circles(graph) == [["model", "runtime", "model"]]
