"""Checkpoints, exports and errors of layers with expert replicas see canonical experts:
GroupedApply state saved once per expert and loaded into every copy, check_experts_finite
naming experts (not slots), to_hf / load_hf_checkpoint with spare slots."""

import pytest
import torch

import moe
from moe.checkpoint import load_checkpoint, save_checkpoint
from moe.parallel import init_mesh, parallelize
from moe.parallel.rebalance import rebalance_experts
from moe.parallel.replicas import sum_replica_grads
from moe.slots.layout import SlotLayout
from tests.distributed import run_ranks
from tests.test_replicas import TOL64, D, E, F, _batch, _canonical, _full, _pair, _step


def _grouped(model):
    return moe.memory.GroupedApply(
        model.parameters(), torch.optim.AdamW, groups=2, lr=1e-2, weight_decay=0.1
    )


def _state(model, opt, grouped=True):
    """Every expert parameter's AdamW moments, rows in canonical order (copies checked equal)."""
    out = {}
    for name, p in model.named_parameters():
        layer = model.get_submodule(name.rsplit(".experts.", 1)[0]) if ".experts." in name else None
        state = opt.state_of(p) if grouped else opt.state[p]
        for key in ("exp_avg", "exp_avg_sq"):
            full = _full(state[key])
            if layer is not None and layer.config.spare_slots:
                first = full[layer.slot_of_expert_E]
                torch.testing.assert_close(full, first[layer.expert_of_slot_S], rtol=0, atol=0)
                full = first
            out[f"{name}/{key}"] = full
    return out


def _save_body(rank, world, path):
    """ep = world with replicas and GroupedApply: 4 steps around a rebalance, then save."""
    mesh = init_mesh(dp=1, ep=world)
    model = parallelize(_pair(world)[1], mesh, "ddp")
    opt = _grouped(model)
    for s in (0, 1):
        _step(model, opt, s, rank, world, True, mesh=mesh)
    rebalance_experts(model, opt, min_gain=0.0)
    assert any(m.expert_of_slot_S.tolist() != list(range(E)) + [0, 1] for m in model[1::2])
    for s in (2, 3):
        _step(model, opt, s, rank, world, True, mesh=mesh)
    save_checkpoint(path, model, opt)
    return _canonical(model), _state(model, opt)


def test_grouped_apply_state_of_replicas_round_trips(tmp_path):
    """Saved at ep = 2 with replicas (rebalanced) and GroupedApply; loaded in one process
    without replicas (AdamW and GroupedApply) and with 3 spare slots (GroupedApply: every copy
    filled): the weights and AdamW moments the saving run had, and the next step is the same
    in all three."""
    path = str(tmp_path / "ckpt")
    saved_params, saved_state = run_ranks(_save_body, 2, path, timeout=120)[0]
    after = None
    for R, grouped in ((0, False), (0, True), (3, True)):
        model = _pair(R, seed=5)[R > 0]
        opt = (
            _grouped(model)
            if grouped
            else torch.optim.AdamW(model.parameters(), 1e-2, weight_decay=0.1)
        )
        load_checkpoint(path, model, opt)
        for name, value in _canonical(model).items():
            torch.testing.assert_close(value, saved_params[name], rtol=0, atol=0, msg=name)
        for key, value in _state(model, opt, grouped).items():
            torch.testing.assert_close(value, saved_state[key], rtol=0, atol=0, msg=key)
        _step(model, opt, 4, 0, 1, R > 0)
        with torch.no_grad():
            y = model(_batch(99)[0])
        params = _canonical(model)
        if after is None:
            after = (y, params)
        torch.testing.assert_close(y, after[0], **TOL64, msg=f"R={R}")
        for name, value in params.items():
            torch.testing.assert_close(value, after[1][name], **TOL64, msg=f"R={R} {name}")


@pytest.mark.parametrize("spare", [0, 3])
def test_check_finite_names_canonical_experts_not_slots(spare):
    """A NaN planted in one copy (the spare slot, or a permuted slot after a rebalance) is
    reported as the canonical expert that copy holds, with the slot beside it."""
    torch.manual_seed(0)
    layer = moe.MoELayer(D, F, E, top_k=2, spare_slots=spare, check_finite=True, name="ffn")
    with torch.no_grad():  # a non-trivial layout: experts reversed, spare slots copy 7, 6, 5
        order = list(range(E))[::-1]
        layer.set_slot_layout(SlotLayout(E, tuple(order + [7, 6, 5][:spare])))
        slot = E + 1 if spare else 2  # holds expert 6 (spare: its second copy) / expert 5
        layer.experts.w1[slot, 0, 0] = float("nan")
    with pytest.raises(FloatingPointError, match=r"ffn: .*expert\(s\) \[(6|5)\] \(slots?"):
        layer(torch.randn(64, D))
    try:
        layer(torch.randn(64, D))
    except FloatingPointError as e:
        assert f"[{6 if spare else 5}]" in str(e) and f"[{slot}]" in str(e), str(e)


