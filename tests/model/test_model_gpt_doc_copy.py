"""features.doc_copy in the model (PR #378): its three fp32 parameters and constant buffers, a copy vector
that starts at zero (the same losses as without it), and, with its parameters moved, the two injections
where frontier_doc_copy.md §2.4 puts them: the model equals one without the feature whose smear output
and post-loop mix get site₀·v and site₁·v added by hand, v from the brute-force matcher."""
import dataclasses

import pytest
import torch

import model.embeddings
import model.gpt as gpt
import model.mudd
from config import MODEL_PRESETS, FeatureConfig
from model.doc_copy import BOS_ID, COPY_BUCKETS
from model.gpt import GPT, StepArgs
from tests.model.test_model_doc_copy import brute_force

SMOKE = MODEL_PRESETS["smoke"]
HASHED = FeatureConfig(token_norm_hashes=True)
COPYING = FeatureConfig(token_norm_hashes=True, doc_copy=True)
T = 256


def _batch(seed=0):
    gen = torch.Generator().manual_seed(seed)
    inputs = torch.randint(0, 6, (T,), generator=gen, dtype=torch.int32)  # few ids: contexts repeat
    inputs[torch.rand(T, generator=gen) < 0.02] = BOS_ID
    targets = torch.randint(0, 50257, (T,), generator=gen).long()
    cu = torch.tensor([0, T // 2, T, T], dtype=torch.int32)
    rows = (0.1 * torch.randn(2 * T, SMOKE.model_dim, generator=gen)).bfloat16()
    signs = torch.randint(0, SMOKE.ngram_sign_rows, (2 * T,), generator=gen, dtype=torch.int32)
    return inputs, targets, cu, rows, signs


def _pair():
    torch.manual_seed(0)
    off = GPT(SMOKE, fp8=False, features=dataclasses.replace(HASHED, prefix_loss=False))
    torch.manual_seed(0)
    on = GPT(SMOKE, fp8=False, features=dataclasses.replace(COPYING, prefix_loss=False))
    return off, on


def test_parameters_buffers_and_no_random_draw(gpt2_bpe):
    off, on = _pair()
    extra = [n for n, _ in on.named_parameters() if n not in dict(off.named_parameters())]
    assert extra == ["copy_doc_scale", "copy_doc_bucket_embed", "copy_doc_site"]
    names = [n for n, _ in on.named_parameters()]
    assert names.index("post_lambdas") + 1 == names.index("copy_doc_scale") and \
        names.index("copy_doc_site") + 1 == names.index("resid_lambdas")  # PR #378's order
    p = dict(on.named_parameters())
    assert [(tuple(p[n].shape), p[n].dtype) for n in extra] == [
        ((COPY_BUCKETS,), torch.float32), ((COPY_BUCKETS, SMOKE.model_dim), torch.float32), ((2,), torch.float32)]
    assert p["copy_doc_site"].tolist() == [0.5, 1.0] and not p["copy_doc_scale"].any()
    for name, q in off.named_parameters():  # the same weights: the feature draws nothing
        assert torch.equal(q, p[name]), name
    assert on.copy_doc_live.tolist() == [0.0] + [1.0] * 30
    assert on.token_norm_map[383] == 262 and on.copy_pow_fwd.numel() == 262_144
    assert not {"token_norm_map", "copy_pow_fwd", "copy_pow_bwd", "copy_doc_live"} & set(on.state_dict())
    with pytest.raises(ValueError, match="doc_copy needs features.token_norm_hashes"):
        GPT(SMOKE, features=FeatureConfig(doc_copy=True))


def test_at_init_the_copy_vector_is_zero_and_only_scale_and_bucket_embed_learn(gpt2_bpe):
    off, on = _pair()
    batch = _batch()
    step = StepArgs(ws_short=1, ws_long=1)
    loss_off, loss_on = off(*batch, step), on(*batch, step)
    assert torch.equal(loss_off, loss_on)  # v = 0: x + 0.5·0 and x + 0 are x, bitwise
    loss_on.backward()
    _, bucket = brute_force(batch[0].tolist(), on.token_norm_map[batch[0].long()].tolist())
    used = sorted(set(bucket) - {0})
    assert len(used) > 5
    assert not on.copy_doc_site.grad.any()  # v = 0 on step 0
    scale_grad, table_grad = on.copy_doc_scale.grad, on.copy_doc_bucket_embed.grad
    assert scale_grad[used].ne(0).all() and table_grad[used].ne(0).any(dim=1).all()
    unused = [b for b in range(COPY_BUCKETS) if b not in used]
    assert not scale_grad[unused].any() and not table_grad[unused].any()  # bucket 0 included


@pytest.mark.parametrize("training", [True, False])
def test_the_two_sites_are_the_spec_expression(monkeypatch, gpt2_bpe, training):
    off, on = _pair()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        on.copy_doc_scale.copy_(torch.randn(COPY_BUCKETS, generator=gen))
        on.copy_doc_bucket_embed.copy_(0.3 * torch.randn(COPY_BUCKETS, SMOKE.model_dim, generator=gen))
        on.copy_doc_site.copy_(torch.tensor([0.7, -1.3]))
    batch = _batch(2)
    candidate, bucket = brute_force(batch[0].tolist(), on.token_norm_map[batch[0].long()].tolist())
    candidate, bucket = torch.tensor(candidate).clamp_min(0), torch.tensor(bucket)
    live = (bucket > 0).float()[:, None]
    copied = on.embed.weight.detach()[candidate]  # (T, D) bf16
    v = copied * (on.copy_doc_scale.detach()[bucket, None] * live).bfloat16() + \
        (on.copy_doc_bucket_embed.detach()[bucket] * live).bfloat16()  # §2.4, in bf16
    site = on.copy_doc_site.detach().bfloat16()
    smear, mix = gpt.smear, model.mudd.post_loop_mix
    monkeypatch.setattr(gpt, "smear", lambda *a: smear(*a) + site[0] * v)  # after the smear, before x0
    monkeypatch.setattr(model.mudd, "post_loop_mix", lambda *a: mix(*a) + site[1] * v)  # before the final norm
    step = StepArgs(ws_short=1, ws_long=1, training=training)
    with torch.no_grad():
        want = off(*batch, step)
    monkeypatch.setattr(gpt, "smear", smear)
    monkeypatch.setattr(model.mudd, "post_loop_mix", mix)
    with torch.no_grad():
        got, plain = on(*batch, step), off(*batch, step)
    assert torch.equal(got, want) and not torch.equal(got, plain)
