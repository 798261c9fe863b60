"""Speed only, never new math. This folder holds what a training step executes: residual fusions,
fp8, backend choice, attention backends, compile, collectives, pinned batches, the host-memory
n-gram table, CUDA-graph capture (cuda_graphs/) and the Triton kernels (kernels/).

perf/checks/ holds what the run calls off the clock (preflight, the sync check, the collective-order
check, the step's cost for MFU); perf/tools/ holds the tools run as `python -m perf.tools.NAME`,
which nothing in a run imports (memory, cross-compile, benches, the capture contract). gpu_check.py
stays here, at the path the GPU runbook names. tests/test_imports.py enforces the split."""
