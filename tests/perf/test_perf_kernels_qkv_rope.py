"""perf/kernels/qkv_rope.py: the fused QKV path is the unfused one bitwise on the portable backend,
and its three Triton kernels match their twins (Triton's interpreter) and a float64 reference.

Shapes are small and ragged: T not a multiple of the interpreter's BLOCK_T (4 or 8), head widths
not powers of two (masked BLOCK_D), odd head counts, paired and unpaired tables, the key offset on
and off. Tolerances (why):
  - kernel vs twin, bf16 q/k: ≤ 1 bf16 ulp (Σu² in another order: r one fp32 ulp off can move a
    rounding); g8: ≤ 1 e4m3 ulp (the same, through du's bf16 rounding); x8: bitwise (one division,
    one rounding in both).
  - vs float64: ≤ 0.5 ulp of the output format plus the fp32 error (a few 2⁻²⁴ relative): 0.51 ulp
    for q/k and x8; g8 rounds twice (du to bf16, then e4m3), so 0.5 e4m3 ulp + 0.5 bf16 ulp
    (= 2⁻⁵ e4m3 ulp): 0.55.
    pytest tests/perf/test_perf_kernels_qkv_rope.py -q
"""
import pytest
import torch

from model.attention import AttnArgs, CausalSelfAttention
from model.rotary import Yarn
from perf.kernels import qkv_rope as qr
from perf.backend import use_backend
from perf.fp8 import E4M3, QKV_GRAD_SCALE, QKV_X_SCALE, quantize
from perf.residual_fusion import RMS_NORM_EPS
from tools.gpu_check import ulp_distance

pytestmark = pytest.mark.triton

# (T, H, d_qk, d_v, paired, key_offset, rotary_dim): record layer kinds at toy widths, ragged
CASES = {
    "key_offset": (13, 3, 24, 40, False, True, 16),  # long-window layers 3, 10 (d_qk > rotary_dim)
    "paired": (13, 4, 16, 24, True, False, 16),  # layers 0, 2, 5 (d_qk < d_v, paired heads)
    "plain": (9, 3, 8, 8, False, False, 8),  # layers 1, 8 (half v)
}


def _yarn(d, rotary_dim, paired):
    yarn = Yarn(d, rotary_dim, 0.13, paired=paired)
    yarn.rescale(128, 384)  # YaRN-stretched frequencies, as after the first window change
    return yarn


def _qk(T, H, d, dv, dtype, seed):
    """qk [T, 2H, d] as a view of a packed [T, R] projection (row stride R, as the GEMM leaves it)."""
    gen = torch.Generator().manual_seed(seed)
    qkv = (2 * torch.randn(T, H * (2 * d + dv), generator=gen)).to(dtype)
    return qkv[:, : 2 * H * d].view(T, 2 * H, d), gen


# ------------------------------------------------------------------------------------------------
# The math does not change: fused (portable twins) vs unfused, bitwise


def _attention_step(fused, dtype, T, H, dq, dv, paired, key_offset, rotary_dim, seed=0):
    """One attention layer (fp8 training projection) forward + backward: output and every gradient."""
    D = 48
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, D, generator=gen)
    x = (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True))).to(dtype).requires_grad_()
    qk_w, v_w = ((0.2 * torch.randn(rows, D, generator=gen)).to(dtype).requires_grad_()
                 for rows in (2 * H * dq, H * dv))
    o_w = (0.2 * torch.randn(D, H * dv, generator=gen)).to(dtype).requires_grad_()
    sa = torch.tensor([0.5, 1.0], requires_grad=True)
    cu = torch.tensor([0, 5, T - 3, T, T], dtype=torch.int32)
    args = AttnArgs(sa_lambdas=sa, cu_seqlens=cu, window=6, yarn=_yarn(dq, rotary_dim, paired), key_offset=key_offset,
                    fp8=True, xsa_alpha=torch.randn(T, H, generator=gen))
    g = torch.randn(T, D, generator=gen).to(dtype)
    with use_backend(fused_qkv=fused, triton=False):
        out = CausalSelfAttention(H, max(dq, dv), dq, dv, paired)(x, qk_w, v_w, o_w, args)
        out.backward(g)
    return [out, x.grad, qk_w.grad, v_w.grad, o_w.grad, sa.grad]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("case", list(CASES))
