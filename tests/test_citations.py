"""Citations a reader can follow: no tracked file (source, tests, docs, README) cites a document that
is not in the repository.

The project was written from notes kept outside it (a design document and three descriptions of the
upstream records). A citation of those, by file name or by one of their section numbers, leads a
reader nowhere: a fact from upstream cites upstream (record #360 and the `track_1_short/` file that
holds it, record #89's `train_gpt.py`; docs/design.md, "Sources", says where they are), and a rule
of this repository cites a file of it (docs/design.md). Markdown links and `docs/*.md` paths must
name files that exist.
"""
import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# the notes kept outside the repository, by name (spelled in pieces, so this file does not cite them)
OUTSIDE = ("DESIGN" + ".md", "record_" + "360.md", "record_" + "360_modules.md", "record_" + "89.md")
# their section numbers: "modules §4.2", "record #360 §6.2", "record #360 modules §1.2"
SECTION = re.compile(r"modules §|record #\d+,? (modules )?§")
MARKDOWN_LINK = re.compile(r"\]\(([^)#:\s]+\.md)(#[^)]*)?\)")
DOCS_PATH = re.compile(r"(?<![\w/.])docs/[\w-]+\.md")


def tracked_text_files(root: Path) -> list[tuple[str, str]]:
    """(path, text) of the repository's text files: git's, untracked ones not ignored included."""
    names = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=root,
                           capture_output=True, text=True, check=True).stdout.split()
    out = []
    for name in names:
        path = root / name
        if path.is_file() and path.suffix in (".py", ".md", ".txt", ".toml", ".sh", ".cfg", "") and \
                path.stat().st_size < 2_000_000:
            try:
                out.append((name, path.read_text(encoding="utf-8")))
            except UnicodeDecodeError:
                pass
    return out


def unfollowable(name: str, text: str, root: Path) -> list[str]:
    """`name:line: what` for every citation in `text` (the file `name`) a reader cannot follow."""
    bad = []
    for number, line in enumerate(text.splitlines(), 1):
        found = [doc for doc in OUTSIDE if re.search(rf"(?<![\w-]){re.escape(doc)}", line)]
        found += [m.group(0) for m in SECTION.finditer(line)]
        for link, _ in MARKDOWN_LINK.findall(line) if name.endswith(".md") else ():  # (.py: templates of files it writes)
            if not (root / name).parent.joinpath(link).exists() and not (root / link).exists():
                found.append(f"link to {link}")
        for path in DOCS_PATH.findall(MARKDOWN_LINK.sub("]", line)):
            if not (root / path).exists():
                found.append(f"missing {path}")
        bad += [f"{name}:{number}: {what}" for what in found]
    return bad


def test_every_citation_can_be_followed():
    files = tracked_text_files(REPO)
    assert len(files) > 100 and any(name == "docs/design.md" for name, _ in files)
    bad = [b for name, text in files if name != "tests/test_citations.py" for b in unfollowable(name, text, REPO)]
    assert bad == [], "cite the upstream source or a file of this repository instead:\n" + "\n".join(bad)


@pytest.mark.parametrize("line, expected", [
    ("Contracts: ../" + OUTSIDE[0] + ' "The residual fusions".', [OUTSIDE[0]]),
    ("# record #360 (modules §7.3). lr_mul 1.52", ["modules §"]),
    ("(record #360 §6.4, modules §9.2): every step", ["record #360 §", "modules §"]),
    ("Reference: " + OUTSIDE[3] + " §6.4-6.6.", [OUTSIDE[3]]),
    ("see docs/gone.md", ["missing docs/gone.md"]),
    ("# record #360 (track_1_short/config.py TRAINING_STAGES); docs/design.md", []),
    ("def test_record_360_pool_statistics(tmp_path):", []),  # a test's name, not a document
    ("writes OUT/statistics.md and [the guide](docs/testing.md)", []),  # an output file; an existing doc
])
def test_the_check_names_what_a_reader_cannot_follow(line, expected):
    assert [b.split(": ", 1)[1] for b in unfollowable("x.py", line, REPO)] == expected


def test_a_markdown_file_s_links_must_exist():
    line = "see [the design](design.md), [gone](nowhere.md) and [up](../README.md)"
    assert [b.split(": ", 1)[1] for b in unfollowable("docs/x.md", line, REPO)] == ["link to nowhere.md"]
