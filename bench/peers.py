"""The layers the MoE-layer benchmark runs side by side: ours, a dense FFN of equal active FLOPs,
and peers that install from the package index (DeepSpeed-MoE; Tutel is not on PyPI).

Every builder returns a module mapping x [T, d] -> y [T, d] with gelu experts of width d_ff.
"""

import socket

import torch
import torch.distributed as dist
from torch import nn

import moe


def ours(d_model: int, d_ff: int, E: int, k: int) -> nn.Module:
    """moe.MoELayer, dropless."""
    return moe.MoELayer(d_model, d_ff, E, top_k=k, capacity_factor=None)


def dense(d_model: int, d_ff: int, E: int, k: int) -> nn.Module:
    """A dense FFN of width d_ff * k: the FLOPs one token does in a top-k MoE layer."""
    return nn.Sequential(
        nn.Linear(d_model, d_ff * k, bias=False),
        nn.GELU(),
        nn.Linear(d_ff * k, d_model, bias=False),
    )


def _single_rank_group() -> None:
    """DeepSpeed's MoE layer builds expert / data groups: give it a 1-rank gloo world."""
    if dist.is_initialized():
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)


class _FirstOutput(nn.Module):
    """DeepSpeed's MoE returns (y, l_aux, counts): keep y, like our layer's forward."""

    def __init__(self, layer: nn.Module):
        super().__init__()
        self.layer = layer

    def forward(self, x_TD: torch.Tensor) -> torch.Tensor:
        return self.layer(x_TD.unsqueeze(0))[0].squeeze(0)


def deepspeed_moe(d_model: int, d_ff: int, E: int, k: int, capacity_factor: float = 1.0):
    """DeepSpeed-MoE (deepspeed.moe.layer.MoE, one-hot einsum dispatch) at capacity factor 1.0
    (it drops tokens past capacity, so it does less work than a dropless layer)."""
    from deepspeed.moe.layer import MoE

    _single_rank_group()
    expert = nn.Sequential(
        nn.Linear(d_model, d_ff, bias=False), nn.GELU(), nn.Linear(d_ff, d_model, bias=False)
    )
    layer = MoE(
        d_model,
        expert,
        num_experts=E,
        ep_size=1,
        k=k,
        capacity_factor=capacity_factor,
        eval_capacity_factor=capacity_factor,
        min_capacity=4,
        drop_tokens=True,
        use_rts=False,
    )
    return _FirstOutput(layer)


def available_peers() -> dict:
    """name -> builder for the peers that import here; a note for each one that does not."""
    peers, notes = {}, []
    try:
        import deepspeed  # noqa: F401

        peers["deepspeed cf1.0"] = deepspeed_moe
    except ImportError as e:
        notes.append(f"DeepSpeed-MoE skipped: {e} (pip install -e '.[bench]')")
    notes.append("Tutel skipped: not on the package index this machine reaches")
    return peers, notes
