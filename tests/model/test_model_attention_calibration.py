"""model/attention_calibration.py: PR #371's prefix cut, error metric, cost table and choice, the persistent
state (in-place reset, running max, finish) and two gloo ranks ending with one table."""
import math
import textwrap

import pytest
import torch

from model.attention_calibration import (ELIGIBLE_LAYERS, CalibrationState, EligibleLayer,
                                         attention_backward_mode, backward_cost, choose_windows,
                                         complete_document_prefix, relative_errors)
from perf.windowed_backward import windowed_attention_backward, windowed_attention_forward
from tests.gloo_workers import run_workers


def test_the_record_constants():
    assert sorted(ELIGIBLE_LAYERS) == [0, 1, 2, 5, 8]
    assert sum(spec.heads for spec in ELIGIBLE_LAYERS.values()) == 21  # PR #371: 21 (layer, head) pairs
    assert {layer for layer, spec in ELIGIBLE_LAYERS.items() if spec.paired} == {0, 2, 5}
    assert [attention_backward_mode(s) for s in (0, 591, 592, 593, 594, 1106, 1107, 1193)] == [0, 0, 1, 1, 2, 2, 0, 0]
    assert attention_backward_mode(600, enabled=False) == 0


@pytest.mark.parametrize("cu, limit, end", [
    ([0, 5, 9, 16, 16, 16], 12, 9),     # the document [9, 16) crosses row 12: left out
    ([0, 5, 9, 16, 16, 16], 16, 16),    # a document ending on the limit stays; padding repeats are one offset
    ([0, 5, 9, 16, 16, 16], 100, 16),   # a batch shorter than the limit: all of it
    ([0, 20, 30], 12, 0),               # the first document crosses: nothing to measure
    ([0, 3000, 8000, 8200, 16384, 32768, 32768], 8192, 8000),  # PR #371's limit
])
def test_complete_document_prefix(cu, limit, end):
    assert complete_document_prefix(cu, limit) == end


def test_relative_errors_by_hand():
    ref = torch.zeros(4, 2, 2)
    ref[:, 0] = 1.0  # head 0: Σ ref² = 8 over all rows, 4 over the first 2
    ref[:, 1, 0] = 2.0  # head 1: 16, 8
    x = ref.clone()
    x[0, 0, 0] += 1.0  # head 0, row 0: Σ diff² = 1
    x[3, 1, 1] += 5.0  # head 1, row 3: beyond end = 2, not counted
    zero = torch.zeros_like(ref)
    got = relative_errors([(x, ref, zero), (ref, zero, ref)], (ref, ref, zero), end=2)
    assert got.shape == (2, 3, 2) and got.dtype == torch.float32
    want = torch.tensor([[[math.sqrt(1 / 4), 0.0], [0, 0], [0, 0]],
                         # dK: everything missing (error 1); dV: a zero reference floors at 1e-30, error huge
                         [[0, 0], [1, 1], [math.sqrt(4 / 1e-30), math.sqrt(8 / 1e-30)]]])
    torch.testing.assert_close(got, want)


# PR #371's cost table, ceil((128 + min(w, W))/block_m): (block_m, W) → full, 64, 128, 256
COSTS = {(64, 384): (8, 3, 4, 6), (128, 384): (4, 2, 2, 3), (64, 640): (12, 3, 4, 6), (128, 640): (6, 2, 2, 3)}


@pytest.mark.parametrize("block_m, W", list(COSTS))
def test_the_cost_table(block_m, W):
    assert tuple(backward_cost(w, W, block_m) for w in (None, 64, 128, 256)) == COSTS[block_m, W]
    assert backward_cost(-1, W, block_m) == COSTS[block_m, W][0]
    assert backward_cost(10_000, W, block_m) == COSTS[block_m, W][0]  # a window beyond W costs what full does


def _errors(per_window_head):
    """[W, H] of E(w, h) → [W, 3, H] with the largest on one gradient (the max over gradients is E)."""
    worst = torch.tensor(per_window_head, dtype=torch.float32)
    errors = torch.stack([worst * 0.5, worst, worst * 0.25], dim=1)
    return errors.roll(1, dims=1)  # the binding gradient is dV here, not always dK


def test_choice_on_made_up_errors():
    # heads: all pass | only 256 passes | none passes | 64 fails, 128 passes | NaN at 64, 128 passes
    E = [[0.10, 0.30, 0.5, 0.25, float("nan")],   # w = 64
         [0.05, 0.25, 0.5, 0.15, 0.1],            # w = 128
         [0.01, 0.15, 0.5, 0.05, 0.1]]            # w = 256
    codes = choose_windows(_errors(E), full_window=384, block_m=64)
    assert codes.dtype == torch.int32 and codes.tolist() == [64, 256, -1, 128, 128]
    # block_m 128 (layers 1, 8): 64 and 128 cost 2 each, the more accurate wins; 256 costs 3
    codes = choose_windows(_errors(E), full_window=384, block_m=128)
    assert codes.tolist() == [128, 256, -1, 128, 128]
    tie = [[0.05, 0.15], [0.1, 0.15]]  # head 0: 64 more accurate; head 1: equal errors, 64 (the earlier) wins
    assert choose_windows(_errors(tie), (64, 128), full_window=384, block_m=128).tolist() == [64, 64]
    assert choose_windows(_errors(E), full_window=384, block_m=64, threshold=0.0).tolist() == [-1] * 5


def test_a_window_beyond_w_never_beats_full():
    """W = 128 (stage 0): 256 costs what full costs and full's error is 0; 128 = W also ties full."""
    codes = choose_windows(_errors([[0.3, 0.1], [0.0, 0.0], [0.0, 0.0]]), full_window=128, block_m=64)
    assert codes.tolist() == [-1, 64]


