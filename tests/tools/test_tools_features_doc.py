"""docs/features.md's switch table is the declarations' (config.FEATURES) text: regenerated here and
compared with the file, row by row, as `python -m tools.features_doc --write` would write it."""
import dataclasses

from config import FEATURES
from tools import features_doc


def test_the_docs_table_is_the_declarations():
    text = features_doc.DOC.read_text()
    assert features_doc.table() in text, "docs/features.md's switch rows differ: run python -m tools.features_doc --write"
    assert features_doc.rewrite(text) == text
    for f in FEATURES:  # one row each, with the declaration's texts
        (line,) = [row for row in text.splitlines() if row.startswith(f"| `--set features.{f.name}=")]
        assert line == features_doc.row(f).rstrip("\n")
        assert f.removes_in_full in line and f.introduced_by in line and line.endswith(f"| {f.gain} |")
    # the hand-written rows of the switches that live elsewhere stay after the generated ones
    assert "| `--set optim.bank_optimizer=normuon` |" in text and "| `SPEEDRUN_COMPILE=0` |" in text


def test_rewrite_replaces_the_rows_of_changed_declarations_and_keeps_the_rest():
    text = features_doc.DOC.read_text()
    changed = (dataclasses.replace(FEATURES[0], gain="+1.00 s"), *FEATURES[2:])  # one edited, one removed
    out = features_doc.rewrite(text, changed)
    assert features_doc.table(changed) in out and "features.value_embeds" not in out.split("## Adding a switch")[0]
    assert out.replace(features_doc.table(changed), features_doc.table()) == text
    assert "| +1.00 s |" in out and "| +7.05 s |" not in out
