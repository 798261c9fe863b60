"""The tests a change touches: the test files mirroring the changed files and those reaching them.

    python3 tests/affected.py                   # the working tree (untracked files too) against HEAD
    python3 tests/affected.py main              # ... against a branch or commit
    python3 tests/affected.py --run -- -x -m "not slow"    # run them; what follows -- goes to pytest
    python3 tests/affected.py --files model/loss.py        # these paths, no git

A test file is selected when it changed, when it mirrors a changed file (model/loss.py ->
tests/model/test_model_loss*.py, perf/kernels/mlp.py -> tests/perf/test_perf_kernels_mlp*.py,
a top-level file such as train_gpt.py or config.py -> tests/run/), or when it reaches a changed
module through any chain of the project's modules: an import (at the top or inside a function), an
import in a worker script it keeps as a string (tests/gloo_workers.py runs those), or a module or
file it launches (`"-m", "tools.cross_compile"`, `"data/tokenize.py"`), and so on from each of those.
Tests that read the tree as text run for any change to what they read (`READERS`: the import-circle
and citation checks, the README's). A change to the test set-up (conftest, pyproject, requirements)
selects everything. Files are read, not run, so it cannot see an import built at run time
(`importlib.import_module(name)` of a computed name), a script launched by a path it builds, or a
data file a test reads (shards, JSON, text): those are left to the full `pytest`, which CI runs.
"""
import argparse
import ast
import fnmatch
import shlex
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# ours: these change every test's set-up (fixtures, markers, options, installed packages)
WHOLE_SUITE = {"tests/conftest.py", "pyproject.toml", "requirements.txt", "requirements-test.txt"}
# ours: tests that read the tree as text, not through imports, and the changed paths they read
READERS = {"tests/test_imports.py": ("*.py",),
           "tests/test_citations.py": ("*.py", "*.md", "*.txt", "*.toml", "*.sh", "Dockerfile", ".ci/run"),
           "tests/test_readme.py": ("README.md", "docs/*.md")}


def module_name(path: str) -> str:
    """model/loss.py -> model.loss; model/__init__.py -> model."""
    return path.removesuffix(".py").replace("/", ".").removesuffix(".__init__")


def with_packages(name: str) -> list[str]:
    """perf.cuda_graphs.capture -> [runtime, perf.cuda_graphs, perf.cuda_graphs.capture]: importing it runs each __init__."""
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts) + 1)]


def names_in(path: Path) -> set[str]:
    """Every module-like name a file imports, imports in a script kept as a string, or launches."""
    try:
        found, trees = set(), [ast.parse(path.read_text(), str(path))]
    except SyntaxError as error:
        sys.exit(f"tests/affected.py: error: {path}: line {error.lineno}: {error.msg}; fix it, then rerun")
    while trees:
        for node in ast.walk(trees.pop()):
            if isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                found.add(node.module)
                found.update(f"{node.module}.{alias.name}" for alias in node.names)  # from model import loss
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                text = node.value
                if "import " in text:  # a worker script
                    try:
                        trees.append(ast.parse(textwrap.dedent(text)))
                    except SyntaxError:
                        pass
                if text.endswith(".py") or ("." in text and " " not in text):  # "tools.cross_compile", "train_gpt.py"
                    found.add(module_name(text))
    return {package for name in found for package in with_packages(name)}


def is_test(path: str) -> bool:
    return path.startswith("tests/") and Path(path).name.startswith("test_")


def mirrors(path: str, repo: Path) -> list[str]:
    """The test files mirroring a source file: tests/<area>/test_<area>_<name>*.py; tests/run/ for top-level."""
    parts = module_name(path).split(".")
    if "/" not in path:
        folder, stem = repo / "tests" / "run", "test"
    else:
        folder, stem = repo / "tests" / parts[0], "test_" + "_".join(parts)
    return [str(p.relative_to(repo)) for p in [*folder.glob(stem + ".py"), *folder.glob(stem + "_*.py")]]


def reaches(start: str, targets, graph: dict[str, set[str]]) -> dict[str, list[str]]:
    """{target: the shortest chain of project modules from `start` to it} for each target that
    `start` imports, directly or through other modules (breadth first)."""
    chains, previous, frontier = {}, {start: None}, [start]
    while frontier:
        following = []
        for name in frontier:
            for child in sorted(graph.get(name, ())):
                if child not in previous:
                    previous[child] = name
                    following.append(child)
        frontier = following
    for target in targets:
        if target in previous and target != start:
            chain = [target]
            while previous[chain[-1]] is not None:
                chain.append(previous[chain[-1]])
            chains[target] = chain[::-1]
    return chains


