"""CPLM's pointer head (PR #379): the Triton kernels against their portable twin (interpreter on CPU),
values and the gradients of q, k and k_sink, fp32 and bf16; the worked example through the kernels;
the dispatch, input errors and no host sync. Small shapes: the interpreter runs every tile in Python."""
import math

import pytest
import torch

from perf.backend import use_backend
from perf.kernels import copy_pointer as cp
from runtime.sync_check import sync_check
from tools.gpu_check import ulp_distance

pytestmark = pytest.mark.triton

# (N, d, band, cu_seqlens, q/k dtype). The interpreter's tiles are 16 × 16 (cp.TILES), so every case
# crosses several query and key tiles and ends in a ragged one.
CASES = [
    # 4 blocks of 32 (the last one ragged), an empty document [10, 10), documents [45, 70) and [70, 100)
    # crossing block boundaries (64 and 96), trailing N padding
    (100, 16, 32, [0, 10, 10, 45, 70, 100, 100], torch.float32),
    (100, 32, 32, [0, 10, 10, 45, 70, 100, 100], torch.bfloat16),
    # one document of 90 against a band of 24: not a multiple of the tile, so query tiles straddle blocks;
    # d = 24, not a power of two (the columns past d are masked)
    (90, 24, 24, [0, 90], torch.float32),
    # 0 repeated at the front, an entry past N (clamped), a band longer than N (the CPU smoke run's 2048)
    (53, 16, 2048, [0, 0, 20, 41, 400], torch.float32),
    (53, 16, 2048, [0, 0, 20, 41, 400], torch.bfloat16),
]


