"""Write a small checkpoint and what it holds, so later releases can prove they still load it.

    PYTHONPATH=. python -m tools.compat_checkpoint OUT_DIR [--fp8]

On 2 gloo ranks (dp 1 x ep 2): a model of a plain MoE layer and a layer with 2 spare slots
(replicas), with --fp8 also a float32 layer with FP8 dispatch and FP8 experts; AdamW, two
steps, rebalance_experts (a placement and a replica layout other than the initial ones), one
more step, save_checkpoint(OUT_DIR/ckpt). Then in one process it loads that checkpoint into
the same model without parallelism and writes the canonical state (every parameter in
canonical expert order, and the AdamW moments) to OUT_DIR/expected.safetensors:
what any later release must read from OUT_DIR/ckpt (tests/test_checkpoint_compat.py).
"""

import os
import sys

import torch
from safetensors.torch import save_file
from torch import nn

import moe
from moe.checkpoint import load_checkpoint, save_checkpoint

D, F, E, T = 8, 12, 4, 16


def build(fp8: bool = False) -> nn.Sequential:
    """The model (public names only, so it builds at old commits too); fp8 adds a third layer
    with FP8Config(dispatch=True, experts=True) (fixtures from 7b9a55a on)."""
    torch.manual_seed(0)
    model = nn.Sequential(
        moe.MoELayer(D, F, E, top_k=2, activation="swiglu", dtype=torch.float64, name="plain"),
        moe.MoELayer(
            D, F, E, top_k=2, activation="gelu", bias=True, spare_slots=2,
            dtype=torch.float64, name="replicas",
        ),
    )  # fmt: skip
    if fp8:
        from moe.fp8 import FP8Config

        model.append(
            moe.MoELayer(
                D, F, E, top_k=2, activation="swiglu", dtype=torch.float32, backend="auto",
                fp8=FP8Config(dispatch=True, experts=True), name="fp8",
            )
        )  # fmt: skip
    with torch.no_grad():  # a skewed load, so rebalance moves experts
        model[0].router.weight[:2] += 1.0  # experts 0 and 1: both on rank 0
        model[1].router.weight[2] += 10.0  # expert 2: a copy for it
    return model


def _step(model, opt, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, D, generator=g, dtype=torch.float64)
    model(x).square().sum().backward()
    moe.parallel.sum_replica_grads(model)
    opt.step()
    opt.zero_grad()


def _save_body(rank: int, world: int, path: str, fp8: bool) -> None:
    mesh = moe.parallel.init_mesh(dp=1, ep=world)
    model = moe.parallel.parallelize(build(fp8), mesh, "ddp")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for s in range(2):
        _step(model, opt, 10 * s + rank)
    moe.parallel.rebalance_experts(model, opt, min_gain=0.0)
    _step(model, opt, 100 + rank)
    save_checkpoint(path, model, opt, extra={"step": 3})
    return [layer.slot_of_expert_E.tolist() for layer in model] + [
        model[1].expert_of_slot_S.tolist()
    ]


def canonical_state(model: nn.Module, opt) -> dict[str, torch.Tensor]:
    """Every parameter and AdamW moment with expert rows in canonical order."""
    out = {}
    for name, p in model.named_parameters():
        layer = model[int(name.split(".")[0])]
        rows = layer.slot_of_expert_E if ".experts." in name else None
        for key, t in [("param", p.detach()), *opt.state.get(p, {}).items()]:
            if t.dim() == 0:
                continue
            out[f"{name}/{key}"] = (t if rows is None else t[rows]).contiguous()
    return out


def main(out: str, fp8: bool = False) -> None:
    from tests.distributed import run_ranks

    path = os.path.join(out, "ckpt")
    layouts = run_ranks(_save_body, 2, path, fp8, timeout=120)[0]
    print("saved layouts (placement per layer, replica slots):", layouts)
    model = build(fp8)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    extra = load_checkpoint(path, model, opt)
    assert extra == {"step": 3}, extra
    save_file(canonical_state(model, opt), os.path.join(out, "expected.safetensors"))


if __name__ == "__main__":
    main(sys.argv[1], "--fp8" in sys.argv[2:])
