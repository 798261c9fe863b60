"""tools/capture_contract.py: the CUDA-graph capture contract, on CPU.

A toy model with the real OptimizerManager (an ANVIL bank and an Adam parameter, the smoke
schedule) shows each injected violation caught and named, and checks that the device-scalar form
of the update is bitwise the host-float form (the reference: optim/adam.py `adam_update` and
optim/anvil.py `anvil_update` with `bank_scalars`' floats). The smoke preset's own training step is
checked once (slow: a module fixture shares one Run)."""
import pytest
import torch
from torch import nn

from config import SCHEDULE_PRESETS, OptimConfig
from optim.adam import ParamRule, adam_update
from optim.anvil import anvil_update
from optim.manager import OptimizerManager
from optim.normuon import normuon_update
from optim.schedule import TrainingSchedule
from perf.cuda_graphs.state import module_state, optimizer_state
from tools import capture_contract as contract
from tools.capture_contract import ContractChecker

TOY_TABLE = {"w_bank": ParamRule("bank", "sharded", "every"),
             "gain": ParamRule("adam", "replicated", "adam", betas=(0.9, 0.99), lr_mul=2.0, wd_mul=3.0)}


class Toy(nn.Module):
    def __init__(self, seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.w_bank = nn.Parameter((torch.randn(2, 16, 8, generator=g) * 0.3).bfloat16())  # [matrices, rows, cols]
        self.gain = nn.Parameter(torch.ones(8) + 0.1 * torch.randn(8, generator=g))
        self.register_buffer("x", torch.zeros(32, 8), persistent=False)  # the static input (T, 8)

    def forward(self, x):  # x (T, 8)
        h = torch.relu(x @ self.w_bank[0].float().t())  # (T, 16)
        return ((h @ self.w_bank[1].float()) * self.gain).square().mean()


def toy(seed: int = 0, keep_grads: bool = True, bank_optimizer: str = "anvil"):
    model = Toy(seed)
    manager = OptimizerManager(model.named_parameters(), TrainingSchedule(SCHEDULE_PRESETS["smoke"]),
                               OptimConfig(bank_optimizer=bank_optimizer), table=TOY_TABLE, keep_grads=keep_grads)
    checker = ContractChecker(lambda: module_state(model) + optimizer_state(manager))
    return model, manager, checker


def toy_steps(model, manager, checker, steps, forward_hook=None, optimizer_hook=None):
    """The training step's two regions, as training.Run.train_step draws them."""
    for step in steps:
        model.x.copy_(torch.randn(32, 8, generator=torch.Generator().manual_seed(step)))  # into the static input
        with checker.region("forward_backward", "toy"):
            loss = model(model.x)
            if forward_hook is not None:
                loss = forward_hook(loss, step)
            loss.backward()
        manager.load_scalars(step)
        with checker.region("optimizer", manager.phase(step)):
            if optimizer_hook is not None:
                optimizer_hook(step)
            manager.update(step)


def kinds(checker):
    return {v.kind for v in checker.violations}


def messages(checker, kind):
    return [v.message for v in checker.violations if v.kind == kind]


# ---- the clean update, and bitwise equality with the host-float reference -------------------------


def test_toy_update_keeps_the_contract_through_the_lr_cooldown():
    model, manager, checker = toy()
    toy_steps(model, manager, checker, range(8, 18))  # smoke: cooldown from step 12, rail-beta warmup
    assert checker.violations == []
    assert max(checker.calls.values()) >= 3  # something was compared


@pytest.mark.parametrize("bank_optimizer", ["anvil", "normuon"])
def test_device_scalars_update_bitwise_like_host_floats(bank_optimizer):
    """The manager (0-D fp32 device scalars, persistent zeroed grads) against the former
    host-float updates (adam_update, anvil_update / normuon_update with bank_scalars) through the
    lr cooldown."""
    model, manager, _ = toy(bank_optimizer=bank_optimizer)
    ref_model, ref, _ = toy(bank_optimizer=bank_optimizer)
    bank_update = anvil_update if bank_optimizer == "anvil" else normuon_update
    for step in range(20):
        x = torch.randn(32, 8, generator=torch.Generator().manual_seed(step))
        model(x).backward()
        manager.step(step)
        ref_model(x).backward()
        for name, e in ref.entries.items():
            if not ref.updates_at(e, step):
                continue
            if e.rule.optim == "bank":
                bank_update(e.view, e.param.grad.view(e.view.shape), e.state, ref.bank_scalars(e, step))
            else:
                betas, lr, wd = ref.adam_hparams(e, step)
                adam_update(e.param.data, e.param.grad, e.state, betas, lr, ref.cfg.adam_eps, wd)
            e.param.grad = None
        for (name, p), (_, q) in zip(model.named_parameters(), ref_model.named_parameters()):
            assert torch.equal(p.view(torch.int16) if p.dtype == torch.bfloat16 else p,
                               q.view(torch.int16) if q.dtype == torch.bfloat16 else q), (name, step)
    assert manager.schedule.lr_mult(19) != manager.schedule.lr_mult(18)  # the lr did change per step
    for key in ("velocity", "lane_energy", "mantissa"):
        assert torch.equal(getattr(manager.entries["w_bank"].state, key), getattr(ref.entries["w_bank"].state, key)), key


# ---- injected violations, each caught and named ----------------------------------------------------


def test_host_float_adam_is_caught_as_a_changing_python_scalar():
    """The pre-refactor Adam (bias correction as a Python float) inside a captured region."""
    model, manager, checker = toy()
    state = manager.entries["gain"].state

    def host_float_adam(step):
        adam_update(torch.zeros(8), torch.ones(8), state, (0.9, 0.99), 0.01, 1e-10, 0.0)

    toy_steps(model, manager, checker, range(6), optimizer_hook=host_float_adam)  # 3 calls per phase
    found = messages(checker, "Python scalar changes")
    assert any("aten::mul" in m and "optim/adam.py" in m and "adam_apply" in m for m in found), found
    assert all("at the capture call" in m and "now" in m for m in found)


def test_per_step_python_scalar_in_the_forward_is_caught_with_both_values():
    model, manager, checker = toy()
    toy_steps(model, manager, checker, range(4), forward_hook=lambda loss, step: loss * (1.0 + step))
    found = messages(checker, "Python scalar changes")  # the forward's mul, and its backward's
    assert any(m.startswith("aten::mul") and "test_tools_capture_contract.py" in m and "loss * (1.0 + step)" in m
               and "2.0 at the capture call, 3.0 now" in m for m in found), found


def test_moved_parameter_is_caught_and_named():
    model, manager, checker = toy()

    def move(loss, step):
        model.gain.data = model.gain.data.clone()  # p.data = ... inside a region
        return loss

    toy_steps(model, manager, checker, range(4), forward_hook=move)
    assert any(m.startswith("gain is a tensor created inside the region") for m in messages(checker, "new persistent tensor"))
    assert any(m.startswith("gain:") for m in messages(checker, "storage moved")), checker.violations


def test_fresh_optimizer_state_is_caught_and_named():
    model, manager, checker = toy()
    state = manager.entries["gain"].state

    def fresh_state(step):
        state.exp_avg = torch.zeros_like(state.exp_avg)

    toy_steps(model, manager, checker, range(4), optimizer_hook=fresh_state)
    assert any(m.startswith("optimizer[gain].state.exp_avg is a tensor created inside the region")
               for m in messages(checker, "new persistent tensor")), checker.violations


def test_released_gradient_is_caught():
    """Without keep_grads the manager releases used gradients (p.grad = None): a replay would not,
    and the next backward makes a fresh .grad."""
    model, manager, checker = toy(keep_grads=False)
    toy_steps(model, manager, checker, range(4))
    assert any(m.startswith("w_bank.grad was released") for m in messages(checker, "state changed by Python"))
    assert any(m.startswith("w_bank.grad is a tensor created inside the region")
               for m in messages(checker, "new persistent tensor")), checker.violations


def test_item_is_caught_with_the_line():
    model, manager, checker = toy()

    def read(loss, step):
        if loss.item() < 0:  # a host sync
            pass
        return loss

    toy_steps(model, manager, checker, range(2), forward_hook=read)
    (msg,) = messages(checker, "host sync")
    assert "_local_scalar_dense" in msg and "test_tools_capture_contract.py" in msg and "loss.item()" in msg


def test_per_step_input_outside_a_static_buffer_is_caught():
    model, manager, checker = toy()
    inputs = [torch.randn(8) for _ in range(4)]  # made outside the region, a new tensor per step

    def fresh_input(loss, step):
        return loss + (model.gain * inputs[step]).sum()

    toy_steps(model, manager, checker, range(4), forward_hook=fresh_input)
    assert any("unnamed tensor from outside the region" in m for m in messages(checker, "storage moved"))


def test_pageable_copy_into_device_memory_is_caught():
    checker = ContractChecker(lambda: [])
    dst = torch.empty(4, device="meta")  # a non-host destination (no GPU here)
    with checker.region("upload", "k"):
        dst.copy_(torch.ones(4))
    (msg,) = messages(checker, "pageable copy")
    assert "cpu (pageable) -> meta" in msg and "dst.copy_" in msg


# ---- the smoke preset's real training step (one shared Run) ---------------------------------------


@pytest.fixture(scope="module")
def smoke():
    from perf import backend as perf_backend
    with perf_backend.use_backend(host_checks=False):
        run = contract.build_run("smoke", seed=0)
        checker = contract.check_run(run, 3)
        yield run, checker


@pytest.mark.slow
def test_smoke_training_step_keeps_the_contract(smoke):
    run, checker = smoke
    text, code = contract.summary(checker, 3, "smoke")
    assert code == 0, text
    assert text.endswith("PASS: every region keeps the capture contract")
    assert {region for region, _ in checker.calls} == {"forward_backward", "optimizer", "fp8_refresh"}
    assert checker.calls["fp8_refresh", "True"] == 3  # (key reprs) one refresh per step, the last one by the final flush
    assert max(checker.calls.values()) >= 3


@pytest.mark.slow
def test_violations_injected_into_the_smoke_step_are_named(smoke, monkeypatch):
    """One more step (3, an Adam step) with a .item() and a moved parameter in the forward and a
    fresh optimizer state in the update."""
    run, checker = smoke
    forward = run.forward

    def bad_forward(*args, **kwargs):
        loss = forward(*args, **kwargs)
        loss.item()
        run.model.resid_lambdas.data = run.model.resid_lambdas.data.clone()
        return loss

    update = run.manager.update  # the captured part of the optimizer's step

    def bad_update(s):
        st = run.manager.entries["scalars"].state
        st.exp_avg_sq = torch.zeros_like(st.exp_avg_sq)
        update(s)

    monkeypatch.setattr(run, "forward", bad_forward)
    monkeypatch.setattr(run.manager, "update", bad_update)
    contract.check_run(run, 1, start=3, checker=checker)
    text, code = contract.summary(checker, 4, "smoke")
    assert code == 1 and "FAIL" in text
    assert any("_local_scalar_dense" in m and "loss.item()" in m for m in messages(checker, "host sync"))
    new = messages(checker, "new persistent tensor")
    assert any(m.startswith("resid_lambdas is a tensor created inside the region") for m in new), text
    assert any(m.startswith("optimizer[scalars].state.exp_avg_sq is a tensor created inside") for m in new), text


# ---- PR #371's restricted attention backward: the head table read in place ------------------------------


class RestrictedAttentionToy(nn.Module):
    """One paired attention layer in mode 2 on the fa3 backend (the two opaque ops of
    perf/windowed_backward.py; FA3 a CPU stand-in computing the portable forward and its LSE), its head table
    a buffer as CalibrationState's tables are persistent tensors."""
    T, W = 48, 20

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.w = nn.Parameter(0.3 * torch.randn(8, 3 * 6 * 8, generator=g))  # x → q, k, v of 6 heads of 8
        self.register_buffer("x", torch.zeros(self.T, 8), persistent=False)  # the static input (T, 8)
        self.register_buffer("cu_seqlens", torch.tensor([0, 20, self.T, self.T], dtype=torch.int32), persistent=False)
        self.register_buffer("head_windows", torch.full((3,), -1, dtype=torch.int32), persistent=False)

    def forward(self, x):
        from perf.windowed_backward import restricted_backward_attention
        q, k, v = (x @ self.w).view(self.T, 3, 6, 8).unbind(1)  # (T, 6, 8) each
        y = restricted_backward_attention(q, k, v, self.cu_seqlens, self.W, 0.35, self.head_windows, paired=True,
                                          max_seqlen=28)
        return y.square().mean()


def _restricted_steps(monkeypatch, write_table):
    """Five mode-2 steps in the forward_backward region; before step 2 the calibration's choice arrives
    through `write_table(model, codes)`, outside the region (as CalibrationState.finish writes it)."""
    from perf import attention_backends
    from perf.backend import use_backend
    from perf.windowed_backward import windowed_attention_forward

    class NumericFA3:
        def flash_attn_varlen_func(self, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                                   softmax_scale, window_size, return_attn_probs=False):
            out, lse = windowed_attention_forward(q, k, v, cu_seqlens_q, softmax_scale, window_size[0])
            return (out, lse) if return_attn_probs else out

    monkeypatch.setattr(attention_backends, "_fa3_interface", NumericFA3())
    model = RestrictedAttentionToy()
    checker = ContractChecker(lambda: module_state(model))
    grads = []
    with use_backend(attention="fa3", host_checks=False):
        for step in range(5):
            if step == 2:
                write_table(model, torch.tensor(CODES, dtype=torch.int32))
            model.x.copy_(_toy_input(step))
            model.w.grad = None if step == 0 else model.w.grad.zero_()  # zeroed in place: the same .grad
            with checker.region("forward_backward", "mode 2"):
                model(model.x).backward()
            grads.append(model.w.grad.clone())
    return checker, grads


CODES = (4, -1, 0)  # the "calibrated" table written before step 2


def _toy_input(step):
    return torch.randn(RestrictedAttentionToy.T, 8, generator=torch.Generator().manual_seed(step))


def _twin_gradient(codes, step):
    """The toy's weight gradient at `step` through the portable twin with the table `codes` (sdpa backend)."""
    model = RestrictedAttentionToy()
    model.head_windows.copy_(torch.tensor(codes, dtype=torch.int32))
    model(_toy_input(step)).backward()
    return model.w.grad


def test_the_restricted_attention_step_keeps_the_contract_with_its_table_written_in_place(monkeypatch):
    """The table written in place between steps (as the calibration writes it after step 593): no host sync,
    no moved storage, no baked scalar, the same ops each call; and the gradients before and after the write
    are the portable twin's with the table each step had (the op reads the table, it does not bake it)."""
    checker, grads = _restricted_steps(monkeypatch, lambda model, codes: model.head_windows.copy_(codes))
    assert checker.violations == []
    for step, codes in ((1, (-1, -1, -1)), (2, CODES), (4, CODES)):
        torch.testing.assert_close(grads[step], _twin_gradient(codes, step), rtol=1e-5, atol=1e-7)
    assert not torch.allclose(grads[2], _twin_gradient((-1, -1, -1), 2), rtol=1e-3, atol=1e-6)


def test_a_table_replaced_instead_of_written_in_place_is_caught(monkeypatch):
    """A new tensor for the table (what a replayed graph would never see) is caught as moved storage."""
    def replace(model, codes):
        model.head_windows = codes

    checker, _ = _restricted_steps(monkeypatch, replace)
    assert any(m.startswith("head_windows:") for m in messages(checker, "storage moved")), checker.violations
