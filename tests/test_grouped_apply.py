"""GroupedApply (grouped, offloaded, mixed precision) against plain torch.optim.AdamW."""

import copy

import pytest
import torch
from torch import nn

import moe
from moe.memory import GroupedApply, LossScaler
from moe.memory.grouped_apply import partition_balanced

ADAMW = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def small_model(dtype=torch.float32) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(16, 24),
        nn.LayerNorm(24),
        moe.MoELayer(24, 32, num_experts=4, top_k=2),
        nn.Linear(24, 8, bias=False),
    )
    return model.to(dtype)


def set_grads(params: list[nn.Parameter], step: int, scale: float = 1.0) -> None:
    gen = torch.Generator().manual_seed(1000 + step)
    for p in params:
        g = torch.randn(p.shape, generator=gen) * scale
        p.grad = g.to(p.dtype)


def test_partition_is_size_balanced():
    sizes = [100, 7, 50, 50, 3, 40, 60, 1]
    parts = partition_balanced(sizes, 3)
    assert sorted(i for p in parts for i in p) == list(range(len(sizes)))
    totals = [sum(sizes[i] for i in p) for p in parts]
    assert max(totals) - min(totals) <= 12, totals
    assert all(p == sorted(p) for p in parts)
    assert len(partition_balanced([5, 5], 4)) == 2  # never empty groups


@pytest.mark.parametrize("offload", [None, "optimizer", "all"])
@pytest.mark.parametrize("groups", [1, 3])
def test_fp32_equals_plain_adamw(groups, offload):
    model = small_model()
    ref = copy.deepcopy(model)
    opt = GroupedApply(model.named_parameters(), torch.optim.AdamW, groups, offload, **ADAMW)
    ref_opt = torch.optim.AdamW(ref.parameters(), **ADAMW)
    assert len(opt.param_groups) == min(groups, len(list(model.parameters())))
    for step in range(4):
        set_grads(list(model.parameters()), step)
        set_grads(list(ref.parameters()), step)
        opt.step()
        ref_opt.step()
        opt.zero_grad(set_to_none=True)
        ref_opt.zero_grad()
    exact = offload is None  # offloaded steps run the CPU-fused kernel: rounding may differ
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        if exact:
            torch.testing.assert_close(p, q, rtol=0, atol=1e-7, msg=name)
        else:
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)
        for key in ("exp_avg", "exp_avg_sq", "step"):
            torch.testing.assert_close(opt.state[p][key], ref_opt.state[q][key], msg=key)


def reference_master_adamw(model: nn.Module, steps: int):
    """fp32 masters stepped by plain AdamW on fp32 copies of the low-precision grads."""
    params = list(model.parameters())
    masters = [p.detach().float().clone().requires_grad_() for p in params]
    opt = torch.optim.AdamW(masters, **ADAMW)
    for step in range(steps):
        set_grads(params, step)
        for m, p in zip(masters, params):
            m.grad = p.grad.float()
        opt.step()
        with torch.no_grad():
            for m, p in zip(masters, params):
                p.copy_(m)
    return masters, opt


