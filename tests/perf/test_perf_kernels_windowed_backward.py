"""PR #371's restricted attention backward in Triton (perf/kernels/windowed_backward.py) against its definition,
`windowed_attention_backward` (perf/windowed_backward.py), under the interpreter: fp32 and bf16, several
segments and padding, ragged n, mixed head windows, d_qk != d_v, strided inputs; the exact gradient when
every head is full; the paired stream layout through the dispatcher; the head table read on the device
(refilled in place, no host sync). Small shapes: the interpreter runs every tile in Python."""
import inspect

import pytest
import torch

from perf.attention_backends import _stream_layout, sdpa_varlen_attention
from perf.backend import use_backend
from perf.kernels import windowed_backward as wb
from perf.windowed_backward import (varlen_attention_lse, windowed_attention_backward, windowed_attention_backward_fast,
                                    windowed_attention_forward)
from runtime.sync_check import sync_check
from tools.gpu_check import ulp_distance

pytestmark = pytest.mark.triton

SCALE = 0.35

# (n, H, d_qk, d_v, cu_seqlens, window, codes, dtype). The interpreter's tiles are 16 × 16 (wb.TILES), so
# every case crosses several query and key tiles and ends in a ragged one (n not a multiple of 16).
CASES = [
    # two segments (the second crossing two tile boundaries) and a padding entry; codes: full, 0 (the
    # diagonal only), a window shorter than a tile, one tile + 1 (a key tile's last key reaches exactly
    # the first query of a tile two on), and one past both segments' lengths (as full: W is beyond them)
    (45, 5, 16, 32, [0, 12, 45, 45], 40, [-1, 0, 3, 17, 40], torch.float32),
    # three segments, padding, d_qk = 24 (not a power of two: masked columns) > d_v = 16; a window of
    # exactly one tile (a query tile's first row reaches exactly a key tile's first key), and a code
    # above the launch window (clamped to it)
    (50, 3, 24, 16, [0, 7, 30, 50, 50], 20, [16, -1, 100], torch.float32),
    (45, 5, 16, 32, [0, 12, 45, 45], 40, [-1, 0, 3, 17, 40], torch.bfloat16),
    (50, 3, 24, 16, [0, 7, 30, 50, 50], 20, [16, -1, 100], torch.bfloat16),
]


def _inputs(n, H, d_qk, d_v, cu, window, dtype, seed=0):
    """q, k, v, out, lse, d_out, cu_seqlens: out and lse from the full-window forward in fp32 (the
    definition's), then q, k, v, out, d_out cast to dtype (lse stays fp32, as FA3's)."""
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(n, H, d_qk, generator=gen) for _ in range(2))
    v, d_out = (torch.randn(n, H, d_v, generator=gen) for _ in range(2))
    cu = torch.tensor(cu, dtype=torch.int32)
    q, k, v, d_out = (t.to(dtype).float() for t in (q, k, v, d_out))  # the values dtype can hold
    out, lse = windowed_attention_forward(q, k, v, cu, SCALE, window)
    return [t.to(dtype) for t in (q, k, v, out)] + [lse, d_out.to(dtype), cu]


def _assert_matches(got, want, dtype):
    for name, g, w in zip("qkv", got, want):
        assert g.dtype == w.dtype == dtype and g.shape == w.shape and g.is_contiguous(), name
        if dtype == torch.float32:  # IEEE fp32 dots, summed in another order
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5 * w.abs().max().item(), msg=f"d{name}")
        else:  # both round one fp32 accumulation to bf16 (the interpreter truncates): <= 1 bf16 ulp
            assert ulp_distance(g, w, atol=1e-5 * w.float().abs().max().item()) <= 1.0, f"d{name}"


@pytest.mark.parametrize("n,H,d_qk,d_v,cu,window,codes,dtype", CASES)
def test_kernels_match_the_definition(n, H, d_qk, d_v, cu, window, codes, dtype):
    q, k, v, out, lse, d_out, cu = _inputs(n, H, d_qk, d_v, cu, window, dtype, seed=n)
    table = torch.tensor(codes, dtype=torch.int32)
    got = wb.windowed_attention_backward_triton(q, k, v, out, lse, d_out, cu, SCALE, window, table)
    want = windowed_attention_backward(q, k, v, out, lse, d_out, cu, SCALE, window, table)
    _assert_matches(got, want, dtype)
    if 0 in codes:  # w = 0 keeps P_jj only: dV_j = P_jj·dO_j exactly where the definition says
        h = codes.index(0)
        p = torch.exp(SCALE * (q[:, h].float() * k[:, h].float()).sum(-1) - lse[h])[:, None]
        torch.testing.assert_close(got[2][:, h].float(), p * d_out[:, h].float(), rtol=1e-5, atol=1e-2)