def _inputs(N, d, cu, dtype, seed=0, vocab=3):
    """q, k (dtype), k_sink (fp32), inputs (int32), targets (int64), cu_seqlens (int32): a small vocabulary
    so that many sources match (p_copy not mostly 0)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(N, d, generator=gen).to(dtype)
    k = torch.randn(N, d, generator=gen).to(dtype)
    k_sink = torch.randn(d, generator=gen)
    inputs = torch.randint(0, vocab, (N,), generator=gen, dtype=torch.int32)
    targets = torch.randint(0, vocab, (N,), generator=gen)
    return q, k, k_sink, inputs, targets, torch.tensor(cu, dtype=torch.int32)


def _values_and_grads(fn, q, k, k_sink, inputs, targets, cu, band, seed=1):
    """(p_copy, a_sink, ∂/∂q, ∂/∂k, ∂/∂k_sink) of Σ w1·p_copy + Σ w2·a_sink, random weights."""
    gen = torch.Generator().manual_seed(seed)
    w1, w2 = (torch.randn(q.shape[0], generator=gen).to(q.device) for _ in range(2))
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, k_sink)]
    p_copy, a_sink = fn(*leaves, inputs, targets, cu, band)
    grads = torch.autograd.grad((w1 * p_copy).sum() + (w2 * a_sink).sum(), leaves)
    return (p_copy.detach(), a_sink.detach(), *grads)


def _assert_matches_twin(got, want, dtype):
    p_copy, a_sink, dq, dk, dk_sink = got
    assert p_copy.dtype == a_sink.dtype == dk_sink.dtype == torch.float32 and dq.dtype == dk.dtype == dtype
    # fp32 scores of the same bf16 (or fp32) operands, summed in another order: fp32 ulps of the values
    torch.testing.assert_close(p_copy, want[0], rtol=0, atol=2e-6)
    torch.testing.assert_close(a_sink, want[1], rtol=0, atol=2e-6)
    torch.testing.assert_close(dk_sink, want[4], rtol=1e-5, atol=2e-6)
    if dtype == torch.float32:
        torch.testing.assert_close(dq, want[2], rtol=1e-5, atol=2e-6)
        torch.testing.assert_close(dk, want[3], rtol=1e-5, atol=2e-6)
    else:
        # dk: both round one fp32 accumulation to bf16 (the interpreter truncates): <= 1 bf16 ulp
        assert ulp_distance(dk, want[3], atol=1e-6) <= 1.0
        # dq: the kernel's part and the sink's (through s0 = q·k_sink, autograd) are each rounded to
        # bf16 and then added, where the twin rounds their fp32 sum once (PR #379's split): where
        # they cancel, the small sum's ulps shrink, so the slack is one bf16 ulp of the largest |dq|
        assert ulp_distance(dq, want[2], atol=torch.finfo(dtype).eps * want[2].abs().max().item()) <= 1.0


@pytest.mark.parametrize("N,d,band,cu,dtype", CASES)
def test_kernels_match_the_twin_values_and_gradients(N, d, band, cu, dtype):
    args = _inputs(N, d, cu, dtype)
    got = _values_and_grads(cp.copy_pointer_triton, *args, band)
    want = _values_and_grads(cp.copy_pointer_portable, *args, band)
    _assert_matches_twin(got, want, dtype)
    # queries without a source (a document's first token, the empty document's neighbour): all sink
    doc, dstart, _ = cp._documents(args[5], N)
    first = torch.arange(N, dtype=torch.int32) == dstart
    assert first.any() and bool((got[1][first] == 1).all()) and bool((got[0][first] == 0).all())


@pytest.mark.parametrize("block_m,block_n", [(32, 16), (16, 32)])
def test_unequal_tiles(monkeypatch, block_m, block_n):
    """BLOCK_M ≠ BLOCK_N: the key range of a query tile and the query range of a key tile are tiled
    with the other size."""
    monkeypatch.setitem(cp.TILES, "interpreter", dict(BLOCK_M=block_m, BLOCK_N=block_n, num_warps=1, num_stages=1))
    N, d, band, cu, dtype = CASES[0]
    args = _inputs(N, d, cu, dtype, seed=3)
    got = _values_and_grads(cp.copy_pointer_triton, *args, band)
    want = _values_and_grads(cp.copy_pointer_portable, *args, band)
    _assert_matches_twin(got, want, dtype)


def test_worked_example_through_the_kernels():
    """PR #379's worked example (N = 8, d = 4, L = 4; s = 2 on even keys, 0 on odd; s0 = 1); d = 4 runs
    in a 16-wide tile."""
    x = torch.tensor([50256, 11, 12, 11, 13, 50256, 11, 11], dtype=torch.int32)
    y = torch.tensor([11, 12, 11, 13, 50256, 11, 11, 11])
    q = torch.ones(8, 4)
    k = torch.tensor([[1.0, 1, 1, 1] if j % 2 == 0 else [1.0, -1, 1, -1] for j in range(8)])
    p_copy, a_sink = cp.copy_pointer_triton(q, k, torch.full((4,), 0.5), x, y, torch.tensor([0, 5, 8, 8]), 4)
    assert p_copy.tolist() == pytest.approx([0, 0, 0.09003, 0, 0.37900, 0, 0, 0.66524], abs=1e-5)
    assert a_sink.tolist() == pytest.approx([1, 0.26894, 0.24473, 0.14696, 0.13942, 1, 0.73106, 0.24473], abs=1e-5)
    e = math.e
    assert a_sink[4].item() == pytest.approx(e / (e + 2 * e * e + 2), rel=1e-6)


def test_documents_on_the_device():
    """doc, dstart (last entry <= i, 0 if none) and dend (first entry > i, N if none), with a repeated 0,
    an empty document, an entry past N and trailing padding."""
    doc, dstart, dend = cp._documents(torch.tensor([0, 0, 3, 3, 6, 20, 20], dtype=torch.int32), 8)
    assert doc.dtype == dstart.dtype == dend.dtype == torch.int32
    assert doc.tolist() == cp.pointer_documents(torch.tensor([0, 0, 3, 3, 6, 20, 20]), 8).tolist()
    assert dstart.tolist() == [0, 0, 0, 3, 3, 3, 6, 6]
    assert dend.tolist() == [3, 3, 3, 6, 6, 6, 8, 8]
    doc, dstart, dend = cp._documents(torch.tensor([2, 5], dtype=torch.int32), 6)  # no entry <= 0, 1
    assert dstart.tolist() == [0, 0, 2, 2, 2, 5] and dend.tolist() == [2, 2, 5, 5, 5, 6]


def test_dispatch_follows_the_backend(monkeypatch):
    calls = []
    kernel = cp.copy_pointer_triton
    monkeypatch.setattr(cp, "copy_pointer_triton", lambda *a: calls.append("triton") or kernel(*a))
    args = _inputs(40, 16, [0, 17, 40], torch.float32)
    results = {}
    for on_triton in (False, True):
        with use_backend(triton=on_triton):
            results[on_triton] = cp.copy_pointer(*args, 16)
    assert calls == ["triton"]  # once, and only under triton=True
    for got, want in zip(results[True], results[False]):
        torch.testing.assert_close(got, want, rtol=0, atol=2e-6)


def test_no_host_sync_forward_and_backward():
    """The op runs inside the compiled, captured step: no .item(), no data-dependent shape, the document
    bounds included (runtime/sync_check.py's CPU check, what set_sync_debug_mode("error") is on a GPU)."""
    q, k, k_sink, inputs, targets, cu = _inputs(40, 16, [0, 17, 40, 40], torch.bfloat16)
    leaves = [t.requires_grad_() for t in (q, k, k_sink)]
    with sync_check("cpu"):
        p_copy, a_sink = cp.copy_pointer_triton(*leaves, inputs, targets, cu, 16)
        (p_copy.sum() + 0.5 * a_sink.sum()).backward()
    assert all(t.grad is not None for t in leaves)


def test_bad_inputs_name_the_tensor():
    q, k, k_sink, inputs, targets, cu = _inputs(8, 16, [0, 8], torch.float32)
    for fn in (cp.copy_pointer_triton, cp.copy_pointer_portable):
        name = fn.__name__
        with pytest.raises(ValueError, match=rf"{name}: q, k must be \[N, d\].*\(8, 16\), \(8, 8\)"):
            fn(q, k[:, :8], k_sink, inputs, targets, cu, 4)
        with pytest.raises(ValueError, match=rf"{name}: q, k must be .* \(16,\), \(7,\)"):
            fn(q, k, k_sink, inputs[:7], targets, cu, 4)
        with pytest.raises(ValueError, match=rf"{name}: band must be a positive token count, got 0"):
            fn(q, k, k_sink, inputs, targets, cu, 0)
        with pytest.raises(ValueError, match=rf"{name}: q must be \[N, d\], got \(8,\)"):
            fn(q[:, 0], k, k_sink, inputs, targets, cu, 4)


def test_empty_batch():
    q, k, k_sink, inputs, targets, cu = _inputs(0, 16, [0, 0], torch.float32)
    p_copy, a_sink = cp.copy_pointer_triton(q, k, k_sink, inputs, targets, cu, 16)
    assert p_copy.shape == a_sink.shape == (0,)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_kernels_on_gpu_at_the_record_width_and_band(dtype):
    """The GPU tiles (64 × 64, d = 128) at the training band L = 2048 with a ragged N (3 blocks, the last
    partial), documents crossing both block boundaries, against the twin on the same GPU."""
    N, d, band = 5000, 128, 2048
    args = [t.cuda() for t in _inputs(N, d, [0, 700, 1900, 4500, 4600, N, N], dtype, seed=7, vocab=50)]
    args[0], args[1] = args[0] * 3, args[1] * 3  # peaked softmaxes, as QK-normed and gained q·k gives
    got = _values_and_grads(cp.copy_pointer_triton, *args, band)
    want = _values_and_grads(cp.copy_pointer_portable, *args, band)
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=2e-5)  # GPU exp is approximate
    torch.testing.assert_close(got[1], want[1], rtol=0, atol=2e-5)
    for g, w in zip(got[2:], want[2:]):
        if dtype == torch.float32:  # UPCAST: IEEE fp32 dots
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5 * w.abs().max().item())
        else:  # ∂L/∂s is rounded to bf16 before each tile product (PR #379): bf16-level error, not a few ulps
            torch.testing.assert_close(g.float(), w.float(), rtol=0, atol=2 ** -6 * w.abs().max().item())
