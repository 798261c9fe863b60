"""The optimizer against the real model and the kernels it calls: the tied embed/lm_head transposes
(perf/kernels/transpose.py), the parameter table over the real GPT, the frozen MLP slot 7."""
import pytest
import torch

from config import ScheduleConfig
from optim.adam import EMBED, LM_HEAD, RECORD_PARAM_TABLE
from optim.manager import OptimizerManager
from optim.schedule import TrainingSchedule
from optim.standin import StandInParams
from perf.backend import use_backend
from perf.kernels import transpose as tr

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
