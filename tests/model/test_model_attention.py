"""model/attention.py and model/rotary.py: o_gain, paired rotary, key offset, YaRN constants.

The QK-norm + rotary the attention runs is perf/kernels/qkv_rope.py `normed_rotary_qk` (written once,
below the model); these tests hold it, with the model's tables, to the record's semantics."""
import math

import pytest
import torch

from model.attention import AttnArgs, CausalSelfAttention
from model.rotary import Yarn
from perf.kernels.qkv_rope import normed_rotary_qk, rotate
from tests.recipe import pin, recipe

T, D, H = 32, 48, 6


def _layer(seed, qk_dim, v_dim, head_dim=8, paired=False):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, D, generator=gen)
    qk_w = torch.randn(2 * H * qk_dim, D, generator=gen) * 0.2
    v_w = torch.randn(H * v_dim, D, generator=gen) * 0.2
    o_w = torch.randn(D, H * v_dim, generator=gen) * 0.2
    attn = CausalSelfAttention(H, head_dim, qk_dim, v_dim, paired)
    return gen, x, qk_w, v_w, o_w, attn


def _args(yarn, **kw):
    cu = torch.tensor([0, 11, 20, T, T], dtype=torch.int32)
    return AttnArgs(sa_lambdas=torch.tensor([0.5, 1.0]), cu_seqlens=cu, window=9, yarn=yarn, **kw)


def test_o_gain_equals_scaling_the_output():
    gen, x, qk_w, v_w, o_w, attn = _layer(0, qk_dim=8, v_dim=8)
    yarn = Yarn(8, 4, 0.13)
    xsa = torch.randn(T, H, generator=gen)
    p = torch.tensor(0.8, requires_grad=True)
    g = torch.randn(T, D, generator=gen)
    out = attn(x, qk_w, v_w, o_w, _args(yarn, o_gain=p, xsa_alpha=xsa))
    plain_p = torch.tensor(0.8, requires_grad=True)
    plain = plain_p * attn(x, qk_w, v_w, o_w, _args(yarn, xsa_alpha=xsa))
    torch.testing.assert_close(out, plain, rtol=1e-6, atol=1e-6)
    out.backward(g)
    plain.backward(g)
    assert abs(p.grad - plain_p.grad) <= 1e-5 * abs(plain_p.grad)


def test_paired_heads_rotate_even_heads_at_2t_and_odd_heads_at_2t_plus_1():
    yarn = Yarn(8, 8, 0.13, paired=True)
    f1, f2 = yarn.tables(5)
    single = Yarn(8, 8, 0.13)
    g1, g2 = single.tables(10)
    assert torch.equal(f1[:, :8], g1[0::2]) and torch.equal(f1[:, 8:], g1[1::2])
    assert torch.equal(f2[:, :8], g2[0::2]) and torch.equal(f2[:, 8:], g2[1::2])


def test_rotate_is_the_pairwise_rotation():
    yarn = Yarn(8, 4, 0.1)
    f1, f2 = yarn.tables(6)
    u = torch.randn(6, 1, 8)
    y = rotate(u, f1[:, None], f2[:, None])
    for t in range(6):
        for j in range(4):
            w = float(yarn.angular_freq[2 * j])
            c, s = float(f1[t, 2 * j]), float(f2[t, 2 * j])
            assert c == pytest.approx(math.cos(t * w), abs=4e-3) and s == pytest.approx(math.sin(t * w), abs=4e-3)
            a, b = u[t, 0, 2 * j].item(), u[t, 0, 2 * j + 1].item()
            assert y[t, 0, 2 * j].item() == pytest.approx(c * a + s * b, abs=1e-5)
            assert y[t, 0, 2 * j + 1].item() == pytest.approx(c * b - s * a, abs=1e-5)
    assert torch.equal(y[..., 4:], u[..., 4:])  # stationary dims


def test_key_offset_takes_stationary_dims_from_the_previous_token():
    gen = torch.Generator().manual_seed(1)
    qk = torch.randn(T, 2 * H, 8, generator=gen) * 3
    yarn = Yarn(8, 4, 0.085)
    f1, f2 = yarn.tables(T)
    q, k = normed_rotary_qk(qk, f1, f2, yarn.rotary_dim, paired=False, key_offset=True)
    q0, k0 = normed_rotary_qk(qk, f1, f2, yarn.rotary_dim, paired=False, key_offset=False)
    assert torch.equal(q, q0) and torch.equal(k[:, :, :4], k0[:, :, :4])
    normed_k = qk[:, H:] / qk[:, H:].pow(2).mean(-1, keepdim=True).add(1.1920928955078125e-7).sqrt()
    torch.testing.assert_close(k[1:, :, 4:], normed_k[:-1, :, 4:], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(k[0, :, 4:], normed_k[0, :, 4:], rtol=1e-6, atol=1e-6)
    gen, x, qk_w, v_w, o_w, attn = _layer(1, qk_dim=8, v_dim=8)
    with pytest.raises(ValueError, match="stationary"):
        attn(x, qk_w, v_w, o_w, _args(Yarn(8, 8, 0.085), key_offset=True))


@recipe
def test_yarn_window_changes_match_the_record_table():
    wide, narrow = Yarn(128, 64, 0.085), Yarn(64, 64, 0.13)
    narrow_freq = narrow.angular_freq[0::2].clone()
    rotations = 128 * narrow_freq / (2 * math.pi)
    pin((int((rotations >= 32).sum()), int((rotations <= 1).sum())), (0, 18),
        "(kept, fully scaled) narrow rotary frequencies at the first window change")
    for (wo, wn), (no, nn_), (ws, ns) in [((384, 896), (128, 384), (0.099404, 0.158564)),
                                          ((896, 1408), (384, 640), (0.108390, 0.174764)),
                                          ((1408, 1664), (640, 768), (0.112011, 0.181136))]:
        wide.rescale(wo, wn)
        narrow.rescale(no, nn_)
        pin(wide.attn_scale, ws, f"the wide softmax scale after the window {wo} -> {wn}", abs=1e-6)
        pin(narrow.attn_scale, ns, f"the narrow softmax scale after the window {no} -> {nn_}", abs=1e-6)
    assert torch.all(wide.angular_freq[64:] == 0)  # stationary dims stay stationary
    # a fully scaled frequency moved by exactly old/new at each change
    assert narrow.angular_freq[-1].item() == pytest.approx(narrow_freq[-1].item() * 128 / 768, rel=1e-5)


def test_paired_layers_rotate_logical_head_h_at_position_2t_plus_h_mod_2():
    gen = torch.Generator().manual_seed(2)
    T_, dq = 5, 8
    qk = torch.randn(T_, 2 * H, dq, generator=gen)
    q, k = normed_rotary_qk(qk, *Yarn(dq, dq, 0.13, paired=True).tables(T_), dq, paired=True, key_offset=False)
    f1, f2 = Yarn(dq, dq, 0.13).tables(2 * T_)  # one row per interleaved position
    normed = qk / qk.pow(2).mean(-1, keepdim=True).add(1.1920928955078125e-7).sqrt()
    for t in range(T_):
        for h in range(H):
            pos = 2 * t + h % 2  # record #360: even heads at 2t, odd heads at 2t+1 (pair (1,4) swapped)
            for u, got in ((normed[t, h], q[t, h]), (normed[t, H + h], k[t, h])):
                want = rotate(u[None, None], f1[pos], f2[pos])[0, 0]
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
