"""A feature switch is one declaration (config.FEATURES): FeatureConfig's fields, the features line,
the optimizer's rows for the parameters a switch adds, the parameters a model without it lacks and
docs/features.md's rows are all made from it. Here the record's declarations against an independent
copy of record #360's optimizer table, and a toy switch declared the way docs/features.md says
("Adding a switch"), trained on the smoke preset with it on and off.
"""
import dataclasses
import json
import math
import re

import pytest
import torch
from torch import nn

import config
from cli import apply_overrides
from config import FEATURES, RUN_PRESETS, Feature, FeatureConfig, ParamRule, features_line
from model.gpt import GPT
from optim import adam
from runtime import training
from tests.tiny_shards import write_tiny_shards

SMOKE = RUN_PRESETS["smoke"]


def _adam(betas, lr_mul=1.0, wd_mul=1.0, comms="replicated", cadence="adam"):
    return ParamRule("adam", comms, cadence, betas, lr_mul, wd_mul)


# the rows features.value_embeds declares, as record #360's track_1_short/training.py lists them (typed
# out here; the whole table's typed-out reference is tests/optim/test_optim_adam.py's)
VALUE_EMBED_ROWS = {
    "ve_gate_bank": _adam((0.9, 0.99)),
    "value_embeds": _adam((0.75, 0.95), lr_mul=70.0, wd_mul=5.0, comms="sharded", cadence="table"),
}


# the rows features.doc_copy declares, as PR #378's track_1_short/training.py lists them (frontier_doc_copy.md §2.5)
DOC_COPY_ROWS = {name: _adam((0.9, 0.99), wd_mul=0.0)
                 for name in ("copy_doc_scale", "copy_doc_bucket_embed", "copy_doc_site")}
# the rows features.cplm declares, as PR #379's track_1_short/training.py lists them (frontier_cplm.md §3)
CPLM_ROWS = {"copy_qk_bank": _adam((0.9, 0.99)), "copy_k_sink": _adam((0.9, 0.99), wd_mul=0.0),
             "copy_qk_gain": _adam((0.9, 0.99), wd_mul=0.0)}


def test_the_record_declarations_make_the_switches_the_table_and_the_doc():
    assert [f.name for f in dataclasses.fields(FeatureConfig)] == [f.name for f in FEATURES]
    assert all(f.type is bool and f.default is d.default for f, d in zip(dataclasses.fields(FeatureConfig), FEATURES))
    record = tuple(f for f in FEATURES if f.default)
    assert [f.name for f in FEATURES if not f.default] == ["token_norm_hashes", "doc_copy", "cplm",
                                                           "approx_lm_head_grad", "approx_attention_backward"]  # past the record
    assert adam.RECORD_PARAM_TABLE == adam.param_table(record)
    assert adam.PARAM_TABLE == adam.param_table(FEATURES)
    assert {p: r for f in record for p, r in f.params} == VALUE_EMBED_ROWS  # of the record's, only value_embeds adds
    assert adam.RECORD_PARAM_TABLE.keys() - adam.BASE_PARAM_TABLE.keys() == VALUE_EMBED_ROWS.keys()
    assert adam.PARAM_TABLE.keys() - adam.RECORD_PARAM_TABLE.keys() == DOC_COPY_ROWS.keys() | CPLM_ROWS.keys()
    assert {p: adam.PARAM_TABLE[p] for p in DOC_COPY_ROWS} == DOC_COPY_ROWS
    assert {p: adam.PARAM_TABLE[p] for p in CPLM_ROWS} == CPLM_ROWS
    owned = {p: f.name for f in FEATURES for p in f.param_names}
    assert owned == {"value_embeds": "value_embeds", "ve_gate_bank": "value_embeds",
                     **{p: "doc_copy" for p in DOC_COPY_ROWS}, **{p: "cplm" for p in CPLM_ROWS}}
    # every record feature's parameter is one the record model has, in its order
    with torch.device("meta"):
        names = [n for n, _ in GPT(SMOKE.model).named_parameters()]
    assert [n for n in names if n in owned] == ["value_embeds", "ve_gate_bank"]
    assert sorted(names) == sorted(adam.RECORD_PARAM_TABLE)
    line = features_line(FeatureConfig(value_embeds=False, fp8=False))
    assert line == ("features: value_embeds off (no value_embeds/ve_gate_bank, no value embeddings on V or in the "
                    "MUDD mix), fp8 off (bf16 GEMMs, no fp8 caches) (the record has its features on and none past it)")
    assert features_line(FeatureConfig(token_norm_hashes=True)) == (
        "features: token_norm_hashes on (n-gram hashes over normalized token classes) (the record has its features "
        "on and none past it)")
    assert FeatureConfig(fp8=False, doc_copy=True).off() == ["fp8"]
    assert FeatureConfig(fp8=False, doc_copy=True).added() == ["doc_copy"]
    with pytest.raises(ValueError, match="requires must name other declared features"):
        config.feature_config_class(FEATURES + (dataclasses.replace(FEATURES[-1], name="x", params=(), requires=("y",)),))
    with pytest.raises(ValueError, match="names must be distinct"):
        config.feature_config_class(FEATURES + FEATURES[:1])
    with pytest.raises(ValueError, match="a parameter belongs to one feature"):
        config.feature_config_class(FEATURES + (dataclasses.replace(FEATURES[1], name="ve_again"),))
    with pytest.raises(ValueError, match="declares parameter 'scalars', which already has a row"):
        adam.param_table((Feature("x", "", "", "", "", params=(("scalars", _adam((0.9, 0.99))),)),))


# ---- a toy switch, declared once ---------------------------------------------------------------------

