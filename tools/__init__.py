"""Tools run as `python -m tools.NAME` (or `python tools/NAME.py`): per-rank memory, the
cross-compile for a faked GPU, the benches, the CUDA-graph capture contract, its cost and the
graphed-vs-eager comparison. Nothing in a run imports them (tests/test_imports.py)."""
