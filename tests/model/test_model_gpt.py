"""model/gpt.py at smoke size: finiteness, the init loss, fused = plain residuals, capacity."""
import dataclasses
import math

import pytest
import torch

from config import MODEL_PRESETS, FeatureConfig
from model.gpt import GPT, StepArgs
from model.loss import CandidateSampler
from tests.recipe import pin, recipe

SMOKE = MODEL_PRESETS["smoke"]


def _batch(cfg, T, seed=0, vocab=50257):
    gen = torch.Generator().manual_seed(seed)
    inputs = torch.randint(0, vocab, (T,), generator=gen, dtype=torch.int32)
    targets = torch.randint(0, vocab, (T,), generator=gen).long()
    cu = torch.tensor([0, T // 3, T // 2, T, T], dtype=torch.int32)
    rows = (0.1 * torch.randn(2 * T, cfg.model_dim, generator=gen)).bfloat16()
    signs = torch.randint(0, cfg.ngram_sign_rows, (2 * T,), generator=gen, dtype=torch.int32)
    return inputs, targets, cu, rows, signs


def test_smoke_forward_backward_is_finite():
    torch.manual_seed(0)
    model = GPT(SMOKE)
    T = 192
    inputs, targets, cu, rows, signs = _batch(SMOKE, T)
    rows.requires_grad_(True)
    table = torch.full((SMOKE.vocab_size,), -1, dtype=torch.long)
    table[:50000] = torch.arange(50000) % 256  # any prefix classes will do here
    model.set_prefix_table(table)
    cand = CandidateSampler(SMOKE.vocab_size).candidates(targets, 2048)
    model.refresh_fp8()
    step = StepArgs(ws_short=1, ws_long=1, mtp_weights=(1.0, 0.5, 0.25), prefix_weight=0.25, candidates=cand)
    loss = model(inputs, targets, cu, rows, signs, step)
    loss.backward()
    assert torch.isfinite(loss)
    # each CE term starts near ln(P): near-uniform logits (record #360: track_1_short/model/gpt.py)
    weights = (1 + 0.5 * (T - 1) / T + 0.25 * (T - 2) / T)
    per_token = loss.item() / T
    prefix_share = torch.isin(table[targets], cand).float().mean().item()  # other prefix terms drop
    assert per_token == pytest.approx((weights + 0.25 * prefix_share) * math.log(2048), rel=0.02)
    for name, p in model.named_parameters():
        assert p.grad is None or torch.isfinite(p.grad).all(), name
    assert torch.isfinite(rows.grad).all() and rows.grad.abs().sum() > 0
    # bank rows the narrow layers never read get no gradient (record #360: track_1_short/model/gpt.py)
    qk_grad = model.qk_bank.grad.view(8, 12, SMOKE.head_dim, -1)
    assert qk_grad[0, :, SMOKE.narrow_head_dim:].abs().sum() == 0  # slot 0 = layer 0, d_qk narrow
    assert qk_grad[7].abs().sum() == 0  # padding slot
    assert model.mlp_bank.grad[7].abs().sum() == 0  # layer 7 has no MLP
    with torch.no_grad():
        val = model(inputs, targets, cu, rows, signs, StepArgs(training=False))
    assert val.item() == pytest.approx(math.log(SMOKE.vocab_size), rel=0.01)


def test_fused_residuals_equal_the_plain_expressions():
    """Same weights, λ's moved off their inits: the fused wiring is the same function and gradient."""
    cfg = dataclasses.replace(SMOKE, vocab_size=512)
    torch.manual_seed(1)
    fused = GPT(cfg, dtype=torch.float32, fp8=False)
    with torch.no_grad():
        fused.mlp_bank[:, 1].normal_(std=0.02)
        fused.post_lambdas.uniform_(0.5, 1.5)
        fused.resid_lambdas.uniform_(0.8, 1.2)
        fused.scalars[22] = 0.3  # smear on
    plain = GPT(cfg, dtype=torch.float32, fp8=False, features=FeatureConfig(residual_fusions=False))
    plain.load_state_dict(fused.state_dict())
    inputs, targets, cu, rows, signs = _batch(cfg, 96, seed=2, vocab=512)
    rows = rows.float()
    step = StepArgs(ws_short=1, ws_long=1, mtp_weights=(1.0, 0.5))
    losses = []
    for model in (fused, plain):
        loss = model(inputs, targets, cu, rows, signs, step)
        loss.backward()
        losses.append(loss.detach())
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-5, atol=0)
    for (name, a), (_, b) in zip(fused.named_parameters(), plain.named_parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=2e-3, atol=1e-6, msg=name)


def test_capacity_on_a_repeated_text():
    """A hundred steps of plain Adam memorise a short text (not the record optimizer): 49 tokens of
    the embedded corpus's process (data/synthetic.py) over 300 ids, so it needs no files."""
    from data.synthetic import SyntheticProcess, SyntheticSpec

    ids = torch.from_numpy(SyntheticProcess(SyntheticSpec(vocab=300)).sample(49, stream=0).astype("int64"))
    _, compact = torch.unique(ids, return_inverse=True)  # a small vocabulary keeps Adam cheap
    T = 48
    cfg = dataclasses.replace(SMOKE, vocab_size=256, ngram_rows=1024)
    torch.manual_seed(0)
    model = GPT(cfg, dtype=torch.float32)
    inputs, targets = compact[:T].int(), compact[1: T + 1].long()
    cu = torch.tensor([0, T], dtype=torch.int32)
    rows, signs = torch.zeros(2 * T, cfg.model_dim), torch.zeros(2 * T, dtype=torch.int32)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3, betas=(0.9, 0.95))
    losses = []
    for _ in range(100):
        model.refresh_fp8()
        loss = model(inputs, targets, cu, rows, signs, StepArgs()) / T
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[0] == pytest.approx(math.log(256), rel=0.05)
    assert losses[-1] < 0.1 * losses[0]


