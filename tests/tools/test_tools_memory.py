"""tools/memory.py: the per-rank memory table and the peak estimate of a training step."""
import math

import pytest
import torch

from config import RUN_PRESETS
from model.summary import build_on_meta
from runtime.meta_rank import GIB, build_rank_on_meta, geometries
from tools.memory import LiveStorages, main, memory_report, saved_for_backward, static_items, step_memory

GB = 10 ** 9


@pytest.fixture(scope="module")
def record_report():
    return memory_report(RUN_PRESETS["record"], 8)


def test_static_items_of_smoke_match_an_independent_count():
    """Smoke on 2 ranks: every static item against a count that does not go through the optimizer
    or the summary (parameter sizes from the model, bank shards and Adam shards by hand)."""
    cfg = RUN_PRESETS["smoke"]
    items = {i.name: i for i in static_items(build_rank_on_meta(cfg, 2))}
    model = build_on_meta(cfg.model)
    params = dict(model.named_parameters())
    param_bytes = sum(p.numel() * p.element_size() for p in params.values())
    assert items["parameters"].bytes == param_bytes
    assert items["gradients (.grad)"].bytes == param_bytes - 4 * 50304 * 96 * 2  # value_embeds: no .grad
    # banks on 2 ranks: qk [48, 32, 96] -> 24 matrices each, vo [16, 96, 96] -> 8, mlp [24, 192, 96] -> 12;
    # velocity 2 rails fp32, mantissa uint16, lane energy fp32 along the longer side, lr mults fp32 [chunk]
    def bank(chunk, rows, cols):
        lanes = chunk * max(rows, cols)
        return chunk * rows * cols * (2 * 4 + 2) + lanes * 4 + chunk * 4
    assert items["anvil qk_bank"].bytes == bank(24, 32, 96)
    assert items["anvil vo_bank"].bytes == bank(8, 96, 96)
    assert items["anvil mlp_bank"].bytes == bank(12, 192, 96)
    # sharded Adam: half the rows of lm_head [96, V], embed [V, 96], value_embeds [4V, 96]; two fp32 moments
    assert items["adam lm_head.weight"].bytes == 2 * 4 * 48 * 50304
    assert items["adam embed.weight"].bytes == 2 * 4 * 25152 * 96
    assert items["adam value_embeds"].bytes == 2 * 4 * 100608 * 96
    assert items["value_embeds cycle gradient"].bytes == 4 * 50304 * 96 * 2  # fp16, the whole table
    # n-gram: 16,384 rows over 2 ranks, bf16; row Adam: fp32 moment + int32 event per row, fp64 sums
    assert items["n-gram table shard"].bytes == 8192 * 96 * 2
    schedule_events = sum(1 for s in range(70) if (s % 4 == 3 if s >= 20 else s % 2 == 1))
    assert items["n-gram row Adam state"].bytes == 8192 * (4 + 4) + (schedule_events + 1) * 8
    # tail averages: fp32 copies of the rank's own rows
    assert items["tail average tail-ema"].bytes == 4 * (48 * 50304 + 25152 * 96)
    assert items["tail average value-embed-avg"].bytes == 4 * 100608 * 96
    assert items["tail average bank-blend"].bytes == 4 * (24 * 32 * 96 + 8 * 96 * 96 + 12 * 192 * 96)
    assert "canonical mask" not in items  # smoke validates without it
    # the reset snapshot is host memory: every state_dict tensor, outside the device total
    snapshot = items["warmup-reset snapshot (Run.initial_state)"]
    assert snapshot.where == "host"
    assert snapshot.bytes == param_bytes + sum(b.numel() * b.element_size() for n, b in model.named_buffers()
                                               if n in model.state_dict())