def select(changed: list[str], repo: Path = REPO,
           readers: dict[str, tuple[str, ...]] = READERS) -> dict[str, tuple[str, str]] | None:
    """{test file: (why, the changed path it answers)} for the changed paths (repo-relative); None when
    the test set-up changed: the whole suite."""
    if WHOLE_SUITE & set(changed):
        return None
    folders = [d for d in repo.iterdir() if (d / "__init__.py").is_file() or d.name == "tests"]  # not a venv
    paths = [*repo.glob("*.py"), *(p for folder in folders for p in folder.rglob("*.py"))]
    files = sorted(str(p.relative_to(repo)) for p in paths)
    modules = {module_name(f) for f in files + [c for c in changed if c.endswith(".py")]}
    graph = {module_name(f): names_in(repo / f) & modules for f in files}  # module -> project modules it names
    origin = {module_name(c): c for c in changed if c.endswith(".py") and not is_test(c)}  # module -> changed path
    why = {}
    for path in changed:
        if is_test(path) and (repo / path).is_file():
            why[path] = ("changed", path)
        elif path.endswith(".py") and not path.startswith("tests/"):
            why.update({test: (f"mirrors {path}", path) for test in mirrors(path, repo) if test not in why})
    for test in (f for f in files if is_test(f) and f not in why):
        chains = reaches(module_name(test), origin, graph)
        if chains:  # the shortest chain, then the first changed module by name
            target, chain = min(chains.items(), key=lambda item: (len(item[1]), item[0]))
            how = f"imports {target}" if len(chain) == 2 else f"imports {' → '.join(chain[1:])}"
            why[test] = (how, origin[target])
    for test, patterns in readers.items():
        read = [c for c in changed if any(fnmatch.fnmatch(c, pattern) for pattern in patterns)]
        if read and test not in why and (repo / test).is_file():
            why[test] = (f"reads {read[0]}", read[0])
    return dict(sorted(why.items()))


def changed_files(rev: str, repo: Path = REPO) -> list[str]:
    """Paths that differ between the working tree and `rev`, and untracked files (git's view, repo-relative)."""
    def git(*args: str) -> list[str]:
        done = subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True)
        if done.returncode != 0:
            sys.exit(f"tests/affected.py: error: `git {' '.join(args)}` failed in {repo}: {done.stderr.strip()}")
        return done.stdout.splitlines()
    return sorted(set(git("diff", "--name-only", "--no-renames", rev, "--"))
                  | set(git("ls-files", "--others", "--exclude-standard")))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tests/affected.py", description=__doc__.split("\n")[0],
                                     epilog="arguments after -- go to pytest (with --run)")
    parser.add_argument("rev", nargs="?", default="HEAD", help="compare the working tree with this revision")
    parser.add_argument("--files", nargs="+", metavar="PATH", help="these changed paths instead of git's")
    parser.add_argument("--run", action="store_true", help="run the selected tests with pytest")
    argv = sys.argv[1:] if argv is None else argv
    split = argv.index("--") if "--" in argv else len(argv)
    args, pytest_args = parser.parse_args(argv[:split]), argv[split + 1:]
    changed = args.files or changed_files(args.rev)
    why = select(changed)
    if why is None:
        print(f"the test set-up changed ({', '.join(sorted(WHOLE_SUITE & set(changed)))}): the whole suite")
    else:
        source = "--files" if args.files else f"git diff {args.rev}, untracked"
        print(f"{len(changed)} changed path(s) ({source}) -> {len(why)} test file(s):")
        for test, (reason, _) in why.items():
            print(f"  {test:50s} {reason}")
        if untested := [c for c in changed if c.endswith(".py") and c not in {path for _, path in why.values()}]:
            print(f"  no test mirrors or names: {', '.join(untested)}")
        if not why:
            return 0  # pytest without paths would run the whole suite
    command = [sys.executable, "-m", "pytest", *(why or []), *pytest_args]
    print(shlex.join(["python3", *command[1:]]))
    return subprocess.run(command, cwd=REPO).returncode if args.run else 0


if __name__ == "__main__":
    sys.exit(main())