def test_bad_inputs_are_rejected():
    model = GPT(dataclasses.replace(SMOKE, vocab_size=512), dtype=torch.float32, fp8=False)
    inputs, targets, cu, rows, signs = _batch(model.cfg, 32, vocab=512)
    with pytest.raises(ValueError, match="ngram_rows"):
        model(inputs, targets, cu, rows[:10], signs, StepArgs())
    with pytest.raises(ValueError, match="cu_seqlens"):
        model(inputs, targets, torch.tensor([0, 5], dtype=torch.int32), rows.float(), signs, StepArgs())


def test_dead_parameters_are_exactly_the_record_list():
    """Record #360 (track_1_short/model/gpt.py) has parameters no layer reads; they (and only they) get zero grad."""
    cfg = dataclasses.replace(SMOKE, vocab_size=512)
    torch.manual_seed(3)
    model = GPT(cfg, dtype=torch.float32, fp8=False)
    with torch.no_grad():  # wake every path that starts at zero
        for p in (model.mlp_bank[:, 1], model.mudd_w2, model.mudd_w2g, model.mudd_gate_w2, model.ve_gate_bank,
                  model.smear_gate.weight):
            p.normal_(std=0.05)
        model.scalars[22] = 0.2
    inputs, targets, cu, rows, signs = _batch(cfg, 64, seed=4, vocab=512)
    model(inputs, targets, cu, rows.float(), signs, StepArgs(ws_short=1, ws_long=1)).backward()
    nd, hd = cfg.narrow_head_dim, cfg.head_dim
    dead = {name: torch.zeros_like(p, dtype=torch.bool) for name, p in model.named_parameters()}
    for i in (4, 6, 7, 9):
        dead["scalars"][[2 * i, 2 * i + 1]] = True  # sa λ's of layers without attention
    dead["post_lambdas"][[4, 6, 7, 9, 10], 0] = True
    dead["post_lambdas"][7, 1] = dead["resid_lambdas"][6, 0] = True
    dead["post_lambdas"][10] = dead["resid_lambdas"][10] = True  # the MUDD layer uses μ
    dead["mlp_bank"][7] = True
    dead["mudd_w2"][1, 10:] = dead["mudd_b2"][1, 10:] = dead["mudd_w2g"][10:] = True
    dead["mudd_gate_w2"][1, 13:] = dead["mudd_gate_b2"][1, 13:] = True
    qk = dead["qk_bank"].view(8, 12, hd, -1)
    qk[7] = True  # padding
    qk[:5, :, nd:] = True  # slots 0..4 (layers 0, 2, 5, 1, 8) read d_qk = 64 rows of each head
    vo = dead["vo_bank"].view(8, 2, cfg.model_dim, cfg.model_dim)
    vo[7] = True
    for slot in (3, 4):  # half-v layers 1, 8: V rows and O columns 64.. of each head
        vo[slot, 0].view(6, hd, -1)[:, nd:] = True
        vo[slot, 1].view(-1, 6, hd)[:, :, nd:] = True
    for name, p in model.named_parameters():
        zero = p.grad == 0
        assert torch.equal(zero & dead[name], dead[name]), f"{name}: a dead entry has a gradient"
        if name in ("scalars", "post_lambdas", "resid_lambdas", "qk_bank", "vo_bank", "mudd_w2", "mudd_gate_w2"):
            assert not (zero & ~dead[name]).any(), f"{name}: a live entry has no gradient"