def test_fused_portable_path_is_bitwise_the_unfused_path(case, dtype):
    T, H, dq, dv, paired, key_offset, rotary_dim = CASES[case]
    if paired:
        H = 6  # paired attention needs an even head count
    fused = _attention_step(True, dtype, T, H, dq, dv, paired, key_offset, rotary_dim)
    unfused = _attention_step(False, dtype, T, H, dq, dv, paired, key_offset, rotary_dim)
    for name, a, b in zip(("out", "dx", "dW_qk", "dW_v", "dW_o", "dsa"), fused, unfused):
        assert torch.equal(a, b), (name, float((a.float() - b.float()).abs().max()))
    assert fused[5][0] != 0  # sa0 received a gradient through the fused backward


@pytest.mark.parametrize("case", list(CASES))
def test_portable_twins_are_the_model_definition_and_its_autograd(case):
    """The forward twin against `normed_rotary_qk` (the one definition, which the model's unfused path
    runs); the backward twin against autograd through it, then the unfused path's quantize (perf/fp8.py
    Fp8QKVFunction.backward)."""
    T, H, d, dv, paired, key_offset, rotary_dim = CASES[case]
    qk, gen = _qk(T, H, d, dv, torch.bfloat16, 1)
    yarn = _yarn(d, rotary_dim, paired)
    f1, f2 = yarn.tables(T)
    q, k = qr.qk_norm_rope_portable(qk, f1, f2, H, rotary_dim, paired, key_offset)
    leaf = qk.detach().clone().requires_grad_()
    q_ref, k_ref = (t.to(qk.dtype) for t in qr.normed_rotary_qk(leaf, f1, f2, rotary_dim, paired, key_offset))
    assert torch.equal(q, q_ref) and torch.equal(k, k_ref)
    gq, gk, gv = ((0.01 * torch.randn(T, H, w, generator=gen)).bfloat16() for w in (d, d, dv))
    g_s = torch.tensor(QKV_GRAD_SCALE)
    g8, g8_t = qr.qkv_rope_backward_portable(gq, gk, gv, qk, f1, f2, rotary_dim, paired, key_offset, g_s)
    (dqk,) = torch.autograd.grad((q_ref, k_ref), leaf, (gq, gk))
    want = quantize(torch.cat([dqk.reshape(T, -1), gv.reshape(T, -1)], dim=1), g_s, E4M3)
    assert torch.equal(g8.view(torch.uint8), want.view(torch.uint8))
    assert torch.equal(g8_t.view(torch.uint8), g8.view(torch.uint8).t())


# ------------------------------------------------------------------------------------------------
# Kernels under the interpreter: against the twins and a float64 reference


def _rope_reference(qk, f1, f2, H, rotary_dim, paired, key_offset):
    """float64 q, k: per head n = u/√(mean u² + eps); y_i = f1_i·n_i + f2_i·n_(i xor 1) with head h of a
    paired layer on the row half h mod 2; keys' dims ≥ rotary_dim from the previous token (token 0: own)."""
    T, _, d = qk.shape
    u = qk.double()
    n = u / torch.sqrt(u.pow(2).mean(-1, keepdim=True) + RMS_NORM_EPS)
    partner = torch.arange(d) ^ 1
    y = torch.empty_like(n)
    for h in range(2 * H):
        half = (h % H) % 2 if paired else 0
        c, s = (f[:, half * d:(half + 1) * d].double() for f in (f1, f2))
        y[:, h] = c * n[:, h] + s * n[:, h][:, partner]
    q, k = y[:, :H], y[:, H:].clone()
    if key_offset:
        for t in range(1, T):
            k[t, :, rotary_dim:] = n[t - 1, H:, rotary_dim:]
    return q, k


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("case", list(CASES))
def test_qk_norm_rope_kernel(case, dtype):
    T, H, d, dv, paired, key_offset, rotary_dim = CASES[case]
    qk, _ = _qk(T, H, d, dv, dtype, 2)
    f1, f2 = _yarn(d, rotary_dim, paired).tables(T)
    q, k = qr.qk_norm_rope_triton(qk, f1, f2, H, rotary_dim, paired, key_offset)
    q_twin, k_twin = qr.qk_norm_rope_portable(qk, f1, f2, H, rotary_dim, paired, key_offset)
    q_ref, k_ref = _rope_reference(qk, f1, f2, H, rotary_dim, paired, key_offset)
    atol = 1e-6 * float(q_ref.abs().max())  # fp32 sums that cancel: ulps shrink without bound near 0
    for got, twin, ref in ((q, q_twin, q_ref), (k, k_twin, k_ref)):
        assert got.dtype == dtype and got.shape == (T, H, d) and got.is_contiguous()
        assert ulp_distance(got, twin, dtype, atol=atol) <= 1.0
        assert ulp_distance(got, ref, dtype, atol=atol) <= 0.51


