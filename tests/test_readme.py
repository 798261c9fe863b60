"""README.md is the newcomer's page: short, every document it points to exists, and no Markdown line
starts a heading by accident (a wrapped "#360 ..." renders as a title)."""
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
README_MAX_LINES = 300  # issue 31: what it is, set up, run, test, layout, where to read more


def test_readme_is_short_and_its_links_exist():
    text = (REPO / "README.md").read_text(encoding="utf-8")
    assert text.count("\n") <= README_MAX_LINES, f"README.md has {text.count(chr(10))} lines; move depth to docs/"
    links = re.findall(r"\]\(([^)#:]+)\)", text)
    assert "docs/testing.md" in links
    assert [link for link in links if not (REPO / link).exists()] == []


def test_every_doc_is_listed_in_the_readme():
    text = (REPO / "README.md").read_text(encoding="utf-8")
    assert [p.name for p in sorted((REPO / "docs").glob("*.md")) if f"docs/{p.name}" not in text] == []


def test_no_wrapped_line_turns_into_a_heading():
    bad = []
    for path in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        fenced = False
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if line.startswith("```"):
                fenced = not fenced
            elif not fenced and re.match(r"#+[^# ]", line):
                bad.append(f"{path.name}:{number}: {line[:40]}")
    assert bad == []
