"""perf/windowed_backward.py: the restricted backward of PR #371 against a brute-force loop of its formula,
the exact gradient (autograd of sdpa_varlen_attention) when every head is full, and the edge windows."""
import math

import pytest
import torch

from perf.attention_backends import sdpa_varlen_attention
from perf.backend import use_backend
from perf.windowed_backward import (effective_windows, windowed_attention_backward, windowed_attention_forward,
                                    windowed_backward_attention)
from runtime.sync_check import sync_check


def _segment_of(cu: list[int]):
    return lambda t: max(d for d in range(len(cu) - 1) if cu[d] <= t)


def _brute_force(q, k, v, d_out, cu, scale, window, codes):
    """Loops over (head, query, key) of the formula, float64: the forward (full window W) gives O and LSE;
    the backward keeps 0 <= i − j <= w_h, w_h = W for a code < 0, else min(code, W)."""
    q, k, v, d_out = (t.double() for t in (q, k, v, d_out))
    n, H, _ = q.shape
    seg = _segment_of(cu)
    out, lse = torch.zeros(n, H, v.shape[-1], dtype=torch.float64), torch.zeros(H, n, dtype=torch.float64)
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for h in range(H):
        w_h = window if codes[h] < 0 else min(codes[h], window)
        for i in range(n):
            keys = [j for j in range(n) if seg(j) == seg(i) and 0 <= i - j <= window]
            logits = {j: scale * float(q[i, h] @ k[j, h]) for j in keys}
            lse[h, i] = math.log(sum(math.exp(s) for s in logits.values()))
            for j in keys:
                out[i, h] += math.exp(logits[j] - lse[h, i]) * v[j, h]
        for i in range(n):
            D = float(d_out[i, h] @ out[i, h])
            for j in range(n):
                if seg(j) != seg(i) or not 0 <= i - j <= w_h:
                    continue
                p = math.exp(scale * float(q[i, h] @ k[j, h]) - lse[h, i])
                dv[j, h] += p * d_out[i, h]
                ds = p * (float(d_out[i, h] @ v[j, h]) - D)
                dq[i, h] += scale * ds * k[j, h]
                dk[j, h] += scale * ds * q[i, h]
    return out, lse, (dq, dk, dv)


def _inputs(n, H, dqk, dv, seed, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(n, H, d, generator=gen).to(dtype) for d in (dqk, dqk, dv, dv)]  # q, k, v, d_out


CU = [0, 9, 16, 16]  # two documents of 9 and 7 positions, one padding entry
SCALE = 0.4


@pytest.mark.parametrize("chunk", [2048, 4])  # one tile, and tiles that cut documents and windows
@pytest.mark.parametrize("codes", [[2, -1, 0], [5, 3, 1000]])  # mixed windows, one full; 0; a code > W
def test_restricted_backward_matches_the_loop(chunk, codes):
    window = 5
    q, k, v, d_out = _inputs(16, 3, 4, 6, seed=len(codes) + codes[0])  # d_qk != d_v, as on layers 0, 2, 5
    cu = torch.tensor(CU, dtype=torch.int32)
    want_out, want_lse, want = _brute_force(q, k, v, d_out, CU, SCALE, window, codes)
    out, lse = windowed_attention_forward(q, k, v, cu, SCALE, window, chunk=chunk)
    torch.testing.assert_close(out, want_out, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(lse, want_lse, rtol=1e-10, atol=1e-10)
    table = torch.tensor(codes, dtype=torch.int32)
    got = windowed_attention_backward(q, k, v, out, lse, d_out, cu, SCALE, window, table, chunk=chunk)
    for name, g, w in zip("qkv", got, want):
        assert g.dtype == torch.float64 and g.shape == w.shape and g.is_contiguous(), name
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-10, msg=f"d{name}")


def test_effective_windows():
    codes = torch.tensor([-1, 0, 64, 128, 384, 1000], dtype=torch.int32)
    assert effective_windows(codes, 384).tolist() == [384, 0, 64, 128, 384, 384]


