"""The tensor collectives under the names this torch prefers.

torch 2.13 renamed `all_gather_into_tensor` / `reduce_scatter_tensor` to `all_gather_single` /
`reduce_scatter_single` (the old names print a FutureWarning at every call); the record's torch 2.10
has only the old names. Same signatures: (output, input, group=None, async_op=False).
"""
import contextlib

import torch.distributed as dist

all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


# ----------------------------------------------------------------------------------------------------
# a collective that never completes: a named error, not a silent hang
# ----------------------------------------------------------------------------------------------------
class CollectiveTimeout(RuntimeError):
    """A collective did not complete within the process group's timeout: another rank never reached
    it. The message names where this rank was (step, region); the other rank's log says where it is."""


def is_collective_timeout(exc: BaseException) -> bool:
    """gloo raises "Timed out waiting ...ms for recv operation"; NCCL under TORCH_NCCL_BLOCKING_WAIT
    a DistBackendError naming the watchdog timeout (the default, asynchronous error handling, tears
    the process down from the watchdog instead, with its own message)."""
    text = str(exc)
    return isinstance(exc, RuntimeError) and ("Timed out" in text or "timed out" in text or "Watchdog" in text)


@contextlib.contextmanager
def named_timeouts(where, timeout_s: float):
    """Re-raise a collective timeout inside the block as CollectiveTimeout naming `where()` (a
    callable: the position at the moment of the failure)."""
    try:
        yield
    except RuntimeError as exc:
        if not is_collective_timeout(exc) or isinstance(exc, CollectiveTimeout):
            raise
        raise CollectiveTimeout(
            f"{where()}: a collective did not complete within {timeout_s:g} s (collective_timeout_s): another "
            f"rank never reached it; its log says where it stopped ({str(exc).splitlines()[0][:200]})") from exc