def test_saved_tensors_of_a_known_graph_count_each_storage_once():
    """y = exp(x) saves its result y; y * w saves y and w; sin(z) saves z; a view of y saved by cos
    adds nothing: unique storages y, w, z. w is ignored like a parameter."""
    with torch.device("meta"):
        x = torch.empty(4, 8, requires_grad=True)
        w = torch.empty(8, requires_grad=True)

        def f():
            y = x.exp()
            z = y * w
            return z.sin().sum() + y.view(8, 4).cos().sum()

        _, saved = saved_for_backward(f)
        assert sorted(i.bytes for i in saved.values()) == [32, 128, 128]  # w [8], y, z [4, 8] fp32
        _, saved = saved_for_backward(f, ignore={w.untyped_storage()._cdata})
        assert sum(i.bytes for i in saved.values()) == 2 * 128


def test_live_storages_peak_of_a_known_sequence():
    """b = 2x (400 B), c = exp(b) (400 B): both alive, 800 B; b dropped, then c.sum() (4 B)."""
    with torch.device("meta"):
        x = torch.empty(100)
        tracker = LiveStorages({x.untyped_storage()._cdata})
        with tracker:
            b = x * 2
            c = b.exp()
            mid = tracker.mark()
            del b
            s = c.sum()
            end = tracker.mark()
        assert tracker.peak(0, end) == 800
        assert tracker.peak(mid, end) == 800 and tracker.peak(mid + 1, end) == 404  # from the moment b is freed
        assert [i.bytes for i in tracker.temporaries(0, end)] == [400]
        del c, s


def test_record_at_8_ranks_fits_60_gib(record_report):
    """The record preset per rank, 8 ranks: static 17.2 GiB (15.13 of it the n-gram shard), the worst
    step (1107, full softmax over 40,960 tokens) 20.8 GiB, peak estimate 38.0 GiB (record #360 logged
    53,424 MiB = 52.2 GiB allocated; ours was 52.5 GiB with fp32 logits and an fp32 σ saved). The
    step saves the e4m3 logits [40960, 50304], 1.92 GiB, and nothing fp32 at that size."""
    r = record_report
    items = {i.name: i.bytes for i in r.static}
    assert items["n-gram table shard"] == 10_575_360 * 768 * 2
    assert 15.13 * GIB < r.static_bytes < 18 * GIB
    assert r.worst.settings.step == 1107 and r.worst.settings.softmax_p == 0
    # the row prefetch: the next step's rows received and served, [2T, D] bf16 each, T = 40,960
    assert r.worst.prefetch == 2 * (2 * 40960) * 768 * 2
    assert r.peak_bytes <= 60 * GIB
    widest = max(r.worst.saved_tensors, key=lambda i: i.bytes)
    assert widest.shape == (40960, 50304) and widest.bytes == 40960 * 50304  # the e4m3 logits, 1 byte each


def test_dev_on_one_gpu_fits_80_gb():
    """The dev preset on 1 GPU: the whole 8.4M-row table, unsharded optimizer states, 8 accumulation
    steps (the n-gram gradient rows held over a table cycle are bounded by 31 × [2T, D] fp32)."""
    r = memory_report(RUN_PRESETS["dev"], 1)
    items = {i.name: i.bytes for i in r.static}
    assert items["n-gram table shard"] == 8_388_608 * 768 * 2
    assert r.peak_bytes <= 80 * GB


def test_record_on_one_gpu_fits_40_gib_with_the_table_in_host_memory():
    """The record's recipe in 1 process (8 virtual ranks): the 121.03 GiB table does not fit an H100,
    so `ngram_table=auto` puts it in host memory; the device keeps 8 lanes of the per-rank gradients
    and fp8 scales (optim/lanes.py). Measured: static 9.4 GiB, peak estimate 35.9 GiB; host 127.4 GiB."""
    r = memory_report(RUN_PRESETS["record"], 1)
    host = {i.name: i.bytes for i in r.static if i.where == "host"}
    device = {i.name: i.bytes for i in r.static if i.where == "device"}
    assert host["n-gram table shard"] == 84_602_880 * 768 * 2 and "n-gram table shard" not in device
    V, D = 50304, 768
    # by hand: lm_head [768, V] and embed [V, 768] bf16 .grads, the fp16 value_embeds cycle buffer
    # (4 planes plus the padding rows the model allocates), the small Adam parameters, 4 fp32 [11-slot] states
    small = sum(p.numel() * p.element_size() for n, p in r.rank.model.named_parameters()
                if n not in ("lm_head.weight", "embed.weight", "value_embeds") and not n.endswith("_bank")
                or n == "ve_gate_bank")
    cycle = r.rank.model.value_embeds.numel() * 2
    slots = r.rank.model.mlp_fp8.post_amax.numel()
    assert device["virtual-rank lanes"] == 8 * (2 * V * D * 2 + cycle + small + 4 * slots * 4)
    assert r.peak_bytes <= 40 * GIB
    assert sum(host.values()) < 130 * GIB


