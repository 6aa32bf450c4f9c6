"""Automatic activation checkpointing (Whale's auto gradient checkpoint): find the model's
repeated blocks and recompute each one in backward, keeping only block inputs alive.

Non-reentrant torch.utils.checkpoint with the default preserve_rng_state=True replays the
CPU and CUDA RNG state, so routers with randomness (GShard random routing, Switch jitter,
noisy top-k) choose the same experts in the recompute as in the forward. Router bias
updates (aux-loss-free balancing) happen outside autograd (moe.update_router_biases), so the
recompute never sees different parameters.
"""

import types

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from moe.recompute_frame import recompute_context

_MARK = "_moe_checkpointed"


def find_repeated_blocks(model: nn.Module) -> list[str]:
    """Qualified names of the children of the largest nn.ModuleList whose elements share a
    class (ties: the first in module order). Empty when there is none."""
    best: list[str] = []
    for name, module in model.named_modules():
        if not isinstance(module, nn.ModuleList) or len(module) < 2:
            continue
        if len({type(child) for child in module}) != 1:
            continue
        if len(module) > len(best):
            prefix = f"{name}." if name else ""
            best = [f"{prefix}{i}" for i in range(len(module))]
    return best


def _checkpointed_forward(self, *args, **kwargs):
    forward = type(self).forward.__get__(self)
    if self.training and torch.is_grad_enabled():
        # recompute_context: a recompute replays what its own forward took (router replay)
        return checkpoint(
            forward, *args, use_reentrant=False, context_fn=recompute_context, **kwargs
        )
    return forward(*args, **kwargs)


def checkpoint_module(module: nn.Module) -> None:
    """Recompute `module` in backward (training mode with grad enabled only). In place; the
    parameter names do not change, so state dicts and checkpoints are unaffected."""
    if getattr(module, _MARK, False):
        return
    module.forward = types.MethodType(_checkpointed_forward, module)
    setattr(module, _MARK, True)


def recompute_blocks(model: nn.Module, names: list[str] | None = None) -> list[str]:
    """Checkpoint each repeated block of `model` (or the modules named in `names`); returns
    the names of the blocks it wrapped. Raises ValueError when no repeated blocks exist."""
    names = find_repeated_blocks(model) if names is None else list(names)
    if not names:
        raise ValueError(
            "recompute_blocks found no nn.ModuleList of same-class blocks; pass names="
        )
    modules = dict(model.named_modules())
    for name in names:
        if name not in modules:
            raise ValueError(f"recompute_blocks: no module named {name!r}")
        checkpoint_module(modules[name])
    return names
