"""The capture check's host and device bytes (perf/cuda_graphs/capture.py's HostStaging and the
names of the state it leaves out; tools/capture_cost.py's count on "meta"), against
hand-computed numbers. The pool and the guard inside a capture are tested with the other capture
tests, on their toy training (tests/perf/test_perf_cuda_graphs_capture.py)."""
import math

import pytest
import torch

from perf.cuda_graphs.capture import HostStaging, written_outside_regions


# ----------------------------------------------------------------------------------------------------
# the staging pool
# ----------------------------------------------------------------------------------------------------


def test_staging_pool_splits_copies_over_blocks_and_restores_them_bit_for_bit():
    """64-byte blocks: an 80-byte bf16 tensor spans two blocks, every copy starts 64-byte aligned;
    restore puts the bits back (a non-contiguous view, a 0-d tensor and bools included)."""
    pool = HostStaging(pin=False, block=64)
    a = torch.arange(40, dtype=torch.bfloat16) / 3            # 80 B: bytes [0, 80)
    b = torch.arange(5, dtype=torch.int64) * -7                # 40 B: [128, 168)
    c = torch.tensor(2.5)                                      # 4 B: [192, 196)
    d = torch.tensor([True, False, True])                      # 3 B: [256, 259)
    base = torch.arange(12.0).reshape(3, 4)
    e = base.t()                                               # 48 B, non-contiguous: [320, 368)
    tensors = [a, b, c, d, e]
    expected = [t.clone() for t in tensors]
    copies = [pool.save(t) for t in tensors]
    assert [c.pieces for c in copies] == [[(0, 0, 64), (1, 0, 16)], [(2, 0, 40)], [(3, 0, 4)], [(4, 0, 3)],
                                          [(5, 0, 48)]]
    assert pool.used == 368 and pool.nbytes == 6 * 64 and len(pool.blocks) == 6
    for t in tensors:
        t.copy_(torch.zeros_like(t))
    for copy, t in zip(copies, tensors):
        pool.restore(copy, t)
    assert all(torch.equal(t, want) for t, want in zip(tensors, expected))
    assert torch.equal(base, torch.arange(12.0).reshape(3, 4))   # the view wrote through to its base


def test_staging_pool_is_reused_and_grows_by_whole_blocks():
    pool = HostStaging(pin=False, block=64)
    pool.save(torch.zeros(30))                      # 120 B: 2 blocks
    blocks = [blk.data_ptr() for blk in pool.blocks]
    pool.clear()
    pool.save(torch.ones(16))                       # 64 B: fits, nothing allocated
    assert [blk.data_ptr() for blk in pool.blocks] == blocks and pool.nbytes == 128
    pool.clear()
    pool.save(torch.ones(16))
    pool.save(torch.ones(20))                       # [0, 64) + [64, 144): 3 blocks, the first two kept
    assert pool.nbytes == 192 and [blk.data_ptr() for blk in pool.blocks[:2]] == blocks
    pool.release()
    assert pool.nbytes == 0 and pool.used == 0
    with pytest.raises(ValueError, match="multiple of 64"):
        HostStaging(pin=False, block=100)


def test_staging_compare_finds_a_difference_in_a_later_block():
    pool = HostStaging(pin=False, block=64)
    t = torch.arange(32.0)                          # 128 B: two blocks, elements 16.. in the second
    copy = pool.save(t)
    assert pool.compare(copy, t) == (True, 0.0, 0.0)
    t[20] += 0.5                                    # max |t| is 31; |graphed - eager| 0.5
    assert pool.compare(copy, t) == (False, 0.5, 31.0)
    t[3] = float("nan")
    same, diff, _ = pool.compare(copy, t)
    assert not same and math.isnan(diff)


def test_what_the_check_leaves_out_by_name():
    """run_state's names of state written only outside the regions; the sink leaf's gradient,
    which the backward writes, stays checked."""
    out = ["ngram_table.rows", "ngram_optimizer.state.exp_avg_sq", "step_weights[mtp]",
           "static_input[ngram_rows [1024, 96] bfloat16]", "static_input[inputs [512] int32]"]
    checked = ["static_input[ngram_rows [1024, 96] bfloat16].grad", "qk_bank", "qk_bank.grad",
               "optimizer[value_embeds].held", "mlp_fp8.post_amax", "ngram_sign_pool"]
    assert all(written_outside_regions(n) for n in out)
    assert not any(written_outside_regions(n) for n in checked)


