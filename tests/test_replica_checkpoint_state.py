"""Slot layouts through checkpoints (issue 41 items 4, 5, 15): a stored placement that is not
a permutation is refused before anything changes; ranks that read different checkpoints or
hold different replica layouts get one error on every rank; a resumed replicated run is
bit-exact with the uninterrupted one."""

import os

import pytest
import torch

import moe
from moe.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from moe.checkpoint import slots as slot_files
from moe.parallel import init_mesh, parallelize
from moe.parallel.rebalance import rebalance_experts
from moe.parallel.replicas import sum_replica_grads
from moe.slots.guard import ReplicaGradsNotSummed
from tests.distributed import run_ranks
from tests.test_replicas import D, F, _batch, _canonical, _pair, _step


def _plain(spare=0):
    torch.manual_seed(3)
    return torch.nn.Sequential(
        torch.nn.Linear(D, D), moe.MoELayer(D, F, 4, spare_slots=spare)
    ).double()


@pytest.mark.parametrize("bad", [[0, 0, 2, 3], [99, 1, 2, 3], [-1, 1, 2, 3]])
def test_a_damaged_placement_is_refused_before_anything_changes(bad, tmp_path, monkeypatch):
    model = _plain()
    good = model[1].expert_of_slot_S.clone()
    model[1].expert_of_slot_S.copy_(torch.tensor(bad))  # written by hand
    with pytest.raises(CheckpointError, match="1.expert_of_slot_S: .*nothing was written"):
        save_checkpoint(str(tmp_path / "refused"), model)
    assert not os.path.exists(tmp_path / "refused" / "LATEST")
    model[1].expert_of_slot_S.copy_(good)
    # a checkpoint holding that placement (as 0afafd8's save_checkpoint wrote it)
    monkeypatch.setattr(moe.MoELayer, "slot_of_expert_E", property(lambda _: torch.tensor(bad)))
    monkeypatch.setattr(slot_files, "layouts_to_save", lambda model: {})
    save_checkpoint(str(tmp_path / "ckpt"), model)
    monkeypatch.undo()
    for spare in (0, 2):
        target = _plain(spare)
        with torch.no_grad():
            target[0].weight.mul_(-1)
        before = {k: v.clone() for k, v in target.state_dict().items()}
        with pytest.raises(CheckpointError, match="slot_of_expert_E: not a permutation of the 4"):
            load_checkpoint(str(tmp_path / "ckpt"), target)
        for k, v in target.state_dict().items():
            assert torch.equal(v, before[k]), k


def _train(model, opt, steps, rank, world, mesh):
    return [_step(model, opt, s, rank, world, True, mesh=mesh) for s in steps]


def _body(rank, world, path):
    out = {}
    mesh = init_mesh(dp=1, ep=2)
    model = parallelize(_pair(2, seed=1)[1], mesh, "ddp")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    _train(model, opt, (0, 1), rank, world, mesh)
    x, _ = _batch(7)
    (model(x[rank::2]).square().sum()).backward()  # one micro-batch of the next step
    try:
        rebalance_experts(model, opt, min_gain=0.0)
    except ValueError as e:
        out["between micro-batches"] = str(e)
    opt.zero_grad()
    report = rebalance_experts(model, opt, min_gain=0.0)
    out["moved"] = report.moved_experts
    save_checkpoint(f"{path}/a", model, opt, extra={"step": 2})
    _train(model, opt, (2, 3), rank, world, mesh)
    save_checkpoint(f"{path}/b", model, opt, extra={"step": 4})
    uninterrupted = _canonical(model)
    resumed = parallelize(_pair(2, seed=1)[1], mesh, "ddp")
    opt = torch.optim.AdamW(resumed.parameters(), lr=1e-2, weight_decay=0.1)
    load_checkpoint(f"{path}/a", resumed, opt)
    out["layout"] = [m.expert_of_slot_S.tolist() for m in (model[1], resumed[1])]
    _train(resumed, opt, (2, 3), rank, world, mesh)
    out["bit-exact"] = all(torch.equal(v, uninterrupted[k]) for k, v in _canonical(resumed).items())
    before = _canonical(resumed)
    try:  # LATEST read at different moments: rank 0 has a, rank 1 b
        load_checkpoint(f"{path}/{'ab'[rank]}", resumed, opt)
    except CheckpointError as e:
        out["different checkpoints"] = str(e)
    out["unchanged"] = all(torch.equal(v, before[k]) for k, v in _canonical(resumed).items())
    mesh = init_mesh(dp=2, ep=1)
    out["compiled fsdp"] = _compiled_steps(mesh)
    # a state-dict load of another replica layout on rank 1
    model = parallelize(_pair(2, seed=1)[1], mesh, "ddp")
    if rank == 1:
        model[1].load_state_dict(
            {
                "slot_of_expert_E": torch.arange(8),
                "expert_of_slot_S": torch.tensor([*range(8), 3, 4]),
            },
            strict=False,
        )
    model(_batch(8)[0][rank::2]).sum().backward()
    try:
        sum_replica_grads(model)
    except ValueError as e:
        out["different layouts"] = str(e)
    return out


