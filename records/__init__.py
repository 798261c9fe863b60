"""Run logs, the append-only runs log (runs.jsonl) and the records report."""
