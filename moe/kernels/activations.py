"""Expert activations shared by every backend (the torch path and the Triton epilogues)."""

import torch
import torch.nn.functional as F

ACTIVATIONS = ("gelu", "gelu_tanh", "relu", "silu", "swiglu")
GATED = ("swiglu",)


def check_activation(name: str) -> None:
    if name not in ACTIVATIONS:
        raise ValueError(f"activation={name!r} is not supported; choose one of {ACTIVATIONS}")


def apply_activation(h: torch.Tensor, name: str, gate: torch.Tensor | None = None) -> torch.Tensor:
    """act(h); for swiglu `h` is the w1 projection and `gate` the w3 projection: silu(h) * gate."""
    if name == "gelu":
        return F.gelu(h)
    if name == "gelu_tanh":
        return F.gelu(h, approximate="tanh")
    if name == "relu":
        return F.relu(h)
    if name == "silu":
        return F.silu(h)
    if name == "swiglu":
        return F.silu(h) * gate
    raise ValueError(f"activation={name!r} is not supported; choose one of {ACTIVATIONS}")
