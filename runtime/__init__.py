"""The run's machinery, above the math: Setup and Run (training.py), checkpoints, the loss watch, the
throughput a run logs, the source it embeds, and the guards a run calls (config_check, preflight,
sync_check, collective_order). It imports perf/, model/, optim/ and data/ below it; entry points,
records/ and tools/ import it (tests/test_imports.py)."""
