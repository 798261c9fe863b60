"""The tensor collectives under the names this torch prefers.

torch 2.13 renamed `all_gather_into_tensor` / `reduce_scatter_tensor` to `all_gather_single` /
`reduce_scatter_single` (the old names print a FutureWarning at every call); the record's torch 2.10
has only the old names. Same signatures: (output, input, group=None, async_op=False).
"""
import torch.distributed as dist

all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
