"""The fast path's Triton kernels, one file per op, each beside its portable twin (plain PyTorch, the
math the CPU runs) and a parity test under tests/perf/test_perf_kernels_<op>*.py (TRITON_INTERPRET=1 on
CPU, compiled on a GPU). The names follow upstream's track_1_short/perf/kernels/."""