def test_quantize_dual_kernel_bitwise_and_against_float64():
    gen = torch.Generator().manual_seed(3)
    x = (3 * torch.randn(21, 40, generator=gen)).bfloat16()  # T, D ragged for the 8×16 interpreter tiles
    x[0, :5] = torch.tensor([9.0, -9.0, 8.0, 500.0, -1e-5])  # saturating, the edge, a subnormal
    x_s = torch.tensor(QKV_X_SCALE)
    x8, x8_t = qr.quantize_dual_triton(x, x_s)
    want, _ = qr.quantize_dual_portable(x, x_s)
    assert torch.equal(x8.view(torch.uint8), want.view(torch.uint8))
    assert x8_t.is_contiguous() and torch.equal(x8_t.view(torch.uint8), want.t().view(torch.uint8))
    ref = (x.double() / float(x_s)).clamp(-448, 448)
    assert ulp_distance(x8.float(), ref, E4M3) <= 0.51
    assert float(x8[0, 0]) == 448 and float(x8[0, 1]) == -448


@pytest.mark.parametrize("case", list(CASES))
def test_qkv_rope_backward_kernel(case):
    T, H, d, dv, paired, key_offset, rotary_dim = CASES[case]
    qk, gen = _qk(T, H, d, dv, torch.bfloat16, 4)
    f1, f2 = _yarn(d, rotary_dim, paired).tables(T)
    gq, gk, gv = ((0.01 * torch.randn(T, H, w, generator=gen)).bfloat16() for w in (d, d, dv))
    gv[0, 0, :3] = torch.tensor([3.0, -3.0, 1e-7])  # beyond ±448·s_g = ±1: saturates; below e4m3's subnormals
    g_s = torch.tensor(QKV_GRAD_SCALE)
    g8, g8_t = qr.qkv_rope_backward_triton(gq, gk, gv, qk, f1, f2, rotary_dim, paired, key_offset, g_s)
    twin, _ = qr.qkv_rope_backward_portable(gq, gk, gv, qk, f1, f2, rotary_dim, paired, key_offset, g_s)
    assert g8.shape == (T, H * (2 * d + dv)) and g8_t.is_contiguous()
    assert torch.equal(g8_t.view(torch.uint8), g8.view(torch.uint8).t())
    assert ulp_distance(g8.float(), twin.float(), E4M3) <= 1.0
    # float64: autograd through the float64 reference forward (an independent route to the gradient)
    leaf = qk.double().requires_grad_()
    q_ref, k_ref = _rope_reference(leaf, f1, f2, H, rotary_dim, paired, key_offset)
    (dqk,) = torch.autograd.grad((q_ref, k_ref), leaf, (gq.double(), gk.double()))
    ref = (torch.cat([dqk.reshape(T, -1), gv.double().reshape(T, -1)], dim=1) / float(g_s)).clamp(-448, 448)
    assert ulp_distance(g8.float(), ref, E4M3) <= 0.55
    assert float(g8[0, 2 * H * d]) == 448 and float(g8[0, 2 * H * d + 1]) == -448