def test_nothing_wider_than_2_bytes_is_saved_at_tokens_by_classes():
    """No tensor saved for the backward in training at [T, >= N] (N the sampled-softmax width P, or V)
    is wider than 2 bytes per element (the issue's bound), and the one there is the e4m3 logits at 1
    byte (before: σ of fp32 logits, 4 bytes). Checked at a sampled and a full-softmax geometry of the
    smoke preset."""
    cfg = RUN_PRESETS["smoke"]
    rank = build_rank_on_meta(cfg, 2)
    for settings, steps in geometries(rank.schedule)[:1] + geometries(rank.schedule)[-1:]:  # sampled, full
        m = step_memory(rank, settings, steps)
        width = settings.softmax_p or cfg.model.vocab_size
        wide = [i for i in m.saved_tensors if len(i.shape) == 2 and i.shape[0] == m.tokens and i.shape[1] >= width]
        assert all(info.bytes / math.prod(info.shape) <= 2 for info in wide), wide
        assert [info.dtype for info in wide] == [torch.float8_e4m3fn], wide


def test_memory_command_ends_with_the_two_lines(capsys, record_report):
    main(["--config", "smoke"])
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[-2].startswith("static per rank: ") and lines[-2].endswith(" GiB")
    assert lines[-1].startswith("per-rank peak estimate: ") and lines[-1].endswith(" GiB")
    assert "warmup-reset snapshot" in "\n".join(lines)
    # the capture check's section (tools/capture_cost.py; its numbers: tests/perf/test_perf_cuda_graphs_capture_bytes.py)
    text = "\n".join(lines)
    assert "capture check (SPEEDRUN_CUDA_GRAPHS" in text and "bound: host bytes per rank ≤ 2 × the largest key's" in text
    assert "WARNING" not in text


def test_reset_snapshot_is_a_host_copy(monkeypatch):
    """Run.initial_state (the item listed as host memory) holds host copies of the state_dict's
    tensors, none sharing the model's storage; on CPU they are plain (unpinned) tensors."""
    from runtime import training

    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    cfg = RUN_PRESETS["smoke"]
    run = training.Run(cfg, training.Setup(cfg))
    state = {k: v for k, v in run.model.state_dict().items() if torch.is_tensor(v)}
    assert set(run.initial_state) == set(state)
    for name, t in state.items():
        snap = run.initial_state[name]
        assert snap.device.type == "cpu" and not snap.is_pinned()
        assert snap.untyped_storage().data_ptr() != t.untyped_storage().data_ptr()
        assert torch.equal(snap, t)


def test_the_doc_copy_proposal_adds_its_buffers_and_adam_state(gpt2_bpe):
    """Smoke on 2 ranks with --proposal doc_copy: "other buffers" grows by the matcher's constants, counted
    by hand (the power tables 2 × 262,144 int64, the map 50,304 int32, the bucket mask 31 fp32), the
    parameters by the three fp32 parameters, and each replicated Adam parameter keeps two fp32 moments."""
    from config import PROPOSALS

    plain = {i.name: i for i in static_items(build_rank_on_meta(RUN_PRESETS["smoke"], 2))}
    cfg = PROPOSALS["doc_copy"].apply(RUN_PRESETS["smoke"])
    items = {i.name: i for i in static_items(build_rank_on_meta(cfg, 2))}
    assert items["other buffers"].bytes - plain["other buffers"].bytes == 2 * 262_144 * 8 + 50_304 * 4 + 31 * 4
    added = 4 * (31 + 31 * 96 + 2)
    assert items["parameters"].bytes - plain["parameters"].bytes == added
    assert items["gradients (.grad)"].bytes - plain["gradients (.grad)"].bytes == added
    assert items["adam, replicated parameters"].bytes - plain["adam, replicated parameters"].bytes == 2 * added
    report = memory_report(cfg, 2)
    assert report.peak_bytes > memory_report(RUN_PRESETS["smoke"], 2).peak_bytes


