"""Triton kernels of the fast path; each has a portable twin and a parity test."""