@pytest.mark.parametrize("block_m,block_n", [(32, 16), (16, 32)])
def test_unequal_tiles(monkeypatch, block_m, block_n):
    """BLOCK_M != BLOCK_N, as on the GPU's paired layers (64 × 128): each kernel tiles the other side with
    the other size, and the dq kernel's first key tile is rounded down to BLOCK_N."""
    monkeypatch.setitem(wb.TILES, "interpreter", dict(BLOCK_M=block_m, BLOCK_N=block_n, num_warps=1, num_stages=1))
    n, H, d_qk, d_v, cu, window, codes, dtype = CASES[1]
    q, k, v, out, lse, d_out, cu = _inputs(n, H, d_qk, d_v, cu, window, dtype, seed=3)
    table = torch.tensor([5, -1, 20], dtype=torch.int32)
    got = wb.windowed_attention_backward_triton(q, k, v, out, lse, d_out, cu, SCALE, window, table)
    _assert_matches(got, windowed_attention_backward(q, k, v, out, lse, d_out, cu, SCALE, window, table), dtype)


def test_all_full_is_the_stock_gradient():
    """Every code −1: the exact attention gradient, autograd of `sdpa_varlen_attention` (out and LSE its
    forward's, as FA3's forward hands them over)."""
    n, H, window = 41, 2, 9
    gen = torch.Generator().manual_seed(11)
    q, k = (torch.randn(n, H, 16, generator=gen) for _ in range(2))
    v, d_out = (torch.randn(n, H, 32, generator=gen) for _ in range(2))
    cu = torch.tensor([0, 13, 14, 41, 41], dtype=torch.int32)  # a one-position segment among them
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = sdpa_varlen_attention(*leaves, cu, window, SCALE)
    want = torch.autograd.grad(out, leaves, d_out)
    lse = varlen_attention_lse(q, k, cu, SCALE, window)
    got = wb.windowed_attention_backward_triton(q, k, v, out.detach(), lse, d_out, cu, SCALE, window,
                                                torch.full((H,), -1, dtype=torch.int32))
    for name, a, b in zip("qkv", got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=f"d{name}")


