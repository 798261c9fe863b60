"""perf/cost.py: the FLOP counter against hand formulas, the attention's pairs against a brute-force mask,
the optimizer's collectives against the banks' sizes, the smoke model against 6·N·T, tokens/s and MFU."""
import pytest
import torch

from config import RUN_PRESETS
from perf import cost
from perf.attention_backends import varlen_attention_mask
from perf.fp8 import E4M3, scaled_mm


def _count(fn):
    counter = cost.FlopCounter()
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
    assert cost.attention_pairs(lengths, window) == int(varlen_attention_mask(cu, T, window).sum())
    fwd, bwd = cost.attention_flops(cu.tolist(), window, heads=6, d_qk=16, d_v=8, paired=False)
    pairs = int(varlen_attention_mask(cu, T, window).sum())
    assert fwd == 2 * pairs * 6 * (16 + 8) and bwd == 2 * pairs * 6 * (3 * 16 + 2 * 8)
    # paired heads: half the heads over the doubled positions (the layout perf.attention_backends uses)
    paired_fwd, _ = cost.attention_flops(cu.tolist(), window, heads=6, d_qk=16, d_v=8, paired=True)
    doubled = int(varlen_attention_mask(2 * cu, 2 * T, window).sum())
    assert paired_fwd == 2 * doubled * 3 * (16 + 8)


@pytest.fixture(scope="module")
def smoke_rank():
    from perf.memory import build_rank_on_meta

    return build_rank_on_meta(RUN_PRESETS["smoke"], 2)


def test_the_smoke_model_at_full_softmax_is_6_n_t_within_a_band(smoke_rank):
    """The tensor-core GEMMs of one step at full softmax against 6·N·T, N the parameters a token
    meets in a matmul. Not equal, and why: the banks hold rows some layers do not use (narrow heads
    on the qk bank, layers without MLP slots), the MUDD and gate matrices are tiny, and lm_head
    counts once for all MTP offsets; measured 0.975 (smoke) and 0.90 (record, stage 3)."""
    from perf.memory import geometries

    settings, steps = next((s, st) for s, st in geometries(smoke_rank.schedule) if not s.softmax_p)
    g = cost.geometry_cost(smoke_rank, settings, steps)
    n_matmul = cost._matmul_params(cost.ScheduleCost(smoke_rank.cfg, 2, [g], []))
    gemms = g.flops["fp8 GEMM"] + g.flops["bf16 GEMM"] + g.flops["fp32 GEMM"]
    assert 0.85 < gemms / (6 * n_matmul * g.tokens) < 1.05
    # the lm_head alone: a forward and two backward GEMMs of T × D × V, all fp8
    D, V = smoke_rank.cfg.model.model_dim, smoke_rank.cfg.model.vocab_size
    assert g.flops["fp8 GEMM"] > 3 * 2 * g.tokens * D * V
    assert g.flops["attention"] > 0 and g.model_flops == gemms + g.flops["attention"]


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


def test_tokens_per_second_and_mfu():
    from optim.schedule import TrainingSchedule

    schedule = TrainingSchedule(RUN_PRESETS["smoke"].schedule)
    plain = cost.RunCost(schedule)
    tokens = sum(schedule.batch_tokens(s) for s in range(10))
    assert plain.tokens_per_s(10, 2000.0) == pytest.approx(tokens / 2.0)
    assert plain.mfu(10, 2000.0) is None  # no peak: no MFU
    g = cost.GeometryCost(None, list(range(schedule.total_steps)), 512, 1,
                          {"fp8 GEMM": 2e12, "bf16 GEMM": 1e12, "fp32 GEMM": 0, "attention": 1e12, "pointwise": 5e9}, {})
    peak = cost.DevicePeak("test", fp8_tflops=1000.0, bf16_tflops=500.0, tf32_tflops=250.0, hbm_tb_per_s=1.0,
                           link_gb_per_s=1.0, source="a test")
    mfu = cost.RunCost(schedule, cost.ScheduleCost(RUN_PRESETS["smoke"], 2, [g], []), peak).mfu(10, 2000.0)
    assert mfu == pytest.approx(10 * (2e12 / 1e15 + 2e12 / 5e14) / 2.0)  # 10 steps of 6 ms at peak in 2 s


def test_device_peaks_by_cuda_name():
    assert cost.device_peak("NVIDIA H100 80GB HBM3") is cost.H100_SXM
    assert cost.device_peak("NVIDIA H200") is cost.H200_SXM
    assert cost.device_peak("NVIDIA H100 PCIe") is None and cost.device_peak("NVIDIA H200 NVL") is None
    assert cost.device_peak("NVIDIA A100-SXM4-80GB") is None