def test_window_changes_rescale_the_three_rotary_tables():
    """Structure: each table's scale grows by YaRN's 1 + gain·ln(new/old) of its own window, the paired
    table with the narrow one (the record's values: test_record_softmax_scales_at_step_320)."""
    from model.rotary import YARN_SCALE_GAIN

    model = GPT(dataclasses.replace(SMOKE, vocab_size=128), dtype=torch.float32)
    start = (model.yarn_wide.attn_scale, model.yarn.attn_scale)
    model.rescale_rotary((1, 3), (1, 3))  # no change, no YaRN
    assert (model.yarn_wide.attn_scale, model.yarn.attn_scale) == start
    model.rescale_rotary((1, 3), (3, 7))  # record #360 step 320: long 3 -> 7 blocks, short 1 -> 3
    assert model.yarn_wide.attn_scale == pytest.approx(start[0] * (1 + YARN_SCALE_GAIN * math.log(7 / 3)), rel=1e-12)
    assert model.yarn.attn_scale == model.yarn_paired.attn_scale == pytest.approx(
        start[1] * (1 + YARN_SCALE_GAIN * math.log(3 / 1)), rel=1e-12)
    model.refresh_fp8()
    model.mlp_fp8.post_amax.fill_(3.0)
    model.rearm_fp8()
    assert model.mlp_fp8.refresh_calls == 0 and model.mlp_fp8.post_amax.abs().sum() == 0
    assert (model.mlp_fp8.dpre_scale == 2.0 ** -6).all() and (model.mlp_fp8.post_scale == 1).all()


@recipe
def test_record_softmax_scales_at_step_320():
    model = GPT(dataclasses.replace(SMOKE, vocab_size=128), dtype=torch.float32)
    pin((model.yarn_wide.attn_scale, model.yarn.attn_scale), (0.085, 0.13), "the initial (wide, narrow) softmax scales")
    model.rescale_rotary((1, 3), (3, 7))
    pin(model.yarn_wide.attn_scale, 0.099404, "the wide softmax scale at step 320", abs=1e-6)
    pin(model.yarn.attn_scale, 0.158564, "the narrow softmax scale at step 320", abs=1e-6)


def test_state_dict_carries_the_whole_yarn_state():
    """After two window changes (YaRN rescales the frequencies and grows the attention scales), a
    model rebuilt from the state_dict validates bitwise like the original. The weights are
    perturbed so that attention matters: a barely trained model's loss hardly depends on the scale."""
    torch.manual_seed(0)
    model = GPT(SMOKE)
    with torch.no_grad():
        for bank in (model.qk_bank, model.vo_bank):
            bank.add_(0.3 * torch.randn_like(bank))
    model.rescale_rotary((1, 3), (3, 7))
    model.rescale_rotary((3, 7), (5, 11))
    assert model.yarn.attn_scale != model.yarn.initial_attn_scale
    batch = _batch(SMOKE, 160, seed=3)
    step = StepArgs(ws_short=5, ws_long=11, training=False)
    with torch.no_grad():
        expected = model(*batch, step)
        torch.manual_seed(1)
        loaded = GPT(SMOKE)
        loaded.load_state_dict(model.state_dict())
        got = loaded(*batch, step)
    assert [t.attn_scale for t in (loaded.yarn, loaded.yarn_paired, loaded.yarn_wide)] == \
        [t.attn_scale for t in (model.yarn, model.yarn_paired, model.yarn_wide)]
    assert torch.equal(got, expected)
    fresh = GPT(SMOKE)
    fresh.load_state_dict({k: v for k, v in model.state_dict().items() if not k.endswith("_extra_state")},
                          strict=False)
    with torch.no_grad():
        assert not torch.equal(fresh(*batch, step), expected)  # the scales matter here