def test_paired_stream_layout_through_the_dispatcher(monkeypatch):
    """The model's [T, 6, d] paired heads as FA3's [2T, 3, d] stream (positions 2t, 2t + 1, segments
    doubled), d_qk 16 / d_v 32 as the record's 64/128: `windowed_attention_backward_fast` runs the kernels
    under triton=True (once) and the definition otherwise, and both agree."""
    T, H, window = 20, 6, 10
    gen = torch.Generator().manual_seed(5)
    q, k = (torch.randn(T, H, 16, generator=gen) for _ in range(2))
    v, g = (torch.randn(T, H, 32, generator=gen) for _ in range(2))
    q, k, v, cu = _stream_layout(q, k, v, torch.tensor([0, 8, 20], dtype=torch.int32), paired=True)
    d_out = g.reshape(2 * T, H // 2, 32)
    out, lse = windowed_attention_forward(q, k, v, cu, SCALE, window)
    table = torch.tensor([3, -1, 0], dtype=torch.int32)  # one code per stream head (model heads h', h' + 3)
    calls = []
    kernel = wb.windowed_attention_backward_triton
    monkeypatch.setattr("perf.windowed_backward.windowed_attention_backward_triton",
                        lambda *a: calls.append("triton") or kernel(*a))
    results = {}
    for on_triton in (False, True):
        with use_backend(triton=on_triton):
            results[on_triton] = windowed_attention_backward_fast(q, k, v, out, lse, d_out, cu, SCALE, window, table)
    assert calls == ["triton"]
    _assert_matches(results[True], results[False], torch.float32)
    assert results[True][0].shape == (2 * T, 3, 16)


def test_strided_inputs_are_read_in_place():
    """q and k as slices of a fused [n, H, 2·d] buffer, lse a slice of a wider [H, n + 5] buffer: strides
    as given (no copy needed), the same gradients as from contiguous copies."""
    n, H, d_qk, d_v, cu, window, codes, dtype = CASES[0]
    q, k, v, out, lse, d_out, cu = _inputs(n, H, d_qk, d_v, cu, window, dtype, seed=9)
    qk = torch.cat([q, k], dim=-1)  # (n, H, 2·d_qk)
    wide_lse = torch.zeros(H, n + 5)
    wide_lse[:, :n] = lse
    table = torch.tensor(codes, dtype=torch.int32)
    strided = (qk[..., :d_qk], qk[..., d_qk:], v, out, wide_lse[:, :n], d_out)
    assert not strided[0].is_contiguous() and not strided[4].is_contiguous()
    got = wb.windowed_attention_backward_triton(*strided, cu, SCALE, window, table)
    want = wb.windowed_attention_backward_triton(q, k, v, out, lse, d_out, cu, SCALE, window, table)
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def test_the_table_is_read_on_the_device_when_the_kernels_run(monkeypatch):
    """The table refilled in place between two calls (as the calibration does at step 593, after capture):
    the second call runs the new codes. The launches get the table tensor itself (its storage), and no
    launch argument is a Python number taken from it: a replayed graph reads the codes of replay time."""
    n, H, d_qk, d_v, cu, window, _, dtype = CASES[0]
    q, k, v, out, lse, d_out, cu = _inputs(n, H, d_qk, d_v, cu, window, dtype, seed=2)
    table = torch.full((H,), -1, dtype=torch.int32)
    launched = []
    for name in ("_dkdv_kernel", "_dq_kernel"):
        kernel = getattr(wb, name)

        class Spy:
            def __getitem__(self, grid, kernel=kernel):
                def launch(*args, **kwargs):
                    launched.append(args)
                    return kernel[grid](*args, **kwargs)
                return launch

        monkeypatch.setattr(wb, name, Spy())
    before = wb.windowed_attention_backward_triton(q, k, v, out, lse, d_out, cu, SCALE, window, table)
    table.copy_(torch.tensor([2, -1, 0, 7, 17], dtype=torch.int32))
    after = wb.windowed_attention_backward_triton(q, k, v, out, lse, d_out, cu, SCALE, window, table)
    _assert_matches(after, windowed_attention_backward(q, k, v, out, lse, d_out, cu, SCALE, window, table), dtype)
    assert not torch.equal(before[0], after[0])
    assert len(launched) == 4  # dk/dv and dq, twice
    host_numbers = [[a for a in args if not torch.is_tensor(a)] for args in launched]
    assert host_numbers[:2] == host_numbers[2:]  # the same n, window and strides: none came from the codes
    for args in launched:
        assert any(a is table for a in args)  # the table's storage, not a copy of its values


def test_no_host_sync():
    """No .item(), no data-dependent shape, the segment bounds included (runtime/sync_check.py's CPU check,
    what set_sync_debug_mode("error") is on a GPU)."""
    n, H, d_qk, d_v, cu, window, codes, dtype = CASES[1]
    q, k, v, out, lse, d_out, cu = _inputs(n, H, d_qk, d_v, cu, window, dtype, seed=4)
    table = torch.tensor(codes, dtype=torch.int32)
    with use_backend(host_checks=False, triton=True), sync_check("cpu"):
        windowed_attention_backward_fast(q, k, v, out, lse, d_out, cu, SCALE, window, table)


def test_signature_and_errors_are_the_definitions():
    assert inspect.signature(wb.windowed_attention_backward_triton) == inspect.signature(windowed_attention_backward)
    assert inspect.signature(windowed_attention_backward_fast) == inspect.signature(windowed_attention_backward)
    q, k, v, out, lse, d_out, cu = _inputs(16, 3, 16, 16, [0, 16], 5, torch.float32)
    fn = wb.windowed_attention_backward_triton
    with pytest.raises(ValueError, match="head_windows"):
        fn(q, k, v, out, lse, d_out, cu, SCALE, 5, torch.full((6,), -1, dtype=torch.int32))
    with pytest.raises(ValueError, match="lse"):
        fn(q, k, v, out, lse.T, d_out, cu, SCALE, 5, torch.full((3,), -1, dtype=torch.int32))
    with pytest.raises(TypeError, match="int32"):
        fn(q, k, v, out, lse, d_out, cu, SCALE, 5, torch.full((3,), -1))
    n = 2 ** 30  # [n, 1, 2]: 2^31 elements, past int32 offsets (meta tensors: shapes and strides, no memory)
    big = [torch.empty(n, 1, 2, device="meta") for _ in range(5)]
    with pytest.raises(ValueError, match="int32 offsets"):
        fn(*big[:4], torch.empty(1, n, device="meta"), big[4], torch.tensor([0, n], dtype=torch.int32), SCALE, 5,
           torch.full((1,), -1, dtype=torch.int32))
    with pytest.raises(TypeError, match="bf16, fp16 or fp32"):
        fn(*(t.double() for t in (q, k, v, out)), lse, d_out.double(), cu, SCALE, 5,
           torch.full((3,), -1, dtype=torch.int32))


def test_empty_batch():
    q, k, v, out, d_out = (torch.zeros(0, 2, 16) for _ in range(5))
    cu = torch.tensor([0, 0], dtype=torch.int32)
    got = wb.windowed_attention_backward_triton(q, k, v, out, torch.zeros(2, 0), d_out, cu, SCALE, 5,
                                                torch.full((2,), -1, dtype=torch.int32))
    assert [t.shape for t in got] == [(0, 2, 16)] * 3


def test_segment_bounds():
    """id (entries <= i), start (the last entry <= i) and end (the first entry > i), with a repeated entry
    (an empty segment) and trailing padding."""
    seg, start, end = wb.segment_bounds(torch.tensor([0, 3, 3, 6, 8, 8], dtype=torch.int32), 8)
    assert seg.dtype == start.dtype == end.dtype == torch.int32
    assert seg.tolist() == [1, 1, 1, 3, 3, 3, 4, 4]
    assert start.tolist() == [0, 0, 0, 3, 3, 3, 6, 6] and end.tolist() == [3, 3, 3, 6, 6, 6, 8, 8]


# The record's two head shapes (stream layout, PR #371's eligible layers) and typical calibrated codes
# (certify run 01): paired layers 3 heads 64/128, layers 1 and 8 six heads 64/64; W = 384 (stage 1).
RECORD_SHAPES = [
    (3, 64, 128, [128, 64, 256]),  # layer 0 (paired: windows in interleaved positions)
    (6, 64, 64, [-1, -1, 128, 128, -1, 256]),  # layer 1
]


@pytest.mark.gpu
@pytest.mark.parametrize("H,d_qk,d_v,codes", RECORD_SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_record_shapes_on_gpu(H, d_qk, d_v, codes, dtype):
    """The GPU tiles at the record's head shapes and window (n = 16,384 stream positions, a quarter of a
    rank's paired batch), documents of many lengths, calibrated and all-full tables, against the
    definition on the same GPU: fp32 tight, bf16 within PR #371's own check (0.008 relative, norm-wise)."""
    n, window = 16384, 384
    gen = torch.Generator().manual_seed(0)
    ends = torch.cumsum(torch.randint(20, 3000, (40,), generator=gen), 0)
    cu = torch.cat([torch.zeros(1, dtype=torch.long), ends[ends < n], torch.full((3,), n)]).int().cuda()
    q, k = (torch.randn(n, H, d_qk, generator=gen).cuda() for _ in range(2))
    v, d_out = (torch.randn(n, H, d_v, generator=gen).cuda() for _ in range(2))
    q, k = q * 1.5, k * 1.5  # peaked softmaxes, as QK-normed and gained scores give
    q, k, v, d_out = (t.to(dtype).float() for t in (q, k, v, d_out))
    out, lse = windowed_attention_forward(q, k, v, cu, d_qk ** -0.5, window)
    args = [t.to(dtype) for t in (q, k, v, out)] + [lse, d_out.to(dtype), cu, d_qk ** -0.5, window]
    for table in (codes, [-1] * H):
        table = torch.tensor(table, dtype=torch.int32, device="cuda")
        want = windowed_attention_backward(*[t.float() if torch.is_tensor(t) and t.is_floating_point() else t
                                             for t in args], table)
        got = wb.windowed_attention_backward_triton(*args, table)
        torch.cuda.synchronize()
        for name, g, w in zip("qkv", got, want):
            assert g.dtype == dtype, name
            if dtype == torch.float32:  # UPCAST: IEEE fp32 dots
                torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5 * w.abs().max().item(), msg=f"d{name}")
            else:  # P and dS rounded to bf16 before their GEMMs (FA2/FA3): bf16-level error
                rel = ((g.float() - w).norm(dim=(0, 2)) / w.norm(dim=(0, 2)).clamp_min(1e-30)).max().item()
                assert rel < 0.008, (name, rel)
