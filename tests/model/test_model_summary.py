"""model/summary.py: the record-size model on the meta device has record #360's parameters."""
import math

from config import MODEL_PRESETS
from model.summary import build_on_meta, format_summary, main, parameter_count

# The parameter table of record #360 (track_1_short/model/gpt.py), written out by hand.
RECORD_SHAPES = {
    "lm_head.weight": (768, 50304), "embed.weight": (50304, 768), "value_embeds": (4 * 50304, 768),
    "ve_gate_bank": (3, 6, 12), "qk_bank": (48, 256, 768), "vo_bank": (16, 768, 768),
    "mlp_bank": (12, 2, 2816, 768), "smear_gate.weight": (1, 12), "post_lambdas": (11, 2),
    "resid_lambdas": (11, 2), "scalars": (24,), "mudd_w1": (2, 64, 768), "mudd_w2": (2, 14, 64),
    "mudd_b2": (2, 14), "mudd_w2g": (14, 12, 64), "mudd_gate_scale": (), "mudd_gate_w1": (2, 64, 768),
    "mudd_gate_w2": (2, 23, 64), "mudd_gate_b2": (2, 23),
}
RECORD_TOTAL = 302_792_179  # Σ of the products above


def test_record_parameters_and_total():
    assert sum(math.prod(s) for s in RECORD_SHAPES.values()) == RECORD_TOTAL
    model = build_on_meta(MODEL_PRESETS["record"])
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
    assert shapes == RECORD_SHAPES
    assert parameter_count(model) == RECORD_TOTAL
    assert tuple(model.ngram_sign_pool.shape) == (8192, 768)


def test_summary_prints_banks_and_total(capsys):
    main(["--config", "record"])
    out = capsys.readouterr().out
    for text in ("[48, 256, 768]", "[16, 768, 768]", "[12, 2, 2816, 768]", f"parameters: {RECORD_TOTAL:,}",
                 "10,575,360 rows, 15.13 GiB"):
        assert text in out


def test_smoke_keeps_the_topology():
    smoke = build_on_meta(MODEL_PRESETS["smoke"])
    record = build_on_meta(MODEL_PRESETS["record"])
    assert [n for n, _ in smoke.named_parameters()] == [n for n, _ in record.named_parameters()]
    assert smoke.qk_bank.shape[0] == 48 and smoke.vo_bank.shape[0] == 16 and smoke.mlp_bank.shape[:2] == (12, 2)
    assert "parameters:" in format_summary(MODEL_PRESETS["smoke"], smoke)