def _compiled_steps(mesh) -> list:
    """FSDP2's DTensor gradients as a compiled layer's guard sees them (its trace sets
    ran_compiled; tests/test_replica_state.py traces one for real): refused before the sum,
    accepted after it (gradients watched by identity and version of their local tensors)."""
    torch.manual_seed(2)
    model = parallelize(torch.nn.Sequential(moe.MoELayer(D, F, 4, spare_slots=2)), mesh, "fsdp")
    model[0].ran_compiled = True
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out = []
    for step in range(2):
        model(_batch(step)[0][:6].float()).sum().backward()
        try:
            opt.step()
            out.append("stepped")
        except ReplicaGradsNotSummed:
            out.append("refused")
        sum_replica_grads(model)
        opt.step()  # accepted
        opt.zero_grad(set_to_none=step == 0)  # both ways of zeroing
    return out


def test_replica_layouts_agree_and_resume_exactly_on_two_ranks(tmp_path):
    results = run_ranks(_body, 2, str(tmp_path), timeout=120)
    for r in results:
        assert "unsummed gradients" in r["between micro-batches"]
        assert r["moved"] > 0
        assert r["layout"][0] == r["layout"][1]  # the saved placement, not the initial one
        assert r["bit-exact"]
        assert "checkpoint" in r["different checkpoints"] and r["unchanged"]
        assert "different replica layouts" in r["different layouts"]
        assert r["compiled fsdp"] == ["refused", "refused"]
    assert results[0] == results[1]


def test_state_dict_keys_are_those_0afafd8_wrote():
    """The layer keeps its layout once (expert_of_slot_S); state dicts keep the old keys, so
    0afafd8's state dicts and checkpoints load and these load there."""
    plain, rep = _plain()[1], _plain(2)[1]
    assert sorted(plain.state_dict()) == sorted(
        ["router.weight", "router.expert_bias", "experts.w1", "experts.w2", "slot_of_expert_E"]
    )
    assert sorted(rep.state_dict()) == sorted([*plain.state_dict(), "expert_of_slot_S"])
    old = {**rep.state_dict(), "expert_of_slot_S": torch.tensor([3, 1, 2, 0, 3, 1])}
    old["slot_of_expert_E"] = torch.tensor([3, 1, 2, 0])  # 0afafd8 kept it as a second buffer
    rep.load_state_dict(old)
    assert rep.expert_of_slot_S.tolist() == [3, 1, 2, 0, 3, 1]
    assert rep.slot_of_expert_E.tolist() == [3, 1, 2, 0]
    gone = {k: v for k, v in old.items() if "slot" not in k}
    result = rep.load_state_dict(gone, strict=False)
    assert sorted(result.missing_keys) == ["expert_of_slot_S", "slot_of_expert_E"]