@pytest.mark.parametrize("offload", [None, "optimizer", "all"])
def test_bf16_master_weights_equal_reference(offload):
    model = small_model(torch.bfloat16)
    ref = copy.deepcopy(model)
    opt = GroupedApply(model.parameters(), torch.optim.AdamW, 2, offload, **ADAMW)
    assert opt.master_weights and opt.loss_scaler is None
    for step in range(4):
        set_grads(list(model.parameters()), step)
        opt.step()
        opt.zero_grad()
    masters, ref_opt = reference_master_adamw(ref, 4)
    for p, q, m, rm in zip(model.parameters(), ref.parameters(), opt.params, masters):
        state = opt.state_of(m)
        assert state["master"].dtype == torch.float32 and p.dtype == torch.bfloat16
        torch.testing.assert_close(state["master"], rm.detach(), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(state["exp_avg_sq"], ref_opt.state[rm]["exp_avg_sq"])
        assert (p.float() - q.float()).abs().max() <= 2 * torch.finfo(torch.bfloat16).eps * (
            q.float().abs().max() + 1
        )
        if offload is None:
            assert torch.equal(p, q)


@pytest.mark.parametrize("offload", ["optimizer", "all"])
def test_offload_state_lives_on_host(offload):
    model = small_model(torch.bfloat16)
    opt = GroupedApply(model.parameters(), torch.optim.AdamW, 2, offload, **ADAMW)
    set_grads(list(model.parameters()), 0)
    opt.step()
    cuda = next(model.parameters()).is_cuda
    param_ptrs = {p.untyped_storage().data_ptr() for p in model.parameters()}
    for p in model.parameters():
        state = opt.state_of(p)
        for key in ("exp_avg", "exp_avg_sq"):
            t = state[key]
            assert t.device.type == "cpu" and t.dtype == torch.float32
            assert t.untyped_storage().data_ptr() not in param_ptrs
            assert t.is_pinned() == cuda
        master = state["master"]
        assert master.untyped_storage().data_ptr() not in param_ptrs
        assert (master.device.type == "cpu") == (offload == "all") or not cuda
    assert opt._pipeline.staging_bytes > 0


def test_fp16_loss_scaling_skips_inf_and_unscales():
    model = small_model(torch.float16)
    ref = copy.deepcopy(model)
    scaler = LossScaler(init_scale=1024.0, growth_interval=1)
    opt = GroupedApply(model.parameters(), torch.optim.AdamW, 2, loss_scaler=scaler, **ADAMW)
    before = [p.detach().clone() for p in model.parameters()]
    params = list(model.parameters())
    set_grads(params, 0, scale=1024.0)
    params[0].grad[0, 0] = float("inf")
    opt.step()  # skipped: nothing changes, the scale halves
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert scaler.scale == 512.0 and scaler.skipped_steps == 1
    opt.zero_grad()
    for step in range(3):
        set_grads(params, step, scale=scaler.scale)  # what scale_loss(loss).backward() gives
        opt.step()
        opt.zero_grad()
    assert scaler.scale == 4096.0  # grew after each clean step (growth_interval=1)
    masters, _ = reference_master_adamw(ref, 3)
    for p, m in zip(model.parameters(), masters):
        torch.testing.assert_close(opt.state_of(p)["master"], m.detach(), rtol=1e-3, atol=1e-4)
    x = torch.ones(())
    assert opt.scale_loss(x).item() == scaler.scale


def test_state_dict_round_trip_and_scheduler():
    model = small_model()
    opt = GroupedApply(model.parameters(), torch.optim.AdamW, 3, **ADAMW)
    for step in range(2):
        set_grads(list(model.parameters()), step)
        opt.step()
    twin = copy.deepcopy(model)
    twin_opt = GroupedApply(twin.parameters(), torch.optim.AdamW, 3, offload="all", **ADAMW)
    twin_opt.load_state_dict(opt.state_dict())
    set_grads(list(model.parameters()), 5)
    set_grads(list(twin.parameters()), 5)
    opt.step()
    twin_opt.step()
    for p, q in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.0)
    assert all(g["lr"] == 0.0 for g in opt.param_groups)
    before = [p.detach().clone() for p in model.parameters()]
    set_grads(list(model.parameters()), 6)
    opt.step()
    sched.step()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_other_optimizer_and_errors():
    model = small_model()
    ref = copy.deepcopy(model)
    opt = GroupedApply(model.parameters(), torch.optim.SGD, 2, "all", lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for step in range(3):
        set_grads(list(model.parameters()), step)
        set_grads(list(ref.parameters()), step)
        opt.step()
        ref_opt.step()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="groups"):
        GroupedApply(model.parameters(), torch.optim.AdamW, groups=0)
    with pytest.raises(ValueError, match="offload"):
        GroupedApply(model.parameters(), torch.optim.AdamW, offload="gpu")
    with pytest.raises(TypeError, match="flat list"):
        GroupedApply([{"params": list(model.parameters())}], torch.optim.AdamW)
    with pytest.raises(NotImplementedError):
        opt.add_param_group({"params": [nn.Parameter(torch.zeros(1))]})


