"""clip_grad_norm_: the global norm under EP x DP counts every expert gradient once."""

import copy
import math

import pytest
import torch
from torch import nn

import moe
from moe.memory import GroupedApply
from moe.parallel import clip_grad_norm_
from tests.distributed import run_ranks
from tests.test_checkpoint import make_model


def shard_experts_(model: nn.Module, ep_rank: int, ep: int) -> nn.Module:
    """Keep experts [r*E/ep, (r+1)*E/ep) of every GroupedExperts (dim 0 of each parameter,
    gradients too) and set expert_offset / num_global_experts, as parallelize() does."""
    for m in model.modules():
        if not isinstance(m, moe.GroupedExperts):
            continue
        E = m.num_global_experts if m.num_experts != m.num_global_experts else m.num_experts
        n = E // ep
        lo = ep_rank * n
        for name, p in list(m.named_parameters(recurse=False)):
            new = nn.Parameter(p.detach()[lo : lo + n].clone(), requires_grad=p.requires_grad)
            if p.grad is not None:
                new.grad = p.grad[lo : lo + n].clone()
            setattr(m, name, new)
        m.expert_offset, m.num_global_experts = lo, E
    return model


def step_grads(model: nn.Module, step: int) -> None:
    """Deterministic full-model gradients for `step`, sliced for sharded experts."""
    gen = torch.Generator().manual_seed(100 + step)
    experts = {n: m for n, m in model.named_modules() if isinstance(m, moe.GroupedExperts)}
    for name, p in model.named_parameters():
        module = experts.get(name.rsplit(".", 1)[0])
        shape = p.shape
        if module is not None:
            shape = (module.num_global_experts, *p.shape[1:])
        g = torch.randn(shape, generator=gen)
        if module is not None:
            g = g[module.expert_offset : module.expert_offset + p.shape[0]]
        p.grad = g.to(p.dtype)


def clone_with_grads(model: nn.Module) -> nn.Module:
    twin = copy.deepcopy(model)  # deepcopy does not carry .grad
    for p, q in zip(model.parameters(), twin.parameters()):
        q.grad = None if p.grad is None else p.grad.clone()
    return twin


def reference_clip(model: nn.Module, max_norm: float, norm_type: float = 2.0):
    ref = clone_with_grads(model)
    total = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm, norm_type)
    return total, {n: p.grad for n, p in ref.named_parameters()}


@pytest.mark.parametrize("norm_type", [2.0, math.inf])
def test_single_process_matches_torch(norm_type):
    model = make_model()
    step_grads(model, 0)
    total_ref, grads_ref = reference_clip(model, 0.5, norm_type)
    total = clip_grad_norm_(model, 0.5, norm_type=norm_type)
    torch.testing.assert_close(total, total_ref)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, grads_ref[name], msg=name)


def test_no_clip_below_max_norm():
    model = make_model()
    step_grads(model, 0)
    before = {n: p.grad.clone() for n, p in model.named_parameters()}
    total = clip_grad_norm_(model, 1e9)
    assert total > 0
    assert all(torch.equal(p.grad, before[n]) for n, p in model.named_parameters())


def test_clip_folded_into_grouped_apply_step():
    """With optimizer=, the clip factor scales the step's fp32 gradients, not the bf16 ones."""
    model = make_model().to(torch.bfloat16)
    ref = copy.deepcopy(model)
    opt = GroupedApply(model.parameters(), torch.optim.AdamW, 2, lr=1e-2)
    step_grads(model, 0)
    step_grads(ref, 0)
    grads_before = [p.grad.clone() for p in model.parameters()]
    total = clip_grad_norm_(model, 0.5, optimizer=opt)
    assert all(torch.equal(a, p.grad) for a, p in zip(grads_before, model.parameters()))
    opt.step()
    masters = [p.detach().float().clone().requires_grad_() for p in ref.parameters()]
    grads = [p.grad.float() for p in ref.parameters()]
    ref_total = torch.nn.utils.get_total_norm(grads)
    torch.testing.assert_close(total, ref_total)
    for m, g in zip(masters, grads):
        m.grad = g * min(1.0, 0.5 / (ref_total.item() + 1e-6))
    ref_opt = torch.optim.AdamW(masters, lr=1e-2)
    ref_opt.step()
    for p, m in zip(model.parameters(), masters):
        torch.testing.assert_close(opt.state_of(p)["master"], m.detach(), rtol=1e-5, atol=1e-6)


def _ep_dp_body(rank, world_size, layouts):
    out = []
    for dp, ep in layouts:
        mesh = moe.parallel.init_mesh(dp=dp, ep=ep)
        full = make_model()
        step_grads(full, 0)
        total_ref, grads_ref = reference_clip(full, 0.5)
        model = shard_experts_(clone_with_grads(full), mesh.get_local_rank("ep"), ep)
        total = clip_grad_norm_(model, 0.5, mesh)
        torch.testing.assert_close(total, total_ref, rtol=1e-6, atol=0)
        experts = dict(moe.parallel.expert_parameters(model))
        for name, p in model.named_parameters():
            want = grads_ref[name]
            if name in experts:
                module = model.get_submodule(name.rsplit(".", 1)[0])
                want = want[module.expert_offset : module.expert_offset + p.shape[0]]
            torch.testing.assert_close(p.grad, want, rtol=1e-6, atol=1e-7, msg=name)
        out.append((dp, ep, float(total), float(total_ref)))
    return out


def test_global_norm_under_ep_x_dp():
    results = run_ranks(_ep_dp_body, 4, [(2, 2), (1, 4), (4, 1)], timeout=90)
    for per_rank in results:
        assert [(dp, ep) for dp, ep, _, _ in per_rank] == [(2, 2), (1, 4), (4, 1)]
        for dp, ep, total, ref in per_rank:
            assert total == pytest.approx(ref, rel=1e-6), (dp, ep)
