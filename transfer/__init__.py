"""How bytes move beside the math: collectives between ranks, side streams and worker threads, pinned
host buffers in flight, and the host-memory n-gram table. The layer under model/ and optim/ (whose
sharded step and row exchange call it), beside ops/; it imports neither (tests/test_imports.py)."""
