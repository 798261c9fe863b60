"""tools/cost.py: the FLOP counter against hand formulas, its bytes against a hand-counted graph, the
attention's pairs against a brute-force mask, the optimizer's collectives against the banks' sizes, the
smoke model's GEMMs against 6·N·T, the datasheet peaks, the roofline, tokens/s, MFU and the peak fraction,
CPLM's pointer kernels against a brute-force loop over their tiles; the record's per-stretch times from a
made-up log by hand, a prediction against its hand-written sum, the record predicting itself, the printed lines."""
import pytest
import torch

from config import RUN_PRESETS
from perf.attention_backends import varlen_attention_mask
from perf.fp8 import E4M3, scaled_mm
from runtime import op_count, throughput
from tools import cost


def _count(fn):
    counter = op_count.FlopCounter()
    with counter:
        fn()
    return {k: v for k, v in counter.flops.items() if v}


def test_plain_matmuls_by_dtype_and_pointwise_by_element():
    a, b = torch.randn(6, 5), torch.randn(5, 7)
    assert _count(lambda: a @ b) == {"fp32 GEMM": 2 * 6 * 5 * 7}
    a16, b16 = a.bfloat16(), b.bfloat16()
    assert _count(lambda: a16 @ b16) == {"bf16 GEMM": 2 * 6 * 5 * 7}
    batched = torch.randn(3, 6, 5, dtype=torch.bfloat16)
    assert _count(lambda: torch.bmm(batched, batched.transpose(1, 2))) == {"bf16 GEMM": 3 * 2 * 6 * 5 * 6}
    assert _count(lambda: a + 1) == {"pointwise": 30}


def test_fp8_gemms_count_as_fp8_through_the_project_op_and_torch():
    a = (torch.randn(16, 32) * 8).to(E4M3)
    b = (torch.randn(64, 32) * 8).to(E4M3).t()  # (32, 64) column-major
    one = torch.tensor(1.0)
    assert _count(lambda: scaled_mm(a, b, one, one, torch.float32, False)) == {"fp8 GEMM": 2 * 16 * 32 * 64}
    assert _count(lambda: torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.float32)) == \
        {"fp8 GEMM": 2 * 16 * 32 * 64}


@pytest.mark.parametrize("window", [0, 3, 7, 100])
def test_attention_pairs_match_a_brute_force_mask(window):
    lengths = [1, 5, 9, 13, 0, 4]
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)))
    T = int(cu[-1])
    assert op_count.attention_pairs(lengths, window) == int(varlen_attention_mask(cu, T, window).sum())
    fwd, bwd = op_count.attention_flops(cu.tolist(), window, heads=6, d_qk=16, d_v=8, paired=False)
    pairs = int(varlen_attention_mask(cu, T, window).sum())
    assert fwd == 2 * pairs * 6 * (16 + 8) and bwd == 2 * pairs * 6 * (3 * 16 + 2 * 8)
    # paired heads: half the heads over the doubled positions (the layout perf.attention_backends uses)
    paired_fwd, _ = op_count.attention_flops(cu.tolist(), window, heads=6, d_qk=16, d_v=8, paired=True)
    doubled = int(varlen_attention_mask(2 * cu, 2 * T, window).sum())
    assert paired_fwd == 2 * doubled * 3 * (16 + 8)


@pytest.fixture(scope="module")
def smoke_rank():
    from runtime.meta_rank import build_rank_on_meta

    return build_rank_on_meta(RUN_PRESETS["smoke"], 2)


def test_the_smoke_models_gemms_are_6_n_t_of_the_parameters_the_step_uses(smoke_rank):
    """N counts what the step's GEMMs touch (the attention weights as cut from the banks, the MLP
    slots read, the lm_head's P or V columns, the small matrices), so the counted tensor-core GEMMs
    of a forward and backward are 6·N·T within 0.5%, at the full softmax and a sampled one: N counts
    the MUDD and gate matrices whole, and the smaller MUDD block and the post gate use fewer rows of
    theirs (measured 0.9985 on smoke, 0.99994 on the record)."""
    from runtime.meta_rank import geometries

    for settings, steps in geometries(smoke_rank.schedule):
        g = op_count.geometry_cost(smoke_rank, settings, steps)
        gemms = g.flops["fp8 GEMM"] + g.flops["bf16 GEMM"] + g.flops["fp32 GEMM"]
        assert gemms == pytest.approx(g.six_n_t, rel=5e-3)
        D, V = smoke_rank.cfg.model.model_dim, smoke_rank.cfg.model.vocab_size
        assert g.params["lm_head"] == D * (settings.softmax_p or V)
        # the model FLOPs leave out FA3's recomputed QKᵀ, which the hardware FLOPs keep
        assert 0 < g.flops["attention recompute"] < g.flops["attention"] / 3
        assert g.model_flops == gemms + g.flops["attention"] - g.flops["attention recompute"]
        assert g.hardware_flops == gemms + g.flops["attention"]
    # the padded bank slots, layer 7's MLP slot and the full lm_head are not counted
    model = smoke_rank.model
    assert g.params["MLP"] == 11 * model.mlp_bank[0].numel()
    assert g.params["attention"] < model.qk_bank.numel() + model.vo_bank.numel()