def _relayout(model, shift: int) -> None:
    """A non-trivial slot map in every converted layer: experts rotated by `shift`, the spare
    slots copying the experts after them; weights moved with it (same function)."""
    with torch.no_grad():
        for layer in [m for m in model.modules() if isinstance(m, moe.interop.HFMoELayer)]:
            E, R = layer.config.num_experts, layer.config.spare_slots
            canon = [p[layer.slot_of_expert_E].clone() for p in layer.experts.parameters()]
            order = [(e + shift) % E for e in range(E)]
            eos = order + [(shift + E - 1 - i) % E for i in range(R)]
            layer.set_slot_layout(SlotLayout(E, tuple(eos)))
            for p, c in zip(layer.experts.parameters(), canon):
                p.copy_(c[layer.expert_of_slot_S])


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
def test_hf_export_and_load_with_spare_slots(family, tmp_path):
    """transformers' real classes: converted with 2 spare slots and a rotated slot map, the
    model computes the reference's logits; to_hf and save_hf_checkpoint write canonical
    experts (transformers computes the same logits); load_hf_checkpoint into a model with
    spare slots (another slot map) fills every copy."""
    transformers = pytest.importorskip("transformers")
    from tests.test_hf_checkpoint import converted_from_config, logits
    from tests.test_hf_parity import fresh

    reference = fresh(family)
    ids = torch.randint(0, 97, (2, 9))
    expected = logits(reference, ids)
    model = moe.from_hf(fresh(family), spare_slots=2)
    _relayout(model, 3)
    torch.testing.assert_close(logits(model, ids), expected, rtol=1e-5, atol=1e-6)
    moe.save_hf_checkpoint(model, str(tmp_path / "out"))
    again = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"))
    torch.testing.assert_close(logits(again, ids), expected, rtol=1e-5, atol=1e-6)
    loaded = converted_from_config(family)  # other weights, rebuilt with spare slots
    loaded = moe.from_hf(moe.to_hf(loaded), spare_slots=2)
    _relayout(loaded, 5)
    assert not torch.allclose(logits(loaded, ids), expected)
    moe.load_hf_checkpoint(loaded, str(tmp_path / "out"))
    torch.testing.assert_close(logits(loaded, ids), expected, rtol=1e-5, atol=1e-6)
    for layer in [m for m in loaded.modules() if isinstance(m, moe.interop.HFMoELayer)]:
        assert layer.expert_of_slot_S[0] == 5  # the live slot map is kept
        for p in layer.experts.parameters():  # every copy holds its expert
            torch.testing.assert_close(p, p[layer.slot_of_expert_E][layer.expert_of_slot_S])
    exported = moe.to_hf(model)
    torch.testing.assert_close(logits(exported, ids), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("grouped", [False, True])
def test_a_step_without_sum_replica_grads_is_refused(grouped):
    """Forgetting sum_replica_grads: optimizer.step (torch's AdamW or GroupedApply) and
    clip_grad_norm_ raise naming the layers, before anything changes; two micro-batches then
    one sum step normally, equal to the model without replicas."""
    from moe.slots.guard import ReplicaGradsNotSummed

    ref, rep = _pair(3)
    opts = [
        _grouped(m) if grouped else torch.optim.AdamW(m.parameters(), 1e-2, weight_decay=0.1)
        for m in (ref, rep)
    ]
    x = torch.randn(16, D, dtype=torch.float64)
    for model in (ref, rep):
        for xs in x.tensor_split(2):  # gradient accumulation
            model(xs).square().sum().backward()
    before = _canonical(rep)
    step = f"{type(opts[1]).__name__}.step: the expert copies of moe, moe hold unsummed"
    with pytest.raises(ReplicaGradsNotSummed, match=step):
        opts[1].step()
    with pytest.raises(ReplicaGradsNotSummed, match="clip_grad_norm_: .* of 1, 3 hold unsummed"):
        moe.parallel.clip_grad_norm_(rep, 1.0)
    for name, value in _canonical(rep).items():
        torch.testing.assert_close(value, before[name], rtol=0, atol=0)
    sum_replica_grads(rep)
    for model, opt in zip((ref, rep), opts):
        moe.parallel.clip_grad_norm_(model, 0.1, optimizer=opt if grouped else None)
        opt.step()  # ref (no spare slots) never needs the sum
    after = _canonical(rep)
    for name, value in _canonical(ref).items():
        torch.testing.assert_close(after[name], value, **TOL64, msg=name)
    with torch.no_grad():
        rep(x)  # no gradient: nothing pending
    opts[1].step()
