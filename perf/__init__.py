"""The layer below the math, laid out as upstream's `track_1_short/perf/` is: what the math runs on.

    kernels/            the Triton kernels of the fast path, each beside its portable twin and held to it by
                        a parity test (copy_pointer, cross_entropy, mlp, ngram_embed, qkv_rope,
                        symmetric_matmul, transpose, value_embed); fp8's delayed scales live in
                        kernels/mlp.py's Fp8MLPState
    residual_fusion.py  scale / scale_add / rms_norm_with_head at every residual site
    fp8.py              the e4m3/e5m2 casts, scaled GEMMs, the fp8 QKV and lm_head
    attention_backends  SDPA, flex and FA3 behind one varlen call
    backend.py          which path a run takes (portable or fast) and what the device offers
    streams.py, collectives.py, pinned_batches.py, host_table.py
                        how bytes move: side streams and worker threads, collectives, pinned batches in
                        flight, the host-memory n-gram table
    compile.py, cuda_graphs/
                        torch.compile of the model and the CUDA-graph capture of a step's regions

It imports no model, optimizer or run module (tests/test_imports.py): `model/` defines the math, this
package implements it. The nested `kernels/` is `perf.kernels`, never a top-level `kernels`, so the pip
package `kernels` (FA3 from the hub) is not shadowed.

Every module here is imported through this package, so a fix to the Triton interpreter that the
CPU parity tests (TRITON_INTERPRET=1) need lives here, once, switched on the version it applies to.
Compiled kernels (a GPU, the SM90 cross-compiles) never run the interpreter and see no change.
"""
from __future__ import annotations

import triton


def _triton_version() -> tuple[int, int]:
    major, minor = triton.__version__.split(".")[:2]
    return int(major), int("".join(ch for ch in minor if ch.isdigit()) or 0)


def _fix_interpreter_index() -> None:
    """Triton 3.6 (the record's pin, with torch 2.10) / NumPy >= 2.4: the interpreter holds every
    scalar (a launch's int argument, tl.load of one element) as a 1-element 1-D array and converts it
    for Python's range() with int(data), which NumPy 2.4 refuses ("only 0-dimensional arrays can be
    converted to Python scalars", triton-lang/triton issue 9171). So every loop whose bound is a
    run-time argument (`for n0 in range(0, N, BLOCK_N)` in the cross-entropy kernels, the K loops of
    the matmuls, ...) failed there. Triton 3.8 (CI's) converts data.squeeze(); this re-registers that
    same conversion on the interpreter's tensors for Triton < 3.7, so both run the same kernels with
    the same results."""
    try:
        from triton.runtime import interpreter
    except ImportError:  # a Triton without the interpreter module: nothing to fix
        return
    patch_tensor = getattr(interpreter, "_patch_lang_tensor", None)
    if patch_tensor is None or getattr(patch_tensor, "_speedrun_index_fix", False):
        return

    def _patch_lang_tensor(tensor, scope):
        patch_tensor(tensor, scope)  # Triton's own patches, then __index__ over (restored with them)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    _patch_lang_tensor._speedrun_index_fix = True
    interpreter._patch_lang_tensor = _patch_lang_tensor


if _triton_version() < (3, 7):  # torch 2.10 / Triton 3.6: the interpreter's int() of a scalar (above)
    _fix_interpreter_index()