def test_fused_op_triton_against_portable():
    """The whole training op (fp8_qkv_rope), key-offset layer: outputs and every gradient, Triton kernels
    against their twins. The GEMMs are the same torch._scaled_mm calls, so the differences are the
    kernels' (≤ 1 ulp of q/k, ≤ 1 e4m3 ulp of a few g8 bytes): the gradients within 1% of their norm."""
    T, H, d, dv, paired, key_offset, rotary_dim = CASES["key_offset"]
    D = 40
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(T, D, generator=gen)
    x = (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True))).bfloat16()
    w_qk, w_v = ((0.2 * torch.randn(r, D, generator=gen)).bfloat16() for r in (2 * H * d, H * dv))
    f1, f2 = _yarn(d, rotary_dim, paired).tables(T)
    grads = [(0.01 * torch.randn(T, H, w, generator=gen)).bfloat16() for w in (d, d, dv)]

    def run(use_triton):
        leaves = [t.clone().requires_grad_() for t in (x, w_qk, w_v, torch.tensor(0.5))]
        with use_backend(triton=use_triton):
            outs = qr.fp8_qkv_rope(*leaves, f1, f2, H, rotary_dim, paired, key_offset)
            torch.autograd.backward(outs, grads)
        return list(outs) + [t.grad for t in leaves]

    for i, (a, b) in enumerate(zip(run(True), run(False))):
        if i < 3:  # q, k, v
            assert ulp_distance(a, b, torch.bfloat16, atol=1e-6) <= 1.0, i
        else:
            assert float((a.float() - b.float()).norm() / b.float().norm()) <= 1e-2, i


def test_fused_op_rejects_bad_shapes():
    x, w = torch.zeros(4, 8), torch.zeros(12, 8)
    f = torch.zeros(4, 2)
    with pytest.raises(ValueError, match="0-D"):
        qr.fp8_qkv_rope(x, w, w, torch.zeros(1), f, f, 3, 2, False, False)
    with pytest.raises(ValueError, match="stationary"):
        qr.fp8_qkv_rope(x, w, w, torch.tensor(1.0), f, f, 3, 2, False, True)
    with pytest.raises(ValueError, match="tables"):
        qr.qk_norm_rope_triton(torch.zeros(4, 6, 2), torch.zeros(4, 4), torch.zeros(4, 4), 3, 2, False, False)


def test_smoke_model_step_is_bitwise_the_same_with_the_switch_on_or_off(monkeypatch):
    """The whole smoke model (the record's topology: every attention layer kind, the shared late input
    of layers 8 and 10), one fp8 training forward + backward: loss and every gradient, SPEEDRUN_FUSED_QKV
    on vs off, portable backend."""
    import dataclasses

    from config import MODEL_PRESETS
    from model.gpt import GPT, StepArgs

    cfg = dataclasses.replace(MODEL_PRESETS["smoke"], vocab_size=512)
    torch.manual_seed(0)
    model = GPT(cfg)
    with torch.no_grad():  # move the zero-initialized matrices and λ's off their inits
        for p in model.parameters():
            p.add_(0.02 * torch.randn_like(p))
    model.refresh_fp8()
    T, gen = 96, torch.Generator().manual_seed(1)
    inputs = torch.randint(0, cfg.vocab_size, (T,), generator=gen, dtype=torch.int32)
    targets = torch.randint(0, cfg.vocab_size, (T,), generator=gen)
    cu = torch.tensor([0, 30, 61, T, T], dtype=torch.int32)
    rows = (0.1 * torch.randn(2 * T, cfg.model_dim, generator=gen)).bfloat16()
    signs = torch.randint(0, cfg.ngram_sign_rows, (2 * T,), generator=gen, dtype=torch.int32)

    calls, fused_function = [], qr.Fp8QKVRopeFunction

    class Counted(fused_function):  # proves which path ran
        @staticmethod
        def forward(ctx, *args):
            calls.append(1)
            return fused_function.forward(ctx, *args)

    monkeypatch.setattr(qr, "Fp8QKVRopeFunction", Counted)

    def step(fused):
        model.zero_grad(set_to_none=True)
        calls.clear()
        with use_backend(fused_qkv=fused, triton=False):
            loss = model(inputs, targets, cu, rows, signs, StepArgs(ws_short=1, ws_long=1))
            loss.backward()
        assert len(calls) == (7 if fused else 0)  # the 7 attention layers
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    (loss_on, grads_on), (loss_off, grads_off) = step(True), step(False)
    assert torch.equal(loss_on, loss_off) and grads_on.keys() == grads_off.keys()
    for name in grads_on:
        assert torch.equal(grads_on[name], grads_off[name]), name
    assert grads_on["qk_bank"].abs().sum() > 0
