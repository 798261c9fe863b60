"""perf/kernels/mlp.py: the fp8 and bf16 MLP kernels against their portable twins (Triton interpreter).

Each fused kernel runs on the same fp8 inputs as its twin, at ragged shapes (not multiples of the
interpreter's 16×32×16 tiles, so every mask is exercised, and more tiles than programs, so the
persistent loop turns). Then the whole training Function runs through both paths for a few steps,
with the fold on and off, and the bf16 validation forward through both.

Tolerances. The kernels sum the same exact fp32 products in another order and apply the scales to
the accumulator instead of the operands, so a value sitting on a rounding boundary of the compute
dtype can round the other way: the bf16/fp32 intermediate is one ulp off, and after the fp8 cast the
output is at most one fp8 ulp off (e4m3: 2⁻³ of the value; e5m2: 2⁻²). Such boundary cases are rare,
so beside the 1-ulp bound the tests also require nearly every element to be bitwise equal; a wrong
scale or a truncating cast would move a large fraction. (The interpreter's own fp8/bf16 casts do not
round to nearest even; the kernels round onto the grid first in interpreter mode, so the bounds above
hold there too.)
"""
import pytest
import torch
import triton
import triton.language as tl

from perf.kernels import mlp
from perf.backend import use_backend
from perf.fp8 import E4M3, E5M2, E5M2_MAX, quantize
from tools.gpu_check import ulp_distance

pytestmark = pytest.mark.triton

# (T, D, H): ragged against the interpreter tiles in every dimension; D ≥ 40 gives several K steps
SHAPES = [(45, 40, 72), (33, 56, 50)]
BOUNDARY_FRACTION = 0.02  # at most 2% of the fp8 outputs may sit one ulp off (rounding-boundary flips)


@triton.jit
def _cast_kernel(src_ptr, dst_ptr, n, LIMIT: tl.constexpr, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    v = tl.load(src_ptr + offsets, mask=offsets < n)
    v = tl.minimum(tl.maximum(v, -LIMIT), LIMIT)
    tl.store(dst_ptr + offsets, mlp._cast(v, dst_ptr.dtype.element_ty, True), mask=offsets < n)


@pytest.mark.parametrize("dtype", [E4M3, E5M2, torch.bfloat16])
def test_kernel_casts_round_like_torch(dtype):
    # The kernels' in-kernel casts (with the interpreter's rounding onto the grid) against torch's
    # round-to-nearest-even casts after the kernels' clamp: quarter steps m/4 (|m| ≤ 64) scaled by
    # every octave hit the ties of both fp8 formats (2.25 for e5m2, 4.25 for e4m3) and the carries
    # into the exponent (15.75 → 16), and reach the subnormals; random values span the whole range.
    limit = torch.finfo(dtype).max
    gen = torch.Generator().manual_seed(4)
    steps = torch.arange(-64, 65) / 4.0  # (129,)
    octaves = 2.0 ** torch.arange(-20, 17).float()
    src = torch.cat([(steps[:, None] * octaves[None, :]).flatten(),
                     torch.randn(20000, generator=gen) * 2.0 ** torch.randint(-24, 17, (20000,), generator=gen),
                     torch.tensor([limit, -limit, 1.01 * limit, 1e30, -1e30])]).float()
    dst = torch.empty(src.shape, dtype=dtype)
    _cast_kernel[(triton.cdiv(src.numel(), 1024),)](src, dst, src.numel(), LIMIT=limit, BLOCK=1024)
    assert torch.equal(dst.float(), src.clamp(-limit, limit).to(dtype).float())


def _normed(T, D, gen):
    x = torch.randn(T, D, generator=gen)
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True))  # like the model's post-RMS-norm rows


def _fp8_inputs(shape, dtype, seed=0):
    """x8, e4m3 weights with their scales (one refresh of a random bank) and an e5m2 gradient."""
    T, D, H = shape
    gen = torch.Generator().manual_seed(seed)
    x = _normed(T, D, gen).to(dtype)
    bank = ((torch.rand(2, 2, H, D, generator=gen) * 2 - 1) * 0.2).to(dtype)
    state = mlp.Fp8MLPState(2, H, D)
    state.refresh(bank)
    g8 = quantize(torch.randn(T, D, generator=gen) * 0.05, state.grad_scale, E5M2)
    return state, state.quantize_input(x), g8