# the declaration docs/features.md shows, zero-scaled: a [D] bias added into the residual stream times 0,
# a real Adam parameter (it gets a gradient, zero, and Adam steps) that leaves the math bitwise alone
TOY = Feature(
    "toy_bias",
    removes="no toy bias",
    removes_in_full="the zero-scaled [D] toy bias and its Adam state",
    introduced_by="tests/run/test_run_feature_declaration.py",
    gain="not priced",
    params=(("toy_bias", ParamRule("adam", "replicated", "adam", (0.9, 0.99), wd_mul=0.0)),))


class ToyGPT(GPT):
    """The model code the toy switch needs: its parameter, registered after the record's (a seeded
    run draws them in order), and its one use, added to the embeddings' output."""
    built: list = []

    def __init__(self, cfg, *args, **kwargs):
        super().__init__(cfg, *args, **kwargs)
        if self.features.toy_bias:
            self.toy_bias = nn.Parameter(torch.zeros(cfg.model_dim))  # [D]
            self.embed.register_forward_hook(lambda m, a, out: out + (0.0 * self.toy_bias).to(out.dtype))
        ToyGPT.built.append(self)


def _declare(monkeypatch, feature: Feature):
    """What adding `feature` at the end of config.FEATURES does when config.py and optim/adam.py
    are imported: the registry, FeatureConfig made from it, the smoke preset's switches, and the
    optimizer table made from it (the manager's default table object, its rows updated in place)."""
    features = (*config.FEATURES, feature)
    monkeypatch.setattr(config, "FEATURES", features)
    feature_config = config.feature_config_class(features)
    monkeypatch.setattr(config, "FeatureConfig", feature_config)
    monkeypatch.setitem(config.RUN_PRESETS, "smoke", dataclasses.replace(SMOKE, features=feature_config()))
    table = adam.param_table(features)
    for name in table.keys() - adam.PARAM_TABLE.keys():  # a record feature: both tables get its rows
        monkeypatch.setitem(adam.RECORD_PARAM_TABLE, name, table[name])
        monkeypatch.setitem(adam.PARAM_TABLE, name, table[name])
    return feature_config


@pytest.fixture(scope="module")
def tiny_shards(tmp_path_factory):
    """Random documents of 64 tokens: three training steps and one validation step of the smoke preset."""
    return write_tiny_shards(tmp_path_factory.mktemp("shards"))


def _train(tmp_path, tiny_shards, monkeypatch, *flags) -> tuple[dict, str, training.Run]:
    import train_gpt
    runs = []

    class Recorded(training.Run):
        def __init__(self, *args):
            super().__init__(*args)
            runs.append(self)

    monkeypatch.setattr(train_gpt, "Run", Recorded)
    small = ["--set", "schedule.stages.0.batch_tokens=256", "--set", "val_batch_tokens=512"]
    train_gpt.main(["--config", "smoke", "--records-dir", str(tmp_path), "--data-path", str(tiny_shards),
                    "--no-warmup", "--max-steps", "3", "--val-every", "0", "--val-tokens", "512", "--seed", "0",
                    *flags, *small])
    (entry,) = [json.loads(line) for line in (tmp_path / "runs.jsonl").read_text().splitlines()]
    assert entry["status"] != "failed"
    (run,) = runs
    return entry, open(entry["log_path"]).read(), run


def test_a_toy_switch_declared_once_trains_on_and_off(tmp_path, tiny_shards, monkeypatch):
    toy_config = _declare(monkeypatch, TOY)
    monkeypatch.setattr(training, "GPT", ToyGPT)
    assert toy_config().toy_bias and apply_overrides(config.RUN_PRESETS["smoke"], ["features.toy_bias=false"]).features \
        == toy_config(toy_bias=False)

    on, on_log, on_run = _train(tmp_path / "on", tiny_shards, monkeypatch)
    on_names = [n for n, _ in on_run.model.named_parameters()]
    entry = on_run.manager.entries["toy_bias"]
    assert entry.rule == TOY.params[0][1] and entry.state.step >= 1  # Adam stepped it (odd steps: 1 and 3)
    assert torch.equal(entry.param.detach(), torch.zeros(SMOKE.model.model_dim))  # its gradient is 0·(...)
    assert not re.search(r"^features: ", on_log, re.M) and on_run.cfg.features.toy_bias is True

    off, off_log, off_run = _train(tmp_path / "off", tiny_shards, monkeypatch, "--set", "features.toy_bias=false")
    assert off_run.model.switched_off_parameters == ("toy_bias",)
    off_names = [n for n, _ in off_run.model.named_parameters()]
    assert "toy_bias" not in off_names and "toy_bias" not in off_run.manager.entries
    assert "toy_bias" in on_names and [n for n in on_names if n != "toy_bias"] == off_names  # the record's, in order
    assert list(on_run.manager.entries) == on_names and list(off_run.manager.entries) == off_names
    (line,) = re.findall(r"^features: .*$", off_log, re.M)
    assert line == "features: toy_bias off (no toy bias) (the record has its features on and none past it)"
    # the zero-scaled bias changes nothing: the same losses bit for bit (and the record's parameters
    # were drawn in the record's order)
    assert len(on["train_losses"]) == 3 and on["train_losses"] == off["train_losses"]
    assert on["val_loss"] == off["val_loss"] and math.isfinite(on["val_loss"])
    from tools.features_doc import table
    assert table(config.FEATURES).endswith("| `--set features.toy_bias=false` | the zero-scaled [D] toy bias and its "
                                           "Adam state | tests/run/test_run_feature_declaration.py | not priced |\n")
