"""A hand-made repository for the tests of the repository's own tooling (tests/affected.py, the
import-circle check): files written from a {path: source} dict."""
from pathlib import Path


def write_tree(root: Path, files: dict[str, str]) -> Path:
    """Write each source at its path under root, folders made as needed; returns root."""
    for path, source in files.items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text(source)
    return root