def _assert_fp8_close(got, want, dtype, what):
    assert got.dtype == want.dtype == dtype and got.shape == want.shape, what
    assert torch.isfinite(got.float()).all(), f"{what}: a non-finite fp8 value (a cast without its clamp)"
    assert ulp_distance(got.float(), want.float(), dtype) <= 1.0, what
    assert (got.float() != want.float()).float().mean() <= BOUNDARY_FRACTION, what


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("saturate", [False, True])
def test_up_relu2_fp8_kernel_matches_twin(shape, dtype, saturate):
    state, x8, _ = _fp8_inputs(shape, dtype)
    args = (x8, state.w1_f8[1], state.x_scale, state.w1_scale[1])
    exact_amax = torch.zeros(())
    mlp.up_relu2_fp8_portable(*args, torch.tensor(1.0), exact_amax, dtype)
    # the delayed scale as the recipe sets it (1.03 headroom), or 4× too small so the top saturates
    s_post = exact_amax * 1.03 / 448 / (4.0 if saturate else 1.0)
    amax_k, amax_t = torch.full((), 0.5), torch.full((), 0.5)  # a previous maximum below this step's
    post8_k, post8_t_k = mlp.up_relu2_fp8_triton(*args, s_post, amax_k, dtype)
    post8, _ = mlp.up_relu2_fp8_portable(*args, s_post, amax_t, dtype)
    _assert_fp8_close(post8_k, post8, E4M3, "post8")
    assert torch.equal(post8_t_k, post8_k.t())  # the transposed layout holds the same bytes
    if saturate:  # the largest post/s_post is about 4·435: unclamped, the e4m3fn cast would give NaN
        assert (post8.float() == 448).any()
    # the amax is the maximum of post in the compute dtype: one ulp of it at most (the pre rounding flip)
    assert amax_k.item() == pytest.approx(amax_t.item(), rel=2.0**-7)
    assert amax_k.item() > 0.5
    assert amax_k.to(dtype).float() == amax_k  # the max of post as stored in the compute dtype


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("saturate", [False, True])
def test_dpre_fp8_kernel_matches_twin(shape, dtype, saturate):
    state, x8, g8 = _fp8_inputs(shape, dtype, seed=1)
    post8, _ = mlp.up_relu2_fp8_portable(x8, state.w1_f8[0], state.x_scale, state.w1_scale[0],
                                         torch.tensor(0.02), torch.zeros(()), dtype)
    s_post, p = torch.tensor(0.02), 0.8125
    args = (g8, state.w2_f8[0], state.grad_scale, state.w2_scale[0] * p, post8, s_post)
    exact_amax = torch.zeros(())
    mlp.dpre_fp8_portable(*args, torch.tensor(1.0), exact_amax, dtype)
    s_dpre = exact_amax * 1.25 / E5M2_MAX / (4.0 if saturate else 1.0)
    amax_k, amax_t = torch.zeros(()), torch.zeros(())
    dpre8_k, dpre8_t_k = mlp.dpre_fp8_triton(*args, s_dpre, amax_k, dtype)
    dpre8, _ = mlp.dpre_fp8_portable(*args, s_dpre, amax_t, dtype)
    _assert_fp8_close(dpre8_k, dpre8, E5M2, "dpre8")
    assert torch.equal(dpre8_t_k, dpre8_k.t())
    if saturate:
        assert (dpre8.float().abs() == E5M2_MAX).any()
    assert (dpre8.float() < 0).any() and (dpre8.float() > 0).any()  # the clamp acts on both signs
    assert amax_k.item() == pytest.approx(amax_t.item(), rel=2.0**-7)
    assert amax_k.to(dtype).float() == amax_k


def _train_steps(use_triton, fold, steps=3, seed=2):
    """Outputs, gradients and state of `steps` refresh → forward → backward rounds of slot 1."""
    T, D, H = 37, 40, 72
    gen = torch.Generator().manual_seed(seed)
    x = _normed(T, D, gen).bfloat16()
    bank = ((torch.rand(2, 2, H, D, generator=gen) * 2 - 1) * 0.2).bfloat16()
    g = (torch.randn(T, D, generator=gen) * 0.05).bfloat16()
    state = mlp.Fp8MLPState(2, H, D)
    p = torch.tensor(0.8125, requires_grad=True) if fold else None
    with use_backend(triton=use_triton):
        for _ in range(steps):  # each step's amaxes set the next step's delayed scales
            state.refresh(bank)
            xg, w1, w2 = (t.clone().requires_grad_() for t in (x, bank[1, 0], bank[1, 1]))
            if p is not None:
                p.grad = None
            out = mlp.fp8_mlp(xg, w1, w2, p, state, 1)
            out.backward(g)
    grads = {"x": xg.grad, "w1": w1.grad, "w2": w2.grad, **({"p": p.grad} if fold else {})}
    return out, grads, state


