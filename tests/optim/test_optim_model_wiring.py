"""The optimizer against the real model and the kernels it calls: the tied embed/lm_head transposes
(perf/kernels/transpose.py), the parameter table over the real GPT, the frozen MLP slot 7."""
import pytest
import torch

from config import ScheduleConfig
from perf.kernels import transpose as tr
from perf.backend import use_backend
from optim.adam import EMBED, LM_HEAD, RECORD_PARAM_TABLE
from optim.manager import OptimizerManager
from optim.schedule import TrainingSchedule
from optim.standin import StandInParams

RECORD = TrainingSchedule(ScheduleConfig())


def _count_calls(monkeypatch, module, names):
    calls = dict.fromkeys(names, 0)
    for name in names:
        fn = getattr(module, name)

        def counted(*args, _name=name, _fn=fn):
            calls[_name] += 1
            return _fn(*args)
        monkeypatch.setattr(module, name, counted)
    return calls


def _tied_pair(seed=0):
    """Only lm_head and embed of the small stand-in, with their record rules."""
    params = [(n, p) for n, p in StandInParams.small(seed).named_parameters() if n in (LM_HEAD, EMBED)]
    return dict(params), {n: RECORD_PARAM_TABLE[n] for n, _ in params}


@pytest.mark.parametrize("triton", [False, pytest.param(True, marks=pytest.mark.triton)])
def test_tied_transposes_take_the_transpose_ops(triton, monkeypatch):
    """Both paths: while tied, lm_head's gradient gains embed's transposed (fp32 sum, one
    rounding) and embed <- lm_head^T after the update (exact); at the split the moments move
    transposed. The fast path runs the Triton transposes (interpreter on CPU)."""
    into, add = ("transpose_into_triton", "transpose_add_triton_") if triton else \
        ("transpose_into_portable", "transpose_add_portable_")
    calls = _count_calls(monkeypatch, tr, [into, add])
    sums = []
    add_fn = getattr(tr, add)
    monkeypatch.setattr(tr, add, lambda dst, src: sums.append(add_fn(dst, src).clone()) or dst)
    params, table = _tied_pair()
    lm, em = params[LM_HEAD], params[EMBED]
    em_before = em.detach().clone()
    g = torch.Generator().manual_seed(1)
    split = RECORD.split_step
    with use_backend(triton=triton):
        mgr = OptimizerManager(params.items(), RECORD, table=table)
        lm.grad = torch.randn(lm.shape, generator=g).bfloat16()
        em.grad = torch.randn(em.shape, generator=g).bfloat16()
        want = (lm.grad.double() + em.grad.double().mT).bfloat16()  # bf16 + bf16 is exact in fp64
        mgr.step(split - 2)                                          # odd: an Adam step, still tied
        assert calls == {into: 1, add: 1}
        # the interpreter truncates its stores: within one bf16 ulp of the rounded sum
        assert torch.all((sums[0].double() - want.double()).abs() <= want.double().abs() * 2 ** -7)
        if not triton:
            assert torch.equal(sums[0], want)
        assert not torch.equal(em.detach(), em_before)
        assert torch.equal(em.detach(), lm.detach().mT)              # embed <- lm_head^T, exact
        mgr.entries[LM_HEAD].state.exp_avg.normal_(generator=g)
        mgr.untie()
        assert mgr.split and calls[into] == 3                        # + exp_avg, exp_avg_sq
        assert torch.equal(mgr.entries[EMBED].state.exp_avg, mgr.entries[LM_HEAD].state.exp_avg.mT)


# --- the real GPT ---------------------------------------------------------------------------------

def _smoke_gpt(**changes):
    import dataclasses

    from config import MODEL_PRESETS
    from model.gpt import GPT
    torch.manual_seed(0)
    return GPT(dataclasses.replace(MODEL_PRESETS["smoke"], **changes))


def test_every_gpt_parameter_has_exactly_one_entry():
    model = _smoke_gpt()
    mgr = OptimizerManager(model.named_parameters(), RECORD)
    names = [n for n, _ in model.named_parameters()]
    assert sorted(mgr.entries) == sorted(names) == sorted(RECORD_PARAM_TABLE)
    assert all(mgr.entries[n].param is p for n, p in model.named_parameters())
    # a parameter added to the model without a table entry is named
    model.extra_gate = torch.nn.Parameter(torch.zeros(3))
    with pytest.raises(ValueError, match="'extra_gate'.*no optimizer entry"):
        OptimizerManager(model.named_parameters(), RECORD)


@pytest.fixture(scope="module")
def record_gpt_on_meta():
    """The record-size GPT on the meta device: shapes and dtypes, no memory (about 2 s)."""
    from config import MODEL_PRESETS
    from model.gpt import GPT
    with torch.device("meta"):
        return GPT(MODEL_PRESETS["record"])


