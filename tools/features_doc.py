"""docs/features.md's switch table, written from the declarations (config.FEATURES): one row per
`features.*` switch, in declaration order. The rows of the switches that live elsewhere (NorMuon,
CUDA graphs, compile) follow it in the file by hand; tests/tools/test_tools_features_doc.py fails
when the file's rows and the declarations differ.

    python -m tools.features_doc            # print the table
    python -m tools.features_doc --write    # rewrite its rows in docs/features.md in place
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from config import FEATURES, Feature

DOC = Path(__file__).resolve().parent.parent / "docs" / "features.md"
HEADER = ("| switch | what it removes (its cost, not only its effect); past the record, what it adds | introduced by "
          "| #360's measured gain; past the record, the PR's claim |\n"
          "|---|---|---|---|\n")


def row(feature: Feature) -> str:
    value = "false" if feature.default else "true"  # the row names the switch that changes the record
    return (f"| `--set features.{feature.name}={value}` | {feature.removes_in_full} | {feature.introduced_by} "
            f"| {feature.gain} |\n")


def table(features: tuple[Feature, ...] = FEATURES) -> str:
    """The header and one row per declared switch."""
    return HEADER + "".join(row(f) for f in features)


def rewrite(text: str, features: tuple[Feature, ...] = FEATURES) -> str:
    """`text` (docs/features.md) with the header and the rows of `features.*` switches that follow it
    replaced by `table(features)`; the hand-written rows after them are kept."""
    start = text.index(HEADER)
    lines = text[start + len(HEADER):].splitlines(keepends=True)
    generated = 0
    while generated < len(lines) and lines[generated].startswith("| `--set features."):
        generated += 1
    return text[:start] + table(features) + "".join(lines[generated:])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.features_doc", description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help=f"rewrite the table's rows in {DOC.name}")
    args = parser.parse_args(argv)
    if args.write:
        DOC.write_text(rewrite(DOC.read_text()))
        print(f"wrote {len(FEATURES)} rows to {DOC}")
    else:
        sys.stdout.write(table())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