@pytest.mark.parametrize("fold", [True, False])
def test_training_function_triton_path_matches_portable(fold):
    out_k, grads_k, state_k = _train_steps(True, fold)
    out_t, grads_t, state_t = _train_steps(False, fold)
    # The delayed scales carry each path's amaxes from step to step: within one ulp of post / dpre.
    for name in ("post_scale", "dpre_scale", "post_amax", "dpre_amax"):
        torch.testing.assert_close(getattr(state_k, name), getattr(state_t, name), rtol=2.0**-7, atol=0)
    assert state_t.post_amax[1] > 0 and state_t.dpre_amax[1] > 0 and state_t.post_amax[0] == 0
    # A few fp8 operands one ulp off (≤ 2% of them, ≤ 2⁻² of their value) move a GEMM result by well
    # under 2⁻⁵ of its norm; the four _scaled_mm GEMMs are the same calls on both paths.
    for name, got, want in [("out", out_k, out_t), *((n, grads_k[n], grads_t[n]) for n in grads_t)]:
        assert got.shape == want.shape and got.dtype == want.dtype, name
        assert (got.float() - want.float()).norm() <= 2.0**-5 * want.float().norm(), name
    assert ("p" in grads_t) == fold


@pytest.mark.parametrize("shape", SHAPES)
def test_bf16_forward_kernel_matches_twin(shape):
    T, D, H = shape
    gen = torch.Generator().manual_seed(3)
    x = _normed(T, D, gen).bfloat16()
    w1, w2 = (((torch.rand(H, D, generator=gen) * 2 - 1) * 0.2).bfloat16() for _ in range(2))
    got, want = mlp.bf16_mlp_triton(x, w1, w2), mlp.bf16_mlp_portable(x, w1, w2)
    assert got.shape == want.shape == (T, D) and got.dtype == torch.bfloat16
    # post may differ by ≤ 3 bf16 ulps (2⁻⁶ of its value) where pre rounded the other way; through
    # post @ W2 that is at most 2⁻⁶·(|post| @ |W2|), plus one ulp of the output's own rounding.
    post = torch.relu(x.float() @ w1.float().t()).square()
    slack = 2.0**-6 * (post @ w2.float().abs())
    assert ulp_distance(got, want, atol=float(slack.max())) <= 1.0
    assert (got != want).float().mean() <= BOUNDARY_FRACTION


def test_backend_switch_dispatches(monkeypatch):
    state, x8, _ = _fp8_inputs((20, 24, 40), torch.bfloat16)
    x = torch.randn(20, 24).bfloat16()
    w1, w2 = state.w1_f8[0].float().bfloat16(), state.w2_f8[0].float().bfloat16()
    calls = []
    for name in ("up_relu2_fp8_triton", "dpre_fp8_triton", "bf16_mlp_triton"):
        monkeypatch.setattr(mlp, name, lambda *a, _f=getattr(mlp, name), _n=name: calls.append(_n) or _f(*a))
    with use_backend(triton=False):
        mlp.fp8_mlp(x.requires_grad_(), w1, w2, None, state, 0).sum().backward()
        mlp.bf16_mlp(x.detach(), w1, w2)
    assert calls == []
    with use_backend(triton=True):
        mlp.fp8_mlp(x, w1, w2, None, state, 0).sum().backward()
        with torch.no_grad():
            mlp.bf16_mlp(x, w1, w2)
        # the bf16 kernel has no backward: a forward that needs gradients runs the (autograd) twin
        w1g = w1.clone().requires_grad_()
        mlp.bf16_mlp(x.detach(), w1g, w2).sum().backward()
        assert w1g.grad is not None
    assert calls == ["up_relu2_fp8_triton", "dpre_fp8_triton", "bf16_mlp_triton"]