# ----------------------------------------------------------------------------------------------------
# the count on "meta"
# ----------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smoke_cost():
    """Smoke's first 6 steps on one process: the keys its twin captures (test_perf_cuda_graphs_capture)."""
    from config import RUN_PRESETS
    from tools.capture_cost import capture_check_cost
    from runtime.meta_rank import build_rank_on_meta
    rank = build_rank_on_meta(RUN_PRESETS["smoke"], 1)
    return rank, capture_check_cost(rank, horizon=6)


def test_smoke_capture_check_bytes_against_a_hand_count(smoke_cost):
    """Smoke (D 96, V 50,304, T 512 per virtual rank, P 1,280, 12 MLP slots, banks qk [48, 32, 96],
    vo [16, 96, 96], mlp [24, 192, 96] bf16) on one process, its first 6 steps."""
    from config import RUN_PRESETS
    from model.summary import build_on_meta
    rank, cost = smoke_cost
    keys = {(k.region, k.key if k.region != "optimizer" else (k.key.adam, k.key.table_event)): k for k in cost.keys}
    assert set(keys) == {("forward_backward", rank.schedule.settings(0).geometry), ("optimizer", (False, False)),
                         ("fp8_refresh", True), ("optimizer", (True, True))} and cost.eager_keys == []
    params = sum(p.numel() * p.element_size() for p in build_on_meta(RUN_PRESETS["smoke"].model).parameters())
    value_embeds = 4 * 50304 * 96 * 2
    fb = keys[("forward_backward", rank.schedule.settings(0).geometry)]
    # every parameter's gradient but value_embeds', whose backward adds into the fp16 cycle buffer
    # [4V, 96] instead; the sink leaf's gradient [2T, 96] bf16; the fp8 MLP's two amax [12] fp32
    assert fb.written_bytes == (params - value_embeds) + 4 * 50304 * 96 * 2 + 1024 * 96 * 2 + 2 * 12 * 4
    assert fb.output_sizes == (4,)   # the loss, fp32
    # the first call leaves out: the table [16,384, 96] bf16, its row Adam (fp32 + int32 per row, 23
    # fp64 event sums), the step weights (MTP [70, 3] and prefix [70] tables, [3] and a 0-d, fp32),
    # the static inputs of step 0 (tokens int32, targets int64, 128 cu_seqlens int32, 2T sign rows
    # int32, P candidates int64, the sink [2T, 96] bf16)
    excluded = 16384 * 96 * 2 + 16384 * 8 + 23 * 8 + (70 * 3 + 70 + 3 + 1) * 4 + \
        512 * 4 + 512 * 8 + 128 * 4 + 1024 * 4 + 1280 * 8 + 1024 * 96 * 2
    assert fb.fingerprinted_all - fb.fingerprinted == excluded
    # the update of step 0, right after: the same state plus the gradients the backward made
    tied = keys[("optimizer", (False, False))]
    assert tied.fingerprinted - fb.fingerprinted == (params - value_embeds) + 1024 * 96 * 2
    # the banks' update: parameter, gradient, velocity (2 fp32 rails), mantissa (uint16), lane
    # energy (fp32 along the longer side)
    banks = [(48, 32, 96), (16, 96, 96), (24, 192, 96)]
    assert tied.written_bytes == sum(m * r * c * (2 + 2 + 8 + 2) + m * max(r, c) * 4 for m, r, c in banks)
    # the fp8 refresh: e4m3 W1, W2 in both layouts, 4 scales [12], 2 tile amaxes [12, 6] and the 2 amaxes it rolls
    assert keys[("fp8_refresh", True)].written_bytes == 4 * 12 * 192 * 96 + 4 * 12 * 4 + 2 * 12 * 6 * 4 + 2 * 12 * 4
    largest = keys[("optimizer", (True, True))]
    assert cost.largest is largest and largest.host_bytes == 2 * sum(-(-n // 64) * 64 for n in largest.written_sizes)
    assert cost.pool_bytes == -(-largest.host_bytes // 2 ** 28) * 2 ** 28   # whole 256 MiB blocks


def test_no_region_writes_the_state_the_check_leaves_out(smoke_cost):
    """Structurally, every aten write of every captured region on "meta" (the collectives'
    destinations included): none lands in the excluded state, which the runtime guard (version
    counters) would miss if it came through `.data`, an all_reduce or a raw kernel."""
    _, cost = smoke_cost
    assert [(k.region, k.key, k.writes_excluded) for k in cost.keys if k.writes_excluded] == []
    assert {n.split("[")[0].split(".")[0] for n, _ in cost.excluded} == {"ngram_table", "ngram_optimizer",
                                                                         "step_weights", "static_input"}
