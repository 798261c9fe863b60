"""CUDA-graph capture: the contract a captured region must keep, checked on any device
(perf/cuda_graphs/contract.py)."""