def test_triton_path_names_bad_inputs():
    state, x8, g8 = _fp8_inputs((20, 24, 40), torch.bfloat16)
    s = torch.ones(())
    with pytest.raises(TypeError, match="computes in bfloat16 .* or float32, got x of dtype torch.float16"):
        mlp.up_relu2_fp8_triton(x8, state.w1_f8[0], s, s, s, torch.zeros(()), torch.float16)
    with pytest.raises(TypeError, match="expected x8 torch.float8_e4m3fn"):
        mlp.up_relu2_fp8_triton(x8.float(), state.w1_f8[0], s, s, s, torch.zeros(()), torch.bfloat16)
    with pytest.raises(ValueError, match=r"W2_8 \[H, D\]"):
        mlp.dpre_fp8_triton(g8, state.w2_f8[0][:, :8], s, s, x8, s, s, torch.zeros(()), torch.bfloat16)
    with pytest.raises(ValueError, match="post8 must be a contiguous e4m3"):
        mlp.dpre_fp8_triton(g8, state.w2_f8[0], s, s, x8, s, s, torch.zeros(()), torch.bfloat16)
    with pytest.raises(TypeError, match="bf16_mlp: expected x torch.bfloat16"):
        mlp.bf16_mlp_triton(torch.randn(4, 24), torch.randn(40, 24).bfloat16(), torch.randn(40, 24).bfloat16())


# ------------------------------------------------------------------------------------------------
# On a GPU (tools/gpu_check.py runs these): the 128×256×128 launch configurations on shapes ragged in
# every dimension, which the record shapes (multiples of the tiles) never send through the masks.
# Multiples of 16 all the same: the twins' cuBLAS fp8 GEMMs require them.

@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(304, 208, 528), (1008, 768, 2816)])
def test_fp8_kernels_on_gpu(shape):
    T, D, H = shape
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(T, D, device="cuda", generator=gen)
    x = (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True))).bfloat16()
    bank = ((torch.rand(2, 2, H, D, device="cuda", generator=gen) * 2 - 1) * 0.05).bfloat16()
    state = mlp.Fp8MLPState(2, H, D, device="cuda")
    state.refresh(bank)
    x8 = state.quantize_input(x)
    g8 = quantize(torch.randn(T, D, device="cuda", generator=gen) * 0.05, state.grad_scale, E5M2)
    up_args = (x8, state.w1_f8[0], state.x_scale, state.w1_scale[0])
    amax = torch.zeros((), device="cuda")
    mlp.up_relu2_fp8_portable(*up_args, torch.ones((), device="cuda"), amax, torch.bfloat16)
    s_post = amax * 1.03 / 448
    amax_k, amax_t = torch.zeros((), device="cuda"), torch.zeros((), device="cuda")
    post8_k, post8_t_k = mlp.up_relu2_fp8_triton(*up_args, s_post, amax_k, torch.bfloat16)
    post8, _ = mlp.up_relu2_fp8_portable(*up_args, s_post, amax_t, torch.bfloat16)
    _assert_fp8_close(post8_k, post8, E4M3, "post8")
    assert torch.equal(post8_t_k, post8_k.t()) and float(amax_k) == pytest.approx(float(amax_t), rel=2.0**-7)
    dpre_args = (g8, state.w2_f8[0], state.grad_scale, state.w2_scale[0] * 0.8125, post8, s_post)
    amax = torch.zeros((), device="cuda")
    mlp.dpre_fp8_portable(*dpre_args, torch.ones((), device="cuda"), amax, torch.bfloat16)
    s_dpre = amax * 1.25 / E5M2_MAX
    amax_k, amax_t = torch.zeros((), device="cuda"), torch.zeros((), device="cuda")
    dpre8_k, dpre8_t_k = mlp.dpre_fp8_triton(*dpre_args, s_dpre, amax_k, torch.bfloat16)
    dpre8, _ = mlp.dpre_fp8_portable(*dpre_args, s_dpre, amax_t, torch.bfloat16)
    _assert_fp8_close(dpre8_k, dpre8, E5M2, "dpre8")
    assert torch.equal(dpre8_t_k, dpre8_k.t()) and float(amax_k) == pytest.approx(float(amax_t), rel=2.0**-7)
    w1, w2 = bank[0, 0], bank[0, 1]
    got, want = mlp.bf16_mlp_triton(x, w1, w2), mlp.bf16_mlp_portable(x, w1, w2)
    post = torch.relu(x.float() @ w1.float().t()).square()
    assert ulp_distance(got, want, atol=float((2.0**-6 * (post @ w2.float().abs())).max())) <= 1.0