def test_record_gpt_on_meta_gets_the_record_table(record_gpt_on_meta):
    """Record size without memory: every parameter has its entry and the banks the matrix views
    of record #360's track_1_short/training.py; the model marks mlp slot 7's matrices (14, 15) frozen."""
    model = record_gpt_on_meta
    with torch.device("meta"):
        mgr = OptimizerManager(model.named_parameters(), RECORD)
    assert sorted(mgr.entries) == sorted(RECORD_PARAM_TABLE)
    views = {n: tuple(mgr.entries[n].view.shape) for n in ("qk_bank", "vo_bank", "mlp_bank")}
    assert views == {"qk_bank": (48, 256, 768), "vo_bank": (16, 768, 768), "mlp_bank": (24, 2816, 768)}
    assert model.mlp_bank.frozen_matrices == {14, 15}


def test_frozen_mlp_slot_never_moves():
    """Slot 7's matrices hold random c_fc weights that decay would shrink and (given a gradient)
    ANVIL would move; with the model's declaration they stay bit for bit over bank and Adam steps.
    (A small vocabulary: the embedding tables' Adam is not what this tests.)"""
    model = _smoke_gpt(vocab_size=512)
    mgr = OptimizerManager(model.named_parameters(), RECORD)
    hidden, dim = model.mlp_bank.shape[-2:]
    shape_mul = (hidden / dim) ** 0.5                    # max(1, rows / cols)^0.5
    want = [0.0 if i in (14, 15) else shape_mul * (2 if i % 2 else 1) for i in range(24)]  # c_proj x2
    assert mgr.entries["mlp_bank"].bank_eff_lr(1.0).flatten().tolist() == pytest.approx(want)
    before = model.mlp_bank.detach().clone()
    assert before[7, 0].abs().sum() > 0
    g = torch.Generator().manual_seed(2)
    for step in range(2):   # a bank-only step, then a bank + Adam step
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=g).to(p.dtype)
        mgr.step(step)
    after = model.mlp_bank.detach()
    assert torch.equal(after[7], before[7])
    assert all(not torch.equal(after[s], before[s]) for s in range(12) if s != 7)


def test_standin_is_the_gpt_parameter_list(record_gpt_on_meta):
    """optim/standin.py stays for what the real GPT cannot give cheaply: bank matrix counts that
    pad on 2 and 4 ranks (small) and record-shaped real tensors for bench_optim without the
    model's buffers. It must keep the GPT's names, shapes (record) and dtypes."""
    gpt = {n: (tuple(p.shape), p.dtype) for n, p in record_gpt_on_meta.named_parameters()}
    with torch.device("meta"):
        standin = {n: (tuple(p.shape), p.dtype) for n, p in StandInParams.record().named_parameters()}
    assert standin == gpt
    small = {n: (p.dim(), p.dtype) for n, p in StandInParams.small().named_parameters()}
    assert small == {n: (len(shape), dtype) for n, (shape, dtype) in gpt.items()}


def test_value_embed_backward_fills_the_optimizer_cycle_buffer():
    """GPT.value_embed_grad_buffer = manager.cycle_gradient("value_embeds"): the backward adds the
    row sums into the fp16 buffer (no dense .grad), the same sums a dense bf16 .grad holds (to the
    two formats' rounding), only on the batch's rows; the table event consumes and clears it."""
    from model.gpt import StepArgs
    T, V = 64, 512
    g = torch.Generator().manual_seed(4)
    inputs = torch.randint(0, 40, (T,), generator=g, dtype=torch.int32)    # repeats: sums matter
    targets = torch.randint(0, V, (T,), generator=g)
    cu = torch.tensor([0, T // 2, T], dtype=torch.int32)
    rows = (0.1 * torch.randn(2 * T, 96, generator=g)).bfloat16()
    signs = torch.randint(0, 8192, (2 * T,), generator=g, dtype=torch.int32)
    grads = []
    for buffered in (False, True):
        model = _smoke_gpt(vocab_size=V)
        mgr = OptimizerManager(model.named_parameters(), RECORD)
        if buffered:
            model.value_embed_grad_buffer = mgr.cycle_gradient("value_embeds")
        model.refresh_fp8()
        model(inputs, targets, cu, rows, signs, StepArgs()).backward()
        grads.append(mgr.cycle_gradient("value_embeds").clone() if buffered else model.value_embeds.grad)
    assert model.value_embeds.grad is None
    dense, buffer = grads[0].double(), grads[1].double()
    read = torch.zeros(4 * V, dtype=torch.bool)
    read[(inputs.long()[None, :] + V * torch.arange(4)[:, None]).flatten()] = True
    assert buffer[~read].abs().sum() == 0 and (buffer[read].abs().sum(-1) > 0).all()
    torch.testing.assert_close(buffer, dense, rtol=2 ** -8, atol=1e-7)     # bf16 vs fp16 rounding
    before = model.value_embeds.detach().clone()
    mgr.step(0)                                                             # not a table event
    assert torch.equal(model.value_embeds, before)
    assert torch.equal(mgr.cycle_gradient("value_embeds").double(), buffer)   # held for the event
    mgr.step(1)                                                             # table event
    assert not torch.equal(model.value_embeds, before)
    assert mgr.cycle_gradient("value_embeds").abs().sum() == 0
    with pytest.raises(ValueError, match="cycle gradient buffer"):
        mgr.cycle_gradient("qk_bank")
