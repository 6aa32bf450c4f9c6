"""Bit-identity of the layer across a refactor: dump outputs and every gradient, then compare.

    PYTHONPATH=. python -m tools.bit_identity dump OUT.safetensors     # in each tree
    python -m tools.bit_identity compare OLD.safetensors NEW.safetensors

Only public names are used, so the same file runs on an old commit and a new one. The cases:
six single-process configurations (both kernels, recompute, capacity drops, expert choice,
shared experts), a replicated layer (spare slots) in one process, and on 2 gloo ranks
`parallelize(ep=2)` plain and overlapped, and a replicated layer under ddp and fsdp (each rank
feeds its own batch; gradients gathered to full tensors).
"""

import os
import sys

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: CPU kernels

import torch  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

import moe  # noqa: E402

D, F, E, T = 24, 40, 6, 37

SINGLE = {
    "torch": {"backend": "torch"},
    "triton": {"backend": "triton"},
    "recompute": {"backend": "torch", "recompute": True},
    "drops": {"backend": "torch", "capacity_factor": 0.5, "min_capacity": 1},
    "expert_choice": {"backend": "torch", "router": "expert_choice", "capacity_factor": 1.5},
    "shared": {"backend": "torch", "num_shared_experts": 1},
    "replicas": {"backend": "torch", "spare_slots": 2},
}
RANKS = {  # name -> (layer options, parallelize keywords)
    "ep2": ({"backend": "torch"}, {"data_parallel": "ddp"}),
    "ep2_overlap": ({"backend": "torch"}, {"data_parallel": "ddp", "overlap": 2}),
    "ep2_replicas_ddp": ({"backend": "torch", "spare_slots": 2}, {"data_parallel": "ddp"}),
    "ep2_replicas_fsdp": ({"backend": "torch", "spare_slots": 2}, {"data_parallel": "fsdp"}),
}


def _layer(options: dict, dtype: torch.dtype) -> moe.MoELayer:
    torch.manual_seed(0)
    return moe.MoELayer(D, F, E, top_k=2, activation="swiglu", dtype=dtype, **options)


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _step(layer: torch.nn.Module, seed: int, dtype: torch.dtype, prefix: str) -> dict:
    """One forward and backward on fresh inputs; the output, x's gradient and every
    parameter gradient (full tensors), keyed by prefix."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, D, generator=g, dtype=dtype, requires_grad=True)
    dy = torch.randn(T, D, generator=g, dtype=dtype)
    y = layer(x)
    (y * dy).sum().backward()
    if layer.config.spare_slots:
        moe.parallel.sum_replica_grads(layer)
    out = {f"{prefix}/y": y.detach(), f"{prefix}/dx": x.grad}
    for name, p in layer.named_parameters():
        if p.grad is not None:
            out[f"{prefix}/grad/{name}"] = _full(p.grad).detach()
    return {k: v.contiguous() for k, v in out.items()}


def dump_single() -> dict:
    out = {}
    for name, options in SINGLE.items():
        for dtype in (torch.float32, torch.float64):
            if options["backend"] == "triton" and dtype == torch.float64:
                continue
            out.update(_step(_layer(options, dtype), 1, dtype, f"{name}/{dtype}"))
    return out


def _rank_body(rank: int, world_size: int) -> dict:
    out = {}
    for name, (options, kw) in RANKS.items():
        layer = _layer(options, torch.float64)
        mesh = moe.parallel.init_mesh(dp=1, ep=world_size)
        moe.parallel.parallelize(layer, mesh, **kw)
        out.update(_step(layer, 10 + rank, torch.float64, f"{name}/rank{rank}"))
    return out


def dump_ranks() -> dict:
    from tests.distributed import run_ranks

    out = {}
    for part in run_ranks(_rank_body, 2, timeout=120):
        out.update(part)
    return out


def compare(old: dict, new: dict) -> int:
    bad = sorted(set(old) ^ set(new))
    for key in sorted(set(old) & set(new)):
        if old[key].dtype != new[key].dtype or not torch.equal(old[key], new[key]):
            diff = (old[key].double() - new[key].double()).abs().max().item()
            bad.append(f"{key} (max |diff| {diff:.3g})")
    print(f"{len(set(old) & set(new))} tensors compared; {len(bad)} differ or are missing")
    for line in bad:
        print("  ", line)
    return 1 if bad else 0


def main(argv: list[str]) -> int:
    if len(argv) == 2 and argv[0] == "dump":
        save_file({**dump_single(), **dump_ranks()}, argv[1])
        return 0
    if len(argv) == 3 and argv[0] == "compare":
        return compare(load_file(argv[1]), load_file(argv[2]))
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