@pytest.mark.parametrize("paired", [False, True])
@pytest.mark.parametrize("chunk", [2048, 7])
def test_all_full_is_the_exact_gradient_of_sdpa(paired, chunk):
    """Every head −1: the forward is sdpa_varlen_attention's bitwise and the backward its autograd's."""
    T, H, window = 40, 6, 9
    q, k, v, g = _inputs(T, H, 8, 16, seed=3, dtype=torch.float32)
    cu = torch.tensor([0, 11, 12, 30, 40, 40], dtype=torch.int32)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    want_y = sdpa_varlen_attention(*leaves, cu, window, SCALE, paired=paired)
    want = torch.autograd.grad(want_y, leaves, g)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    table = torch.full((H // 2 if paired else H,), -1, dtype=torch.int32)
    y = windowed_backward_attention(*leaves, cu, window, SCALE, table, paired=paired, chunk=chunk)
    assert torch.equal(y, sdpa_varlen_attention(q, k, v, cu, window, SCALE, paired=paired, chunk=chunk))
    got = torch.autograd.grad(y, leaves, g)
    for name, a, b in zip("qkv", got, want):
        assert a.shape == b.shape and a.dtype == b.dtype, name
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=f"d{name}")


def test_paired_layout_maps_heads_to_stream_heads():
    """Paired: FA3's [2T, 3, d] view; the table's entry h' shortens the model's heads h' and h' + 3 (one
    attention stream), in interleaved positions. The autograd wrapper equals the stream-layout call."""
    T, H, window = 12, 6, 6
    q, k, v, g = _inputs(T, H, 4, 8, seed=8)
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    codes = [1, -1, 3]
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    y = windowed_backward_attention(*leaves, cu, window, SCALE, torch.tensor(codes, dtype=torch.int32), paired=True)
    got = torch.autograd.grad(y, leaves, g)
    stream = [t.reshape(2 * T, H // 2, t.shape[-1]) for t in (q, k, v, g)]  # position 2t + h // 3, head h % 3
    _, _, want = _brute_force(*stream, [2 * c for c in cu.tolist()], SCALE, window, codes)
    for name, a, b in zip("qkv", got, want):
        torch.testing.assert_close(a, b.reshape(a.shape), rtol=1e-10, atol=1e-10, msg=f"d{name}")
    # the model's head 4 is stream head 1 (full): its gradient is the exact one
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    exact = torch.autograd.grad(sdpa_varlen_attention(*leaves, cu, window, SCALE, paired=True), leaves, g)
    for a, b in zip(got, exact):
        torch.testing.assert_close(a[:, [1, 4]], b[:, [1, 4]], rtol=1e-10, atol=1e-10)
        assert not torch.allclose(a[:, [0, 3]], b[:, [0, 3]])  # stream head 0 is shortened to 1


def test_window_zero_keeps_only_the_diagonal():
    """w = 0: P_ii only, so dV_i = P_ii·dO_i, dQ_i = s·P_ii·(dO_i·v_i − D_i)·k_i, dK_i = s·(same)·q_i."""
    q, k, v, d_out = _inputs(16, 2, 4, 6, seed=4)
    cu = torch.tensor(CU, dtype=torch.int32)
    out, lse = windowed_attention_forward(q, k, v, cu, SCALE, 5)
    dq, dk, dv = windowed_attention_backward(q, k, v, out, lse, d_out, cu, SCALE, 5, torch.zeros(2, dtype=torch.int32))
    p = torch.exp(SCALE * (q * k).sum(-1) - lse.T)[..., None]  # (n, H, 1)
    ds = p * ((d_out * v).sum(-1) - (d_out * out).sum(-1))[..., None]
    torch.testing.assert_close(dv, p * d_out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(dq, SCALE * ds * k, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(dk, SCALE * ds * q, rtol=1e-12, atol=1e-12)


def test_a_window_at_least_the_segment_length_is_full():
    """Codes >= the longest document's largest distance (9 positions: 8) under a launch window beyond it
    keep the same pairs as full: bitwise the same gradients."""
    q, k, v, d_out = _inputs(16, 3, 4, 6, seed=5, dtype=torch.float32)
    cu, window = torch.tensor(CU, dtype=torch.int32), 20
    out, lse = windowed_attention_forward(q, k, v, cu, SCALE, window)
    run = lambda codes: windowed_attention_backward(q, k, v, out, lse, d_out, cu, SCALE, window,  # noqa: E731
                                                    torch.tensor(codes, dtype=torch.int32))
    for a, b in zip(run([8, 9, 12]), run([-1, -1, -1])):
        assert torch.equal(a, b)
    shorter = run([7, -1, -1])  # the pair (8, 0) of the 9-long document dropped: head 0 changes, no other
    for a, b in zip(shorter, run([-1, -1, -1])):
        assert not torch.equal(a[:, 0], b[:, 0]) and torch.equal(a[:, 1:], b[:, 1:])


def test_bf16_inputs_give_bf16_gradients_near_fp32():
    q, k, v, d_out = _inputs(40, 3, 8, 16, seed=6, dtype=torch.float32)
    cu, table = torch.tensor([0, 25, 40], dtype=torch.int32), torch.tensor([3, -1, 7], dtype=torch.int32)
    out, lse = windowed_attention_forward(q, k, v, cu, SCALE, 12)
    want = windowed_attention_backward(q, k, v, out, lse, d_out, cu, SCALE, 12, table)
    bf = [t.bfloat16() for t in (q, k, v, out)]
    got = windowed_attention_backward(*bf, lse, d_out.bfloat16(), cu, SCALE, 12, table)
    for a, b in zip(got, want):
        assert a.dtype == torch.bfloat16
        torch.testing.assert_close(a.float(), b, rtol=0.05, atol=0.05)


def test_no_host_sync_reads_the_head_table():
    """The table is read by device ops only: forward and backward pass the CPU sync check."""
    q, k, v, g = _inputs(24, 6, 4, 8, seed=7, dtype=torch.float32)
    cu, table = torch.tensor([0, 10, 24, 24], dtype=torch.int32), torch.tensor([2, -1, 5], dtype=torch.int32)
    leaves = [t.requires_grad_() for t in (q, k, v)]
    with use_backend(host_checks=False), sync_check("cpu"):
        y = windowed_backward_attention(*leaves, cu, 8, SCALE, table, paired=True)
        torch.autograd.grad(y, leaves, g)


def test_bad_shapes_are_refused():
    q, k, v, d_out = _inputs(16, 3, 4, 6, seed=0, dtype=torch.float32)
    cu = torch.tensor(CU, dtype=torch.int32)
    out, lse = windowed_attention_forward(q, k, v, cu, SCALE, 5)
    with pytest.raises(ValueError, match="head_windows"):
        windowed_attention_backward(q, k, v, out, lse, d_out, cu, SCALE, 5, torch.full((6,), -1, dtype=torch.int32))
    with pytest.raises(ValueError, match="lse"):
        windowed_attention_backward(q, k, v, out, lse.T, d_out, cu, SCALE, 5, torch.full((3,), -1, dtype=torch.int32))
    with pytest.raises(TypeError, match="int32"):
        windowed_attention_backward(q, k, v, out, lse, d_out, cu, SCALE, 5, torch.full((3,), -1))


def test_compiled_fullgraph_reads_the_table_at_run_time():
    """torch.compile (aot_eager: the graphs a GPU run traces) takes the op whole, forward and backward, and
    the table stays an input: refilled in place after compiling (as finish() does at step 593), the same
    compiled graph runs the new windows."""
    q, k, v, g = _inputs(24, 6, 4, 8, seed=9, dtype=torch.float32)
    cu, table = torch.tensor([0, 10, 24, 24], dtype=torch.int32), torch.full((3,), -1, dtype=torch.int32)

    def eager(codes):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        y = windowed_backward_attention(*leaves, cu, 8, SCALE, torch.tensor(codes, dtype=torch.int32), paired=True)
        return torch.autograd.grad(y, leaves, g)

    from torch._dynamo.testing import CompileCounterWithBackend

    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(lambda q, k, v: windowed_backward_attention(q, k, v, cu, 8, SCALE, table, paired=True),
                             backend=counter, fullgraph=True, dynamic=False)
    for codes in ([-1, -1, -1], [2, -1, 0]):
        table.copy_(torch.tensor(codes, dtype=torch.int32))
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        got = torch.autograd.grad(compiled(*leaves), leaves, g)
        for a, b in zip(got, eager(codes)):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    assert counter.frame_count == 1  # one graph: the new codes did not recompile it


def _paired_layer(T, H, cut, seed):
    """A paired layer's leaves q, k [T, H, 8], v [T, H, 16] (requiring grad), two documents cut at `cut`,
    an all-full table of H/2 stream heads, and an output gradient [T, H, 16]."""
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(T, H, 8, generator=g).requires_grad_() for _ in range(2))
    v = torch.randn(T, H, 16, generator=g).requires_grad_()
    cu = torch.tensor([0, cut, T, T], dtype=torch.int32)
    return q, k, v, cu, torch.full((H // 2,), -1, dtype=torch.int32), torch.randn(T, H, 16, generator=g)


def test_the_restricted_backward_compiles_fullgraph_and_reads_its_table_at_run_time():
    """Mode 2 as the model calls it (`restricted_backward_attention`, paired), under torch.compile(fullgraph,
    aot_eager): one graph, the eager values, and a table rewritten in place after compiling (as the calibration
    writes it) changes the gradients without a recompile: the table is read on the device, not baked."""
    from perf.windowed_backward import restricted_backward_attention
    from torch._dynamo.testing import CompileCounter

    T, H, W = 256, 6, 96
    q, k, v, cu, table, _ = _paired_layer(T, H, cut=100, seed=0)

    def fn(q, k, v):
        return restricted_backward_attention(q, k, v, cu, W, 0.3, table, paired=True)

    from perf.backend import current
    current()  # the backend chosen before compiling, as a run does (its first read would be a guard that changes)
    counter = CompileCounter()
    compiled = torch.compile(fn, backend=aot_eager_counting(counter), fullgraph=True)
    grads = {}
    for codes in ((-1, -1, -1), (16, -1, 40)):
        table.copy_(torch.tensor(codes, dtype=torch.int32))
        y = compiled(q, k, v)
        got = torch.autograd.grad(y.square().sum(), (q, k, v))
        y_ref = fn(q, k, v)
        want = torch.autograd.grad(y_ref.square().sum(), (q, k, v))
        assert torch.equal(y, y_ref)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        grads[codes] = got
    assert counter.frame_count == 1  # one graph for both tables
    assert not torch.equal(grads[(-1, -1, -1)][0], grads[(16, -1, 40)][0])


def aot_eager_counting(counter):
    """aot_eager that counts the frames it compiles (torch._dynamo.testing.CompileCounter's count)."""
    from torch._dynamo.backends.debugging import aot_eager

    def backend(gm, example_inputs):
        counter(gm, example_inputs)
        return aot_eager(gm, example_inputs)
    return backend


class _NumericFA3:
    """A CPU FA3 for the op path: the portable forward (sdpa's output) and its LSE, returned as the build
    returns them: (out, lse) when asked with return_attn_probs=True, else out alone (or, `always_tuple`,
    both every time, as older builds)."""

    def __init__(self, with_flag: bool = True, always_tuple: bool = False):
        self.calls, self.with_flag, self.always_tuple = [], with_flag, always_tuple

    def _forward(self, q, k, v, cu_seqlens_q, max_seqlen_q, softmax_scale, window_size):
        self.calls.append((tuple(q.shape), max_seqlen_q, window_size))
        return windowed_attention_forward(q, k, v, cu_seqlens_q, softmax_scale, window_size[0])

    def flash_attn_varlen_func(self, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                               causal=False, softmax_scale=None, window_size=(-1, -1), return_attn_probs=False):
        out, lse = self._forward(q, k, v, cu_seqlens_q, max_seqlen_q, softmax_scale, window_size)
        return (out, lse) if return_attn_probs or self.always_tuple else out


class _NumericFA3WithoutFlag(_NumericFA3):
    def flash_attn_varlen_func(self, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                               causal=False, softmax_scale=None, window_size=(-1, -1)):
        out, lse = self._forward(q, k, v, cu_seqlens_q, max_seqlen_q, softmax_scale, window_size)
        return (out, lse) if self.always_tuple else out


@pytest.mark.parametrize("triton", [False, True])  # the backward op's definition, then its Triton kernels
def test_the_fa3_path_is_two_opaque_ops_with_fa3s_output_and_the_twins_gradients(monkeypatch, triton):
    """Mode 2 on the fa3 backend (`restricted_backward_attention` → `restricted_attention_op`), FA3 a numeric
    CPU stand-in: under torch.compile(fullgraph, aot_eager) the graph holds the two custom ops whole (FA3's
    forward with its LSE, the restricted backward), the output is bitwise FA3's mode-0 output, the gradients
    are the portable twin's (`windowed_backward_attention`), FA3 is called with the paired stream's doubled
    max_seqlen and the launch window, and a table rewritten after compiling is read at run time."""
    from perf import attention_backends
    from perf.attention_backends import fa3_varlen_attention
    from perf.windowed_backward import restricted_backward_attention
    from torch._dynamo.testing import CompileCounterWithBackend

    fa3 = _NumericFA3()
    monkeypatch.setattr(attention_backends, "_fa3_interface", fa3)
    T, H, W = 48, 6, 20
    q, k, v, cu, table, d_y = _paired_layer(T, H, cut=20, seed=3)
    with use_backend(attention="fa3", triton=triton, compile=True, compile_backend="aot_eager"):
        counter = CompileCounterWithBackend("aot_eager")
        compiled = torch.compile(lambda q, k, v: restricted_backward_attention(q, k, v, cu, W, SCALE, table, paired=True,
                                                                               max_seqlen=28),
                                 backend=counter, fullgraph=True, dynamic=False)
        for codes in ((-1, -1, -1), (6, -1, 0)):
            table.copy_(torch.tensor(codes, dtype=torch.int32))
            fa3.calls.clear()
            y = compiled(q, k, v)
            assert fa3.calls == [((2 * T, H // 2, 8), 56, (W, 0))]  # one FA3 call: stream layout, 2 × 28, (W, 0)
            got = torch.autograd.grad(y, (q, k, v), d_y)
            assert torch.equal(y, fa3_varlen_attention(q, k, v, cu, W, SCALE, paired=True, max_seqlen=28))
            y_twin = windowed_backward_attention(q, k, v, cu, W, SCALE, table, paired=True)
            want = torch.autograd.grad(y_twin, (q, k, v), d_y)
            for a, b in zip(got, want):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert counter.frame_count == 1
    ops = {str(node.target) for graph in counter.graphs for node in graph.graph.nodes if node.op == "call_function"}
    assert "speedrun.restricted_attention_fwd.default" in ops, ops  # FA3 and the Triton launches never traced


def test_the_fa3_path_takes_the_lse_from_either_kind_of_build_and_stops_without_one(monkeypatch):
    """The LSE comes from `return_attn_probs=True` where the build's signature has it, from the tuple older
    builds always return otherwise; a build that returns the output alone stops the step, saying why."""
    from perf import attention_backends
    from perf.windowed_backward import restricted_attention_op

    q, k, v, _ = _inputs(16, 3, 4, 6, seed=1, dtype=torch.float32)
    cu, table = torch.tensor(CU, dtype=torch.int32), torch.tensor([2, -1, 0], dtype=torch.int32)
    want = sdpa_varlen_attention(q, k, v, cu, 5, SCALE)
    with use_backend(attention="fa3"):
        for fa3 in (_NumericFA3(), _NumericFA3WithoutFlag(always_tuple=True)):
            monkeypatch.setattr(attention_backends, "_fa3_interface", fa3)
            assert torch.equal(restricted_attention_op(q, k, v, cu, 5, SCALE, table), want)
        monkeypatch.setattr(attention_backends, "_fa3_interface", _NumericFA3WithoutFlag())
        with pytest.raises(RuntimeError, match="flash_attn_varlen_func returned no softmax LSE"):
            restricted_attention_op(q, k, v, cu, 5, SCALE, table)


def test_the_restricted_ops_pass_torch_librarys_opcheck():
    """`torch.library.opcheck` on both ops: schema, fake kernels (shapes, dtypes, strides) against the real
    ones, and the autograd registration (forward op) — what torch.compile and AOT autograd rely on."""
    from perf.windowed_backward import restricted_attention_bwd, restricted_attention_fwd

    q, k, v, d_out = _inputs(16, 3, 4, 6, seed=2, dtype=torch.float32)
    cu, table = torch.tensor(CU, dtype=torch.int32), torch.tensor([2, -1, 0], dtype=torch.int32)
    torch.library.opcheck(restricted_attention_fwd, (q.requires_grad_(), k.requires_grad_(), v.requires_grad_(),
                                                     cu, table, 5, SCALE, 9))
    out, lse = windowed_attention_forward(q.detach(), k.detach(), v.detach(), cu, SCALE, 5)
    torch.library.opcheck(restricted_attention_bwd, (q.detach(), k.detach(), v.detach(), out, lse, d_out, cu, table,
                                                     5, SCALE))


@pytest.mark.gpu
def test_the_fa3_op_on_gpu_hands_over_fa3s_output_and_lse_and_runs_the_triton_backward():
    """The real FA3 (the pinned build) at record #360's paired widths (n = 8,192 stream positions, 3 heads,
    d_qk 64 / d_v 128, W = 384), bf16: the op's output is bitwise `fa3_varlen_attention`'s (PR #371: the
    forward unchanged), its LSE the definition's (`varlen_attention_lse`) to fp32 rounding, and the
    gradients through the op the definition's (fp32, on the same GPU) within PR #371's bf16 check."""
    from perf.attention_backends import fa3_varlen_attention, load_fa3
    from perf.windowed_backward import restricted_attention_fwd, varlen_attention_lse

    try:
        load_fa3()
    except RuntimeError as exc:  # no hub access on this machine: tools/gpu_check.py reports FA3 separately
        pytest.skip(f"FA3 not loadable: {exc}")
    T, H, window, scale = 4096, 6, 384, 0.12
    gen = torch.Generator().manual_seed(0)
    ends = torch.cumsum(torch.randint(50, 1500, (12,), generator=gen), 0)
    cu = torch.cat([torch.zeros(1, dtype=torch.long), ends[ends < T], torch.full((2,), T)]).int().cuda()
    q, k = ((1.5 * torch.randn(T, H, 64, generator=gen)).bfloat16().cuda().requires_grad_() for _ in range(2))
    v = torch.randn(T, H, 128, generator=gen).bfloat16().cuda().requires_grad_()
    d_y = torch.randn(T, H, 128, generator=gen).bfloat16().cuda()
    table = torch.tensor([64, -1, 256], dtype=torch.int32, device="cuda")
    max_seqlen = int((cu[1:] - cu[:-1]).max())
    with use_backend(attention="fa3", triton=True):
        from perf.windowed_backward import restricted_backward_attention
        y = restricted_backward_attention(q, k, v, cu, window, scale, table, paired=True, max_seqlen=max_seqlen)
        assert torch.equal(y, fa3_varlen_attention(q, k, v, cu, window, scale, paired=True, max_seqlen=max_seqlen))
        got = torch.autograd.grad(y, (q, k, v), d_y)
        qs, ks, vs = (t.detach().reshape(2 * T, H // 2, t.shape[-1]) for t in (q, k, v))
        out, lse = restricted_attention_fwd(qs, ks, vs, 2 * cu, table, window, scale, 2 * max_seqlen)
    want_lse = varlen_attention_lse(qs, ks, 2 * cu, scale, window)
    torch.testing.assert_close(lse, want_lse, rtol=1e-4, atol=1e-4)
    want = windowed_attention_backward(qs.float(), ks.float(), vs.float(), out.float(), want_lse,
                                       d_y.reshape(2 * T, H // 2, 128).float(), 2 * cu, scale, window, table)
    for name, g, w in zip("qkv", got, want):
        g = g.float().reshape(w.shape)
        rel = ((g - w).norm(dim=(0, 2)) / w.norm(dim=(0, 2)).clamp_min(1e-30)).max().item()
        assert rel < 0.008, (name, rel)