def test_offload_all_takes_parameters_changed_in_place():
    """offload="all": the host copy holds the weights between steps; a parameter changed in
    place (a load_state_dict, rebalance_experts moving rows) is fetched again at the step."""
    model, ref = small_model(), small_model()
    opt = GroupedApply(model.parameters(), torch.optim.AdamW, 2, "all", **ADAMW)
    ref_opt = torch.optim.AdamW(ref.parameters(), **ADAMW)
    for step in range(3):
        if step == 1:
            state = {
                k: v * 0.5 if v.is_floating_point() else v for k, v in ref.state_dict().items()
            }
            model.load_state_dict(state)
            ref.load_state_dict(state)
        for m, o in ((model, opt), (ref, ref_opt)):
            set_grads(list(m.parameters()), step)
            o.step()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def _change_through_data(model: nn.Module, form: str) -> None:
    """An in-place weight change the autograd version counter does not see (HF init, EMA)."""
    for i, p in enumerate(model.parameters()):
        if form == "mul_":
            p.data.mul_(0.5)
        elif form == "assign":
            p.data = p.detach().flip(0) * 0.5 + 0.25
        else:
            p.data.copy_(torch.full_like(p, 0.01 * (i + 1)))


@pytest.mark.parametrize("form", ["mul_", "assign", "copy_"])
@pytest.mark.parametrize("offload", [None, "optimizer", "all"])
def test_weights_changed_through_data_between_steps_are_kept(offload, form):
    """A change made through `.data` between steps is what the next step starts from, with
    every offload mode (offload="all" once restored its host copy: issue 49, item 4)."""
    model, ref = small_model(), small_model()
    opt = GroupedApply(model.parameters(), torch.optim.AdamW, 2, offload, **ADAMW)
    ref_opt = torch.optim.AdamW(ref.parameters(), **ADAMW)
    for step in range(3):
        for m, o in ((model, opt), (ref, ref_opt)):
            if step == 1:
                _change_through_data(m, form)
            set_grads(list(m.parameters()), step)
            o.step()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("form", ["mul_", "assign", "copy_"])
@pytest.mark.parametrize("offload", [None, "optimizer", "all"])
def test_bf16_weights_changed_through_data_are_taken_into_their_masters(offload, form):
    """bf16 parameters with fp32 masters: an edit through `.data` between steps is what the
    next step starts from (the master takes the edited elements) in every offload mode; it
    used to be overwritten by the master at the next step. The reference is fp32 AdamW on the
    masters' values, with the edit as the bf16 parameter stored it."""
    model, ref = small_model(torch.bfloat16), small_model()
    with torch.no_grad():
        for q, p in zip(ref.parameters(), model.parameters()):
            q.copy_(p.float())
    opt = GroupedApply(model.parameters(), torch.optim.AdamW, 2, offload, **ADAMW)
    ref_opt = torch.optim.AdamW(ref.parameters(), **ADAMW)
    for step in range(3):
        if step == 1:
            _change_through_data(model, form)
            _change_through_data(ref, form)
            with torch.no_grad():  # what the bf16 parameter holds after the edit
                for q in ref.parameters():
                    q.copy_(q.to(torch.bfloat16).float())
        set_grads(list(model.parameters()), step)
        for q, p in zip(ref.parameters(), model.parameters()):
            q.grad = p.grad.float()
        opt.step()
        ref_opt.step()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.float(), q.to(torch.bfloat16).float(), rtol=2**-6, atol=2e-3)
