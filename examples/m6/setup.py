"""Process setup of the M6 example: the process group, the device, parallelism applied from
outside the model (each one call into moe.parallel or moe.memory), the optimizer and gradient clipping."""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

import moe
import moe.memory
import moe.parallel
from examples.device import activate, backend


def init_distributed(args, device: torch.device) -> tuple[int, int, bool]:
    """(rank, world, whether we initialised the process group) from torchrun's variables;
    NCCL when this rank trains on a GPU (its LOCAL_RANK's, see examples/device.py), else gloo."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size(), False
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return 0, 1, False
    activate(device)  # before NCCL starts: each rank on its own GPU
    # A collective timeout: a dead or stuck rank becomes an error on the others, not a hang.
    timeout = datetime.timedelta(seconds=args.timeout)
    dist.init_process_group(backend(device), timeout=timeout)
    return dist.get_rank(), world, True


def topology(world: int) -> str:
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    nodes = max(world // max(local, 1), 1)
    return f"{nodes} node(s) x {local} rank(s)"


def setup_parallel(model, args):
    """(model, mesh): MoE models get experts sharded over "ep" and gradients reduced in
    backward by moe.parallel; a dense model on several ranks (the baseline) is plain
    DistributedDataParallel (mesh None); one process: (model, None). Activation
    checkpointing either way when --checkpointing."""
    mesh = None
    if _world() > 1 and moe.moe_layers(model):
        ep = args.ep or 1
        mesh = moe.parallel.init_mesh(dp=args.dp or _world() // ep, ep=ep)
        model = moe.parallel.parallelize(model, mesh, config=parallel_config(args))
    if args.checkpointing:  # every block, or the first N
        first = None if args.checkpointing is True else args.checkpointing
        args.recomputed = moe.memory.recompute_blocks(
            model, moe.memory.find_repeated_blocks(model)[:first]
        )
    if _world() > 1 and mesh is None:
        model = torch.nn.parallel.DistributedDataParallel(model)
    return model, mesh


def parallel_config(args) -> moe.parallel.ParallelConfig:
    """The ParallelConfig of --data-parallel, --alltoall and --overlap (parallelize's at
    --pp 1, every stage's under --pp)."""
    return moe.parallel.ParallelConfig(args.data_parallel, args.alltoall, overlap=args.overlap)


def unwrap(model):
    """The model itself, without a DistributedDataParallel wrapper."""
    return getattr(model, "module", model)


def _world() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def make_optimizer(model, args):
    """AdamW; through moe.memory.GroupedApply for --groups > 1 or --offload (Whale)."""
    params = [p for p in model.parameters() if p.requires_grad]
    kwargs = {"lr": args.lr, "betas": (0.9, 0.95), "weight_decay": args.weight_decay}
    if args.groups > 1 or args.offload != "none":
        offload = None if args.offload == "none" else args.offload
        return moe.memory.GroupedApply(
            params, torch.optim.AdamW, groups=args.groups, offload=offload, **kwargs
        )
    return torch.optim.AdamW(params, **kwargs)


def clip_gradients(model, opt, args, mesh) -> None:
    """Global gradient-norm clipping (experts counted once, not once per replica)."""
    if args.clip <= 0:
        return
    grouped = isinstance(opt, moe.memory.GroupedApply)
    moe.parallel.clip_grad_norm_(model, args.clip, mesh=mesh, optimizer=opt if grouped else None)


# -- training -----------------------------------------------------------------------------