def test_the_cplm_proposal_adds_its_parameters_and_the_pointers_saved_tensors():
    """Smoke on 2 ranks with --proposal cplm, counted by hand: the three parameters (copy_qk_bank bf16
    [2, 128, 96], copy_k_sink fp32 [128], copy_qk_gain fp32 [1]) with their gradients and two fp32 Adam
    moments each, the diagnostics buffer (6 fp32); at the first geometry (T = 512) the pointer kernels save
    q, k bf16 [T, 128], lse, p_copy, a_sink fp32 [T] and doc, dstart, dend int32 [T] (536 B per row, the
    step's inputs and targets not counted again), inside the head's and the step's saved total. The record's
    three parameters are PR #379's 196,737 values."""
    from config import PROPOSALS
    from tools.memory import MemoryReport, cplm_static, format_memory

    plain = {i.name: i for i in static_items(build_rank_on_meta(RUN_PRESETS["smoke"], 2))}
    cfg = PROPOSALS["cplm"].apply(RUN_PRESETS["smoke"])
    rank = build_rank_on_meta(cfg, 2)
    items = {i.name: i for i in static_items(rank)}
    values = 2 * 128 * 96 + 128 + 1
    added = 2 * 128 * 96 * 2 + (128 + 1) * 4
    assert items["parameters"].bytes - plain["parameters"].bytes == added
    assert items["gradients (.grad)"].bytes - plain["gradients (.grad)"].bytes == added
    assert items["adam, replicated parameters"].bytes - plain["adam, replicated parameters"].bytes == 2 * 4 * values
    assert items["other buffers"].bytes - plain["other buffers"].bytes == 6 * 4
    assert cplm_static(rank) == {"values": values, "parameters": added, "gradients": added, "adam": 2 * 4 * values}
    record = cplm_static(build_rank_on_meta(PROPOSALS["cplm"].apply(RUN_PRESETS["record"]), 8))
    assert record == {"values": 196_737, "parameters": 2 * 128 * 768 * 2 + 129 * 4,
                      "gradients": 2 * 128 * 768 * 2 + 129 * 4, "adam": 8 * 196_737}
    assert cplm_static(build_rank_on_meta(RUN_PRESETS["smoke"], 2)) is None

    settings, steps = geometries(rank.schedule)[0]
    m = step_memory(rank, settings, steps)
    T = m.tokens
    kernels = m.cplm_saved["pointer kernels"]
    assert sorted((i.shape, str(i.dtype)) for i in kernels) == sorted(
        [((T, 128), "torch.bfloat16")] * 2 + [((T,), "torch.float32")] * 3 + [((T,), "torch.int32")] * 3)
    assert sum(i.bytes for i in kernels) == T * (2 * 128 * 2 + 3 * 4 + 3 * 4) == 536 * T
    head = sum(i.bytes for i in m.cplm_saved["head"])
    assert head >= 536 * T + T * 96 * 2  # and the projections' input h bf16 [T, D]
    assert head + sum(i.bytes for i in m.cplm_saved["mixture"]) < m.saved
    plain_step = step_memory(build_rank_on_meta(RUN_PRESETS["smoke"], 2), settings, steps)
    assert m.saved - plain_step.saved >= head
    text = format_memory(MemoryReport(rank, static_items(rank), [m]))
    assert f"{values:,} values" in text and f"step     0 T={T:,}: pointer kernels {536 * T / 2**20:,.2f}, head" in text
