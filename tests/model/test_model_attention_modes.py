"""PR #371 part 2 in the model: the attention backward's modes reach the five eligible layers.

* mode 2: exactly layers 0, 1, 2, 5, 8 run `restricted_backward_attention`, each with its own head table
  (the calibration's persistent tensor, not a copy) and its launch window; the forward is unchanged (the
  loss bit for bit) and so is every gradient computed before the first attention backward (the lm_head's);
* mode 1: the stock step bit for bit (loss and every gradient), and each layer's snapshot holds its first
  rows, consistent with the attention it took them from (the output recomputed from the snapshot's q, k, v);
* the snapshots measured and the choice made: tables written in place, the log's lines, snapshots dropped.
The restricted backward's numbers are tested against a brute-force loop in tests/perf/test_perf_windowed_backward.py.
"""
import pytest
import torch

from config import MODEL_PRESETS
from model import attention as attention_module
from model.attention_calibration import ELIGIBLE_LAYERS, CalibrationState, eligible_layers
from model.gpt import GPT, PAIRED_HEAD_LAYERS, StepArgs
from perf.attention_backends import sdpa_varlen_attention
from perf.windowed_backward import FULL_WINDOW_CODE

SMOKE = MODEL_PRESETS["smoke"]
T = 512
WS_SHORT = 3  # stage 1's windows, the calibration's: W = 384 positions on the short layers
CU = (0, 300, T, T)  # a document crossing row 256 (and, paired, stream row 512)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    m = GPT(SMOKE)
    with torch.no_grad():  # away from the init, where zero projections leave attention without a gradient
        for p in m.parameters():
            if p.is_floating_point():
                p.add_(0.05 * torch.randn_like(p))
    table = torch.full((SMOKE.vocab_size,), -1, dtype=torch.long)
    table[:50000] = torch.arange(50000) % 256
    m.set_prefix_table(table)
    m.refresh_fp8()
    return m


@pytest.fixture(scope="module")
def stock(model):
    """Mode 0: the record's step (loss, gradients)."""
    return _step(model, 0)


@pytest.fixture(scope="module")
def calibrated(model):
    """Mode 1 with snapshots of the first 384 rows: (calibration, loss, gradients)."""
    calibration = CalibrationState(eligible_layers(SMOKE.num_heads), limit=384)
    return (calibration, *_step(model, 1, calibration))


def _step(model, mode: int, calibration=None):
    gen = torch.Generator().manual_seed(1)
    inputs = torch.randint(0, 50257, (T,), generator=gen, dtype=torch.int32)
    targets = torch.randint(0, 50257, (T,), generator=gen).long()
    rows = (0.1 * torch.randn(2 * T, SMOKE.model_dim, generator=gen)).bfloat16().requires_grad_(True)
    signs = torch.randint(0, SMOKE.ngram_sign_rows, (2 * T,), generator=gen, dtype=torch.int32)
    model.zero_grad(set_to_none=True)
    args = StepArgs(ws_short=WS_SHORT, ws_long=7, attention_mode=mode, attention_calibration=calibration)
    loss = model(inputs, targets, torch.tensor(CU, dtype=torch.int32), rows, signs, args)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_mode_two_runs_the_restricted_backward_on_exactly_the_five_layers_with_their_tables(model, stock, monkeypatch):
    calibration = CalibrationState(eligible_layers(SMOKE.num_heads))
    calibration.tables[8].fill_(64)  # one layer shortened: the others stay full
    calls, original = [], attention_module.restricted_backward_attention

    def recording(q, k, v, cu_seqlens, window, scale, head_windows, paired=False, max_seqlen=None):
        calls.append((q.shape[1], window, head_windows, paired))
        return original(q, k, v, cu_seqlens, window, scale, head_windows, paired, max_seqlen)

    monkeypatch.setattr(attention_module, "restricted_backward_attention", recording)
    loss0, grads0 = stock  # (modes 0 and 1 never call it: mode 1's gradients are mode 0's, bit for bit, below)
    loss2, grads2 = _step(model, 2, calibration)
    assert len(calls) == len(ELIGIBLE_LAYERS)
    for (heads, window, table, paired), layer in zip(calls, ELIGIBLE_LAYERS):  # forward order: 0, 1, 2, 5, 8
        assert table is calibration.tables[layer] and paired == (layer in PAIRED_HEAD_LAYERS)
        assert window == WS_SHORT * 128 and heads == SMOKE.num_heads
    assert torch.equal(loss2, loss0)  # the forward is the record's
    assert torch.equal(grads2["lm_head.weight"], grads0["lm_head.weight"])  # before any attention backward
    assert not torch.equal(grads2["qk_bank"], grads0["qk_bank"])


def test_mode_one_is_the_stock_step_and_snapshots_what_its_attention_saw(stock, calibrated):
    (loss0, grads0), (calibration, loss1, grads1) = stock, calibrated
    assert torch.equal(loss1, loss0)
    assert grads1.keys() == grads0.keys() and all(torch.equal(grads1[n], grads0[n]) for n in grads0)
    for layer, snapshot in calibration.snapshots.items():
        paired = layer in PAIRED_HEAD_LAYERS
        heads = SMOKE.num_heads // 2 if paired else SMOKE.num_heads
        assert snapshot.complete and snapshot.q.shape[:2] == (384, heads) and snapshot.d_out.shape == snapshot.out.shape
        assert snapshot.cu_seqlens.tolist() == [2 * c if paired else c for c in CU]  # FA3's rows: doubled when paired
        assert snapshot.window == WS_SHORT * 128 and snapshot.d_out.abs().sum() > 0
        # the output of the rows whose document lies inside the snapshot, recomputed from its q, k, v
        if not paired:  # (unpaired: rows [0, 300) are a whole document within the first 384)
            y = sdpa_varlen_attention(snapshot.q[:300], snapshot.k[:300], snapshot.v[:300],
                                      torch.tensor([0, 300], dtype=torch.int32), snapshot.window, snapshot.scale)
            torch.testing.assert_close(y, snapshot.out[:300], atol=1e-2, rtol=1e-2)  # another chunking: rounding


def test_the_snapshots_measured_write_the_tables_in_place_and_log_their_choice(calibrated):
    calibration = calibrated[0]
    tables = dict(calibration.tables)
    calibration.measure_snapshots()
    assert not any(s.complete for s in calibration.snapshots.values())  # dropped once measured
    with pytest.raises(RuntimeError, match="layer 0's snapshot is incomplete"):
        calibration.measure_snapshots()
    calibration.finish()
    assert all(calibration.tables[layer] is tables[layer] for layer in tables)  # in place: graphs bake them
    codes = {c for t in calibration.tables.values() for c in t.tolist()}
    assert codes <= {FULL_WINDOW_CODE, 64, 128, 256}
    lines = calibration.log_lines(ranks=1)
    assert lines[0].startswith("attention backward (PR #371): windows chosen from 1 snapshot(s) per layer")
    # unpaired layers: the first 300 rows are whole; paired: the first document is 600 stream rows, past 384
    assert "attention backward: layer 1 (W 384): windows " in lines[2] and "prefix rows [300]" in lines[2]
    assert lines[1].endswith("prefix rows [0] (no complete document in any rank's prefix: full)")
    assert calibration.tables[0].tolist() == [FULL_WINDOW_CODE] * 3
    calibration.reset()
    assert all(t.tolist() == [FULL_WINDOW_CODE] * t.numel() for t in calibration.tables.values())
