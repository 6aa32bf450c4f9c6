"""Shared experts: a dense MLP every token goes through, added to the routed experts' output
(DeepSeek-V3's `shared_experts`, Qwen2-MoE's `shared_expert` with a sigmoid gate).

They are dense parameters for parallelism: replicated or sharded with the rest of the model,
never exchanged between expert-parallel ranks. Weights are stored as nn.Linear ([out, in]) so
Hugging Face checkpoints copy in without transposes.
"""

import torch
from torch import nn

from moe.kernels.activations import GATED, apply_activation


class SharedExperts(nn.Module):
    """y = down(act(gate_proj x) * up_proj x) for gated activations (swiglu), else
    down(act(up_proj x)); times sigmoid(gate x) when `gated_output` (Qwen2-MoE)."""

    def __init__(
        self,
        d_model: int,
        d_ff: int,
        activation: str,
        gated_output: bool = False,
        bias: bool = False,
        device=None,
        dtype=None,
    ):
        super().__init__()
        kw = {"bias": bias, "device": device, "dtype": dtype}
        self.activation = activation
        self.gate_proj = nn.Linear(d_model, d_ff, **kw) if activation in GATED else None
        self.up_proj = nn.Linear(d_model, d_ff, **kw)
        self.down_proj = nn.Linear(d_ff, d_model, **kw)
        self.gate = (
            nn.Linear(d_model, 1, bias=False, device=device, dtype=dtype) if gated_output else None
        )

    def forward(self, x_TD: torch.Tensor) -> torch.Tensor:
        x_TD = x_TD.to(self.up_proj.weight.dtype)
        if self.gate_proj is not None:  # apply_activation's swiglu: silu(first) * second
            h_TF = apply_activation(self.gate_proj(x_TD), self.activation, self.up_proj(x_TD))
        else:
            h_TF = apply_activation(self.up_proj(x_TD), self.activation)
        y_TD = self.down_proj(h_TF)
        if self.gate is not None:
            y_TD = torch.sigmoid(self.gate(x_TD)) * y_TD
        return y_TD