def test_state_reset_keeps_storages_and_finish_chooses():
    layers = {0: EligibleLayer(3, 64, True), 1: EligibleLayer(6, 128, False)}
    state = CalibrationState(layers)
    assert state.tables[0].tolist() == [-1] * 3 and state.tables[1].dtype == torch.int32
    assert state.errors[1].shape == (3, 3, 6) and state.errors[0].shape == (3, 3, 3)
    pointers = [t.data_ptr() for t in (*state.tables.values(), *state.errors.values())]
    # the running max over the two steps: at w = 64, head 0 fails on the first step, head 2 on the second
    state.record(0, _errors([[0.3, 0.1, 0.1], [0.1] * 3, [0.1] * 3]), end=8, window=384)
    state.record(0, _errors([[0.1, 0.1, 0.3], [0.1] * 3, [0.1] * 3]), end=10, window=384)
    state.record(1, _errors([[0.1] * 6] * 3), end=12, window=384)
    state.finish()
    assert state.tables[0].tolist() == [128, 64, 128]  # either step alone would give 64 to head 0 or 2
    assert state.tables[1].tolist() == [64] * 6  # 64 and 128 tie on cost and error: the earlier
    log = state.log_record()
    assert log["layers"]["0"]["windows"] == [128, 64, 128] and log["layers"]["0"]["ends"] == [8, 10]
    assert log["layers"]["0"]["errors"] == pytest.approx([0.1] * 3) and log["layers"]["0"]["binding"] == ["dv"] * 3
    state.reset()
    assert [t.data_ptr() for t in (*state.tables.values(), *state.errors.values())] == pointers
    assert all(t.tolist() == [-1] * len(t) for t in state.tables.values())
    assert all(not e.any() for e in state.errors.values()) and state.ends[0] == []


def test_a_layer_measured_on_no_rank_stays_full():
    state = CalibrationState({1: EligibleLayer(6, 128, False)})
    state.record(1, None, end=0, window=384)  # the first document crossed the limit
    state.finish()
    assert state.tables[1].tolist() == [-1] * 6 and state.log_record()["layers"]["1"]["measured"] is False
    with pytest.raises(RuntimeError, match="never measured"):
        CalibrationState({1: EligibleLayer(6, 128, False)}).finish()


def test_measure_a_snapshot():
    """The portable backward measures the prefix: rows past `end` do not count, a window >= W has error 0,
    shorter windows have larger errors."""
    n, H, W = 48, 3, 16
    gen = torch.Generator().manual_seed(0)
    q, k, v, d_out = (torch.randn(n, H, d, generator=gen) for d in (8, 8, 16, 16))
    cu_host = [0, 20, 34, 48, 48]
    out, lse = windowed_attention_forward(q, k, v, torch.tensor(cu_host, dtype=torch.int32), 0.3, W)
    state = CalibrationState({1: EligibleLayer(H, 64, False)}, candidates=(4, 8, 16))
    assert state.measure(1, q, k, v, out, lse, d_out, cu_host, 0.3, W, limit=40) == 34
    e = state.errors[1]  # (3 windows, 3 gradients, H)
    assert (e[:2] > 0).all() and not e[2].any() and (e[0] >= e[1]).all()
    d_out[34:] += 1.0  # past the prefix: the document [34, 48) crosses 40
    again = CalibrationState({1: EligibleLayer(H, 64, False)}, candidates=(4, 8, 16))
    again.measure(1, q, k, v, out, lse, d_out, cu_host, 0.3, W, limit=40, backward=windowed_attention_backward)
    assert torch.equal(again.errors[1], e)


WORKER = textwrap.dedent('''
    import datetime, sys
    import torch, torch.distributed as dist
    from model.attention_calibration import CalibrationState, EligibleLayer

    rank, world, port, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    torch.set_num_threads(1)
    state = CalibrationState({0: EligibleLayer(3, 64, True), 1: EligibleLayer(6, 128, False)})
    errors = torch.load(f"{out}.errors")  # {layer: [rank's [W, 3, H]]}
    for layer in (0, 1):
        state.record(layer, errors[layer][rank], end=100 + rank, window=384)
    state.finish()
    torch.save({"tables": {l: t.clone() for l, t in state.tables.items()}, "log": state.log_record()}, f"{out}.{rank}")
    dist.barrier()  # no rank tears gloo down while a peer is still in a collective
    dist.destroy_process_group()
''')


@pytest.mark.distributed
def test_two_gloo_ranks_end_with_the_table_of_their_max(tmp_path):
    out = tmp_path / "calibration"
    errors = {0: [_errors([[0.3, 0.1, 0.1], [0.1] * 3, [0.1] * 3]),     # rank 0 alone: 128, 64, 64
                  _errors([[0.1, 0.1, 0.3], [0.1] * 3, [0.1] * 3])],    # rank 1 alone: 64, 64, 128
              1: [_errors([[0.1] * 6, [0.15] * 6, [0.1] * 6]),           # rank 0 alone: 64 everywhere
                  _errors([[0.05] * 3 + [0.3] * 3, [0.1] * 6, [0.3] * 6])]}
    torch.save(errors, f"{out}.errors")
    run_workers(WORKER, tmp_path, 2, out, timeout=120)
    want = {0: [128, 64, 128], 1: [64, 64, 64, 128, 128, 128]}  # by hand, from the elementwise max
    for r in range(2):
        saved = torch.load(f"{out}.{r}")
        for layer in (0, 1):
            assert saved["tables"][layer].tolist() == want[layer], (r, layer)
        assert saved["log"]["layers"]["0"]["ends"] == [100 + r]
