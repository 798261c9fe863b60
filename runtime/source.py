"""The run's own code: which project modules this process imported, and their text.

The run log (records/run_log.py) embeds it after its header, as upstream's log embeds the code its run
executed (record #360), and a checkpoint keeps it under "code" (runtime/checkpoints.py). Never the
tests, the tools no run imports, or a virtual environment inside the checkout.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
SOURCE_RULE = "-" * 40  # record #360 run_log: 40 dashes around each file's path header
SKIPPED_DIRS = {"__pycache__", "logs", "fineweb10B"}  # run outputs and data, not source

# Never embedded, though a process may have imported them: the test suite, the tools no run imports
# (cost, memory, cross-compile, benches: tools/), and anything inside a virtual environment.
NOT_RUN_SOURCE_DIRS = ("tests", "tools")
NOT_SOURCE_PARTS = {"site-packages", "dist-packages"}


def run_source_files(root: Path = REPO_ROOT, modules=None) -> list[Path]:
    """The project's .py files this process has imported (`modules`, default sys.modules; the entry
    script is `__main__`), sorted: the code the run executes. Tests, tools and virtual environments
    are left out (NOT_RUN_SOURCE_DIRS, NOT_SOURCE_PARTS), as are hidden folders and caches."""
    root = Path(root).resolve()
    found = set()
    for module in list((sys.modules if modules is None else modules).values()):
        name = getattr(module, "__file__", None)
        if not isinstance(name, str) or not name.endswith(".py"):
            continue
        path = Path(os.path.abspath(name)).resolve()   # __main__'s may be relative to the working dir
        if not path.is_relative_to(root) or not path.is_file():
            continue
        rel = path.relative_to(root)
        if (any(part.startswith(".") or part in SKIPPED_DIRS or part in NOT_SOURCE_PARTS for part in rel.parts[:-1])
                or any(rel.as_posix().startswith(d + "/") for d in NOT_RUN_SOURCE_DIRS)):
            continue
        found.add(path)
    return sorted(found, key=lambda p: p.relative_to(root).as_posix())


def read_source(files: list[Path], root: Path = REPO_ROOT) -> str:
    """The concatenated source of `files` (below `root`), each after a `# <relative path>` header
    between dash rules."""
    parts = []
    for path in files:
        rel = path.relative_to(root).as_posix()
        parts.append(f"{SOURCE_RULE}\n# {rel}\n{SOURCE_RULE}\n{path.read_text(encoding='utf-8')}")
    return "\n".join(parts)


def format_source_line(files: list[Path]) -> str:
    """`source: N files, B bytes embedded (...)`: what the log's header holds."""
    size = sum(len(path.read_bytes()) for path in files)
    return f"source: {len(files)} files, {size:,} bytes embedded (the project modules this run imported)"