def test_the_step_counts_the_triton_kernels_as_kernels(smoke_rank):
    """Under fused_kernels the fp8 CE is one kernel each way, reading the e4m3 logits [T, N] once and
    writing lse (forward) or the e5m2 gradient (backward): its twin's fp32 slabs are not counted."""
    from runtime.meta_rank import geometries

    settings, steps = geometries(smoke_rank.schedule)[0]
    g = op_count.geometry_cost(smoke_rank, settings, steps)
    T, N = g.tokens, settings.softmax_p or smoke_rank.cfg.model.vocab_size
    assert g.traffic.bytes["fused kernel"] >= 3 * T * N  # e4m3 read twice, e5m2 written once
    assert g.traffic.memory_bound_bytes > g.traffic.fusable > 0


def test_the_optimizer_sends_each_bank_once_each_way(smoke_rank):
    """A non-Adam step: the banks' bf16 gradients reduce-scattered and their updates all-gathered, each
    rank sending (W-1)/W of each bank (ring), nothing else."""
    phases = cost.phase_costs(smoke_rank)
    banks = sum(p.numel() for n, p in smoke_rank.model.named_parameters() if n.endswith("_bank") and n != "ve_gate_bank")
    plain = next(p for p in phases if not p.phase.adam and not p.phase.table_event and p.phase.tied)
    assert plain.sent_bytes == {"reduce-scatter (torch.bfloat16)": banks * 2 // 2, "all-gather (torch.bfloat16)": banks * 2 // 2}
    assert plain.flops["bf16 GEMM"] > 0  # ANVIL's cascades
    adam = next(p for p in phases if p.phase.adam)
    assert sum(adam.sent_bytes.values()) > sum(plain.sent_bytes.values())
    assert sum(len(p.steps) for p in phases) == smoke_rank.schedule.total_steps


def test_tokens_per_second_mfu_and_peak_fraction():
    from optim.schedule import TrainingSchedule

    schedule = TrainingSchedule(RUN_PRESETS["smoke"].schedule)
    plain = throughput.RunCost(schedule)
    tokens = sum(schedule.batch_tokens(s) for s in range(10))
    assert plain.tokens_per_s(10, 2000.0) == pytest.approx(tokens / 2.0)
    assert plain.mfu(10, 2000.0) is None and plain.peak_fraction(10, 2000.0) is None  # no peak: neither
    g = op_count.GeometryCost(None, list(range(schedule.total_steps)), 512, 1,
                          {"fp8 GEMM": 2e12, "bf16 GEMM": 1e12, "fp32 GEMM": 0, "attention": 1e12, "pointwise": 5e9,
                           "attention recompute": 0.2e12}, {})
    peak = throughput.DevicePeak("test", fp8_tflops=1000.0, bf16_tflops=500.0, tf32_tflops=250.0, fp32_tflops=50.0,
                           hbm_tb_per_s=1.0, link_gb_per_s=1.0, source="a test")
    run = throughput.RunCost(schedule, [g], peak)
    # MFU: 10 steps × 3.8e12 model FLOPs (4e12 less the 0.2e12 recomputed) over 2 s at 500 TFLOP/s
    assert run.mfu(10, 2000.0) == pytest.approx(0.038)
    assert throughput.mfu(3.8e13, 2.0, peak) == pytest.approx(0.038)
    # peak fraction: 10 steps of 2 ms (fp8 at 1000) + 4 ms (bf16 and attention at 500) at peak in 2 s
    assert run.peak_fraction(10, 2000.0) == pytest.approx(0.03)


def test_the_datasheet_peaks_and_the_fp32_gemm_price():
    """H100 SXM (NVIDIA's datasheet, sparse tensor-core figures halved): fp8 1,978.9, bf16 989.4, TF32
    494.7 dense TFLOP/s, fp32 67 on the CUDA cores, HBM3 3.35 TB/s, NVLink 450 GB/s each way; the
    H200 SXM has the same cores and 4.8 TB/s. fp32 GEMMs cost the fp32 peak unless TF32 is enabled."""
    h100, h200 = throughput.H100_SXM, throughput.H200_SXM
    assert (h100.fp8_tflops, h100.bf16_tflops, h100.tf32_tflops, h100.fp32_tflops) == (1978.9, 989.4, 494.7, 67.0)
    assert (h100.hbm_tb_per_s, h100.link_gb_per_s) == (3.35, 450.0)
    assert (h200.fp8_tflops, h200.bf16_tflops, h200.fp32_tflops, h200.hbm_tb_per_s) == (1978.9, 989.4, 67.0, 4.8)
    assert torch.get_float32_matmul_precision() == "highest"  # torch's default: nothing here changes it
    assert h100.tflops("fp32 GEMM") == 67.0 and h100.tflops("fp8 GEMM") == 1978.9
    assert h100.tflops("bf16 GEMM") == h100.tflops("attention") == 989.4
    torch.set_float32_matmul_precision("high")
    try:
        assert h100.tflops("fp32 GEMM") == 494.7
    finally:
        torch.set_float32_matmul_precision("highest")


def _traffic(fn):
    counter = op_count.FlopCounter()
    with counter:
        fn(counter)
    return counter


def test_bytes_of_a_hand_counted_graph():
    """c = a·b (broadcast), d = bf16(c), a view of d, its sum; a GEMM; a gather; a kernel of two ops.
    fp32 a [4, 8] is 128 B, b [8] 32 B."""
    a, b = torch.randn(4, 8), torch.randn(8)
    table, ids = torch.randn(10, 8), torch.tensor([1, 5, 5])
    w = torch.randn(8, 2)

    def graph(counter):
        c = a * b  # reads 128 + 32, writes 128: 288
        d = c.to(torch.bfloat16)  # reads 128, writes 64: 192
        d.view(32).sum()  # the view is free; the sum reads 64, writes a bf16 scalar 2: 66
        a @ w  # a GEMM: 2·4·8·2 FLOPs; reads 128 + 64, writes 32
        torch.nn.functional.embedding(ids, table)  # reads 3 rows (96) and the ids (24), writes 96: 216
        with counter.kernel() as returned:  # one kernel: reads a (128), writes u (128); t is internal
            t = a * 2
            u = t + 1
            returned(u)

    counter = _traffic(graph)
    assert dict(counter.bytes) == {"pointwise": 288, "copy and cast": 192, "other": 66, "gather and scatter": 216,
                                   "fused kernel": 256}
    assert dict(counter.gemm_ops) == {("fp32 GEMM", 128, 224): 1}
    # fusing: c is read once, by the cast (128 written + 128 read); d once, by the sum (64 + 64); a is
    # read by several ops and the sum's result by none
    assert counter.fusable() == 384


def test_the_roofline_of_a_region():
    """Traffic.seconds: each GEMM call at max(FLOPs at its peak, bytes at HBM bandwidth), the
    memory-bound bytes at bandwidth, less what fusion saves when fused."""
    peak = throughput.DevicePeak("test", fp8_tflops=1000.0, bf16_tflops=500.0, tf32_tflops=250.0, fp32_tflops=50.0,
                           hbm_tb_per_s=1.0, link_gb_per_s=1.0, source="a test")
    traffic = op_count.Traffic({("bf16 GEMM", 10**12, 10**9): 2, ("fp8 GEMM", 10**9, 10**10): 1},
                           {"pointwise": 3 * 10**9}, fusable=10**9)
    # 2 × max(2 ms, 1 ms) + max(1 µs, 10 ms) + 3 ms (unfused) or 2 ms (fused)
    assert traffic.seconds(peak, fused=False) == pytest.approx(0.004 + 0.010 + 0.003)
    assert traffic.seconds(peak, fused=True) == pytest.approx(0.004 + 0.010 + 0.002)


def test_device_peaks_by_cuda_name():
    assert throughput.device_peak("NVIDIA H100 80GB HBM3") is throughput.H100_SXM
    assert throughput.device_peak("NVIDIA H200") is throughput.H200_SXM
    assert throughput.device_peak("NVIDIA H100 PCIe") is None and throughput.device_peak("NVIDIA H200 NVL") is None
    assert throughput.device_peak("NVIDIA A100-SXM4-80GB") is None


def test_host_table_bytes_by_hand():
    """The record's stage-0 step on 1 process (8 micro-batches of 16,384 tokens): 262,144 ids, 58%
    distinct (152,043.52 rows), bf16 rows of 768 (1,536 bytes): 233,538,846.7 bytes; a table event
    reads and writes back half a 4-step cycle's ids."""
    from tools.cost import host_table_bytes
    cfg = RUN_PRESETS["record"]
    assert host_table_bytes(cfg, 16_384, 8, False) == {"n-gram row gather, host→device (bf16)": 233_538_846}
    event = host_table_bytes(cfg, 16_384, 8, True)
    assert event["n-gram event rows, host→device and back (bf16)"] == 2 * 524_288 * 768 * 2


def test_each_step_is_priced_with_its_own_table_event():
    """A geometry groups steps of one shape, table events or not: the n-gram push (and a host table's
    event traffic) is priced by each step's own event, as the schedule has it."""
    from optim.schedule import TrainingSchedule
    from tools.cost import schedule_cost

    cfg = RUN_PRESETS["smoke"]
    cost = schedule_cost(cfg, 2)
    schedule = TrainingSchedule(cfg.schedule, cfg.features)
    events = [s for s in range(schedule.total_steps) if schedule.is_table_event(s)]
    assert [s for s in range(schedule.total_steps) if cost.is_table_event(s)] == events
    pushed = [s for s in range(schedule.total_steps) if any("push" in k for k in cost.sent_bytes(s))]
    assert pushed == events and len(events) > len({cost.geometry_at(s).steps[0] for s in events})


def test_the_doc_copy_matcher_is_priced_and_its_sort_moves_what_it_must(gpt2_bpe):
    """With --proposal doc_copy every geometry names the matcher's bytes; at least what its stable sort
    of 10·T int64 keys moves by hand (the keys read, the sorted keys and their indices written: 3 × 80·T
    bytes) and its two scatters back (each writes 10·T int64 and reads its 10·T indices and values:
    ≥ 2 × 240·T), inside the step's memory-bound bytes; none without the feature."""
    from config import PROPOSALS
    from runtime.meta_rank import build_rank_on_meta, geometries

    cfg = PROPOSALS["doc_copy"].apply(RUN_PRESETS["smoke"])
    rank = build_rank_on_meta(cfg, 2)
    settings, steps = geometries(rank.schedule)[0]
    g = op_count.geometry_cost(rank, settings, steps)
    T = g.tokens
    assert g.matcher["other"] >= 3 * 10 * T * 8
    assert g.matcher["gather and scatter"] >= 2 * 3 * 10 * T * 8
    assert sum(g.matcher.values()) < g.traffic.memory_bound_bytes
    text = "\n".join(cost.matcher_lines(cost.ScheduleCost(cfg, 2, [g], []), throughput.H100_SXM))
    assert f"T={T:,}:" in text and "% of" in text
    plain = op_count.geometry_cost(build_rank_on_meta(RUN_PRESETS["smoke"], 2), settings, steps)
    assert plain.matcher is None


# ----------------------------------------------------------------------------------------------------
# features.cplm (PR #379): the pointer's Triton kernels priced by their tiles
# ----------------------------------------------------------------------------------------------------

def _bounds(segments, n):
    """(dstart, dend) of every position, walking the segments (no searchsorted)."""
    dstart, dend, pos = [0] * n, [n] * n, 0
    for length in segments:
        for i in range(pos, min(pos + length, n)):
            dstart[i], dend[i] = pos, min(pos + length, n)
        pos += length
    return dstart, dend


def _tiles_by_brute_force(segments, n, band, bm=64, bn=64):
    """Every (query tile, key tile) pair, checked against the kernels' rule in the spec's words: query tile
    m0 visits the key tiles from the one holding max(dstart(m0), ⌊m0/L⌋·L − L, 0) to its diagonal (a key
    tile with a key before its last row); key tile n0 visits the query tiles from its own to the one
    before min(dend(its last key), (⌊last key/L⌋ + 2)·L, n). Returns the visited sets."""
    dstart, dend = _bounds(segments, n)
    forward, dk = set(), set()
    for m0 in range(0, n, bm):
        lo = max(dstart[m0], (m0 // band) * band - band, 0)
        for n0 in range(0, n, bn):
            if n0 + bn > lo and n0 < min(m0 + bm, n) - 1:
                forward.add((m0 // bm, n0 // bn))
    for n0 in range(0, n, bn):
        last = min(n0 + bn, n) - 1
        end = min(dend[last], (last // band + 2) * band, n)
        for m0 in range(0, n, bm):
            if n0 <= m0 < end:
                dk.add((m0 // bm, n0 // bn))
    return forward, dk


def _valid_pairs(segments, n, band):
    """(i, j) where the pointer's query i sees source j (frontier_cplm.md §5), as an [n, n] mask."""
    dstart = torch.tensor(_bounds(segments, n)[0])
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    return (j < i) & (dstart[None, :] == dstart[:, None]) & (j >= (i // band) * band - band)


@pytest.mark.parametrize("segments, band", [
    ([300, 1000, 77, 900, 3], 512),  # segments across tiles and blocks, n not a multiple of 64
    ([320, 64] * 4, 256),  # the record's stage-2 layout scaled down: 2,560 + 512 segments, L = 2,048
    ([1536], 2048),  # one segment inside the first block (the smoke geometry's)
    ([65, 1, 62, 700], 128),
])
def test_the_pointer_kernels_tiles_match_a_brute_force_loop_over_tiles(segments, band):
    """`pointer_tiles` (the kernels' loop bounds) against every tile pair checked by hand, every valid pair
    inside a visited tile of both sets (so the count never prices less than the pointer needs), and
    `pointer_pairs` against the definition's mask."""
    n = sum(segments)
    cu = [0] + torch.tensor(segments).cumsum(0).tolist() + [n, n]  # trailing empty segments, as a batch pads
    forward, dk = _tiles_by_brute_force(segments, n, band)
    assert op_count.pointer_tiles(cu, n, band, 64, 64) == {"forward": len(forward), "dq": len(forward), "dk": len(dk)}
    valid = _valid_pairs(segments, n, band)
    i, j = valid.nonzero().unbind(1)
    tiles = set(zip((i // 64).tolist(), (j // 64).tolist()))
    assert tiles <= forward and tiles <= dk
    assert cost.pointer_pairs(cu, n, band) == int(valid.sum())


def test_the_cplm_step_prices_the_pointer_kernels_and_the_head(smoke_rank):
    """Smoke with --proposal cplm at its first geometry (T = 512, one segment, L = 2,048): the pointer's
    FLOPs are the brute-force tiles × 2·64·64·128 (forward 1 product, dq and dk 2 each, one of them
    recomputed), exactly what the step's attention column and recomputation gained over the record's;
    the q/k projections add 3 × 2·T·D·256 bf16 GEMM FLOPs and the dense definition is not run (no fp32
    GEMM). The head counted alone has the same kernels; the tool prints its line."""
    from config import PROPOSALS
    from model.cplm import COPY_DIM
    from runtime.meta_rank import build_rank_on_meta, geometries, meta_step

    cfg = PROPOSALS["cplm"].apply(RUN_PRESETS["smoke"])
    rank = build_rank_on_meta(cfg, 2)
    settings, steps = geometries(rank.schedule)[0]
    with cost.recorded_cplm_calls() as calls:
        g = op_count.geometry_cost(rank, settings, steps)
    plain = op_count.geometry_cost(smoke_rank, *geometries(smoke_rank.schedule)[0])
    T, D = g.tokens, cfg.model.model_dim
    cu = meta_step(rank, settings, steps).host_batch.cu_seqlens.tolist()
    segments = [b - a for a, b in zip(cu, cu[1:]) if b > a]
    forward, dk = _tiles_by_brute_force(segments, T, 2048)
    assert (len(forward), len(dk)) == (8 * 9 // 2, 8 * 9 // 2)  # T = 512: 8 query tiles, a triangle
    tile = 2 * 64 * 64 * COPY_DIM
    assert g.pointer["tiles"] == {"forward": len(forward), "dq": len(forward), "dk": len(dk)}
    assert g.pointer["flops"] == {"forward": tile * len(forward), "dq": 2 * tile * len(forward), "dk": 2 * tile * len(dk)}
    assert g.flops["attention"] - plain.flops["attention"] == sum(g.pointer["flops"].values())
    assert g.flops["attention recompute"] - plain.flops["attention recompute"] == tile * (len(forward) + len(dk))
    assert g.flops["bf16 GEMM"] - plain.flops["bf16 GEMM"] == 3 * 2 * T * D * 2 * COPY_DIM
    assert g.flops["fp32 GEMM"] == plain.flops["fp32 GEMM"] == 0
    # q, k bf16 [T, 128] read by all three kernels, dq and dk written: at least 5 × 256 bytes per row
    assert sum(g.pointer["bytes"].values()) >= 5 * T * COPY_DIM * 2
    alone = cost.cplm_cost(rank, g, calls)
    assert alone.pointer == g.pointer and alone.flops["bf16 GEMM"] == 3 * 2 * T * D * 2 * COPY_DIM
    assert alone.band == 2048 and alone.pairs == T * (T - 1) // 2 and alone.segments == [T]
    text = "\n".join(cost.cplm_lines(cost.ScheduleCost(cfg, 2, [g], [], [alone]), throughput.H100_SXM))
    assert f"T={T:,} (1 × {T:,}): tiles 36 forward and dq, 36 dk" in text
    assert f"GFLOP {tile * 36 / 1e9:,.2f} / {2 * tile * 36 / 1e9:,.2f} / {2 * tile * 36 / 1e9:,.2f}" in text
    # the record's comparison: the proposal's floor against RECORD_FLOOR_SECONDS, on the record's preset only
    record = PROPOSALS["cplm"].apply(RUN_PRESETS["record"])
    lines = cost.cplm_schedule_lines(cost.ScheduleCost(record, 8, [g], [], [alone]), throughput.H100_SXM,
                                     g.steps, 26.8)
    assert lines[-1].endswith(f"the schedule's fused floor is 26.80 s over {len(g.steps)} steps, against the "
                              f"record's 30.04 s over 1194 (RECORD_FLOOR_SECONDS): −3.24 s")
    assert op_count.geometry_cost(smoke_rank, settings, steps).pointer is None  # none without the feature


def test_the_cost_command_prints_the_cplm_lines(capsys, monkeypatch):
    """`python -m tools.cost --config smoke --proposal cplm`, its first geometry only (the whole schedule
    takes 15 s): the CPLM header, its geometry's line and the schedule's line."""
    first = cost.geometries
    monkeypatch.setattr(cost, "geometries", lambda schedule: first(schedule)[:1])
    cost.main(["--config", "smoke", "--proposal", "cplm"])
    out = capsys.readouterr().out
    assert "past the record, on: cplm" in out
    assert "cplm (PR #379), one rank's step: the pointer's 3 Triton kernels" in out
    assert "0-16    T=512 (1 × 512): tiles 36 forward and dq, 36 dk" in out
    assert "cplm over the 17 steps: pointer kernels" in out


def test_the_restricted_attention_backward_is_priced_by_each_heads_window(smoke_rank):
    """features.approx_attention_backward on the smoke preset at its first mode-2 geometry (steps 33-35): the
    attention column drops by exactly the backward pairs the five layers' heads skip at PR #371's certify-run
    windows, counted on the brute-force mask per head (2·(3·d_qk + 2·d_v) FLOPs a pair, d = 8 everywhere
    but the paired layers' d_v = 16), and the recomputation by 2·d_qk a pair; the forward is unchanged."""
    import dataclasses

    from config import FeatureConfig
    from model.attention_calibration import PR_371_RUN_01_WINDOWS
    from model.gpt import PAIRED_HEAD_LAYERS
    from runtime.meta_rank import build_rank_on_meta, geometries, meta_step

    cfg = dataclasses.replace(RUN_PRESETS["smoke"], features=FeatureConfig(approx_attention_backward=True))
    rank = build_rank_on_meta(cfg, 2)
    settings, steps = next((s, st) for s, st in geometries(rank.schedule) if s.attention_mode == 2)
    assert steps[0] == 33
    g = op_count.geometry_cost(rank, settings, steps)
    stock = op_count.geometry_cost(rank, dataclasses.replace(settings, attention_mode=0), steps)
    cu = torch.tensor(meta_step(rank, settings, steps).host_batch.cu_seqlens.tolist())
    W = settings.ws_short * 128
    skipped = skipped_recompute = 0
    for layer, codes in PR_371_RUN_01_WINDOWS.items():
        paired = layer in PAIRED_HEAD_LAYERS
        n = 2 * int(cu[-1]) if paired else int(cu[-1])
        stream_cu = 2 * cu if paired else cu
        full = int(varlen_attention_mask(stream_cu, n, W).sum())
        d_qk, d_v = 8, 16 if paired else 8
        for code in codes:
            kept = int(varlen_attention_mask(stream_cu, n, W if code < 0 else min(code, W)).sum())
            skipped += 2 * (full - kept) * (3 * d_qk + 2 * d_v)
            skipped_recompute += 2 * (full - kept) * d_qk
    A = rank.accum
    assert skipped > 0
    assert stock.flops["attention"] - g.flops["attention"] == skipped * A
    assert stock.flops["attention recompute"] - g.flops["attention recompute"] == skipped_recompute * A


# ----------------------------------------------------------------------------------------------------
# the record's measured time per stretch (tools/record_timing.py) and a change priced on it
# ----------------------------------------------------------------------------------------------------

def test_stretch_times_split_a_made_up_log_by_hand():
    """Stretches ending at steps done [0, 5, 12], a line every 2 steps: steps run at 2 then 5 ms, the clock
    starts with 7 ms of one-off work, the crossing interval (4, 6] takes 9 ms (not 2 + 5) and the final line
    holds 11 ms after the last step. The rates come from the lines inside each stretch (2→4: 2 ms; 6→12:
    5 ms); the crossing 9 ms splits 2 : 5 by step × rate; every millisecond lands once."""
    from tools.record_timing import interior_rates, stretch_times

    points = [(2, 11), (4, 15), (6, 24), (8, 34), (10, 44), (12, 54)]
    assert interior_rates(points, [0, 5, 12]) == [2.0, 5.0]
    t = stretch_times(points, [0, 5, 12], final_ms=65)
    assert t.steps == (5, 7)
    assert t.start_ms == pytest.approx(7.0) and t.end_ms == pytest.approx(11.0)
    assert t.ms_per_step[0] == pytest.approx((4 + 4 + 9 * 2 / 7) / 5)
    assert t.ms_per_step[1] == pytest.approx((9 * 5 / 7 + 30) / 7)
    assert t.total_ms == pytest.approx(65.0)
    with pytest.raises(ValueError, match="stretch 0 .* holds 1 logged point"):
        interior_rates([(4, 15), (6, 24), (8, 34)], [0, 5, 8])


def test_the_record_log_figures_and_the_record_schedules_stretches():
    """RECORD_360 covers record #360's stretches (the record preset's stage ends and its stage-2 width change
    at 965) and adds up to its log's final train_time, 39,846 ms, to the constants' rounding."""
    from tools.record_timing import RECORD_360

    spans = cost.stretches(RUN_PRESETS["record"].schedule)
    assert [(r.start, r.stop) for r in spans] == [(0, 320), (320, 681), (681, 965), (965, 1107), (1107, 1174),
                                                  (1174, 1194)]
    assert tuple(len(r) for r in spans) == RECORD_360.steps
    assert RECORD_360.total_ms == pytest.approx(39_846, abs=0.01)


class _FakeCost:
    """A ScheduleCost's `cfg` and `floor`, no counting: each step's (compute, communication) seconds made up."""

    def __init__(self, cfg, floor_of_step):
        self.cfg, self.floor_of_step = cfg, floor_of_step

    def floor(self, step, peak, with_bytes="fused"):
        return self.floor_of_step(step)


def test_a_prediction_is_steps_times_floor_times_the_records_ratio():
    """By hand: a made-up record of 2 stretches (5 and 7 steps, floors 2 and 4 ms/step, measured 3 and 5,
    one-off 7 + 11 ms) has ratios 1.5 and 1.25; a run of 3 and 4 steps at floors 2 and 5 ms/step is
    predicted at 3·2·1.5 + 4·5·1.25 + 18 = 52 ms."""
    from tools.record_timing import StretchTimes

    assert cost.predict_ms((3, 4), (2.0, 5.0), (1.5, 1.2), 10.0) == pytest.approx(3 * 2 * 1.5 + 4 * 5 * 1.2 + 10)
    calibration = cost.Calibration((2.0, 4.0), StretchTimes((5, 7), (3.0, 5.0), 7.0, 11.0))
    assert calibration.ratios == pytest.approx((1.5, 1.25)) and calibration.fixed_ms == 18.0
    run = cost.Prediction("run", (range(0, 3), range(3, 7)), (2.0, 5.0), calibration)
    assert run.seconds == pytest.approx((3 * 2 * 1.5 + 4 * 5 * 1.25 + 18) / 1000)
    assert run.delta == pytest.approx(run.seconds - (5 * 3 + 7 * 5 + 18) / 1000)


def test_the_record_predicts_its_own_measured_time_exactly():
    """By construction: its ratios are its measured ms/step over its own floors, so its steps × floors ×
    ratios give back the measured time, whatever the floors are (made up here: the wiring through
    `stretch_floors`, the overlapped max of each step's compute and communication, `calibrate`, `predict`)."""
    import dataclasses

    from config import ConfigError
    from tools.record_timing import RECORD_360

    record = _FakeCost(RUN_PRESETS["record"], lambda s: (1e-3 * (10 + s % 7), 1e-3 * (s % 3) * 6))
    calibration = cost.calibrate(record)
    first = [max(10 + s % 7, (s % 3) * 6) for s in range(320)]
    assert calibration.floor_ms[0] == pytest.approx(sum(first) / 320)
    p = cost.predict(record, calibration)
    assert p.seconds * 1000 == pytest.approx(RECORD_360.total_ms, rel=1e-12)
    assert p.delta == pytest.approx(0, abs=1e-12)
    # a schedule with other stretches than the log's cannot be calibrated on it, nor predicted on its ratios
    with pytest.raises(ValueError, match="the schedule changed under RECORD_360"):
        cost.calibrate(_FakeCost(RUN_PRESETS["smoke"], lambda s: (1e-3, 0.0)))
    schedule = RUN_PRESETS["record"].schedule
    one_width = tuple(dataclasses.replace(st, softmax_p=st.softmax_p[:1]) for st in schedule.stages)
    cfg = dataclasses.replace(RUN_PRESETS["record"], schedule=dataclasses.replace(schedule, stages=one_width))
    with pytest.raises(ConfigError, match=r"--set/--proposal: the schedule has 5 stretches \(0-319, 320-680, "
                                          r"681-1106, .* record #360's log 6"):
        cost.predict(_FakeCost(cfg, lambda s: (1e-3, 0.0)), calibration)


def test_the_proposals_claims_parse():
    from config import PROPOSALS

    claims = {name: cost.parse_claim(p.claim) for name, p in PROPOSALS.items()}
    assert claims["cplm"] == cost.Claim(36.009, 0.039, 40.575, 0.024)
    assert claims["token_norm_hashes"] == cost.Claim(40.588, None, 41.008, None)
    assert claims["stack"] is None
    assert claims["cplm"].delta == pytest.approx(-4.566)
    assert claims["cplm"].delta_spread == pytest.approx((0.039 ** 2 + 0.024 ** 2) ** 0.5)
    assert claims["token_norm_hashes"].delta_spread is None


def test_the_printed_prediction_of_one_proposal():
    """The per-stretch lines and the claim's line for --proposal cplm, on made-up floors (each stretch's
    record floor + 1 ms/step) and the record's log: their format, and the numbers they must show."""
    from config import PROPOSALS
    from tools.record_timing import RECORD_360

    cfg = PROPOSALS["cplm"].apply(RUN_PRESETS["record"])
    calibration = cost.Calibration((10.0, 20.0, 30.0, 30.0, 30.0, 10.0), RECORD_360)
    ranges = cost.stretches(cfg.schedule)
    floors = {s: f + 1 for r, f in zip(ranges, calibration.floor_ms) for s in r}
    p = cost.predict(_FakeCost(cfg, lambda s: (floors[s] / 1000, 0.0)), calibration)
    assert p.label == "cplm" and p.pr == "PR #379"
    lines = cost.prediction_lines(p)
    assert lines[0] == ("  predicted for cplm: per stretch, its steps × its floor ms/step × the record's ratio there, "
                        "plus the record's one-off 0.37 s")
    assert lines[1].split() == ["steps", "n", "floor", "ms/step", "ratio", "predicted", "ms/step", "record", "n",
                                "record", "ms/step"]
    ratio = RECORD_360.ms_per_step[0] / 10.0
    assert lines[2] == (f"      0-278     279          11.00 {ratio:>6.3f} {11 * ratio:>18.2f}       320 "
                        f"{RECORD_360.ms_per_step[0]:>15.2f}")
    assert len(lines) == 2 + 6 + 2
    # by hand: Σ steps × (record floor + 1) × measured / record floor, plus the one-off start and end
    predicted = (sum(len(r) * (f + 1) * m / f for r, f, m in zip(ranges, calibration.floor_ms, RECORD_360.ms_per_step))
                 + RECORD_360.start_ms + RECORD_360.end_ms) / 1000
    delta = predicted - RECORD_360.total_ms / 1000
    assert lines[-2] == (f"  predicted {predicted:.3f} s: record #360's measured 39.846 s {delta:+.3f} s "
                         f"({predicted / 39.846004:.3f}×)").replace("-", "−")
    error = f"{delta + 4.566:+.3f}".replace("-", "−")
    assert lines[-1] == ("  PR #379 measured 36.009 ± 0.039 s vs 40.575 ± 0.024 s for #360 on its node: −4.566 s "
                         f"(0.887×); our delta misses it by {error} s, outside its spread (± 0.046 s, its two ± "
                         f"combined)")
    row = cost.format_frontier([p]).splitlines()[-2]  # --frontier's row for it
    assert row.startswith(f"cplm                1050 {p.floor_seconds:>8.2f} {predicted:>11.3f} ")
    assert "36.009 ± 0.039   40.575 ± 0.024  −4.566    0.887" in row and row.endswith("no (± 0.046)")


def test_the_frontier_flag_refuses_other_presets_and_proposals(capsys):
    with pytest.raises(SystemExit) as exit_:
        cost.main(["--frontier", "--config", "smoke", "--proposal", "cplm"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "--frontier: --config smoke: the frontier prices every proposal on the record preset's 8 ranks" in err
    assert "--frontier: --proposal cplm:" in err
