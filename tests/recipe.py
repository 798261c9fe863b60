"""Tests that pin the record's numbers: `@pytest.mark.recipe` and `pin`.

A recipe edit (a cosine cooldown, another rotary base, MTP off) legitimately changes these numbers;
`pytest -m "not recipe"` then checks structure only, and `pytest -m recipe` lists every pinned
number the edit moved, each failure one line naming the source and the record's value:

    record #360: lr_mult at step 1106 is 0.40345, got 0.31839
"""
import pytest

recipe = pytest.mark.recipe


def pin(actual, expected, what: str, source: str = "record #360", abs: float | None = None,
        rel: float | None = None) -> None:
    """Fail, in one line naming `source`, `what` and the record's value, unless actual ≈ expected
    (exact for anything but numbers and sequences of them, where pytest.approx takes abs/rel)."""
    if abs is None and rel is None:
        matches = actual == expected
    else:
        matches = actual == pytest.approx(expected, abs=abs, rel=rel)
    if not matches:
        pytest.fail(f"{source}: {what} is {expected}, got {actual}", pytrace=False)
