"""Families converted through the experts contract (moe.interop.hf_contract) under expert
parallelism: EP = 2 on gloo equals one process on the global batch (logits, loss, every
gradient; float64), under ddp for four families and fsdp (FSDP2) for one. One start of the
ranks for all of them. Tolerance 1e-6 relative:
these families' routers compute in float32, whose rounding depends on the batch (GLM-4.5's
gate gradient: 6e-8 between one process's sum over 4 sequences and two ranks' sums over 2;
MiniMax-M2's logits: 6e-9)."""

import pytest
import torch

pytest.importorskip("transformers")  # the `hf` extra; .ci/run installs it

import moe  # noqa: E402
from tests.distributed import run_ranks  # noqa: E402
from tests.hf_tiny import relative_error, run, tiny_model  # noqa: E402

# group-limited sigmoid routing + shared experts + a dense layer (GLM-4.5 MoE), a multimodal
# model (Qwen3-VL-MoE), a non-gated expert with biases... (Ernie-4.5 MoE: its own router and
# shared experts), a router with its own bias (MiniMax-M2)
FAMILIES = ["glm4_moe", "qwen3_vl_moe", "ernie4_5_moe", "minimax_m2"]


def _ids(rank: int) -> torch.Tensor:
    return torch.randint(0, 97, (2, 7), generator=torch.Generator().manual_seed(10 + rank))


def converted(family: str):
    model = tiny_model(family, torch.float64)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p, generator=torch.Generator().manual_seed(p.numel())) * 0.05)
    return moe.from_hf(model)


def _body(rank, world, families):
    from moe.parallel import init_mesh, parallelize
    from moe.shards import local

    out = {}
    for family, data_parallel in families:
        model = converted(family)
        parallelize(model, init_mesh(dp=1, ep=2), data_parallel, sync_params=False)
        got = run(model, _ids(rank))
        grads = {
            n: None if p.grad is None else local(p.grad).detach().clone()
            for n, p in model.named_parameters()
        }
        out[family, data_parallel] = (got.logits.detach(), got.loss.detach(), grads)
    return out


def test_expert_parallel_equals_one_process():
    cases = [(f, "ddp") for f in FAMILIES] + [(FAMILIES[0], "fsdp")]
    results = run_ranks(_body, 2, cases, timeout=120)
    for family, data_parallel in cases:
        model = converted(family)
        ids = torch.cat([_ids(0), _ids(1)])
        want = run(model, ids)
        for rank in range(2):
            logits, loss, grads = results[rank][family, data_parallel]
            rows = want.logits[2 * rank : 2 * rank + 2]
            assert relative_error(logits, rows) <= 1e-6, (family, rank)
            for name, p in model.named_parameters():
                g = p.grad
                if g is None:  # unused in this forward, on every rank alike
                    assert grads[name] is None, (family, rank, name)
                    continue
                if ".experts.w" in name:  # sharded over ep: this rank's half of the experts
                    assert grads[name].shape[0] == g.shape[0] // 2, (family, name)
                if grads[name].shape != g.shape:  # this rank's shard (experts: its half;
                    g = g.chunk(2, 0)[rank]  # FSDP2: its chunk of dim 0)
                assert relative_error(grads[name], g, 1e-12) <= 1e-6, (family, rank, name)

        losses = [float(results[r][family, data_parallel][1]) for r in range(2)]
        assert abs(sum(losses) / 2 - float(want.loss)) <= 1e-6 * float(want.loss), family
