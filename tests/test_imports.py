"""No import circle anywhere in the repository: every module's imports, read from its source (ast),
form a graph without a cycle.

Every import counts, the ones inside functions too (a lazy import only moves a circle to run time,
where it fails half-way through a command, or hides that two modules depend on each other). An
import names the module and, for `from a.b import c`, a.b.c when that is a module; the packages
above an imported module count too (importing perf.tools.capture_cost runs perf/tools/
__init__.py), but not a module's own packages (perf/tools/memory.py is inside perf/, whatever it imports).
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
    assert len(graph) > 100 and "training" in graph and "perf.cuda_graphs.capture" in graph and "perf.tools.memory" in graph  # it read the tree
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
# the house plan: what a run executes apart from the tools (perf/__init__.py)
# ----------------------------------------------------------------------------------------------------

TOOLS = ("perf.tools", "perf.gpu_check")      # run as commands; gpu_check stays where the GPU runbook calls it
CHECKS = ("perf.checks",)                      # called by the run, off the clock
RUN_ENTRY_POINTS = ("train_gpt", "training", "evaluate")


def _under(name: str, prefixes) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def reachable(graph: dict[str, dict[str, int]], start: str) -> dict[str, str]:
    """{module: the module that first imported it} for everything `start` imports, at any depth."""
    seen, todo = {start: ""}, [start]
    while todo:
        a = todo.pop()
        for b in graph.get(a, {}):
            if b not in seen:
                seen[b] = a
                todo.append(b)
    return seen


def split_violations(graph: dict[str, dict[str, int]]) -> list[str]:
    broken = []
    for entry in RUN_ENTRY_POINTS:  # a run never loads a tool, through any chain
        if entry in graph:
            via = reachable(graph, entry)
            broken += [f"{entry} reaches the tool {m} (imported by {via[m]})" for m in via if _under(m, TOOLS)]
    for name, imported in graph.items():
        if _under(name, TOOLS) or name.startswith("tests"):
            continue
        runtime = name.split(".")[0] in ("model", "optim", "data") or (
            name.startswith("perf") and not _under(name, CHECKS))
        broken += [f"{name} imports the tool {m}" for m in imported if _under(m, TOOLS)]
        if runtime:  # what a step executes does not call the off-the-clock checks
            broken += [f"{name} (run-time) imports the check {m}" for m in imported if _under(m, CHECKS)]
    return broken


def test_the_run_time_code_is_apart_from_the_checks_and_the_tools():
    graph = import_graph(REPO)
    assert "perf.checks.preflight" in graph and "perf.tools.cross_compile" in graph and "perf.kernels.mlp" in graph
    assert split_violations(graph) == []


def test_the_split_rule_names_a_tool_reached_through_a_chain():
    graph = {"train_gpt": {"training": 1}, "training": {"perf.fp8": 3}, "perf.fp8": {"perf.tools.memory": 9},
             "perf.tools.memory": {}, "perf.kernels.mlp": {"perf.checks.cost": 1}, "perf.checks.cost": {}}
    assert split_violations(graph) == [
        "train_gpt reaches the tool perf.tools.memory (imported by perf.fp8)",
        "training reaches the tool perf.tools.memory (imported by perf.fp8)",
        "perf.fp8 imports the tool perf.tools.memory",
        "perf.kernels.mlp (run-time) imports the check perf.checks.cost"]
